"""Micro-benchmark: the PDU reader's cost per PDU, compiled (``blockd/_pdu_reader.pyx``) against
the Python reference (``blockd/pdu_reader.py``), on the streams of 4 KiB QD1 I/O.

- host, read reply: C2HData (4 KiB, placed into the command's buffer) + CapsuleResp, one
  receive per I/O, as the initiator sees a QD1 read;
- target, write: CapsuleCmd with 4 KiB in-capsule data (placed into a new buffer, as
  ``target/tcp.py`` does), one receive per command.

Each I/O's bytes are copied into ``get_buffer()`` (the socket's part) and ``buffer_updated``'s
PDUs are taken; the copy and the ``place`` callback are the same Python code for both readers.
Not a test (pytest does not collect bench_*.py). Run:

    .venv/bin/python tests/bench/bench_pdu_reader.py [--seconds 0.2]
"""

from __future__ import annotations

import argparse
import os
import sys
import timeit

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from blockd._pdu_reader import PduReader as CReader  # noqa: E402
from blockd.pdu_reader import PduReader as PyReader  # noqa: E402
from blockd.tcp_pdu import PduWriter  # noqa: E402
from protocol.tcp import PduFlags, PduType  # noqa: E402

IO = 4096


def stream_of(ptype: int, digests: bool) -> tuple[bytes, int]:
    """One I/O's bytes as the reader receives them, and how many PDUs they hold."""
    writer = PduWriter()
    writer.hdgst = writer.ddgst = digests
    if ptype == PduType.C2H_DATA:
        bufs = writer.data_pdu(ptype, 7, 0, 0, bytes(IO), PduFlags.LAST_PDU) + writer.pdu(PduType.CAPSULE_RESP, bytes(16))
        return b"".join(bytes(b) for b in bufs), 2
    return b"".join(bytes(b) for b in writer.pdu(PduType.CAPSULE_CMD, bytes(64), bytes(IO))), 1


def per_io_ns(cls: type, ptype: int, digests: bool, seconds: float) -> float:
    """Best-of-5 nanoseconds per I/O (one receive, its PDUs taken)."""
    one, _ = stream_of(ptype, digests)
    n = len(one)
    if ptype == PduType.C2H_DATA:
        dest = memoryview(bytearray(IO))  # the command's buffer, reused as the host reuses it

        def place(t: int, header: memoryview, length: int) -> memoryview | None:
            return dest if t == PduType.C2H_DATA else None
        types = frozenset({PduType.C2H_DATA, PduType.CAPSULE_RESP})
    else:
        def place(t: int, header: memoryview, length: int) -> memoryview | None:
            return memoryview(bytearray(length))
        types = frozenset({PduType.CAPSULE_CMD})
    reader = cls(types, max_data=1 << 20, place=place)
    reader.hdgst = reader.ddgst = digests

    def io() -> None:
        reader.get_buffer(-1)[:n] = one
        for _ in reader.buffer_updated(n):
            pass

    timer = timeit.Timer(io)
    count, _ = timer.autorange()
    count = max(1, int(count * seconds / 0.2))
    return min(timer.repeat(repeat=5, number=count)) / count * 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=0.2, help="time per measurement round")
    args = ap.parse_args()
    print(f"Python {sys.version.split()[0]}; best of 5; ns per I/O (per PDU in brackets)")
    print(f"{'stream':50} {'pure':>16} {'compiled':>16} {'pure/compiled':>14}")
    for ptype, name in ((PduType.C2H_DATA, "host: C2HData 4 KiB placed + CapsuleResp"),
                        (PduType.CAPSULE_CMD, "target: CapsuleCmd + 4 KiB in-capsule")):
        for digests in (False, True):
            _, pdus = stream_of(ptype, digests)
            py = per_io_ns(PyReader, ptype, digests, args.seconds)
            c = per_io_ns(CReader, ptype, digests, args.seconds)
            label = name + (", digests" if digests else "")
            print(f"{label:50} {py:7.0f} ({py / pdus:5.0f}) {c:7.0f} ({c / pdus:5.0f}) {py / c:13.2f}x")


if __name__ == "__main__":
    main()
