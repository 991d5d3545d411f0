"""Builders for every command the host sends: each returns a 64-byte SQE as a ``bytearray``
with CID 0 and a zero SGL1 (the host queue writes the CID and the transport the SGL when the
command goes out, at :data:`SQE_CID_OFFSET` and :data:`SQE_SGL_OFFSET`).

Every builder packs through a ``struct`` layout derived from the construct definitions in
:mod:`protocol.nvme` and :mod:`protocol.fabrics` (see :mod:`protocol.layout`), with the values
given by field name; the two per-I/O builders (:func:`read_command`, :func:`write_command`)
call the Read/Write layout's ``pack`` directly, one ``struct.pack`` per I/O, with the field
order checked against the layout when this module is imported. Counts named ``*0`` are 0's
based, as on the wire.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Callable

import construct as c

from protocol.auth import AUTH_COMMAND, SECP_DHCHAP, SPSP_DHCHAP
from protocol.constants import PSDT_SGL, AdminOpcode, FabricsType, IoOpcode
from protocol.digest import DIGEST_COMMAND
from protocol.fabrics import CONNECT_COMMAND, CONNECT_DATA, FABRICS_COMMAND, PROPERTY_COMMAND
from protocol.layout import FixedLayout, at_offsets, field_offset, fixed_layout
from protocol.reservation import CPTPL_SHIFT, EDS, IEKEY, REPORT_COMMAND, RESERVATION_COMMAND
from protocol.nvme import (
    CQE, GET_LOG_PAGE_COMMAND, IDENTIFY_COMMAND, NVM_COMMAND_HEAD, RW_CONTROL_DEAC,
    RW_CONTROL_FUA, RW_FAST, SGL_SIZE, SQE, SQE_FAST, SQE_SIZE,
)


SQE_CID_OFFSET = field_offset(SQE, "cid")
SQE_SGL_OFFSET = field_offset(SQE, "dptr")
"""Where SGL1 sits in an SQE: the transport writes its descriptor there when it sends."""
SQE_SGL_END = SQE_SGL_OFFSET + SGL_SIZE
CQE_CID_OFFSET = field_offset(CQE, "cid")

DSM_COMMAND = at_offsets(SQE_SIZE, NVM_COMMAND_HEAD + [
    (40, "nr", c.Int8ul),
    (44, "attributes", c.Int32ul),
])
"""Dataset Management: NR (CDW10 bits 7:0) is the 0's based number of ranges in the data;
CDW11 holds the attributes, AD = :data:`~protocol.nvme.DSM_ATTR_DEALLOCATE` among them."""

SET_FEATURES_COMMAND = at_offsets(SQE_SIZE, NVM_COMMAND_HEAD + [
    (40, "fid", c.Int8ul),
    (43, "sv", c.Int8ul),
    (44, "cdw11", c.Int32ul),
])
"""Set Features: FID (CDW10 bits 7:0), SV (CDW10 bit 31); CDW11 is feature specific."""

GET_LOG_PAGE_RAE = 0x80
"""Retain Asynchronous Event: CDW10 bit 15, i.e. bit 7 of the ``lsp_rae`` byte."""
PROPERTY_SIZE_8 = 1
"""Property Get ATTRIB for an 8-byte property (CAP); 0 is a 4-byte one."""

_ZERO_SGL = bytes(SGL_SIZE)
_FIELD_DEFAULTS = {"flags": PSDT_SGL, "dptr": _ZERO_SGL}


def _packer(layout: FixedLayout) -> Callable[..., bytearray]:
    """A builder for ``layout`` taking its fields by name (others zero, FLAGS = PSDT SGL)."""
    names = layout.names
    pack = layout.pack

    def build(**values: int | bytes) -> bytearray:
        unknown = values.keys() - set(names)
        if unknown:
            raise TypeError(f"no field {sorted(unknown)} in this command")
        return bytearray(pack(*(values.get(n, _FIELD_DEFAULTS.get(n, 0)) for n in names)))
    return build


_generic = _packer(SQE_FAST)
_rw = _packer(RW_FAST)
_dsm = _packer(fixed_layout(DSM_COMMAND))
_set_features = _packer(fixed_layout(SET_FEATURES_COMMAND))
_identify = _packer(fixed_layout(IDENTIFY_COMMAND))
_get_log_page = _packer(fixed_layout(GET_LOG_PAGE_COMMAND))
_connect = _packer(fixed_layout(CONNECT_COMMAND))
_property = _packer(fixed_layout(PROPERTY_COMMAND))
_auth = _packer(fixed_layout(AUTH_COMMAND))
_reservation = _packer(fixed_layout(RESERVATION_COMMAND))
_report = _packer(fixed_layout(REPORT_COMMAND))
_digest = _packer(fixed_layout(DIGEST_COMMAND))

# -- NVM I/O commands ---------------------------------------------------------------------------

if RW_FAST.names != ("opcode", "flags", "cid", "nsid", "dptr", "slba", "nlb", "control", "dsmgmt"):
    raise AssertionError(f"read_command/write_command pack RW_FAST positionally: {RW_FAST.names}")
_pack_rw = RW_FAST.pack
_READ = int(IoOpcode.READ)
_WRITE = int(IoOpcode.WRITE)
_PSDT_SGL = int(PSDT_SGL)


def read_command(nsid: int, slba: int, nlb0: int) -> bytearray:
    """Read ``nlb0 + 1`` blocks from ``slba`` (per I/O: one pack, see the module docstring)."""
    return bytearray(_pack_rw(_READ, _PSDT_SGL, 0, nsid, _ZERO_SGL, slba, nlb0, 0, 0))


def write_command(nsid: int, slba: int, nlb0: int, fua: bool = False) -> bytearray:
    """Write ``nlb0 + 1`` blocks at ``slba``; ``fua``: on stable media before completing."""
    return bytearray(_pack_rw(_WRITE, _PSDT_SGL, 0, nsid, _ZERO_SGL, slba, nlb0,
                              RW_CONTROL_FUA if fua else 0, 0))


if SQE_FAST.names != ("opcode", "flags", "cid", "nsid", "cdw2", "cdw3", "mptr", "dptr",
                      "cdw10", "cdw11", "cdw12", "cdw13", "cdw14", "cdw15"):
    raise AssertionError(f"flush_command packs SQE_FAST positionally: {SQE_FAST.names}")
_pack_sqe = SQE_FAST.pack
_FLUSH = int(IoOpcode.FLUSH)


def flush_command(nsid: int) -> bytearray:
    """Flush namespace ``nsid`` (NSID_ALL: every one). Per I/O (a FUSE fsync sends one), so
    one pack, as the Read/Write builders: the by-name builder was a third of the host's Python
    time per fsync (cProfile)."""
    return bytearray(_pack_sqe(_FLUSH, _PSDT_SGL, 0, nsid, 0, 0, 0, _ZERO_SGL, 0, 0, 0, 0, 0, 0))


def write_zeroes_command(nsid: int, slba: int, nlb0: int, deallocate: bool = False) -> bytearray:
    """Zero ``nlb0 + 1`` blocks; ``deallocate`` sets DEAC (the target may unmap them)."""
    return _rw(opcode=IoOpcode.WRITE_ZEROES, nsid=nsid, slba=slba, nlb=nlb0,
               control=RW_CONTROL_DEAC if deallocate else 0)


def dsm_command(nsid: int, nr0: int, attributes: int) -> bytearray:
    """Dataset Management over ``nr0 + 1`` ranges sent as data (see ``DSM_RANGE``)."""
    return _dsm(opcode=IoOpcode.DATASET_MANAGEMENT, nsid=nsid, nr=nr0, attributes=attributes)


def reservation_register_command(nsid: int, action: int, iekey: bool = False, cptpl: int = 0) -> bytearray:
    """Reservation Register (RREGA ``action``, CPTPL ``cptpl``); the data is the two keys
    (:data:`protocol.reservation.REGISTER_DATA`)."""
    return _reservation(opcode=IoOpcode.RESERVATION_REGISTER, nsid=nsid, action=action | (IEKEY if iekey else 0),
                        cptpl=cptpl << CPTPL_SHIFT)


def reservation_acquire_command(nsid: int, action: int, rtype: int, iekey: bool = False) -> bytearray:
    """Reservation Acquire (RACQA ``action``, type ``rtype``); data: CRKEY, PRKEY."""
    return _reservation(opcode=IoOpcode.RESERVATION_ACQUIRE, nsid=nsid, action=action | (IEKEY if iekey else 0),
                        rtype=rtype)


def reservation_release_command(nsid: int, action: int, rtype: int, iekey: bool = False) -> bytearray:
    """Reservation Release (RRELA ``action``, type ``rtype``); data: CRKEY."""
    return _reservation(opcode=IoOpcode.RESERVATION_RELEASE, nsid=nsid, action=action | (IEKEY if iekey else 0),
                        rtype=rtype)


def reservation_report_command(nsid: int, numd0: int, extended: bool = True) -> bytearray:
    """Reservation Report of ``numd0 + 1`` dwords; ``extended``: the 128-bit host id structure."""
    return _report(opcode=IoOpcode.RESERVATION_REPORT, nsid=nsid, numd=numd0, cdw11=EDS if extended else 0)


def digest_command(nsid: int, slba: int, nlb0: int, chunk: int, algorithm: int) -> bytearray:
    """blockd's Digest of ``nlb0 + 1`` blocks from ``slba``, one digest per ``chunk`` blocks
    (:mod:`protocol.digest`); the data is the digests."""
    return _digest(opcode=IoOpcode.BLOCKD_DIGEST, nsid=nsid, slba=slba, nlb=nlb0, chunk=chunk, algorithm=algorithm)


# -- admin commands -------------------------------------------------------------------------------


def identify_command(cns: int, nsid: int = 0, cntid: int = 0) -> bytearray:
    return _identify(opcode=AdminOpcode.IDENTIFY, nsid=nsid, cns=cns, cntid=cntid)


def get_log_page_command(lid: int, numd0: int, offset: int = 0, nsid: int = 0,
                         rae: bool = False, lsp: int = 0) -> bytearray:
    """Get Log Page of ``numd0 + 1`` dwords from byte ``offset``; ``rae`` keeps the event;
    ``lsp`` the log specific field (bits 3:0 of that byte)."""
    return _get_log_page(opcode=AdminOpcode.GET_LOG_PAGE, nsid=nsid, lid=lid,
                         lsp_rae=(GET_LOG_PAGE_RAE if rae else 0) | lsp,
                         numdl=numd0 & 0xFFFF, numdu=numd0 >> 16, lpo=offset)


def set_features_command(fid: int, cdw11: int, nsid: int = 0) -> bytearray:
    return _set_features(opcode=AdminOpcode.SET_FEATURES, fid=fid, cdw11=cdw11, nsid=nsid)


def keep_alive_command() -> bytearray:
    return _generic(opcode=AdminOpcode.KEEP_ALIVE)


def async_event_request_command() -> bytearray:
    return _generic(opcode=AdminOpcode.ASYNC_EVENT_REQUEST)


# -- fabrics commands -------------------------------------------------------------------------------


def connect_command(qid: int, sqsize0: int, kato_ms: int = 0, cattr: int = 0) -> bytearray:
    """Connect for queue ``qid`` of ``sqsize0 + 1`` entries (the data is :func:`connect_data`)."""
    return _connect(opcode=AdminOpcode.FABRICS, fctype=FabricsType.CONNECT, qid=qid,
                    sqsize=sqsize0, cattr=cattr, kato=kato_ms)


def connect_data(hostid: bytes, cntlid: int, subnqn: str, hostnqn: str) -> bytes:
    return CONNECT_DATA.build(dict(hostid=hostid, cntlid=cntlid, subnqn=subnqn, hostnqn=hostnqn))


def property_get_command(offset: int, size: int) -> bytearray:
    """Property Get of the ``size``-byte (4 or 8) property at ``offset``."""
    return _property(opcode=AdminOpcode.FABRICS, fctype=FabricsType.PROPERTY_GET, offset=offset,
                     attrib=PROPERTY_SIZE_8 if size == 8 else 0)


def property_set_command(offset: int, value: int) -> bytearray:
    return _property(opcode=AdminOpcode.FABRICS, fctype=FabricsType.PROPERTY_SET, offset=offset,
                     value=value)


def auth_send_command(length: int) -> bytearray:
    """Authentication Send of a ``length``-byte DH-HMAC-CHAP message (the command's data)."""
    return _auth(opcode=AdminOpcode.FABRICS, fctype=FabricsType.AUTH_SEND, spsp0=SPSP_DHCHAP,
                 spsp1=SPSP_DHCHAP, secp=SECP_DHCHAP, length=length)


def auth_receive_command(length: int) -> bytearray:
    """Authentication Receive of at most ``length`` bytes."""
    return _auth(opcode=AdminOpcode.FABRICS, fctype=FabricsType.AUTH_RECEIVE, spsp0=SPSP_DHCHAP,
                 spsp1=SPSP_DHCHAP, secp=SECP_DHCHAP, length=length)


# -- naming a command (error messages) ----------------------------------------------------------

_unpack_head = SQE_FAST.unpack_from
_unpack_fabrics = fixed_layout(FABRICS_COMMAND).unpack_from


def is_io_command(sqe: bytes | bytearray | memoryview, admin: bool) -> bool:
    """An NVM I/O command: sent on an I/O queue and not a Fabrics command (an I/O queue's
    Connect is one); its command-specific statuses have their own names (protocol.status)."""
    return not admin and _unpack_head(sqe)[0] != AdminOpcode.FABRICS


def describe_command(sqe: bytes | bytearray | memoryview, admin: bool) -> str:
    """``"read on namespace 1"``, ``"IDENTIFY"``, ``"fabrics CONNECT"``: what a failed command
    was, for the message of the error it raises (``admin``: sent on the admin queue, where
    opcodes mean something else than on an I/O queue)."""
    opcode, _, _, nsid = _unpack_head(sqe)[:4]
    if opcode == AdminOpcode.FABRICS:
        fctype = _unpack_fabrics(sqe)[3]
        return f"fabrics {_name(FabricsType, fctype)}"
    if admin:
        return _name(AdminOpcode, opcode)
    return f"{_name(IoOpcode, opcode).lower()} on namespace {nsid}"


def _name(enum: type[IntEnum], value: int) -> str:
    try:
        return enum(value).name
    except ValueError:
        return f"{value:#04x}"
