# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The compiled NVMe/TCP PDU reader: :class:`blockd.pdu_reader.PduReader` written for C.

Same interface, same checks in the same order, same errors (FES, FEI, message): the Python
reader is the reference and ``tests/protocol/test_reader_differential.py`` feeds both the same
streams. What changes is the cost per PDU: the reader's state is typed C fields, the common
header is read from the staging buffer through a pointer instead of ``struct.unpack_from``'s
tuple, the type checks are table lookups, data is placed with ``memcpy``, and a partly placed
PDU is a handful of fields rather than an object. What remains per PDU is what the callers take:
the :class:`~blockd.tcp_frames.Pdu` and the header view.

Every size, offset, flag and status comes from ``protocol/`` and :mod:`blockd.tcp_frames` at
import (bound below to C variables), so nothing is typed twice.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_FromStringAndSize
from libc.string cimport memcpy, memmove, memset

from blockd._le cimport le32

from blockd.buffers import page_aligned

from blockd.tcp_frames import (
    CARRIES_DATA, HLEN, MIN_FREE, NO_DIGEST, STAGING, TERM_REQS, DataDigestError, FramingError, Pdu,
)
from protocol.layout import field_offset
from protocol.tcp import COMMON_HEADER, COMMON_HEADER_SIZE, DIGEST_SIZE, MAX_TERM_COPY, PduFlags, TermReqFes, crc32c

cdef Py_ssize_t _HDR = COMMON_HEADER_SIZE
cdef Py_ssize_t _DIGEST = DIGEST_SIZE
cdef Py_ssize_t _MAX_TERM = MAX_TERM_COPY
cdef Py_ssize_t _MIN_FREE = MIN_FREE
cdef int _F_HDGST = PduFlags.HDGST
cdef int _F_DDGST = PduFlags.DDGST
cdef Py_ssize_t _O_TYPE = field_offset(COMMON_HEADER, "pdu_type")
cdef Py_ssize_t _O_FLAGS = field_offset(COMMON_HEADER, "flags")
cdef Py_ssize_t _O_HLEN = field_offset(COMMON_HEADER, "hlen")
cdef Py_ssize_t _O_PDO = field_offset(COMMON_HEADER, "pdo")
cdef Py_ssize_t _O_PLEN = field_offset(COMMON_HEADER, "plen")
# The reads in _next take one byte each for type, flags, HLEN and PDO and a little-endian 32-bit
# PLEN at those offsets: a header built by protocol/ must read back. If protocol/ ever changes the
# layout, the ImportError makes blockd run the Python reader (with the start-up warning) rather
# than read it wrongly.
_sample = {"pdu_type": 0x11, "flags": 0x22, "hlen": 0x33, "pdo": 0x44, "plen": 0x55667788}
_built = COMMON_HEADER.build(_sample)
if (_built[_O_TYPE], _built[_O_FLAGS], _built[_O_HLEN], _built[_O_PDO],
        int.from_bytes(_built[_O_PLEN:_O_PLEN + 4], "little")) != tuple(_sample.values()):
    raise ImportError("protocol.tcp.COMMON_HEADER's layout is not the one blockd/_pdu_reader.pyx reads")

cdef int _FES_HEADER = TermReqFes.INVALID_HEADER_FIELD
cdef int _FES_SEQUENCE = TermReqFes.PDU_SEQUENCE_ERROR
cdef int _FES_HDGST = TermReqFes.HEADER_DIGEST_ERROR
cdef int _FES_RANGE = TermReqFes.DATA_OUT_OF_RANGE

# Per-type rules as tables indexed by the type byte (0 = no such rule).
cdef int _hlen[256]
cdef unsigned char _no_digest[256]
cdef unsigned char _term_req[256]
cdef unsigned char _carries_data[256]
cdef int _t
for _t in range(256):
    _hlen[_t] = HLEN.get(_t, -1)
    _no_digest[_t] = _t in NO_DIGEST
    _term_req[_t] = _t in TERM_REQS
    _carries_data[_t] = _t in CARRIES_DATA

# Pdu(...) would run the named tuple's Python-level __new__; tuple.__new__ builds the same object in C.
_new_tuple = tuple.__new__


def data_buffer(Py_ssize_t size):
    """:func:`blockd.pdu_reader.data_buffer` without the zero fill: ``size`` bytes left as
    the allocator gave them, for a destination the reader fills completely before anyone
    reads it (see the reference for why and the measurement)."""
    return PyByteArray_FromStringAndSize(NULL, size)


cdef void _fill_table(unsigned char* table, types) except *:
    memset(table, 0, 256)
    for t in types:
        if 0 <= t < 256:
            table[<int>t] = 1


cdef class PduReader:
    """See :class:`blockd.pdu_reader.PduReader`: the same reader, compiled."""

    def __init__(self, accepted, Py_ssize_t max_data, place=None, Py_ssize_t staging=STAGING):
        self.accepted = accepted
        self.allowed = accepted
        self.max_data = max_data
        self.completed = 0
        self.copied = 0
        self.place = place
        self.hdgst = False
        self.ddgst = False
        self.stage_type = -1
        self.stage_limit = 0
        self._set_buffer(page_aligned(staging))  # see blockd.pdu_reader.PduReader.__init__
        self._min_free = min(_MIN_FREE, staging)
        self._start = 0
        self._end = 0
        self._need = _HDR
        self._pl_dest = None

    @property
    def accepted(self):
        return self._accepted

    @accepted.setter
    def accepted(self, types):
        self._accepted = types
        _fill_table(self._accepted_t, types)

    @property
    def allowed(self):
        return self._allowed

    @allowed.setter
    def allowed(self, types):
        self._allowed = types
        _fill_table(self._allowed_t, types)

    cdef int _set_buffer(self, buf) except -1:
        """Stage into ``buf`` (a writable ``page_aligned`` view): its address is kept, which the
        view's hold on its mapping keeps valid for as long as ``_view`` is ours."""
        cdef Py_buffer view
        PyObject_GetBuffer(buf, &view, PyBUF_WRITABLE)
        self._p = <unsigned char*>view.buf
        self._size = view.len
        PyBuffer_Release(&view)
        self._buf = buf
        self._view = buf
        return 0

    cpdef object get_buffer(self, Py_ssize_t sizehint=-1):
        if self._pl_dest is not None and self._pl_filled < self._pl_len:
            return self._pl_dest[self._pl_filled:]
        if self._start == self._end:  # nothing pending: the next PDU starts at the front, no move
            self._start = self._end = 0
        if self._size - self._end < self._min_free or self._size - self._start < self._need:
            self._make_room()
        return self._view[self._end:]

    cdef void _make_room(self) except *:
        """Move the unparsed bytes to the front (into a bigger buffer when the PDU needs it)."""
        cdef Py_ssize_t size = max(self._size, self._need + self._min_free)
        if size > self._size:
            self._regrow(size)
            return
        cdef Py_ssize_t pending = self._end - self._start
        if pending:
            memmove(self._p, self._p + self._start, pending)
        self.copied += pending
        self._start = 0
        self._end = pending

    cdef int _regrow(self, Py_ssize_t size) except -1:
        """Stage into a new buffer of ``size`` bytes on a page, the unparsed bytes at its front."""
        cdef Py_ssize_t pending = self._end - self._start
        cdef unsigned char* old = self._p
        held = self._buf  # the old mapping, alive until the copy out of it is done
        self._set_buffer(page_aligned(size))
        memcpy(self._p, old + self._start, pending)
        del held
        self.copied += pending
        self._start = 0
        self._end = pending
        return 0

    def grow_staging(self, Py_ssize_t size=STAGING):
        """Receive into ``size`` bytes of staging from now on; bytes not yet parsed are kept."""
        self._min_free = _MIN_FREE
        if size > self._size:
            self._regrow(size)

    def buffer_updated(self, Py_ssize_t nbytes):
        """``nbytes`` arrived where ``get_buffer`` said: yield every PDU now complete."""
        if not self.advance(nbytes):
            return
        while True:
            pdu = self.take()
            if pdu is None:
                return
            yield pdu

    cdef bint advance(self, Py_ssize_t nbytes) noexcept:
        """Count ``nbytes`` more received; False while the data being placed is still incomplete
        (no PDU can be complete then)."""
        if self._pl_dest is not None and self._pl_filled < self._pl_len:
            self._pl_filled += nbytes
            return self._pl_filled >= self._pl_len
        self._end += nbytes
        return True

    cdef object take(self):
        """The next complete PDU, or None: one step of ``buffer_updated``."""
        if self._pl_dest is not None:
            pdu = self._finish_placement()
        else:
            pdu = self._next()
        if pdu is not None:
            self.completed += 1
        return pdu

    cdef Py_ssize_t whole(self, int ptype) noexcept:
        """PLEN of the next PDU if it is a whole ``ptype`` PDU in staging that ``_next`` would
        return as it is (every check passed, no digests, its data, if any, in staging), else -1.

        It checks less than ``_next`` only in the direction of saying -1 (a PDU with a digest
        flag set, or with a digest negotiated, is left to ``take``), so a caller that serves
        the PDU from staging and ``skip`` s it sees what ``take`` would have given. ``place`` is
        not called: the caller applies its rule (the target's in-capsule size) itself. Data
        being placed is no concern here: until it is all in, ``advance`` says False and staging
        holds none of it; after it, only its data digest (and with digests on this says -1)."""
        cdef Py_ssize_t pos = self._start
        cdef Py_ssize_t plen, hlen, data_len
        cdef const unsigned char* h
        if self.hdgst or self.ddgst or self._end - pos < _HDR:
            return -1
        h = self._p + pos
        if h[_O_TYPE] != ptype or not self._allowed_t[ptype] or h[_O_FLAGS] & (_F_HDGST | _F_DDGST):
            return -1
        hlen = h[_O_HLEN]
        plen = le32(h + _O_PLEN)
        if hlen != _hlen[ptype] or plen < hlen or plen > self._end - pos:
            return -1
        data_len = plen - hlen
        if data_len and (not _carries_data[ptype] or _term_req[ptype] or h[_O_PDO] != hlen
                         or data_len > self.max_data):
            return -1
        return plen

    cdef void skip(self, Py_ssize_t plen) noexcept:
        """The PDU ``whole`` measured was handled from staging: go past it."""
        self._start += plen
        self._need = _HDR
        self.completed += 1

    def in_pdu(self):
        """Part of a PDU has arrived and not the rest (or whole PDUs wait to be taken)."""
        return self._pl_dest is not None or self._end > self._start

    def feed(self, data):
        """Copy ``data`` in and yield every complete PDU (for callers holding bytes)."""
        view = memoryview(data)
        cdef Py_ssize_t pos = 0, n, total = len(view)
        while True:
            room = self.get_buffer()
            n = min(len(room), total - pos)
            room[:n] = view[pos:pos + n]
            pos += n
            yield from self.buffer_updated(n)
            if pos == total:
                return

    cdef object _finish_placement(self):
        cdef unsigned int got = 0
        if self._pl_digest:
            if self._end - self._start < _DIGEST:
                self._need = _DIGEST
                return None
            got = le32(self._p + self._start)
            self._start += _DIGEST
        dest = self._pl_dest
        self._pl_dest = None
        self._need = _HDR
        if self._pl_digest and got != crc32c(dest):  # the stream goes on after it
            raise DataDigestError(self._pl_type, self._pl_header)
        return _new_tuple(Pdu, (self._pl_type, self._pl_flags, memoryview(self._pl_header), dest, True))

    cdef object _next(self):
        """The next whole PDU in staging, or None (``_need`` then says how much is missing)."""
        cdef Py_ssize_t pos = self._start
        cdef Py_ssize_t avail = self._end - pos
        cdef const unsigned char* h
        cdef int ptype, flags, hlen, pdo, hd, dd
        cdef Py_ssize_t plen, header_end, data_len, start
        cdef bint digests
        if avail < _HDR:
            self._need = _HDR
            return None
        h = self._p + pos
        ptype = h[_O_TYPE]
        flags = h[_O_FLAGS]
        hlen = h[_O_HLEN]
        pdo = h[_O_PDO]
        plen = le32(h + _O_PLEN)
        if not self._allowed_t[ptype]:
            if self._accepted_t[ptype]:
                raise self._refused(_FES_SEQUENCE, 0, f"PDU type {ptype:#x} out of sequence")
            raise self._refused(_FES_HEADER, 0, f"unexpected PDU type {ptype:#x}")
        if hlen != _hlen[ptype]:
            raise self._refused(_FES_HEADER, 2, f"bad HLEN {hlen} for PDU type {ptype:#x}")
        digests = not _no_digest[ptype]
        hd = _DIGEST if digests and self.hdgst else 0
        if digests and ((flags & _F_HDGST) != 0) != (hd != 0):
            raise self._refused(_FES_HEADER, 1, "header digest flag does not match negotiation")
        header_end = hlen + hd
        if plen < header_end:
            raise self._refused(_FES_HEADER, 4, f"PLEN {plen} shorter than the header")
        data_len = plen - header_end
        dd = 0
        if data_len:
            if not _carries_data[ptype]:
                raise self._refused(_FES_HEADER, 4, f"PDU type {ptype:#x} carries no data")
            if _term_req[ptype]:
                if data_len > _MAX_TERM:
                    raise self._refused(_FES_HEADER, 4, "termination request too long")
            else:
                if pdo != header_end:
                    raise self._refused(_FES_HEADER, 3, f"PDO {pdo} is not {header_end}")
                dd = _DIGEST if self.ddgst else 0
                if ((flags & _F_DDGST) != 0) != (dd != 0):
                    raise self._refused(_FES_HEADER, 1, "data digest flag does not match negotiation")
                data_len -= dd
                if data_len <= 0 or data_len > self.max_data:
                    raise self._refused(_FES_RANGE, 4, f"PDU data length {data_len} out of range")
        if avail < header_end:
            self._need = header_end
            return None
        header = self._view[pos:pos + hlen]
        if hd and le32(h + hlen) != crc32c(header):
            raise FramingError(_FES_HDGST, 0, "header digest mismatch", bytes(header))
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
            data = self._view[start:start + data_len]
            if dd and le32(self._p + start + data_len) != crc32c(data):
                # The stream goes on after the bad PDU.
                self._start = pos + plen
                raise DataDigestError(ptype, bytes(header))
        self._start = pos + plen
        self._need = _HDR
        return _new_tuple(Pdu, (ptype, flags, header, data, False))

    cdef bint _stages(self, int ptype, Py_ssize_t pos, Py_ssize_t plen, Py_ssize_t data_len) noexcept:
        """Keep this PDU's data in staging until it is whole (``place`` called only then): see
        the reference's ``_stages`` for the rule and why."""
        return (ptype == self.stage_type and data_len <= self.stage_limit
                and (pos + plen <= self._size or self._size < plen + self._min_free))

    cdef object _refused(self, int fes, int fei, str message):
        """The error for the PDU at ``_start``, quoting its common header."""
        return FramingError(fes, fei, message, self._p[self._start:self._start + _HDR])

    cdef object _place(self, int ptype, int flags, header, Py_ssize_t header_end, Py_ssize_t data_len,
                       int dd, dest):
        """Copy what staging holds of the data to ``dest``; the rest is received into it."""
        cdef Py_ssize_t start = self._start + header_end
        cdef Py_ssize_t have = self._end - start
        cdef Py_buffer target
        cdef bint bad
        PyObject_GetBuffer(dest, &target, PyBUF_SIMPLE | PyBUF_WRITABLE)
        try:
            if target.len != data_len:
                raise ValueError(f"place gave {target.len} bytes for {data_len} bytes of data")
            if have >= data_len + dd:  # all of it is here (the usual small PDU): no placement state
                memcpy(target.buf, self._p + start, data_len)
                self.copied += data_len
            else:
                if have > data_len:
                    have = data_len
                memcpy(target.buf, self._p + start, have)
                self.copied += have
        finally:
            PyBuffer_Release(&target)
        if have >= data_len + dd:
            bad = dd and le32(self._p + start + data_len) != crc32c(dest)
            self._start = start + data_len + dd  # the stream goes on after it, even after a bad digest
            self._need = _HDR
            if bad:
                raise DataDigestError(ptype, bytes(header))
            return _new_tuple(Pdu, (ptype, flags, header, dest, True))
        self._pl_dest = dest
        self._pl_header = bytes(header)
        self._pl_type = ptype
        self._pl_flags = flags
        self._pl_len = data_len
        self._pl_filled = have
        self._pl_digest = dd != 0
        self._start = start + have
        if have < data_len:
            self._need = 0
            return None
        return self._finish_placement()
