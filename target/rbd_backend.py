"""The ``rbd`` backend: a namespace is a Ceph RBD image, reached through librbd (python3-rbd).

``path`` is ``pool/image`` (as ``rbd map`` writes it); ``[subsystem.namespace.options]`` holds
``conf`` (the ceph.conf, default /etc/ceph/ceph.conf), ``client_id`` (default ``admin``),
``keyring``, ``failover`` and ``op_timeout`` (docs/ceph.md). The namespace's NGUID/UUID/EUI-64 derive from the
image's id unless configured, so every gateway exporting the image presents the same ids.

I/O is librbd's ``aio_*`` calls; each completion (on a librbd thread) is handed to the target's
event loop with ``call_soon_threadsafe``. librbd's client cache is turned off (``rbd_cache =
false``): a completed write is then committed by the OSDs, so the namespace reports no volatile
cache (``can_flush`` False, VWC 0), a FUA write is a plain write and a flush has nothing to do; with the cache on, a
gateway that died or was fenced would lose writes it had acknowledged. Partial discards are not
skipped (``rbd_skip_partial_discard = false``), so a deallocated range reads back as zeroes
whatever its alignment.

This backend has no C twin: it makes no ``fast`` copy, so the compiled plane
(``target/_io_core.pyx``'s ``eligible`` reads the namespace's :class:`FastNamespace`, which only
a plain file has) leaves every command on an RBD namespace to the Python queue. python3-rbd's
``aio_read`` returns a new ``bytes``, copied into the transfer buffer once; ``aio_write`` needs
``bytes``/``bytearray``, so a write from a view is copied once too.

Errors map to NVMe statuses by what they mean for the host: a client the cluster blocklisted
(``ESHUTDOWN``: another gateway broke our lock), a write refused because another gateway holds
the image's exclusive lock (``EROFS``) and an operation the cluster did not answer within
``op_timeout`` (``ETIMEDOUT``: this gateway is cut from the cluster, or the cluster is stuck) get
ANA Inaccessible (0x302, path-related, no DNR): the Linux host retries on another path and reads
the ANA log, rather than failing the I/O as a medium error. Without the op timeout (librados'
default) an operation to an unreachable OSD waits for ever, and the host only learns of it when
its own I/O timeout fires and it resets the whole controller. ``ENOSPC`` is Capacity Exceeded and anything else the controller's Write Fault /
Unrecovered Read Error, as for a file.
"""

from __future__ import annotations

import asyncio
import errno
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import rados
import rbd
import structlog

from protocol.status import Status

if TYPE_CHECKING:
    from target.backend import NamespaceHooks
    from target.config import NamespaceConfig
    from target.rbd_gateway import Gateway

log = structlog.get_logger("blockd.target.rbd")

CONNECT_TIMEOUT = 10
"""Seconds to reach the monitors when a namespace opens."""
OP_TIMEOUT = 20
"""Whole seconds librados gives an OSD or monitor operation before it fails with ``ETIMEDOUT``
(``rados_osd_op_timeout``, ``rados_mon_op_timeout``): below the Linux host's 30 s I/O timeout,
so that the host gets a path status and retries elsewhere before it resets the controller."""
REWATCH_EVERY = 1.0
"""Seconds between attempts to watch the image header again after its watch broke."""
_ID_NAMESPACE = uuid.UUID("5d0f6a52-3c8e-4b7e-9e0a-8f1b2c3d4e5f")
"""The UUIDv5 namespace the image-derived ids are made in."""
_CLIENT_CONF = {"rbd_cache": "false", "rbd_skip_partial_discard": "false"}


class RbdPathError(OSError):
    """An I/O this gateway cannot do on the image any more; ``status`` is the path status the
    host gets (the controller reads it)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(code, message)
        self.status = Status.ANA_INACCESSIBLE


@dataclass(frozen=True)
class RbdOptions:
    """A namespace's RBD settings, checked."""

    pool: str
    image: str
    conf: str = "/etc/ceph/ceph.conf"
    client_id: str = "admin"
    keyring: str | None = None
    failover: bool = False
    """Two gateways share the image (docs/ceph.md): the one whose group serves I/O holds the
    image's exclusive lock, the other takes it over, fencing the first, when its watch ends."""
    takeover_after: float = 2.0
    """Seconds the lock's owner must have been without a watch on the image (or the lock without
    owner) before a standby gateway takes it."""
    poll: float = 0.5
    """Seconds between the gateway's looks at the lock and the watchers."""
    op_timeout: int = OP_TIMEOUT
    """Whole seconds (librados takes no fraction) before an operation the cluster does not answer
    fails (0: wait for ever, librados' own default)."""

    @classmethod
    def from_config(cls, nc: NamespaceConfig) -> RbdOptions:
        pool, sep, image = nc.path.partition("/")
        if not sep or not pool or not image or "/" in image:
            raise ValueError(f"an rbd namespace's path is pool/image, not {nc.path!r}")
        opts = dict(nc.options)
        types = {"conf": str, "client_id": str, "keyring": str, "failover": bool,
                 "takeover_after": (int, float), "poll": (int, float),
                 "op_timeout": int}
        for key, value in opts.items():
            if key not in types:
                raise ValueError(f"unknown rbd option {key!r} (known: {', '.join(types)})")
            if not isinstance(value, types[key]) or (types[key] != bool and isinstance(value, bool)):
                raise ValueError(f"rbd option {key} has the wrong type: {value!r}")
        if opts.get("op_timeout", 0) < 0:
            raise ValueError(f"rbd option op_timeout must be >= 0 seconds, not {opts['op_timeout']!r}")
        return cls(pool, image, **opts)


class RbdBackend:
    """An open RBD image: its client, I/O context and image handle, and the size the namespace
    shows."""

    can_trim = True  # librbd discard, partial ones included (rbd_skip_partial_discard off)
    can_zero = True  # librbd write_zeroes
    can_fua = True  # the cache is off: a completed write is committed
    can_flush = False  # ... so there is no volatile cache to flush

    def __init__(self, opts: RbdOptions, size: int | None, read_only: bool = False) -> None:
        self.opts = opts
        self.read_only = read_only
        self.fenced = False
        """The cluster refused this client (ESHUTDOWN: blocklisted); set once, never cleared."""
        self.gateway: Gateway | None = None
        self._hooks: NamespaceHooks | None = None
        self._watch: Any = None
        self._watch_lost = False
        """librados reported the header watch broken (blocklisted, cluster gone): not unwatched."""
        self._rewatching: asyncio.Task[None] | None = None
        self._unclosed: list[Any] = []
        """Broken watches whose unwatch failed (see :meth:`_rewatch`)."""
        conf = {"keyring": opts.keyring} if opts.keyring else {}
        self.cluster = rados.Rados(conffile=opts.conf, rados_id=opts.client_id, conf=conf)
        try:
            for key, value in {**_CLIENT_CONF, "rados_osd_op_timeout": str(opts.op_timeout),
                               "rados_mon_op_timeout": str(opts.op_timeout)}.items():
                self.cluster.conf_set(key, value)
            self.cluster.connect(timeout=CONNECT_TIMEOUT)
            self.ioctx = self.cluster.open_ioctx(opts.pool)
            self.image = rbd.Image(self.ioctx, opts.image, read_only=read_only)
        except (rados.Error, rbd.Error) as exc:
            self.cluster.shutdown()
            raise OSError(getattr(exc, "errno", None) or errno.EIO, f"rbd {opts.pool}/{opts.image}: {exc}") from None
        self.image_id: str = self.image.id()
        self.features: int = self.image.features()
        self.size = self.image.size()
        if size is not None and size != self.size:
            self.close()
            raise ValueError(f"rbd image {opts.pool}/{opts.image} is {self.size} bytes, not the configured {size}"
                             " (leave size out: the image's size is the namespace's)")
        if opts.failover and not self.features & rbd.RBD_FEATURE_EXCLUSIVE_LOCK:
            self.close()
            raise ValueError(f"rbd image {opts.pool}/{opts.image}: failover needs the exclusive-lock feature")

    def derived_ids(self) -> tuple[bytes, bytes, bytes]:
        """(NGUID, UUID, EUI-64) from the image's id (unique in its pool) and pool: the same on
        every gateway that opens the image, whatever its subsystem NQN or nsid."""
        derived = uuid.uuid5(_ID_NAMESPACE, f"rbd:{self.opts.pool}/{self.image_id}")
        return derived.bytes, derived.bytes, derived.bytes[:8]

    # -- I/O ---------------------------------------------------------------------------------------

    async def _aio(self, what: str, start: Callable[[Callable[..., None]], Any]) -> tuple[int, Any]:
        """Start one librbd aio call and wait for its completion in this loop; (rv, data)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[tuple[int, Any]] = loop.create_future()

        def done(comp: Any, data: Any = None) -> None:  # a librbd thread
            loop.call_soon_threadsafe(_settle, fut, comp.get_return_value(), data)
        try:
            start(done)
        except rbd.Error as exc:
            raise self._error(getattr(exc, "errno", None) or errno.EIO, what) from None
        rv, data = await fut
        if rv < 0:
            raise self._error(-rv, what)
        return rv, data

    def _error(self, code: int, what: str) -> OSError:
        where = f"rbd {self.opts.pool}/{self.opts.image}: {what}"
        if code == errno.ESHUTDOWN:
            if not self.fenced:
                log.error("this gateway's client was blocklisted: fenced", image=self.opts.image)
                self.fenced = True
                if self.gateway is not None:
                    self.gateway.wake()
            return RbdPathError(code, f"{where}: this gateway was fenced (blocklisted)")
        if code == errno.EROFS:
            return RbdPathError(code, f"{where}: another gateway holds the image's exclusive lock")
        if code == errno.ETIMEDOUT:
            return RbdPathError(code, f"{where}: the cluster did not answer within {self.opts.op_timeout} s")
        return OSError(code, f"{where}: {errno.errorcode.get(code, code)}")

    async def read_into(self, offset: int, buf: memoryview) -> None:
        rv, data = await self._aio("read", lambda cb: self.image.aio_read(offset, len(buf), cb))
        if rv != len(buf):
            raise OSError(errno.EIO, f"short read at {offset}: {rv} of {len(buf)} bytes")
        buf[:] = data

    async def write(self, offset: int, data: memoryview | bytes, fua: bool = False) -> None:
        payload = data if isinstance(data, (bytes, bytearray)) else bytes(data)
        await self._aio("write", lambda cb: self.image.aio_write(payload, offset, cb))

    async def flush(self) -> None:
        """Nothing to do: with the client cache off every completed write is committed (the
        controller never calls this, ``can_flush`` being False; the target's stop does)."""

    async def discard(self, offset: int, length: int) -> None:
        await self._aio("discard", lambda cb: self.image.aio_discard(offset, length, cb))

    async def write_zeroes(self, offset: int, length: int) -> None:
        await self._aio("write zeroes", lambda cb: self.image.aio_write_zeroes(offset, length, cb))

    # -- size ---------------------------------------------------------------------------------------

    def resize(self, size: int | None) -> int:
        """None: the image's size now (grown or shrunk by ``rbd resize``); a size: resize the
        image to it (the target checked that no host loses data)."""
        if size is not None and size != self.image.size():
            self.image.resize(size)
        self.size = self.image.size()
        return self.size

    def attach(self, hooks: NamespaceHooks) -> None:
        """Watch the image's header object, whose notifications include every resize: the
        namespace then follows the image's size (:meth:`_header_changed`). With ``failover``,
        start the gateway's loop (:mod:`target.rbd_gateway`)."""
        self._hooks = hooks
        self._watch = self._watch_header(asyncio.get_running_loop())
        if self.opts.failover:
            from target.rbd_gateway import Gateway
            self.gateway = Gateway(self, hooks)
            self.gateway.start()

    def _watch_header(self, loop: asyncio.AbstractEventLoop) -> Any:
        """A watch on the image's header object (blocks for a round trip to its OSD)."""
        def notified(*_: Any) -> str:  # a librados thread; the reply to the notifier is empty
            loop.call_soon_threadsafe(self._header_changed)
            return ""

        def broken(*_: Any) -> None:  # a librados thread: the watch ended (timed out, blocklisted, cluster gone)
            loop.call_soon_threadsafe(self._watch_broke)
        return self.ioctx.watch(f"rbd_header.{self.image_id}", notified, broken)

    def _watch_broke(self) -> None:
        if self._watch_lost or self._hooks is None:  # a second report of the same break; or closed
            return
        self._watch_lost = True
        self._rewatching = asyncio.get_running_loop().create_task(self._rewatch())

    async def _rewatch(self) -> None:
        """Watch the header again once librados has ended the watch: the OSD drops a watch that
        has not been pinged for ``osd client watch timeout`` (a pause of the OSD or of this
        process, a partition), librbd then watches its own header again but not ours, and every
        resize from then on would never reach the host. As librbd does: unwatch the broken
        watch, watch anew, then look at the size once (a resize while no watch was there);
        every :data:`REWATCH_EVERY` seconds until it works. Not for a blocklisted (fenced)
        client, which the cluster refuses for good (an unwatch or watch that meets ``ESHUTDOWN``
        fences the backend as an I/O would), nor after :meth:`close`."""
        loop = asyncio.get_running_loop()
        failures = 0
        while self._hooks is not None and not self.fenced and self._watch_lost:
            try:
                if self._watch is not None:
                    old, self._watch = self._watch, None
                    try:
                        await loop.run_in_executor(None, old.close)
                    except rados.Error:
                        # its __dealloc__ would unwatch a second time, which aborts librados
                        # (seen with a blocklisted client): kept until the cluster is shut down
                        self._unclosed.append(old)
                        raise
                self._watch = await loop.run_in_executor(None, self._watch_header, loop)
            except rados.Error as exc:
                if getattr(exc, "errno", None) == errno.ESHUTDOWN:  # blocklisted: refused for good
                    self._error(errno.ESHUTDOWN, "watch")  # fenced, as an I/O that meets it
                    return
                if not failures:
                    log.warning("cannot watch the image header again; retrying", image=self.opts.image,
                                error=str(exc))
                failures += 1
                await asyncio.sleep(REWATCH_EVERY)
                continue
            self._watch_lost = False
            log.info("watching the image header again", image=self.opts.image, failures=failures)
            self._check_size()

    def _header_changed(self) -> None:
        """A notification on the header: librbd refreshes the image on its own notification,
        which may come after ours, so the size is looked at now and once more shortly after."""
        self._check_size()
        asyncio.get_running_loop().call_later(0.5, self._check_size)

    def _check_size(self) -> None:
        if self._hooks is None or self.fenced:
            return
        try:
            changed = self.image.size() != self.size
        except rbd.Error as exc:
            log.warning("cannot read the image size", image=self.opts.image, error=str(exc))
            return
        if changed:
            self._hooks.resized()

    def close(self) -> None:
        """Stop the gateway (releasing the lock when held), end the watch, close the image."""
        self._hooks = None
        if self._rewatching is not None:
            self._rewatching.cancel()
        if self.gateway is not None:
            self.gateway.stop()
            self.gateway = None
        if self._watch is not None and not (self.fenced or self._watch_lost):
            self._watch.close()  # not a broken watch: unwatching one aborted librados 16.2 (a test sequence)
        self._watch = None
        if self.cluster is not None:
            try:
                self.image.close()
                self.ioctx.close()
            except (rbd.Error, rados.Error):
                pass
            self.cluster.shutdown()
            self.cluster = None
        self._unclosed.clear()  # their __dealloc__ now finds the cluster shut down and does not unwatch


def _settle(fut: asyncio.Future[tuple[int, Any]], rv: int, data: Any) -> None:
    if not fut.done():  # the command was cancelled meanwhile (its connection ended)
        fut.set_result((rv, data))


def open_rbd(nc: NamespaceConfig) -> RbdBackend:
    """The ``rbd`` backend's opener (:mod:`target.backend_registry`)."""
    return RbdBackend(RbdOptions.from_config(nc), nc.size, read_only=nc.read_only)
