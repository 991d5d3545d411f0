"""Benchmark: the target's NVMe/TCP queue thread on io_uring (``[target] io_uring_queues``,
target/_uring_loop.pyx), with SQPOLL and without (``io_uring_sqpoll``, ``io_uring_spin_us``),
against the same thread on its own system calls, behind the blockd FUSE mount on loopback, in
one run, alternated (issue 42).

Run (root; fio and strace installed)::

    .venv/bin/python tests/bench/bench_target_uring.py [--rounds 2] [--runtime 5] [--no-pin]
        [--ios 4000] [--workloads randread-1,randwrite-1,randread-32,randwrite-32] [--dir /var/tmp]
        [--loops "io_uring,system calls,io_uring + SQPOLL"] [--spin-us 1000]

Each round starts one stack per loop (the order reverses between rounds) and runs every
workload on it: fio 4 KiB random reads or writes, ``-1`` one job with psync (queue depth 1),
``-32`` one job with libaio at iodepth 32, direct I/O on the mount's file. Reported per loop and
workload: IOPS, and the target process's CPU (user + system), context switches and CPU
migrations per I/O (per I/O the target served in the same window: its namespace's read and
write counts; fio's own count leaves out its 1 s ramp, which the target's counters do not, and
dividing by it put every figure per I/O 1.2-1.3x too high, io_uring_enter 1.20-1.32 at QD1) (``/proc/PID/stat``, ``/proc/PID/task/*/sched``; the process's CPU holds its SQPOLL
threads' too, which are also shown apart with the CPUs they may run on), then, in a separate fio run of
``--ios`` I/Os under ``strace -c -f`` on the target (strace slows every call: its counts mean
something, its speed does not), the target's system calls per I/O, total and by call. Single-job
runs pin fio and every thread of both daemons to one CPU unless ``--no-pin``. Not collected by
pytest (no test_ prefix). ``--dir``: where the volumes live (default /dev/shm, tmpfs; the file
system decides which file steps the ring takes: ``TcpUringPath._takes_nowait``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "tests" / "fuse"))

from blockd_stack import Stack  # noqa: E402
from initiator.control import ControlClient  # noqa: E402
from fuse_syscalls import measure  # noqa: E402
from run_fuse_bench import cpu_seconds, make_file, run_fio, sched_counts, set_affinity, start_stack  # noqa: E402

SIZE = 256 << 20
SQPOLL = {"io_uring_queues": True, "io_uring_sqpoll": True, "io_uring_sqpoll_idle_ms": 10}
LOOPS = {"io_uring": {"io_uring_queues": True}, "system calls": {"io_uring_queues": False},
         "io_uring + SQPOLL": SQPOLL, "io_uring + SQPOLL + spin": {**SQPOLL, "io_uring_spin_us": 1000}}
"""The ways the target's queue thread does its I/O: its ``[target]`` settings (the spin's
length from ``--spin-us``)."""
PIN_CPU = {1}


def jobfile(path: Path, file: Path, rw: str, depth: int, runtime: int) -> Path:
    engine = "ioengine=psync\n" if depth == 1 else f"ioengine=libaio\niodepth={depth}\n"
    path.write_text(f"[global]\ndirect=1\ntime_based=1\nruntime={runtime}\nramp_time=1\nsize={SIZE}\n"
                    f"randrepeat=0\nnorandommap=1\nfilename={file}\n{engine}\n[job]\nrw={rw}\nbs=4k\nnumjobs=1\n")
    return path


def sqpoll_threads(pid: int) -> tuple[float, str]:
    """CPU seconds (user + system) of the kernel's SQPOLL threads of ``pid`` (tasks of it named
    ``iou-sqp-PID``) so far, and the CPUs they may run on."""
    total, cpus = 0.0, set()
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if not (task / "comm").read_text().startswith("iou-sqp-"):
                continue
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            cpus.update(line.split(":")[1].strip() for line in (task / "status").read_text().splitlines()
                        if line.startswith("Cpus_allowed_list"))
        except OSError:
            continue
    return total, ",".join(sorted(cpus)) or "-"


def ring_enters(stack: Stack) -> int:
    """The target's ``io_uring_enter`` calls so far, as its queue threads count them (``served_by``
    of ``blockctl target hosts``): no tracer slows the loop, so a bounded spin meets the timing it
    meets in use (strace's counts below do not)."""
    with ControlClient(str(stack.target_socket), timeout=10, daemon="target") as client:
        hosts = client.call({"op": "hosts"})["hosts"]
    return sum(q["served_by"].get("io_uring_enters", 0) for h in hosts for q in h["queues"])


def target_ios(stack: Stack) -> int:
    """Reads and writes the target has completed so far (its namespaces' counters): the I/Os the
    per-I/O figures are divided by, counted over the same window as they are."""
    with ControlClient(str(stack.target_socket), timeout=10, daemon="target") as client:
        namespaces = client.call({"op": "counters"})["namespaces"]
    return sum(n["ops"]["read"] + n["ops"]["write"] for n in namespaces)


def one(stack: Stack, work: Path, name: str, runtime: int, pin: bool, ios: int) -> dict[str, Any]:
    """One workload on a running stack: figures per I/O of its target process."""
    rw, depth = name.split("-")
    pid = stack.target.pid
    cpus = PIN_CPU if pin else None
    if pin:
        set_affinity([stack.target.pid, stack.initiator.pid], PIN_CPU)
    user0, sys0 = cpu_seconds(pid)
    sw0, mig0 = sched_counts(pid)
    sqp0, _ = sqpoll_threads(pid)
    enters0 = ring_enters(stack)
    ios0 = target_ios(stack)
    got = run_fio(jobfile(work / f"{name}.fio", stack.file, rw, int(depth), runtime), cpus, runtime * 4 + 60)
    user1, sys1 = cpu_seconds(pid)
    sw1, mig1 = sched_counts(pid)
    sqp1, sqp_cpus = sqpoll_threads(pid)
    enters1 = ring_enters(stack)
    done = max(target_ios(stack) - ios0, 1)
    out = {"iops": got["iops"], "user_us": (user1 - user0) * 1e6 / done, "sys_us": (sys1 - sys0) * 1e6 / done,
           "switches": (sw1 - sw0) / done, "migrations_per_1000": (mig1 - mig0) * 1000 / done,
           "sqpoll_us": (sqp1 - sqp0) * 1e6 / done, "sqpoll_cpus": sqp_cpus, "enters": (enters1 - enters0) / done,
           "fio_share": got["ios"] / done}
    if depth == "1":  # strace's pass at QD1 (the count); fio's own engine, ios I/Os
        calls = measure(stack.file, {"target": pid}, rw, ios, work)["target"]
        out["syscalls"] = calls.pop("total")
        out["by_call"] = ", ".join(f"{c} {v:.2f}" for c, v in calls.items())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--runtime", type=int, default=5)
    ap.add_argument("--ios", type=int, default=4000)
    ap.add_argument("--no-pin", action="store_true")
    ap.add_argument("--workloads", default="randread-1,randwrite-1,randread-32,randwrite-32")
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--loops", default=",".join(LOOPS), help="which of: " + ", ".join(LOOPS))
    ap.add_argument("--spin-us", type=int, default=1000, help="io_uring_spin_us of the spinning loop")
    args = ap.parse_args()
    LOOPS["io_uring + SQPOLL + spin"]["io_uring_spin_us"] = args.spin_us
    for tool in ("fio", "strace"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} is not installed")
    work = Path(tempfile.mkdtemp(prefix="blockd-uringq.", dir=args.dir))
    loops = args.loops.split(",")
    for loop in loops:
        if loop not in LOOPS:
            sys.exit(f"unknown loop {loop!r}: one of {', '.join(LOOPS)}")
    rows = []
    try:
        for r in range(args.rounds):
            order = loops if r % 2 == 0 else list(reversed(loops))
            for loop in order:
                sub = work / f"r{r}-{loop.replace(' ', '-')}"
                sub.mkdir()
                backing = sub / "vol.img"
                make_file(backing, SIZE)
                stack = start_stack(Stack(sub / "stack", size=SIZE, block_size=4096, log_level="warning",
                                          backing=backing, target_settings=LOOPS[loop]), uring=True)
                try:
                    for name in args.workloads.split(","):
                        pin = not args.no_pin and name.endswith("-1")
                        f = one(stack, sub, name, args.runtime, pin, args.ios)
                        rows.append(
                            f"| {r + 1} | {name} | {loop} | {f['iops']:,.0f} | {f['user_us']:.1f} + {f['sys_us']:.1f} "
                            f"| {f['sqpoll_us']:.1f} ({f['sqpoll_cpus']}) | {f['enters']:.2f} | {f['fio_share']:.2f} "
                            f"| {f['switches']:.2f} | {f['migrations_per_1000']:.1f} | "
                            + (f"{f['syscalls']:.2f} ({f['by_call']})" if "syscalls" in f else "") + " |")
                        print(rows[-1], flush=True)
                finally:
                    stack.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nvolumes in {args.dir}; pinned: {'no' if args.no_pin else 'single-job runs, CPU ' + str(sorted(PIN_CPU))}\n"
          "| round | workload | target loop | IOPS | target CPU µs/I/O (user + sys) | of it SQPOLL threads µs/I/O (their CPUs) "
          "| io_uring_enter/I/O (counted) | fio's I/Os / target's | context switches/I/O | migrations/1000 I/Os | target syscalls/I/O (strace) |"
          "\n|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
