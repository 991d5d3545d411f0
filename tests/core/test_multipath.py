"""The host's multipath layer (initiator/multipath.py) over two targets presenting one
subsystem on the same file: route by ANA state, fail over without errors, give up after
ctrl_loss_tmo (issue 14)."""

from __future__ import annotations

import asyncio
import gc
import os
import weakref
from pathlib import Path
from typing import Any

import pytest
import structlog

from initiator.controller import Controller
from initiator.errors import ConnectError, NvmeError, QueueLost
from initiator import multipath
from initiator.multipath import MultipathController, parse_path
from protocol.logpage import ANA_HEADER, ANA_LOG
from protocol.status import Status
from target.config import parse
from target.service import TargetService

from .conftest import NQN, free_port, ns, params, run, sub, until

SIZE = 4 << 20
BS = 512


def target_config(port: int, path: Path, state: str, cntlids: tuple[int, int]) -> Any:
    return parse({"port": [{"transport": "tcp", "address": "127.0.0.1", "port": port}],
                  "subsystem": [sub(cntlid_min=cntlids[0], cntlid_max=cntlids[1],
                                    namespaces=[ns(path, 1, SIZE)])],
                  "ana": [{"state": state}], "control": {"socket": ""}}, "test")


class Pair:
    """Target A (optimized) and target B (inaccessible) exporting one file as one subsystem."""

    def __init__(self, tmp_path: Path) -> None:
        self.file = tmp_path / "shared.img"
        self.ports = free_port(), free_port()
        self.a = TargetService(target_config(self.ports[0], self.file, "optimized", (1, 99)))
        self.b = TargetService(target_config(self.ports[1], self.file, "inaccessible", (100, 199)))

    async def start(self) -> None:
        await self.a.start()
        await self.b.start()

    async def stop(self) -> None:
        for service in (self.a, self.b):
            if service.listeners or service.target.controllers:
                await service.stop()

    async def connect(self, **kw: Any) -> MultipathController:
        kw.setdefault("ctrl_loss_tmo", 10.0)
        kw.setdefault("reconnect_delay", 0.2)
        return await MultipathController.connect([params(p, **kw) for p in self.ports])

    def writes(self, service: TargetService) -> int:
        return service.target.subsystems[NQN].namespaces[1].counters.ops[1]


def test_routes_by_ana_state_and_follows_the_event(tmp_path: Path) -> None:
    pair = Pair(tmp_path)

    async def main() -> None:
        await pair.start()
        mp = await pair.connect()
        try:
            assert {p.cntlid // 100 for p in mp.paths} == {0, 1}  # disjoint ranges
            states = [p["ana"] for p in mp.describe_paths()]
            assert states == [{"1": "optimized"}, {"1": "inaccessible"}]
            await mp.write(1, 0, b"a" * BS)
            assert (pair.writes(pair.a), pair.writes(pair.b)) == (1, 0)
            # swap the roles: B is promoted, then A demoted; the host follows each event
            await pair.b.op_ana_set("optimized")
            await pair.a.op_ana_set("inaccessible")
            swapped = [{"1": "inaccessible"}, {"1": "optimized"}]
            for _ in range(50):  # no I/O meanwhile: only the events can tell the host
                if [p["ana"] for p in mp.describe_paths()] == swapped:
                    break
                await asyncio.sleep(0.05)
            assert [p["ana"] for p in mp.describe_paths()] == swapped
            await mp.write(1, 1, b"b" * BS)
            assert (pair.writes(pair.a), pair.writes(pair.b)) == (1, 1)
            assert await mp.read(1, 0, 2) == b"a" * BS + b"b" * BS
        finally:
            await mp.close()
            await pair.stop()
    run(main())


def test_ana_status_requeues_on_the_other_path(tmp_path: Path) -> None:
    """A's state changes under the host without it noticing (the event re-arms only once the
    log is read): its writes come back 0x302 and go to B, promoted, instead of failing."""
    pair = Pair(tmp_path)

    async def main() -> None:
        await pair.start()
        mp = await pair.connect()
        try:
            a_ctrl = next(iter(pair.a.target.controllers.values()))
            a_ctrl.ana_event_masked = True  # the host will not hear of A's change
            pair.a.target.set_ana_state([1], 1, pair.a.target.ana.state(1, 1).__class__(3))
            await pair.b.op_ana_set("optimized")
            await asyncio.gather(*(mp.write(1, i, bytes([i]) * BS) for i in range(32)))
            assert pair.writes(pair.b) == 32
            assert a_ctrl.counters.errors.get(Status.ANA_INACCESSIBLE | 0x2000, 0) + \
                a_ctrl.counters.errors.get(Status.ANA_INACCESSIBLE, 0) >= 1
            data = await mp.read(1, 0, 32)
            assert data == b"".join(bytes([i]) * BS for i in range(32))
        finally:
            await mp.close()
            await pair.stop()
    run(main())


def test_failover_when_the_primary_dies(tmp_path: Path) -> None:
    """A writer keeps writing and logging what was acknowledged; A stops (its connections cut),
    B is promoted a moment later: no write fails and every acknowledged one reads back."""
    pair = Pair(tmp_path)

    async def main() -> None:
        await pair.start()
        mp = await pair.connect()
        acked: dict[int, bytes] = {}  # the last acknowledged data of each LBA: what must read back
        # acknowledged writes, counted apart from acked: its keys stop growing once the writers
        # have covered every LBA, which a fast plane does before the failover
        writes = [0]
        stop = asyncio.Event()

        async def writer(k: int) -> None:
            i = 0
            while not stop.is_set():
                lba = (k * 1000 + i) % (SIZE // BS)
                data = os.urandom(BS)
                await mp.write(1, lba, data)
                acked[lba] = data
                writes[0] += 1
                i += 1

        try:
            tasks = [asyncio.create_task(writer(k)) for k in range(4)]
            await asyncio.sleep(0.3)
            await pair.a.stop()  # listeners closed, every controller torn down
            await asyncio.sleep(0.5)  # the writers wait: B is still inaccessible
            before = writes[0]
            await pair.b.op_ana_set("optimized")
            await asyncio.sleep(0.5)
            stop.set()
            await asyncio.gather(*tasks)  # raises if any write failed
            assert writes[0] > before > 0  # writes went on after the failover
            assert mp.state == "live"
            for lba, data in acked.items():
                assert await mp.read(1, lba, 1) == data
        finally:
            stop.set()
            await mp.close()
            await pair.stop()
    run(main())


def test_no_usable_path_fails_after_ctrl_loss_tmo(tmp_path: Path) -> None:
    pair = Pair(tmp_path)

    async def main() -> None:
        await pair.start()
        mp = await pair.connect(ctrl_loss_tmo=1.0)
        try:
            await pair.a.op_ana_set("inaccessible")
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises((NvmeError, QueueLost)):
                await mp.write(1, 0, bytes(BS))
            assert 0.9 < loop.time() - start < 5
        finally:
            await mp.close()
            await pair.stop()
    run(main())


def test_a_real_error_is_not_retried(tmp_path: Path) -> None:
    pair = Pair(tmp_path)

    async def main() -> None:
        await pair.start()
        mp = await pair.connect()
        try:
            from protocol.commands import write_command
            with pytest.raises(NvmeError) as err:  # past the end: the caller's error, at once
                await mp.io_command(write_command(1, SIZE // BS, 0), data_out=bytes(BS))
            assert err.value.status & 0x7FF == Status.LBA_RANGE & 0x7FF
        finally:
            await mp.close()
            await pair.stop()
    run(main())


def test_hostile_ana_log_page(tmp_path: Path) -> None:
    """A log page that does not parse leaves the path's known state; a group in a state no
    spec names makes the path unused; neither reaches the caller or stops the connection."""
    pair = Pair(tmp_path)

    async def main() -> None:
        await pair.start()
        mp = await pair.connect()
        a = mp.paths[0]
        real = a.get_log_page
        try:
            async def truncated(*args: Any, **kw: Any) -> bytes:
                return ANA_HEADER.build(dict(chgcnt=1, ngrps=0xFFFF)) + bytes(64)

            async def odd_state(*args: Any, **kw: Any) -> bytes:
                return ANA_LOG.build(dict(header=dict(chgcnt=2, ngrps=1), groups=[
                    dict(grpid=1, nnsids=1, chgcnt=2, state=7, nsids=[1])]))

            a.get_log_page = truncated
            mp._refresh(a)
            await asyncio.sleep(0.3)
            assert mp.describe_paths()[0]["ana"] == {"1": "optimized"}
            a.get_log_page = odd_state
            mp._refresh(a)
            await asyncio.sleep(0.3)
            assert mp.describe_paths()[0]["ana"] == {}
            write = asyncio.ensure_future(mp.write(1, 0, b"z" * BS))  # no usable path: it waits
            await asyncio.sleep(0.3)
            assert not write.done()
            a.get_log_page = real
            await pair.b.op_ana_set("optimized")
            await asyncio.wait_for(write, 10)
            assert pair.writes(pair.b) == 1
        finally:
            a.get_log_page = real
            await mp.close()
            await pair.stop()
    run(main())


def test_paths_to_different_namespaces_refused(tmp_path: Path) -> None:
    """Same NQN and NSID but another NGUID (another data set): not one namespace."""
    p1, p2 = free_port(), free_port()
    a = TargetService(target_config(p1, tmp_path / "a.img", "optimized", (1, 9)))
    other = parse({"port": [{"transport": "tcp", "address": "127.0.0.1", "port": p2}],
                   "subsystem": [sub(cntlid_min=10, namespaces=[
                       {**ns(tmp_path / "b.img", 1, SIZE), "nguid": "11" * 16}])],
                   "control": {"socket": ""}}, "test")
    b = TargetService(other)

    async def main() -> None:
        await a.start()
        await b.start()
        try:
            with pytest.raises(ConnectError, match="different NGUID"):
                await MultipathController.connect([params(p1), params(p2)])
            for _ in range(100):  # both paths closed (the targets see it a moment later)
                if not a.target.controllers and not b.target.controllers:
                    break
                await asyncio.sleep(0.02)
            assert not a.target.controllers and not b.target.controllers
        finally:
            await a.stop()
            await b.stop()
    run(main())


def _path_states(mp: MultipathController) -> list[tuple[str, dict[str, str]]]:
    return [(p["state"], p["ana"]) for p in mp.describe_paths()]


@pytest.mark.parametrize("b_first", [False, True])
def test_a_path_down_at_connect_joins_when_it_comes_up(tmp_path: Path, b_first: bool) -> None:
    """B is down at connect time: the connection is made on A, B shows "connecting" and takes
    no I/O; I/O goes on while B comes up and joins (its ANA log read); then A dies and B,
    promoted, carries the writes. Listed first or second, the path down is not the one the
    connection takes its namespaces and controller id from."""
    pair = Pair(tmp_path)
    if b_first:
        pair.ports = pair.ports[::-1]
    a, b = (1, 0) if b_first else (0, 1)

    async def main() -> None:
        await pair.a.start()
        mp = await pair.connect()
        stop = asyncio.Event()
        acked: dict[int, bytes] = {}
        count = [0]

        async def writer() -> None:
            while not stop.is_set():
                data = os.urandom(BS)
                lba = count[0] % 512
                await mp.write(1, lba, data)
                acked[lba] = data
                count[0] += 1

        try:
            assert _path_states(mp)[a] == ("live", {"1": "optimized"})
            assert _path_states(mp)[b] == ("connecting", {})
            assert mp.state == "live" and mp.cntlid == mp.paths[a].cntlid < 100
            assert sorted(mp.namespaces) == [1]
            task = asyncio.create_task(writer())
            await asyncio.sleep(0.3)
            await pair.b.start()
            await until(lambda: _path_states(mp)[b] == ("live", {"1": "inaccessible"}))
            assert mp.paths[b].reconnects == mp.reconnects == 0  # a first connect, not a reconnect
            before = count[0]
            await asyncio.sleep(0.2)
            assert count[0] > before and not task.done()  # the load never stopped
            await pair.a.stop()
            await pair.b.op_ana_set("optimized")
            await until(lambda: pair.writes(pair.b) > 20)
            stop.set()
            await task  # raises if a write failed
            for lba, data in acked.items():
                assert await mp.read(1, lba, 1) == data
        finally:
            stop.set()
            await mp.close()
            await pair.stop()
    run(main())


def test_a_late_path_to_another_data_set_is_refused(tmp_path: Path) -> None:
    """The path that comes up later shows another NGUID: it is closed, shown refused with the
    reason, and never used; the connection goes on on A."""
    pair = Pair(tmp_path)
    other = parse({"port": [{"transport": "tcp", "address": "127.0.0.1", "port": pair.ports[1]}],
                   "subsystem": [sub(cntlid_min=100, namespaces=[
                       {**ns(tmp_path / "b.img", 1, SIZE), "nguid": "11" * 16}])],
                   "control": {"socket": ""}}, "test")
    pair.b = TargetService(other)

    async def main() -> None:
        await pair.a.start()
        mp = await pair.connect()
        try:
            await pair.b.start()
            await until(lambda: mp.describe_paths()[1]["state"] == "refused")
            assert "different NGUID" in mp.describe_paths()[1]["error"]
            await mp.write(1, 0, b"r" * BS)
            assert (pair.writes(pair.a), pair.writes(pair.b)) == (1, 0)
            await until(lambda: not pair.b.target.controllers)  # closed on the target too
        finally:
            await mp.close()
            await pair.stop()
    run(main())


def test_a_path_that_never_connects_gives_up_after_its_ctrl_loss_tmo(tmp_path: Path) -> None:
    """B, listed first, never comes up: "connecting", then "failed" after its ctrl_loss_tmo;
    the connection stays live on A and keeps A's namespaces, also while A is down."""
    pair = Pair(tmp_path)
    pair.ports = pair.ports[::-1]

    async def main() -> None:
        await pair.a.start()
        mp = await pair.connect(ctrl_loss_tmo=0.6)
        try:
            assert mp.describe_paths()[0]["state"] == "connecting"
            await until(lambda: mp.describe_paths()[0]["state"] == "failed")
            assert mp.state == "live" and mp.failed is None
            await mp.write(1, 0, b"f" * BS)
            assert await mp.read(1, 0, 1) == b"f" * BS
            await pair.a.stop()
            with pytest.raises((QueueLost, ConnectionError)):  # no path left within ctrl_loss_tmo
                await mp.write(1, 0, b"g" * BS)
            await until(lambda: not mp._refreshing)  # A's state read again (and failed)
            assert sorted(mp.namespaces) == [1]  # still what A showed, not B's nothing
        finally:
            await mp.close()
            await pair.stop()
    run(main())


def test_a_joining_path_takes_no_io_before_its_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write waits for a usable path (A down); B, another data set and optimized, comes up
    and its check takes a while: the waiting write must not go to B meanwhile (neither the
    waiting-commands sweep nor B's events may read its ANA log before it is admitted)."""
    pair = Pair(tmp_path)
    pair.b = TargetService(parse({"port": [{"transport": "tcp", "address": "127.0.0.1", "port": pair.ports[1]}],
                                  "subsystem": [sub(cntlid_min=100, namespaces=[
                                      {**ns(tmp_path / "b.img", 1, SIZE), "nguid": "22" * 16}])],
                                  "control": {"socket": ""}}, "test"))
    real = multipath._namespace_ids

    async def slow_ids(path: Controller) -> Any:
        if path is mp.paths[1]:
            await asyncio.sleep(1.0)
        return await real(path)

    async def main() -> None:
        nonlocal mp
        await pair.a.start()
        mp = await pair.connect(ctrl_loss_tmo=2.0)
        monkeypatch.setattr(multipath, "_namespace_ids", slow_ids)
        try:
            await pair.a.stop()
            write = asyncio.create_task(mp.write(1, 0, b"w" * BS))
            await asyncio.sleep(0.3)
            await pair.b.start()
            await until(lambda: mp.describe_paths()[1]["state"] == "refused")
            with pytest.raises((QueueLost, ConnectionError)):
                await write
            assert pair.writes(pair.b) == 0
        finally:
            await mp.close()
            await pair.stop()
    mp: Any = None
    run(main())


def test_connect_fails_when_no_path_connects(tmp_path: Path) -> None:
    """Every path down: one ConnectError naming each path and its error; nothing is left
    running (no controller stays referenced by a timer or task)."""
    pair = Pair(tmp_path)

    async def main() -> None:
        before = asyncio.all_tasks()
        # Controllers an earlier test left for the collector are not this test's to judge
        earlier = weakref.WeakSet(o for o in gc.get_objects() if isinstance(o, Controller))
        with pytest.raises(ConnectError) as err:
            await pair.connect()
        message = str(err.value)
        del err  # its traceback holds the connect's frames
        assert message.startswith(f"no path to {NQN} connects: 127.0.0.1:{pair.ports[0]}: ")
        assert f"; 127.0.0.1:{pair.ports[1]}: " in message and "\n" not in message
        await asyncio.sleep(0.05)  # the cancelled reconnect tasks end
        assert asyncio.all_tasks() == before
        with pytest.raises(OSError):  # a single path too leaves nothing behind
            await Controller.connect(params(pair.ports[0]))
        gc.collect()
        assert not [o for o in gc.get_objects() if isinstance(o, Controller) and o not in earlier]
    run(main())


@pytest.mark.parametrize("late", [False, True])
def test_overlapping_cntlid_ranges_are_warned_about(tmp_path: Path, late: bool) -> None:
    """Both targets give controller id 1 (the same cntlid range): the connection works, with a
    warning naming both paths, whether the second path is there at connect time or joins."""
    pair = Pair(tmp_path)
    pair.b = TargetService(target_config(pair.ports[1], pair.file, "inaccessible", (1, 99)))

    async def main() -> None:
        await pair.a.start()
        if not late:
            await pair.b.start()
        with structlog.testing.capture_logs() as logs:
            mp = await pair.connect()
            try:
                if late:
                    await pair.b.start()
                    await until(lambda: _path_states(mp)[1] == ("live", {"1": "inaccessible"}))
                await mp.write(1, 0, b"c" * BS)
            finally:
                await mp.close()
                await pair.stop()
        warned = [e for e in logs if e["event"].startswith("two paths have the same controller id")]
        assert [(e["cntlid"], e["paths"]) for e in warned] == [(1, [f"127.0.0.1:{p}" for p in pair.ports])]
    run(main())


@pytest.mark.parametrize("text, expected", [
    ("10.0.0.1", ("10.0.0.1", 4420)), ("10.0.0.1:4421", ("10.0.0.1", 4421)),
    ("[fe80::1]:4422", ("fe80::1", 4422)), ("fe80::1", ("fe80::1", 4420)),
])
def test_parse_path(text: str, expected: tuple[str, int]) -> None:
    assert parse_path(text, 4420) == expected


@pytest.mark.parametrize("text", ["host:0", "host:x", ":4420", "[::1]x"])
def test_parse_path_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        parse_path(text, 4420)
