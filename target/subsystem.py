"""Subsystems and namespaces: what the target exports and to whom."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field

from target.ana import DEFAULT_ANA_GROUP
from target.config import MAX_CNTLID, HostAuthConfig
from blockd.iocounters import IoCounters
from protocol.constants import DISCOVERY_NQN
from target.backend import Backend
from target.io_fast import fast_namespace
from target.reservations import SIDECAR_SUFFIX, Reservations

_ID_NAMESPACE = uuid.UUID("6d1c7a43-3b64-4a63-9c55-0b7c0d0ad0b1")


@dataclass
class Namespace:
    """One namespace of a subsystem.

    Its UUID/NGUID/EUI-64 derive from (subsystem NQN, NSID) unless configured, so they are
    unique across subsystems and stable across restarts: the Linux host drops a namespace whose
    ids change. Two targets presenting one namespace (ANA) therefore agree on them by default;
    the configured ones serve a namespace another target (nvmet's ``device_nguid``) also shows.
    """

    nsid: int
    backend: Backend
    block_size: int = 512
    subsystem_nqn: str = ""
    path: str = ""
    ana_group: int = DEFAULT_ANA_GROUP
    """The ANA group whose state, per port, says whether I/O is served (target.ana)."""
    ids: tuple[bytes | None, bytes | None, bytes | None] = (None, None, None)
    """Configured (NGUID, UUID, EUI-64), each None for the derived one."""
    counters: IoCounters = field(default_factory=IoCounters, compare=False, repr=False)
    """Every host's I/O commands on this namespace."""
    in_flight: int = field(default=0, init=False, repr=False, compare=False)
    """Commands parsed against this namespace and not yet completed: the backend stays open
    while any holds it (as nvmet's per-namespace ``ns->ref``). The core counts them, not the
    handlers, so a write still waiting for its R2T data is held too."""
    removed: bool = field(default=False, init=False, repr=False, compare=False)
    """Taken out of its subsystem: the backend closes when ``in_flight`` drops to 0."""
    fast: object = field(default=None, init=False, repr=False, compare=False)
    """Its C copy for the compiled I/O path (:func:`target.io_fast.fast_namespace`), None when
    that path does not serve it; ``fast.accessible = False`` withdraws it."""
    reserved: bool = field(default=False, init=False, repr=False, compare=False)
    """Some host is registered (:mod:`target.reservations`): every I/O command is checked
    against the reservation, on the Python queue (the compiled plane leaves it there)."""

    def __post_init__(self) -> None:
        if self.block_size not in (512, 4096):
            raise ValueError(f"namespace {self.nsid}: block size must be 512 or 4096, not {self.block_size}")
        if not 1 <= self.nsid < 0xFFFFFFFF:
            raise ValueError(f"namespace id {self.nsid} is out of range")
        derived = uuid.uuid5(_ID_NAMESPACE, f"{self.subsystem_nqn}/{self.nsid}")
        nguid, uuid_bytes, eui64 = self.ids
        self.uuid = uuid.UUID(bytes=uuid_bytes) if uuid_bytes is not None else derived
        self.nguid = nguid if nguid is not None else derived.bytes
        self.eui64 = eui64 if eui64 is not None else derived.bytes[:8]
        self.lba_shift = self.block_size.bit_length() - 1
        self.fast = fast_namespace(self)
        sidecar = self.path + SIDECAR_SUFFIX if self.path and os.path.isfile(self.path) else ""
        self.reservations = Reservations(self, sidecar)
        self.reservations.load()

    @property
    def read_only(self) -> bool:
        """The backend's own answer: write protection is kept in one place."""
        return self.backend.read_only

    @property
    def blocks(self) -> int:
        return self.backend.size >> self.lba_shift


@dataclass
class Subsystem:
    """An NVM subsystem (or the discovery subsystem) with its access list."""

    nqn: str
    serial: str = "blockd0000000001"
    model: str = "blockd"
    allow_any_host: bool = True
    hosts: set[str] = field(default_factory=set)
    namespaces: dict[int, Namespace] = field(default_factory=dict)
    reopening: set[int] = field(default_factory=set)
    """Namespace ids a reload closed to open again (a change other than size or ANA group):
    hosts keep seeing them (Active Namespace ID list, no change event) and their commands get
    Internal Path Error, which hosts send again, until the new copy is added."""
    port_ids: set[int] | None = None
    """Ports this subsystem is reachable through; None = every port."""
    auth: dict[str, HostAuthConfig] = field(default_factory=dict)
    """Hosts that must authenticate (DH-HMAC-CHAP) on every queue, by host NQN."""
    cntlid_range: tuple[int, int] = (1, MAX_CNTLID)
    """Controller ids given to this subsystem's hosts (nvmet's ``attr_cntlid_min/max``): two
    targets presenting one subsystem need disjoint ranges, or the Linux host refuses the
    second controller as a duplicate."""

    @property
    def is_discovery(self) -> bool:
        return self.nqn == DISCOVERY_NQN

    def allows(self, hostnqn: str) -> bool:
        return self.is_discovery or self.allow_any_host or hostnqn in self.hosts

    def exported_on(self, port_id: int) -> bool:
        return self.port_ids is None or port_id in self.port_ids

    def add_namespace(self, ns: Namespace) -> None:
        if ns.nsid in self.namespaces:
            raise ValueError(f"{self.nqn}: namespace {ns.nsid} already exists")
        self.namespaces[ns.nsid] = ns
