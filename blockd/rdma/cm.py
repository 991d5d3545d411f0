"""rdma_cm for asyncio, with external QPs and NVMe-oF private data (pyverbs 44 + ctypes).

Model
-----
* :class:`CmEventChannel` -- one ``rdma_event_channel`` whose fd (O_NONBLOCK) is watched by the
  running asyncio loop.  Every CM id created through this module lives on one such channel and is
  registered under its raw ``rdma_cm_id*``; events are demultiplexed by ``event->id`` (and
  ``event->listen_id`` for connect requests) read through the raw event pointer, because pyverbs
  44's ``CMEvent`` exposes neither.  Every event is acked right after it is read (its private
  data copied first), so ``rdma_destroy_id`` never blocks.
* Passive side: :meth:`CmEventChannel.listen` -> :class:`RdmaListener` on one specific local IP
  (never the wildcard: pyverbs 44 ``bind_addr`` dereferences a NULL context and segfaults) ->
  :class:`ConnectionRequest` objects (parsed NVMe-oF request, the peer's offered responder
  resources / initiator depth) -> :meth:`ConnectionRequest.accept` (QP INIT, caller's hook to
  post receives, RTR, RTS with ``max_rd_atomic`` clamped, then ``rdma_accept`` with explicit
  ConnParam + private data) or :meth:`ConnectionRequest.reject` (NVMe-oF REJECT private data).
* Active side: :func:`connect` resolves address and route, lets the caller create the QP on the
  device the route chose, connects with private data and responder_resources > 0, and on
  CONNECT_RESPONSE moves the QP INIT (only now: before the REP the CM grants no remote access),
  hook, RTR, RTS and calls ``establish()`` (RTU).  A REJECTED event raises :class:`CmRejected`
  with the consumer-reject status and the parsed NVMe-oF STS.
* :class:`RdmaConnection` -- both sides' established connection: ``disconnect()``, ``closed``
  future set on DISCONNECTED (QP moved to ERR so its WRs flush), ``close()``.

QPs are "external" (:class:`blockd.rdma.verbs.QueuePair` on our own Context/PD/CQ,
docs/wire-facts.md, "RDMA provider quirks"): rdma_cm only sees their number and hands out the
attributes via ``rdma_init_qp_attr``.  ConnParam is always explicit (pyverbs' defaults are 1/1/5/5/no flow
control).

pyverbs 44 gaps closed here (see :mod:`blockd.rdma._raw`): channel fd (raw pointer), event
``id``/``listen_id``/``status``/``responder_resources``/``initiator_depth`` (raw event pointer),
per-CMID demultiplexing (registry keyed by raw ``rdma_cm_id*``).
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
from dataclasses import dataclass
from typing import Callable

import pyverbs.cm_enums as ce
import pyverbs.enums as e
from pyverbs.cmid import CMID, AddrInfo, CMEvent, CMEventChannel, ConnParam
from pyverbs.pyverbs_error import PyverbsRDMAError

from protocol import rdma_cm as nvme_cm

from . import _raw
from .verbs import QueuePair

__all__ = [
    "CmError", "CmEvent", "CmEventChannel", "CmRejected", "ConnectionRequest", "RdmaConnection",
    "RdmaListener", "connect", "MAX_PRIVATE_DATA_CONNECT", "MAX_PRIVATE_DATA_ACCEPT",
]

log = logging.getLogger("blockd.rdma.cm")

# private data limits on IB/RoCE (RDMA_PS_TCP): REQ 56, REP 196, REJ 148
MAX_PRIVATE_DATA_CONNECT = 56
MAX_PRIVATE_DATA_ACCEPT = 196
MAX_PRIVATE_DATA_REJECT = 148
IB_CM_REJ_CONSUMER_DEFINED = 28
RDMA_MAX_INIT_DEPTH = 0xFF
IBV_EVENT_COMM_EST = 5

EV = {v: k for k, v in vars(ce).items() if k.startswith("RDMA_CM_EVENT_")}
_TERMINAL = frozenset({ce.RDMA_CM_EVENT_DISCONNECTED, ce.RDMA_CM_EVENT_DEVICE_REMOVAL,
                       ce.RDMA_CM_EVENT_CONNECT_ERROR, ce.RDMA_CM_EVENT_UNREACHABLE,
                       ce.RDMA_CM_EVENT_REJECTED})
"""Events after which the connection is over (``RdmaConnection.end_event`` names the first)."""


class CmError(ConnectionError):
    """A connection setup step failed (address/route error, unreachable, connect error...)."""


class CmRejected(CmError):
    """The peer rejected the connection.

    ``status`` is the CM reject reason (28 = consumer defined, i.e. the peer's application
    rejected it), ``private_data`` the reject data as delivered (padded), ``nvme`` the parsed
    NVMe-oF REJECT (:class:`protocol.rdma_cm.Reject`) or None if it was too short.
    """

    def __init__(self, status: int, private_data: bytes) -> None:
        self.status = status
        self.private_data = private_data
        try:
            self.nvme: nvme_cm.Reject | None = nvme_cm.parse_reject(private_data)
        except nvme_cm.PrivateDataError:
            self.nvme = None
        why = f"NVMe-oF STS {self.nvme.sts} ({self.nvme.describe()})" if self.nvme else "no NVMe-oF status"
        super().__init__(f"connection rejected (CM reason {status}): {why}")


@dataclass(frozen=True)
class CmEvent:
    """A CM event as seen by this module (copied out before the ack)."""

    type: int
    status: int
    private_data: bytes
    responder_resources: int
    initiator_depth: int

    @property
    def name(self) -> str:
        return EV.get(self.type, str(self.type))


def _ev(raw: _raw.RawCmEvent) -> CmEvent:
    return CmEvent(raw.event, raw.status, raw.private_data, raw.responder_resources,
                   raw.initiator_depth)


class CmEventChannel:
    """An rdma_cm event channel driven by an asyncio loop (``loop.add_reader`` on its fd).

    Create it inside a running loop (or pass ``loop``).  One channel can carry any number of
    listeners and connections.  ``close()`` closes everything still registered.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop or asyncio.get_running_loop()
        self.channel = CMEventChannel()
        self.fd = _raw.cm_channel_fd(self.channel)
        _raw.set_nonblocking(self.fd)
        self._ids: dict[int, "RdmaListener | RdmaConnection"] = {}
        self.loop.add_reader(self.fd, self._ready)
        self.closed = False

    # -- registry ---------------------------------------------------------------------------------
    def _register(self, cmid: CMID, owner) -> int:
        ptr = _raw.raw_ptr(cmid)
        self._ids[ptr] = owner
        return ptr

    def _unregister(self, ptr: int, owner) -> None:
        # only our own entry: once an id is destroyed librdmacm may hand its address to a new one
        if self._ids.get(ptr) is owner:
            del self._ids[ptr]

    def _new_cmid(self) -> CMID:
        return CMID(creator=self.channel, port_space=ce.RDMA_PS_TCP)

    # -- event pump -------------------------------------------------------------------------------
    def _ready(self) -> None:
        while True:
            try:
                ev = CMEvent(self.channel)
            except PyverbsRDMAError as ex:
                if ex.error_code in (errno.EAGAIN, errno.EWOULDBLOCK):
                    return
                log.error("rdma_get_cm_event failed: %s", ex)
                return
            try:
                raw = _raw.read_cm_event(ev)
                if raw.event == ce.RDMA_CM_EVENT_CONNECT_REQUEST:
                    listener = self._ids.get(raw.listen_id)
                    if not isinstance(listener, RdmaListener):
                        ev.ack_cm_event()
                        log.warning("connect request for an unknown listener")
                        continue
                    child = CMID(creator=ev, listen_id=listener.cmid)
                    ev.ack_cm_event()
                    listener._on_request(child, raw)
                else:
                    ev.ack_cm_event()
                    owner = self._ids.get(raw.id)
                    if owner is None:
                        log.debug("CM event %s for an unregistered id", EV.get(raw.event))
                        continue
                    owner._on_event(_ev(raw))
            except Exception:  # keep pumping; one bad handler must not stall the channel
                log.exception("CM event handling failed")
                try:
                    ev.close()  # acks it if the handler failed before the ack
                except PyverbsRDMAError:
                    pass

    # -- API --------------------------------------------------------------------------------------
    def listen(self, addr: str, port: int, backlog: int = 128,
               on_request: Callable[["ConnectionRequest"], None] | None = None) -> "RdmaListener":
        """Listen on one specific local IP (not 0.0.0.0 / ::) and port."""
        return RdmaListener(self, addr, port, backlog, on_request)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for owner in list(self._ids.values()):
            owner.close()
        self._ids.clear()
        self.loop.remove_reader(self.fd)
        self.channel.close()


class RdmaListener:
    """A listening CM id bound to one local IP:port.

    Connect requests go to ``on_request(req)`` if given, else queue for
    ``await listener.get_request()``.
    """

    def __init__(self, channel: CmEventChannel, addr: str, port: int, backlog: int,
                 on_request: Callable[["ConnectionRequest"], None] | None) -> None:
        ip = ipaddress.ip_address(addr)
        if ip.is_unspecified:
            raise ValueError("listen on a specific local RDMA address, not the wildcard "
                             "(pyverbs 44 bind_addr segfaults on it); use one listener per IP")
        self.channel = channel
        self.addr = addr
        self.port = port
        self.on_request = on_request
        self.requests: asyncio.Queue[ConnectionRequest] = asyncio.Queue()
        self.cmid = channel._new_cmid()
        try:
            ai = AddrInfo(src=addr, src_service=str(port), port_space=ce.RDMA_PS_TCP,
                          flags=ce.RAI_PASSIVE)
            self.cmid.bind_addr(ai)
            self.cmid.listen(backlog)
        except PyverbsRDMAError as ex:
            self.cmid.close()
            raise CmError(f"cannot listen on {addr}:{port}: {ex}") from None
        self.dev_name = self.cmid.dev_name
        self._ptr = channel._register(self.cmid, self)
        self.closed = False

    def _on_request(self, child: CMID, raw: _raw.RawCmEvent) -> None:
        req = ConnectionRequest(self, child, raw)
        if self.on_request is not None:
            self.on_request(req)
        else:
            self.requests.put_nowait(req)

    def _on_event(self, ev: CmEvent) -> None:
        log.info("listener %s:%s got %s", self.addr, self.port, ev.name)

    async def get_request(self) -> "ConnectionRequest":
        return await self.requests.get()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.channel._unregister(self._ptr, self)
        while not self.requests.empty():
            self.requests.get_nowait().reject(None)
        self.cmid.close()


def _conn_param(*, responder_resources: int, initiator_depth: int, qp_num: int,
                private_data: bytes | None, max_len: int, retry: int = 7,
                rnr_retry: int = 7) -> ConnParam:
    data = private_data or b""
    if len(data) > max_len:
        raise ValueError(f"private data is {len(data)} bytes, at most {max_len} fit")
    cp = ConnParam(resources=responder_resources, depth=initiator_depth, flow_control=1,
                   retry=retry, rnr_retry=rnr_retry, srq=0, qp_num=qp_num, data_len=len(data))
    if data:
        cp.set_private_data(data)
    return cp


def _modify_from_cm(cmid: CMID, qp: QueuePair, state: int, max_rd_atomic: int | None = None) -> None:
    attr, mask = cmid.init_qp_attr(state)
    if state == e.IBV_QPS_RTS and max_rd_atomic is not None:
        attr.max_rd_atomic = min(attr.max_rd_atomic, max_rd_atomic)
    if state == e.IBV_QPS_RTS:
        qp.max_rd_atomic = attr.max_rd_atomic
    qp.modify(attr, mask)


class ConnectionRequest:
    """An incoming connect request (passive side), not yet accepted or rejected.

    ``nvme`` is the parsed NVMe-oF CONNECT private data (:class:`protocol.rdma_cm.ConnectRequest`)
    or None, in which case ``nvme_error`` holds the :class:`~protocol.rdma_cm.PrivateDataError`
    (whose ``sts`` is the status to reject with).  ``peer_responder_resources`` is the RDMA READ
    depth the peer offers to serve for us (the most READs we may have in flight; 0 means we may
    not RDMA READ at all); ``peer_initiator_depth`` how many READs it wants to issue to us.
    (The kernel reports these from the passive side's point of view: ``event->initiator_depth``
    is the peer's responder resources and vice versa; librdmacm clamps accept to them.)  ``dev_name`` is the local RDMA device the request arrived on: create the
    QP there (``verbs.open_device(req.dev_name)``); ``peer`` the host's ``address:port``.
    """

    def __init__(self, listener: RdmaListener, cmid: CMID, raw: _raw.RawCmEvent) -> None:
        self.listener = listener
        self.cmid = cmid
        self.private_data = raw.private_data
        self.peer_responder_resources = raw.initiator_depth
        self.peer_initiator_depth = raw.responder_resources
        self.dev_name = cmid.dev_name
        self.peer = _raw.peer_address(cmid)
        """The host's ``address:port`` ("" when not IPv4)."""
        try:
            self.nvme: nvme_cm.ConnectRequest | None = nvme_cm.parse_request(raw.private_data)
            self.nvme_error: nvme_cm.PrivateDataError | None = None
        except nvme_cm.PrivateDataError as ex:
            self.nvme, self.nvme_error = None, ex
        self.done = False

    def accept(self, qp: QueuePair, private_data: bytes | None = None, *,
               initiator_depth: int | None = None, responder_resources: int = 0,
               before_rtr: Callable[[QueuePair], None] | None = None,
               on_disconnect: Callable[["RdmaConnection"], None] | None = None) -> "RdmaConnection":
        """Bring ``qp`` to RTS with the CM's attributes and send the REP.

        ``initiator_depth`` (default: the device's max_qp_init_rd_atom) is clamped to what the
        peer offered; the result is ``conn.initiator_depth`` = the QP's ``max_rd_atomic`` = the
        bound on RDMA READs we may have in flight.  ``before_rtr(qp)`` runs in INIT: post the
        receives there (the peer may SEND as soon as it sees the REP).  Returns the connection;
        ``await conn.established`` for the peer's RTU (commands may arrive before it).
        """
        if self.done:
            raise RuntimeError("connect request already answered")
        self.done = True
        ird = qp.device.max_qp_init_rd_atom if initiator_depth is None else initiator_depth
        depth = min(ird, self.peer_responder_resources, qp.device.max_qp_init_rd_atom)
        conn = RdmaConnection(self.listener.channel, self.cmid, qp, on_disconnect,
                              peer_private_data=self.private_data, passive=True)
        try:
            _modify_from_cm(self.cmid, qp, e.IBV_QPS_INIT)
            if before_rtr is not None:
                before_rtr(qp)
            _modify_from_cm(self.cmid, qp, e.IBV_QPS_RTR)
            _modify_from_cm(self.cmid, qp, e.IBV_QPS_RTS, max_rd_atomic=depth)
            conn.initiator_depth = qp.max_rd_atomic
            conn.responder_resources = responder_resources
            self.cmid.accept(_conn_param(responder_resources=responder_resources,
                                         initiator_depth=qp.max_rd_atomic, qp_num=qp.qp_num,
                                         private_data=private_data,
                                         max_len=MAX_PRIVATE_DATA_ACCEPT))
        except Exception:
            conn.close(qp=False)
            raise
        return conn

    def accept_nvme(self, qp: QueuePair, crqsize: int, **kw) -> "RdmaConnection":
        """:meth:`accept` with the NVMe-oF ACCEPT private data (RECFMT 0, CRQSIZE)."""
        return self.accept(qp, nvme_cm.Accept(crqsize).pack(), **kw)

    def reject(self, private_data: bytes | None) -> None:
        """``rdma_reject`` with ``private_data`` (reason: consumer defined), then destroy the id."""
        if self.done:
            return
        self.done = True
        if private_data and len(private_data) > MAX_PRIVATE_DATA_REJECT:
            raise ValueError("reject private data too long")
        try:
            self.cmid.reject(private_data=private_data or None)
        finally:
            self.cmid.close()

    def reject_nvme(self, sts: int) -> None:
        """Reject with the 4-byte NVMe-oF REJECT private data (RECFMT 0, ``sts``)."""
        self.reject(nvme_cm.Reject(sts).pack())


class RdmaConnection:
    """A connected (or connecting) CM id with its external QP.

    ``established``: future done when the connection is usable (passive side: on ESTABLISHED;
    active side: once :func:`connect` returns).  ``closed``: future done on DISCONNECTED (or
    any terminal error); the QP has been moved to ERR by then, so its outstanding WRs flush
    with IBV_WC_WR_FLUSH_ERR.  ``peer_private_data``: the peer's CONNECT (passive) or ACCEPT
    (active) private data as delivered (padded).  ``initiator_depth``: RDMA READs we may have
    in flight on this QP.
    """

    def __init__(self, channel: CmEventChannel, cmid: CMID, qp: QueuePair | None,
                 on_disconnect: Callable[["RdmaConnection"], None] | None,
                 peer_private_data: bytes = b"", passive: bool = False) -> None:
        self.channel = channel
        self.cmid = cmid
        self.qp = qp
        self.on_disconnect = on_disconnect
        self.peer_private_data = peer_private_data
        self.passive = passive
        self.initiator_depth = 0
        self.responder_resources = 0
        loop = channel.loop
        self.established: asyncio.Future[None] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()
        self._setup: asyncio.Queue[CmEvent] | None = None if passive else asyncio.Queue()
        self._ptr = channel._register(cmid, self)
        self._disconnect_sent = False
        self._destroyed = False
        self.end_event: str | None = None
        """The CM event that ended the connection (its name), None while none has."""
        self.end_status = 0

    @property
    def dev_name(self) -> str:
        return self.cmid.dev_name

    def _on_event(self, ev: CmEvent) -> None:
        t = ev.type
        if self._setup is not None and not self.established.done():
            self._setup.put_nowait(ev)
            return
        if t in _TERMINAL and self.end_event is None:
            self.end_event, self.end_status = ev.name, ev.status
        if t == ce.RDMA_CM_EVENT_ESTABLISHED:
            if not self.established.done():
                self.established.set_result(None)
        elif t == ce.RDMA_CM_EVENT_DISCONNECTED:
            # the peer's DREQ: answer it (rdma_disconnect sends the DREP) or the peer only sees
            # its DISCONNECTED after its DREQ times out
            if not self._disconnect_sent and not self._destroyed:
                self.disconnect()
            self._terminate(None)
        elif t in _TERMINAL:
            self._terminate(CmError(f"connection ended: {ev.name} (status {ev.status})"))
        elif t == ce.RDMA_CM_EVENT_TIMEWAIT_EXIT:
            pass
        else:
            log.debug("connection got %s", ev.name)

    def _terminate(self, reason: Exception | None) -> None:
        if self.qp is not None and not self.qp.closed:
            try:
                self.qp.to_error()
            except PyverbsRDMAError:
                pass
        if not self.established.done():
            self.established.set_exception(reason or CmError("closed"))
            self.established.exception()  # mark retrieved
        first = not self.closed.done()
        if first:
            self.closed.set_result(None)
            if self.on_disconnect is not None:
                self.on_disconnect(self)

    def disconnect(self) -> None:
        """``rdma_disconnect`` (sends DREQ; the QP goes to ERR locally); ``await closed`` for the
        DISCONNECTED event."""
        if self._disconnect_sent or self._destroyed:
            return
        self._disconnect_sent = True
        try:
            self.cmid.disconnect()
        except PyverbsRDMAError as ex:
            log.debug("rdma_disconnect: %s", ex)
            self._terminate(None)
        if self.qp is not None and not self.qp.closed:
            try:
                self.qp.to_error()
            except PyverbsRDMAError:
                pass

    async def aclose(self, timeout: float = 5.0, qp: bool = True) -> None:
        """Graceful: disconnect, wait for DISCONNECTED (bounded), then :meth:`close`."""
        self.disconnect()
        try:
            await asyncio.wait_for(asyncio.shield(self.closed), timeout)
        except asyncio.TimeoutError:
            pass
        self.close(qp=qp)

    def close(self, qp: bool = True) -> None:
        """Destroy the CM id (and the QP if ``qp``); no wait for the peer."""
        if self._destroyed:
            return
        self._destroyed = True
        self.channel._unregister(self._ptr, self)
        self._terminate(None)
        if qp and self.qp is not None:
            self.qp.close()
        self.cmid.close()


async def connect(channel: CmEventChannel, dst: str, port: int,
                  make_qp: Callable[[str], QueuePair], private_data: bytes | None = None, *,
                  src: str | None = None, responder_resources: int | None = None,
                  initiator_depth: int = 0, retry: int = 7, rnr_retry: int = 7,
                  timeout_ms: int = 3000,
                  before_rtr: Callable[[QueuePair], None] | None = None,
                  on_disconnect: Callable[[RdmaConnection], None] | None = None) -> RdmaConnection:
    """Active side: resolve, ``make_qp(dev_name)``, connect, finish on CONNECT_RESPONSE.

    ``responder_resources`` (RDMA READs we serve for the peer; default: the device's
    max_qp_rd_atom) must be > 0 if the peer is to RDMA READ from us (NVMe writes).
    ``before_rtr(qp)`` runs in INIT after the REP: post receives there.  Raises
    :class:`CmRejected` (with the NVMe-oF STS) or :class:`CmError`.
    """
    cmid = channel._new_cmid()
    conn = RdmaConnection(channel, cmid, None, on_disconnect)
    q = conn._setup
    assert q is not None

    async def expect(want: int, what: str) -> CmEvent:
        try:
            ev = await asyncio.wait_for(q.get(), timeout_ms / 1000 + 2)
        except asyncio.TimeoutError:
            raise CmError(f"{what}: timed out") from None
        if ev.type == want:
            return ev
        if ev.type == ce.RDMA_CM_EVENT_REJECTED:
            raise CmRejected(ev.status, ev.private_data)
        raise CmError(f"{what}: got {ev.name} (status {ev.status})")

    try:
        ai = AddrInfo(src=src, dst=dst, dst_service=str(port), port_space=ce.RDMA_PS_TCP)
        cmid.resolve_addr(ai, timeout_ms)
        await expect(ce.RDMA_CM_EVENT_ADDR_RESOLVED, f"resolving {dst}")
        cmid.resolve_route(timeout_ms)
        await expect(ce.RDMA_CM_EVENT_ROUTE_RESOLVED, f"route to {dst}")
        qp = conn.qp = make_qp(cmid.dev_name)
        rr = qp.device.max_qp_rd_atom if responder_resources is None else responder_resources
        cmid.connect(_conn_param(responder_resources=rr, initiator_depth=initiator_depth,
                                 qp_num=qp.qp_num, private_data=private_data,
                                 max_len=MAX_PRIVATE_DATA_CONNECT, retry=retry,
                                 rnr_retry=rnr_retry))
        ev = await expect(ce.RDMA_CM_EVENT_CONNECT_RESPONSE, f"connecting to {dst}:{port}")
        conn.peer_private_data = ev.private_data
        # INIT only now: before the REP the CM hands out access flags 0 (K:cma)
        _modify_from_cm(cmid, qp, e.IBV_QPS_INIT)
        if before_rtr is not None:
            before_rtr(qp)
        _modify_from_cm(cmid, qp, e.IBV_QPS_RTR)
        _modify_from_cm(cmid, qp, e.IBV_QPS_RTS, max_rd_atomic=qp.device.max_qp_init_rd_atom)
        conn.initiator_depth = qp.max_rd_atomic
        conn.responder_resources = rr
        cmid.establish()
    except PyverbsRDMAError as ex:
        conn.close()
        raise CmError(f"connect to {dst}:{port}: {ex}") from None
    except BaseException:
        conn.close()  # also closes the QP make_qp created
        raise
    conn._setup = None
    conn.established.set_result(None)
    # events that raced in after CONNECT_RESPONSE (e.g. an immediate DISCONNECTED)
    while not q.empty():
        conn._on_event(q.get_nowait())
    return conn
