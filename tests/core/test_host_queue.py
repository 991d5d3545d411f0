"""HostQueue is sans-I/O: command ids and in-flight bookkeeping, driven without an event loop.
Each test runs on the Python reference and, when built, on the compiled twin."""

from __future__ import annotations

import importlib
import subprocess
import sys
from types import ModuleType

import pytest

from protocol.commands import read_command


@pytest.fixture(params=["initiator.queue", "initiator._queue"])
def mod(request: pytest.FixtureRequest) -> ModuleType:
    try:
        return importlib.import_module(request.param)
    except ImportError:
        pytest.skip("compiled data plane not built")


def test_ids_are_written_into_the_sqe_and_reused(mod: ModuleType) -> None:
    HostCommand, HostQueue = mod.HostCommand, mod.HostQueue
    q = HostQueue(1, 2)
    a, b = HostCommand(read_command(1, 0, 0)), HostCommand(read_command(1, 1, 0))
    q.start(a)
    q.start(b)
    assert (a.cid, b.cid) == (0, 1)
    assert bytes(b.sqe[2:4]) == (1).to_bytes(2, "little")  # CID: SQE bytes 2-3 (CDW0 31:16)
    assert not q.has_room
    assert q.finish(0) is a and q.finish(0) is None  # a stale id is not found twice
    assert q.has_room
    c = HostCommand(read_command(1, 2, 0))
    q.start(c)
    assert c.cid == 0 and q.pending == {0: c, 1: b}


def test_cid_above_255_uses_both_bytes(mod: ModuleType) -> None:
    HostCommand, HostQueue = mod.HostCommand, mod.HostQueue
    q = HostQueue(1, 300)
    cmds = [HostCommand(read_command(1, i, 0)) for i in range(300)]
    for cmd in cmds:
        q.start(cmd)
    assert bytes(cmds[299].sqe[2:4]) == (299).to_bytes(2, "little")


def test_expired_and_take_all(mod: ModuleType) -> None:
    HostCommand, HostQueue = mod.HostCommand, mod.HostQueue
    q = HostQueue(0, 4)
    early, late = HostCommand(bytearray(64), deadline=1.0), HostCommand(bytearray(64), deadline=5.0)
    q.start(early)
    q.start(late)
    assert q.expired(2.0) == [early]
    assert q.take_all() == [early, late]
    assert not q.pending and q.has_room


def test_completion_runs_on_done_once(mod: ModuleType) -> None:
    HostCommand = mod.HostCommand
    seen = []
    cmd = HostCommand(bytearray(64), on_done=lambda c, exc: seen.append(exc))
    cmd.complete()
    cmd.fail(ConnectionError("late"))
    assert seen == [None] and cmd.finished


def test_queue_module_needs_no_event_loop() -> None:
    code = "import sys, initiator.queue; sys.exit('asyncio' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
