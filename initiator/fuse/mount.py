"""One mounted directory: its FUSE session and its place in the mount table, from mount to
unmount. Every step that resolves a path runs off the event loop and is bounded (see
``kernel_mount``), so an unmount ends whatever state the mount is in."""

from __future__ import annotations

import asyncio
import errno
import os
from typing import Any, Mapping

import structlog

from initiator.fuse import kernel_mount
from initiator.fuse.kernel_mount import off_loop
from initiator.fuse.needs import MountController
from initiator.fuse.session import MAX_WRITE, FuseSession

log = structlog.get_logger("blockd.initiator.fuse")

ATTR_TTL = 60.0
"""Seconds the kernel may cache names and attributes (nothing changes them but a reconnect)."""
UNMOUNT_TIMEOUT = 5.0
"""How long an unmount may take before the FUSE connection is aborted to end it."""
DRAIN_TIMEOUT = 5.0
"""How long requests still being served after an unmount may take before they are cancelled."""


class FuseMount:
    """One mounted directory serving the namespaces of one named connection."""

    def __init__(self, connections: Mapping[str, MountController], name: str, mountpoint: str,
                 attr_ttl: float = ATTR_TTL) -> None:
        self.name = name
        self.mountpoint = mountpoint
        self.session = FuseSession(connections, name, mountpoint, attr_ttl)
        self.mounted = False
        self.via_fusermount = False

    async def start(self, timeout: float = 10.0) -> None:
        opts = kernel_mount.options(os.getuid(), os.getgid())
        mountpoint = self.mountpoint
        if os.geteuid() == 0:
            # mount(2) does not wait for INIT, so the fd is watched only once it is mounted
            # (before that /dev/fuse polls as an error and never wakes epoll).
            fd = kernel_mount.open_device()
            try:
                await off_loop(lambda: kernel_mount.mount_device(fd, mountpoint, opts, MAX_WRITE), timeout)
            except BaseException:
                os.close(fd)
                raise
        else:
            fd = await off_loop(lambda: kernel_mount.fusermount(mountpoint, opts, timeout), timeout)
            self.via_fusermount = True
            os.set_blocking(fd, False)
        self.session.attach(fd)
        self.mounted = True
        try:
            await asyncio.wait_for(asyncio.shield(self.session.ready), timeout)
        except BaseException:
            await self.stop(lazy=True)
            raise

    async def stop(self, lazy: bool = False) -> None:
        """Unmount; a busy mount fails with EBUSY unless ``lazy`` (detach, as SIGTERM does).

        Bounded: an unmount that has not returned after ``UNMOUNT_TIMEOUT`` (something in the
        kernel waits on this mount and its answer does not come) is ended by aborting the FUSE
        connection, and the mount is then detached. The connection is aborted by closing our
        /dev/fuse fd, the only one (``FuseSession.close``), not through
        /sys/fs/fuse/connections/N/abort: the fusectl file system is not mounted everywhere."""
        if self.mounted and not self.session.disconnected:
            try:
                await self._unmount(lazy)
            except TimeoutError:
                log.warning("unmount did not finish: aborting the FUSE connection",
                            mountpoint=self.mountpoint, timeout=UNMOUNT_TIMEOUT)
                self.session.close()
                try:
                    await self._unmount(True)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:  # EINVAL: the first unmount ended meanwhile
                        raise
        self.mounted = False
        await self.session.drain(DRAIN_TIMEOUT)
        self.session.close()

    async def _unmount(self, lazy: bool) -> None:
        mountpoint, via = self.mountpoint, self.via_fusermount
        await off_loop(lambda: kernel_mount.unmount(mountpoint, lazy, via, UNMOUNT_TIMEOUT), UNMOUNT_TIMEOUT)

    def describe(self) -> dict[str, Any]:
        return {"mountpoint": self.mountpoint, "name": self.name,
                "files": [f"ns{n}" for n in sorted(self.session.directory.namespaces())],
                "transport": self.session.transport, "transport_reason": self.session.transport_reason,
                "ring_requests": self.session.ring_requests, "busy_polls": self.session.busy_polls,
                **self.session.stats}
