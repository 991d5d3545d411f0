"""NVMe completion status codes.

Each value is the Linux kernel's encoding: SC in bits 7:0, SCT in bits 10:8, DNR = 0x4000.
The 16-bit status word on the wire (CQE bytes 14-15) is that value shifted left by one, the
phase bit (always 0 over fabrics) taking bit 0.
"""

from __future__ import annotations

from enum import IntEnum

DNR = 0x4000
MORE = 0x2000
"""More: the controller's Error Information log has an entry for this command (nvmet sets it only
then, see target.controller.ERROR_LOCATIONS); not part of the status itself."""


class Status(IntEnum):
    SUCCESS = 0x000
    INVALID_OPCODE = 0x001 | DNR
    INVALID_FIELD = 0x002 | DNR
    DATA_TRANSFER_ERROR = 0x004
    INTERNAL_ERROR = 0x006 | DNR
    INVALID_NS = 0x00B | DNR
    HOST_ID_INCONSISTENT_FORMAT = 0x018 | DNR
    """Reservation Report without the extended structure, Get Features 81h without EXHID: the
    host identifier is 128 bits and cannot be given in 64."""
    COMMAND_SEQUENCE_ERROR = 0x00C | DNR
    SGL_INVALID_DATA_LENGTH = 0x00F | DNR
    SGL_INVALID_TYPE = 0x011 | DNR
    SGL_INVALID_OFFSET = 0x016 | DNR
    NS_WRITE_PROTECTED = 0x020
    KEEP_ALIVE_EXPIRED = 0x019
    KEEP_ALIVE_INVALID = 0x01A  # without DNR, as nvmet_execute_keep_alive answers it (measured in the VM bed)
    LBA_RANGE = 0x080 | DNR
    CAPACITY_EXCEEDED = 0x081 | DNR
    NS_NOT_READY = 0x082
    RESERVATION_CONFLICT = 0x083 | DNR
    """The namespace's reservation refuses this host the command (DNR, as nvmet's pr.c: the
    answer will not change by retrying; the Linux host makes it BLK_STS_RESV_CONFLICT, EBADE)."""
    INVALID_QID = 0x101 | DNR
    INVALID_QUEUE_SIZE = 0x102 | DNR
    ASYNC_LIMIT = 0x105 | DNR
    INVALID_LOG_PAGE = 0x109 | DNR
    FEATURE_NOT_SAVEABLE = 0x10D | DNR
    CONNECT_INCOMPATIBLE_FORMAT = 0x180 | DNR
    CONNECT_CONTROLLER_BUSY = 0x181 | DNR
    CONNECT_INVALID_PARAMETERS = 0x182 | DNR
    CONNECT_RESTART_DISCOVERY = 0x183
    CONNECT_INVALID_HOST = 0x184 | DNR
    AUTH_REQUIRED = 0x191 | DNR
    """A command other than Authentication Send/Receive on a queue not yet authenticated."""
    WRITE_FAULT = 0x280
    INTERNAL_PATH_ERROR = 0x300
    """Path-related (SCT 3, SC 0), without DNR: the namespace exists but cannot serve through this
    controller for now. nvmet answers it for a namespace that is configured but disabled
    (``nvmet_req_find_ns``, "nvmet: fix nvme status code when namespace is disabled", 2024);
    blockd for a namespace opened again by a reload. The Linux host fails such a command over to
    another path, or sends it again on this one."""
    UNRECOVERED_READ_ERROR = 0x281
    ANA_PERSISTENT_LOSS = 0x301
    ANA_INACCESSIBLE = 0x302
    ANA_TRANSITION = 0x303
    """Path-related (SCT 3) and without DNR: the host retries the command on another path."""


ANA_STATUSES = frozenset({Status.ANA_PERSISTENT_LOSS, Status.ANA_INACCESSIBLE, Status.ANA_TRANSITION})

NVM_COMMAND_SPECIFIC = {0x180: "CONFLICTING_ATTRIBUTES", 0x181: "INVALID_PROTECTION_INFORMATION",
                        0x182: "WRITE_TO_READ_ONLY_RANGE", 0x183: "ONCS_NOT_SUPPORTED"}
"""SCT 1 codes 80h-83h answered to an NVM I/O command (Read, Write, Dataset Management, Write
Zeroes...). The same values answered to a Fabrics Connect are Connect's own (``Status.CONNECT_*``),
so a status alone cannot be named: :func:`describe` takes the command's kind. Names as the Linux
host's ``nvme.h``: 0x183 is what nvmet answers a Write Zeroes or Deallocate its backend cannot do."""


def to_wire(status: int) -> int:
    """The CQE status word for ``status`` (phase bit 0)."""
    return (status << 1) & 0xFFFF


def from_wire(word: int) -> int:
    """Inverse of :func:`to_wire`; drops the phase bit."""
    return word >> 1


def describe(status: int, io: bool = False) -> str:
    """Human text for a status, e.g. ``"LBA_RANGE (sct 0 sc 0x80, dnr, more)"``; ``io``: the status
    answers an NVM I/O command (not an admin or Fabrics one), see :data:`NVM_COMMAND_SPECIFIC`."""
    more = ", more" if status & MORE else ""
    status &= ~MORE
    if io and status & ~DNR in NVM_COMMAND_SPECIFIC:
        name = NVM_COMMAND_SPECIFIC[status & ~DNR]
    else:
        try:
            name = Status(status).name
        except ValueError:
            try:
                name = Status(status ^ DNR).name
            except ValueError:
                name = "UNKNOWN"
    sct = (status >> 8) & 0x7
    sc = status & 0xFF
    dnr = ", dnr" if status & DNR else ""
    return f"{name} (sct {sct} sc {sc:#04x}{dnr}{more})"
