"""Micro-benchmark: the verbs fast path's own cost per call, compiled (``blockd/rdma/_fast_verbs.pyx``)
against the ctypes reference (``blockd/rdma/_fast.py``), in the same run.

The provider is the fake of ``tests/rdma/test_fast_path.py`` with its ops slots pointed at C
stubs compiled here with gcc (``post_*`` return 0, ``poll_cq`` returns one completion,
``req_notify_cq`` 0), so what is timed is the caller's side only: building the chain in the
preallocated WRs, the call into the provider, reading the completion into a ``Wc`` tuple --
what the implementation changes. The provider's own work (rxe's queue writes, its doorbell
system call) comes on top, the same for both. Not a test (pytest does not collect bench_*.py).
Run:

    .venv/bin/python tests/bench/bench_rdma_fast.py [--seconds 0.2]
    valgrind --tool=callgrind --collect-atstart=no --callgrind-out-file=/tmp/cg.%p \
        .venv/bin/python tests/bench/bench_rdma_fast.py --callgrind 2000

``--callgrind N`` times nothing: it runs each case N times with callgrind's collection turned on
around the loop only (a client request from the stubs) and prints instructions per call,
which the machine's load does not change.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import timeit

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from blockd.rdma import _fast, _fast_verbs  # noqa: E402
from blockd.rdma.abi import SEND_SIGNALED, WR_RDMA_READ, WR_RDMA_WRITE, WR_SEND  # noqa: E402
from tests.rdma.test_fast_path import FakeProvider  # noqa: E402

STUBS = r"""
#include <stdint.h>
#include <string.h>
#include <valgrind/callgrind.h>
void stub_collect(int on) { if (on) CALLGRIND_ZERO_STATS; else CALLGRIND_DUMP_STATS; CALLGRIND_TOGGLE_COLLECT; }
int stub_post(void *qp, void *wr, void **bad) { return 0; }
int stub_notify(void *cq, int solicited) { return 0; }
int stub_poll1(void *cq, int n, void *wc) {
    if (n < 1) return 0;
    memset(wc, 0, 48);
    *(uint64_t *)wc = 0x100000007ULL;        /* wr_id */
    *(uint32_t *)((char *)wc + 16) = 4160;   /* byte_len */
    return 1;
}
"""


def load_stubs(tmp: str) -> ctypes.CDLL:
    src, lib = os.path.join(tmp, "stubs.c"), os.path.join(tmp, "stubs.so")
    with open(src, "w") as f:
        f.write(STUBS)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", lib, src], check=True)
    return ctypes.CDLL(lib)


def point_at_stubs(fake: FakeProvider, lib: ctypes.CDLL) -> None:
    for offset, name in ((_fast._POST_SEND, "stub_post"), (_fast._POST_RECV, "stub_post"),
                         (_fast._POLL_CQ, "stub_poll1"), (_fast._REQ_NOTIFY_CQ, "stub_notify")):
        ctypes.c_void_p.from_address(fake.ctx_ptr + offset).value = \
            ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


CASES = {
    "post_recv (1 WR)": lambda qp, cq: (qp.post_recv, [((1 << 48) | 3, 0x10000, 4160, 9)]),
    "post_send (SEND)": lambda qp, cq: (qp.post_send, [(5, WR_SEND, SEND_SIGNALED, 0x2000, 16, 9, 0, 0, 0)]),
    "chain RDMA WRITE + SEND": lambda qp, cq: (qp.post_send, [
        (6, WR_RDMA_WRITE, 0, 0x3000, 4096, 9, 0, 0xAA000, 0x55),
        (7, WR_SEND, SEND_SIGNALED, 0x2000, 16, 9, 0, 0, 0)]),
    "post_send (RDMA READ)": lambda qp, cq: (qp.post_send, [
        (8, WR_RDMA_READ, SEND_SIGNALED, 0x4000, 4096, 9, 0, 0xBB000, 0x66)]),
    "poll (1 WC)": lambda qp, cq: (lambda _: cq.poll(), None),
    "req_notify": lambda qp, cq: (lambda _: cq.req_notify(), None),
}


def ns_per_call(impl, fake: FakeProvider, case: str, seconds: float) -> float:
    qp, cq = fake.make_qp(impl, 16, 16), fake.make_cq(impl)
    fn, arg = CASES[case](qp, cq)
    timer = timeit.Timer(lambda: fn(arg))
    n, t = timer.autorange()
    n = max(1, int(n * seconds / t))
    return min(timer.repeat(5, n)) / n * 1e9


def collected(lib: ctypes.CDLL, impl, fake: FakeProvider, case: str, n: int) -> None:
    """Run ``case`` ``n`` times with callgrind collecting (then a dump: one file per call)."""
    qp, cq = fake.make_qp(impl, 16, 16), fake.make_cq(impl)
    fn, arg = CASES[case](qp, cq)
    fn(arg)  # warm
    lib.stub_collect(1)
    for _ in range(n):
        fn(arg)
    lib.stub_collect(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=0.2, help="per measurement (best of 5)")
    ap.add_argument("--callgrind", type=int, metavar="N", help="instructions, under callgrind")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-rdma-fast.") as tmp:
        lib = load_stubs(tmp)
        fake = FakeProvider()
        point_at_stubs(fake, lib)
        if a.callgrind:
            for case in CASES:
                for impl in (_fast, _fast_verbs):
                    print(f"callgrind dump: {impl.__name__} {case}", flush=True)
                    collected(lib, impl, fake, case, a.callgrind)
            return
        print(f"{'ns per call':28} {'ctypes':>9} {'compiled':>9}")
        for case in CASES:
            slow = ns_per_call(_fast, fake, case, a.seconds)
            fast = ns_per_call(_fast_verbs, fake, case, a.seconds)
            print(f"{case:28} {slow:9.0f} {fast:9.0f}   {slow / fast:4.1f}x")
        fake.close()
        assert not fake.stray


if __name__ == "__main__":
    main()
