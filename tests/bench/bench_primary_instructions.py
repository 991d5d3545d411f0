"""Benchmark (not a test): instructions the primary daemon executes per 4 KiB write at QD1,
under callgrind, with the replicas and the host at full speed.

A replicated namespace over ``--replicas`` blockd replicas (0: a plain namespace) on loopback
(tests/replication/nodes.py), the primary started under ``valgrind --tool=callgrind``. The host
writes every region once (every write-intent bit set, as on a volume in use), then ``n`` random
4 KiB writes; the primary stops and callgrind gives its total. Two runs, ``n1`` and ``n2``
writes: (I(n2) - I(n1)) / (n2 - n1) is the cost of one write, start-up and warm-up cancelled.
Unlike timings, the count does not move with the machine's load (a sweep of the bits every
second and the keep-alive checks are the only work that follows the run's length). Compare
trees by running it from each checkout:

    .venv/bin/python tests/bench/bench_primary_instructions.py [--replicas 1] [--writes 200 700]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from initiator.controller import ConnectParams, Controller  # noqa: E402
from tests.replication.nodes import BIN, HOSTNQN, NQN, REGION, RNQN, Node, all_in_sync  # noqa: E402


async def _load(node: Node, nqn: str, writes: int) -> None:
    ctrl = await Controller.connect(ConnectParams(traddr="127.0.0.1", trsvcid=node.port, subnqn=nqn, hostnqn=HOSTNQN,
                                                  ctrl_loss_tmo=0, command_timeout=60))
    data = os.urandom(4096)
    for offset in range(0, node.data - REGION + 1, REGION):
        await ctrl.write_bytes(1, offset, data)
    rng = random.Random(1)
    for _ in range(writes):
        await ctrl.write_bytes(1, rng.randrange(node.data // 4096) * 4096, data)
    await ctrl.close()


def instructions(writes: int, replicas: int) -> tuple[int, int | None]:
    """The primary's total instructions over a run of ``writes`` writes, and how many writes
    the compiled lane took (None: not shown by this tree, or no replica)."""
    with tempfile.TemporaryDirectory(prefix="bench-primary-cg-") as tmp:
        base = Path(tmp)
        reps = [Node(base, f"r{i}") for i in range(replicas)]
        primary = Node(base, "p")
        nqn = NQN if replicas else RNQN
        out = base / "callgrind.out"
        try:
            for r in reps:
                r.start()
            cfg = base / "p.toml"
            cfg.write_text(primary.config(nqn, reps))
            primary.proc = subprocess.Popen(
                ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, str(BIN / "blockd"),
                 "target", "--config", str(cfg)],
                stdout=subprocess.DEVNULL, stderr=open(primary.log, "ab"), env=dict(os.environ, PYTHONHASHSEED="0"))
            deadline = time.monotonic() + 600
            while b"target ready" not in primary.log.read_bytes():
                assert primary.proc.poll() is None, primary.log.read_text()[-3000:]
                assert time.monotonic() < deadline, "the primary never became ready under callgrind"
                time.sleep(0.2)
            if replicas:
                primary.wait_states(all_in_sync(), timeout=600)
            asyncio.run(_load(primary, nqn, writes))
            lane = primary.namespace().get("compiled_writes") if replicas else None
            primary.proc.send_signal(signal.SIGTERM)
            primary.proc.wait(900)  # callgrind writes its file as the process ends
        finally:
            if primary.proc is not None and primary.proc.poll() is None:
                primary.proc.kill()
                primary.proc.wait()
            for r in reps:
                r.stop()
        for line in out.read_text().splitlines():
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1]), lane
    raise SystemExit("callgrind wrote no total")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=1, choices=(0, 1, 2))
    parser.add_argument("--writes", type=int, nargs=2, default=(200, 700), metavar=("N1", "N2"))
    args = parser.parse_args()
    n1, n2 = args.writes
    (a, _), (b, lane) = instructions(n1, args.replicas), instructions(n2, args.replicas)
    took = f"; the compiled lane took {lane} of the {n2} writes" if lane is not None else ""
    print(f"replicas={args.replicas}: {(b - a) / (n2 - n1):,.0f} instructions per 4 KiB write in the primary at QD1{took}")


if __name__ == "__main__":
    main()
