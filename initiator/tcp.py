"""NVMe/TCP transport of the host: one TCP connection per queue, as the Linux host does."""

from __future__ import annotations

import asyncio
import socket
from typing import Callable

import structlog

from blockd.dataplane import twin
from blockd.tcp_asyncio import OutputBatcher, PduProtocol
from blockd.tcp_frames import Pdu
from blockd.tcp_pdu import FramingError, PduReader, PduWriter
from initiator.errors import ConnectError
from initiator.params import ConnectParams
from initiator.queue import HostQueue
from protocol.fabrics import CATTR_DISABLE_SQFLOW
from protocol.layout import fixed_layout
from protocol.tcp import IC_REQ, IC_RESP, TERM_REQ_HEADER, PduType, TermReqFes

log = structlog.get_logger("blockd.initiator")

TcpHostIo = twin("initiator._tcp_host_io").TcpHostIo

ADMIN_INLINE = 8192
_C2H_TYPES = frozenset({PduType.IC_RESP, PduType.C2H_TERM_REQ, PduType.CAPSULE_RESP,
                        PduType.C2H_DATA, PduType.R2T})
_unpack_term_req = fixed_layout(TERM_REQ_HEADER).unpack_from
_FES = fixed_layout(TERM_REQ_HEADER).index("fes")
_PDU_SEQUENCE_ERROR = int(TermReqFes.PDU_SEQUENCE_ERROR)


class TcpHostConnection(TcpHostIo, PduProtocol):
    """One queue's TCP connection; completions run each command's ``on_done``. A read's data
    is received straight into the caller's buffer (see :class:`PduReader`). Sending commands
    and handling the PDUs that answer them is :class:`TcpHostIo`'s (compiled or Python, see
    :mod:`initiator.tcp_host_io`); the connection's life is here."""

    hold: Callable[[], None]
    release: Callable[[], None]
    """``hold``/``release`` (see ``QueueConnection``) are the batcher's own bound methods, set
    once connected: no method of ours in between, as every command goes through them."""

    def __init__(self, queue: HostQueue, on_lost: Callable[[TcpHostConnection, Exception | None], None],
                 max_data: int = 1 << 22) -> None:
        self.queue = queue
        self.on_lost = on_lost
        self.reader = PduReader(_C2H_TYPES, max_data=max_data, place=self._place)
        self.get_buffer = self.reader.get_buffer  # type: ignore[method-assign]
        """The event loop asks the reader itself where the next bytes go (no call of ours in
        between: ~700 instructions per receive on the compiled plane); the reader is this
        connection's for its whole life."""
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

    def _control(self, pdu: Pdu) -> bool:
        """A PDU that is not part of a command's exchange: ICResp, or the target ending the
        connection (True); anything else is out of sequence."""
        ptype = pdu.pdu_type
        if ptype == PduType.IC_RESP and self._icresp is not None and not self._icresp.done():
            self._icresp.set_result(bytes(pdu.header))
            return False
        if ptype == PduType.C2H_TERM_REQ:
            fes = _unpack_term_req(pdu.header)[_FES]
            name = TermReqFes(fes).name if fes in TermReqFes._value2member_map_ else f"{fes:#x}"
            self._fail(ConnectionError(f"target terminated the connection (FES {name})"))
            return True
        raise FramingError(_PDU_SEQUENCE_ERROR, 0, f"unexpected PDU type {ptype:#x}", bytes(pdu.header))

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
