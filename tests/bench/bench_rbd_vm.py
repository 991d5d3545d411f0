"""blockd as an RBD gateway against the kernel's own RBD clients, in the VM bed, in one run.

Three block devices on one single-node cluster (tests/ceph/cluster.py) inside the guest, each on
an image of its own, at the same fio jobs (tests/bench/bench_rbd.py's), device by device per job:

- ``blockd``: the kernel NVMe/TCP host (``nvme connect``, guest loopback) on ``blockd target``
  whose namespace is the image (the target's Python I/O path, librbd aio, cache off);
- ``krbd``: the kernel's ``rbd device map`` (the rbd module, msgr2 in crc mode, ``noudev`` as the
  guest runs no udev; no client cache);
- ``rbd-nbd``: librbd in the ``rbd-nbd`` daemon behind the kernel's nbd module (cache off, as
  blockd runs librbd).

This host's kernel has no rbd/nbd modules; the guest's Debian kernel has both (the VM bed shares
its module tree). Ratios are against krbd measured in the same run. Everything runs under qemu
TCG on 2 shared cores: the figures are functional-scale, read the ratios. Not collected by pytest.

    flock /tmp/blockd-vm.lock .venv/bin/python tests/bench/bench_rbd_vm.py [--runtime 5] [--size-mib 64] [--no-docs]

In the guest it runs itself with ``--guest OUT.json``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "bench"))

from bench_rbd import JOBS, fio  # noqa: E402
from docs_section import write_section  # noqa: E402

from tests.ceph.cluster import Cluster  # noqa: E402

NQN = "nqn.2026-11.io.blockd:bench-rbd"
PORT = 4440
DEVICES = ("blockd", "krbd", "rbd-nbd")
BEGIN, END = "<!-- BEGIN bench_rbd_vm -->", "<!-- END bench_rbd_vm -->"
HEADING = "## blockd over RBD against `rbd map` and `rbd-nbd`, in the VM (tests/bench/bench_rbd_vm.py)"


def _target_config(cluster: Cluster, work: Path) -> Path:
    cfg = work / "bench-rbd.toml"
    cfg.write_text(f"""\
[control]
socket = "{work}/bench-rbd.sock"

[[port]]
transport = "tcp"
address = "127.0.0.1"
port = {PORT}

[[subsystem]]
nqn = "{NQN}"
allow_any_host = true

[[subsystem.namespace]]
nsid = 1
backend = "rbd"
path = "{cluster.pool}/blockd"
options = {{ conf = "{cluster.conf}" }}
""")
    return cfg


def guest(out: Path, runtime: int, size: int) -> None:
    """In the guest: the cluster, the three devices, the fio jobs; the figures to ``out``."""
    from tests.vm.guest_tests.util import Daemon, sh, tool, wait_tcp

    work = Path(tempfile.mkdtemp(prefix="bench-rbd-", dir="/dev/shm"))
    cluster = Cluster(work / "ceph", watch_timeout=15, store_bytes=4 * size + (512 << 20)).start()
    res: dict = {"cluster_start_s": cluster.start_seconds, "rss_kib": cluster.rss_kib(), "size": size,
                 "runtime": runtime, "jobs": {}}
    for name in DEVICES:
        cluster.create_image(name, size)
    target = Daemon("bench-rbd-target", [tool("blockd"), "target", "--config", str(_target_config(cluster, work))])
    devs: dict[str, str] = {}
    try:
        wait_tcp("127.0.0.1", PORT, timeout=120, proc=target.proc, what="blockd target")
        devs["blockd"] = sh(f"nvmeh_connect tcp 127.0.0.1 {PORT} {NQN}", timeout=120).strip().splitlines()[-1]
        try:  # a client that cannot map is reported in the table, the others still measured
            sh("modprobe rbd")
            # noudev: the guest runs no udev, for whose event rbd would wait (it hung 60 s)
            devs["krbd"] = cluster.run("rbd", "device", "map", f"{cluster.pool}/krbd", "-o", "ms_mode=crc,noudev",
                                       timeout=120).strip()
        except (AssertionError, RuntimeError, subprocess.TimeoutExpired) as exc:
            res.setdefault("errors", {})["krbd"] = str(exc)[-300:]
        try:  # the daemon rbd-nbd leaves behind keeps its stdout: a file, not a pipe to wait on
            sh(f"modprobe nbd nbds_max=4 && CEPH_CONF={cluster.conf} rbd-nbd map {cluster.pool}/rbd-nbd "
               f"--rbd-cache=false >{work}/nbd 2>&1 || {{ cat {work}/nbd; exit 1; }}")
            devs["rbd-nbd"] = (work / "nbd").read_text().strip().splitlines()[-1]
        except AssertionError as exc:
            res.setdefault("errors", {})["rbd-nbd"] = str(exc)[-300:]
        res["devices"] = devs
        print(f"devices: {devs}", flush=True)
        for dev in devs.values():  # reads then hit written objects, on every device alike
            sh(f"dd if=/dev/zero of={dev} bs=1M count={size >> 20} oflag=direct", timeout=600)
        for job_name, job in JOBS.items():
            res["jobs"][job_name] = {name: fio([f"--filename={dev}", "--ioengine=libaio"], job, runtime, size=size)
                                     for name, dev in devs.items()}
            print(job_name, json.dumps(res["jobs"][job_name]), flush=True)
        res["rss_kib_after"] = cluster.rss_kib()
    finally:
        if "rbd-nbd" in devs:
            subprocess.run(["rbd-nbd", "unmap", devs["rbd-nbd"]], check=False)
        if "krbd" in devs:
            cluster.run("rbd", "device", "unmap", "-o", "noudev", devs["krbd"])
        sh(f"nvme disconnect -n {NQN}", check=False)
        target.stop()
        cluster.stop()
    out.write_text(json.dumps(res, indent=1))


def table(res: dict, command: str) -> str:
    rss = res["rss_kib"]
    lines = [f"Run {res['when']} UTC, `{command}`, in the VM bed's guest (qemu TCG, 2 vCPUs on the shared "
             f"2-core host): memstore cluster started in {res['cluster_start_s']:.1f} s in the guest (mon "
             f"{rss['mon'] // 1024} MiB, OSD {rss['osd'] // 1024} MiB RSS at start), images of "
             f"{res['size'] >> 20} MiB, {res['runtime']} s per job and device. Ratio: IOPS against krbd in the "
             "same run.", "",
             "| job | krbd IOPS | blockd (kernel NVMe/TCP host) IOPS (ratio) | rbd-nbd IOPS (ratio) |",
             "|---|---|---|---|"]
    for job_name, r in res["jobs"].items():
        floor = r.get("krbd", {}).get("iops")
        cells = [("–" if n not in r else f"{r[n]['iops']:,.0f}" + (f" ({r[n]['iops'] / floor:.2f})" if floor else ""))
                 for n in ("krbd", "blockd", "rbd-nbd")]
        lines.append(f"| {job_name} | {' | '.join(cells)} |")
    lines += ["", "krbd is the kernel's RBD client (`rbd device map`, no client cache); rbd-nbd is librbd "
              "in the rbd-nbd daemon behind /dev/nbd (cache off); blockd is `blockd target` with the image as "
              "its namespace (librbd aio, cache off), reached by the kernel NVMe/TCP host on the guest's "
              "loopback. All three on one memstore OSD in the same guest: functional scale under TCG."]
    if res.get("errors"):
        lines += ["", *(f"Not measured: {name}: {error}" for name, error in res["errors"].items())]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runtime", type=int, default=5, help="seconds per fio job and device")
    ap.add_argument("--size-mib", type=int, default=64)
    ap.add_argument("--no-docs", action="store_true", help="print only; leave docs/benchmarks.md alone")
    ap.add_argument("--guest", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.guest:
        guest(a.guest, a.runtime, a.size_mib << 20)
        return 0
    from tests.vm import harness

    command = "flock /tmp/blockd-vm.lock .venv/bin/python tests/bench/bench_rbd_vm.py" + \
        (f" --runtime {a.runtime}" if a.runtime != 5 else "") + \
        (f" --size-mib {a.size_mib}" if a.size_mib != 64 else "")
    out_dir = REPO / "results" / "bench-rbd-vm"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "bench-rbd-vm.json"
    out.unlink(missing_ok=True)
    argv = [sys.executable, "tests/bench/bench_rbd_vm.py", "--guest", str(out), "--runtime", str(a.runtime),
            "--size-mib", str(a.size_mib)]
    r = harness.run(shlex.join(argv), rw=[out_dir], env={"BLOCKD_VM_RESULTS": str(out_dir)},
                    timeout=600 + len(JOBS) * len(DEVICES) * (a.runtime + 20) + a.size_mib * 3,
                    log_path=out_dir / "console.log", mem=3072)
    if r.rc != 0 or not out.exists():
        print(f"the VM run failed (exit {r.rc}); see {out_dir}/console.log", file=sys.stderr)
        return 1
    res = json.loads(out.read_text())
    res["when"] = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    out.write_text(json.dumps(res, indent=1))
    text = table(res, command)
    print(text)
    if not a.no_docs:
        write_section(BEGIN, END, HEADING, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
