"""blockd as an RBD gateway against librbd itself, on one single-node cluster, in one run.

Three clients of the same memstore cluster (tests/ceph/cluster.py), each on an image of its own,
at the same fio jobs:

- ``fio-librbd``: fio's rbd engine, librbd in fio's process: what any librbd client gets (the
  floor for a gateway; cache off, as the rbd backend runs it);
- ``blockd-rbd``: fio on ``blockd``'s FUSE mount of a ``blockd target`` whose namespace is the
  image (NVMe/TCP on loopback, the target's Python I/O path, librbd aio);
- ``blockd-file``: the same stack on a file namespace, for what the NVMe-oF path costs alone.

The kernel's ``rbd map`` and ``rbd-nbd`` need the rbd/nbd kernel modules, which this host's
kernel cannot load (no /lib/modules, no /dev/nbd*): they are not measured here (docs/ceph.md).
Ratios are against fio-librbd measured in the same run. Figures are functional-scale on a loaded
2-core machine: read the ratios.

    .venv/bin/python tests/bench/bench_rbd.py [--runtime 10] [--write-doc]
"""

from __future__ import annotations

import argparse
import json
import os
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


def fio(target: list[str], job: list[str], runtime: int, env: dict[str, str] | None = None) -> dict[str, float]:
    out = subprocess.run(["fio", "--name=j", *target, *job, "--direct=1", f"--runtime={runtime}", "--time_based",
                          f"--size={SIZE}", "--output-format=json"], capture_output=True, text=True,
                         timeout=runtime * 10 + 60, env=env)
    if out.returncode:
        raise RuntimeError(out.stderr[-1000:])
    j = json.loads(out.stdout)["jobs"][0]
    side = j["write"] if j["write"]["io_bytes"] else j["read"]
    return {"iops": side["iops"], "mbs": side["bw_bytes"] / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runtime", type=int, default=10)
    ap.add_argument("--write-doc", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-rbd-"))
    cluster = Cluster(work / "ceph").start()
    start_s, rss = cluster.start_seconds, cluster.rss_kib()
    for name in ("floor", "gw"):
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
        subprocess.run(["fio", "--name=fill", "--ioengine=rbd", "--pool=rbd", "--rbdname=floor", "--rw=write",
                        "--bs=1M", f"--size={SIZE}", "--direct=1"], check=True, capture_output=True, env=env)
        for job_name, job in JOBS.items():  # the clients alternate per job, in one run
            results[job_name] = {
                "fio-librbd": fio(["--ioengine=rbd", "--pool=rbd", "--rbdname=floor"], job, args.runtime, env),
                **{name: fio([f"--filename={s.file}", "--ioengine=libaio"], job, args.runtime)
                   for name, s in stacks.items()}}
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
             "| job | fio-librbd IOPS | blockd-rbd IOPS (ratio) | blockd-file IOPS (ratio) |", "|---|---|---|---|"]
    for job_name, r in results.items():
        floor = r["fio-librbd"]["iops"]
        cells = [f"{r[n]['iops']:,.0f} ({r[n]['iops'] / floor:.2f})" for n in ("blockd-rbd", "blockd-file")]
        lines.append(f"| {job_name} | {floor:,.0f} | {cells[0]} | {cells[1]} |")
    lines += ["", "fio-librbd is librbd in fio's own process (no gateway): the floor for any gateway. "
              "blockd-rbd adds NVMe/TCP on loopback, the target's Python I/O path and librbd aio; "
              "blockd-file is the same stack on a file, the NVMe-oF path alone. `rbd map` and "
              "`rbd-nbd` are not measured: this host's kernel has no rbd/nbd modules (docs/ceph.md)."]
    text = "\n".join(lines)
    print(text)
    if args.write_doc:
        write_section(BEGIN, END, "## blockd as an RBD gateway (tests/bench/bench_rbd.py)", text)


if __name__ == "__main__":
    main()
