"""Initiator daemon configuration (``/etc/blockd/initiator.toml``): connections made at start.

Example::

    # every [[connection]] takes the options of `blockctl connect` (initiator/params.py)
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
    # rdma_keys = "auto"                # or "mw", "mr" (initiator/rdma.py)
    # hdr_digest = false
    # data_digest = false
    # dhchap_secret = "DHHC-1:01:...:"   # in-band authentication (docs/security.md); the file
    # dhchap_ctrl_secret = "DHHC-1:00:...:"  # must then not be readable by others
    # paths = ["192.0.2.1:4420", "192.0.2.2:4420"]  # multipath (ANA failover): instead of traddr
    # iopolicy = "numa"                 # among the paths: or "round-robin", "queue-depth"

    # discovery controllers `blockctl connect-all --config FILE` reads (as lines of nvme-cli's
    # /etc/nvme/discovery.conf): traddr, and any other connect option but nqn
    [[discovery]]
    transport = "tcp"
    traddr = "192.0.2.1"
    trsvcid = 8009

    # FUSE mounts, as `blockctl mount vol1 /mnt/vol1` (initiator/fuse/): made once the
    # connection is up; the mount point must be an existing directory
    [[mount]]
    connection = "vol1"
    mountpoint = "/mnt/vol1"

    [metrics]                 # Prometheus text format over HTTP (docs/operations.md)
    enabled = false
    address = "127.0.0.1"     # loopback unless you mean to expose it
    port = 9470

The daemon connects every entry at start and keeps retrying one that fails (the target may
boot later than the host); once connected, the initiator library reconnects by itself for
``ctrl_loss_tmo`` seconds after a target restart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from blockd.config import ConfigError, MetricsConfig, metrics_config, read_toml, refuse_readable_secrets, take
from initiator.multipath import parse_path
from initiator.params import CONNECT_OPTIONS, OPTIONS_BY_KEY, check_option
from protocol.constants import DEFAULT_IO_PORT

DEFAULT_METRICS_PORT = 9470
"""The target's is 9469: both daemons may run on one machine."""
BOOT_CTRL_LOSS_TMO = -1.0
"""Boot-time connections keep reconnecting forever unless their table says otherwise (a storage
host must not give up on its volumes because a target took a few minutes to come back): the one
default that differs from ``blockctl connect``'s, on purpose."""


@dataclass(frozen=True)
class ConnectionConfig:
    """One ``[[connection]]``: the connect options as written (``initiator.params``) and a name."""

    options: tuple[tuple[str, Any], ...] = field(repr=False)  # may hold secrets
    name: str | None = None
    paths: tuple[str, ...] = ()
    """``ADDR[:PORT]`` of each path of a multipath connection (initiator.multipath)."""

    @property
    def key(self) -> str:
        return self.name or dict(self.options)["nqn"]

    def connect_args(self) -> dict[str, Any]:
        """The daemon's ``connect`` request (``InitiatorDaemon.op_connect``) for this entry."""
        return {"ctrl_loss_tmo": BOOT_CTRL_LOSS_TMO, **dict(self.options), "name": self.name,
                **({"paths": list(self.paths)} if self.paths else {})}


@dataclass(frozen=True)
class MountConfig:
    connection: str
    mountpoint: str


@dataclass(frozen=True)
class InitiatorConfig:
    connections: tuple[ConnectionConfig, ...] = ()
    mounts: tuple[MountConfig, ...] = ()
    metrics: MetricsConfig | None = None
    discoveries: tuple[tuple[tuple[str, Any], ...], ...] = field(default=(), repr=False)
    """``[[discovery]]``: the connect options of each discovery controller (may hold secrets)."""


def _table(table: Any, where: str) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: must be a table")
    return table


def _connection(table: Any, where: str) -> ConnectionConfig:
    options = dict(_table(table, where))
    name = options.pop("name", None)
    if name is not None and not isinstance(name, str):
        raise ConfigError(f"{where}: 'name' must be str, not {name!r}")
    paths = options.pop("paths", [])
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        raise ConfigError(f"{where}: 'paths' must be a list of \"ADDR[:PORT]\" strings")
    for text in paths:
        try:
            parse_path(text, DEFAULT_IO_PORT)
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    extra = sorted(options.keys() - OPTIONS_BY_KEY.keys())
    if extra:
        raise ConfigError(f"{where}: unknown setting(s) {', '.join(extra)}")
    for opt in CONNECT_OPTIONS:
        if opt.required and opt.key not in options and not (paths and opt.key == "traddr"):
            raise ConfigError(f"{where}: missing '{opt.key}'")
    for key, value in options.items():
        why = check_option(key, value)
        if why:
            raise ConfigError(f"{where}: {why}")
    return ConnectionConfig(tuple(options.items()), name, tuple(paths))


def _discovery(table: Any, where: str) -> tuple[tuple[str, Any], ...]:
    options = dict(_table(table, where))
    extra = sorted(options.keys() - OPTIONS_BY_KEY.keys() | options.keys() & {"nqn"})
    if extra:
        raise ConfigError(f"{where}: unknown setting(s) {', '.join(extra)}")
    if "traddr" not in options:
        raise ConfigError(f"{where}: missing 'traddr'")
    for key, value in options.items():
        why = check_option(key, value)
        if why:
            raise ConfigError(f"{where}: {why}")
    return tuple(options.items())


def _mount(table: Any, where: str) -> MountConfig:
    fields = dict(_table(table, where))
    extra = set(fields) - {"connection", "mountpoint"}
    if extra:
        raise ConfigError(f"{where}: unknown setting(s) {', '.join(sorted(extra))}")
    for key in ("connection", "mountpoint"):
        if key not in fields:
            raise ConfigError(f"{where}: missing '{key}'")
        if not isinstance(fields[key], str):
            raise ConfigError(f"{where}: '{key}' must be str, not {fields[key]!r}")
    return MountConfig(**fields)


def parse(raw: dict[str, Any], source: str = "initiator config") -> InitiatorConfig:
    extra = set(raw) - {"connection", "mount", "metrics", "discovery"}
    if extra:
        raise ConfigError(f"{source}: unknown setting(s) {', '.join(sorted(extra))}")
    conns = [_connection(t, f"{source} connection #{i + 1}") for i, t in enumerate(raw.get("connection", []))]
    keys = [c.key for c in conns]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"{source}: connection names must be unique (the name defaults to the NQN)")
    mounts = []
    for i, t in enumerate(raw.get("mount", [])):
        m = _mount(t, f"{source} mount #{i + 1}")
        if m.connection not in keys:
            raise ConfigError(f"{source} mount #{i + 1}: no [[connection]] named {m.connection!r}")
        mounts.append(m)
    metrics = metrics_config(take(raw, "metrics", dict, source, {}), f"{source} [metrics]", DEFAULT_METRICS_PORT)
    discoveries = tuple(_discovery(t, f"{source} discovery #{i + 1}") for i, t in enumerate(raw.get("discovery", [])))
    return InitiatorConfig(tuple(conns), tuple(mounts), metrics, discoveries)


def load(path: str) -> InitiatorConfig:
    """Read and validate an initiator configuration file; one holding secrets must not be
    readable by others."""
    config = parse(read_toml(path), path)
    if any(k in ("dhchap_secret", "dhchap_ctrl_secret")
           for options in [*(c.options for c in config.connections), *config.discoveries] for k, _ in options):
        refuse_readable_secrets(path)
    return config
