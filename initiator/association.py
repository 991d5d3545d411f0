"""The association half of the host's :class:`initiator.controller.Controller`: set-up, auth,
enable, keep-alive, asynchronous events, reconnect and teardown.

``_establish`` opens the admin queue, runs Fabrics Connect (and DH-HMAC-CHAP when the target asks
for it: :mod:`initiator.auth`), enables the controller, reads its identity, opens the I/O queues
and scans the namespaces; a lost queue parks what was in flight and ``_reconnect`` establishes
the association again while ``ctrl_loss_tmo`` allows. Every command these send goes through the
controller's one command path (``_admin`` over ``_submit``/``_send``), which
:class:`initiator.controller.Controller` defines with the state both halves share (set in its
``__init__``, where the compiled lane finds it): this class is its base, not a second owner.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from initiator.auth import AuthFailed, HostAuth
from initiator.errors import ConnectError, NvmeError, QueueLost
from protocol.commands import (
    async_event_request_command, auth_receive_command, auth_send_command, connect_command, connect_data,
    identify_command, keep_alive_command, property_get_command, property_set_command, set_features_command,
)
from protocol.constants import (
    AEN_DW0_MASK, AEN_NS_ATTR_CHANGED, CAP_MPSMIN_SHIFT, CAP_TO_SHIFT, CAP_TO_UNIT, CC_EN, CC_IOCQES_16,
    CC_IOSQES_64, CC_SHN_NORMAL, CSTS_RDY, CSTS_SHST_COMPLETE, CSTS_SHST_MASK, DISCOVERY_NQN, DYNAMIC_CNTLID,
    FLBAS_FORMAT_MASK, NSATTR_WRITE_PROTECTED, OAES_ANA_CHANGE, OAES_NS_ATTR, Cns, FeatureId, LogPageId, Property,
)
from protocol.fabrics import CONNECT_AUTHREQ_ATR, IATTR_DATA
from protocol.identify import ACTIVE_NS_LIST, IDENTIFY_CONTROLLER, IDENTIFY_NAMESPACE, IDENTIFY_SIZE
from protocol.status import Status

if TYPE_CHECKING:
    from initiator.controller import Controller
    from initiator.params import ConnectParams
    from initiator.transport import QueueConnection

log = structlog.get_logger("blockd.initiator")

ADMIN_DEPTH = 32
CC_ENABLE = CC_IOCQES_16 | CC_IOSQES_64 | CC_EN
CC_SHUTDOWN = CC_ENABLE | CC_SHN_NORMAL
MAX_ATTEMPTS = 5
AER_TIMEOUT = 365 * 86400.0
"""An Asynchronous Event Request stays outstanding until an event: no practical timeout."""
CONNECT_IATTR_SUBNQN = IATTR_DATA | 256
"""Connect's Invalid Parameters pointing at SUBNQN in the Connect data: no such subsystem."""
AUTH_RECEIVE_SIZE = 4096
"""Authentication Receive's buffer: room for a Challenge with an ffdhe8192 value (as the
kernel's host, drivers/nvme/host/auth.c)."""

_EVENTS = OAES_NS_ATTR | OAES_ANA_CHANGE
"""The asynchronous events this host enables when the controller offers them."""

RETRYABLE = (OSError, NvmeError, asyncio.TimeoutError, ConnectionError)
"""What an attempt to establish an association may fail with and be tried again later."""


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


class Association:
    """Set-up, keep-alive, events, reconnect and teardown of a :class:`Controller`'s association.

    The base of :class:`Controller` only: it uses the state ``Controller.__init__`` sets and the
    command path it defines (``_admin``, ``_open_queue``, ``_park``/``_unpark``/``_fail_parked``,
    ``_set_live``/``_set_failed``/``_set_namespaces``, ``_start_sweep``)."""

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

    async def _establish(self) -> None:
        p = self.params
        if self._loop is None:
            self._start_sweep()
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

    def reset(self) -> None:
        """Drop the association and establish it again (the kernel's nvme_reset_ctrl): what
        was in flight is retried on the new one. The multipath layer's answer to a path whose
        ANA transition outlasts ANATT."""
        if self.admin is not None and not self.admin.closed and not self._closing:
            log.warning("resetting the association", subnqn=self.params.subnqn, traddr=self.params.traddr,
                        trsvcid=self.params.trsvcid)
            self.admin.close()

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
