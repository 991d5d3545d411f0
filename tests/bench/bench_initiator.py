"""Benchmark: the blockd host library over NVMe/TCP on loopback vs nbdkit (fio's nbd engine).

Run: ``.venv/bin/python tests/bench/bench_initiator.py [--seconds 5] [--size-mib 512]``

In one run, on the same backing-file size and page-cache state, it measures 4 KiB random read
and write at queue depth 1 and 32 (IOPS, mean and p99 latency) and 128 KiB sequential read
and write (MB/s):

* blockd: a real ``blockd target`` process; the load generator is this process, driving
  ``initiator.controller.Controller`` with N coroutines (N = queue depth) on one I/O queue;
* nbdkit: ``nbdkit file`` serving an equal file, driven by fio's ``nbd`` engine (libnbd) with
  the same block size, pattern, depth and duration.

Not a test: it prints figures and the ratio blockd/nbdkit. Both backing files are read once
before every job so neither system pays for page-cache misses the other does not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from blockd import eventloop  # noqa: E402
from initiator.controller import ConnectParams, Controller  # noqa: E402

NQN = "nqn.2026-11.io.blockd:bench"
JOBS = [
    # name, pattern, block size, queue depth
    ("4k randread qd1", "randread", 4096, 1),
    ("4k randread qd32", "randread", 4096, 32),
    ("4k randwrite qd1", "randwrite", 4096, 1),
    ("4k randwrite qd32", "randwrite", 4096, 32),
    ("128k seqread qd8", "read", 131072, 8),
    ("128k seqwrite qd8", "write", 131072, 8),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prefill(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        chunk = os.urandom(1 << 20)
        for _ in range(size >> 20):
            f.write(chunk)


def warm(path: Path) -> None:
    """Pull the whole file into the page cache right before a job."""
    with open(path, "rb") as f:
        while f.read(1 << 22):
            pass


async def blockd_job(ctrl: Controller, pattern: str, bs: int, depth: int, seconds: float,
                     size: int) -> dict[str, float]:
    ns = ctrl.namespaces[1]
    blocks_per_io = bs // ns.block_size
    slots = size // bs
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds
    seq = iter(range(1 << 62))

    async def worker() -> None:
        buf = memoryview(bytearray(bs))
        data = os.urandom(bs)
        rng = random.Random()
        write = "write" in pattern
        while True:
            t0 = time.perf_counter()
            if t0 > deadline:
                return
            slot = rng.randrange(slots) if pattern.startswith("rand") else next(seq) % slots
            if write:
                await ctrl.write(1, slot * blocks_per_io, data)
            else:
                await ctrl.read_into(1, slot * blocks_per_io, buf)
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(depth)))
    elapsed = time.perf_counter() - t0
    latencies.sort()
    n = len(latencies)
    return {"iops": n / elapsed, "mbps": n * bs / elapsed / 1e6,
            "mean_us": statistics.fmean(latencies) * 1e6, "p99_us": latencies[int(n * 0.99)] * 1e6}


def fio_nbd_job(port: int, pattern: str, bs: int, depth: int, seconds: float, size: int) -> dict[str, float]:
    out = subprocess.run(
        ["fio", "--name=j", "--ioengine=nbd", f"--uri=nbd://127.0.0.1:{port}", f"--rw={pattern}",
         f"--bs={bs}", f"--iodepth={depth}", f"--size={size}", "--time_based",
         f"--runtime={seconds}", "--output-format=json"],
        check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job["read"] if "read" in pattern else job["write"]
    lat = side["clat_ns"] if side["clat_ns"]["N"] else side["lat_ns"]
    return {"iops": side["iops"], "mbps": side["bw_bytes"] / 1e6, "mean_us": lat["mean"] / 1e3,
            "p99_us": lat["percentile"]["99.000000"] / 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--size-mib", type=int, default=256)
    args = ap.parse_args()
    for tool in ("fio", "nbdkit"):
        if not shutil.which(tool):
            sys.exit(f"{tool} is not installed (scripts/setup.sh installs it)")
    size = args.size_mib << 20
    work = Path(tempfile.mkdtemp(prefix="blockd-bench-"))
    blockd_img, nbd_img = work / "blockd.img", work / "nbd.img"
    prefill(blockd_img, size)
    shutil.copyfile(blockd_img, nbd_img)
    tport, nport = free_port(), free_port()
    (work / "target.toml").write_text(f"""
[logging]
level = "warning"
[[port]]
transport = "tcp"
address = "127.0.0.1"
port = {tport}
[[subsystem]]
nqn = "{NQN}"
[[subsystem.namespace]]
nsid = 1
path = "{blockd_img}"
block_size = 512
""")
    blockd_bin = REPO / ".venv/bin/blockd"
    target = subprocess.Popen([str(blockd_bin), "target", "--config", str(work / "target.toml")])
    nbd = subprocess.Popen(["nbdkit", "-f", "-p", str(nport), "-i", "127.0.0.1", "file", str(nbd_img)])
    results: list[tuple[str, dict[str, float], dict[str, float]]] = []
    try:
        async def run_all() -> None:
            for _ in range(100):
                try:
                    ctrl = await Controller.connect(ConnectParams(traddr="127.0.0.1", trsvcid=tport,
                                                                  subnqn=NQN, nr_io_queues=1))
                    break
                except ConnectionError:
                    await asyncio.sleep(0.1)
            else:
                raise SystemExit("blockd target did not come up")
            try:
                for name, pattern, bs, depth in JOBS:
                    warm(blockd_img)
                    b = await blockd_job(ctrl, pattern, bs, depth, args.seconds, size)
                    warm(nbd_img)
                    n = await asyncio.to_thread(fio_nbd_job, nport, pattern, bs, depth, args.seconds, size)
                    results.append((name, b, n))
                    print(f"  done: {name}", file=sys.stderr)
            finally:
                await ctrl.close()
        eventloop.run(run_all())
    finally:
        target.terminate()
        nbd.terminate()
        target.wait(30)
        nbd.wait(30)
        shutil.rmtree(work, ignore_errors=True)

    print(f"\nblockd host library (NVMe/TCP, 1 I/O queue) vs nbdkit file + fio nbd engine; "
          f"{args.size_mib} MiB file, {args.seconds:g} s per job, loopback, {os.cpu_count()} CPUs\n")
    print(f"{'job':<20}{'blockd IOPS':>12}{'MB/s':>9}{'mean µs':>9}{'p99 µs':>9}"
          f"{'nbdkit IOPS':>13}{'MB/s':>9}{'mean µs':>9}{'p99 µs':>9}{'ratio':>7}")
    for name, b, n in results:
        print(f"{name:<20}{b['iops']:>12.0f}{b['mbps']:>9.1f}{b['mean_us']:>9.0f}{b['p99_us']:>9.0f}"
              f"{n['iops']:>13.0f}{n['mbps']:>9.1f}{n['mean_us']:>9.0f}{n['p99_us']:>9.0f}"
              f"{b['iops'] / n['iops']:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
