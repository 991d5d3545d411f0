"""In-band authentication (NVMe Base 2.0 section 8.13, TP 8006): the Authentication Send/Receive
fabrics commands and the DH-HMAC-CHAP messages they carry.

Offsets follow the Linux kernel's include/linux/nvme.h (``struct nvmf_auth_*``), which matches
the spec's figures. Every message starts with the same four
fields (AUTH_TYPE, AUTH_ID, two reserved bytes, T_ID); the variable parts (challenge, response
and DH values) follow a fixed head whose lengths (HL, DHVLEN) say how long they are.

``parse_*`` functions check lengths against the transfer length and raise
:class:`AuthMessageError` carrying the failure reason explanation the spec wants in the
Failure1/Failure2 answer; they never index past the received bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import construct as c

from protocol.fabrics import FABRICS_COMMAND_HEAD
from protocol.layout import at_offsets, field_offset
from protocol.nvme import SQE_SIZE

SECP_DHCHAP = 0xE9
"""Security Protocol of Authentication Send/Receive: NVMe in-band authentication."""
SPSP_DHCHAP = 0x01
"""SPSP0 and SPSP1 of Authentication Send/Receive (both 01h)."""

AUTH_COMMAND = at_offsets(SQE_SIZE, FABRICS_COMMAND_HEAD + [
    (41, "spsp0", c.Int8ul),
    (42, "spsp1", c.Int8ul),
    (43, "secp", c.Int8ul),
    (44, "length", c.Int32ul),
])
"""Authentication Send (TL: bytes the host sends) and Receive (AL: bytes the host can take)."""
IPO_AUTH_SPSP0 = field_offset(AUTH_COMMAND, "spsp0")
IPO_AUTH_SPSP1 = field_offset(AUTH_COMMAND, "spsp1")
IPO_AUTH_SECP = field_offset(AUTH_COMMAND, "secp")
IPO_AUTH_LENGTH = field_offset(AUTH_COMMAND, "length")


class AuthType(IntEnum):
    COMMON = 0x00
    DHCHAP = 0x01


class AuthMessage(IntEnum):
    """AUTH_ID: which message of the transaction (Negotiate and Failure1 are common messages)."""
    NEGOTIATE = 0x00
    CHALLENGE = 0x01
    REPLY = 0x02
    SUCCESS1 = 0x03
    SUCCESS2 = 0x04
    FAILURE2 = 0xF0
    FAILURE1 = 0xF1


AUTHID_DHCHAP = 0x01
"""AUTHID of the DH-HMAC-CHAP protocol descriptor in AUTH_Negotiate."""
SC_C_NONE = 0x00
"""Secure channel concatenation not requested (the only value blockd speaks: no TLS)."""


class HashId(IntEnum):
    SHA256 = 0x01
    SHA384 = 0x02
    SHA512 = 0x03


class DhGroup(IntEnum):
    """RFC 7919 finite-field groups; NULL means no Diffie-Hellman exchange."""
    NULL = 0x00
    FFDHE2048 = 0x01
    FFDHE3072 = 0x02
    FFDHE4096 = 0x03
    FFDHE6144 = 0x04
    FFDHE8192 = 0x05


FAILURE_REASON_FAILED = 0x01
"""The only Reason Code defined: authentication failed; the explanation says why."""


class FailureExplanation(IntEnum):
    FAILED = 0x01
    NOT_USABLE = 0x02
    CONCAT_MISMATCH = 0x03
    HASH_UNUSABLE = 0x04
    DHGROUP_UNUSABLE = 0x05
    INCORRECT_PAYLOAD = 0x06
    INCORRECT_MESSAGE = 0x07


_HEAD = [
    (0, "auth_type", c.Int8ul),
    (1, "auth_id", c.Int8ul),
    (4, "t_id", c.Int16ul),
]

ID_LIST_SIZE = 60
DH_IDS_AT = 30
"""The descriptor's ID list: up to 30 hash IDs from byte 0, up to 30 DH group IDs from byte 30."""

PROTOCOL_DESCRIPTOR = at_offsets(64, [
    (0, "authid", c.Int8ul),
    (2, "halen", c.Int8ul),
    (3, "dhlen", c.Int8ul),
    (4, "idlist", c.Bytes(ID_LIST_SIZE)),
])
NEGOTIATE_HEAD = at_offsets(8, _HEAD + [
    (6, "sc_c", c.Int8ul),
    (7, "napd", c.Int8ul),
])
CHALLENGE_HEAD = at_offsets(16, _HEAD + [
    (6, "hl", c.Int8ul),
    (8, "hashid", c.Int8ul),
    (9, "dhgid", c.Int8ul),
    (10, "dhvlen", c.Int16ul),
    (12, "seqnum", c.Int32ul),
])
"""Followed by HL bytes of challenge C1, then DHVLEN bytes of the controller's DH value."""
REPLY_HEAD = at_offsets(16, _HEAD + [
    (6, "hl", c.Int8ul),
    (8, "cvalid", c.Int8ul),
    (10, "dhvlen", c.Int16ul),
    (12, "seqnum", c.Int32ul),
])
"""Followed by HL bytes of response R1, HL bytes of challenge C2 (zero unless CVALID), then
DHVLEN bytes of the host's DH value. SEQNUM is S2, 0 when not bidirectional."""
SUCCESS1_HEAD = at_offsets(16, _HEAD + [
    (6, "hl", c.Int8ul),
    (8, "rvalid", c.Int8ul),
])
"""Followed by HL bytes of the controller's response R2 (meaningful when RVALID)."""
SUCCESS2 = at_offsets(16, _HEAD)
FAILURE = at_offsets(8, _HEAD + [
    (6, "rescode", c.Int8ul),
    (7, "rescode_exp", c.Int8ul),
])
"""Failure1 (controller to host, a common message) and Failure2 (host to controller)."""

HEAD_SIZE = 8
"""Bytes every message has: enough to read AUTH_TYPE, AUTH_ID and T_ID."""
MESSAGE_HEAD = at_offsets(HEAD_SIZE, _HEAD)


class AuthMessageError(ValueError):
    """A message that cannot be taken; ``explanation`` is the failure reason to answer with."""

    def __init__(self, explanation: FailureExplanation, text: str) -> None:
        super().__init__(text)
        self.explanation = explanation


def _need(data: bytes, size: int, what: str) -> None:
    if len(data) < size:
        raise AuthMessageError(FailureExplanation.INCORRECT_PAYLOAD,
                               f"{what}: {len(data)} bytes, at least {size} needed")


@dataclass(frozen=True)
class Head:
    auth_type: int
    auth_id: int
    t_id: int


def parse_head(data: bytes) -> Head:
    _need(data, HEAD_SIZE, "authentication message")
    h = MESSAGE_HEAD.parse(data[:HEAD_SIZE])
    return Head(h.auth_type, h.auth_id, h.t_id)


# -- AUTH_Negotiate -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Negotiate:
    t_id: int
    sc_c: int
    hash_ids: tuple[int, ...]
    dh_groups: tuple[int, ...]


def build_negotiate(t_id: int, hash_ids: list[int], dh_groups: list[int]) -> bytes:
    """One DH-HMAC-CHAP protocol descriptor listing the host's hashes and groups, best first."""
    idlist = bytearray(ID_LIST_SIZE)
    idlist[:len(hash_ids)] = bytes(hash_ids)
    idlist[DH_IDS_AT:DH_IDS_AT + len(dh_groups)] = bytes(dh_groups)
    head = NEGOTIATE_HEAD.build(dict(auth_type=AuthType.COMMON, auth_id=AuthMessage.NEGOTIATE,
                                     t_id=t_id, sc_c=SC_C_NONE, napd=1))
    return head + PROTOCOL_DESCRIPTOR.build(dict(authid=AUTHID_DHCHAP, halen=len(hash_ids),
                                                 dhlen=len(dh_groups), idlist=bytes(idlist)))


def parse_negotiate(data: bytes) -> Negotiate:
    _need(data, NEGOTIATE_HEAD.sizeof() + PROTOCOL_DESCRIPTOR.sizeof(), "AUTH_Negotiate")
    head = NEGOTIATE_HEAD.parse(data[:8])
    if head.napd != 1:
        raise AuthMessageError(FailureExplanation.HASH_UNUSABLE,
                               f"AUTH_Negotiate: {head.napd} protocol descriptors, 1 expected")
    desc = PROTOCOL_DESCRIPTOR.parse(data[8:72])
    if desc.authid != AUTHID_DHCHAP:
        raise AuthMessageError(FailureExplanation.INCORRECT_PAYLOAD,
                               f"AUTH_Negotiate: AUTHID {desc.authid:#x} is not DH-HMAC-CHAP")
    if desc.halen > DH_IDS_AT or desc.dhlen > ID_LIST_SIZE - DH_IDS_AT:
        raise AuthMessageError(FailureExplanation.INCORRECT_PAYLOAD,
                               f"AUTH_Negotiate: HALEN {desc.halen} / DHLEN {desc.dhlen} beyond 30")
    ids = desc.idlist
    return Negotiate(head.t_id, head.sc_c, tuple(ids[:desc.halen]),
                     tuple(ids[DH_IDS_AT:DH_IDS_AT + desc.dhlen]))


# -- DH-HMAC-CHAP_Challenge ---------------------------------------------------------------------


@dataclass(frozen=True)
class Challenge:
    t_id: int
    hash_id: int
    dh_group: int
    seqnum: int
    c1: bytes
    dh_value: bytes


def build_challenge(t_id: int, hash_id: int, dh_group: int, seqnum: int, c1: bytes,
                    dh_value: bytes) -> bytes:
    return CHALLENGE_HEAD.build(dict(
        auth_type=AuthType.DHCHAP, auth_id=AuthMessage.CHALLENGE, t_id=t_id, hl=len(c1),
        hashid=hash_id, dhgid=dh_group, dhvlen=len(dh_value), seqnum=seqnum)) + c1 + dh_value


def parse_challenge(data: bytes) -> Challenge:
    _need(data, 16, "DH-HMAC-CHAP_Challenge")
    h = CHALLENGE_HEAD.parse(data[:16])
    _need(data, 16 + h.hl + h.dhvlen, "DH-HMAC-CHAP_Challenge")
    end = 16 + h.hl
    return Challenge(h.t_id, h.hashid, h.dhgid, h.seqnum, bytes(data[16:end]),
                     bytes(data[end:end + h.dhvlen]))


# -- DH-HMAC-CHAP_Reply -------------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    t_id: int
    seqnum: int
    response: bytes
    c2: bytes | None
    dh_value: bytes


def build_reply(t_id: int, response: bytes, c2: bytes | None, seqnum: int,
                dh_value: bytes) -> bytes:
    """The C2 field is always HL bytes long: zeros when the host does not challenge back."""
    hl = len(response)
    return REPLY_HEAD.build(dict(
        auth_type=AuthType.DHCHAP, auth_id=AuthMessage.REPLY, t_id=t_id, hl=hl,
        cvalid=1 if c2 is not None else 0, dhvlen=len(dh_value), seqnum=seqnum,
    )) + response + (c2 if c2 is not None else bytes(hl)) + dh_value


def parse_reply(data: bytes) -> Reply:
    _need(data, 16, "DH-HMAC-CHAP_Reply")
    h = REPLY_HEAD.parse(data[:16])
    _need(data, 16 + 2 * h.hl + h.dhvlen, "DH-HMAC-CHAP_Reply")
    r_end = 16 + h.hl
    c_end = r_end + h.hl
    return Reply(h.t_id, h.seqnum, bytes(data[16:r_end]),
                 bytes(data[r_end:c_end]) if h.cvalid else None,
                 bytes(data[c_end:c_end + h.dhvlen]))


# -- Success1, Success2, Failure1/2 --------------------------------------------------------------


def build_success1(t_id: int, hl: int, response: bytes | None) -> bytes:
    """RVAL is always HL bytes (as the kernel's host expects); zeros when not bidirectional."""
    return SUCCESS1_HEAD.build(dict(
        auth_type=AuthType.DHCHAP, auth_id=AuthMessage.SUCCESS1, t_id=t_id, hl=hl,
        rvalid=1 if response is not None else 0)) + (response if response is not None else bytes(hl))


@dataclass(frozen=True)
class Success1:
    t_id: int
    hl: int
    response: bytes | None


def parse_success1(data: bytes) -> Success1:
    _need(data, 16, "DH-HMAC-CHAP_Success1")
    h = SUCCESS1_HEAD.parse(data[:16])
    if not h.rvalid:
        return Success1(h.t_id, h.hl, None)
    _need(data, 16 + h.hl, "DH-HMAC-CHAP_Success1")
    return Success1(h.t_id, h.hl, bytes(data[16:16 + h.hl]))


def build_success2(t_id: int) -> bytes:
    return SUCCESS2.build(dict(auth_type=AuthType.DHCHAP, auth_id=AuthMessage.SUCCESS2, t_id=t_id))


def build_failure(message: AuthMessage, t_id: int, explanation: int) -> bytes:
    """Failure1 is a common message (AUTH_TYPE 0, as the kernel's nvmet sends it); Failure2 a
    DH-HMAC-CHAP one."""
    auth_type = AuthType.COMMON if message is AuthMessage.FAILURE1 else AuthType.DHCHAP
    return FAILURE.build(dict(auth_type=auth_type, auth_id=message, t_id=t_id,
                              rescode=FAILURE_REASON_FAILED, rescode_exp=explanation))


def parse_failure(data: bytes) -> int:
    """The failure reason explanation of a Failure1/Failure2."""
    _need(data, FAILURE.sizeof(), "DH-HMAC-CHAP_Failure")
    return FAILURE.parse(data[:FAILURE.sizeof()]).rescode_exp
