"""NVMe/TCP transport of the target: one asyncio protocol per TCP connection (= one queue).

It only moves bytes: PDUs in, SQEs and data into the :class:`TargetQueue`, R2T/C2HData/
CapsuleResp out. Framing errors end the connection with a C2HTermReq; command errors are
completions with an NVMe status, and the other queues carry on.
"""

from __future__ import annotations

import asyncio
import socket

import structlog

from blockd import eager
from blockd.tcp_asyncio import OutputBatcher, PduProtocol
from blockd.tcp_pdu import (
    DataDigestError, FramingError, PduReader, PduWriter, term_req,
)
from protocol.tcp import (
    IC_RESP, DATA_PDU_HEADER_FAST, PduFlags, PduType, TermReqFes,
)
from target.queue import MAX_TRANSFER, TargetQueue
from target.request import Request, RequestState
from target.target import TCP_ADMIN_INLINE, PortInfo, Target

log = structlog.get_logger("blockd.target.tcp")

MAXH2CDATA = MAX_TRANSFER
_H2C_TYPES = frozenset({PduType.IC_REQ, PduType.H2C_TERM_REQ, PduType.CAPSULE_CMD, PduType.H2C_DATA})
_unpack_data_header = DATA_PDU_HEADER_FAST.unpack_from
_CAPSULE_RESP_HEADER = bytes([PduType.CAPSULE_RESP, 0, 24, 0, 24, 0, 0, 0])
# Bound once: an Enum class attribute lookup costs several times a global's, per PDU.
_CAPSULE_CMD, _H2C_DATA, _C2H_DATA = int(PduType.CAPSULE_CMD), int(PduType.H2C_DATA), int(PduType.C2H_DATA)
_EXECUTING, _NEED_DATA = RequestState.EXECUTING, RequestState.NEED_DATA
_SENDING_DATA = RequestState.SENDING_DATA


class TcpTargetConnection(PduProtocol):
    """One NVMe/TCP connection; becomes an admin or I/O queue at Connect.

    Received data lands where it belongs: in-capsule data in a buffer of the command's own,
    H2CData in the write's request buffer (see :class:`PduReader`)."""

    def __init__(self, target: Target, port: PortInfo, tasks: set[asyncio.Task[None]]) -> None:
        self.target = target
        self.port = port
        self.tasks = tasks
        self.reader = PduReader(_H2C_TYPES, max_data=MAX_TRANSFER, place=self._place)
        self.writer = PduWriter()
        self.transport: asyncio.Transport | None = None
        self.out: OutputBatcher | None = None
        self.queue: TargetQueue | None = None
        self.initialized = False
        self.r2t_pending: dict[int, tuple[Request, int]] = {}
        self._next_ttag = 0
        self.local_address = ""

    # -- asyncio callbacks ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.out = OutputBatcher(self.transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = transport.get_extra_info("peername")
        local = transport.get_extra_info("sockname")
        self.local_address = local[0] if local else ""
        self.queue = TargetQueue(self.target, "tcp", self.port.port_id, TCP_ADMIN_INLINE,
                                 self.close, peer=f"{peer[0]}:{peer[1]}" if peer else "",
                                 local_address=self.local_address)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.queue is not None:
            self.queue.close()
        self.r2t_pending.clear()

    def _receive(self, nbytes: int) -> None:
        while True:
            try:
                for pdu in self.reader.buffer_updated(nbytes):
                    ptype = pdu.pdu_type
                    if ptype == _CAPSULE_CMD and self.initialized:
                        self._capsule(pdu.header, pdu.data)
                    elif ptype == _H2C_DATA and self.initialized and pdu.placed:
                        self._h2c_data(pdu.header, pdu.flags)
                    elif ptype == PduType.IC_REQ and not self.initialized:
                        self._icreq(pdu.header)
                    elif ptype == PduType.H2C_TERM_REQ:
                        log.info("host terminated the connection", peer=self.queue.peer)
                        self.close()
                        return
                    else:
                        raise FramingError(TermReqFes.PDU_SEQUENCE_ERROR, 0,
                                           f"PDU type {ptype:#x} out of sequence", bytes(pdu.header))
                return
            except FramingError as exc:
                self._terminate(exc)
                return
            except DataDigestError as exc:
                self._digest_error(exc)
                if self.transport.is_closing():
                    return
                nbytes = 0  # the reader skipped the bad PDU; go on with what follows it

    # -- PDUs from the host ---------------------------------------------------------------------

    def _icreq(self, header: memoryview) -> None:
        icreq = bytes(header)
        pfv = int.from_bytes(icreq[8:10], "little")
        hpda, dgst = icreq[10], icreq[11]
        if pfv != 0:
            raise FramingError(TermReqFes.INVALID_HEADER_FIELD, 8, f"unsupported PFV {pfv}", icreq)
        if hpda != 0:
            raise FramingError(TermReqFes.INVALID_HEADER_FIELD, 10, f"unsupported HPDA {hpda}", icreq)
        self.reader.hdgst = self.writer.hdgst = bool(dgst & 1)
        self.reader.ddgst = self.writer.ddgst = bool(dgst & 2)
        self.initialized = True
        self.transport.write(IC_RESP.build(dict(
            pdu_type=PduType.IC_RESP, flags=0, hlen=128, pdo=0, plen=128, pfv=0, cpda=0,
            dgst=dgst & 3, maxh2cdata=MAXH2CDATA)))

    def _capsule(self, header: memoryview, data: memoryview | None) -> None:
        queue = self.queue
        req = queue.submit(header[8:72], data)
        state = req.state
        if state is _EXECUTING:
            self._start(req)
        elif state is _NEED_DATA:
            ttag = self._next_ttag
            self._next_ttag = (ttag + 1) & 0xFFFF
            self.r2t_pending[ttag] = (req, 0)
            req.data = bytearray(req.length)  # where _place puts the host's H2CData
            self.out.send(self.writer.r2t(req.cid, ttag, 0, req.length))
        else:
            self._respond(req)

    def _place(self, ptype: int, header: memoryview, length: int) -> memoryview | None:
        """Where a PDU's data goes: a new buffer for in-capsule data, the request's own buffer
        (at the offset the host says, checked against what the R2T asked for) for H2CData."""
        if ptype == _CAPSULE_CMD:
            return memoryview(bytearray(length))
        if ptype != _H2C_DATA or not self.initialized:
            return None
        _, _, _, _, _, cccid, ttag, datao, datal = _unpack_data_header(header)
        entry = self.r2t_pending.get(ttag)
        if entry is None or entry[0].cid != cccid:
            raise FramingError(TermReqFes.INVALID_HEADER_FIELD, 10, f"H2CData for unknown tag {ttag}", bytes(header))
        req, received = entry
        if datal != length:
            raise FramingError(TermReqFes.INVALID_HEADER_FIELD, 16, "DATAL does not match the PDU", bytes(header))
        if datao != received or datao + datal > req.length:
            raise FramingError(TermReqFes.DATA_OUT_OF_RANGE, 12, "H2CData outside the requested range", bytes(header))
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
            raise FramingError(TermReqFes.INVALID_HEADER_FIELD, 1, "last H2CData without LAST_PDU", bytes(header))
        del self.r2t_pending[ttag]
        self.queue.data_received(req)
        self._start(req)

    def _digest_error(self, exc: DataDigestError) -> None:
        """A corrupt data PDU fails its command with Data Transfer Error (spec 7.4.6)."""
        header = exc.header
        if exc.pdu_type == PduType.H2C_DATA:
            ttag = int.from_bytes(header[10:12], "little")
            entry = self.r2t_pending.pop(ttag, None)
            if entry is not None:
                self.queue.data_failed(entry[0])
                self._respond(entry[0])
                return
        elif exc.pdu_type == PduType.CAPSULE_CMD:
            req = self.queue.submit(header[8:72])
            req.fail(0x004)
            self._respond(req)
            return
        self._terminate(FramingError(TermReqFes.HEADER_DIGEST_ERROR, 0, "data digest error", header))

    # -- execution and replies ------------------------------------------------------------------

    def _start(self, req: Request) -> None:
        task = eager.start(self._execute(req))
        if task is not None:  # it waits (an fsync, a slow backend): track it for shutdown
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _execute(self, req: Request) -> None:
        queue = self.queue
        await queue.execute(req)
        if self.transport.is_closing():
            return
        if req.state is _SENDING_DATA:
            # without SQ flow control the data PDU completes the command (as Linux's nvmet-tcp)
            success = PduFlags.SUCCESS if queue.sqhd_disabled else 0
            self.out.send(self.writer.data_pdu(_C2H_DATA, req.cid, 0, 0, req.data, PduFlags.LAST_PDU | success))
            queue.data_sent(req)
            if success:
                queue.completion(req)
                return
        self._respond(req)

    def _respond(self, req: Request) -> None:
        cqe = self.queue.completion(req)
        if self.transport.is_closing():
            return
        if self.writer.hdgst:
            self.out.send(self.writer.pdu(PduType.CAPSULE_RESP, cqe))
        else:
            self.out.send([_CAPSULE_RESP_HEADER + cqe])

    def _terminate(self, exc: FramingError) -> None:
        log.warning("closing connection after a framing error", peer=self.queue.peer,
                    fes=exc.fes, fei=exc.fei, error=str(exc))
        self.out.send([term_req(PduType.C2H_TERM_REQ, exc.fes, exc.fei, exc.header)])
        self.close()

    def close(self) -> None:
        """Send what is queued, then close."""
        if self.transport is not None and not self.transport.is_closing():
            self.out.flush()
            self.transport.close()


class TcpListener:
    """A listening NVMe/TCP port."""

    def __init__(self, target: Target, port: PortInfo, tasks: set[asyncio.Task[None]]) -> None:
        self.target = target
        self.port = port
        self.tasks = tasks
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(
            lambda: TcpTargetConnection(self.target, self.port, self.tasks),
            self.port.address, int(self.port.service), reuse_address=True)
        log.info("listening", transport="tcp", address=self.port.address, port=self.port.service)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
