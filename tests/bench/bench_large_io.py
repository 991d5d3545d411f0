"""Benchmark: the target's CPU time, syscalls and user-space copies per large NVMe/TCP transfer
(128 KiB reads, 128 KiB in-capsule writes, 1 MiB R2T writes; 4 KiB for comparison), over real
loopback TCP.

The target (a :class:`target.service.TargetService` on uvloop, one namespace on a file in
/dev/shm, page cache) runs in a child process; this process is a blocking QD1 client speaking
NVMe/TCP by hand. The target's CPU time comes from /proc/PID/stat around each workload
(user + system) and this process's own (the client's) process time. ``--strace`` runs the child under
``strace -c -f`` and prints its syscall table per workload instead of timing.

At the end it prints the bytes each queue's PDU reader copied in user space (``reader.copied``:
moves within staging and copies from staging into a data PDU's destination buffer; run one
workload at a time to get them per I/O). Not a test (pytest does not collect bench_*.py). Run:

    .venv/bin/python tests/bench/bench_large_io.py [--ios 2000] [--workloads read-128k] [--strace]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from protocol.constants import IoOpcode  # noqa: E402
from protocol.nvme import CQE_FAST, build_sqe  # noqa: E402
from protocol.tcp import PduType  # noqa: E402
from tests.core.conftest import (  # noqa: E402
    capsule, config, connect_data, connect_sqe, free_port, h2c_data, icreq, incapsule_sgl, ns, prop_sqe, sub,
    transport_sgl,
)

SIZE = 64 << 20
WORKLOADS = {  # name: (opcode, bytes per I/O, in the capsule)
    "read-4k": (IoOpcode.READ, 4096, False),
    "read-32k": (IoOpcode.READ, 32 << 10, False),
    "read-64k": (IoOpcode.READ, 64 << 10, False),
    "read-128k": (IoOpcode.READ, 128 << 10, False),
    "write-4k": (IoOpcode.WRITE, 4096, True),
    "write-128k": (IoOpcode.WRITE, 128 << 10, True),
    "write-1m-r2t": (IoOpcode.WRITE, 1 << 20, False),
}
_STATUS = CQE_FAST.index("status")


def _target(path: str, port: int, counts_file: str, ready: multiprocessing.Event, zero_fill: bool,
            by_reference_min: int | None) -> None:
    """The child: serve until SIGTERM, then write each queue's ``reader.copied``."""
    import signal

    if by_reference_min is not None:
        from target import file_send
        file_send.BY_REFERENCE_MIN = by_reference_min

    if zero_fill:
        import target.tcp
        target.tcp.data_buffer = bytearray  # type: ignore[assignment]

    from blockd import eventloop
    from target.service import TargetService

    async def main() -> None:
        import asyncio
        cfg = config([port], [sub(namespaces=[ns(path, size=SIZE)])])
        service = TargetService(cfg)
        await service.start()
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        ready.set()
        await stop.wait()
        copied = {f"qid {qid}": queue.transport.reader.copied
                  for ctrl in service.target.controllers.values() for qid, queue in ctrl.queues.items()}
        Path(counts_file).write_text(f"bytes the reader copied: {copied}")
        await service.stop()

    eventloop.run(main())


class Client:
    """A blocking NVMe/TCP host at QD1."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray(2 << 20)
        self.sock.sendall(icreq())
        self.recv()

    def recv_exact(self, n: int) -> memoryview:
        view = memoryview(self.buf)[:n]
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if not k:
                raise ConnectionError("target closed")
            got += k
        return view

    def recv(self) -> tuple[int, int, bytes, int]:
        """(type, flags, header, data length) of the next PDU (its data is read and dropped)."""
        ptype, flags, hlen, _pdo, plen = struct.unpack("<BBBBI", self.recv_exact(8))
        header = bytes(self.recv_exact(hlen - 8))
        if plen > hlen:
            self.recv_exact(plen - hlen)
        return ptype, flags, header, plen - hlen

    def command(self, sqe: bytes, data: bytes = b"") -> tuple[int, int]:
        """One command to completion (an R2T answered with one H2CData): (status, DW0)."""
        self.sock.sendall(capsule(sqe, data))
        while True:
            ptype, _flags, header, _ = self.recv()
            if ptype == PduType.R2T:
                cid, ttag, offset, length = struct.unpack_from("<HHII", header, 0)
                self.sock.sendall(h2c_data(cid, ttag, offset, self.payload[offset:offset + length]))
            elif ptype == PduType.CAPSULE_RESP:
                cqe = CQE_FAST.unpack_from(header, 0)
                return cqe[_STATUS], cqe[0]

    payload = os.urandom(1 << 20)


def _cpu(pid: int) -> tuple[float, float]:
    """User and system seconds of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ios", type=int, default=2000)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--zero-fill", action="store_true",
                    help="data buffers by bytearray(n), zero-filled (the pure plane's), to compare")
    ap.add_argument("--strace", action="store_true", help="syscall counts of the target (strace -c -f)")
    ap.add_argument("--by-reference-min", type=int, default=None,
                    help="reads of at least this many bytes by reference (target/file_send.py; "
                         "default: its BY_REFERENCE_MIN; a large value turns it off)")
    args = ap.parse_args()
    port = free_port()
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        path = Path(tmp) / "vol.img"
        path.write_bytes(os.urandom(SIZE))  # real pages, not a hole
        counts_file = str(Path(tmp) / "counts")
        ctx = multiprocessing.get_context("fork")
        ready = ctx.Event()
        child = ctx.Process(target=_target, args=(str(path), port, counts_file, ready, args.zero_fill,
                                                             args.by_reference_min))
        child.start()
        ready.wait(30)
        admin = Client(port)
        status, cntlid = admin.command(connect_sqe(), connect_data())
        assert status == 0
        assert admin.command(prop_sqe(1, False, 0x14, value=0x00460001))[0] == 0
        io = Client(port)
        assert io.command(connect_sqe(qid=1, sqsize=127), connect_data(cntlid=cntlid & 0xFFFF))[0] == 0
        strace = None
        if args.strace:
            strace = subprocess.Popen(["strace", "-c", "-f", "-p", str(child.pid), "-o", str(Path(tmp) / "strace")])
            time.sleep(1)
        print(f"target per I/O, QD1 over loopback, {args.ios} I/Os each (load {os.getloadavg()[0]:.1f})")
        print("| workload | target CPU µs/IO (user + system) | client CPU µs/IO | IOPS |\n|---|---|---|---|")
        for name in args.workloads.split(","):
            opcode, length, in_capsule = WORKLOADS[name]
            blocks = length // 512
            sgl = incapsule_sgl(length) if in_capsule else transport_sgl(length)
            data = Client.payload[:length] if in_capsule else b""
            cpu0, t0, c0 = _cpu(child.pid), time.perf_counter(), time.process_time()
            for i in range(args.ios):
                slba = (i * blocks) % (SIZE // 512 - blocks)
                sqe = build_sqe(int(opcode), i & 0xFFFF, nsid=1, dptr=sgl, cdw10=slba, cdw12=blocks - 1)
                assert io.command(sqe, data)[0] == 0
            cpu1, wall, client = _cpu(child.pid), time.perf_counter() - t0, time.process_time() - c0
            user, system = ((b - a) / args.ios * 1e6 for a, b in zip(cpu0, cpu1))
            print(f"| {name} | {user + system:.0f} = {user:.0f} + {system:.0f} | {client / args.ios * 1e6:.0f} "
                  f"| {args.ios / wall:.0f} |")
        if strace is not None:
            strace.terminate()
            strace.wait()
            print((Path(tmp) / "strace").read_text())
        child.terminate()
        child.join(30)
        print(Path(counts_file).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
