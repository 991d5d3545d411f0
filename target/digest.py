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

That is the reference. On the compiled plane a plain file backend (the one that has a
:class:`~target.backend.FileBackend` ``fast`` copy of its descriptor) is read and hashed by
``target/_digest.pyx`` instead, the whole range in one executor call that holds no GIL
(:func:`compiled_file`, :func:`hash_file`): the Python loop above spent its time between pieces,
not hashing. A replicated, filtered or rbd backend keeps the Python loop, through its
``read_into``.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import structlog

from blockd.dataplane import twin
from protocol.digest import (
    DIGEST_ALGORITHM, DIGEST_CHUNK, DIGEST_FAST, DIGEST_NLB, DIGEST_SLBA, HASHERS, DigestAlgorithm, Digests,
    digest_length,
)
from protocol.status import Status

if TYPE_CHECKING:
    from target.backend import Backend
    from target.io_fast import FastFile
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
_file_digests = getattr(twin("target._digest", hint="libxxhash-dev"), "file_digests", None)


def compiled_file(backend: Backend, algorithm: int) -> FastFile | None:
    """The plain file whose range :func:`hash_file` reads and hashes in C for ``backend``, or
    None: the Python loop runs (the pure plane, the module not built, another algorithm, or a
    backend that is no plain :class:`~target.backend.FileBackend`: only that one has ``fast``)."""
    file = getattr(backend, "fast", None)
    return file if _file_digests is not None and algorithm == DigestAlgorithm.XXH3_128 else None


async def hash_file(file: FastFile, offset: int, length: int, chunk: int, out: bytearray | memoryview) -> None:
    """The digests of ``length`` bytes of ``file`` from ``offset``, a chunk of ``chunk`` bytes
    each, into ``out``: one executor call for the whole range, the GIL released throughout. A
    failed read raises ``OSError`` as ``read_into`` does."""
    await asyncio.get_running_loop().run_in_executor(None, _file_digests, file, offset, length, chunk, out)


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
    chunk = fields[DIGEST_CHUNK] << shift
    file = compiled_file(ns.backend, fields[DIGEST_ALGORITHM])
    try:
        if file is not None:
            await hash_file(file, start, length, chunk, out)
        else:
            await _hash_backend(ns.backend, start, length, Digests(fields[DIGEST_ALGORITHM], length, chunk, out))
    except OSError as exc:
        log.error("digest read failed", nsid=ns.nsid, offset=start, length=length, error=str(exc))
        req.status = getattr(exc, "status", Status.UNRECOVERED_READ_ERROR)  # as Controller._read
        return
    req.reply = out


async def _hash_backend(backend: Backend, start: int, length: int, digests: Digests) -> None:
    """The reference: read the range through ``read_into`` in pieces, each hashed in the
    executor while the next is read (see the module docstring)."""
    loop = asyncio.get_running_loop()
    buffers = [_pool.pop() if _pool else bytearray(PIECE) for _ in range(2)]
    hashing: asyncio.Future[None] | None = None
    try:
        for i, at in enumerate(range(start, start + length, PIECE)):
            piece = memoryview(buffers[i & 1])[:min(PIECE, start + length - at)]
            await backend.read_into(at, piece)
            if hashing is not None:  # the previous piece, in the other buffer
                await hashing
            hashing = loop.run_in_executor(None, digests.feed, piece)
        if hashing is not None:
            await hashing
            hashing = None
    finally:
        if hashing is not None:  # a read failed while the last piece was hashed: its buffer is busy
            await asyncio.wait([hashing])
        for buf in buffers:
            if len(_pool) < POOL:
                _pool.append(buf)
