"""Every target queue teardown is logged once, with its cause (target/queue.py note_teardown/close):
the host hanging up, a framing error, the admin queue taking the I/O queues with it, keep-alive
expiry."""

from __future__ import annotations

from pathlib import Path

from structlog.testing import capture_logs

from .conftest import (RawConn, config, free_port, ns, raw_io, run, serving, sub,
                       until)


def _teardowns(logs: list[dict]) -> list[dict]:
    return [e for e in logs if e["event"] == "queue torn down"]


def _serve(tmp_path: Path, attack) -> list[dict]:
    port = free_port()
    path = tmp_path / "vol.img"
    path.write_bytes(bytes(1 << 20))
    cfg = config([port], [sub(namespaces=[ns(path, size=1 << 20)])])

    async def main() -> None:
        async with serving(cfg) as service:
            await attack(port, service)

    with capture_logs() as logs:
        run(main(), timeout=30)
    return logs


def test_host_hanging_up_each_queue_logs_peer_disconnect(tmp_path: Path) -> None:
    async def attack(port: int, service) -> None:
        admin, io = await raw_io(port)
        await io.close()
        await until(lambda: len(next(iter(service.target.controllers.values())).queues) == 1)
        await admin.close()
        await until(lambda: not service.target.controllers)

    torn = _teardowns(_serve(tmp_path, attack))
    assert [(e["qid"], e["cause"]) for e in torn] == [(1, "peer disconnect"), (0, "peer disconnect")]
    assert all(e["transport"] == "tcp" and e["cntlid"] is not None and e["peer"] for e in torn)


def test_admin_queue_closing_takes_the_io_queues_with_it(tmp_path: Path) -> None:
    async def attack(port: int, service) -> None:
        admin, io = await raw_io(port)
        await admin.close()
        assert await io.closed()
        await io.close()

    torn = _teardowns(_serve(tmp_path, attack))
    assert sorted((e["qid"], e["cause"]) for e in torn) == [(0, "peer disconnect"),
                                                           (1, "admin queue closed")]


def test_framing_error_is_named(tmp_path: Path) -> None:
    async def attack(port: int, service) -> None:
        conn = await RawConn.open(port)
        conn.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert await conn.recv() is not None  # the C2HTermReq, then EOF
        assert await conn.closed()
        await conn.close()

    torn = _teardowns(_serve(tmp_path, attack))
    assert len(torn) == 1 and torn[0]["cause"] == "framing error" and torn[0]["qid"] is None
    assert torn[0]["fes"] == "1"


def test_keep_alive_expiry_is_named(tmp_path: Path) -> None:
    async def attack(port: int, service) -> None:
        conn = await RawConn.open(port)
        await conn.initialize()
        await conn.connect_admin(kato=1000)
        await until(lambda: not service.target.controllers, timeout=10)
        await conn.close()

    torn = _teardowns(_serve(tmp_path, attack))
    assert [(e["qid"], e["cause"]) for e in torn] == [(0, "keep-alive timeout")]
