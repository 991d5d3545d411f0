"""Does a threaded queue wait for the GIL when the loop is busy? QD1 latency next to a busy queue.

The target's threaded queue (docs/dataplane.md, "The target's threaded queue") takes the GIL
after each system call; while the event-loop thread runs Python (other queues on the loop), a
thread asking for the GIL may wait CPython's switch interval (5 ms). This measures it where it
would show: a ``blockd target`` process, a host process doing 4 KiB random Reads at QD1 on I/O
queue 1 (its latency percentiles), and a second host process keeping QD32 of Reads on queue 2
of the same controller, of ``4k`` (which go to queue 2's own thread as well) or ``128k`` (by
reference: served on the loop, queue 2 handing back per command), or none. The target's CPU
(user + system, from /proc) is divided by all I/Os of both queues::

    .venv/bin/python tests/bench/bench_thread_neighbours.py SECONDS {thread,loop,default} {none,4k,128k}

Not a test (pytest does not collect bench_*.py).
"""

from __future__ import annotations

import multiprocessing
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.environ.get("PYTHONPATH", "").split(":")[0] or os.getcwd(), "tests"))

from bench.blocking_host import completion, connect  # noqa: E402
from core.conftest import NQN, capsule, connect_data, connect_sqe, fill_file, prop_sqe  # noqa: E402
from fuse.blockd_stack import free_port, tool, wait_tcp  # noqa: E402
from protocol.constants import IoOpcode, SglId  # noqa: E402
from protocol.nvme import build_sgl_data_block, build_sqe  # noqa: E402

SIZE = 64 << 20
BLOCK = 512


def _io_queue(port: int, cntlid: int, qid: int) -> socket.socket:
    s = connect(port)
    s.sendall(capsule(connect_sqe(qid=qid, sqsize=127), connect_data(cntlid=cntlid)))
    assert completion(s)["status"] == 0, "I/O Connect failed"
    return s


def _read(cid: int, length: int, rng: random.Random) -> bytes:
    blocks = length // BLOCK
    slba = rng.randrange(SIZE // length) * blocks
    return capsule(build_sqe(IoOpcode.READ, cid, nsid=1, dptr=build_sgl_data_block(
        SglId.TRANSPORT_DATA_BLOCK, 0, length), cdw10=slba, cdw12=blocks - 1))


def _neighbour(port: int, cntlid: int, length: int, stop: multiprocessing.Event, done: multiprocessing.Value) -> None:
    """Queue 2: QD32 of Reads of ``length`` bytes until ``stop``; ``done``: how many completed."""
    rng = random.Random(2)
    s = _io_queue(port, cntlid, 2)
    s.sendall(b"".join(_read(cid, length, rng) for cid in range(32)))
    n = 0
    while not stop.is_set():
        completion(s)
        n += 1
        s.sendall(_read(n % 32, length, rng))
    done.value = n


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    seconds, mode, neighbour = float(sys.argv[1]), sys.argv[2], sys.argv[3]
    work = Path(tempfile.mkdtemp(dir="/dev/shm"))
    fill_file(work / "vol.img", SIZE)
    port = free_port()
    table = "" if mode == "default" else f"threaded_queues = {'true' if mode == 'thread' else 'false'}\n"
    (work / "target.toml").write_text(f"""[target]
{table}
[logging]
level = "warning"

[control]
socket = ""

[[port]]
transport = "tcp"
address = "127.0.0.1"
port = {port}

[[subsystem]]
nqn = "{NQN}"
serial = "BLOCKDBENCH0001"
allow_any_host = true

[[subsystem.namespace]]
nsid = 1
path = "{work / 'vol.img'}"
size = {SIZE}
block_size = {BLOCK}
""")
    target = subprocess.Popen([tool("blockd"), "target", "--config", str(work / "target.toml")],
                              stdout=subprocess.DEVNULL, stderr=open(work / "target.log", "wb"))
    try:
        wait_tcp(port, target)
        admin = connect(port)
        admin.sendall(capsule(connect_sqe(), connect_data()))
        cntlid = completion(admin)["dw0"] & 0xFFFF
        admin.sendall(capsule(prop_sqe(1, False, 0x14, value=0x00460001)))  # CC.EN
        completion(admin)
        probe = _io_queue(port, cntlid, 1)
        stop, done = multiprocessing.Event(), multiprocessing.Value("q", 0)
        other = None
        if neighbour != "none":
            other = multiprocessing.Process(target=_neighbour, args=(port, cntlid, 4096 if neighbour == "4k" else 128 << 10,
                                                                     stop, done))
            other.start()
            time.sleep(0.5)
        rng = random.Random(1)
        cpu0, t0 = _cpu(target.pid), time.monotonic()
        lat = []
        end = t0 + seconds
        while time.monotonic() < end:
            start = time.perf_counter_ns()
            probe.sendall(_read(1, 4096, rng))
            completion(probe)
            lat.append(time.perf_counter_ns() - start)
        cpu = _cpu(target.pid) - cpu0
        elapsed = time.monotonic() - t0
        stop.set()
        if other is not None:
            other.join(10)
        lat.sort()

        def pct(p: float) -> float:
            return lat[min(len(lat) - 1, int(p * len(lat)))] / 1000

        total = len(lat) + done.value
        print(f"{mode:7} neighbour={neighbour:5} probe {len(lat) / elapsed:7.0f} IOPS  p50 {pct(0.5):6.1f}  "
              f"p99 {pct(0.99):7.1f}  p99.9 {pct(0.999):7.1f}  max {lat[-1] / 1000:8.1f} us  "
              f">2ms {sum(x > 2_000_000 for x in lat)}  neighbour {done.value / elapsed:7.0f} IOPS  "
              f"target CPU {cpu / total * 1e6:5.1f} us/IO")
    finally:
        target.kill()
        target.wait()


if __name__ == "__main__":
    main()
