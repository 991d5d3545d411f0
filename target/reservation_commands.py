"""The reservation commands on one controller: Register, Report, Acquire and Release as rows of
its I/O command table, the Reservation Notification log page (80h) with its event, and Features
81h-83h (NVMe Base 2.0, 5.27.1.x, 7.2-7.5).

The state and its rules live in :mod:`target.reservations`, one per namespace; this module
parses the commands (through :mod:`protocol.reservation`), asks that state, makes the change
durable when PTPL is on, and tells the other hosts' controllers what happened to them.
"""

from __future__ import annotations

import collections
import weakref
from typing import TYPE_CHECKING

import structlog

from protocol.constants import AEN_RESERVATION_LOG, FeatureId, IoOpcode
from protocol.layout import fixed_layout
from protocol.nvme import NSID_ALL
from protocol.reservation import (
    ACQUIRE_DATA, ACTION_MASK, CNTLID_DYNAMIC, CPTPL_SHIFT, EDS, EXT_REGISTRANT, EXT_STATUS_HEADER, IEKEY,
    NOTIFICATION_LOG, NOTIFY_MASK_BY_TYPE, NOTIFY_MASK_REGPRE, NOTIFY_MASK_RESPRE, NOTIFY_MASK_RESREL, PTPL, REGISTER_DATA, RELEASE_DATA, REPORT_COMMAND, RESERVATION_COMMAND,
    RCSTS_HOLDS, NotificationType,
)
from protocol.status import Status
from target.request import Direction, Request
from target.reservations import Outcome, Reservations

if TYPE_CHECKING:
    from target.controller import Controller
    from target.queue import CommandTable
    from target.subsystem import Subsystem

log = structlog.get_logger("blockd.target.reservations")

_COMMAND = fixed_layout(RESERVATION_COMMAND)
_ACTION, _RTYPE, _CPTPL = (_COMMAND.index(n) for n in ("action", "rtype", "cptpl"))
_REPORT = fixed_layout(REPORT_COMMAND)
_NUMD, _CDW11 = (_REPORT.index(n) for n in ("numd", "cdw11"))
_DATA_SIZE = {IoOpcode.RESERVATION_REGISTER: REGISTER_DATA.sizeof(),
              IoOpcode.RESERVATION_ACQUIRE: ACQUIRE_DATA.sizeof(),
              IoOpcode.RESERVATION_RELEASE: RELEASE_DATA.sizeof()}
_MASKS = NOTIFY_MASK_REGPRE | NOTIFY_MASK_RESREL | NOTIFY_MASK_RESPRE
NOTICE_LIMIT = 255
"""Notices a controller keeps unread (the page's Number of Available Log Pages is one byte);
older ones go first, as the spec lets a controller lose them and counts on the running count."""


_BY_CONTROLLER: weakref.WeakKeyDictionary[Controller, ReservationCommands] = weakref.WeakKeyDictionary()


def of(ctrl: Controller) -> ReservationCommands:
    """``ctrl``'s reservation commands. Looked up here rather than kept as an attribute of the
    controller: one more instance attribute there cost the compiled I/O path ~150 instructions
    per 4 KiB I/O under callgrind (tests/bench/bench_target_io.py, docs/benchmarks.md
    "Reservations on the I/O path"); likely CPython 3.11's limit of 30 keys for an instance's
    shared-key attribute table, which the controller's 29 attributes then passed."""
    return _BY_CONTROLLER[ctrl]


class ReservationCommands:
    """A controller's reservation commands and notices (see the module docstring)."""

    def __init__(self, ctrl: Controller) -> None:
        self._ctrl = ctrl
        _BY_CONTROLLER[ctrl] = self
        self.notices: collections.deque[tuple[int, int]] = collections.deque(maxlen=NOTICE_LIMIT)
        """(nsid, NotificationType) not read yet, oldest first."""
        self.notice_count = 0
        """Log Page Count: every notice ever queued here (64 bits, 0 skipped on wrap)."""
        self.event_masked = False
        """The event was sent and the log not read since (one event per unread batch)."""
        self.masks: dict[int, int] = {}
        """nsid -> Set Features 82h mask bits (absent: 0, every notice)."""

    def rows(self) -> CommandTable:
        """The four commands as I/O command table rows (opcode -> (checks, handler))."""
        return {IoOpcode.RESERVATION_REGISTER: (self._check, self._register),
                IoOpcode.RESERVATION_REPORT: (self._check_report, self._report),
                IoOpcode.RESERVATION_ACQUIRE: (self._check, self._acquire),
                IoOpcode.RESERVATION_RELEASE: (self._check, self._release)}

    # -- checks ---------------------------------------------------------------------------------

    def _namespace(self, req: Request) -> int:
        """Look the namespace up and hold it until completion, as ``Controller._check_rw``."""
        ctrl = self._ctrl
        ns = req.ns = ctrl.io_namespaces.get(req.nsid)
        if ns is None:
            return ctrl.ana_refusal(req.nsid)
        ns.in_flight += 1
        return Status.SUCCESS

    def _check(self, req: Request) -> int:
        """Register, Acquire, Release: their data is exactly the keys they carry."""
        status = self._namespace(req)
        if status:
            return status
        if req.length != _DATA_SIZE[req.opcode] or req.direction is not Direction.HOST_TO_CONTROLLER:
            return Status.SGL_INVALID_DATA_LENGTH
        return Status.SUCCESS

    def _check_report(self, req: Request) -> int:
        """Report: the transfer is NUMD's (CDW10, 0's based dwords), as nvmet checks it."""
        status = self._namespace(req)
        if status:
            return status
        if (_REPORT.unpack_from(req.sqe)[_NUMD] + 1) * 4 != req.length:
            return Status.SGL_INVALID_DATA_LENGTH
        return Status.SUCCESS

    # -- commands ---------------------------------------------------------------------------------

    async def _register(self, req: Request) -> None:
        fields = _COMMAND.unpack_from(req.sqe)
        data = REGISTER_DATA.parse(bytes(req.data))
        resv = req.ns.reservations
        await self._finish(req, resv, resv.ptpl, resv.register(
            self._ctrl.hostid, fields[_ACTION] & ACTION_MASK, bool(fields[_ACTION] & IEKEY),
            data.crkey, data.nrkey, fields[_CPTPL] >> CPTPL_SHIFT))

    async def _acquire(self, req: Request) -> None:
        fields = _COMMAND.unpack_from(req.sqe)
        data = ACQUIRE_DATA.parse(bytes(req.data))
        resv = req.ns.reservations
        await self._finish(req, resv, resv.ptpl, resv.acquire(
            self._ctrl.hostid, fields[_ACTION] & ACTION_MASK, bool(fields[_ACTION] & IEKEY),
            fields[_RTYPE], data.crkey, data.prkey))

    async def _release(self, req: Request) -> None:
        fields = _COMMAND.unpack_from(req.sqe)
        data = RELEASE_DATA.parse(bytes(req.data))
        resv = req.ns.reservations
        await self._finish(req, resv, resv.ptpl, resv.release(
            self._ctrl.hostid, fields[_ACTION] & ACTION_MASK, bool(fields[_ACTION] & IEKEY),
            fields[_RTYPE], data.crkey))

    async def _finish(self, req: Request, resv: Reservations, ptpl_before: bool, out: Outcome) -> None:
        """Make a change durable (see ``Reservations.must_save``), then tell the other hosts."""
        req.status = out.status
        if out.changed and resv.must_save(ptpl_before):
            try:
                await resv.save_now()
            except OSError as exc:
                req.status = Status.INTERNAL_ERROR
                log.error("reservation state not saved", nsid=req.nsid, error=str(exc))
                return
        for hostid, kind in out.notices:
            deliver(self._ctrl, req.nsid, hostid, kind)

    async def _report(self, req: Request) -> None:
        if not _REPORT.unpack_from(req.sqe)[_CDW11] & EDS:
            # host identifiers here are 128 bits (CTRATT.HIDS): only the extended structure has room
            req.status = Status.HOST_ID_INCONSISTENT_FORMAT
            return
        resv = req.ns.reservations
        parts = [EXT_STATUS_HEADER.build(dict(gen=resv.generation, rtype=resv.rtype,
                                              regctl=len(resv.registrants), ptpls=int(resv.ptpl)))]
        parts += [EXT_REGISTRANT.build(dict(cntlid=CNTLID_DYNAMIC, rcsts=RCSTS_HOLDS if resv.holds(h) else 0,
                                            rkey=k, hostid=h)) for h, k in resv.registrants.items()]
        page = b"".join(parts)[:req.length]  # a short buffer takes what fits (REGCTL says how many)
        req.reply = page.ljust(req.length, b"\0")

    # -- features ---------------------------------------------------------------------------------

    async def set_feature(self, nsid: int, fid: int, value: int) -> int:
        """Set Features 82h (this controller's notice mask for ``nsid``, or every namespace with
        NSID FFFFFFFFh) or 83h (the namespace's PTPL, durable before the command completes)."""
        ctrl = self._ctrl
        if fid == FeatureId.RESERVATION_NOTIFICATION_MASK:
            mask = value & _MASKS
            if nsid == NSID_ALL:
                self.masks = dict.fromkeys(ctrl.io_namespaces, mask)
                return Status.SUCCESS
            if nsid not in ctrl.io_namespaces:
                return ctrl.ana_refusal(nsid)
            self.masks[nsid] = mask
            return Status.SUCCESS
        ns = ctrl.io_namespaces.get(nsid)
        if ns is None:
            return Status.INVALID_FIELD if nsid == NSID_ALL else ctrl.ana_refusal(nsid)
        resv = ns.reservations
        before = resv.ptpl
        status = resv.set_ptpl(bool(value & PTPL))
        if not status and resv.must_save(before):
            try:
                await resv.save_now()
            except OSError as exc:
                log.error("reservation state not saved", nsid=nsid, error=str(exc))
                return Status.INTERNAL_ERROR
        return status

    def get_feature(self, nsid: int, fid: int) -> tuple[int, int]:
        """Get Features 82h or 83h: (status, dw0)."""
        ns = self._ctrl.io_namespaces.get(nsid)
        if ns is None:
            return (Status.INVALID_FIELD if nsid == NSID_ALL else self._ctrl.ana_refusal(nsid)), 0
        if fid == FeatureId.RESERVATION_NOTIFICATION_MASK:
            return Status.SUCCESS, self.masks.get(nsid, 0)
        return Status.SUCCESS, int(ns.reservations.ptpl)

    # -- notices ----------------------------------------------------------------------------------

    def notice(self, nsid: int, kind: NotificationType) -> None:
        """Queue a notice for this controller's host unless it masked that kind on ``nsid``; the
        event goes out when the host has read the log since the last one."""
        if self.masks.get(nsid, 0) & NOTIFY_MASK_BY_TYPE[kind]:
            return
        self.notices.append((nsid, kind))
        self.notice_count = (self.notice_count + 1) & 0xFFFFFFFFFFFFFFFF or 1
        if not self.event_masked:
            self.event_masked = True
            self._ctrl.notify(AEN_RESERVATION_LOG)

    def log_page(self, rae: bool) -> bytes:
        """Reservation Notification log page: the oldest unread notice, taken off (an empty page
        when there is none); reading without RAE re-arms the event."""
        if self.notices:
            nsid, kind = self.notices.popleft()
            page = NOTIFICATION_LOG.build(dict(count=self.notice_count - len(self.notices), type=kind,
                                               available=min(len(self.notices), 255), nsid=nsid))
        else:
            page = NOTIFICATION_LOG.build(dict(count=0, type=NotificationType.EMPTY, available=0, nsid=0))
        if not rae:
            self.event_masked = False
        return page


def deliver(ctrl: Controller, nsid: int, hostid: bytes, kind: NotificationType) -> None:
    """A notice for every controller ``hostid`` holds on ``ctrl``'s subsystem (a host is one
    registrant however many controllers it has)."""
    sub: Subsystem = ctrl.subsystem
    for other in list(ctrl.target.controllers.values()):
        if other.subsystem is sub and other.hostid == hostid and not other.dead:
            of(other).notice(nsid, kind)
