"""NVMe/RDMA transport of the host: one RC queue pair per NVMe queue, as the Linux host does.

``open_queue(params, queue, on_lost)`` (the controller's ``QueueOpener``) connects through rdma_cm (private data QID,
HRQSIZE = depth, HSQSIZE = depth - 1; responder resources > 0 so the target may RDMA READ our
write data) and returns an :class:`RdmaHostConnection` satisfying the controller's
``QueueConnection`` protocol.

Per queue, registered once: command capsule slots (64 bytes + up to 4096 in-capsule bytes on
I/O queues; the admin queue sends 64-byte capsules only, as a Linux target requires), 16-byte
response receive buffers (one per queue slot, posted before RTR), and data buffers in three
size classes.  Small writes on I/O queues travel in-capsule (SGL 0x01, data right after the
SQE in the same SEND); everything else uses one keyed SGL.

Per-command remote key protection (``key_mode``)
-----------------------------------------------
``"mw"`` (default where the device supports type 2B memory windows, e.g. rxe): the data pools
are registered *without* remote access (LOCAL_WRITE | MW_BIND), so their MR rkeys are useless
to a peer.  Each command slot owns one type 2 memory window; per command a BIND_MW work request
(chained in front of the command SEND) opens exactly the command's buffer range -- REMOTE_READ
for writes, REMOTE_WRITE for reads -- under a fresh rkey (the 8-bit key part is bumped every
time), and the SGL is 0x4F ("please invalidate").  The key dies before the command completes:
either the target answers with SEND_WITH_INV for that very key (checked: any other key is a
protocol error and tears the queue down, like Linux's "bogus remote invalidation"), or the host
posts LOCAL_INV itself and completes the command only after that finished.  Cost: one extra
(unsignalled) WR per command, plus one LOCAL_INV round through the send queue when the target
does not invalidate.  pyverbs 44 has ``MW``/``MWBindInfo``/``SendWR.set_bind_wr``, but its
``set_bind_wr`` derives the new key from the ``ibv_mw.rkey`` field that the old post_send API
never updates; we keep that field in step through a raw pointer (checked at start-up).

Soft-RoCE (rxe; vendor id 0xFFFFFF) gets ``"mr"`` under ``auto``: with BIND_MW work requests
in the send queue, Linux 6.1's rxe sometimes stops sending after the requester retransmits
(``rdma statistic`` completer_retry_err +1): the QP stays in RTS, nothing more goes out, no
completion (not even an error) ever arrives, and every command on the queue hangs.  Seen against
nvmet-rdma in the VM bed (TCG drops packets, so retries are common) within a few runs of ~100
commands; never with ``"mr"`` (no local operations in the send queue).  Likely mechanism: the
retry rewinds the requester to the oldest unacknowledged WR and it re-executes a BIND_MW the
completer has already retired, with the window's previous key; that bind fails behind the
completer's index, so the error is never reported.  ``rdma_keys = "mw"`` (``BLOCKD_RDMA_KEYS=mw``,
see ``ConnectParams``) still forces windows.

``"mr"`` (fallback where MWs are missing or fail, on rxe, or forced with ``rdma_keys = "mr"``): the
data pools are registered with REMOTE_READ|REMOTE_WRITE and SGL 0x40 carries the pool's MR
rkey.  Risk: for the lifetime of the queue the target can read and write the *whole* data pool
of that queue (not other memory) -- including buffers of commands that already completed or
have not started.  Data is copied in/out of the pool, so caller buffers are never exposed, but
a malicious target could corrupt or read other in-flight I/O of the same queue.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import weakref
from typing import Callable

import structlog

from blockd.rdma.abi import SEND_SIGNALED, WR_SEND
from initiator.errors import ConnectError, QueueLost
from initiator.params import ConnectParams
from initiator.queue import HostCommand, HostQueue
from protocol.commands import SQE_SGL_END, SQE_SGL_OFFSET
from protocol.constants import SglId
from protocol.nvme import CQE_FAST, CQE_SIZE, SQE_SIZE, build_sgl_data_block, build_sgl_keyed
from protocol.status import from_wire

log = structlog.get_logger("blockd.initiator.rdma")

INLINE_MAX = 4096
_KIND_SHIFT = 48
_MASK = (1 << _KIND_SHIFT) - 1
_RECV, _SEND, _INV = 1, 2, 3
_NULL_SGL = build_sgl_keyed(0, 0, 0, SglId.KEYED_DATA_BLOCK)
_unpack_cqe = CQE_FAST.unpack_from
# "received with invalidate": IBV_WC_WITH_INV (8), and 4 = the kernel's IB_WC_WITH_INVALIDATE,
# which rxe (Linux 6.1) copies unconverted into user-space completions (on an RC QP the user
# meaning of 4, IP_CSUM_OK, never occurs).  Missing it would make us LOCAL_INV a window that is
# already invalid, which oopses 6.1's rxe (NULL mr in rxe_invalidate_mw).
_WITH_INV = 8 | 4
_RXE_VENDOR_ID = 0xFFFFFF  # rdma_rxe's attr.vendor_id

_channels: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, object]" = weakref.WeakKeyDictionary()


def _channel(loop: asyncio.AbstractEventLoop):
    from blockd.rdma.cm import CmEventChannel
    ch = _channels.get(loop)
    if ch is None or ch.closed:
        ch = _channels[loop] = CmEventChannel(loop)
    return ch


def _data_classes(qid: int, depth: int, max_transfer: int = 1 << 20) -> list[tuple[int, int]]:
    if qid == 0:
        return [(8192, depth), (max_transfer, 1)]
    return [(8192, depth), (128 << 10, min(depth, 16)), (max_transfer, 4)]


# -- memory windows (pyverbs 44 + a raw pointer) ---------------------------------------------------

def _mw_ptr(mw) -> int:
    """The ``ibv_mw*`` inside a pyverbs MW (fields: pd object @40, ibv_mw* @48; checked)."""
    for off in (48, 40):
        p = ctypes.c_void_p.from_address(id(mw) + off).value
        if p and ctypes.c_uint32.from_address(p + 16).value == mw.rkey:
            return p
    raise RuntimeError("cannot locate ibv_mw in the pyverbs MW object")


class _Window:
    """One type 2 MW with its current rkey; ``ibv_mw.rkey`` (+16) kept equal to it."""

    __slots__ = ("mw", "ptr", "rkey")

    def __init__(self, pd) -> None:
        import pyverbs.enums as e
        from pyverbs.mr import MW
        self.mw = MW(pd, e.IBV_MW_TYPE_2)
        self.ptr = _mw_ptr(self.mw)
        self.rkey = self.mw.rkey

    def bind_wr(self, mr, addr: int, length: int, access: int):
        """A BIND_MW SendWR under a fresh rkey (returned as ``wr.rkey``)."""
        import pyverbs.enums as e
        from pyverbs.mr import MWBindInfo
        from pyverbs.wr import SendWR
        ctypes.c_uint32.from_address(self.ptr + 16).value = self.rkey
        wr = SendWR(wr_id=0, opcode=e.IBV_WR_BIND_MW, num_sge=0, sg=None, send_flags=0)
        wr.set_bind_wr(self.mw, MWBindInfo(mr, addr, length, access))
        return wr

    def bound(self, rkey: int) -> None:
        # the kernel's MW now has ``rkey``; the provider looks the MW up by ibv_mw.rkey
        self.rkey = rkey
        ctypes.c_uint32.from_address(self.ptr + 16).value = rkey

    def close(self) -> None:
        self.mw.close()


class _Slot:
    """Transport state of one command id."""

    __slots__ = ("cmd", "data", "rkey", "sent", "resp", "key_live")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.cmd: HostCommand | None = None
        self.data = None
        self.rkey: int | None = None
        self.sent = False
        self.resp: tuple[int, int, int] | None = None
        self.key_live = False


class RdmaHostConnection:
    """One NVMe queue over an RC QP (see the module docstring)."""

    def __init__(self, queue: HostQueue, on_lost: Callable[["RdmaHostConnection", Exception | None], None],
                 key_mode: str = "auto") -> None:
        self.queue = queue
        self.on_lost = on_lost
        self.qid = queue.qid
        self.depth = queue.depth
        self.inline_limit = 0
        self.inline_cap = 0 if queue.qid == 0 else INLINE_MAX
        self.closed = False
        self.error: Exception | None = None
        self.key_mode = key_mode
        self.connect_cattr = 0
        self.loop = asyncio.get_running_loop()
        self.dev = None
        self.cq = None
        self.qp = None
        self.cm = None
        self.cmd_pool = None
        self.resp_pool = None
        self.data = None
        self.windows: list[_Window] = []
        self.slots = [_Slot() for _ in range(queue.depth)]
        self.backlog: collections.deque[HostCommand] = collections.deque()
        self._lost_reported = False
        self._lost_delivered = False
        self._destroyed = False

    # -- setup ----------------------------------------------------------------------------------

    def _make_qp(self, dev_name: str):
        import pyverbs.enums as e
        from blockd.rdma.slots import SlotClasses
        from blockd.rdma.verbs import ACCESS_LOCAL, ACCESS_REMOTE, open_device
        self.dev = dev = open_device(dev_name)
        depth = self.depth
        self.cq = dev.create_cq(5 * depth + 8)
        self.cmd_pool = dev.create_pool(SQE_SIZE + self.inline_cap, depth)
        self.resp_pool = dev.create_pool(CQE_SIZE, depth + 1)
        classes = _data_classes(self.qid, depth)
        mode = self.key_mode
        if mode == "auto" and dev.attr.vendor_id == _RXE_VENDOR_ID:
            mode = "mr"  # rxe replays BIND_MW after a retransmission and stalls (docstring)
        if mode in ("auto", "mw"):
            caps = dev.attr.device_cap_flags
            if mode == "mw" or caps & e.IBV_DEVICE_MEM_WINDOW_TYPE_2B:
                try:
                    self.data = SlotClasses(dev, classes, ACCESS_LOCAL | e.IBV_ACCESS_MW_BIND)
                    self.windows = [_Window(dev.pd) for _ in range(depth)]
                    mode = "mw"
                except Exception as exc:
                    if self.key_mode == "mw":
                        raise
                    log.warning("memory windows unavailable; registering data buffers for "
                                "remote access instead", error=str(exc))
                    for w in self.windows:
                        w.close()
                    self.windows = []
                    if self.data is not None:
                        self.data.close()
                        self.data = None
                    mode = "mr"
            else:
                mode = "mr"
        if mode == "mr":
            self.data = SlotClasses(dev, classes, ACCESS_REMOTE)
        self.key_mode = mode
        # per command: BIND_MW + SEND (+ LOCAL_INV)
        self.qp = dev.create_qp(self.cq, max_send_wr=3 * depth + 4, max_recv_wr=depth + 1)
        return self.qp

    def _post_recvs(self, qp) -> None:
        qp.post_recvs([((_RECV << _KIND_SHIFT) | s.index, *s.sge()) for s in self.resp_pool.slots])

    # -- sending --------------------------------------------------------------------------------

    def hold(self) -> None:
        """Work requests are posted as they are submitted: nothing to hold."""

    def release(self) -> None:
        pass

    def submit(self, cmd: HostCommand) -> None:
        """Post ``cmd``'s capsule (work requests go out as they are posted)."""
        if self.closed:
            if self._lost_delivered:
                raise QueueLost("connection closed")
            # on_lost is still on its way: park the command, the controller takes it from the
            # queue (and retries it) when on_lost runs -- raising here would make a caller that
            # retries at once spin without ever yielding to the loop
            self.queue.start(cmd)
            return
        self.queue.start(cmd)
        st = self.slots[cmd.cid]
        st.reset()
        st.cmd = cmd
        out = cmd.data_out
        length = cmd.length
        if out is not None and length <= min(self.inline_limit, self.inline_cap) and length:
            self._send(cmd, st, inline=True)
        elif length:
            self.data.get(length, lambda slot, cmd=cmd: self._got_slot(cmd, slot))
        else:
            self._send(cmd, st)

    def _got_slot(self, cmd: HostCommand, slot) -> None:
        st = self.slots[cmd.cid] if cmd.cid < len(self.slots) else None
        if self.closed or st is None or st.cmd is not cmd:
            self.data.put(slot)
            return
        st.data = slot
        if cmd.data_out is not None:
            slot.view[:len(cmd.data_out)] = cmd.data_out
        self._send(cmd, st)

    def _send(self, cmd: HostCommand, st: _Slot, inline: bool = False) -> None:
        cid = cmd.cid
        cslot = self.cmd_pool.slots[cid]
        sqe = cmd.sqe
        length = cmd.length
        nbytes = SQE_SIZE
        bind = None
        if inline:
            sqe[SQE_SGL_OFFSET:SQE_SGL_END] = build_sgl_data_block(SglId.DATA_BLOCK_OFFSET, 0, length)
            cslot.view[SQE_SIZE:SQE_SIZE + length] = cmd.data_out
            nbytes += length
        elif st.data is not None:
            slot = st.data
            if self.key_mode == "mw":
                import pyverbs.enums as e
                win = self.windows[cid]
                access = e.IBV_ACCESS_REMOTE_READ if cmd.data_out is not None else \
                    e.IBV_ACCESS_REMOTE_WRITE
                mr = slot.pool.mr
                bind = win.bind_wr(mr, slot.addr, length, access)
                st.rkey = bind.rkey
                sqe[SQE_SGL_OFFSET:SQE_SGL_END] = build_sgl_keyed(slot.addr, length, st.rkey,
                                             SglId.KEYED_DATA_BLOCK_INVALIDATE)
            else:
                sqe[SQE_SGL_OFFSET:SQE_SGL_END] = build_sgl_keyed(slot.addr, length, slot.rkey, SglId.KEYED_DATA_BLOCK)
        else:
            sqe[SQE_SGL_OFFSET:SQE_SGL_END] = _NULL_SGL
        cslot.view[:SQE_SIZE] = sqe
        wr_id = (_SEND << _KIND_SHIFT) | cid
        if bind is None:  # the common case: one SEND, posted without pyverbs objects
            try:
                self.qp.post_sends([(wr_id, WR_SEND, SEND_SIGNALED, cslot.addr, nbytes, cslot.lkey, 0, 0, 0)])
            except Exception as exc:
                self._fail(ConnectionError(f"posting a command failed: {exc}"))
            return
        self._send_bound(cid, st, bind, wr_id, cslot, nbytes)

    def _send_bound(self, cid: int, st: _Slot, bind, wr_id: int, cslot, nbytes: int) -> None:
        """The memory-window bind chained before the SEND: pyverbs' ``set_bind_wr`` builds the
        bind, so this chain is posted through pyverbs."""
        import pyverbs.enums as e
        from pyverbs.wr import SGE, SendWR
        sge = SGE(cslot.addr, nbytes, cslot.lkey)
        send = SendWR(wr_id=wr_id, opcode=e.IBV_WR_SEND, num_sge=1, sg=[sge], send_flags=e.IBV_SEND_SIGNALED)
        try:
            bind.next_wr = send
            self.qp.qp.post_send(bind)
            self.windows[cid].bound(st.rkey)
            st.key_live = True
        except Exception as exc:
            self._fail(ConnectionError(f"posting a command failed: {exc}"))
        finally:
            send.close()
            sge.close()
            bind.close()

    # -- completions ----------------------------------------------------------------------------

    def _completions(self, wcs: list) -> None:
        for wc in wcs:
            kind = wc.wr_id >> _KIND_SHIFT
            idx = wc.wr_id & _MASK
            if self.closed:
                return
            if wc.status:
                from blockd.rdma.verbs import wc_status_str
                bad = next((w for w in wcs if w.status not in (0, 5)), wc)  # 5: flushed
                self._fail(ConnectionError(
                    f"RDMA work request failed: {wc_status_str(bad.status)} (kind "
                    f"{bad.wr_id >> _KIND_SHIFT}, cid {bad.wr_id & _MASK}, vendor_err {bad.vendor_err})"))
                return
            try:
                if kind == _RECV:
                    self._response(idx, wc)
                elif kind == _SEND:
                    st = self.slots[idx]
                    st.sent = True
                    self._maybe_complete(idx, st)
                elif kind == _INV:
                    st = self.slots[idx]
                    st.key_live = False
                    self._maybe_complete(idx, st)
            except ConnectionError as exc:
                self._fail(exc)
                return
            except Exception as exc:
                log.exception("rdma completion handling failed")
                self._fail(ConnectionError(f"internal error: {exc}"))
                return

    def _response(self, idx: int, wc) -> None:
        rslot = self.resp_pool.slots[idx]
        if wc.byte_len != CQE_SIZE:
            raise ConnectionError(f"response of {wc.byte_len} bytes (want 16)")
        dw0, dw1, _, _, cid, status = _unpack_cqe(rslot.view)
        self.qp.post_recvs([((_RECV << _KIND_SHIFT) | idx, *rslot.sge())])
        st = self.slots[cid] if cid < len(self.slots) else None
        if st is None or st.cmd is None or st.resp is not None or self.queue.get(cid) is not st.cmd:
            raise ConnectionError(f"completion for unknown command id {cid}")
        st.resp = (from_wire(status), dw0, dw1)
        if wc.wc_flags & _WITH_INV:
            inv = wc.imm_data
            if not st.key_live or inv != st.rkey:
                raise ConnectionError(f"bogus remote invalidation of key {inv:#x} for command "
                                      f"{cid} (its key: {st.rkey if st.rkey is None else hex(st.rkey)})")
            st.key_live = False
        elif st.key_live:
            # the target did not invalidate: kill the key ourselves before completing
            import pyverbs.enums as e
            self.qp.post_chain([dict(wr_id=(_INV << _KIND_SHIFT) | cid, opcode=e.IBV_WR_LOCAL_INV,
                                     sges=None, signaled=True, imm_data=st.rkey)])
            return
        self._maybe_complete(cid, st)

    def _maybe_complete(self, cid: int, st: _Slot) -> None:
        if not st.sent or st.resp is None or st.key_live:
            return
        cmd = st.cmd
        status, dw0, dw1 = st.resp
        slot = st.data
        st.reset()
        if slot is not None:
            if status == 0 and cmd.data_in is not None:
                cmd.data_in[:] = slot.view[:len(cmd.data_in)]
            self.data.put(slot)
        if self.queue.finish(cid) is not cmd:
            return  # timed out meanwhile: the controller already failed it
        cmd.status = status
        cmd.dw0, cmd.dw1 = dw0, dw1
        cmd.complete()

    # -- failure and close ----------------------------------------------------------------------

    def _cm_closed(self, _conn) -> None:
        if self.cm is None:
            return  # still connecting: open_queue reports the failure
        if not self.closed:
            self._fail(ConnectionError("the target disconnected"))

    def _fail(self, exc: Exception) -> None:
        if self.closed:
            return
        log.warning("rdma queue failed", qid=self.qid, error=str(exc))
        self.error = exc
        self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.cm is not None:
                self.cm.disconnect()
                task = self.loop.create_task(self._teardown())
                _teardowns.add(task)
                task.add_done_callback(_teardowns.discard)
            else:
                self._destroy()
        if not self._lost_reported:
            self._lost_reported = True
            self.loop.call_soon(self._deliver_lost)

    def _deliver_lost(self) -> None:
        self._lost_delivered = True
        self.on_lost(self, self.error)

    async def _teardown(self) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(self.cm.closed), 2)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            pass
        finally:
            self._destroy()

    def _destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        if self.cq is not None:
            self.cq.detach()
        if self.cm is not None:
            self.cm.close()
        elif self.qp is not None:
            self.qp.close()
        for w in self.windows:
            try:
                w.close()
            except Exception:
                pass
        self.windows = []
        for obj in (self.data, self.cmd_pool, self.resp_pool, self.cq):
            if obj is not None:
                obj.close()


_teardowns: set[asyncio.Task[None]] = set()


async def open_queue(params: ConnectParams, queue: HostQueue,
                     on_lost: Callable[[RdmaHostConnection, Exception | None], None]) -> RdmaHostConnection:
    """Connect one NVMe queue over RDMA (see the module docstring)."""
    from blockd.rdma.cm import CmError, CmRejected, connect
    from protocol import rdma_cm as pcm
    loop = asyncio.get_running_loop()
    conn = RdmaHostConnection(queue, on_lost, params.rdma_keys)
    pdata = pcm.ConnectRequest(qid=queue.qid, hrqsize=queue.depth, hsqsize=queue.depth - 1).pack()
    where = f"{params.traddr}:{params.trsvcid}"
    try:
        for attempt in range(3):
            try:
                conn.cm = await asyncio.wait_for(
                    connect(_channel(loop), params.traddr, int(params.trsvcid), conn._make_qp, pdata,
                            before_rtr=conn._post_recvs, on_disconnect=conn._cm_closed,
                            timeout_ms=min(5000, int(params.connect_timeout * 1000))),
                    params.connect_timeout + 3)
                break
            except CmError as exc:
                # the first address resolution after boot sometimes never answers (seen on rxe
                # with the bed's policy routing); retry those, nothing else
                if isinstance(exc, CmRejected) or "resolving" not in str(exc) or attempt == 2:
                    raise
                log.info("rdma address resolution timed out; retrying", qid=queue.qid)
                for obj in (conn.cmd_pool, conn.resp_pool, conn.data, conn.cq):
                    if obj is not None:
                        obj.close()
                conn.cmd_pool = conn.resp_pool = conn.data = conn.cq = None
                for w in conn.windows:
                    w.close()
                conn.windows = []
    except CmRejected as exc:
        conn.qp = None  # connect() closed it
        conn._destroy()
        raise ConnectError(f"{where} rejected the rdma connection of queue {queue.qid}: {exc}") from exc
    except (CmError, OSError, asyncio.TimeoutError, LookupError) as exc:
        conn.qp = None
        conn._destroy()
        raise ConnectError(f"cannot reach {where} over rdma: {exc or 'timed out'}") from exc
    except BaseException:
        conn.qp = None
        conn._destroy()
        raise
    conn.cq.attach(loop, conn._completions)
    log.debug("rdma queue connected", qid=queue.qid, depth=queue.depth, keys=conn.key_mode,
              dev=conn.dev.name)
    return conn
