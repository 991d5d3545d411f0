"""The initiator daemon's boot-time connections and mounts (``[[connection]]``/``[[mount]]`` of
the initiator config, :mod:`initiator.config`), retried until they come up."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Callable

import structlog

from initiator.config import ConnectionConfig, InitiatorConfig, MountConfig

if TYPE_CHECKING:
    from initiator.daemon import InitiatorDaemon

log = structlog.get_logger("blockd.initiator.boot")


class BootConnections:
    """Connects every configured connection through the daemon, retrying until it succeeds."""

    RETRY_MIN = 1.0
    RETRY_MAX = 15.0

    def __init__(self, daemon: InitiatorDaemon, config: InitiatorConfig,
                 on_change: Callable[[str], None] | None = None) -> None:
        self.daemon = daemon
        self.config = config
        self.on_change = on_change
        self.tasks: list[asyncio.Task[None]] = []
        self.connected: set[str] = set()

    def summary(self) -> str:
        n = len(self.config.connections)
        return f"{len(self.connected)}/{n} configured connection(s) up"

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        for c in self.config.connections:
            self.tasks.append(loop.create_task(self._connect(c), name=f"boot-connect-{c.key}"))

    async def _connect(self, c: ConnectionConfig) -> None:
        delay = self.RETRY_MIN
        attempt = 0
        args = c.connect_args()
        while True:
            attempt += 1
            try:
                await self.daemon.op_connect(**args)
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # ConnectError, OSError, TimeoutError, NvmeError ...
                log.warning("boot connection failed; retrying", name=c.key, traddr=args["traddr"],
                            attempt=attempt, retry_in_s=delay, error=str(exc) or type(exc).__name__)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.RETRY_MAX)
        self.connected.add(c.key)
        log.info("boot connection up", name=c.key, attempts=attempt)
        if self.on_change:
            self.on_change(self.summary())
        for m in self.config.mounts:
            if m.connection == c.key:
                await self.mount_hook(m)

    async def mount_hook(self, m: MountConfig) -> None:
        """FUSE-mount ``m.connection`` at ``m.mountpoint`` through the daemon's mount table
        (the `blockctl mount` request); a failure is logged, the connection stays."""
        try:
            await self.daemon.mounts.op_mount(name=m.connection, mountpoint=m.mountpoint)
            log.info("boot mount up", connection=m.connection, mountpoint=m.mountpoint)
        except Exception as exc:  # MountError, OSError ...
            log.error("boot mount failed", connection=m.connection, mountpoint=m.mountpoint,
                      error=str(exc))

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks.clear()
