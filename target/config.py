"""Target configuration (TOML): ports, subsystems, namespaces, allowed hosts.

Example::

    [logging]
    format = "console"        # or "json"
    level = "info"

    [target]
    max_io_queues = 16
    max_unsent = "4MiB"       # limits against a hostile host: see docs/security.md
    r2t_budget = "16MiB"
    r2t_budget_total = "256MiB"
    hello_timeout = 5.0
    pdu_timeout = 30.0
    max_connections = 1024
    max_connections_per_host = 128
    max_unsent_total = "256MiB"
    rdma_recv_total = "256MiB"
    auth_timeout = 120.0
    threaded_queues = true    # steady NVMe/TCP I/O queues served by a thread each; false: all on the loop (docs/dataplane.md)
    io_uring_queues = false   # those threads receive, read/write and send through an io_uring each (docs/dataplane.md)
    io_uring_sqpoll = false   # those rings submit through a kernel thread each (SQPOLL): no system call to submit
    io_uring_sqpoll_idle_ms = 10  # how long that kernel thread spins after its last work before it sleeps
    io_uring_spin_us = 0      # with SQPOLL: how long a queue thread polls its ring for a completion before it sleeps

    [control]
    socket = "/run/blockd/target.sock"   # root-only; "" turns the control socket off

    [metrics]                 # Prometheus text format over HTTP (docs/operations.md)
    enabled = false
    address = "127.0.0.1"     # loopback unless you mean to expose it
    port = 9469

    [[port]]
    id = 1                    # optional, defaults to the position (1, 2, ...)
    transport = "tcp"         # or "rdma"
    address = "127.0.0.1"
    port = 4420
    discovery = "port"        # optional: what its discovery log lists: "port" (nvmet's rule: the
                              # subsystems on this port) or "all" (SPDK's: every port's, the host may see)

    [[port.referral]]         # optional, as nvmet's ports/N/referrals: a discovery log entry of
    transport = "tcp"         # subtype referral sending the host to another discovery controller
    address = "192.0.2.7"
    port = 8009
    port_id = 1               # optional: the PORTID the entry names (default 0)

    [[subsystem]]
    nqn = "nqn.2026-11.io.blockd:vol1"
    serial = "BLOCKD0001"
    model = "blockd"
    allow_any_host = false
    hosts = ["nqn.2014-08.org.nvmexpress:uuid:..."]
    ports = [1]               # optional: default every port
    cntlid_min = 1            # optional: the controller ids of this subsystem's hosts; two
    cntlid_max = 0xFFEF       # targets presenting one subsystem need disjoint ranges

    [[subsystem.host_auth]]   # DH-HMAC-CHAP for one host (docs/security.md, Authentication)
    nqn = "nqn.2014-08.org.nvmexpress:uuid:..."     # allowed even if not in hosts
    dhchap_key = "DHHC-1:01:...:"                   # the host's secret (nvme gen-dhchap-key)
    dhchap_ctrl_key = "DHHC-1:00:...:"              # optional: the host authenticates us too
    dhchap_hashes = ["sha256", "sha384", "sha512"]  # optional, preferred first
    dhchap_dhgroups = ["ffdhe2048", "null"]         # optional, preferred first

    [[subsystem.namespace]]
    nsid = 1
    backend = "file"          # optional: the storage behind it, by name (target/backend_registry.py)
    path = "/var/lib/blockd/vol1.img"   # the backend's locator: the file or block device
    size = "10GiB"            # files are created at this size when missing
    block_size = 512          # or 4096
    read_only = false
    ana_group = 1             # optional: its ANA group (default 1)
    options = {}              # optional: a backend's own settings (backend = "rbd": docs/ceph.md)
    nguid = "..."             # optional, 32 hex digits; uuid = "8-4-4-4-12"; eui64 = 16 hex digits:
                              # by default derived from (NQN, nsid), so equal on two targets

    [[ana]]                   # optional: an ANA group's state (default optimized everywhere)
    port = 1                  # optional: default every port
    group = 1                 # optional: default 1
    state = "inaccessible"    # optimized, non-optimized, inaccessible, persistent-loss, change

    # with replicas (docs/replication.md) the end of the file holds the replication metadata
    # and the namespace exports less than ``size``; these three keys apply only then:
    region_size = "64KiB"     # one write-intent bitmap bit
    min_in_sync = 1           # copies (this one included) a write needs, else it fails
    resync_rate = "100MiB"    # per second, per replica
    standby_nqn = "nqn.2026-11.io.blockd:vol1-standby"  # optional: a failover pair (docs/replication.md):
                              # while this copy is the standby (its ANA group inaccessible), its
                              # primary writes it through this subsystem, in ANA group 128
    standby_hosts = ["nqn.2014-08.org.nvmexpress:uuid:..."]  # who may (default: any host)
    metadata_path = "/var/lib/blockd/vol1.md"  # optional: external metadata (the namespace then
                              # exports all of path); made by 'blockctl target create-md'

    [[subsystem.namespace.replica]]   # one table per copy: an NVMe-oF namespace
    transport = "tcp"         # or "rdma"
    address = "10.0.0.6"
    port = 4420
    nqn = "nqn.2026-11.io.blockd:vol1-copy"
    nsid = 1
    hostnqn = "nqn.2014-08.org.nvmexpress:uuid:..."  # optional: default this machine's
    timeout = 5.0             # seconds a replica may take to answer before it goes out of sync

Every mistake is reported as one :class:`ConfigError` line naming the offending entry. A file
holding secrets must not be readable by others (mode o-r), or it is refused; the secrets
themselves never appear in an error or a log line.
"""

from __future__ import annotations

import hashlib
import os
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from blockd.config import (
    ConfigError, MetricsConfig, metrics_config, parse_size, read_toml, refuse_readable_secrets, take, unknown,
)
from blockd.dhchap_secret import Secret, SecretError, parse_secret
from protocol.auth import DhGroup, HashId
from protocol.constants import ANA_STATE_NAMES, DEFAULT_IO_PORT, DISCOVERY_NQN, AnaState
from target.ana import DEFAULT_ANA_GROUP, MAX_ANA_GROUPS, STANDBY_ANA_GROUP
from target.backend_registry import DEFAULT_BACKEND, backend_names
from target.transport import DEFAULT_MAX_TRANSFER, transport_names

DEFAULT_CONTROL_SOCKET = "/run/blockd/target.sock"
DEFAULT_METRICS_PORT = 9469
"""blockd's exporter port (beside node_exporter's 9100 range; not taken in Prometheus's list
of default ports)."""
_NQN = re.compile(r"^nqn\.\d{4}-\d{2}\.[^:]+(:.+)?$")


@dataclass(frozen=True)
class ReferralConfig:
    """Another discovery controller a port's discovery log refers hosts to (nvmet's referral:
    transport, address, service and PORTID of the entry)."""
    transport: str
    address: str
    port: int
    port_id: int = 0


DISCOVERY_LISTINGS = ("port", "all")
"""What a port's discovery log lists: "port", the subsystems exported on that port (nvmet); "all",
every port's listener of every subsystem the host may use (SPDK's default)."""


@dataclass(frozen=True)
class PortConfig:
    port_id: int
    transport: str
    address: str
    port: int
    discovery: str = "port"
    """One of :data:`DISCOVERY_LISTINGS`."""
    referrals: tuple[ReferralConfig, ...] = ()


DEFAULT_REGION_SIZE = 64 << 10
DEFAULT_RESYNC_RATE = 100 << 20
MAX_REPLICAS = 4
"""Replicas of one namespace; also the peer slots its metadata is formatted with."""


@dataclass(frozen=True)
class ReplicaConfig:
    """One remote copy of a replicated namespace: an NVMe-oF namespace address."""
    transport: str
    address: str
    port: int
    nqn: str
    nsid: int = 1
    hostnqn: str | None = None
    timeout: float = 5.0

    @property
    def name(self) -> str:
        """How logs and ``blockctl target replicas`` name it."""
        return f"{self.transport}://{self.address}:{self.port}/{self.nqn}/{self.nsid}"


@dataclass(frozen=True)
class NamespaceConfig:
    nsid: int
    path: str
    size: int | None
    block_size: int = 512
    read_only: bool = False
    ana_group: int = DEFAULT_ANA_GROUP
    ids: tuple[bytes | None, bytes | None, bytes | None] = (None, None, None)
    """Configured (NGUID, UUID, EUI-64); None: derived (target.subsystem.Namespace)."""
    replicas: tuple[ReplicaConfig, ...] = ()
    """Empty: a plain file namespace."""
    region_size: int = DEFAULT_REGION_SIZE
    min_in_sync: int = 1
    resync_rate: int = DEFAULT_RESYNC_RATE
    """Bytes per second one resync copies at most."""
    standby_nqn: str | None = None
    """A failover pair's copy: the subsystem through which the primary writes this copy while
    this node is the standby (target.replication.standby)."""
    standby_hosts: frozenset[str] = frozenset()
    """Host NQNs allowed on the standby subsystem; empty: any host."""
    metadata_path: str | None = None
    """External replication metadata: the file or device holding the superblocks and bitmaps
    (target.replication.external); None: they sit at the end of ``path``."""
    backend: str = DEFAULT_BACKEND
    """The registered backend that opens ``path`` (:mod:`target.backend_registry`)."""
    options: tuple[tuple[str, Any], ...] = ()
    """The ``[subsystem.namespace.options]`` table, sorted by key: settings of a backend other
    than the file (the rbd backend's ceph.conf, client, failover); its opener checks them."""


MAX_CNTLID = 0xFFEF
"""Highest controller id (0xFFF0 and up are reserved)."""


@dataclass(frozen=True)
class AnaConfig:
    """One ``[[ana]]`` entry: ``group``'s state on ``port`` (None: every port)."""
    port: int | None
    group: int
    state: AnaState


HASH_NAMES = {"sha256": HashId.SHA256, "sha384": HashId.SHA384, "sha512": HashId.SHA512}
DHGROUP_NAMES = {"null": DhGroup.NULL, "ffdhe2048": DhGroup.FFDHE2048,
                 "ffdhe3072": DhGroup.FFDHE3072, "ffdhe4096": DhGroup.FFDHE4096,
                 "ffdhe6144": DhGroup.FFDHE6144, "ffdhe8192": DhGroup.FFDHE8192}
"""The names nvmet's configfs uses for ``dhchap_hash`` (without ``hmac()``) and ``dhchap_dhgroup``."""


@dataclass(frozen=True)
class HostAuthConfig:
    """What the target requires of one host: its secret, the controller's secret when the host
    may authenticate the controller, and the hashes and DH groups allowed, preferred first."""
    secret: Secret
    ctrl_secret: Secret | None
    hashes: tuple[int, ...]
    dh_groups: tuple[int, ...]


@dataclass(frozen=True)
class SubsystemConfig:
    nqn: str
    serial: str
    model: str
    allow_any_host: bool
    hosts: frozenset[str]
    ports: frozenset[int] | None
    namespaces: tuple[NamespaceConfig, ...]
    host_auth: dict[str, HostAuthConfig] = field(default_factory=dict)
    cntlid_range: tuple[int, int] = (1, MAX_CNTLID)


@dataclass(frozen=True)
class Limits:
    """What one host may make the target hold; docs/security.md says why each default."""

    max_unsent: int = 4 << 20
    """Replies a queue may have waiting to be sent (bytes) before it stops reading commands."""
    r2t_budget: int = 16 << 20
    """Write data buffers (asked for with R2T) one queue may hold; later writes wait."""
    r2t_budget_total: int = 256 << 20
    """The same over all queues of the daemon."""
    hello_timeout: float = 5.0
    """Seconds from accept until ICReq and Connect must have succeeded."""
    pdu_timeout: float = 30.0
    """Seconds one PDU may take to arrive once its first byte has."""
    max_connections: int = 1024
    """Connections open at once, over all ports; more are closed at accept."""
    max_connections_per_host: int = 128
    """Connections open at once from one source address."""
    max_unsent_total: int = 256 << 20
    """Replies waiting to be sent over all queues; past it, queues with unsent replies stop reading."""
    rdma_recv_total: int = 256 << 20
    """Receive buffers posted by all NVMe/RDMA queues (depth x (64 + in-capsule size) each); a
    queue that would pass it is refused at its CM connect request."""
    auth_timeout: float = 120.0
    """Seconds a queue of a host with a DH-HMAC-CHAP secret has to authenticate from Connect, when
    its controller has no KATO (else the KATO), as nvmet's transaction timer; then it is closed."""


_LIMIT_KINDS = {"max_unsent": "size", "r2t_budget": "size", "r2t_budget_total": "size",
                "hello_timeout": "seconds", "pdu_timeout": "seconds",
                "max_connections": "count", "max_connections_per_host": "count",
                "max_unsent_total": "size", "rdma_recv_total": "size", "auth_timeout": "seconds"}


def _limits(table: dict[str, Any], where: str) -> Limits:
    values: dict[str, Any] = {}
    for key, kind in _LIMIT_KINDS.items():
        if key not in table:
            continue
        if kind == "size":
            values[key] = parse_size(table[key], f"{where} {key}")
        elif kind == "seconds":
            value = take(table, key, (int, float), where)
            if not 0 < value <= 3600:
                raise ConfigError(f"{where}: {key} must be more than 0 and at most 3600 seconds")
            values[key] = float(value)
        else:
            value = take(table, key, int, where)
            if value < 1:
                raise ConfigError(f"{where}: {key} must be at least 1")
            values[key] = value
    # a budget smaller than the largest write could never let such a write through
    if min(values.get("r2t_budget", Limits.r2t_budget),
           values.get("r2t_budget_total", Limits.r2t_budget_total)) < DEFAULT_MAX_TRANSFER:
        raise ConfigError(f"{where}: r2t_budget and r2t_budget_total must hold one largest write (1MiB)")
    return Limits(**values)


@dataclass(frozen=True)
class TargetConfig:
    ports: tuple[PortConfig, ...]
    subsystems: tuple[SubsystemConfig, ...]
    log_format: str = "console"
    log_level: str = "info"
    max_io_queues: int = 16
    limits: Limits = Limits()
    control_socket: str = DEFAULT_CONTROL_SOCKET
    """The control socket's path; empty: none."""
    metrics: MetricsConfig | None = None
    """The Prometheus endpoint; None: off."""
    ana: tuple[AnaConfig, ...] = ()
    """ANA states set by the configuration; every other (port, group) is optimized."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    threaded_queues: bool = True
    """Steady NVMe/TCP I/O queues served by a thread each (compiled plane only; docs/dataplane.md,
    "The target's threaded queue": less target CPU per I/O, and why it is now on by default);
    False keeps every queue on the event loop."""
    io_uring_queues: bool = False
    """Those threads run their Reads and Writes through an io_uring each, one ``io_uring_enter``
    per receive (``target/_uring_loop.pyx``; docs/dataplane.md, "The target's io_uring queue
    loop"); where the kernel refuses a ring the threads make their own system calls, said at
    start."""
    io_uring_sqpoll: bool = False
    """Those rings are made with ``IORING_SETUP_SQPOLL``: a kernel thread per ring takes the
    submissions, so a queue thread submits without a system call; that kernel thread spins on a
    CPU of its own while there is work and for ``io_uring_sqpoll_idle_ms`` after (docs/dataplane.md,
    "SQPOLL and the bounded spin": what it costs on a small machine)."""
    io_uring_sqpoll_idle_ms: int = 10
    """The SQPOLL thread's spin after its last submission (``sq_thread_idle``), milliseconds."""
    io_uring_spin_us: int = 0
    """With SQPOLL, how long a queue thread polls its ring's completions before it waits in
    ``io_uring_enter`` (the bounded spin of SPDK's reactor); 0: it waits at once."""


_URING_KEYS = ("io_uring_sqpoll", "io_uring_sqpoll_idle_ms", "io_uring_spin_us")


def _uring_poll(target_t: dict[str, Any], io_uring_queues: bool, where: str) -> tuple[bool, int, int]:
    """``[target]``'s SQPOLL and spin settings, checked: SQPOLL without ``io_uring_queues``, or a
    spin without SQPOLL, would do nothing, so they are refused rather than ignored. The idle time
    alone is let be (the sample configuration lists it beside ``io_uring_sqpoll = false``)."""
    sqpoll = take(target_t, "io_uring_sqpoll", bool, where, False)
    idle_ms = take(target_t, "io_uring_sqpoll_idle_ms", int, where, 10)
    spin_us = take(target_t, "io_uring_spin_us", int, where, 0)
    if sqpoll and not io_uring_queues:
        raise ConfigError(f"{where}: io_uring_sqpoll needs io_uring_queues = true")
    if not 1 <= idle_ms <= 10_000:
        raise ConfigError(f"{where}: io_uring_sqpoll_idle_ms must be 1..10000")
    if not 0 <= spin_us <= 10_000:
        raise ConfigError(f"{where}: io_uring_spin_us must be 0..10000")
    if spin_us and not sqpoll:
        raise ConfigError(f"{where}: io_uring_spin_us needs io_uring_sqpoll = true")
    return sqpoll, idle_ms, spin_us


def load(path: str) -> TargetConfig:
    """Read and validate a target configuration file; one holding secrets must not be readable
    by others."""
    config = parse(read_toml(path), path)
    if any(s.host_auth for s in config.subsystems):
        refuse_readable_secrets(path)
    return config


def _secret(table: dict[str, Any], key: str, where: str) -> Secret | None:
    text = take(table, key, str, where, None)
    if text is None:
        return None
    try:
        return parse_secret(text)
    except SecretError as exc:  # the message never quotes the secret
        raise ConfigError(f"{where}: {key}: {exc}") from None


def _names(table: dict[str, Any], key: str, known: dict[str, int], where: str) -> tuple[int, ...]:
    names = take(table, key, list, where, list(known))
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ConfigError(f"{where}: {key} must list some of {', '.join(known)}")
    return tuple(known[n] for n in names)


def _host_auth(entries: list[Any], where: str) -> dict[str, HostAuthConfig]:
    result: dict[str, HostAuthConfig] = {}
    for k, h in enumerate(entries):
        hwhere = f"{where} host_auth #{k + 1}"
        unknown(h, {"nqn", "dhchap_key", "dhchap_ctrl_key", "dhchap_hashes", "dhchap_dhgroups"},
                 hwhere)
        nqn = take(h, "nqn", str, hwhere)
        secret = _secret(h, "dhchap_key", hwhere)
        if secret is None:
            raise ConfigError(f"{hwhere}: missing 'dhchap_key'")
        if nqn in result:
            raise ConfigError(f"{hwhere}: host {nqn} appears twice")
        result[nqn] = HostAuthConfig(secret, _secret(h, "dhchap_ctrl_key", hwhere),
                                     _names(h, "dhchap_hashes", HASH_NAMES, hwhere),
                                     _names(h, "dhchap_dhgroups", DHGROUP_NAMES, hwhere))
    return result


def parse(raw: dict[str, Any], source: str = "config") -> TargetConfig:
    unknown(raw, {"port", "subsystem", "logging", "target", "control", "metrics", "ana"}, source)
    logging_t = take(raw, "logging", dict, source, {})
    unknown(logging_t, {"format", "level"}, f"{source} [logging]")
    log_format = take(logging_t, "format", str, f"{source} [logging]", "console")
    if log_format not in ("console", "json"):
        raise ConfigError(f"{source} [logging]: format must be 'console' or 'json'")
    target_t = take(raw, "target", dict, source, {})
    unknown(target_t, {"max_io_queues", "threaded_queues", "io_uring_queues", *_URING_KEYS, *_LIMIT_KINDS},
            f"{source} [target]")
    max_io_queues = take(target_t, "max_io_queues", int, f"{source} [target]", 16)
    if not 1 <= max_io_queues <= 1024:
        raise ConfigError(f"{source} [target]: max_io_queues must be 1..1024")
    limits = _limits(target_t, f"{source} [target]")
    threaded_queues = take(target_t, "threaded_queues", bool, f"{source} [target]", True)
    io_uring_queues = take(target_t, "io_uring_queues", bool, f"{source} [target]", False)
    sqpoll, sqpoll_idle_ms, spin_us = _uring_poll(target_t, io_uring_queues, f"{source} [target]")
    control_t = take(raw, "control", dict, source, {})
    unknown(control_t, {"socket"}, f"{source} [control]")
    control_socket = take(control_t, "socket", str, f"{source} [control]", DEFAULT_CONTROL_SOCKET)
    if control_socket and not control_socket.startswith("/"):
        raise ConfigError(f"{source} [control]: socket must be an absolute path (or \"\" for none)")
    metrics = metrics_config(take(raw, "metrics", dict, source, {}), f"{source} [metrics]", DEFAULT_METRICS_PORT)

    ports: list[PortConfig] = []
    for i, p in enumerate(take(raw, "port", list, source, [])):
        where = f"{source} port #{i + 1}"
        unknown(p, {"id", "transport", "address", "port", "discovery", "referral"}, where)
        transport = _transport(p, where)
        address = take(p, "address", str, where)
        if transport == "rdma" and address in ("0.0.0.0", "::"):
            raise ConfigError(f"{where}: RDMA ports must name a local address, not the wildcard {address}")
        number = take(p, "port", int, where, DEFAULT_IO_PORT)
        if not 1 <= number <= 65535:
            raise ConfigError(f"{where}: port {number} is out of range")
        referrals = tuple(_referral(r, f"{where} referral #{k + 1}")
                          for k, r in enumerate(take(p, "referral", list, where, [])))
        ports.append(PortConfig(take(p, "id", int, where, i + 1), transport, address, number,
                                _one_of(p, "discovery", DISCOVERY_LISTINGS, where), referrals))
    ids = [p.port_id for p in ports]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{source}: port ids must be unique")

    subsystems: list[SubsystemConfig] = []
    for i, s in enumerate(take(raw, "subsystem", list, source, [])):
        where = f"{source} subsystem #{i + 1}"
        unknown(s, {"nqn", "serial", "model", "allow_any_host", "hosts", "ports", "namespace",
                     "host_auth", "cntlid_min", "cntlid_max"}, where)
        nqn = take(s, "nqn", str, where)
        where = f"{source} subsystem {nqn}"
        if not _NQN.match(nqn) or len(nqn.encode()) > 223 or nqn == DISCOVERY_NQN:
            raise ConfigError(f"{where}: not a valid subsystem NQN (nqn.yyyy-mm.reverse.domain:name, at most 223 bytes)")
        host_auth = _host_auth(take(s, "host_auth", list, where, []), where)
        hosts = take(s, "hosts", list, where, []) + list(host_auth)
        allow_any = take(s, "allow_any_host", bool, where, not hosts)
        sub_ports = take(s, "ports", list, where, None)
        if sub_ports is not None and not set(sub_ports) <= set(ids):
            raise ConfigError(f"{where}: ports {sorted(set(sub_ports) - set(ids))} are not configured")
        serial = take(s, "serial", str, where, hashlib.sha1(nqn.encode()).hexdigest()[:20])
        if len(serial) > 20 or not serial.isascii():
            raise ConfigError(f"{where}: serial must be at most 20 ASCII characters")
        model = take(s, "model", str, where, "blockd")
        if len(model) > 40 or not model.isascii():
            raise ConfigError(f"{where}: model must be at most 40 ASCII characters")
        namespaces = [_namespace(n, f"{where} namespace #{j + 1}", j + 1)
                      for j, n in enumerate(take(s, "namespace", list, where, []))]
        nsids = [n.nsid for n in namespaces]
        if len(set(nsids)) != len(nsids) or any(not 1 <= x < 0xFFFFFFFF for x in nsids):
            raise ConfigError(f"{where}: namespace ids must be unique and between 1 and 4294967294")
        subsystems.append(SubsystemConfig(nqn, serial, model, allow_any, frozenset(hosts),
                                          frozenset(sub_ports) if sub_ports is not None else None,
                                          tuple(namespaces), host_auth, _cntlid_range(s, where)))
    nqns = [s.nqn for s in subsystems] + [n.standby_nqn for s in subsystems for n in s.namespaces if n.standby_nqn]
    if len(set(nqns)) != len(nqns):
        raise ConfigError(f"{source}: subsystem NQNs (standby_nqn included) must be unique")
    ana = _ana_entries(take(raw, "ana", list, source, []), set(ids), source)
    if len(nqns) > len(subsystems) and any(a.group == STANDBY_ANA_GROUP for a in ana):
        raise ConfigError(f"{source}: ANA group {STANDBY_ANA_GROUP} holds the standby subsystems: "
                          "its state is not configurable")
    return TargetConfig(tuple(ports), tuple(subsystems), log_format,
                        take(logging_t, "level", str, f"{source} [logging]", "info"), max_io_queues,
                        limits, control_socket, metrics, ana, threaded_queues=threaded_queues,
                        io_uring_queues=io_uring_queues, io_uring_sqpoll=sqpoll,
                        io_uring_sqpoll_idle_ms=sqpoll_idle_ms, io_uring_spin_us=spin_us)


def _referral(r: Any, where: str) -> ReferralConfig:
    if not isinstance(r, dict):
        raise ConfigError(f"{where}: must be a table")
    unknown(r, {"transport", "address", "port", "port_id"}, where)
    number = take(r, "port", int, where)
    if not 1 <= number <= 65535:
        raise ConfigError(f"{where}: port {number} is out of range")
    port_id = take(r, "port_id", int, where, 0)
    if not 0 <= port_id <= 0xFFFF:
        raise ConfigError(f"{where}: port_id must be 0..65535")
    address = take(r, "address", str, where)
    if not address or len(address.encode()) > 255:
        raise ConfigError(f"{where}: address must be 1 to 255 bytes")
    return ReferralConfig(_transport(r, where), address, number, port_id)


def idle_ports(config: TargetConfig) -> list[PortConfig]:
    """Ports whose discovery log would name nothing but the discovery subsystem: no subsystem
    exported there, no referral and no listing of the other ports (``discovery = "all"`` with a
    subsystem somewhere). A host sent there finds no volume: worth a warning at start."""
    def exported(port_id: int) -> bool:
        return any(s.ports is None or port_id in s.ports for s in config.subsystems)
    return [p for p in config.ports
            if not exported(p.port_id) and not p.referrals
            and not (p.discovery == "all" and any(exported(q.port_id) for q in config.ports))]


def _one_of(table: dict[str, Any], key: str, names: tuple[str, ...], where: str) -> str:
    """``table[key]`` (default the first name), which must be one of ``names``."""
    value = take(table, key, str, where, names[0])
    if value not in names:
        raise ConfigError(f"{where}: {key} must be one of {', '.join(names)}, not {value!r}")
    return value


def _transport(table: dict[str, Any], where: str) -> str:
    """A port's or a replica's transport: a name of the registry (:mod:`target.transport`; a
    replica is reached through the host's transports, which have the same names)."""
    return _one_of(table, "transport", transport_names(), where)


def _namespace(n: dict[str, Any], where: str, default_nsid: int) -> NamespaceConfig:
    unknown(n, {"nsid", "backend", "path", "size", "block_size", "read_only", "ana_group", "nguid", "uuid", "eui64",
                "replica", "region_size", "min_in_sync", "resync_rate", "standby_nqn", "standby_hosts",
                "metadata_path", "options"}, where)
    nsid = take(n, "nsid", int, where, default_nsid)
    size = n.get("size")
    block_size = take(n, "block_size", int, where, 512)
    if block_size not in (512, 4096):
        raise ConfigError(f"{where}: block_size must be 512 or 4096")
    size_b = parse_size(size, where) if size is not None else None
    if size_b is not None and size_b % block_size:
        raise ConfigError(f"{where}: size must be a multiple of the block size {block_size}")
    read_only = take(n, "read_only", bool, where, False)
    path = take(n, "path", str, where)
    common = {"ana_group": _ana_group(n, where), "ids": _namespace_ids(n, where),
              "backend": _one_of(n, "backend", backend_names(), where),
              "options": tuple(sorted(take(n, "options", dict, where, {}).items()))}
    replicas = tuple(_replica(r, f"{where} replica #{k + 1}")
                     for k, r in enumerate(take(n, "replica", list, where, [])))
    if not replicas:
        extra = {"region_size", "min_in_sync", "resync_rate", "standby_nqn", "standby_hosts", "metadata_path"} & n.keys()
        if extra:
            raise ConfigError(f"{where}: {', '.join(sorted(extra))} apply only to a namespace with replicas")
        return NamespaceConfig(nsid, path, size_b, block_size, read_only, **common)
    if read_only:
        raise ConfigError(f"{where}: a replicated namespace cannot be read_only")
    if len(replicas) > MAX_REPLICAS:
        raise ConfigError(f"{where}: at most {MAX_REPLICAS} replicas")
    if len({r.name for r in replicas}) != len(replicas):
        raise ConfigError(f"{where}: a replica appears twice")
    region_size = parse_size(n.get("region_size", DEFAULT_REGION_SIZE), f"{where} region_size")
    if region_size < 4096 or region_size & (region_size - 1):
        raise ConfigError(f"{where}: region_size must be a power of two of at least 4KiB")
    min_in_sync = take(n, "min_in_sync", int, where, 1)
    if not 1 <= min_in_sync <= len(replicas) + 1:
        raise ConfigError(f"{where}: min_in_sync must be 1 (this copy alone) to {len(replicas) + 1} (every copy)")
    resync_rate = parse_size(n.get("resync_rate", DEFAULT_RESYNC_RATE), f"{where} resync_rate")
    if resync_rate < region_size:
        raise ConfigError(f"{where}: resync_rate must be at least one region ({region_size} bytes) per second")
    standby_nqn = take(n, "standby_nqn", str, where, None)
    if standby_nqn is not None and (not _NQN.match(standby_nqn) or standby_nqn == DISCOVERY_NQN):
        raise ConfigError(f"{where}: standby_nqn {standby_nqn!r} is not a valid subsystem NQN")
    standby_hosts = take(n, "standby_hosts", list, where, [])
    if standby_nqn is None and standby_hosts:
        raise ConfigError(f"{where}: standby_hosts applies only with standby_nqn")
    for host in standby_hosts:
        if not isinstance(host, str) or not _NQN.match(host):
            raise ConfigError(f"{where}: standby_hosts: {host!r} is not a valid host NQN")
    if standby_nqn is not None and common["ana_group"] == STANDBY_ANA_GROUP:
        raise ConfigError(f"{where}: ANA group {STANDBY_ANA_GROUP} holds the standby subsystems")
    metadata_path = take(n, "metadata_path", str, where, None)
    if metadata_path is not None and os.path.abspath(metadata_path) == os.path.abspath(path):
        raise ConfigError(f"{where}: metadata_path must be another file than path")
    return NamespaceConfig(nsid, path, size_b, block_size, False, replicas=replicas, region_size=region_size,
                           min_in_sync=min_in_sync, resync_rate=resync_rate, standby_nqn=standby_nqn,
                           standby_hosts=frozenset(standby_hosts), metadata_path=metadata_path, **common)


def _replica(r: dict[str, Any], where: str) -> ReplicaConfig:
    unknown(r, {"transport", "address", "port", "nqn", "nsid", "hostnqn", "timeout"}, where)
    transport = _transport(r, where)
    port = take(r, "port", int, where, DEFAULT_IO_PORT)
    if not 1 <= port <= 65535:
        raise ConfigError(f"{where}: port {port} is out of range")
    nqn = take(r, "nqn", str, where)
    if not _NQN.match(nqn) or nqn == DISCOVERY_NQN:
        raise ConfigError(f"{where}: {nqn!r} is not a valid subsystem NQN")
    nsid = take(r, "nsid", int, where, 1)
    if not 1 <= nsid < 0xFFFFFFFF:
        raise ConfigError(f"{where}: nsid {nsid} is out of range")
    hostnqn = take(r, "hostnqn", str, where, None)
    if hostnqn is not None and not _NQN.match(hostnqn):
        raise ConfigError(f"{where}: {hostnqn!r} is not a valid host NQN")
    timeout = take(r, "timeout", (int, float), where, 5.0)
    if not 0 < timeout <= 600:
        raise ConfigError(f"{where}: timeout must be more than 0 and at most 600 seconds")
    return ReplicaConfig(transport, take(r, "address", str, where), port, nqn, nsid, hostnqn, float(timeout))


def _ana_group(table: dict[str, Any], where: str) -> int:
    group = take(table, "ana_group", int, where, DEFAULT_ANA_GROUP)
    if not 1 <= group <= MAX_ANA_GROUPS:
        raise ConfigError(f"{where}: ana_group must be 1..{MAX_ANA_GROUPS}")
    return group


def _hex_id(table: dict[str, Any], key: str, size: int, where: str) -> bytes | None:
    text = take(table, key, str, where, None)
    if text is None:
        return None
    try:
        value = bytes.fromhex(text.replace("-", ""))
    except ValueError:
        value = b""
    if len(value) != size or not any(value):
        raise ConfigError(f"{where}: {key} must be {size * 2} hexadecimal digits, not all zero")
    return value


def _namespace_ids(table: dict[str, Any], where: str) -> tuple[bytes | None, bytes | None, bytes | None]:
    """The configured NGUID, UUID and EUI-64 (a target presenting a namespace another target
    presents too must show the same ids, or the Linux host drops the shared namespace)."""
    text = take(table, "uuid", str, where, None)
    try:
        uuid_bytes = uuid.UUID(text).bytes if text is not None else None
    except ValueError:
        raise ConfigError(f"{where}: uuid {text!r} is not a UUID") from None
    return _hex_id(table, "nguid", 16, where), uuid_bytes, _hex_id(table, "eui64", 8, where)


def _cntlid_range(table: dict[str, Any], where: str) -> tuple[int, int]:
    """nvmet's ``attr_cntlid_min/max``: disjointness across targets is the user's to keep."""
    low = take(table, "cntlid_min", int, where, 1)
    high = take(table, "cntlid_max", int, where, MAX_CNTLID)
    if not 1 <= low <= high <= MAX_CNTLID:
        raise ConfigError(f"{where}: cntlid_min and cntlid_max must satisfy 1 <= min <= max <= {MAX_CNTLID:#x}")
    return low, high


def ana_state(name: str, where: str) -> AnaState:
    try:
        return ANA_STATE_NAMES[name]
    except KeyError:
        raise ConfigError(f"{where}: ANA state must be one of {', '.join(ANA_STATE_NAMES)}, not {name!r}") from None


def _ana_entries(entries: list[Any], port_ids: set[int], source: str) -> tuple[AnaConfig, ...]:
    result: list[AnaConfig] = []
    seen: set[tuple[int | None, int]] = set()
    for i, a in enumerate(entries):
        where = f"{source} ana #{i + 1}"
        if not isinstance(a, dict):
            raise ConfigError(f"{where}: must be a table")
        unknown(a, {"port", "group", "state"}, where)
        port = take(a, "port", int, where, None)
        if port is not None and port not in port_ids:
            raise ConfigError(f"{where}: port {port} is not configured")
        group = take(a, "group", int, where, DEFAULT_ANA_GROUP)
        if not 1 <= group <= MAX_ANA_GROUPS:
            raise ConfigError(f"{where}: group must be 1..{MAX_ANA_GROUPS}")
        if (port, group) in seen:
            raise ConfigError(f"{where}: group {group} on {'every port' if port is None else f'port {port}'} "
                              "is set twice")
        seen.add((port, group))
        result.append(AnaConfig(port, group, ana_state(take(a, "state", str, where), where)))
    return tuple(result)
