"""One command's life on the target, as explicit states with one checked setter.

    NEW -> EXECUTING -> COMPLETING -> DONE   (DONE: the transport sent the response)
    NEW -> NEED_DATA -> EXECUTING            (the host's data is not in the capsule)
    NEW -> COMPLETING                        (parsing refused it: nothing ran, no data moved)
    NEED_DATA -> COMPLETING                  (the transport could not fetch the data)

:class:`target.queue.TargetQueue` moves every request: ``submit`` parses it (NEW), asks the
transport for the host's data (NEED_DATA) or runs its handler (EXECUTING), builds the completion
(COMPLETING) and hands it to the transport, which reports it sent (DONE). Every move goes
through :meth:`Request.set_state`, which checks it against :data:`TRANSITIONS` (as h11's
transition table, SPDK's ``nvmf_tcp_req_set_state``) and raises
:class:`IllegalTransition` for any other: a transport reporting data twice, or a response
for a request that never ran, is a bug to surface, not to paper over.
"""

from __future__ import annotations

from enum import IntEnum
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from protocol.nvme import IO_CID, IO_NSID, IO_OPCODE
from protocol.status import Status

if TYPE_CHECKING:
    from target.subsystem import Namespace


class RequestState(IntEnum):
    """An IntEnum, not an Enum: an Enum member hashes by a Python-level ``__hash__``, two calls
    per table lookup on every transition (measured: 12 of a read's 39 Python calls)."""

    NEW = 0
    NEED_DATA = 1
    EXECUTING = 2
    COMPLETING = 3
    DONE = 4


_NEW, _NEED_DATA, _EXECUTING = RequestState.NEW, RequestState.NEED_DATA, RequestState.EXECUTING
_COMPLETING, _DONE = RequestState.COMPLETING, RequestState.DONE

TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    _NEW: frozenset({_NEED_DATA, _EXECUTING, _COMPLETING}),
    _NEED_DATA: frozenset({_EXECUTING, _COMPLETING}),
    _EXECUTING: frozenset({_COMPLETING}),
    _COMPLETING: frozenset({_DONE}),
    _DONE: frozenset(),
}
"""Every legal move: state -> the states it may go to."""


class IllegalTransition(RuntimeError):
    """A request was asked to move where :data:`TRANSITIONS` does not allow."""

    def __init__(self, req: Request, new: RequestState) -> None:
        super().__init__(f"{req!r} cannot go from {req.state.name} to {new.name}")
        self.request = req
        self.new = new


class Direction(IntEnum):
    """Data direction, from opcode bits 1:0 (fabrics: FCTYPE bit 0)."""

    NONE = 0
    HOST_TO_CONTROLLER = 1
    CONTROLLER_TO_HOST = 2


class Request:
    """One command in flight on one queue."""

    __slots__ = ("cid", "opcode", "nsid", "sqe", "fields", "state", "direction", "length",
                 "sgl_id", "sgl_address", "sgl_key", "data", "reply", "buffer", "status", "dw0",
                 "dw1", "cqe", "execute", "ns", "transport_ctx", "start_ns")

    def __init__(self, sqe: bytes, fields: tuple[int, ...], transport_ctx: Any, start_ns: int) -> None:
        self.sqe = sqe
        self.fields = fields
        """The SQE unpacked as :data:`protocol.nvme.IO_COMMAND`."""
        self.opcode: int = fields[IO_OPCODE]
        self.cid: int = fields[IO_CID]
        self.nsid: int = fields[IO_NSID]
        self.state = _NEW
        self.direction = Direction.NONE
        self.length = 0
        self.sgl_id = 0
        self.sgl_address = 0
        self.sgl_key = 0
        self.data: bytearray | memoryview | bytes | None = None
        """The host's data (in-capsule, or fetched by the transport)."""
        self.reply: bytearray | memoryview | bytes | None = None
        """Data for the host, exactly ``length`` bytes; set by the handler of a command that
        returns data, cleared by the core when the command fails."""
        self.buffer: memoryview | None = None
        """Where a read may put its data (the transport's registered memory, exactly ``length``
        bytes); None: the controller allocates."""
        self.status: int = Status.SUCCESS
        self.dw0 = 0
        self.dw1 = 0
        self.cqe = b""
        """The 16-byte completion, built by the core before ``queue_response``."""
        self.execute: Callable[[Request], Awaitable[None]] | None = None
        """The handler parsing picked (as the kernel's ``req->execute``)."""
        self.ns: Namespace | None = None
        """The namespace an I/O command addresses, looked up once at parsing."""
        self.transport_ctx = transport_ctx
        """Whatever the transport needs to remember (R2T tag, RDMA slot…)."""
        self.start_ns = start_ns
        """``monotonic_ns`` when the queue took the capsule: the start of its counted latency."""

    def set_state(self, new: RequestState) -> None:
        """Move to ``new``; :class:`IllegalTransition` if the table does not allow it."""
        if new not in TRANSITIONS[self.state]:
            raise IllegalTransition(self, new)
        self.state = new

    def __repr__(self) -> str:
        return f"<Request cid={self.cid} opc={self.opcode:#x} {self.state.name} status={self.status:#x}>"
