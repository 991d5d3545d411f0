"""The VM benchmark's work inside the guest (started by tests/bench/run_rdma_bench.py).

``rdma_bench_guest.py OUT.json [--transport tcp|rdma|both] [--size-mib N] [--runtime S] [--no-fuse]
[--profile] [--jobs KEY,...] [--loop-queues] [--uring-queues]``.
One boot: the kernel's nvmet target and ``blockd target`` (from a TOML config with a port per
transport) each export an equal pre-filled file on tmpfs (4 KiB blocks). Per transport in turn:
RDMA on rxe0/rxe1 over a veth pair, TCP on the guest's loopback (nvmet-tcp vs blockd target);
the kernel host (``nvme connect -t TRANSPORT``) is connected to both, and blockd's FUSE mount
(initiator daemon, ``blockctl connect -t TRANSPORT``, ``blockctl mount``) to blockd's; each fio
job runs on the three in turn, workload by workload; then everything of that transport is
disconnected, so the kernel host never holds two paths to one subsystem (``--profile``: before
that, ``perf record -a`` over a 4 KiB QD1 read on each kernel-host device). With RDMA, then
``ib_write_bw``/``ib_read_lat`` over the same link as the fabric's ceiling. Writes the figures as
JSON to OUT.json: ``{"transports": {"rdma": {"jobs": ..., "blockd_dev": ...}, "tcp": ...}, ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.vm.guest_tests.util import ADDR0, GUEST, Daemon, sh, tool  # noqa: E402

KERNEL_NQN = "nqn.2026-11.io.blockd:bench-kernel"
BLOCKD_NQN = "nqn.2026-11.io.blockd:bench-blockd"
PORTS = {  # transport: (nvmet port id, address, kernel target's port, blockd target's port)
    "rdma": (1, ADDR0, 4420, 4421),
    "tcp": (2, "127.0.0.1", 4430, 4431),
}
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


def guest_busy() -> int:
    """Clock ticks the guest's CPUs spent busy so far (/proc/stat: all but idle and iowait)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(ticks) - ticks[3] - ticks[4]


def proc_ticks(pid: int) -> tuple[int, int]:
    """User and system clock ticks of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])


def measured(filename: str, rw: str, bs: str, depth: int, runtime: int, size: int,
             daemons: dict[str, int]) -> dict[str, object]:
    """:func:`fio`, plus where the CPU went: µs per I/O (user, system) of each blockd daemon
    serving it, and the share of the guest's two vCPUs that was busy (fio, kernel, daemons)."""
    tick = 1e6 / os.sysconf("SC_CLK_TCK")
    busy0, t0, procs0 = guest_busy(), time.monotonic(), {n: proc_ticks(pid) for n, pid in daemons.items()}
    r: dict[str, object] = dict(fio(filename, rw, bs, depth, runtime, size))
    busy, elapsed = guest_busy() - busy0, time.monotonic() - t0
    ios = max(int(r["iops"]) * (runtime + RAMP), 1)  # type: ignore[call-overload]  # the ramp too, as CPU is
    r["cpu_us_per_io"] = {n: [(a - b) * tick / ios for a, b in zip(proc_ticks(pid), procs0[n])]
                          for n, pid in daemons.items()}
    r["guest_busy_pct"] = busy * tick / 1e6 / elapsed / os.cpu_count() * 100
    return r


def profile(work: Path, dev: str, runtime: int, size: int, job: str) -> dict[str, str]:
    """``perf record -a`` (software clock: TCG has no PMU) over fio's ``job`` (a key of ``JOBS``)
    on ``dev``: the guest's samples by command and library, and by library and symbol."""
    _, rw, bs, depth = next(j for j in JOBS if j[0] == job)
    data = work / "perf.data"
    rec = subprocess.Popen(["perf", "record", "-F", "499", "-a", "-o", str(data), "--", "sleep", str(runtime)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        fio(dev, rw, bs, depth, runtime, size)
    finally:
        rec.wait(runtime * 4 + 60)
    out = {}
    for sort in ("comm,dso", "dso,sym"):
        out[sort] = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "--sort", sort, "--percent-limit",
                                    "1"], capture_output=True, text=True, timeout=600).stdout
    return out


_STRACE_ROW = re.compile(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)\s*$", re.M)


def syscalls(work: Path, dev: str, runtime: int, size: int, job: str, pid: int) -> dict[str, object]:
    """``strace -c -f -p PID`` (every thread of blockd's target) over fio's ``job`` on ``dev``:
    the target's system calls per I/O, by name. Counts, not times: ptrace slows the target, so
    this run's IOPS are not the table's, but what it asks of the kernel per I/O is the same."""
    _, rw, bs, depth = next(j for j in JOBS if j[0] == job)
    report = work / "strace.txt"
    tracer = subprocess.Popen(["strace", "-c", "-f", "-o", str(report), "-p", str(pid)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(2)  # attached to every thread
        r = fio(dev, rw, bs, depth, runtime, size)
    finally:
        tracer.send_signal(signal.SIGINT)
        tracer.wait(120)
    ios = max(r["iops"] * (runtime + RAMP), 1)  # the ramp's I/Os were traced too
    calls = {name: int(n) / ios for n, name in _STRACE_ROW.findall(report.read_text()) if name != "total"}
    return {"job": job, "ios": ios, "per_io": dict(sorted(calls.items(), key=lambda kv: -kv[1]))}


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


def start_fuse(work: Path, transport: str) -> tuple[Daemon, list[str], Path]:
    """The initiator daemon, connected to blockd's target over ``transport`` (2 I/O queues x 128)
    and mounted; returns it, the blockctl command prefix and the namespace's file."""
    _, addr, _, port = PORTS[transport]
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
    subprocess.run(ctl + ["connect", "-t", transport, "-a", addr, "-s", str(port), "-n", BLOCKD_NQN,
                          "--name", "vol", "-i", "2", "-Q", "128"], check=True, timeout=120)
    subprocess.run(ctl + ["mount", "vol", str(mnt)], check=True, timeout=60)
    return init, ctl, mnt / "ns1"


def run_transport(transport: str, work: Path, args: argparse.Namespace, target: Daemon) -> dict[str, object]:
    """Connect the kernel host to both targets (and the FUSE mount to blockd's) over
    ``transport``, run every job on each in turn, disconnect; the figures of that transport."""
    _, addr, kport, bport = PORTS[transport]
    out: dict[str, object] = {"jobs": {}}
    fuse: tuple[Daemon, list[str], Path] | None = None
    try:
        devs = {"nvmet": sh(f"nvmeh_connect {transport} {addr} {kport} {KERNEL_NQN}", timeout=180).split()[-1],
                "blockd": sh(f"nvmeh_connect {transport} {addr} {bport} {BLOCKD_NQN}", timeout=180).split()[-1]}
        # I/O queues of the kernel host's controller (queue_count includes the admin queue;
        # /sys/block/nvmeXnY has no mq/ under native multipath)
        ctrl = sh(f"nvmeh_ctrl {BLOCKD_NQN}").strip()
        out["blockd_dev"] = {"path": devs["blockd"], "blk_mq_queues": int(
            Path(f"/sys/class/nvme/{ctrl}/queue_count").read_text()) - 1}
        if not args.no_fuse:
            (work / transport).mkdir(exist_ok=True)
            fuse = start_fuse(work / transport, transport)
            devs["fuse"] = str(fuse[2])
        daemons = {"nvmet": {}, "blockd": {"target": target.proc.pid},
                   "fuse": {"target": target.proc.pid, "initiator": fuse[0].proc.pid} if fuse else {}}
        for key, rw, bs, depth in JOBS:
            if args.jobs and key not in args.jobs:
                continue
            for system, dev in devs.items():
                r = measured(dev, rw, bs, depth, args.runtime, args.size_mib << 20, daemons[system])
                out["jobs"].setdefault(key, {})[system] = r  # type: ignore[union-attr]
                print(f"{transport:<5} {key:<10} {system:<7} {r['iops']:>9,} IOPS {r['mbs']:>8,.1f} MB/s "
                      f"{r['lat_mean_us']:>8,.0f} / {r['lat_p99_us']:,.0f} us, guest busy "
                      f"{r['guest_busy_pct']:.0f} %, {r['cpu_us_per_io']}", flush=True)
        if args.syscalls:
            out["syscalls"] = syscalls(work, devs["blockd"], args.runtime, args.size_mib << 20, args.syscalls,
                                       target.proc.pid)
        if args.profile:
            out["profile"] = {system: profile(work, devs[system], args.runtime, args.size_mib << 20, args.profile_job)
                              for system in ("nvmet", "blockd")}
    finally:
        if fuse is not None:
            init, ctl, mounted = fuse
            subprocess.run(ctl + ["umount", str(mounted.parent)], timeout=60)
            init.stop()
        sh(f"nvmeh_disconnect {KERNEL_NQN} || true; nvmeh_disconnect {BLOCKD_NQN} || true", check=False)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--transport", choices=("tcp", "rdma", "both"), default="rdma")
    ap.add_argument("--runtime", type=int, default=10)
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--no-fuse", action="store_true")
    ap.add_argument("--profile", action="store_true", help="perf record a fio job on each kernel-host device")
    ap.add_argument("--profile-job", default="rr4k_qd1", choices=[j[0] for j in JOBS], help="the job --profile runs")
    ap.add_argument("--syscalls", choices=[j[0] for j in JOBS],
                    help="strace -c blockd's target over this job on its kernel-host device")
    ap.add_argument("--jobs", type=lambda v: v.split(","), default=None,
                    help=f"only these jobs (comma-separated, of {', '.join(j[0] for j in JOBS)})")
    ap.add_argument("--loop-queues", action="store_true", help="[target] threaded_queues = false for blockd's")
    ap.add_argument("--uring-queues", action="store_true", help="[target] io_uring_queues = true for blockd's")
    args = ap.parse_args()
    transports = ["rdma", "tcp"] if args.transport == "both" else [args.transport]
    work = Path("/dev/shm/rdma-bench")
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    sh("ip link set lo up")  # NVMe/TCP runs on the guest's loopback
    if "rdma" in transports:
        sh(f"bash {GUEST / 'rxe-up.sh'}", timeout=120)
        # permanent neighbours across the veth, as the VM tests: an rdma_cm address resolution that
        # has to ARP sometimes never answers in the TCG guest
        sh("ip neigh replace 192.0.2.1 lladdr $(cat /sys/class/net/veth0/address) dev veth1 nud permanent; "
           "ip neigh replace 192.0.2.2 lladdr $(cat /sys/class/net/veth1/address) dev veth0 nud permanent")
    res: dict[str, object] = {"runtime_s": args.runtime, "size_mib": args.size_mib,
                              "kernel": sh("uname -r").strip(), "transports": {}}
    for name in ("kernel.img", "blockd.img"):  # written through, so reads hit real pages
        sh(f"dd if=/dev/urandom of={work / name} bs=1M count={args.size_mib} status=none")

    sh(f"nvmet_subsys {KERNEL_NQN} BENCHKERNEL1 && nvmet_ns_file {KERNEL_NQN} 1 {work / 'kernel.img'}")
    ports = ""
    for t in transports:
        port_id, addr, kport, bport = PORTS[t]
        sh(f"nvmet_port {port_id} {t} {addr} {kport} && nvmet_link {port_id} {KERNEL_NQN}")
        ports += f'\n[[port]]\ntransport = "{t}"\naddress = "{addr}"\nport = {bport}\n'
    cfg = work / "target.toml"
    cfg.write_text(f"""
[logging]
level = "info"

[target]
threaded_queues = {str(not args.loop_queues).lower()}
io_uring_queues = {str(args.uring_queues).lower()}
{ports}
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
    try:
        wait_log(target, "target ready")  # every port listens (not the control socket's line)
        for t in transports:
            res["transports"][t] = run_transport(t, work, args, target)  # type: ignore[index]
    finally:
        target.stop()
        sh("nvmet_teardown", check=False)

    if "rdma" in transports:
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
