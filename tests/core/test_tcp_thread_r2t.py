"""R2T writes on a target queue's thread (target/_tcp_thread.pyx, ``TcpFastPath._h2c_on_thread``).

The thread sends a write's R2T and takes its H2CData itself, straight into the write's buffer,
instead of handing the socket back to the loop for every write. What it takes must be exactly
what the loop would have taken without a word; every other PDU is left to the loop, which
judges it as ever (the termination requests of test_r2t.py's bad sequences, the namespace
removed during the round trip, a host stopping in the middle of the data). Each test checks
that the thread did run (``thread_data``: H2CData PDUs it took; ``thread_entries``: the queue
never went back to the loop where it should not have).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import resource
import signal
from pathlib import Path
from typing import Iterator

import pytest

from blockd.tcp_pdu import PduWriter
from protocol.constants import IoOpcode
from protocol.nvme import CQE_FAST, build_sqe
from protocol.status import Status
from protocol.tcp import DATA_PDU_HEADER_FAST, PduFlags, PduType

from .conftest import NQN, RawConn, capsule, free_port, raw_admin, run, serving, transport_sgl
from .test_hostile import expect_termination
from .test_r2t import BAD_SEQUENCES, CID, LENGTH, SLBA, h2c, write_asking_r2t
from .test_tcp_thread import _cfg, _io_queue, _on_thread, _one_queue, _queue_threads, _read, _threaded, _write
from .test_tcp_thread import pytestmark  # noqa: F401  (skipped, as there, without the compiled plane)


def _r2t_write(cid: int, slba: int, length: int = LENGTH) -> bytes:
    return build_sqe(IoOpcode.WRITE, cid, nsid=1, dptr=transport_sgl(length), cdw10=slba, cdw12=length // 512 - 1)


def _payload(seed: int) -> bytes:
    data = bytes(range(256)) * (LENGTH // 256)
    return data[seed:] + data[:seed]  # no piece of it looks like another at its offset


async def _r2ts(io: RawConn, count: int) -> list[tuple[int, int]]:
    """The next ``count`` R2Ts: (CID, tag) each, each asking for the whole write."""
    got = []
    for _ in range(count):
        pdu = await io.recv()
        assert pdu is not None and pdu.ptype == PduType.R2T, pdu
        _, _, _, _, _, cccid, ttag, r2to, r2tl = DATA_PDU_HEADER_FAST.unpack_from(pdu.header)
        assert (r2to, r2tl) == (0, LENGTH)
        got.append((cccid, ttag))
    return got


async def _statuses(io: RawConn, count: int) -> dict[int, int]:
    out = {}
    for _ in range(count):
        pdu = await io.recv()
        assert pdu is not None and pdu.ptype == PduType.CAPSULE_RESP, pdu
        _, _, _, _, cid, status = CQE_FAST.unpack_from(pdu.header, 8)
        out[cid] = status
    return out


@pytest.mark.parametrize("cuts", [(), (LENGTH - 4096,), (512, 40960 + 65536)], ids=["1-pdu", "2-pdus", "3-pdus"])
def test_r2t_writes_are_taken_on_the_thread(tmp_path: Path, cuts: tuple[int, ...]) -> None:
    """Two R2T writes asked together, their H2CData PDUs interleaved: both written and answered
    on the thread (every PDU taken there, the queue never handed back), the data where it
    belongs."""
    writer = PduWriter()

    async def main() -> None:
        async with _on_thread(tmp_path) as (service, io, fast):
            entries, served, taken, spliced = fast.thread_entries, fast.thread_served, fast.thread_data, fast.thread_spliced
            writes = {20: (SLBA, _payload(3)), 21: (SLBA + 2 * LENGTH // 512, _payload(11))}
            io.send(b"".join(capsule(_r2t_write(cid, slba)) for cid, (slba, _) in writes.items()))
            tags = dict(await _r2ts(io, 2))
            assert sorted(tags) == sorted(writes)
            bounds = [0, *cuts, LENGTH]
            pieces = []
            for start, end in zip(bounds, bounds[1:]):
                for cid, (_, data) in writes.items():
                    pieces.append(b"".join(writer.data_pdu(PduType.H2C_DATA, cid, tags[cid], start, data[start:end],
                                                           PduFlags.LAST_PDU if end == LENGTH else 0)))
            io.send(b"".join(pieces))
            assert await _statuses(io, 2) == {20: 0, 21: 0}
            assert fast.thread_data == taken + len(pieces)
            assert fast.thread_served == served + 2
            assert fast.thread_spliced == spliced + (0 if cuts else 2)  # one PDU each: socket to file by the pipe
            assert fast.thread_entries == entries and fast.threaded
            assert service.target.r2t_budget.used == 0
            for cid, (slba, data) in writes.items():
                status, _, _, got = await io.command(_read(cid + 100, slba, LENGTH // 512))
                assert status == 0 and got == data, cid

    run(main(), timeout=30)


TAKEN_BEFORE = {"skips-ahead": 1, "second-piece-first": 0, "overlaps": 1, "resends-a-piece": 1, "no-last-pdu": 1}
"""How many of each bad sequence's PDUs the thread takes before the one it leaves to the loop."""


@pytest.mark.parametrize("name", sorted(BAD_SEQUENCES))
def test_a_bad_h2c_data_sequence_on_the_thread_ends_as_on_the_loop(tmp_path: Path, name: str) -> None:
    """test_r2t.py's bad sequences sent to a queue on its thread: the thread takes the good
    PDUs before the bad one, the loop refuses the bad one with the same termination request
    as ever, and nothing is written."""
    pieces, fes, fei = BAD_SEQUENCES[name]
    writer = PduWriter()

    async def main() -> None:
        async with _on_thread(tmp_path) as (service, io, fast):
            before = (tmp_path / "vol.img").read_bytes()
            taken = fast.thread_data
            ttag = await write_asking_r2t(io, digests=False)
            io.send(b"".join(h2c(writer, ttag, offset, b"\x66" * length, last) for offset, length, last in pieces))
            await expect_termination(io, fes, fei)
            assert fast.thread_data == taken + TAKEN_BEFORE[name]
            for _ in range(200):
                if not _queue_threads():
                    break
                await asyncio.sleep(0.01)
            assert not _queue_threads()
            assert service.target.r2t_budget.used == 0
            assert service.target.subsystems[NQN].namespaces[1].in_flight == 0
            assert (tmp_path / "vol.img").read_bytes() == before

    run(main(), timeout=30)


def test_bad_sequences_cover_what_the_thread_takes() -> None:
    assert sorted(TAKEN_BEFORE) == sorted(BAD_SEQUENCES)


async def _write_across_removal(tmp_path: Path, threaded: bool) -> tuple[int, int]:
    """An R2T write whose namespace is removed between the R2T and the data: its status, and
    the H2CData PDUs a queue thread took (0 on the loop)."""
    async with _one_queue(tmp_path, threaded) as (service, io, fast):
        taken = fast.thread_data
        target = service.target
        subsystem = target.subsystems[NQN]
        namespace = subsystem.namespaces[1]
        ttag = await write_asking_r2t(io, digests=False)
        target.remove_namespace(subsystem, 1)
        assert namespace.fast.file.fd >= 0  # the write holds it open
        io.send(h2c(PduWriter(), ttag, 0, b"\x55" * LENGTH, True))
        status = (await _statuses(io, 1))[CID]
        for _ in range(200):  # the last hold closes it, on the loop
            if namespace.fast.file.fd < 0:
                break
            await asyncio.sleep(0.01)
        assert namespace.fast.file.fd < 0 and namespace.in_flight == 0
        assert target.r2t_budget.used == 0
        status2, *_ = await io.command(_read(30))  # the queue goes on (the namespace is gone)
        assert status2 != 0
        return status, fast.thread_data - taken


def test_an_r2t_write_whose_namespace_goes_meanwhile_is_answered_as_on_the_loop(tmp_path: Path) -> None:
    """The thread takes the data, does not write it (the namespace was removed during the round
    trip: its copy is withdrawn) and leaves it to the loop, whose queue answers what the
    loop-only target answers (it writes through the backend the write holds open, as every
    command that had started when the namespace went); the namespace's file closes once the
    write lets go of it, in both."""
    on_loop, none_taken = run(_write_across_removal(tmp_path / "loop", False), timeout=30)
    on_thread, taken = run(_write_across_removal(tmp_path / "thread", True), timeout=30)
    assert (none_taken, taken) == (0, 1)
    assert on_thread == on_loop, (hex(on_thread), hex(on_loop))


def test_a_host_stopping_in_the_middle_of_h2c_data_is_timed_out(tmp_path: Path) -> None:
    """A host that sends an H2CData header and part of its data and stops, while the queue is
    on its thread (blocked receiving the data into the connection's pipe), is ended by the PDU
    timeout as on the loop: no thread left, the budget and the namespace given back, nothing of
    the write in the file."""
    port = free_port()

    async def main() -> None:
        async with serving(_cfg(tmp_path, port, hello_timeout=0.5, pdu_timeout=0.3)) as service:
            admin, cntlid = await raw_admin(port)
            io = await _io_queue(port, cntlid)
            fast = await _threaded(service, cntlid, io)
            before = (tmp_path / "vol.img").read_bytes()
            ttag = await write_asking_r2t(io, digests=False)
            io.send(h2c(PduWriter(), ttag, 0, b"\x77" * LENGTH, True)[:24 + LENGTH // 2])
            assert await io.closed(timeout=5)
            for _ in range(200):
                if not _queue_threads():
                    break
                await asyncio.sleep(0.01)
            assert not _queue_threads()
            assert fast.thread_data == 0  # (it never completed)
            assert service.target.r2t_budget.used == 0
            assert service.target.subsystems[NQN].namespaces[1].in_flight == 0
            assert (tmp_path / "vol.img").read_bytes() == before  # (its data waited in the pipe)
            await io.close()
            await admin.close()

    run(main(), timeout=30)


def test_a_write_the_pipe_cannot_hold_whole_goes_to_the_file_as_it_comes(tmp_path: Path) -> None:
    """A write whose data comes in more pieces than the connection's pipe has slots (here: the
    pipe shrunk to one page behind the path's back) is spliced to the file each time the pipe
    fills, and answered once all of it is there; the data reads back."""
    async def main() -> None:
        async with _on_thread(tmp_path) as (service, io, fast):
            writer = PduWriter()
            ttag = await write_asking_r2t(io, digests=False)
            io.send(h2c(writer, ttag, 0, _payload(5), True))
            assert (await _statuses(io, 1))[CID] == 0
            spliced, taken = fast.thread_spliced, fast.thread_data
            assert spliced  # the first went by the pipe, which now says it holds the next
            (controller,) = service.target.controllers.values()
            pipe = controller.queues[1].transport.pipe
            fcntl.fcntl(pipe.w, fcntl.F_SETPIPE_SZ, 4096)
            ttag = await write_asking_r2t(io, digests=False)
            io.send(h2c(writer, ttag, 0, _payload(9), True))
            assert (await _statuses(io, 1))[CID] == 0
            assert (fast.thread_spliced, fast.thread_data) == (spliced + 1, taken + 1)
            assert fast.threaded and service.target.r2t_budget.used == 0
            status, _, _, got = await io.command(_read(40, SLBA, LENGTH // 512))
            assert status == 0 and got == _payload(9)

    run(main(), timeout=30)


@contextlib.contextmanager
def _file_size_limit(limit: int) -> Iterator[None]:
    """Writes of this process at or past ``limit`` fail with EFBIG (RLIMIT_FSIZE, without the
    SIGXFSZ that would end the process): for both ``splice`` and ``pwrite``."""
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old_limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


async def _write_past_limit(tmp_path: Path, threaded: bool) -> tuple[int, bytes, int]:
    """A one-PDU R2T write that the file takes only half of: its status, the file after it,
    and how many writes the thread spliced to the file (0 on the loop)."""
    async with _one_queue(tmp_path, threaded) as (service, io, fast):
        ttag = await write_asking_r2t(io, digests=False)
        with _file_size_limit(SLBA * 512 + LENGTH // 2):
            io.send(h2c(PduWriter(), ttag, 0, _payload(13), True))
            status = (await _statuses(io, 1))[CID]
        status2, *_ = await io.command(_write(41, 0, 4096), b"\x42" * 4096)  # the queue goes on
        assert status2 == 0
        assert service.target.r2t_budget.used == 0
        assert service.target.subsystems[NQN].namespaces[1].in_flight == 0
        return status, (tmp_path / "vol.img").read_bytes(), fast.thread_spliced


def test_a_write_the_file_refuses_part_way_is_answered_as_on_the_loop(tmp_path: Path) -> None:
    """The file takes the first half of a write's data from the pipe and refuses the rest: the
    thread receives the rest all the same (the queue goes on) and leaves the write to the
    loop, whose queue answers Write Fault, as the loop-only target does, with the same bytes
    in the file."""
    on_loop, loop_file, _ = run(_write_past_limit(tmp_path / "loop", False), timeout=30)
    on_thread, thread_file, spliced = run(_write_past_limit(tmp_path / "thread", True), timeout=30)
    assert on_thread == on_loop, (hex(on_thread), hex(on_loop))
    assert on_loop >> 1 & 0x7FF == Status.WRITE_FAULT
    assert thread_file == loop_file
    assert spliced == 0
