"""NVMe/TCP transport of the target: one asyncio protocol per TCP connection (= one queue).

It only moves bytes: PDUs in, command capsules and the host's data into the
:class:`TargetQueue` (which drives each command, see :mod:`target.transport`), R2T/C2HData/
CapsuleResp out. Framing errors end the connection with a C2HTermReq; command errors are
completions with an NVMe status, and the other queues carry on.
"""

from __future__ import annotations

import asyncio
import select
import socket
from collections import deque
from typing import Any

import structlog

from blockd.tcp_asyncio import OutputBatcher, PduProtocol
from blockd.tcp_frames import Pdu
from blockd.tcp_pdu import (
    DataDigestError, FramingError, PduReader, PduWriter, data_buffer, data_header, term_req,
)
from protocol.constants import IoOpcode, SglId, TransportType
from protocol.nvme import SQE_SIZE
from protocol.tcp import (
    CAPSULE_RESP_HLEN, COMMON_HEADER, COMMON_HEADER_FAST, COMMON_HEADER_SIZE, DATA_PDU_HEADER, DATA_PDU_HEADER_FAST,
    IC_REQ, IC_REQ_FAST, IC_RESP, PduFlags, PduType, TermReqFes, fei_of,
)
from target import file_send
from target.backend import FileBackend
from target.file_send import PipedRead, ReplyPipe
from target.io_fast import TcpFastPath, TcpUringPath
from target.queue import TargetQueue
from target.rejections import FRAMING, HELLO_TIMEOUT, INCAPSULE_TOO_LARGE, PDU_TIMEOUT, R2T_BUDGET_WAIT
from target.request import Request
from target.target import PortInfo, Target
from target.transport import DEFAULT_MAX_TRANSFER, TransportInfo

log = structlog.get_logger("blockd.target.tcp")

TCP_IO_INLINE = 131072
"""In-capsule data limit on TCP I/O queues: 128 KiB writes then need no R2T round trip
(the Linux target defaults to 16 KiB; hosts honour whatever IOCCSZ says)."""
TCP_ADMIN_INLINE = 8192
INFO = TransportInfo(
    name="tcp", trtype=TransportType.TCP, data_sgl_ids=frozenset({SglId.TRANSPORT_DATA_BLOCK}),
    keyed_sgls=False, admin_inline=TCP_ADMIN_INLINE, io_inline=TCP_IO_INLINE,
    max_transfer=DEFAULT_MAX_TRANSFER, sgls=0x00100001, tsas=bytes(256))
"""SGLS bits 0 (SGLs supported) and 20 (a Data Block's address may be an offset: in-capsule
data); TSAS: none, for NVMe/TCP without TLS."""
MAXH2CDATA = DEFAULT_MAX_TRANSFER
_CAPSULE_SQE = slice(COMMON_HEADER_SIZE, COMMON_HEADER_SIZE + SQE_SIZE)
_H2C_TYPES = frozenset({PduType.IC_REQ, PduType.H2C_TERM_REQ, PduType.CAPSULE_CMD, PduType.H2C_DATA})
_BEFORE_IC = frozenset({PduType.IC_REQ, PduType.H2C_TERM_REQ})
_AFTER_IC = _H2C_TYPES - {PduType.IC_REQ}
_unpack_data_header = DATA_PDU_HEADER_FAST.unpack_from
_CAPSULE_RESP_HEADER = COMMON_HEADER_FAST.pack(PduType.CAPSULE_RESP, 0, CAPSULE_RESP_HLEN, 0, CAPSULE_RESP_HLEN)
"""The CapsuleResp common header without digests: HLEN = PLEN = 24."""
# Bound once: an Enum class attribute lookup costs several times a global's, per PDU.
_CAPSULE_CMD, _H2C_DATA, _C2H_DATA = int(PduType.CAPSULE_CMD), int(PduType.H2C_DATA), int(PduType.C2H_DATA)
_READ = int(IoOpcode.READ)
_LAST_PDU, _SUCCESS_FLAG = int(PduFlags.LAST_PDU), int(PduFlags.SUCCESS)
_TTAG = DATA_PDU_HEADER_FAST.index("ttag")
_IC_PFV, _IC_HPDA, _IC_DGST = (IC_REQ_FAST.index(n) for n in ("pfv", "hpda", "dgst"))
_FEI_PFV, _FEI_HPDA = fei_of(IC_REQ, "pfv"), fei_of(IC_REQ, "hpda")
_FEI_FLAGS, _FEI_TTAG, _FEI_DATAO, _FEI_DATAL = (
    fei_of(DATA_PDU_HEADER, n) for n in ("flags", "ttag", "datao", "datal"))
_FEI_PLEN = fei_of(COMMON_HEADER, "plen")
_HELLO_STAGING = IC_REQ.sizeof()


TERM_LINGER = 2.0
"""Seconds a terminated connection waits for the host to close after its C2HTermReq (see
``TcpTargetConnection.terminate``)."""


class _Discard:
    """Reader and output of a terminated connection: what the host still sends is dropped, and
    so is what commands still running would answer."""

    completed = 0
    _scratch = memoryview(bytearray(4096))

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._scratch

    def buffer_updated(self, nbytes: int) -> tuple[()]:
        return ()

    def in_pdu(self) -> bool:
        return False

    def send(self, bufs: list[bytes | memoryview]) -> None:
        pass

    def take(self) -> list[bytes | memoryview]:
        return []

    def hold(self) -> None:
        pass

    release = flush = hold


_DISCARD = _Discard()


class TcpTargetConnection(PduProtocol):
    """One NVMe/TCP connection; becomes an admin or I/O queue at Connect.

    Received data lands where it belongs: in-capsule data in a buffer of the command's own,
    H2CData in the write's request buffer (see :class:`PduReader`).

    What a host can make it hold is bounded (issue 12, limits in :class:`target.config.Limits`):
    nothing but the header staging before ICReq, in-capsule data only up to the queue's size,
    write buffers only for R2Ts sent within a per-queue and a global budget, and replies the
    host does not read only up to ``max_unsent`` (and while all queues' together stay within
    ``max_unsent_total``), after which the socket is not read."""

    info = INFO

    def __init__(self, target: Target, port: PortInfo) -> None:
        self.target = target
        self.port = port
        # until ICReq only an ICReq (or H2CTermReq) may come: staging for that, not 64 KiB per
        # connection that never said hello (grown in _icreq)
        self.reader = PduReader(_H2C_TYPES, max_data=INFO.max_transfer, place=self._place, staging=_HELLO_STAGING)
        self.writer = PduWriter()
        self.transport: asyncio.Transport | None = None
        self.out: OutputBatcher | _Discard | None = None
        self.queue: TargetQueue | None = None
        self.fast = (None if TcpFastPath is None else
                     TcpUringPath(self, INFO.max_transfer, target.sqpoll_idle_ms, target.spin_us)
                     if target.io_uring_queues else TcpFastPath(self, INFO.max_transfer))
        """The compiled Read/Write path (:mod:`target.io_fast`): it answers the capsules it can,
        the queue takes the rest; None in pure mode. Its queue thread on io_uring when the
        target says so (``Target.io_uring_queues``)."""
        if self.fast is not None:
            # the event loop calls the compiled receive loop itself (these shadow PduProtocol's):
            # no Python frame, generator or Pdu per served command (docs/dataplane.md)
            self.get_buffer = self.fast.get_buffer  # type: ignore[method-assign]
            self.buffer_updated = self.fast.buffer_updated  # type: ignore[method-assign]
        self.r2t_pending: dict[int, tuple[Request, int]] = {}
        """Writes whose R2T was sent, by transfer tag: the request and the bytes received (the
        compiled path's own R2Ts hold an ``R2tWrite`` in place of the request)."""
        self.next_ttag = 0
        self.local_address = ""
        self.limits = target.limits
        self.host = ""
        self.paused = False
        """Replies the host has not read passed ``max_unsent`` (``_stopped_by_queue``), or all
        queues' passed ``max_unsent_total`` (``_stopped_by_total``): the socket is not read, and
        commands already received wait in the reader until the replies drain."""
        self._stopped_by_queue = False
        self._stopped_by_total = False
        self.batched = 0
        """Read data queued in the output batch since it last went to the socket."""
        self.flush_at = self.limits.max_unsent // 4
        self._unsent = target.unsent
        self.r2t_waiting: deque[Request] = deque()
        """Writes whose R2T waits for budget, in arrival order."""
        self.r2t_held = 0
        """Bytes of write buffers this queue holds (for R2Ts sent)."""
        self.sock = -1
        """The socket's descriptor, for reads sent by reference (-1: none; e.g. not a socket)."""
        self.pipe: ReplyPipe | None = None
        """The pipe of reads sent by reference (:mod:`target.file_send`), made at the first."""
        self._timer: asyncio.TimerHandle | None = None
        self._released = False
        """``connection_lost``'s work is done (by :meth:`settle`, before asyncio calls it)."""
        self._seen = -1
        """``reader.completed`` at the last PDU-timeout tick if a PDU was in progress, else -1."""

    # -- asyncio callbacks ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        host = peer[0] if peer else ""
        if not self.target.connections.admit(host):
            log.warning("connection refused: too many connections", peer=host,
                        total=self.target.connections.total)
            transport.close()
            return
        self.host = host
        # what a write leaves unsent counts against the daemon-wide max_unsent_total
        self.out = OutputBatcher(self.transport, on_backlog=self._note_unsent)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock = sock.fileno()
        # pause_writing once this much waits to be sent; resume_writing once below a quarter of it
        self.transport.set_write_buffer_limits(high=self.limits.max_unsent)
        self.reader.allowed = _BEFORE_IC
        local = transport.get_extra_info("sockname")
        self.local_address = local[0] if local else ""
        self.queue = TargetQueue(self.target, self, self.port.port_id,
                                 peer=f"{peer[0]}:{peer[1]}" if peer else "",
                                 local_address=self.local_address)
        self._timer = asyncio.get_running_loop().call_later(self.limits.hello_timeout, self._hello_expired)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.queue is None or self._released:  # refused at accept, or settled already
            return
        self._released = True
        if self.fast is not None:
            self.fast.stop_thread()
        if exc is None:
            self.queue.note_teardown("peer disconnect")
        else:
            self.queue.note_teardown("connection error", error=str(exc))
        self.target.connections.release(self.host)
        self.target.unsent.forget(self)
        self._timer.cancel()
        # writes still waiting for their H2CData end here (no response goes out on a closed
        # transport), so they let go of their namespace: a removed one may then close
        pending = [req for req, _ in self.r2t_pending.values()]
        pending += self.r2t_waiting
        self.r2t_pending.clear()
        self.r2t_waiting.clear()
        for req in pending:
            self._data_failed(req)
        if self.out is not _DISCARD:  # else terminate closed the queue already
            self.queue.close()
        budget = self.target.r2t_budget
        budget.forget(self.send_r2ts)
        if self.r2t_held:
            budget.give(self.r2t_held)
            self.r2t_held = 0
        if self.pipe is not None:
            self.pipe.close()
            self.pipe = None

    def pause_writing(self) -> None:
        """The host does not read its replies fast enough: read no more commands from it."""
        self._stopped_by_queue = True
        self._set_paused()

    def resume_writing(self) -> None:
        """The replies drained: take the commands that waited in the reader, then read again."""
        self._stopped_by_queue = False
        self._set_paused()

    def _note_unsent(self) -> None:
        self._unsent.note(self)

    def unsent(self) -> int:
        """Replies handed to the socket and not sent yet (for :class:`UnsentTotal`)."""
        return self.transport.get_write_buffer_size()

    def hold_reading(self, held: bool) -> None:
        """All queues' unsent replies passed ``max_unsent_total`` (or fell back below it)."""
        self._stopped_by_total = held
        self._set_paused()

    def _set_paused(self) -> None:
        paused = self._stopped_by_queue or self._stopped_by_total
        if paused == self.paused:
            return
        self.paused = paused
        if paused:
            self.transport.pause_reading()
        elif not self.transport.is_closing() and not (self.fast is not None and self.fast.threaded):
            # (a queue's thread sees the pause itself and hands back; its return reads again)
            self.transport.resume_reading()
            asyncio.get_running_loop().call_soon(self._take_waiting)

    def _take_waiting(self) -> None:
        """The commands the reader kept while paused (none run once the connection closes)."""
        if not self.transport.is_closing() and not self.paused:
            self.buffer_updated(0)

    # -- timeouts ---------------------------------------------------------------------------------

    def _hello_expired(self) -> None:
        """The hello deadline: a connection not yet connected (ICReq and Connect) is closed; a
        connected one is watched for stuck PDUs from now on."""
        if self.queue.controller is None:
            self.target.rejections.add(HELLO_TIMEOUT)
            self.queue.note_teardown("no ICReq and Connect in time", timeout=str(self.limits.hello_timeout))
            self.close()
            return
        self._pdu_tick()

    def _pdu_tick(self) -> None:
        """Close the connection when the same PDU has been arriving for a whole period (a host
        that stopped mid-PDU, or sends a byte now and then); not while we stopped reading."""
        completed = self.reader.completed
        in_pdu = not self.paused and self.reader.in_pdu()
        if in_pdu and completed == self._seen:  # mid-PDU at the last tick too, none completed since
            self.target.rejections.add(PDU_TIMEOUT)
            self.queue.note_teardown("stuck in the middle of a PDU", timeout=str(self.limits.pdu_timeout))
            self.close()
            return
        self._seen = completed if in_pdu else -1
        self._timer = asyncio.get_running_loop().call_later(self.limits.pdu_timeout, self._pdu_tick)

    def _receive(self, nbytes: int) -> None:
        """The reference receive loop; with the compiled plane ``TcpFastPath.buffer_updated``
        runs the same loop in C (and calls ``take_pdu`` for every PDU it does not serve itself)."""
        while True:
            try:
                for pdu in self.reader.buffer_updated(nbytes):
                    if not self.take_pdu(pdu):
                        return
                return
            except FramingError as exc:
                self.terminate(exc)
                return
            except DataDigestError as exc:
                self.digest_error(exc)
                if self.transport.is_closing():
                    return
                nbytes = 0  # the reader skipped the bad PDU; go on with what follows it

    def take_pdu(self, pdu: Pdu) -> bool:
        """Handle one PDU from the reader; False: take no more now (the connection paused, the
        rest stays in the reader until resume_writing; or it ends)."""
        ptype = pdu.pdu_type
        # the reader lets through only the types the state allows (reader.allowed)
        if ptype == _CAPSULE_CMD:
            fast = self.fast
            if fast is None or not fast.submit(pdu.header, pdu.data):
                self.queue.submit(pdu.header[_CAPSULE_SQE], pdu.data)
            return not self.paused
        if ptype == _H2C_DATA:
            self._h2c_data(pdu.header, pdu.flags)
        elif ptype == PduType.IC_REQ:
            self._icreq(pdu.header)
        else:  # H2CTermReq
            self.queue.note_teardown("peer terminated (H2CTermReq)")
            self.close()
            return False
        return True

    # -- PDUs from the host ---------------------------------------------------------------------

    def _icreq(self, header: memoryview) -> None:
        icreq = bytes(header)
        fields = IC_REQ_FAST.unpack_from(icreq)
        pfv, hpda, dgst = fields[_IC_PFV], fields[_IC_HPDA], fields[_IC_DGST]
        if pfv != 0:
            raise FramingError(TermReqFes.INVALID_HEADER_FIELD, _FEI_PFV, f"unsupported PFV {pfv}", icreq)
        if hpda != 0:
            raise FramingError(TermReqFes.INVALID_HEADER_FIELD, _FEI_HPDA, f"unsupported HPDA {hpda}", icreq)
        self.reader.hdgst = self.writer.hdgst = bool(dgst & 1)
        self.reader.ddgst = self.writer.ddgst = bool(dgst & 2)
        self.reader.allowed = _AFTER_IC
        self.reader.grow_staging()
        self.transport.write(IC_RESP.build(dict(
            pdu_type=PduType.IC_RESP, flags=0, hlen=128, pdo=0, plen=128, pfv=0, cpda=0,
            dgst=dgst & 3, maxh2cdata=MAXH2CDATA)))

    def fetch_data(self, req: Request) -> None:
        """Ask for the write's data with one R2T once the budgets have room for its buffer;
        ``_place`` puts the H2CData in ``req.data``."""
        self.r2t_waiting.append(req)
        self.send_r2ts()
        if self.r2t_waiting:  # this write (the last in line) waits for budget
            self.target.rejections.add(R2T_BUDGET_WAIT)

    def send_r2ts(self) -> None:
        """Send the R2Ts of waiting writes, oldest first, while this queue's budget and the
        daemon's have room for their buffers (called again when either frees some)."""
        waiting = self.r2t_waiting
        per_queue = self.limits.r2t_budget
        while waiting and not self.transport.is_closing():
            req = waiting[0]
            length = req.length
            if self.r2t_held + length > per_queue or not self.target.r2t_budget.take(length, self.send_r2ts):
                return
            waiting.popleft()
            self.r2t_held += length
            req.transport_ctx = length  # given back in queue_response
            ttag = self.next_ttag
            self.next_ttag = (ttag + 1) & 0xFFFF
            self.r2t_pending[ttag] = (req, 0)
            req.data = data_buffer(length)
            self.out.send(self.writer.r2t(req.cid, ttag, 0, length))

    def _place(self, ptype: int, header: memoryview, length: int) -> memoryview:
        """Where a PDU's data goes: a new buffer for in-capsule data (no more than the queue
        takes), the request's own buffer (at the offset the host says, checked against what the
        R2T asked for) for H2CData. Checked once the header is in, before anything is allocated."""
        if ptype == _CAPSULE_CMD:
            if length > self.queue.inline_size:
                self.target.rejections.add(INCAPSULE_TOO_LARGE)
                raise FramingError(TermReqFes.DATA_OUT_OF_RANGE, _FEI_PLEN,
                                   f"{length} bytes of in-capsule data, more than {self.queue.inline_size}",
                                   bytes(header))
            return memoryview(data_buffer(length))
        _, _, _, _, _, cccid, ttag, datao, datal = _unpack_data_header(header)
        entry = self.r2t_pending.get(ttag)
        if entry is None or entry[0].cid != cccid:
            raise FramingError(TermReqFes.INVALID_HEADER_FIELD, _FEI_TTAG, f"H2CData for unknown tag {ttag}", bytes(header))
        req, received = entry
        if datal != length:
            raise FramingError(TermReqFes.INVALID_HEADER_FIELD, _FEI_DATAL, "DATAL does not match the PDU", bytes(header))
        if datao != received or datao + datal > req.length:
            raise FramingError(TermReqFes.DATA_OUT_OF_RANGE, _FEI_DATAO, "H2CData outside the requested range", bytes(header))
        return memoryview(req.data)[datao:datao + datal]

    def _h2c_data(self, header: memoryview, flags: int) -> None:
        """H2CData whose data ``_place`` already put in the request's buffer."""
        _, _, _, _, _, _, ttag, _, datal = _unpack_data_header(header)
        req, received = self.r2t_pending[ttag]
        received += datal
        if received < req.length:
            self.r2t_pending[ttag] = (req, received)
            return
        if not flags & PduFlags.LAST_PDU:
            raise FramingError(TermReqFes.INVALID_HEADER_FIELD, _FEI_FLAGS, "last H2CData without LAST_PDU", bytes(header))
        del self.r2t_pending[ttag]
        fast = self.fast
        if fast is None or not fast.data_ready(req):  # the compiled path writes and answers what it can
            self.queue.data_ready(req)

    def _data_failed(self, req: Request) -> None:
        """A write's data will not come: it fails (an R2T the compiled path sent is its
        ``R2tWrite`` until then, handed over as the queue's request)."""
        self.queue.data_failed(req if self.fast is None else self.fast.request(req))

    def digest_error(self, exc: DataDigestError) -> None:
        """A corrupt data PDU fails its command with Data Transfer Error (docs/wire-facts.md,
        "Digests")."""
        header = exc.header
        if exc.pdu_type == PduType.H2C_DATA:
            entry = self.r2t_pending.pop(_unpack_data_header(header)[_TTAG], None)
            if entry is not None:
                self._data_failed(entry[0])
                return
        elif exc.pdu_type == PduType.CAPSULE_CMD:
            self.queue.capsule_data_failed(header[_CAPSULE_SQE])
            return
        self.terminate(FramingError(TermReqFes.HEADER_DIGEST_ERROR, 0, "data digest error", header))

    # -- replies ----------------------------------------------------------------------------------

    def read_buffer(self, req: Request) -> PipedRead | None:
        """Where a command on this I/O queue that returns data reads it: the connection's pipe
        for a Read sent by reference (:mod:`target.file_send`), else None (a buffer of its own).

        The one place the Python path decides: a Read of at least ``file_send.BY_REFERENCE_MIN``
        bytes from a plain :class:`FileBackend` (a filter or replication keeps its own read), no
        digests, a socket, and a pipe that can hold it."""
        ns = req.ns
        length = req.length
        if (length < file_send.BY_REFERENCE_MIN or req.opcode != _READ or ns is None
                or type(ns.backend) is not FileBackend or self.sock < 0 or self.writer.hdgst or self.writer.ddgst):
            return None
        pipe = self.reply_pipe()
        if not pipe.room_for(length):
            return None
        flags = _LAST_PDU | (_SUCCESS_FLAG if self.queue.sqhd_disabled else 0)
        return PipedRead(pipe, data_header(_C2H_DATA, req.cid, 0, 0, length, flags), length)

    def reply_pipe(self) -> ReplyPipe:
        """The connection's pipe for reads by reference (both twins use it)."""
        if self.pipe is None:
            self.pipe = ReplyPipe()
        return self.pipe

    def queue_response(self, req: Request) -> None:
        """C2HData with the read's data if any, then the CapsuleResp."""
        if self.transport.is_closing():
            return  # connection_lost gives back any write buffer (and the pipe's next fill empties it)
        held = req.transport_ctx
        if held:  # a write's buffer is free again
            self.r2t_held -= held
            self.target.r2t_budget.give(held)
            if self.r2t_waiting:
                self.send_r2ts()
        queue = self.queue
        reply = req.reply
        if type(reply) is PipedRead:  # the header and data are in the pipe (the flags set in read_buffer)
            tail = None if queue.sqhd_disabled else _CAPSULE_RESP_HEADER + req.cqe
            if reply.pipe.drain(self.out, self.transport, self.sock, tail):
                self.batched = 0
                self.out.flush()  # what the socket did not take: to the transport now (its backlog shows)
            queue.response_sent(req)
            return
        if reply is not None:
            # without SQ flow control the data PDU completes the command (as Linux's nvmet-tcp)
            success = PduFlags.SUCCESS if queue.sqhd_disabled else 0
            self.out.send(self.writer.data_pdu(_C2H_DATA, req.cid, 0, 0, req.reply, PduFlags.LAST_PDU | success))
            self.batched += req.length
            if self.batched > self.flush_at or self._unsent.over:
                # to the socket now, so that a host not reading shows (pause_writing, or the
                # daemon-wide count) before the rest of this receive's commands pile up more replies
                self.batched = 0
                self.out.flush()
            if success:
                queue.response_sent(req)
                return
        if self.writer.hdgst:
            self.out.send(self.writer.pdu(PduType.CAPSULE_RESP, req.cqe))
        else:
            self.out.send([_CAPSULE_RESP_HEADER + req.cqe])
        queue.response_sent(req)

    def terminate(self, exc: FramingError) -> None:
        """Send the C2HTermReq, then close: after a FIN, reading and dropping what the host still
        sends for up to ``TERM_LINGER`` seconds. Closing a socket with unread bytes sends a reset,
        and a reset makes the host's kernel drop the C2HTermReq it has not read yet; before ICReq
        the reader takes no more than an ICReq, so a host sending anything else has bytes unread."""
        self.target.rejections.add(FRAMING[exc.fes])
        self.queue.note_teardown("framing error", fes=str(exc.fes), fei=str(exc.fei), error=str(exc))
        self.out.send([term_req(PduType.C2H_TERM_REQ, exc.fes, exc.fei, exc.header)])
        self.out.flush()
        transport = self.transport
        if transport.is_closing() or transport.get_write_buffer_size() or self.paused:
            self.close()  # the host does not read: it will not see the C2HTermReq either way
            return
        self.reader = _DISCARD
        self.out = _DISCARD  # nothing may be written after the FIN
        transport.write_eof()
        # the queue ends now, not when the socket does: its QID is free for the host's next
        # connection at once, as when the target closed without waiting
        self.queue.close()
        self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(TERM_LINGER, self.close)

    def served_by(self) -> dict[str, Any]:
        """``TargetTransport.served_by``: the compiled path's count, its thread's and, on
        io_uring, the ring's with its ``io_uring_enter`` calls (or why this queue has no ring)."""
        fast = self.fast
        if fast is None:
            return {}
        out: dict[str, Any] = {"compiled": fast.served, "thread": fast.thread_served}
        if TcpUringPath is not None and isinstance(fast, TcpUringPath):
            out.update(io_uring=fast.ring_served, io_uring_enters=fast.ring_enters,
                       io_uring_undone=fast.ring_undone, io_uring_probes_refused=fast.ring_probes_refused)
            if fast.ring_reason:
                out["io_uring_refused"] = fast.ring_reason
        return out

    def settle(self) -> bool:
        """``TargetTransport.settle``: a connection the host has closed (or reset) or that is
        closing is released now, with what ``connection_lost`` does (which then does nothing).

        Without this, a host that closes an I/O queue and at once connects a new one with the
        same QID could get Command Sequence Error: the old connection's end of stream reaches
        the core only after the loop has read it and asyncio has called ``connection_lost``, and
        the new Connect can come first when the end is read in the same loop round after it, or
        when the queue's thread (``TcpFastPath._run``) has seen it but waits for the GIL. The
        socket says whether the host is gone without reading it: ``poll`` with ``POLLRDHUP``
        (the host's FIN, even behind commands not read yet; ``POLLHUP``/``POLLERR`` for a reset)."""
        if self._released or self.transport is None:
            return False
        if not self.transport.is_closing():  # (once closing, the socket's number may be closed)
            if not self._peer_ended():
                return False
            self.queue.note_teardown("peer disconnect")
            self.close()  # ends the queue's thread first (it joins: the thread needs only the GIL)
        self.connection_lost(None)
        return True

    def _peer_ended(self) -> bool:
        """The host has shut down its side of the socket, or the socket failed."""
        if self.sock < 0:
            return False
        poller = select.poll()
        poller.register(self.sock, select.POLLRDHUP)
        return bool(poller.poll(0))

    def close(self) -> None:
        """Send what is queued, then close."""
        if self.transport is not None and not self.transport.is_closing():
            if self.queue is not None:
                self.queue.note_teardown("local shutdown")
            if self.fast is not None:
                self.fast.stop_thread()  # before the namespaces it may be using can close
            self.out.flush()
            self.transport.close()


class TcpListener:
    """A listening NVMe/TCP port."""

    def __init__(self, target: Target, port: PortInfo) -> None:
        self.target = target
        self.port = port
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(
            lambda: TcpTargetConnection(self.target, self.port),
            self.port.address, int(self.port.service), reuse_address=True)
        log.info("listening", transport=INFO.name, address=self.port.address, port=self.port.service)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
