"""One namespace's reservation: its registrants, holder and type, the access rule every I/O
command passes, and the rules of the four reservation commands (NVMe Base 2.0, 8.19).

A registrant is a *host* (its 128-bit Host Identifier from Connect), not a controller: every
controller of one host shares its registration, as nvmet's ``pr.c`` and SPDK's
``nvmf_ns_reservation_*`` key registrants by host id. The command methods here only decide and
change state; they return the status and the notices to deliver (:class:`Outcome`), which
:class:`target.controller.Controller` turns into log pages and AENs on the hosts' controllers.

While the namespace has no registrant the I/O path pays one flag test (``Namespace.reserved``)
and the compiled plane serves it; with any registrant the compiled plane's per-namespace flag
(``fast.accessible``) is off and every command goes through the Python queue, which applies
:meth:`Reservations.allows`.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog

from protocol.replication import MAX_STORED_REGISTRANTS, NO_HOLDER, RESERVATION_STATE
from protocol.reservation import (
    AcquireAction, Cptpl, NotificationType, RegisterAction, ReleaseAction, ReservationType,
)
from protocol.status import Status

if TYPE_CHECKING:
    from target.subsystem import Namespace

log = structlog.get_logger("blockd.target.reservations")

_CONFLICT, _INVALID_FIELD = Status.RESERVATION_CONFLICT, Status.INVALID_FIELD
_WE, _EA = ReservationType.WRITE_EXCLUSIVE, ReservationType.EXCLUSIVE_ACCESS
_ALL_REGISTRANTS = frozenset({ReservationType.WRITE_EXCLUSIVE_ALL_REGS, ReservationType.EXCLUSIVE_ACCESS_ALL_REGS})
"""Types whose every registrant is a holder."""
_REGISTRANTS_ONLY = frozenset({ReservationType.WRITE_EXCLUSIVE_REG_ONLY, ReservationType.EXCLUSIVE_ACCESS_REG_ONLY})
_EXCLUSIVE_ACCESS = frozenset({ReservationType.EXCLUSIVE_ACCESS, ReservationType.EXCLUSIVE_ACCESS_REG_ONLY,
                               ReservationType.EXCLUSIVE_ACCESS_ALL_REGS})
"""Types that refuse reads to non-holders (to every non-holder for Exclusive Access, to
non-registrants for the other two)."""
SIDECAR_SUFFIX = ".resv"
"""The PTPL state of a namespace backed by ``path`` lives in ``path + SIDECAR_SUFFIX``."""
Notice = tuple[bytes, NotificationType]
"""(host identifier, what happened to it)."""


@dataclass
class Outcome:
    """What a reservation command did: its status and the notices owed to other hosts."""

    status: int = Status.SUCCESS
    notices: list[Notice] = field(default_factory=list)
    changed: bool = False
    """The persistent state changed: with PTPL it must be on disk before the command completes."""


class Reservations:
    """The reservation state of one namespace (see the module docstring)."""

    def __init__(self, ns: Namespace, sidecar: str = "") -> None:
        self._ns = ns
        self._replicated = getattr(ns.backend, "save_reservations", None)
        """A replicated namespace's backend keeps the state in every copy's superblock
        (:meth:`target.replication.mirror.ReplicatedBackend.save_reservations`), on every
        change: a failover to the standby keeps it, PTPL or not."""
        self.sidecar = "" if self._replicated is not None else sidecar
        """Where the state is kept with PTPL on a plain namespace; "" when it is not kept there."""
        self.registrants: dict[bytes, int] = {}
        """host identifier -> registration key, in registration order (the Report's order)."""
        self.holder: bytes | None = None
        """The holding host for types 1-4; for types 5 and 6 every registrant holds and this is None."""
        self.rtype = 0
        self.generation = 0
        self.ptpl = False
        self.save_lock = asyncio.Lock()
        """Sidecar writes one at a time, in command order (:func:`target.reservation_commands.persist`)."""

    # -- access -------------------------------------------------------------------------------

    def holds(self, hostid: bytes) -> bool:
        """Whether ``hostid`` is a reservation holder."""
        if not self.rtype:
            return False
        if self.rtype in _ALL_REGISTRANTS:
            return hostid in self.registrants
        return self.holder == hostid

    def allows(self, hostid: bytes, write: bool) -> bool:
        """The access table (NVMe Base 2.0, "Command Behavior in the Presence of a Reservation"):
        whether a command of the write (or else the read) command group from ``hostid`` runs."""
        rtype = self.rtype
        if not rtype or self.holds(hostid):
            return True
        registered = hostid in self.registrants
        if write:
            # only the registrants-only and all-registrants types let a registrant write
            return registered and rtype not in (_WE, _EA)
        if rtype not in _EXCLUSIVE_ACCESS:
            return True
        return registered and rtype != _EA

    # -- commands -----------------------------------------------------------------------------

    def register(self, hostid: bytes, action: int, iekey: bool, crkey: int, nrkey: int, cptpl: int) -> Outcome:
        """Reservation Register: register, unregister or replace the host's key; CPTPL."""
        if cptpl == Cptpl.RESERVED:
            return Outcome(_INVALID_FIELD)
        key = self.registrants.get(hostid)
        out = Outcome()
        if action == RegisterAction.REGISTER:
            if not nrkey:
                return Outcome(_INVALID_FIELD)  # as SPDK: a zero key cannot be registered
            if key is None:
                if len(self.registrants) >= MAX_STORED_REGISTRANTS:
                    return Outcome(Status.INTERNAL_ERROR)  # no room to keep one more (replication superblock)
                self.registrants[hostid] = nrkey
            elif key != nrkey:
                return Outcome(_CONFLICT)  # registering again with the same key is no error
        elif action == RegisterAction.UNREGISTER:
            if key is None or (not iekey and key != crkey):
                return Outcome(_CONFLICT)
            out.notices = self._unregister(hostid)
        elif action == RegisterAction.REPLACE:
            if not nrkey:
                return Outcome(_INVALID_FIELD)
            if key is None or (not iekey and key != crkey):
                return Outcome(_CONFLICT)
            self.registrants[hostid] = nrkey
        else:
            return Outcome(_INVALID_FIELD)
        self.generation = (self.generation + 1) & 0xFFFFFFFF
        if cptpl in (Cptpl.CLEAR, Cptpl.SET):
            # Where the state cannot persist (RESCAP bit 0 clear) a request for PTPL is ignored,
            # as nvmet ignores CPTPL: the Linux host's IOC_PR_REGISTER always asks for it
            self.ptpl = cptpl == Cptpl.SET and self.can_persist
        out.changed = True
        self._changed()
        return out

    def _unregister(self, hostid: bytes) -> list[Notice]:
        """Drop ``hostid``'s registration; a holder's goes with it (types 1-4), and in the
        registrants-only types the others hear the reservation was released."""
        del self.registrants[hostid]
        if not self.rtype:
            return []
        if self.rtype in _ALL_REGISTRANTS:
            if not self.registrants:
                self.rtype = 0
            return []
        if self.holder != hostid:
            return []
        released = self.rtype in _REGISTRANTS_ONLY
        self.holder, self.rtype = None, 0
        if released:
            return [(h, NotificationType.RESERVATION_RELEASED) for h in self.registrants]
        return []

    def acquire(self, hostid: bytes, action: int, iekey: bool, rtype: int, crkey: int, prkey: int) -> Outcome:
        """Reservation Acquire: acquire, preempt, or preempt and abort (the core refuses the
        preempted hosts' commands from here on: see ``Controller._write``)."""
        key = self.registrants.get(hostid)
        if key is None or (not iekey and key != crkey):
            return Outcome(_CONFLICT)
        if not ReservationType.WRITE_EXCLUSIVE <= rtype <= ReservationType.EXCLUSIVE_ACCESS_ALL_REGS:
            return Outcome(_INVALID_FIELD)
        if action == AcquireAction.ACQUIRE:
            if not self.rtype:
                self._take(hostid, rtype)
                return Outcome(changed=True)
            if self.holds(hostid) and self.rtype == rtype:
                return Outcome()
            return Outcome(_CONFLICT)
        if action in (AcquireAction.PREEMPT, AcquireAction.PREEMPT_AND_ABORT):
            return self._preempt(hostid, rtype, prkey)
        return Outcome(_INVALID_FIELD)

    def _take(self, hostid: bytes, rtype: int) -> None:
        self.rtype = rtype
        self.holder = None if rtype in _ALL_REGISTRANTS else hostid
        self._changed()

    def _preempt(self, hostid: bytes, rtype: int, prkey: int) -> Outcome:
        """The preempt rules of 8.19.7: by the holder's key (or 0 under an all-registrants
        type) the reservation moves to this host; by any other key only those registrants go."""
        out = Outcome(changed=True)
        held = self.rtype
        if held in _ALL_REGISTRANTS and not prkey:
            victims = [h for h in self.registrants if h != hostid]
            take = True
        elif held and held not in _ALL_REGISTRANTS and self.registrants.get(self.holder) == prkey:
            victims = [h for h, k in self.registrants.items() if k == prkey and h != hostid]
            take = True
        else:
            if not prkey:
                return Outcome(_INVALID_FIELD)
            victims = [h for h, k in self.registrants.items() if k == prkey and h != hostid]
            take = False
            if not victims:
                return Outcome(_CONFLICT)  # as nvmet/SPDK: nobody registered with that key
        for victim in victims:
            del self.registrants[victim]
            out.notices.append((victim, NotificationType.REGISTRATION_PREEMPTED))
        if take:
            self._take(hostid, rtype)
            if held != rtype:  # a new type: the others' reservation as they knew it is gone (as nvmet)
                out.notices.extend((h, NotificationType.RESERVATION_RELEASED)
                                   for h in self.registrants if h != hostid)
        elif held in _ALL_REGISTRANTS and not self.registrants:
            self.rtype = 0
        self.generation = (self.generation + 1) & 0xFFFFFFFF
        self._changed()
        return out

    def release(self, hostid: bytes, action: int, iekey: bool, rtype: int, crkey: int) -> Outcome:
        """Reservation Release: release the reservation, or clear it and every registration."""
        key = self.registrants.get(hostid)
        if key is None or (not iekey and key != crkey):
            return Outcome(_CONFLICT)
        if action == ReleaseAction.CLEAR:
            others = [h for h in self.registrants if h != hostid]
            self.registrants.clear()
            self.holder, self.rtype = None, 0
            self.generation = (self.generation + 1) & 0xFFFFFFFF
            self._changed()
            return Outcome(notices=[(h, NotificationType.RESERVATION_PREEMPTED) for h in others], changed=True)
        if action != ReleaseAction.RELEASE:
            return Outcome(_INVALID_FIELD)
        if not self.holds(hostid):
            return Outcome()  # not the holder: succeeds with no effect
        if rtype != self.rtype:
            return Outcome(_INVALID_FIELD)
        released = self.rtype not in (_WE, _EA)
        self.holder, self.rtype = None, 0
        self._changed()
        notices = [(h, NotificationType.RESERVATION_RELEASED) for h in self.registrants if h != hostid]
        return Outcome(notices=notices if released else [], changed=True)

    def set_ptpl(self, on: bool) -> int:
        """Set Features 83h: a status (Invalid Field when this namespace cannot persist)."""
        if on and not self.can_persist:
            return _INVALID_FIELD
        self.ptpl = on
        self._changed()
        return Status.SUCCESS

    def _changed(self) -> None:
        """Keep the namespace's I/O flags in step: with any registrant the compiled plane leaves
        its commands to the Python queue (``fast.accessible``), which then checks each one."""
        ns = self._ns
        reserved = bool(self.registrants)
        ns.reserved = reserved
        if ns.fast is not None and not ns.removed:
            ns.fast.accessible = not reserved

    # -- persistence --------------------------------------------------------------------------

    @property
    def can_persist(self) -> bool:
        """PTPL is possible (RESCAP bit 0): a sidecar file, or a replicated namespace's metadata.
        Elsewhere (a block device path, a RAM namespace) CPTPL 11b / Set Features 83h do not
        turn it on."""
        return bool(self.sidecar) or self._replicated is not None

    def must_save(self, ptpl_before: bool) -> bool:
        """Whether a change has to be made durable before its command completes: always on a
        replicated namespace (the standby must have it), else while PTPL is or was on."""
        return self._replicated is not None or ptpl_before or self.ptpl

    async def save_now(self) -> None:
        """Make the state as it is now durable: the replicas' and this copy's superblocks, or the
        sidecar (in a thread), one save at a time so they land in command order."""
        async with self.save_lock:
            if self._replicated is not None:
                await self._replicated(self.record())
            else:
                await asyncio.to_thread(self.save, self.snapshot())

    def record(self) -> bytes:
        """The state as the replication superblock keeps it (``protocol.replication``)."""
        regs = list(self.registrants.items())
        holder = next((i for i, (h, _) in enumerate(regs) if h == self.holder), NO_HOLDER)
        return RESERVATION_STATE.build(dict(generation=self.generation, rtype=self.rtype, ptpl=int(self.ptpl),
                                            holder=holder, count=len(regs),
                                            registrants=[dict(hostid=h, key=k) for h, k in regs]))

    def restore_record(self, raw: bytes) -> None:
        """Take a :meth:`record` as this namespace's state (nothing kept: no state)."""
        if not raw:
            self.restore({"ptpl": False, "generation": 0, "rtype": 0, "holder": None, "registrants": []})
            return
        state = RESERVATION_STATE.parse(raw)
        regs = [(r.hostid, r.key) for r in state.registrants]
        holder = regs[state.holder][0].hex() if state.holder < len(regs) else None
        self.restore({"ptpl": bool(state.ptpl), "generation": state.generation, "rtype": state.rtype,
                      "holder": holder, "registrants": [[h.hex(), k] for h, k in regs]})

    def adopt_replicated(self) -> None:
        """This copy was promoted: the state its former primary kept in its superblock is the
        namespace's now, PTPL or not (a failover is no power loss)."""
        if self._replicated is not None:
            self.restore_record(self._ns.backend.md.reservations)
            log.info("reservation state taken over", nsid=self._ns.nsid, registrants=len(self.registrants),
                     rtype=self.rtype)

    def snapshot(self) -> dict[str, object]:
        """The state as JSON-able data (the sidecar's and the replication link's form)."""
        return {"version": 1, "ptpl": self.ptpl, "generation": self.generation, "rtype": self.rtype,
                "holder": self.holder.hex() if self.holder is not None else None,
                "registrants": [[h.hex(), k] for h, k in self.registrants.items()]}

    def restore(self, state: dict[str, object]) -> None:
        """Take ``state`` (a :meth:`snapshot`) as this namespace's."""
        self.ptpl = bool(state["ptpl"])
        self.generation = int(state["generation"])  # type: ignore[arg-type]
        self.rtype = int(state["rtype"])  # type: ignore[arg-type]
        holder = state["holder"]
        self.holder = bytes.fromhex(holder) if isinstance(holder, str) else None
        self.registrants = {bytes.fromhex(h): int(k) for h, k in state["registrants"]}  # type: ignore[union-attr]
        self._changed()

    def load(self) -> None:
        """At start: the state saved with PTPL, if any (without PTPL a restart clears it, as a
        power loss does)."""
        if self._replicated is not None:
            raw = self._ns.backend.md.reservations
            if raw and RESERVATION_STATE.parse(raw).ptpl:
                self.restore_record(raw)
            return
        if not self.sidecar:
            return
        try:
            with open(self.sidecar, encoding="utf-8") as f:
                state = json.load(f)
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            raise ValueError(f"namespace {self._ns.nsid}: reservation state {self.sidecar} unreadable: {exc}") from exc
        if state.get("ptpl"):
            self.restore(state)
            log.info("reservation state restored", nsid=self._ns.nsid, registrants=len(self.registrants),
                     rtype=self.rtype)

    def save(self, state: dict[str, object]) -> None:
        """Write ``state`` durably: a new file fsync'd, renamed over the old, the directory
        fsync'd, so a crash leaves the old state or the new, never half of one. Blocking: the
        controller runs it in a thread, one at a time per namespace."""
        tmp = self.sidecar + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, json.dumps(state).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, self.sidecar)
        dfd = os.open(os.path.dirname(os.path.abspath(self.sidecar)), os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
