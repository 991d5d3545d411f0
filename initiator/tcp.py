"""NVMe/TCP transport of the host: one TCP connection per queue, as the Linux host does."""

from __future__ import annotations

import asyncio
import socket
from typing import Callable

from blockd.tcp_asyncio import OutputBatcher, PduProtocol
from blockd.tcp_pdu import (
    DataDigestError, FramingError, PduReader, PduWriter, term_req,
)
from initiator.queue import HostCommand, HostQueue, QueueLost
from protocol.constants import SglId
from protocol.nvme import CQE_FAST, SGL_DATA_BLOCK_FAST
from protocol.status import Status
from protocol.tcp import DATA_PDU_HEADER_FAST, IC_REQ, IC_RESP, PduFlags, PduType

ICRESP_TIMEOUT = 10.0
ADMIN_INLINE = 8192
_C2H_TYPES = frozenset({PduType.IC_RESP, PduType.C2H_TERM_REQ, PduType.CAPSULE_RESP,
                        PduType.C2H_DATA, PduType.R2T})
_unpack_data_header = DATA_PDU_HEADER_FAST.unpack_from
_unpack_cqe = CQE_FAST.unpack_from
_pack_sgl_into = SGL_DATA_BLOCK_FAST.pack_into
# Plain ints for the per-I/O code: an IntEnum member is a class attribute lookup each time.
_CAPSULE_CMD = int(PduType.CAPSULE_CMD)
_CAPSULE_RESP = int(PduType.CAPSULE_RESP)
_C2H_DATA = int(PduType.C2H_DATA)
_R2T = int(PduType.R2T)
_IN_CAPSULE = int(SglId.DATA_BLOCK_OFFSET)
_TRANSPORT = int(SglId.TRANSPORT_DATA_BLOCK)
_SUCCESS = PduFlags.SUCCESS
_LAST_PDU = PduFlags.LAST_PDU


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
        self.maxh2cdata = 0
        self._icresp: asyncio.Future[bytes] | None = None
        self.closed = False
        self.error: Exception | None = None
        """Why we closed the connection ourselves, reported to ``on_lost``."""

    @classmethod
    async def open(cls, address: str, port: int, queue: HostQueue,
                   on_lost: Callable[[TcpHostConnection, Exception | None], None],
                   hdgst: bool = False, ddgst: bool = False, timeout: float = ICRESP_TIMEOUT) -> TcpHostConnection:
        """Connect and run the ICReq/ICResp exchange."""
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(
            loop.create_connection(lambda: cls(queue, on_lost), address, port), timeout)
        try:
            await asyncio.wait_for(conn._initialize(hdgst, ddgst), timeout)
        except BaseException:
            conn.close()
            raise
        return conn

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
                _pack_sgl_into(sqe, 24, 0, length, _IN_CAPSULE)
                self.out.send(self.writer.pdu(_CAPSULE_CMD, sqe, out))
                return
        _pack_sgl_into(sqe, 24, 0, length, _TRANSPORT)
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
        try:
            for pdu in self.reader.buffer_updated(nbytes):
                ptype = pdu.pdu_type
                if ptype == _C2H_DATA and pdu.placed:
                    self._c2h_data(pdu.header, pdu.flags)
                elif ptype == _CAPSULE_RESP:
                    self._response(pdu.header)
                elif ptype == _R2T:
                    self._r2t(pdu.header)
                elif ptype == PduType.IC_RESP and self._icresp is not None and not self._icresp.done():
                    self._icresp.set_result(bytes(pdu.header))
                elif ptype == PduType.C2H_TERM_REQ:
                    fes = int.from_bytes(pdu.header[8:10], "little")
                    self._fail(ConnectionError(f"target terminated the connection (FES {fes})"))
                    return
                else:
                    raise FramingError(2, 0, f"unexpected PDU type {ptype:#x}", bytes(pdu.header))
        except FramingError as exc:
            self.out.send([term_req(PduType.H2C_TERM_REQ, exc.fes, exc.fei, exc.header)])
            self._fail(ConnectionError(f"protocol error from target: {exc}"))
        except DataDigestError:
            self._fail(ConnectionError("data digest error from target"))

    def _response(self, header: memoryview) -> None:
        dw0, dw1, _, _, cid, status = _unpack_cqe(header, 8)
        cmd = self.queue.finish(cid)
        if cmd is None:
            raise FramingError(1, 12, f"completion for unknown command id {cid}", bytes(header))
        status >>= 1
        if status == 0 and cmd.data_in is not None and cmd.received != len(cmd.data_in):
            status = Status.DATA_TRANSFER_ERROR
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
            raise FramingError(1, 8, f"C2HData for unknown command id {cid}", bytes(header))
        size = len(dest)
        if datao != cmd.received or datao + datal > size or datal != length:
            raise FramingError(4, 12, "C2HData outside the command's buffer", bytes(header))
        return dest if datal == size else dest[datao:datao + datal]  # one PDU: no new view

    def _c2h_data(self, header: memoryview, flags: int) -> None:
        """C2HData whose data ``_place`` already put in the command's buffer."""
        _, _, _, _, _, cid, _, _, datal = _unpack_data_header(header)
        queue = self.queue
        cmd = queue.pending[cid]
        cmd.received += datal
        if flags & _SUCCESS:
            if not flags & _LAST_PDU:
                raise FramingError(1, 1, "SUCCESS without LAST_PDU", bytes(header))
            queue.finish(cid)
            cmd.status = 0 if cmd.received == len(cmd.data_in) else Status.DATA_TRANSFER_ERROR
            cmd.complete()

    def _r2t(self, header: memoryview) -> None:
        _, _, _, _, _, cid, ttag, offset, length = _unpack_data_header(header)
        cmd = self.queue.pending.get(cid)
        if cmd is None or cmd.data_out is None:
            raise FramingError(1, 8, f"R2T for unknown command id {cid}", bytes(header))
        out = memoryview(cmd.data_out)
        if length == 0 or offset + length > len(out):
            raise FramingError(4, 12, "R2T outside the command's data", bytes(header))
        end = offset + length
        chunk = self.maxh2cdata
        while offset < end:
            n = min(chunk, end - offset)
            last = PduFlags.LAST_PDU if offset + n == end else 0
            self.out.send(self.writer.data_pdu(
                PduType.H2C_DATA, cid, ttag, offset, out[offset:offset + n], last))
            offset += n

    def _fail(self, exc: Exception) -> None:
        self.error = exc
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None and not self.transport.is_closing():
            self.out.flush()
            self.transport.close()
