"""Commands in flight when the connection goes (the retry-after-reconnect promise
of docs/systemd.md).

Against a real ``blockd target`` stopped and started again on the same port and file, and
against a :class:`~tests.rawpeer.ScriptedTarget` that drops the connection at a chosen moment:
every command's ``done`` runs exactly once; acknowledged writes are in the file and are not sent
again; reads return acknowledged data; a command lost too often fails alone (the attempt limit);
a target gone for good fails everything after ``ctrl_loss_tmo`` and not before.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
import structlog

from initiator.association import MAX_ATTEMPTS
from initiator.controller import Controller, QueueLost
from protocol.constants import IoOpcode
from target.service import TargetService
from tests.rawpeer import IoCommand, ScriptedTarget, TargetConnection

from .conftest import config, fill_file, free_port, ns, params, run, sub, until
from .test_host_controller import Done
from .test_hostile_target import params as scripted_params

NSID = 1
BS = 512


def test_real_target_restarted_under_io_loses_and_repeats_nothing(tmp_path: Path) -> None:
    """64 writes and 64 reads in flight when the target stops; it starts again on the same
    port and file. Every command completes once, the writes are all in the file, the reads
    all return what had been acknowledged before them."""
    port = free_port()
    path = tmp_path / "vol.img"
    size = 16 << 20
    original = fill_file(path, size)
    cfg = config([port], [sub(namespaces=[ns(path, size=size)])])
    chunk = 64 << 10
    acked = random.Random(1).randbytes(64 * chunk)  # written, and acknowledged, before the drop
    fresh = [random.Random(100 + i).randbytes(chunk) for i in range(64)]
    write_base = 8 << 20

    async def main() -> None:
        service = TargetService(cfg)
        await service.start()
        ctrl = await Controller.connect(params(port, reconnect_delay=0.05, ctrl_loss_tmo=20))
        try:
            await ctrl.write_bytes(NSID, 0, acked)
            writes = [Done() for _ in fresh]
            reads = [Done() for _ in fresh]
            read_bufs = [bytearray(chunk) for _ in fresh]
            with structlog.testing.capture_logs() as logs:
                for i, data in enumerate(fresh):
                    ctrl.transfer(True, NSID, write_base + i * chunk, memoryview(data), writes[i])
                    ctrl.transfer(False, NSID, i * chunk, memoryview(read_bufs[i]), reads[i])
                await service.stop()
                service = TargetService(cfg)
                await service.start()
                await until(lambda: all(d.calls for d in writes + reads), timeout=20)
                await asyncio.sleep(0.05)  # time for a second completion that must not come
            retried = [e["retrying"] for e in logs if e["event"] == "reconnected"]
            assert retried and retried[0] > 0, ("nothing was in flight at the drop", retried)
            assert all(d.calls == [None] for d in writes + reads), [d.calls for d in writes + reads]
            assert all(bytes(buf) == acked[i * chunk:(i + 1) * chunk] for i, buf in enumerate(read_bufs))
            assert await ctrl.read_bytes(NSID, write_base, len(fresh) * chunk) == b"".join(fresh)
        finally:
            await ctrl.close()
            await service.stop()

    run(main(), timeout=60)
    data = path.read_bytes()
    assert data[:len(acked)] == acked
    assert data[write_base:write_base + len(fresh) * chunk] == b"".join(fresh)
    assert data[len(acked):write_base] == original[len(acked):write_base]


class DropAfter:
    """A script: hold the first ``hold`` I/O commands, execute the first ``answer`` of them,
    then drop the connection with the rest in flight; later connections are served correctly
    (with ``depth_after`` as the queue depth, so that the retries find less room). ``executed``
    counts how often each (opcode, LBA) reached the disk."""

    def __init__(self, hold: int, answer: int, depth_after: int) -> None:
        self.hold = hold
        self.answer = answer
        self.depth_after = depth_after
        self.held: list[IoCommand] = []
        self.dropped = False
        self.executed: dict[tuple[int, int], int] = {}

    async def run(self, conn: TargetConnection, cmd: IoCommand) -> None:
        self.executed[cmd.opcode, cmd.slba] = self.executed.get((cmd.opcode, cmd.slba), 0) + 1
        await conn.execute(cmd)

    async def __call__(self, conn: TargetConnection, cmd: IoCommand) -> None:
        if self.dropped:
            await self.run(conn, cmd)
            return
        self.held.append(cmd)
        if len(self.held) < self.hold:
            return
        for held in self.held[:self.answer]:
            await self.run(conn, held)
        self.dropped = True  # the answers leave before the close: the host reads them first
        conn.target.queue_depth = self.depth_after
        conn.close()


def test_dropped_connection_resends_only_what_was_not_acknowledged() -> None:
    """32 commands in flight (16 writes, 8 of them by R2T, and 16 reads); the target answers 12
    and drops the connection; after the reconnect the queue is 8 deep, so the 20 left wait
    their turn. Each completes once, each acknowledged write reached the disk exactly once."""
    script = DropAfter(hold=32, answer=12, depth_after=8)
    target = ScriptedTarget(size=4 << 20, queue_depth=32, inline=8192, script=script)
    target.disk[:] = random.Random(3).randbytes(len(target.disk))
    before = bytes(target.disk)
    writes = [random.Random(i).randbytes(4096 if i % 2 else 16384) for i in range(16)]
    write_lba = [2048 + 64 * i for i in range(16)]
    reads = [bytearray(4096) for _ in range(16)]
    read_lba = [64 * i for i in range(16)]
    dones = [Done() for _ in range(32)]

    async def main() -> None:
        async with target:
            ctrl = await Controller.connect(scripted_params(target.port, queue_size=64))
            try:
                for i in range(16):
                    ctrl.transfer(True, NSID, write_lba[i] * BS, memoryview(writes[i]), dones[2 * i])
                    ctrl.transfer(False, NSID, read_lba[i] * BS, memoryview(reads[i]), dones[2 * i + 1])
                await until(lambda: all(d.calls for d in dones), timeout=10)
                await asyncio.sleep(0.05)
            finally:
                await ctrl.close()
        assert not target.errors, target.errors

    run(main(), timeout=30)
    assert script.dropped and target.connects == [0, 1, 0, 1]
    assert all(d.calls == [None] for d in dones), [d.calls for d in dones]
    for i in range(16):
        start = write_lba[i] * BS
        assert bytes(target.disk[start:start + len(writes[i])]) == writes[i]
        assert script.executed[IoOpcode.WRITE, write_lba[i]] == 1, "a write reached the disk twice, or never"
        assert bytes(reads[i]) == before[read_lba[i] * BS:read_lba[i] * BS + 4096]


def test_attempt_limit_fails_the_command_lost_too_often() -> None:
    """The target drops the connection whenever it sees a write to one LBA: that write is sent
    ``MAX_ATTEMPTS + 1`` times, then fails alone with QueueLost; the association lives on."""
    poison = 100
    seen: list[int] = []

    async def script(conn: TargetConnection, cmd: IoCommand) -> None:
        seen.append(cmd.slba)
        if cmd.slba == poison:
            conn.close()
        else:
            await conn.execute(cmd)

    target = ScriptedTarget(script=script)

    async def main() -> None:
        async with target:
            ctrl = await Controller.connect(scripted_params(target.port))
            try:
                done = Done()
                ctrl.transfer(True, NSID, poison * BS, memoryview(b"\x11" * BS), done)
                await until(lambda: done.calls, timeout=10)
                assert len(done.calls) == 1 and isinstance(done.calls[0], QueueLost), done.calls
                await ctrl.write(NSID, 7, b"\x22" * BS)  # the association is fine
                assert ctrl.state == "live"
            finally:
                await ctrl.close()
        assert not target.errors, target.errors

    run(main(), timeout=30)
    assert seen.count(poison) == MAX_ATTEMPTS + 1
    assert target.disk[7 * BS:8 * BS] == b"\x22" * BS and target.disk[poison * BS] == 0


def test_target_gone_for_good_fails_everything_after_ctrl_loss_tmo() -> None:
    """Commands in flight and one sent while reconnecting fail once with QueueLost, no sooner
    than ``ctrl_loss_tmo``; the controller is then failed and refuses new work at once."""
    tmo = 0.5
    held: list[IoCommand] = []

    async def script(conn: TargetConnection, cmd: IoCommand) -> None:
        held.append(cmd)  # never answered

    target = ScriptedTarget(script=script)

    async def main() -> None:
        async with target:
            ctrl = await Controller.connect(scripted_params(target.port, ctrl_loss_tmo=tmo, reconnect_delay=0.05))
            try:
                dones = [Done() for _ in range(8)]
                for i, done in enumerate(dones):
                    ctrl.transfer(False, NSID, i * BS, memoryview(bytearray(BS)), done)
                await until(lambda: len(held) == 8)
                await target.stop()
                lost = time.monotonic()
                await until(lambda: ctrl.state == "reconnecting")
                late = Done()
                ctrl.transfer(True, NSID, 0, memoryview(bytes(BS)), late)
                await until(lambda: all(d.calls for d in dones + [late]), timeout=5)
                elapsed = time.monotonic() - lost
                assert elapsed >= tmo - 0.05, elapsed
                await asyncio.sleep(0.05)
                for done in dones + [late]:
                    assert len(done.calls) == 1 and isinstance(done.calls[0], QueueLost), done.calls
                assert ctrl.state == "failed"
                after = Done()
                ctrl.transfer(False, NSID, 0, memoryview(bytearray(BS)), after)
                assert len(after.calls) == 1 and isinstance(after.calls[0], QueueLost)
            finally:
                await ctrl.close()

    run(main(), timeout=30)
