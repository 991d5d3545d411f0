"""Online namespace resize: our host sees a grown namespace without reconnecting (Namespace
Attribute Changed event, Changed Namespace List, Identify Namespace); a shrink under a connected
host is refused."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from initiator.control import ControlClient, ControlError
from initiator.controller import Controller

from .conftest import NQN, config, connect, free_port, ns, run, serving, sub, until

MIB = 1 << 20


async def _call(path: str, request: dict[str, Any]) -> dict[str, Any]:
    def call() -> dict[str, Any]:
        with ControlClient(path, timeout=10, daemon="target") as client:
            return client.call(request)
    return await asyncio.to_thread(call)


def _cfg(tmp_path: Path, port: int, size: int | None) -> Any:
    return config([port], [sub(NQN, [ns(tmp_path / "a.img", 1, size=size)])],
                  control=str(tmp_path / "target.sock"))


async def _sees(host: Controller, size: int) -> None:
    await until(lambda: host.namespaces[1].size == size)


def test_grow_by_reload_and_by_verb_host_stays_connected(tmp_path: Path) -> None:
    port = free_port()
    sock = str(tmp_path / "target.sock")

    async def main() -> tuple[int, list[int], bytes]:
        async with serving(_cfg(tmp_path, port, 8 * MIB)) as service:
            host = await connect(port, nr_io_queues=1)
            changes: list[int] = []
            host.namespace_listeners.append(lambda: changes.append(host.namespaces[1].size))
            try:
                cntlid = host.cntlid
                await service.reload(_cfg(tmp_path, port, 16 * MIB))
                await _sees(host, 16 * MIB)
                assert (await host.identify_namespace(1)).nsze == 16 * MIB // 512
                await host.write_bytes(1, 12 * MIB, b"g" * 4096)  # past the old end

                os.truncate(tmp_path / "a.img", 24 * MIB)  # the administrator grows the file
                reply = await _call(sock, {"op": "resize", "nqn": NQN, "nsid": 1, "size": None})
                assert (reply["old_size"], reply["size"]) == (16 * MIB, 24 * MIB)
                await _sees(host, 24 * MIB)
                data = await host.read_bytes(1, 12 * MIB, 4096)
                assert service.target.controllers[cntlid].queues.keys() == {0, 1}
                return cntlid - host.cntlid, changes, bytes(data)
            finally:
                await host.close()

    same, changes, data = run(main())
    assert same == 0  # the same controller all along: no reconnect
    assert changes == [16 * MIB, 24 * MIB]
    assert data == b"g" * 4096
    assert os.path.getsize(tmp_path / "a.img") == 24 * MIB


def test_shrink_refused_while_a_host_is_connected(tmp_path: Path) -> None:
    port = free_port()
    sock = str(tmp_path / "target.sock")

    async def main() -> tuple[str, str, int, int]:
        async with serving(_cfg(tmp_path, port, 8 * MIB)) as service:
            host = await connect(port, nr_io_queues=1)
            try:
                with pytest.raises(ControlError) as by_verb:
                    await _call(sock, {"op": "resize", "nqn": NQN, "nsid": 1, "size": 4 * MIB})
                with pytest.raises(RuntimeError) as by_reload:
                    await service.reload(_cfg(tmp_path, port, 4 * MIB))
                seen = host.namespaces[1].size
            finally:
                await host.close()
            await until(lambda: not service.target.controllers)
            shrunk = (await _call(sock, {"op": "resize", "nqn": NQN, "nsid": 1, "size": 4 * MIB}))["size"]
            return str(by_verb.value), str(by_reload.value), seen, shrunk

    by_verb, by_reload, seen, shrunk = run(main())
    assert "will not shrink" in by_verb and "1 host(s) are connected" in by_verb
    assert "will not shrink" in by_reload
    assert seen == 8 * MIB
    assert shrunk == 4 * MIB  # nobody connected: allowed (the file keeps its bytes)
    assert os.path.getsize(tmp_path / "a.img") == 8 * MIB


def test_resize_refusals(tmp_path: Path) -> None:
    port = free_port()
    sock = str(tmp_path / "target.sock")

    async def main() -> list[str]:
        errors = []
        async with serving(_cfg(tmp_path, port, 8 * MIB)):
            for req in ({"nqn": NQN, "nsid": 1, "size": 8 * MIB + 100},
                        {"nqn": NQN, "nsid": 9, "size": 16 * MIB},
                        {"nqn": "nqn.2026-11.io.blockd:none", "nsid": 1, "size": 16 * MIB}):
                with pytest.raises(ControlError) as exc:
                    await _call(sock, {"op": "resize", **req})
                errors.append(str(exc.value))
        return errors

    errors = run(main())
    assert "not a positive multiple of the block size 512" in errors[0]
    assert "has no namespace 9" in errors[1]
    assert "no subsystem" in errors[2]
