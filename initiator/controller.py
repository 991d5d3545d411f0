"""The host side of one NVMe-oF association, as a library.

``await Controller.connect(ConnectParams(...))`` opens the admin queue and N I/O queues, enables
the controller and reads its identity; then ``read``/``write``/``flush``/``write_zeroes``/
``deallocate`` keep many commands in flight across the queues. A lost connection starts a
reconnect; commands that were in flight are sent again on the new association (block commands
are idempotent) or, once ``ctrl_loss_tmo`` passes, fail with :class:`QueueLost`.

Every I/O goes through :meth:`Controller.submit_io`, a callback API: the awaitable methods,
``transfer`` (byte ranges split at ``max_transfer``) and the FUSE mount are wrappers over it.
Admin commands take the same way (:meth:`Controller._submit`): one place sends, parks a command
that finds no live association or no free command id, retries after a lost queue and turns a
status into :class:`NvmeError`. Who writes which bytes of an SQE: a builder from
:mod:`protocol.commands` the command, :class:`HostQueue` the CID, the transport the SGL.

The association itself (connect, authentication, enable, keep-alive, asynchronous events,
reconnect, teardown) is the base class's, :class:`initiator.association.Association`; the
transports are found by name in :mod:`initiator.transport`; discovery is :mod:`initiator.discovery`.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import time
from typing import Any, Callable

import structlog

from blockd.dataplane import twin
from blockd.iocounters import IoCounters
from initiator.association import Association, NamespaceInfo
from initiator.errors import ConnectError, NvmeError, QueueLost
from initiator.params import ConnectParams
from initiator.transport import QueueConnection, queue_opener
from protocol.commands import (
    describe_command, dsm_command, flush_command, get_log_page_command, is_io_command, read_command, write_command,
    write_zeroes_command,
)
from protocol.nvme import DSM_ATTR_DEALLOCATE, DSM_RANGE_FAST
from protocol.status import MORE, Status

__all__ = ["ConnectError", "ConnectParams", "Controller", "IoDone", "NamespaceInfo", "NvmeError", "QueueLost"]

log = structlog.get_logger("blockd.initiator")

_queue = twin("initiator._queue")
HostCommand, HostQueue = _queue.HostCommand, _queue.HostQueue
Command, AdminCommand = _queue.Command, _queue.AdminCommand
"""The commands and queue every connection of this controller uses: the compiled set
(``initiator/_queue.pyx``) or its Python reference (:mod:`initiator.queue`), never a mix."""
IoLane: Any = getattr(twin("initiator._lane"), "IoLane", None)
"""The compiled steady-state ``transfer`` (``initiator/_lane.pyx``, which cimports the compiled
queue), None on the Python plane."""


TIMEOUT_SWEEP = 0.5
"""Seconds between checks for commands past their deadline. One periodic sweep (as the Linux
block layer's request timer) instead of a timer armed and cancelled for every command."""
PATH_RETRY_DELAY = 0.01
"""Seconds before an I/O command answered Internal Path Error goes out again (the kernel host
requeues at once; a pause keeps a reopen of some milliseconds from costing hundreds of sends)."""
_PATH_ERROR = Status.INTERNAL_PATH_ERROR

IoDone = Callable[[BaseException | None], None]
"""Callback of :meth:`Controller.submit_io`, called exactly once: None on success, else why the
command failed (:class:`NvmeError` with ``.status``, :class:`QueueLost`, ``TimeoutError``,
``ConnectionError``)."""


class _Gather:
    """``done`` of a :meth:`Controller.transfer` that took several commands: the caller's
    ``done`` once, when the last piece completed, with the first error."""

    __slots__ = ("left", "error", "done")

    def __init__(self, pieces: int, done: IoDone) -> None:
        self.left = pieces
        self.error: BaseException | None = None
        self.done = done

    def piece_done(self, exc: BaseException | None) -> None:
        if exc is not None and self.error is None:
            self.error = exc
        self.left -= 1
        if not self.left:
            self.done(self.error)


def _settle(fut: asyncio.Future[None], exc: BaseException | None) -> None:
    """``done`` of a command someone awaits."""
    if fut.done():  # the waiter was cancelled
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


class Controller(Association):
    """A live association with one subsystem (see module docstring): the command path here,
    the association's set-up and teardown in its base (:mod:`initiator.association`)."""

    def __init__(self, params: ConnectParams, lane: bool | None = None) -> None:
        """``lane``: serve steady-state transfers through the compiled :data:`IoLane` (default:
        when it is built; the differential test runs either)."""
        self.params = params
        self.cntlid = 0
        self.identity: Any = None
        self.namespaces: dict[int, NamespaceInfo] = {}
        self.max_transfer = 1 << 20
        self.admin: QueueConnection | None = None
        self.io: list[QueueConnection] = []
        self._open = queue_opener(params.transport)
        self._live = asyncio.Event()
        self._closing = False
        self._parked_io: collections.deque[Command] = collections.deque()
        self._parked_admin: collections.deque[Command] = collections.deque()
        """Commands waiting for a live association or a free command id, oldest first; sent
        by :meth:`_unpark` when a command completes or the association comes back."""
        self._on_done = self._complete  # bound once: every command's on_done
        self.counters = IoCounters()
        """This connection's I/O commands (blockd.iostats), counted at completion; latency
        from the last send (a retried command's from its retry) to the completion."""
        self._io_timeout = params.command_timeout
        self._establishing: set[QueueConnection] = set()
        """Connections of an association being set up: their commands go straight out (the
        association is not live yet) and fail, never retry."""
        self._held: list[QueueConnection] = []
        self._reconnect_task: asyncio.Task[None] | None = None
        self.reconnects = 0
        """Associations re-established after a lost connection (a metric)."""
        self.timeouts = 0
        """Commands failed for want of an answer in time (each reset its association)."""
        self.path_error_retries = 0
        """Sends again after Internal Path Error (counted in its log lines: the first, then every
        1,000th)."""
        self._keep_alive_task: asyncio.Task[None] | None = None
        self._aer_task: asyncio.Task[None] | None = None
        self.namespace_listeners: list[Callable[[], None]] = []
        """Called after a namespace-changed event has refreshed ``namespaces``."""
        self.event_listeners: list[Callable[[int], None]] = []
        """Called with the completion DW0 of every other asynchronous event (the multipath
        layer's ANA change)."""
        self.live_listeners: list[Callable[[bool], None]] = []
        """Called when the association goes down (False) or is established again (True),
        while the controller has not given up: the multipath layer forgets a lost path's ANA
        state and reads it again before the path takes I/O (the kernel reads the ANA log in
        every controller (re)initialisation, nvme_mpath_init_identify)."""
        self.failfast = False
        """Set by the multipath layer (initiator.multipath) on each of its paths: an I/O command
        that finds the association down fails at once with :class:`QueueLost`, to be sent on
        another path, instead of waiting here for this path's reconnect (the kernel's
        REQ_FAILFAST_TRANSPORT on a multipath request)."""
        self.failed: Exception | None = None
        self.was_live = False
        """The association was established once (a path still trying its first connect has not)."""
        self.first_error: Exception | None = None
        """Why the first attempt failed, for a controller connected with ``keep_trying``."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sweep: asyncio.TimerHandle | None = None
        self._secret, self._ctrl_secret = params.secrets()
        self._transaction = 0
        """T_ID of the next DH-HMAC-CHAP transaction (one per queue and authentication)."""
        self.lane: Any = None
        """The compiled lane, which mirrors the association's state: every change of ``_live``,
        ``failed`` or the namespace table goes through :meth:`_set_live`, :meth:`_set_failed`
        or :meth:`_set_namespaces`, which tell it (``IoLane.sync``)."""
        if IoLane is not None if lane is None else lane:
            self.lane = IoLane(self, Controller.transfer, self._complete, self._parked_io, self._parked_admin,
                                self._io_timeout)
            self.lane.sync(self._loop, self._live.is_set())
            # the lane's transfer shadows the method below (which it falls back to)
            self.transfer = self.lane.transfer  # type: ignore[method-assign]

    def _set_live(self, live: bool) -> None:
        """The association is live (or, with ``failed`` set, finished: waiters wake to see it).
        ``_establish`` replaces ``io``, ``max_transfer`` and the namespace table before it sets
        this, so the lane reads them again here."""
        was = self._live.is_set()
        if live:
            self._live.set()
        else:
            self._live.clear()
        if self.lane is not None:
            self.lane.sync(self._loop, self._live.is_set())
        if live != was and self.failed is None:
            for listener in self.live_listeners:
                listener(live)

    def _set_failed(self, exc: Exception | None) -> None:
        """The controller gave up (or was closed): every later command fails."""
        self.failed = exc
        if self.lane is not None:
            self.lane.sync(self._loop, self._live.is_set())

    def _set_namespaces(self, table: dict[int, NamespaceInfo]) -> None:
        """A new namespace table (a scan, at connect or after a namespace-changed event)."""
        self.namespaces = table
        if self.lane is not None:
            self.lane.sync(self._loop, self._live.is_set())

    def _start_sweep(self) -> None:
        """Bind the event loop and start the timeout sweep (at the first association's set-up)."""
        self._loop = asyncio.get_running_loop()
        self._sweep = self._loop.call_later(TIMEOUT_SWEEP, self._sweep_timeouts)

    async def _open_queue(self, qid: int, depth: int) -> QueueConnection:
        conn = await self._open(self.params, HostQueue(qid, depth), self._queue_lost)
        self._establishing.add(conn)
        return conn

    # -- the one way a command goes out ------------------------------------------------------------

    def submit_io(self, sqe: bytearray, data_out: bytes | memoryview | None, data_in: memoryview | None,
                  done: IoDone) -> None:
        """Send the I/O command ``sqe`` (from a :mod:`protocol.commands` builder) with the data
        it writes or the buffer its data is read into; ``done`` runs once (see :data:`IoDone`).

        Live with a queue that has room, the command goes out now and ``done`` runs from the
        transport's receive callback (no Task, no Future); else it waits for the association
        or room, and after a lost queue it is sent again while the reconnect policy allows."""
        cmd = Command(sqe, data_out, data_in, self._on_done)
        cmd.done = done
        cmd.timeout = self._io_timeout
        self._submit(cmd)

    def _submit(self, cmd: Command) -> None:
        """Send ``cmd`` now if the association is live and its queue has room, else park it."""
        if self.failed is None and self._live.is_set():
            if cmd.admin:
                conn = self.admin
                if not conn.queue.has_room:
                    conn = None
            else:
                conn = self._io_with_room()
            if conn is not None and not conn.closed:
                self._send(conn, cmd)
                return
        self._park(cmd)

    def _send(self, conn: QueueConnection, cmd: Command) -> None:
        cmd.deadline = self._loop.time() + cmd.timeout
        cmd.sent_ns = time.monotonic_ns()
        conn.hold()  # out now, not at the end of the loop iteration (unless held further up)
        try:
            conn.submit(cmd)
        finally:
            conn.release()

    def _park(self, cmd: Command) -> None:
        if self.failed is not None:
            cmd.fail(QueueLost(f"connection to {self.params.subnqn} lost: {self.failed}"))
        elif self.failfast and not cmd.admin and not self._live.is_set():
            cmd.fail(QueueLost(f"path {self.params.traddr}:{self.params.trsvcid} is down"))
        else:
            (self._parked_admin if cmd.admin else self._parked_io).append(cmd)

    def _unpark(self) -> None:
        """Send parked commands, oldest first, while the association is live and has room."""
        for parked in (self._parked_admin, self._parked_io):
            while parked and self.failed is None and self._live.is_set():
                cmd = parked.popleft()
                self._submit(cmd)
                if parked and parked[-1] is cmd:  # parked again: no room left
                    parked.rotate(1)  # back to the front, its turn kept
                    break
        if self.failed is not None:
            self._fail_parked()

    def _fail_parked(self) -> None:
        exc = QueueLost(f"connection to {self.params.subnqn} lost: {self.failed}")
        for parked in (self._parked_admin, self._parked_io):
            while parked:
                parked.popleft().fail(exc)

    def _path_error(self, cmd: Command) -> bool:
        """``cmd`` came back with Internal Path Error (SCT 3, no DNR): the namespace is there
        but not serving through this controller for now (a target reload opening it again;
        nvmet's disabled namespace). Send it again in :data:`PATH_RETRY_DELAY`, as the Linux host
        fails it over or retries it rather than failing the I/O, for at most the command's
        timeout from the first such answer; False when that has run out (the caller gets the
        status). The deadline rides on the command (made per I/O, never reused): the compiled
        lane completes a later successful send without coming here, and leaves nothing behind."""
        now = self._loop.time()
        until = cmd.path_retry_until or now + cmd.timeout
        if now >= until or self.failed is not None:
            return False
        cmd.path_retry_until = until
        self.path_error_retries += 1
        if self.path_error_retries == 1 or self.path_error_retries % 1000 == 0:
            log.warning("internal path error: sending the command again", subnqn=self.params.subnqn,
                        command=describe_command(cmd.sqe, False), retries=self.path_error_retries)
        cmd.on_done = self._on_done  # a completion consumes it (HostCommand._done)
        self._loop.call_later(PATH_RETRY_DELAY, self._resend, cmd)
        return True

    def _resend(self, cmd: Command) -> None:
        if self._parked_io or self._parked_admin:
            self._unpark()  # the id the path error freed: commands parked for room go first
        self._submit(cmd)

    def _complete(self, cmd: Command, exc: BaseException | None) -> None:
        """Every command's ``on_done``: a status becomes :class:`NvmeError` (here only), the
        freed command id goes to a parked command, then the caller's ``done`` runs. An I/O
        command answered Internal Path Error is sent again instead (:meth:`_path_error`)."""
        if exc is None and cmd.status & ~MORE == _PATH_ERROR and not cmd.admin and self._path_error(cmd):
            return
        if exc is None and cmd.status:
            exc = NvmeError(cmd.status, describe_command(cmd.sqe, cmd.admin), cmd.dw0,
                            is_io_command(cmd.sqe, cmd.admin))
        if not cmd.admin:
            cmd.count(self.counters, time.monotonic_ns())
            if exc is not None:
                self.counters.add_error(cmd.status or type(exc).__name__)
        if self._parked_io or self._parked_admin:
            self._unpark()
        cmd.done(exc)

    async def _admin(self, sqe: bytearray, data_out: bytes | None = None, data_in: memoryview | None = None,
                     timeout: float | None = None, conn: QueueConnection | None = None) -> HostCommand:
        """Send an admin (or fabrics) command and wait for it; raises :class:`NvmeError`. While
        an association is being set up its commands go straight out on its connection ``conn``
        (the admin queue by default)."""
        cmd = AdminCommand(sqe, data_out, data_in, self._on_done)
        cmd.timeout = timeout or self._io_timeout
        fut = self._loop.create_future()
        cmd.done = functools.partial(_settle, fut)
        conn = conn or self.admin
        if conn in self._establishing:
            self._send(conn, cmd)
        else:
            self._submit(cmd)
        await fut
        return cmd

    async def admin_command(self, sqe: bytearray, data_out: bytes | None = None,
                            data_in: memoryview | None = None) -> HostCommand:
        """Send an admin command (built with :mod:`protocol.commands`) once the association is
        live; returns it (``dw0``/``dw1`` hold the result); raises :class:`NvmeError`."""
        await self.wait_live()
        return await self._admin(sqe, data_out, data_in)

    def _sweep_timeouts(self) -> None:
        """Fail commands past their deadline and reset the association of their queue (their
        command ids cannot be reused safely); the rest in flight is retried after reconnecting."""
        now = self._loop.time()
        for conn in (self.admin, *self.io):
            if conn is None:
                continue
            expired = conn.queue.expired(now)
            self.timeouts += len(expired)
            for cmd in expired:
                conn.queue.finish(cmd.cid)
                what = describe_command(cmd.sqe, conn is self.admin)
                cmd.fail(TimeoutError(f"{what} timed out on queue {conn.queue.qid}"))
                log.warning("command timed out; resetting the association", qid=conn.queue.qid, cid=cmd.cid)
            if expired:
                conn.close()
        if not (self._closing and self.failed is not None):  # close() still times its shutdown
            self._sweep = self._loop.call_later(TIMEOUT_SWEEP, self._sweep_timeouts)


    async def get_log_page(self, lid: int, length: int, offset: int = 0, nsid: int = 0,
                           rae: bool = False, lsp: int = 0) -> bytes:
        buf = bytearray(length)
        await self.admin_command(get_log_page_command(lid, length // 4 - 1, offset, nsid, rae, lsp),
                                 data_in=memoryview(buf))
        return bytes(buf)


    def namespace(self, nsid: int) -> NamespaceInfo:
        try:
            return self.namespaces[nsid]
        except KeyError:
            raise NvmeError(Status.INVALID_NS, f"namespace {nsid} of {self.params.subnqn}") from None

    def _io_with_room(self) -> QueueConnection | None:
        """The first I/O queue with room, None when all are full. This host is one thread, so
        spreading commands over queues buys no parallelism here; packing them onto one
        connection lets both ends take several capsules per receive and send several replies
        at once (measured: ~10% less CPU per 4 KiB I/O with four FUSE jobs). Further queues
        take the overflow."""
        for conn in self.io:
            if conn.queue.has_room:
                return conn
        return None

    # -- wrappers over submit_io --------------------------------------------------------------------

    def transfer(self, write: bool, nsid: int, offset: int, buf: memoryview, done: IoDone,
                 fua: bool = False) -> None:
        """Read into or write from ``buf`` the block-aligned byte range at ``offset`` (any length
        inside the namespace; a ValueError here otherwise): one command per ``max_transfer``
        bytes, this being the one place that splits; ``done`` once, when all completed, with
        the first error."""
        length = len(buf)
        bs = self.check_range(nsid, offset, length).block_size
        if 0 < length <= self.max_transfer:
            if write:
                self.submit_io(write_command(nsid, offset // bs, length // bs - 1, fua), buf, None, done)
            else:
                self.submit_io(read_command(nsid, offset // bs, length // bs - 1), None, buf, done)
            return
        if not length:
            done(None)
            return
        step = self.max_transfer - self.max_transfer % bs
        piece_done = _Gather(-(-length // step), done).piece_done
        for pos in range(0, length, step):
            piece = buf[pos:pos + step]
            slba, nlb0 = (offset + pos) // bs, len(piece) // bs - 1
            if write:
                self.submit_io(write_command(nsid, slba, nlb0, fua), piece, None, piece_done)
            else:
                self.submit_io(read_command(nsid, slba, nlb0), None, piece, piece_done)

    async def _wait(self, start: Callable[[IoDone], None]) -> None:
        """Await a callback-API call: ``start(done)``, then the Future ``done`` settles."""
        fut = self._loop.create_future()
        start(functools.partial(_settle, fut))
        await fut

    async def io_command(self, sqe: bytearray, data_out: bytes | memoryview | None = None,
                         data_in: memoryview | None = None) -> None:
        """Awaitable :meth:`submit_io`: raises :class:`NvmeError` and the rest of :data:`IoDone`."""
        await self._wait(functools.partial(self.submit_io, sqe, data_out, data_in))

    async def read_into(self, nsid: int, slba: int, buf: memoryview) -> None:
        """Read ``len(buf)`` bytes (whole blocks, at most ``max_transfer``: one command, the
        range checked by the target) at block ``slba`` into ``buf``."""
        await self.io_command(read_command(nsid, slba, self._nlb0(nsid, buf)), data_in=buf)

    async def read(self, nsid: int, slba: int, nblocks: int) -> bytearray:
        buf = bytearray(nblocks * self.namespace(nsid).block_size)
        await self.read_into(nsid, slba, memoryview(buf))
        return buf

    async def write(self, nsid: int, slba: int, data: bytes | memoryview, fua: bool = False) -> None:
        """Write ``data`` (whole blocks, at most ``max_transfer``: one command) at block ``slba``."""
        await self.io_command(write_command(nsid, slba, self._nlb0(nsid, data), fua), data_out=data)

    def _nlb0(self, nsid: int, data: bytes | bytearray | memoryview) -> int:
        """The 0's based block count of ``data``; a ValueError (not a malformed command) when it
        is not a whole number of blocks, or more than one command may carry."""
        bs = self.namespace(nsid).block_size
        n = len(data)
        if not n or n % bs or n > self.max_transfer:
            raise ValueError(f"{n} bytes is not 1 to {self.max_transfer // bs} blocks of "
                             f"{bs} bytes on namespace {nsid}")
        return n // bs - 1

    async def read_bytes(self, nsid: int, offset: int, length: int) -> bytearray:
        """Read a block-aligned byte range of any size."""
        buf = bytearray(length)
        await self.read_bytes_into(nsid, offset, memoryview(buf))
        return buf

    async def read_bytes_into(self, nsid: int, offset: int, buf: memoryview) -> None:
        """Read a block-aligned byte range of any size into ``buf``: a caller that reads much
        (a replica's verify) reuses its buffers instead of zero-filling new ones."""
        await self._wait(functools.partial(self.transfer, False, nsid, offset, buf))

    async def write_bytes(self, nsid: int, offset: int, data: bytes | memoryview, fua: bool = False) -> None:
        await self._wait(functools.partial(self.transfer, True, nsid, offset, memoryview(data), fua=fua))

    async def flush(self, nsid: int) -> None:
        await self.io_command(flush_command(nsid))

    async def write_zeroes(self, nsid: int, slba: int, nblocks: int, deallocate: bool = False) -> None:
        await self.io_command(write_zeroes_command(nsid, slba, nblocks - 1, deallocate))

    async def deallocate(self, nsid: int, ranges: list[tuple[int, int]]) -> None:
        """Dataset Management / deallocate of (slba, nblocks) ranges (trim)."""
        if not 1 <= len(ranges) <= 256:
            raise ValueError("between 1 and 256 ranges per deallocate")
        data = b"".join(DSM_RANGE_FAST.pack(0, nlb, slba) for slba, nlb in ranges)
        await self.io_command(dsm_command(nsid, len(ranges) - 1, DSM_ATTR_DEALLOCATE), data_out=data)

    def hold_sends(self) -> None:
        """Hold the I/O queues' sends until :meth:`release_sends` (see ``QueueConnection.hold``):
        a caller about to submit several commands (the FUSE mount draining its requests) lets
        them leave together. Not nested."""
        self._held = list(self.io)
        for conn in self._held:
            conn.hold()

    def release_sends(self) -> None:
        held, self._held = self._held, []
        for conn in held:
            conn.release()

    def check_range(self, nsid: int, offset: int, length: int) -> NamespaceInfo:
        """The namespace, once ``offset``/``length`` are block-aligned and inside it (ValueError else)."""
        info = self.namespaces.get(nsid) or self.namespace(nsid)
        bs = info.block_size
        if offset % bs or length % bs:
            raise ValueError(f"offset {offset} and length {length} must be multiples of the "
                             f"{bs}-byte block size")
        if offset < 0 or offset + length > info.size:
            raise ValueError(f"range {offset}+{length} is outside namespace {nsid} ({info.size} bytes)")
        return info

