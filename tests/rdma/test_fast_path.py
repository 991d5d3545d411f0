"""The verbs fast path without a device: both implementations against one fake provider.

``blockd/rdma/_fast.py`` (ctypes, the reference) and ``blockd/rdma/_fast_verbs.pyx`` (compiled,
direct libibverbs calls) run here on a stand-in ``ibv_context`` whose ops table holds ctypes
callbacks that record what they are given: the fake's ``post_send``/``post_recv`` walk the chain
they receive and keep each work request's bytes, its SGE's bytes and how the chain is linked;
``poll_cq`` hands out prepared ``ibv_wc`` records; ``req_notify_cq`` records its arguments. The
real libibverbs functions run for ``ibv_get_cq_event`` (on a pipe) and ``ibv_ack_cq_events`` (on
the fake ``ibv_cq``'s counter). Every other ops slot records a stray call, so an implementation
calling through the wrong slot fails. Each test runs on both implementations, and the
differential tests feed both the same random batches and compare everything byte for byte.
The real rxe run is ``tests/rdma/test_fast_vm.py`` (in the VM).

Fake structure layouts (x86-64, rdma-core 44; the compiled module's :data:`LAYOUT`, taken from the
compiler, is checked against the reference's constants below): ``ibv_context.ops`` @8, 32
pointers; ``ibv_cq``: context @0, channel @8, comp_events_completed @120 (128 bytes);
``ibv_comp_channel``: context @0, fd @8; ``ibv_qp``: context @0, qp_num @52.
"""

from __future__ import annotations

import ctypes
import os
import random
import struct

import pytest

_fast = pytest.importorskip("blockd.rdma._fast", exc_type=ImportError)
try:
    from blockd.rdma import _fast_verbs
except ImportError:  # not built (no <infiniband/verbs.h>): the compiled cases skip, and fail in CI
    _fast_verbs = None

NOT_BUILT = "blockd.rdma._fast_verbs not built (libibverbs-dev missing?)"
IMPLS = [pytest.param(_fast, id="ctypes"),
         pytest.param(_fast_verbs, id="compiled", marks=pytest.mark.skipif(
             _fast_verbs is None, reason=NOT_BUILT))]
needs_compiled = pytest.mark.skipif(_fast_verbs is None, reason=NOT_BUILT)

_OPS_SLOTS = 32
_SEND_WR, _RECV_WR, _SGE, _WC = 128, 32, 16, 48
_CQ_COMP_EVENTS = 120
_POST_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
_POLL_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)
_NOTIFY_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int)


def _u64(a: int) -> int:
    return ctypes.c_uint64.from_address(a).value


class FakeProvider:
    """A stand-in verbs context, CQ, completion channel and QP in ctypes memory."""

    def __init__(self, qp_num: int = 17) -> None:
        self.ctx = ctypes.create_string_buffer(1024)
        self.cq = ctypes.create_string_buffer(128)
        self.cc = ctypes.create_string_buffer(16)
        self.qp = ctypes.create_string_buffer(160)
        self.ctx_ptr, self.cq_ptr = ctypes.addressof(self.ctx), ctypes.addressof(self.cq)
        self.cc_ptr, self.qp_ptr = ctypes.addressof(self.cc), ctypes.addressof(self.qp)
        for p in (self.cq_ptr, self.cc_ptr, self.qp_ptr):
            ctypes.c_void_p.from_address(p).value = self.ctx_ptr
        ctypes.c_void_p.from_address(self.cq_ptr + 8).value = self.cc_ptr
        ctypes.c_uint32.from_address(self.qp_ptr + 52).value = qp_num
        self.rfd, self.wfd = os.pipe2(os.O_NONBLOCK)
        ctypes.c_int.from_address(self.cc_ptr + 8).value = self.rfd
        self.stray: list[int] = []
        self.sends: list[list[tuple[bytes, bytes | None]]] = []
        self.recvs: list[list[tuple[bytes, bytes]]] = []
        self.polls: list[int] = []
        self.notifies: list[tuple[int, int]] = []
        self.pending: list[bytes] = []   # ibv_wc records poll_cq hands out
        self.fail_at: int | None = None  # post_*: refuse the chain's WR of this index...
        self.fail_rc = 12                # ...with this return code
        self.notify_rc = 0
        self._keep = []
        for i in range(_OPS_SLOTS):
            self._set(8 + 8 * i, _POST_FN(lambda a, b, c, i=i: self._stray(i)))
        self._set(_fast._POLL_CQ, _POLL_FN(self._poll))
        self._set(_fast._REQ_NOTIFY_CQ, _NOTIFY_FN(self._notify))
        self._set(_fast._POST_SEND, _POST_FN(lambda qp, wr, bad: self._post(qp, wr, bad, True)))
        self._set(_fast._POST_RECV, _POST_FN(lambda qp, wr, bad: self._post(qp, wr, bad, False)))

    def close(self) -> None:
        os.close(self.rfd)
        os.close(self.wfd)

    def _set(self, offset: int, fn) -> None:
        self._keep.append(fn)
        ctypes.c_void_p.from_address(self.ctx_ptr + offset).value = ctypes.cast(fn, ctypes.c_void_p).value

    def _stray(self, slot: int) -> int:
        self.stray.append(slot)
        return -1

    def _post(self, qp, wr, bad, send: bool) -> int:
        assert qp == self.qp_ptr
        size = _SEND_WR if send else _RECV_WR
        chain = []
        while wr:
            raw = bytearray(ctypes.string_at(wr, size))
            sg, nsge = _u64(wr + 16), ctypes.c_int.from_address(wr + 24).value
            raw[8:24] = bytes(16)  # next and sg_list: addresses of each side's own arrays
            chain.append((bytes(raw), ctypes.string_at(sg, _SGE * nsge) if nsge else None))
            if self.fail_at is not None and len(chain) - 1 == self.fail_at:
                ctypes.c_void_p.from_address(bad).value = wr
                (self.sends if send else self.recvs).append(chain)
                return self.fail_rc
            wr = _u64(wr + 8)
        (self.sends if send else self.recvs).append(chain)
        return 0

    def _poll(self, cq, n, wc) -> int:
        assert cq == self.cq_ptr
        self.polls.append(n)
        take = self.pending[:min(n, 64)]  # never past the 64 records both sides allocate
        del self.pending[:len(take)]
        for k, rec in enumerate(take):
            ctypes.memmove(wc + _WC * k, rec, _WC)
        return len(take)

    def _notify(self, cq, solicited) -> int:
        self.notifies.append((cq, solicited))
        return self.notify_rc

    def comp_events_completed(self) -> int:
        return ctypes.c_uint32.from_address(self.cq_ptr + _CQ_COMP_EVENTS).value

    def make_cq(self, impl):
        return impl.FastCQ(self.cq_ptr, self.cc_ptr, self.ctx_ptr)

    def make_qp(self, impl, max_send: int = 8, max_recv: int = 8):
        return impl.FastQP(self.qp_ptr, self.ctx_ptr, max_send, max_recv)


@pytest.fixture
def fake():
    f = FakeProvider()
    yield f
    f.close()
    assert not f.stray, f"calls through ops slots the data path must not use: {f.stray}"


def _send_fields(chain) -> list[tuple]:
    """(wr_id, num_sge, opcode, send_flags, imm/inv, remote_addr, rkey, sge) of a recorded chain."""
    out = []
    for raw, sge in chain:
        wr_id, = struct.unpack_from("<Q", raw)
        nsge, opcode, flags, imm, raddr, rkey = struct.unpack_from("<iIIIQI", raw, 24)
        out.append((wr_id, nsge, opcode, flags, imm, raddr, rkey,
                    struct.unpack("<QII", sge) if sge else None))
        assert raw[52:] == bytes(76), "ibv_send_wr past wr.rdma must stay zero"
    return out


@pytest.mark.parametrize("impl", IMPLS)
def test_post_send_chains_write_send_read(fake, impl):
    """RDMA WRITE + SEND_WITH_INV chained as one post, an RDMA READ, a SEND without data."""
    qp = fake.make_qp(impl)
    qp.post_send([(1, 0, 0, 0x1000, 4096, 7, 0, 0xAA00, 0x55),      # RDMA WRITE, unsignalled
                  (2, 9, 2, 0x2000, 16, 8, 0x55, 0, 0)])             # SEND_WITH_INV 0x55
    qp.post_send([(3, 4, 2, 0x3000, 512, 9, 0, 0xBB00, 0x66)])       # RDMA READ
    qp.post_send([(4, 2, 2, 0, 0, 0, 0, 0, 0)])                      # SEND, no SGE
    assert [_send_fields(c) for c in fake.sends] == [
        [(1, 1, 0, 0, 0, 0xAA00, 0x55, (0x1000, 4096, 7)), (2, 1, 9, 2, 0x55, 0, 0, (0x2000, 16, 8))],
        [(3, 1, 4, 2, 0, 0xBB00, 0x66, (0x3000, 512, 9))],
        [(4, 0, 2, 2, 0, 0, 0, None)]]


@pytest.mark.parametrize("impl", IMPLS)
def test_post_send_splits_at_capacity_and_reports_what_went_in(fake, impl):
    qp = fake.make_qp(impl, max_send=2)
    real_post = fake._post

    def second_chain_fails(qp_, wr, bad, send):
        fake.fail_at = 1 if len(fake.sends) == 1 else None
        return real_post(qp_, wr, bad, send)
    fake._post = second_chain_fails
    with pytest.raises(_fast.PostError) as err:
        qp.post_send([(i, 2, 2, 0x1000 * i, 16, 1, 0, 0, 0) for i in range(1, 6)])
    assert [[f[0] for f in _send_fields(c)] for c in fake.sends] == [[1, 2], [3, 4]]
    assert err.value.posted == 3 and err.value.errno == 12


@pytest.mark.parametrize("impl", IMPLS)
def test_post_recv_chains(fake, impl):
    qp = fake.make_qp(impl, max_recv=4)
    qp.post_recv([((1 << 48) | i, 0x10000 + 4160 * i, 4160, 3) for i in range(6)])
    got = [[struct.unpack_from("<Q", raw) + struct.unpack_from("<i", raw, 24) + struct.unpack("<QII", sge)
            for raw, sge in chain] for chain in fake.recvs]
    want = [((1 << 48) | i, 1, 0x10000 + 4160 * i, 4160, 3) for i in range(6)]
    assert got == [want[:4], want[4:]]
    fake.fail_at = 0
    with pytest.raises(_fast.PostError) as err:
        qp.post_recv([(9, 0x1000, 64, 3)])
    assert err.value.posted == 0 and "ibv_post_recv" in str(err.value)


def _wc(i: int) -> tuple:
    return (i, 0 if i % 3 else 5, 128 + i % 2, i % 7, 64 + i, 0x1234 * (i % 2), 17, 0, i % 4,
            i % 5, 0, 0, 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_poll_returns_every_completion_in_batches_of_64(fake, impl):
    cq = fake.make_cq(impl)
    fake.pending = [_fast.WC_STRUCT.pack(*_wc(i)) for i in range(100)]
    wcs = cq.poll()
    assert wcs == [_fast.Wc(*_wc(i)) for i in range(100)]
    assert all(type(w) is _fast.Wc for w in wcs)
    assert fake.polls == [64, 64]  # a short batch ends the loop
    fake.pending = [_fast.WC_STRUCT.pack(*_wc(i)) for i in range(3)]
    assert cq.poll(1000) == [_fast.Wc(*_wc(i)) for i in range(3)]
    assert fake.polls[2:] == [64]  # never more than the 64 records allocated
    assert cq.poll(2) == [] and fake.polls[3:] == [2]


@pytest.mark.parametrize("impl", IMPLS)
def test_arming_and_events(fake, impl):
    cq = fake.make_cq(impl)
    cq.req_notify()
    assert fake.notifies == [(fake.cq_ptr, 0)]  # every completion, not solicited only
    fake.notify_rc = 22
    with pytest.raises(OSError, match="ibv_req_notify_cq"):
        cq.req_notify()
    assert cq.get_event() is False and cq.get_events() == 0  # the empty non-blocking channel
    cq.unacked = 3
    cq.ack()
    assert fake.comp_events_completed() == 3 and cq.unacked == 0
    cq.ack()
    assert fake.comp_events_completed() == 3
    ctypes.c_int.from_address(fake.cc_ptr + 8).value = -1
    with pytest.raises(OSError, match="ibv_get_cq_event"):
        cq.get_event()


@pytest.mark.parametrize("impl", IMPLS)
def test_null_ops_slot_refused(fake, impl):
    for slot in (_fast._POLL_CQ, _fast._POST_RECV):
        saved = ctypes.c_void_p.from_address(fake.ctx_ptr + slot).value
        ctypes.c_void_p.from_address(fake.ctx_ptr + slot).value = None
        with pytest.raises(ImportError, match="NULL"):  # LayoutError
            fake.make_cq(impl) if slot == _fast._POLL_CQ else fake.make_qp(impl)
        ctypes.c_void_p.from_address(fake.ctx_ptr + slot).value = saved


@needs_compiled
def test_reference_layout_is_the_compilers():
    """The ctypes reference's hand-written offsets and sizes are the header's."""
    ours = {"ibv_wc": _fast.WC_STRUCT.size, "ibv_send_wr": _fast._SEND_WR_SIZE,
            "ibv_recv_wr": _fast._RECV_WR_SIZE, "ibv_sge": _fast._SGE_SIZE,
            "ibv_context.ops.poll_cq": _fast._POLL_CQ,
            "ibv_context.ops.req_notify_cq": _fast._REQ_NOTIFY_CQ,
            "ibv_context.ops.post_send": _fast._POST_SEND,
            "ibv_context.ops.post_recv": _fast._POST_RECV,
            "ibv_cq.channel": 8, "ibv_qp.qp_num": 52, "ibv_comp_channel.fd": 8,
            # _SEND_WR's format: wr_id, next, sg_list, num_sge, opcode, send_flags | imm | raddr, rkey
            "ibv_send_wr.imm_data": struct.calcsize("<QQQiII"),
            "ibv_send_wr.wr.rdma.remote_addr": struct.calcsize("<QQQiIII"),
            "ibv_send_wr.wr.rdma.rkey": struct.calcsize("<QQQiIIIQ")}
    assert ours == _fast_verbs.LAYOUT


def _random_send(rng: random.Random, i: int) -> tuple:
    opcode = rng.choice((0, 2, 4, 9))
    length = rng.choice((0, 16, 4096, rng.randrange(1 << 32)))
    return (rng.randrange(1 << 64), opcode, rng.choice((0, 2)), rng.randrange(1 << 64), length,
            rng.randrange(1 << 32), rng.randrange(1 << 32), rng.randrange(1 << 64), rng.randrange(1 << 32))


@needs_compiled
def test_differential_random_batches():
    """The same random batches through both: the same WR/SGE bytes, chains, errors, completions."""
    rng = random.Random(18)
    for _ in range(150):
        max_send, max_recv = rng.randrange(1, 9), rng.randrange(1, 9)
        sends = [_random_send(rng, i) for i in range(rng.randrange(1, 20))]
        recvs = [(rng.randrange(1 << 64), rng.randrange(1 << 64), rng.randrange(1 << 32),
                  rng.randrange(1 << 32)) for _ in range(rng.randrange(1, 20))]
        wcs = [struct.pack("<Q", rng.randrange(1 << 64)) + rng.randbytes(40) for _ in range(rng.randrange(150))]
        fail_at = rng.choice((None, None, 0, rng.randrange(8)))
        batch = rng.choice((1, 7, 64, 65, 500))
        seen = []
        for impl in (_fast, _fast_verbs):
            f = FakeProvider()
            try:
                qp, cq = f.make_qp(impl, max_send, max_recv), f.make_cq(impl)
                f.fail_at = fail_at
                errors = []
                for post, wrs in ((qp.post_send, sends), (qp.post_recv, recvs)):
                    try:
                        post(wrs)
                    except _fast.PostError as exc:
                        errors.append((exc.errno, exc.posted, str(exc)))
                f.pending = list(wcs)
                polled = cq.poll(batch)
                seen.append((f.sends, f.recvs, errors, polled, f.polls, f.stray))
            finally:
                f.close()
        assert seen[0] == seen[1]
        assert seen[0][3] == [_fast.Wc._make(_fast.WC_STRUCT.unpack(w)) for w in wcs]
