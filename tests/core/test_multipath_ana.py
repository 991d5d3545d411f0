"""The host's multipath as the kernel's (issue 40): a path's ANA log is read again on every
reconnect before it takes I/O, ANA statuses and events cost one log read per path, the "change"
state holds commands for ANATT, and planned switch-over / switch-back under load."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from initiator.errors import NvmeError
from initiator.multipath import MultipathController
from protocol.status import ANA_STATUSES, Status
from target.service import TargetService

from .conftest import NQN, run, until
from .test_multipath import BS, Pair, target_config


def ana_errors(service: TargetService) -> int:
    """The ANA statuses (0x301-0x303, with or without DNR) ``service``'s controllers answered."""
    return sum(n for ctrl in service.target.controllers.values() for status, n in ctrl.counters.errors.items()
               if isinstance(status, int) and status & 0x7FF in ANA_STATUSES)


def test_a_path_back_from_a_restart_shows_its_new_state(tmp_path: Path) -> None:
    """The issue's case: A (optimized) dies, B is promoted, A comes back as the standby (its group
    inaccessible). The host must read A's ANA log on the reconnect: listed inaccessible, never
    chosen again, so no write takes a 0x302 round trip to A when the routes are next chosen."""
    pair = Pair(tmp_path)

    async def main() -> None:
        await pair.start()
        mp = await pair.connect()
        try:
            await mp.write(1, 0, b"a" * BS)
            await pair.a.stop()
            await pair.b.op_ana_set("optimized")
            # no I/O while A is down (an idle mount): nothing fails on A to make the host look
            await until(lambda: mp.describe_paths()[1]["ana"] == {"1": "optimized"})
            pair.a = TargetService(target_config(pair.ports[0], pair.file, "inaccessible", (1, 99)))
            await pair.a.start()
            await until(lambda: mp.paths[0].state == "live" and mp.paths[0].reconnects == 1)
            await until(lambda: mp.describe_paths()[0]["ana"] == {"1": "inaccessible"})
            # the routes are chosen again (B's group changes twice): A must not be taken
            await pair.b.op_ana_set("non-optimized")
            await pair.b.op_ana_set("optimized")
            await until(lambda: mp.describe_paths()[1]["ana"] == {"1": "optimized"})
            for i in range(8):
                await mp.write(1, 1 + i, bytes([i]) * BS)
            assert pair.writes(pair.a) == 0 and ana_errors(pair.a) == 0 and mp.ana_retries == 0
            assert await mp.read(1, 0, 2) == b"a" * BS + bytes(BS)
        finally:
            await mp.close()
            await pair.stop()
    run(main())


class Writers:
    """``n`` writers keeping one write each in flight on ``mp`` until stopped, remembering
    what was acknowledged (what must read back) and failing on any error."""

    def __init__(self, mp: MultipathController, n: int, blocks: int = 512) -> None:
        self.mp = mp
        self.acked: dict[int, bytes] = {}
        self.count = 0
        self.stop = asyncio.Event()
        self.tasks = [asyncio.create_task(self._run(k, blocks)) for k in range(n)]

    async def _run(self, k: int, blocks: int) -> None:
        i = 0
        while not self.stop.is_set():
            lba = (k * 997 + i) % blocks
            data = os.urandom(BS)
            await self.mp.write(1, lba, data)
            self.acked[lba] = data
            self.count += 1
            i += 1

    async def more(self, n: int) -> None:
        """Wait until ``n`` more writes were acknowledged (the load goes on)."""
        target = self.count + n
        await until(lambda: self.count >= target or any(t.done() for t in self.tasks), 20)
        for task in self.tasks:
            if task.done():
                task.result()  # a writer that ended early raises its error here

    async def finish(self) -> None:
        self.stop.set()
        await asyncio.gather(*self.tasks)  # raises if a write failed

    async def verify(self) -> None:
        for lba, data in self.acked.items():
            assert await self.mp.read(1, lba, 1) == data


def sends_on(path: Any) -> dict[int, int]:
    """Count, per command (its SQE buffer, the same object however often the multipath layer
    sends it), its sends on ``path`` from now on."""
    sends: dict[int, int] = {}
    keep: list[Any] = []  # the SQEs stay alive, so their ids stay theirs
    real_submit = path.submit_io

    def counting_submit(sqe: Any, *args: Any) -> None:
        keep.append(sqe)
        sends[id(sqe)] = sends.get(id(sqe), 0) + 1
        real_submit(sqe, *args)

    path.submit_io = counting_submit
    return sends


def test_commands_in_flight_at_a_change_make_one_retry(tmp_path: Path) -> None:
    """A's group turns inaccessible without the host hearing of it (its event masked) under 32
    writers, all on A: of the 0x302 statuses that come back, the first is the transition's one
    retry (A's log read once, namespace 1 not sent to A meanwhile); the others are requeued with
    it, counting no retry of their own. No command goes to A twice, none reaches a writer."""
    pair = Pair(tmp_path)

    async def main() -> None:
        await pair.start()
        mp = await pair.connect()
        a = mp.paths[0]
        try:
            await pair.b.op_ana_set("optimized")  # both optimized: numa keeps to A, the first
            await until(lambda: mp.describe_paths()[1]["ana"] == {"1": "optimized"})
            sends = sends_on(a)
            load = Writers(mp, 32)
            await load.more(100)
            reads = mp.ana_reads[a]
            next(iter(pair.a.target.controllers.values())).ana_event_masked = True
            await pair.a.op_ana_set("inaccessible")
            await until(lambda: mp.describe_paths()[0]["ana"] == {"1": "inaccessible"})
            await load.more(200)
            await load.finish()
            statuses = ana_errors(pair.a)
            assert statuses > 1  # several commands were in flight on A at the change
            shown = mp.describe()
            assert shown["ana_retries"] == 1, f"{shown['ana_retries']} retries for one transition"
            assert shown["ana_requeued"] == statuses - 1, shown
            assert [(p["ana_retries"], p["ana_requeued"]) for p in shown["paths"]] == [
                ({"1": 1}, {"1": statuses - 1}), ({}, {})]
            assert mp.ana_reads[a] == reads + 1
            assert max(sends.values()) == 1, "a command was sent to A again after its ANA status"
            await load.verify()
        finally:
            await mp.close()
            await pair.stop()
    run(main())


class HeldOnA:
    """A and B both optimized (numa: commands go to A); A's commands then held on the host
    (``sent``: each one's ``done``, for the test to answer) and A's ANA log reads held until
    ``release`` (``reading`` set when one starts): to time the answers against the read."""

    def __init__(self, pair: Pair, mp: MultipathController) -> None:
        self.pair, self.mp, self.a = pair, mp, mp.paths[0]
        self.sent: list[Any] = []
        self.reading = asyncio.Event()
        self.release = asyncio.Event()
        self.reads = 0
        """A's log reads before the hold."""
        self._real = self.a.submit_io, self.a.get_log_page

    async def start(self, writes: int) -> list[asyncio.Task[None]]:
        """Hold A, then send ``writes`` writes (blocks 0..writes-1), all held on A."""
        await self.pair.b.op_ana_set("optimized")
        await until(lambda: self.mp.describe_paths()[1]["ana"] == {"1": "optimized"})
        self.reads = self.mp.ana_reads[self.a]
        self.a.submit_io, self.a.get_log_page = self._held_submit, self._slow_log  # type: ignore[method-assign]
        tasks = [asyncio.create_task(self.mp.write(1, i, bytes([i]) * BS)) for i in range(writes)]
        await until(lambda: len(self.sent) == writes)
        return tasks

    def _held_submit(self, sqe: Any, data_out: Any, data_in: Any, done: Any) -> None:
        self.sent.append(done)

    async def _slow_log(self, *args: Any, **kw: Any) -> bytes:
        self.reading.set()
        await self.release.wait()
        return await self._real[1](*args, **kw)

    def restore(self) -> None:
        self.a.submit_io, self.a.get_log_page = self._real  # type: ignore[method-assign]
        self.release.set()


def test_statuses_that_come_back_while_the_events_read_is_under_way_stay_off_the_path(tmp_path: Path) -> None:
    """Eight writes sent on A (held on the host) are in flight when A's group turns inaccessible;
    A's event comes first and its log read is under way (held) when they come back 0x302. Not
    one goes back to A (its state there is still the old "optimized" until the read answers):
    all go to B. The event's read is the transition's only one, and no status counts a retry
    (they were sent before it started)."""
    pair = Pair(tmp_path)

    async def main() -> None:
        await pair.start()
        mp = await pair.connect()
        held = HeldOnA(pair, mp)
        try:
            writes = await held.start(8)
            await pair.a.op_ana_set("inaccessible")  # its event starts the read
            await asyncio.wait_for(held.reading.wait(), 5)
            for done in held.sent[:8]:
                done(NvmeError(Status.ANA_INACCESSIBLE, "write"))
            await until(lambda: pair.writes(pair.b) == 8 or len(held.sent) > 8)
            assert len(held.sent) == 8, f"{len(held.sent) - 8} command(s) sent to A again while its log was read"
            held.release.set()
            await asyncio.wait_for(asyncio.gather(*writes), 10)
            await until(lambda: mp.describe_paths()[0]["ana"] == {"1": "inaccessible"})
            assert (mp.ana_reads[held.a], mp.ana_retries, mp.ana_requeued) == (held.reads + 1, 0, 8)
        finally:
            held.restore()
            await mp.close()
            await pair.stop()
    run(main())


def test_statuses_that_come_back_during_the_read_ask_for_none(tmp_path: Path) -> None:
    """Eight writes sent on A (held on the host, to time their answers) come back 0x302 one by
    one while A's log is being read: the first is the transition's retry and asks for the read,
    the seven later ones were sent before it started: requeued, no read, no retry. Each goes to
    B, once."""
    pair = Pair(tmp_path)

    async def main() -> None:
        await pair.start()
        mp = await pair.connect()
        held = HeldOnA(pair, mp)
        try:
            writes = await held.start(8)
            held.sent[0](NvmeError(Status.ANA_INACCESSIBLE, "write"))
            await asyncio.wait_for(held.reading.wait(), 5)  # the read is under way
            for done in held.sent[1:]:
                done(NvmeError(Status.ANA_INACCESSIBLE, "write"))
            held.release.set()
            await asyncio.wait_for(asyncio.gather(*writes), 10)
            assert (mp.ana_reads[held.a], mp.ana_retries, mp.ana_requeued) == (held.reads + 1, 1, 7)
            assert pair.writes(pair.b) == 8 and len(held.sent) == 8
        finally:
            held.restore()
            await mp.close()
            await pair.stop()
    run(main())


def test_a_transition_longer_than_anatt_resets_the_path(tmp_path: Path, monkeypatch: Any) -> None:
    """A enters "change" (B inaccessible): a write waits, held, not failed. A then becomes
    optimized but its event is lost: after twice ANATT the host resets A, reads its log on the
    reconnect and the held write completes on A."""
    monkeypatch.setattr("target.controller.ANATT_SECONDS", 1)
    pair = Pair(tmp_path)

    async def main() -> None:
        await pair.start()
        mp = await pair.connect()
        a = mp.paths[0]
        try:
            assert a.identity.anatt == 1
            await pair.a.op_ana_set("change")
            await until(lambda: mp.describe_paths()[0]["ana"] == {"1": "change"})
            next(iter(pair.a.target.controllers.values())).ana_event_masked = True
            write = asyncio.create_task(mp.write(1, 0, b"t" * BS))
            await pair.a.op_ana_set("optimized")  # the host does not hear of it
            assert not write.done() and a.reconnects == 0
            await asyncio.wait_for(write, 10)
            assert a.reconnects == 1 and mp.describe_paths()[0]["ana"] == {"1": "optimized"}
            assert (pair.writes(pair.a), pair.writes(pair.b)) == (1, 0)
        finally:
            await mp.close()
            await pair.stop()
    run(main())


def test_planned_switch_over_and_back_under_load(tmp_path: Path) -> None:
    """As ``blockctl target ana demote`` on A then ``promote`` on B, and back, under four
    writers: no write fails, the load goes on after each switch on the new primary, each
    switch costs at most one ANA-status retry (namespace 1 on the demoted path; the other
    commands in flight are requeued with it), and every acknowledged write reads back."""
    pair = Pair(tmp_path)

    async def main() -> None:
        await pair.start()
        mp = await pair.connect()
        try:
            load = Writers(mp, 4)
            await load.more(50)
            retries = []
            for old, new in ((pair.a, pair.b), (pair.b, pair.a)):
                before = mp.ana_retries
                await old.op_ana_set("inaccessible")  # demote
                await new.op_ana_set("optimized")     # promote
                on_new = pair.writes(new)
                await until(lambda: pair.writes(new) >= on_new + 100, 20)
                await load.more(50)
                retries.append(mp.ana_retries - before)
            await load.finish()
            assert all(n <= 1 for n in retries), retries
            assert mp.path_retries == 0
            await load.verify()
        finally:
            await mp.close()
            await pair.stop()
    run(main())


def test_each_demotion_costs_at_most_one_retry_per_path(tmp_path: Path) -> None:
    """16 writers while A and B swap the primary role eight times (demote the old, promote the
    new), the old one's event masked on every other swap (the statuses then come first): no
    write fails; per path, namespace 1's ANA-status retries are at most its demotions (4
    each), never more than its log reads since the connect; every ANA status answered is a
    retry or a command requeued with one; every acknowledged write reads back."""
    pair = Pair(tmp_path)

    async def main() -> None:
        await pair.start()
        mp = await pair.connect()
        try:
            reads = dict(mp.ana_reads)
            load = Writers(mp, 16)
            await load.more(50)
            for i in range(8):
                old, new = (pair.a, pair.b) if i % 2 == 0 else (pair.b, pair.a)
                if i % 4 >= 2:
                    next(iter(old.target.controllers.values())).ana_event_masked = True
                await old.op_ana_set("inaccessible")  # demote
                await new.op_ana_set("optimized")     # promote
                on_new = pair.writes(new)
                await until(lambda: pair.writes(new) >= on_new + 50, 20)
            await load.finish()
            for path in mp.paths:
                retries = mp.ana_retries_on[path][1]
                assert retries <= min(4, mp.ana_reads[path] - reads[path]), (retries, mp.describe())
            assert mp.ana_retries + mp.ana_requeued == ana_errors(pair.a) + ana_errors(pair.b), mp.describe()
            await load.verify()
        finally:
            await mp.close()
            await pair.stop()
    run(main())


def test_list_and_metrics_show_each_paths_real_state(tmp_path: Path) -> None:
    """The daemon's list and its metrics: the policy, each path's ANA state, log reads and, per
    namespace, its ANA-status retries and requeued commands; a path that went down shows
    "unknown" until its log is read on the new association."""
    from initiator.config import parse as parse_initiator_config
    from initiator.daemon import InitiatorDaemon

    from .test_initiator_metrics import _scrape
    from .conftest import free_port

    pair = Pair(tmp_path)
    mport = free_port()
    conf = parse_initiator_config({"metrics": {"enabled": True, "port": mport}})

    def shown(fams: Any) -> dict[str, str]:
        return {s.labels["path"]: s.labels["state"] for s in fams["blockd_initiator_path_ana_state"].samples
                if s.value == 1}

    def counts(fams: Any, name: str) -> dict[tuple[str, str], float]:
        """blockd_initiator_path_<name>_total per (path, nsid)."""
        return {(s.labels["path"], s.labels["nsid"]): s.value for s in fams[f"blockd_initiator_path_{name}"].samples
                if s.name.endswith("_total")}

    async def main() -> None:
        await pair.start()
        daemon = InitiatorDaemon(str(tmp_path / "initiator.sock"), conf.metrics)
        await daemon.start()
        a, b = (f"127.0.0.1:{p}" for p in pair.ports)
        try:
            await daemon.op_connect(name="vol", nqn=NQN, paths=[a, b], iopolicy="round-robin",
                                    hostnqn="nqn.2014-08.org.nvmexpress:uuid:1")
            (conn,) = (await daemon.op_list())["connections"]
            assert (conn["iopolicy"], conn["ana_retries"], conn["path_retries"]) == ("round-robin", 0, 0)
            assert [(p["ana"], p["ana_reads"]) for p in conn["paths"]] == [
                ({"1": "optimized"}, 1), ({"1": "inaccessible"}, 1)]
            fams = await asyncio.to_thread(_scrape, mport)
            assert shown(fams) == {a: "optimized", b: "inaccessible"}
            # A turns inaccessible unheard of (its event masked): a write takes the transition's
            # retry (0x302), waits, and goes to B once B is promoted
            next(iter(pair.a.target.controllers.values())).ana_event_masked = True
            await pair.a.op_ana_set("inaccessible")
            write = asyncio.create_task(daemon.connections["vol"].write(1, 0, b"m" * BS))
            await until(lambda: daemon.connections["vol"].describe_paths()[0]["ana"] == {"1": "inaccessible"})
            await pair.b.op_ana_set("optimized")
            await asyncio.wait_for(write, 10)
            fams = await asyncio.to_thread(_scrape, mport)
            assert counts(fams, "ana_retries") == {(a, "1"): 1.0, (b, "1"): 0.0}
            assert counts(fams, "ana_requeued") == {(a, "1"): 0.0, (b, "1"): 0.0}
            await pair.a.stop()
            await until(lambda: daemon.connections["vol"].describe_paths()[0]["state"] == "reconnecting")
            fams = await asyncio.to_thread(_scrape, mport)
            assert shown(fams) == {a: "unknown", b: "optimized"}
            reads = [s.value for s in fams["blockd_initiator_path_ana_log_reads"].samples
                     if s.name.endswith("_total") and s.labels["path"] == a]
            assert reads == [2.0]  # at connect, and after the retry
        finally:
            await daemon.stop()
            await pair.stop()
    run(main())


@pytest.mark.parametrize("state", ["inaccessible", "persistent-loss", "change"])
@pytest.mark.parametrize("iopolicy", ["numa", "round-robin", "queue-depth"])
def test_a_path_in_a_state_without_io_takes_none(tmp_path: Path, state: str, iopolicy: str) -> None:
    """A (listed first) in ``state``, B only non-optimized: every write goes to B, none to A,
    whatever the policy."""
    pair = Pair(tmp_path)
    pair.a = TargetService(target_config(pair.ports[0], pair.file, state, (1, 99)))
    pair.b = TargetService(target_config(pair.ports[1], pair.file, "non-optimized", (100, 199)))

    async def main() -> None:
        await pair.start()
        mp = await pair.connect(iopolicy=iopolicy)
        try:
            assert [p["ana"] for p in mp.describe_paths()] == [{"1": state}, {"1": "non-optimized"}]
            await asyncio.gather(*(mp.write(1, i, b"s" * BS) for i in range(16)))
            assert (pair.writes(pair.a), pair.writes(pair.b), ana_errors(pair.a)) == (0, 16, 0)
        finally:
            await mp.close()
            await pair.stop()
    run(main())
