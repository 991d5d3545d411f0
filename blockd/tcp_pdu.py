"""NVMe/TCP framing shared by the target and the host: a sans-I/O PDU reader and PDU builders.

The reader takes whatever bytes the socket delivered and yields whole PDUs after checking the
common header (type, HLEN, PDO, PLEN bounds) and the negotiated digests. A violation raises
:class:`FramingError`, whose FES/FEI go into the termination request that ends the connection.
"""

from __future__ import annotations

import asyncio
from typing import Iterator, NamedTuple

from protocol.tcp import (
    CAPSULE_CMD_HLEN, CAPSULE_RESP_HLEN, COMMON_HEADER_FAST, DATA_HLEN, DATA_PDU_HEADER_FAST,
    DIGEST_SIZE, IC_SIZE, MAX_TERM_COPY, TERM_HLEN, PduFlags, PduType, TermReqFes, crc32c,
)

_unpack_common = COMMON_HEADER_FAST.unpack_from
_pack_common = COMMON_HEADER_FAST.pack
_pack_data_header = DATA_PDU_HEADER_FAST.pack

HLEN = {
    PduType.IC_REQ: IC_SIZE,
    PduType.IC_RESP: IC_SIZE,
    PduType.H2C_TERM_REQ: TERM_HLEN,
    PduType.C2H_TERM_REQ: TERM_HLEN,
    PduType.CAPSULE_CMD: CAPSULE_CMD_HLEN,
    PduType.CAPSULE_RESP: CAPSULE_RESP_HLEN,
    PduType.H2C_DATA: DATA_HLEN,
    PduType.C2H_DATA: DATA_HLEN,
    PduType.R2T: DATA_HLEN,
}
_NO_DIGEST = (PduType.IC_REQ, PduType.IC_RESP, PduType.H2C_TERM_REQ, PduType.C2H_TERM_REQ)
_CARRIES_DATA = (PduType.CAPSULE_CMD, PduType.H2C_DATA, PduType.C2H_DATA,
                 PduType.H2C_TERM_REQ, PduType.C2H_TERM_REQ)


class FramingError(Exception):
    """A PDU the connection cannot survive; ``header`` is the offending PDU's header."""

    def __init__(self, fes: int, fei: int, message: str, header: bytes = b"") -> None:
        super().__init__(message)
        self.fes = fes
        self.fei = fei
        self.header = header


class Pdu(NamedTuple):
    """One received PDU. ``header`` and ``data`` are views valid until the next ``feed``."""

    pdu_type: int
    flags: int
    header: memoryview
    data: memoryview | None


class PduReader:
    """Splits a byte stream into PDUs of the types ``accepted`` (one direction's PDUs)."""

    def __init__(self, accepted: frozenset[int], max_data: int) -> None:
        self.accepted = accepted
        self.max_data = max_data
        self.hdgst = False
        self.ddgst = False
        self._buf = bytearray()
        self._pos = 0

    def feed(self, data: bytes) -> Iterator[Pdu]:
        """Add received bytes and yield every complete PDU."""
        buf = self._buf
        if self._pos:
            del buf[:self._pos]
            self._pos = 0
        buf += data
        view = memoryview(buf)
        try:
            while True:
                pdu, end = self._next(view, self._pos)
                if pdu is None:
                    return
                self._pos = end
                yield pdu
        finally:
            view.release()

    def _next(self, view: memoryview, pos: int) -> tuple[Pdu | None, int]:
        if len(view) - pos < 8:
            return None, pos
        ptype, flags, hlen, pdo, plen = _unpack_common(view, pos)
        header8 = bytes(view[pos:pos + 8])
        if ptype not in self.accepted:
            raise FramingError(TermReqFes.INVALID_HEADER_FIELD, 0, f"unexpected PDU type {ptype:#x}", header8)
        if hlen != HLEN[ptype]:
            raise FramingError(TermReqFes.INVALID_HEADER_FIELD, 2, f"bad HLEN {hlen} for PDU type {ptype:#x}", header8)
        digests = ptype not in _NO_DIGEST
        hd = DIGEST_SIZE if digests and self.hdgst else 0
        if digests and bool(flags & PduFlags.HDGST) != bool(hd):
            raise FramingError(TermReqFes.INVALID_HEADER_FIELD, 1, "header digest flag does not match negotiation", header8)
        header_end = hlen + hd
        if plen < header_end:
            raise FramingError(TermReqFes.INVALID_HEADER_FIELD, 4, f"PLEN {plen} shorter than the header", header8)
        data_len = plen - header_end
        if data_len:
            if ptype not in _CARRIES_DATA:
                raise FramingError(TermReqFes.INVALID_HEADER_FIELD, 4, f"PDU type {ptype:#x} carries no data", header8)
            if ptype in (PduType.H2C_TERM_REQ, PduType.C2H_TERM_REQ):
                if data_len > MAX_TERM_COPY:
                    raise FramingError(TermReqFes.INVALID_HEADER_FIELD, 4, "termination request too long", header8)
            else:
                if pdo != header_end:
                    raise FramingError(TermReqFes.INVALID_HEADER_FIELD, 3, f"PDO {pdo} is not {header_end}", header8)
                dd = DIGEST_SIZE if self.ddgst else 0
                if bool(flags & PduFlags.DDGST) != bool(dd):
                    raise FramingError(TermReqFes.INVALID_HEADER_FIELD, 1, "data digest flag does not match negotiation", header8)
                data_len -= dd
                if data_len <= 0 or data_len > self.max_data:
                    raise FramingError(TermReqFes.DATA_OUT_OF_RANGE, 4, f"PDU data length {data_len} out of range", header8)
        if len(view) - pos < plen:
            return None, pos
        header = view[pos:pos + hlen]
        if hd:
            got = int.from_bytes(view[pos + hlen:pos + header_end], "little")
            if got != crc32c(header):
                raise FramingError(TermReqFes.HEADER_DIGEST_ERROR, 0, "header digest mismatch", bytes(header))
        data = None
        if data_len:
            start = pos + header_end
            data = view[start:start + data_len]
            if self.ddgst and ptype not in _NO_DIGEST:
                got = int.from_bytes(view[start + data_len:start + data_len + DIGEST_SIZE], "little")
                if got != crc32c(data):
                    # The stream goes on after the bad PDU, and the exception (its traceback)
                    # must not pin the buffer with views, or the next feed cannot resize it.
                    self._pos = pos + plen
                    copy = bytes(header)
                    header.release()
                    data.release()
                    raise DataDigestError(ptype, copy)
        return Pdu(ptype, flags, header, data), pos + plen


class DataDigestError(Exception):
    """Data digest mismatch: the command fails (Data Transfer Error), the connection may live."""

    def __init__(self, pdu_type: int, header: bytes) -> None:
        super().__init__("data digest mismatch")
        self.pdu_type = pdu_type
        self.header = header


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
        rest = _pack_data_header(0, 0, 0, 0, 0, cccid, ttag, offset, len(data))[8:]
        return self.pdu(ptype, rest, data, flags)

    def r2t(self, cccid: int, ttag: int, offset: int, length: int) -> list[bytes]:
        rest = _pack_data_header(0, 0, 0, 0, 0, cccid, ttag, offset, length)[8:]
        return self.pdu(PduType.R2T, rest)  # type: ignore[return-value]


def term_req(ptype: int, fes: int, fei: int, offending: bytes) -> bytes:
    """A termination request (never digests) quoting up to 128 bytes of the bad header."""
    copy = offending[:MAX_TERM_COPY]
    rest = fes.to_bytes(2, "little") + fei.to_bytes(4, "little") + bytes(10)
    return _pack_common(ptype, 0, TERM_HLEN, 0, TERM_HLEN + len(copy)) + rest + copy


class OutputBatcher:
    """Coalesces the PDUs produced while handling input into a single socket write.

    Every completion used to cost its own ``send`` (two for a read: C2HData, then the
    CapsuleResp), and on loopback the syscall dominated the per-I/O cost. Between ``hold()``
    and ``release()`` (a receive callback, say; holds nest) buffers only queue, and ``release`` sends them
    together; sends outside a hold go out once the loop has run everything that was ready.
    Order is kept either way.
    """

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self._bufs: list[bytes | memoryview] = []
        self._held = 0
        self._scheduled = False
        self._loop = asyncio.get_running_loop()

    def hold(self) -> None:
        self._held += 1

    def release(self) -> None:
        self._held -= 1
        if not self._held and self._bufs:
            self.flush()

    def send(self, bufs: list[bytes | memoryview]) -> None:
        self._bufs.extend(bufs)
        if not self._held and not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        bufs, self._bufs = self._bufs, []
        if not bufs or self.transport.is_closing():
            return
        if len(bufs) == 1:
            self.transport.write(bufs[0])
        elif sum(map(len, bufs)) <= 65536:
            self.transport.write(b"".join(bufs))
        else:
            self.transport.writelines(bufs)
