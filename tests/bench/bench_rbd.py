"""blockd as an RBD gateway against librbd itself, on one single-node cluster, in one run.

Four clients of the same memstore cluster (tests/ceph/cluster.py), each on an image of its own,
at the same fio jobs:

- ``fio-librbd``: fio's rbd engine, librbd in fio's process: what any librbd client gets (the
  floor for a gateway; cache off, as the rbd backend runs it);
- ``blockd-rbd``: fio on ``blockd``'s FUSE mount of a ``blockd target`` whose namespace is the
  image (NVMe/TCP on loopback, the target's Python I/O path, librbd aio);
- ``blockd-file``: the same stack on a file, for what the NVMe-oF path alone costs;
- ``backend-alone``: the rbd backend (``target/rbd_backend.py``) driven directly from one asyncio
  loop at the job's queue depth: python3-rbd's aio calls and the completions' hop into the loop,
  without NVMe/TCP or the target: what a compiled librbd path could at most win back.

The kernel's ``rbd map`` and ``rbd-nbd`` need the rbd/nbd kernel modules, which this host's
kernel cannot load (no /lib/modules, no /dev/nbd*): tests/bench/bench_rbd_vm.py measures them
against blockd in the VM bed's guest.
Ratios are against fio-librbd measured in the same run. Figures are functional-scale on a loaded
2-core machine: read the ratios.

    .venv/bin/python tests/bench/bench_rbd.py [--runtime 10] [--write-doc]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "bench"))

from docs_section import write_section  # noqa: E402

from tests.ceph.cluster import Cluster  # noqa: E402
from tests.ceph.rbd_stack import RbdStack, Stack  # noqa: E402

SIZE = 256 << 20
JOBS = {
    "4k randwrite QD16": ["--rw=randwrite", "--bs=4k", "--iodepth=16"],
    "4k randread QD16": ["--rw=randread", "--bs=4k", "--iodepth=16"],
    "4k randwrite QD1": ["--rw=randwrite", "--bs=4k", "--iodepth=1"],
    "128k write QD4": ["--rw=write", "--bs=128k", "--iodepth=4"],
}
BEGIN, END = "<!-- BEGIN bench_rbd -->", "<!-- END bench_rbd -->"


def fio(target: list[str], job: list[str], runtime: int, env: dict[str, str] | None = None,
        size: int = SIZE) -> dict[str, float]:
    """One fio job; IOPS, MB/s and fio's own CPU time per I/O (its process and threads, librbd's
    with the rbd engine: from this process's children's rusage)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(["fio", "--name=j", *target, *job, "--direct=1", f"--runtime={runtime}", "--time_based",
                          f"--size={size}", "--output-format=json"], capture_output=True, text=True,
                         timeout=runtime * 10 + 60, env=env)
    if out.returncode:
        raise RuntimeError(out.stderr[-1000:])
    j = json.loads(out.stdout)["jobs"][0]
    side = j["write"] if j["write"]["io_bytes"] else j["read"]
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"iops": side["iops"], "mbs": side["bw_bytes"] / 1e6, "cpu_us_per_io": cpu / max(side["total_ios"], 1) * 1e6}


def _cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time so far (/proc/PID/stat utime, stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def on_stack(stack: Stack, job: list[str], runtime: int) -> dict[str, float]:
    """fio on ``stack``'s FUSE mount, and its ``blockd target``'s CPU time per I/O."""
    assert stack.target is not None
    before = _cpu_seconds(stack.target.pid)
    r = fio([f"--filename={stack.file}", "--ioengine=libaio"], job, runtime)
    r["target_cpu_us_per_io"] = (_cpu_seconds(stack.target.pid) - before) / (r["iops"] * runtime) * 1e6
    return r


def _job_shape(job: list[str]) -> tuple[str, int, int]:
    """(rw, block size, queue depth) of one of JOBS' fio argument lists."""
    opts = dict(arg[2:].split("=", 1) for arg in job)
    return opts["rw"], int(opts["bs"].rstrip("k")) << 10, int(opts["iodepth"])


def backend_alone(cluster: Cluster, image: str, job: list[str], runtime: int) -> dict[str, float]:
    """The job's I/O straight through an :class:`RbdBackend` on ``image``, ``iodepth`` coroutines
    in one loop; IOPS, and the process's CPU time (librbd's threads included) per I/O."""
    from target.config import NamespaceConfig
    from target.rbd_backend import open_rbd

    rw, bs, depth = _job_shape(job)
    backend = open_rbd(NamespaceConfig(1, f"{cluster.pool}/{image}", None, backend="rbd",
                                       options=(("conf", str(cluster.conf)),)))
    data = os.urandom(bs)
    rng = random.Random(37)
    done = 0

    async def worker(loop: asyncio.AbstractEventLoop, end: float) -> None:
        nonlocal done
        buf = memoryview(bytearray(bs))
        while loop.time() < end:
            offset = rng.randrange(SIZE // bs) * bs if rw.startswith("rand") else (done * bs) % SIZE
            if "write" in rw:
                await backend.write(offset, data)
            else:
                await backend.read_into(offset, buf)
            done += 1

    async def drive() -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + runtime
        await asyncio.gather(*(worker(loop, end) for _ in range(depth)))

    try:
        cpu, t0 = time.process_time(), time.monotonic()
        asyncio.run(drive())
        cpu, wall = time.process_time() - cpu, time.monotonic() - t0
    finally:
        backend.close()
    return {"iops": done / wall, "mbs": done * bs / wall / 1e6, "cpu_us_per_io": cpu / done * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runtime", type=int, default=10)
    ap.add_argument("--write-doc", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-rbd-"))
    cluster = Cluster(work / "ceph").start()
    start_s, rss = cluster.start_seconds, cluster.rss_kib()
    for name in ("floor", "gw", "alone"):
        cluster.create_image(name, SIZE)
    env = {**os.environ, "CEPH_CONF": str(cluster.conf), "CEPH_ARGS": "--rbd_cache=false"}
    stacks = {"blockd-rbd": RbdStack(work / "gw", cluster, "gw", SIZE),
              "blockd-file": Stack(work / "file", size=SIZE)}
    results: dict[str, dict[str, dict[str, float]]] = {}
    try:
        for s in stacks.values():
            s.start()
            subprocess.run(["dd", "if=/dev/zero", f"of={s.file}", "bs=1M", f"count={SIZE >> 20}", "oflag=direct"],
                           check=True, capture_output=True)  # reads hit written objects, as on fio-librbd
        for image in ("floor", "alone"):
            subprocess.run(["fio", "--name=fill", "--ioengine=rbd", "--pool=rbd", f"--rbdname={image}", "--rw=write",
                            "--bs=1M", f"--size={SIZE}", "--direct=1"], check=True, capture_output=True, env=env)
        for job_name, job in JOBS.items():  # the clients alternate per job, in one run
            results[job_name] = {
                "fio-librbd": fio(["--ioengine=rbd", "--pool=rbd", "--rbdname=floor"], job, args.runtime, env),
                **{name: on_stack(s, job, args.runtime) for name, s in stacks.items()},
                "backend-alone": backend_alone(cluster, "alone", job, args.runtime)}
            print(job_name, json.dumps(results[job_name]), flush=True)
        rss_after = cluster.rss_kib()
    finally:
        for s in stacks.values():
            s.stop()
        cluster.stop()
    lines = [f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, `.venv/bin/python tests/bench/bench_rbd.py "
             f"--runtime {args.runtime}{' --write-doc' if args.write_doc else ''}`; memstore cluster started in {start_s:.2f} s "
             f"(mon {rss['mon'] // 1024} MiB, OSD {rss['osd'] // 1024} MiB RSS at start; OSD "
             f"{rss_after['osd'] // 1024} MiB after the run). Ratio: IOPS against fio-librbd in the same run.", "",
             "| job | fio-librbd IOPS | blockd-rbd IOPS (ratio) | blockd-file IOPS (ratio) "
             "| backend-alone IOPS (ratio) | CPU µs/I/O: fio-librbd; backend-alone; blockd-rbd's target |", "|---|---|---|---|---|---|"]
    for job_name, r in results.items():
        floor = r["fio-librbd"]["iops"]
        cells = [f"{r[n]['iops']:,.0f} ({r[n]['iops'] / floor:.2f})" for n in ("blockd-rbd", "blockd-file", "backend-alone")]
        lines.append(f"| {job_name} | {floor:,.0f} | {' | '.join(cells)} | {r['fio-librbd']['cpu_us_per_io']:,.0f}; {r['backend-alone']['cpu_us_per_io']:,.0f}; "
                     f"{r['blockd-rbd']['target_cpu_us_per_io']:,.0f} |")
    lines += ["", "fio-librbd is librbd in fio's own process (no gateway): the floor for any gateway. "
              "blockd-rbd adds NVMe/TCP on loopback, the target's Python I/O path and librbd aio; "
              "blockd-file is the same stack on a file, the NVMe-oF path alone; backend-alone is the rbd backend "
              "driven from one asyncio loop (python3-rbd aio and the completions' hop into the loop, no NVMe/TCP, "
              "no target), its CPU time per I/O counting librbd's threads, as fio-librbd's counts fio's process with librbd's "
              "threads (rusage) and blockd-rbd's target's its whole process (/proc/PID/stat). `rbd map` and "
              "`rbd-nbd` need kernel modules this host lacks: they are measured in the VM (below)."]
    text = "\n".join(lines)
    print(text)
    if args.write_doc:
        write_section(BEGIN, END, "## blockd as an RBD gateway (tests/bench/bench_rbd.py)", text)


if __name__ == "__main__":
    main()
