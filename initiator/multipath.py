"""Several paths to one subsystem (NVMe multipath with ANA), as one connection.

Each path is a :class:`initiator.controller.Controller` of its own (one association with one
target or port, reconnecting by itself); :class:`MultipathController` sits over them and offers
what a mount needs (:class:`initiator.fuse.needs.MountController`), so ``Controller.submit_io``
stays the one per-path primitive. As the Linux host's native multipath
(drivers/nvme/host/multipath.c):

- each path's ANA log page says, per namespace, the state of that path: I/O goes to the
  optimized paths, the non-optimized ones when there is none; inaccessible, persistent-loss and
  change paths, and paths whose state is not known, are not used;
- the log is read when a path connects and again on every reconnect (nvme_mpath_init_identify):
  a path that goes down forgets its states and takes no I/O until the new association's log
  is read, so a target that came back with its group inaccessible is never taken for the
  optimized path it was;
- among the paths of the best state the connection's ``iopolicy`` chooses, named as the
  kernel's: ``numa`` (its default; one process is one node here, so the first usable path in
  the order given, as the kernel's with equal distances), ``round-robin`` (each command the
  next path, nvme_round_robin_path) and ``queue-depth`` (the path with the fewest commands in
  flight, nvme_queue_depth_path);
- a command that fails with an ANA status (0x301-0x303) or because its path went down is sent
  again on another path instead of failing. ANA statuses are bounded as the kernel's
  nvme_failover_req bounds them: the first status from a path for a namespace whose state
  there the host holds as usable is that (namespace, path) transition's one *retry*: the
  namespace is taken off the path (not used there until its log is read) and one read of the
  path's log is asked for. Every other command of that namespace that comes back from that
  path with an ANA status in the same transition -- the path already taken off, or a read
  started since the command was sent -- is *requeued*: sent on the current route, asking for no
  read and counting no retry; one sent before a read that is still under way takes the
  namespace off the path until that read answers, so none goes back to the path it came from
  on the state the read is replacing. Reads asked for while one is under way make one more
  after it, as the kernel's ana_work. The retries and the requeued commands are counted per
  (namespace, path) (:meth:`MultipathController.describe_paths`, the metrics). A command with
  no usable path waits for one, for at most ``ctrl_loss_tmo`` from its first failure;
- the ANA change event makes the host read that path's log again;
- a log that shows a group in the "change" state starts the path's ANATT timer (twice the
  controller's ANATT, as the kernel's nvme_read_ana_log); a path still in transition when it
  runs out is reset (nvme_anatt_timeout), and its log is read again on the reconnect.

A path that is down when the connection is made does not fail it while another connects: it
keeps trying in the background (``Controller.connect(keep_trying=True)``: every
``reconnect_delay``, within its own ``ctrl_loss_tmo``, "connecting" meanwhile) and joins when it
comes up, checked as the first paths were (the same namespaces and NGUID/EUI-64) before its ANA
log is read and it takes I/O. The connect fails only when no path connects.

Paths are told to fail fast (``Controller.failfast``): a command on a path that is down comes
back here at once rather than waiting for that path's reconnect.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any, Callable

import construct
import structlog

from blockd.iostats import IoCounters
from initiator.association import RETRYABLE
from initiator.controller import Controller, IoDone, NamespaceInfo
from initiator.errors import ConnectError, NvmeError, QueueLost
from initiator.params import IOPOLICIES
from protocol.constants import AEN_ANA_CHANGED, AEN_DW0_MASK, CMIC_ANA, AnaState, LogPageId
from protocol.layout import field_offset
from protocol.logpage import ANA_GROUP_SIZE, ANA_HEADER_SIZE, ANA_LOG
from protocol.nvme import SQE
from protocol.status import ANA_STATUSES

log = structlog.get_logger("blockd.initiator.multipath")

_NSID = field_offset(SQE, "nsid")
_STATUS_CODE = 0x7FF
"""SCT and SC of a status (without DNR and More), what the ANA statuses are compared on."""
_KNOWN_STATES = frozenset(int(s) for s in AnaState)
_UNKNOWN = None
"""A path's state for a namespace until its ANA log is read (again): the path is not used."""
ANATT_SLACK = 2
"""The ANATT timer runs this many times the controller's ANATT, as the kernel's (slack for the
transport and the event)."""
_NUMA, _ROUND_ROBIN = IOPOLICIES[:2]  # and queue-depth, the third
WAIT_SWEEP = 0.25
"""Seconds between checks of the commands waiting for a usable path (for their deadline)."""


class _Attempt:
    """One command on its way through the paths: the caller's ``done`` runs once, when a path
    completes it or when no path can and the wait is over."""

    __slots__ = ("mp", "sqe", "data_out", "data_in", "done", "nsid", "path", "seen", "deadline", "error")

    def __init__(self, mp: MultipathController, sqe: bytearray, data_out: bytes | memoryview | None,
                 data_in: memoryview | None, done: IoDone) -> None:
        self.mp = mp
        self.sqe = sqe
        self.data_out = data_out
        self.data_in = data_in
        self.done = done
        self.nsid = int.from_bytes(sqe[_NSID:_NSID + 4], "little")
        self.path: Controller | None = None
        self.seen = 0
        """The ANA log reads of ``path`` started when the command was sent on it."""
        self.deadline = 0.0
        """When the first path failure happened plus ``ctrl_loss_tmo`` (0: none yet)."""
        self.error: BaseException | None = None

    def finished(self, exc: BaseException | None) -> None:
        mp = self.mp
        mp._inflight[self.path] -= 1
        if exc is None or not mp._path_failed(self, exc):
            self.done(exc)


class MultipathController:
    """One connection over several paths (see the module docstring)."""

    def __init__(self, paths: list[Controller]) -> None:
        if not paths:
            raise ValueError("a multipath connection needs at least one path")
        self.paths = paths
        self.params = paths[0].params
        self.ctrl_loss_tmo = self.params.ctrl_loss_tmo
        self.iopolicy = self.params.iopolicy
        self._states: dict[Controller, dict[int, AnaState | None]] = {p: {} for p in paths}
        """Per path, nsid -> its ANA state there (None: not known, see :data:`_UNKNOWN`)."""
        self._tiers: dict[int, tuple[Controller, ...]] = {}
        """Per nsid, the live paths of the best usable state (cached until a state changes)."""
        self._turn: dict[int, int] = {}
        """Per nsid, the round-robin policy's count of commands sent."""
        self._inflight = {p: 0 for p in paths}
        """Per path, this connection's commands in flight there (the queue-depth policy)."""
        self.ana_reads = {p: 0 for p in paths}
        """Per path, ANA log reads started (a metric; a command's ``seen``)."""
        self._again: set[Controller] = set()
        """Paths whose read under way may predate what asked for one: read once more after it."""
        self._epoch = {p: 0 for p in paths}
        """Per path, how often it went down or came back (a read across one is not used)."""
        self._anatt: dict[Controller, asyncio.TimerHandle] = {}
        self.ana_retries_on: dict[Controller, collections.Counter[int]] = {
            p: collections.Counter() for p in paths}
        """Per path, nsid -> ANA-status retries: at most one per transition (module docstring)."""
        self.ana_requeued_on: dict[Controller, collections.Counter[int]] = {
            p: collections.Counter() for p in paths}
        """Per path, nsid -> commands requeued after an ANA status in a transition already retried."""
        self.path_retries = 0
        """Commands sent again after their path went down or timed out."""
        self._waiting: collections.deque[_Attempt] = collections.deque()
        self._sweep: asyncio.TimerHandle | None = None
        self._refreshing: dict[Controller, asyncio.Task[None]] = {}
        self._joining: dict[Controller, asyncio.Task[None]] = {}
        """Paths not connected yet (or connected and being checked): no I/O, no ANA log read."""
        self._refused: dict[Controller, str] = {}
        """Paths that came up showing another data set (closed), with the reason."""
        self._ids: dict[int, tuple[bytes, bytes]] = {}
        """nsid -> (NGUID, EUI-64) the paths showed at connect time; a joining path must match."""
        self._loop = asyncio.get_running_loop()
        self._closed = False
        self.namespace_listeners: list[Callable[[], None]] = []
        self.namespaces: dict[int, NamespaceInfo] = self._any_live().namespaces
        self.max_transfer = min(p.max_transfer for p in paths)
        for path in paths:
            path.failfast = True
            path.event_listeners.append(lambda dw0, path=path: self._event(path, dw0))
            path.live_listeners.append(lambda live, path=path: self._live_changed(path, live))
            path.namespace_listeners.append(self._namespaces_changed)

    @classmethod
    async def connect(cls, params_list: list[Any]) -> MultipathController:
        """Connect every path (each a :class:`ConnectParams`), check that those up show the
        same namespaces, then read their ANA logs. A path that cannot connect now keeps trying
        and joins later (see the module docstring); when none connects the connect fails
        with one line naming each path's error (and nothing is left running)."""
        results = await asyncio.gather(*(Controller.connect(p, keep_trying=True) for p in params_list),
                                       return_exceptions=True)
        paths = [r for r in results if isinstance(r, Controller)]
        errors = [r for r in results if not isinstance(r, Controller)]
        live = [p for p in paths if p.first_error is None]
        if errors or not live:
            for path in paths:
                await path.close()
            if errors:
                raise errors[0]
            raise ConnectError(f"no path to {params_list[0].subnqn} connects: "
                               + "; ".join(f"{_name(p)}: {p.first_error}" for p in paths))
        mp = cls(paths)
        try:
            ids = [await _namespace_ids(path) for path in live]
            for path, other in zip(live[1:], ids[1:]):
                _same_namespaces(ids[0], _name(live[0]), path, other)
            mp._ids = ids[0]
            for i, path in enumerate(live):
                _check_cntlid(mp.params.subnqn, path, live[:i])
                await mp._read_ana(path)
        except BaseException:
            await mp.close()
            raise
        for path in paths:
            if path.first_error is not None:
                log.warning("path down; it joins when it connects", subnqn=mp.params.subnqn, path=_name(path),
                            error=str(path.first_error))
                mp._joining[path] = mp._loop.create_task(mp._join(path))
        return mp

    async def _join(self, path: Controller) -> None:
        """Admit ``path``, down at connect time, once it is up: the same namespaces (NSIDs,
        NGUID/EUI-64) as at connect time, else it is closed and shown refused; then its ANA log
        is read and it takes I/O. A path that gives up (``ctrl_loss_tmo``) stays failed."""
        while True:
            try:
                await path.wait_live()
                _same_namespaces(self._ids, "the connection", path, await _namespace_ids(path))
                break
            except ConnectError as exc:
                log.error("path refused", subnqn=self.params.subnqn, path=_name(path), error=str(exc))
                self._refused[path] = str(exc)
                del self._joining[path]
                await path.close()
                return
            except RETRYABLE as exc:
                if path.failed is not None:  # gave up after ctrl_loss_tmo (or closed)
                    log.warning("path never connected", subnqn=self.params.subnqn, path=_name(path),
                                error=str(exc))
                    del self._joining[path]
                    return
                await asyncio.sleep(path.params.reconnect_delay)  # down again while being checked
        del self._joining[path]
        _check_cntlid(self.params.subnqn, path, [p for p in self.paths if p is not path and p.was_live
                                                 and p not in self._joining and p not in self._refused])
        self.max_transfer = min(self.max_transfer, path.max_transfer)
        log.info("path joined", subnqn=self.params.subnqn, path=_name(path), cntlid=path.cntlid)
        self._refresh(path)

    # -- ANA state ------------------------------------------------------------------------------

    async def _read_ana(self, path: Controller) -> None:
        """Read ``path``'s ANA log page (once it is live) and use its states; read again when
        the path went down or came back meanwhile, or another read was asked for (the answer
        may predate it)."""
        while True:
            epoch = self._epoch[path]
            self._again.discard(path)
            self.ana_reads[path] += 1
            states, change = await self._ana_states(path)
            if self._epoch[path] == epoch and path not in self._again:
                break
        if self._states[path] != states:
            log.info("path ANA state", subnqn=self.params.subnqn, path=_name(path),
                     states={n: s.name.lower() for n, s in sorted(states.items())})
        self._states[path] = states
        self._anatt_timer(path, change)
        self._changed()

    async def _ana_states(self, path: Controller) -> tuple[dict[int, AnaState], bool]:
        """nsid -> state from ``path``'s ANA log page, and whether a group is in "change". A
        controller without ANA reporting serves every namespace, as an optimized path."""
        ident = path.identity
        if not ident.cmic & CMIC_ANA:
            return {nsid: AnaState.OPTIMIZED for nsid in path.namespaces}, False
        # sized as the Linux host sizes it: every group, every namespace listed once
        size = ANA_HEADER_SIZE + ident.nanagrpid * ANA_GROUP_SIZE + ident.mnan * 4
        page = await path.get_log_page(LogPageId.ANA, min(size, path.max_transfer))
        try:
            groups = ANA_LOG.parse(page).groups
        except construct.ConstructError:
            raise ConnectError(f"{_name(path)}: the ANA log page does not parse") from None
        states = {}
        for group in groups:
            if group.state in _KNOWN_STATES:  # an unknown state: not a path to use
                for nsid in group.nsids:
                    states[nsid] = AnaState(group.state)
        return states, any(group.state == AnaState.CHANGE for group in groups)

    def _anatt_timer(self, path: Controller, change: bool) -> None:
        """(Re)start ``path``'s ANATT timer when a group is in transition, else stop it (as the
        kernel's, one timer per controller, restarted by every read that shows a change)."""
        timer = self._anatt.pop(path, None)
        if timer is not None:
            timer.cancel()
        if change and not self._closed:
            delay = ANATT_SLACK * max(1, path.identity.anatt)
            self._anatt[path] = self._loop.call_later(delay, self._anatt_expired, path)

    def _anatt_expired(self, path: Controller) -> None:
        del self._anatt[path]
        log.warning("ANA transition longer than ANATT; resetting the path", subnqn=self.params.subnqn,
                    path=_name(path), anatt=path.identity.anatt)
        path.reset()

    def _live_changed(self, path: Controller, live: bool) -> None:
        """``path`` went down or came back: its states are not known until its log is read
        on the new association (a joining path's first read is :meth:`_join`'s)."""
        if self._closed or path in self._joining or path in self._refused:
            return
        self._epoch[path] += 1
        self._states[path] = dict.fromkeys(self._states[path], _UNKNOWN)
        self._anatt_timer(path, False)
        if live:
            self._refresh(path)
        self._changed()

    def _refresh(self, path: Controller) -> None:
        """Read ``path``'s ANA log again, in the background: one read at a time per path, and
        one more after it when asked for while it is under way."""
        if self._closed or path in self._joining or path in self._refused:
            return
        if path in self._refreshing:
            self._again.add(path)
            return
        self._refreshing[path] = self._loop.create_task(self._refresh_task(path))

    async def _refresh_task(self, path: Controller) -> None:
        try:
            await self._read_ana(path)
        except (QueueLost, ConnectionError, TimeoutError, NvmeError) as exc:
            if path.failed is None and not self._closed:
                log.warning("ANA log not read; retrying", path=_name(path), error=str(exc))
                self._loop.call_later(path.params.reconnect_delay, self._refresh, path)
        finally:
            self._refreshing.pop(path, None)
            self._changed()

    def _event(self, path: Controller, dw0: int) -> None:
        if dw0 & AEN_DW0_MASK == AEN_ANA_CHANGED:
            self._refresh(path)

    def _namespaces_changed(self) -> None:
        self._changed()
        for listener in self.namespace_listeners:
            listener()

    def _changed(self) -> None:
        """A path's state changed: choose routes again and send the commands that waited."""
        self._tiers.clear()
        self.namespaces = self._any_live().namespaces
        waiting, self._waiting = self._waiting, collections.deque()
        while waiting:
            self._dispatch(waiting.popleft())

    def _tier(self, nsid: int) -> tuple[Controller, ...]:
        """The live optimized paths for ``nsid``, else the non-optimized ones, in their order."""
        optimized, fallback = [], []
        for path in self.paths:
            if path.state != "live":
                continue
            state = self._states[path].get(nsid)
            if state == AnaState.OPTIMIZED:
                optimized.append(path)
            elif state == AnaState.NON_OPTIMIZED:
                fallback.append(path)
        return tuple(optimized or fallback)

    # -- I/O ------------------------------------------------------------------------------------

    def submit_io(self, sqe: bytearray, data_out: bytes | memoryview | None, data_in: memoryview | None,
                  done: IoDone) -> None:
        """As :meth:`Controller.submit_io`, on the best path; sent again on another when a path
        fails it with an ANA status or goes down."""
        self._dispatch(_Attempt(self, sqe, data_out, data_in, done))

    def _dispatch(self, attempt: _Attempt) -> None:
        nsid = attempt.nsid
        tier = self._tiers.get(nsid)
        if tier is None:
            tier = self._tiers[nsid] = self._tier(nsid)
        if not tier:
            self._hold_back(attempt)
            return
        if len(tier) == 1 or self.iopolicy == _NUMA:
            path = tier[0]
        elif self.iopolicy == _ROUND_ROBIN:
            turn = self._turn.get(nsid, 0)
            self._turn[nsid] = turn + 1
            path = tier[turn % len(tier)]
        else:  # queue-depth
            path = min(tier, key=self._inflight.__getitem__)
        attempt.path = path
        attempt.seen = self.ana_reads[path]
        self._inflight[path] += 1
        path.submit_io(attempt.sqe, attempt.data_out, attempt.data_in, attempt.finished)

    def _path_failed(self, attempt: _Attempt, exc: BaseException) -> bool:
        """``attempt`` failed on its path: True when it goes on (another path, or waiting for
        one); False when ``exc`` is the caller's (a status of the command itself, or the wait
        is over)."""
        path = attempt.path
        ana = isinstance(exc, NvmeError)
        if ana and exc.status & _STATUS_CODE not in ANA_STATUSES:
            return False
        if not ana and not isinstance(exc, (ConnectionError, TimeoutError)):
            return False
        if self._closed:
            return False
        now = time.monotonic()
        if not attempt.deadline:
            attempt.deadline = now + self.ctrl_loss_tmo
            if not ana:  # an ANA status is logged once per transition (_ana_status)
                log.warning("path failed; retrying on another", subnqn=self.params.subnqn, path=_name(path),
                            nsid=attempt.nsid, error=str(exc))
        elif now > attempt.deadline:
            return False
        attempt.error = exc
        if ana:
            self._ana_status(attempt, path, exc)
        else:  # a path that went down is read again when it is back (_live_changed)
            self.path_retries += 1
            self._tiers.pop(attempt.nsid, None)
        self._dispatch(attempt)
        return True

    def _ana_status(self, attempt: _Attempt, path: Controller, exc: BaseException) -> None:
        """``attempt`` came back from ``path`` with an ANA status: the (namespace, path)
        transition's one retry when it is the first news of it, else requeued with it (see the
        module docstring). Either way ``attempt`` is then sent on the route this leaves."""
        nsid = attempt.nsid
        states = self._states[path]
        read_since = attempt.seen != self.ana_reads[path]  # a read started after it was sent: its news is in it
        if states.get(nsid) is not _UNKNOWN and not read_since:
            self.ana_retries_on[path][nsid] += 1
            log.warning("ANA status; reading the path's log, the namespace's commands go elsewhere",
                        subnqn=self.params.subnqn, path=_name(path), nsid=nsid, error=str(exc))
            self._take_off(path, nsid)
            self._refresh(path)
            return
        self.ana_requeued_on[path][nsid] += 1
        if read_since and path in self._refreshing:  # that read is under way: wait for its answer
            self._take_off(path, nsid)

    def _take_off(self, path: Controller, nsid: int) -> None:
        """``nsid`` is not sent on ``path`` until the path's log is read (its state unknown)."""
        self._states[path][nsid] = _UNKNOWN
        self._tiers.pop(nsid, None)

    def _hold_back(self, attempt: _Attempt) -> None:
        """No usable path for ``attempt`` now: it waits for one (see :meth:`_changed`), or
        fails once its deadline passes or every path gave up."""
        if self._closed or all(p.failed is not None for p in self.paths):
            attempt.done(attempt.error or QueueLost(f"no path to {self.params.subnqn}"))
            return
        if not attempt.deadline:
            attempt.deadline = time.monotonic() + self.ctrl_loss_tmo
        self._waiting.append(attempt)
        if self._sweep is None:
            self._sweep = self._loop.call_later(WAIT_SWEEP, self._sweep_waiting)

    def _sweep_waiting(self) -> None:
        self._sweep = None
        now = time.monotonic()
        keep: collections.deque[_Attempt] = collections.deque()
        for attempt in self._waiting:
            if now > attempt.deadline or self._closed or all(p.failed is not None for p in self.paths):
                attempt.done(attempt.error or QueueLost(f"no usable path to {self.params.subnqn}"))
            else:
                keep.append(attempt)
        self._waiting = keep
        if keep:
            self._sweep = self._loop.call_later(WAIT_SWEEP, self._sweep_waiting)

    def hold_sends(self) -> None:
        for path in self.paths:
            path.hold_sends()

    def release_sends(self) -> None:
        for path in self.paths:
            path.release_sends()

    # The byte-range and awaitable wrappers are Controller's own, not a second copy: they use
    # only submit_io, check_range, namespace(s), max_transfer and _loop, which this class has.
    transfer = Controller.transfer
    _wait = Controller._wait
    io_command = Controller.io_command
    read_into = Controller.read_into
    read = Controller.read
    write = Controller.write
    _nlb0 = Controller._nlb0
    read_bytes = Controller.read_bytes
    write_bytes = Controller.write_bytes
    flush = Controller.flush
    write_zeroes = Controller.write_zeroes
    deallocate = Controller.deallocate
    namespace = Controller.namespace
    check_range = Controller.check_range

    # -- what the daemon shows ------------------------------------------------------------------

    @property
    def failed(self) -> BaseException | None:
        """Every path gave up (or the connection was closed)."""
        if all(p.failed is not None for p in self.paths):
            return self.paths[0].failed
        return None

    @property
    def state(self) -> str:
        states = [self._path_state(p) for p in self.paths]
        return next((s for s in ("live", "reconnecting", "connecting") if s in states), "failed")

    def _path_state(self, path: Controller) -> str:
        """As ``path.state``, but "connecting" until a joining path is admitted, "refused" after
        it showed another data set."""
        return "refused" if path in self._refused else "connecting" if path in self._joining else path.state

    @property
    def cntlid(self) -> int:
        return self._any_live().cntlid

    @property
    def reconnects(self) -> int:
        """The paths' re-established associations (the initiator's metrics)."""
        return sum(p.reconnects for p in self.paths)

    @property
    def io(self) -> list[Any]:
        return [conn for p in self.paths for conn in p.io]

    @property
    def counters(self) -> IoCounters:
        """The paths' counters summed (a command retried on another path counts on each)."""
        total = IoCounters()
        for p in self.paths:
            c = p.counters
            total.ops = [a + b for a, b in zip(total.ops, c.ops)]
            total.bytes = [a + b for a, b in zip(total.bytes, c.bytes)]
            total.buckets = [a + b for a, b in zip(total.buckets, c.buckets)]
            total.latency_ns += c.latency_ns
            for k, n in c.errors.items():
                total.errors[k] = total.errors.get(k, 0) + n
        return total

    def describe_paths(self) -> list[dict[str, Any]]:
        return [{"transport": p.params.transport, "traddr": p.params.traddr, "trsvcid": p.params.trsvcid,
                 "cntlid": p.cntlid, "state": self._path_state(p),
                 **({"error": self._refused[p]} if p in self._refused else {}),
                 "ana": {str(n): s.name.lower().replace("_", "-") if s is not None else "unknown"
                         for n, s in sorted(self._states[p].items())},
                 "ana_reads": self.ana_reads[p], "inflight": self._inflight[p],
                 "ana_retries": _by_nsid(self.ana_retries_on[p]), "ana_requeued": _by_nsid(self.ana_requeued_on[p])}
                for p in self.paths]

    @property
    def ana_retries(self) -> int:
        """ANA-status retries, all namespaces and paths (at most one per transition of each)."""
        return sum(sum(c.values()) for c in self.ana_retries_on.values())

    @property
    def ana_requeued(self) -> int:
        """Commands requeued with an ANA-status retry, all namespaces and paths."""
        return sum(sum(c.values()) for c in self.ana_requeued_on.values())

    def describe(self) -> dict[str, Any]:
        """What ``blockctl list`` and the metrics show of the connection beside its paths."""
        return {"iopolicy": self.iopolicy, "ana_retries": self.ana_retries, "ana_requeued": self.ana_requeued,
                "path_retries": self.path_retries, "paths": self.describe_paths()}

    async def identify_controller(self) -> Any:
        return await self._any_live().identify_controller()

    async def identify_namespace(self, nsid: int) -> Any:
        return await self._any_live().identify_namespace(nsid)

    def _any_live(self) -> Controller:
        """A live admitted path, else an admitted one (the first path up at connect time
        while none is live): never a joining path, whose namespaces are not checked yet."""
        admitted = [p for p in self.paths if p not in self._joining and p not in self._refused
                    and p.was_live]
        return next((p for p in admitted if p.state == "live"), admitted[0] if admitted else self.paths[0])

    async def close(self) -> None:
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for task in [*self._refreshing.values(), *self._joining.values()]:
            task.cancel()
        for timer in self._anatt.values():
            timer.cancel()
        self._anatt.clear()
        for path in self.paths:
            await path.close()
        waiting, self._waiting = self._waiting, collections.deque()
        for attempt in waiting:
            attempt.done(QueueLost("disconnected"))


async def _namespace_ids(path: Controller) -> dict[int, tuple[bytes, bytes]]:
    """nsid -> (NGUID, EUI-64) of every namespace ``path`` shows."""
    ids = {}
    for nsid in sorted(path.namespaces):
        ident = await path.identify_namespace(nsid)
        ids[nsid] = (bytes(ident.nguid), bytes(ident.eui64))
    return ids


def _same_namespaces(expected: dict[int, tuple[bytes, bytes]], where: str, path: Controller,
                     ids: dict[int, tuple[bytes, bytes]]) -> None:
    """Refuse (ConnectError) a path whose namespaces (``ids``) differ from ``expected``, what
    ``where`` shows: other NSIDs, or another NGUID/EUI-64 for one NSID. Two targets with the
    same NQN but different data sets, which the Linux host refuses too ("IDs don't match for
    shared namespace")."""
    if sorted(ids) != sorted(expected):
        raise ConnectError(f"{_name(path)} shows namespaces {sorted(ids)}, {where} {sorted(expected)}")
    for nsid, pair in expected.items():
        if ids[nsid] != pair:
            raise ConnectError(f"namespace {nsid} has different NGUID/EUI-64 on the paths: not one "
                               "namespace (give both targets the same nguid, or let them derive it)")


def _check_cntlid(subnqn: str, path: Controller, others: list[Controller]) -> None:
    """Warn when ``path`` has the controller id of one of ``others`` (paths already in use): the
    targets' cntlid ranges overlap. This host tells paths apart without it, but the Linux host
    refuses a second controller of a subsystem with the same id ("Duplicate cntlid",
    nvme_validate_cntlid), so the same set-up would lose a path there."""
    for other in others:
        if other.cntlid == path.cntlid:
            log.warning("two paths have the same controller id: give the targets disjoint "
                        "cntlid_min..cntlid_max (the Linux host refuses the second path)",
                        subnqn=subnqn, cntlid=path.cntlid, paths=[_name(other), _name(path)])
            return


def _by_nsid(counts: collections.Counter[int]) -> dict[str, int]:
    """A per-namespace count as the daemon shows it (JSON keys: nsid as text, in order)."""
    return {str(n): counts[n] for n in sorted(counts)}


def _name(path: Controller) -> str:
    return f"{path.params.traddr}:{path.params.trsvcid}"


def parse_path(text: str, default_port: int) -> tuple[str, int]:
    """``ADDR``, ``ADDR:PORT`` or ``[IPv6]:PORT`` -> (address, port); a ValueError for the user."""
    address, port = text, default_port
    if text.startswith("["):
        address, _, rest = text[1:].partition("]")
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"path {text!r}: expected [ADDRESS]:PORT")
            port = _port(rest[1:], text)
    elif text.count(":") == 1:
        address, port_text = text.split(":")
        port = _port(port_text, text)
    if not address:
        raise ValueError(f"path {text!r} has no address")
    return address, port


def _port(text: str, path: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError(f"path {path!r}: port {text!r} is not 1..65535")
    return int(text)
