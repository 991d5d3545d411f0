"""Micro-benchmark: the CPU cost of ``WriteIntentBitmap.mark`` when the bits are already on disk
(the per-write cost of replication in steady state), beside an empty coroutine of the same
signature (the floor of any ``await`` on the write path).

Not a test (pytest does not collect bench_*.py). Run:

    .venv/bin/python tests/bench/bench_bitmap_mark.py [--calls 200000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from target.backend import MemoryBackend  # noqa: E402
from target.replication.blockio import BackendBlockIO  # noqa: E402
from target.replication.metadata import Metadata  # noqa: E402


async def _empty(offset: int, length: int) -> None:
    pass


async def _cpu_per_call(fn: Callable[[int, int], Awaitable[None]], offset: int, length: int,
                        calls: int) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.process_time()
        for _ in range(calls):
            await fn(offset, length)
        best = min(best, (time.process_time() - start) / calls)
    return best


async def main(calls: int) -> None:
    md = await Metadata.format(BackendBlockIO(MemoryBackend(256 << 20)))
    bitmap = md.bitmap(await md.assign_slot(1))
    await bitmap.mark(0, 1 << 20)
    rows = [("empty coroutine", _empty, 4096, 4096),
            ("mark 4 KiB, bit on disk", bitmap.mark, 4096, 4096),
            ("mark 128 KiB over 3 regions, bits on disk", bitmap.mark, 1000, 131072)]
    for name, fn, offset, length in rows:
        print(f"{name:45s} {await _cpu_per_call(fn, offset, length, calls) * 1e6:6.3f} µs CPU per call")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200000)
    asyncio.run(main(parser.parse_args().calls))
