"""The target as a whole: subsystems, live controllers, ports, discovery and keep-alive."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import structlog

from target.config import Limits, ReferralConfig
from protocol.constants import (
    AEN_DISCOVERY_CHANGED, AEN_NS_ATTR_CHANGED, DISCOVERY_NQN, DYNAMIC_CNTLID,
    TREQ_SECURE_CHANNEL_NOT_SPECIFIED, TREQ_SQFLOW_DISABLE_SUPPORTED, AddressFamily, AnaState, SubsystemType,
)
from protocol.fabrics import IPO_CONNECT_CNTLID, IPO_CONNECT_QID, IPO_CONNECT_SQSIZE, IPO_CONNECT_SUBNQN
from protocol.logpage import DISCOVERY_ENTRY, DISCOVERY_HEADER
from protocol.status import Status
from target.ana import AnaStates
from target.controller import MQES, Controller
from target.io_fast import uring_queues
from target.limits import ConnectionCount, DataBudget, UnsentTotal
from target.queue import TargetQueue
from target.rejections import KEEP_ALIVE_TIMEOUT, Rejections
from target.subsystem import Namespace, Subsystem
from target.transport import transport_info

log = structlog.get_logger("blockd.target")

ADMIN_QUEUE_MAX = 32
_TREQ = TREQ_SECURE_CHANNEL_NOT_SPECIFIED | TREQ_SQFLOW_DISABLE_SUPPORTED
"""What nvmet says for a port without TLS: no secure channel requirement stated, and the host may
disable SQ flow control (the queue honours Connect's CATTR bit, see TargetQueue.sqhd_disabled)."""


@dataclass(frozen=True)
class PortInfo:
    """A listening port, as the discovery log describes it."""

    port_id: int
    transport: str
    """The transport's configuration name (see :func:`target.transport.transport_info`)."""
    address: str
    service: str
    list_all: bool = False
    """Its discovery log lists every port's entries, not only its own (target.config, ``discovery``)."""
    referrals: tuple[ReferralConfig, ...] = ()
    """Discovery controllers its discovery log refers hosts to."""

    @property
    def family(self) -> int:
        return _family(self.address)


def _family(address: str) -> int:
    return AddressFamily.IPV6 if ":" in address else AddressFamily.IPV4


class Target:
    """Everything the transports share; transports call into it, never the reverse."""

    def __init__(self, max_io_queues: int = 16, limits: Limits = Limits(), threaded_queues: bool = True,
                 io_uring_queues: bool = False, sqpoll_idle_ms: int = 0, spin_us: int = 0) -> None:
        self.subsystems: dict[str, Subsystem] = {DISCOVERY_NQN: Subsystem(DISCOVERY_NQN, serial="discovery", model="blockd discovery")}
        self.controllers: dict[int, Controller] = {}
        self.ports: dict[int, PortInfo] = {}
        self.max_io_queues = max_io_queues
        self.limits = limits
        self.threaded_queues = threaded_queues
        """NVMe/TCP I/O queues in the steady state are served by a thread of their own (the
        compiled plane only; docs/dataplane.md, "The target's threaded queue")."""
        self.io_uring_queues, self.queue_loop_reason = uring_queues(io_uring_queues and threaded_queues,
                                                                    sqpoll_idle_ms)
        """Those threads receive, read or write and send through an io_uring each (asked for,
        and this kernel and plane can; docs/dataplane.md, "The target's io_uring queue loop");
        else why not."""
        self.sqpoll_idle_ms = sqpoll_idle_ms if self.io_uring_queues else 0
        """Those rings are made with SQPOLL and this idle time when > 0 (``[target] io_uring_sqpoll``)."""
        self.spin_us = spin_us if self.sqpoll_idle_ms else 0
        """With SQPOLL, the queue threads' bounded spin on their rings (``[target] io_uring_spin_us``)."""
        self.rejections = Rejections()
        """Hostile or over-limit input refused, by reason (a metric)."""
        self.connections = ConnectionCount(limits.max_connections, limits.max_connections_per_host,
                                           self.rejections)
        self.r2t_budget = DataBudget(limits.r2t_budget_total)
        """Write data buffers asked for with R2T, over every queue (see target.limits)."""
        self.unsent = UnsentTotal(limits.max_unsent_total)
        """Replies waiting in the NVMe/TCP sockets, over every queue."""
        self.rdma_recv = DataBudget(limits.rdma_recv_total)
        """Receive buffers posted by every NVMe/RDMA queue."""
        self.genctr = 1
        self._next_cntlid: dict[str, int] = {}
        """Per subsystem, where the search for a free controller id starts."""
        self.ana = AnaStates()
        """The ANA state of every port and group (target.ana)."""
        self._reaper: asyncio.Task[None] | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        """Commands that wait (an fsync, a slow backend, an AER), on every queue: drained at
        shutdown."""
        self.draining: list[Namespace] = []
        """Removed namespaces whose backend still serves commands in flight (closed by
        :meth:`namespace_released` after the last, or at :meth:`close`)."""
        self._close_waiters: dict[int, asyncio.Future[None]] = {}
        """id(namespace) -> what :meth:`until_closed` waits on, for a namespace in ``draining``."""

    # -- configuration ----------------------------------------------------------------------------

    def add_port(self, port: PortInfo) -> None:
        self.ports[port.port_id] = port
        self._discovery_changed()

    def remove_port(self, port_id: int) -> None:
        self.ports.pop(port_id, None)
        self._discovery_changed()

    def add_subsystem(self, sub: Subsystem) -> None:
        if sub.nqn in self.subsystems:
            raise ValueError(f"subsystem {sub.nqn} already exists")
        self.subsystems[sub.nqn] = sub
        self._discovery_changed()

    def remove_subsystem(self, nqn: str) -> None:
        sub = self.subsystems.pop(nqn)
        for ctrl in [c for c in self.controllers.values() if c.subsystem is sub]:
            ctrl.shutdown("subsystem removed")
        for ns in sub.namespaces.values():
            self._retire(ns)  # its controllers' commands still waiting on the backend finish first
        self._discovery_changed()

    def add_namespace(self, sub: Subsystem, ns: Namespace) -> None:
        sub.add_namespace(ns)
        sub.reopening.discard(ns.nsid)
        self._ns_changed(sub, ns.nsid)

    def remove_namespace(self, sub: Subsystem, nsid: int, reopen: bool = False) -> None:
        """New commands for ``nsid`` fail with Invalid Namespace from now on; those already
        parsed against it run to their end on the backend, which closes after the last.

        ``reopen``: the same namespace is added again (:meth:`add_namespace`) once its old copy
        has closed. Meanwhile its commands get Internal Path Error (no DNR: hosts send them again)
        and hosts are not told of a change: the Linux host drops a namespace missing from the
        Active Namespace ID list at its next scan, and with it the block device a file system
        may be mounted on (nvmet's disable/enable of a namespace does drop it)."""
        ns = sub.namespaces.pop(nsid)
        self._retire(ns)
        if reopen:
            sub.reopening.add(nsid)
        self._ns_changed(sub, None if reopen else nsid)

    def reopen_failed(self, sub: Subsystem, nsid: int) -> None:
        """The namespace :meth:`remove_namespace` closed to reopen could not be opened again: it
        is gone, and hosts are told."""
        sub.reopening.discard(nsid)
        self._ns_changed(sub, nsid)

    def check_resize(self, sub: Subsystem, nsid: int, size: int | None) -> None:
        """Refuse (ValueError, the message for the user) a size the namespace cannot take now:
        not whole blocks, or smaller while a host is connected to its subsystem (a host may
        have data or a file system past the new end; nvmet leaves this to the administrator,
        we refuse it)."""
        ns = sub.namespaces.get(nsid)
        if ns is None:
            raise ValueError(f"{sub.nqn} has no namespace {nsid}")
        if size is None:
            return
        if size <= 0 or size % ns.block_size:
            raise ValueError(f"{sub.nqn} namespace {nsid}: size {size} is not a positive multiple "
                             f"of the block size {ns.block_size}")
        if size < ns.backend.size and self._users(sub, ns):
            raise ValueError(
                f"{sub.nqn} namespace {nsid}: will not shrink from {ns.backend.size} to {size} "
                f"bytes while {self._users(sub, ns)} host(s) are connected (data past the new end "
                f"may be in use); disconnect them first")

    def _users(self, sub: Subsystem, ns: Namespace) -> int:
        """Hosts connected to ``sub`` (1 at least while a command still holds ``ns``)."""
        return max(sum(c.subsystem is sub for c in self.controllers.values()), bool(ns.in_flight))

    def resize_namespace(self, sub: Subsystem, nsid: int, size: int | None) -> tuple[int, int]:
        """Give namespace ``nsid`` a new capacity (None: its storage's current size, after the
        file grew) and tell every connected host with a Namespace Attribute Changed event and
        the Changed Namespace List, as nvmet's ``nvmet_ns_revalidate``; Identify Namespace
        reads the new size at once. Returns (old size, new size)."""
        self.check_resize(sub, nsid, size)
        ns = sub.namespaces[nsid]
        old = ns.backend.size
        new = ns.backend.resize(size)
        if new % ns.block_size:
            ns.backend.resize(old)
            raise ValueError(f"{sub.nqn} namespace {nsid}: {ns.path} is {new} bytes, not whole "
                             f"{ns.block_size}-byte blocks")
        if new < old and self._users(sub, ns):
            ns.backend.resize(old)  # the file shrank under us: serve the old size (zeroes back)
            raise ValueError(f"{sub.nqn} namespace {nsid}: {ns.path} shrank to {new} bytes while in use")
        if new != old:
            log.info("namespace resized", nqn=sub.nqn, nsid=nsid, old=old, new=new)
            self._ns_changed(sub, nsid)
        return old, new

    def _retire(self, ns: Namespace) -> None:
        ns.removed = True
        if ns.fast is not None:
            ns.fast.accessible = False  # the compiled path leaves it to the Python queue's checks
        if ns.in_flight:
            self.draining.append(ns)
        else:
            ns.backend.close()

    def namespace_released(self, ns: Namespace) -> None:
        """A command let go of a removed namespace: close its backend if it was the last (the
        core calls this only for removed namespaces, so the per-I/O cost is one flag test)."""
        if not ns.in_flight:
            self.draining.remove(ns)
            ns.backend.close()
            self._closed_now(ns)

    async def until_closed(self, ns: Namespace, timeout: float) -> bool:
        """Wait until removed ``ns`` has let go of its storage (its last command done, its
        backend closed); False if that took longer than ``timeout``. A reload that opens the same
        storage again waits here: a replicated namespace's new copy must read the write-intent
        bits after the old copy's last write set them, or a region the replica missed would
        never be resynced."""
        if ns not in self.draining:
            return True
        waiter = self._close_waiters.setdefault(id(ns), asyncio.get_running_loop().create_future())
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout)
        except TimeoutError:
            return False
        return True

    def _closed_now(self, ns: Namespace) -> None:
        waiter = self._close_waiters.pop(id(ns), None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def update_access(self, sub: Subsystem, allow_any_host: bool, hosts: set[str]) -> None:
        """Change who may connect; controllers of hosts no longer allowed are torn down."""
        sub.allow_any_host = allow_any_host
        sub.hosts = set(hosts)
        for ctrl in [c for c in self.controllers.values() if c.subsystem is sub]:
            if not sub.allows(ctrl.hostnqn):
                ctrl.shutdown("host no longer allowed")
        self._discovery_changed()

    def _ns_changed(self, sub: Subsystem, nsid: int | None) -> None:
        """Every controller of ``sub`` recomputes what it serves; told of ``nsid`` by the
        Namespace Attribute Changed event (None: no event, as for a namespace reopening)."""
        for ctrl in self.controllers.values():
            if ctrl.subsystem is sub:
                ctrl.refresh_access()
                if nsid is not None:
                    ctrl.notify(AEN_NS_ATTR_CHANGED, changed_nsid=nsid)

    def set_ana_state(self, port_ids: list[int], group: int, state: AnaState) -> bool:
        """Set ``group``'s state on each of ``port_ids``; every controller on a port whose state
        changed sees it at once (I/O statuses, Identify, the log page) and gets the ANA change
        event if it enabled it (nvmet's ``nvmet_port_send_ana_event``). True if any changed."""
        changed = {p for p in port_ids if self.ana.set(p, group, state)}
        if changed:
            log.info("ANA state changed", group=group, state=state.name.lower(), ports=sorted(changed))
        for ctrl in self.controllers.values():
            if ctrl.port_id in changed and not ctrl.is_discovery:
                ctrl.refresh_access()
                ctrl.notify_ana_change()
        return bool(changed)

    def move_namespace(self, sub: Subsystem, nsid: int, group: int) -> None:
        """Put namespace ``nsid`` in ANA group ``group`` while it stays attached (hosts keep it:
        removing and adding it back would make a host drop the device). As nvmet does when its
        ``ana_grpid`` is written (``nvmet_ns_ana_grpid_store``): the ANA change count goes up and
        every controller of the subsystem, on every port, gets the ANA change event; no
        Namespace Attribute Changed is sent, since the Linux host takes a namespace's group
        from the ANA log descriptor that lists it (``nvme_update_ns_ana_state`` sets
        ``ns->ana_grpid``). Identify Namespace, the log page and I/O statuses follow at once."""
        ns = sub.namespaces[nsid]
        if ns.ana_group == group:
            return
        log.info("namespace moved to another ANA group", nqn=sub.nqn, nsid=nsid, old=ns.ana_group, new=group)
        ns.ana_group = group
        self.ana.namespace_moved()
        for ctrl in self.controllers.values():
            if ctrl.subsystem is sub:
                ctrl.refresh_access()
                ctrl.notify_ana_change()

    def _discovery_changed(self) -> None:
        self.genctr += 1
        for ctrl in self.controllers.values():
            if ctrl.is_discovery and ctrl.async_event_config & (1 << 31):
                ctrl.notify(AEN_DISCOVERY_CHANGED)

    # -- associations -----------------------------------------------------------------------------

    def connect_admin(self, queue: TargetQueue, subnqn: str, hostnqn: str, hostid: bytes,
                      cntlid: int, sqsize: int, kato_ms: int) -> tuple[int, int, Controller | None]:
        """Admin Connect: make a controller. Returns (status, CQE DW0, controller)."""
        if cntlid != DYNAMIC_CNTLID:
            return Status.CONNECT_INVALID_PARAMETERS, IPO_CONNECT_CNTLID, None
        if sqsize + 1 > ADMIN_QUEUE_MAX:
            return Status.CONNECT_INVALID_PARAMETERS, IPO_CONNECT_SQSIZE, None
        sub = self.subsystems.get(subnqn)
        if sub is None or not sub.exported_on(queue.port_id) and not sub.is_discovery:
            log.warning("connect to unknown subsystem", subnqn=subnqn, hostnqn=hostnqn, peer=queue.peer)
            return Status.CONNECT_INVALID_PARAMETERS, IPO_CONNECT_SUBNQN, None
        if not sub.allows(hostnqn):
            log.warning("host not allowed", subnqn=subnqn, hostnqn=hostnqn, peer=queue.peer)
            return Status.CONNECT_INVALID_HOST, 0, None
        new_id = self._allocate_cntlid(sub)
        if new_id is None:
            return Status.CONNECT_CONTROLLER_BUSY, 0, None
        ctrl = Controller(self, sub, new_id, hostnqn, hostid, kato_ms, queue.transport.info,
                          queue.port_id, self.max_io_queues)
        ctrl.queues[0] = queue
        self.controllers[new_id] = ctrl
        self._ensure_reaper()
        return Status.SUCCESS, new_id, ctrl

    def connect_io(self, queue: TargetQueue, subnqn: str, hostnqn: str, cntlid: int, qid: int,
                   sqsize: int) -> tuple[int, int, Controller | None]:
        """I/O Connect: attach a queue to a live controller."""
        ctrl = self.controllers.get(cntlid)
        if ctrl is None or ctrl.dead or ctrl.subsystem.nqn != subnqn or ctrl.hostnqn != hostnqn:
            return Status.CONNECT_INVALID_PARAMETERS, IPO_CONNECT_CNTLID, None
        if ctrl.is_discovery or not ctrl.ready:
            return Status.COMMAND_SEQUENCE_ERROR, 0, None
        if qid > ctrl.max_io_queues:
            return Status.CONNECT_INVALID_PARAMETERS, IPO_CONNECT_QID, None
        if sqsize > MQES:
            return Status.CONNECT_INVALID_PARAMETERS, IPO_CONNECT_SQSIZE, None
        old = ctrl.queues.get(qid)
        if old is not None and not old.transport.settle():  # a queue whose host is gone lets go now
            return Status.COMMAND_SEQUENCE_ERROR, 0, None
        ctrl.queues[qid] = queue
        ctrl.restart_keep_alive()
        return Status.SUCCESS, cntlid, ctrl

    def _allocate_cntlid(self, sub: Subsystem) -> int | None:
        """A free controller id in ``sub``'s range (ids are unique over the whole target), the
        search going on from the last one given, as nvmet's ida does not reuse at once."""
        low, high = sub.cntlid_range
        span = high - low + 1
        start = self._next_cntlid.get(sub.nqn, low)
        for i in range(span):
            cid = low + (start - low + i) % span
            if cid not in self.controllers:
                self._next_cntlid[sub.nqn] = low + (cid - low + 1) % span
                return cid
        return None

    def remove_controller(self, ctrl: Controller) -> None:
        if self.controllers.get(ctrl.cntlid) is ctrl:
            del self.controllers[ctrl.cntlid]
            ctrl.shutdown("admin queue closed")

    def flush_subsystem_soon(self, sub: Subsystem) -> None:
        """Controller shutdown (CC.SHN) makes the subsystem's data durable in the background."""
        for ns in list(sub.namespaces.values()):
            asyncio.get_running_loop().create_task(ns.backend.flush())

    # -- discovery --------------------------------------------------------------------------------

    def discovery_log(self, ctrl: Controller) -> bytes:
        """Discovery log for ``ctrl``'s host, in nvmet's order: this discovery subsystem, every
        allowed subsystem exported on the port the host asked on, then the port's referrals. As
        nvmet, the log names only that port (a host that discovered over TCP is not sent to an
        RDMA port it may not reach, and ``nvme connect-all`` tries every entry), unless the port
        lists every port (``discovery = "all"``, SPDK's rule): then each allowed subsystem comes
        once per port that exports it."""
        port = self.ports.get(ctrl.port_id)
        if port is None:  # the port went away while its discovery controller lives on
            return DISCOVERY_HEADER.build(dict(genctr=self.genctr, numrec=0, recfmt=0))
        entries = [self._entry(port, DISCOVERY_NQN, SubsystemType.CURRENT_DISCOVERY, ctrl)]
        listed = sorted(self.ports.values(), key=lambda p: p.port_id) if port.list_all else [port]
        for sub in self.subsystems.values():
            if sub.is_discovery or not sub.allows(ctrl.hostnqn):
                continue
            entries += [self._entry(p, sub.nqn, SubsystemType.NVME, ctrl) for p in listed if sub.exported_on(p.port_id)]
        entries += [self._referral(r) for r in port.referrals]
        header = DISCOVERY_HEADER.build(dict(genctr=self.genctr, numrec=len(entries), recfmt=0))
        return header + b"".join(entries)

    def _entry(self, port: PortInfo, nqn: str, subtype: int, ctrl: Controller) -> bytes:
        address = port.address
        if address in ("0.0.0.0", "::", ""):
            queue = ctrl.queues.get(0)
            address = queue.local_address if queue is not None and queue.local_address else "127.0.0.1"
        return _discovery_entry(port.transport, port.family, subtype, port.port_id, port.service, nqn, address)

    @staticmethod
    def _referral(r: ReferralConfig) -> bytes:
        """A referral entry as nvmet's ``nvmet_format_discovery_entry`` makes one: subtype
        referral, the discovery NQN, the referral's own address, PORTID and TREQ (nvmet's
        ``addr_treq`` of a referral stays "not specified": 0)."""
        return _discovery_entry(r.transport, _family(r.address), SubsystemType.REFERRAL, r.port_id, str(r.port),
                                DISCOVERY_NQN, r.address, treq=TREQ_SECURE_CHANNEL_NOT_SPECIFIED)

    # -- keep-alive and shutdown ------------------------------------------------------------------

    def _ensure_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap())

    async def _reap(self) -> None:
        """Tear down controllers whose host fell silent (see Controller.keep_alive_expired)."""
        while self.controllers:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            for ctrl in list(self.controllers.values()):
                if ctrl.keep_alive_expired(now):
                    self.rejections.add(KEEP_ALIVE_TIMEOUT)
                    ctrl.shutdown("keep-alive timeout")

    async def close(self) -> list[str]:
        """Tear down every controller, flush and close every namespace; the namespaces whose
        flush failed, one line each (empty when every flush succeeded).

        A failed flush is logged and the others still run: one namespace's EIO at stop must not
        leave the next namespaces unflushed (it did, the exception ending the loop)."""
        for ctrl in list(self.controllers.values()):
            ctrl.shutdown("target stopping")
        if self._reaper is not None:
            self._reaper.cancel()
        failed: list[str] = []
        for sub in self.subsystems.values():
            for ns in sub.namespaces.values():
                try:
                    await ns.backend.flush()
                except OSError as exc:
                    log.error("flush at stop failed: writes since the last flush may not be durable",
                              nqn=sub.nqn, nsid=ns.nsid, error=str(exc))
                    failed.append(f"{sub.nqn} namespace {ns.nsid}: {exc}")
                finally:
                    ns.backend.close()
        for ns in self.draining:  # a command that never completed (its connection died) held it
            ns.backend.close()
            self._closed_now(ns)
        self.draining.clear()
        return failed


def _discovery_entry(transport_name: str, family: int, subtype: int, port_id: int, service: str, nqn: str,
                     address: str, treq: int = _TREQ) -> bytes:
    transport = transport_info(transport_name)
    return DISCOVERY_ENTRY.build(dict(
        trtype=transport.trtype, adrfam=family, subtype=subtype, treq=treq, portid=port_id,
        cntlid=DYNAMIC_CNTLID, asqsz=ADMIN_QUEUE_MAX, eflags=0, trsvcid=service, subnqn=nqn,
        traddr=address, tsas=transport.tsas))
