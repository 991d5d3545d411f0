"""NVMe/TCP framing shared by the target and the host: the PDU reader in use and the PDU builders.

The reader (:class:`PduReader`) is the compiled one when the data plane is compiled, else the
Python reference (:mod:`blockd.dataplane` picks; both behave alike, see
:mod:`blockd.pdu_reader`). Nothing here touches an event loop or a socket
(``tests/test_layers.py`` holds it to that): the asyncio protocol that feeds the reader and the
output batching live in :mod:`blockd.tcp_asyncio`.
"""

from __future__ import annotations

from blockd.dataplane import twin
from blockd.tcp_frames import DataDigestError, FramingError
from protocol.tcp import (
    COMMON_HEADER_FAST, DATA_HLEN, DATA_PDU_HEADER_FAST, DIGEST_SIZE, MAX_TERM_COPY, TERM_HLEN, PduFlags, PduType,
    crc32c,
)

_reader = twin("blockd._pdu_reader")
PduReader = _reader.PduReader
data_buffer = _reader.data_buffer

__all__ = ["DataDigestError", "FramingError", "PduReader", "PduWriter", "data_buffer", "term_req"]

_pack_common = COMMON_HEADER_FAST.pack
_pack_data_header = DATA_PDU_HEADER_FAST.pack


class PduWriter:
    """Builds outgoing PDUs with the negotiated digests."""

    def __init__(self) -> None:
        self.hdgst = False
        self.ddgst = False

    def _frame(self, ptype: int, flags: int, header_rest: bytes, data_len: int) -> tuple[bytes, int]:
        hlen = 8 + len(header_rest)
        hd = DIGEST_SIZE if self.hdgst else 0
        dd = DIGEST_SIZE if self.ddgst and data_len else 0
        if hd:
            flags |= PduFlags.HDGST
        if dd:
            flags |= PduFlags.DDGST
        pdo = hlen + hd if data_len else 0
        plen = hlen + hd + data_len + dd
        header = _pack_common(ptype, flags, hlen, pdo, plen) + header_rest
        if hd:
            header += crc32c(header).to_bytes(4, "little")
        return header, dd

    def pdu(self, ptype: int, header_rest: bytes, data: bytes | memoryview | None = None,
            flags: int = 0) -> list[bytes | memoryview]:
        """The buffers of one PDU, ready for ``writelines``."""
        n = len(data) if data is not None else 0
        header, dd = self._frame(ptype, flags, header_rest, n)
        if not n:
            return [header]
        if dd:
            return [header, data, crc32c(data).to_bytes(4, "little")]
        return [header, data]

    def data_pdu(self, ptype: int, cccid: int, ttag: int, offset: int, data: bytes | memoryview,
                 flags: int = 0) -> list[bytes | memoryview]:
        """H2CData / C2HData carrying ``data`` at ``offset`` of command ``cccid``."""
        if not self.hdgst and not self.ddgst:  # the common case, in one pack
            return [data_header(ptype, cccid, ttag, offset, len(data), flags), data]
        rest = _pack_data_header(0, 0, 0, 0, 0, cccid, ttag, offset, len(data))[8:]
        return self.pdu(ptype, rest, data, flags)

    def r2t(self, cccid: int, ttag: int, offset: int, length: int) -> list[bytes]:
        rest = _pack_data_header(0, 0, 0, 0, 0, cccid, ttag, offset, length)[8:]
        return self.pdu(PduType.R2T, rest)  # type: ignore[return-value]


def data_header(ptype: int, cccid: int, ttag: int, offset: int, n: int, flags: int = 0) -> bytes:
    """The header of a data PDU carrying ``n`` bytes, without digests (the data follows it on
    the wire; ``target/file_send.py`` sends it by reference)."""
    return _pack_data_header(ptype, flags, DATA_HLEN, DATA_HLEN, DATA_HLEN + n, cccid, ttag, offset, n)


def term_req(ptype: int, fes: int, fei: int, offending: bytes) -> bytes:
    """A termination request (never digests) quoting up to 128 bytes of the bad header."""
    copy = offending[:MAX_TERM_COPY]
    rest = fes.to_bytes(2, "little") + fei.to_bytes(4, "little") + bytes(10)
    return _pack_common(ptype, 0, TERM_HLEN, 0, TERM_HLEN + len(copy)) + rest + copy
