"""The host side of one NVMe-oF association, as a library.

``await Controller.connect(ConnectParams(...))`` opens the admin queue and N I/O queues, enables
the controller and reads its identity; then ``read``/``write``/``flush``/``write_zeroes``/
``deallocate`` keep many commands in flight across the queues. A lost connection starts a
reconnect; commands that were in flight are sent again on the new association (block commands
are idempotent) or, once ``ctrl_loss_tmo`` passes, fail with :class:`QueueLost`.

Every I/O goes through :meth:`Controller.submit_io`, a callback API: the awaitable methods,
``transfer`` (byte ranges split at ``max_transfer``) and the FUSE mount are wrappers over it.
Admin commands take the same way (:meth:`Controller._submit`): one place sends, parks a command
that finds no live association or no free command id, retries after a lost queue and turns a
status into :class:`NvmeError`. Who writes which bytes of an SQE: a builder from
:mod:`protocol.commands` the command, :class:`HostQueue` the CID, the transport the SGL.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import importlib
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol

import structlog

from blockd.dataplane import twin
from blockd.iocounters import IoCounters
from initiator.auth import AuthFailed, HostAuth
from initiator.errors import ConnectError, NvmeError, QueueLost
from initiator.params import ConnectParams
from protocol.commands import (
    async_event_request_command, auth_receive_command, auth_send_command, connect_command, connect_data, describe_command, dsm_command,
    flush_command, get_log_page_command, identify_command, keep_alive_command, property_get_command,
    property_set_command, read_command, set_features_command, write_command, write_zeroes_command,
)
from protocol.constants import (
    AEN_DW0_MASK, AEN_NS_ATTR_CHANGED, CAP_MPSMIN_SHIFT, CAP_TO_SHIFT, CAP_TO_UNIT, CC_EN, CC_IOCQES_16,
    CC_IOSQES_64, CC_SHN_NORMAL, CSTS_RDY, CSTS_SHST_COMPLETE, CSTS_SHST_MASK, DISCOVERY_NQN, DYNAMIC_CNTLID,
    FLBAS_FORMAT_MASK, NSATTR_WRITE_PROTECTED, OAES_ANA_CHANGE, OAES_NS_ATTR, Cns, FeatureId, LogPageId, Property, TransportType,
)
from protocol.fabrics import CONNECT_AUTHREQ_ATR, IATTR_DATA
from protocol.identify import (
    ACTIVE_NS_LIST, IDENTIFY_CONTROLLER, IDENTIFY_NAMESPACE, IDENTIFY_SIZE,
)
from protocol.logpage import DISCOVERY_ENTRY, DISCOVERY_ENTRY_SIZE, DISCOVERY_HEADER, DISCOVERY_HEADER_SIZE
from protocol.nvme import DSM_ATTR_DEALLOCATE, DSM_RANGE_FAST
from protocol.status import Status

__all__ = ["ConnectError", "ConnectParams", "Controller", "IoDone", "NamespaceInfo", "NvmeError", "QueueLost",
           "discover"]

log = structlog.get_logger("blockd.initiator")

_queue = twin("initiator._queue")
HostCommand, HostQueue = _queue.HostCommand, _queue.HostQueue
Command, AdminCommand = _queue.Command, _queue.AdminCommand
"""The commands and queue every connection of this controller uses: the compiled set
(``initiator/_queue.pyx``) or its Python reference (:mod:`initiator.queue`), never a mix."""
IoLane: Any = getattr(twin("initiator._lane"), "IoLane", None)
"""The compiled steady-state ``transfer`` (``initiator/_lane.pyx``, which cimports the compiled
queue), None on the Python plane."""


ADMIN_DEPTH = 32
CC_ENABLE = CC_IOCQES_16 | CC_IOSQES_64 | CC_EN
CC_SHUTDOWN = CC_ENABLE | CC_SHN_NORMAL
MAX_ATTEMPTS = 5
AER_TIMEOUT = 365 * 86400.0
"""An Asynchronous Event Request stays outstanding until an event: no practical timeout."""
TIMEOUT_SWEEP = 0.5
"""Seconds between checks for commands past their deadline. One periodic sweep (as the Linux
block layer's request timer) instead of a timer armed and cancelled for every command."""
MAX_DISCOVERY_RECORDS = ((1 << 20) - DISCOVERY_HEADER_SIZE) // DISCOVERY_ENTRY_SIZE
"""Most discovery log entries read: header and entries in one 1 MiB read. NUMREC is 64 bits
wide and the log is read into one buffer of its size, so a discovery controller (which
answers any host) could otherwise have us allocate whatever it claims."""
CONNECT_IATTR_SUBNQN = IATTR_DATA | 256
"""Connect's Invalid Parameters pointing at SUBNQN in the Connect data: no such subsystem."""
AUTH_RECEIVE_SIZE = 4096
"""Authentication Receive's buffer: room for a Challenge with an ffdhe8192 value (as the
kernel's host, drivers/nvme/host/auth.c)."""

_EVENTS = OAES_NS_ATTR | OAES_ANA_CHANGE
"""The asynchronous events this host enables when the controller offers them."""

IoDone = Callable[[BaseException | None], None]
"""Callback of :meth:`Controller.submit_io`, called exactly once: None on success, else why the
command failed (:class:`NvmeError` with ``.status``, :class:`QueueLost`, ``TimeoutError``,
``ConnectionError``)."""

@dataclass(frozen=True)
class NamespaceInfo:
    nsid: int
    blocks: int
    block_size: int
    read_only: bool
    size: int = field(init=False, repr=False, compare=False)
    """Bytes: a field, not a property, as the FUSE mount checks it on every request."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", self.blocks * self.block_size)


@dataclass(frozen=True)
class DiscoveryEntry:
    trtype: int
    adrfam: int
    subtype: int
    portid: int
    trsvcid: str
    subnqn: str
    traddr: str

    @property
    def transport(self) -> str:
        try:
            return TransportType(self.trtype).name.lower()
        except ValueError:
            return str(self.trtype)


LostCallback = Callable[[Any, "Exception | None"], None]
"""What a transport calls once when its connection is gone (with why, if it knows)."""


class QueueConnection(Protocol):
    """What a transport's per-queue connection offers the controller."""

    queue: HostQueue
    inline_limit: int
    closed: bool
    connect_cattr: int
    """CATTR this transport's I/O queues are connected with (see protocol.fabrics)."""

    def submit(self, cmd: HostCommand) -> None:
        """Send ``cmd`` (the queue has room); transports that batch send it by the end of this
        loop iteration, or at ``release`` inside a hold."""

    def hold(self) -> None:
        """Keep what ``submit`` sends until ``release``, which sends it; holds nest."""

    def release(self) -> None: ...

    def close(self) -> None: ...


QueueOpener = Callable[[ConnectParams, HostQueue, LostCallback], Awaitable[QueueConnection]]
"""How every transport opens one queue: ``open_queue(params, queue, on_lost)`` in its module;
raises :class:`ConnectError` with one line for the user when it cannot."""

TRANSPORTS = {"tcp": "initiator.tcp", "rdma": "initiator.rdma"}
"""Transport name -> the module whose ``open_queue`` is its :data:`QueueOpener` (imported when
first used: the RDMA one needs pyverbs)."""


def queue_opener(transport: str) -> QueueOpener:
    try:
        module = TRANSPORTS[transport]
    except KeyError:
        raise ConnectError(f"unknown transport {transport!r} (use {' or '.join(TRANSPORTS)})") from None
    opener: QueueOpener = importlib.import_module(module).open_queue
    return opener


class _Gather:
    """``done`` of a :meth:`Controller.transfer` that took several commands: the caller's
    ``done`` once, when the last piece completed, with the first error."""

    __slots__ = ("left", "error", "done")

    def __init__(self, pieces: int, done: IoDone) -> None:
        self.left = pieces
        self.error: BaseException | None = None
        self.done = done

    def piece_done(self, exc: BaseException | None) -> None:
        if exc is not None and self.error is None:
            self.error = exc
        self.left -= 1
        if not self.left:
            self.done(self.error)


def _settle(fut: asyncio.Future[None], exc: BaseException | None) -> None:
    """``done`` of a command someone awaits."""
    if fut.done():  # the waiter was cancelled
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


RETRYABLE = (OSError, NvmeError, asyncio.TimeoutError, ConnectionError)
"""What an attempt to establish an association may fail with and be tried again later."""


class Controller:
    """A live association with one subsystem (see module docstring)."""

    def __init__(self, params: ConnectParams, lane: bool | None = None) -> None:
        """``lane``: serve steady-state transfers through the compiled :data:`IoLane` (default:
        when it is built; the differential test runs either)."""
        self.params = params
        self.cntlid = 0
        self.identity: Any = None
        self.namespaces: dict[int, NamespaceInfo] = {}
        self.max_transfer = 1 << 20
        self.admin: QueueConnection | None = None
        self.io: list[QueueConnection] = []
        self._open = queue_opener(params.transport)
        self._live = asyncio.Event()
        self._closing = False
        self._parked_io: collections.deque[Command] = collections.deque()
        self._parked_admin: collections.deque[Command] = collections.deque()
        """Commands waiting for a live association or a free command id, oldest first; sent
        by :meth:`_unpark` when a command completes or the association comes back."""
        self._on_done = self._complete  # bound once: every command's on_done
        self.counters = IoCounters()
        """This connection's I/O commands (blockd.iostats), counted at completion; latency
        from the last send (a retried command's from its retry) to the completion."""
        self._io_timeout = params.command_timeout
        self._establishing: set[QueueConnection] = set()
        """Connections of an association being set up: their commands go straight out (the
        association is not live yet) and fail, never retry."""
        self._held: list[QueueConnection] = []
        self._reconnect_task: asyncio.Task[None] | None = None
        self.reconnects = 0
        """Associations re-established after a lost connection (a metric)."""
        self.timeouts = 0
        """Commands failed for want of an answer in time (each reset its association)."""
        self._keep_alive_task: asyncio.Task[None] | None = None
        self._aer_task: asyncio.Task[None] | None = None
        self.namespace_listeners: list[Callable[[], None]] = []
        """Called after a namespace-changed event has refreshed ``namespaces``."""
        self.event_listeners: list[Callable[[int], None]] = []
        """Called with the completion DW0 of every other asynchronous event (the multipath
        layer's ANA change)."""
        self.failfast = False
        """Set by the multipath layer (initiator.multipath) on each of its paths: an I/O command
        that finds the association down fails at once with :class:`QueueLost`, to be sent on
        another path, instead of waiting here for this path's reconnect (the kernel's
        REQ_FAILFAST_TRANSPORT on a multipath request)."""
        self.failed: Exception | None = None
        self.was_live = False
        """The association was established once (a path still trying its first connect has not)."""
        self.first_error: Exception | None = None
        """Why the first attempt failed, for a controller connected with ``keep_trying``."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sweep: asyncio.TimerHandle | None = None
        self._secret, self._ctrl_secret = params.secrets()
        self._transaction = 0
        """T_ID of the next DH-HMAC-CHAP transaction (one per queue and authentication)."""
        self.lane: Any = None
        """The compiled lane, which mirrors the association's state: every change of ``_live``,
        ``failed`` or the namespace table goes through :meth:`_set_live`, :meth:`_set_failed`
        or :meth:`_set_namespaces`, which tell it (``IoLane.sync``)."""
        if IoLane is not None if lane is None else lane:
            self.lane = IoLane(self, Controller.transfer, self._complete, self._parked_io, self._parked_admin,
                                self._io_timeout)
            self.lane.sync(self._loop, self._live.is_set())
            # the lane's transfer shadows the method below (which it falls back to)
            self.transfer = self.lane.transfer  # type: ignore[method-assign]

    def _set_live(self, live: bool) -> None:
        """The association is live (or, with ``failed`` set, finished: waiters wake to see it).
        ``_establish`` replaces ``io``, ``max_transfer`` and the namespace table before it sets
        this, so the lane reads them again here."""
        if live:
            self._live.set()
        else:
            self._live.clear()
        if self.lane is not None:
            self.lane.sync(self._loop, self._live.is_set())

    def _set_failed(self, exc: Exception | None) -> None:
        """The controller gave up (or was closed): every later command fails."""
        self.failed = exc
        if self.lane is not None:
            self.lane.sync(self._loop, self._live.is_set())

    def _set_namespaces(self, table: dict[int, NamespaceInfo]) -> None:
        """A new namespace table (a scan, at connect or after a namespace-changed event)."""
        self.namespaces = table
        if self.lane is not None:
            self.lane.sync(self._loop, self._live.is_set())

    # -- association ------------------------------------------------------------------------------

    @classmethod
    async def connect(cls, params: ConnectParams, keep_trying: bool = False) -> Controller:
        """Establish the association; raises what failed. With ``keep_trying`` a first attempt
        that fails for a reason that may pass (:data:`RETRYABLE`: the target is down or
        refuses for now) is not raised: the controller goes on trying in the background as
        after a lost association (every ``reconnect_delay``, until ``ctrl_loss_tmo``), with
        ``was_live`` False until it succeeds and ``first_error`` saying why the first attempt
        failed. The multipath layer connects each path so (a path down at connect time joins
        when it comes up)."""
        ctrl = cls(params)
        try:
            await ctrl._establish()
        except RETRYABLE as exc:
            if not keep_trying:
                await ctrl.close()  # nothing keeps running for a controller the caller never gets
                raise
            ctrl.first_error = exc
            ctrl._reconnect_task = asyncio.get_running_loop().create_task(ctrl._reconnect())
        except BaseException:
            await ctrl.close()
            raise
        return ctrl

    async def _open_queue(self, qid: int, depth: int) -> QueueConnection:
        conn = await self._open(self.params, HostQueue(qid, depth), self._queue_lost)
        self._establishing.add(conn)
        return conn

    async def _establish(self) -> None:
        p = self.params
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._sweep = self._loop.call_later(TIMEOUT_SWEEP, self._sweep_timeouts)
        discovery = p.subnqn == DISCOVERY_NQN
        self.admin = await self._open_queue(0, ADMIN_DEPTH)
        try:
            kato_ms = int(p.keep_alive_tmo * 1000)
            self.cntlid = await self._fabrics_connect(self.admin, 0, ADMIN_DEPTH - 1, DYNAMIC_CNTLID, kato_ms)
            await self._enable()
            self.identity = IDENTIFY_CONTROLLER.parse(await self._identify(Cns.CONTROLLER, 0))
            if self.identity.cntlid != self.cntlid:
                raise ConnectError(f"Identify CNTLID {self.identity.cntlid} differs from Connect's {self.cntlid}")
            if self.identity.mdts:
                self.max_transfer = min(self.max_transfer, (1 << self.identity.mdts) * 4096)
            self.io = []
            if not discovery:
                await self._open_io_queues()
                await self._scan_namespaces()
                if self.identity.oaes & _EVENTS:
                    await self._admin(set_features_command(FeatureId.ASYNC_EVENT_CONFIG, self.identity.oaes & _EVENTS))
        except BaseException:
            self._close_connections()
            raise
        finally:
            self._establishing.clear()
        self._set_live(True)
        self.was_live = True
        if kato_ms and self._keep_alive_task is None:
            self._keep_alive_task = asyncio.get_running_loop().create_task(self._keep_alive())
        if not discovery and self._aer_task is None and self.identity.oaes & _EVENTS:
            self._aer_task = asyncio.get_running_loop().create_task(self._async_events())

    async def _open_io_queues(self) -> None:
        p = self.params
        want = max(1, p.nr_io_queues)
        cmd = await self._admin(set_features_command(FeatureId.NUMBER_OF_QUEUES, (want - 1) | ((want - 1) << 16)))
        granted = min(cmd.dw0 & 0xFFFF, cmd.dw0 >> 16) + 1  # NSQA, NCQA: 0's based, as asked
        depth = min(p.queue_size, self.identity.maxcmd or p.queue_size)
        inline = self.identity.ioccsz * 16 - 64
        for qid in range(1, min(want, granted) + 1):
            conn = await self._open_queue(qid, depth)
            conn.inline_limit = inline
            self.io.append(conn)
            await self._fabrics_connect(conn, qid, depth - 1, self.cntlid, 0, conn.connect_cattr)

    async def _scan_namespaces(self) -> None:
        raw = await self._identify(Cns.ACTIVE_NS_LIST, 0)
        found = {}
        for nsid in ACTIVE_NS_LIST.parse(raw):
            if nsid == 0:
                break
            ns = IDENTIFY_NAMESPACE.parse(await self._identify(Cns.NAMESPACE, nsid))
            fmt = ns.lbaf[ns.flbas & FLBAS_FORMAT_MASK]
            found[nsid] = NamespaceInfo(nsid, ns.nsze, 1 << fmt.lbads, bool(ns.nsattr & NSATTR_WRITE_PROTECTED))
        self._set_namespaces(found)

    async def _async_events(self) -> None:
        """Keep one Asynchronous Event Request outstanding (as the Linux host does); a
        namespace-attribute-changed event re-reads the namespace list and tells listeners."""
        while not self._closing:
            try:
                await self.wait_live()
                cmd = await self._admin(async_event_request_command(), timeout=AER_TIMEOUT)
                if cmd.dw0 & AEN_DW0_MASK == AEN_NS_ATTR_CHANGED:
                    await self.get_log_page(LogPageId.CHANGED_NS_LIST, 4096, nsid=0xFFFFFFFF)
                    await self._scan_namespaces()
                    log.info("namespaces changed", subnqn=self.params.subnqn, nsids=sorted(self.namespaces))
                    for listener in self.namespace_listeners:
                        listener()
                else:
                    for event_listener in self.event_listeners:
                        event_listener(cmd.dw0)
            except (QueueLost, ConnectionError, TimeoutError):
                if self.failed is not None or self._closing:
                    return
            except NvmeError as exc:
                log.info("target refuses asynchronous events", error=str(exc))
                return

    async def _fabrics_connect(self, conn: QueueConnection, qid: int, sqsize: int, cntlid: int,
                               kato_ms: int, cattr: int = 0) -> int:
        p = self.params
        data = connect_data(p.hostid.bytes, cntlid, p.subnqn, p.hostnqn)
        try:
            cmd = await self._admin(connect_command(qid, sqsize, kato_ms, cattr), data_out=data,
                                    timeout=p.connect_timeout, conn=conn)
        except NvmeError as exc:
            if exc.status == Status.CONNECT_INVALID_HOST:
                raise ConnectError(f"host {p.hostnqn} is not allowed to access {p.subnqn}") from exc
            if exc.status == Status.CONNECT_INVALID_PARAMETERS and exc.dw0 == CONNECT_IATTR_SUBNQN:
                raise ConnectError(f"target at {p.traddr}:{p.trsvcid} has no subsystem {p.subnqn}") from exc
            raise
        if cmd.dw0 & CONNECT_AUTHREQ_ATR:
            await self._authenticate(conn)
        elif self._ctrl_secret is not None:  # asked to authenticate the controller: no downgrade
            raise ConnectError(f"{p.subnqn} did not ask for authentication, and "
                               "--dhchap-ctrl-secret wants the controller authenticated")
        return cmd.dw0 & 0xFFFF

    async def _authenticate(self, conn: QueueConnection) -> None:
        """DH-HMAC-CHAP on the queue just connected (initiator/auth.py says the steps)."""
        p = self.params
        if self._secret is None:
            raise ConnectError(f"{p.subnqn} requires authentication: give --dhchap-secret")
        self._transaction = (self._transaction + 1) & 0xFFFF
        auth = HostAuth(self._secret, self._ctrl_secret, p.hostnqn, p.subnqn, self._transaction)

        async def send(message: bytes) -> None:
            await self._admin(auth_send_command(len(message)), data_out=message,
                              timeout=p.connect_timeout, conn=conn)

        async def receive() -> bytes:
            buf = bytearray(AUTH_RECEIVE_SIZE)
            await self._admin(auth_receive_command(AUTH_RECEIVE_SIZE), data_in=memoryview(buf),
                              timeout=p.connect_timeout, conn=conn)
            return bytes(buf)

        try:
            await send(auth.negotiate())
            await send(auth.challenge(await receive()))
            success2 = auth.success1(await receive())
            if success2 is not None:
                await send(success2)
        except AuthFailed as exc:
            if exc.failure2 is not None:
                await send(exc.failure2)
            raise ConnectError(f"authentication with {p.subnqn} failed: {exc}") from None
        except ConnectError:
            raise
        except ConnectionError as exc:
            # the kernel's nvmet tears the association down right after its Failure1, so
            # the connection may close before the Failure1 arrives
            raise ConnectError(f"authentication with {p.subnqn} failed: "
                               f"the target closed the connection ({exc})") from None

    async def _enable(self) -> None:
        cap = await self.get_property(Property.CAP, 8)
        if (cap >> CAP_MPSMIN_SHIFT) & 0xF:
            raise ConnectError("controller requires pages larger than 4 KiB")
        await self.set_property(Property.CC, CC_ENABLE & ~CC_EN)
        await self.set_property(Property.CC, CC_ENABLE)
        deadline = time.monotonic() + ((cap >> CAP_TO_SHIFT) & 0xFF) * CAP_TO_UNIT + 0.5
        while not await self.get_property(Property.CSTS, 4) & CSTS_RDY:
            if time.monotonic() > deadline:
                raise ConnectError("controller did not become ready")
            await asyncio.sleep(0.002)

    async def get_property(self, offset: int, size: int) -> int:
        cmd = await self._admin(property_get_command(offset, size))
        return cmd.dw0 | (cmd.dw1 << 32)

    async def set_property(self, offset: int, value: int) -> None:
        await self._admin(property_set_command(offset, value))

    # -- the one way a command goes out ------------------------------------------------------------

    def submit_io(self, sqe: bytearray, data_out: bytes | memoryview | None, data_in: memoryview | None,
                  done: IoDone) -> None:
        """Send the I/O command ``sqe`` (from a :mod:`protocol.commands` builder) with the data
        it writes or the buffer its data is read into; ``done`` runs once (see :data:`IoDone`).

        Live with a queue that has room, the command goes out now and ``done`` runs from the
        transport's receive callback (no Task, no Future); else it waits for the association
        or room, and after a lost queue it is sent again while the reconnect policy allows."""
        cmd = Command(sqe, data_out, data_in, self._on_done)
        cmd.done = done
        cmd.timeout = self._io_timeout
        self._submit(cmd)

    def _submit(self, cmd: Command) -> None:
        """Send ``cmd`` now if the association is live and its queue has room, else park it."""
        if self.failed is None and self._live.is_set():
            if cmd.admin:
                conn = self.admin
                if not conn.queue.has_room:
                    conn = None
            else:
                conn = self._io_with_room()
            if conn is not None and not conn.closed:
                self._send(conn, cmd)
                return
        self._park(cmd)

    def _send(self, conn: QueueConnection, cmd: Command) -> None:
        cmd.deadline = self._loop.time() + cmd.timeout
        cmd.sent_ns = time.monotonic_ns()
        conn.hold()  # out now, not at the end of the loop iteration (unless held further up)
        try:
            conn.submit(cmd)
        finally:
            conn.release()

    def _park(self, cmd: Command) -> None:
        if self.failed is not None:
            cmd.fail(QueueLost(f"connection to {self.params.subnqn} lost: {self.failed}"))
        elif self.failfast and not cmd.admin and not self._live.is_set():
            cmd.fail(QueueLost(f"path {self.params.traddr}:{self.params.trsvcid} is down"))
        else:
            (self._parked_admin if cmd.admin else self._parked_io).append(cmd)

    def _unpark(self) -> None:
        """Send parked commands, oldest first, while the association is live and has room."""
        for parked in (self._parked_admin, self._parked_io):
            while parked and self.failed is None and self._live.is_set():
                cmd = parked.popleft()
                self._submit(cmd)
                if parked and parked[-1] is cmd:  # parked again: no room left
                    parked.rotate(1)  # back to the front, its turn kept
                    break
        if self.failed is not None:
            self._fail_parked()

    def _fail_parked(self) -> None:
        exc = QueueLost(f"connection to {self.params.subnqn} lost: {self.failed}")
        for parked in (self._parked_admin, self._parked_io):
            while parked:
                parked.popleft().fail(exc)

    def _complete(self, cmd: Command, exc: BaseException | None) -> None:
        """Every command's ``on_done``: a status becomes :class:`NvmeError` (here only), the
        freed command id goes to a parked command, then the caller's ``done`` runs."""
        if exc is None and cmd.status:
            exc = NvmeError(cmd.status, describe_command(cmd.sqe, cmd.admin), cmd.dw0)
        if not cmd.admin:
            cmd.count(self.counters, time.monotonic_ns())
            if exc is not None:
                self.counters.add_error(cmd.status or type(exc).__name__)
        if self._parked_io or self._parked_admin:
            self._unpark()
        cmd.done(exc)

    async def _admin(self, sqe: bytearray, data_out: bytes | None = None, data_in: memoryview | None = None,
                     timeout: float | None = None, conn: QueueConnection | None = None) -> HostCommand:
        """Send an admin (or fabrics) command and wait for it; raises :class:`NvmeError`. While
        an association is being set up its commands go straight out on its connection ``conn``
        (the admin queue by default)."""
        cmd = AdminCommand(sqe, data_out, data_in, self._on_done)
        cmd.timeout = timeout or self._io_timeout
        fut = self._loop.create_future()
        cmd.done = functools.partial(_settle, fut)
        conn = conn or self.admin
        if conn in self._establishing:
            self._send(conn, cmd)
        else:
            self._submit(cmd)
        await fut
        return cmd

    async def admin_command(self, sqe: bytearray, data_out: bytes | None = None,
                            data_in: memoryview | None = None) -> HostCommand:
        """Send an admin command (built with :mod:`protocol.commands`) once the association is
        live; returns it (``dw0``/``dw1`` hold the result); raises :class:`NvmeError`."""
        await self.wait_live()
        return await self._admin(sqe, data_out, data_in)

    def _sweep_timeouts(self) -> None:
        """Fail commands past their deadline and reset the association of their queue (their
        command ids cannot be reused safely); the rest in flight is retried after reconnecting."""
        now = self._loop.time()
        for conn in (self.admin, *self.io):
            if conn is None:
                continue
            expired = conn.queue.expired(now)
            self.timeouts += len(expired)
            for cmd in expired:
                conn.queue.finish(cmd.cid)
                what = describe_command(cmd.sqe, conn is self.admin)
                cmd.fail(TimeoutError(f"{what} timed out on queue {conn.queue.qid}"))
                log.warning("command timed out; resetting the association", qid=conn.queue.qid, cid=cmd.cid)
            if expired:
                conn.close()
        if not (self._closing and self.failed is not None):  # close() still times its shutdown
            self._sweep = self._loop.call_later(TIMEOUT_SWEEP, self._sweep_timeouts)

    async def _identify(self, cns: int, nsid: int) -> bytes:
        buf = bytearray(IDENTIFY_SIZE)
        await self._admin(identify_command(cns, nsid), data_in=memoryview(buf))
        return bytes(buf)

    async def identify_controller(self) -> Any:
        await self.wait_live()
        return IDENTIFY_CONTROLLER.parse(await self._identify(Cns.CONTROLLER, 0))

    async def identify_namespace(self, nsid: int) -> Any:
        await self.wait_live()
        return IDENTIFY_NAMESPACE.parse(await self._identify(Cns.NAMESPACE, nsid))

    async def get_log_page(self, lid: int, length: int, offset: int = 0, nsid: int = 0,
                           rae: bool = False, lsp: int = 0) -> bytes:
        buf = bytearray(length)
        await self.admin_command(get_log_page_command(lid, length // 4 - 1, offset, nsid, rae, lsp),
                                 data_in=memoryview(buf))
        return bytes(buf)

    async def discovery_log(self) -> list[DiscoveryEntry]:
        header = DISCOVERY_HEADER.parse(await self.get_log_page(LogPageId.DISCOVERY, DISCOVERY_HEADER_SIZE, rae=True))
        if header.numrec > MAX_DISCOVERY_RECORDS:
            raise ConnectError(f"discovery log at {self.params.traddr}:{self.params.trsvcid} claims "
                               f"{header.numrec} entries; at most {MAX_DISCOVERY_RECORDS} are read")
        total = DISCOVERY_HEADER_SIZE + header.numrec * DISCOVERY_ENTRY_SIZE
        page = await self.get_log_page(LogPageId.DISCOVERY, total)
        entries = []
        for i in range(header.numrec):
            e = DISCOVERY_ENTRY.parse(page[DISCOVERY_HEADER_SIZE + i * DISCOVERY_ENTRY_SIZE:][:DISCOVERY_ENTRY_SIZE])
            entries.append(DiscoveryEntry(e.trtype, e.adrfam, e.subtype, e.portid,
                                          e.trsvcid.strip(), e.subnqn, e.traddr.strip()))
        return entries

    def namespace(self, nsid: int) -> NamespaceInfo:
        try:
            return self.namespaces[nsid]
        except KeyError:
            raise NvmeError(Status.INVALID_NS, f"namespace {nsid} of {self.params.subnqn}") from None

    def _io_with_room(self) -> QueueConnection | None:
        """The first I/O queue with room, None when all are full. This host is one thread, so
        spreading commands over queues buys no parallelism here; packing them onto one
        connection lets both ends take several capsules per receive and send several replies
        at once (measured: ~10% less CPU per 4 KiB I/O with four FUSE jobs). Further queues
        take the overflow."""
        for conn in self.io:
            if conn.queue.has_room:
                return conn
        return None

    # -- wrappers over submit_io --------------------------------------------------------------------

    def transfer(self, write: bool, nsid: int, offset: int, buf: memoryview, done: IoDone,
                 fua: bool = False) -> None:
        """Read into or write from ``buf`` the block-aligned byte range at ``offset`` (any length
        inside the namespace; a ValueError here otherwise): one command per ``max_transfer``
        bytes, this being the one place that splits; ``done`` once, when all completed, with
        the first error."""
        length = len(buf)
        bs = self.check_range(nsid, offset, length).block_size
        if 0 < length <= self.max_transfer:
            if write:
                self.submit_io(write_command(nsid, offset // bs, length // bs - 1, fua), buf, None, done)
            else:
                self.submit_io(read_command(nsid, offset // bs, length // bs - 1), None, buf, done)
            return
        if not length:
            done(None)
            return
        step = self.max_transfer - self.max_transfer % bs
        piece_done = _Gather(-(-length // step), done).piece_done
        for pos in range(0, length, step):
            piece = buf[pos:pos + step]
            slba, nlb0 = (offset + pos) // bs, len(piece) // bs - 1
            if write:
                self.submit_io(write_command(nsid, slba, nlb0, fua), piece, None, piece_done)
            else:
                self.submit_io(read_command(nsid, slba, nlb0), None, piece, piece_done)

    async def _wait(self, start: Callable[[IoDone], None]) -> None:
        """Await a callback-API call: ``start(done)``, then the Future ``done`` settles."""
        fut = self._loop.create_future()
        start(functools.partial(_settle, fut))
        await fut

    async def io_command(self, sqe: bytearray, data_out: bytes | memoryview | None = None,
                         data_in: memoryview | None = None) -> None:
        """Awaitable :meth:`submit_io`: raises :class:`NvmeError` and the rest of :data:`IoDone`."""
        await self._wait(functools.partial(self.submit_io, sqe, data_out, data_in))

    async def read_into(self, nsid: int, slba: int, buf: memoryview) -> None:
        """Read ``len(buf)`` bytes (whole blocks, at most ``max_transfer``: one command, the
        range checked by the target) at block ``slba`` into ``buf``."""
        await self.io_command(read_command(nsid, slba, self._nlb0(nsid, buf)), data_in=buf)

    async def read(self, nsid: int, slba: int, nblocks: int) -> bytearray:
        buf = bytearray(nblocks * self.namespace(nsid).block_size)
        await self.read_into(nsid, slba, memoryview(buf))
        return buf

    async def write(self, nsid: int, slba: int, data: bytes | memoryview, fua: bool = False) -> None:
        """Write ``data`` (whole blocks, at most ``max_transfer``: one command) at block ``slba``."""
        await self.io_command(write_command(nsid, slba, self._nlb0(nsid, data), fua), data_out=data)

    def _nlb0(self, nsid: int, data: bytes | bytearray | memoryview) -> int:
        """The 0's based block count of ``data``; a ValueError (not a malformed command) when it
        is not a whole number of blocks, or more than one command may carry."""
        bs = self.namespace(nsid).block_size
        n = len(data)
        if not n or n % bs or n > self.max_transfer:
            raise ValueError(f"{n} bytes is not 1 to {self.max_transfer // bs} blocks of "
                             f"{bs} bytes on namespace {nsid}")
        return n // bs - 1

    async def read_bytes(self, nsid: int, offset: int, length: int) -> bytearray:
        """Read a block-aligned byte range of any size."""
        buf = bytearray(length)
        await self._wait(functools.partial(self.transfer, False, nsid, offset, memoryview(buf)))
        return buf

    async def write_bytes(self, nsid: int, offset: int, data: bytes | memoryview, fua: bool = False) -> None:
        await self._wait(functools.partial(self.transfer, True, nsid, offset, memoryview(data), fua=fua))

    async def flush(self, nsid: int) -> None:
        await self.io_command(flush_command(nsid))

    async def write_zeroes(self, nsid: int, slba: int, nblocks: int, deallocate: bool = False) -> None:
        await self.io_command(write_zeroes_command(nsid, slba, nblocks - 1, deallocate))

    async def deallocate(self, nsid: int, ranges: list[tuple[int, int]]) -> None:
        """Dataset Management / deallocate of (slba, nblocks) ranges (trim)."""
        if not 1 <= len(ranges) <= 256:
            raise ValueError("between 1 and 256 ranges per deallocate")
        data = b"".join(DSM_RANGE_FAST.pack(0, nlb, slba) for slba, nlb in ranges)
        await self.io_command(dsm_command(nsid, len(ranges) - 1, DSM_ATTR_DEALLOCATE), data_out=data)

    def hold_sends(self) -> None:
        """Hold the I/O queues' sends until :meth:`release_sends` (see ``QueueConnection.hold``):
        a caller about to submit several commands (the FUSE mount draining its requests) lets
        them leave together. Not nested."""
        self._held = list(self.io)
        for conn in self._held:
            conn.hold()

    def release_sends(self) -> None:
        held, self._held = self._held, []
        for conn in held:
            conn.release()

    def check_range(self, nsid: int, offset: int, length: int) -> NamespaceInfo:
        """The namespace, once ``offset``/``length`` are block-aligned and inside it (ValueError else)."""
        info = self.namespaces.get(nsid) or self.namespace(nsid)
        bs = info.block_size
        if offset % bs or length % bs:
            raise ValueError(f"offset {offset} and length {length} must be multiples of the "
                             f"{bs}-byte block size")
        if offset < 0 or offset + length > info.size:
            raise ValueError(f"range {offset}+{length} is outside namespace {nsid} ({info.size} bytes)")
        return info

    @property
    def state(self) -> str:
        """One of live, reconnecting (or still trying a first time, see :meth:`connect`) or
        failed (gave up after ``ctrl_loss_tmo``)."""
        if self.failed is not None:
            return "failed"
        return "live" if self._live.is_set() else "reconnecting"

    # -- failures, keep-alive, reconnect ----------------------------------------------------------------

    async def wait_live(self) -> None:
        """Return once the association is live; QueueLost once it gave up (or was closed)."""
        if self.failed is not None:
            raise QueueLost(f"connection to {self.params.subnqn} lost: {self.failed}")
        if not self._live.is_set():
            await self._live.wait()
            if self.failed is not None:
                raise QueueLost(f"connection to {self.params.subnqn} lost: {self.failed}")

    def _queue_lost(self, conn: QueueConnection, exc: Exception | None) -> None:
        """A transport's connection is gone: its commands in flight are parked to go again on
        the next association (at most ``MAX_ATTEMPTS`` times), and a reconnect starts."""
        orphans = conn.queue.take_all()
        if self._closing or conn in self._establishing:
            for cmd in orphans:
                cmd.fail(QueueLost(f"queue {conn.queue.qid} closed"))
            return
        if self._reconnect_task is None:
            log.warning("connection lost; reconnecting", subnqn=self.params.subnqn,
                        qid=conn.queue.qid, error=str(exc) if exc else "closed by peer")
            self._set_live(False)
            self._close_connections()
            self._reconnect_task = asyncio.get_running_loop().create_task(self._reconnect())
        for cmd in orphans:
            cmd.attempts += 1
            if cmd.attempts > MAX_ATTEMPTS:
                cmd.fail(QueueLost("command failed after repeated reconnects"))
            else:
                self._park(cmd)

    async def _reconnect(self) -> None:
        """Establish the association again (or, after a first attempt that failed, at all)."""
        p = self.params
        deadline = time.monotonic() + p.ctrl_loss_tmo
        last: Exception | None = self.first_error
        again = self.was_live
        try:
            while time.monotonic() < deadline and not self._closing:
                await asyncio.sleep(p.reconnect_delay)
                try:
                    await self._establish()
                except RETRYABLE as exc:
                    last = exc
                    continue
                if again:
                    self.reconnects += 1
                log.info("reconnected" if again else "connected after retrying", subnqn=p.subnqn,
                         traddr=p.traddr, trsvcid=p.trsvcid, cntlid=self.cntlid,
                         retrying=len(self._parked_io) + len(self._parked_admin))
                self._unpark()
                return
            self._set_failed(last or QueueLost("closed"))
            self._fail_parked()
            self._set_live(True)  # wake waiters so they see ``failed``
        finally:
            self._reconnect_task = None

    async def _keep_alive(self) -> None:
        interval = self.params.keep_alive_tmo / 2
        while not self._closing:
            await asyncio.sleep(interval)
            if not self._live.is_set() or self.failed is not None:
                continue
            try:
                await self._admin(keep_alive_command(), timeout=self.params.keep_alive_tmo)
            except (NvmeError, QueueLost, TimeoutError, ConnectionError) as exc:
                log.warning("keep-alive failed", error=str(exc))

    def _close_connections(self) -> None:
        for conn in self.io:
            conn.close()
        if self.admin is not None:
            self.admin.close()

    async def close(self) -> None:
        """Clean disconnect: I/O queues first, then CC.SHN on the admin queue (as Linux does)."""
        if self._closing:
            return
        self._closing = True
        for task in (self._keep_alive_task, self._aer_task):
            if task is not None:
                task.cancel()
        if self._reconnect_task is not None:
            self._reconnect_task.cancel()
        for conn in self.io:
            conn.close()
        if self._live.is_set() and self.failed is None and self.admin is not None and not self.admin.closed:
            try:
                await self.set_property(Property.CC, CC_SHUTDOWN)
                deadline = time.monotonic() + 5
                while (await self.get_property(Property.CSTS, 4) & CSTS_SHST_MASK != CSTS_SHST_COMPLETE
                       and time.monotonic() < deadline):
                    await asyncio.sleep(0.01)
            except (NvmeError, QueueLost, TimeoutError, ConnectionError):
                pass
        self._close_connections()
        if self.failed is None:  # later or waiting commands fail instead of spinning or hanging
            self._set_failed(QueueLost("disconnected"))
        self._fail_parked()
        self._set_live(True)
        if self._sweep is not None:
            self._sweep.cancel()

    async def __aenter__(self) -> Controller:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def discover(traddr: str, trsvcid: int, transport: str = "tcp", hostnqn: str | None = None,
                   timeout: float = 5.0, dhchap_secret: str | None = None,
                   dhchap_ctrl_secret: str | None = None) -> list[DiscoveryEntry]:
    """Read the discovery log of a target (non-persistent discovery controller, KATO 0); the
    secrets serve a discovery controller that asks for authentication."""
    params = ConnectParams(traddr=traddr, subnqn=DISCOVERY_NQN, trsvcid=trsvcid,
                           transport=transport, keep_alive_tmo=0, connect_timeout=timeout,
                           dhchap_secret=dhchap_secret, dhchap_ctrl_secret=dhchap_ctrl_secret,
                           command_timeout=timeout, ctrl_loss_tmo=0, **({"hostnqn": hostnqn} if hostnqn else {}))
    ctrl = await Controller.connect(params)
    try:
        return await ctrl.discovery_log()
    finally:
        await ctrl.close()
