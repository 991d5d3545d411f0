"""Micro-benchmark: the initiator's CPU per 4 KiB QD1 I/O through its FUSE path, in one process
and without the network, so that the compiled and the pure data plane can be compared on a
noisy machine.

One I/O: a READ, WRITE or FSYNC request sent into a SEQPACKET pair standing in for /dev/fuse ->
``FuseSession`` (its readiness callback, called by hand) -> ``BlockFiles`` -> ``Controller`` ->
``TcpHostConnection`` (a transport that drops what it is given) -> the target's answer (C2HData
with SUCCESS, or a CapsuleResp for a write or a Flush) fed to the connection as received bytes
-> the FUSE reply read back from the pair. Everything the initiator does per I/O runs, except
the TCP send and receive syscalls and the event loop's wait. Not a test (pytest does not
collect bench_*.py). Run:

    .venv/bin/python tests/bench/bench_fuse_path.py [--ios 20000] [--repeat 3]
    BLOCKD_PURE=1 .venv/bin/python tests/bench/bench_fuse_path.py

For counts that do not move with the machine's load, run it under
``valgrind --tool=callgrind`` twice with different ``--ios`` and divide the difference of the
instruction totals by the difference of I/Os (``docs/dataplane.md`` does).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from blockd.dataplane import DATA_PLANE  # noqa: E402
from blockd.tcp_pdu import PduWriter  # noqa: E402
from initiator.controller import ConnectParams, Controller, HostQueue, NamespaceInfo  # noqa: E402
from initiator.fuse.abi import FSYNC, FSYNC_IN, IN_HEADER, READ, RW_IN, WRITE  # noqa: E402
from initiator.fuse.session import FuseSession  # noqa: E402
from initiator.tcp import TcpHostConnection  # noqa: E402
from protocol.nvme import CQE_FAST  # noqa: E402
from protocol.tcp import PduFlags, PduType  # noqa: E402

IO = 4096
KINDS = ("read", "write", "fsync")


class _NullTransport:
    def write(self, data: bytes) -> None:
        pass

    def writelines(self, data: list[bytes]) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str) -> None:
        return None


async def _measure(kind: str, ios: int, warm: int) -> tuple[float, float]:
    """(user, system) µs per I/O of ``kind``: read, write or fsync."""
    ctrl = Controller(ConnectParams(traddr="127.0.0.1", subnqn="nqn.2026-11.io.blockd:bench"))
    ctrl._loop = asyncio.get_running_loop()
    conn = TcpHostConnection(HostQueue(1, 1), lambda *_: None)  # depth 1: the answer's CID is 0
    conn.connection_made(_NullTransport())  # type: ignore[arg-type]
    ctrl.io = [conn]
    ctrl.namespaces = {1: NamespaceInfo(1, 1024, IO, False)}
    ctrl._set_live(True)
    session = FuseSession({"bench": ctrl}, "bench", "/nonexistent", 60.0)
    ours, kernel = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setblocking(False)
    session.attach(ours.fileno())
    asyncio.get_running_loop().remove_reader(ours.fileno())  # served by hand below
    target = PduWriter()
    rw = RW_IN.pack(0, 2 * IO, IO, 0, 0, 0, 0)
    capsule_resp = b"".join(target.pdu(PduType.CAPSULE_RESP, CQE_FAST.pack(0, 0, 0, 1, 0, 0)))
    if kind == "write":
        request = IN_HEADER.pack(IN_HEADER.size + RW_IN.size + IO, WRITE, 5, 2, 0, 0, 0, 0, 0) + rw + bytes(IO)
        answer = capsule_resp
    elif kind == "fsync":
        request = IN_HEADER.pack(IN_HEADER.size + FSYNC_IN.size, FSYNC, 5, 2, 0, 0, 0, 0, 0) + FSYNC_IN.pack(0, 0, 0)
        answer = capsule_resp
    else:
        request = IN_HEADER.pack(IN_HEADER.size + RW_IN.size, READ, 5, 2, 0, 0, 0, 0, 0) + rw
        answer = b"".join(bytes(b) for b in target.data_pdu(PduType.C2H_DATA, 0, 0, 0, bytes(IO),
                                                             PduFlags.LAST_PDU | PduFlags.SUCCESS))
    size = len(answer)
    readable = session.on_readable

    def one() -> None:
        kernel.send(request)
        readable()
        conn.get_buffer(size)[:size] = answer
        conn.buffer_updated(size)
        kernel.recv(2 * IO)

    for _ in range(warm):
        one()
    before = os.times()
    for _ in range(ios):
        one()
    after = os.times()
    ours.close()
    kernel.close()
    return (after.user - before.user) / ios * 1e6, (after.system - before.system) / ios * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ios", type=int, default=20000)
    ap.add_argument("--warm", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3, help="best of this many runs")
    ap.add_argument("--only", choices=KINDS)
    args = ap.parse_args()
    print(DATA_PLANE)
    for name in KINDS:
        if args.only not in (None, name):
            continue
        user, system = min((asyncio.run(_measure(name, args.ios, args.warm)) for _ in range(args.repeat)), key=sum)
        print(f"{name:5}: {user + system:5.1f} µs CPU per I/O = {user:.1f} user + {system:.1f} system")


if __name__ == "__main__":
    main()
