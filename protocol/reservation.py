"""Reservations (NVMe Base 2.0, section 8.19 and the Reservation commands, 7.2-7.5): the four
commands' dwords and data, the Reservation Status data structures, the Reservation Notification
log page (80h) and the numbers they carry.

Every command here is an I/O command (opcodes 0Dh, 0Eh, 11h, 15h); CDW10 holds the action
(bits 2:0), IEKEY (bit 3) and, for Acquire and Release, the reservation type (bits 15:8).
"""

from __future__ import annotations

from enum import IntEnum

import construct as c

from protocol.layout import at_offsets
from protocol.nvme import NVM_COMMAND_HEAD, SQE_SIZE


class ReservationType(IntEnum):
    """RTYPE (Reservation Acquire/Release CDW10 bits 15:8, Report byte 4); 0: none held."""

    WRITE_EXCLUSIVE = 1
    EXCLUSIVE_ACCESS = 2
    WRITE_EXCLUSIVE_REG_ONLY = 3
    EXCLUSIVE_ACCESS_REG_ONLY = 4
    WRITE_EXCLUSIVE_ALL_REGS = 5
    EXCLUSIVE_ACCESS_ALL_REGS = 6


class RegisterAction(IntEnum):
    """RREGA, Reservation Register CDW10 bits 2:0."""

    REGISTER = 0
    UNREGISTER = 1
    REPLACE = 2


class AcquireAction(IntEnum):
    """RACQA, Reservation Acquire CDW10 bits 2:0."""

    ACQUIRE = 0
    PREEMPT = 1
    PREEMPT_AND_ABORT = 2


class ReleaseAction(IntEnum):
    """RRELA, Reservation Release CDW10 bits 2:0."""

    RELEASE = 0
    CLEAR = 1


class Cptpl(IntEnum):
    """CPTPL, Reservation Register CDW10 bits 31:30: what the command does to PTPL."""

    NO_CHANGE = 0
    RESERVED = 1
    CLEAR = 2
    SET = 3


class NotificationType(IntEnum):
    """Reservation Notification log page type (byte 8); 0 is an empty page."""

    EMPTY = 0
    REGISTRATION_PREEMPTED = 1
    RESERVATION_RELEASED = 2
    RESERVATION_PREEMPTED = 3


RESERVATION_COMMAND = at_offsets(SQE_SIZE, NVM_COMMAND_HEAD + [
    (40, "action", c.Int8ul),
    (41, "rtype", c.Int8ul),
    (43, "cptpl", c.Int8ul),
])
"""Register, Acquire, Release: byte 40 holds the action (bits 2:0) and IEKEY (bit 3), byte 41
the type (Acquire, Release), byte 43 bits 7:6 CPTPL (Register)."""
REPORT_COMMAND = at_offsets(SQE_SIZE, NVM_COMMAND_HEAD + [
    (40, "numd", c.Int32ul),
    (44, "cdw11", c.Int32ul),
])
"""Reservation Report: NUMD (0's based dwords of data) and CDW11 (bit 0: EDS)."""
ACTION_MASK = 0x07
IEKEY = 0x08
CPTPL_SHIFT = 6
EDS = 0x01
"""Reservation Report CDW11 bit 0: the extended data structure (128-bit host identifiers)."""

REGISTER_DATA = c.Struct("crkey" / c.Int64ul, "nrkey" / c.Int64ul)
"""Reservation Register data: the current key and the new one (16 bytes)."""
ACQUIRE_DATA = c.Struct("crkey" / c.Int64ul, "prkey" / c.Int64ul)
"""Reservation Acquire data: the current key and the key to preempt (16 bytes)."""
RELEASE_DATA = c.Struct("crkey" / c.Int64ul)
"""Reservation Release data: the current key (8 bytes)."""

STATUS_HEADER_SIZE = 24
EXT_STATUS_HEADER_SIZE = 64
REGISTRANT_SIZE = 24
EXT_REGISTRANT_SIZE = 64

STATUS_HEADER = at_offsets(STATUS_HEADER_SIZE, [
    (0, "gen", c.Int32ul),
    (4, "rtype", c.Int8ul),
    (5, "regctl", c.Int16ul),
    (9, "ptpls", c.Int8ul),
])
"""Reservation Status header: generation, type held (0: none), how many registrants follow,
PTPL state."""
EXT_STATUS_HEADER = at_offsets(EXT_STATUS_HEADER_SIZE, [
    (0, "gen", c.Int32ul),
    (4, "rtype", c.Int8ul),
    (5, "regctl", c.Int16ul),
    (9, "ptpls", c.Int8ul),
])
"""The extended structure's header: the same fields, padded to 64 bytes."""
REGISTRANT = at_offsets(REGISTRANT_SIZE, [
    (0, "cntlid", c.Int16ul),
    (2, "rcsts", c.Int8ul),
    (8, "hostid", c.Bytes(8)),
    (16, "rkey", c.Int64ul),
])
"""Registered Controller data structure (64-bit host identifier)."""
EXT_REGISTRANT = at_offsets(EXT_REGISTRANT_SIZE, [
    (0, "cntlid", c.Int16ul),
    (2, "rcsts", c.Int8ul),
    (8, "rkey", c.Int64ul),
    (16, "hostid", c.Bytes(16)),
])
"""Registered Controller extended data structure (128-bit host identifier): the key moves to
byte 8, the host identifier to 16."""
RCSTS_HOLDS = 0x01
"""RCSTS bit 0: this registrant holds the reservation."""
CNTLID_DYNAMIC = 0xFFFF
"""CNTLID of a registrant in the dynamic controller model (a host, not one controller)."""

NOTIFICATION_LOG_SIZE = 64
NOTIFICATION_LOG = at_offsets(NOTIFICATION_LOG_SIZE, [
    (0, "count", c.Int64ul),
    (8, "type", c.Int8ul),
    (9, "available", c.Int8ul),
    (12, "nsid", c.Int32ul),
])
"""Reservation Notification log page (80h): a running count, the type (:class:`NotificationType`),
how many more are queued (capped at 255) and the namespace."""

NOTIFY_MASK_REGPRE = 1 << 1
NOTIFY_MASK_RESREL = 1 << 2
NOTIFY_MASK_RESPRE = 1 << 3
"""Set Features 82h (Reservation Notification Mask) CDW11 bits, one per notification type."""
NOTIFY_MASK_BY_TYPE = {NotificationType.REGISTRATION_PREEMPTED: NOTIFY_MASK_REGPRE,
                       NotificationType.RESERVATION_RELEASED: NOTIFY_MASK_RESREL,
                       NotificationType.RESERVATION_PREEMPTED: NOTIFY_MASK_RESPRE}
PTPL = 0x01
"""Get/Set Features 83h (Reservation Persistence) CDW11 bit 0."""
EXHID = 0x01
"""Get Features 81h (Host Identifier) CDW11 bit 0: the 128-bit identifier."""
RESCAP_ALL = 0xFF
"""Identify Namespace RESCAP: PTPL (bit 0), the six types (bits 1-6) and IEKEY as in 1.3 (bit 7)."""
