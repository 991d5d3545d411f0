"""Micro-benchmark: cost of parsing and building one SQE, one CQE and one NVMe/TCP data PDU
header with construct (interpreted and compiled) versus the struct layouts derived from the
same definitions (protocol.layout.fixed_layout).

Not a test (pytest does not collect bench_*.py). Run:

    .venv/bin/python tests/bench/bench_protocol.py [--seconds 0.05]
"""

from __future__ import annotations

import argparse
import os
import sys
import timeit

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from protocol import nvme, tcp  # noqa: E402


def per_op_ns(fn, seconds: float) -> float:
    """Best-of-5 mean nanoseconds per call of ``fn``."""
    timer = timeit.Timer(fn)
    n, _ = timer.autorange()
    n = max(1, int(n * seconds / 0.2))
    return min(timer.repeat(repeat=5, number=n)) / n * 1e9


def fmt(ns: float) -> str:
    return f"{ns / 1000:8.2f} µs" if ns >= 10_000 else f"{ns:8.0f} ns"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=0.05, help="time per measurement round")
    args = ap.parse_args()

    sqe_values = dict(opcode=0x02, flags=0x40, cid=0x1234, nsid=1, cdw2=0, cdw3=0, mptr=0,
                      dptr=nvme.build_sgl_data_block(0x5A, 0, 4096), cdw10=0x1000, cdw11=0,
                      cdw12=7, cdw13=0, cdw14=0, cdw15=0)
    cqe_values = dict(dw0=0, dw1=0, sqhd=5, sqid=1, cid=0x1234, status=0)
    pdu_values = dict(pdu_type=tcp.PduType.C2H_DATA, flags=tcp.PduFlags.LAST_PDU, hlen=24, pdo=24,
                      plen=24 + 4096, cccid=0x1234, ttag=0, datao=0, datal=4096)
    cases = [
        ("SQE (64 B)", nvme.SQE, nvme.SQE_FAST, sqe_values),
        ("CQE (16 B)", nvme.CQE, nvme.CQE_FAST, cqe_values),
        ("TCP data PDU header (24 B)", tcp.DATA_PDU_HEADER, tcp.DATA_PDU_HEADER_FAST, pdu_values),
    ]

    print(f"Python {sys.version.split()[0]}; best of 5, per operation")
    header = f"{'structure':28} {'op':6} {'construct':>11} {'compiled':>11} {'struct':>11} " \
             f"{'construct/struct':>17} {'compiled/struct':>16}"
    print(header)
    print("-" * len(header))
    for name, con, fast, values in cases:
        compiled = con.compile()
        raw = con.build(values)
        ordered = tuple(values[n] for n in fast.names)
        assert fast.pack(*ordered) == raw == compiled.build(values)
        assert fast.unpack_from(raw) == tuple(compiled.parse(raw)[n] for n in fast.names)
        unpack, pack = fast.unpack_from, fast.pack
        rows = {
            "parse": (lambda: con.parse(raw), lambda: compiled.parse(raw), lambda: unpack(raw)),
            "build": (lambda: con.build(values), lambda: compiled.build(values),
                      lambda: pack(*ordered)),
        }
        for op, (f_con, f_comp, f_fast) in rows.items():
            t_con, t_comp, t_fast = (per_op_ns(f, args.seconds) for f in (f_con, f_comp, f_fast))
            print(f"{name:28} {op:6} {fmt(t_con):>11} {fmt(t_comp):>11} {fmt(t_fast):>11} "
                  f"{t_con / t_fast:16.0f}x {t_comp / t_fast:15.0f}x")


if __name__ == "__main__":
    main()
