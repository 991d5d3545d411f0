"""DH-HMAC-CHAP secrets in the ``DHHC-1:hh:<base64>:`` form nvme-cli writes and the kernel reads.

The base64 text holds the key (32, 48 or 64 bytes) followed by its CRC-32 (zlib's, stored
little-endian), as the kernel's ``nvme_auth_extract_key`` checks it. ``hh`` names the hash of
the optional transform (00 none, 01/02/03 SHA-256/384/512): before use the key becomes
HMAC_hash(key, NQN || "NVMe-over-Fabrics") -- the host NQN for a host secret, the subsystem NQN
for a controller secret (the kernel's ``nvme_auth_transform_key``).

A :class:`Secret` never shows its key in ``repr``/``str``, so it cannot reach a log by accident.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import os
import zlib

from protocol.auth import HashId

PREFIX = "DHHC-1"
KEY_LENGTHS = (32, 48, 64)
TRANSFORM_LABEL = b"NVMe-over-Fabrics"

HASHES: dict[int, tuple[str, int]] = {
    HashId.SHA256: ("sha256", 32),
    HashId.SHA384: ("sha384", 48),
    HashId.SHA512: ("sha512", 64),
}
"""hashlib name and digest length of each DH-HMAC-CHAP hash identifier."""


class SecretError(ValueError):
    """A secret that is not a well-formed DHHC-1 string (the message never quotes the key)."""


class Secret:
    """One DH-HMAC-CHAP secret: the raw key and the hash of its transform (0: none)."""

    __slots__ = ("key", "transform")

    def __init__(self, key: bytes, transform: int) -> None:
        if len(key) not in KEY_LENGTHS:
            raise SecretError(f"a DH-HMAC-CHAP key is 32, 48 or 64 bytes, not {len(key)}")
        if transform and transform not in HASHES:
            raise SecretError(f"unknown key transform {transform:#04x}")
        self.key = key
        self.transform = transform

    def __repr__(self) -> str:
        return f"Secret(<{len(self.key)} bytes>, transform={self.transform})"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        """Same key and transform (a reloaded configuration keeps unchanged hosts' secrets)."""
        if not isinstance(other, Secret):
            return NotImplemented
        return self.transform == other.transform and hmac.compare_digest(self.key, other.key)

    __hash__ = None  # type: ignore[assignment]

    def transformed(self, nqn: str) -> bytes:
        """The HMAC key this secret gives for ``nqn`` (unchanged when no transform is named)."""
        if not self.transform:
            return self.key
        return hmac.new(self.key, nqn.encode() + TRANSFORM_LABEL, HASHES[self.transform][0]).digest()

    def encode(self) -> str:
        """The DHHC-1 text of this secret."""
        blob = self.key + zlib.crc32(self.key).to_bytes(4, "little")
        return f"{PREFIX}:{self.transform:02x}:{base64.b64encode(blob).decode()}:"


def parse_secret(text: str) -> Secret:
    """Read a DHHC-1 secret, checking its length and CRC-32."""
    parts = text.strip().split(":")
    if len(parts) != 4 or parts[0] != PREFIX or parts[3] != "":
        raise SecretError(f"a DH-HMAC-CHAP secret reads {PREFIX}:hh:<base64>:")
    try:
        transform = int(parts[1], 16)
        blob = base64.b64decode(parts[2], validate=True)
    except (ValueError, binascii.Error):
        raise SecretError("the secret's hash field or base64 text is malformed") from None
    if len(blob) - 4 not in KEY_LENGTHS:
        raise SecretError(f"the secret decodes to {len(blob)} bytes, not 36, 52 or 68")
    key, crc = blob[:-4], blob[-4:]
    if zlib.crc32(key).to_bytes(4, "little") != crc:
        raise SecretError("the secret's CRC-32 does not match its key (mistyped?)")
    return Secret(key, transform)


def generate_secret(nqn: str, hmac_id: int = 0, key_length: int = 0,
                    seed: bytes | None = None) -> Secret:
    """A new secret as ``nvme gen-dhchap-key`` makes it: ``seed`` (random when None) of
    ``key_length`` bytes, run through the transform for ``nqn`` when ``hmac_id`` names a hash,
    whose digest length then fixes the key length."""
    if hmac_id:
        if hmac_id not in HASHES:
            raise SecretError(f"HMAC identifier {hmac_id} is not 0-3")
        need = HASHES[hmac_id][1]
        if key_length and key_length != need:
            raise SecretError(f"key length {key_length} does not fit hash {hmac_id} ({need} bytes)")
        key_length = need
    key_length = key_length or 32
    if seed is None:
        seed = os.urandom(key_length)
    if len(seed) != key_length:
        raise SecretError(f"the seed is {len(seed)} bytes, the key length {key_length}")
    key = Secret(seed, hmac_id).transformed(nqn)
    return Secret(key, hmac_id)
