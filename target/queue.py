"""One submission/completion queue pair on the target, with no I/O of its own (sans-I/O).

A transport feeds it raw SQEs (plus any in-capsule data), moves data when a request asks for
it, and sends the 16-byte completions it produces. The queue checks the command's framing
(flags, SGL, transfer length) before any data moves, then hands execution to the controller.
"""

from __future__ import annotations

from time import monotonic
from typing import TYPE_CHECKING, Callable

import structlog

from protocol.constants import PSDT_SGL, FabricsType, SglId
from protocol.fabrics import CATTR_DISABLE_SQFLOW, CONNECT_COMMAND, CONNECT_DATA, CONNECT_DATA_SIZE, IATTR_DATA
from protocol.nvme import CQE_FAST, IO_COMMAND_FAST, parse_sgl_keyed
from protocol.status import Status, to_wire
from target.request import Direction, Request, RequestState

if TYPE_CHECKING:
    from target.controller import Controller
    from target.target import Target

log = structlog.get_logger("blockd.target.queue")

MAX_TRANSFER = 1 << 20
"""Largest data transfer of one command (Identify MDTS = 8: 2^8 x 4 KiB)."""

_FABRICS = 0x7F
_unpack_command = IO_COMMAND_FAST.unpack_from
_pack_cqe = CQE_FAST.pack
_KEYED = frozenset({SglId.KEYED_DATA_BLOCK, SglId.KEYED_DATA_BLOCK_INVALIDATE})
_IN_CAPSULE = int(SglId.DATA_BLOCK_OFFSET)
# Enum members bound once: a class attribute lookup on an Enum costs several times a global's,
# and these are read several times per I/O.
_NEW, _NEED_DATA, _EXECUTING = RequestState.NEW, RequestState.NEED_DATA, RequestState.EXECUTING
_SENDING_DATA, _COMPLETING, _DONE = RequestState.SENDING_DATA, RequestState.COMPLETING, RequestState.DONE
_NONE, _TO_CONTROLLER, _TO_HOST = Direction.NONE, Direction.HOST_TO_CONTROLLER, Direction.CONTROLLER_TO_HOST
_DIRECTIONS = (_NONE, _TO_CONTROLLER, _TO_HOST, None)
"""Data direction by opcode bits 1:0 (FCTYPE bit 0 for fabrics); 3 is no valid opcode."""
_TRANSPORT_SGL_IDS = {
    "tcp": frozenset({SglId.TRANSPORT_DATA_BLOCK}),
    "rdma": _KEYED,
}


class TargetQueue:
    """Admin (qid 0) or I/O queue of one controller, bound to one transport connection."""

    def __init__(self, target: Target, transport: str, port_id: int, inline_size: int,
                 close: Callable[[], None], peer: str = "", local_address: str = "") -> None:
        self.target = target
        self.transport = transport
        self.port_id = port_id
        self.inline_size = inline_size
        self.close_transport = close
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
        self._data_sgl_ids = _TRANSPORT_SGL_IDS[transport]

    # -- the request life cycle -------------------------------------------------------------

    def submit(self, sqe: bytes | memoryview, incapsule: memoryview | None = None) -> Request:
        """Take one command; afterwards it is NEED_DATA, EXECUTING or COMPLETING."""
        fields = _unpack_command(sqe)
        req = Request(bytes(sqe[:64]), fields)
        self.in_flight += 1
        if fields[1] & 0xC3 != PSDT_SGL:
            req.fail(Status.INVALID_FIELD)
            return req
        ctrl = self.controller
        opcode = req.opcode
        if ctrl is not None:
            # Any command proves the host alive (traffic-based keep-alive): a host busy setting
            # up queues or moving data is not torn down for a Keep Alive that queued behind.
            ctrl.last_keep_alive = monotonic()
        if opcode == _FABRICS:
            fctype = req.sqe[4]
            if fctype != FabricsType.CONNECT and ctrl is None:
                req.fail(Status.INVALID_OPCODE)  # as nvmet_parse_connect_cmd
                return req
            direction = _TO_CONTROLLER if fctype & 1 else _TO_HOST
        elif ctrl is None:
            req.fail(Status.INVALID_OPCODE)
            return req
        elif not ctrl.ready:
            req.fail(Status.COMMAND_SEQUENCE_ERROR)
            return req
        elif self.in_flight > self.sqsize + 1:
            req.fail(Status.COMMAND_SEQUENCE_ERROR)
            return req
        else:
            direction = _DIRECTIONS[opcode & 3]
            if direction is None:
                req.fail(Status.INVALID_OPCODE)
                return req
        if not self._map_sgl(req, direction, fields, incapsule):
            return req
        if self.qid and opcode != _FABRICS:
            status = ctrl.check_io(req)
            if status:
                req.fail(status)
                return req
        if req.state is _NEW:
            req.state = _EXECUTING
        return req

    def _map_sgl(self, req: Request, direction: Direction, fields: tuple[int, ...],
                 incapsule: memoryview | None) -> bool:
        """Validate SGL1 and decide how data moves; False when ``req`` already failed."""
        _, _, _, _, address, length, sgl_id, _, _, _ = fields
        if sgl_id in _KEYED and self.transport == "rdma":
            address, length, key, _ = parse_sgl_keyed(req.sqe[24:40])
        else:
            key = 0
        req.sgl_id = sgl_id
        if length == 0:
            return True
        if direction is _NONE:
            req.fail(Status.INVALID_FIELD)
            return False
        if length > MAX_TRANSFER:
            req.fail(Status.SGL_INVALID_DATA_LENGTH)
            return False
        req.direction = direction
        req.length = length
        if sgl_id == _IN_CAPSULE:
            if direction is not _TO_CONTROLLER:
                req.fail(Status.INVALID_FIELD)
                return False
            avail = len(incapsule) if incapsule is not None else 0
            if address != 0 or length > self.inline_size or length > avail:
                req.fail(Status.SGL_INVALID_OFFSET)
                return False
            req.data = incapsule[:length]
            return True
        if sgl_id not in self._data_sgl_ids:
            req.fail(Status.SGL_INVALID_TYPE if sgl_id >> 4 else Status.INVALID_FIELD)
            return False
        req.sgl_address = address
        req.sgl_key = key
        if direction is _TO_CONTROLLER:
            req.state = _NEED_DATA  # the transport puts the data in req.data
        return True

    def data_received(self, req: Request) -> None:
        """The transport set ``req.data`` to the host's data (in a buffer of its choosing)."""
        assert req.state is _NEED_DATA, req
        req.state = _EXECUTING

    def data_failed(self, req: Request) -> None:
        """The transport could not fetch the host's data."""
        req.fail(Status.DATA_TRANSFER_ERROR)

    async def execute(self, req: Request) -> None:
        """Run the command; afterwards it is SENDING_DATA or COMPLETING."""
        assert req.state is _EXECUTING, req
        try:
            if req.opcode == _FABRICS:
                await self._fabrics(req)
            elif self.qid == 0:
                await self.controller.execute_admin(req)
            else:
                await self.controller.execute_io(req)
        except Exception:
            log.exception("command failed", cid=req.cid, opcode=req.opcode, qid=self.qid)
            req.status = Status.INTERNAL_ERROR
        if req.state is _EXECUTING:
            if req.status or req.direction is not _TO_HOST:
                req.state = _COMPLETING
            elif req.data is None:
                req.status = Status.SGL_INVALID_DATA_LENGTH  # a data buffer on a command that returns none
                req.state = _COMPLETING
            else:
                req.state = _SENDING_DATA

    def data_sent(self, req: Request) -> None:
        assert req.state is _SENDING_DATA, req
        req.state = _COMPLETING

    def completion(self, req: Request) -> bytes:
        """The 16-byte CQE for ``req``; the request is DONE afterwards."""
        assert req.state is _COMPLETING, req
        status = req.status
        if status and self.controller is not None:
            self.controller.log_error(self.qid or 0, req)
        if self.sqsize and not self.sqhd_disabled:
            self.sqhd = (self.sqhd + 1) % (self.sqsize + 1)
        req.state = _DONE
        self.in_flight -= 1
        return _pack_cqe(req.dw0, req.dw1, self.sqhd, self.qid or 0, req.cid, to_wire(status))

    def close(self) -> None:
        """The connection is gone: detach from the controller."""
        if self.controller is not None:
            self.controller.queue_closed(self)

    # -- fabrics commands ----------------------------------------------------------------------

    async def _fabrics(self, req: Request) -> None:
        fctype = req.sqe[4]
        if fctype == FabricsType.CONNECT:
            self._connect(req)
        elif fctype in (FabricsType.PROPERTY_GET, FabricsType.PROPERTY_SET):
            if self.qid != 0:
                req.status = Status.INVALID_FIELD
                return
            self.controller.property_command(req)
        else:
            req.status = Status.INVALID_OPCODE

    def _connect(self, req: Request) -> None:
        if self.controller is not None:
            req.status = Status.COMMAND_SEQUENCE_ERROR
            return
        if req.length != CONNECT_DATA_SIZE or req.data is None:
            req.status = Status.SGL_INVALID_DATA_LENGTH
            return
        fields = CONNECT_COMMAND.parse(req.sqe)
        recfmt, qid, sqsize, kato = fields.recfmt, fields.qid, fields.sqsize, fields.kato
        if recfmt != 0:
            req.status = Status.CONNECT_INCOMPATIBLE_FORMAT
            return
        try:
            data = CONNECT_DATA.parse(bytes(req.data))
        except Exception:
            req.status, req.dw0 = Status.CONNECT_INVALID_PARAMETERS, IATTR_DATA | 256
            return
        if sqsize == 0:
            req.status, req.dw0 = Status.CONNECT_INVALID_PARAMETERS, 44
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
            self.sqhd_disabled = bool(fields.cattr & CATTR_DISABLE_SQFLOW)
            if qid:  # I/O queues take the transport's (larger) in-capsule data from now on
                self.inline_size = self.target.inline_size(self.transport)
            log.info("queue connected", subnqn=data.subnqn, hostnqn=data.hostnqn,
                     cntlid=ctrl.cntlid, qid=qid, sqsize=sqsize + 1, peer=self.peer)
