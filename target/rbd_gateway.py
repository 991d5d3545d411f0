"""Fenced failover between gateways that export one RBD image (``failover = true``).

Each gateway runs ``blockd target`` with the same subsystem and namespace; their ANA groups say
which one serves (for example A optimized, B inaccessible, from each one's ``[[ana]]``). There is
no quorum of our own: Ceph decides, through two of its primitives.

- **The image's exclusive lock** (``lock_acquire``): the gateway whose group serves I/O holds it.
  A gateway made to serve (by its configuration at start, or ``blockctl target ana promote``)
  takes the lock first, and goes back to inaccessible if a live gateway holds it.
- **The watchers of the image's header**: every gateway has the image open, so it watches the
  header; the OSD ends the watch of a client that stops pinging after ``osd client watch
  timeout`` (Ceph's default 30 s). A lock whose owner has no watch left belongs to a gateway
  that died (kill -9) or stopped (SIGSTOP, a hung host).

A standby gateway that sees the lock's owner without a watch for ``takeover_after`` seconds (or
the lock without owner that long) **breaks the lock, which blocklists the old owner's client in
the OSD map, then acquires it, and only then makes its group optimized** (:meth:`Gateway._take`,
then ``set_serving``). From then on the cluster refuses every write the old owner sends, even one
already queued in it when it wakes up (a zombie): librbd gets ``ESHUTDOWN``, the rbd backend marks
itself fenced, answers ANA Inaccessible and this loop makes its group inaccessible.

A gateway demoted by the operator while it holds the lock releases it (a planned switchover:
demote A, then promote B) and leaves an ownerless lock to the other gateway for a while.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import rbd
import structlog

if TYPE_CHECKING:
    from target.backend import NamespaceHooks
    from target.rbd_backend import RbdBackend

log = structlog.get_logger("blockd.target.rbd_gateway")

YIELD_FACTOR = 3
"""After releasing the lock on a demotion, a gateway leaves an ownerless lock alone this many
``takeover_after`` periods, so that the other gateway takes it."""


class Gateway:
    """The lock-and-ANA loop of one failover namespace."""

    def __init__(self, backend: RbdBackend, hooks: NamespaceHooks) -> None:
        self.backend = backend
        self.hooks = hooks
        self.opts = backend.opts
        self.me: str = backend.cluster.get_addrs()
        """This gateway's client address, as the lock's owner and the watchers name it: librbd
        may say it does not own the lock for a moment while it re-takes its own (after its watch
        was re-registered), and a lock whose owner is this client is never another gateway's."""
        self.takeovers = 0
        """Times this gateway took the lock from a dead owner or an empty lock and served."""
        self._since: float | None = None
        """When the lock was first seen without a live owner (monotonic), None while one lives."""
        self._yielded_until = 0.0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._run(), name="rbd-gateway")

    def wake(self) -> None:
        """Look again now (the backend was fenced); from any thread (an I/O queue may run its
        commands on a loop of its own)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def stop(self) -> None:
        """Stop looking; release the lock if held, so the other gateway takes over at once."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if not self.backend.fenced:
            try:
                if self.backend.image.is_exclusive_lock_owner():
                    self.backend.image.lock_release()
            except rbd.Error:
                pass

    async def _run(self) -> None:
        while True:
            try:
                await self._step()
            except rbd.ConnectionShutdown:
                self.backend.fenced = True
                continue
            except rbd.Error as exc:
                log.warning("gateway step failed", image=self.opts.image, error=str(exc))
            try:
                await asyncio.wait_for(self._wake.wait(), self.opts.poll)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()

    async def _step(self) -> None:
        serving = self.hooks.serving()
        if self.backend.fenced:
            if serving:
                log.error("fenced: this gateway's group goes inaccessible", image=self.opts.image)
                await self.hooks.set_serving(False)
            return
        image = self.backend.image
        mine = await asyncio.to_thread(self._mine, image)
        if mine and not serving:
            log.info("demoted: releasing the image's lock", image=self.opts.image)
            await asyncio.to_thread(image.lock_release)
            self._yielded_until = time.monotonic() + YIELD_FACTOR * self.opts.takeover_after
        elif serving and not mine:
            if not await self._take(image):
                log.warning("another gateway holds the image: this group goes inaccessible", image=self.opts.image)
                await self.hooks.set_serving(False)
        elif not serving and not mine:
            if await asyncio.to_thread(self._owner_alive, image):
                self._since = None
                return
            now = time.monotonic()
            self._since = self._since if self._since is not None else now
            if now - self._since < self.opts.takeover_after or now < self._yielded_until:
                return
            if await self._take(image):
                self.takeovers += 1
                log.warning("took the image over: this group goes optimized", image=self.opts.image)
                await self.hooks.set_serving(True)  # only now that the old owner is fenced
            self._since = None

    def _mine(self, image: Any) -> bool:
        """This gateway holds the lock (by librbd's word, or as the owner the lock names)."""
        return bool(image.is_exclusive_lock_owner()) or any(
            o["owner"] == self.me for o in image.lock_get_owners())

    @staticmethod
    def _owner_alive(image: Any) -> bool:
        """The lock has an owner that still watches the image (the lock is held and live)."""
        owners = list(image.lock_get_owners())
        if not owners:
            return False
        watching = {w["addr"] for w in image.watchers_list()}
        return any(o["owner"] in watching for o in owners)

    async def _take(self, image: Any) -> bool:
        """Break a dead owner's lock (blocklisting its client: the fence) and acquire the lock;
        False when a live gateway holds it."""
        def take() -> bool:
            owners = list(image.lock_get_owners())
            watching = {w["addr"] for w in image.watchers_list()}
            for owner in owners:
                if owner["owner"] in watching:
                    return False
                log.warning("fencing the image's previous owner (lock break, blocklist)",
                            image=self.opts.image, owner=owner["owner"])
                image.lock_break(owner["mode"], owner["owner"])
            try:
                image.lock_acquire(rbd.RBD_LOCK_MODE_EXCLUSIVE)
            except (rbd.ReadOnlyImage, rbd.ImageBusy):
                return False
            return True
        return await asyncio.to_thread(take)
