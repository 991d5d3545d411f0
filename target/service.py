"""The running target daemon: builds a :class:`Target` from a config, listens, reloads, drains.

Reload applies only the difference between the old and the new configuration, so hosts of
subsystems and namespaces that did not change keep their connections.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from typing import Any, Awaitable, Callable, Iterator

import structlog

from target.config import MAX_REPLICAS, NamespaceConfig, PortConfig, SubsystemConfig, TargetConfig, idle_ports
from blockd.control_socket import RequestError
from protocol.constants import ANA_STATE_NAMES, AnaState
from target.ana import MAX_ANA_GROUPS, STANDBY_ANA_GROUP
from target.backend import Backend, NamespaceHooks
from target.backend_registry import open_backend
from target.control import ControlServer
from target.io_fast import TcpFastPath
from blockd.prometheus import MetricsServer
from target.metrics import target_metrics_server
from target.replication.control import ReplicationControl
from target.replication.link import ReplicaIO
from target.replication.mirror import ReplicatedBackend
from target.replication.standby import StandbyExport
from target.replication.volume import local_copy
from target.subsystem import Namespace, Subsystem
from target.target import PortInfo, Target
from target.transport import Listener, listen

log = structlog.get_logger("blockd.target.service")

DRAIN_TIMEOUT = 30.0


def _log_queue_plane(target: Target) -> None:
    """Say at start what serves the steady NVMe/TCP I/O queues, as chosen (not as asked): a
    thread each on io_uring (with SQPOLL or not), a thread each on its own system calls, or the
    event loop (``threaded_queues`` off, or the Python plane, which has no queue threads), with
    why not the ring when it was asked for."""
    if target.io_uring_queues:
        log.info("NVMe/TCP queue threads on io_uring",
                 sqpoll=f"idle {target.sqpoll_idle_ms} ms, spin {target.spin_us} us" if target.sqpoll_idle_ms else "off")
    elif TcpFastPath is None:
        log.info("NVMe/TCP I/O queues on the event loop", reason="the compiled queue threads (target._tcp_thread) "
                 "are not running on this plane", io_uring=target.queue_loop_reason)
    elif target.threaded_queues:
        log.info("NVMe/TCP queue threads on system calls", reason=target.queue_loop_reason)
    else:
        log.info("NVMe/TCP I/O queues on the event loop", reason="threaded_queues is off")


def _port_info(p: PortConfig) -> PortInfo:
    return PortInfo(p.port_id, p.transport, p.address, str(p.port), p.discovery == "all", p.referrals)


def _kept(before: NamespaceConfig, after: NamespaceConfig | None) -> bool:
    """``after`` is ``before`` but for what changes while the namespace stays attached: its size
    (resized in place) and its ANA group (moved in place). Any other change re-opens it."""
    return after is not None and dataclasses.replace(before, size=after.size, ana_group=after.ana_group) == after


def _resized(before: NamespaceConfig, after: NamespaceConfig) -> bool:
    """A kept namespace whose size may change: another size, or both leave it to the file."""
    return before.size != after.size or after.size is None


ReplicaOpener = Callable[..., Awaitable[ReplicaIO]]
"""Connects to one replica namespace: ``(transport, address, port, nqn, nsid, hostnqn, timeout)``
(``initiator.replica.open_remote``, injected by the composition root: target/ does not import
the host library)."""


async def _open_namespace(sub: Subsystem, nc: NamespaceConfig, open_replica: ReplicaOpener | None,
                          primary: bool) -> Namespace:
    """Open ``nc``; a replicated namespace opens in the role ``primary`` says (its group's ANA
    state: see :meth:`TargetService._role_changes`)."""
    where = f"{sub.nqn} namespace {nc.nsid}"
    try:
        backend: Backend = open_backend(nc)
    except OSError as exc:
        raise RuntimeError(f"{where}: cannot open {nc.path}: {exc.strerror}") from None
    except ValueError as exc:
        raise RuntimeError(f"{where}: {exc}") from None
    if nc.replicas:
        if open_replica is None:
            backend.close()
            raise RuntimeError(f"{where}: replicas are configured but this target cannot reach them")
        openers = [(rc.name, functools.partial(open_replica, rc.transport, rc.address, rc.port, rc.nqn,
                                               rc.nsid, rc.hostnqn, rc.timeout)) for rc in nc.replicas]
        try:
            backend = local_copy(backend, nc, MAX_REPLICAS)
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"{where}: {exc}") from None
        try:
            backend = await ReplicatedBackend.open(backend, openers, nc.region_size, nc.min_in_sync,
                                                   nc.resync_rate, MAX_REPLICAS, name=where,
                                                   block_size=nc.block_size, primary=primary)
        except (OSError, ValueError) as exc:
            backend.close()
            raise RuntimeError(f"{where}: {exc}") from None
    if backend.size % nc.block_size:
        backend.close()
        raise RuntimeError(f"{where}: {nc.path} size is not a multiple of {nc.block_size}")
    if isinstance(backend, ReplicatedBackend):
        backend.start()
    derived = getattr(backend, "derived_ids", None)  # a backend whose storage names itself (rbd)
    ids = nc.ids if derived is None else tuple(c if c is not None else d for c, d in zip(nc.ids, derived()))
    return Namespace(nc.nsid, backend, nc.block_size, sub.nqn, nc.path, nc.ana_group, ids)


class TargetService:
    """Owns the Target and its listeners."""

    def __init__(self, config: TargetConfig, open_replica: ReplicaOpener | None = None) -> None:
        self.config = config
        self.open_replica = open_replica
        self.target = Target(max_io_queues=config.max_io_queues, limits=config.limits,
                             threaded_queues=config.threaded_queues, io_uring_queues=config.io_uring_queues,
                             sqpoll_idle_ms=config.io_uring_sqpoll_idle_ms if config.io_uring_sqpoll else 0,
                             spin_us=config.io_uring_spin_us)
        _log_queue_plane(self.target)
        self.listeners: dict[int, Listener] = {}
        self.standby: dict[tuple[str, int], str] = {}
        """(subsystem NQN, nsid) of each failover pair's namespace -> its standby subsystem's NQN."""
        self.control: ControlServer | None = (
            ControlServer(self, config.control_socket) if config.control_socket else None)
        """The control socket (``blockctl target ...``); its path is not reloadable."""
        self.metrics: MetricsServer | None = (
            target_metrics_server(self.target, config.metrics.address, config.metrics.port)
            if config.metrics is not None else None)
        """The Prometheus endpoint; its address is not reloadable."""
        if self.control is not None:
            self.control.add_verb("resize", self.op_resize)
            self.control.add_verb("ana", self.op_ana)
            self.control.add_verb("ana-set", self.op_ana_set)
            ReplicationControl(self.target).add_verbs(self.control)

    async def start(self) -> None:
        """Open every namespace, then listen on every port (the service is then ready); the
        control socket and the metrics endpoint open first, so a failing port can be looked at."""
        if self.control is not None:
            await self.control.start()
        if self.metrics is not None:
            await self.metrics.start()
        for (port_id, group), state in _ana_map(self.config).items():  # first: they set the roles
            self.target.set_ana_state([port_id], group, state)
        for sc in self.config.subsystems:
            await self._add_subsystem(sc, self.config)
        for pc in self.config.ports:
            await self._add_port(pc)
        for pc in idle_ports(self.config):
            log.warning("port serves nothing: no subsystem is exported on it and it has no referral; a host "
                        "discovering there finds no volume (add a [[port.referral]] or discovery = \"all\")",
                        port=pc.port_id, address=f"{pc.transport}://{pc.address}:{pc.port}")

    def describe(self) -> str:
        """One line on what is exported, for logs and systemd STATUS=."""
        subs = [s for s in self.target.subsystems.values() if not s.is_discovery]
        nss = sum(len(s.namespaces) for s in subs)
        ports = ", ".join(f"{p.transport}://{p.address}:{p.service}" for p in self.target.ports.values())
        return f"exporting {len(subs)} subsystem(s), {nss} namespace(s) on {ports or 'no ports'}"

    async def _add_port(self, pc: PortConfig) -> None:
        info = _port_info(pc)
        listener = listen(self.target, info)
        await listener.start()
        self.listeners[pc.port_id] = listener
        self.target.add_port(info)

    async def _remove_port(self, port_id: int) -> None:
        await self.listeners.pop(port_id).stop()
        self.target.remove_port(port_id)

    async def _add_subsystem(self, sc: SubsystemConfig, config: TargetConfig) -> None:
        sub = Subsystem(sc.nqn, sc.serial, sc.model, sc.allow_any_host, set(sc.hosts),
                        port_ids=set(sc.ports) if sc.ports is not None else None,
                        auth=dict(sc.host_auth), cntlid_range=sc.cntlid_range)
        try:
            for nc in sc.namespaces:
                sub.add_namespace(await self._open(sub, sc, nc, config))
        except BaseException:
            for ns in sub.namespaces.values():
                ns.backend.close()
            raise
        self.target.add_subsystem(sub)
        for nc in sc.namespaces:
            self._add_standby(sc, nc, sub.namespaces[nc.nsid])
            self._attach(sub, sub.namespaces[nc.nsid])

    def _attach(self, sub: Subsystem, ns: Namespace) -> None:
        """Hand a backend whose storage changes outside the target (rbd) its hooks
        (:class:`target.backend.NamespaceHooks`)."""
        attach = getattr(ns.backend, "attach", None)
        if attach is None:
            return

        def resized() -> None:
            try:
                self.target.resize_namespace(sub, ns.nsid, None)
            except (ValueError, OSError) as exc:
                log.error("namespace not resized", nqn=sub.nqn, nsid=ns.nsid, error=str(exc))

        def serving() -> bool:
            sc = next(s for s in self.config.subsystems if s.nqn == sub.nqn)
            return _serves(_ports(self.config, sc), ns.ana_group, self.target.ana.state)

        async def set_serving(on: bool) -> None:
            await self.op_ana_set("optimized" if on else "inaccessible", group=ns.ana_group)
        attach(NamespaceHooks(resized, serving, set_serving))

    async def _open(self, sub: Subsystem, sc: SubsystemConfig, nc: NamespaceConfig, config: TargetConfig) -> Namespace:
        primary = _serves(_ports(config, sc), nc.ana_group, self.target.ana.state)
        return await _open_namespace(sub, nc, self.open_replica, primary)

    def _add_standby(self, sc: SubsystemConfig, nc: NamespaceConfig, ns: Namespace) -> None:
        """A failover pair's namespace: its standby subsystem (target.replication.standby), on
        the same ports, in the standby ANA group (controller ids: the default range, as only
        the primary connects to it)."""
        if nc.standby_nqn is None or not isinstance(ns.backend, ReplicatedBackend):
            return
        standby = Subsystem(nc.standby_nqn, sc.serial, "blockd standby", not nc.standby_hosts, set(nc.standby_hosts),
                            port_ids=set(sc.ports) if sc.ports is not None else None)
        standby.add_namespace(Namespace(nc.nsid, StandbyExport(ns.backend), nc.block_size, nc.standby_nqn,
                                        nc.path, STANDBY_ANA_GROUP))
        self.target.add_subsystem(standby)
        self.standby[sc.nqn, nc.nsid] = nc.standby_nqn

    def _remove_standby(self, nqn: str, nsid: int) -> None:
        standby = self.standby.pop((nqn, nsid), None)
        if standby is not None:
            self.target.remove_subsystem(standby)

    async def reload(self, new: TargetConfig) -> None:
        """Apply ``new``: only what changed is touched. A namespace whose size alone changed
        (or whose file grew, when the configuration gives no size) is resized in place, its
        hosts told by an event; one whose ``ana_group`` changed moves to that group in place
        (:meth:`Target.move_namespace`). A refused resize, promotion or move refuses the whole
        reload before any change."""
        old = self.config
        for sub, _, nc in self._kept(old, new, _resized):
            try:
                self.target.check_resize(sub, nc.nsid, nc.size)
            except ValueError as exc:
                raise RuntimeError(str(exc)) from None
        ana_changes = _ana_changes(old, new)
        moves = {(sub.nqn, nc.nsid): nc.ana_group for sub, _, nc in self._kept(old, new, _moved)}

        def after(port_id: int, group: int) -> AnaState:
            return ana_changes.get((port_id, group), self.target.ana.state(port_id, group))
        for where, backend in self._role_changes(new, after, moves)[0]:
            why = await backend.promotion_blocker()
            if why:
                raise RuntimeError(f"{where} not made primary (its ANA group would serve I/O): {why}")
        old_ports = {p.port_id: p for p in old.ports}
        new_ports = {p.port_id: p for p in new.ports}
        for pid, pc in old_ports.items():
            if new_ports.get(pid) != pc:
                await self._remove_port(pid)
        old_subs = {s.nqn: s for s in old.subsystems}
        new_subs = {s.nqn: s for s in new.subsystems}
        for nqn in old_subs.keys() - new_subs.keys():
            for nc in old_subs[nqn].namespaces:
                self._remove_standby(nqn, nc.nsid)
            self.target.remove_subsystem(nqn)
            log.info("subsystem removed", nqn=nqn)
        for nqn, sc in new_subs.items():
            before = old_subs.get(nqn)
            if before is None:
                await self._add_subsystem(sc, new)
                log.info("subsystem added", nqn=nqn)
            elif before != sc:
                await self._update_subsystem(before, sc, new)
        self._apply_resizes(old, new)
        for _, backend in self._role_changes(new, after, moves)[0]:  # (namespaces re-opened meanwhile too)
            await self._promote(backend)
        for sub, _, nc in self._kept(old, new, _moved):  # no await from here to the ANA states:
            self.target.move_namespace(sub, nc.nsid, nc.ana_group)  # hosts see one change
        for (port_id, group), state in ana_changes.items():
            self.target.set_ana_state([port_id], group, state)
        for _, backend in self._role_changes(new, self.target.ana.state, {})[1]:
            await backend.demote()
        for pid, pc in new_ports.items():
            if old_ports.get(pid) != pc:
                await self._add_port(pc)
        if (new.control_socket, new.metrics) != (old.control_socket, old.metrics):
            log.warning("[control] and [metrics] changes take effect at the next start")
        self.config = new
        log.info("configuration reloaded", status=self.describe())

    def _kept(self, old: TargetConfig, new: TargetConfig,
              which: Callable[[NamespaceConfig, NamespaceConfig], bool],
              ) -> Iterator[tuple[Subsystem, NamespaceConfig, NamespaceConfig]]:
        """(subsystem, old, new) of the namespaces that stay attached (:func:`_kept`) and for
        which ``which(old, new)`` holds."""
        old_subs = {s.nqn: s for s in old.subsystems}
        for sc in new.subsystems:
            before = old_subs.get(sc.nqn)
            if before is None:
                continue
            old_ns = {n.nsid: n for n in before.namespaces}
            for nc in sc.namespaces:
                was = old_ns.get(nc.nsid)
                if was is not None and _kept(was, nc) and which(was, nc):
                    yield self.target.subsystems[sc.nqn], was, nc

    async def _update_subsystem(self, before: SubsystemConfig, after: SubsystemConfig, config: TargetConfig) -> None:
        sub = self.target.subsystems[after.nqn]
        sub.serial, sub.model = after.serial, after.model
        sub.port_ids = set(after.ports) if after.ports is not None else None
        sub.auth = dict(after.host_auth)  # queues connecting from now on
        sub.cntlid_range = after.cntlid_range  # controllers made from now on
        if (before.allow_any_host, before.hosts) != (after.allow_any_host, after.hosts):
            self.target.update_access(sub, after.allow_any_host, set(after.hosts))
        old_ns = {n.nsid: n for n in before.namespaces}
        new_ns = {n.nsid: n for n in after.namespaces}
        removed: dict[int, Namespace] = {}
        for nsid, nc in old_ns.items():
            if not _kept(nc, new_ns.get(nsid)):
                self._remove_standby(sub.nqn, nsid)
                removed[nsid] = sub.namespaces[nsid]
                reopen = nsid in new_ns
                self.target.remove_namespace(sub, nsid, reopen=reopen)
                log.info("namespace closed to open again" if reopen else "namespace removed", nqn=sub.nqn, nsid=nsid)
        for nsid, nc in new_ns.items():
            if old_ns.get(nsid) is None or not _kept(old_ns[nsid], nc):
                if nsid in removed and not await self.target.until_closed(removed[nsid], DRAIN_TIMEOUT):
                    log.warning("opening a namespace again while its old copy still has a command in flight",
                                nqn=sub.nqn, nsid=nsid, waited_s=DRAIN_TIMEOUT)
                try:
                    ns = await self._open(sub, after, nc, config)
                except BaseException:
                    if nsid in removed:
                        self.target.reopen_failed(sub, nsid)
                    raise
                self.target.add_namespace(sub, ns)
                self._add_standby(after, nc, sub.namespaces[nsid])
                self._attach(sub, sub.namespaces[nsid])
                log.info("namespace added", nqn=sub.nqn, nsid=nsid, path=nc.path)

    def _apply_resizes(self, old: TargetConfig, new: TargetConfig) -> None:
        for sub, _, nc in self._kept(old, new, _resized):
            try:
                self.target.resize_namespace(sub, nc.nsid, nc.size)
            except (ValueError, OSError) as exc:  # the file changed under us: keep the rest
                log.error("namespace not resized", nqn=sub.nqn, nsid=nc.nsid, error=str(exc))

    async def op_resize(self, nqn: str, nsid: int, size: int | None = None) -> dict[str, Any]:
        """Control verb ``resize``: the namespace's new size in bytes (None: its file's size
        now). The configuration file is not rewritten: give the size there too, or a reload
        brings the old one back."""
        sub = self.target.subsystems.get(nqn)
        if sub is None or sub.is_discovery:
            raise RequestError(f"no subsystem {nqn!r}")
        try:
            old, new = self.target.resize_namespace(sub, nsid, size)
        except (ValueError, OSError) as exc:
            raise RequestError(str(exc)) from None
        return {"nqn": nqn, "nsid": nsid, "old_size": old, "size": new}

    # -- ANA: promotion and demotion ----------------------------------------------------------------

    async def _promote(self, backend: Any, forced: bool = False) -> None:
        """Promote a replicated namespace's copy; its namespace then takes the reservation state
        the former primary kept in the metadata (target.reservations, issue 38)."""
        await backend.promote(forced=forced)
        for sub in self.target.subsystems.values():
            for ns in sub.namespaces.values():
                if ns.backend is backend:
                    ns.reservations.adopt_replicated()

    def _role_changes(self, config: TargetConfig, state: Callable[[int, int], AnaState],
                      moves: dict[tuple[str, int], int]) -> tuple[list[tuple[str, ReplicatedBackend]],
                                                                   list[tuple[str, ReplicatedBackend]]]:
        """The replicated namespaces to promote and to demote under the ANA states ``state``
        (and the group ``moves``, by (NQN, nsid)): roles follow ANA. A copy is the primary while
        its namespace's group serves I/O (optimized or non-optimized) on any port of its
        subsystem, and the secondary (a failover pair's standby) while it serves none."""
        promote, demote = [], []
        for sc in config.subsystems:
            sub = self.target.subsystems.get(sc.nqn)
            if sub is None:
                continue
            for ns in sub.namespaces.values():
                if not isinstance(ns.backend, ReplicatedBackend):
                    continue
                primary = _serves(_ports(config, sc), moves.get((sc.nqn, ns.nsid), ns.ana_group), state)
                if primary != ns.backend.primary:
                    (promote if primary else demote).append((f"{sc.nqn} namespace {ns.nsid}", ns.backend))
        return promote, demote

    def _group_namespaces(self, group: int) -> list[Namespace]:
        return [ns for sub in self.target.subsystems.values() for ns in sub.namespaces.values()
                if ns.ana_group == group]

    async def op_ana(self) -> dict[str, Any]:
        """Control verb ``ana``: every port's groups, their states and namespaces."""
        target = self.target
        groups = sorted(target.ana.groups | {ns.ana_group for sub in target.subsystems.values()
                                             for ns in sub.namespaces.values()})
        return {"chgcnt": target.ana.chgcnt, "ana": [
            {"port": port_id, "group": group, "state": _STATE_NAMES[target.ana.state(port_id, group)],
             "namespaces": [f"{ns.subsystem_nqn}/{ns.nsid}" for ns in self._group_namespaces(group)]}
            for port_id in sorted(target.ports) for group in groups]}

    async def op_ana_set(self, state: str, group: int = 1, port: int | None = None,
                         force: bool = False) -> dict[str, Any]:
        """Control verb ``ana-set`` (``blockctl target ana promote|demote|set``): ``group``'s
        state on ``port`` (None: every port), sending the ANA change event, with the role
        changes it implies (:meth:`_role_changes`). A replicated namespace made primary is
        promoted first (hosts must not reach a copy that is not yet the primary), one made
        secondary is demoted after its hosts were told. A promotion is refused while the copy
        may lack acknowledged writes (the backend's ``promotion_blocker()``) unless ``force``;
        every promotion starts a new generation, so the replication layer sees the other copy's
        later writes as diverged rather than resyncing over this one. Not written to the
        configuration: a reload keeps it unless the file's ``[[ana]]`` entries change."""
        try:
            new = ANA_STATE_NAMES[state]
        except KeyError:
            raise RequestError(f"ANA state must be one of {', '.join(ANA_STATE_NAMES)}, not {state!r}") from None
        if not 1 <= group <= MAX_ANA_GROUPS:
            raise RequestError(f"ANA group must be 1..{MAX_ANA_GROUPS}")
        if group == STANDBY_ANA_GROUP and self.standby:
            raise RequestError(f"ANA group {STANDBY_ANA_GROUP} holds the standby subsystems: its state is fixed")
        if port is not None and port not in self.target.ports:
            raise RequestError(f"no port {port}")
        ports = [port] if port is not None else sorted(self.target.ports)

        def after(port_id: int, g: int) -> AnaState:
            return new if port_id in ports and g == group else self.target.ana.state(port_id, g)
        promote, demote = self._role_changes(self.config, after, {})
        blockers = [f"{where}: {why}" for where, backend in promote if (why := await backend.promotion_blocker())]
        if blockers and not force:
            raise RequestError(f"not promoted: {blockers[0]} (--force promotes anyway, starting a new generation)")
        if blockers:
            log.warning("forced promotion", group=group, blockers=blockers)
        for where, backend in promote:
            try:
                await self._promote(backend, forced=bool(blockers))
            except (OSError, ValueError) as exc:
                raise RequestError(f"not promoted: {where}: {exc}") from None
        changed = self.target.set_ana_state(ports, group, new)
        for _, backend in demote:
            await backend.demote()
        return {"group": group, "state": state, "ports": ports, "changed": changed,
                "chgcnt": self.target.ana.chgcnt}

    async def stop(self) -> list[str]:
        """Stop accepting, let in-flight commands finish, tear down, flush, close files; the
        namespaces whose final flush failed (:meth:`Target.close`)."""
        for pid in list(self.listeners):
            await self._remove_port(pid)
        for ctrl in self.target.controllers.values():
            ctrl.cancel_async_events()
        pending = [t for t in self.target.tasks if not t.done()]
        if pending:
            log.info("draining in-flight commands", count=len(pending))
            done, not_done = await asyncio.wait(pending, timeout=DRAIN_TIMEOUT)
            if not_done:
                log.warning("commands still running after the drain timeout", count=len(not_done))
        for sub in self.target.subsystems.values():
            for ns in sub.namespaces.values():
                if isinstance(ns.backend, ReplicatedBackend):
                    await ns.backend.stop()
        for nqn, nsid in list(self.standby):  # before the files they export close
            self._remove_standby(nqn, nsid)
        failed = await self.target.close()
        if self.metrics is not None:
            await self.metrics.stop()
        if self.control is not None:
            await self.control.stop()
        log.info("target stopped", flush_failed=len(failed))
        return failed


_ACCESSIBLE = (AnaState.OPTIMIZED, AnaState.NON_OPTIMIZED)


def _moved(before: NamespaceConfig, after: NamespaceConfig) -> bool:
    return before.ana_group != after.ana_group


def _ports(config: TargetConfig, sc: SubsystemConfig) -> list[int]:
    """The ports a subsystem is offered on."""
    return sorted(sc.ports) if sc.ports is not None else [p.port_id for p in config.ports]


def _serves(ports: list[int], group: int, state: Callable[[int, int], AnaState]) -> bool:
    """Whether ``group`` serves I/O on any of ``ports``: its copy is then the primary."""
    return any(state(p, group) in _ACCESSIBLE for p in ports)


_STATE_NAMES = {state: name for name, state in ANA_STATE_NAMES.items()}


def _ana_map(config: TargetConfig) -> dict[tuple[int, int], AnaState]:
    """The configuration's ANA states by (port, group); an entry for one port overrides one
    for every port, whatever their order."""
    result: dict[tuple[int, int], AnaState] = {}
    ports = [p.port_id for p in config.ports]
    for entry in sorted(config.ana, key=lambda a: a.port is not None):
        for port_id in ([entry.port] if entry.port is not None else ports):
            result[port_id, entry.group] = entry.state
    return result


def _ana_changes(old: TargetConfig, new: TargetConfig) -> dict[tuple[int, int], AnaState]:
    """What a reload changes: states the new file sets differently, and optimized again where
    the old one set a state and the new one none. A state set at run time (blockctl) stays when
    the file's entry for it did not change."""
    before, after = _ana_map(old), _ana_map(new)
    changes = {key: state for key, state in after.items() if before.get(key) != state}
    changes.update({key: AnaState.OPTIMIZED for key in before.keys() - after.keys()})
    return changes
