"""The target's threaded NVMe/TCP queue (target/_tcp_thread.pyx, ``TcpFastPath._run``): an idle I/O
queue goes to a thread of its own, which serves steady Reads and Writes blocking in the socket
(R2T writes: test_tcp_thread_r2t.py) and hands everything else back to the loop; every way a
connection ends leaves no thread and no descriptor behind, and a host that stops reading its
replies holds only its own queue.

(The answers themselves are compared with the Python queue's in test_io_fast.py's differential
test, in both modes.)"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

from protocol.constants import IoOpcode, SglId
from protocol.nvme import CQE_FAST, NSID_ALL, RW_CONTROL_FUA, build_sgl_data_block, build_sqe
from protocol.tcp import PduType
from target.io_fast import TcpFastPath

from .conftest import (NQN, RawConn, SyncCounter, capsule, config, fill_file, free_port, ns, raw_admin, run, serving,
                       sub)

pytestmark = pytest.mark.skipif(
    TcpFastPath is None, reason="the compiled data plane is not in use (BLOCKD_PURE=1 or not built)")

SIZE = 4 << 20


def _read(cid: int, slba: int = 0, blocks: int = 8) -> bytes:
    return build_sqe(IoOpcode.READ, cid, nsid=1, dptr=build_sgl_data_block(
        SglId.TRANSPORT_DATA_BLOCK, 0, blocks * 512), cdw10=slba, cdw12=blocks - 1)


def _write(cid: int, slba: int, length: int, nsid: int = 1, control: int = 0) -> bytes:
    return build_sqe(IoOpcode.WRITE, cid, nsid=nsid, dptr=build_sgl_data_block(
        SglId.DATA_BLOCK_OFFSET, 0, length), cdw10=slba, cdw12=(length // 512 - 1) | control << 16)


def _queue_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("blockd-tcp-q")]


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _cfg(tmp: Path, port: int, **target: Any) -> Any:
    """One namespace of ``SIZE`` bytes; threaded queues on unless ``target`` says otherwise."""
    path = tmp / "vol.img"
    fill_file(path, SIZE)
    return config([port], [sub(namespaces=[ns(path, size=SIZE)])], target={"threaded_queues": True, **target})


async def _io_queue(port: int, cntlid: int, qid: int = 1) -> RawConn:
    io = await RawConn.open(port)
    await io.initialize()
    await io.connect_io(cntlid, qid)
    return io


async def _threaded(service: Any, cntlid: int, io: RawConn, qid: int = 1) -> Any:
    """Make queue ``qid`` idle on its thread (one read answered on the loop gives it the socket)."""
    fast = service.target.controllers[cntlid].queues[qid].transport.fast
    status, *_ = await io.command(_read(1))
    assert status == 0
    for _ in range(100):
        if fast.threaded:
            return fast
        await asyncio.sleep(0.01)
    raise AssertionError("the queue did not go to its thread")


@contextlib.asynccontextmanager
async def _on_thread(tmp: Path) -> AsyncIterator[tuple[Any, RawConn, Any]]:
    """A target with threaded queues and one I/O queue on its thread: (service, host, fast path)."""
    port = free_port()
    async with serving(_cfg(tmp, port)) as service:
        admin, cntlid = await raw_admin(port)
        io = await _io_queue(port, cntlid)
        try:
            yield service, io, await _threaded(service, cntlid, io)
        finally:
            await io.close()
            await admin.close()


@contextlib.asynccontextmanager
async def _one_queue(tmp_path: Path, threaded: bool) -> AsyncIterator[tuple[Any, RawConn, Any]]:
    """A target with one I/O queue, idle on its thread or (``threaded`` false) served by the
    loop alone: (service, host, fast path)."""
    port = free_port()
    tmp_path.mkdir()
    async with serving(_cfg(tmp_path, port, threaded_queues=threaded)) as service:
        admin, cntlid = await raw_admin(port)
        io = await _io_queue(port, cntlid)
        try:
            yield service, io, (await _threaded(service, cntlid, io) if threaded else
                                service.target.controllers[cntlid].queues[1].transport.fast)
        finally:
            await io.close()
            await admin.close()


def test_a_queue_goes_to_its_thread_and_back(tmp_path: Path) -> None:
    """Reads and in-capsule writes are served on the thread; a Flush of every namespace (not
    served there) goes back to the loop and the Python queue, after which the queue is on its
    thread again; the data written on the thread reads back."""
    async def main() -> None:
        async with _on_thread(tmp_path) as (service, io, fast):
            served = fast.thread_served
            for cid in range(2, 12):
                status, _, got, data = await io.command(_write(cid, cid * 8, 4096), bytes([cid]) * 4096)
                assert (status, got) == (0, cid)
                status, _, got, data = await io.command(_read(cid + 100, cid * 8))
                assert (status, got, data) == (0, cid + 100, bytes([cid]) * 4096)
            assert fast.thread_served == served + 20, (fast.thread_served, served, fast.thread_entries, fast.served)
            entries = fast.thread_entries
            status, _, got, _ = await io.command(build_sqe(IoOpcode.FLUSH, 50, nsid=NSID_ALL))
            assert (status, got) == (0, 50)
            status, *_ = await io.command(_read(51))
            assert status == 0
            for _ in range(100):
                if fast.threaded and fast.thread_entries > entries:
                    break
                await asyncio.sleep(0.01)
            assert fast.threaded and fast.thread_entries > entries  # back on the thread after the Flush
            assert [t.name for t in _queue_threads()] == ["blockd-tcp-q1"]

    run(main(), timeout=30)


FLUSHES = {
    "one namespace": build_sqe(IoOpcode.FLUSH, 60, nsid=1),
    "every namespace": build_sqe(IoOpcode.FLUSH, 61, nsid=NSID_ALL),
    "no such namespace": build_sqe(IoOpcode.FLUSH, 62, nsid=7),
    "with a data length": build_sqe(IoOpcode.FLUSH, 63, nsid=1, dptr=build_sgl_data_block(
        SglId.TRANSPORT_DATA_BLOCK, 0, 4096)),
    "not an SGL": build_sqe(IoOpcode.FLUSH, 64, nsid=1, flags=0),
}
"""Flush capsules, of which the queue's thread serves the first alone."""


async def _flushes(tmp: Path, threaded: bool) -> tuple[dict[str, int], int, int, int]:
    """Each of ``FLUSHES`` on a queue on its thread or on the loop: the statuses, the commands
    the thread served, its entries after the first (0: it never handed the socket back before
    the others), and the flushes the namespace counted."""
    async with _one_queue(tmp, threaded) as (service, io, fast):
        served, entries = fast.thread_served, fast.thread_entries
        statuses = {}
        for name, sqe in FLUSHES.items():
            statuses[name], *_ = await io.command(sqe)
            if name == "one namespace":
                first = (fast.thread_served - served, fast.thread_entries - entries)
        counters = service.target.subsystems[NQN].namespaces[1].counters.snapshot()
        return statuses, *first, counters["ops"]["flush"]


def test_a_flush_is_served_on_the_thread_as_the_loop_answers_it(tmp_path: Path) -> None:
    """A Flush of one namespace is served on the queue's thread (``fdatasync`` there, the
    socket never handed back); every other Flush goes to the loop. Each gets the status the
    loop-only target gives it, and the namespace counts the same flushes."""
    on_loop, _, _, loop_flushes = run(_flushes(tmp_path / "loop", False), timeout=30)
    on_thread, served, entries, thread_flushes = run(_flushes(tmp_path / "thread", True), timeout=30)
    assert on_thread == on_loop, (on_thread, on_loop)
    assert on_loop["one namespace"] == on_loop["every namespace"] == 0
    assert all(on_loop[name] for name in ("no such namespace", "with a data length", "not an SGL")), on_loop
    assert (served, entries) == (1, 0)
    assert thread_flushes == loop_flushes == 1


FUA_WRITES = {
    "in the capsule": (_write(70, 16, 4096, control=RW_CONTROL_FUA), b"\x70" * 4096),
    "past the namespace": (_write(71, SIZE // 512 - 4, 4096, control=RW_CONTROL_FUA), b"\x71" * 4096),
    "no such namespace": (_write(72, 0, 4096, nsid=7, control=RW_CONTROL_FUA), b"\x72" * 4096),
}
"""FUA Write capsules, of which the queue's thread serves the first alone."""


async def _fua_writes(tmp: Path, threaded: bool, monkeypatch: pytest.MonkeyPatch,
                      sync_fails: bool) -> tuple[dict[str, int], int, int, int, bytes]:
    """Each of ``FUA_WRITES`` on a queue on its thread or on the loop (every ``fdatasync``
    failing with EIO when ``sync_fails``): the statuses, the commands the compiled path served
    (on the thread or the loop) and the thread's entries after the first, the namespace file's
    syncs, and what its file holds where the first wrote."""
    syncs = SyncCounter(monkeypatch, fail=OSError(errno.EIO, "injected") if sync_fails else None)
    async with _one_queue(tmp, threaded) as (service, io, fast):
        served, entries = fast.served, fast.thread_entries
        statuses = {}
        for name, (sqe, data) in FUA_WRITES.items():
            statuses[name], *_ = await io.command(sqe, data)
            if name == "in the capsule":
                first = (fast.served - served, fast.thread_entries - entries)
        synced = syncs.of(service, 1)
        monkeypatch.undo()  # the target's own sync when it stops is not counted (nor failed)
        return statuses, *first, synced, (tmp / "vol.img").read_bytes()[16 * 512:16 * 512 + 4096]


@pytest.mark.parametrize("sync_fails", [False, True])
def test_a_fua_write_in_the_capsule_is_synced_on_the_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           sync_fails: bool) -> None:
    """A FUA Write with its data in the capsule is written and synced (``fdatasync``, before its
    answer) on the queue's thread, the socket never handed back; the others go to the loop and
    get the status the loop-only target gives them. A sync that fails is the loop's to report:
    its queue writes and syncs again, and answers as the loop-only target does."""
    on_loop, loop_served, _, loop_syncs, loop_data = run(
        _fua_writes(tmp_path / "loop", False, monkeypatch, sync_fails), timeout=30)
    assert loop_served == 0  # on the loop, the Python queue's: its fdatasync runs in the executor
    on_thread, served, entries, thread_syncs, thread_data = run(
        _fua_writes(tmp_path / "thread", True, monkeypatch, sync_fails), timeout=30)
    assert on_thread == on_loop, (on_thread, on_loop)
    assert thread_data == loop_data == b"\x70" * 4096
    assert all(on_loop[name] for name in ("past the namespace", "no such namespace")), on_loop
    if sync_fails:
        assert on_loop["in the capsule"], on_loop  # a Write Fault, not a success
        assert served == 0  # handed back, not answered on the thread
        assert (loop_syncs, thread_syncs) == (1, 2)  # the thread's sync, then the queue's
    else:
        assert on_loop["in the capsule"] == 0
        assert (served, entries) == (1, 0)
        assert thread_syncs == loop_syncs == 1


@pytest.mark.parametrize(("table", "threaded"), [({"threaded_queues": False}, False), ({}, True)],
                         ids=["off", "default"])
def test_the_switch(tmp_path: Path, table: dict[str, Any], threaded: bool) -> None:
    """``[target] threaded_queues = false`` keeps every queue on the loop; the default (true)
    gives an idle I/O queue its thread."""
    port = free_port()
    path = tmp_path / "vol.img"
    fill_file(path, SIZE)

    async def main() -> None:
        async with serving(config([port], [sub(namespaces=[ns(path, size=SIZE)])], target=table)) as service:
            admin, cntlid = await raw_admin(port)
            io = await _io_queue(port, cntlid)
            for cid in range(1, 6):
                status, *_ = await io.command(_read(cid))
                assert status == 0
            fast = service.target.controllers[cntlid].queues[1].transport.fast
            if threaded:
                assert await _threaded(service, cntlid, io) is fast and fast.thread_entries >= 1
                assert [t.name for t in _queue_threads()] == ["blockd-tcp-q1"]
            else:
                assert fast.served == 5 and not fast.threaded and fast.thread_entries == 0
                assert not _queue_threads()
            await io.close()
            await admin.close()

    run(main(), timeout=30)


@pytest.mark.parametrize("end", ["host disconnects", "controller deleted", "pdu timeout", "daemon stop"])
def test_every_end_leaves_no_thread_and_no_descriptor(tmp_path: Path, end: str) -> None:
    """The host closes, the controller is torn down (as at KATO expiry), the host stops in the
    middle of a capsule (the PDU timeout), or the daemon stops, all while the queue's thread
    waits in ``recv``: its thread ends and its descriptor is closed."""
    port = free_port()
    before = _fds()

    async def main() -> None:
        async with serving(_cfg(tmp_path, port, hello_timeout=0.5, pdu_timeout=0.3)) as service:
            admin, cntlid = await raw_admin(port)
            io = await _io_queue(port, cntlid)
            await _threaded(service, cntlid, io)
            assert len(_queue_threads()) == 1
            conn = service.target.controllers[cntlid].queues[1].transport
            if end == "host disconnects":
                await io.close()
            elif end == "controller deleted":
                service.target.controllers[cntlid].shutdown("keep-alive timeout")
                assert await io.closed()
            elif end == "pdu timeout":
                io.send(capsule(_read(7))[:30])  # the thread has begun a PDU and waits for the rest
                assert await io.closed(timeout=5)
            if end != "daemon stop":
                for _ in range(200):
                    if not _queue_threads() and conn.transport.is_closing():
                        break
                    await asyncio.sleep(0.01)
                assert not _queue_threads(), end
            await io.close()
            await admin.close()
        assert not _queue_threads(), end

    run(main(), timeout=30)
    assert _fds() <= before, end


def test_a_failure_on_the_thread_ends_only_its_connection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception on a queue's thread that is not an I/O error (a bug; here the Flush's
    ``fdatasync`` made to raise one) ends that connection, never left with a reply cut part
    way: the host sees it close, the thread ends, its descriptor and the namespace's hold are
    given back, and the daemon goes on serving another queue."""
    port = free_port()
    before = _fds()

    def buggy(fd: int) -> None:
        raise RuntimeError("injected")

    async def main() -> None:
        async with serving(_cfg(tmp_path, port)) as service:
            admin, cntlid = await raw_admin(port)
            broken = await _io_queue(port, cntlid, qid=1)
            await _threaded(service, cntlid, broken, qid=1)
            monkeypatch.setattr(os, "fdatasync", buggy)
            broken.send(capsule(build_sqe(IoOpcode.FLUSH, 9, nsid=1)))
            assert await broken.closed(timeout=5)
            monkeypatch.undo()
            for _ in range(200):
                if not _queue_threads():
                    break
                await asyncio.sleep(0.01)
            assert not _queue_threads()
            assert service.target.subsystems[NQN].namespaces[1].in_flight == 0
            other = await _io_queue(port, cntlid, qid=2)
            status, *_ = await other.command(_read(1))
            assert status == 0
            await other.close()
            await broken.close()
            await admin.close()

    run(main(), timeout=30)
    assert _fds() <= before


def test_a_host_not_reading_its_replies_holds_only_its_queue(tmp_path: Path) -> None:
    """A host that sends reads and never reads the replies blocks its queue's thread in
    ``send`` (the GIL released): another queue of the daemon goes on being served, and the
    daemon still stops at once, ending the blocked thread."""
    port = free_port()

    async def main() -> None:
        async with serving(_cfg(tmp_path, port)) as service:
            admin, cntlid = await raw_admin(port)
            stuck = await _io_queue(port, cntlid, qid=1)
            fast = await _threaded(service, cntlid, stuck, qid=1)
            stuck.writer.transport.pause_reading()  # this host reads nothing from now on
            reads = b"".join(capsule(_read(cid % 60000, 0, 120)) for cid in range(2, 802))  # 48 MiB asked
            stuck.send(reads)
            other = await _io_queue(port, cntlid, qid=2)
            for _ in range(50):
                served = fast.thread_served
                await asyncio.sleep(0.05)
                if fast.thread_served == served:
                    break
            assert fast.threaded and fast.thread_served < 800  # blocked in send, not done
            start = time.monotonic()
            for cid in range(1, 50):
                status, *_ = await other.command(_read(cid, cid * 8), timeout=2)
                assert status == 0
            assert time.monotonic() - start < 5
            assert fast.thread_served < 800
            await other.close()
            await admin.close()
        assert not _queue_threads()
        await stuck.close()

    run(main(), timeout=60)


def test_a_namespace_removed_while_threaded_is_the_loops(tmp_path: Path) -> None:
    """A namespace removed while its queue is on the thread closes at once (no command holds it)
    and its next read is refused by the Python queue, as on the loop; the queue carries on."""
    async def main() -> None:
        async with _on_thread(tmp_path) as (service, io, fast):
            target = service.target
            subsystem = target.subsystems[NQN]
            namespace = subsystem.namespaces[1]
            target.remove_namespace(subsystem, 1)
            assert namespace.fast.file.fd == -1 and namespace.in_flight == 0
            served = fast.served
            status, *_ = await io.command(_read(9))
            assert status != 0 and fast.served == served  # Invalid Namespace, from the Python queue

    run(main(), timeout=30)


def test_a_host_reconnecting_at_once_gets_its_queue(tmp_path: Path) -> None:
    """A host closes its I/O queue while the queue is on its thread and at once connects one
    with the same QID, 30 times: every Connect succeeds (the thread has seen the end of stream
    but may be waiting for the GIL while the loop serves the new Connect: the connection is
    settled, ``TcpTargetConnection.settle``), and no thread is left behind."""
    port = free_port()

    async def main() -> None:
        async with serving(_cfg(tmp_path, port)) as service:
            admin, cntlid = await raw_admin(port)
            for _ in range(30):
                io = await _io_queue(port, cntlid)  # asserts SUCCESS
                await _threaded(service, cntlid, io)
                await io.close()
            await io.close()
            await admin.close()
        assert not _queue_threads()

    run(main(), timeout=60)


def test_the_thread_sends_one_receives_replies_together(tmp_path: Path) -> None:
    """32 Reads that arrive in one write are served on the thread and their replies leave in
    a few sends, not one each (as the loop sends one batch per receive), in order."""
    async def main() -> None:
        async with _on_thread(tmp_path) as (service, io, fast):
            served, sends = fast.thread_served, fast.thread_sends
            io.send(b"".join(capsule(_read(cid, cid * 8)) for cid in range(100, 132)))
            cids = []
            while len(cids) < 32:
                pdu = await io.recv()
                assert pdu is not None
                if pdu.ptype == PduType.CAPSULE_RESP:
                    cids.append(CQE_FAST.unpack_from(pdu.header, 8)[4])
            assert cids == list(range(100, 132))
            assert fast.thread_served == served + 32
            assert fast.thread_sends - sends <= 4, fast.thread_sends - sends

    run(main(), timeout=30)
