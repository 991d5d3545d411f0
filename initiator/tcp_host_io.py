"""The per-I/O half of the host's NVMe/TCP connection: sending a command's capsule, and the
PDUs that answer it (C2HData placed into the command's buffer, CapsuleResp, R2T).

This is the Python reference; ``initiator/_tcp_host_io.pyx`` is its compiled twin, which
:mod:`initiator.tcp` uses when the data plane is compiled (``tests/core/test_tcp_host_differential.py``
feeds both the same PDU streams). :class:`~initiator.tcp.TcpHostConnection` adds the rest (the
connection's life, ICReq, termination requests) on top of either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from blockd.tcp_pdu import DataDigestError, FramingError, term_req
from initiator.errors import QueueLost
from initiator.queue import HostCommand, HostQueue
from protocol.commands import CQE_CID_OFFSET, SQE_SGL_OFFSET, field_offset
from protocol.constants import SglId
from protocol.nvme import CQE_FAST, SGL_DATA_BLOCK_FAST
from protocol.status import Status, from_wire
from protocol.tcp import COMMON_HEADER, COMMON_HEADER_SIZE, DATA_PDU_HEADER, DATA_PDU_HEADER_FAST, PduFlags, PduType, TermReqFes

if TYPE_CHECKING:
    from blockd.tcp_asyncio import OutputBatcher
    from blockd.tcp_pdu import PduReader, PduWriter
    from blockd.tcp_frames import Pdu

_unpack_data_header = DATA_PDU_HEADER_FAST.unpack_from
# Fatal Error Information for an invalid header field: the field's byte offset in the PDU header.
FEI_FLAGS = field_offset(COMMON_HEADER, "flags")
FEI_RESP_CID = COMMON_HEADER_SIZE + CQE_CID_OFFSET
FEI_CCCID = field_offset(DATA_PDU_HEADER, "cccid")
FEI_DATAO = field_offset(DATA_PDU_HEADER, "datao")
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
_OUT_OF_RANGE = int(TermReqFes.DATA_OUT_OF_RANGE)
_LAST_PDU = PduFlags.LAST_PDU
_DATA_TRANSFER_ERROR = int(Status.DATA_TRANSFER_ERROR)


class TcpHostIo:
    """What every command of a queue goes through. The subclass sets the fields and provides
    ``_control`` (any other PDU: True when it ended the connection) and ``_fail``."""

    queue: HostQueue
    reader: PduReader
    writer: PduWriter
    out: OutputBatcher
    inline_limit: int
    maxh2cdata: int
    closed: bool

    def _control(self, pdu: Pdu) -> bool:
        raise NotImplementedError

    def _fail(self, exc: Exception) -> None:
        raise NotImplementedError

    # -- sending ------------------------------------------------------------------------------

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
                    elif self._control(pdu):
                        return
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
            raise FramingError(_INVALID_FIELD, FEI_RESP_CID, f"completion for unknown command id {cid}", bytes(header))
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
        cmd = self.queue.get(cid)
        dest = None if cmd is None else cmd.data_in
        if dest is None:
            raise FramingError(_INVALID_FIELD, FEI_CCCID, f"C2HData for unknown command id {cid}", bytes(header))
        size = len(dest)
        if datao != cmd.transferred or datao + datal > size or datal != length:
            raise FramingError(_OUT_OF_RANGE, FEI_DATAO, "C2HData outside the command's buffer", bytes(header))
        return dest if datal == size else dest[datao:datao + datal]  # one PDU: no new view

    def _c2h_data(self, header: memoryview | bytes, status: int = 0) -> None:
        """C2HData whose data ``_place`` already put in the command's buffer; ``status`` is
        Data Transfer Error when its data digest was wrong (the command fails, later PDUs of
        it still land where they belong)."""
        _, flags, _, _, _, cid, _, _, datal = _unpack_data_header(header)
        queue = self.queue
        cmd = queue.get(cid)
        if cmd is None:  # its data was placed, so only a command failed meanwhile (timed out)
            raise KeyError(cid)
        cmd.transferred += datal
        if status:
            cmd.status = status
        if flags & _SUCCESS:
            if not flags & _LAST_PDU:
                raise FramingError(_INVALID_FIELD, FEI_FLAGS, "SUCCESS without LAST_PDU", bytes(header))
            queue.finish(cid)
            if cmd.transferred != len(cmd.data_in):
                cmd.status = _DATA_TRANSFER_ERROR
            cmd.complete()

    def _r2t(self, header: memoryview) -> None:
        """Send the data an R2T asks for. Only data not yet asked for: each byte of a write
        leaves at most once (as the Linux host checks), so a target repeating R2Ts cannot make
        us send, or buffer in the transport, more than the command's own data."""
        _, _, _, _, _, cid, ttag, offset, length = _unpack_data_header(header)
        cmd = self.queue.get(cid)
        out = None if cmd is None else cmd.data_out
        if out is None or len(out) <= self.inline_limit:  # a read, or its data went in the capsule
            raise FramingError(_INVALID_FIELD, FEI_CCCID, f"R2T for command id {cid}, which has no data to ask for",
                               bytes(header))
        end = offset + length
        if length == 0 or offset < cmd.transferred or end > len(out):
            raise FramingError(_OUT_OF_RANGE, FEI_DATAO, "R2T outside the command's data not yet sent",
                               bytes(header))
        cmd.transferred = end
        out = memoryview(out)
        chunk = self.maxh2cdata
        while offset < end:
            n = min(chunk, end - offset)
            last = _LAST_PDU if offset + n == end else 0
            self.out.send(self.writer.data_pdu(_H2C_DATA, cid, ttag, offset, out[offset:offset + n], last))
            offset += n
