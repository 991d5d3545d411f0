"""FUA and Flush seen where durability happens: ``fdatasync`` on the namespace's file, and the FUA
bit in the SQE the target receives from our host.

"No error and the data reads back" cannot tell a flushed write from one left in the page cache,
so these count the ``os.fdatasync`` calls per file descriptor (the file backend makes FUA and
Flush durable with it) and look at the commands as the target core gets them.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

import target.tcp
from initiator.controller import Controller
from protocol.constants import IoOpcode
from protocol.nvme import IO_COMMAND_FAST, IO_CONTROL, IO_NSID, IO_OPCODE, NSID_ALL, RW_CONTROL_FUA
from target.filter import BackendFilter
from target.queue import TargetQueue
from target.service import TargetService

from .conftest import NQN, SyncCounter, config, connect, free_port, ns, run, serving, sub

SIZE = 4 << 20


@contextlib.asynccontextmanager
async def two_namespaces(tmp_path: Path) -> AsyncIterator[tuple[TargetService, Controller]]:
    """A target exporting namespaces 1 and 2 (files), and our host connected to it."""
    port = free_port()
    cfg = config([port], [sub(namespaces=[ns(tmp_path / "a.img", 1, SIZE), ns(tmp_path / "b.img", 2, SIZE)])])
    async with serving(cfg) as service:
        host = await connect(port, nr_io_queues=1)
        try:
            yield service, host
        finally:
            await host.close()


def test_fua_write_is_synced_before_its_completion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    syncs = SyncCounter(monkeypatch)

    async def main() -> None:
        async with two_namespaces(tmp_path) as (service, host):
            await host.write(1, 0, b"\x01" * 4096)
            assert syncs.of(service, 1) == 0  # a plain write stays in the cache
            await host.write(1, 8, b"\x02" * 4096, fua=True)
            # the completion reached the host, so the sync ran before the target sent it
            assert syncs.of(service, 1) == 1
            assert syncs.of(service, 2) == 0

    run(main())


class NoNativeFua(BackendFilter):
    """A backend that cannot make one write durable: the controller must flush after it."""

    can_fua = False

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.events: list[str] = []

    async def write(self, offset: int, data: memoryview | bytes, fua: bool = False) -> None:
        self.events.append("write+fua" if fua else "write")
        await super().write(offset, data, fua)

    async def flush(self) -> None:
        self.events.append("flush")
        await super().flush()


def test_fua_without_native_fua_flushes_before_completion(tmp_path: Path) -> None:
    async def main() -> None:
        async with two_namespaces(tmp_path) as (service, host):
            namespace = service.target.subsystems[NQN].namespaces[1]
            backend = namespace.backend = NoNativeFua(namespace.backend)
            await host.write(1, 0, b"\x03" * 4096, fua=True)
            assert backend.events == ["write", "flush"]

    run(main())


def test_flush_syncs_its_namespace_and_nsid_all_syncs_every_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    syncs = SyncCounter(monkeypatch)

    async def main() -> None:
        async with two_namespaces(tmp_path) as (service, host):
            await host.flush(2)
            assert (syncs.of(service, 1), syncs.of(service, 2)) == (0, 1)
            await host.flush(NSID_ALL)
            assert (syncs.of(service, 1), syncs.of(service, 2)) == (1, 2)

    run(main())


def test_host_sets_fua_on_the_wire(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``write(fua=True)`` and ``write_bytes(fua=True)`` (split at max_transfer: every piece)
    send FUA; without it they do not."""
    writes: list[tuple[int, bool]] = []
    real_submit = TargetQueue.submit

    def recording(self: TargetQueue, sqe: bytes | memoryview, *args: Any, **kw: Any) -> None:
        fields = IO_COMMAND_FAST.unpack_from(sqe)
        if self.qid and fields[IO_OPCODE] == IoOpcode.WRITE:
            writes.append((fields[IO_NSID], bool(fields[IO_CONTROL] & RW_CONTROL_FUA)))
        real_submit(self, sqe, *args, **kw)
    monkeypatch.setattr(TargetQueue, "submit", recording)
    # every capsule to the Python queue, where it is recorded (the compiled path answers plain writes itself)
    monkeypatch.setattr(target.tcp, "TcpFastPath", None)

    async def main() -> None:
        async with two_namespaces(tmp_path) as (_, host):
            await host.write(1, 0, b"\x04" * 512, fua=True)
            await host.write(1, 0, b"\x05" * 512)
            assert writes == [(1, True), (1, False)]
            writes.clear()
            length = host.max_transfer + 4096  # two commands
            await host.write_bytes(2, 0, b"\x06" * length, fua=True)
            await host.write_bytes(2, 0, b"\x07" * length)
            assert writes == [(2, True), (2, True), (2, False), (2, False)]

    run(main())


class FailingFlush(BackendFilter):
    """A backend whose flush fails (fdatasync's EIO), recording what the target asked of it."""

    def __init__(self, inner: Any, fail: bool) -> None:
        super().__init__(inner)
        self.fail = fail
        self.events: list[str] = []

    async def flush(self) -> None:
        self.events.append("flush")
        if self.fail:
            raise OSError(5, "Input/output error")
        await super().flush()

    def close(self) -> None:
        self.events.append("close")
        super().close()


def test_a_failed_flush_at_stop_still_flushes_and_closes_the_others(tmp_path: Path) -> None:
    """The stop's flush of namespace 1 fails: namespace 2 is still flushed and closed, both files
    are closed, and the failure comes back (the daemon then exits 1)."""
    async def main() -> None:
        cfg = config([free_port()], [sub(namespaces=[ns(tmp_path / "a.img", 1, SIZE),
                                                     ns(tmp_path / "b.img", 2, SIZE)])])
        service = TargetService(cfg)
        await service.start()
        spaces = service.target.subsystems[NQN].namespaces
        one = spaces[1].backend = FailingFlush(spaces[1].backend, fail=True)
        two = spaces[2].backend = FailingFlush(spaces[2].backend, fail=False)
        failed = await service.stop()
        assert (one.events, two.events) == (["flush", "close"], ["flush", "close"])
        assert len(failed) == 1 and f"{NQN} namespace 1" in failed[0] and "Input/output error" in failed[0]

    run(main())
