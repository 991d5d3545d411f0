"""How a FUSE session chooses between FUSE over io_uring and /dev/fuse at INIT, without a kernel
mount: a SEQPACKET socket stands in for /dev/fuse (``test_fuse_loop.py``'s way). The ring itself
serving requests needs a real connection: ``tests/fuse/test_fuse_uring.py``."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import mmap
import socket
from pathlib import Path
from typing import Iterator

import pytest

from initiator.fuse.abi import (
    FUSE_INIT_EXT, FUSE_KERNEL_VERSION, FUSE_OVER_IO_URING, IN_HEADER, INIT, INIT_OUT, OUT_HEADER,
)
from initiator.fuse.session import RING_PAYLOAD, FuseLoop, FuseSession, possible_cpus

from .conftest import run

compiled_only = pytest.mark.skipif(FuseLoop is None, reason="the ring is the compiled loop's (not built, or BLOCKD_PURE)")

INIT_IN_FULL = 64
"""``sizeof(struct fuse_init_in)`` as kernels with FUSE_INIT_EXT send it (flags2, then unused)."""


def _init(unique: int, flags: int) -> bytes:
    arg = bytearray(INIT_IN_FULL)
    arg[0:16] = (FUSE_KERNEL_VERSION).to_bytes(4, "little") + (45).to_bytes(4, "little") + \
        (1 << 17).to_bytes(4, "little") + (flags & 0xFFFFFFFF).to_bytes(4, "little")
    arg[16:20] = (flags >> 32).to_bytes(4, "little")
    return IN_HEADER.pack(IN_HEADER.size + len(arg), INIT, unique, 0, 0, 0, 0, 0, 0) + bytes(arg)


@contextlib.contextmanager
def _session(compiled: bool) -> Iterator[tuple[FuseSession, socket.socket]]:
    session = FuseSession({}, "c", "/nonexistent", 60.0, compiled=compiled)
    ours, kernel = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setblocking(False)
    kernel.settimeout(5.0)
    session.attach(ours.detach())  # the session closes it (and its ring) as an unmount does
    try:
        yield session, kernel
    finally:
        session.close()
        kernel.close()


def _init_reply(kernel: socket.socket) -> tuple[int, int]:
    """The INIT reply's flags and flags2."""
    raw = kernel.recv(4096)
    _, err, _ = OUT_HEADER.unpack_from(raw)
    assert err == 0
    out = INIT_OUT.unpack_from(raw, OUT_HEADER.size)
    return out[3], out[10]


def test_possible_cpus_counts_every_range(tmp_path: Path) -> None:
    f = tmp_path / "possible"
    for text, count in (("0\n", 1), ("0-1\n", 2), ("0-3,8\n", 5), ("0,2-3,6-7\n", 5)):
        f.write_text(text)
        assert possible_cpus(str(f)) == count


@compiled_only
def test_an_init_offering_the_ring_is_answered_with_it_and_the_ring_is_made() -> None:
    async def main() -> None:
        with _session(compiled=True) as (session, kernel):
            kernel.send(_init(1, FUSE_INIT_EXT | FUSE_OVER_IO_URING))
            session.on_readable()
            flags, flags2 = _init_reply(kernel)
            assert flags & FUSE_INIT_EXT and flags2 << 32 == FUSE_OVER_IO_URING
            assert session.transport == "io_uring"
            assert session.transport_reason == f"{possible_cpus()} queues x 8 entries"
            # a socket is no /dev/fuse: each registration is refused at once, and the session says
            # the kernel went back to /dev/fuse (as it does when a REGISTER fails)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 5.0
            while session.transport == "io_uring" and loop.time() < deadline:
                await asyncio.sleep(0.01)
            assert session.transport == "/dev/fuse"
            assert session.transport_reason.startswith("io_uring registration refused")
            assert session.ring_requests == 0
    run(main())


@pytest.mark.parametrize("compiled, offered, why", [
    pytest.param(True, False, "the kernel does not offer FUSE over io_uring (fuse enable_uring off?)",
                 marks=compiled_only),
    (False, True, "the Python loop serves /dev/fuse only"),
])
def test_without_an_offer_or_the_compiled_loop_init_keeps_to_dev_fuse(compiled: bool, offered: bool,
                                                                      why: str) -> None:
    async def main() -> None:
        with _session(compiled=compiled) as (session, kernel):
            kernel.send(_init(1, FUSE_INIT_EXT | (FUSE_OVER_IO_URING if offered else 0)))
            session.on_readable()
            flags, flags2 = _init_reply(kernel)
            assert flags2 == 0 and not flags & FUSE_INIT_EXT
            assert (session.transport, session.transport_reason) == ("/dev/fuse", why)
    run(main())


@compiled_only
def test_every_ring_payload_starts_on_a_page() -> None:
    """The kernel copies a WRITE's data to the start of an entry's payload, from the caller's
    (usually page-aligned) buffer; a payload 16 bytes into a page put that copy in the CPU's slow
    case (4K aliasing: ``FuseRing.__init__``), so each entry's payload starts on a page, also
    when its size is not whole pages."""
    from initiator.fuse._loop import FuseRing
    for size in (RING_PAYLOAD, RING_PAYLOAD + 100):
        ring = FuseRing(-1, 2, 3, size)
        try:
            assert len(ring.payloads) == 6
            for payload in ring.payloads:
                assert len(payload) == size and not payload.readonly
                assert ctypes.addressof(ctypes.c_char.from_buffer(payload)) % mmap.PAGESIZE == 0
        finally:
            ring.close()
