"""Replication on loopback with real daemons: a primary `blockd target` whose namespace has two
replicas, each another `blockd target` process exporting a plain namespace. Killed with
SIGKILL under a write load, restarted, split, verified: the copies' data areas are compared as
files at the end of each test (sha256 of the bytes the namespace exports)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from initiator.errors import NvmeError
from protocol.status import Status

from tests.core.conftest import until

from .nodes import BIN, DATA, HOSTNQN, NQN, REGION, Node, all_in_sync, block_of, connect, load


async def longest_stall(acked: list[int], stop: asyncio.Event) -> float:
    """The longest time ``acked`` went without growing, until ``stop``."""
    loop = asyncio.get_running_loop()
    seen, since, longest = len(acked), loop.time(), 0.0
    while not stop.is_set():
        await asyncio.sleep(0.01)
        now = loop.time()
        if len(acked) != seen:
            seen, since = len(acked), now
        longest = max(longest, now - since)
    return longest


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[tuple[Node, Node, Node]]:
    primary, r1, r2 = Node(tmp_path, "primary"), Node(tmp_path, "r1"), Node(tmp_path, "r2")
    try:
        r1.start()
        r2.start()
        primary.start([r1, r2])
        yield primary, r1, r2
    finally:
        for n in (primary, r1, r2):
            n.stop()


def test_write_and_read_back_through_blockctl_and_the_fuse_mount(nodes: tuple[Node, Node, Node], tmp_path: Path) -> None:
    primary, r1, r2 = nodes
    primary.wait_states(all_in_sync())
    text = primary.ctl("replicas").stdout.decode()
    assert "primary, 3 of 3 copies in sync" in text and text.count(" in_sync ") == 2
    sock = tmp_path / "ctl" / "initiator.sock"
    ini = subprocess.Popen([str(BIN / "blockd"), "initiator", "--socket", str(sock)],
                           stdout=subprocess.DEVNULL, stderr=open(tmp_path / "initiator.log", "wb"))
    try:
        deadline = time.monotonic() + 15
        while not sock.exists():
            assert ini.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)

        def ctl(*args: str) -> bytes:
            res = subprocess.run([str(BIN / "blockctl"), "--socket", str(sock), *args], capture_output=True, timeout=60)
            assert res.returncode == 0, (args, res.stderr.decode())
            return res.stdout
        ctl("connect", "-t", "tcp", "-a", "127.0.0.1", "-s", str(primary.port), "-n", NQN, "-q", HOSTNQN,
            "--name", "m")
        assert f"nsid 1: {DATA} bytes" in ctl("list").decode()  # the data area, not the device
        pattern = os.urandom(3 << 20)
        (tmp_path / "p.bin").write_bytes(pattern)
        ctl("write", "m", "--nsid", "1", "--offset", "65536", "-i", str(tmp_path / "p.bin"))
        assert ctl("read", "m", "--offset", "65536", "--length", str(len(pattern))) == pattern
        mnt = tmp_path / "mnt"  # and through the FUSE mount, an unaligned write made durable by fsync
        mnt.mkdir()
        ctl("mount", "m", str(mnt))
        try:
            fd = os.open(mnt / "ns1", os.O_RDWR)
            try:
                assert os.pwrite(fd, b"through fuse", 4 << 20 | 7) == 12
                os.fsync(fd)
                assert os.pread(fd, 12, 4 << 20 | 7) == b"through fuse"
            finally:
                os.close(fd)
        finally:
            ctl("umount", str(mnt))
        ctl("disconnect", "m")
    finally:
        ini.send_signal(signal.SIGTERM)
        ini.wait(15)
    for node in (r1, r2):  # on every copy as soon as acknowledged: no resync involved
        with open(node.file, "rb") as f:
            f.seek(65536)
            assert f.read(len(pattern)) == pattern
            f.seek(4 << 20 | 7)
            assert f.read(12) == b"through fuse"
    assert primary.data_hash() == r1.data_hash() == r2.data_hash()


def test_replica_killed_under_load_gets_only_the_dirty_regions(nodes: tuple[Node, Node, Node]) -> None:
    primary, r1, r2 = nodes
    primary.wait_states(all_in_sync(settled=True), timeout=40)
    base = primary.replicas()[1]["resynced_bytes"]
    written = sorted({r * 16 + 3 for r in range(3, 13)})  # 4 KiB blocks in 10 regions of 16 blocks

    async def main() -> tuple[list[int], list[BaseException]]:
        ctrl = await connect(primary)
        stop, acked, errors = asyncio.Event(), [], []
        task = asyncio.get_running_loop().create_task(load(ctrl, written, stop, acked, errors))
        await until(lambda: len(acked) >= 20 or bool(errors), 20)  # under way
        r2.kill()
        # the primary has left r2 behind (the poll runs in a thread: the load goes on meanwhile)
        await asyncio.to_thread(primary.wait_states, lambda reps: reps[1]["state"] in ("degraded", "connecting"))
        before = len(acked)
        await until(lambda: len(acked) > before + 50 or bool(errors), 20)  # the load goes on without it
        stop.set()
        await task
        await ctrl.close()
        return acked, errors

    acked, errors = asyncio.run(main())
    assert not errors, errors
    reps = primary.replicas()
    assert reps[0]["state"] == "in_sync" and reps[1]["state"] in ("degraded", "connecting"), reps
    r2.start()
    reps = primary.wait_states(all_in_sync(), timeout=40)
    copied = reps[1]["resynced_bytes"] - base
    assert 0 < copied <= 10 * REGION, copied  # the 10 written regions at most, not the volume
    assert primary.data_hash() == r1.data_hash() == r2.data_hash()


def test_primary_killed_under_load_loses_no_acknowledged_write(nodes: tuple[Node, Node, Node]) -> None:
    primary, r1, r2 = nodes
    primary.wait_states(all_in_sync())
    blocks = list(range(DATA // 4096))

    async def main() -> list[int]:
        ctrl = await connect(primary)
        stop, acked, errors = asyncio.Event(), [], []
        task = asyncio.get_running_loop().create_task(load(ctrl, blocks, stop, acked, errors, depth=16, once=True))
        while len(acked) < len(blocks) // 3:  # mid-load, whatever the machine's speed
            await asyncio.sleep(0.005)
        primary.kill()
        await asyncio.wait_for(task, 20)  # every worker ends with the connection's loss
        await ctrl.close()
        assert errors, "the load never noticed the primary's death"
        return acked

    acked = asyncio.run(main())
    assert len(acked) > 100 and len(acked) < len(blocks)
    primary.start([r1, r2])
    primary.wait_states(all_in_sync(), timeout=40)
    for node in (primary, r1, r2):
        with open(node.file, "rb") as f:
            for seq in acked:
                f.seek(blocks[seq] * 4096)
                assert f.read(4096) == block_of(seq), (node.name, seq)
    assert primary.data_hash() == r1.data_hash() == r2.data_hash()


@pytest.mark.parametrize("discard", ["replica", "local"])
def test_split_brain_is_detected_kept_apart_and_resolved(tmp_path: Path, discard: str) -> None:
    a, b = Node(tmp_path, "a"), Node(tmp_path, "b")
    try:
        b.start()
        a.start([b])
        a.wait_states(all_in_sync(settled=True))

        async def write(node: Node, offset: int, data: bytes) -> None:
            ctrl = await connect(node)
            await ctrl.write_bytes(1, offset, data)
            await ctrl.close()

        b.stop()  # apart: A goes on alone
        asyncio.run(write(a, 0, b"A" * 4096))
        a.stop()
        b.start([a])  # B promoted, its replica (A) away: a primary of its own
        asyncio.run(write(b, REGION, b"B" * 4096))
        b.stop()
        b.start()  # back to a plain replica; A primary again
        a.start([b])
        reps = a.wait_states(lambda reps: reps[0]["state"] == "split_brain")
        assert "split brain" in reps[0]["reason"]
        assert "split_brain" in a.ctl("replicas").stdout.decode()
        with open(b.file, "rb") as f:  # nothing overwritten
            f.seek(REGION)
            assert f.read(4096) == b"B" * 4096
        res = a.ctl("resolve", NQN, "1", "0", "--discard", discard)
        assert res.returncode == 0, res.stderr.decode()
        a.wait_states(all_in_sync())
        assert a.data_hash() == b.data_hash()
        kept, lost = (b"A", b"B") if discard == "replica" else (b"B", b"A")
        with open(a.file, "rb") as f:  # the side kept has its write, the other side's is gone
            block = f.read(REGION + 4096)
        assert (block[:4096] == b"A" * 4096) == (kept == b"A")
        assert (block[REGION:] == b"B" * 4096) == (kept == b"B"), lost
    finally:
        a.stop()
        b.stop()


def test_verify_finds_a_flipped_byte_and_resync_mends_it(nodes: tuple[Node, Node, Node]) -> None:
    primary, r1, r2 = nodes
    primary.wait_states(all_in_sync())

    async def fill() -> None:
        ctrl = await connect(primary)
        await ctrl.write_bytes(1, 0, os.urandom(DATA))
        await ctrl.close()
    asyncio.run(fill())
    offset = 37 * REGION + 1234
    fd = os.open(r1.file, os.O_RDWR)
    try:
        old = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([old[0] ^ 0x40]), offset)
    finally:
        os.close(fd)
    res = primary.ctl("verify", NQN, "1", "--json")
    assert res.returncode == 1, res.stderr.decode()  # differences found
    reply = {r["replica"]: r["mismatched"] for r in json.loads(res.stdout)["replicas"]}
    assert sorted(len(m) for m in reply.values()) == [0, 1]
    assert [m["region"] for ms in reply.values() for m in ms] == [37]
    primary.wait_states(all_in_sync())
    assert primary.data_hash() == r1.data_hash() == r2.data_hash()
    res = primary.ctl("verify", NQN, "1")
    assert res.returncode == 0 and "0 differ" in res.stdout.decode()


def test_a_replica_that_stops_answering_is_left_behind_after_its_timeout(nodes: tuple[Node, Node, Node]) -> None:
    primary, r1, r2 = nodes
    primary.wait_states(all_in_sync())
    written = list(range(0, DATA // 4096, 37))

    async def main() -> float:
        ctrl = await connect(primary)
        stop, acked, errors = asyncio.Event(), [], []
        task = asyncio.get_running_loop().create_task(load(ctrl, written, stop, acked, errors))
        stall = asyncio.get_running_loop().create_task(longest_stall(acked, stop))
        await until(lambda: len(acked) >= 20 or bool(errors), 20)  # under way
        assert r1.proc is not None
        r1.proc.send_signal(signal.SIGSTOP)  # alive, connected, silent
        try:
            # r1 (index 0) goes degraded once its 2 s timeout passes (polled from a thread)
            await asyncio.to_thread(primary.wait_states, lambda reps: reps[0]["state"] == "degraded", 20)
            before = len(acked)
            await until(lambda: len(acked) > before + 50 or bool(errors), 20)  # writes go on without it
        finally:
            r1.proc.send_signal(signal.SIGCONT)
        stop.set()
        await task
        await ctrl.close()
        assert not errors, errors
        return await stall

    longest = asyncio.run(main())
    # the writes in flight when r1 went silent waited out its timeout once (2 s), not once each
    assert longest < 2.0 + 3.0, f"host writes stalled {longest:.1f} s"
    assert [r["state"] for r in primary.replicas()][1] == "in_sync"
    primary.wait_states(all_in_sync(), timeout=40)
    assert primary.data_hash() == r1.data_hash() == r2.data_hash()


def test_too_few_copies_fail_the_write_with_namespace_not_ready(tmp_path: Path) -> None:
    primary, away = Node(tmp_path, "primary"), Node(tmp_path, "away")  # "away" never starts
    try:
        primary.start([away], min_in_sync=2)

        async def main() -> None:
            ctrl = await connect(primary)
            try:
                with pytest.raises(NvmeError) as err:
                    await ctrl.write_bytes(1, 0, bytes(4096))
                assert err.value.status == Status.NS_NOT_READY
                assert (await ctrl.read_bytes(1, 0, 4096)) == bytes(4096)  # reads go on
            finally:
                await ctrl.close()
        asyncio.run(main())
    finally:
        primary.stop()
