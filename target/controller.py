"""An NVMe controller on the target: registers, admin commands and NVM I/O commands.

One controller exists per host association (dynamic controller model): the admin Connect makes
it, I/O Connects attach queues to it, and it dies with its admin queue or when the host stops
sending Keep Alive.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import time
from typing import TYPE_CHECKING

import structlog

from blockd.iocounters import IoCounters
from protocol.constants import (
    ANACAP_ALL_STATES, AEN_ANA_CHANGED, CC_EN, CC_SHN_MASK, CMIC_ANA, CMIC_MULTI_CONTROLLER, CMIC_MULTI_PORT,
    CSTS_CFS, CSTS_RDY, CSTS_SHST_COMPLETE, CTRATT_HOST_ID_128, CTRATT_TBKAS, DISCOVERY_NQN,
    GET_LOG_PAGE_LSP_RGO, LPA_COMMANDS_EFFECTS, LPA_EXTENDED_DATA, NMIC_SHARED, OAES_ANA_CHANGE,
    OAES_DISCOVERY_CHANGE, OAES_NS_ATTR, ONCS_DSM,
    ONCS_RESERVATIONS, ONCS_WRITE_ZEROES, AdminOpcode, Cns, FeatureId, IoOpcode, LogPageId, NidType, Property,
)
from protocol.fabrics import PROPERTY_COMMAND_FAST, PROPERTY_SIZE_8, PROPERTY_SIZE_MASK
from protocol.identify import (
    ACTIVE_NS_LIST, IDENTIFY_CONTROLLER, IDENTIFY_CSI_INDEPENDENT_NS, IDENTIFY_NAMESPACE,
    IDENTIFY_SIZE, NS_DESCRIPTOR_LIST,
)
from protocol.layout import field_offset
from protocol.logpage import CHANGED_NS_LIST, COMMANDS_EFFECTS_LOG, EFFECTS_CSUPP, EFFECTS_LBCC, ERROR_LOG_ENTRY
from protocol.nvme import (
    DSM_ATTR_DEALLOCATE, DSM_COMMAND_FAST, DSM_RANGE_FAST, FEATURES_COMMAND, FEATURES_SAVE,
    GET_LOG_PAGE_COMMAND, GET_LOG_PAGE_RAE, IDENTIFY_COMMAND, IO_CONTROL, IO_NLB, IO_SLBA, NSID_ALL,
    RW_CONTROL_DEAC, RW_CONTROL_FUA, SQE,
)
from protocol.reservation import EXHID, PTPL, RESCAP_ALL
from protocol.status import Status, to_wire
from target.ana import ANATT_SECONDS, MAX_ANA_GROUPS, MAX_ANA_NAMESPACES
from target.file_send import PipedRead
from target.request import Direction, Request
from target import digest, reservation_commands
from target.reservation_commands import ReservationCommands

if TYPE_CHECKING:
    from target.queue import CommandTable, TargetQueue
    from target.subsystem import Namespace, Subsystem
    from target.target import Target
    from target.transport import TransportInfo

log = structlog.get_logger("blockd.target.controller")

_READ, _WRITE_ZEROES = int(IoOpcode.READ), int(IoOpcode.WRITE_ZEROES)
_SUCCESS, _INVALID_NS, _LBA_RANGE = Status.SUCCESS, Status.INVALID_NS, Status.LBA_RANGE
_WRITE_PROTECTED, _BAD_LENGTH = Status.NS_WRITE_PROTECTED, Status.SGL_INVALID_DATA_LENGTH
_CONFLICT = Status.RESERVATION_CONFLICT
_TO_HOST = Direction.CONTROLLER_TO_HOST
"""Bound once: read several times per I/O, an IntEnum class attribute costs several globals."""
_PROP_ATTRIB, _PROP_OFFSET, _PROP_VALUE = (PROPERTY_COMMAND_FAST.index(n) for n in ("attrib", "offset", "value"))

VERSION_1_3 = 0x00010300
MQES = 127
CAP = (1 << 37) | (15 << 24) | MQES
"""NVM command set only, CAP.TO = 7.5 s, MPSMIN = MPSMAX = 4 KiB, 128-entry queues."""
KAS_100MS = 10
ERROR_LOG_ENTRIES = 64
AER_LIMIT = 4
DLFEAT_ZEROES = 0x09
"""Deallocated blocks read as zeroes, and Write Zeroes may deallocate (DEAC)."""
DISCOVERY_DEFAULT_KATO_MS = 120_000
"""A discovery controller without keep-alive is still reaped after 2 minutes, as nvmet does."""
_NUSE_ZERO = (Status.ANA_INACCESSIBLE, Status.ANA_PERSISTENT_LOSS)
"""Identify Namespace shows NUSE 0 through a path in these states (in change it does not), as
nvmet's ``nvmet_execute_identify_ns``."""
CMIC = CMIC_MULTI_PORT | CMIC_MULTI_CONTROLLER | CMIC_ANA
"""As nvmet: a subsystem may be reached through several ports and controllers (one per target
when two present it), and reports ANA."""
CTRATT = CTRATT_HOST_ID_128 | CTRATT_TBKAS
"""True of every controller here, discovery included: Connect always carries the 128-bit host id,
and TargetQueue.submit restarts the keep-alive timer on any command (nvmet's I/O controllers
report the same 0x41; its discovery controller reports 0, though it too resets on traffic)."""

_OPCODE, _NSID, _DPTR, _CDW10, _CDW12 = (field_offset(SQE, name)
                                         for name in ("opcode", "nsid", "dptr", "cdw10", "cdw12"))
ERROR_LOCATIONS: dict[int, int] = {
    Status.INVALID_OPCODE: _OPCODE,
    Status.INVALID_FIELD: _CDW10,
    Status.INVALID_NS: _NSID,
    Status.SGL_INVALID_DATA_LENGTH: _DPTR,
    Status.LBA_RANGE: _CDW10,  # SLBA
    Status.ANA_INACCESSIBLE: _NSID,
    Status.ANA_PERSISTENT_LOSS: _NSID,
    Status.ANA_TRANSITION: _NSID,
    Status.INTERNAL_PATH_ERROR: _NSID,  # as nvmet_req_find_ns sets error_loc
    Status.NS_WRITE_PROTECTED: _CDW10,
    Status.FEATURE_NOT_SAVEABLE: _CDW10,  # SV
    Status.INTERNAL_ERROR: _OPCODE,
    Status.WRITE_FAULT: _OPCODE,
    Status.UNRECOVERED_READ_ERROR: _OPCODE,
    Status.CAPACITY_EXCEEDED: _CDW12,  # NLB, as nvmet's errno_to_nvme_status points ENOSPC at the length
}
"""Statuses that get an Error Information log entry (and so the More bit), with the SQE byte the
entry points at. nvmet records an entry only for a failure that set an error location
(``nvmet_set_error`` in drivers/nvme/target/core.c), and its checks set one for these statuses:
the opcode for an unknown command or a backend error, the NSID, the data pointer for a transfer
length, CDW10 for a bad field. Statuses that nvmet completes without a location have no entry
here: a sequence error, an invalid Keep Alive, the AER limit, a transport's SGL offset/type or data
transfer error, and every Connect failure (no controller yet). The location is the one nvmet
gives each status in the common case; it names no finer field than that."""


class Controller:
    """State of one host association with one subsystem."""

    def __init__(self, target: Target, subsystem: Subsystem, cntlid: int, hostnqn: str,
                 hostid: bytes, kato_ms: int, transport: TransportInfo, port_id: int,
                 max_io_queues: int) -> None:
        self.target = target
        self.subsystem = subsystem
        self.cntlid = cntlid
        self.hostnqn = hostnqn
        self.hostid = hostid
        self.transport = transport
        self.port_id = port_id
        self.kato_ms = kato_ms
        self.max_io_queues = max_io_queues
        self.cc = 0
        self.csts = 0
        self.queues: dict[int, TargetQueue] = {}
        self.aer_waiters: collections.deque[asyncio.Future[int]] = collections.deque()
        self.pending_events: collections.deque[int] = collections.deque()
        self.changed_nsids: set[int] = set()
        self.async_event_config = 0
        self.error_count = 0
        self.error_log: collections.deque[bytes] = collections.deque(maxlen=ERROR_LOG_ENTRIES)
        self.traffic_seen = False
        """A command arrived since the keep-alive period began (set by TargetQueue.submit: an
        attribute store per command, where a timestamp would be a clock call per command)."""
        self.restart_keep_alive()
        self.dead = False
        self.connected_ns = time.time_ns()
        """Wall-clock time of the admin Connect (shown as "connected since")."""
        self.counters = IoCounters()
        """This host's I/O commands on this controller (every I/O queue adds here)."""
        self._namespaces = subsystem.namespaces
        self.io_namespaces = self._namespaces
        """The namespaces I/O is served for through this controller's port: the subsystem's own
        dict while every ANA group is accessible there (no cost per I/O), else the accessible
        ones; see :meth:`refresh_access`."""
        self._ana_refusals: dict[int, int] = {}
        """nsid -> the status I/O to it gets through this port: its ANA group's (target.ana), or
        Internal Path Error while a reload opens it again (``Subsystem.reopening``)."""
        self.ana_event_masked = False
        """An ANA change event was sent and the host has not read the ANA log since (nvmet
        masks the event until then: one event per change the host has not seen)."""
        if not self.is_discovery:
            self.refresh_access()
        # Reservation commands, notices and features (target.reservation_commands): not kept as an
        # attribute here, which would cost the compiled path (see reservation_commands.of)
        reservation = ReservationCommands(self)
        self.admin_commands: CommandTable = {
            AdminOpcode.KEEP_ALIVE: (_no_data, self._keep_alive),
            AdminOpcode.IDENTIFY: (_identify_length, self._identify),
            AdminOpcode.GET_LOG_PAGE: (_check_get_log_page, self._get_log_page),
            AdminOpcode.SET_FEATURES: (_no_data, self._set_features),
            AdminOpcode.GET_FEATURES: (_check_get_features, self._get_features),
            AdminOpcode.ASYNC_EVENT_REQUEST: (_no_data, self._async_event_request),
        }
        """Admin commands (as nvmet_parse_admin_cmd): opcode -> (checks, handler)."""
        if not self.is_discovery:
            self.admin_commands[AdminOpcode.ABORT] = (_no_data, self._abort)
        self.io_commands: CommandTable = {
            IoOpcode.READ: (self._check_rw, self._read),
            IoOpcode.WRITE: (self._check_rw, self._write),
            IoOpcode.WRITE_ZEROES: (self._check_write_zeroes, self._write_zeroes),
            IoOpcode.FLUSH: (self._check_flush, self._flush),
            IoOpcode.DATASET_MANAGEMENT: (self._check_dsm, self._dsm),
            **reservation.rows(),
            IoOpcode.BLOCKD_DIGEST: (self._check_digest, digest.execute),
        }
        """NVM I/O commands (as nvmet_parse_io_cmd): opcode -> (checks, handler)."""

    # -- state ------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return bool(self.cc & CC_EN and self.csts & CSTS_RDY)

    @property
    def is_discovery(self) -> bool:
        return self.subsystem.nqn == DISCOVERY_NQN

    def _kato_s(self) -> int:
        """KATO in whole seconds, rounded up (as nvmet); 0: no keep-alive."""
        kato = self.kato_ms or (DISCOVERY_DEFAULT_KATO_MS if self.is_discovery else 0)
        return (kato + 999) // 1000

    def restart_keep_alive(self) -> None:
        """A Keep Alive (or Connect, CC.EN, a new KATO): a full period from now."""
        self.keep_alive_deadline = time.monotonic() + self._kato_s()

    def keep_alive_expired(self, now: float) -> bool:
        """The reaper's look at this controller: True when the host fell silent. A period that
        ends with traffic seen starts another (traffic-based keep-alive, CTRATT.TBKAS), as
        nvmet's keep-alive timer does with ``reset_tbkas``: a host is given between one and two
        KATO after its last command. That second period is needed: a Linux host that sees
        TBKAS skips its Keep Alive while completions arrive and may then send it a whole KATO
        after its last command (measured in the VM bed: a 4 KiB-block namespace was torn down
        11 s after connect with a 5 s KATO when the deadline was one KATO after the last one)."""
        kato_s = self._kato_s()
        if not kato_s or now <= self.keep_alive_deadline:
            return False
        if self.traffic_seen:
            self.traffic_seen = False
            self.keep_alive_deadline = now + kato_s
            return False
        return True

    def queue_closed(self, queue: TargetQueue) -> None:
        if self.queues.get(queue.qid) is queue:
            del self.queues[queue.qid]
        if queue.qid == 0:
            self.target.remove_controller(self)

    def shutdown(self, reason: str) -> None:
        """Tear down every queue (keep-alive expiry, subsystem removal, daemon exit)."""
        if self.dead:
            return
        self.dead = True
        log.info("controller torn down", cntlid=self.cntlid, subnqn=self.subsystem.nqn,
                 hostnqn=self.hostnqn, reason=reason)
        self.cancel_async_events()
        for queue in list(self.queues.values()):
            queue.note_teardown(reason)
            queue.transport.close()
        self.target.remove_controller(self)

    def cancel_async_events(self) -> None:
        """Drop outstanding AERs without completing them (the host re-arms after reconnect)."""
        for fut in self.aer_waiters:
            fut.cancel()
        self.aer_waiters.clear()

    def log_error(self, qid: int, req: Request) -> bool:
        """Record ``req``'s failure in the Error Information log if its status has an error
        location (see :data:`ERROR_LOCATIONS`); True when it did, and the completion then says
        so with the More bit."""
        location = ERROR_LOCATIONS.get(req.status)
        if location is None:
            return False
        self.error_count += 1
        self.error_log.appendleft(ERROR_LOG_ENTRY.build(dict(
            error_count=self.error_count, sqid=qid, cid=req.cid, status=to_wire(req.status),
            param_location=location, lba=0, nsid=req.nsid, vs=0, trtype=0, cs=0,
            trtype_specific=0)))
        return True

    def ana_refusal(self, nsid: int) -> int:
        """The status a command naming ``nsid`` gets when it is not in ``io_namespaces``."""
        return self._ana_refusals.get(nsid, _INVALID_NS)

    def refresh_access(self) -> None:
        """Recompute which namespaces serve I/O through this port (after an ANA change or a
        namespace added or removed)."""
        ana = self.target.ana
        refusals = {nsid: status for nsid, ns in self._namespaces.items()
                    if (status := ana.io_status(self.port_id, ns.ana_group))}
        refusals.update(dict.fromkeys(self.subsystem.reopening, Status.INTERNAL_PATH_ERROR))
        self._ana_refusals = refusals
        self.io_namespaces = (self._namespaces if not refusals else
                               {n: ns for n, ns in self._namespaces.items() if n not in refusals})

    def notify_ana_change(self) -> None:
        """Send the ANA change event if the host enabled it and has read the log since the last."""
        if self.async_event_config & OAES_ANA_CHANGE and not self.ana_event_masked:
            self.ana_event_masked = True
            self.notify(AEN_ANA_CHANGED)

    def notify(self, event: int, changed_nsid: int | None = None) -> None:
        """Queue an asynchronous event; completes a waiting AER if there is one."""
        if changed_nsid is not None:
            if not self.async_event_config & OAES_NS_ATTR:
                return
            already = bool(self.changed_nsids)
            self.changed_nsids.add(changed_nsid)
            if already:
                return
        while self.aer_waiters:
            fut = self.aer_waiters.popleft()
            if not fut.done():
                fut.set_result(event)
                return
        self.pending_events.append(event)

    # -- properties ----------------------------------------------------------------------------

    def property_get(self, req: Request) -> None:
        fields = PROPERTY_COMMAND_FAST.unpack_from(req.sqe)
        size8 = fields[_PROP_ATTRIB] & PROPERTY_SIZE_MASK == PROPERTY_SIZE_8
        offset = fields[_PROP_OFFSET]
        if offset == Property.CAP and size8:
            value = CAP
        elif offset == Property.VS and not size8:
            value = VERSION_1_3
        elif offset == Property.CC and not size8:
            value = self.cc
        elif offset == Property.CSTS and not size8:
            value = self.csts
        else:
            req.status = Status.INVALID_FIELD
            return
        req.dw0 = value & 0xFFFFFFFF
        req.dw1 = value >> 32

    @staticmethod
    def check_property_set(req: Request) -> int:
        """Only CC is writable, as a 4-byte property."""
        fields = PROPERTY_COMMAND_FAST.unpack_from(req.sqe)
        if fields[_PROP_OFFSET] != Property.CC or fields[_PROP_ATTRIB] & PROPERTY_SIZE_MASK == PROPERTY_SIZE_8:
            return Status.INVALID_FIELD
        return _SUCCESS

    def property_set(self, req: Request) -> None:
        self._write_cc(PROPERTY_COMMAND_FAST.unpack_from(req.sqe)[_PROP_VALUE] & 0xFFFFFFFF)

    def _write_cc(self, new: int) -> None:
        old = self.cc
        self.cc = new
        if new & CC_EN and not old & CC_EN:
            mps, ams, css = (new >> 7) & 0xF, (new >> 11) & 7, (new >> 4) & 7
            iosqes, iocqes = (new >> 16) & 0xF, (new >> 20) & 0xF
            io_ok = self.is_discovery or (iosqes == 6 and iocqes == 4)
            if mps or ams or css not in (0, 6) or not io_ok:
                self.csts = CSTS_CFS
            else:
                self.csts = CSTS_RDY
                self.restart_keep_alive()
        elif not new & CC_EN and old & CC_EN:
            self.csts = 0
            self.cc = 0
        if new & CC_SHN_MASK and not old & CC_SHN_MASK:
            self.csts = (self.csts & ~CSTS_RDY) | CSTS_SHST_COMPLETE
            self.target.flush_subsystem_soon(self.subsystem)

    # -- admin commands ------------------------------------------------------------------------

    async def _keep_alive(self, req: Request) -> None:
        if not self.kato_ms:
            req.status = Status.KEEP_ALIVE_INVALID
        self.restart_keep_alive()

    async def _abort(self, req: Request) -> None:
        req.dw0 = 1  # the command was not aborted

    def _give(self, req: Request, data: bytes) -> None:
        """Return controller-to-host data of exactly the command's transfer length."""
        if req.direction is not _TO_HOST:
            req.status = Status.INVALID_FIELD if req.length else _BAD_LENGTH
            return
        if len(data) < req.length:
            data = data + bytes(req.length - len(data))
        req.reply = data[:req.length]

    async def _identify(self, req: Request) -> None:
        fields = IDENTIFY_COMMAND.parse(req.sqe)
        cns, csi = fields.cns, fields.csi
        if cns == Cns.CONTROLLER:
            self._give(req, self.identify_controller())
            return
        if self.is_discovery:
            req.status = Status.INVALID_FIELD
            return
        if cns == Cns.ACTIVE_NS_LIST:
            if req.nsid >= 0xFFFFFFFE:
                req.status = _INVALID_NS
                return
            ids = sorted(n for n in self._namespaces.keys() | self.subsystem.reopening if n > req.nsid)[:1024]
            self._give(req, ACTIVE_NS_LIST.build(ids + [0] * (1024 - len(ids))))
            return
        if cns == Cns.CSI_CONTROLLER:
            if csi != 0:
                req.status = Status.INVALID_FIELD
                return
            self._give(req, bytes(IDENTIFY_SIZE))
            return
        ns = self._namespaces.get(req.nsid)
        if cns not in (Cns.NAMESPACE, Cns.NS_DESCRIPTORS, Cns.CSI_INDEPENDENT_NS):
            req.status = Status.INVALID_FIELD
        elif ns is None:
            req.status = self.ana_refusal(req.nsid)  # Invalid Namespace, or a namespace reopening
        elif cns == Cns.NAMESPACE:
            self._give(req, identify_namespace(ns, self._ana_refusals.get(req.nsid) not in _NUSE_ZERO))
        elif cns == Cns.NS_DESCRIPTORS:
            self._give(req, NS_DESCRIPTOR_LIST.build([
                dict(nidt=NidType.NGUID, nidl=16, nid=ns.nguid),
                dict(nidt=NidType.UUID, nidl=16, nid=ns.uuid.bytes),
                dict(nidt=NidType.CSI, nidl=1, nid=b"\0"),
                dict(nidt=0, nidl=0, nid=b""),
            ]))
        else:
            self._give(req, IDENTIFY_CSI_INDEPENDENT_NS.build(dict(
                nsfeat=0, nmic=NMIC_SHARED, rescap=rescap(ns), fpi=0, anagrpid=ns.ana_group, nsattr=int(ns.read_only),
                nvmsetid=0, endgid=0, nstat=1)))

    def identify_controller(self) -> bytes:
        sub = self.subsystem
        disc = self.is_discovery
        transport = self.transport
        # at least 1: with ANA reporting, the Linux host refuses the controller unless
        # 1 <= MNAN <= NN ("Invalid MNAN value"), an empty subsystem included
        nn = 0 if disc else max(max(sub.namespaces, default=0), 1)
        return IDENTIFY_CONTROLLER.build(dict(
            vid=0, ssvid=0, sn=sub.serial[:20], mn=sub.model[:40], fr="0.1.0", rab=6,
            ieee=b"\0\0\0", cmic=0 if disc else CMIC, mdts=_mdts(transport.max_transfer),
            cntlid=self.cntlid, ver=VERSION_1_3, rtd3r=0, rtd3e=0,
            oaes=OAES_DISCOVERY_CHANGE if disc else OAES_NS_ATTR | OAES_ANA_CHANGE, ctratt=CTRATT,
            cntrltype=2 if disc else 1, fguid=bytes(16), crdt1=0, crdt2=0, crdt3=0,
            oacs=0, acl=3, aerl=AER_LIMIT - 1, frmw=0x3,
            lpa=LPA_EXTENDED_DATA if disc else LPA_EXTENDED_DATA | LPA_COMMANDS_EFFECTS, elpe=ERROR_LOG_ENTRIES - 1,
            npss=0, avscc=0, apsta=0, kas=KAS_100MS,
            anatt=0 if disc else ANATT_SECONDS, anacap=0 if disc else ANACAP_ALL_STATES,
            anagrpmax=0 if disc else MAX_ANA_GROUPS, nanagrpid=0 if disc else MAX_ANA_GROUPS,
            sqes=0x66, cqes=0x44, maxcmd=MQES + 1, nn=nn,
            oncs=0 if disc else self._oncs(), fuses=0, fna=0,
            vwc=int(any(ns.backend.can_flush for ns in self._namespaces.values())),
            awun=0, awupf=0, icsvscc=0, nwpc=0, acwu=0,
            sgls=transport.sgls, mnan=min(nn, MAX_ANA_NAMESPACES), subnqn=sub.nqn, ioccsz=(64 + transport.io_inline) // 16,
            iorcsz=1, icdoff=0, fcatt=0, msdbd=1, ofcs=0))

    def _oncs(self) -> int:
        """Optional NVM commands: those some namespace's backend can do (a namespace whose
        backend cannot is refused or does nothing, see the I/O checks). Like VWC it is read
        when the host identifies the controller, from the namespaces it has then."""
        backends = [ns.backend for ns in self._namespaces.values()]
        return ((ONCS_DSM if any(b.can_trim for b in backends) else 0)
                | (ONCS_WRITE_ZEROES if any(b.can_zero for b in backends) else 0) | ONCS_RESERVATIONS)

    async def _get_log_page(self, req: Request) -> None:
        fields = GET_LOG_PAGE_COMMAND.parse(req.sqe)
        lid, lpo = fields.lid, fields.lpo
        if lid == LogPageId.DISCOVERY and self.is_discovery:
            page = self.target.discovery_log(self)
        elif lid == LogPageId.ERROR:
            page = b"".join(self.error_log)
        elif self.is_discovery:
            req.status = Status.INVALID_FIELD  # an unsupported LID: as nvmet, and the spec (Get Log Page)
            return
        elif lid in (LogPageId.SMART, LogPageId.FIRMWARE_SLOT):
            page = bytes(512)
        elif lid == LogPageId.COMMANDS_EFFECTS:
            page = self.commands_effects()
        elif lid == LogPageId.ANA:
            page = self.target.ana.log_page(
                self.port_id, ((n, ns.ana_group) for n, ns in self._namespaces.items()),
                bool(fields.lsp_rae & GET_LOG_PAGE_LSP_RGO))
            if lpo > len(page):  # the spec's rule for an offset past the end of the log
                req.status = Status.INVALID_FIELD
                return
            if not fields.lsp_rae & GET_LOG_PAGE_RAE:
                self.ana_event_masked = False
        elif lid == LogPageId.RESERVATION_NOTIFICATION:
            page = reservation_commands.of(self).log_page(bool(fields.lsp_rae & GET_LOG_PAGE_RAE))
        elif lid == LogPageId.CHANGED_NS_LIST:
            ids = sorted(self.changed_nsids)[:1024]
            page = CHANGED_NS_LIST.build(ids + [0] * (1024 - len(ids)))
            if not fields.lsp_rae & GET_LOG_PAGE_RAE:  # reading the log re-arms the event
                self.changed_nsids.clear()
        else:
            req.status = Status.INVALID_FIELD
            return
        self._give(req, page[lpo:lpo + req.length] if lpo < len(page) else b"")

    def commands_effects(self) -> bytes:
        """The Commands Supported and Effects log: CSUPP for every command in the tables, LBCC
        for those that change blocks. A primary reads it to learn whether this controller serves
        blockd's Digest command (a verify's digests, :mod:`protocol.digest`)."""
        acs = [0] * 256
        iocs = [0] * 256
        for opcode in self.admin_commands:
            acs[opcode] = EFFECTS_CSUPP
        for opcode in self.io_commands:
            iocs[opcode] = EFFECTS_CSUPP | (EFFECTS_LBCC if opcode in _CHANGE_BLOCKS else 0)
        return COMMANDS_EFFECTS_LOG.build(dict(acs=acs, iocs=iocs))

    async def _set_features(self, req: Request) -> None:
        fields = FEATURES_COMMAND.parse(req.sqe)
        fid, value = fields.fid, fields.value
        if fields.sv & FEATURES_SAVE:  # saving features is not supported
            req.status = Status.FEATURE_NOT_SAVEABLE
        elif fid == FeatureId.NUMBER_OF_QUEUES and not self.is_discovery:
            if value & 0xFFFF == 0xFFFF or value >> 16 == 0xFFFF:
                req.status = Status.INVALID_FIELD
                return
            n = self.max_io_queues - 1
            req.dw0 = n | (n << 16)
        elif fid == FeatureId.KEEP_ALIVE_TIMER:
            self.kato_ms = value
            self.restart_keep_alive()
        elif fid == FeatureId.ASYNC_EVENT_CONFIG:
            self.async_event_config = value
        elif fid == FeatureId.VOLATILE_WRITE_CACHE and not self.is_discovery:
            req.status = Status.INVALID_FIELD if value != 1 else _SUCCESS
        elif fid == FeatureId.HOST_IDENTIFIER and not self.is_discovery:
            req.status = Status.COMMAND_SEQUENCE_ERROR  # over fabrics it is Connect's, as nvmet
        elif fid in _RESERVATION_FEATURES and not self.is_discovery:
            req.status = await reservation_commands.of(self).set_feature(req.nsid, fid, value)
        else:
            req.status = Status.INVALID_FIELD

    async def _get_features(self, req: Request) -> None:
        fid = FEATURES_COMMAND.parse(req.sqe).fid
        if fid == FeatureId.NUMBER_OF_QUEUES and not self.is_discovery:
            n = self.max_io_queues - 1
            req.dw0 = n | (n << 16)
        elif fid == FeatureId.KEEP_ALIVE_TIMER:
            req.dw0 = self.kato_ms
        elif fid == FeatureId.ASYNC_EVENT_CONFIG:
            req.dw0 = self.async_event_config
        elif fid == FeatureId.VOLATILE_WRITE_CACHE and not self.is_discovery:
            req.dw0 = 1
        elif fid == FeatureId.HOST_IDENTIFIER and not self.is_discovery:
            if not FEATURES_COMMAND.parse(req.sqe).value & EXHID:
                req.status = Status.HOST_ID_INCONSISTENT_FORMAT  # ours are 128 bits (CTRATT.HIDS)
                return
            self._give(req, self.hostid)
        elif fid in _RESERVATION_FEATURES and not self.is_discovery:
            req.status, req.dw0 = reservation_commands.of(self).get_feature(req.nsid, fid)
        else:
            req.status = Status.INVALID_FIELD

    async def _async_event_request(self, req: Request) -> None:
        if self.pending_events:
            req.dw0 = self.pending_events.popleft()
            return
        if len(self.aer_waiters) >= AER_LIMIT:
            req.status = Status.ASYNC_LIMIT
            return
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        if self.dead:
            # arrived while the controller was being torn down: dropped like the others, not left
            # waiting forever (a transport waiting for its commands would hang on it)
            fut.cancel()
        else:
            self.aer_waiters.append(fut)
        req.dw0 = await fut

    # -- NVM I/O commands ----------------------------------------------------------------------

    def _check_rw(self, req: Request) -> int:
        """Read, Write, Write Zeroes: namespace (and its ANA state), LBA range, write protection,
        transfer length."""
        ns = self.io_namespaces.get(req.nsid)
        if ns is None:
            return self._ana_refusals.get(req.nsid, _INVALID_NS)
        # Held from here, refused or not, until it completes (TargetQueue._complete), so a
        # refused command also counts on its namespace (blockd.iostats).
        req.ns = ns
        ns.in_flight += 1
        opc = req.opcode
        if ns.reserved and not ns.reservations.allows(self.hostid, opc != _READ):
            return _CONFLICT
        fields = req.fields
        nlb = fields[IO_NLB]
        if fields[IO_SLBA] + nlb + 1 > ns.blocks:
            return _LBA_RANGE
        if opc != _READ and ns.backend.read_only:  # not ns.read_only: a property call per write
            return _WRITE_PROTECTED
        expected = 0 if opc == _WRITE_ZEROES else (nlb + 1) << ns.lba_shift
        return _BAD_LENGTH if req.length != expected else _SUCCESS

    def _check_digest(self, req: Request) -> int:
        """blockd's Digest command: the namespace as for a Read (held until completion, and a
        read as reservations see it), then its own checks (:func:`target.digest.check`)."""
        ns = self.io_namespaces.get(req.nsid)
        if ns is None:
            return self._ana_refusals.get(req.nsid, _INVALID_NS)
        req.ns = ns
        ns.in_flight += 1
        if ns.reserved and not ns.reservations.allows(self.hostid, False):
            return _CONFLICT
        return digest.check(req, ns)

    def _check_write_zeroes(self, req: Request) -> int:
        status = self._check_rw(req)
        if not status and not req.ns.backend.can_zero:
            return Status.INVALID_OPCODE  # not for this namespace (ONCS is the controller's)
        return status

    def _check_flush(self, req: Request) -> int:
        if req.nsid == NSID_ALL:
            return _SUCCESS
        ns = req.ns = self.io_namespaces.get(req.nsid)
        if ns is None:
            return self._ana_refusals.get(req.nsid, _INVALID_NS)
        ns.in_flight += 1
        if ns.reserved and not ns.reservations.allows(self.hostid, True):
            return _CONFLICT  # Flush is of the write command group
        return _SUCCESS

    def _check_dsm(self, req: Request) -> int:
        ns = req.ns = self.io_namespaces.get(req.nsid)
        if ns is None:
            return self._ana_refusals.get(req.nsid, _INVALID_NS)
        ns.in_flight += 1  # held until it completes, refused or not (as _check_rw)
        if ns.reserved and not ns.reservations.allows(self.hostid, True):
            return _CONFLICT
        if ns.read_only:
            return _WRITE_PROTECTED
        if req.length < _dsm_ranges(req) * DSM_RANGE_FAST.size or req.direction is not Direction.HOST_TO_CONTROLLER:
            return _BAD_LENGTH
        return _SUCCESS

    async def _read(self, req: Request) -> None:
        ns = req.ns
        offset = req.fields[IO_SLBA] << ns.lba_shift
        buf = req.buffer
        if type(buf) is PipedRead:  # sent by reference (the connection decided: target/file_send.py)
            if buf.fill(ns.backend.fd, offset):
                req.reply = buf
                return
            buf = None  # the range did not come whole: read it as always (which reports the error)
        if buf is None:
            buf = bytearray(req.length)
        try:
            await ns.backend.read_into(offset, memoryview(buf))
        except OSError as exc:
            log.error("read failed", nsid=ns.nsid, offset=offset, error=str(exc))
            req.status = getattr(exc, "status", Status.UNRECOVERED_READ_ERROR)  # a backend may say why
            return
        req.reply = buf

    async def _write(self, req: Request) -> None:
        ns = req.ns
        if ns.reserved and not ns.reservations.allows(self.hostid, True):
            # checked at parsing, again now: a write whose data came after a preempt and abort
            req.status = _CONFLICT
            return
        fields = req.fields
        offset = fields[IO_SLBA] << ns.lba_shift
        backend = ns.backend
        fua = fields[IO_CONTROL] & RW_CONTROL_FUA
        try:
            if fua and not backend.can_fua:
                # as nbdkit emulates FUA: a flush after the write (nothing to do without a cache)
                await backend.write(offset, req.data)
                if backend.can_flush:
                    await backend.flush()
            else:
                await backend.write(offset, req.data, bool(fua))
        except OSError as exc:
            req.status = self.write_error(req, exc)

    @staticmethod
    def write_error(req: Request, exc: OSError) -> int:
        """A write whose backend refused its data: logged, and the status it ends with."""
        ns = req.ns
        log.error("write failed", nsid=ns.nsid, offset=req.fields[IO_SLBA] << ns.lba_shift, error=str(exc))
        return _write_status(exc)

    async def _flush(self, req: Request) -> None:
        if req.ns is not None:
            await self._flush_one(req, req.ns)
            return
        # NSID_ALL: each namespace is held while its flush runs, as a command on it would be,
        # so a reload removing it meanwhile closes its file only afterwards
        for ns in list(self._namespaces.values()):
            if ns.removed:
                continue
            ns.in_flight += 1
            try:
                await self._flush_one(req, ns)
            finally:
                ns.in_flight -= 1
                if ns.removed:
                    self.target.namespace_released(ns)

    @staticmethod
    async def _flush_one(req: Request, ns: Namespace) -> None:
        if not ns.backend.can_flush:
            return  # every completed write is already durable
        try:
            await ns.backend.flush()
        except OSError as exc:
            log.error("flush failed", nsid=ns.nsid, error=str(exc))
            req.status = _write_status(exc)

    async def _write_zeroes(self, req: Request) -> None:
        """Zero the range; with DEAC, and a backend whose deallocated blocks read as zeroes
        (DLFEAT 0x09), deallocate it instead, as the spec allows: a resync sends the holes of a
        sparse primary so, and a thin replica stays thin (written zeroes would allocate them)."""
        ns = req.ns
        fields = req.fields
        backend = ns.backend
        offset, length = fields[IO_SLBA] << ns.lba_shift, (fields[IO_NLB] + 1) << ns.lba_shift
        try:
            if fields[IO_CONTROL] & RW_CONTROL_DEAC and backend.can_trim:
                await backend.discard(offset, length)
            else:
                await backend.write_zeroes(offset, length)
        except OSError as exc:
            log.error("zeroing failed", nsid=ns.nsid, error=str(exc))
            req.status = _write_status(exc)

    async def _dsm(self, req: Request) -> None:
        ns = req.ns
        if not DSM_COMMAND_FAST.unpack_from(req.sqe)[_DSM_ATTRIBUTES] & DSM_ATTR_DEALLOCATE:
            return  # only hints: nothing to do
        ranges = []
        for i in range(_dsm_ranges(req)):
            _, nlb, slba = DSM_RANGE_FAST.unpack_from(req.data, i * DSM_RANGE_FAST.size)
            if slba + nlb > ns.blocks:
                req.status = _LBA_RANGE
                return
            ranges.append((slba, nlb))
        if not ns.backend.can_trim:
            return  # deallocation is a hint; DLFEAT tells the host not to expect zeroes
        try:
            for slba, nlb in ranges:
                if nlb:
                    await ns.backend.discard(slba << ns.lba_shift, nlb << ns.lba_shift)
        except OSError as exc:
            log.error("deallocate failed", nsid=ns.nsid, error=str(exc))
            req.status = _write_status(exc)


_CHANGE_BLOCKS = frozenset({IoOpcode.WRITE, IoOpcode.WRITE_ZEROES, IoOpcode.DATASET_MANAGEMENT})
"""I/O commands whose effects log entry says LBCC (they may change the contents of blocks)."""

_DSM_NR, _DSM_ATTRIBUTES = DSM_COMMAND_FAST.index("nr"), DSM_COMMAND_FAST.index("attributes")


def _dsm_ranges(req: Request) -> int:
    """How many ranges a Dataset Management command carries (NR is 0's based)."""
    return DSM_COMMAND_FAST.unpack_from(req.sqe)[_DSM_NR] + 1


def _write_status(exc: OSError) -> int:
    """A failed write's status: the backend's own when it names one (a replicated namespace
    with too few copies in sync: Namespace Not Ready); Capacity Exceeded (DNR) when the file
    system is full (ENOSPC: a thin file, or its metadata, could not be allocated), as nvmet's
    ``errno_to_nvme_status`` answers, so that the host sees "no space" (the Linux host makes it
    BLK_STS_NOSPC) rather than a media fault; else Write Fault (EIO and the rest: the data could
    not be committed, where nvmet says Internal Error)."""
    status = getattr(exc, "status", None)
    if status is not None:
        return status
    return Status.CAPACITY_EXCEEDED if exc.errno == errno.ENOSPC else Status.WRITE_FAULT


def _no_data(req: Request) -> int:
    """Checks of a command that moves no data."""
    return _BAD_LENGTH if req.length else _SUCCESS


_RESERVATION_FEATURES = (FeatureId.RESERVATION_NOTIFICATION_MASK, FeatureId.RESERVATION_PERSISTENCE)


def _check_get_features(req: Request) -> int:
    """Get Features moves data only for the Host Identifier (16 bytes: the 128-bit one)."""
    if FEATURES_COMMAND.parse(req.sqe).fid == FeatureId.HOST_IDENTIFIER:
        return _SUCCESS if req.length == 16 else _BAD_LENGTH
    return _no_data(req)


def _identify_length(req: Request) -> int:
    return _SUCCESS if req.length == IDENTIFY_SIZE else _BAD_LENGTH


def _check_get_log_page(req: Request) -> int:
    fields = GET_LOG_PAGE_COMMAND.parse(req.sqe)
    numd = (fields.numdu << 16 | fields.numdl) + 1
    if numd * 4 != req.length:
        return _BAD_LENGTH
    if fields.lpo & 3:
        return Status.INVALID_FIELD
    return _SUCCESS


def _mdts(max_transfer: int) -> int:
    """Identify MDTS: the largest transfer as a power of two of the 4 KiB minimum page size."""
    return (max_transfer >> 12).bit_length() - 1


def rescap(ns: Namespace) -> int:
    """Identify Namespace RESCAP (and NSRESCAP): every type and IEKEY; PTPL where the state can
    be kept (a sidecar beside the namespace's file, or the replication metadata: target.reservations)."""
    return RESCAP_ALL if ns.reservations.can_persist else RESCAP_ALL & ~PTPL


def identify_namespace(ns: Namespace, in_use: bool) -> bytes:
    """Identify Namespace; NUSE is 0 unless ``in_use`` (see :data:`_NUSE_ZERO`)."""
    blocks = ns.blocks
    lbaf = [dict(ms=0, lbads=ns.lba_shift, rp=0)] + [dict(ms=0, lbads=0, rp=0)] * 63
    return IDENTIFY_NAMESPACE.build(dict(
        nsze=blocks, ncap=blocks, nuse=blocks if in_use else 0, nsfeat=0, nlbaf=0, flbas=0, mc=0, dpc=0,
        dps=0, nmic=NMIC_SHARED, rescap=rescap(ns), fpi=0, dlfeat=DLFEAT_ZEROES if ns.backend.can_trim else 0,
        nawun=0, nawupf=0, nacwu=0, noiob=0,
        anagrpid=ns.ana_group, nsattr=int(ns.read_only), nguid=ns.nguid, eui64=ns.eui64, lbaf=lbaf))

