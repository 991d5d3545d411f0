"""The FUSE mount's request loop and block-file semantics without a kernel: a SEQPACKET socket
stands in for /dev/fuse (one request per read, like the device) and fake controllers answer."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
from typing import Any, Iterator

import pytest

from initiator.controller import NamespaceInfo
from initiator.errors import NvmeError, QueueLost
from initiator.fuse import blockfile
from initiator.fuse import session as session_module
from initiator.fuse.abi import (
    FSYNC, FSYNC_IN, GETXATTR, IN_HEADER, INTERRUPT, INTERRUPT_IN, OUT_HEADER, READ, RW_IN, STATFS_OUT, WRITE,
    WRITE_OUT,
)
from initiator.fuse.ops import OPS, FuseOp
from initiator.fuse.session import MAX_BATCH, FuseSession
from protocol.commands import flush_command
from protocol.status import MORE, Status

from .conftest import config, connect, free_port, ns, run, serving, sub

BS = 4096
REPLY_TIMEOUT = 5.0
"""How long the kernel's end waits for a reply: a missing one fails the test, never hangs it."""


class _Ctrl:
    """Just enough of a MountController: reads complete inside ``transfer``, but for the first
    ``keep``, whose ``done`` waits in ``kept`` (a request in flight)."""

    def __init__(self, keep: int = 0) -> None:
        self.namespaces = {1: NamespaceInfo(1, 256, BS, False)}
        self.failed = None
        self.holds = 0
        self.held = False
        self.keep = keep
        self.kept: list[Any] = []

    def hold_sends(self) -> None:
        self.holds += 1
        self.held = True

    def release_sends(self) -> None:
        self.held = False

    def transfer(self, write: bool, nsid: int, offset: int, buf: memoryview, done: Any, fua: bool = False) -> None:
        assert not write
        buf[:] = bytes([offset // BS & 0xFF]) * len(buf)
        if len(self.kept) < self.keep:
            self.kept.append(done)
            return
        done(None)


def _request(unique: int, block: int) -> bytes:
    return _read(unique, block * BS, BS)


def _read(unique: int, offset: int, size: int) -> bytes:
    return (IN_HEADER.pack(IN_HEADER.size + RW_IN.size, READ, unique, 2, 0, 0, 0, 0, 0)
            + RW_IN.pack(0, offset, size, 0, 0, 0, 0))


def _write(unique: int, offset: int, data: bytes) -> bytes:
    return (IN_HEADER.pack(IN_HEADER.size + RW_IN.size + len(data), WRITE, unique, 2, 0, 0, 0, 0, 0)
            + RW_IN.pack(0, offset, len(data), 0, 0, 0, 0) + data)


@contextlib.contextmanager
def _mount(ctrl: Any = None, compiled: bool | None = None) -> Iterator[tuple[FuseSession, Any, socket.socket]]:
    """A session watching our end of the pair; yields it, its controller and the kernel's end.
    ``compiled``: which request loop (default: the plane's)."""
    ctrl = ctrl or _Ctrl()
    mount = FuseSession({"c": ctrl}, "c", "/nonexistent", 60.0, compiled=compiled)
    assert compiled is None or (mount.on_readable == mount.py_on_readable) is not compiled
    ours, kernel = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setblocking(False)
    kernel.settimeout(REPLY_TIMEOUT)
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
        raw = kernel.recv(1 << 21)
        length, err, unique = OUT_HEADER.unpack_from(raw)
        assert length == len(raw)
        out.append((unique, err, raw[OUT_HEADER.size:]))
    return out


def test_a_lone_request_is_served_without_holding_sends() -> None:
    async def main() -> None:
        with _mount() as (mount, ctrl, kernel):
            kernel.send(_request(7, 3))
            mount.on_readable()
            assert _replies(kernel, 1) == [(7, 0, bytes([3]) * BS)]
            assert ctrl.holds == 0
            mount.on_readable()  # nothing queued (a spurious wakeup): no error, no reply
            assert ctrl.holds == 0 and not mount.inflight
    run(main())


def _one_in_flight(mount: FuseSession, kernel: socket.socket) -> None:
    """A request the controller keeps (``_Ctrl(keep=1)``): the mount is busy from now on."""
    kernel.send(_request(99, 9))
    mount.on_readable()
    assert list(mount.inflight) == [99]


def test_queued_requests_are_served_in_one_callback_under_one_hold() -> None:
    async def main() -> None:
        with _mount(_Ctrl(keep=1)) as (mount, ctrl, kernel):
            _one_in_flight(mount, kernel)
            for i in range(3):
                kernel.send(_request(i + 1, i))
            mount.on_readable()
            assert _replies(kernel, 3) == [(i + 1, 0, bytes([i]) * BS) for i in range(3)]
            assert ctrl.holds == 1 and not ctrl.held  # taken for the second, released
            ctrl.kept.pop()(None)
            assert _replies(kernel, 1) == [(99, 0, bytes([9]) * BS)]
    run(main())


def test_more_queued_requests_than_one_batch_wait_for_the_next_callback() -> None:
    async def main() -> None:
        with _mount(_Ctrl(keep=1)) as (mount, _, kernel):
            _one_in_flight(mount, kernel)
            for i in range(MAX_BATCH + 1):
                kernel.send(_request(i + 1, i))
            mount.on_readable()
            assert len(_replies(kernel, MAX_BATCH)) == MAX_BATCH
            mount.on_readable()
            assert _replies(kernel, 1)[0][0] == MAX_BATCH + 1
    run(main())


def test_a_request_with_nothing_in_flight_is_served_alone() -> None:
    """At QD1 the read after a lone request would find nothing: it is not made. A second request
    queued meanwhile waits for the next callback (the loop's readiness is level-triggered)."""
    async def main() -> None:
        with _mount() as (mount, ctrl, kernel):
            kernel.send(_request(1, 1))
            kernel.send(_request(2, 2))
            mount.on_readable()
            assert _replies(kernel, 1) == [(1, 0, bytes([1]) * BS)]
            kernel.setblocking(False)
            with pytest.raises(BlockingIOError):
                kernel.recv(1 << 21)
            kernel.settimeout(REPLY_TIMEOUT)
            mount.on_readable()
            assert _replies(kernel, 1) == [(2, 0, bytes([2]) * BS)]
            assert ctrl.holds == 0
    run(main())



class _RamCtrl:
    """A controller over a bytearray whose commands complete later, each write landing only when
    it completes (as on a target): what the range lock must order."""

    def __init__(self, blocks: int = 64, delay: float = 0.0) -> None:
        self.namespaces = {1: NamespaceInfo(1, blocks, BS, False)}
        self.failed = None
        self.data = bytearray(blocks * BS)
        self.delay = delay
        self.transfers: list[tuple[bool, int, int]] = []

    def hold_sends(self) -> None:
        pass

    def release_sends(self) -> None:
        pass

    def transfer(self, write: bool, nsid: int, offset: int, buf: memoryview, done: Any, fua: bool = False) -> None:
        self.transfers.append((write, offset, len(buf)))
        loop = asyncio.get_running_loop()
        if write:
            payload = bytes(buf)

            def land() -> None:
                self.data[offset:offset + len(payload)] = payload
                done(None)
            loop.call_later(self.delay, land)
        else:
            buf[:] = self.data[offset:offset + len(buf)]
            loop.call_soon(done, None)

    async def _transferred(self, write: bool, offset: int, buf: memoryview) -> None:
        fut = asyncio.get_running_loop().create_future()
        self.transfer(write, 1, offset, buf, lambda exc: fut.set_result(None))
        await fut

    async def read_into(self, nsid: int, slba: int, buf: memoryview) -> None:
        await self._transferred(False, slba * BS, buf)

    async def write_bytes(self, nsid: int, offset: int, data: bytes | memoryview, fua: bool = False) -> None:
        await self._transferred(True, offset, memoryview(data))


async def _await_replies(kernel: socket.socket, count: int) -> list[tuple[int, int, bytes]]:
    kernel.setblocking(False)
    out: list[tuple[int, int, bytes]] = []
    loop = asyncio.get_running_loop()
    while len(out) < count:
        raw = await asyncio.wait_for(loop.sock_recv(kernel, 1 << 21), 5)
        length, err, unique = OUT_HEADER.unpack_from(raw)
        assert length == len(raw)
        out.append((unique, err, raw[OUT_HEADER.size:]))
    return out


def test_a_read_of_any_size_is_one_transfer_the_controller_splits() -> None:
    async def main() -> None:
        ctrl = _RamCtrl(blocks=40)  # 160 KiB: more than one command of a 128 KiB max transfer
        ctrl.data[:] = bytes(range(256)) * (len(ctrl.data) // 256)
        with _mount(ctrl) as (mount, _, kernel):
            kernel.send(_read(1, 0, len(ctrl.data)))
            mount.on_readable()
            assert await _await_replies(kernel, 1) == [(1, 0, bytes(ctrl.data))]
            assert ctrl.transfers == [(False, 0, len(ctrl.data))]
    run(main())


def test_an_unaligned_read_replies_with_exactly_its_bytes() -> None:
    async def main() -> None:
        ctrl = _RamCtrl()
        ctrl.data[:] = bytes(range(256)) * (len(ctrl.data) // 256)
        size = len(ctrl.data)
        with _mount(ctrl) as (mount, _, kernel):
            kernel.send(_read(1, 100, 5000))
            kernel.send(_read(2, size - 10, 4096))  # clipped at the end of the file
            kernel.send(_read(3, size, 4096))  # at the end: nothing
            mount.on_readable()
            replies = sorted(await _await_replies(kernel, 3))
            assert replies == [(1, 0, bytes(ctrl.data[100:5100])), (2, 0, bytes(ctrl.data[-10:])), (3, 0, b"")]
            assert sorted(ctrl.transfers) == [(False, 0, 2 * BS), (False, size - BS, BS)]
    run(main())


def test_an_aligned_write_and_a_read_modify_write_of_the_same_block_do_not_interleave() -> None:
    """The aligned write goes out at once; the read-modify-write that arrived with it must read
    the block only after that write landed, or it writes the old block back over it."""
    async def main() -> None:
        ctrl = _RamCtrl(delay=0.02)
        with _mount(ctrl) as (mount, _, kernel):
            kernel.send(_write(1, 10, b"A" * 20))
            kernel.send(_write(2, 0, b"B" * BS))
            mount.on_readable()  # the first, alone (nothing was in flight)
            mount.on_readable()
            replies = sorted(await _await_replies(kernel, 2))
            assert replies == [(1, 0, WRITE_OUT.pack(20, 0)), (2, 0, WRITE_OUT.pack(BS, 0))]
            assert ctrl.data[:BS] == b"B" * 10 + b"A" * 20 + b"B" * (BS - 30)
            # and one that arrives while a read-modify-write holds the block waits for it
            kernel.send(_write(3, 100, b"C" * 10))
            mount.on_readable()
            await asyncio.sleep(0)  # the read-modify-write takes its lock
            kernel.send(_write(4, 0, b"D" * BS))
            mount.on_readable()
            await _await_replies(kernel, 2)
            assert ctrl.data[:BS] == b"D" * BS
    run(main())


class _HeldCtrl(_RamCtrl):
    """A controller that keeps every command until the test completes it (a reconnect)."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[Any] = []

    def transfer(self, write: bool, nsid: int, offset: int, buf: memoryview, done: Any, fua: bool = False) -> None:
        self.held.append(done)


def _interrupt(unique: int, target: int) -> bytes:
    return IN_HEADER.pack(IN_HEADER.size + INTERRUPT_IN.size, INTERRUPT, unique, 0, 0, 0, 0, 0, 0) + \
        INTERRUPT_IN.pack(target)


def test_an_interrupted_request_is_answered_eintr_at_once_and_only_once() -> None:
    async def main() -> None:
        ctrl = _HeldCtrl()
        with _mount(ctrl) as (mount, _, kernel):
            kernel.send(_read(1, 0, BS))
            kernel.send(_write(2, BS, b"W" * BS))
            mount.on_readable()  # the read, alone (nothing was in flight)
            mount.on_readable()
            assert len(ctrl.held) == 2
            kernel.send(_interrupt(3, 1))
            kernel.send(_interrupt(4, 2))
            mount.on_readable()
            assert sorted(await _await_replies(kernel, 2)) == [(1, -errno.EINTR, b""), (2, -errno.EINTR, b"")]
            for done in ctrl.held:  # the commands complete after all: no second answer
                done(None)
            with pytest.raises(BlockingIOError):
                kernel.recv(64)
            assert not mount.inflight and not mount.files.locks[1].active
    run(main())


def test_an_unmount_that_hangs_is_ended_by_aborting_the_connection(monkeypatch: Any) -> None:
    """umount2 can wait on the mount itself; after UNMOUNT_TIMEOUT the mount closes its /dev/fuse
    fd, the kernel then aborts the connection, which frees such a waiter, and the mount is
    detached. Here the stuck unmount waits until the session's end of the pair is closed."""
    import threading

    from initiator.fuse import mount as mount_module
    from initiator.fuse.mount import FuseMount

    ours, kernel = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    mount = FuseMount({"c": _Ctrl()}, "c", "/nonexistent")
    events: list[str] = []
    freed = threading.Event()

    def unmount(mountpoint: str, lazy: bool, via_fusermount: bool, timeout: float) -> None:
        if lazy:
            events.append("detach, connection " + ("aborted" if mount.session.fd < 0 else "open"))
            return
        events.append("umount")
        kernel.settimeout(10)
        if kernel.recv(1) == b"":  # until the connection is aborted
            freed.set()

    monkeypatch.setattr(mount_module.kernel_mount, "unmount", unmount)
    monkeypatch.setattr(mount_module, "UNMOUNT_TIMEOUT", 0.2)

    async def main() -> None:
        ours.setblocking(False)
        mount.session.attach(ours.detach())
        mount.mounted = True
        await asyncio.wait_for(mount.stop(), 5)
        assert events == ["umount", "detach, connection aborted"]
        assert mount.session.fd == -1 and not mount.mounted
    try:
        run(main())
        assert freed.wait(5)
    finally:
        kernel.close()


# -- FSYNC: a callback request, as READ and WRITE -------------------------------------------------


@pytest.fixture(params=[False, True], ids=["python-loop", "compiled-loop"])
def compiled(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Each request loop: the compiled one even under BLOCKD_PURE=1 (when built), with the
    compiled range locks it cimports, as ``test_fuse_differential.py`` runs it."""
    if request.param:
        loop = pytest.importorskip("initiator.fuse._loop", reason="compiled data plane not built")
        monkeypatch.setattr(session_module, "FuseLoop", loop.FuseLoop)
        monkeypatch.setattr(blockfile, "RangeLocks",
                            pytest.importorskip("initiator.fuse._rangelock").RangeLocks)
    return bool(request.param)


class _FlushCtrl(_Ctrl):
    """A controller whose ``submit_io`` keeps each command (its SQE, then ``done``) until the
    test completes it."""

    def __init__(self) -> None:
        super().__init__()
        self.commands: list[tuple[bytes, Any]] = []

    def submit_io(self, sqe: bytearray, data_out: Any, data_in: Any, done: Any) -> None:
        assert data_out is None and data_in is None
        self.commands.append((bytes(sqe), done))


def _fsync(unique: int, nodeid: int = 2) -> bytes:
    return IN_HEADER.pack(IN_HEADER.size + FSYNC_IN.size, FSYNC, unique, nodeid, 0, 0, 0, 0, 0) + \
        FSYNC_IN.pack(0, 0, 0)


def _no_reply(kernel: socket.socket) -> None:
    kernel.setblocking(False)
    with pytest.raises(BlockingIOError):
        kernel.recv(64)
    kernel.settimeout(REPLY_TIMEOUT)


def test_an_fsync_is_one_flush_answered_by_its_completion_without_a_task(compiled: bool) -> None:
    """The Flush leaves from the request's own callback (no Task: nothing for the loop to run
    first) and its completion writes the reply."""
    async def main() -> None:
        ctrl = _FlushCtrl()
        with _mount(ctrl, compiled) as (mount, _, kernel):
            kernel.send(_fsync(5))
            mount.on_readable()
            assert [sqe for sqe, _ in ctrl.commands] == [bytes(flush_command(1))]
            assert not mount.tasks and list(mount.inflight) == [5]
            _no_reply(kernel)
            ctrl.commands[0][1](None)
            assert _replies(kernel, 1) == [(5, 0, b"")]
            assert not mount.inflight and not mount.tasks
    run(main())


@pytest.mark.parametrize("failure", [NvmeError(Status.WRITE_FAULT, "Flush"), QueueLost("gone")],
                         ids=["status", "queue-lost"])
def test_a_failed_flush_answers_eio(compiled: bool, failure: BaseException) -> None:
    async def main() -> None:
        ctrl = _FlushCtrl()
        with _mount(ctrl, compiled) as (mount, _, kernel):
            kernel.send(_fsync(6))
            mount.on_readable()
            ctrl.commands[0][1](failure)
            assert _replies(kernel, 1) == [(6, -errno.EIO, b"")]
            assert not mount.inflight and mount.stats["errors"] == 1
    run(main())


def test_an_fsync_without_a_controller_or_namespace_answers_eio_sending_nothing(compiled: bool) -> None:
    async def main() -> None:
        ctrl = _FlushCtrl()
        with _mount(ctrl, compiled) as (mount, _, kernel):
            kernel.send(_fsync(7, nodeid=9))  # no namespace 8
            mount.on_readable()
            ctrl.failed = QueueLost("gave up")
            kernel.send(_fsync(8))
            mount.on_readable()
            assert _replies(kernel, 2) == [(7, -errno.EIO, b""), (8, -errno.EIO, b"")]
            assert not ctrl.commands and not mount.inflight
    run(main())


def test_an_interrupted_fsync_is_answered_eintr_at_once_and_only_once(compiled: bool) -> None:
    async def main() -> None:
        ctrl = _FlushCtrl()
        with _mount(ctrl, compiled) as (mount, _, kernel):
            kernel.send(_fsync(9))
            mount.on_readable()
            kernel.send(_interrupt(10, 9))
            mount.on_readable()
            assert _replies(kernel, 1) == [(9, -errno.EINTR, b"")]
            ctrl.commands[0][1](None)  # the Flush completes after all: no second answer
            _no_reply(kernel)
            assert not mount.inflight and not mount.tasks
    run(main())


def test_an_fsync_through_a_controller_answers_the_targets_status(compiled: bool, tmp_path: Any) -> None:
    """On a real controller and target: the Flush of namespace 1 succeeds; one of a namespace
    the host believes in but the target has not comes back Invalid Namespace, answered EIO."""
    port = free_port()
    cfg = config([port], [sub(namespaces=[ns(tmp_path / "a.img")])])

    async def main() -> None:
        async with serving(cfg):
            ctrl = await connect(port)
            try:
                ctrl._set_namespaces({**ctrl.namespaces, 7: NamespaceInfo(7, 16, 512, False)})
                with _mount(ctrl, compiled) as (mount, _, kernel):
                    kernel.send(_fsync(1))
                    mount.on_readable()
                    kernel.send(_fsync(2, nodeid=8))
                    mount.on_readable()
                    assert not mount.tasks
                    assert sorted(await _await_replies(kernel, 2)) == [(1, 0, b""), (2, -errno.EIO, b"")]
                    assert {s & ~MORE: n for s, n in ctrl.counters.errors.items()} == {Status.INVALID_NS: 1}
            finally:
                await ctrl.close()
    run(main())


def _bare(opcode: int, unique: int, nodeid: int = 1) -> bytes:
    return IN_HEADER.pack(IN_HEADER.size, opcode, unique, nodeid, 0, 0, 0, 0, 0)


def test_an_opcode_is_served_by_its_table_row_alone(compiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Either loop answers an opcode with no row ENOSYS, and one row added for it (no handler
    code touched) serves it; a READ whose row points elsewhere goes there in the Python loop,
    while the compiled loop keeps the READ it serves itself (its row says ``compiled``)."""
    async def main() -> None:
        with _mount(compiled=compiled) as (mount, _, kernel):
            kernel.send(_bare(GETXATTR, 1))
            mount.on_readable()
            assert _replies(kernel, 1) == [(1, -errno.ENOSYS, b"")]
        monkeypatch.setitem(OPS, GETXATTR, FuseOp("GETXATTR", "session", "ok"))
        monkeypatch.setitem(OPS, READ, FuseOp("READ", "directory", "statfs", compiled=True))
        with _mount(compiled=compiled) as (mount, _, kernel):
            kernel.send(_bare(GETXATTR, 2))
            mount.on_readable()
            kernel.send(_request(3, 1))
            mount.on_readable()
            replies = _replies(kernel, 2)
            assert replies[0] == (2, 0, b"")
            assert replies[1][:2] == (3, 0)
            assert (replies[1][2] == bytes([1]) * BS) is compiled  # else STATFS_OUT, by the row
    run(main())


def test_the_compiled_loop_takes_its_fast_opcodes_from_the_table(compiled: bool,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A READ row not marked ``compiled``: either loop hands READ to the row's handler (here
    STATFS's) instead of reading the file; a row marked ``compiled`` that the compiled loop does
    not serve is refused when a session makes that loop."""
    monkeypatch.setitem(OPS, READ, FuseOp("READ", "directory", "statfs"))

    async def main() -> None:
        with _mount(compiled=compiled) as (mount, _, kernel):
            kernel.send(_request(3, 1))
            mount.on_readable()
            [(unique, err, payload)] = _replies(kernel, 1)
            assert (unique, err, len(payload)) == (3, 0, STATFS_OUT.size)  # not the 4 KiB block
    run(main())
    if compiled:
        monkeypatch.setitem(OPS, GETXATTR, FuseOp("GETXATTR", "session", "ok", compiled=True))
        with pytest.raises(ValueError, match="GETXATTR"):
            FuseSession({}, "c", "/nonexistent", 60.0, compiled=True)
