"""NVMe/RDMA transport of the target: one RC queue pair per NVMe queue, driven by asyncio.

It only moves data; the NVMe core (:class:`target.queue.TargetQueue`) validates, executes and
answers each command, calling back ``fetch_data`` and ``queue_response`` (see
:mod:`target.transport`).

* Listening: one rdma_cm listener per local IP (never the wildcard: pyverbs 44 segfaults on
  it; a wildcard port listens on every IPv4 address of a netdev that has an RDMA device).
* Connect request: the NVMe-oF private data is checked (RECFMT, QID, HSQSIZE, HRQSIZE; admin
  HSQSIZE+1 <= 32) and a bad one rejected with its NVMe-oF STS.  Otherwise a CQ and an external
  QP are created on the request's device, HSQSIZE+1 receives of 64 (+4096 in-capsule bytes on
  I/O queues; the admin queue takes 64-byte capsules only, as nvmet) are posted *before* the
  accept, which carries CRQSIZE = HSQSIZE+1.  A request past the connection maxima (shared with
  NVMe/TCP) or whose receive buffers would pass ``rdma_recv_total`` is rejected with No
  Resources; an accepted queue that sends no Fabrics Connect within ``hello_timeout`` is closed
  (issue 12, docs/security.md).
* Command (RECV): the SQE and any in-capsule data go to ``queue.submit``.  Host-to-controller
  data behind a keyed SGL is fetched (``fetch_data``) with RDMA READs of the SGL's (validated)
  address/length/key into a registered slot, in pieces of at most ``READ_CHUNK`` bytes, with at
  most ``initiator_depth`` READs and ``READ_BYTES_IN_FLIGHT`` bytes in flight per QP (the rest
  wait in FIFO order); then ``queue.data_ready``.
* Execution: the core runs the command at once, in the completion handler; only a command
  that really waits (an fsync, a slow backend) becomes a Task.
* Reply (``queue_response``): a read goes straight into a registered slot when one is free
  (``read_buffer``; else it is copied into one once one is free, and while it waits it counts
  against the daemon's ``max_unsent_total``, past which queues adding to it take no new
  commands until the total drops) and is RDMA WRITTEN to the SGL's address/key
  (never more than the SGL length), chained with the 16-byte response SEND; the command's
  receive buffer is re-posted before that SEND.  SEND_WITH_INV carries the command's key only
  when the host asked for it (SGL id 0x4F with data).  What one batch of completions produces
  goes out as one chain of receives and one of sends
  (:meth:`blockd.rdma.verbs.QueuePair.post_sends`, no pyverbs objects per I/O).
* Failures: a failed RDMA READ fails its command with DATA TRANSFER ERROR where the
  connection still lives; a remote access error (bad key/address from the host) moves an RC
  QP to the error state, so that host's queue is torn down -- every other connection is
  untouched.

Data buffers come from per-device registered pools in three size classes
(:class:`blockd.rdma.slots.SlotClasses`), shared by all connections on that device; receive
and response buffers are per connection.  Nothing is registered per I/O.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import ipaddress
from typing import Any

import structlog

from blockd.rdma import netdev
from blockd.rdma.abi import (SEND_SIGNALED, WC_WR_FLUSH_ERR, WR_RDMA_READ, WR_RDMA_WRITE, WR_SEND,
                             WR_SEND_WITH_INV, wc_status_name)
from protocol.constants import SglId, TransportType
from protocol.logpage import TSAS_RDMA
from protocol.nvme import CQE_SIZE, SQE_SIZE
from target.controller import MQES
from target.io_fast import RdmaFastPath
from target.queue import TargetQueue
from target.request import Request, RequestState
from target.rejections import HELLO_TIMEOUT, RDMA_RECV_BUDGET
from target.target import ADMIN_QUEUE_MAX, PortInfo, Target
from target.transport import DEFAULT_MAX_TRANSFER, TransportInfo

log = structlog.get_logger("blockd.target.rdma")

KIND_SHIFT = 48
KIND_RECV, KIND_READ, KIND_SEND, KIND_WRITE = 1, 2, 3, 4
WR_ID_MASK = (1 << KIND_SHIFT) - 1
_SGL_INVALIDATE = int(SglId.KEYED_DATA_BLOCK_INVALIDATE)
_READ_FAILED = -1  # RdmaCommand.posted once a piece of its RDMA READ has failed
RDMA_INLINE = 4096
READ_CHUNK = 128 << 10
"""Largest RDMA READ we post: what the kernel's rdma_rw makes of a 1 MiB transfer on rxe (32
SGEs of 4 KiB per work request), so the host's responder answers in pieces as it does for nvmet."""
READ_BYTES_IN_FLIGHT = 512 << 10
"""RDMA READ bytes one queue has outstanding at most (at least ``READ_CHUNK``).

Measured (docs/rdma-read-pacing.md): Soft-RoCE's responder sends a READ's whole answer from one
softirq run, a packet per MTU (1 KiB on the VM bed's veth), and everything it sends in that run
waits in the CPU's netdev backlog (``net.core.netdev_max_backlog``, 1000 packets), which is
drained only after the run.  With up to ``initiator_depth`` (128) READs of up to 1 MiB requested
at once, the host dropped its own READ responses and ACKs (rxe ``send_err``, dmesg ``Failed
sending ACK``), our requester retried (``completer_retry_err``) until the retry count ran out and
the QP failed.  The initiator depth alone (a count, not bytes) does not prevent it; 256 KiB per
queue still let 28 packets drop in one of three runs, 128 KiB (one piece, or several small
READs) none in the runs since.

Raised to 512 KiB once the bed turned on RPS (which put each QP's packets into one CPU's backlog
in order, docs/rdma-read-pacing.md): ``test_khost_ext4_write_bursts``, which fails on any rxe
send error, backlog drop or ``Failed sending ACK``, passed 3 of 3; the VM bench's 128 KiB write
at QD16, four boots alternated with 128 KiB, gave 17.4, 17.2, 19.0, 16.8 MB/s (1.27, 0.78,
1.28, 0.94x nvmet-rdma) against 12.8, 16.0, 15.8, 8.9 MB/s (0.89, 0.72, 1.04, 0.49x): one
128 KiB READ per queue in flight had left the host's responder idle between pieces."""
INFO = TransportInfo(
    name="rdma", trtype=TransportType.RDMA,
    data_sgl_ids=frozenset({SglId.KEYED_DATA_BLOCK, SglId.KEYED_DATA_BLOCK_INVALIDATE}),
    keyed_sgls=True, admin_inline=0, io_inline=RDMA_INLINE, max_transfer=DEFAULT_MAX_TRANSFER,
    sgls=0x00100005, tsas=TSAS_RDMA.build(dict(qptype=1, prtype=1, cms=1, pkey=0)))
"""The admin queue takes 64-byte capsules only, as nvmet; SGLS adds bit 2 (Keyed SGL Data
Block) to TCP's; TSAS: reliable connected QP, no RDMA provider type, rdma_cm."""
# shared data buffers per device: (slot size, count); 2 + 4 + 8 MiB registered once
DATA_CLASSES = [(8192, 256), (128 << 10, 32), (INFO.max_transfer, 8)]

FLUSH_GRACE = 1.0
"""Seconds a flushed work completion waits for the CM event that explains it (see wc_failed)."""

_data_slots: dict[str, Any] = {}


def _device_slots(dev):
    from blockd.rdma.slots import SlotClasses
    s = _data_slots.get(dev.name)
    if s is None or s.closed:
        s = _data_slots[dev.name] = SlotClasses(dev, DATA_CLASSES)
    return s


def _inline_size(qid: int) -> int:
    """In-capsule data a queue's receive buffers hold: none on the admin queue, as nvmet."""
    return INFO.admin_inline if qid == 0 else INFO.io_inline


_NEED_DATA = RequestState.NEED_DATA


class RdmaCommand:
    """Transport state of one command (its ``req.transport_ctx``): the request once the core
    hands it back, its receive slot, data slot (and the view of it the controller reads into),
    bytes to RDMA WRITE, response slot, and how far its RDMA READ has gone."""

    __slots__ = ("req", "recv", "data", "view", "nbytes", "resp", "posted", "reading")

    def __init__(self, recv: int) -> None:
        self.req: Request | None = None
        self.recv = recv
        self.data = None
        self.view = None
        self.nbytes = 0
        self.resp = -1
        self.posted = 0
        """Bytes of the host's data RDMA READs have been posted for."""
        self.reading = 0
        """RDMA READs of this command in flight."""


class RdmaTargetConnection:
    """One accepted NVMe/RDMA queue (admin or I/O)."""

    info = INFO
    fast = None
    """The compiled per-command path once accepted (``__init__``); None before and without it."""

    def __init__(self, listener: "RdmaListener", creq, host: str, recv_bytes: int) -> None:
        from blockd.rdma.verbs import open_device
        nv = creq.nvme
        self.listener = listener
        self.depth = nv.hsqsize + 1
        self.inline = _inline_size(nv.qid)
        self.loop = asyncio.get_running_loop()
        self.dev = dev = open_device(creq.dev_name)
        self.data = _device_slots(dev)
        depth = self.depth
        self.cq = dev.create_cq(6 * depth + 16)
        self.recv_pool = dev.create_pool(SQE_SIZE + self.inline, depth)
        self.resp_pool = dev.create_pool(CQE_SIZE, 2 * depth)
        self.qp = dev.create_qp(self.cq, max_send_wr=4 * depth + 8, max_recv_wr=depth + 1)
        self.closing = False
        self.destroyed = False
        self._flush_timer: asyncio.TimerHandle | None = None
        self.held: list = []
        self.cm = None
        self.reads_in_flight = 0
        self.read_bytes_free = READ_BYTES_IN_FLIGHT
        self.read_wait: collections.deque[RdmaCommand] = collections.deque()
        self.resp_wait: collections.deque[RdmaCommand] = collections.deque()
        self.tokens: dict[int, tuple[RdmaCommand, int]] = {}  # RDMA READs in flight: command, bytes
        self._next_token = 0
        self.cmds: set[RdmaCommand] = set()
        self.unsent_total = listener.target.unsent
        self.waiting_bytes = 0
        """Read data waiting in ordinary buffers for a registered slot (``unsent``)."""
        self.deferring = False
        """Past ``max_unsent_total``: received commands wait in their receive slots, unsubmitted."""
        self.deferred: collections.deque[tuple[int, int]] = collections.deque()
        # work requests as the fast post path takes them, built once
        lkey = self.recv_pool.lkey
        self.recv_wrs = [((KIND_RECV << KIND_SHIFT) | s.index, s.addr, s.size, lkey)
                          for s in self.recv_pool.slots]
        self.resp_cmd: list[RdmaCommand | None] = [None] * len(self.resp_pool.slots)
        # while a batch of completions is handled, receives and sends wait here and go out as
        # one chain each at its end (receives first: a command's buffer is re-posted before its
        # response can let the host send into it again)
        self.batching = False
        self.recv_out: list = []
        self.send_out: list = []
        self._admitted = None
        self._hello: asyncio.TimerHandle | None = None
        self.peer = creq.peer
        port = listener.port
        self.queue = TargetQueue(listener.target, self, port.port_id, peer=self.peer,
                                 local_address=creq.listener.addr, inline_size=self.inline)
        try:
            self.cm = creq.accept_nvme(self.qp, crqsize=depth, before_rtr=self._post_all_recvs,
                                       on_disconnect=self._cm_closed)
        except Exception:
            self._destroy()
            raise
        # from here on _destroy gives back what the listener counted for this queue
        self._admitted: tuple[str, int] | None = (host, recv_bytes)
        self._hello = self.loop.call_later(listener.target.limits.hello_timeout, self._hello_expired)
        self.fast = RdmaFastPath(self) if RdmaFastPath is not None else None
        """The compiled per-command path (:mod:`target.io_fast`): it takes each batch of
        completions first, serves the steady-state ones and hands the rest to ``completion``."""
        self.cq.attach(self.loop, self._completions if self.fast is None else self.fast.completions)
        log.info("rdma queue accepted", peer=self.peer, qid=nv.qid, depth=depth,
                 inline=self.inline, initiator_depth=self.cm.initiator_depth, dev=dev.name)

    def _hello_expired(self) -> None:
        """An established queue that sent no Fabrics Connect within ``hello_timeout`` holds its
        QP and receive buffers for nothing: close it (as NVMe/TCP's hello timeout)."""
        if not self.closing and self.queue.controller is None:
            self.listener.target.rejections.add(HELLO_TIMEOUT)
            self._fatal("no Connect in time", timeout=str(self.listener.target.limits.hello_timeout))

    # -- receives -------------------------------------------------------------------------------

    def _post_all_recvs(self, qp) -> None:
        qp.post_recvs(self.recv_wrs)

    def _token(self, cmd: RdmaCommand, nbytes: int) -> int:
        t = self._next_token
        self._next_token = (t + 1) & WR_ID_MASK
        self.tokens[t] = (cmd, nbytes)
        return t

    # -- completions ----------------------------------------------------------------------------

    def _completions(self, wcs: list) -> None:
        """The CQ's callback (the compiled path's ``completions`` stands in for it when it runs):
        one batch of completions, whose receives and sends go out as one chain each at its end."""
        self.batching = True
        try:
            for wc in wcs:
                self.completion(wc)
        finally:
            self.batching = False
            if self.send_out or self.recv_out:
                self.flush()

    def completion(self, wc) -> None:
        wr_id = wc.wr_id
        kind = wr_id >> KIND_SHIFT
        idx = wr_id & WR_ID_MASK
        status = wc.status
        try:
            if kind == KIND_RECV:
                if status:
                    self.wc_failed("RECV", status)
                elif not self.closing:
                    self._command(idx, wc.byte_len)
            elif kind == KIND_SEND:
                self._send_done(idx, status)
            elif kind == KIND_READ:
                self._read_done(idx, status)
            elif kind == KIND_WRITE and status:  # unsignalled: only an error completes it
                self.wc_failed("RDMA WRITE", status)
        except Exception as exc:  # never let one completion stall the rest
            self.handling_failed(exc)

    def handling_failed(self, exc: Exception) -> None:
        log.exception("rdma completion handling failed", peer=self.peer)
        self._fatal("internal error", error=str(exc))

    def flush(self) -> None:
        """Post the receives and sends the batch queued: one chain each."""
        recvs, sends = self.recv_out, self.send_out
        try:
            if not self.closing:
                if recvs:
                    self.qp.post_recvs(recvs)
                if sends:
                    self.qp.post_sends(sends)
        except Exception as exc:
            self._fatal("posting the responses failed", error=str(exc))
        finally:
            recvs.clear()
            sends.clear()

    def _fatal(self, cause: str, **detail: str) -> None:
        """Close the queue for ``cause`` (the queue's teardown line logs it)."""
        self.queue.note_teardown(cause, **detail)
        self.close()

    def wc_failed(self, wr: str, status: int, **detail: str) -> None:
        """A work request completed in error: the QP is in the error state, the queue is gone.

        A flushed one is a consequence, not a cause: something else moved the QP to the error
        state, most often the host's DREQ, whose DISCONNECTED event may be read just after these
        completions. It gets ``FLUSH_GRACE`` seconds to name the cause first."""
        if self.closing:
            return
        if status != WC_WR_FLUSH_ERR:
            self._fatal("completion error", wc=wr, wc_status=wc_status_name(status), **detail)
        elif self._flush_timer is None:
            self._flush_timer = self.loop.call_later(FLUSH_GRACE, functools.partial(
                self._fatal, "completion error", wc=wr, wc_status=wc_status_name(status), **detail))

    def _command(self, idx: int, nbytes: int) -> None:
        if self.deferring:
            self.deferred.append((idx, nbytes))
            return
        if nbytes < SQE_SIZE:
            self._fatal("framing error", error=f"capsule of {nbytes} bytes is shorter than an SQE")
            return
        view = self.recv_pool.slots[idx].view
        cmd = RdmaCommand(idx)
        self.cmds.add(cmd)
        self.queue.submit(view[:SQE_SIZE], view[SQE_SIZE:nbytes] if nbytes > SQE_SIZE else None, cmd)

    def read_buffer(self, req: Request) -> memoryview | None:
        """The registered slot the RDMA WRITE goes from, when one is free now: the controller
        reads straight into it."""
        slot = self.data.get_now(req.length)
        if slot is None:
            return None
        cmd = req.transport_ctx
        cmd.data = slot
        cmd.view = slot.view[:req.length]
        return cmd.view

    # -- host-to-controller data: RDMA READ -----------------------------------------------------

    def fetch_data(self, req: Request) -> None:
        cmd = req.transport_ctx
        cmd.req = req
        if self.cm.initiator_depth == 0:
            self.queue.data_failed(req)  # the host offered no RDMA READ service
        else:
            self.data.get(req.length, lambda slot, cmd=cmd: self._read_slot(cmd, slot))

    def _read_slot(self, cmd: RdmaCommand, slot) -> None:
        if self.closing:
            self.data.put(slot)  # never posted: free at once
            return
        cmd.data = slot
        self.read_wait.append(cmd)
        self.pump_reads()

    def pump_reads(self) -> None:
        """Post the waiting commands' READs, in order, as far as the READ count and byte bounds
        allow (see ``READ_BYTES_IN_FLIGHT``)."""
        limit = self.cm.initiator_depth
        wait = self.read_wait
        while wait and self.reads_in_flight < limit and not self.closing:
            cmd = wait[0]
            req = cmd.req
            off = cmd.posted
            n = req.length - off
            if n > READ_CHUNK:
                n = READ_CHUNK
            if n > self.read_bytes_free:
                return  # the next READ completion makes room
            slot = cmd.data
            tok = self._token(cmd, n)
            try:
                # within the SGL the core validated: address, key, length (<= MAX_TRANSFER)
                self.qp.post_sends([((KIND_READ << KIND_SHIFT) | tok, WR_RDMA_READ, SEND_SIGNALED,
                                     slot.addr + off, n, slot.lkey, 0, req.sgl_address + off,
                                     req.sgl_key)])
            except Exception as exc:
                self.tokens.pop(tok, None)
                wait.popleft()
                self.queue.data_failed(self._request(cmd))
                self._fatal("RDMA READ post failed", error=str(exc))
                return
            self.reads_in_flight += 1
            self.read_bytes_free -= n
            cmd.reading += 1
            cmd.posted = off = off + n
            if off == req.length:
                wait.popleft()

    def _read_done(self, tok: int, status: int) -> None:
        self.reads_in_flight -= 1
        entry = self.tokens.pop(tok, None)
        if entry is None:
            return
        cmd, nbytes = entry
        self.read_bytes_free += nbytes
        cmd.reading -= 1
        if self.closing:
            # not dropped here: _destroy fails a command still waiting for its data (so it lets go
            # of its namespace, which dropping it here leaked) and takes its slot back once the QP is gone
            return
        req = cmd.req
        if status:
            if cmd.posted != _READ_FAILED:  # its first failed piece fails the command
                if self.read_wait and self.read_wait[0] is cmd:
                    self.read_wait.popleft()
                cmd.posted = _READ_FAILED
                req = self._request(cmd)
                self.queue.data_failed(req)
            # an RC requester error puts the QP in the error state: the queue is gone
            self.wc_failed("RDMA READ", status, cid=str(req.cid), addr=hex(req.sgl_address),
                            key=hex(req.sgl_key), length=str(req.length))
            return
        if not cmd.reading and cmd.posted == req.length and (self.fast is None or not self.fast.data_ready(cmd)):
            req.data = cmd.data.view[:req.length]  # zero copy: the core reads it in place
            self.queue.data_ready(req)
        self.pump_reads()

    def _request(self, cmd: RdmaCommand) -> Request:
        """The queue's request of a command waiting for its data: the compiled path's writes
        (``target/_rdma_fast.pyx`` ``FastWrite``) get the one the queue would have made."""
        return cmd.req if self.fast is None else self.fast.request(cmd)

    # -- replies ----------------------------------------------------------------------------------

    def queue_response(self, req: Request) -> None:
        """RDMA WRITE the read's data (if any) from a registered slot, then SEND the CQE."""
        cmd = req.transport_ctx
        cmd.req = req
        if self.closing:
            self._drop(cmd)
            return
        reply = req.reply
        if reply is None:
            self._respond(cmd)
            return
        n = cmd.nbytes = min(len(reply), req.length)
        if reply is cmd.view and cmd.view is not None:  # read in place: nothing to copy
            self._respond(cmd)
        elif cmd.data is not None and cmd.data.size >= n:
            self._write_slot(cmd, cmd.data)
        else:
            if cmd.data is not None:
                self.data.put(cmd.data)
                cmd.data = None
            self.waiting_bytes += n
            self.data.get(n, lambda slot, cmd=cmd: self._waited_slot(cmd, slot))
            if cmd.data is None:  # no slot now: the reply waits in memory
                self.unsent_total.note(self)

    def _waited_slot(self, cmd: RdmaCommand, slot) -> None:
        self.waiting_bytes -= cmd.nbytes
        self._write_slot(cmd, slot)

    # -- the daemon-wide count of replies waiting (target.limits.UnsentTotal) -------------------

    def unsent(self) -> int:
        return self.waiting_bytes

    def hold_reading(self, held: bool) -> None:
        """Take no new commands while the daemon's waiting replies are past the cap (the host
        can send no more than the receives it has, which are posted again only with responses)."""
        self.deferring = held
        if not held and self.deferred:
            self.loop.call_soon(self._submit_deferred)

    def _submit_deferred(self) -> None:
        self.batching = True
        try:
            while self.deferred and not self.deferring and not self.closing:
                self._command(*self.deferred.popleft())
        finally:
            self.batching = False
            if self.send_out or self.recv_out:
                self.flush()

    def _write_slot(self, cmd: RdmaCommand, slot) -> None:
        if self.closing:
            self.data.put(slot)
            return
        cmd.data = slot
        n = cmd.nbytes
        slot.view[:n] = memoryview(cmd.req.reply)[:n]
        self._respond(cmd)

    def _respond(self, cmd: RdmaCommand) -> None:
        """Send the CQE (after the RDMA WRITE of ``cmd.nbytes`` of read data) once a response
        slot is free."""
        self.resp_wait.append(cmd)
        self.pump_responses()

    def pump_responses(self) -> None:
        """Queue the WRITE (if any) + SEND of every answered command a response slot is free
        for, with its receive's re-post; posted at the batch's end, or at once outside one."""
        pool = self.resp_pool
        wait = self.resp_wait
        sends = self.send_out
        recvs = self.recv_out
        while wait and pool.available and not self.closing:
            cmd = wait.popleft()
            req = cmd.req
            rslot = pool.get()
            i = rslot.index
            rslot.view[:CQE_SIZE] = req.cqe
            cmd.resp = i
            self.resp_cmd[i] = cmd
            write = cmd.nbytes
            if write:
                data = cmd.data
                sends.append(((KIND_WRITE << KIND_SHIFT) | i, WR_RDMA_WRITE, 0, data.addr, write,
                              data.lkey, 0, req.sgl_address, req.sgl_key))
            if req.sgl_id == _SGL_INVALIDATE and req.length:
                sends.append(((KIND_SEND << KIND_SHIFT) | i, WR_SEND_WITH_INV, SEND_SIGNALED, rslot.addr,
                              CQE_SIZE, pool.lkey, req.sgl_key, 0, 0))
            else:
                sends.append(((KIND_SEND << KIND_SHIFT) | i, WR_SEND, SEND_SIGNALED, rslot.addr,
                              CQE_SIZE, pool.lkey, 0, 0, 0))
            # before the response: the host may reuse the slot as soon as it has it
            recvs.append(self.recv_wrs[cmd.recv])
            cmd.recv = -1
        if not self.batching and (sends or recvs):
            self.flush()

    def _send_done(self, idx: int, status: int) -> None:
        cmd = self.resp_cmd[idx]
        if cmd is None:
            return
        self.resp_cmd[idx] = None
        self.resp_pool.put(self.resp_pool.slots[idx])
        self._drop(cmd)
        if status and not self.closing:
            self.wc_failed("SEND", status)
            return
        self.queue.response_sent(cmd.req)
        if self.resp_wait:
            self.pump_responses()

    def _drop(self, cmd: RdmaCommand) -> None:
        """The command is over (answered or abandoned): give back its data slot."""
        self.cmds.discard(cmd)
        cmd.view = None
        if cmd.data is not None:
            slot, cmd.data = cmd.data, None
            if self.closing and not self.destroyed:
                self.held.append(slot)  # maybe still posted: free once the QP is gone
            else:
                self.data.put(slot)

    # -- teardown -------------------------------------------------------------------------------

    def _cm_closed(self, conn) -> None:
        """The CM ended the connection: the host's DREQ, or another terminal CM event."""
        ev = conn.end_event
        if ev == "RDMA_CM_EVENT_DISCONNECTED":
            self.queue.note_teardown("peer disconnect", cm_event=ev)
        else:
            self.queue.note_teardown("CM event", cm_event=ev or "none", cm_status=str(conn.end_status))
        self.close()

    def served_by(self) -> dict[str, Any]:
        """``TargetTransport.served_by``: {} (the RDMA fast path keeps no count of its own)."""
        return {}

    def settle(self) -> bool:
        """``TargetTransport.settle``: False. :meth:`close` detaches the queue at once, so a
        closing connection holds no QID; a host's disconnect not yet handled is a CM event still
        in the channel, which this does not look ahead for."""
        return False

    def close(self) -> None:
        """End the connection (host gone, fatal error, controller shut down)."""
        if self.closing:
            return
        self.queue.note_teardown("local shutdown")
        self.closing = True
        self.held = []
        if self._hello is not None:
            self._hello.cancel()
        self.listener.connections.discard(self)
        self.unsent_total.forget(self)
        self.deferred.clear()
        try:
            self.queue.close()
        except Exception:
            log.exception("queue close failed")
        if self.cm is not None:
            self.cm.disconnect()
        task = self.loop.create_task(self._teardown())
        self.listener.teardowns.add(task)
        task.add_done_callback(self.listener.teardowns.discard)

    async def _teardown(self) -> None:
        try:
            if self.queue.tasks:  # a command still reading into (or writing from) our slots
                _, pending = await asyncio.wait(list(self.queue.tasks), timeout=10)
                if pending:
                    log.warning("commands still executing at teardown", peer=self.peer)
            if self.cm is not None:
                try:
                    await asyncio.wait_for(asyncio.shield(self.cm.closed), 2)
                except asyncio.TimeoutError:
                    pass
        finally:
            self._destroy()

    def _destroy(self) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
        self.cq.detach()
        if self.cm is not None:
            self.cm.close()  # destroys the QP: no more DMA into any of our buffers
        else:
            self.qp.close()
        self.cq.close()
        # writes still waiting for their data (a slot, or RDMA READs) end here, with no response
        # on the closed connection, so they let go of their namespace: a removed one may then
        # close (as the NVMe/TCP transport does for writes waiting for H2CData)
        for cmd in list(self.cmds):
            if cmd.req is not None and self._request(cmd).state is _NEED_DATA:
                self.queue.data_failed(cmd.req)
        # data slots still owned by commands (READ sinks / WRITE sources) are now free
        held, self.held = self.held, []
        for cmd in list(self.cmds):
            if cmd.data is not None:
                held.append(cmd.data)
                cmd.data = None
        # a command the compiled path served stands in resp_cmd as its data slot (False: none)
        # until its SEND completes
        held.extend(e for e in self.resp_cmd if e is not None and e is not False and type(e) is not RdmaCommand)
        self.cmds.clear()
        self.tokens.clear()
        self.resp_cmd[:] = [None] * len(self.resp_cmd)  # in place: the compiled path holds this list
        self.read_wait.clear()
        self.resp_wait.clear()
        self.recv_out.clear()
        self.send_out.clear()
        self.closing = True
        self.destroyed = True
        self.recv_pool.close()
        self.resp_pool.close()
        for slot in held:
            self.data.put(slot)  # also serves other connections' waiters
        if self._admitted is not None:
            self.listener.release(*self._admitted)
            self._admitted = None


def _reject(creq, sts: int) -> None:
    try:
        creq.reject_nvme(sts)
    except Exception:
        log.exception("reject failed")


class RdmaListener:
    """A listening NVMe/RDMA port (one rdma_cm listener per local IP)."""

    def __init__(self, target: Target, port: PortInfo) -> None:
        self.target = target
        self.port = port
        self.channel = None
        self.listeners: list = []
        self.connections: set[RdmaTargetConnection] = set()
        self.teardowns: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        from blockd.rdma.cm import CmEventChannel
        addr = self.port.address
        # a synchronous netlink exchange (blockd.rdma.netdev): keep it off our loop
        local = await asyncio.get_running_loop().run_in_executor(None, netdev.rdma_netdev_addresses)
        wildcard = addr in ("", "0.0.0.0", "::") or ipaddress.ip_address(addr).is_unspecified
        if wildcard:
            addrs = sorted(local)
            if not addrs:
                raise OSError(f"rdma port {self.port.port_id}: no IPv4 address on an RDMA netdev "
                              "(is an rxe link or RDMA NIC up?)")
        else:
            if addr not in local:
                # pyverbs 44 crashes binding an address without an RDMA device: check first
                raise OSError(f"rdma port {self.port.port_id}: {addr} is not on a netdev with an "
                              f"RDMA device (RDMA addresses: {', '.join(sorted(local)) or 'none'})")
            addrs = [addr]
        self.channel = CmEventChannel(asyncio.get_running_loop())
        try:
            for a in addrs:
                self.listeners.append(self.channel.listen(a, int(self.port.service),
                                                          on_request=self._on_request))
        except Exception:
            self.channel.close()
            self.channel = None
            self.listeners = []
            raise
        log.info("listening", transport=INFO.name, address=",".join(addrs), port=self.port.service)

    def _on_request(self, creq) -> None:
        from protocol import rdma_cm as pcm
        nv = creq.nvme
        sts = None
        if nv is None:
            sts = creq.nvme_error.sts
        elif nv.qid > self.target.max_io_queues:
            sts = pcm.STS_INVALID_QID
        elif nv.qid == 0 and nv.hsqsize + 1 > ADMIN_QUEUE_MAX:
            sts = pcm.STS_INVALID_HSQSIZE
        elif nv.hsqsize > MQES:
            sts = pcm.STS_INVALID_HSQSIZE
        elif nv.hrqsize == 0:
            sts = pcm.STS_INVALID_HRQSIZE
        if sts is not None:
            log.warning("rejecting rdma connection", sts=sts,
                        why=pcm.REJECT_STS.get(sts, "?"), request=str(nv))
            _reject(creq, sts)
            return
        peer = creq.peer
        host = peer.rpartition(":")[0]
        recv_bytes = (nv.hsqsize + 1) * (SQE_SIZE + _inline_size(nv.qid))
        if not self._admit(host, recv_bytes, peer, nv.qid):
            _reject(creq, pcm.STS_NO_RESOURCES)  # as nvmet-rdma when it cannot set a queue up
            return
        try:
            conn = RdmaTargetConnection(self, creq, host, recv_bytes)
        except Exception as exc:
            log.exception("cannot accept rdma connection", error=str(exc))
            self.release(host, recv_bytes)
            if not creq.done:
                _reject(creq, pcm.STS_NO_RESOURCES)
            return
        self.connections.add(conn)

    def _admit(self, host: str, recv_bytes: int, peer: str, qid: int) -> bool:
        """Count a new queue against the connection maxima (shared with NVMe/TCP) and the
        daemon's receive-buffer budget, or log why not."""
        target = self.target
        if not target.connections.admit(host):
            log.warning("rejecting rdma connection: too many connections", peer=peer, qid=qid,
                        total=target.connections.total,
                        from_host=target.connections.by_host.get(host, 0))
            return False
        if not target.rdma_recv.try_take(recv_bytes):
            target.connections.release(host)
            target.rejections.add(RDMA_RECV_BUDGET)
            log.warning("rejecting rdma connection: receive buffers would pass rdma_recv_total",
                        peer=peer, qid=qid, need=recv_bytes, used=target.rdma_recv.used,
                        limit=target.rdma_recv.limit)
            return False
        return True

    def release(self, host: str, recv_bytes: int) -> None:
        """A queue :meth:`_admit` counted is gone: its connection and receive buffers are free."""
        self.target.connections.release(host)
        self.target.rdma_recv.give(recv_bytes)

    async def stop(self) -> None:
        for lst in self.listeners:
            lst.close()
        self.listeners = []
        for conn in list(self.connections):
            conn.close()
        if self.teardowns:
            await asyncio.gather(*list(self.teardowns), return_exceptions=True)
        if self.channel is not None:
            self.channel.close()
            self.channel = None
