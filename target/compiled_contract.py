"""What the target's compiled modules read, write and call on the Python objects they are handed:
one Protocol per object, the way uvloop's ``loop.pxd`` declares every field another module uses.

The compiled paths (``target/_tcp_io.pyx``, ``target/_rdma_fast.pyx``, over ``_io_core.pyx`` and
``_file_io.pyx``) keep their Python reference's bookkeeping on the reference's own objects (the queue's SQHD and command pool, the
connection's read-data batching and R2T budget, ...). Those names are therefore an interface: a
rename on the Python side must fail a test, not the compiled plane at run time.
``tests/core/test_compiled_contract.py`` holds both ends to this file:

- every ``receiver.name`` in a compiled module's code, for a receiver :data:`RECEIVERS` names for
  that module, is a member of the receiver's Protocol here;
- every member of a Protocol here is defined by each class :data:`IMPLEMENTED_BY` lists for it
  (a method, a class attribute or a ``self.name`` assignment in the class or its bases);
- no compiled module touches an underscore name of another object unless a ``.pxd`` (or the
  module itself, for its own cdef classes) declares it at C level.

Nothing here is used at run time: the Protocols are declarations, read by the tests and by
readers (and by a type checker, for the Python side).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class DataBudget(Protocol):
    """``target.limits.DataBudget``: the daemon-wide R2T budget an R2T write takes its buffer's
    share of (``Target.r2t_budget``)."""

    def try_take(self, nbytes: int) -> bool: ...
    def give(self, nbytes: int) -> None: ...
    def free(self, nbytes: int) -> bool: ...


class UnsentTotal(Protocol):
    """``target.limits.UnsentTotal``: the daemon-wide count of unsent replies
    (``max_unsent_total``); past it, read data goes to the socket at once."""

    over: bool


class Target(Protocol):
    """``target.target.Target``: what a connection's compiled path reads of the daemon."""

    r2t_budget: DataBudget
    unsent: UnsentTotal
    threaded_queues: bool
    draining: Any
    def namespace_released(self, ns: Namespace) -> None: ...


class Namespace(Protocol):
    """``target.subsystem.Namespace``: its C copy (``fast``, a ``FastNamespace`` or None), the
    backend that copy was made for, and its hold count; for a replicated namespace's compiled
    lane (``target/_io_core.pyx`` ``mirror_eligible``) also its size in blocks, block shift,
    whether a host is registered (reservations), and its I/O counters."""

    fast: Any
    backend: Any
    in_flight: int
    removed: bool
    blocks: int
    lba_shift: int
    reserved: bool
    counters: Any


class Controller(Protocol):
    """``target.controller.Controller``: CC/CSTS (ready), the namespaces this port serves, and the
    keep-alive traffic stamp."""

    cc: int
    csts: int
    io_namespaces: dict[int, Namespace]
    traffic_seen: bool


class Queue(Protocol):
    """``target.queue.TargetQueue``: its fixed shape (read once an I/O queue connected), its
    command pool and SQHD (kept here as ``_complete`` keeps them), and the calls that hand a
    command back to it as the request it would have made."""

    qid: int
    sqsize: int
    pool: int
    sqhd: int
    sqhd_disabled: bool
    inline_size: int
    locked: bool
    in_flight: int
    controller: Controller | None
    counters: Any
    peer: str
    def adopt_write(self, sqe: bytes, start_ns: int, ns: Namespace, data: Any, ctx: Any) -> Any: ...
    def data_ready(self, req: Any) -> None: ...
    def write_failed(self, req: Any, exc: BaseException) -> None: ...
    def submit(self, sqe: Any, incapsule: Any = None) -> None: ...
    """(A command of a failed io_uring chain, given back as a capsule the compiled path declined:
    ``target/_uring_loop.pyx``.)"""


class Request(Protocol):
    """``target.request.Request``: the fields of an R2T write the queue made, which the compiled
    path may write and answer (``TcpFastPath.data_ready``)."""

    cid: int
    opcode: int
    fields: Any
    ns: Namespace
    data: Any
    length: int
    start_ns: int
    transport_ctx: Any


class ReplyPipe(Protocol):
    """``target.file_send.ReplyPipe``: the connection's pipe for data by reference."""

    r: int
    w: int
    queued: int
    def discard(self) -> None: ...
    def holds(self, length: int) -> bool: ...
    def room_for(self, length: int) -> bool: ...


class TcpConnection(Protocol):
    """``target.tcp.TcpTargetConnection``: its reader, output and transport; its read-data
    batching (``batched`` against ``flush_at``); its R2T state (``r2t_pending``, ``r2t_waiting``,
    ``r2t_held``, ``next_ttag``, ``send_r2ts``); and its per-PDU step and error ends, which the
    compiled receive loop calls for every PDU it does not serve itself."""

    reader: Any
    out: Any
    transport: Any
    queue: Queue | None
    target: Target
    limits: Any
    paused: bool
    pipe: ReplyPipe | None
    sock: int
    batched: int
    flush_at: int
    r2t_pending: dict[int, tuple[Any, int]]
    r2t_waiting: Any
    r2t_held: int
    next_ttag: int
    def send_r2ts(self) -> None: ...
    def reply_pipe(self) -> ReplyPipe: ...
    def take_pdu(self, pdu: Any) -> bool: ...
    def terminate(self, exc: Exception) -> None: ...
    def digest_error(self, exc: Exception) -> None: ...
    buffer_updated: Callable[..., None]


class RdmaCommand(Protocol):
    """``target.rdma.RdmaCommand``: a command between its receive and its SEND."""

    req: Any
    data: Any
    recv: int


class RdmaConnection(Protocol):
    """``target.rdma.RdmaTargetConnection``: its pools and batch lists (the work requests of one
    completion batch go out as one chain each), its FIFO of writes waiting for RDMA READ, and the
    Python path's handlers the compiled one hands everything else to."""

    queue: Any
    info: Any
    cm: Any
    data: Any
    resp_pool: Any
    recv_pool: Any
    resp_wait: Any
    read_wait: Any
    cmds: set[Any]
    closing: bool
    destroyed: bool
    deferring: bool
    batching: bool
    resp_cmd: list[Any]
    recv_wrs: list[Any]
    send_out: list[Any]
    recv_out: list[Any]
    held: list[Any]
    def completion(self, wc: Any) -> None: ...
    def handling_failed(self, exc: Exception) -> None: ...
    def flush(self) -> None: ...
    def pump_reads(self) -> None: ...
    def pump_responses(self) -> None: ...
    def wc_failed(self, wr: str, status: int, **detail: str) -> None: ...


class RdmaModule(Protocol):
    """``target.rdma`` itself: the work-request id layout both paths encode and decode."""

    KIND_SHIFT: int
    WR_ID_MASK: int
    KIND_RECV: int
    KIND_SEND: int
    KIND_WRITE: int
    RdmaCommand: type


_CORE = {"queue": Queue, "ctrl": Controller, "entry": Namespace, "nsobj": Namespace, "target": Target,
         "budget": DataBudget, "r2t_budget": DataBudget, "unsent": UnsentTotal}

RECEIVERS: dict[str, dict[str, type]] = {
    "target/_tcp_io.pyx": {**_CORE, "conn": TcpConnection, "pipe": ReplyPipe, "req": Request},
    "target/_tcp_thread.pyx": {**_CORE, "conn": TcpConnection, "pipe": ReplyPipe, "req": Request},
    "target/_uring_loop.pyx": {**_CORE, "conn": TcpConnection},
    "target/_io_core.pyx": _CORE,
    "target/_file_io.pyx": _CORE,
    "target/_rdma_fast.pyx": {**_CORE, "conn": RdmaConnection, "cmd": RdmaCommand, "rdma": RdmaModule},
}
"""Per compiled module: the names its code gives the Python objects it is handed, and the
Protocol each is held to."""

IMPLEMENTED_BY: dict[type, tuple[str, ...]] = {
    DataBudget: ("target.limits.DataBudget",),
    UnsentTotal: ("target.limits.UnsentTotal",),
    Target: ("target.target.Target",),
    Namespace: ("target.subsystem.Namespace",),
    Controller: ("target.controller.Controller",),
    Queue: ("target.queue.TargetQueue",),
    Request: ("target.request.Request",),
    ReplyPipe: ("target.file_send.ReplyPipe",),
    TcpConnection: ("target.tcp.TcpTargetConnection",),
    RdmaCommand: ("target.rdma.RdmaCommand",),
    RdmaConnection: ("target.rdma.RdmaTargetConnection",),
    RdmaModule: ("target.rdma",),
}
"""The Python classes (or module) that must define every member of each Protocol."""
