"""Where the target's CPU goes during a 4 KiB QD1 random read through the FUSE mount: ``perf
record`` of the ``blockd target`` process, reported by shared object and by symbol.

A blockd stack (target + initiator + mount, as ``run_fuse_bench.py`` starts it) on a 256 MiB file
in /dev/shm; fio reads it with one job, psync, direct=1, pinned with both daemons to the last
CPU; after 3 s, ``perf record -F 1999 -p TARGET`` samples for 6 s. ``BLOCKD_PURE=1`` in the
environment profiles the pure plane instead. Root, fio and perf needed; run under the bench lock:

    flock /tmp/blockd-bench.lock .venv/bin/python tests/bench/perf_target_read.py

Not collected by pytest (no test_ prefix).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fuse"))

from blockd_stack import Stack  # noqa: E402

SIZE = 256 << 20


def pin(pids: list[int], cpu: int) -> None:
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(tid), {cpu})


def report(data: Path, sort: str, lines: int) -> str:
    out = subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--sort", sort, "--stdio"],
                         capture_output=True, text=True, check=True).stdout
    return "\n".join([line for line in out.splitlines() if line and not line.startswith("#")][:lines])


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="blockd-perf.", dir="/dev/shm"))
    backing = work / "vol.img"
    with open(backing, "wb") as f:
        chunk = os.urandom(1 << 20)
        for _ in range(SIZE >> 20):
            f.write(chunk)
    stack = Stack(work / "blockd", size=SIZE, block_size=4096, log_level="warning", backing=backing).start()
    try:
        cpu = max(os.sched_getaffinity(0))
        pin([stack.target.pid, stack.initiator.pid], cpu)
        job = work / "read.fio"
        job.write_text(f"[read]\nfilename={stack.file}\ndirect=1\nioengine=psync\nrw=randread\nbs=4k\n"
                       f"size={SIZE}\ntime_based=1\nruntime=12\nnorandommap=1\nrandrepeat=0\n")
        fio = subprocess.Popen(["fio", "--output-format=terse", str(job)], stdout=subprocess.PIPE, text=True,
                               preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
        time.sleep(3)
        data = work / "perf.data"
        subprocess.run(["perf", "record", "-F", "1999", "-o", str(data), "-p", str(stack.target.pid),
                        "--", "sleep", "6"], capture_output=True, check=True)
        print(f"fio read IOPS: {fio.communicate()[0].split(';')[7]}")
        print(report(data, "dso", 12))
        print(report(data, "dso,symbol", 40))
    finally:
        stack.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
