"""Count (not time) the host's instructions per read on a one-path connection: the compiled lane.

Run::

    .venv/bin/python tests/bench/callgrind_one_path.py [--reads 1000,3000]

Starts a ``blockd target`` on loopback, then runs this script's client under valgrind's
callgrind twice, with each count of QD 1 4 KiB reads through ``Controller.transfer``; the
difference of the two instruction totals over the difference of the counts is the cost of one
read (connect, set-up and teardown cancel out). Instructions do not move with the machine's
load, as IOPS and CPU time do on a shared machine: run it on two trees to compare them
(issue 40: before and after the multipath policies, docs/benchmarks.md). Not collected by pytest.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "fuse")]

sys.path.insert(0, str(HERE))

from bench_multipath import NQN, SIZE, target_config  # noqa: E402
from blockd_stack import free_port, tool, wait_tcp  # noqa: E402


async def client(port: int, reads: int) -> None:
    from initiator.controller import Controller
    from initiator.params import ConnectParams
    ctrl = await Controller.connect(ConnectParams(traddr="127.0.0.1", subnqn=NQN, trsvcid=port, nr_io_queues=1))
    if ctrl.lane is None:
        raise SystemExit("the compiled lane is not built (BLOCKD_PURE set, or not compiled)")
    buf = memoryview(bytearray(4096))
    loop = asyncio.get_running_loop()
    for i in range(reads):
        fut = loop.create_future()
        ctrl.transfer(False, 1, (i % (SIZE // 4096)) * 4096, buf, lambda exc, fut=fut: fut.set_result(exc))
        if (exc := await fut) is not None:
            raise exc
    await ctrl.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reads", default="1000,3000", help="the two read counts, comma-separated")
    ap.add_argument("--client", nargs=2, type=int, metavar=("PORT", "READS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        asyncio.run(client(*args.client))
        return 0
    low, high = (int(n) for n in args.reads.split(","))
    with tempfile.TemporaryDirectory(prefix="callgrind-") as tmp:
        d = Path(tmp)
        (d / "vol.img").write_bytes(bytes(SIZE))
        port = free_port()
        config = target_config(d, "t", port, d / "vol.img", (1, 99))
        with open(d / "t.log", "wb") as log:
            target = subprocess.Popen([tool("blockd"), "target", "--config", str(config)], stdout=log,
                                      stderr=log, cwd=REPO)
        try:
            wait_tcp(port, target)
            totals = []
            for reads in (low, high):
                run = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={d}/cg.{reads}",
                                      sys.executable, __file__, "--client", str(port), str(reads)],
                                     capture_output=True, text=True, cwd=REPO, check=True)
                totals.append(int(re.search(r"Collected : (\d+)", run.stderr)[1]))
                print(f"{reads} reads: {totals[-1]} instructions")
        finally:
            target.terminate()
            target.wait(10)
    print(f"{(totals[1] - totals[0]) / (high - low):.0f} instructions per QD 1 4 KiB read (one path, the lane)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
