"""Discovery: read a target's discovery log (``nvme discover``).

A discovery controller is an association with the well-known discovery NQN and no I/O queues
(:meth:`initiator.controller.Controller.connect` sees the NQN); its one use is the Discovery log
page, read here in two steps: the header for the record count, then header and records.
"""

from __future__ import annotations

from dataclasses import dataclass

from initiator.controller import Controller
from initiator.errors import ConnectError
from initiator.params import ConnectParams
from protocol.constants import DISCOVERY_NQN, LogPageId, TransportType
from protocol.logpage import DISCOVERY_ENTRY, DISCOVERY_ENTRY_SIZE, DISCOVERY_HEADER, DISCOVERY_HEADER_SIZE

MAX_DISCOVERY_RECORDS = ((1 << 20) - DISCOVERY_HEADER_SIZE) // DISCOVERY_ENTRY_SIZE
"""Most discovery log entries read: header and entries in one 1 MiB read. NUMREC is 64 bits
wide and the log is read into one buffer of its size, so a discovery controller (which
answers any host) could otherwise have us allocate whatever it claims."""


@dataclass(frozen=True)
class DiscoveryEntry:
    trtype: int
    adrfam: int
    subtype: int
    portid: int
    trsvcid: str
    subnqn: str
    traddr: str
    treq: int = 0
    eflags: int = 0
    tsas: bytes = bytes(256)
    """Transport specific address subtype (TCP: byte 0 is SECTYPE; RDMA: protocol.logpage.TSAS_RDMA)."""

    @property
    def transport(self) -> str:
        try:
            return TransportType(self.trtype).name.lower()
        except ValueError:
            return str(self.trtype)


@dataclass(frozen=True)
class DiscoveryLog:
    """A discovery log page: its generation counter and its records."""

    genctr: int
    entries: list[DiscoveryEntry]


async def discovery_log(ctrl: Controller) -> DiscoveryLog:
    """The discovery log of the discovery controller ``ctrl`` is connected to."""
    header = DISCOVERY_HEADER.parse(await ctrl.get_log_page(LogPageId.DISCOVERY, DISCOVERY_HEADER_SIZE, rae=True))
    if header.numrec > MAX_DISCOVERY_RECORDS:
        raise ConnectError(f"discovery log at {ctrl.params.traddr}:{ctrl.params.trsvcid} claims "
                           f"{header.numrec} entries; at most {MAX_DISCOVERY_RECORDS} are read")
    total = DISCOVERY_HEADER_SIZE + header.numrec * DISCOVERY_ENTRY_SIZE
    page = await ctrl.get_log_page(LogPageId.DISCOVERY, total)
    entries = []
    for i in range(header.numrec):
        e = DISCOVERY_ENTRY.parse(page[DISCOVERY_HEADER_SIZE + i * DISCOVERY_ENTRY_SIZE:][:DISCOVERY_ENTRY_SIZE])
        entries.append(DiscoveryEntry(e.trtype, e.adrfam, e.subtype, e.portid,
                                      e.trsvcid.strip(), e.subnqn, e.traddr.strip(), e.treq, e.eflags, e.tsas))
    return DiscoveryLog(DISCOVERY_HEADER.parse(page).genctr, entries)


async def discover(traddr: str, trsvcid: int, transport: str = "tcp", hostnqn: str | None = None,
                   timeout: float = 5.0, dhchap_secret: str | None = None,
                   dhchap_ctrl_secret: str | None = None) -> DiscoveryLog:
    """Read the discovery log of a target (non-persistent discovery controller, KATO 0); the
    secrets serve a discovery controller that asks for authentication."""
    params = ConnectParams(traddr=traddr, subnqn=DISCOVERY_NQN, trsvcid=trsvcid,
                           transport=transport, keep_alive_tmo=0, connect_timeout=timeout,
                           dhchap_secret=dhchap_secret, dhchap_ctrl_secret=dhchap_ctrl_secret,
                           command_timeout=timeout, ctrl_loss_tmo=0, **({"hostnqn": hostnqn} if hostnqn else {}))
    ctrl = await Controller.connect(params)
    try:
        return await discovery_log(ctrl)
    finally:
        await ctrl.close()
