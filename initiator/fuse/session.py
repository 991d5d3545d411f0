"""The FUSE request loop of one mount: requests read from /dev/fuse on the daemon's event loop,
handed to the block files or the directory, and replies written back.

No libfuse threads and no thread hop per request: requests from many client threads are served
concurrently on the one loop without GIL contention (see docs/benchmarks.md for why this beat
mfusepy and pyfuse3). The session owns what every request shares: the device fd and the request
buffers, the reply calls, the tasks INTERRUPT can cancel, the INIT handshake and the errno a
failure answers with.
"""

from __future__ import annotations

import asyncio
import errno
import io
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Coroutine, Mapping

import structlog

from blockd.dataplane import twin
from initiator.fuse.abi import (
    FALLOCATE_IN, FUSE_ASYNC_DIO, FUSE_ASYNC_READ, FUSE_ATOMIC_O_TRUNC, FUSE_BIG_WRITES, FUSE_KERNEL_MINOR,
    FUSE_KERNEL_VERSION, FUSE_MAX_PAGES, FUSE_MIN_MINOR, FUSE_PARALLEL_DIROPS, IN_HEADER, INIT_IN, INIT_OUT,
    INTERRUPT_IN, OUT_HEADER, RW_IN, FUSE_INIT_EXT, FUSE_OVER_IO_URING, INIT_IN_EXT,
)
from initiator.fuse.blockfile import BlockFiles
from initiator.fuse.directory import NamespaceDir
from initiator.fuse.errors import FsError, errno_for
from initiator.fuse.ops import OPS

if TYPE_CHECKING:
    from initiator.fuse.needs import MountController

log = structlog.get_logger("blockd.initiator.fuse")

FuseLoop: Any = getattr(twin("initiator.fuse._loop"), "FuseLoop", None)
"""The compiled request loop (``initiator/fuse/_loop.pyx``) when the data plane is compiled; its
reference is this module's ``py_on_readable`` and replies, so there is no twin module to name."""

WANTED_FLAGS = FUSE_ASYNC_READ | FUSE_ATOMIC_O_TRUNC | FUSE_BIG_WRITES | FUSE_ASYNC_DIO | \
    FUSE_PARALLEL_DIROPS | FUSE_MAX_PAGES
MAX_WRITE = 1 << 20
MAX_PAGES = MAX_WRITE // 4096
MAX_BACKGROUND = 128
BUFFER_SIZE = MAX_WRITE + 4096
COPY_LIMIT = 64 << 10
"""Writes up to this size are copied out of the request buffer; bigger ones take the buffer.
(The compiled loop copies one it sends itself into the bytes its NVMe/TCP capsule is sent as:
``initiator/_inline.pyx``.)"""
SPARE_BUFFERS = 8
MAX_BATCH = 8
"""Requests read from /dev/fuse per readiness callback at most (then the loop takes its turn)."""
RING_ENTRIES = 8
"""FUSE over io_uring: entries (requests in flight) per kernel queue; the kernel has one queue
per possible CPU and queues a request on its caller's CPU, where it waits for a free entry."""
RING_PAYLOAD = max(8192, MAX_WRITE, MAX_PAGES * 4096)
"""An entry's payload buffer: the kernel refuses one smaller than this (``fuse_uring_create``:
FUSE_MIN_READ_BUFFER, max_write, max_pages pages)."""
_ENDED = frozenset({errno.ENOTCONN, errno.ECONNABORTED, errno.ECANCELED})
"""How a ring entry's command ends when the connection does (unmount, abort, our close)."""

_unpack_in = IN_HEADER.unpack_from
_unpack_rw = RW_IN.unpack_from
_pack_out = OUT_HEADER.pack
_HDR = IN_HEADER.size
_RW_DATA = _HDR + RW_IN.size


def possible_cpus(path: str = "/sys/devices/system/cpu/possible") -> int:
    """How many CPUs the kernel may ever run (its FUSE ring has one queue for each): the count
    of a list of ranges such as ``0-3,8``."""
    with open(path) as f:
        text = f.read().strip()
    count = 0
    for part in text.split(","):
        first, _, last = part.partition("-")
        count += int(last or first) - int(first) + 1
    return count


BUSY_POLL_US = 20.0
"""How long the compiled loop spins for the next request once it answered the last one in flight
(``FuseLoop.busy_poll_ns``), unless ``BLOCKD_FUSE_BUSY_POLL_US`` says otherwise (0: never)."""


def busy_poll_us() -> float:
    """``BUSY_POLL_US``, or ``BLOCKD_FUSE_BUSY_POLL_US`` from the environment (docs/operations.md)."""
    value = os.environ.get("BLOCKD_FUSE_BUSY_POLL_US")
    try:
        return BUSY_POLL_US if value is None else max(0.0, float(value))
    except ValueError:
        log.warning("BLOCKD_FUSE_BUSY_POLL_US is not a number; using the default", value=value)
        return BUSY_POLL_US


class FuseSession:
    """The requests of one mount, served from the event loop once ``attach`` gave it the fd."""

    def __init__(self, connections: Mapping[str, MountController], name: str, mountpoint: str,
                 attr_ttl: float, compiled: bool | None = None) -> None:
        """``compiled``: run the compiled request loop (default: when the data plane is compiled);
        the tests' differential runs pick either."""
        self.connections = connections
        self.name = name
        self.mountpoint = mountpoint
        self.fd = -1
        self.tasks: dict[int, asyncio.Task[None]] = {}
        """Requests served by a coroutine, by FUSE unique id (INTERRUPT cancels them)."""
        self.inflight: dict[int, bool] = {}
        """Requests served by callbacks, by FUSE unique id (see ``BlockFiles``): taken out when
        answered, by their completion or by an INTERRUPT, whichever comes first."""
        self.stats = {"read": 0, "write": 0, "errors": 0}
        self.spare: list[bytearray] = []
        self._fast: Any = None
        """The compiled loop (see ``FuseLoop``), or None when this session runs the Python one."""
        if FuseLoop is not None if compiled is None else compiled:
            self._fast = FuseLoop(self, BUFFER_SIZE, COPY_LIMIT, MAX_BATCH)
            self._fast.busy_poll_ns = round(busy_poll_us() * 1000)
            # the compiled reply calls shadow the Python ones below, for the block files too
            self.reply = self._fast.reply
            self.reply_err = self._fast.reply_err
        self.on_readable = self.py_on_readable if self._fast is None else self._fast.on_readable
        """What runs when /dev/fuse is readable: the compiled loop or its Python reference."""
        self.files = BlockFiles(self, connections, name)
        self.directory = NamespaceDir(self, connections, name, attr_ttl)
        owners = {"session": self, "directory": self.directory}
        self._handlers: dict[int, Callable[[int, int, memoryview], None]] = {
            opcode: getattr(owners[op.owner], op.method) for opcode, op in OPS.items()}
        """The opcode table, bound to this session (see :meth:`serve`)."""
        self.disconnected = False
        """The kernel ended the connection (an unmount from outside, or an abort)."""
        self.ready: asyncio.Future[None] | None = None
        """Set once the kernel's INIT was answered."""
        self._read = self.files.read
        self._write = self.files.write
        self._buf = bytearray(BUFFER_SIZE)
        self._view = memoryview(self._buf)
        self._file: io.FileIO | None = None
        """/dev/fuse for reading requests (see ``attach``)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last_error_log = 0.0
        self._suppressed = 0
        self.transport = "/dev/fuse"
        """How requests reach us: ``io_uring`` (FUSE over io_uring) or ``/dev/fuse``, chosen at
        INIT (see ``init``), with why in ``transport_reason``; ``blockctl mounts`` shows both."""
        self.transport_reason = "before INIT"
        self._ring_fd = -1

    # -- the device ---------------------------------------------------------------------------------

    def attach(self, fd: int) -> None:
        """Serve requests whenever ``fd`` (/dev/fuse) is readable. They are read through a FileIO,
        whose ``readinto`` answers None when none is queued where ``os.readv`` raises
        BlockingIOError: at QD1 every readiness callback ends with such a read (see ``py_on_readable``)."""
        self._loop = asyncio.get_running_loop()
        if self.ready is None:
            self.ready = self._loop.create_future()
        self.fd = fd
        self._file = io.FileIO(fd, "r", closefd=False)
        if self._fast is not None:
            self._fast.start(fd)
        self._loop.add_reader(fd, self.on_readable)

    def close(self) -> None:
        """Close the device fd. The last close of a FUSE connection aborts it in the kernel
        (fuse_dev_release), so whatever still waits on this mount gets ENOTCONN rather than
        waiting for us: this is how an unmount that hangs is ended (see ``FuseMount.stop``)."""
        if self._ring_fd >= 0:
            if self._loop is not None:
                self._loop.remove_reader(self._ring_fd)
            self._ring_fd = -1
        if self._fast is not None:
            self._fast.stop_ring()  # its commands hold /dev/fuse open: end them first
        if self.fd >= 0:
            if self._loop is not None:
                self._loop.remove_reader(self.fd)
            self._file = None
            if self._fast is not None:
                self._fast.fd = -1
            os.close(self.fd)
            self.fd = -1

    async def drain(self, timeout: float) -> None:
        """Let requests still being served finish, for at most ``timeout``; cancel the rest."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if self.tasks:
            _, pending = await asyncio.wait(list(self.tasks.values()), timeout=timeout)
            for task in pending:
                task.cancel()
        while self.inflight and loop.time() < deadline:
            await asyncio.sleep(0.01)

    # -- the request loop ---------------------------------------------------------------------------

    def py_on_readable(self) -> None:
        """Serve what /dev/fuse has queued: a request, at once, then more while they keep coming
        (up to ``MAX_BATCH``), whose capsules leave together when the batch ends, so with several
        fio jobs the target gets them in one receive and answers in one send. A lone request
        costs one more read, which finds nothing; the sends are held only once a second request
        is there. Measured with 4 jobs, 4 KiB: ~20% less CPU per I/O; holding the first capsule
        back too cost 15-25% IOPS (the target idled meanwhile), this did not.

        A request that finds nothing else in flight is served alone: at QD1 (one fio job, psync)
        the next read would find nothing, as the kernel sends no new request before this one is
        answered; and where a burst did queue several, the event loop's readiness is
        level-triggered, so the loop calls back at once and that call, with this request in
        flight, reads the rest as a batch. Measured (``strace -c`` on the initiator, 4 KiB QD1
        read): 3 reads, 1 write, 1 writev and 2 epoll waits per I/O before, one read fewer after."""
        busy = bool(self.inflight or self.tasks)
        n = self._read_request()
        if not n:
            return
        if n > 0:
            self._serve(n)
            if not busy:
                return
        ctrl = None
        try:
            for _ in range(MAX_BATCH - 1):
                n = self._read_request()
                if not n:
                    break
                if n > 0:
                    if ctrl is None:
                        ctrl = self.connections.get(self.name)
                        if ctrl is not None:
                            ctrl.hold_sends()
                    self._serve(n)
        finally:
            if ctrl is not None:
                ctrl.release_sends()

    def _read_request(self) -> int:
        """Read the next request into ``_buf``: its length; 0 when there was none (or the mount
        is gone), -1 when it was interrupted before we read it (there may be more)."""
        try:
            return self._file.readinto(self._buf) or 0  # None: nothing queued
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return -1
            if exc.errno == errno.ENODEV:
                self.device_gone()
                return 0
            raise

    def device_gone(self) -> None:
        """/dev/fuse answered ENODEV: unmounted (or the connection was aborted)."""
        log.info("fuse connection closed by the kernel", mountpoint=self.mountpoint)
        self.disconnected = True
        self.close()

    def _serve(self, n: int) -> None:
        """Serve the request of ``n`` bytes in ``_buf``."""
        _, opcode, unique, nodeid, _, _, _, _, _ = _unpack_in(self._view, 0)
        self.serve(opcode, unique, nodeid, self._view[_HDR:n])

    def serve(self, opcode: int, unique: int, nodeid: int, arg: memoryview) -> None:
        """Serve one request by its row of the opcode table (:mod:`initiator.fuse.ops`); the
        compiled loop's way out of its fast path too."""
        try:
            handler = self._handlers.get(opcode)
            if handler is None:
                raise FsError(errno.ENOSYS)
            handler(unique, nodeid, arg)
        except FsError as exc:
            self.reply_err(unique, exc.errno)
        except Exception:
            log.exception("fuse request failed", opcode=opcode, op=OPS[opcode].name if opcode in OPS else "?")
            self.reply_err(unique, errno.EIO)

    # -- the session's rows of the opcode table (each called as handler(unique, nodeid, arg)) ----------

    def read(self, unique: int, nodeid: int, arg: memoryview) -> None:
        fh, offset, size, _, _, _, _ = _unpack_rw(arg)
        self._read(unique, nodeid - 1, offset, size)

    def write(self, unique: int, nodeid: int, arg: memoryview) -> None:
        fh, offset, size, _, _, _, _ = _unpack_rw(arg)
        if size <= COPY_LIMIT:  # a copy out of the request buffer, as a view like the other
            data = memoryview(self._buf[_RW_DATA:_RW_DATA + size])
            owned = None
        else:  # big write: hand the request buffer itself to the write, read into another
            owned = self._buf
            data = self._view[_RW_DATA:_RW_DATA + size]
            self._buf = self.spare.pop() if self.spare else bytearray(BUFFER_SIZE)
            self._view = memoryview(self._buf)
        self._write(unique, nodeid - 1, offset, data, owned)

    def fsync(self, unique: int, nodeid: int, arg: memoryview) -> None:
        self.files.fsync(unique, nodeid - 1)

    def fallocate(self, unique: int, nodeid: int, arg: memoryview) -> None:
        _, offset, length, mode, _ = FALLOCATE_IN.unpack_from(arg)
        self.spawn(unique, self.files.fallocate(unique, nodeid - 1, offset, length, mode))

    def forget(self, unique: int, nodeid: int, arg: memoryview) -> None:
        """FORGET and BATCH_FORGET: no node is ever dropped, and these take no reply."""

    def ok(self, unique: int, nodeid: int, arg: memoryview) -> None:
        """An empty success: RELEASE, FLUSH, ACCESS and the like have nothing to do here."""
        self.reply(unique)

    def interrupt(self, unique: int, nodeid: int, arg: memoryview) -> None:
        """The caller got a signal. Once we have read its request the kernel waits for our
        answer even through SIGKILL, and a command the controller holds while it reconnects may
        take until ctrl_loss_tmo: answer EINTR now. A coroutine is cancelled (it answers); a
        callback request is answered here and its completion, finding it gone from
        ``inflight``, answers nothing."""
        target = INTERRUPT_IN.unpack_from(arg)[0]
        task = self.tasks.get(target)
        if task is not None:
            task.cancel()
        elif self.inflight.pop(target, False):
            self.reply_err(target, errno.EINTR)

    def init(self, unique: int, nodeid: int, arg: memoryview) -> None:
        major, minor, max_readahead, flags = INIT_IN.unpack_from(arg)
        if major != FUSE_KERNEL_VERSION or minor < FUSE_MIN_MINOR:
            log.error("unsupported FUSE protocol", major=major, minor=minor)
            raise FsError(errno.EPROTO)
        if flags & FUSE_INIT_EXT and len(arg) >= INIT_IN_EXT.size:
            flags |= INIT_IN_EXT.unpack_from(arg)[4] << 32
        ring = self._make_ring(flags)
        out = flags & WANTED_FLAGS
        if ring:
            out |= FUSE_INIT_EXT | FUSE_OVER_IO_URING
        self.reply(unique, INIT_OUT.pack(
            FUSE_KERNEL_VERSION, FUSE_KERNEL_MINOR, max_readahead, out & 0xFFFFFFFF,
            MAX_BACKGROUND, MAX_BACKGROUND * 3 // 4, MAX_WRITE, 1, MAX_PAGES, 0, out >> 32, *(0,) * 7))
        if ring:
            # the kernel holds every request from now on until each of its queues has an entry
            self._ring_fd = self._fast.register_ring()
            self._loop.add_reader(self._ring_fd, self._fast.on_ring)
        log.info("fuse session ready", mountpoint=self.mountpoint, proto=f"{major}.{minor}",
                 transport=self.transport, why=self.transport_reason)
        if self.ready is not None and not self.ready.done():
            self.ready.set_result(None)

    def _make_ring(self, flags: int) -> bool:
        """Whether this connection runs over io_uring: when the compiled loop runs, the kernel
        offered it in INIT (the fuse module's ``enable_uring`` is on) and io_uring can be set
        up; else /dev/fuse. Sets ``transport`` and its reason."""
        if self._fast is None:
            self.transport_reason = "the Python loop serves /dev/fuse only"
            return False
        if not flags & FUSE_OVER_IO_URING:
            self.transport_reason = "the kernel does not offer FUSE over io_uring (fuse enable_uring off?)"
            return False
        queues = possible_cpus()
        try:
            self._fast.make_ring(queues, RING_ENTRIES, RING_PAYLOAD)
        except OSError as exc:
            self.transport_reason = f"io_uring unavailable: {exc}"
            return False
        self.transport = "io_uring"
        self.transport_reason = f"{queues} queues x {RING_ENTRIES} entries"
        return True

    @property
    def ring_requests(self) -> int:
        """Requests served from the io_uring so far (0 on /dev/fuse)."""
        ring = None if self._fast is None else self._fast.ring
        return 0 if ring is None else ring.served

    @property
    def busy_polls(self) -> tuple[int, int]:
        """Busy-polls of the compiled loop so far, and how many of them saw what they waited
        for in time (``FuseLoop.busy_poll_ns``)."""
        return (0, 0) if self._fast is None else (self._fast.spins, self._fast.spins_caught)

    def ring_entry_ended(self, err: int, before_any_request: bool) -> None:
        """A ring entry's command ended with ``err``: the connection ending (quiet); before any
        request, the kernel refusing a registration, after which it serves the connection
        through /dev/fuse (``fuse_uring_cmd``), as we then report; else a refused commit, whose
        entry takes no more requests (the others go on)."""
        if err in _ENDED:
            return
        if not before_any_request:
            log.warning("fuse io_uring commit refused by the kernel: one ring entry fewer",
                        mountpoint=self.mountpoint, error=os.strerror(err))
            return
        log.warning("fuse io_uring registration refused by the kernel: requests go through /dev/fuse",
                    mountpoint=self.mountpoint, error=os.strerror(err))
        self.transport = "/dev/fuse"
        self.transport_reason = f"io_uring registration refused: {os.strerror(err)}"

    def spawn(self, unique: int, coro: Coroutine[Any, Any, None]) -> None:
        """Serve request ``unique`` by a coroutine (interruptible; it replies itself)."""
        task = self.tasks[unique] = self._loop.create_task(coro)
        task.add_done_callback(lambda _: self.tasks.pop(unique, None))

    def recycle(self, buf: bytearray) -> None:
        """A big write's request buffer back to the pool. Only after the write succeeded: a failed
        write's data may still sit in a closing transport's buffer and must not be overwritten by
        the next request."""
        if len(self.spare) < SPARE_BUFFERS:
            self.spare.append(buf)

    # -- replies ------------------------------------------------------------------------------------

    def send(self, parts: list[Any]) -> None:
        try:
            os.writev(self.fd, parts)
        except OSError as exc:
            # ENOENT: the request was interrupted and is gone; ENODEV/EBADF: unmounted meanwhile
            if exc.errno not in (errno.ENOENT, errno.ENODEV, errno.EBADF):
                raise

    def reply(self, unique: int, payload: bytes | bytearray | memoryview = b"") -> None:
        self.send([_pack_out(16 + len(payload), 0, unique), payload])

    def reply_err(self, unique: int, err: int) -> None:
        self.send([_pack_out(16, -err, unique)])

    def fail(self, unique: int, exc: BaseException, what: str) -> None:
        """Answer request ``unique`` with the errno of ``exc``. I/O errors are counted and
        logged at most once a second (a dead connection fails every request)."""
        if not isinstance(exc, (Exception, asyncio.CancelledError)):  # KeyboardInterrupt, SystemExit
            self.reply_err(unique, errno.EIO)
            raise exc
        err = errno_for(exc)
        if err is None:
            log.exception("fuse request failed", op=what, exc_info=exc)
            err = errno.EIO
        if err == errno.EIO:
            self.stats["errors"] += 1
            now = time.monotonic()
            if now - self._last_error_log >= 1.0:
                log.warning("I/O error returned to the caller", mountpoint=self.mountpoint, op=what,
                            error=str(exc) or type(exc).__name__, suppressed=self._suppressed)
                self._last_error_log = now
                self._suppressed = 0
            else:
                self._suppressed += 1
        self.reply_err(unique, err)
