"""Micro-benchmark: the primary's CPU per replicated 4 KiB write inside the mirror
(``ReplicatedBackend.write``), with replicas that complete at once, beside the RAM backend alone:
what the mirror's bookkeeping costs a write (bits, the overlap check, the join), without the
network. Writes never overlap here, so it shows what ordering overlapping writes costs those
that do not overlap.

``--local file`` puts the local copy in a file (a ``FileBackend`` in a temporary directory)
instead of RAM, and ``--lane`` writes through the compiled lane (``MirrorLane.write``,
``target/replication/_mirror_io.pyx``, what the target's compiled TCP path calls) instead of
``ReplicatedBackend.write`` (it needs the file; each lane write still costs the bench a future,
which the transport does not have).

Not a test (pytest does not collect bench_*.py). The timings move with the machine's load;
under callgrind the instruction counts do not (compare two trees with ``--writes 2000``):

    .venv/bin/python tests/bench/bench_mirror_write.py [--writes 20000]
    valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.out \\
        .venv/bin/python tests/bench/bench_mirror_write.py --writes 2000 --replicas 1 --depth 1 --rounds 1 \\
        --device-mib 16 [--local file [--lane]]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from typing import Any, Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from target.backend import Backend, FileBackend, MemoryBackend  # noqa: E402
from target.replication.link import IN_SYNC  # noqa: E402
from target.replication import mirror  # noqa: E402
from target.replication.mirror import ReplicatedBackend  # noqa: E402

mirror.SWEEP_INTERVAL = 3600.0
"""No lazy clear of bits during a run: it runs on a timer, so how many sweeps a run pays would
follow its wall time (slow under callgrind), not its writes."""

REGION = 64 << 10


class InstantReplica:
    """A replica whose writes complete on the next loop iteration (as a reply would)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.block_size = 512
        self.store = MemoryBackend(size)
        self.stale_for = 0.0  # the replica side of target.replication.link.ReplicaIO
        self.gave_up = False

    def submit_write(self, offset: int, data: Any, fua: bool, done: Callable[[BaseException | None], None]) -> None:
        asyncio.get_running_loop().call_soon(done, None)

    async def read(self, offset: int, length: int) -> bytes:
        return bytes(self.store.data[offset:offset + length])

    async def write(self, offset: int, data: Any, fua: bool = False) -> None:
        self.store.data[offset:offset + len(data)] = data

    async def flush(self) -> None:
        pass

    async def write_zeroes(self, offset: int, length: int) -> None:
        pass

    async def close(self) -> None:
        pass


async def _backend(replicas: int, device: int, local: Backend) -> Any:
    if not replicas:
        return local
    stores = [InstantReplica(device) for _ in range(replicas)]

    def opener(i: int) -> Callable[[], Any]:
        async def open_() -> InstantReplica:
            return stores[i]
        return open_
    m = await ReplicatedBackend.open(local, [(f"r{i}", opener(i)) for i in range(replicas)],
                                     REGION, 1, 1 << 30, 4, name="bench")
    m.start()
    while any(link.state != IN_SYNC for link in m.links):
        await asyncio.sleep(0.01)
    for offset in range(0, m.size - REGION + 1, REGION):  # warm: every region's bit set
        await m.write(offset, bytes(4096))
    return m


async def _measure(replicas: int, depth: int, writes: int, rounds: int, device: int, local: Backend,
                   lane: bool) -> float:
    """Best CPU µs per write over ``rounds`` runs of ``writes`` writes, ``depth`` at once."""
    backend = await _backend(replicas, device, local)
    write = backend.write
    if lane:
        assert replicas and backend.lane is not None, "--lane needs replicas, --local file and the compiled plane"
        loop = asyncio.get_running_loop()

        async def write(offset: int, data: bytes) -> None:
            fut = loop.create_future()
            if not backend.lane.write(offset, data, fut.set_result):
                raise AssertionError("the lane declined a steady write")
            if await fut is not None:
                raise AssertionError("a replica failed")
    data = os.urandom(4096)
    span = backend.size // 4096
    best = float("inf")
    for _ in range(rounds):
        nxt = 0

        async def worker() -> None:
            nonlocal nxt
            while nxt < writes:
                block = (nxt * 7919) % span  # spread, never two at once on one block
                nxt += 1
                await write(block * 4096, data)
        start = time.process_time()
        await asyncio.gather(*(worker() for _ in range(depth)))
        best = min(best, (time.process_time() - start) / writes * 1e6)
    if replicas:
        await backend.stop()
    local.close()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writes", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--replicas", type=int, choices=(0, 1, 2), action="append")
    parser.add_argument("--depth", type=int, action="append")
    parser.add_argument("--device-mib", type=int, default=256,
                        help="the volume (small under callgrind: the first sync and the warm-up write it all)")
    parser.add_argument("--local", choices=("ram", "file"), default="ram")
    parser.add_argument("--lane", action="store_true", help="write through the compiled lane (--local file)")
    args = parser.parse_args()
    tmp = tempfile.TemporaryDirectory(prefix="bench-mirror-")

    made = []

    def local() -> Backend:  # a new file per measurement (a new volume, as the RAM one)
        size = args.device_mib << 20
        made.append(size)
        return MemoryBackend(size) if args.local == "ram" else FileBackend(os.path.join(tmp.name, f"{len(made)}.img"), size)
    print("| replicas | QD | CPU µs per write (best of runs) |")
    print("|---|---|---|")
    for replicas in args.replicas or ((1, 2) if args.lane else (0, 1, 2)):
        for depth in args.depth or (1, 32):
            us = asyncio.run(_measure(replicas, depth, args.writes, args.rounds, args.device_mib << 20, local(),
                                      args.lane))
            print(f"| {replicas} | {depth} | {us:.1f} |", flush=True)


if __name__ == "__main__":
    main()
