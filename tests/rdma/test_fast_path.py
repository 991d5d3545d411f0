"""blockd.rdma._fast without a device: the C structures it builds and reads (x86-64 layouts of
ibv_send_wr, ibv_recv_wr, ibv_sge, ibv_wc), with the provider's functions replaced by fakes."""

from __future__ import annotations

import ctypes

import pytest

_fast = pytest.importorskip("blockd.rdma._fast", exc_type=ImportError)


def _u64(a: int) -> int:
    return ctypes.c_uint64.from_address(a).value


def _u32(a: int) -> int:
    return ctypes.c_uint32.from_address(a).value


def _qp(max_send: int = 8, max_recv: int = 8):
    qp = _fast.FastQP.__new__(_fast.FastQP)
    qp.qp_ptr = 0x1234
    qp._alloc(max_send, max_recv)
    return qp


def _walk_send(wr: int) -> list[tuple]:
    out = []
    while wr:
        sg, nsge = _u64(wr + 16), ctypes.c_int.from_address(wr + 24).value
        sge = (_u64(sg), _u32(sg + 8), _u32(sg + 12)) if nsge else None
        out.append((_u64(wr), _u32(wr + 28), _u32(wr + 32), sge, _u32(wr + 36), _u64(wr + 40),
                    _u32(wr + 48)))
        wr = _u64(wr + 8)
    return out


def test_post_send_builds_one_chain_per_call():
    qp = _qp()
    posted = []

    def fake(qp_ptr, wr, bad):
        assert qp_ptr == 0x1234
        posted.append(_walk_send(wr))
        return 0

    qp._post_send = fake
    qp.post_send([(1, 0, 0, 0x1000, 4096, 7, 0, 0xAA00, 0x55),      # RDMA WRITE, unsignalled
                  (2, 9, 2, 0x2000, 16, 8, 0x55, 0, 0),              # SEND_WITH_INV 0x55
                  (3, 4, 2, 0x3000, 512, 9, 0, 0xBB00, 0x66)])       # RDMA READ
    assert posted == [[(1, 0, 0, (0x1000, 4096, 7), 0, 0xAA00, 0x55),
                       (2, 9, 2, (0x2000, 16, 8), 0x55, 0, 0),
                       (3, 4, 2, (0x3000, 512, 9), 0, 0xBB00, 0x66)]]


def test_post_send_splits_at_capacity_and_reports_what_went_in():
    qp = _qp(max_send=2)
    chains = []

    def fake(qp_ptr, wr, bad):
        chain = _walk_send(wr)
        chains.append([c[0] for c in chain])
        if len(chains) == 2:  # the second chain's second WR is refused
            ctypes.c_void_p.from_address(bad).value = _u64(wr + 8)
            return 12
        return 0

    qp._post_send = fake
    with pytest.raises(_fast.PostError) as err:
        qp.post_send([(i, 2, 2, 0x1000 * i, 16, 1, 0, 0, 0) for i in range(1, 6)])
    assert chains == [[1, 2], [3, 4]]
    assert err.value.posted == 3 and err.value.errno == 12


def test_post_recv_chain():
    qp = _qp(max_recv=4)
    seen = []

    def fake(qp_ptr, wr, bad):
        while wr:
            sg = _u64(wr + 16)
            seen.append((_u64(wr), ctypes.c_int.from_address(wr + 24).value, _u64(sg), _u32(sg + 8),
                         _u32(sg + 12)))
            wr = _u64(wr + 8)
        return 0

    qp._post_recv = fake
    qp.post_recv([((1 << 48) | i, 0x10000 + 4160 * i, 4160, 3) for i in range(6)])
    assert seen == [((1 << 48) | i, 1, 0x10000 + 4160 * i, 4160, 3) for i in range(6)]


def test_poll_reads_ibv_wc():
    cq = _fast.FastCQ.__new__(_fast.FastCQ)
    cq.cq_ptr = 0x99
    cq.cc_ptr = 0
    cq._alloc()
    pending = [(i, 0 if i % 3 else 5, 128, 0, 64 + i, 0, 17, 0, 0, 0, 0, 0, 0) for i in range(100)]

    def fake(cq_ptr, n, buf):
        assert cq_ptr == 0x99 and n <= cq.BATCH
        take = pending[:n]
        del pending[:n]
        for k, wc in enumerate(take):
            _fast.WC_STRUCT.pack_into((ctypes.c_char * (48 * n)).from_address(buf), 48 * k, *wc)
        return len(take)

    cq._poll = fake
    wcs = cq.poll()
    assert len(wcs) == 100
    assert [(w.wr_id, w.status, w.opcode, w.byte_len, w.qp_num) for w in wcs] == \
        [(i, 0 if i % 3 else 5, 128, 64 + i, 17) for i in range(100)]
