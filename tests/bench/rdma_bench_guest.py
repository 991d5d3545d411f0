"""The RDMA benchmark's work inside the VM (started by tests/bench/run_rdma_bench.py).

``rdma_bench_guest.py OUT.json [--size-mib N] [--runtime S] [--no-fuse]``. One boot: rxe0/rxe1
on a veth pair; the kernel's nvmet-rdma target and ``blockd target`` (from a TOML config with
an rdma port) each export an equal pre-filled file on tmpfs (4 KiB blocks); the kernel host
(``nvme connect -t rdma``) is connected to both, and blockd's FUSE mount over RDMA (initiator
daemon, ``blockctl connect -t rdma``, ``blockctl mount``) to blockd's; each fio job runs on the
three in turn, workload by workload; then ``ib_write_bw``/``ib_read_lat`` over the same link
as the fabric's ceiling. Writes the figures as JSON to OUT.json.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.vm.guest_tests.util import ADDR0, GUEST, Daemon, sh, tool  # noqa: E402

KERNEL_NQN = "nqn.2026-11.io.blockd:bench-kernel"
BLOCKD_NQN = "nqn.2026-11.io.blockd:bench-blockd"
KERNEL_PORT, BLOCKD_PORT = 4420, 4421
JOBS = [  # key, fio rw, block size, iodepth
    ("rr4k_qd1", "randread", "4k", 1),
    ("rr4k_qd32", "randread", "4k", 32),
    ("sr128k", "read", "128k", 16),
    ("sw128k", "write", "128k", 16),
]
RAMP = 2
_PERF_BW = re.compile(r"^\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$", re.M)
_PERF_LAT = re.compile(r"^\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", re.M)


def fio(filename: str, rw: str, bs: str, depth: int, runtime: int, size: int) -> dict[str, float]:
    out = subprocess.run(
        ["fio", "--name=bench", f"--filename={filename}", f"--rw={rw}", f"--bs={bs}", f"--iodepth={depth}",
         "--ioengine=libaio", "--direct=1", "--time_based", f"--runtime={runtime}", f"--ramp_time={RAMP}",
         f"--size={size}", "--output-format=json"],
        capture_output=True, text=True, timeout=runtime * 4 + 60)
    if out.returncode:
        raise RuntimeError(f"fio on {filename} failed: {out.stderr.strip()[-500:]}")
    job = json.loads(out.stdout)["jobs"][0]
    side = job["write"] if rw in ("write", "randwrite") else job["read"]
    clat = side["clat_ns"]
    return {"iops": round(side["iops"]), "mbs": side["bw_bytes"] / 1e6, "lat_mean_us": clat["mean"] / 1000,
            "lat_p99_us": clat.get("percentile", {}).get("99.000000", 0) / 1000}


def perftest(binary: str, pattern: re.Pattern[str], extra: list[str]) -> list[str]:
    """Server on rxe0, client on rxe1 -> ADDR0 over rdma_cm; the client's result row."""
    srv = subprocess.Popen([binary, "-d", "rxe0", "-R", "-F", *extra],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while "LISTEN" not in sh("rdma res show cm_id || true", check=False):
            if srv.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{binary} server did not listen")
            time.sleep(0.3)
        cli = subprocess.run([binary, "-d", "rxe1", "-R", "-F", *extra, ADDR0],
                             capture_output=True, text=True, timeout=180)
    finally:
        if srv.poll() is None:
            srv.kill()
        srv.wait()
    m = pattern.search(cli.stdout)
    if cli.returncode or not m:
        raise RuntimeError(f"{binary} gave no result: {cli.stdout[-800:]} {cli.stderr[-400:]}")
    return list(m.groups())


def wait_log(d: Daemon, text: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while text not in d.log_path.read_text(errors="replace"):
        if d.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{d.name} did not log {text!r}:\n{d.log_tail()}")
        time.sleep(0.3)


def start_fuse(work: Path) -> tuple[Daemon, list[str], Path]:
    """The initiator daemon, connected to blockd's target over RDMA (2 I/O queues x 128) and
    mounted; returns it, the blockctl command prefix and the namespace's file."""
    sock = work / "initiator.sock"
    mnt = work / "mnt"
    mnt.mkdir(exist_ok=True)
    init = Daemon("bench-initiator", [tool("blockd"), "initiator", "--socket", str(sock), "--log-level", "warning"])
    deadline = time.monotonic() + 60
    while not sock.exists():
        if init.proc.poll() is not None or time.monotonic() > deadline:
            init.stop()
            raise RuntimeError("initiator daemon did not start:\n" + init.log_tail())
        time.sleep(0.2)
    ctl = [tool("blockctl"), "--socket", str(sock)]
    subprocess.run(ctl + ["connect", "-t", "rdma", "-a", ADDR0, "-s", str(BLOCKD_PORT), "-n", BLOCKD_NQN,
                          "--name", "vol", "-i", "2", "-Q", "128"], check=True, timeout=120)
    subprocess.run(ctl + ["mount", "vol", str(mnt)], check=True, timeout=60)
    return init, ctl, mnt / "ns1"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--runtime", type=int, default=10)
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--no-fuse", action="store_true")
    args = ap.parse_args()
    size = args.size_mib << 20
    work = Path("/dev/shm/rdma-bench")
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    sh(f"bash {GUEST / 'rxe-up.sh'}", timeout=120)
    # permanent neighbours across the veth, as the VM tests: an rdma_cm address resolution that
    # has to ARP sometimes never answers in the TCG guest
    sh("ip neigh replace 192.0.2.1 lladdr $(cat /sys/class/net/veth0/address) dev veth1 nud permanent; "
       "ip neigh replace 192.0.2.2 lladdr $(cat /sys/class/net/veth1/address) dev veth0 nud permanent")
    res: dict[str, object] = {"runtime_s": args.runtime, "size_mib": args.size_mib,
                              "kernel": sh("uname -r").strip(), "jobs": {}}
    for name in ("kernel.img", "blockd.img"):  # written through, so reads hit real pages
        sh(f"dd if=/dev/urandom of={work / name} bs=1M count={args.size_mib} status=none")

    sh(f"nvmet_subsys {KERNEL_NQN} BENCHKERNEL1 && nvmet_ns_file {KERNEL_NQN} 1 {work / 'kernel.img'} "
       f"&& nvmet_port 1 rdma {ADDR0} {KERNEL_PORT} && nvmet_link 1 {KERNEL_NQN}")
    cfg = work / "target.toml"
    cfg.write_text(f"""
[logging]
level = "info"

[[port]]
transport = "rdma"
address = "{ADDR0}"
port = {BLOCKD_PORT}

[[subsystem]]
nqn = "{BLOCKD_NQN}"
serial = "BENCHBLOCKD1"
allow_any_host = true

[[subsystem.namespace]]
nsid = 1
path = "{work / 'blockd.img'}"
block_size = 4096
""")
    target = Daemon("bench-blockd-target", [tool("blockd"), "target", "--config", str(cfg)])
    fuse: tuple[Daemon, list[str], Path] | None = None
    try:
        wait_log(target, "target ready")  # every port listens (not the control socket's line)
        devs = {"nvmet": sh(f"nvmeh_connect rdma {ADDR0} {KERNEL_PORT} {KERNEL_NQN}", timeout=180).split()[-1],
                "blockd": sh(f"nvmeh_connect rdma {ADDR0} {BLOCKD_PORT} {BLOCKD_NQN}", timeout=180).split()[-1]}
        # I/O queues of the kernel host's controller (queue_count includes the admin queue;
        # /sys/block/nvmeXnY has no mq/ under native multipath)
        ctrl = sh(f"nvmeh_ctrl {BLOCKD_NQN}").strip()
        res["blockd_dev"] = {"path": devs["blockd"], "blk_mq_queues": int(
            Path(f"/sys/class/nvme/{ctrl}/queue_count").read_text()) - 1}
        if not args.no_fuse:
            fuse = start_fuse(work)
            devs["fuse"] = str(fuse[2])
        for key, rw, bs, depth in JOBS:
            for system, dev in devs.items():
                r = fio(dev, rw, bs, depth, args.runtime, size)
                res["jobs"].setdefault(key, {})[system] = r  # type: ignore[union-attr]
                print(f"{key:<10} {system:<7} {r['iops']:>9,} IOPS {r['mbs']:>8,.1f} MB/s "
                      f"{r['lat_mean_us']:>8,.0f} / {r['lat_p99_us']:,.0f} us", flush=True)
    finally:
        if fuse is not None:
            init, ctl, mounted = fuse
            subprocess.run(ctl + ["umount", str(mounted.parent)], timeout=60)
            init.stop()
        sh(f"nvmeh_disconnect {KERNEL_NQN} || true; nvmeh_disconnect {BLOCKD_NQN} || true", check=False)
        target.stop()
        sh("nvmet_teardown", check=False)

    # iterations, not -D: perftest 44 reports 0.00 MB/s in duration mode over rdma_cm here
    bw = perftest("ib_write_bw", _PERF_BW, ["-s", "131072", "-n", "2000"])
    res["ib_write_bw_128k"] = {"bytes": int(bw[0]), "bw_average_MBps": float(bw[3])}
    lat = perftest("ib_read_lat", _PERF_LAT, ["-s", "4096", "-n", "2000"])
    res["ib_read_lat_4k"] = {"bytes": int(lat[0]), "t_typical_us": float(lat[4]), "t_avg_us": float(lat[5]),
                             "p99_us": float(lat[7])}
    res["guest_seconds"] = round(time.monotonic() - started, 1)
    args.out.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
