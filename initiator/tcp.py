"""NVMe/TCP transport of the host: one TCP connection per queue, as the Linux host does."""

from __future__ import annotations

import asyncio
import socket
from typing import Callable

from blockd.tcp_asyncio import OutputBatcher, PduProtocol
from blockd.tcp_pdu import (
    DataDigestError, FramingError, PduReader, PduWriter, term_req,
)
from initiator.errors import ConnectError, QueueLost
from initiator.params import ConnectParams
from initiator.queue import HostCommand, HostQueue
from protocol.commands import CQE_CID_OFFSET, SQE_SGL_OFFSET, field_offset
from protocol.constants import SglId
from protocol.fabrics import CATTR_DISABLE_SQFLOW
from protocol.nvme import CQE_FAST, SGL_DATA_BLOCK_FAST
from protocol.status import Status, from_wire
from protocol.layout import fixed_layout
from protocol.tcp import (
    COMMON_HEADER, COMMON_HEADER_SIZE, DATA_PDU_HEADER, DATA_PDU_HEADER_FAST, IC_REQ, IC_RESP, TERM_REQ_HEADER,
    PduFlags, PduType, TermReqFes,
)

ADMIN_INLINE = 8192
_C2H_TYPES = frozenset({PduType.IC_RESP, PduType.C2H_TERM_REQ, PduType.CAPSULE_RESP,
                        PduType.C2H_DATA, PduType.R2T})
_unpack_data_header = DATA_PDU_HEADER_FAST.unpack_from
_unpack_term_req = fixed_layout(TERM_REQ_HEADER).unpack_from
_FES = fixed_layout(TERM_REQ_HEADER).index("fes")
# Fatal Error Information for an invalid header field: the field's byte offset in the PDU header.
_FEI_FLAGS = field_offset(COMMON_HEADER, "flags")
_FEI_RESP_CID = COMMON_HEADER_SIZE + CQE_CID_OFFSET
_FEI_CCCID = field_offset(DATA_PDU_HEADER, "cccid")
_FEI_DATAO = field_offset(DATA_PDU_HEADER, "datao")
_unpack_cqe = CQE_FAST.unpack_from
_pack_sgl_into = SGL_DATA_BLOCK_FAST.pack_into
# Plain ints for the per-I/O code: an IntEnum member is a class attribute lookup each time.
_CAPSULE_CMD = int(PduType.CAPSULE_CMD)
_CAPSULE_RESP = int(PduType.CAPSULE_RESP)
_C2H_DATA = int(PduType.C2H_DATA)
_R2T = int(PduType.R2T)
_H2C_DATA = int(PduType.H2C_DATA)
_IN_CAPSULE = int(SglId.DATA_BLOCK_OFFSET)
_TRANSPORT = int(SglId.TRANSPORT_DATA_BLOCK)
_SUCCESS = PduFlags.SUCCESS
_INVALID_FIELD = int(TermReqFes.INVALID_HEADER_FIELD)
_PDU_SEQUENCE_ERROR = int(TermReqFes.PDU_SEQUENCE_ERROR)
_OUT_OF_RANGE = int(TermReqFes.DATA_OUT_OF_RANGE)
_LAST_PDU = PduFlags.LAST_PDU
_DATA_TRANSFER_ERROR = int(Status.DATA_TRANSFER_ERROR)


class TcpHostConnection(PduProtocol):
    """One queue's TCP connection; completions run each command's ``on_done``. A read's data
    is received straight into the caller's buffer (see :class:`PduReader`)."""

    hold: Callable[[], None]
    release: Callable[[], None]
    """``hold``/``release`` (see ``QueueConnection``) are the batcher's own bound methods, set
    once connected: no method of ours in between, as every command goes through them."""

    def __init__(self, queue: HostQueue, on_lost: Callable[[TcpHostConnection, Exception | None], None],
                 max_data: int = 1 << 22) -> None:
        self.queue = queue
        self.on_lost = on_lost
        self.reader = PduReader(_C2H_TYPES, max_data=max_data, place=self._place)
        self.writer = PduWriter()
        self.transport: asyncio.Transport | None = None
        self.out: OutputBatcher | None = None
        self.inline_limit = ADMIN_INLINE
        self.connect_cattr = CATTR_DISABLE_SQFLOW
        """Our queues never overrun the target (one command per free id), so SQ flow control
        is off and a read completes with its data PDU: one PDU less per read."""
        self.maxh2cdata = 0
        self._icresp: asyncio.Future[bytes] | None = None
        self.closed = False
        self.error: Exception | None = None
        """Why we closed the connection ourselves, reported to ``on_lost``."""

    async def _initialize(self, hdgst: bool, ddgst: bool) -> None:
        self._icresp = asyncio.get_running_loop().create_future()
        dgst = int(hdgst) | (int(ddgst) << 1)
        self.transport.write(IC_REQ.build(dict(pdu_type=PduType.IC_REQ, flags=0, hlen=128, pdo=0,
                                               plen=128, pfv=0, hpda=0, dgst=dgst, maxr2t=0)))
        raw = await self._icresp
        resp = IC_RESP.parse(raw)
        if resp.pfv != 0 or resp.cpda != 0:
            raise ConnectionError(f"target offers PFV {resp.pfv} / CPDA {resp.cpda}; only 0 is supported")
        if resp.dgst != dgst:
            raise ConnectionError(f"target answered digests {resp.dgst:#x} to our {dgst:#x}")
        if resp.maxh2cdata < 4096 or resp.maxh2cdata % 4:
            raise ConnectionError(f"target's MAXH2CDATA {resp.maxh2cdata} is invalid")
        self.maxh2cdata = resp.maxh2cdata
        self.reader.hdgst = self.writer.hdgst = hdgst
        self.reader.ddgst = self.writer.ddgst = ddgst

    # -- sending ---------------------------------------------------------------------------------

    def submit(self, cmd: HostCommand) -> None:
        """Send ``cmd`` (the queue must have room); in-capsule data when it fits. The capsule
        goes out with the others of this loop iteration, or at ``release`` inside a hold."""
        if self.closed:
            raise QueueLost("connection closed")
        self.queue.start(cmd)
        sqe = cmd.sqe
        out = cmd.data_out
        if out is None:
            data_in = cmd.data_in
            length = 0 if data_in is None else len(data_in)
        else:
            length = len(out)
            if length <= self.inline_limit:
                _pack_sgl_into(sqe, SQE_SGL_OFFSET, 0, length, _IN_CAPSULE)
                self.out.send(self.writer.pdu(_CAPSULE_CMD, sqe, out))
                return
        _pack_sgl_into(sqe, SQE_SGL_OFFSET, 0, length, _TRANSPORT)
        self.out.send(self.writer.pdu(_CAPSULE_CMD, sqe))

    # -- receiving -------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.out = OutputBatcher(self.transport)
        self.hold = self.out.hold
        self.release = self.out.release
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._icresp is not None and not self._icresp.done():
            self._icresp.set_exception(ConnectionError("connection closed during ICReq"))
        self.on_lost(self, self.error or exc)

    def _receive(self, nbytes: int) -> None:
        bad_data: bytes | None = None
        while True:
            try:
                if bad_data is not None:
                    header, bad_data = bad_data, None
                    self._c2h_data(header, _DATA_TRANSFER_ERROR)
                for pdu in self.reader.buffer_updated(nbytes):
                    ptype = pdu.pdu_type
                    if ptype == _C2H_DATA and pdu.placed:
                        self._c2h_data(pdu.header)
                    elif ptype == _CAPSULE_RESP:
                        self._response(pdu.header)
                    elif ptype == _R2T:
                        self._r2t(pdu.header)
                    elif ptype == PduType.IC_RESP and self._icresp is not None and not self._icresp.done():
                        self._icresp.set_result(bytes(pdu.header))
                    elif ptype == PduType.C2H_TERM_REQ:
                        fes = _unpack_term_req(pdu.header)[_FES]
                        name = TermReqFes(fes).name if fes in TermReqFes._value2member_map_ else f"{fes:#x}"
                        self._fail(ConnectionError(f"target terminated the connection (FES {name})"))
                        return
                    else:
                        raise FramingError(_PDU_SEQUENCE_ERROR, 0, f"unexpected PDU type {ptype:#x}",
                                           bytes(pdu.header))
                return
            except FramingError as exc:
                self.out.send([term_req(PduType.H2C_TERM_REQ, exc.fes, exc.fei, exc.header)])
                self._fail(ConnectionError(f"protocol error from target: {exc}"))
                return
            except DataDigestError as exc:
                # As the Linux host: the command fails with Data Transfer Error and the stream,
                # intact after the bad PDU, goes on (the PDUs already received come next).
                bad_data = exc.header
                nbytes = 0

    def _response(self, header: memoryview) -> None:
        dw0, dw1, _, _, cid, status = _unpack_cqe(header, 8)
        cmd = self.queue.finish(cid)
        if cmd is None:
            raise FramingError(_INVALID_FIELD, _FEI_RESP_CID, f"completion for unknown command id {cid}", bytes(header))
        status = from_wire(status) or cmd.status  # a read's data digest error stands
        if status == 0 and cmd.data_in is not None and cmd.transferred != len(cmd.data_in):
            status = _DATA_TRANSFER_ERROR
        cmd.status = status
        cmd.dw0 = dw0
        cmd.dw1 = dw1
        cmd.complete()

    def _place(self, ptype: int, header: memoryview, length: int) -> memoryview | None:
        """C2HData lands in the command's own buffer, at the offset it must come next."""
        if ptype != _C2H_DATA:
            return None
        _, _, _, _, _, cid, _, datao, datal = _unpack_data_header(header)
        cmd = self.queue.pending.get(cid)
        dest = None if cmd is None else cmd.data_in
        if dest is None:
            raise FramingError(_INVALID_FIELD, _FEI_CCCID, f"C2HData for unknown command id {cid}", bytes(header))
        size = len(dest)
        if datao != cmd.transferred or datao + datal > size or datal != length:
            raise FramingError(_OUT_OF_RANGE, _FEI_DATAO, "C2HData outside the command's buffer", bytes(header))
        return dest if datal == size else dest[datao:datao + datal]  # one PDU: no new view

    def _c2h_data(self, header: memoryview | bytes, status: int = 0) -> None:
        """C2HData whose data ``_place`` already put in the command's buffer; ``status`` is
        Data Transfer Error when its data digest was wrong (the command fails, later PDUs of
        it still land where they belong)."""
        _, flags, _, _, _, cid, _, _, datal = _unpack_data_header(header)
        queue = self.queue
        cmd = queue.pending[cid]
        cmd.transferred += datal
        if status:
            cmd.status = status
        if flags & _SUCCESS:
            if not flags & _LAST_PDU:
                raise FramingError(_INVALID_FIELD, _FEI_FLAGS, "SUCCESS without LAST_PDU", bytes(header))
            queue.finish(cid)
            if cmd.transferred != len(cmd.data_in):
                cmd.status = _DATA_TRANSFER_ERROR
            cmd.complete()

    def _r2t(self, header: memoryview) -> None:
        """Send the data an R2T asks for. Only data not yet asked for: each byte of a write
        leaves at most once (as the Linux host checks), so a target repeating R2Ts cannot make
        us send, or buffer in the transport, more than the command's own data."""
        _, _, _, _, _, cid, ttag, offset, length = _unpack_data_header(header)
        cmd = self.queue.pending.get(cid)
        out = None if cmd is None else cmd.data_out
        if out is None or len(out) <= self.inline_limit:  # a read, or its data went in the capsule
            raise FramingError(_INVALID_FIELD, _FEI_CCCID, f"R2T for command id {cid}, which has no data to ask for",
                               bytes(header))
        end = offset + length
        if length == 0 or offset < cmd.transferred or end > len(out):
            raise FramingError(_OUT_OF_RANGE, _FEI_DATAO, "R2T outside the command's data not yet sent",
                               bytes(header))
        cmd.transferred = end
        out = memoryview(out)
        chunk = self.maxh2cdata
        while offset < end:
            n = min(chunk, end - offset)
            last = _LAST_PDU if offset + n == end else 0
            self.out.send(self.writer.data_pdu(_H2C_DATA, cid, ttag, offset, out[offset:offset + n], last))
            offset += n

    def _fail(self, exc: Exception) -> None:
        self.error = exc
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None and not self.transport.is_closing():
            self.out.flush()
            self.transport.close()


async def open_queue(params: ConnectParams, queue: HostQueue,
                     on_lost: Callable[[TcpHostConnection, Exception | None], None]) -> TcpHostConnection:
    """Connect one queue and run the ICReq/ICResp exchange (the controller's ``QueueOpener``)."""
    loop = asyncio.get_running_loop()
    timeout = params.connect_timeout
    try:
        _, conn = await asyncio.wait_for(
            loop.create_connection(lambda: TcpHostConnection(queue, on_lost), params.traddr, params.trsvcid),
            timeout)
    except (OSError, asyncio.TimeoutError) as exc:
        raise ConnectError(f"cannot reach {params.traddr}:{params.trsvcid} over tcp: {exc or 'timed out'}") from exc
    try:
        await asyncio.wait_for(conn._initialize(params.hdr_digest, params.data_digest), timeout)
    except BaseException:
        conn.close()
        raise
    return conn
