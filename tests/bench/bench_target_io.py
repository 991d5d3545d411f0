"""Micro-benchmark: the target's CPU time per 4 KiB QD1 Read and Write, from the capsule's bytes
arriving to the reply handed to the transport, with the compiled I/O path
(``target/_tcp_io.pyx``) and with every capsule going to the Python ``TargetQueue``.

A real :class:`target.tcp.TcpTargetConnection` of a real :class:`target.service.TargetService`
(one namespace on a file in /dev/shm, page cache) is driven in-process: its reader is fed each
capsule through ``get_buffer``/``buffer_updated`` (as asyncio's protocol calls it), and the reply
goes to a transport that only counts bytes (no socket: the send syscall is the same for both
paths and is left out). What is measured is the per-I/O work of the target's event-loop thread:
parse, checks, pread/pwrite, reply build, accounting, output batching (its ``flush`` runs after
each I/O, from the loop, as in the daemon). Not a test (pytest does not collect bench_*.py). Run:

    .venv/bin/python tests/bench/bench_target_io.py [--ios 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import target.tcp  # noqa: E402
from protocol.constants import IoOpcode, SglId  # noqa: E402
from protocol.fabrics import CONNECT_DATA  # noqa: E402
from protocol.nvme import build_sgl_data_block, build_sqe  # noqa: E402
from protocol.tcp import IC_REQ, PduType  # noqa: E402
from target.config import parse  # noqa: E402
from target.service import TargetService  # noqa: E402
from target.target import PortInfo  # noqa: E402

NQN = "nqn.2026-11.io.blockd:bench"
HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-000000000001"
IO = 4096
SIZE = 64 << 20


class CountingTransport(asyncio.Transport):
    """Takes the replies and counts their bytes: the socket's part of a transport, left out."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 1), "sockname": ("127.0.0.1", 4420)}.get(name, default)

    def write(self, data: Any) -> None:
        self.sent += len(data)

    def writelines(self, bufs: Any) -> None:
        for b in bufs:
            self.write(b)

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def close(self) -> None:
        pass


def capsule(sqe: bytes, data: bytes = b"") -> bytes:
    header = bytes([PduType.CAPSULE_CMD, 0, 72, 72 if data else 0]) + (72 + len(data)).to_bytes(4, "little")
    return header + sqe + data


def connect_capsule(qid: int, cntlid: int) -> bytes:
    sqe = bytearray(build_sqe(0x7F, 0, dptr=build_sgl_data_block(SglId.DATA_BLOCK_OFFSET, 0, 1024)))
    sqe[4] = 0x01
    sqe[42:44] = qid.to_bytes(2, "little")
    sqe[44:46] = (31 if qid == 0 else 127).to_bytes(2, "little")
    data = CONNECT_DATA.build(dict(hostid=bytes(16), cntlid=cntlid, subnqn=NQN, hostnqn=HOSTNQN))
    return capsule(bytes(sqe), data)


def feed(conn: target.tcp.TcpTargetConnection, raw: bytes) -> None:
    """What asyncio does with received bytes: into the reader's buffer, then buffer_updated."""
    pos = 0
    while pos < len(raw):
        room = conn.get_buffer(-1)
        n = min(len(room), len(raw) - pos)
        room[:n] = raw[pos:pos + n]
        pos += n
        conn.buffer_updated(n)


async def measure(path: Path, ios: int, repeat: int = 1, size: int = IO,
                  kinds: tuple[str, ...] = ("read", "write")) -> dict[str, float]:
    cfg = parse({"port": [], "subsystem": [{"nqn": NQN, "namespace": [
        {"nsid": 1, "path": str(path), "size": SIZE, "block_size": 512}]}], "control": {"socket": ""}}, "bench")
    service = TargetService(cfg)
    await service.start()
    port = PortInfo(1, "tcp", "127.0.0.1", "4420")
    admin = target.tcp.TcpTargetConnection(service.target, port)
    admin.connection_made(CountingTransport())
    icreq = IC_REQ.build(dict(pdu_type=PduType.IC_REQ, flags=0, hlen=128, pdo=0, plen=128, pfv=0, hpda=0,
                              dgst=0, maxr2t=0))
    feed(admin, icreq + connect_capsule(0, 0xFFFF))
    cntlid = next(iter(service.target.controllers))
    prop = bytearray(build_sqe(0x7F, 1))
    prop[4] = 0x00
    prop[44:48] = (0x14).to_bytes(4, "little")
    prop[48:56] = (0x00460001).to_bytes(8, "little")
    feed(admin, capsule(bytes(prop)))
    io = target.tcp.TcpTargetConnection(service.target, port)
    io.connection_made(CountingTransport())
    feed(io, icreq + connect_capsule(1, cntlid))
    await asyncio.sleep(0)
    blocks = SIZE // 512
    sgl_read = build_sgl_data_block(SglId.TRANSPORT_DATA_BLOCK, 0, size)
    sgl_write = build_sgl_data_block(SglId.DATA_BLOCK_OFFSET, 0, size)
    payload = os.urandom(size)
    nlb = size // 512
    out: dict[str, float] = {}
    for name, opcode, sgl, data in (("read", IoOpcode.READ, sgl_read, b""),
                                    ("write", IoOpcode.WRITE, sgl_write, payload)):
        if name not in kinds:
            out[name] = 0.0
            continue
        streams = [capsule(build_sqe(opcode, i & 0xFFFF, nsid=1, dptr=sgl, cdw10=(i * nlb) % (blocks - nlb),
                                     cdw12=nlb - 1), data)
                   for i in range(ios)]
        before = io.transport.sent
        t0 = time.process_time()
        for _ in range(repeat):
            for raw in streams:
                feed(io, raw)
                io.out.flush()  # the loop's call_soon, once per receive
        elapsed = time.process_time() - t0
        assert io.transport.sent - before >= repeat * ios * 24, "replies missing"
        out[name] = elapsed / (repeat * ios) * 1e6
    out["served"] = io.fast.served if io.fast is not None else 0
    await service.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ios", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mode", choices=("both", "compiled", "python queue"), default="both",
                    help="one mode only: for valgrind's instruction counts, taken at two --repeat values")
    ap.add_argument("--repeat", type=int, default=1,
                    help="feed the same capsules this many times (building them costs more than serving)")
    ap.add_argument("--size", type=int, default=IO, help="bytes per I/O (up to the 128 KiB in-capsule size)")
    ap.add_argument("--kinds", default="read,write", help="read, write or both (instruction counts per kind)")
    args = ap.parse_args()
    if target.tcp.TcpFastPath is None:
        sys.exit("the compiled data plane is not in use (BLOCKD_PURE=1 or not built)")
    compiled = target.tcp.TcpFastPath
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        path = Path(tmp) / "vol.img"
        path.write_bytes(os.urandom(SIZE))
        best: dict[str, dict[str, float]] = {}
        for _ in range(args.rounds):  # interleaved, best of each
            for mode, fast in (("compiled", compiled), ("python queue", None)):
                if args.mode not in ("both", mode):
                    continue
                target.tcp.TcpFastPath = fast
                got = asyncio.run(measure(path, args.ios, args.repeat, args.size,
                                               tuple(args.kinds.split(","))))
                for k in ("read", "write"):
                    best.setdefault(mode, {})[k] = min(best.get(mode, {}).get(k, 1e9), got[k])
                best[mode]["served"] = got["served"]
    print(f"target CPU per {args.size >> 10} KiB QD1 I/O (µs, process time, best of {args.rounds} x {args.ios} I/Os)")
    if args.mode != "both":
        print(", ".join(f"{k} {best[args.mode][k]:.2f}" for k in ("read", "write")))
        return 0
    print("| I/O | Python queue | compiled | ratio |\n|---|---|---|---|")
    for k in ("read", "write"):
        py, c = best["python queue"][k], best["compiled"][k]
        print(f"| {k} | {py:.2f} | {c:.2f} | {py / c:.1f}× |")
    print(f"(compiled path served {best['compiled']['served']:.0f} of {2 * args.ios} per round)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
