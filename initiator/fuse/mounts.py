"""The daemon's mount table and its control verbs: ``mount``, ``umount`` and ``mounts``.

They run on the event loop that serves the mounts, so they never touch a path themselves: a
stat of a mount root whose cached attributes have expired becomes a FUSE request that only this
loop could answer (``blockctl umount`` once left the daemon asleep in newfstatat → fuse_do_getattr
→ request_wait_answer on its own mountpoint, deaf to SIGTERM). Paths are matched lexically
against the table first and resolved off the loop otherwise.
"""

from __future__ import annotations

import asyncio
import errno
import os
from typing import Any, Callable, Mapping

import structlog

from initiator.fuse.kernel_mount import off_loop
from initiator.fuse.mount import ATTR_TTL, FuseMount
from initiator.fuse.needs import MountController

log = structlog.get_logger("blockd.initiator.fuse")

RESOLVE_TIMEOUT = 10.0
"""How long resolving a mountpoint given by the user may take (it may lie on a dead mount)."""


class MountError(ValueError):
    """A mount request the daemon refuses (a ValueError, so it is reported as a request error)."""


def _directory(mountpoint: str) -> str:
    """The canonical path of ``mountpoint``, which must be a directory (blocking: off the loop)."""
    path = os.path.realpath(mountpoint)
    if not os.path.isdir(path):
        raise MountError(f"mountpoint {path} is not a directory")
    return path


class FuseMounts:
    """The daemon's mounts, by canonical mountpoint."""

    def __init__(self, connections: Mapping[str, MountController],
                 find: Callable[[str], MountController]) -> None:
        self.connections = connections
        self.find = find
        self.mounts: dict[str, FuseMount] = {}
        self.attr_ttl = float(os.environ.get("BLOCKD_FUSE_ATTR_TTL", ATTR_TTL))
        """Attribute cache time of new mounts; the environment sets it for tests, which need it
        to expire within a test's time."""

    def _lookup(self, mountpoint: str) -> FuseMount | None:
        """The mount at ``mountpoint`` as written (blockctl sends absolute paths): no syscall."""
        return self.mounts.get(os.path.normpath(mountpoint)) if os.path.isabs(mountpoint) else None

    async def op_mount(self, name: str, mountpoint: str) -> dict[str, Any]:
        ctrl = self.find(name)
        name = next(k for k, v in self.connections.items() if v is ctrl)
        if self._lookup(mountpoint) is not None:
            raise MountError(f"{os.path.normpath(mountpoint)} is already a blockd mount")
        try:
            path = await off_loop(lambda: _directory(mountpoint), RESOLVE_TIMEOUT)
        except TimeoutError:
            raise MountError(f"cannot mount {mountpoint}: the path did not resolve") from None
        if path in self.mounts:
            raise MountError(f"{path} is already a blockd mount")
        mount = FuseMount(self.connections, name, path, self.attr_ttl)
        try:
            await mount.start()
        except OSError as exc:
            raise MountError(f"cannot mount {path}: {exc.strerror or exc}") from None
        except asyncio.TimeoutError:
            raise MountError(f"cannot mount {path}: the kernel did not start the FUSE session") from None
        self.mounts[path] = mount
        log.info("mounted", name=name, mountpoint=path)
        return mount.describe()

    async def op_umount(self, mountpoint: str, lazy: bool = False) -> dict[str, Any]:
        mount = self._lookup(mountpoint)
        if mount is None:  # a path through a symlink, say: resolved where waiting is harmless
            try:
                mount = self.mounts.get(await off_loop(lambda: os.path.realpath(mountpoint), RESOLVE_TIMEOUT))
            except (OSError, TimeoutError):
                mount = None
        if mount is None:
            raise MountError(f"{mountpoint} is not a blockd mount (see 'blockctl mounts')")
        path = mount.mountpoint
        try:
            await mount.stop(lazy=lazy)
        except OSError as exc:
            if exc.errno == errno.EBUSY:
                raise MountError(f"{path} is busy (files open); close them or use --lazy") from None
            raise MountError(f"cannot unmount {path}: {exc.strerror or exc}") from None
        except TimeoutError:
            raise MountError(f"cannot unmount {path}: no answer from the kernel") from None
        del self.mounts[path]
        log.info("unmounted", mountpoint=path)
        return {"mountpoint": path}

    async def op_mounts(self) -> dict[str, Any]:
        return {"mounts": [m.describe() for m in self.mounts.values()]}

    async def stop(self) -> None:
        """Detach every mount (SIGTERM): open files see ENOTCONN from then on, not stale data."""
        for path, mount in list(self.mounts.items()):
            try:
                await mount.stop(lazy=True)
                log.info("unmounted", mountpoint=path)
            except (OSError, TimeoutError) as exc:
                log.error("unmount failed", mountpoint=path, error=str(exc) or type(exc).__name__)
            del self.mounts[path]
