"""Verbs layer over Debian's pyverbs 44: devices, PD, CQs driven by asyncio, QPs, buffer pools.

Everything here is transport independent (no NVMe).  The NVMe-oF RDMA target and host build on:

* :func:`list_devices` / :func:`open_device` -- one shared :class:`Device` (own ``Context`` + ``PD``)
  per RDMA device.  It is *not* the CM id's context/PD: pyverbs 44 NULLs those shared wrappers
  when a child CM id is closed (docs/wire-facts.md, "RDMA provider quirks"); QPs are
  "external" QPs that rdma_cm only references by number (see :mod:`blockd.rdma.cm`).
* :class:`CompletionQueue` -- a CQ with its own ``CompChannel``; :attr:`CompletionQueue.fd` is
  non-blocking and can be given to ``loop.add_reader``; :meth:`CompletionQueue.drain` collects
  events, acks them, re-arms and polls until empty, returning the work completions (as
  :data:`blockd.rdma._fast.Wc` tuples, polled without pyverbs objects).
* :class:`QueuePair` -- an RC QP on a :class:`Device` with post helpers (RECV, SEND,
  SEND_WITH_INV, RDMA READ/WRITE, chains) that free pyverbs' leaked WR/SGE buffers after posting,
  and :meth:`QueuePair.post_sends` / :meth:`QueuePair.post_recvs`, which post whole chains from
  preallocated C memory for the data path.
* :class:`BufferPool` -- one registered MR split into fixed-size :class:`Slot` s (address, lkey,
  rkey, zero-copy memoryview); registered once, reused for every I/O.

The data path (events, arming, polling, chained posts) runs through :data:`FAST_PATH`: the
compiled ``blockd/rdma/_fast_verbs.pyx`` (direct libibverbs calls), or its ctypes reference
:mod:`blockd.rdma._fast` when ``BLOCKD_PURE=1`` (:mod:`blockd.dataplane`) or when the extension
was not built (no ``<infiniband/verbs.h>``: a warning at import).  Both take the raw pointers
:func:`blockd.rdma._fast.cq_pointers` / ``qp_pointers`` extract and check.

pyverbs 44 gaps closed here: the completion channel fd (raw pointer, :mod:`blockd.rdma._raw`);
``SGE``/``RecvWR``/``SendWR`` never free their C buffers (``__dealloc`` typo) -- the post helpers
call ``close()`` on them once ``ibv_post_*`` has consumed them.
"""

from __future__ import annotations

import asyncio
import atexit
import mmap
from dataclasses import dataclass
from typing import Callable, Sequence

import pyverbs.enums as e
from pyverbs.cq import CQ, CompChannel
from pyverbs.device import Context, get_device_list
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.wr import SGE, RecvWR, SendWR

from blockd import dataplane

from . import _fast, _raw

_impl = dataplane.twin("blockd.rdma._fast_verbs",
                       hint="install libibverbs-dev and rebuild (scripts/setup.sh)")
FAST_PATH = "compiled" if _impl is not _fast else \
    f"ctypes ({dataplane.NOT_BUILT.get('blockd.rdma._fast_verbs', dataplane.REASON)})"
"""How the data path runs: "compiled", or "ctypes (why)"."""

__all__ = [
    "ACCESS_LOCAL", "ACCESS_REMOTE", "BufferPool", "CompletionQueue", "Device", "QueuePair",
    "Slot", "WcError", "close_devices", "list_devices", "open_device", "wc_status_str",
]

ACCESS_LOCAL = e.IBV_ACCESS_LOCAL_WRITE
ACCESS_REMOTE = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE


def list_devices() -> list[str]:
    """Names of the RDMA devices libibverbs sees (empty without /sys/class/infiniband)."""
    return [d.name.decode() if isinstance(d.name, bytes) else d.name for d in get_device_list()]


def wc_status_str(status: int) -> str:
    names = {v: k for k, v in vars(e).items() if k.startswith("IBV_WC_") and k.endswith("_ERR")}
    if status == e.IBV_WC_SUCCESS:
        return "IBV_WC_SUCCESS"
    return names.get(status, f"wc status {status}")


class WcError(RuntimeError):
    """A work completion that did not succeed."""

    def __init__(self, wc) -> None:
        super().__init__(f"{wc_status_str(wc.status)} (wr_id {wc.wr_id}, opcode {wc.opcode}, "
                         f"vendor_err {wc.vendor_err})")
        self.wc = wc


class Device:
    """One RDMA device opened by us: ``ctx`` (pyverbs Context), ``pd`` (PD), ``attr`` (query_device).

    Use :func:`open_device` to share one per device name.  Close order (done by :meth:`close`):
    whatever the caller created (QPs, CQs, pools) first, then PD, then Context.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.ctx = Context(name=name)
        self.pd = PD(self.ctx)
        self.attr = self.ctx.query_device()
        self._children: list = []

    @property
    def max_qp_rd_atom(self) -> int:
        """Max RDMA READs this device serves as responder per QP (the IRD we can offer)."""
        return self.attr.max_qp_rd_atom

    @property
    def max_qp_init_rd_atom(self) -> int:
        """Max RDMA READs this device can have outstanding as initiator per QP (ORD)."""
        return self.attr.max_qp_init_rd_atom

    def create_cq(self, depth: int) -> "CompletionQueue":
        cq = CompletionQueue(self, depth)
        self._children.append(cq)
        return cq

    def create_qp(self, send_cq: "CompletionQueue", recv_cq: "CompletionQueue | None" = None, *,
                  max_send_wr: int, max_recv_wr: int, max_send_sge: int = 1,
                  max_recv_sge: int = 1, max_inline_data: int = 0) -> "QueuePair":
        """An RC QP in RESET state on this device's PD (no signalling for all: sq_sig_all=0)."""
        qp = QueuePair(self, send_cq, recv_cq or send_cq, max_send_wr=max_send_wr,
                       max_recv_wr=max_recv_wr, max_send_sge=max_send_sge,
                       max_recv_sge=max_recv_sge, max_inline_data=max_inline_data)
        self._children.append(qp)
        return qp

    def create_pool(self, slot_size: int, count: int, access: int = ACCESS_LOCAL) -> "BufferPool":
        pool = BufferPool(self, slot_size, count, access)
        self._children.append(pool)
        return pool

    def close(self) -> None:
        # QPs before CQs before MRs (pools): order of kind, newest first within a kind
        for kind in (QueuePair, CompletionQueue, BufferPool):
            for obj in reversed([c for c in list(self._children) if isinstance(c, kind)]):
                obj.close()
        self._children.clear()
        self.pd.close()
        self.ctx.close()


_devices: dict[str, Device] = {}


def open_device(name: str) -> Device:
    """The shared :class:`Device` for ``name`` (opened on first use)."""
    dev = _devices.get(name)
    if dev is None:
        if name not in list_devices():
            raise LookupError(f"no RDMA device {name!r} (have: {', '.join(list_devices()) or 'none'})")
        dev = _devices[name] = Device(name)
    return dev


def close_devices() -> None:
    """Close every shared device (and everything created on it)."""
    while _devices:
        _, dev = _devices.popitem()
        dev.close()


# in order at exit: left to the GC, pyverbs frees Contexts before their PDs and MRs ("Failed to
# dereg MR ... Bad file descriptor" at every target exit, a segfault at the end of a guest pytest)
atexit.register(close_devices)


class CompletionQueue:
    """A CQ with its own completion channel whose fd an asyncio loop can watch.

    ``fd`` is O_NONBLOCK.  Call :meth:`drain` when it is readable: it takes the CQ's event
    (``ibv_get_cq_event``; there is one per arming; acked in batches and at close), re-arms
    (``req_notify``) and only then polls until the CQ is empty, so no completion that arrives in
    between is lost.  Events,
    arming and polling go through ``FastCQ`` of :data:`FAST_PATH` (libibverbs directly).
    :meth:`attach` wires that to a loop with a callback taking the list of WCs.
    """

    def __init__(self, device: Device, depth: int) -> None:
        self.device = device
        self.depth = depth
        self.channel = CompChannel(device.ctx)
        self.cq = CQ(device.ctx, depth, None, self.channel, 0)
        self.fd = _raw.comp_channel_fd(self.channel)
        _raw.set_nonblocking(self.fd)
        self.fast = _impl.FastCQ(*_fast.cq_pointers(self.cq, self.channel, device.ctx))
        self.fast.req_notify()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.closed = False

    def drain(self, batch: int = 64) -> list:
        """Ack pending channel events, re-arm, and return every completion now in the CQ
        (:data:`blockd.rdma._fast.Wc` tuples: ``wr_id``, ``status``, ``byte_len``, ...)."""
        fast = self.fast
        fast.get_event()  # acked in batches (and at close)
        fast.req_notify()
        return fast.poll(batch)

    def poll(self, batch: int = 64) -> list:
        """Poll until empty without touching the channel (busy-poll use)."""
        return self.fast.poll(batch)

    def attach(self, loop: asyncio.AbstractEventLoop, callback: Callable[[list], None]) -> None:
        """``loop.add_reader(fd)`` calling ``callback(wcs)`` for each non-empty drain."""
        def ready() -> None:
            wcs = self.drain()
            if wcs:
                callback(wcs)
        self._loop = loop
        loop.add_reader(self.fd, ready)
        # completions that arrived before the reader was installed
        wcs = self.poll()
        if wcs:
            loop.call_soon(callback, wcs)

    def detach(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self.fd)
            self._loop = None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.detach()
        # events fetched but not acked would make ibv_destroy_cq block: drain() acks all
        try:
            self.fast.get_events()
        except OSError:
            pass
        self.fast.ack()
        self.cq.close()
        self.channel.close()
        if self in self.device._children:
            self.device._children.remove(self)


class QueuePair:
    """An RC QP created on a :class:`Device`'s own PD, to be connected through rdma_cm.

    ``qp`` is the pyverbs QP; ``qp_num`` goes into the CM's ConnParam.  The ``post_*`` helpers
    take plain (address, length, lkey) tuples so callers can use :class:`Slot` s directly.
    """

    def __init__(self, device: Device, send_cq: CompletionQueue, recv_cq: CompletionQueue, *,
                 max_send_wr: int, max_recv_wr: int, max_send_sge: int, max_recv_sge: int,
                 max_inline_data: int) -> None:
        self.device = device
        self.send_cq = send_cq
        self.recv_cq = recv_cq
        cap = QPCap(max_send_wr=max_send_wr, max_recv_wr=max_recv_wr, max_send_sge=max_send_sge,
                    max_recv_sge=max_recv_sge, max_inline_data=max_inline_data)
        init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=send_cq.cq, rcq=recv_cq.cq, cap=cap,
                          sq_sig_all=0)
        self.qp = QP(device.pd, init)
        self.qp_num = self.qp.qp_num
        self.fast = _impl.FastQP(*_fast.qp_pointers(self.qp, device.ctx), max_send_wr, max_recv_wr)
        self.max_rd_atomic = 0  # set by the CM layer when it moves the QP to RTS
        self.closed = False

    def modify(self, attr: QPAttr, mask: int) -> None:
        self.qp.modify(attr, mask)

    def to_error(self) -> None:
        """Move to ERR so outstanding WRs flush (librdmacm does not do it for external QPs)."""
        if self.closed:
            return
        attr = QPAttr(qp_state=e.IBV_QPS_ERR)
        self.qp.modify(attr, e.IBV_QP_STATE)

    # -- posting ----------------------------------------------------------------------------------
    def post_recv(self, wr_id: int, addr: int, length: int, lkey: int) -> None:
        sge = SGE(addr, length, lkey)
        wr = RecvWR(wr_id, 1, [sge])
        try:
            self.qp.post_recv(wr)
        finally:
            wr.close()
            sge.close()

    def post_recvs(self, bufs: Sequence[tuple[int, int, int, int]]) -> None:
        """Post (wr_id, addr, length, lkey) receives as one chain (no pyverbs objects);
        raises :class:`blockd.rdma._fast.PostError` (its ``posted``: how many went in)."""
        if self.closed:
            raise ValueError("QP is closed")
        self.fast.post_recv(bufs)

    def post_sends(self, wrs: Sequence[tuple[int, int, int, int, int, int, int, int, int]]) -> None:
        """Post send-queue WRs as one chain (no pyverbs objects), each a tuple
        ``(wr_id, opcode, send_flags, addr, length, lkey, imm_data_or_invalidate_rkey, raddr,
        rkey)`` with one SGE (none when ``length`` is 0); raises
        :class:`blockd.rdma._fast.PostError` (its ``posted``: how many went in)."""
        if self.closed:
            raise ValueError("QP is closed")
        self.fast.post_send(wrs)

    @staticmethod
    def _send_wr(wr_id: int, opcode: int, sges: Sequence[SGE], signaled: bool,
                 imm_data: int = 0, rkey: int | None = None, raddr: int | None = None,
                 inline: bool = False) -> SendWR:
        flags = (e.IBV_SEND_SIGNALED if signaled else 0) | (e.IBV_SEND_INLINE if inline else 0)
        wr = SendWR(wr_id=wr_id, opcode=opcode, num_sge=len(sges), imm_data=imm_data,
                    sg=list(sges) if sges else None, send_flags=flags)
        if rkey is not None:
            wr.set_wr_rdma(rkey, raddr)
        return wr

    def post_chain(self, ops: Sequence[dict]) -> None:
        """Post several send-queue WRs as one chain (e.g. RDMA WRITE(s) then the response SEND).

        Each op is a dict: ``wr_id``, ``opcode`` (IBV_WR_*), ``sge`` (addr, length, lkey) or
        ``sges`` list, optional ``signaled`` (default True), ``rkey``/``raddr`` for RDMA ops,
        ``invalidate_rkey`` for SEND_WITH_INV, ``inline``.
        """
        sges_all: list[SGE] = []
        wrs: list[SendWR] = []
        try:
            for op in ops:
                raw = op.get("sges") or ([op["sge"]] if op.get("sge") else [])
                sges = [SGE(*s) for s in raw]
                sges_all.extend(sges)
                wrs.append(self._send_wr(op["wr_id"], op["opcode"], sges, op.get("signaled", True),
                                         imm_data=op.get("invalidate_rkey", op.get("imm_data", 0)),
                                         rkey=op.get("rkey"), raddr=op.get("raddr"),
                                         inline=op.get("inline", False)))
            for a, b in zip(wrs, wrs[1:]):
                a.next_wr = b
            self.qp.post_send(wrs[0])
        finally:
            for w in wrs:
                w.close()
            for s in sges_all:
                s.close()

    def post_send(self, wr_id: int, addr: int, length: int, lkey: int, *,
                  signaled: bool = True, invalidate_rkey: int | None = None,
                  inline: bool = False) -> None:
        """SEND (or SEND_WITH_INV when ``invalidate_rkey`` is given; host byte order)."""
        op = e.IBV_WR_SEND if invalidate_rkey is None else e.IBV_WR_SEND_WITH_INV
        self.post_chain([dict(wr_id=wr_id, opcode=op, sge=(addr, length, lkey), signaled=signaled,
                              invalidate_rkey=invalidate_rkey or 0, inline=inline)])

    def post_rdma_write(self, wr_id: int, addr: int, length: int, lkey: int, *, rkey: int,
                        raddr: int, signaled: bool = True) -> None:
        self.post_chain([dict(wr_id=wr_id, opcode=e.IBV_WR_RDMA_WRITE, sge=(addr, length, lkey),
                              signaled=signaled, rkey=rkey, raddr=raddr)])

    def post_rdma_read(self, wr_id: int, addr: int, length: int, lkey: int, *, rkey: int,
                       raddr: int) -> None:
        """RDMA READ (always signalled: the data is only there once it completes)."""
        self.post_chain([dict(wr_id=wr_id, opcode=e.IBV_WR_RDMA_READ, sge=(addr, length, lkey),
                              signaled=True, rkey=rkey, raddr=raddr)])

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.qp.close()
            if self in self.device._children:
                self.device._children.remove(self)


@dataclass(eq=False)
class Slot:
    """One fixed-size buffer of a :class:`BufferPool`.

    ``addr`` is the virtual address to put in SGEs and keyed SGLs, ``view`` a zero-copy
    writable memoryview of the whole slot (valid while the pool is open).
    """

    pool: "BufferPool"
    index: int
    addr: int
    view: memoryview

    @property
    def size(self) -> int:
        return self.pool.slot_size

    @property
    def lkey(self) -> int:
        return self.pool.lkey

    @property
    def rkey(self) -> int:
        return self.pool.rkey

    def sge(self, length: int | None = None, offset: int = 0) -> tuple[int, int, int]:
        """(addr, length, lkey) for the post helpers."""
        return (self.addr + offset, self.size - offset if length is None else length, self.pool.lkey)


class BufferPool:
    """``count`` slots of ``slot_size`` bytes in one anonymous mmap registered once as one MR.

    :meth:`get` / :meth:`put` hand slots out and back (LIFO, no allocation); ``get`` raises
    :class:`IndexError` when empty (``available`` tells beforehand).  ``access`` defaults to
    LOCAL_WRITE; use :data:`ACCESS_REMOTE` for buffers a peer reads or writes with RDMA.
    All slots share one lkey/rkey: a peer holding the rkey can reach the *whole* pool; callers
    that hand rkeys to untrusted peers must layer per-command protection on top.
    """

    def __init__(self, device: Device, slot_size: int, count: int, access: int = ACCESS_LOCAL) -> None:
        if slot_size <= 0 or count <= 0:
            raise ValueError("slot_size and count must be positive")
        self.device = device
        self.slot_size = slot_size
        self.count = count
        self.length = slot_size * count
        self._mem = mmap.mmap(-1, self.length)
        import ctypes
        self._anchor = ctypes.c_char.from_buffer(self._mem)  # pins the mmap (cannot close/resize)
        self.base = ctypes.addressof(self._anchor)
        self.mr = MR(device.pd, self.length, access, address=self.base)
        self.lkey = self.mr.lkey
        self.rkey = self.mr.rkey
        self.view = memoryview(self._mem)
        self.slots = [Slot(self, i, self.base + i * slot_size,
                           self.view[i * slot_size:(i + 1) * slot_size]) for i in range(count)]
        self._free = list(reversed(self.slots))
        self.closed = False

    @property
    def available(self) -> int:
        return len(self._free)

    def get(self) -> Slot:
        if not self._free:
            raise IndexError("buffer pool exhausted")
        return self._free.pop()

    def put(self, slot: Slot) -> None:
        if slot.pool is not self:
            raise ValueError("slot belongs to another pool")
        self._free.append(slot)

    def slot_at(self, addr: int) -> Slot:
        """The slot containing virtual address ``addr`` (e.g. from a completion's wr_id mapping)."""
        i, _ = divmod(addr - self.base, self.slot_size)
        if not 0 <= i < self.count:
            raise ValueError(f"address {addr:#x} outside the pool")
        return self.slots[i]

    def contains(self, addr: int, length: int) -> bool:
        return self.base <= addr and addr + length <= self.base + self.length

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.mr.close()
        for s in self.slots:
            s.view.release()
        self.view.release()
        self.slots = []
        self._free = []
        del self._anchor
        try:
            self._mem.close()
        except BufferError:  # a caller still holds a view derived from a slot; GC frees it
            pass
        if self in self.device._children:
            self.device._children.remove(self)
