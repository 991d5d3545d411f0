"""The verbs data path without pyverbs objects: poll, arm, post through libibverbs' own ABI.

pyverbs 44 builds Python objects for everything on the data path: each polled completion is a
``WC`` (13 keyword arguments, a logger lookup), each posted work request an ``SGE`` plus a
``SendWR``/``RecvWR`` (a ``logging.getLogger`` each, a ``malloc``, a ``close``), and
``get_cq_event`` raises an exception to say "no more events".  Under the VM bed's TCG that
was a large share of a command's cost on the target.  This module calls the same C functions
directly with ctypes on preallocated buffers:

* ``ibv_poll_cq``, ``ibv_req_notify_cq``, ``ibv_post_send``, ``ibv_post_recv`` are inline
  functions of ``<infiniband/verbs.h>`` that jump through ``ibv_context.ops``; that table's
  layout is libibverbs' public ABI (every compiled verbs program depends on it):
  ``ops`` @8 in ``ibv_context``, ``poll_cq`` its 12th pointer, ``req_notify_cq`` the 13th,
  ``post_send`` the 26th, ``post_recv`` the 27th.
* ``ibv_get_cq_event`` / ``ibv_ack_cq_events`` are exported by libibverbs.so.1.
* Structures (x86-64): ``ibv_wc`` 48 bytes, ``ibv_send_wr`` 128, ``ibv_recv_wr`` 32, ``ibv_sge``
  16 (field offsets in the ``struct`` formats below).

The C pointers of pyverbs objects come from :func:`blockd.rdma._raw.raw_ptr` (layout-checked);
:func:`cq_pointers` and :func:`qp_pointers` cross-check them against the fields they must agree
with (the CQ's channel, the QP's number, both contexts) and refuse to run on a mismatch.
:class:`FastCQ` and :class:`FastQP` take those raw pointers, as their compiled twins in
``blockd/rdma/_fast_verbs.pyx`` do (the one :mod:`blockd.rdma.verbs` runs unless
``BLOCKD_PURE=1`` or the extension is missing): this module is their reference and fallback.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import os
import struct

from . import _raw, abi

_ibv = ctypes.CDLL("libibverbs.so.1", use_errno=True)
_get_cq_event = _ibv.ibv_get_cq_event
_get_cq_event.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
_get_cq_event.restype = ctypes.c_int
_ack_cq_events = _ibv.ibv_ack_cq_events
_ack_cq_events.argtypes = [ctypes.c_void_p, ctypes.c_uint]
_ack_cq_events.restype = None

_OPS = 8  # ibv_context: device *, then struct ibv_context_ops
_POLL_CQ = _OPS + 11 * 8
_REQ_NOTIFY_CQ = _OPS + 12 * 8
_POST_SEND = _OPS + 25 * 8
_POST_RECV = _OPS + 26 * 8
_POLL_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)
_NOTIFY_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int)
_POST_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)

# ibv_wc: wr_id, status, opcode, vendor_err, byte_len, imm_data, qp_num, src_qp, wc_flags,
# pkey_index, slid, sl, dlid_path_bits
WC_STRUCT = struct.Struct("<QIIIIIIIIHHBBxx")
assert WC_STRUCT.size == 48
Wc = collections.namedtuple("Wc", "wr_id status opcode vendor_err byte_len imm_data qp_num src_qp "
                            "wc_flags pkey_index slid sl dlid_path_bits")
"""A polled work completion (the fields of ``struct ibv_wc``, as pyverbs' ``WC`` names them)."""

# ibv_send_wr up to wr.rdma: wr_id, next, sg_list, num_sge, opcode, send_flags,
# imm_data/invalidate_rkey, wr.rdma.remote_addr, wr.rdma.rkey (the rest stays zero)
_SEND_WR = struct.Struct("<QQQiIIIQI")
_SEND_WR_SIZE = 128
_RECV_WR = struct.Struct("<QQQi")  # wr_id, next, sg_list, num_sge
_RECV_WR_SIZE = 32
_SGE = struct.Struct("<QII")  # addr, length, lkey
_SGE_SIZE = 16


class PostError(OSError):
    """``ibv_post_*`` refused a WR: ``posted`` WRs of the batch before it were posted."""

    def __init__(self, rc: int, what: str, posted: int) -> None:
        super().__init__(rc, f"{what} failed: {os.strerror(rc) if rc > 0 else rc} "
                             f"(after {posted} WRs of the batch)")
        self.posted = posted


def _fn(ctx: int, offset: int, proto):
    addr = ctypes.c_void_p.from_address(ctx + offset).value
    if not addr:
        raise _raw.LayoutError(f"ibv_context ops slot @{offset} is NULL")
    return proto(addr)


def _u64(addr: int) -> int:
    return ctypes.c_uint64.from_address(addr).value


def cq_pointers(cq, channel, ctx) -> tuple[int, int, int]:
    """``(ibv_cq *, ibv_comp_channel *, ibv_context *)`` of pyverbs ``CQ``, ``CompChannel`` and
    ``Context`` objects, checked against each other (for both implementations)."""
    cq_ptr, cc_ptr, ctx_ptr = _raw.raw_ptr(cq), _raw.raw_ptr(channel), _raw.raw_ptr(ctx)
    # ibv_cq: context @0, channel @8
    if not cq_ptr or _u64(cq_ptr) != ctx_ptr or _u64(cq_ptr + 8) != cc_ptr:
        raise _raw.LayoutError("ibv_cq does not point to its context/channel")
    return cq_ptr, cc_ptr, ctx_ptr


def qp_pointers(qp, ctx) -> tuple[int, int]:
    """``(ibv_qp *, ibv_context *)`` of pyverbs ``QP`` and ``Context`` objects, checked against
    the QP's number and context; also checks :mod:`blockd.rdma.abi` against pyverbs."""
    qp_ptr, ctx_ptr = _raw.raw_ptr(qp), _raw.raw_ptr(ctx)
    # ibv_qp: context @0, ..., handle @48, qp_num @52
    if not qp_ptr or _u64(qp_ptr) != ctx_ptr or \
            ctypes.c_uint32.from_address(qp_ptr + 52).value != qp.qp_num:
        raise _raw.LayoutError("ibv_qp does not match its pyverbs QP")
    abi.check_against_pyverbs()
    return qp_ptr, ctx_ptr


class FastCQ:
    """Poll / arm / event handling of one CQ with its completion channel (raw pointers from
    :func:`cq_pointers`)."""

    BATCH = 64
    ACK_EVERY = 64

    def __init__(self, cq_ptr: int, cc_ptr: int, ctx_ptr: int) -> None:
        self.cq_ptr = cq_ptr
        self.cc_ptr = cc_ptr
        self._poll = _fn(ctx_ptr, _POLL_CQ, _POLL_FN)
        self._notify = _fn(ctx_ptr, _REQ_NOTIFY_CQ, _NOTIFY_FN)
        self._alloc()

    def _alloc(self) -> None:
        self._buf = ctypes.create_string_buffer(WC_STRUCT.size * self.BATCH)
        self._addr = ctypes.addressof(self._buf)
        self._view = memoryview(self._buf).cast("B")
        self._ev_cq = ctypes.c_void_p()
        self._ev_ctx = ctypes.c_void_p()
        self.unacked = 0
        self._ev_args = (self.cc_ptr, ctypes.addressof(self._ev_cq), ctypes.addressof(self._ev_ctx))

    def get_event(self) -> bool:
        """Take one event off the (non-blocking) channel; False when there was none.

        One is all there can be: the CQ raises an event once per arming, and it is re-armed only
        after its event was taken (a level-triggered reader calls again if there is more)."""
        if _get_cq_event(*self._ev_args) == 0:
            if self._ev_cq.value != self.cq_ptr:
                raise OSError(errno.EINVAL, "completion event for another CQ")
            self.unacked += 1
            if self.unacked >= self.ACK_EVERY:
                self.ack()
            return True
        err = ctypes.get_errno()
        if err not in (errno.EAGAIN, errno.EWOULDBLOCK):
            raise OSError(err, f"ibv_get_cq_event: {os.strerror(err)}")
        return False

    def get_events(self) -> int:
        """Take every pending event off the channel; how many there were."""
        n = 0
        while self.get_event():
            n += 1
        return n

    def ack(self) -> None:
        """Acknowledge the events taken so far (ibv_destroy_cq waits for every one)."""
        if self.unacked:
            _ack_cq_events(self.cq_ptr, self.unacked)
            self.unacked = 0

    def req_notify(self) -> None:
        rc = self._notify(self.cq_ptr, 0)
        if rc:
            raise OSError(rc, f"ibv_req_notify_cq: {os.strerror(rc) if rc > 0 else rc}")

    def poll(self, batch: int = BATCH) -> list:
        """Every completion now in the CQ, as :data:`Wc` tuples."""
        batch = min(batch, self.BATCH)
        out: list = []
        size = WC_STRUCT.size
        while True:
            n = self._poll(self.cq_ptr, batch, self._addr)
            if n < 0:
                raise OSError(-n, "ibv_poll_cq failed")
            if n:
                out.extend(map(Wc._make, WC_STRUCT.iter_unpack(self._view[:n * size])))
            if n < batch:
                return out


class FastQP:
    """Chained posting of send and receive WRs on one QP from preallocated memory (raw pointers
    from :func:`qp_pointers`)."""

    def __init__(self, qp_ptr: int, ctx_ptr: int, max_send: int, max_recv: int) -> None:
        self.qp_ptr = qp_ptr
        self._post_send = _fn(ctx_ptr, _POST_SEND, _POST_FN)
        self._post_recv = _fn(ctx_ptr, _POST_RECV, _POST_FN)
        self._alloc(max_send, max_recv)

    def _alloc(self, max_send: int, max_recv: int) -> None:
        self.max_send = max(1, max_send)
        self.max_recv = max(1, max_recv)
        self._swr = ctypes.create_string_buffer(_SEND_WR_SIZE * self.max_send)
        self._ssge = ctypes.create_string_buffer(_SGE_SIZE * self.max_send)
        self._rwr = ctypes.create_string_buffer(_RECV_WR_SIZE * self.max_recv)
        self._rsge = ctypes.create_string_buffer(_SGE_SIZE * self.max_recv)
        self._swr_addr = ctypes.addressof(self._swr)
        self._ssge_addr = ctypes.addressof(self._ssge)
        self._rwr_addr = ctypes.addressof(self._rwr)
        self._rsge_addr = ctypes.addressof(self._rsge)
        self._bad = ctypes.c_void_p()
        self._bad_addr = ctypes.addressof(self._bad)

    def post_send(self, wrs) -> None:
        """Post ``(wr_id, opcode, send_flags, addr, length, lkey, imm_or_inv, raddr, rkey)`` WRs
        as chains (one SGE each; ``length`` 0 means no SGE); raises :class:`PostError`."""
        i, n = 0, len(wrs)
        while i < n:
            part = wrs[i:i + self.max_send]
            m = len(part)
            wbuf, sbuf = self._swr, self._ssge
            wbase, sbase = self._swr_addr, self._ssge_addr
            pack_wr, pack_sge = _SEND_WR.pack_into, _SGE.pack_into
            for k, (wr_id, opcode, flags, addr, length, lkey, imm, raddr, rkey) in enumerate(part):
                nxt = wbase + (k + 1) * _SEND_WR_SIZE if k + 1 < m else 0
                if length:
                    pack_sge(sbuf, k * _SGE_SIZE, addr, length, lkey)
                    pack_wr(wbuf, k * _SEND_WR_SIZE, wr_id, nxt, sbase + k * _SGE_SIZE, 1, opcode,
                            flags, imm, raddr, rkey)
                else:
                    pack_wr(wbuf, k * _SEND_WR_SIZE, wr_id, nxt, 0, 0, opcode, flags, imm, raddr, rkey)
            rc = self._post_send(self.qp_ptr, wbase, self._bad_addr)
            if rc:
                bad = self._bad.value
                done = (bad - wbase) // _SEND_WR_SIZE if bad and wbase <= bad < wbase + m * _SEND_WR_SIZE else 0
                raise PostError(rc, "ibv_post_send", i + done)
            i += m

    def post_recv(self, wrs) -> None:
        """Post ``(wr_id, addr, length, lkey)`` receives as chains; raises :class:`PostError`."""
        i, n = 0, len(wrs)
        while i < n:
            part = wrs[i:i + self.max_recv]
            m = len(part)
            wbuf, sbuf = self._rwr, self._rsge
            wbase, sbase = self._rwr_addr, self._rsge_addr
            pack_wr, pack_sge = _RECV_WR.pack_into, _SGE.pack_into
            for k, (wr_id, addr, length, lkey) in enumerate(part):
                pack_sge(sbuf, k * _SGE_SIZE, addr, length, lkey)
                pack_wr(wbuf, k * _RECV_WR_SIZE, wr_id,
                        wbase + (k + 1) * _RECV_WR_SIZE if k + 1 < m else 0, sbase + k * _SGE_SIZE, 1)
            rc = self._post_recv(self.qp_ptr, wbase, self._bad_addr)
            if rc:
                bad = self._bad.value
                done = (bad - wbase) // _RECV_WR_SIZE if bad and wbase <= bad < wbase + m * _RECV_WR_SIZE else 0
                raise PostError(rc, "ibv_post_recv", i + done)
            i += m
