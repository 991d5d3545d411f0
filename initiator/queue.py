"""Host-side queue bookkeeping with no I/O of its own (sans-I/O: no event loop, no Futures).

Command ids, the commands in flight and their completion are tracked here; transports only
turn :class:`HostCommand` objects into wire units and feed completions back. Waiting for a
free command id is the controller's business (it parks commands until one completes).

This is the Python reference; ``initiator/_queue.pyx`` is its compiled twin, which
:mod:`initiator.controller` uses when the data plane is compiled
(``tests/core/test_host_queue_differential.py`` drives both the same way).
"""

from __future__ import annotations

import collections
import math
import struct
from typing import Callable

from blockd.iostats import KIND_BY_OPCODE, IoCounters
from protocol.commands import SQE_CID_OFFSET
from protocol.layout import field_offset
from protocol.nvme import SQE, SQE_FAST

_pack_cid_into = struct.Struct("<H").pack_into
SQE_OPCODE_OFFSET = field_offset(SQE, "opcode")


class HostCommand:
    """One command from the host's point of view.

    ``data_out`` is what a write sends; ``data_in`` is where a read's data lands (the caller's
    own buffer, so reads need no extra copy). ``on_done(cmd, None)`` runs straight from the
    transport's receive callback when the target answers, ``on_done(cmd, exc)`` when the
    command cannot complete: no Future and no extra trip round the event loop per I/O.

    A plain class with ``__slots__`` rather than a dataclass: one is made per I/O, and slot
    stores in a hand-written ``__init__`` cost less than a dataclass's instance dict.
    """

    __slots__ = ("sqe", "data_out", "data_in", "cid", "transferred", "status", "dw0", "dw1", "on_done",
                 "deadline", "sent_ns", "attempts", "path_retry_until")

    def __init__(self, sqe: bytearray, data_out: bytes | memoryview | None = None,
                 data_in: memoryview | None = None,
                 on_done: Callable[[HostCommand, BaseException | None], None] | None = None,
                 deadline: float = math.inf) -> None:
        self.sqe = sqe
        self.data_out = data_out
        self.data_in = data_in
        self.cid = -1
        self.transferred = 0
        """Bytes of data moved so far: received (C2HData) for a read; asked for by R2T, and so
        sent, for a write. The transport's bound on what a target may send or ask for."""
        self.status = 0
        self.dw0 = 0
        self.dw1 = 0
        self.on_done = on_done
        self.deadline = deadline
        """Event-loop time after which the controller's timeout sweep gives up on the command
        (the controller sets it when it sends the command; never, for one sent by hand)."""
        self.sent_ns = 0
        """``time.monotonic_ns()`` at the last send (0: never sent), where its latency counts
        from. Not the deadline less the timeout: uvloop's ``loop.time()`` is libuv's cached loop
        time in whole milliseconds, so latencies taken from it were 0 or 1 ms."""
        self.attempts = 0
        self.path_retry_until = 0.0
        """Event-loop time until which an I/O command answered Internal Path Error is sent again
        (``Controller._path_error``); 0 until the first such answer."""

    def __repr__(self) -> str:
        return f"HostCommand(opcode={SQE_FAST.as_dict(self.sqe)['opcode']:#x}, cid={self.cid}, status={self.status:#x})"

    @property
    def length(self) -> int:
        if self.data_out is not None:
            return len(self.data_out)
        if self.data_in is not None:
            return len(self.data_in)
        return 0

    @property
    def finished(self) -> bool:
        return self.on_done is None

    def count(self, counters: IoCounters, now_ns: int) -> None:
        """Count this completed I/O command in ``counters`` (blockd.iostats): its kind, its
        bytes, and its latency from the last send (``sent_ns``) to ``now_ns``, both
        ``time.monotonic_ns()``; a command that never went out counts 0 ns.
        Here rather than in the controller so that the compiled twin does it in C: it was
        ~5.6k of the ~50k instructions per 4 KiB FUSE read as Python."""
        elapsed_ns = now_ns - self.sent_ns if self.sent_ns and now_ns > self.sent_ns else 0
        data = self.data_in if self.data_in is not None else self.data_out
        counters.count(KIND_BY_OPCODE[self.sqe[SQE_OPCODE_OFFSET]], len(data) if data is not None else 0, elapsed_ns)

    def complete(self) -> None:
        """The target answered (with any status); runs ``on_done`` once."""
        done, self.on_done = self.on_done, None
        if done is not None:
            done(self, None)

    def fail(self, exc: BaseException) -> None:
        """The command will not complete; runs ``on_done`` once with ``exc``."""
        done, self.on_done = self.on_done, None
        if done is not None:
            done(self, exc)


class Command(HostCommand):
    """A command the controller sends: the caller's ``done`` (see ``initiator.controller.IoDone``)
    and the timeout it gets each time it goes out. Its ``on_done`` is the controller's one bound
    completion, not a partial made (and called through) per I/O."""

    __slots__ = ("done", "timeout")
    done: Callable[[BaseException | None], None]
    timeout: float
    admin = False
    """Sent on the admin queue (a class attribute: no store per I/O)."""


class AdminCommand(Command):
    __slots__ = ()
    admin = True


class HostQueue:
    """Command ids and in-flight commands of one queue (depth = the negotiated queue size)."""

    def __init__(self, qid: int, depth: int) -> None:
        self.qid = qid
        self.depth = depth
        self._free = collections.deque(range(depth))
        self.pending: dict[int, HostCommand] = {}

    @property
    def has_room(self) -> bool:
        return bool(self._free)

    def start(self, cmd: HostCommand) -> None:
        """Give ``cmd`` a command id and write it into the SQE."""
        cid = self._free.popleft()
        cmd.cid = cid
        _pack_cid_into(cmd.sqe, SQE_CID_OFFSET, cid)
        cmd.transferred = 0
        cmd.status = 0  # a transport may mark a failure (a read's bad data digest) before the completion
        self.pending[cid] = cmd

    def get(self, cid: int) -> HostCommand | None:
        """The command in flight under ``cid``, None for a free or unknown id."""
        return self.pending.get(cid)

    def finish(self, cid: int) -> HostCommand | None:
        """Forget ``cid``; returns its command, or None for an unknown/stale id."""
        cmd = self.pending.pop(cid, None)
        if cmd is None:
            return None
        self._free.append(cid)
        return cmd

    def expired(self, now: float) -> list[HostCommand]:
        """Commands in flight whose deadline has passed."""
        return [cmd for cmd in self.pending.values() if cmd.deadline <= now]

    def take_all(self) -> list[HostCommand]:
        """Everything still in flight (the connection died); the queue is empty afterwards."""
        cmds = [self.finish(cid) for cid in list(self.pending)]
        return [c for c in cmds if c is not None]
