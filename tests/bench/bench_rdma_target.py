"""Micro-benchmark: what the RDMA target spends per 4 KiB read (or write) command, in process.

The target's RDMA I/O queue runs on :mod:`tests.core.rdma_sim`'s fake device and host (the
verbs posts go through the running plane's ``FastQP`` onto the recording provider), so what is
measured is the target's own per-command work: the receive completion's handling, the read into
the registered slot, the RDMA WRITE + SEND posted, the SEND completion's handling -- without
rxe or the kernel. QD1: one capsule, one completion batch for it, one for its SEND (``--fetch``:
a 128 KiB write by RDMA READ, as the kernel host sends one: one batch more, for its READ). Not a test
(pytest does not collect bench_*.py). Run (take the difference of two ``--ios`` to cancel the
start-up; ``BLOCKD_PURE=1`` for the Python path, or ``--python`` for the Python per-command path
with the rest of the compiled plane). ``--callgrind`` counts the target's side only: collection
is switched on around each call of the target's completion callback (a client request from a
stub compiled here), so the simulated host's work is not in the figure::

    PYTHONPATH=. valgrind --tool=callgrind --collect-atstart=no --callgrind-out-file=/tmp/cg.%p \\
        .venv/bin/python tests/bench/bench_rdma_target.py --callgrind --ios 2000
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import pytest  # noqa: E402  (MonkeyPatch only)

import target.rdma  # noqa: E402
from protocol.constants import IoOpcode, SglId  # noqa: E402
from protocol.nvme import build_sgl_data_block, build_sgl_keyed, build_sqe  # noqa: E402
from target.rdma import RdmaListener  # noqa: E402
from target.target import PortInfo  # noqa: E402
from tests.core.conftest import config, connect_data, connect_sqe, free_port, ns, raw_admin, serving, sub  # noqa: E402
from tests.core.rdma_sim import open_queue, patch_device  # noqa: E402


TOGGLE = r"""
#include <valgrind/callgrind.h>
void toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
"""


def toggled(fn, toggle):
    """``fn`` with callgrind's collection switched (on if off, off if on) during each call."""
    def call(*args):
        toggle()
        try:
            return fn(*args)
        finally:
            toggle()
    return call


def collect_target_only(conn, host, tmp: str) -> None:
    """Collect inside the target's completion callback, but not in the fake provider's
    recording of what it posts (the simulated host's work)."""
    src, lib = os.path.join(tmp, "toggle.c"), os.path.join(tmp, "toggle.so")
    with open(src, "w") as f:
        f.write(TOGGLE)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", lib, src], check=True)
    toggle = ctypes.CDLL(lib).toggle
    conn.cq.callback = toggled(conn.cq.callback, toggle)
    host.provider._post = toggled(host.provider._post, toggle)


async def bench(path: Path, ios: int, write: bool, fetch: bool, callgrind: bool) -> float:
    port = free_port()
    cfg = config([port], [sub(namespaces=[ns(path, size=64 << 20)])])
    async with serving(cfg) as service:
        admin, cntlid = await raw_admin(port)
        listener = RdmaListener(service.target, PortInfo(2, "rdma", "192.0.2.1", "4420"))
        conn, host = open_queue(listener, 1, 32)
        assert host.capsule(connect_sqe(qid=1, sqsize=31), connect_data(cntlid=cntlid))
        while host.step():
            pass
        if callgrind:
            collect_target_only(conn, host, str(path.parent))
        size = (128 << 10) if fetch else 4096
        addr, key = host.buffer(1, bytes(size) if fetch else size)
        data = bytes(4096)
        if write:
            dptr = build_sgl_data_block(SglId.DATA_BLOCK_OFFSET, 0, 4096)
        else:
            dptr = build_sgl_keyed(addr, size, key, SglId.KEYED_DATA_BLOCK_INVALIDATE)
        opcode = IoOpcode.WRITE if write or fetch else IoOpcode.READ
        blocks = size // 512
        sqes = [build_sqe(opcode, 1, nsid=1, dptr=dptr, cdw10=(i * blocks) % (64 << 11), cdw12=blocks - 1)
                for i in range(256)]
        before = len(host.responses)
        t0 = time.perf_counter()
        for i in range(ios):
            host.capsule(sqes[i & 255], data if write else b"")
            host.step()  # the command
            if fetch:
                host.step()  # its RDMA READ's completion
            host.step()  # its SEND's completion
        elapsed = time.perf_counter() - t0
        assert len(host.responses) - before == ios
        assert all(r[14:16] == b"\0\0" for r in host.responses[before:])
        conn.close()
        await asyncio.gather(*listener.teardowns)
        await admin.close()
        return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ios", type=int, default=2000)
    ap.add_argument("--write", action="store_true", help="4 KiB in-capsule writes instead of reads")
    ap.add_argument("--fetch", action="store_true", help="128 KiB writes by RDMA READ instead of reads")
    ap.add_argument("--python", action="store_true", help="without the compiled per-command path")
    ap.add_argument("--callgrind", action="store_true", help="collect only inside the target's callback")
    a = ap.parse_args()
    mp = pytest.MonkeyPatch()
    patch_device(mp)
    if a.python:
        mp.setattr(target.rdma, "RdmaFastPath", None)
    with tempfile.TemporaryDirectory(prefix="bench-rdma-target.") as tmp:
        path = Path(tmp) / "ns.img"
        with open(path, "wb") as f:
            f.truncate(64 << 20)
        elapsed = asyncio.run(bench(path, a.ios, a.write, a.fetch, a.callgrind))
    what = "128 KiB writes by RDMA READ" if a.fetch else "writes" if a.write else "reads"
    print(f"{a.ios} {what}: {elapsed / a.ios * 1e6:.1f} us per command")


if __name__ == "__main__":
    main()
