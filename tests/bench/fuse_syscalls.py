"""Benchmark: system calls per I/O of each daemon behind a FUSE file, 4 KiB QD1, counted with
``strace -c -f``: blockd over FUSE io_uring, blockd over /dev/fuse, nbdkit + nbdfuse.

Run (root; fio, strace, nbdkit, nbdfuse installed)::

    .venv/bin/python tests/bench/fuse_syscalls.py [--ios 5000] [--workloads randread,randwrite]

For each system and workload: fio (psync, direct=1, 4 KiB, ``--ios`` I/Os) on the system's file
while one ``strace -c -f`` per daemon counts its calls; prints calls per I/O, total and by call
(those at 0.01 or more). strace slows every call down, so only the counts mean anything here, not
the speed (run_fuse_bench.py measures that). The path of a blockd mount is chosen at its INIT by
the fuse module's ``enable_uring`` (docs/wire-facts.md, "FUSE over io_uring"), set around each
mount and put back. Not collected by pytest (no test_ prefix).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "tests" / "fuse"))

from blockd_stack import Stack  # noqa: E402
from run_fuse_bench import NbdSystems, make_file, start_stack  # noqa: E402

SIZE = 256 << 20


def strace_counts(path: Path) -> dict[str, int]:
    """Calls by name from an ``strace -c`` summary (errors included: they are calls too)."""
    calls: dict[str, int] = {}
    for line in path.read_text().splitlines():
        f = line.split()
        if len(f) >= 5 and f[0][0].isdigit() and f[-1] != "total":
            calls[f[-1]] = int(f[3])
    return calls


def measure(file: Path, daemons: dict[str, int], rw: str, ios: int, work: Path) -> dict[str, dict[str, float]]:
    """Calls per I/O of each daemon (name -> pid) while fio runs ``rw`` on ``file``."""
    tracers = {}
    for name, pid in daemons.items():
        out = work / f"strace-{name}-{rw}.txt"
        tracers[name] = (subprocess.Popen(["strace", "-c", "-f", "-o", str(out), "-p", str(pid)],
                                          stderr=subprocess.DEVNULL), out)
    time.sleep(1.0)  # strace attaches to every thread
    proc = subprocess.run(["fio", "--name=q", f"--filename={file}", "--direct=1", "--ioengine=psync", f"--rw={rw}",
                           "--bs=4k", f"--number_ios={ios}", f"--size={SIZE}", "--output-format=json"],
                          capture_output=True, text=True, timeout=600)
    for tracer, _ in tracers.values():
        tracer.send_signal(signal.SIGINT)
        tracer.wait(30)
    if proc.returncode:
        raise RuntimeError(proc.stderr)
    job = json.loads(proc.stdout[proc.stdout.index("{"):])["jobs"][0]
    done = job["read" if "read" in rw else "write"]["total_ios"]
    result = {}
    for name, (_, out) in tracers.items():
        calls = strace_counts(out)
        per = {call: n / done for call, n in sorted(calls.items(), key=lambda kv: -kv[1])}
        result[name] = {"total": sum(per.values()), **{c: v for c, v in per.items() if v >= 0.01}}
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ios", type=int, default=5000)
    ap.add_argument("--workloads", default="randread,randwrite")
    args = ap.parse_args()
    for tool in ("fio", "strace", "nbdkit", "nbdfuse"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} is not installed")
    work = Path(tempfile.mkdtemp(prefix="blockd-syscalls.", dir="/dev/shm"))
    rows = []
    try:
        for system in ("blockd io_uring", "blockd /dev/fuse", "nbdfuse"):
            sub = work / system.replace(" ", "-").replace("/", "")
            sub.mkdir()
            backing = sub / "vol.img"
            make_file(backing, SIZE)
            if system == "nbdfuse":
                nbd = NbdSystems(sub, backing)
                file, daemons, stop = nbd.file, {"nbdfuse": nbd.nbdfuse.pid, "nbdkit": nbd.nbdkit.pid}, nbd.stop
            else:
                stack = start_stack(Stack(sub / "stack", size=SIZE, block_size=4096, log_level="warning",
                                          backing=backing), uring=system.endswith("io_uring"))
                print(stack.blockctl("mounts").stdout.strip(), flush=True)
                file, daemons, stop = stack.file, {"initiator": stack.initiator.pid,
                                                   "target": stack.target.pid}, stack.stop
            try:
                for rw in args.workloads.split(","):
                    for daemon, per in measure(file, daemons, rw, args.ios, sub).items():
                        calls = ", ".join(f"{c} {v:.2f}" for c, v in per.items() if c != "total")
                        rows.append(f"| {rw} 4k QD1 | {system} | {daemon} | {per['total']:.2f} | {calls} |")
                        print(rows[-1], flush=True)
            finally:
                stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n| workload | system | daemon | calls per I/O | by call |\n|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
