"""blockd's Digest command on the wire (protocol/digest.py): where each field sits, the data's
length, and the digest of each chunk as both ends compute it."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import pytest
import xxhash

from protocol.commands import digest_command
from protocol.constants import IoOpcode
from protocol.digest import DIGEST_SIZE, DigestAlgorithm, Digests, digest_length


def test_the_command_is_a_vendor_specific_read_like_io_command() -> None:
    """Opcode 82h: vendor specific (80h-FFh) with the direction bits of a Read (10b: data to
    the host), SLBA and 0's based NLB where a Read has them, the chunk in CDW13, the algorithm
    in CDW14 bits 7:0."""
    sqe = digest_command(nsid=5, slba=0x1122334455, nlb0=0x7FFF, chunk=128, algorithm=DigestAlgorithm.XXH3_128)
    assert len(sqe) == 64
    assert sqe[0] == IoOpcode.BLOCKD_DIGEST == 0x82 and 0x80 <= sqe[0] and sqe[0] & 3 == 0b10
    assert sqe[1] == 0x40  # PSDT: SGL, as every fabrics command
    assert int.from_bytes(sqe[4:8], "little") == 5
    assert int.from_bytes(sqe[40:48], "little") == 0x1122334455  # CDW10-11
    assert int.from_bytes(sqe[48:50], "little") == 0x7FFF  # CDW12 bits 15:0
    assert int.from_bytes(sqe[52:56], "little") == 128  # CDW13
    assert sqe[56] == 1 and DigestAlgorithm.XXH3_128 == 1  # CDW14 bits 7:0
    assert not any(sqe[50:52]) and not any(sqe[57:64]) and not any(sqe[8:40])


@pytest.mark.parametrize("blocks,chunk,digests", [(1, 1, 1), (256, 128, 2), (257, 128, 3), (65536, 65536, 1)])
def test_the_data_is_one_digest_per_chunk_the_last_one_short(blocks: int, chunk: int, digests: int) -> None:
    assert digest_length(blocks, chunk) == digests * DIGEST_SIZE == digests * 16


@pytest.mark.parametrize("pieces", [[300_000], [1, 65535, 100_000, 133_464], [65536] * 4 + [38_144]])
def test_digests_of_pieces_are_xxh3_128_of_each_chunk(pieces: list[int]) -> None:
    """However the range is fed (pieces that end inside a chunk, exactly at its end, or span
    several), each slot holds XXH3-128 (canonical bytes) of its chunk, the last chunk short."""
    data = os.urandom(sum(pieces))
    chunk = 65536
    out = bytearray(digest_length(len(data), chunk))
    digests = Digests(DigestAlgorithm.XXH3_128, len(data), chunk, out)
    pos = 0
    for n in pieces:
        digests.feed(memoryview(data)[pos:pos + n])
        pos += n
    want = b"".join(xxhash.xxh3_128_digest(data[at:at + chunk]) for at in range(0, len(data), chunk))
    assert len(out) == 5 * DIGEST_SIZE and bytes(out) == want
    with pytest.raises(ValueError):
        digests.feed(b"x")  # past the range's end


class _XXH128(ctypes.Structure):
    _fields_ = [("low64", ctypes.c_uint64), ("high64", ctypes.c_uint64)]


def test_digests_match_the_system_libxxhash() -> None:
    """The bytes on the wire are XXH3-128 (seed 0) in its canonical order, high 64 bits first,
    big-endian, as the C library's ``XXH128_canonicalFromHash`` writes them: computed here by
    Debian's libxxhash (a build of xxHash apart from python-xxhash's), so another
    implementation of the command (a compiled one, another language) can check against it."""
    lib = ctypes.CDLL(ctypes.util.find_library("xxhash") or "libxxhash.so.0")
    lib.XXH3_128bits.restype = _XXH128
    lib.XXH3_128bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    for data in (b"abc", os.urandom(65536), os.urandom(100_003)):
        out = bytearray(16)
        Digests(DigestAlgorithm.XXH3_128, len(data), 1 << 20, out).feed(data)
        h = lib.XXH3_128bits(data, len(data))
        assert bytes(out) == h.high64.to_bytes(8, "big") + h.low64.to_bytes(8, "big")
