"""Benchmark (not a test): what replication costs a host's writes, and how fast a resync copies.

On loopback, one `blockd target` primary and up to two replica targets (tests/replication/nodes.py):
4 KiB random writes from blockd's host library at queue depth 1 and 32, to a plain namespace (0
replicas) and to a replicated one with 1 and 2 replicas, after the whole volume was written once
(warm: every region's write-intent bit is set, as on a volume in use; the first write to a
region whose bit is clear also waits for a FUA write of the bitmap). For each: IOPS, mean and p99 latency,
and the CPU time per write of the primary and of every blockd process together (µs, from
/proc/<pid>/stat). Then the resync rate: a replica stopped, the whole data area written, the
replica back, the time from its return until it is in sync (its ``resynced_bytes`` over that).

The machine is shared and noisy: compare the rows of one run (the ratios), not runs.
Run under the benchmark lock:

    flock /tmp/blockd-bench.lock .venv/bin/python tests/bench/bench_replication.py [--seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from tests.replication.nodes import NQN, Node, all_in_sync, connect  # noqa: E402

DEVICE = 256 << 20
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


async def writes(node: Node, depth: int, seconds: float, span: int) -> tuple[int, list[float]]:
    """Random 4 KiB writes at ``depth`` for ``seconds``: (count, latencies in µs)."""
    ctrl = await connect(node)
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
    await ctrl.close()
    return len(lat), lat


async def fill(node: Node) -> None:
    """Write the whole data area once, 1 MiB at a time."""
    ctrl = await connect(node)
    chunk = os.urandom(1 << 20)
    for offset in range(0, node.data - (1 << 20) + 1, 1 << 20):
        await ctrl.write_bytes(1, offset, chunk)
    await ctrl.close()


def row(label: str, depth: int, count: int, lat: list[float], seconds: float, cpu_primary: float, cpu_all: float) -> str:
    lat.sort()
    return (f"| {label} | {depth} | {count / seconds:,.0f} | {sum(lat) / len(lat):,.0f} | "
            f"{lat[int(len(lat) * 0.99)]:,.0f} | {cpu_primary / count * 1e6:,.0f} | {cpu_all / count * 1e6:,.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="per measurement (default 5)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="blockd-bench-repl-") as tmp:
        base = Path(tmp)
        replicas = [Node(base, "r1", DEVICE), Node(base, "r2", DEVICE)]
        print("| replicas | QD | write IOPS | mean µs | p99 µs | primary CPU µs/write | all daemons CPU µs/write |")
        print("|---|---|---|---|---|---|---|")
        try:
            for r in replicas:
                r.start()
            for n in (0, 1, 2):
                primary = Node(base, f"p{n}", DEVICE)
                primary.start(replicas[:n], nqn=NQN)
                if n:
                    primary.wait_states(all_in_sync(), timeout=120)
                procs = [primary, *replicas[:n]]
                try:
                    asyncio.run(fill(primary))  # every region written once: its bit is set (warm)
                    for depth in (1, 32):
                        before = [cpu_seconds(p.proc.pid) for p in procs]  # type: ignore[union-attr]
                        count, lat = asyncio.run(writes(primary, depth, args.seconds, primary.data))
                        used = [cpu_seconds(p.proc.pid) - b for p, b in zip(procs, before)]  # type: ignore[union-attr]
                        print(row(str(n), depth, count, lat, args.seconds, used[0], sum(used)), flush=True)
                finally:
                    primary.stop()
                    for r in replicas:  # the next primary formats them anew: a new data set
                        r.stop()
                        r.file.unlink()
                        r.start()
            primary = Node(base, "resync", DEVICE)
            primary.start(replicas[:1], nqn=NQN)
            primary.wait_states(all_in_sync(settled=True), timeout=120)
            replicas[0].stop()

            asyncio.run(fill(primary))
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
            primary.stop()
        finally:
            for r in replicas:
                r.stop()


if __name__ == "__main__":
    main()
