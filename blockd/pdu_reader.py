"""The Python NVMe/TCP PDU reader: the reference the compiled reader (``blockd/_pdu_reader.pyx``)
is tested against (``tests/protocol/test_reader_differential.py``), and the reader in use when
the compiled data plane is absent or ``BLOCKD_PURE=1`` (:mod:`blockd.dataplane`).

The reader takes whatever bytes the socket delivered and yields whole PDUs after checking the
common header (type, HLEN, PDO, PLEN bounds) and the negotiated digests. A violation raises
:class:`~blockd.tcp_frames.FramingError`, whose FES/FEI go into the termination request that
ends the connection.
"""

from __future__ import annotations

from typing import Iterator

from blockd.buffers import page_aligned
from blockd.tcp_frames import (
    CARRIES_DATA, HLEN, MIN_FREE, NO_DIGEST, STAGING, TERM_REQS, DataDigestError, FramingError, Pdu, Place,
)
from protocol.tcp import COMMON_HEADER_FAST, DIGEST_SIZE, MAX_TERM_COPY, PduFlags, TermReqFes, crc32c

_unpack_common = COMMON_HEADER_FAST.unpack_from


def data_buffer(size: int) -> bytearray:
    """A new buffer for ``size`` bytes of a data PDU's data (a ``place`` destination: a write's
    in-capsule data, the buffer an R2T asks the host to fill).

    The compiled twin (``blockd/_pdu_reader.pyx``) leaves the bytes uninitialised, which only a
    C allocation can: ``bytearray(size)`` zero-fills, and for a 1 MiB R2T write that fill was
    most of the target's user time per write (``tests/bench/bench_large_io.py``,
    docs/dataplane.md). No byte of it is read before it is filled: the reader fills a
    destination whole before it yields the PDU, and a write runs only once all of its H2CData
    arrived (a connection lost or a bad digest before that fails the command without the
    buffer being read)."""
    return bytearray(size)


class _Placement:
    """The data PDU whose data is being received straight into its destination buffer."""

    __slots__ = ("pdu_type", "flags", "header", "dest", "filled", "digest")

    def __init__(self, pdu_type: int, flags: int, header: bytes, dest: memoryview, filled: int,
                 digest: int) -> None:
        self.pdu_type = pdu_type
        self.flags = flags
        self.header = header
        self.dest = dest
        self.filled = filled
        self.digest = digest


class PduReader:
    """Splits a byte stream into PDUs of the types ``accepted`` (one direction's PDUs).

    It is fed the way an ``asyncio.BufferedProtocol`` is: ``get_buffer()`` says where the next
    bytes go, ``buffer_updated(n)`` yields the PDUs they completed. Headers and small PDUs are
    received into one staging buffer; once a data PDU's header is in, ``place`` may name the
    buffer its data belongs in (the read's destination, the write's request buffer) and the
    rest of the data is received there directly: large transfers are never copied in Python.
    """

    def __init__(self, accepted: frozenset[int], max_data: int, place: Place | None = None,
                 staging: int = STAGING) -> None:
        self.accepted = accepted
        self.allowed = accepted
        """The types the connection's state allows now (a subset of ``accepted``): another
        accepted type is a PDU Sequence Error as soon as its common header is in, before a byte
        of its data is received or anything allocated for it (as nvmet before ICReq)."""
        self.max_data = max_data
        self.completed = 0
        """PDUs yielded so far: a caller watching for a peer stuck mid-PDU compares it over time."""
        self.copied = 0
        """Bytes copied in user space so far: received bytes moved within staging or into a new
        staging buffer, and data copied from staging into a ``place`` destination (the
        benchmarks' and tests' measure of copies per I/O)."""
        self.place = place
        self.hdgst = False
        self.ddgst = False
        self.stage_type = -1
        self.stage_limit = 0
        """PDUs of ``stage_type`` with up to ``stage_limit`` bytes of data that fit in staging
        are received whole into staging and ``place`` is called only then (see ``_stages``)."""
        self._buf = self._view = page_aligned(staging)
        """Staging starts on a page: a write's in-capsule data, at a fixed place in it when the
        capsule came alone, goes from here to the file (``pwrite``), and a read's data to the
        read's buffer; a ``bytearray`` of 64 KiB starts wherever malloc's heap puts it, the same
        place for the whole connection, and for 1-40 bytes of such places the copy ran ~5x
        slower (4K aliasing, see ``blockd.buffers``)."""
        self._min_free = min(MIN_FREE, staging)
        """Free room below which staging is compacted (or grown) before the next receive."""
        self._start = 0
        """First byte of the staging buffer not yet parsed."""
        self._end = 0
        """End of the bytes received into the staging buffer."""
        self._need = 8
        """Bytes from ``_start`` the PDU being parsed needs in staging."""
        self._placing: _Placement | None = None

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        placing = self._placing
        if placing is not None and placing.filled < len(placing.dest):
            return placing.dest[placing.filled:]
        if self._start == self._end:  # nothing pending: the next PDU starts at the front, no move
            self._start = self._end = 0
        free = len(self._buf) - self._end
        if free < self._min_free or len(self._buf) - self._start < self._need:
            self._make_room()
        return self._view[self._end:]

    def _make_room(self) -> None:
        """Move the unparsed bytes to the front (into a bigger buffer when the PDU needs it)."""
        size = max(len(self._buf), self._need + self._min_free)
        if size > len(self._buf):
            self._regrow(size)
            return
        pending = self._end - self._start
        if pending:
            self._buf[:pending] = bytes(self._view[self._start:self._end])
        self.copied += pending
        self._start, self._end = 0, pending

    def _regrow(self, size: int) -> None:
        """Stage into a new buffer of ``size`` bytes on a page, the unparsed bytes at its front."""
        pending = self._end - self._start
        buf = page_aligned(size)
        buf[:pending] = self._view[self._start:self._end]
        self._buf = self._view = buf
        self.copied += pending
        self._start, self._end = 0, pending

    def grow_staging(self, size: int = STAGING) -> None:
        """Receive into ``size`` bytes of staging from now on (a reader started small, before
        its peer said hello); bytes not yet parsed are kept. Safe between two PDUs it yielded."""
        self._min_free = MIN_FREE
        if size > len(self._buf):
            self._regrow(size)

    def buffer_updated(self, nbytes: int) -> Iterator[Pdu]:
        """``nbytes`` arrived where ``get_buffer`` said: yield every PDU now complete."""
        placing = self._placing
        if placing is not None and placing.filled < len(placing.dest):
            placing.filled += nbytes
            if placing.filled < len(placing.dest):
                return
        else:
            self._end += nbytes
        while True:
            if self._placing is not None:
                pdu = self._finish_placement()
                if pdu is None:
                    return
                self.completed += 1
                yield pdu
            pdu = self._next()
            if pdu is None:
                return
            self.completed += 1
            yield pdu

    def in_pdu(self) -> bool:
        """Part of a PDU has arrived and not the rest (or whole PDUs wait to be taken)."""
        return self._placing is not None or self._end > self._start

    def feed(self, data: bytes | bytearray | memoryview) -> Iterator[Pdu]:
        """Copy ``data`` in and yield every complete PDU (for callers holding bytes)."""
        view = memoryview(data)
        pos = 0
        while True:
            room = self.get_buffer()
            n = min(len(room), len(view) - pos)
            room[:n] = view[pos:pos + n]
            pos += n
            yield from self.buffer_updated(n)
            if pos == len(view):
                return

    def _finish_placement(self) -> Pdu | None:
        placing = self._placing
        if placing.digest:
            if self._end - self._start < DIGEST_SIZE:
                self._need = DIGEST_SIZE
                return None
            got = int.from_bytes(self._view[self._start:self._start + DIGEST_SIZE], "little")
            self._start += DIGEST_SIZE
        self._placing = None
        self._need = 8
        if placing.digest and got != crc32c(placing.dest):  # the stream goes on after it
            raise DataDigestError(placing.pdu_type, placing.header)
        return Pdu(placing.pdu_type, placing.flags, memoryview(placing.header), placing.dest, True)

    def _next(self) -> Pdu | None:
        """The next whole PDU in staging, or None (``_need`` then says how much is missing)."""
        view, pos = self._view, self._start
        avail = self._end - pos
        if avail < 8:
            self._need = 8
            return None
        ptype, flags, hlen, pdo, plen = _unpack_common(view, pos)
        if ptype not in self.allowed:
            if ptype in self.accepted:
                raise self._refused(TermReqFes.PDU_SEQUENCE_ERROR, 0, f"PDU type {ptype:#x} out of sequence")
            raise self._refused(TermReqFes.INVALID_HEADER_FIELD, 0, f"unexpected PDU type {ptype:#x}")
        if hlen != HLEN[ptype]:
            raise self._refused(TermReqFes.INVALID_HEADER_FIELD, 2, f"bad HLEN {hlen} for PDU type {ptype:#x}")
        digests = ptype not in NO_DIGEST
        hd = DIGEST_SIZE if digests and self.hdgst else 0
        if digests and bool(flags & PduFlags.HDGST) != bool(hd):
            raise self._refused(TermReqFes.INVALID_HEADER_FIELD, 1, "header digest flag does not match negotiation")
        header_end = hlen + hd
        if plen < header_end:
            raise self._refused(TermReqFes.INVALID_HEADER_FIELD, 4, f"PLEN {plen} shorter than the header")
        data_len = plen - header_end
        dd = 0
        if data_len:
            if ptype not in CARRIES_DATA:
                raise self._refused(TermReqFes.INVALID_HEADER_FIELD, 4, f"PDU type {ptype:#x} carries no data")
            if ptype in TERM_REQS:
                if data_len > MAX_TERM_COPY:
                    raise self._refused(TermReqFes.INVALID_HEADER_FIELD, 4, "termination request too long")
            else:
                if pdo != header_end:
                    raise self._refused(TermReqFes.INVALID_HEADER_FIELD, 3, f"PDO {pdo} is not {header_end}")
                dd = DIGEST_SIZE if self.ddgst else 0
                if bool(flags & PduFlags.DDGST) != bool(dd):
                    raise self._refused(TermReqFes.INVALID_HEADER_FIELD, 1, "data digest flag does not match negotiation")
                data_len -= dd
                if data_len <= 0 or data_len > self.max_data:
                    raise self._refused(TermReqFes.DATA_OUT_OF_RANGE, 4, f"PDU data length {data_len} out of range")
        if avail < header_end:
            self._need = header_end
            return None
        header = view[pos:pos + hlen]
        if hd:
            got = int.from_bytes(view[pos + hlen:pos + header_end], "little")
            if got != crc32c(header):
                raise FramingError(TermReqFes.HEADER_DIGEST_ERROR, 0, "header digest mismatch", bytes(header))
        if (data_len and self.place is not None and digests
                and (avail >= plen or not self._stages(ptype, pos, plen, data_len))):
            dest = self.place(ptype, header, data_len)
            if dest is not None:
                return self._place(ptype, flags, header, header_end, data_len, dd, dest)
        if avail < plen:
            self._need = plen
            return None
        data = None
        if data_len:
            start = pos + header_end
            data = view[start:start + data_len]
            if dd:
                got = int.from_bytes(view[start + data_len:start + data_len + DIGEST_SIZE], "little")
                if got != crc32c(data):
                    # The stream goes on after the bad PDU.
                    self._start = pos + plen
                    raise DataDigestError(ptype, bytes(header))
        self._start = pos + plen
        self._need = 8
        return Pdu(ptype, flags, header, data)

    def _stages(self, ptype: int, pos: int, plen: int, data_len: int) -> bool:
        """Keep this PDU's data in staging until the PDU is whole (``place`` is called then),
        rather than placing it as soon as its header is in: a ``stage_type`` PDU with no more
        than ``stage_limit`` bytes of data that fits behind its position in staging (or for which
        staging must grow anyway).

        Why: placing copies into the destination whatever of the data arrived in staging with
        the header, and a socket read fills all of staging's free room, so a 128 KiB write
        capsule had ~64 KiB copied in user space (``tests/bench/bench_large_io.py
        --count-copies``: 65.4 MB for 1,000 writes; ``_make_room`` moved nothing). Kept whole in
        staging, the target's compiled path writes it to the file from there with no copy. A
        PDU that does not fit behind its position is placed as before: moving the part that
        arrived to the front would copy as much as placing does."""
        return (ptype == self.stage_type and data_len <= self.stage_limit
                and (pos + plen <= len(self._buf) or len(self._buf) < plen + self._min_free))

    def _refused(self, fes: int, fei: int, message: str) -> FramingError:
        """The error for the PDU at ``_start``, quoting its common header."""
        return FramingError(fes, fei, message, bytes(self._view[self._start:self._start + 8]))

    def _place(self, ptype: int, flags: int, header: memoryview, header_end: int, data_len: int,
               dd: int, dest: memoryview) -> Pdu | None:
        """Copy what staging holds of the data to ``dest``; the rest is received into it."""
        start = self._start + header_end
        have = self._end - start
        if have >= data_len + dd:  # all of it is here (the usual small PDU): no placement state
            end = start + data_len
            dest[:] = self._view[start:end]
            self.copied += data_len
            bad = dd and int.from_bytes(self._view[end:end + DIGEST_SIZE], "little") != crc32c(dest)
            self._start = end + dd  # the stream goes on after it, even after a bad digest
            self._need = 8
            if bad:
                raise DataDigestError(ptype, bytes(header))
            return Pdu(ptype, flags, header, dest, True)
        have = min(have, data_len)
        dest[:have] = self._view[start:start + have]
        self.copied += have
        self._placing = _Placement(ptype, flags, bytes(header), dest, have, dd)
        self._start = start + have
        if have < data_len:
            self._need = 0
            return None
        return self._finish_placement()
