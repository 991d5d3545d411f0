"""The overlapping-writes load of issue 35, shared by the loopback test (a blockd replica,
tests/replication/test_overlap.py) and the VM bed (a kernel nvmet replica,
tests/vm/guest_tests/test_blockd.py): several hosts, each with its own association, write the
same blocks at once, more writes in flight than one replica queue holds. Every other block goes
with FUA, which makes the replica slower per write, so that its first queue fills and the second
takes the overflow: without ordering at the primary, that is when two writes to one block reach
the replica's two queues and land in the other order than on the primary."""

from __future__ import annotations

import asyncio
import hashlib

from initiator.controller import ConnectParams, Controller

BLOCKS = 64
"""Each host writes this many consecutive 4 KiB blocks per round, all at once."""


async def overlapping_rounds(params: ConnectParams, hosts: int, rounds: int, nsid: int = 1) -> int:
    """``rounds`` rounds of ``hosts`` associations writing the same ``BLOCKS`` blocks at once
    (a few ranges in turn, so that writes also cross regions); the number of writes
    acknowledged (each one must be: a failure raises)."""
    ctrls = [await Controller.connect(params) for _ in range(hosts)]
    acked = 0
    try:
        for rnd in range(rounds):
            base = (rnd % 8) * BLOCKS * 4096

            async def one(host: int, block: int) -> None:
                nonlocal acked
                data = hashlib.sha256(f"{rnd}/{host}/{block}".encode()).digest() * 128
                await ctrls[host].write_bytes(nsid, base + block * 4096, data, fua=block % 2 == 0)
                acked += 1
            await asyncio.gather(*(one(h, b) for b in range(BLOCKS) for h in range(hosts)))
    finally:
        for c in ctrls:
            await c.close()
    return acked
