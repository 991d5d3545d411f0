"""The target's side of blockd's Digest command (:mod:`protocol.digest`): read a block range
from the namespace's backend and return one digest per chunk, for a primary's online verify.

The backend is read as a Read reads it (``read_into``, so a replicated or filtered backend
answers as it would to a host), in pieces of :data:`PIECE` bytes into reused buffers, and each
piece is hashed in the default executor while the next one is read. An 8 MiB range hashes in
~1-2 ms, which inline would hold the event loop, and every other command of the queue, that
long. In the executor the loop still waits for the GIL while a chunk of 100 kB or less is
hashed (python-xxhash holds it for those: a 64 KiB region), but gets it back between chunks and
at the interpreter's switch interval. Measured piece sizes (docs/benchmarks.md): 1 MiB 0.43-0.83 s
for a 256 MiB verify, 256 KiB 0.61-0.83 s, 8 MiB (read and hash no longer overlap) 1.22-1.33 s.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import structlog

from protocol.digest import (
    DIGEST_ALGORITHM, DIGEST_CHUNK, DIGEST_FAST, DIGEST_NLB, DIGEST_SLBA, HASHERS, Digests, digest_length,
)
from protocol.status import Status

if TYPE_CHECKING:
    from target.request import Request
    from target.subsystem import Namespace

log = structlog.get_logger("blockd.target.digest")

PIECE = 1 << 20
"""Bytes read and hashed at a time (see the module docstring); two buffers a command."""
POOL = 16
"""Most piece buffers kept between commands (a verify has 4 commands out at once, 2 each): a new
1 MiB ``bytearray`` is zero-filled and faulted in, which costs as much as reading it."""
_pool: list[bytearray] = []
_unpack = DIGEST_FAST.unpack_from


def check(req: Request, ns: Namespace) -> int:
    """The command's own checks, once the namespace is found and held: the range inside the
    namespace, a chunk of at least one block, a known algorithm, the exact transfer length."""
    fields = _unpack(req.sqe)
    blocks = fields[DIGEST_NLB] + 1
    if fields[DIGEST_SLBA] + blocks > ns.blocks:
        return Status.LBA_RANGE
    chunk = fields[DIGEST_CHUNK]
    if not chunk or fields[DIGEST_ALGORITHM] not in HASHERS:
        return Status.INVALID_FIELD
    return Status.SGL_INVALID_DATA_LENGTH if req.length != digest_length(blocks, chunk) else Status.SUCCESS


async def execute(req: Request) -> None:
    """Hash the range; a backend read error ends it with the status a Read gets for it."""
    ns = req.ns
    fields = _unpack(req.sqe)
    shift = ns.lba_shift
    start = fields[DIGEST_SLBA] << shift
    length = (fields[DIGEST_NLB] + 1) << shift
    out = req.buffer if req.buffer is not None else bytearray(req.length)  # RDMA: its registered slot
    digests = Digests(fields[DIGEST_ALGORITHM], length, fields[DIGEST_CHUNK] << shift, out)
    loop = asyncio.get_running_loop()
    buffers = [_pool.pop() if _pool else bytearray(PIECE) for _ in range(2)]
    hashing: asyncio.Future[None] | None = None
    try:
        for i, at in enumerate(range(start, start + length, PIECE)):
            piece = memoryview(buffers[i & 1])[:min(PIECE, start + length - at)]
            await ns.backend.read_into(at, piece)
            if hashing is not None:  # the previous piece, in the other buffer
                await hashing
            hashing = loop.run_in_executor(None, digests.feed, piece)
        if hashing is not None:
            await hashing
            hashing = None
    except OSError as exc:
        log.error("digest read failed", nsid=ns.nsid, offset=start, length=length, error=str(exc))
        req.status = getattr(exc, "status", Status.UNRECOVERED_READ_ERROR)  # as Controller._read
        return
    finally:
        if hashing is not None:  # a read failed while the last piece was hashed: its buffer is busy
            await asyncio.wait([hashing])
        for buf in buffers:
            if len(_pool) < POOL:
                _pool.append(buf)
    req.reply = out
