"""A command's life on the target, as explicit states (modelled on SPDK's RDMA target).

    NEW -> NEED_DATA -> EXECUTING -> SENDING_DATA -> COMPLETING -> DONE
            (writes whose data     (reads that
             is not in-capsule)     return data)

Commands that fail validation go from NEW straight to COMPLETING. Transports move a request
forward only through :class:`target.queue.TargetQueue`, which checks each transition.
"""

from __future__ import annotations

from enum import Enum, IntEnum
from typing import Any

from protocol.status import Status


class RequestState(Enum):
    NEW = "new"
    NEED_DATA = "need data"
    EXECUTING = "executing"
    SENDING_DATA = "sending data"
    COMPLETING = "completing"
    DONE = "done"


class Direction(IntEnum):
    """Data direction, from opcode bits 1:0 (fabrics: FCTYPE bit 0)."""

    NONE = 0
    HOST_TO_CONTROLLER = 1
    CONTROLLER_TO_HOST = 2


class Request:
    """One command in flight on one queue."""

    __slots__ = ("cid", "opcode", "nsid", "sqe", "fields", "state", "direction", "length",
                 "sgl_id", "sgl_address", "sgl_key", "data", "buffer", "status", "dw0", "dw1",
                 "transport_ctx")

    def __init__(self, sqe: bytes, fields: tuple[int, ...]) -> None:
        self.sqe = sqe
        self.fields = fields
        """The SQE unpacked as :data:`protocol.nvme.IO_COMMAND`."""
        self.opcode: int = fields[0]
        self.cid: int = fields[2]
        self.nsid: int = fields[3]
        self.state = RequestState.NEW
        self.direction = Direction.NONE
        self.length = 0
        self.sgl_id = 0
        self.sgl_address = 0
        self.sgl_key = 0
        self.data: bytearray | memoryview | bytes | None = None
        self.buffer: memoryview | None = None
        """Where a read may put its data (the transport's registered memory, exactly ``length``
        bytes); None: the controller allocates."""
        self.status: int = Status.SUCCESS
        self.dw0 = 0
        self.dw1 = 0
        self.transport_ctx: Any = None
        """Whatever the transport needs to remember (R2T tag, RDMA slot…)."""

    def fail(self, status: int, dw0: int = 0) -> None:
        """Finish with an error: no data moves, the completion carries ``status``."""
        self.status = status
        self.dw0 = dw0
        self.state = RequestState.COMPLETING

    def __repr__(self) -> str:
        return f"<Request cid={self.cid} opc={self.opcode:#x} {self.state.value} status={self.status:#x}>"
