"""Micro-benchmark for instruction counts: a real target on a real loopback socket at QD1.

``bench_target_io.py`` feeds the connection without a socket, so the target's threaded queue
(``[target] threaded_queues``, docs/dataplane.md "The target's threaded queue") never engages
there. Here a :class:`target.service.TargetService` runs on uvloop in a thread of this process
and a blocking-socket host in the main thread sends N 4 KiB Reads, in-capsule Writes or in-capsule
FUA Writes (``fua-write``: each synced before its answer) one at a time, and prints the wall time
per I/O. Run it under callgrind twice with different N; the difference of the two totals divided by
the difference of N is the whole process's instructions per I/O (the host's share is the same in
both modes, so the difference between modes is the target's)::

    valgrind --tool=callgrind --callgrind-out-file=cg.1000 .venv/bin/python \\
        tests/bench/bench_target_socket.py 1000 read thread

``mode``: ``thread`` or ``loop`` (the key set in ``[target]``), or ``default`` (no key: for a
tree that does not know it). Not a test (pytest does not collect bench_*.py).
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

# the tree measured is the one on PYTHONPATH (main's, to compare), its tests/ for the helpers
sys.path.insert(0, os.path.join(os.environ.get("PYTHONPATH", "").split(":")[0] or os.getcwd(), "tests"))

import uvloop  # noqa: E402

from bench.blocking_host import completion, connect  # noqa: E402
from core.conftest import capsule, config, connect_data, connect_sqe, fill_file, free_port, ns, prop_sqe, sub  # noqa: E402
from protocol.constants import IoOpcode, SglId  # noqa: E402
from protocol.nvme import RW_CONTROL_FUA, build_sgl_data_block, build_sqe  # noqa: E402
from target.service import TargetService  # noqa: E402

SIZE = 16 << 20
IO = 4096


def _command(s: socket.socket, sqe: bytes, data: bytes = b"") -> dict:
    s.sendall(capsule(sqe, data))
    return completion(s)


def main() -> None:
    n, kind, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    path = Path(tempfile.mkdtemp(dir="/dev/shm")) / "vol.img"
    fill_file(path, SIZE)
    port = free_port()
    table = None if mode == "default" else {"threaded_queues": mode == "thread"}
    cfg = config([port], [sub(namespaces=[ns(path, size=SIZE)])], target=table)
    loop = uvloop.new_event_loop()
    ready = threading.Event()
    services: list[TargetService] = []

    def serve() -> None:
        asyncio.set_event_loop(loop)
        service = TargetService(cfg)
        loop.run_until_complete(service.start())
        services.append(service)
        ready.set()
        loop.run_forever()

    threading.Thread(target=serve, daemon=True).start()
    ready.wait()
    admin = connect(port)
    cntlid = _command(admin, connect_sqe(), connect_data())["dw0"] & 0xFFFF
    _command(admin, prop_sqe(1, False, 0x14, value=0x00460001))  # CC.EN
    io = connect(port)
    _command(io, connect_sqe(qid=1, sqsize=127), connect_data(cntlid=cntlid))
    opcode, sgl = (IoOpcode.READ, SglId.TRANSPORT_DATA_BLOCK) if kind == "read" else (IoOpcode.WRITE, SglId.DATA_BLOCK_OFFSET)
    control = RW_CONTROL_FUA if kind == "fua-write" else 0
    sqe = build_sqe(opcode, 1, nsid=1, dptr=build_sgl_data_block(sgl, 0, IO), cdw12=(IO // 4096 * 8 - 1) | control << 16)
    data = b"" if kind == "read" else b"\x5a" * IO
    start = time.perf_counter()
    for _ in range(n):
        _command(io, sqe, data)
    took = time.perf_counter() - start
    fast = services[0].target.controllers[cntlid].queues[1].transport.fast
    print(f"{n} {kind}s, {fast.served} served in C, {fast.thread_served if hasattr(fast, 'thread_served') else 0} "
          f"on the queue's thread, {took / n * 1e6:.1f} us per I/O", file=sys.stderr)
    os._exit(0)  # the daemon thread and its loop end with the process


if __name__ == "__main__":
    main()
