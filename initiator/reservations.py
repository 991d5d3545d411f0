"""The host's reservation commands (NVMe Base 2.0, 7.2-7.5) on a connected controller: the
library API behind ``blockctl resv-*``, as nvme-cli's ``resv-register|report|acquire|release``.

Each call raises :class:`initiator.errors.NvmeError` with the target's status: Reservation
Conflict (``Status.RESERVATION_CONFLICT``) when the keys or the reservation refuse it, which the
FUSE mount answers as EBADE, as the Linux block layer does.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from initiator.controller import _settle  # the one "done of an awaited command"
from protocol.commands import (
    reservation_acquire_command, reservation_register_command, reservation_release_command,
    reservation_report_command,
)
from protocol.reservation import (
    ACQUIRE_DATA, EXT_REGISTRANT, EXT_REGISTRANT_SIZE, EXT_STATUS_HEADER, EXT_STATUS_HEADER_SIZE, RCSTS_HOLDS,
    REGISTER_DATA, RELEASE_DATA,
)

if TYPE_CHECKING:
    from initiator.controller import Controller as Single
    from initiator.multipath import MultipathController

    Controller = Union[Single, MultipathController]

REPORT_FIRST = 4096
"""The first Report's buffer: room for 63 registrants; a second one is sized from REGCTL."""


@dataclass(frozen=True)
class Registrant:
    hostid: bytes
    key: int
    holds: bool
    cntlid: int


@dataclass(frozen=True)
class ReservationStatus:
    """A Reservation Report: the generation, the type held (0: none), PTPL and the registrants."""

    generation: int
    rtype: int
    ptpl: bool
    registrants: list[Registrant]


async def _command(ctrl: Controller, sqe: bytearray, data_out: bytes | None = None,
                   data_in: memoryview | None = None) -> None:
    """One I/O command through ``submit_io``, which a single-path and a multipath connection
    both offer (the multipath one sends it on a path serving the namespace)."""
    fut = asyncio.get_running_loop().create_future()
    ctrl.submit_io(sqe, data_out, data_in, functools.partial(_settle, fut))
    await fut


async def register(ctrl: Controller, nsid: int, action: int, crkey: int, nrkey: int,
                   iekey: bool = False, cptpl: int = 0) -> None:
    """Reservation Register: ``action`` a :class:`protocol.reservation.RegisterAction`, ``cptpl``
    a :class:`protocol.reservation.Cptpl`."""
    await _command(ctrl, reservation_register_command(nsid, action, iekey, cptpl),
                          REGISTER_DATA.build(dict(crkey=crkey, nrkey=nrkey)))


async def acquire(ctrl: Controller, nsid: int, action: int, rtype: int, crkey: int, prkey: int = 0,
                  iekey: bool = False) -> None:
    """Reservation Acquire: ``action`` a :class:`protocol.reservation.AcquireAction`."""
    await _command(ctrl, reservation_acquire_command(nsid, action, rtype, iekey),
                          ACQUIRE_DATA.build(dict(crkey=crkey, prkey=prkey)))


async def release(ctrl: Controller, nsid: int, action: int, rtype: int, crkey: int, iekey: bool = False) -> None:
    """Reservation Release: ``action`` a :class:`protocol.reservation.ReleaseAction`."""
    await _command(ctrl, reservation_release_command(nsid, action, rtype, iekey),
                          RELEASE_DATA.build(dict(crkey=crkey)))


async def report(ctrl: Controller, nsid: int) -> ReservationStatus:
    """Reservation Report (extended structure, 128-bit host ids): read once, and again with a
    buffer sized from REGCTL when the first was too small for every registrant."""
    length = REPORT_FIRST
    while True:
        buf = bytearray(length)
        await _command(ctrl, reservation_report_command(nsid, length // 4 - 1), data_in=memoryview(buf))
        head = EXT_STATUS_HEADER.parse(buf)
        need = EXT_STATUS_HEADER_SIZE + head.regctl * EXT_REGISTRANT_SIZE
        if need <= length:
            break
        length = need
    regs = []
    for i in range(head.regctl):
        r = EXT_REGISTRANT.parse(buf[EXT_STATUS_HEADER_SIZE + i * EXT_REGISTRANT_SIZE:])
        regs.append(Registrant(r.hostid, r.rkey, bool(r.rcsts & RCSTS_HOLDS), r.cntlid))
    return ReservationStatus(head.gen, head.rtype, bool(head.ptpls), regs)
