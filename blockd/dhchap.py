"""The DH-HMAC-CHAP computations both ends share (NVMe Base 2.0 section 8.13.5), as the Linux
kernel's drivers/nvme/host/auth.c and target/auth.c compute them.

Host response R1 = HMAC_Kh(C1' || le32 S1 || le16 T_ID || SC_C || "HostHost" || hostnqn || 0 ||
subnqn), controller response R2 = HMAC_Kc(C2' || le32 S2 || le16 T_ID || 0 || "Controller" ||
subnqn || 0 || hostnqn), Kh/Kc the transformed host/controller secrets. With a DH group the
challenge is augmented first: C' = HMAC_{H(session key)}(C), the session key being the
Diffie-Hellman shared value padded to the length of the group's prime.

Big-number work is ``cryptography``'s (OpenSSL); nothing here does modular arithmetic.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

from cryptography.hazmat.primitives.asymmetric import dh

from blockd.dhchap_secret import HASHES
from blockd.ffdhe import GENERATOR, PRIMES
from protocol.auth import DhGroup

GROUP_BITS: dict[int, int] = {
    DhGroup.FFDHE2048: 2048,
    DhGroup.FFDHE3072: 3072,
    DhGroup.FFDHE4096: 4096,
    DhGroup.FFDHE6144: 6144,
    DhGroup.FFDHE8192: 8192,
}

_parameters: dict[int, dh.DHParameters] = {}


def hash_length(hash_id: int) -> int:
    return HASHES[hash_id][1]


def dh_value_length(group: int) -> int:
    """Bytes of a public value (and of the session key) in ``group``; 0 for the NULL group."""
    return GROUP_BITS[group] // 8 if group != DhGroup.NULL else 0


class DhError(ValueError):
    """The peer's public value is not one of the group (wrong length, 0, 1, p-1 or beyond)."""


class DhExchange:
    """One side's ephemeral key pair in an FFDHE group."""

    def __init__(self, group: int) -> None:
        params = _parameters.get(group)
        if params is None:
            p = PRIMES[GROUP_BITS[group]]
            params = dh.DHParameterNumbers(p, GENERATOR, (p - 1) // 2).parameters()
            _parameters[group] = params
        self.size = GROUP_BITS[group] // 8
        self._private = params.generate_private_key()
        self.public = self._private.public_key().public_numbers().y.to_bytes(self.size, "big")

    def session_key(self, peer: bytes) -> bytes:
        """The shared value with the peer's public value, padded to the prime's length."""
        if len(peer) != self.size:
            raise DhError(f"DH value of {len(peer)} bytes in a {self.size}-byte group")
        numbers = self._private.parameters().parameter_numbers()
        y = int.from_bytes(peer, "big")
        if not 1 < y < numbers.p - 1:
            raise DhError("DH value out of range")
        try:
            shared = self._private.exchange(dh.DHPublicNumbers(y, numbers).public_key())
        except ValueError as exc:  # OpenSSL's public value checks
            raise DhError(str(exc)) from None
        return shared.rjust(self.size, b"\0")


def augment(hash_id: int, session_key: bytes | None, challenge: bytes) -> bytes:
    """The challenge as the response hashes it: itself, or augmented with the session key."""
    if session_key is None:
        return challenge
    name = HASHES[hash_id][0]
    return hmac.new(hashlib.new(name, session_key).digest(), challenge, name).digest()


def host_response(hash_id: int, key: bytes, challenge: bytes, seqnum: int, t_id: int,
                  sc_c: int, hostnqn: str, subnqn: str) -> bytes:
    """R1 for the (augmented) challenge C1 and sequence number S1, keyed by the transformed
    host secret."""
    msg = b"".join((challenge, struct.pack("<IHB", seqnum, t_id, sc_c), b"HostHost",
                    hostnqn.encode(), b"\0", subnqn.encode()))
    return hmac.new(key, msg, HASHES[hash_id][0]).digest()


def controller_response(hash_id: int, key: bytes, challenge: bytes, seqnum: int, t_id: int,
                        hostnqn: str, subnqn: str) -> bytes:
    """R2 for the (augmented) challenge C2 and sequence number S2, keyed by the transformed
    controller secret."""
    msg = b"".join((challenge, struct.pack("<IHB", seqnum, t_id, 0), b"Controller",
                    subnqn.encode(), b"\0", hostnqn.encode()))
    return hmac.new(key, msg, HASHES[hash_id][0]).digest()


def same(a: bytes, b: bytes) -> bool:
    """Constant-time comparison of a received response with the expected one."""
    return hmac.compare_digest(a, b)


_seqnum = int.from_bytes(os.urandom(4), "little")


def next_seqnum() -> int:
    """A fresh sequence number (S1/S2): a counter from a random start that skips 0, which the
    Reply reserves for "not bidirectional" (as the kernel's ``nvme_auth_get_seqnum``)."""
    global _seqnum
    _seqnum = (_seqnum + 1) & 0xFFFFFFFF or 1
    return _seqnum
