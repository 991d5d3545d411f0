# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The compiled twin of :class:`initiator.tcp_host_io.TcpHostIo`: a command's capsule out, and
the PDUs that answer it (C2HData placed, CapsuleResp, R2T) in.

Same checks in the same order, same errors (FES, FEI, message, quoted header) and the same bytes
sent as the Python reference, which ``tests/core/test_tcp_host_differential.py`` compares it
with; the hostile-target suite runs against whichever is in use. What changes is the cost per
PDU: header fields are read through a pointer rather than unpacked into a tuple, the SGL is
written into the SQE in place, and without digests the capsule's common header and SQE are built
as one ``bytes`` (the writer's general path stays for digests); an in-capsule write whose data
is an ``InlineData`` (``initiator/_inline.pyx``, made by the compiled FUSE loop) has them written
into the room in front of its data and goes out as that one ``bytes``, not joined with it. The connection's queue and
commands are the compiled ones (``initiator/_queue.pxd``): ids are taken, looked up and freed,
and a completion's status, DW0/DW1 and callback set and run, with C calls; so is its output
batcher (``blockd/_output.pxd``): hold, release and send are C calls too.

The receive loop is the reader's ``buffer_updated`` loop in C (``advance`` then ``take``), and a
whole C2HData or CapsuleResp in the reader's staging that answers a command in flight as
expected is handled from staging and skipped, with no ``Pdu`` tuple, header view, generator step
or ``place`` call (29.6k -> 24.2k instructions per 4 KiB FUSE read, 33.9k -> 30.1k per write,
callgrind on ``tests/bench/bench_fuse_path.py``); everything else, and every error, comes from
``take`` as before.

Offsets, types, flags and statuses come from ``protocol/`` at import (bound to C variables below).
"""

cimport cython
from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy, memset

from blockd._le cimport le16, le32, st32
from blockd._output cimport OutputBatcher
from blockd._pdu_reader cimport PduReader
from initiator._inline cimport InlineData
from initiator._queue cimport HostCommand, HostConnection, HostQueue

from blockd.tcp_pdu import DataDigestError, FramingError, term_req
from initiator._inline import ROOM
from initiator.errors import QueueLost
from initiator.tcp_host_io import FEI_CCCID, FEI_DATAO, FEI_FLAGS, FEI_RESP_CID
from protocol.commands import SQE_SGL_OFFSET, field_offset
from protocol.constants import SglId
from protocol.nvme import CQE, SGL_DATA_BLOCK, SGL_DATA_BLOCK_FAST, SQE_SIZE
from protocol.status import Status, from_wire
from protocol.tcp import COMMON_HEADER, COMMON_HEADER_SIZE, DATA_PDU_HEADER, DATA_PDU_HEADER_FAST, PduFlags, PduType, TermReqFes

cdef Py_ssize_t _HDR = COMMON_HEADER_SIZE
cdef Py_ssize_t _SQE = SQE_SIZE
cdef Py_ssize_t _CAPSULE = COMMON_HEADER_SIZE + SQE_SIZE
if ROOM != _CAPSULE:
    raise ImportError("initiator/_inline.pyx's room is not the command capsule's header and SQE")
cdef Py_ssize_t _O_TYPE = field_offset(COMMON_HEADER, "pdu_type")
cdef Py_ssize_t _O_FLAGS = field_offset(COMMON_HEADER, "flags")
cdef Py_ssize_t _O_HLEN = field_offset(COMMON_HEADER, "hlen")
cdef Py_ssize_t _O_PDO = field_offset(COMMON_HEADER, "pdo")
cdef Py_ssize_t _O_PLEN = field_offset(COMMON_HEADER, "plen")
cdef Py_ssize_t _O_CCCID = field_offset(DATA_PDU_HEADER, "cccid")
cdef Py_ssize_t _O_TTAG = field_offset(DATA_PDU_HEADER, "ttag")
cdef Py_ssize_t _O_DATAO = field_offset(DATA_PDU_HEADER, "datao")
cdef Py_ssize_t _O_DATAL = field_offset(DATA_PDU_HEADER, "datal")
cdef Py_ssize_t _O_DW0 = _HDR + field_offset(CQE, "dw0")
cdef Py_ssize_t _O_DW1 = _HDR + field_offset(CQE, "dw1")
cdef Py_ssize_t _O_CID = _HDR + field_offset(CQE, "cid")
cdef Py_ssize_t _O_STATUS = _HDR + field_offset(CQE, "status")
cdef Py_ssize_t _O_SGL = SQE_SGL_OFFSET
cdef Py_ssize_t _O_SGL_LENGTH = SQE_SGL_OFFSET + field_offset(SGL_DATA_BLOCK, "length")
cdef Py_ssize_t _O_SGL_ID = SQE_SGL_OFFSET + field_offset(SGL_DATA_BLOCK, "sgl_id")
cdef Py_ssize_t _SGL = SGL_DATA_BLOCK_FAST.size
cdef int _CAPSULE_CMD = PduType.CAPSULE_CMD
cdef int _CAPSULE_RESP = PduType.CAPSULE_RESP
cdef int _C2H_DATA = PduType.C2H_DATA
cdef int _R2T = PduType.R2T
cdef int _H2C_DATA = PduType.H2C_DATA
cdef int _IN_CAPSULE = SglId.DATA_BLOCK_OFFSET
cdef int _TRANSPORT = SglId.TRANSPORT_DATA_BLOCK
cdef int _SUCCESS = PduFlags.SUCCESS
cdef int _LAST_PDU = PduFlags.LAST_PDU
cdef int _INVALID_FIELD = TermReqFes.INVALID_HEADER_FIELD
cdef int _OUT_OF_RANGE = TermReqFes.DATA_OUT_OF_RANGE
cdef int _DATA_TRANSFER_ERROR = Status.DATA_TRANSFER_ERROR
_H2C_TERM_REQ = PduType.H2C_TERM_REQ

# The reads below take little-endian fields of the widths protocol/ gives them at those offsets: a
# data PDU header and an SGL built by protocol/ must read back (else the Python twin runs).
_probe = DATA_PDU_HEADER_FAST.pack(0x11, 0x22, 0x33, 0x44, 0x55667788, 0xA1A2, 0xB1B2, 0xC1C2C3C4, 0xD1D2D3D4)
_sgl = bytearray(SQE_SGL_OFFSET + _SGL)
SGL_DATA_BLOCK_FAST.pack_into(_sgl, SQE_SGL_OFFSET, 0, 0xE1E2E3E4, 0x5A)
if ((_probe[_O_TYPE], _probe[_O_FLAGS], _probe[_O_HLEN], _probe[_O_PDO],
     int.from_bytes(_probe[_O_PLEN:_O_PLEN + 4], "little"), int.from_bytes(_probe[_O_CCCID:_O_CCCID + 2], "little"),
     int.from_bytes(_probe[_O_TTAG:_O_TTAG + 2], "little"), int.from_bytes(_probe[_O_DATAO:_O_DATAO + 4], "little"),
     int.from_bytes(_probe[_O_DATAL:_O_DATAL + 4], "little"))
        != (0x11, 0x22, 0x33, 0x44, 0x55667788, 0xA1A2, 0xB1B2, 0xC1C2C3C4, 0xD1D2D3D4)
        or int.from_bytes(_sgl[_O_SGL_LENGTH:_O_SGL_LENGTH + 4], "little") != 0xE1E2E3E4 or _sgl[_O_SGL_ID] != 0x5A):
    raise ImportError("protocol/'s data PDU or SGL layout is not the one initiator/_tcp_host_io.pyx reads")


cdef struct DataHeader:
    uint8_t flags
    uint16_t cid
    uint16_t ttag
    uint32_t datao
    uint32_t datal


cdef int _data_header(object header, DataHeader* h) except -1:
    cdef Py_buffer view
    cdef const uint8_t* p
    PyObject_GetBuffer(header, &view, PyBUF_SIMPLE)
    try:
        if view.len < _O_DATAL + 4:
            raise ValueError("data PDU header too short")
        p = <const uint8_t*>view.buf
        h.flags = p[_O_FLAGS]
        h.cid = le16(p + _O_CCCID)
        h.ttag = le16(p + _O_TTAG)
        h.datao = le32(p + _O_DATAO)
        h.datal = le32(p + _O_DATAL)
    finally:
        PyBuffer_Release(&view)
    return 0


cdef class TcpHostIo(HostConnection):
    """See :class:`initiator.tcp_host_io.TcpHostIo`: the fields are C fields here (declared in
    ``_tcp_host_io.pxd``), set by the subclass as there."""

    def _control(self, pdu):
        raise NotImplementedError

    def _fail(self, exc):
        raise NotImplementedError

    # -- sending ------------------------------------------------------------------------------

    def submit(self, HostCommand cmd):
        """Send ``cmd`` (see the reference)."""
        self._submit(cmd)

    @cython.nonecheck(True)  # out is None until connected: an AttributeError, as in Python
    cdef int _send_now(self, HostCommand cmd) except -1:
        """``hold()``, ``submit(cmd)``, ``release()``, as ``Controller._send`` calls them: the
        command goes out now unless a hold further up (a FUSE batch, a receive) keeps it. The
        connection's ``hold``/``release`` are its batcher's own (``TcpHostConnection.
        connection_made``), so these are the batcher's C steps."""
        cdef OutputBatcher out = self.out
        out._hold()
        try:
            self._submit(cmd)
        finally:
            out._release()
        return 0

    @cython.nonecheck(True)  # out is None until connected: an AttributeError, as in Python
    cdef int _submit(self, HostCommand cmd) except -1:
        cdef Py_ssize_t length
        cdef int sgl_id = _TRANSPORT
        cdef uint8_t* s
        cdef uint8_t* c = NULL
        cdef bytes capsule
        if self.closed:
            raise QueueLost("connection closed")
        self.queue._start(cmd)
        cdef bytearray sqe = cmd.sqe
        out = cmd.data_out
        if out is None:
            data_in = cmd.data_in
            length = 0 if data_in is None else len(data_in)
        else:
            length = len(out)
            if length <= self.inline_limit:
                sgl_id = _IN_CAPSULE
            else:
                out = None
        if PyByteArray_GET_SIZE(sqe) != _SQE:
            raise ValueError(f"an SQE is {_SQE} bytes, not {len(sqe)}")
        s = <uint8_t*>PyByteArray_AS_STRING(sqe)
        memset(s + _O_SGL, 0, _SGL)
        st32(s + _O_SGL_LENGTH, <uint32_t>length)
        s[_O_SGL_ID] = sgl_id
        writer = self.writer
        if writer.hdgst or writer.ddgst:
            self.out._send(writer.pdu(_CAPSULE_CMD, sqe, out))
            return 0
        if sgl_id == _IN_CAPSULE and length and type(out) is InlineData:
            c = <uint8_t*>(<InlineData>out)._room()  # the data's one bytes, header and SQE in front
        if c != NULL:
            capsule = (<InlineData>out).buf
            out = None
        else:
            capsule = PyBytes_FromStringAndSize(NULL, _CAPSULE)
            c = <uint8_t*>PyBytes_AS_STRING(capsule)
        memset(c, 0, _HDR)
        c[_O_TYPE] = _CAPSULE_CMD
        c[_O_HLEN] = <uint8_t>_CAPSULE
        memcpy(c + _HDR, s, _SQE)
        if sgl_id != _IN_CAPSULE or not length:
            st32(c + _O_PLEN, <uint32_t>_CAPSULE)
            self.out._send([capsule])
        else:
            c[_O_PDO] = <uint8_t>_CAPSULE
            st32(c + _O_PLEN, <uint32_t>(_CAPSULE + length))
            self.out._send([capsule] if out is None else [capsule, out])
        return 0

    # -- receiving ------------------------------------------------------------------------------

    @cython.nonecheck(True)  # out is None until connected: an AttributeError, as in Python
    def buffer_updated(self, Py_ssize_t nbytes):
        """``PduProtocol.buffer_updated`` (the reference's receive step; this class comes first
        in the connection's bases): what handling ``nbytes`` sends leaves in one send."""
        cdef OutputBatcher out = self.out
        out._hold()
        try:
            self._receive(nbytes)
        finally:
            out._release()

    cdef int _receive(self, Py_ssize_t nbytes) except -1:
        """The reader's ``buffer_updated`` loop (``advance``, then ``take`` until None) in C, in
        arrival order, with one shortcut: a whole C2HData or CapsuleResp in the reader's staging
        that answers a command in flight as expected is handled from there (``_staged_data``,
        ``_staged_response``) and ``skip`` ped, with no ``Pdu`` tuple, header view, generator
        step or ``place`` call; anything else, and every error, is what ``take`` gives. (The
        target's receive loop, ``target/_tcp_io.pyx``, does the same for command capsules.)"""
        cdef PduReader reader = self.reader  # the compiled reader: the compiled twins run together
        cdef object bad_data = None
        cdef object pdu
        cdef int ptype
        cdef Py_ssize_t plen
        while True:
            try:
                if bad_data is not None:
                    header, bad_data = bad_data, None
                    self._c2h_data(header, _DATA_TRANSFER_ERROR)
                if not reader.advance(nbytes):
                    return 0
                while True:
                    if reader._pl_dest is None:  # no data being placed: staging is in order
                        plen = reader.whole(_C2H_DATA)
                        if plen >= 0 and self._staged_data(reader, plen):
                            continue
                        plen = reader.whole(_CAPSULE_RESP)
                        if plen >= 0 and self._staged_response(reader, plen):
                            continue
                    pdu = reader.take()
                    if pdu is None:
                        return 0
                    ptype = pdu[0]
                    if ptype == _C2H_DATA and pdu[4]:
                        self._c2h_data(pdu[2])
                    elif ptype == _CAPSULE_RESP:
                        self._response(pdu[2])
                    elif ptype == _R2T:
                        self._r2t(pdu[2])
                    elif self._control(pdu):
                        return 0
            except FramingError as exc:
                self.out._send([term_req(_H2C_TERM_REQ, exc.fes, exc.fei, exc.header)])
                self._fail(ConnectionError(f"protocol error from target: {exc}"))
                return 0
            except DataDigestError as exc:
                # As the Linux host (see the reference).
                bad_data = exc.header
                nbytes = 0

    cdef bint _staged_data(self, PduReader reader, Py_ssize_t plen) except -1:
        """The whole C2HData at the reader's position, if ``_place`` would accept it and
        ``_c2h_data`` complete it without an error: its data copied into the command's buffer
        as the reader's ``_place`` copies it, then ``_c2h_data``'s steps; False, having done
        nothing, otherwise (``take`` then gives the reference's answer or error)."""
        cdef const uint8_t* p = reader._p + reader._start
        cdef Py_ssize_t hlen = p[_O_HLEN]
        cdef Py_ssize_t length = plen - hlen
        cdef uint8_t flags = p[_O_FLAGS]
        cdef uint16_t cid = le16(p + _O_CCCID)
        cdef uint32_t datao = le32(p + _O_DATAO)
        cdef uint32_t datal = le32(p + _O_DATAL)
        cdef Py_buffer view
        cdef HostQueue queue = self.queue
        cdef HostCommand cmd = queue._get(cid)
        if cmd is None or cmd.data_in is None or not length or flags & _SUCCESS and not flags & _LAST_PDU:
            return False
        PyObject_GetBuffer(cmd.data_in, &view, PyBUF_SIMPLE | PyBUF_WRITABLE)
        try:
            if datao != cmd.transferred or datao + <Py_ssize_t>datal > view.len or datal != length:
                return False
            memcpy(<char*>view.buf + datao, p + hlen, length)
        finally:
            PyBuffer_Release(&view)
        reader.copied += length
        reader.skip(plen)
        cmd.transferred += datal
        if flags & _SUCCESS:
            queue._finish(cid)
            if cmd.transferred != len(cmd.data_in):
                cmd.status = _DATA_TRANSFER_ERROR
            cmd._done(None)
        return True

    cdef bint _staged_response(self, PduReader reader, Py_ssize_t plen) except -1:
        """The whole CapsuleResp at the reader's position, for a command in flight: ``_response``
        from staging; False for an unknown id (``take`` then raises the reference's error)."""
        cdef const uint8_t* p = reader._p + reader._start
        if self.queue._get(le16(p + _O_CID)) is None or plen < _O_STATUS + 2:
            return False
        reader.skip(plen)
        self._complete(p, None)
        return True

    cdef _response(self, header):
        cdef Py_buffer view
        PyObject_GetBuffer(header, &view, PyBUF_SIMPLE)
        try:
            if view.len < _O_STATUS + 2:
                raise ValueError("CapsuleResp header too short")
            self._complete(<const uint8_t*>view.buf, header)
        finally:
            PyBuffer_Release(&view)

    cdef int _complete(self, const uint8_t* p, header) except -1:
        """The CapsuleResp whose header is at ``p`` (``header`` its object, for the error)."""
        cdef uint32_t dw0 = le32(p + _O_DW0)
        cdef uint32_t dw1 = le32(p + _O_DW1)
        cdef uint16_t cid = le16(p + _O_CID)
        cdef uint16_t wire = le16(p + _O_STATUS)
        cdef HostCommand cmd = self.queue._finish(cid)
        if cmd is None:
            raise FramingError(_INVALID_FIELD, FEI_RESP_CID, f"completion for unknown command id {cid}", bytes(header))
        status = from_wire(wire) if wire else 0
        if not status:
            status = cmd.status  # a read's data digest error stands
        if status == 0:
            data_in = cmd.data_in
            if data_in is not None and cmd.transferred != len(data_in):
                status = _DATA_TRANSFER_ERROR
        cmd.status = status
        cmd.dw0 = dw0
        cmd.dw1 = dw1
        cmd._done(None)
        return 0

    def _place(self, int ptype, header, Py_ssize_t length):
        """C2HData lands in the command's own buffer, at the offset it must come next."""
        cdef DataHeader h
        cdef Py_ssize_t size
        if ptype != _C2H_DATA:
            return None
        _data_header(header, &h)
        cdef HostCommand cmd = self.queue._get(h.cid)
        dest = None if cmd is None else cmd.data_in
        if dest is None:
            raise FramingError(_INVALID_FIELD, FEI_CCCID, f"C2HData for unknown command id {h.cid}", bytes(header))
        size = len(dest)
        if h.datao != cmd.transferred or h.datao + <Py_ssize_t>h.datal > size or h.datal != length:
            raise FramingError(_OUT_OF_RANGE, FEI_DATAO, "C2HData outside the command's buffer", bytes(header))
        return dest if h.datal == size else dest[h.datao:h.datao + h.datal]  # one PDU: no new view

    cdef _c2h_data(self, header, int status=0):
        """C2HData whose data ``_place`` already put in the command's buffer (see the reference)."""
        cdef DataHeader h
        _data_header(header, &h)
        cdef HostQueue queue = self.queue
        cdef HostCommand cmd = queue._get(h.cid)
        if cmd is None:  # as the reference
            raise KeyError(h.cid)
        cmd.transferred += h.datal
        if status:
            cmd.status = status
        if h.flags & _SUCCESS:
            if not h.flags & _LAST_PDU:
                raise FramingError(_INVALID_FIELD, FEI_FLAGS, "SUCCESS without LAST_PDU", bytes(header))
            queue._finish(h.cid)
            if cmd.transferred != len(cmd.data_in):
                cmd.status = _DATA_TRANSFER_ERROR
            cmd._done(None)

    cdef _r2t(self, header):
        """Send the data an R2T asks for, each byte at most once (see the reference)."""
        cdef DataHeader h
        cdef Py_ssize_t offset, end, n, chunk
        cdef int last
        _data_header(header, &h)
        cdef HostCommand cmd = self.queue._get(h.cid)
        out = None if cmd is None else cmd.data_out
        if out is None or len(out) <= self.inline_limit:  # a read, or its data went in the capsule
            raise FramingError(_INVALID_FIELD, FEI_CCCID, f"R2T for command id {h.cid}, which has no data to ask for",
                               bytes(header))
        offset = h.datao
        end = offset + h.datal
        if h.datal == 0 or offset < cmd.transferred or end > len(out):
            raise FramingError(_OUT_OF_RANGE, FEI_DATAO, "R2T outside the command's data not yet sent",
                               bytes(header))
        cmd.transferred = end
        view = memoryview(out)
        chunk = self.maxh2cdata
        writer = self.writer
        cdef OutputBatcher batcher = self.out
        while offset < end:
            n = min(chunk, end - offset)
            last = _LAST_PDU if offset + n == end else 0
            batcher._send(writer.data_pdu(_H2C_DATA, h.cid, h.ttag, offset, view[offset:offset + n], last))
            offset += n
