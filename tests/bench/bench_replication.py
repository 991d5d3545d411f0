"""Benchmark (not a test): what replication costs a host's writes, against the floor the
round trips set, and how fast a resync copies.

On loopback, `blockd target` processes (tests/replication/nodes.py) that all run for the whole
benchmark: a plain primary (0 replicas), a primary with one replica and one with two, every
replica a target of its own. Before each measurement of a primary its volume is written whole
(warm: every region's write-intent bit is set, as on a volume in use; the first write to a region
whose bit is clear also waits for a FUA write of the bitmap, and a region idle for
``mirror.IDLE_SWEEPS`` sweeps loses its bit); the share of the writes the compiled lane took is
shown. Every round measures, one after the other for
``--seconds`` each, 4 KiB random writes from blockd's host library (in this process, on uvloop
as the daemons) at QD1 to the three primaries, the floor's (b) below, and QD32 to the three
primaries. For each: IOPS, mean and p99 latency, the CPU time per write of this process, of the
primary and of the replicas (µs, from /proc/<pid>/stat), and the context switches per write of
the primary and of the replicas (summed over /proc/<pid>/task/*/status while connected: the
voluntary ones are sleeps a wake-up ended). Medians over the rounds.

**The floor** (same rounds, same replica processes): a replicated write at QD1 is the host's
round trip to the primary plus the primary's round trip to its replicas, in series; the best a
protocol-C mirror can do is to overlap the primary's local ``pwrite`` with the replicas' round
trip:

    floor = (a) + (b) - t_pwrite

(a) the unreplicated QD1 write; (b) QD1 4 KiB writes from the primary's side of the link alone:
``initiator.replica.open_remote`` (the link's own kind of connection) to the replica targets
(their data area), each completion's callback sending the next write as the compiled lane's
does (no future), to one replica (b1) and to two at once (b2); t_pwrite a 4 KiB ``os.pwrite``
into a warm file in the same directory. The summary gives (c)/(a) and (c)/floor, (c) the
replicated write.

With ``--before DIR`` (another tree's ``.venv/bin``, e.g. main's) that tree's daemons run too
and are measured in the same rounds, the order alternating per round (the host and the floor's
client are this tree's). The machine is shared and noisy: compare within a run. Run under the
benchmark lock:

    flock /tmp/blockd-bench.lock .venv/bin/python tests/bench/bench_replication.py [--seconds 2] \\
        [--rounds 5] [--before /work/main/.venv/bin] [--no-resync] [--cases a,b1,c1]
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from blockd import eventloop  # noqa: E402
from initiator.replica import RemoteNamespace, open_remote  # noqa: E402
from tests.replication import nodes  # noqa: E402
from tests.replication.nodes import HOSTNQN, NQN, RNQN, Node, all_in_sync, connect  # noqa: E402

DEVICE = 64 << 20
"""Each volume (the primaries' data area is this less their metadata)."""
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def switches(pid: int) -> tuple[int, int]:
    """(voluntary, involuntary) context switches of every thread of ``pid`` alive now."""
    vol = invol = 0
    for status in glob.glob(f"/proc/{pid}/task/*/status"):
        try:
            with open(status) as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches"):
                        vol += int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches"):
                        invol += int(line.split()[1])
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return vol, invol


async def writes(node: Node, depth: int, seconds: float, span: int,
                 pids: list[int]) -> tuple[int, list[float], list[tuple[int, int]]]:
    """Random 4 KiB writes at ``depth`` for ``seconds``: (count, latencies in µs, the context
    switches of each of ``pids`` meanwhile, counted while connected: a queue's thread ends with
    its connection)."""
    ctrl = await connect(node)
    before = [switches(pid) for pid in pids]
    rng = random.Random(depth)
    data = os.urandom(4096)
    lat: list[float] = []
    stop = time.monotonic() + seconds

    async def worker() -> None:
        while time.monotonic() < stop:
            t = time.perf_counter()
            await ctrl.write_bytes(1, rng.randrange(span // 4096) * 4096, data)
            lat.append((time.perf_counter() - t) * 1e6)
    await asyncio.gather(*(worker() for _ in range(depth)))
    used = [(now[0] - was[0], now[1] - was[1]) for now, was in zip(map(switches, pids), before)]
    await ctrl.close()
    return len(lat), lat, used


async def fill(node: Node) -> None:
    """Write the whole data area once, 1 MiB at a time."""
    ctrl = await connect(node)
    chunk = os.urandom(1 << 20)
    for offset in range(0, node.data - (1 << 20) + 1, 1 << 20):
        await ctrl.write_bytes(1, offset, chunk)
    await ctrl.close()


async def replica_trip(replicas: list[Node], seconds: float,
                       pids: list[int]) -> tuple[list[float], list[tuple[int, int]]]:
    """(b): QD1 4 KiB random writes in the data area, through the replica link's own kind of
    connection (``open_remote``), to every node of ``replicas`` at once, the next one sent from
    the completion callback of the last replica to answer (as ``MirrorWrite.done``, no future):
    the latencies, µs, and the context switches of each of ``pids`` meanwhile."""
    ios: list[RemoteNamespace] = [await open_remote("tcp", "127.0.0.1", r.port, RNQN, 1, HOSTNQN, 10.0)
                                  for r in replicas]
    span = replicas[0].data
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[None] = loop.create_future()
    rng = random.Random(7)
    data = os.urandom(4096)
    lat: list[float] = []
    pending = 0
    began = 0

    def send() -> None:
        nonlocal pending, began
        offset = rng.randrange(span // 4096) * 4096
        pending = len(ios)
        began = time.perf_counter_ns()
        for io in ios:
            io.submit_write(offset, data, False, done)

    def done(exc: BaseException | None) -> None:
        nonlocal pending
        if exc is not None:
            if not ended.done():
                ended.set_exception(exc)
            return
        pending -= 1
        if pending:
            return
        lat.append((time.perf_counter_ns() - began) / 1e3)
        if time.monotonic() < stop:
            send()
        else:
            ended.set_result(None)
    before = [switches(pid) for pid in pids]
    stop = time.monotonic() + seconds
    send()
    await ended
    used = [(now[0] - was[0], now[1] - was[1]) for now, was in zip(map(switches, pids), before)]
    for io in ios:
        await io.close()
    return lat, used


class PwriteProbe:
    """t_pwrite: 4 KiB ``os.pwrite`` at random offsets of a warm file (written whole once), in
    the directory the daemons' files are in."""

    def __init__(self, base: Path) -> None:
        self.path = base / "pwrite.img"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        chunk = os.urandom(1 << 20)
        for offset in range(0, DEVICE, 1 << 20):
            os.pwrite(self.fd, chunk, offset)
        self.rng = random.Random(3)

    def mean_us(self, count: int = 5000) -> float:
        data = os.urandom(4096)
        offsets = [self.rng.randrange(DEVICE // 4096) * 4096 for _ in range(count)]
        t = time.perf_counter_ns()
        for offset in offsets:
            os.pwrite(self.fd, data, offset)
        return (time.perf_counter_ns() - t) / 1e3 / count

    def close(self) -> None:
        os.close(self.fd)
        self.path.unlink()


class Tree:
    """One tree's daemons (``bin_dir``'s blockd), all running for the whole run: a plain
    primary, a primary with one replica and one with two, each replica its own target (the
    floor's (b) writes to them directly, in their data area: their metadata stays the
    primaries')."""

    def __init__(self, base: Path, name: str, bin_dir: Path) -> None:
        self.name, self.bin_dir = name, bin_dir
        tag = "b" if name == "before" else "t"
        self.replicas = [Node(base, f"{tag}r{i}", DEVICE) for i in range(3)]
        self.primaries = [Node(base, f"{tag}p{n}", DEVICE) for n in range(3)]
        self.of = {0: [], 1: self.replicas[:1], 2: self.replicas[1:]}

    def start(self) -> None:
        nodes.BIN = self.bin_dir
        for r in self.replicas:
            r.start()
        for n, p in enumerate(self.primaries):
            p.start(self.of[n], nqn=NQN)
        for n, p in enumerate(self.primaries):
            if n:
                p.wait_states(all_in_sync(), timeout=120)
            eventloop.run(fill(p))  # every region written once: its bit is set (warm)

    def stop(self) -> None:
        for node in (*self.primaries, *self.replicas):
            node.stop()

    def case(self, kind: str, n: int, depth: int, seconds: float) -> dict[str, float]:
        """One measurement: ``kind`` "host" (the host's writes to the primary with ``n``
        replicas) or "link" ((b): the link's writes to that primary's ``n`` replicas alone)."""
        reps = self.of[n]
        daemons = ([self.primaries[n]] if kind == "host" else []) + reps
        if kind == "host":  # written whole again: a region idle for mirror.IDLE_SWEEPS sweeps loses its bit
            eventloop.run(fill(self.primaries[n]))
        lane0 = self.primaries[n].namespace()["compiled_writes"] if kind == "host" and n else 0
        pids = [d.proc.pid for d in daemons]  # type: ignore[union-attr]
        cpu0 = [cpu_seconds(pid) for pid in pids]
        own0 = time.process_time()
        if kind == "host":
            count, lat, sw = eventloop.run(writes(self.primaries[n], depth, seconds, self.primaries[n].data, pids))
        else:
            lat, sw = eventloop.run(replica_trip(reps, seconds, pids))
            count = len(lat)
        own = time.process_time() - own0
        used = [cpu_seconds(pid) - c for pid, c in zip(pids, cpu0)]
        lane = self.primaries[n].namespace()["compiled_writes"] - lane0 if kind == "host" and n else 0
        lat.sort()
        primary = 1 if kind == "host" else 0
        return {"iops": count / seconds, "mean": statistics.mean(lat), "p99": lat[int(len(lat) * 0.99)],
                "lane": lane / count, "cpu_client": own / count * 1e6,
                "cpu_primary": used[0] / count * 1e6 if primary else 0.0,
                "cpu_replicas": sum(used[primary:]) / count * 1e6,
                "vol_primary": sw[0][0] / count if primary else 0.0,
                "invol_primary": sw[0][1] / count if primary else 0.0,
                "vol_replicas": sum(s[0] for s in sw[primary:]) / count,
                "invol_replicas": sum(s[1] for s in sw[primary:]) / count}


CASES = (("a", "host", 0, 1), ("b1", "link", 1, 1), ("c1", "host", 1, 1), ("b2", "link", 2, 1),
         ("c2", "host", 2, 1), ("q0", "host", 0, 32), ("q1", "host", 1, 32), ("q2", "host", 2, 32))
"""Every round measures these, in this order, for every tree: (name, kind, replicas, QD)."""


def med(runs: list[float]) -> float:
    return statistics.median(runs)


def floor_table(trees: list[Tree], got: dict[str, list[dict[str, Any]]]) -> None:
    print("Floor model, QD1 mean latency µs (medians over the rounds): (a) unreplicated, (b) the primary's "
          "link to its replicas alone, t_pwrite, floor = (a) + (b) - t_pwrite, (c) replicated; the ratios are "
          "medians of each round's ratio\n")
    print("| tree | replicas | (a) | (b) | t_pwrite | floor | (c) | (c)/(a) | (c)/floor | floor/(a) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for tree in trees:
        rounds = got[tree.name]
        for n in (1, 2):
            if not all(k in rounds[0] for k in ("a", f"b{n}", f"c{n}")):
                continue  # (--cases left a part out)
            a = [g["a"]["mean"] for g in rounds]
            f = [g["a"]["mean"] + g[f"b{n}"]["mean"] - g["pwrite"] for g in rounds]
            c = [g[f"c{n}"]["mean"] for g in rounds]
            print(f"| {tree.name} | {n} | {med(a):.0f} | {med([g[f'b{n}']['mean'] for g in rounds]):.0f} | "
                  f"{med([g['pwrite'] for g in rounds]):.1f} | {med(f):.0f} | {med(c):.0f} | "
                  f"{med([x / y for x, y in zip(c, a)]):.2f}x | {med([x / y for x, y in zip(c, f)]):.2f}x | "
                  f"{med([x / y for x, y in zip(f, a)]):.2f}x |")


def cases_table(trees: list[Tree], got: dict[str, list[dict[str, Any]]]) -> None:
    print("\nEvery case, medians over the rounds: IOPS, latency µs, CPU µs per write (this process: the "
          "host or the link's client; the primary; the replicas together), context switches per write "
          "voluntary+involuntary (the primary; the replicas together)\n")
    print("| tree | case | replicas | QD | IOPS | mean µs | p99 µs | lane took | CPU client | CPU primary "
          "| CPU replicas | switches primary | switches replicas |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for tree in trees:
        for name, kind, n, depth in CASES:
            if name not in got[tree.name][0]:
                continue
            m = {k: med([g[name][k] for g in got[tree.name]]) for k in got[tree.name][0][name]}
            what = "host -> primary" if kind == "host" else "link -> replicas"
            print(f"| {tree.name} | {name}: {what} | {n} | {depth} | {m['iops']:,.0f} | {m['mean']:,.0f} | "
                  f"{m['p99']:,.0f} | {m['lane']:.0%} | {m['cpu_client']:.0f} | {m['cpu_primary']:.0f} | {m['cpu_replicas']:.0f} | "
                  f"{m['vol_primary']:.2f}+{m['invol_primary']:.2f} | "
                  f"{m['vol_replicas']:.2f}+{m['invol_replicas']:.2f} |")


def resync_rate(base: Path) -> None:
    """A replica stopped, the whole data area written, the replica back: the time until it is
    in sync, and the primary's CPU per MB copied."""
    replicas = [Node(base, "resync-r", DEVICE)]
    replicas[0].start()
    primary = Node(base, "resync", DEVICE)
    try:
        primary.start(replicas, nqn=NQN)
        primary.wait_states(all_in_sync(settled=True), timeout=120)
        replicas[0].stop()
        eventloop.run(fill(primary))
        before = primary.replicas()[0]["resynced_bytes"]
        cpu0 = cpu_seconds(primary.proc.pid)  # type: ignore[union-attr]
        replicas[0].start()
        t = time.monotonic()
        reps = primary.wait_states(all_in_sync(), timeout=600)
        elapsed = time.monotonic() - t
        copied = reps[0]["resynced_bytes"] - before
        cpu = cpu_seconds(primary.proc.pid) - cpu0  # type: ignore[union-attr]
        print(f"\nresync: {copied / 1e6:.0f} MB in {elapsed:.1f} s from the replica's start "
              f"(its start-up included): {copied / elapsed / 1e6:.1f} MB/s with resync_rate 1GiB; "
              f"primary CPU {cpu * 1e3 / (copied / 1e6):.2f} ms per MB copied")
    finally:
        primary.stop()
        replicas[0].stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="per case and round (default 2)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    parser.add_argument("--before", help="directory of another tree's blockd (e.g. main's .venv/bin), "
                                         "measured in the same rounds, the order alternating")
    parser.add_argument("--no-resync", action="store_true", help="skip the resync rate")
    parser.add_argument("--cases", default=",".join(c[0] for c in CASES),
                        help="the cases to run, of " + ", ".join(c[0] for c in CASES) + " (default: all)")
    args = parser.parse_args()
    cases = [c for c in CASES if c[0] in args.cases.split(",")]
    with tempfile.TemporaryDirectory(prefix="blockd-bench-repl-") as tmp:
        base = Path(tmp)
        trees = [Tree(base, "this tree", nodes.BIN)] + ([Tree(base, "before", Path(args.before))] if args.before else [])
        got: dict[str, list[dict[str, Any]]] = {tree.name: [] for tree in trees}
        probe = PwriteProbe(base)
        try:
            for tree in trees:
                tree.start()
            for rnd in range(args.rounds):
                for tree in (trees if rnd % 2 == 0 else trees[::-1]):
                    g: dict[str, Any] = {"pwrite": probe.mean_us()}
                    for name, kind, n, depth in cases:
                        g[name] = tree.case(kind, n, depth, args.seconds)
                    got[tree.name].append(g)
                    print(f"round {rnd + 1}, {tree.name}: " + ", ".join(
                        f"{name} {g[name]['mean']:,.0f} µs" if depth == 1 else f"{name} {g[name]['iops']:,.0f} IOPS"
                        for name, _, _, depth in cases) + f", pwrite {g['pwrite']:.1f} µs", flush=True)
        finally:
            probe.close()
            for tree in trees:
                tree.stop()
        print(f"\n{args.seconds:g} s per case, {args.rounds} rounds, the trees alternating\n")
        floor_table(trees, got)
        cases_table(trees, got)
        if not args.no_resync:
            nodes.BIN = trees[0].bin_dir
            resync_rate(base)


if __name__ == "__main__":
    main()
