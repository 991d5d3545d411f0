"""What the host's compiled modules read and call on the Python objects they are handed (the twin
of ``target/compiled_contract.py``, which says how ``tests/core/test_compiled_contract.py`` holds
both ends to it). Where a Protocol of the host already says what a caller needs
(:class:`initiator.fuse.needs.MountController`, :class:`initiator.controller.QueueConnection`),
it is the one named here, not a second copy.

Nothing here is used at run time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from initiator.controller import QueueConnection
from initiator.fuse.needs import MountController

if TYPE_CHECKING:
    from initiator.controller import NamespaceInfo as _Info


class LaneController(Protocol):
    """``initiator.controller.Controller`` as its compiled lane (``initiator/_lane.pyx``) reads it.
    What the lane needs of the controller's private state (its completion handler, parked lines,
    timeout, event loop, liveness) the controller hands it, at ``IoLane(...)`` and ``sync``."""

    counters: Any
    failed: BaseException | None
    io: list[QueueConnection]
    namespaces: dict[int, _Info]
    max_transfer: int
    def submit_io(self, sqe: bytearray, data_out: Any, data_in: Any, done: Any) -> None: ...


class LaneHolder(MountController, Protocol):
    """A mount's controller as the compiled FUSE loop reads it: a :class:`MountController`, and
    the compiled lane where it has one (``getattr(ctrl, "lane", None)``: a multipath controller
    has none, and its calls go through ``transfer``)."""

    lane: Any


class NamespaceInfo(Protocol):
    """``initiator.controller.NamespaceInfo``: what the lane and the FUSE loop check a range
    against."""

    block_size: int
    size: int
    read_only: bool


class BlockFiles(Protocol):
    """``initiator.fuse.blockfile.BlockFiles``: the Python handlers the compiled FUSE loop hands
    every other case to, and the namespaces' range locks it shares."""

    locks: dict[int, Any]
    def range_lock(self, nsid: int) -> Any: ...
    def read(self, *args: Any) -> Any: ...
    def write(self, *args: Any) -> Any: ...
    def fsync(self, *args: Any) -> Any: ...


class FuseSession(Protocol):
    """``initiator.fuse.session.FuseSession``: what the compiled FUSE loop (``_loop.pyx``) reads
    and calls of the session it serves."""

    name: str
    connections: Any
    files: BlockFiles
    inflight: dict[int, Any]
    tasks: Any
    stats: dict[str, int]
    spare: list[bytearray]
    def fail(self, *args: Any) -> Any: ...
    def recycle(self, *args: Any) -> Any: ...
    def serve(self, *args: Any) -> Any: ...
    def device_gone(self, *args: Any) -> Any: ...
    def ring_entry_ended(self, *args: Any) -> Any: ...


RECEIVERS: dict[str, dict[str, type]] = {
    "initiator/_lane.pyx": {"ctrl": LaneController, "conn": QueueConnection, "c": QueueConnection,
                            "info": NamespaceInfo},
    "initiator/fuse/_loop.pyx": {"ctrl": LaneHolder, "files": BlockFiles, "session": FuseSession,
                                 "info": NamespaceInfo},
}
"""Per compiled module: the names its code gives the Python objects it is handed, and the
Protocol each is held to."""

IMPLEMENTED_BY: dict[type, tuple[str, ...]] = {
    LaneController: ("initiator.controller.Controller",),
    NamespaceInfo: ("initiator.controller.NamespaceInfo",),
    QueueConnection: ("initiator.tcp.TcpHostConnection", "initiator.rdma.RdmaHostConnection"),
    MountController: ("initiator.controller.Controller", "initiator.multipath.MultipathController"),
    LaneHolder: ("initiator.controller.Controller",),
    BlockFiles: ("initiator.fuse.blockfile.BlockFiles",),
    FuseSession: ("initiator.fuse.session.FuseSession",),
}
"""The Python classes that must define every member of each Protocol."""
