"""Our host against a hostile target (its guards, and that a target cannot make
it allocate without bound).

A :class:`~tests.rawpeer.ScriptedTarget` serves ``initiator.controller.Controller`` correctly
except for the first I/O command, which meets one protocol violation. For each guard the test
checks what the host answers (the H2CTermReq's FES and FEI, quoting the bad header), that it
then closes the connection, that the controller reconnects, and that the command, sent again,
completes exactly once with the right data. A bad data digest instead fails only its command
and the connection lives, as the Linux host does. Whatever a target claims in a header (or a
discovery log in its NUMREC), the host allocates nothing beyond the command's own buffer and a
bounded staging buffer (measured with tracemalloc).
"""

from __future__ import annotations

import asyncio
import random
import tracemalloc
from typing import Any, Awaitable, Callable

import pytest

from initiator.controller import ConnectError, ConnectParams, Controller, NvmeError
from initiator.discovery import discover
from protocol.commands import CQE_CID_OFFSET, field_offset
from protocol.constants import LogPageId, TransportType
from protocol.logpage import DISCOVERY_ENTRY, DISCOVERY_HEADER
from protocol.nvme import CQE_FAST
from protocol.status import Status, to_wire
from protocol.tcp import (
    COMMON_HEADER, COMMON_HEADER_FAST, COMMON_HEADER_SIZE, DATA_PDU_HEADER, DATA_HLEN, DIGEST_SIZE, PduFlags, PduType, TermReqFes,
)
from tests.rawpeer import (
    TERM_REQ_FAST, IoCommand, IoScript, RawPdu, ScriptedTarget, TargetConnection, data_header_rest, pdu_bytes,
)

from .conftest import HOSTNQN, run, until
from .test_host_controller import Done

NSID = 1
BS = 512
SLBA = 64
INLINE = 8192
"""The scripted target's in-capsule limit: writes up to here go in the capsule, larger by R2T."""
R2T_WRITE = 64 << 10
SIZE = 1 << 20
FEI_FLAGS = field_offset(COMMON_HEADER, "flags")
FEI_HLEN = field_offset(COMMON_HEADER, "hlen")
FEI_PDO = field_offset(COMMON_HEADER, "pdo")
FEI_PLEN = field_offset(COMMON_HEADER, "plen")
FEI_RESP_CID = COMMON_HEADER_SIZE + CQE_CID_OFFSET
FEI_CCCID = field_offset(DATA_PDU_HEADER, "cccid")
FEI_DATAO = field_offset(DATA_PDU_HEADER, "datao")
INVALID_FIELD = TermReqFes.INVALID_HEADER_FIELD
OUT_OF_RANGE = TermReqFes.DATA_OUT_OF_RANGE

Attack = Callable[[TargetConnection, IoCommand], Awaitable[None]]


def params(port: int, **kw: Any) -> ConnectParams:
    kw = {"nr_io_queues": 1, "queue_size": 16, "keep_alive_tmo": 0, "reconnect_delay": 0.01, "ctrl_loss_tmo": 5,
          "connect_timeout": 3, "command_timeout": 5, "hostnqn": HOSTNQN, **kw}
    return ConnectParams(traddr="127.0.0.1", subnqn="nqn.2026-11.io.blockd:scripted", trsvcid=port, **kw)


class FirstCommandMeets:
    """A script: the first I/O command meets ``attack``, and (unless ``answered`` is False:
    an attack the host survives) the host's answer (its termination request, None if it sent
    none) and whether it then closed are kept; every later command is served correctly."""

    def __init__(self, attack: Attack, trace_memory: bool = False, answered: bool = True) -> None:
        self.attack = attack
        self.answered = answered
        self.attacked = False
        self.reply: RawPdu | None = None
        self.closed = False
        self.trace_memory = trace_memory
        self.peak = -1
        """With ``trace_memory``: the most memory Python allocations held at once (tracemalloc,
        which counts only what is allocated once started) from the attack to the host's answer."""

    async def __call__(self, conn: TargetConnection, cmd: IoCommand) -> None:
        if self.attacked:
            await conn.execute(cmd)
            return
        self.attacked = True
        if not self.answered:
            await self.attack(conn, cmd)
            return
        if self.trace_memory:
            tracemalloc.start()
        try:
            await self.attack(conn, cmd)
            self.reply = await conn.recv()
        finally:
            if self.trace_memory:
                self.peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
        self.closed = self.reply is None or await conn.closed()


def one_command(script: IoScript, write: bool, length: int, **kw: Any) -> tuple[ScriptedTarget, Done, bytes]:
    """Connect to a scripted target, run one read or write of ``length`` bytes, and return the
    target, the command's ``done`` record and what the read returned (or the write sent)."""
    target = ScriptedTarget(size=SIZE, inline=INLINE, script=script)
    target.disk[:] = random.Random(5).randbytes(SIZE)
    buf = bytearray(random.Random(6).randbytes(length) if write else length)
    done = Done()

    async def main() -> None:
        async with target:
            ctrl = await Controller.connect(params(target.port, **kw))
            try:
                ctrl.transfer(write, NSID, SLBA * BS, memoryview(buf), done)
                await until(lambda: done.calls)
                await asyncio.sleep(0.05)  # time for a second completion that must not come
            finally:
                await ctrl.close()
        assert not target.errors, target.errors

    run(main(), timeout=30)
    return target, done, bytes(buf)


def check_terminated_and_retried(write: bool, length: int, attack: Attack | FirstCommandMeets, fes: int,
                                 fei: int, **kw: Any) -> RawPdu:
    """The host answers ``attack`` with H2CTermReq(``fes``, ``fei``) and closes; the controller
    reconnects and the command, sent again, completes once with the right data."""
    script = attack if isinstance(attack, FirstCommandMeets) else FirstCommandMeets(attack)
    target, done, buf = one_command(script, write, length, **kw)
    reply = script.reply
    assert reply is not None and reply.ptype == PduType.H2C_TERM_REQ, reply
    term = reply.fields(TERM_REQ_FAST)
    assert (term["fes"], term["fei"]) == (fes, fei), term
    assert script.closed, "the host kept the connection after a fatal error"
    assert target.connects == [0, 1, 0, 1], "no reconnect"
    assert done.calls == [None]
    assert bytes(target.disk[SLBA * BS:SLBA * BS + length]) == buf
    return reply


def cqe(cid: int, status: int = 0) -> bytes:
    return CQE_FAST.pack(0, 0, 0, 1, cid, to_wire(status))


def term_rest(fes: int) -> bytes:
    """A termination request's header after the common header."""
    return TERM_REQ_FAST.pack(0, 0, 0, 0, 0, fes, 0)[COMMON_HEADER_SIZE:]


# -- what the target sends instead of a correct answer to a read -------------------------------------

async def unknown_pdu_type(conn: TargetConnection, cmd: IoCommand) -> None:
    conn.send(pdu_bytes(0x0A, bytes(16)))


async def bad_hlen(conn: TargetConnection, cmd: IoCommand) -> None:
    conn.send(pdu_bytes(PduType.CAPSULE_RESP, cqe(cmd.cid), hlen=DATA_HLEN - 1))


async def bad_pdo(conn: TargetConnection, cmd: IoCommand) -> None:
    conn.send(pdu_bytes(PduType.C2H_DATA, data_header_rest(cmd.cid, 0, 0, BS), bytes(BS), pdo=DATA_HLEN + 4))


async def plen_inside_header(conn: TargetConnection, cmd: IoCommand) -> None:
    conn.send(pdu_bytes(PduType.C2H_DATA, data_header_rest(cmd.cid, 0, 0, 0), plen=DATA_HLEN - 4))


async def completion_for_unknown_cid(conn: TargetConnection, cmd: IoCommand) -> None:
    conn.respond(cmd.cid ^ 1)


async def duplicate_completion(conn: TargetConnection, cmd: IoCommand) -> None:
    await conn.execute(cmd)
    conn.respond(cmd.cid)


async def c2h_beyond_buffer(conn: TargetConnection, cmd: IoCommand) -> None:
    conn.c2h_data(cmd.cid, 0, bytes(cmd.length + BS))


async def c2h_out_of_order(conn: TargetConnection, cmd: IoCommand) -> None:
    conn.c2h_data(cmd.cid, BS, bytes(BS))


async def c2h_datal_not_plen(conn: TargetConnection, cmd: IoCommand) -> None:
    conn.send(pdu_bytes(PduType.C2H_DATA, data_header_rest(cmd.cid, 0, 0, BS), bytes(2 * BS)))


async def c2h_unknown_cid(conn: TargetConnection, cmd: IoCommand) -> None:
    conn.c2h_data(cmd.cid ^ 1, 0, bytes(BS))


async def success_without_last(conn: TargetConnection, cmd: IoCommand) -> None:
    conn.c2h_data(cmd.cid, 0, bytes(cmd.length), PduFlags.SUCCESS)


async def r2t_unknown_cid(conn: TargetConnection, cmd: IoCommand) -> None:
    conn.r2t(cmd.cid ^ 1, 0, BS)


async def r2t_for_read(conn: TargetConnection, cmd: IoCommand) -> None:
    conn.r2t(cmd.cid, 0, cmd.length)


async def c2h_terminates(conn: TargetConnection, cmd: IoCommand) -> None:
    conn.send(pdu_bytes(PduType.C2H_TERM_REQ, term_rest(INVALID_FIELD)))


READ_ATTACKS = {
    "unknown PDU type": (unknown_pdu_type, INVALID_FIELD, 0),
    "HLEN wrong for the type": (bad_hlen, INVALID_FIELD, FEI_HLEN),
    "PDO not right after the header": (bad_pdo, INVALID_FIELD, FEI_PDO),
    "PLEN inside the header": (plen_inside_header, INVALID_FIELD, FEI_PLEN),
    "completion for an unknown CID": (completion_for_unknown_cid, INVALID_FIELD, FEI_RESP_CID),
    "a second completion of the same command": (duplicate_completion, INVALID_FIELD, FEI_RESP_CID),
    "C2HData beyond the buffer": (c2h_beyond_buffer, OUT_OF_RANGE, FEI_DATAO),
    "C2HData not where the data must come next": (c2h_out_of_order, OUT_OF_RANGE, FEI_DATAO),
    "C2HData whose DATAL is not its PLEN": (c2h_datal_not_plen, OUT_OF_RANGE, FEI_DATAO),
    "C2HData for an unknown CID": (c2h_unknown_cid, INVALID_FIELD, FEI_CCCID),
    "SUCCESS without LAST_PDU": (success_without_last, INVALID_FIELD, FEI_FLAGS),
    "R2T for an unknown CID": (r2t_unknown_cid, INVALID_FIELD, FEI_CCCID),
    "R2T for a read": (r2t_for_read, INVALID_FIELD, FEI_CCCID),
}


@pytest.mark.parametrize("name", READ_ATTACKS)
def test_read_meets_a_fatal_error(name: str) -> None:
    attack, fes, fei = READ_ATTACKS[name]
    check_terminated_and_retried(False, 4096, attack, fes, fei)


def test_termination_request_quotes_the_bad_header() -> None:
    reply = check_terminated_and_retried(False, 4096, bad_hlen, INVALID_FIELD, FEI_HLEN)
    assert reply.data[:COMMON_HEADER_SIZE] == pdu_bytes(PduType.CAPSULE_RESP, b"", hlen=DATA_HLEN - 1,
                                                        plen=DATA_HLEN)[:COMMON_HEADER_SIZE]


def test_header_digest_error() -> None:
    async def attack(conn: TargetConnection, cmd: IoCommand) -> None:
        header = bytearray(conn.framing.pdu(PduType.CAPSULE_RESP, cqe(cmd.cid))[0])
        header[-1] ^= 0xFF  # the header digest's last byte
        conn.send(bytes(header))

    check_terminated_and_retried(False, 4096, attack, TermReqFes.HEADER_DIGEST_ERROR, 0, hdr_digest=True)


def test_c2h_term_req_closes_without_answer_and_the_command_is_retried() -> None:
    script = FirstCommandMeets(c2h_terminates)
    target, done, buf = one_command(script, False, 4096)
    assert script.reply is None and script.closed  # no H2CTermReq back: the host just closes
    assert target.connects == [0, 1, 0, 1]
    assert done.calls == [None]
    assert bytes(target.disk[SLBA * BS:SLBA * BS + 4096]) == buf


# -- writes: C2HData and R2T where they do not belong --------------------------------------------------

async def c2h_for_write(conn: TargetConnection, cmd: IoCommand) -> None:
    conn.c2h_data(cmd.cid, 0, bytes(BS))


async def r2t_beyond_data(conn: TargetConnection, cmd: IoCommand) -> None:
    conn.r2t(cmd.cid, 0, cmd.length + BS)


async def r2t_zero_length(conn: TargetConnection, cmd: IoCommand) -> None:
    conn.r2t(cmd.cid, 0, 0)


async def r2t_for_in_capsule_data(conn: TargetConnection, cmd: IoCommand) -> None:
    assert cmd.in_capsule
    conn.r2t(cmd.cid, 0, cmd.length)


async def r2t_again(conn: TargetConnection, cmd: IoCommand) -> None:
    """Everything asked for and received, then asked for again: a target repeating R2Ts
    would otherwise have the host send (and buffer) the write's data over and over."""
    conn.r2t(cmd.cid, 0, cmd.length)
    await conn.h2c_data(cmd.cid, cmd.length)
    conn.r2t(cmd.cid, 0, cmd.length)


async def r2t_overlapping(conn: TargetConnection, cmd: IoCommand) -> None:
    half = cmd.length // 2
    conn.r2t(cmd.cid, 0, half)
    await conn.h2c_data(cmd.cid, half)
    conn.r2t(cmd.cid, half - BS, half + BS)


WRITE_ATTACKS = {
    "C2HData for a write": (4096, c2h_for_write, INVALID_FIELD, FEI_CCCID),
    "R2T beyond the data": (R2T_WRITE, r2t_beyond_data, OUT_OF_RANGE, FEI_DATAO),
    "R2T of zero bytes": (R2T_WRITE, r2t_zero_length, OUT_OF_RANGE, FEI_DATAO),
    "R2T for data sent in the capsule": (4096, r2t_for_in_capsule_data, INVALID_FIELD, FEI_CCCID),
    "R2T for data already sent": (R2T_WRITE, r2t_again, OUT_OF_RANGE, FEI_DATAO),
    "R2T overlapping data already sent": (R2T_WRITE, r2t_overlapping, OUT_OF_RANGE, FEI_DATAO),
}


@pytest.mark.parametrize("name", WRITE_ATTACKS)
def test_write_meets_a_fatal_error(name: str) -> None:
    length, attack, fes, fei = WRITE_ATTACKS[name]
    check_terminated_and_retried(True, length, attack, fes, fei)


# -- data digest: the command fails, the connection lives ---------------------------------------------

def with_bad_data_digest(bufs: list[bytes | memoryview]) -> list[bytes | memoryview]:
    """A data PDU's buffers (header, data, digest) with the digest made wrong."""
    digest = int.from_bytes(bufs[-1], "little") ^ 0xFFFFFFFF
    return [*bufs[:-1], digest.to_bytes(DIGEST_SIZE, "little")]


@pytest.mark.parametrize("pieces", [1, 2])
@pytest.mark.parametrize("success_flag", [False, True], ids=["with CapsuleResp", "SUCCESS flag"])
def test_bad_c2h_data_digest_fails_only_the_read(pieces: int, success_flag: bool) -> None:
    """The first of ``pieces`` C2HData PDUs has a bad data digest: the read fails with Data
    Transfer Error once, the rest of its data still lands in order (no framing error), and the
    next read on the same connection succeeds."""
    async def attack(conn: TargetConnection, cmd: IoCommand) -> None:
        step = cmd.length // pieces
        for i in range(pieces):
            last = i == pieces - 1
            flags = (PduFlags.LAST_PDU | (PduFlags.SUCCESS if success_flag else 0)) if last else 0
            bufs = conn.framing.data_pdu(PduType.C2H_DATA, cmd.cid, 0, i * step, bytes(step), flags)
            conn.send(with_bad_data_digest(bufs) if i == 0 else bufs)
        if not success_flag:
            conn.respond(cmd.cid)

    target = ScriptedTarget(size=SIZE, script=FirstCommandMeets(attack, answered=False))
    target.disk[:] = random.Random(5).randbytes(SIZE)
    done = Done()

    async def main() -> None:
        async with target:
            ctrl = await Controller.connect(params(target.port, data_digest=True))
            try:
                ctrl.transfer(False, NSID, SLBA * BS, memoryview(bytearray(4096)), done)
                await until(lambda: done.calls)
                assert await ctrl.read(NSID, SLBA, 8) == target.disk[SLBA * BS:SLBA * BS + 4096]
            finally:
                await ctrl.close()
        assert not target.errors, target.errors

    run(main(), timeout=30)
    assert len(done.calls) == 1
    assert isinstance(done.calls[0], NvmeError) and done.calls[0].status == Status.DATA_TRANSFER_ERROR
    assert target.connects == [0, 1], "the connection should have lived"
    assert not target.unexpected  # no termination request


# -- what a header claims must not be what the host allocates ----------------------------------------

CLAIM = 64 << 20


def claim_capsule_resp(cmd: IoCommand) -> bytes:
    return pdu_bytes(PduType.CAPSULE_RESP, cqe(cmd.cid), plen=DATA_HLEN + CLAIM)


def claim_c2h_over_max(cmd: IoCommand) -> bytes:
    return pdu_bytes(PduType.C2H_DATA, data_header_rest(cmd.cid, 0, 0, CLAIM), pdo=DATA_HLEN,
                     plen=DATA_HLEN + CLAIM)


def claim_c2h_beyond_read(cmd: IoCommand) -> bytes:
    """Under the reader's ``max_data`` but far beyond the read's buffer."""
    return pdu_bytes(PduType.C2H_DATA, data_header_rest(cmd.cid, 0, 0, 4 << 20), pdo=DATA_HLEN,
                     plen=DATA_HLEN + (4 << 20))


def claim_c2h_term_req(cmd: IoCommand) -> bytes:
    return pdu_bytes(PduType.C2H_TERM_REQ, term_rest(INVALID_FIELD), plen=DATA_HLEN + CLAIM)


CLAIMS = {
    "CapsuleResp with data": (claim_capsule_resp, INVALID_FIELD, FEI_PLEN),
    "C2HData over the reader's max_data": (claim_c2h_over_max, OUT_OF_RANGE, FEI_PLEN),
    "C2HData beyond the read": (claim_c2h_beyond_read, OUT_OF_RANGE, FEI_DATAO),
    "C2HTermReq too long": (claim_c2h_term_req, INVALID_FIELD, FEI_PLEN),
}
STAGING_BOUND = 1 << 20
"""What receiving one hostile header may cost, all told: well under the claim. Measured about
260 KiB, most of it this process's scripted target (its 64 KiB socket reads and staging); a
claim believed costs the claimed 64 MiB (or 4 MiB) at once."""


@pytest.mark.parametrize("name", CLAIMS)
def test_a_header_claiming_megabytes_costs_nothing(name: str) -> None:
    """The header is sent, then (to a host that did not refuse it at once) a first KiB, never
    the rest: the host must refuse the PDU on its header alone. A host that believed the claim
    sizes its staging buffer for it when the next bytes arrive: hence the KiB."""
    build, fes, fei = CLAIMS[name]

    async def attack(conn: TargetConnection, cmd: IoCommand) -> None:
        conn.send(build(cmd))
        if not await conn.answered(0.5):
            conn.send(bytes(1024))

    script = FirstCommandMeets(attack, trace_memory=True)
    try:
        check_terminated_and_retried(False, 4096, script, fes, fei)
    finally:  # the memory first: a host that believed the claim also fails the checks above
        assert 0 <= script.peak < STAGING_BOUND, f"{script.peak} bytes allocated for one hostile header"


def test_digest_sizes_in_the_claims_stay_bounded() -> None:
    """The same claim with digests on: the digest bytes do not open a way around the checks."""
    async def attack(conn: TargetConnection, cmd: IoCommand) -> None:
        raw = bytearray(conn.framing.pdu(PduType.CAPSULE_RESP, cqe(cmd.cid))[0])
        ptype, flags, hlen, pdo, plen = COMMON_HEADER_FAST.unpack_from(raw)
        COMMON_HEADER_FAST.pack_into(raw, 0, ptype, flags | PduFlags.DDGST, hlen, pdo, plen + CLAIM + DIGEST_SIZE)
        conn.send(bytes(raw))

    check_terminated_and_retried(False, 4096, attack, INVALID_FIELD, FEI_PLEN, hdr_digest=True, data_digest=True)


def test_data_digest_error_then_lost_connection_retries_clean() -> None:
    """A read whose first PDU had a bad digest, then the connection drops before it completed:
    sent again on the new association, its bad digest is history and it succeeds once."""
    async def attack(conn: TargetConnection, cmd: IoCommand) -> None:
        conn.send(with_bad_data_digest(conn.framing.data_pdu(PduType.C2H_DATA, cmd.cid, 0, 0, bytes(BS))))
        conn.close()  # after the PDU has left: the host reads it, then the end of the stream

    target, done, buf = one_command(FirstCommandMeets(attack, answered=False), False, 4096, data_digest=True)
    assert target.connects == [0, 1, 0, 1]
    assert done.calls == [None]
    assert bytes(target.disk[SLBA * BS:SLBA * BS + 4096]) == buf


def discovery_log(numrec: int, entries: int) -> bytes:
    header = DISCOVERY_HEADER.build(dict(genctr=1, numrec=numrec, recfmt=0))
    entry = DISCOVERY_ENTRY.build(dict(trtype=TransportType.TCP, adrfam=1, subtype=2, treq=0, portid=1, cntlid=0xFFFF,
                                       asqsz=32, eflags=0, trsvcid="4420", subnqn="nqn.2026-11.io.blockd:x",
                                       traddr="127.0.0.1", tsas=bytes(256)))
    return header + entry * entries


@pytest.mark.parametrize("numrec", [2, 1 << 16])
def test_discovery_log_claiming_countless_entries_is_refused(numrec: int) -> None:
    """A discovery controller answers any host; its log header's 64-bit NUMREC must not size
    what the host allocates. Two entries are read; 65536 (64 MiB) are refused up front."""
    target = ScriptedTarget()
    target.log_pages[LogPageId.DISCOVERY] = discovery_log(numrec, min(numrec, 2))

    async def main() -> None:
        async with target:
            tracemalloc.start()
            try:
                if numrec == 2:
                    entries = (await discover("127.0.0.1", target.port, timeout=3)).entries
                    assert [(e.traddr, e.trsvcid) for e in entries] == [("127.0.0.1", "4420")] * 2
                else:
                    with pytest.raises(ConnectError, match=f"claims {numrec} entries"):
                        await discover("127.0.0.1", target.port, timeout=3)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert peak < 2 * STAGING_BOUND, peak
        assert not target.errors, target.errors

    run(main(), timeout=30)
