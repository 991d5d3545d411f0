"""The FUSE mount's request loop without a kernel: a SEQPACKET socket stands in for /dev/fuse
(one request per read, like the device) and a controller answers reads at once."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any, Iterator

from initiator.controller import NamespaceInfo
from initiator.fuse.abi import IN_HEADER, OUT_HEADER, READ, RW_IN
from initiator.fuse.session import MAX_BATCH, FuseSession

from .conftest import run

BS = 4096


class _Conn:
    def __init__(self) -> None:
        self.held = 0

    def release(self) -> None:
        self.held -= 1


class _Ctrl:
    """Just enough of Controller: reads complete inside ``submit_read``."""

    def __init__(self) -> None:
        self.namespaces = {1: NamespaceInfo(1, 256, BS, False)}
        self.failed = None
        self.max_transfer = 1 << 20
        self.state = "live"
        self.conn = _Conn()
        self.holds = 0

    def hold_sends(self) -> list[_Conn]:
        self.holds += 1
        self.conn.held += 1
        return [self.conn]

    def submit_read(self, nsid: int, slba: int, buf: memoryview, done: Any) -> None:
        buf[:] = bytes([slba & 0xFF]) * len(buf)
        done(None)


def _request(unique: int, block: int) -> bytes:
    return (IN_HEADER.pack(IN_HEADER.size + RW_IN.size, READ, unique, 2, 0, 0, 0, 0, 0)
            + RW_IN.pack(0, block * BS, BS, 0, 0, 0, 0))


@contextlib.contextmanager
def _mount() -> Iterator[tuple[FuseSession, _Ctrl, socket.socket]]:
    """A session watching our end of the pair; yields it, its controller and the kernel's end."""
    ctrl = _Ctrl()
    mount = FuseSession({"c": ctrl}, "c", "/nonexistent", 60.0)
    ours, kernel = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setblocking(False)
    mount.attach(ours.fileno())
    try:
        yield mount, ctrl, kernel
    finally:
        asyncio.get_running_loop().remove_reader(ours.fileno())
        ours.close()
        kernel.close()


def _replies(kernel: socket.socket, count: int) -> list[tuple[int, int, bytes]]:
    out = []
    for _ in range(count):
        raw = kernel.recv(BS + 64)
        length, err, unique = OUT_HEADER.unpack_from(raw)
        assert length == len(raw)
        out.append((unique, err, raw[OUT_HEADER.size:]))
    return out


def test_a_lone_request_is_served_without_holding_sends() -> None:
    async def main() -> None:
        with _mount() as (mount, ctrl, kernel):
            kernel.send(_request(7, 3))
            mount._on_readable()
            assert _replies(kernel, 1) == [(7, 0, bytes([3]) * BS)]
            assert ctrl.holds == 0
            mount._on_readable()  # nothing queued (a spurious wakeup): no error, no reply
            assert ctrl.holds == 0 and not mount.inflight
    run(main())


def test_queued_requests_are_served_in_one_callback_under_one_hold() -> None:
    async def main() -> None:
        with _mount() as (mount, ctrl, kernel):
            for i in range(3):
                kernel.send(_request(i + 1, i))
            mount._on_readable()
            assert _replies(kernel, 3) == [(i + 1, 0, bytes([i]) * BS) for i in range(3)]
            assert ctrl.holds == 1 and ctrl.conn.held == 0  # taken for the second, released
    run(main())


def test_more_queued_requests_than_one_batch_wait_for_the_next_callback() -> None:
    async def main() -> None:
        with _mount() as (mount, _, kernel):
            for i in range(MAX_BATCH + 1):
                kernel.send(_request(i + 1, i))
            mount._on_readable()
            assert len(_replies(kernel, MAX_BATCH)) == MAX_BATCH
            mount._on_readable()
            assert _replies(kernel, 1)[0][0] == MAX_BATCH + 1
    run(main())

