"""Initiator daemon configuration (``/etc/blockd/initiator.toml``): connections made at start.

Example::

    # every [[connection]] takes the fields of `blockctl connect`
    [[connection]]
    name = "vol1"                       # default: the NQN
    transport = "tcp"                   # or "rdma"
    traddr = "192.0.2.1"
    trsvcid = 4420
    nqn = "nqn.2026-11.io.blockd:vol1"
    # hostnqn = "nqn.2014-08.org.nvmexpress:uuid:..."
    # nr_io_queues = 4
    # queue_size = 128
    # keep_alive_tmo = 5.0
    # ctrl_loss_tmo = -1                # seconds; -1 (the default here) = keep reconnecting forever
    # hdr_digest = false
    # data_digest = false

    # FUSE mounts, as `blockctl mount vol1 /mnt/vol1` (initiator/fuse.py): made once the
    # connection is up; the mount point must be an existing directory
    [[mount]]
    connection = "vol1"
    mountpoint = "/mnt/vol1"

The daemon connects every entry at start and keeps retrying one that fails (the target may
boot later than the host); once connected, the initiator library reconnects by itself for
``ctrl_loss_tmo`` seconds after a target restart.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any, Callable

import structlog

from blockd.config import ConfigError, read_toml

log = structlog.get_logger("blockd.initiator.boot")

BOOT_CTRL_LOSS_TMO = -1.0
"""Boot-time connections keep reconnecting forever by default (a storage host must not give up
on its volumes because a target took a few minutes to come back)."""


@dataclass(frozen=True)
class ConnectionConfig:
    traddr: str
    nqn: str
    transport: str = "tcp"
    trsvcid: int | None = None
    name: str | None = None
    hostnqn: str | None = None
    nr_io_queues: int = 4
    queue_size: int = 128
    keep_alive_tmo: float = 5.0
    ctrl_loss_tmo: float = BOOT_CTRL_LOSS_TMO
    hdr_digest: bool = False
    data_digest: bool = False

    @property
    def key(self) -> str:
        return self.name or self.nqn

    def connect_args(self) -> dict[str, Any]:
        """Keyword arguments of InitiatorDaemon.op_connect (the `blockctl connect` request)."""
        tmo = math.inf if self.ctrl_loss_tmo < 0 else self.ctrl_loss_tmo
        return {"traddr": self.traddr, "nqn": self.nqn, "transport": self.transport,
                "trsvcid": self.trsvcid, "name": self.name, "hostnqn": self.hostnqn,
                "nr_io_queues": self.nr_io_queues, "queue_size": self.queue_size,
                "keep_alive_tmo": self.keep_alive_tmo, "ctrl_loss_tmo": tmo,
                "hdr_digest": self.hdr_digest, "data_digest": self.data_digest}


@dataclass(frozen=True)
class MountConfig:
    connection: str
    mountpoint: str


@dataclass(frozen=True)
class InitiatorConfig:
    connections: tuple[ConnectionConfig, ...] = ()
    mounts: tuple[MountConfig, ...] = ()


_CONN_TYPES: dict[str, tuple[type, ...]] = {
    "traddr": (str,), "nqn": (str,), "transport": (str,), "trsvcid": (int,), "name": (str,),
    "hostnqn": (str,), "nr_io_queues": (int,), "queue_size": (int,), "keep_alive_tmo": (int, float),
    "ctrl_loss_tmo": (int, float), "hdr_digest": (bool,), "data_digest": (bool,),
}
_MOUNT_TYPES: dict[str, tuple[type, ...]] = {
    "connection": (str,), "mountpoint": (str,)}


def _fields(table: Any, types: dict[str, tuple[type, ...]], required: tuple[str, ...],
            where: str) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: must be a table")
    extra = set(table) - set(types)
    if extra:
        raise ConfigError(f"{where}: unknown setting(s) {', '.join(sorted(extra))}")
    for key in required:
        if key not in table:
            raise ConfigError(f"{where}: missing '{key}'")
    for key, value in table.items():
        kinds = types[key]
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise ConfigError(f"{where}: '{key}' must be {' or '.join(k.__name__ for k in kinds)}, "
                              f"not {value!r}")
    return dict(table)


def parse(raw: dict[str, Any], source: str = "initiator config") -> InitiatorConfig:
    extra = set(raw) - {"connection", "mount"}
    if extra:
        raise ConfigError(f"{source}: unknown setting(s) {', '.join(sorted(extra))}")
    conns: list[ConnectionConfig] = []
    for i, t in enumerate(raw.get("connection", [])):
        where = f"{source} connection #{i + 1}"
        f = _fields(t, _CONN_TYPES, ("traddr", "nqn"), where)
        if f.get("transport", "tcp") not in ("tcp", "rdma"):
            raise ConfigError(f"{where}: transport must be 'tcp' or 'rdma'")
        if "trsvcid" in f and not 1 <= f["trsvcid"] <= 65535:
            raise ConfigError(f"{where}: trsvcid {f['trsvcid']} is out of range")
        conns.append(ConnectionConfig(**f))
    keys = [c.key for c in conns]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"{source}: connection names must be unique (the name defaults to the NQN)")
    mounts: list[MountConfig] = []
    for i, t in enumerate(raw.get("mount", [])):
        where = f"{source} mount #{i + 1}"
        f = _fields(t, _MOUNT_TYPES, ("connection", "mountpoint"), where)
        if f["connection"] not in keys:
            raise ConfigError(f"{where}: no [[connection]] named {f['connection']!r}")
        mounts.append(MountConfig(**f))
    return InitiatorConfig(tuple(conns), tuple(mounts))


def load(path: str) -> InitiatorConfig:
    """Read and validate an initiator configuration file."""
    return parse(read_toml(path), path)


class BootConnections:
    """Connects every configured connection through the daemon, retrying until it succeeds."""

    RETRY_MIN = 1.0
    RETRY_MAX = 15.0

    def __init__(self, daemon: Any, config: InitiatorConfig,
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
        while True:
            attempt += 1
            try:
                await self.daemon.op_connect(**c.connect_args())
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # ConnectError, OSError, TimeoutError, NvmeError ...
                log.warning("boot connection failed; retrying", name=c.key, traddr=c.traddr,
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
        mounts = getattr(self.daemon, "mounts", None)
        if mounts is None or not hasattr(mounts, "op_mount"):
            log.warning("this initiator has no FUSE mounts; skipping", connection=m.connection,
                        mountpoint=m.mountpoint)
            return
        try:
            await mounts.op_mount(name=m.connection, mountpoint=m.mountpoint)
            log.info("boot mount up", connection=m.connection, mountpoint=m.mountpoint)
        except Exception as exc:  # MountError, OSError ...
            log.error("boot mount failed", connection=m.connection, mountpoint=m.mountpoint,
                      error=str(exc))

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks.clear()
