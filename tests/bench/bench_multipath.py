"""Benchmark: the host's multipath I/O policies over two optimized paths against one path, on loopback.

Run::

    .venv/bin/python tests/bench/bench_multipath.py [--runtime 5] [--rounds 2] [--qd 32] [--no-docs]

Two ``blockd target`` processes export one file as one subsystem, both ports' group optimized
(an ANA load-balancing pair). In ONE run, round after round, a client in this process keeps QD
4 KiB random reads (then writes) in flight through ``transfer`` -- the callback form of the one
I/O primitive the FUSE mount uses too -- on:

  one-path:     a plain ``Controller`` to target A (the compiled lane when built);
  numa:         a ``MultipathController`` over A and B, policy numa (the kernel's default: every
                command to the first path);
  round-robin:  the same, each command to the next path;
  queue-depth:  the same, each command to the path with fewer in flight.

Per case: IOPS, the ratio to one-path in the same round, the client's CPU microseconds per I/O
and the share of the commands each target served. Prints the table and rewrites this script's
section of docs/benchmarks.md. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "fuse")]

from blockd_stack import free_port, tool, wait_tcp  # noqa: E402
from docs_section import write_section  # noqa: E402
from failover import target_config  # noqa: E402

from blockd.dataplane import DATA_PLANE  # noqa: E402
from initiator.controller import Controller  # noqa: E402
from initiator.multipath import MultipathController  # noqa: E402
from initiator.params import IOPOLICIES, ConnectParams  # noqa: E402

NQN = "nqn.2026-11.io.blockd:bench-multipath"
SIZE = 64 << 20
BS = 4096
CASES = ("one-path", *IOPOLICIES)
BEGIN = "<!-- BEGIN bench_multipath.py -->"
END = "<!-- END bench_multipath.py -->"


def cpu_of(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(ctrl: Any, write: bool, qd: int, runtime: float) -> int:
    """Keep ``qd`` 4 KiB commands in flight on ``ctrl.transfer`` for ``runtime`` seconds;
    returns the commands completed (an error stops the run)."""
    loop = asyncio.get_running_loop()
    blocks = SIZE // BS
    bufs = [memoryview(bytearray(os.urandom(BS))) for _ in range(qd)]
    done = [0]
    errors: list[BaseException] = []
    finished = loop.create_future()
    deadline = time.monotonic() + runtime
    rng = random.Random(1)

    def issue(i: int) -> None:
        ctrl.transfer(write, 1, rng.randrange(blocks) * BS, bufs[i], lambda exc, i=i: complete(i, exc))

    def complete(i: int, exc: BaseException | None) -> None:
        if exc is not None:
            errors.append(exc)
        done[0] += 1
        if errors or time.monotonic() > deadline:
            if not finished.done():
                finished.set_result(None)
            return
        issue(i)

    for i in range(qd):
        issue(i)
    await finished
    await asyncio.sleep(0.2)  # the last commands in flight complete
    if errors:
        raise errors[0]
    return done[0]


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runtime", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--qd", type=int, default=32)
    ap.add_argument("--cases", default=",".join(CASES),
                    help="comma-separated subset of " + ", ".join(CASES) + " (one-path alone: the lane's speed)")
    ap.add_argument("--no-docs", action="store_true")
    args = ap.parse_args()
    if not set(args.cases.split(",")) <= set(CASES):
        ap.error(f"--cases: choose among {', '.join(CASES)}")
    with tempfile.TemporaryDirectory(prefix="bench-mp-") as tmp:
        d = Path(tmp)
        backing = d / "shared.img"
        with open(backing, "wb") as f:
            for _ in range(SIZE >> 20):
                f.write(os.urandom(1 << 20))
        ports = free_port(), free_port()
        procs = []
        for name, port, cntlids in (("a", ports[0], (1, 99)), ("b", ports[1], (100, 199))):
            cfg = target_config(d, name, port, backing, "optimized", cntlids, nqn=NQN, size=SIZE)
            log = open(d / f"{name}.log", "wb")
            procs.append(subprocess.Popen([tool("blockd"), "target", "--config", str(cfg)], stdout=log, stderr=log,
                                          cwd=REPO))
            wait_tcp(port, procs[-1])
        try:
            return await measure(args, ports, procs)
        finally:
            for p in procs:
                p.terminate()
                p.wait(10)


def params(port: int, **kw: Any) -> ConnectParams:
    return ConnectParams(traddr="127.0.0.1", subnqn=NQN, trsvcid=port, nr_io_queues=1, **kw)


async def measure(args: argparse.Namespace, ports: tuple[int, int], procs: list[subprocess.Popen]) -> int:
    rows: dict[tuple[str, str], list[tuple[float, float, float, float]]] = {}
    for rnd in range(args.rounds):
        for write in (False, True):
            op = "randwrite" if write else "randread"
            for case in args.cases.split(","):
                if case == "one-path":
                    ctrl: Any = await Controller.connect(params(ports[0]))
                else:
                    ctrl = await MultipathController.connect([params(p, iopolicy=case) for p in ports])
                try:
                    cpu0, tcpu0, t0 = time.process_time(), [cpu_of(p.pid) for p in procs], time.monotonic()
                    n = await drive(ctrl, write, args.qd, args.runtime)
                    elapsed = time.monotonic() - t0
                    cpu = time.process_time() - cpu0
                    tcpu = [cpu_of(p.pid) - c for p, c in zip(procs, tcpu0)]
                    paths = ctrl.paths if case != "one-path" else [ctrl]
                    ops = [sum(p.counters.ops) for p in paths]
                    share_b = ops[1] / sum(ops) if len(ops) > 1 and sum(ops) else 0.0
                finally:
                    await ctrl.close()
                rows.setdefault((op, case), []).append((n / elapsed, cpu * 1e6 / n, share_b, sum(tcpu) * 1e6 / n))
                print(f"round {rnd + 1} {op:9} {case:11} {n / elapsed:9.0f} IOPS  client {cpu * 1e6 / n:6.1f} us/IO"
                      f"  targets {sum(tcpu) * 1e6 / n:6.1f} us/IO  on B {share_b:4.0%}", flush=True)
    table = report(rows, args)
    print(table)
    if not args.no_docs:
        write_section(BEGIN, END, "## Multipath I/O policies over two optimized paths (bench_multipath.py)", table)
    return 0


def report(rows: dict[tuple[str, str], list[tuple[float, float, float, float]]], args: argparse.Namespace) -> str:
    """The markdown table: per job and case the median of the rounds, and the ratio to one-path."""
    def median(values: list[float]) -> float:
        v = sorted(values)
        return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2

    lines = [f"Measured {datetime.date.today()} on {os.cpu_count()} CPUs shared with other work, {DATA_PLANE}, "
             f"QD {args.qd}, 4 KiB, {args.runtime:g} s per case, median of {args.rounds} rounds; command: "
             f"`.venv/bin/python tests/bench/bench_multipath.py --runtime {args.runtime:g} --rounds {args.rounds} "
             f"--qd {args.qd}`.", "",
             "| job | case | IOPS | vs one path | client CPU us/IO | targets CPU us/IO | commands on B |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for op in ("randread", "randwrite"):
        base = median([r[0] for r in rows.get((op, "one-path"), rows[(op, args.cases.split(",")[0])])])
        for case in args.cases.split(","):
            r = rows[(op, case)]
            iops = median([x[0] for x in r])
            lines.append(f"| {op} | {case} | {iops:.0f} | {iops / base:.2f} | {median([x[1] for x in r]):.1f} | "
                         f"{median([x[3] for x in r]):.1f} | {median([x[2] for x in r]):.0%} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
