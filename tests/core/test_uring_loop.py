"""The target's queue thread on io_uring (``target/_uring_loop.pyx``, ``[target]
io_uring_queues``) against the same thread on its own system calls (``target/_tcp_thread.pyx``)
and against the loop alone: the same commands get the same statuses, SQHDs and data, leave the
same file and the same counts; at queue depth 1 each Read or Write costs one ``io_uring_enter``;
a chain whose file step fails is undone and answered by the Python queue as the other loops
answer it. Runs on this host's kernel (io_uring with linked, completion-skipping steps:
Linux 5.17 or later); ``CI=true`` turns a kernel without io_uring into a failure."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import struct
import tempfile
import threading
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

from protocol.constants import IoOpcode, SglId
from protocol.nvme import CQE_FAST, RW_CONTROL_FUA, build_sgl_data_block, build_sqe
from protocol.tcp import PduType
from target.io_fast import TcpUringPath, uring_queues

from .conftest import NQN, RawConn, capsule, config, fill_file, free_port, ns, raw_admin, run, serving, sub

pytestmark = pytest.mark.skipif(
    TcpUringPath is None, reason="the compiled data plane is not in use (BLOCKD_PURE=1 or not built)")

SIZE = 4 << 20
BLOCK = 512
MODES = {
    "ring": {"threaded_queues": True, "io_uring_queues": True},
    "ring+sqpoll": {"threaded_queues": True, "io_uring_queues": True, "io_uring_sqpoll": True,
                    "io_uring_sqpoll_idle_ms": 50, "io_uring_spin_us": 100},
    "ring+sqpoll+spin": {"threaded_queues": True, "io_uring_queues": True, "io_uring_sqpoll": True,
                         "io_uring_sqpoll_idle_ms": 50, "io_uring_spin_us": 10000},
    "thread": {"threaded_queues": True, "io_uring_queues": False},
    "loop": {"threaded_queues": False},
}
"""The ways a target serves a steady queue: what ``[target]`` says for each (the ring with a
kernel thread submitting and the queue thread's bounded spin, or without)."""


@pytest.fixture(autouse=True)
def _kernel_ring() -> None:
    works, reason = uring_queues(True)
    if not works:
        if os.environ.get("CI") == "true":
            pytest.fail(f"io_uring queue loop unavailable under CI: {reason}")
        pytest.skip(f"io_uring queue loop unavailable: {reason}")


def _read(cid: int, slba: int, blocks: int) -> bytes:
    return build_sqe(IoOpcode.READ, cid, nsid=1, dptr=build_sgl_data_block(
        SglId.TRANSPORT_DATA_BLOCK, 0, blocks * BLOCK), cdw10=slba, cdw12=blocks - 1)


def _write(cid: int, slba: int, length: int, nsid: int = 1, control: int = 0) -> bytes:
    return build_sqe(IoOpcode.WRITE, cid, nsid=nsid, dptr=build_sgl_data_block(
        SglId.DATA_BLOCK_OFFSET, 0, length), cdw10=slba, cdw12=(length // BLOCK - 1) | control << 16)


def _alternating(seed: int, count: int) -> list[tuple[bytes, bytes]]:
    """``count`` 4 KiB in-capsule Writes and Reads in turn (a write first), at random aligned
    places: the ring's steady case."""
    rng = random.Random(seed)
    slots = SIZE // 4096
    return [(_read(10 + i, rng.randrange(0, slots) * 8, 8), b"") if i % 2 else
            (_write(10 + i, rng.randrange(0, slots) * 8, 4096), rng.randbytes(4096)) for i in range(count)]


def _workload(seed: int, count: int) -> list[tuple[bytes, bytes]]:
    """``count`` capsules (SQE, in-capsule data): mostly Reads and in-capsule Writes of 0.5-32 KiB
    the ring serves, among them what it leaves to TcpServe or the loop (a read by reference, a
    FUA write, a Flush) and what the Python queue refuses (past the end, no such namespace)."""
    rng = random.Random(seed)
    blocks = SIZE // BLOCK
    out = []
    for i in range(count):
        cid = 10 + i
        n = rng.choice((1, 8, 8, 8, 16, 64))
        slba = rng.randrange(0, blocks - 256)
        kind = rng.random()
        if kind < 0.40:
            out.append((_read(cid, slba, n), b""))
        elif kind < 0.80:
            out.append((_write(cid, slba, n * BLOCK), rng.randbytes(n * BLOCK)))
        elif kind < 0.84:
            out.append((_read(cid, slba, 256), b""))  # 128 KiB: by reference
        elif kind < 0.88:
            out.append((_write(cid, slba, 4096, control=RW_CONTROL_FUA), rng.randbytes(4096)))
        elif kind < 0.92:
            out.append((build_sqe(IoOpcode.FLUSH, cid, nsid=1), b""))
        elif kind < 0.96:
            out.append((_read(cid, blocks - 4, 8), b""))  # past the end
        else:
            out.append((_write(cid, slba, 4096, nsid=7), rng.randbytes(4096)))
    return out


async def _answers(io: RawConn, count: int) -> dict[int, tuple[int, int, bytes]]:
    """The next ``count`` completions, by CID: (status, SQHD, C2H data)."""
    data: dict[int, bytes] = {}
    done: dict[int, tuple[int, int, bytes]] = {}
    while len(done) < count:
        pdu = await io.recv(10)
        assert pdu is not None, "connection closed instead of a completion"
        if pdu.ptype == PduType.C2H_DATA:
            cid = struct.unpack_from("<H", pdu.header, 8)[0]
            data[cid] = data.get(cid, b"") + pdu.data
            continue
        assert pdu.ptype == PduType.CAPSULE_RESP, pdu
        _dw0, _dw1, sqhd, _sqid, cid, status = CQE_FAST.unpack_from(pdu.header, 8)
        done[cid] = (status, sqhd, data.pop(cid, b""))
    return done


@contextlib.asynccontextmanager
async def _queue(tmp: Path, mode: str, nowait_only: bool = False) -> AsyncIterator[tuple[Any, RawConn, Any, Path]]:
    """A target in ``mode`` with one I/O queue, on its thread unless the mode is the loop's:
    (service, host, fast path, the namespace's file). The ring takes every Read and Write it may
    (``all_file_steps``: the tests' files are on whatever file system ``tmp`` is) unless
    ``nowait_only``."""
    tmp.mkdir()
    path = tmp / "vol.img"
    fill_file(path, SIZE)
    port = free_port()
    async with serving(config([port], [sub(namespaces=[ns(path, size=SIZE)])], target=MODES[mode])) as service:
        admin, cntlid = await raw_admin(port)
        io = await RawConn.open(port)
        await io.initialize()
        await io.connect_io(cntlid, 1)
        fast = service.target.controllers[cntlid].queues[1].transport.fast
        assert (type(fast) is TcpUringPath) == mode.startswith("ring")
        if mode.startswith("ring"):
            assert fast.sqpoll_idle_ms == (50 if mode.startswith("ring+sqpoll") else 0)
            fast.all_file_steps = not nowait_only
        io.send(capsule(_read(1, 0, 8)))  # answered on the loop: the queue goes to its thread after
        assert (await _answers(io, 1))[1][0] == 0
        for _ in range(200):
            if fast.threaded or mode == "loop":
                break
            await asyncio.sleep(0.01)
        assert fast.threaded or mode == "loop"
        try:
            yield service, io, fast, path
        finally:
            await io.close()
            await admin.close()


async def _run(tmp: Path, mode: str, work: list[tuple[bytes, bytes]], depth: int,
               truncate: int = 0, nowait_only: bool = False) -> dict[str, Any]:
    """``work`` on a target in ``mode``, ``depth`` capsules sent together at a time (each group
    answered before the next); ``truncate``: the namespace's file cut to that many bytes first (the
    namespace keeps its size, so reads past the cut come short)."""
    async with _queue(tmp, mode, nowait_only) as (service, io, fast, path):
        if truncate:
            os.truncate(path, truncate)
        names = [k for k in ("served", "thread_served", "ring_served", "ring_enters", "ring_chains", "ring_undone",
                             "ring_probes_refused")
                 if hasattr(fast, k)]
        before = {k: getattr(fast, k) for k in names}
        answers: dict[int, tuple[int, int, bytes]] = {}
        for at in range(0, len(work), depth):
            group = work[at:at + depth]
            io.send(b"".join(capsule(sqe, data) for sqe, data in group))
            answers.update(await _answers(io, len(group)))
        counters = service.target.subsystems[NQN].namespaces[1].counters.snapshot()
        stats = {k: getattr(fast, k) - before[k] for k in names}  # the work's own
    return {"answers": answers, "file": path.read_bytes(), "ops": counters["ops"], "bytes": counters["bytes"],
            "errors": counters["errors"], "stats": stats}


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Equal statuses and data by CID, equal SQHDs as a set (each is taken when its command
    completes, and the three complete the commands of a group in different orders: the loop's
    FUA writes and Flushes wait for the executor), equal file and counts."""
    assert sorted(got["answers"]) == sorted(want["answers"])
    for cid, (status, _, data) in want["answers"].items():
        assert got["answers"][cid][::2] == (status, data), cid
    assert sorted(a[1] for a in got["answers"].values()) == sorted(a[1] for a in want["answers"].values())
    assert got["file"] == want["file"]
    assert (got["ops"], got["bytes"], got["errors"]) == (want["ops"], want["bytes"], want["errors"])


@pytest.mark.parametrize("depth", [1, 8])
def test_the_ring_answers_as_the_thread_and_the_loop(tmp_path: Path, depth: int) -> None:
    """The same 160 commands, one at a time or eight per send: statuses, SQHDs, data, file and
    counts equal on the three; most went through the ring."""
    work = _workload(42, 160)
    ring = run(_run(tmp_path / "ring", "ring", work, depth), timeout=60)
    thread = run(_run(tmp_path / "thread", "thread", work, depth), timeout=60)
    loop = run(_run(tmp_path / "loop", "loop", work, depth), timeout=60)
    _same(ring, thread)
    _same(ring, loop)
    assert any(status for status, _, _ in ring["answers"].values())  # the refused ones are in it
    assert ring["stats"]["ring_served"] >= 80, ring["stats"]
    assert ring["stats"]["ring_undone"] == 0


def test_one_io_uring_enter_per_io_at_queue_depth_1(tmp_path: Path) -> None:
    """200 4 KiB Reads and Writes one at a time: each goes through the ring with one
    ``io_uring_enter`` (its read or write, its reply and the next receive in one chain); eight at a
    time, fewer than one each."""
    work = _alternating(7, 200)
    result = run(_run(tmp_path / "qd1", "ring", work, 1), timeout=60)
    assert all(status == 0 for status, _, _ in result["answers"].values())
    qd1 = result["stats"]
    assert qd1["ring_served"] == 200, qd1
    assert qd1["ring_enters"] <= 200 + 1, qd1  # (a signal's retry)
    qd8 = run(_run(tmp_path / "qd8", "ring", work, 8), timeout=60)["stats"]
    assert qd8["ring_served"] == 200, qd8
    assert qd8["ring_enters"] < 100, qd8


def test_a_failed_read_undoes_its_chain(tmp_path: Path) -> None:
    """The file cut short under a live namespace: a Read past the cut fails inside its chain,
    with Writes before and after it in the same chain. The chain is undone (SQHD, counts) and its
    commands answered by the Python queue: statuses, SQHDs, file and counts as the thread's and
    the loop's, where the same Read fails outside any chain."""
    cut = SIZE // 2
    rng = random.Random(3)
    work: list[tuple[bytes, bytes]] = []
    for i in range(0, 48, 4):
        low = rng.randrange(0, cut // BLOCK - 64)
        work += [(_write(10 + i, low, 4096), rng.randbytes(4096)),
                 (_read(11 + i, cut // BLOCK + rng.randrange(0, 64), 8), b""),  # past the cut
                 (_write(12 + i, low + 8, 4096), rng.randbytes(4096)),
                 (_read(13 + i, low, 16), b"")]
    ring = run(_run(tmp_path / "ring", "ring", work, 4, truncate=cut), timeout=60)
    thread = run(_run(tmp_path / "thread", "thread", work, 4, truncate=cut), timeout=60)
    loop = run(_run(tmp_path / "loop", "loop", work, 4, truncate=cut), timeout=60)
    _same(ring, thread)
    _same(ring, loop)
    assert all(ring["answers"][11 + i][0] != 0 for i in range(0, 48, 4))
    assert ring["stats"]["ring_undone"] >= 12, ring["stats"]


SHM = Path("/dev/shm")


@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm (tmpfs)")
def test_a_file_that_would_block_stays_off_the_ring(tmp_path: Path) -> None:
    """tmpfs takes neither reads nor writes with ``RWF_NOWAIT`` (io_uring would hand each to an
    io-wq thread): on a namespace there, the ring only sends and receives, TcpServe reads and
    writes, and each I/O still costs one ``io_uring_enter``; the answers are the thread's. The
    first write learns it on the ring (its ``RWF_NOWAIT`` write refused, its chain undone): the
    loop's queue writes that one."""
    work = _alternating(11, 100)
    with tempfile.TemporaryDirectory(dir=SHM) as shm:
        ring = run(_run(Path(shm) / "ring", "ring", work, 1, nowait_only=True), timeout=60)
        thread = run(_run(Path(shm) / "thread", "thread", work, 1), timeout=60)
    _same(ring, thread)
    stats = ring["stats"]
    assert stats["ring_served"] == 0 and stats["thread_served"] == 99 and stats["ring_undone"] == 1, stats
    assert stats["ring_probes_refused"] == 1, stats
    assert stats["ring_enters"] <= 100 + 1, stats


def _open_files() -> list[str]:
    """What this process's descriptors name (one listing's own descriptor is gone by its read)."""
    names = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):
            names.append(os.readlink(f"/proc/self/fd/{fd}"))
    return names


def _queue_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("blockd-tcp-q")]


@pytest.mark.parametrize("end", ["host closes", "target stops"])
def test_every_end_closes_the_ring(tmp_path: Path, end: str) -> None:
    """The thread that made the ring closes it when it leaves: after the host's close, or the
    target's stop with the queue idle on its thread (a ``recv`` pending in the ring), no queue
    thread and no descriptor (ring, socket, file) is left."""
    async def main() -> None:
        fds = len(os.listdir("/proc/self/fd"))
        async with _queue(tmp_path / "q", "ring") as (_service, io, fast, _path):
            for cid in range(10, 20):
                io.send(capsule(_write(cid, cid * 8, 4096), bytes([cid]) * 4096))
                assert (await _answers(io, 1))[cid][0] == 0
            assert fast.ring_served >= 10 and fast.threaded
            assert "anon_inode:[io_uring]" in _open_files()
            if end == "host closes":
                await io.close()
                deadline = asyncio.get_running_loop().time() + 10
                while _queue_threads() and asyncio.get_running_loop().time() < deadline:
                    await asyncio.sleep(0.01)
                assert _queue_threads() == []
        assert _queue_threads() == []
        assert len(os.listdir("/proc/self/fd")) == fds
    run(main(), timeout=60)


def _sqpoll_threads() -> list[str]:
    """The kernel's SQPOLL threads of this process: each is a task of it named ``iou-sqp-PID``."""
    names = []
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(FileNotFoundError):
            names.append(Path(f"/proc/self/task/{task}/comm").read_text().strip())
    return [n for n in names if n.startswith("iou-sqp-")]


@pytest.mark.parametrize("depth", [1, 8])
def test_the_ring_with_sqpoll_answers_as_the_thread(tmp_path: Path, depth: int) -> None:
    """``io_uring_sqpoll`` (with the bounded spin): the same 160 commands get the thread's
    statuses, SQHDs, data, file and counts; the ring took most of them, and a kernel SQPOLL
    thread ran beside the queue's. No more ``io_uring_enter`` calls than chains plus their waits
    (submitting costs one only when the SQPOLL thread has gone idle)."""
    works, reason = uring_queues(True, 50)
    if not works:
        pytest.fail(f"SQPOLL ring refused: {reason}") if os.environ.get("CI") == "true" else pytest.skip(reason)
    work = _workload(42, 160)
    seen: list[str] = []

    async def watch() -> None:
        while not seen:
            seen.extend(_sqpoll_threads())
            await asyncio.sleep(0.005)

    async def both() -> dict[str, Any]:
        watcher = asyncio.ensure_future(watch())
        try:
            return await _run(tmp_path / "ring", "ring+sqpoll", work, depth)
        finally:
            watcher.cancel()

    ring = run(both(), timeout=60)
    thread = run(_run(tmp_path / "thread", "thread", work, depth), timeout=60)
    _same(ring, thread)
    stats = ring["stats"]
    assert stats["ring_served"] >= 80 and stats["ring_undone"] == 0, stats
    assert stats["ring_enters"] <= 2 * stats["ring_chains"] + 1, stats
    assert seen, "no iou-sqp thread: the ring was made without SQPOLL"


def test_sqpoll_and_a_spin_longer_than_the_round_trip_make_no_system_call(tmp_path: Path) -> None:
    """SQPOLL submits each chain and the queue thread spins (up to 10 ms, longer than this
    process's host usually takes to send the next command): 200 4 KiB Reads and Writes one at a
    time cost fewer ``io_uring_enter`` calls than chains, where a wait in the kernel for each
    chain makes at least one each. A count, not a time, with room for the load of 2 shared CPUs:
    the two spinners (this thread, the SQPOLL thread) and the host's thread share them, and a
    round trip the scheduler stretches past the spin costs a wait (58-127 of 200 seen here)."""
    work = _alternating(5, 200)
    result = run(_run(tmp_path / "spin", "ring+sqpoll+spin", work, 1), timeout=60)
    assert all(status == 0 for status, _, _ in result["answers"].values())
    stats = result["stats"]
    assert stats["ring_served"] == 200, stats
    assert stats["ring_enters"] < 160, stats


@pytest.mark.parametrize("mode", ["ring", "ring+sqpoll"])
def test_a_ring_command_gives_its_namespace_back_once_answered(tmp_path: Path, mode: str) -> None:
    """A Read and a Write through the ring, each answered while the host then sends nothing:
    the namespace's hold (``in_flight``, which keeps a removed namespace's file open) is given
    back within the hold wait (10 ms), not when the host's next command comes (the chain's
    ``recv`` completion, which an idle host never brings)."""
    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with _queue(tmp_path / "q", mode) as (service, io, fast, _path):
            nsobj = service.target.subsystems[NQN].namespaces[1]
            for sqe, data in ((_read(20, 0, 8), b""), (_write(21, 8, 4096), bytes(range(256)) * 16)):
                served = fast.ring_served
                io.send(capsule(sqe, data))
                assert all(a[0] == 0 for a in (await _answers(io, 1)).values())
                assert fast.ring_served == served + 1
                deadline = loop.time() + 2
                while nsobj.in_flight and loop.time() < deadline:
                    await asyncio.sleep(0.005)
                assert nsobj.in_flight == 0
    run(main(), timeout=60)


def _write_calls(tid: int) -> int:
    """How many write system calls (``write``, ``pwrite64``, ``pwritev2``...) a thread of this
    process has made: ``syscw`` of its I/O accounting (io_uring's steps and sockets' ``sendmsg``
    are not among them)."""
    text = Path(f"/proc/self/task/{tid}/io").read_text()
    return int(text.split("syscw: ")[1].split()[0])


def test_the_nowait_probe_writes_the_first_write_once(tmp_path: Path) -> None:
    """The first write of a namespace learns whether its file takes writes with ``RWF_NOWAIT``
    by going on the ring with that flag: written there once, or refused (having written
    nothing; tmp_path's ext4 refuses buffered ones, 6.18) and written by the loop's queue. The
    queue thread makes no write system call for it: it used to write the bytes with a
    ``pwritev2(RWF_NOWAIT)`` probe and then again with TcpServe's ``pwrite`` (two calls; on a
    file that takes the probe, XFS within a timestamp tick, the bytes twice). The next write,
    the file known, is TcpServe's one ``pwrite`` (or the ring's); the data is in the file."""
    async def main() -> None:
        async with _queue(tmp_path / "q", "ring", nowait_only=True) as (_service, io, fast, path):
            (tid,) = [t.native_id for t in threading.enumerate() if t.name == "blockd-tcp-q1"]
            data = bytes(range(256)) * 16
            for cid, slba in ((30, 64), (31, 128)):
                calls, ring = _write_calls(tid), fast.ring_served
                io.send(capsule(_write(cid, slba, 4096), data))
                assert (await _answers(io, 1))[cid][0] == 0
                by_thread = _write_calls(tid) - calls
                assert by_thread == 0 if cid == 30 else by_thread + fast.ring_served - ring == 1
                with open(path, "rb") as f:
                    f.seek(slba * BLOCK)
                    assert f.read(4096) == data
    run(main(), timeout=60)


@pytest.mark.parametrize(("table", "needle"), [
    ({"io_uring_sqpoll": True}, "io_uring_sqpoll needs io_uring_queues"),
    ({"io_uring_queues": True, "io_uring_spin_us": 50}, "io_uring_spin_us needs io_uring_sqpoll"),
    ({"io_uring_queues": True, "io_uring_sqpoll": True, "io_uring_sqpoll_idle_ms": 0}, "1..10000"),
    ({"io_uring_queues": True, "io_uring_sqpoll": True, "io_uring_spin_us": -1}, "0..10000"),
    ({"io_uring_queues": True, "io_uring_sqpoll": "yes"}, "must be bool"),
])
def test_sqpoll_settings_are_checked(table: dict[str, Any], needle: str) -> None:
    """A SQPOLL setting without the one it refines, or out of range, is a one-line error naming it;
    the sample configuration's lines (the idle time beside SQPOLL off) load."""
    from target.config import ConfigError, parse

    with pytest.raises(ConfigError, match=needle):
        parse({"target": table}, "t.toml")
    assert parse({"target": {"io_uring_queues": True, "io_uring_sqpoll": True, "io_uring_spin_us": 20}}).io_uring_spin_us == 20
    sample = parse({"target": {"io_uring_queues": False, "io_uring_sqpoll": False, "io_uring_sqpoll_idle_ms": 10,
                               "io_uring_spin_us": 0}})
    assert not sample.io_uring_sqpoll and sample.io_uring_sqpoll_idle_ms == 10
