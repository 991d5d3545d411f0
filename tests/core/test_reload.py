"""A reload (SIGHUP) while hosts are connected and have commands in flight.

The reload path is ``TargetService.reload``; the backend of the namespace it touches is wrapped in
a :class:`GatedBackend` after start, so writes are provably still running on it when the reload
lands. What must hold: those writes complete with success and their data is in the file (the old
backend stays open until the last one is done, as nvmet's ``nvmet_ns_disable`` waits for the
namespace's references), nothing reaches the backend after its close, a command sent afterwards
gets the precise status, and the host learns of the change through the Namespace Attribute
Changed event and re-reads its namespace list.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

from initiator.controller import Controller
from initiator.errors import NvmeError
from protocol.commands import read_command
from protocol.constants import AdminOpcode, Cns, IoOpcode
from protocol.identify import ACTIVE_NS_LIST
from protocol.nvme import NSID_ALL, build_sqe
from protocol.status import MORE, Status, from_wire
from protocol.tcp import PduType
from target.backend import Backend
from target.filter import BackendFilter
from target.service import TargetService

from .conftest import (
    HOSTNQN, NQN, capsule, config, connect, fill_file, free_port, ns, raw_io, run, serving, sub, transport_sgl, until,
)

SIZE = 4 << 20
HOSTNQN2 = "nqn.2014-08.org.nvmexpress:uuid:99999999-8888-7777-6666-555555555555"
IN_FLIGHT = 4


class GatedBackend(BackendFilter):
    """Writes (or flushes, with ``gated="flush"``) wait at a gate before reaching the inner
    backend; any call after ``close`` is recorded (a closed file descriptor would be an EBADF,
    or worse, another file's number)."""

    def __init__(self, inner: Backend, gated: str = "write") -> None:
        super().__init__(inner)
        self.gated = gated
        self.gate = asyncio.Event()
        self.waiting = 0
        self.closed = False
        self.after_close: list[str] = []

    async def _touch(self, what: str) -> None:
        if what == self.gated:
            self.waiting += 1
            await self.gate.wait()
            self.waiting -= 1
        if self.closed:
            self.after_close.append(what)

    async def read_into(self, offset: int, buf: memoryview) -> None:
        await self._touch("read")
        await super().read_into(offset, buf)

    async def write(self, offset: int, data: memoryview | bytes, fua: bool = False) -> None:
        await self._touch("write")
        await super().write(offset, data, fua)

    async def flush(self) -> None:
        await self._touch("flush")
        await super().flush()

    def close(self) -> None:
        if self.closed:
            self.after_close.append("close")
        self.closed = True
        super().close()


def gate(service: TargetService, nsid: int, gated: str = "write") -> GatedBackend:
    """Put a gate in front of namespace ``nsid``'s backend (the controller reads it per command)."""
    namespace = service.target.subsystems[NQN].namespaces[nsid]
    backend = GatedBackend(namespace.backend, gated)
    namespace.backend = backend
    return backend


@contextlib.asynccontextmanager
async def gated_host(service: TargetService, port: int, gated: str = "write",
                     **kw: Any) -> AsyncIterator[tuple[Controller, GatedBackend, asyncio.Event]]:
    """Our host connected, namespace 1's backend behind a gate, and an event set when the host
    re-reads its namespace list. On the way out the gate opens (a failed assertion must not
    leave commands held through the target's drain) and the host disconnects."""
    host = await connect(port, nr_io_queues=1, **kw)
    changed = asyncio.Event()
    host.namespace_listeners.append(changed.set)
    backend = gate(service, 1, gated)
    try:
        yield host, backend, changed
    finally:
        backend.gate.set()
        await host.close()


async def writes_held(host: Controller, gated: GatedBackend, pattern: bytes) -> list[asyncio.Task[None]]:
    """``IN_FLIGHT`` 4 KiB writes to namespace 1 (blocks 0, 8, 16…), all waiting at the gate."""
    tasks = [asyncio.create_task(host.write(1, i * 8, pattern * 4096)) for i in range(IN_FLIGHT)]
    await until(lambda: gated.waiting == IN_FLIGHT)
    return tasks


async def release(gated: GatedBackend, tasks: list[asyncio.Task[None]], **gather: Any) -> None:
    """Open the gate: every held command runs to its end; then the old backend closes, with
    nothing reaching it afterwards."""
    assert not gated.closed, "the backend closed with commands still running on it"
    gated.gate.set()
    await asyncio.gather(*tasks, **gather)
    await until(lambda: gated.closed)
    assert gated.after_close == []


def assert_written(path: Path, pattern: bytes) -> None:
    data = path.read_bytes()
    for i in range(IN_FLIGHT):
        assert data[i * 4096:(i + 1) * 4096] == pattern * 4096, i


def two_namespaces(tmp_path: Path, port: int) -> tuple[Path, Any, Any]:
    """Namespace 1's file, and configurations with namespaces 1 and 2, then 2 alone."""
    paths = [tmp_path / "one.img", tmp_path / "two.img"]
    fill_file(paths[0], SIZE)
    before = config([port], [sub(namespaces=[ns(paths[0], 1, SIZE), ns(paths[1], 2, SIZE)])])
    after = config([port], [sub(namespaces=[ns(paths[1], 2, SIZE)])])
    return paths[0], before, after


def test_remove_namespace_with_writes_in_flight(tmp_path: Path) -> None:
    port = free_port()
    path, before, after = two_namespaces(tmp_path, port)

    async def main() -> None:
        async with serving(before) as service, gated_host(service, port) as (host, gated, changed):
            tasks = await writes_held(host, gated, b"\x5a")
            await service.reload(after)
            assert 1 not in service.target.subsystems[NQN].namespaces
            await asyncio.wait_for(changed.wait(), 5)
            assert sorted(host.namespaces) == [2]
            # a command for the removed namespace: Invalid Namespace, not a touch of its file
            with pytest.raises(NvmeError) as err:
                await host.io_command(read_command(1, 0, 0), data_in=memoryview(bytearray(512)))
            assert err.value.status == Status.INVALID_NS
            await release(gated, tasks)
            assert service.target.draining == []
            await host.write(2, 0, b"\x77" * 512)  # the other namespace carries on
            assert await host.read(2, 0, 1) == b"\x77" * 512

    run(main(), timeout=30)
    assert_written(path, b"\x5a")


def test_a_namespace_opened_again_waits_for_its_old_copys_last_command(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A reload that re-opens namespace 1 on the same file (here: made read-only) opens the new
    backend only after the old one's held writes finished and it closed: a replicated namespace's
    new copy reads its write-intent bits from that file, and must see every bit the old copy's
    last writes set. Break: no wait in TargetService._update_subsystem -> "open" before "close"."""
    import target.service as service_module
    port = free_port()
    path = tmp_path / "vol.img"
    fill_file(path, SIZE)
    before = config([port], [sub(namespaces=[ns(path, 1, SIZE)])])
    after = config([port], [sub(namespaces=[ns(path, 1, SIZE, read_only=True)])])
    events: list[str] = []
    real_open = service_module.open_backend
    monkeypatch.setattr(service_module, "open_backend", lambda nc: (events.append("open"), real_open(nc))[1])

    async def main() -> None:
        async with serving(before) as service, gated_host(service, port) as (host, gated, changed):
            tasks = await writes_held(host, gated, b"\x3c")
            events.clear()  # the start's open
            reload = asyncio.create_task(service.reload(after))
            await until(lambda: bool(service.target.draining))  # the old one removed, its writes held
            await asyncio.sleep(0.2)  # the reload has had its chance to open the file again
            assert events == [] and not reload.done()
            real_close = gated.close
            gated.close = lambda: (events.append("close"), real_close())[1]  # type: ignore[method-assign]
            gated.gate.set()
            await asyncio.gather(*tasks)
            await asyncio.wait_for(reload, 10)
            assert events == ["close", "open"]
            assert service.target.subsystems[NQN].namespaces[1].read_only

    run(main(), timeout=30)
    assert_written(path, b"\x3c")


def test_a_namespace_opened_again_stays_listed_and_its_commands_are_sent_again(tmp_path: Path) -> None:
    """While a reload opens namespace 1 again (here: made read-only; the old copy's writes held
    at the gate), hosts keep seeing it: the Active Namespace ID list still has it and no change
    event comes (the Linux host drops a namespace missing from the list at its next scan, and the
    block device with it). A command meanwhile gets Internal Path Error without DNR (raw; what
    nvmet answers for a configured namespace that is disabled), which our host sends again until
    the new copy serves it. Break: ``reopen=False`` in TargetService._update_subsystem -> Invalid
    Namespace (DNR) on the raw queue, and the host's read fails."""
    port = free_port()
    path = tmp_path / "vol.img"
    data = fill_file(path, SIZE)
    before = config([port], [sub(namespaces=[ns(path, 1, SIZE)])])
    after = config([port], [sub(namespaces=[ns(path, 1, SIZE, read_only=True)])])

    async def main() -> None:
        async with serving(before) as service, gated_host(service, port) as (host, gated, changed):
            admin, io = await raw_io(port)
            tasks = await writes_held(host, gated, b"\x3c")
            reload = asyncio.create_task(service.reload(after))
            await until(lambda: bool(service.target.draining))
            status, *_ = await io.command(build_sqe(IoOpcode.READ, 9, nsid=1, dptr=transport_sgl(512)))
            assert from_wire(status) == Status.INTERNAL_PATH_ERROR | MORE, hex(status)  # no DNR; logged
            status, _, _, listed = await admin.command(build_sqe(AdminOpcode.IDENTIFY, 3, dptr=transport_sgl(4096),
                                                                 cdw10=Cns.ACTIVE_NS_LIST))
            assert status == 0 and [n for n in ACTIVE_NS_LIST.parse(listed) if n] == [1], hex(status)
            read = asyncio.create_task(host.read(1, 64, 1))
            await until(lambda: host.path_error_retries >= 2)
            assert not read.done() and not changed.is_set()
            await release(gated, tasks)
            await asyncio.wait_for(reload, 10)
            assert await asyncio.wait_for(read, 10) == data[64 * 512:65 * 512]
            await asyncio.wait_for(changed.wait(), 5)  # told once the new copy is there
            assert service.target.subsystems[NQN].namespaces[1].read_only
            await io.close()
            await admin.close()

    run(main(), timeout=30)
    assert_written(path, b"\x3c")


def test_a_namespace_that_cannot_be_opened_again_is_gone_for_its_hosts(tmp_path: Path) -> None:
    """The reopen's new copy fails to open (its new path is in a directory that does not exist):
    the reload fails, and the namespace is no longer reopening but gone: hosts get the change
    event, no longer list it, and a command gets Invalid Namespace, not a retry for ever. Break:
    no ``reopen_failed`` in TargetService._update_subsystem -> no event, Internal Path Error."""
    port = free_port()
    path = tmp_path / "vol.img"
    fill_file(path, SIZE)
    before = config([port], [sub(namespaces=[ns(path, 1, SIZE)])])
    after = config([port], [sub(namespaces=[ns(tmp_path / "no-such-dir" / "vol.img", 1, SIZE)])])

    async def main() -> None:
        async with serving(before) as service:
            host = await connect(port, nr_io_queues=1)
            changed = asyncio.Event()
            host.namespace_listeners.append(changed.set)
            try:
                with pytest.raises(Exception, match="no-such-dir"):
                    await service.reload(after)
                assert service.target.subsystems[NQN].reopening == set()
                await asyncio.wait_for(changed.wait(), 5)
                assert sorted(host.namespaces) == []
                with pytest.raises(NvmeError) as err:
                    await host.io_command(read_command(1, 0, 0), data_in=memoryview(bytearray(512)))
                assert err.value.status & ~MORE == Status.INVALID_NS
            finally:
                await host.close()

    run(main(), timeout=30)


def test_resize_namespace_with_writes_in_flight(tmp_path: Path) -> None:
    port = free_port()
    path = tmp_path / "vol.img"
    fill_file(path, SIZE)
    before = config([port], [sub(namespaces=[ns(path, 1, SIZE)])])
    after = config([port], [sub(namespaces=[ns(path, 1, 2 * SIZE)])])
    last = 2 * SIZE // 512 - 1

    async def main() -> None:
        async with serving(before) as service, gated_host(service, port) as (host, gated, changed):
            tasks = await writes_held(host, gated, b"\xc3")
            await service.reload(after)
            await asyncio.wait_for(changed.wait(), 5)
            assert host.namespaces[1].blocks == last + 1
            # grown in place (only the size changed): the held writes finish on the same,
            # still open backend
            gated.gate.set()
            await asyncio.gather(*tasks)
            assert service.target.subsystems[NQN].namespaces[1].backend is gated
            assert not gated.closed
            # the grown namespace: its new end is writable, the held writes read back
            await host.write(1, last, b"\x11" * 512)
            assert await host.read(1, last, 1) == b"\x11" * 512
            assert await host.read(1, 0, 8) == b"\xc3" * 4096

    run(main(), timeout=30)
    assert path.stat().st_size == 2 * SIZE


def test_remove_subsystem_with_writes_in_flight(tmp_path: Path) -> None:
    """The subsystem goes with its controllers, but the writes already running on its namespace
    finish on an open file before it closes."""
    port = free_port()
    path = tmp_path / "vol.img"
    before = config([port], [sub(namespaces=[ns(path, 1, SIZE)])])

    async def main() -> None:
        async with serving(before) as service, \
                gated_host(service, port, ctrl_loss_tmo=0.5, reconnect_delay=0.1) as (host, gated, _):
            tasks = await writes_held(host, gated, b"\x3c")
            await service.reload(config([port], []))
            assert NQN not in service.target.subsystems
            await release(gated, tasks, return_exceptions=True)  # their connections are gone

    run(main(), timeout=30)
    assert_written(path, b"\x3c")  # before the close, though no completion could reach the host


def test_flush_of_every_namespace_holds_each_while_it_flushes(tmp_path: Path) -> None:
    """Flush with NSID_ALL names no namespace at parsing: it holds each one while flushing it,
    so a reload removing that namespace meanwhile closes the file only after the flush."""
    port = free_port()
    _, before, after = two_namespaces(tmp_path, port)

    async def main() -> None:
        async with serving(before) as service, gated_host(service, port, "flush") as (host, gated, _):
            flush = asyncio.create_task(host.flush(NSID_ALL))
            await until(lambda: gated.waiting == 1)
            await service.reload(after)
            await release(gated, [flush])

    run(main(), timeout=30)


def test_write_waiting_for_its_data_holds_a_removed_namespace_until_its_connection_goes(tmp_path: Path) -> None:
    """A write parsed against the namespace, its R2T answered by nothing: the backend stays open
    (the data could still come), and closes when the host's connection ends the write."""
    port = free_port()
    _, before, after = two_namespaces(tmp_path, port)

    async def main() -> None:
        async with serving(before) as service:
            gated = gate(service, 1)
            admin, io = await raw_io(port)
            length = 192 << 10  # beyond the in-capsule size: the target asks for it with R2T
            io.send(capsule(build_sqe(IoOpcode.WRITE, 5, nsid=1, dptr=transport_sgl(length),
                                      cdw12=length // 512 - 1)))
            r2t = await io.recv()
            assert r2t is not None and r2t.ptype == PduType.R2T
            await service.reload(after)
            assert not gated.closed
            await io.close()
            await until(lambda: gated.closed)
            assert gated.after_close == [] and service.target.draining == []
            await admin.close()

    run(main(), timeout=30)


def test_removing_a_host_from_hosts_drops_only_its_controllers(tmp_path: Path) -> None:
    port = free_port()
    path = tmp_path / "vol.img"
    fill_file(path, SIZE)
    both = config([port], [sub(namespaces=[ns(path, 1, SIZE)], hosts=[HOSTNQN, HOSTNQN2])])
    second_only = config([port], [sub(namespaces=[ns(path, 1, SIZE)], hosts=[HOSTNQN2])])

    async def main() -> None:
        async with serving(both) as service:
            gone = await connect(port, nr_io_queues=1, ctrl_loss_tmo=1.0, reconnect_delay=0.2)
            stays = await connect(port, nr_io_queues=1, hostnqn=HOSTNQN2)
            try:
                await gone.write(1, 0, b"\x01" * 512)
                await service.reload(second_only)
                await until(lambda: gone.cntlid not in service.target.controllers)
                assert service.target.controllers[stays.cntlid].hostnqn == HOSTNQN2
                for lba in range(16):  # the other host's association is untouched and busy
                    await stays.write(1, lba, bytes([lba]) * 512)
                    assert await stays.read(1, lba, 1) == bytes([lba]) * 512
                assert stays.state == "live"
                # the removed host may not come back: its reconnects are refused until it gives up
                await until(lambda: gone.state == "failed", timeout=10)
                assert all(c.hostnqn == HOSTNQN2 for c in service.target.controllers.values()
                           if not c.is_discovery)
            finally:
                await gone.close()
                await stays.close()

    run(main(), timeout=40)
