"""Hostile or over-limit input the target refuses, counted by reason (target/rejections.py):
each reason provoked once against a real target over loopback TCP moves its own counter by
exactly one and no other; ``blockctl target stats`` and the Prometheus scrape show the table."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path
from typing import Any, Awaitable, Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from blockd.dhchap_secret import generate_secret
from initiator.controller import ConnectError
from protocol.constants import IoOpcode
from protocol.nvme import build_sqe
from protocol.status import Status
from protocol.tcp import PduType
from target.rejections import REASONS
from target.service import TargetService

from .conftest import (
    HOSTNQN, NQN, RawConn, capsule, config, connect, connect_data, connect_sqe, free_port, icreq,
    ns, raw_admin, run, serving, sub, transport_sgl, until,
)
from .test_target_observe import _blockctl, _call

OTHER_HOST = "nqn.2014-08.org.nvmexpress:uuid:99999999-2222-3333-4444-555555555555"
HOST_KEY = generate_secret(HOSTNQN, 1).encode()

Provoke = Callable[[TargetService, int], Awaitable[None]]


def _moved(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def _provoked(tmp_path: Path, provoke: Provoke, target: dict[str, Any] | None = None,
              **sub_kw: Any) -> dict[str, int]:
    """Run ``provoke`` against a fresh target; the rejection counters it moved."""
    port = free_port()
    cfg = config([port], [sub(NQN, [ns(tmp_path / "a.img")], **sub_kw)], target=target)

    async def main() -> dict[str, int]:
        async with serving(cfg) as service:
            counts = service.target.rejections.counts
            before = dict(counts)
            await provoke(service, port)
            await asyncio.sleep(0.05)  # nothing more may follow
            return _moved(before, counts)

    return run(main(), timeout=30)


async def _closed_by_target(conn: RawConn, timeout: float = 5.0) -> None:
    assert await conn.closed(timeout), "the target did not close the connection"
    await conn.close()


def test_every_fixed_reason_is_there_from_the_start() -> None:
    from target.rejections import Rejections
    assert Rejections().counts == dict.fromkeys(REASONS, 0)
    assert {"framing_invalid_header_field", "framing_pdu_sequence_error", "framing_header_digest_error",
            "framing_data_out_of_range", "framing_r2t_limit_exceeded", "framing_unsupported_parameter"} <= set(REASONS)


@pytest.mark.parametrize("limit, reason", [
    ("max_connections_per_host", "connections_per_host"),
    ("max_connections", "connections_total"),
])
def test_connection_over_a_limit(tmp_path: Path, limit: str, reason: str) -> None:
    async def provoke(service: TargetService, port: int) -> None:
        first = await RawConn.open(port)
        await first.initialize()
        second = await RawConn.open(port)
        await _closed_by_target(second)
        await first.close()

    assert _provoked(tmp_path, provoke, {limit: 1}) == {reason: 1}


def test_hello_timeout(tmp_path: Path) -> None:
    async def provoke(service: TargetService, port: int) -> None:
        silent = await RawConn.open(port)
        await _closed_by_target(silent)

    assert _provoked(tmp_path, provoke, {"hello_timeout": 0.3}) == {"hello_timeout": 1}


def test_pdu_timeout(tmp_path: Path) -> None:
    async def provoke(service: TargetService, port: int) -> None:
        conn, _ = await raw_admin(port)
        conn.send(capsule(build_sqe(0x06, 9))[:20])  # a capsule that never finishes
        await _closed_by_target(conn, timeout=10)

    assert _provoked(tmp_path, provoke, {"hello_timeout": 1, "pdu_timeout": 0.3}) == {"pdu_timeout": 1}


def test_keep_alive_timeout(tmp_path: Path) -> None:
    async def provoke(service: TargetService, port: int) -> None:
        conn = await RawConn.open(port)
        await conn.initialize()
        await conn.connect_admin(kato=500)
        await until(lambda: not service.target.controllers, timeout=10)
        await conn.close()

    assert _provoked(tmp_path, provoke) == {"keep_alive_timeout": 1}


def test_command_pool_exhausted(tmp_path: Path) -> None:
    """A queue of 4 entries holds at most 8 commands: writes waiting for their data (R2Ts the
    host never answers) stay in flight, and the ninth is refused."""
    async def provoke(service: TargetService, port: int) -> None:
        admin, cntlid = await raw_admin(port)
        io = await RawConn.open(port)
        await io.initialize()
        status, *_ = await io.command(connect_sqe(qid=1, sqsize=3), connect_data(cntlid=cntlid))
        assert status == 0
        for cid in range(8):
            io.send(capsule(build_sqe(IoOpcode.WRITE, cid, nsid=1, dptr=transport_sgl(4096), cdw12=7)))
            r2t = await io.recv()
            assert r2t is not None and r2t.ptype == PduType.R2T
        status, *_ = await io.command(build_sqe(IoOpcode.WRITE, 8, nsid=1, dptr=transport_sgl(4096), cdw12=7))
        assert status >> 1 == Status.COMMAND_SEQUENCE_ERROR
        await io.close()
        await admin.close()

    assert _provoked(tmp_path, provoke) == {"command_pool_exhausted": 1}


def test_r2t_budget_wait(tmp_path: Path) -> None:
    """A queue's write-buffer budget of 1 MiB (the least allowed): a second 1 MiB write waits
    for the first."""
    async def provoke(service: TargetService, port: int) -> None:
        admin, cntlid = await raw_admin(port)
        io = await RawConn.open(port)
        await io.initialize()
        await io.connect_io(cntlid)
        for cid in range(2):
            io.send(capsule(build_sqe(IoOpcode.WRITE, cid, nsid=1, dptr=transport_sgl(1 << 20), cdw12=2047)))
        r2t = await io.recv()
        assert r2t is not None and r2t.ptype == PduType.R2T
        with pytest.raises(TimeoutError):  # no second R2T while the first holds the budget
            await io.recv(timeout=0.3)
        await io.close()
        await admin.close()

    assert _provoked(tmp_path, provoke, {"r2t_budget": "1MiB"}) == {"r2t_budget_wait": 1}


def test_in_capsule_data_too_large(tmp_path: Path) -> None:
    """More in-capsule data than an admin queue takes (8 KiB): terminated with Data Transfer
    Out of Range, so the framing reason moves too."""
    async def provoke(service: TargetService, port: int) -> None:
        conn = await RawConn.open(port)
        await conn.initialize()
        conn.send(capsule(connect_sqe(length=16384), bytes(16384)))
        term = await conn.recv()
        assert term is not None and term.ptype == PduType.C2H_TERM_REQ
        await _closed_by_target(conn)

    assert _provoked(tmp_path, provoke) == {"incapsule_too_large": 1, "framing_data_out_of_range": 1}


@pytest.mark.parametrize("first, reason", [
    (icreq(pfv=1), "framing_invalid_header_field"),
    (capsule(build_sqe(0x06, 1)), "framing_pdu_sequence_error"),  # a capsule before ICReq
])
def test_framing_errors_by_fes(tmp_path: Path, first: bytes, reason: str) -> None:
    async def provoke(service: TargetService, port: int) -> None:
        conn = await RawConn.open(port)
        conn.send(first)
        term = await conn.recv()
        assert term is not None and term.ptype == PduType.C2H_TERM_REQ
        await _closed_by_target(conn)

    assert _provoked(tmp_path, provoke) == {reason: 1}


@pytest.mark.parametrize("sqe, data, reason", [
    (connect_sqe(recfmt=1), connect_data(), "connect_incompatible_format"),
    (connect_sqe(), connect_data(nqn="nqn.2026-11.io.blockd:nosuch"), "connect_invalid_parameters"),
    (connect_sqe(), connect_data(hostnqn=OTHER_HOST), "connect_invalid_host"),
    (connect_sqe(qid=1), connect_data(cntlid=77), "connect_invalid_parameters"),
])
def test_connect_refused_by_reason(tmp_path: Path, sqe: bytes, data: bytes, reason: str) -> None:
    async def provoke(service: TargetService, port: int) -> None:
        conn = await RawConn.open(port)
        await conn.initialize()
        status, *_ = await conn.command(sqe, data)
        assert status, "Connect was accepted"
        await conn.close()

    assert _provoked(tmp_path, provoke, allow_any_host=False, hosts=[HOSTNQN]) == {reason: 1}


def test_authentication_failed(tmp_path: Path) -> None:
    async def provoke(service: TargetService, port: int) -> None:
        with pytest.raises(ConnectError, match="FAILED"):
            await connect(port, dhchap_secret=generate_secret(HOSTNQN, 1).encode())  # not the target's

    moved = _provoked(tmp_path, provoke, host_auth=[{"nqn": HOSTNQN, "dhchap_key": HOST_KEY}])
    assert moved == {"auth_failed": 1}


def test_stats_and_prometheus_show_the_rejections(tmp_path: Path) -> None:
    """Two refused Connects: ``blockctl target stats`` lists the reason with its count, the
    control socket's JSON has the interval's and the total's, and the scrape has
    ``blockd_target_rejections_total{reason=...}`` for every fixed reason (0 until it happens)."""
    port, mport = free_port(), free_port()
    sock = str(tmp_path / "run" / "target.sock")
    cfg = config([port], [sub(NQN, [ns(tmp_path / "a.img")])], control=sock,
                 metrics={"enabled": True, "port": mport})

    async def main() -> tuple[dict[str, Any], str, str]:
        async with serving(cfg):
            async def refused() -> None:
                conn = await RawConn.open(port)
                await conn.initialize()
                status, *_ = await conn.command(connect_sqe(), connect_data(nqn="nqn.2026-11.io.blockd:nosuch"))
                assert status
                await conn.close()

            await refused()
            stats = asyncio.ensure_future(_call(sock, {"op": "stats", "interval": 1}))
            await asyncio.sleep(0.3)
            await refused()
            reply = await stats
            text = await _blockctl("target", "--target-socket", sock, "stats", "-i", "0.1")
            scrape = await asyncio.to_thread(
                lambda: urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10).read().decode())
            return reply, text, scrape

    reply, text, scrape = run(main())
    assert reply["interval"]["rejections"]["connect_invalid_parameters"] == 1
    assert reply["totals"]["rejections"]["connect_invalid_parameters"] == 2
    rows = {line.split()[0]: line.split()[1:] for line in text.split("REJECTED", 1)[1].splitlines()[1:]}
    assert rows == {"connect_invalid_parameters": ["0", "2"]}, text
    (fam,) = [f for f in text_string_to_metric_families(scrape) if f.name == "blockd_target_rejections"]
    assert fam.type == "counter"
    values = {s.labels["reason"]: s.value for s in fam.samples if s.name == "blockd_target_rejections_total"}
    assert values == {**dict.fromkeys(REASONS, 0.0), "connect_invalid_parameters": 2.0}
