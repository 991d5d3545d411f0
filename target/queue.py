"""One submission/completion queue pair on the target: the core that drives every request.

A transport hands it each command capsule (:meth:`TargetQueue.submit`). From there the queue
owns the request's life (states in :mod:`target.request`):

1. parse once: framing (FLAGS, SGL1, transfer length) and the command's own checks, which
   also pick its handler from one table per command set (fabrics here, admin and NVM I/O in
   :class:`target.controller.Controller`), as the kernel's ``nvmet_parse_*_cmd`` sets
   ``req->execute``. Nothing runs and no data moves before every check passed;
2. host data not in the capsule: ask the transport to ``fetch_data``; it answers with
   :meth:`TargetQueue.data_ready` or :meth:`TargetQueue.data_failed`;
3. run the handler at once (:func:`blockd.eager.start`); only a command that really waits (an
   fsync, a slow backend, an AER) becomes a Task, tracked here and in ``Target.tasks`` for
   shutdown;
4. build the completion, count an I/O command on its host and namespace (:mod:`blockd.iostats`)
   and hand the response to the transport's ``queue_response``, which reports it sent with
   :meth:`TargetQueue.response_sent`.

The queue opens no socket; with a backend that completes at once (``MemoryBackend``) a whole
command runs inside ``submit`` without an event loop.
"""

from __future__ import annotations

import asyncio
from time import monotonic_ns
from typing import TYPE_CHECKING, Awaitable, Callable

import structlog

from blockd import eager
from blockd.iostats import KIND_BY_OPCODE, IoCounters
from protocol.auth import AUTH_COMMAND, SECP_DHCHAP, SPSP_DHCHAP
from protocol.constants import PSDT_SGL, AdminOpcode, FabricsType, SglId
from protocol.fabrics import (
    CATTR_DISABLE_SQFLOW, CONNECT_AUTHREQ_ATR, CONNECT_COMMAND, CONNECT_DATA, CONNECT_DATA_SIZE, FABRICS_COMMAND,
    IPO_CONNECT_SQSIZE, IPO_CONNECT_SUBNQN, NQN_FIELD,
)
from protocol.layout import field_offset
from protocol.nvme import (
    CQE_FAST, FLAGS_PSDT_FUSE_MASK, IO_COMMAND_FAST, IO_FLAGS, SGL1_OFFSET, SGL_SIZE, SQE_SIZE,
    parse_sgl_keyed,
)
from protocol.status import MORE, Status, to_wire
from target.auth import QueueAuth
from target.rejections import AUTH_FAILED, AUTH_TIMEOUT, COMMAND_POOL_EXHAUSTED, connect_refused
from target.request import Direction, IllegalTransition, Request, RequestState

if TYPE_CHECKING:
    from target.controller import Controller
    from target.subsystem import Namespace
    from target.target import Target
    from target.transport import TargetTransport

log = structlog.get_logger("blockd.target.queue")

Check = Callable[[Request], int]
"""A command's checks: a status, 0 when it may run."""
Handler = Callable[[Request], Awaitable[None]]
CommandTable = dict[int, tuple[Check, Handler]]
"""Opcode (FCTYPE for fabrics) -> (checks, handler): one per command set."""

_FABRICS = int(AdminOpcode.FABRICS)
_FCTYPE = field_offset(FABRICS_COMMAND, "fctype")
_CONNECT, _PROPERTY_GET, _PROPERTY_SET = (
    int(FabricsType.CONNECT), int(FabricsType.PROPERTY_GET), int(FabricsType.PROPERTY_SET))
_CONNECT_NQNS = tuple(slice(field_offset(CONNECT_DATA, name), field_offset(CONNECT_DATA, name) + NQN_FIELD)
                      for name in ("subnqn", "hostnqn"))
_AUTH_SEND, _AUTH_RECEIVE = int(FabricsType.AUTH_SEND), int(FabricsType.AUTH_RECEIVE)
_AUTH_FABRICS = (_CONNECT, _AUTH_SEND, _AUTH_RECEIVE)
"""What a queue that must still authenticate may send (the kernel's nvmet_check_auth_status)."""
_unpack_command = IO_COMMAND_FAST.unpack_from
_pack_cqe = CQE_FAST.pack
_IN_CAPSULE = int(SglId.DATA_BLOCK_OFFSET)
_SGL1 = slice(SGL1_OFFSET, SGL1_OFFSET + SGL_SIZE)
# Enum members bound once: a class attribute lookup on an Enum costs several times a global's,
# and these are read several times per I/O.
_NEED_DATA, _EXECUTING = RequestState.NEED_DATA, RequestState.EXECUTING
_COMPLETING, _DONE = RequestState.COMPLETING, RequestState.DONE
_NONE, _TO_CONTROLLER, _TO_HOST = Direction.NONE, Direction.HOST_TO_CONTROLLER, Direction.CONTROLLER_TO_HOST
_DIRECTIONS = (_NONE, _TO_CONTROLLER, _TO_HOST, None)
"""Data direction by opcode bits 1:0 (FCTYPE bit 0 for fabrics); 3 is no valid opcode."""
_SUCCESS, _INVALID_FIELD, _INVALID_OPCODE = Status.SUCCESS, Status.INVALID_FIELD, Status.INVALID_OPCODE
_SEQUENCE_ERROR, _BAD_LENGTH = Status.COMMAND_SEQUENCE_ERROR, Status.SGL_INVALID_DATA_LENGTH
_INTERNAL_ERROR = Status.INTERNAL_ERROR
_AUTH_REQUIRED = Status.AUTH_REQUIRED


def _nqns_to_nul(data: bytes | bytearray | memoryview) -> bytes:
    """Connect data with each NQN field cut at its first NUL, as nvmet compares NQNs up to it
    (whatever follows the NUL is padding, not part of the name)."""
    raw = bytearray(data)
    for field in _CONNECT_NQNS:
        end = raw.find(0, field.start, field.stop)
        if end >= 0:
            raw[end:field.stop] = bytes(field.stop - end)
    return bytes(raw)


class TargetQueue:
    """Admin (qid 0) or I/O queue of one controller, bound to one transport connection."""

    def __init__(self, target: Target, transport: TargetTransport, port_id: int,
                 peer: str = "", local_address: str = "", inline_size: int | None = None) -> None:
        info = transport.info
        self.target = target
        self.transport = transport
        self.port_id = port_id
        self.inline_size = info.admin_inline if inline_size is None else inline_size
        """In-capsule data accepted now: the admin size until an I/O Connect, unless the
        transport knows the queue's kind from the start (RDMA: the QID in the CM request sized
        the receive buffers, and an I/O queue's Connect data comes in the capsule)."""
        self.peer = peer
        self.local_address = local_address
        """Our address on this connection: the discovery log's TRADDR for wildcard ports."""
        self.controller: Controller | None = None
        self.qid: int | None = None
        self.sqsize = 0
        self.sqhd = 0
        self.sqhd_disabled = False
        """The host disabled SQ flow control at Connect (CATTR bit 2)."""
        self.in_flight = 0
        """Commands taken and not yet answered: from ``submit`` to ``response_sent``."""
        self.pool = 0
        """Most commands in flight, set at Connect: twice the queue size, as nvmet-tcp's
        command pool (a command's slot is back only once its response has left, and an RDMA
        host may send its next command before the SEND completion of the last is seen)."""
        self.auth: QueueAuth | None = None
        """This queue's DH-HMAC-CHAP transaction when the host has a secret (from Connect on)."""
        self.locked = False
        """Every command but Connect and Authentication Send/Receive is refused: the host has
        a secret and this queue has not authenticated (or its authentication failed)."""
        self._auth_timer: asyncio.TimerHandle | None = None
        """While ``locked``: closes the queue if it is still locked when it fires."""
        self.counters: IoCounters | None = None
        """The host's counters once this is a connected I/O queue (admin commands are not
        counted: they are the host's housekeeping, not its load)."""
        self._teardown: tuple[str, dict[str, str]] | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        """This queue's commands that wait (a transport tearing down waits for them)."""
        self._data_sgl_ids = info.data_sgl_ids
        self._keyed = info.keyed_sgls
        self._max_transfer = info.max_transfer
        self._read_buffer = transport.read_buffer
        self._queue_response = transport.queue_response
        self._fabrics: CommandTable = {
            _CONNECT: (self._check_connect, self._connect),
            _PROPERTY_GET: (self._check_property, self._property_get),
            _PROPERTY_SET: (self._check_property_set, self._property_set),
            _AUTH_SEND: (self._check_auth, self._auth_send),
            _AUTH_RECEIVE: (self._check_auth, self._auth_receive),
        }

    # -- the request life cycle -------------------------------------------------------------

    def submit(self, sqe: bytes | memoryview, incapsule: memoryview | None = None,
               transport_ctx: object = None) -> None:
        """Take one command capsule and drive the command as far as it goes now."""
        fields = _unpack_command(sqe)
        req = Request(bytes(sqe[:SQE_SIZE]), fields, transport_ctx, monotonic_ns())
        self.in_flight += 1
        if fields[IO_FLAGS] & FLAGS_PSDT_FUSE_MASK != PSDT_SGL:
            self._fail(req, _INVALID_FIELD)
            return
        ctrl = self.controller
        opcode = req.opcode
        if ctrl is not None:
            # Any command proves the host alive (traffic-based keep-alive): a host busy setting
            # up queues or moving data is not torn down for a Keep Alive that queued behind.
            ctrl.traffic_seen = True
        if opcode == _FABRICS:
            fctype = req.sqe[_FCTYPE]
            if fctype != _CONNECT and ctrl is None:
                self._fail(req, _INVALID_OPCODE)  # as nvmet_parse_connect_cmd
                return
            if self.locked and fctype not in _AUTH_FABRICS:
                self._fail(req, _AUTH_REQUIRED)
                return
            command = self._fabrics.get(fctype)
            direction = _TO_CONTROLLER if fctype & 1 else _TO_HOST
        elif ctrl is None:
            self._fail(req, _INVALID_OPCODE)
            return
        elif not ctrl.ready or self.in_flight > self.pool:
            if ctrl.ready:
                self.target.rejections.add(COMMAND_POOL_EXHAUSTED)
            self._fail(req, _SEQUENCE_ERROR)
            return
        elif self.locked:
            self._fail(req, _AUTH_REQUIRED)
            return
        else:
            direction = _DIRECTIONS[opcode & 3]
            command = (ctrl.io_commands if self.qid else ctrl.admin_commands).get(opcode)
        if command is None or direction is None:
            self._fail(req, _INVALID_OPCODE)
            return
        status = self._map_sgl(req, direction, fields, incapsule)
        if not status:
            check, req.execute = command
            status = check(req)
        if status:
            self._fail(req, status)
        elif req.data is None and req.direction is _TO_CONTROLLER:
            req.set_state(_NEED_DATA)
            self.transport.fetch_data(req)
        else:
            if req.direction is _TO_HOST and self._read_buffer is not None and self.qid:
                req.buffer = self._read_buffer(req)
            req.set_state(_EXECUTING)
            self._run(req)

    def _map_sgl(self, req: Request, direction: Direction, fields: tuple[int, ...],
                 incapsule: memoryview | None) -> int:
        """Validate SGL1 and decide how data moves; a status when it cannot."""
        _, _, _, _, address, length, sgl_id, _, _, _ = fields
        key = 0
        if self._keyed and sgl_id in self._data_sgl_ids:
            address, length, key, _ = parse_sgl_keyed(req.sqe[_SGL1])
        req.sgl_id = sgl_id
        if length == 0:
            return _SUCCESS
        if direction is _NONE:
            return _INVALID_FIELD
        if length > self._max_transfer:
            return _BAD_LENGTH
        req.direction = direction
        req.length = length
        if sgl_id == _IN_CAPSULE:
            if direction is not _TO_CONTROLLER:
                return _INVALID_FIELD
            avail = len(incapsule) if incapsule is not None else 0
            if address != 0 or length > self.inline_size or length > avail:
                return Status.SGL_INVALID_OFFSET
            req.data = incapsule[:length]
            return _SUCCESS
        if sgl_id not in self._data_sgl_ids:
            return Status.SGL_INVALID_TYPE if sgl_id >> 4 else _INVALID_FIELD
        req.sgl_address = address
        req.sgl_key = key
        return _SUCCESS

    def adopt_write(self, sqe: bytes, start_ns: int, ns: Namespace, data: bytearray, transport_ctx: object) -> Request:
        """The R2T write the compiled path took (``target/_tcp_io.pyx``: it counted the slot,
        held ``ns``, took the budgets and sent the R2T) as the request ``submit`` would have made,
        waiting for its data in ``data``: for the ends it leaves to this queue (the data never
        came, the write failed), which ``data_failed`` and ``data_ready`` then end as their own.
        Also an in-capsule write the compiled mirror lane took (slot and ``ns`` held, no budget)
        whose replicas failed it: ``write_failed`` answers it with the mirror's status."""
        fields = _unpack_command(sqe)
        req = Request(sqe, fields, transport_ctx, start_ns)
        self._map_sgl(req, _TO_CONTROLLER, fields, None)
        req.ns = ns
        req.execute = self.controller.io_commands[req.opcode][1]
        req.data = data
        req.set_state(_NEED_DATA)
        return req

    def data_ready(self, req: Request) -> None:
        """The transport put the host's data in ``req.data`` (a buffer of its choosing)."""
        req.set_state(_EXECUTING)
        self._run(req)

    def data_failed(self, req: Request) -> None:
        """The transport could not fetch the host's data: the command fails, nothing runs."""
        if req.state is not _NEED_DATA:
            raise IllegalTransition(req, _COMPLETING)
        self._fail(req, Status.DATA_TRANSFER_ERROR)

    def write_failed(self, req: Request, exc: OSError) -> None:
        """The transport wrote the host's data to the file itself and the file refused it (the
        compiled path's R2T writes by splice, ``target/_tcp_io.pyx``): the command ends as the
        controller's write ends when its backend raises."""
        if req.state is not _NEED_DATA:
            raise IllegalTransition(req, _COMPLETING)
        self._fail(req, self.controller.write_error(req, exc))

    def capsule_data_failed(self, sqe: bytes | memoryview, transport_ctx: object = None) -> None:
        """A command arrived with corrupt in-capsule data (data digest): it fails with Data
        Transfer Error (NVMe/TCP 7.4.6) and the queue carries on."""
        req = Request(bytes(sqe[:SQE_SIZE]), _unpack_command(sqe), transport_ctx, monotonic_ns())
        self.in_flight += 1
        self._fail(req, Status.DATA_TRANSFER_ERROR)

    def response_sent(self, req: Request) -> None:
        """The transport sent the response (and the data before it): the request is over, and
        only now is its slot free (a host that does not read its replies cannot have more than
        ``pool`` of them made; as nvmet-tcp returns a command to its pool)."""
        req.set_state(_DONE)
        self.in_flight -= 1

    def _run(self, req: Request) -> None:
        task = eager.start(self._execute(req))
        if task is not None:  # it waits (an fsync, a slow backend): track it for shutdown
            for tasks in (self.tasks, self.target.tasks):
                tasks.add(task)
                task.add_done_callback(tasks.discard)

    async def _execute(self, req: Request) -> None:
        try:
            await req.execute(req)
        except Exception:
            log.exception("command failed", cid=req.cid, opcode=req.opcode, qid=self.qid)
            req.status = _INTERNAL_ERROR
        self._complete(req)

    def _fail(self, req: Request, status: int) -> None:
        req.status = status
        self._complete(req)

    def _complete(self, req: Request) -> None:
        """Build the completion and hand the response to the transport."""
        status = req.status
        if status:
            req.reply = None
        elif req.direction is _TO_HOST and req.reply is None:
            status = req.status = _BAD_LENGTH  # a data buffer on a command that returns none
        if status and self.controller is not None and self.controller.log_error(self.qid or 0, req):
            status |= MORE  # as nvmet: the Error Information log has an entry for this command
        if self.sqsize and not self.sqhd_disabled:
            self.sqhd = (self.sqhd + 1) % (self.sqsize + 1)
        req.set_state(_COMPLETING)
        ns = req.ns
        counters = self.counters
        if counters is not None:
            elapsed = monotonic_ns() - req.start_ns
            kind = KIND_BY_OPCODE[req.opcode]
            counters.count(kind, req.length, elapsed)
            if ns is not None:
                ns.counters.count(kind, req.length, elapsed)
            if status:
                self._count_error(req, status)
        if ns is not None:
            ns.in_flight -= 1
            if ns.removed:
                self.target.namespace_released(ns)
        req.cqe = _pack_cqe(req.dw0, req.dw1, self.sqhd, self.qid or 0, req.cid, to_wire(status))
        self._queue_response(req)

    def _count_error(self, req: Request, status: int) -> None:
        self.counters.add_error(status)
        if req.ns is not None:
            req.ns.counters.add_error(status)

    def note_teardown(self, cause: str, **detail: str) -> None:
        """Record why this queue goes away, for the one line :meth:`close` logs. The first cause
        wins: what follows it (the transport closing, the controller shutting down) is its
        consequence."""
        if self._teardown is None:
            self._teardown = (cause, detail)

    def _watch_auth(self) -> None:
        """A locked queue has its controller's KATO, or ``auth_timeout`` without one, to
        authenticate, then it is closed (docs/security.md: nvmet's transaction timer has the same
        length but only restarts the transaction)."""
        seconds = self.controller.kato_ms / 1000 or self.target.limits.auth_timeout
        self._auth_timer = asyncio.get_running_loop().call_later(seconds, self._auth_expired, seconds)

    def _auth_expired(self, seconds: float) -> None:
        self._auth_timer = None
        if self.locked:
            self.target.rejections.add(AUTH_TIMEOUT)
            self.note_teardown("not authenticated in time", timeout=str(seconds))
            self.transport.close()

    def close(self) -> None:
        """The connection is gone: say why, detach from the controller."""
        if self._auth_timer is not None:
            self._auth_timer.cancel()
            self._auth_timer = None
        cause, detail = self._teardown or ("connection closed", {})
        log.info("queue torn down", peer=self.peer, transport=self.transport.info.name,
                 qid=self.qid, cntlid=self.controller.cntlid if self.controller else None,
                 cause=cause, **detail)
        if self.controller is not None:
            self.controller.queue_closed(self)

    # -- fabrics commands ----------------------------------------------------------------------

    def _check_connect(self, req: Request) -> int:
        if self.controller is not None:
            return _SEQUENCE_ERROR
        if req.length != CONNECT_DATA_SIZE:
            return _BAD_LENGTH
        return _SUCCESS

    def _check_property(self, req: Request) -> int:
        if self.qid != 0:  # an admin-only Fabrics command: nvmet_parse_fabrics_io_cmd's Invalid Opcode
            return _INVALID_OPCODE
        return _BAD_LENGTH if req.length else _SUCCESS

    def _check_property_set(self, req: Request) -> int:
        return self._check_property(req) or self.controller.check_property_set(req)

    async def _property_get(self, req: Request) -> None:
        self.controller.property_get(req)

    async def _property_set(self, req: Request) -> None:
        self.controller.property_set(req)

    async def _connect(self, req: Request) -> None:
        self._connect_queue(req)
        if req.status:
            self.target.rejections.add(connect_refused(req.status))

    def _connect_queue(self, req: Request) -> None:
        """Connect's work; a refusal is ``req.status`` (and ``req.dw0``)."""
        fields = CONNECT_COMMAND.parse(req.sqe)
        recfmt, qid, sqsize, kato = fields.recfmt, fields.qid, fields.sqsize, fields.kato
        if recfmt != 0:
            req.status = Status.CONNECT_INCOMPATIBLE_FORMAT
            return
        try:
            data = CONNECT_DATA.parse(_nqns_to_nul(req.data))
        except Exception:
            req.status, req.dw0 = Status.CONNECT_INVALID_PARAMETERS, IPO_CONNECT_SUBNQN
            return
        if sqsize == 0:
            req.status, req.dw0 = Status.CONNECT_INVALID_PARAMETERS, IPO_CONNECT_SQSIZE
            return
        if qid == 0:
            status, dw0, ctrl = self.target.connect_admin(
                self, data.subnqn, data.hostnqn, data.hostid, data.cntlid, sqsize, kato)
        else:
            status, dw0, ctrl = self.target.connect_io(
                self, data.subnqn, data.hostnqn, data.cntlid, qid, sqsize)
        req.status, req.dw0 = status, dw0
        if ctrl is not None:
            self.controller = ctrl
            self.qid = qid
            self.sqsize = sqsize
            self.pool = 2 * (sqsize + 1)
            self.sqhd_disabled = bool(fields.cattr & CATTR_DISABLE_SQFLOW)
            if qid:  # I/O queues take the transport's (larger) in-capsule data from now on
                self.inline_size = self.transport.info.io_inline
                self.counters = ctrl.counters
            auth = ctrl.subsystem.auth.get(data.hostnqn)
            if auth is not None:
                self.auth = QueueAuth(auth, data.hostnqn, data.subnqn)
                self.locked = True
                self._watch_auth()
                req.dw0 |= CONNECT_AUTHREQ_ATR
            log.info("queue connected", subnqn=data.subnqn, hostnqn=data.hostnqn,
                     cntlid=ctrl.cntlid, qid=qid, sqsize=sqsize + 1, peer=self.peer)

    # -- in-band authentication (DH-HMAC-CHAP, target/auth.py) ----------------------------------

    def _check_auth(self, req: Request) -> int:
        """The kernel's checks of Authentication Send/Receive (fabrics-cmd-auth.c)."""
        if self.auth is None:
            return _INVALID_OPCODE
        cmd = AUTH_COMMAND.parse(req.sqe)
        if cmd.secp != SECP_DHCHAP or cmd.spsp0 != SPSP_DHCHAP or cmd.spsp1 != SPSP_DHCHAP:
            return _INVALID_FIELD
        if cmd.length == 0:
            return _INVALID_FIELD
        return _SUCCESS if req.length == cmd.length else _BAD_LENGTH

    async def _auth_send(self, req: Request) -> None:
        self.auth.send(bytes(req.data))
        self._auth_settled()

    async def _auth_receive(self, req: Request) -> None:
        message = self.auth.receive()
        req.reply = message[:req.length].ljust(req.length, b"\0")
        self._auth_settled()

    def _auth_settled(self) -> None:
        auth = self.auth
        self.locked = not auth.authenticated
        if not self.locked and self._auth_timer is not None:
            self._auth_timer.cancel()
            self._auth_timer = None
        elif self.locked and self._auth_timer is None:  # a re-authentication failed
            self._watch_auth()
        if auth.failed:
            self.target.rejections.add(AUTH_FAILED)
            # the host NQN is a name, not a secret; the secret never reaches a log line
            log.warning("authentication failed", hostnqn=auth.hostnqn, qid=self.qid, peer=self.peer)
