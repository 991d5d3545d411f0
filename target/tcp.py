"""NVMe/TCP transport of the target: one asyncio protocol per TCP connection (= one queue).

It only moves bytes: PDUs in, command capsules and the host's data into the
:class:`TargetQueue` (which drives each command, see :mod:`target.transport`), R2T/C2HData/
CapsuleResp out. Framing errors end the connection with a C2HTermReq; command errors are
completions with an NVMe status, and the other queues carry on.
"""

from __future__ import annotations

import asyncio
import socket

import structlog

from blockd.tcp_pdu import (
    DataDigestError, FramingError, OutputBatcher, PduProtocol, PduReader, PduWriter, term_req,
)
from protocol.constants import SglId, TransportType
from protocol.nvme import SQE_SIZE
from protocol.tcp import (
    CAPSULE_RESP_HLEN, COMMON_HEADER_FAST, COMMON_HEADER_SIZE, DATA_PDU_HEADER, DATA_PDU_HEADER_FAST,
    IC_REQ, IC_REQ_FAST, IC_RESP, PduFlags, PduType, TermReqFes, fei_of,
)
from target.queue import TargetQueue
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
_unpack_data_header = DATA_PDU_HEADER_FAST.unpack_from
_CAPSULE_RESP_HEADER = COMMON_HEADER_FAST.pack(PduType.CAPSULE_RESP, 0, CAPSULE_RESP_HLEN, 0, CAPSULE_RESP_HLEN)
"""The CapsuleResp common header without digests: HLEN = PLEN = 24."""
# Bound once: an Enum class attribute lookup costs several times a global's, per PDU.
_CAPSULE_CMD, _H2C_DATA, _C2H_DATA = int(PduType.CAPSULE_CMD), int(PduType.H2C_DATA), int(PduType.C2H_DATA)
_TTAG = DATA_PDU_HEADER_FAST.index("ttag")
_IC_PFV, _IC_HPDA, _IC_DGST = (IC_REQ_FAST.index(n) for n in ("pfv", "hpda", "dgst"))
_FEI_PFV, _FEI_HPDA = fei_of(IC_REQ, "pfv"), fei_of(IC_REQ, "hpda")
_FEI_FLAGS, _FEI_TTAG, _FEI_DATAO, _FEI_DATAL = (
    fei_of(DATA_PDU_HEADER, n) for n in ("flags", "ttag", "datao", "datal"))


class TcpTargetConnection(PduProtocol):
    """One NVMe/TCP connection; becomes an admin or I/O queue at Connect.

    Received data lands where it belongs: in-capsule data in a buffer of the command's own,
    H2CData in the write's request buffer (see :class:`PduReader`)."""

    info = INFO
    read_buffer = None
    """C2HData is sent from whatever buffer the read used."""

    def __init__(self, target: Target, port: PortInfo) -> None:
        self.target = target
        self.port = port
        self.reader = PduReader(_H2C_TYPES, max_data=INFO.max_transfer, place=self._place)
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
        self.queue = TargetQueue(self.target, self, self.port.port_id,
                                 peer=f"{peer[0]}:{peer[1]}" if peer else "",
                                 local_address=self.local_address)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.queue is not None:
            if exc is None:
                self.queue.note_teardown("peer disconnect")
            else:
                self.queue.note_teardown("connection error", error=str(exc))
            self.queue.close()
        self.r2t_pending.clear()

    def _receive(self, nbytes: int) -> None:
        while True:
            try:
                for pdu in self.reader.buffer_updated(nbytes):
                    ptype = pdu.pdu_type
                    if ptype == _CAPSULE_CMD and self.initialized:
                        self.queue.submit(pdu.header[_CAPSULE_SQE], pdu.data)
                    elif ptype == _H2C_DATA and self.initialized and pdu.placed:
                        self._h2c_data(pdu.header, pdu.flags)
                    elif ptype == PduType.IC_REQ and not self.initialized:
                        self._icreq(pdu.header)
                    elif ptype == PduType.H2C_TERM_REQ:
                        self.queue.note_teardown("peer terminated (H2CTermReq)")
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
        fields = IC_REQ_FAST.unpack_from(icreq)
        pfv, hpda, dgst = fields[_IC_PFV], fields[_IC_HPDA], fields[_IC_DGST]
        if pfv != 0:
            raise FramingError(TermReqFes.INVALID_HEADER_FIELD, _FEI_PFV, f"unsupported PFV {pfv}", icreq)
        if hpda != 0:
            raise FramingError(TermReqFes.INVALID_HEADER_FIELD, _FEI_HPDA, f"unsupported HPDA {hpda}", icreq)
        self.reader.hdgst = self.writer.hdgst = bool(dgst & 1)
        self.reader.ddgst = self.writer.ddgst = bool(dgst & 2)
        self.initialized = True
        self.transport.write(IC_RESP.build(dict(
            pdu_type=PduType.IC_RESP, flags=0, hlen=128, pdo=0, plen=128, pfv=0, cpda=0,
            dgst=dgst & 3, maxh2cdata=MAXH2CDATA)))

    def fetch_data(self, req: Request) -> None:
        """Ask for the write's data with one R2T; ``_place`` puts the H2CData in ``req.data``."""
        ttag = self._next_ttag
        self._next_ttag = (ttag + 1) & 0xFFFF
        self.r2t_pending[ttag] = (req, 0)
        req.data = bytearray(req.length)
        self.out.send(self.writer.r2t(req.cid, ttag, 0, req.length))

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
        self.queue.data_ready(req)

    def _digest_error(self, exc: DataDigestError) -> None:
        """A corrupt data PDU fails its command with Data Transfer Error (spec 7.4.6)."""
        header = exc.header
        if exc.pdu_type == PduType.H2C_DATA:
            entry = self.r2t_pending.pop(_unpack_data_header(header)[_TTAG], None)
            if entry is not None:
                self.queue.data_failed(entry[0])
                return
        elif exc.pdu_type == PduType.CAPSULE_CMD:
            self.queue.capsule_data_failed(header[_CAPSULE_SQE])
            return
        self._terminate(FramingError(TermReqFes.HEADER_DIGEST_ERROR, 0, "data digest error", header))

    # -- replies ----------------------------------------------------------------------------------

    def queue_response(self, req: Request) -> None:
        """C2HData with the read's data if any, then the CapsuleResp."""
        if self.transport.is_closing():
            return
        queue = self.queue
        if req.reply is not None:
            # without SQ flow control the data PDU completes the command (as Linux's nvmet-tcp)
            success = PduFlags.SUCCESS if queue.sqhd_disabled else 0
            self.out.send(self.writer.data_pdu(_C2H_DATA, req.cid, 0, 0, req.reply, PduFlags.LAST_PDU | success))
            if success:
                queue.response_sent(req)
                return
        if self.writer.hdgst:
            self.out.send(self.writer.pdu(PduType.CAPSULE_RESP, req.cqe))
        else:
            self.out.send([_CAPSULE_RESP_HEADER + req.cqe])
        queue.response_sent(req)

    def _terminate(self, exc: FramingError) -> None:
        self.queue.note_teardown("framing error", fes=str(exc.fes), fei=str(exc.fei), error=str(exc))
        self.out.send([term_req(PduType.C2H_TERM_REQ, exc.fes, exc.fei, exc.header)])
        self.close()

    def close(self) -> None:
        """Send what is queued, then close."""
        if self.transport is not None and not self.transport.is_closing():
            if self.queue is not None:
                self.queue.note_teardown("local shutdown")
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
