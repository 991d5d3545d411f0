# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Twin of :class:`target.tcp.TcpTargetConnection` (its receive loop, ``take_pdu``, ``fetch_data``
and ``queue_response``) on the core in ``target/_io_core.pyx`` and the file I/O in
``target/_file_io.pyx``: the target's compiled NVMe/TCP I/O path, Read and Write that succeed,
without a Python object per command beyond the reply's bytes.

:class:`TcpServe` takes a command capsule from the TCP connection before the
:class:`target.queue.TargetQueue` does and serves it in C when it is the steady-state case: an I/O
queue of a ready controller, no digests negotiated, PSDT SGL, Read with a Transport Data Block,
Write with its data in the capsule or with a Transport Data Block (an R2T write, below), a namespace whose backend is a plain
:class:`target.backend.FileBackend` (:class:`FastNamespace`, its C copy), the LBA range inside
it, the transfer length the blocks say, a writable namespace for a write, no FUA, and a read or
write that succeeds in full. Anything else returns False *before anything happened* and the
Python queue takes the capsule as it always did, so every status, error-log entry and More bit
comes from the one reference (the hostile-input suites see it unchanged). A read or write that
fails is not answered here either: the Python queue runs it again and reports the error as it
would have (re-reading is harmless; re-writing the same bytes at the same place too). FUA and
Flush go to Python on purpose: they wait for the disk, which the Python path does on a thread
so that the event loop (every other queue) keeps running.

What :class:`target.queue.TargetQueue` keeps per command and this path does at the same points
(the command completes inside the call, so what the queue holds from ``submit`` to
``response_sent`` is taken and given back within it):

- the command pool: a command is served only while ``queue.in_flight < queue.pool`` (the queue
  refuses the one that would exceed it with a sequence error, so that one goes to Python);
  ``in_flight`` itself is then unchanged, as the reply is queued before we return;
- the namespace hold (``ns.in_flight``): taken and released within the call, so not touched; a
  removed namespace is withdrawn (not in the subsystem's table, its copy marked inaccessible);
- SQHD: advanced modulo SQSIZE + 1 unless the host disabled SQ flow control, in which case the
  C2HData carries SUCCESS and no CapsuleResp follows, as ``TcpTargetConnection.queue_response``;
- the host's and the namespace's :class:`blockd.iostats.IoCounters`: ops, bytes, latency sum
  and bucket of the read or write kind, the latency from the capsule taken to the reply queued
  on the same clock (CLOCK_MONOTONIC is ``time.monotonic_ns``);
- the keep-alive traffic stamp (``controller.traffic_seen``);
- the connection's read-data batching (``batched`` against ``flush_at``, and straight to the
  socket while the daemon-wide ``max_unsent_total`` is passed), so that a host not reading its
  replies is seen (pause_writing, or the daemon-wide count) as soon as on the Python path.

An R2T write's R2T is sent here (``_send_r2t``); its data, written and answered, and the
receive loop and the queue's thread, are ``target/_tcp_thread.pyx``'s (:class:`TcpFastPath`
derives from :class:`TcpServe`, declared in ``target/_tcp_io.pxd``).

Replies go to the connection's compiled output batcher
with C calls (``blockd/_output.pxd``).

A Read of at least ``target.file_send.BY_REFERENCE_MIN`` bytes goes by reference
(:meth:`TcpFastPath._read_by_reference`, the twin of :mod:`target.file_send`, which says why and
how): its header, the file range (``splice``, page references) and its CapsuleResp through the
connection's pipe to the socket, with the same bytes on the wire and the same ends as the
``pread`` path; a range that does not come whole goes to the Python queue like a failed ``pread``.

Every offset comes from ``protocol/`` at import and is checked there against headers built by
``protocol/`` (a changed layout is an ImportError, and the target runs the Python path).

An in-capsule Write to a replicated namespace that ``target._io_core.mirror_eligible`` accepts
goes, on the event loop only, to its compiled lane (``target/replication/_mirror_io.pyx``), which
takes it or declines before anything happened (:meth:`TcpServe._mirror_write`). One it takes
completes later, when every replica took it: it holds the pool slot and the namespace as the
queue's request would, and :class:`MirrorReply` answers it as ``TargetQueue._complete`` and
``queue_response`` would, or, for an error (a replica lost with too few copies left), gives it
to the queue as its own failed write (``TargetQueue.adopt_write``, ``write_failed``).
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_FromStringAndSize
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.errno cimport EINTR, errno
from libc.string cimport memcpy, memset
from posix.types cimport off_t
from posix.unistd cimport pread, write

from blockd._iostats cimport IoCounters, now_ns
from blockd._le cimport le32, le64, st16, st32
from blockd._output cimport OutputBatcher
from blockd._pdu_reader cimport PduReader
from target._file_io cimport FastFile, FastNamespace, _pwrite_all, _read_pipe, _splice_all, _splice_out
from target._io_core cimport (
    _FLUSH, _FUA, _KIND_FLUSH, _KIND_READ, _KIND_WRITE, _O_ADDR, _O_LEN, _O_SGL_ID, _PSDT_MASK, _PSDT_SGL, _READ,
    _SGL_IN_CAPSULE, _SGL_TRANSPORT, _SQE_SIZE, _WRITE, QueueShape, RwCommand, bind_queue, count_io, eligible,
    mirror_eligible, next_sqhd, parse_rw, queue_ready, write_cqe,
)
from target.replication._mirror_io cimport MirrorLane

import os

from blockd.tcp_pdu import PduWriter
from protocol.layout import field_offset
from protocol.nvme import CQE_FAST, IO_CONTROL, IO_SLBA
from protocol.tcp import (
    CAPSULE_RESP_HLEN, COMMON_HEADER, COMMON_HEADER_FAST, COMMON_HEADER_SIZE, DATA_HLEN, DATA_PDU_HEADER,
    DATA_PDU_HEADER_FAST, PduFlags, PduType,
)
from target import file_send


cdef extern from "<sys/uio.h>" nogil:
    struct iovec:
        void* iov_base
        size_t iov_len

cdef extern from "<sys/socket.h>" nogil:
    struct msghdr:
        iovec* msg_iov
        size_t msg_iovlen
    Py_ssize_t send(int fd, const void* buf, size_t n, int flags)
    Py_ssize_t sendmsg(int fd, const msghdr* msg, int flags)
    int MSG_DONTWAIT
    int MSG_NOSIGNAL

cdef enum:
    _IOV_BATCH = 64  # replies per sendmsg of the queue's thread (well under IOV_MAX, 1024)

# -- layouts, from protocol/ (the SQE's fields and the CQE: target/_io_core.pxd; those assigned
# without ``cdef`` are declared in target/_tcp_io.pxd: target/_tcp_thread.pyx reads them too) -----

_SQE_AT = COMMON_HEADER_SIZE  # the SQE follows the CapsuleCmd's common header
_O_HLEN_CMD = field_offset(COMMON_HEADER, "hlen")
_O_TYPE = field_offset(COMMON_HEADER, "pdu_type")
_O_PLEN = field_offset(COMMON_HEADER, "plen")
_O_PDO = field_offset(COMMON_HEADER, "pdo")
_O_HFLAGS = field_offset(COMMON_HEADER, "flags")
_DIGEST_FLAGS = PduFlags.HDGST | PduFlags.DDGST
_HDR = COMMON_HEADER_SIZE

_DATA_HLEN = DATA_HLEN
_RESP_LEN = CAPSULE_RESP_HLEN
cdef Py_ssize_t _D_FLAGS = field_offset(DATA_PDU_HEADER, "flags")
cdef Py_ssize_t _D_PLEN = field_offset(DATA_PDU_HEADER, "plen")
_D_CID = field_offset(DATA_PDU_HEADER, "cccid")
_D_TTAG = field_offset(DATA_PDU_HEADER, "ttag")  # an R2T's fields sit where a data PDU's do
_D_DATAO = field_offset(DATA_PDU_HEADER, "datao")
_D_DATAL = field_offset(DATA_PDU_HEADER, "datal")
cdef Py_ssize_t _CQE_AT = COMMON_HEADER_SIZE  # the CQE follows the CapsuleResp's common header

_LAST = PduFlags.LAST_PDU
cdef int _LAST_SUCCESS = PduFlags.LAST_PDU | PduFlags.SUCCESS
_CAPSULE_CMD = PduType.CAPSULE_CMD
_H2C_DATA = PduType.H2C_DATA
_F_SLBA = IO_SLBA  # indices into Request.fields (the SQE unpacked as IO_COMMAND)
_F_CONTROL = IO_CONTROL

# Templates built by protocol/: the fields that vary are stored into copies of them.
cdef bytes _C2H_TEMPLATE = DATA_PDU_HEADER_FAST.pack(PduType.C2H_DATA, 0, DATA_HLEN, DATA_HLEN, 0, 0, 0, 0, 0)
cdef bytes _R2T_TEMPLATE = b"".join(PduWriter().r2t(0, 0, 0, 0))  # without digests (they turn this path off)
cdef Py_ssize_t _R2T_LEN = len(_R2T_TEMPLATE)
cdef bytes _RESP_TEMPLATE = (COMMON_HEADER_FAST.pack(PduType.CAPSULE_RESP, 0, CAPSULE_RESP_HLEN, 0, CAPSULE_RESP_HLEN)
                             + CQE_FAST.pack(0, 0, 0, 0, 0, 0))


cdef inline void _c2h_header(unsigned char* p, unsigned int cid, unsigned int n, int flags) noexcept:
    memcpy(p, <const char*>_C2H_TEMPLATE, _DATA_HLEN)
    p[_D_FLAGS] = flags
    st32(p + _D_PLEN, _DATA_HLEN + n)
    st16(p + _D_CID, cid)
    st32(p + _D_DATAL, n)


cdef inline void _r2t(unsigned char* p, unsigned int cid, unsigned int ttag, unsigned int n) noexcept:
    memcpy(p, <const char*>_R2T_TEMPLATE, _R2T_LEN)
    st16(p + _D_CID, cid)
    st16(p + _D_TTAG, ttag)
    st32(p + _D_DATAL, n)


cdef inline void _capsule_resp(unsigned char* p, unsigned int sqhd, unsigned int sqid, unsigned int cid) noexcept:
    memcpy(p, <const char*>_RESP_TEMPLATE, _CQE_AT)
    write_cqe(p + _CQE_AT, sqhd, sqid, cid)


def _check_layouts():
    """The headers written here against ``protocol/``'s builders (the SQE's fields and the CQE:
    ``target/_io_core.pyx``'s check)."""
    cdef bytearray out = bytearray(_DATA_HLEN + _RESP_LEN)
    cdef unsigned char* o = <unsigned char*>PyByteArray_AS_STRING(out)
    _c2h_header(o, 0x1234, 0x56789A, _LAST_SUCCESS)
    _capsule_resp(o + _DATA_HLEN, 0x0102, 0x0304, 0x0506)
    want = (DATA_PDU_HEADER_FAST.pack(PduType.C2H_DATA, _LAST_SUCCESS, DATA_HLEN, DATA_HLEN,
                                      DATA_HLEN + 0x56789A, 0x1234, 0, 0, 0x56789A)
            + _RESP_TEMPLATE[:COMMON_HEADER_SIZE] + CQE_FAST.pack(0, 0, 0x0102, 0x0304, 0x0506, 0))
    r2t = bytearray(_R2T_LEN)
    _r2t(<unsigned char*>PyByteArray_AS_STRING(r2t), 0x1234, 0x5678, 0x9ABCDEF)
    if bytes(out) != want or bytes(r2t) != b"".join(
            PduWriter().r2t(0x1234, 0x5678, 0, 0x9ABCDEF)):
        raise ImportError("protocol/'s C2HData, R2T or CapsuleResp layout is not the one target/_tcp_io.pyx uses")


_check_layouts()



cdef inline bint _sendv_all(int fd, iovec* v, Py_ssize_t n) noexcept nogil:
    """Send the ``n`` buffers at ``v`` on the blocking socket ``fd`` (the vector is advanced
    past what each call took); False if the socket failed (the host reset or shut down the
    connection, or the loop shut it down to end the queue's thread)."""
    cdef msghdr m
    cdef Py_ssize_t k
    memset(&m, 0, sizeof(m))
    while n > 0:
        m.msg_iov = v
        m.msg_iovlen = n
        k = sendmsg(fd, &m, MSG_NOSIGNAL)
        if k < 0:
            if errno == EINTR:
                continue
            return False
        while n > 0 and <size_t>k >= v[0].iov_len:
            k -= v[0].iov_len
            v += 1
            n -= 1
        if n > 0:
            v[0].iov_base = <char*>v[0].iov_base + k
            v[0].iov_len -= k
    return True


# -- the C copies of the storage --------------------------------------------------------------------





cdef class R2tWrite:
    """A Write whose R2T the compiled path sent, waiting for its H2CData in ``TcpTargetConnection.r2t_pending``
    in place of a :class:`target.request.Request`: the connection's ``_place`` and ``_h2c_data`` read
    ``cid``, ``length`` and ``data`` of it as of a request; the rare ends the compiled path leaves to
    Python (its data never comes, its write fails) get the request the queue would have made
    (:meth:`TcpFastPath.request`)."""


cdef class MirrorReply:
    """The end of a replicated write the lane took (:meth:`TcpServe._mirror_write`): called
    once, with None when every copy took it, else with the error the host gets."""

    cdef TcpServe serve
    cdef object entry
    cdef unsigned int cid
    cdef unsigned int length
    cdef long long start
    cdef bytes sqe
    cdef bytes data

    def __call__(self, exc):
        cdef TcpServe serve = self.serve
        cdef IoCounters ns_counters
        entry = self.entry
        queue = serve.queue
        if exc is not None:  # the queue's own failed write: status, error log, counters, reply
            queue.write_failed(queue.adopt_write(self.sqe, self.start, entry, self.data, None), exc)
            return
        # TargetQueue._complete: SQHD, the counters, the namespace's hold
        cdef bytes resp = serve._capsule_reply(self.cid)
        cdef long long elapsed = now_ns() - self.start
        serve.counters._count(_KIND_WRITE, self.length, elapsed)
        ns_counters = entry.counters
        ns_counters._count(_KIND_WRITE, self.length, elapsed)
        entry.in_flight -= 1
        if entry.removed:
            serve.conn.target.namespace_released(entry)
        # TcpTargetConnection.queue_response (nothing on a closing connection), response_sent
        if serve.transport.is_closing():
            return
        serve.served += 1
        serve.out._send((resp,))
        queue.in_flight -= 1


# -- the I/O path of one TCP connection --------------------------------------------------------------

cdef class TcpServe:
    """Serves the steady-state Read and Write capsules of one NVMe/TCP I/O queue (module docstring);
    :class:`target._tcp_thread.TcpFastPath` adds the receive loop, the queue's thread and the R2T
    writes' data. Its fields are declared in ``target/_tcp_io.pxd``."""
    def __init__(self, conn, Py_ssize_t max_transfer):
        self.conn = conn
        self.max_transfer = max_transfer
        self.served = 0
        self.by_reference = 0
        self.spilled = 0
        self.sock = -1
        self.pipe_r = self.pipe_w = -1
        self.pipe_room = 0
        self.pipe_data_room = 0
        self.pipe_data_refused = 1 << 62
        self._tfd = -1
        self._handoff = []
        reader = conn.reader
        self.reader = reader if type(reader) is PduReader else None
        self.py_buffer_updated = type(conn).buffer_updated

    cdef int _emit(self, bytes reply) except -1:
        """The reply of a command served on the thread, counted and gathered (:meth:`_gather`)."""
        self.thread_served += 1  # counted before the host can see the reply (the tests read it then)
        return self._gather(reply)

    cdef int _gather(self, bytes reply) except -1:
        """A PDU of the thread's (a reply, or an R2T) for :meth:`_send_replies`, in wire order;
        sent at once when the gathered ones pass the connection's ``flush_at`` (what the loop
        lets read data build up to before a send), so that what a host makes the thread hold
        stays bounded."""
        self._replies.append(reply)
        self._gathered += len(reply)
        if self._gathered > self.flush_at:
            self._send_replies()
        return 0

    cdef int _send_replies(self) except -1:
        """The gathered replies to the socket, in order, ``_IOV_BATCH`` per ``sendmsg``, before the
        thread receives again or hands back (a host not reading its replies blocks this thread
        only, the GIL released); a failed socket ends the thread (the loop sees the error)."""
        cdef list replies = self._replies
        cdef iovec vec[_IOV_BATCH]
        cdef Py_ssize_t count = len(replies), done = 0, n, i
        cdef int fd = self._tfd
        cdef bint ok = True
        cdef bytes reply
        if count:
            self.thread_sends += 1
        while ok and done < count:
            n = min(count - done, _IOV_BATCH)
            for i in range(n):
                reply = <bytes>replies[done + i]
                vec[i].iov_base = PyBytes_AS_STRING(reply)
                vec[i].iov_len = len(reply)
            with nogil:  # (the list holds the bytes meanwhile)
                ok = _sendv_all(fd, vec, n)
            done += n
        if not ok:
            self._broken = True
        del replies[:]
        self._gathered = 0
        return 0

    cdef bytes _capsule_reply(self, unsigned int cid):
        """The CapsuleResp of a command that succeeded, SQHD advanced (``TargetQueue._complete``)."""
        cdef bytes resp = PyBytes_FromStringAndSize(NULL, _RESP_LEN)
        _capsule_resp(<unsigned char*>PyBytes_AS_STRING(resp), self._next_sqhd(), self.shape.qid, cid)
        return resp

    cdef object _connection_pipe(self):
        """The connection's pipe (made on first use), its descriptors taken as C fields."""
        pipe = self.conn.reply_pipe()
        self.pipe = pipe
        self.pipe_r = pipe.r
        self.pipe_w = pipe.w
        return pipe

    cdef int _hold_namespace(self, nsobj, FastNamespace ns) except -2:
        """Hold a namespace across a thread's ``pread``/``pwrite`` (the GIL released: the loop may
        remove it meanwhile), so that its file closes only after (``TargetQueue`` holds it so); the
        descriptor read again under the hold (the checks before it ran Python code, where the GIL
        may have gone to the loop), or -1, nothing held: withdrawn since (the loop's to answer)."""
        nsobj.in_flight += 1
        cdef int fd = ns.file.fd
        if fd < 0 or not ns.accessible or nsobj.backend is not ns.backend:
            self._release_namespace(nsobj)
            return -1
        return fd

    cdef int _release_namespace(self, nsobj) except -1:
        nsobj.in_flight -= 1
        if nsobj.removed and not nsobj.in_flight:  # the last holder closes its file: on the loop
            self._loop.call_soon_threadsafe(self._namespace_released, nsobj)
        return 0

    def _namespace_released(self, nsobj):
        """``Target.namespace_released`` unless the namespace closed meanwhile (the target stopped)."""
        target = self.conn.target
        if nsobj in target.draining:
            target.namespace_released(nsobj)

    # -- serving one capsule -----------------------------------------------------------------------------

    cdef bint _bind(self) except -1:
        """Once the queue is a connected I/O queue: take what stays fixed from then on."""
        queue = self.conn.queue
        if not bind_queue(queue, &self.shape):
            return False  # admin queue, or not connected yet: nothing to serve
        self.shape.max_transfer = self.max_transfer
        self._bound = True
        reader = self.conn.reader
        if reader.hdgst or reader.ddgst:
            self._off = True  # digests are left to the Python path
            return False
        self.queue = queue
        self.ctrl = queue.controller
        self.counters = queue.counters
        self.out = self.conn.out
        self.transport = self.conn.transport
        self.flush_at = self.conn.flush_at
        self.unsent = self.conn.target.unsent  # the daemon-wide count (max_unsent_total)
        self.write_buffer_size = self.transport.get_write_buffer_size
        self.sock = self.conn.sock
        self.by_reference_min = file_send.BY_REFERENCE_MIN
        self.r2t_per_queue = self.conn.limits.r2t_budget
        self.thread_enabled = self.sock >= 0 and self.reader is not None and self.conn.target.threaded_queues
        # a write capsule is received whole into staging and written to the file from there
        # (placing it would copy what arrived with its header: docs/dataplane.md, large transfers)
        if self.reader is not None:  # only the compiled loop serves from staging
            self.reader.stage_type = _CAPSULE_CMD
            self.reader.stage_limit = self.shape.inline_size
        return True

    def submit(self, header, data):
        """Serve the CapsuleCmd whose header (with the SQE) and in-capsule data the reader gave;
        False: nothing was done, the Python queue takes it."""
        cdef long long start = now_ns()
        if self._off or (not self._bound and not self._bind()):
            return False
        cdef Py_buffer hb
        cdef Py_buffer db
        db.buf = NULL
        db.len = 0
        PyObject_GetBuffer(header, &hb, PyBUF_SIMPLE)
        try:
            if data is not None:
                PyObject_GetBuffer(data, &db, PyBUF_SIMPLE)
            try:
                return self._serve(<const unsigned char*>hb.buf, hb.len, <const unsigned char*>db.buf, db.len, start)
            finally:
                if data is not None:
                    PyBuffer_Release(&db)
        finally:
            PyBuffer_Release(&hb)

    cdef bint _serve(self, const unsigned char* header, Py_ssize_t hlen, const unsigned char* data,
                     Py_ssize_t dlen, long long start) except -1:
        """The capsule's header (common header and SQE, ``hlen`` bytes) and in-capsule data
        (``data`` NULL: none): served, or False with nothing done."""
        cdef RwCommand c
        cdef int sgl_id
        cdef unsigned int length
        cdef const unsigned char* q
        if hlen < _SQE_AT + _SQE_SIZE:  # a CapsuleCmd's HLEN is exactly that (the reader checks)
            return False
        q = header + _SQE_AT
        parse_rw(q, &c)
        length = le32(q + _O_LEN)
        sgl_id = q[_O_SGL_ID]
        if c.opcode == _FLUSH:  # (no data: any SGL of length 0, as TargetQueue._map_sgl takes it)
            return (self.threaded and length == 0 and (c.flags & _PSDT_MASK) == _PSDT_SGL
                    and self._flush(c.nsid, c.cid, start))
        # the transport's part: where the data is. A Read's goes by C2HData (a Transport Data
        # Block); a Write's is in the capsule, or a Transport Data Block (an R2T write: any data
        # in the capsule is ignored, as TargetQueue._map_sgl does); FUA only in the capsule on
        # the queue's thread (_write: its fdatasync would stop the loop's every other connection)
        if c.opcode == _READ:
            if sgl_id != _SGL_TRANSPORT:
                return False
        elif c.opcode == _WRITE:
            if sgl_id != _SGL_TRANSPORT and (sgl_id != _SGL_IN_CAPSULE or le64(q + _O_ADDR) != 0
                                             or length > self.shape.inline_size or data == NULL or dlen < length):
                return False
        # the core's part: the one rule both transports ask (target/_io_core.pyx)
        entry = eligible(&c, length, self.threaded and sgl_id == _SGL_IN_CAPSULE, self.ctrl, self.queue, &self.shape)
        if entry is None:
            if c.opcode != _WRITE or sgl_id != _SGL_IN_CAPSULE or self.threaded:
                return False  # (a replicated write on the queue's thread: the loop's, where its replicas are)
            entry = mirror_eligible(&c, length, self.ctrl, self.queue, &self.shape)
            if entry is None or self.transport.is_closing():
                return False
            return self._mirror_write(entry, <MirrorLane><object>c.ns, header, c.slba << entry.lba_shift, length,
                                      c.cid, data, start)
        if self.transport.is_closing():
            return False
        cdef FastNamespace ns = <FastNamespace><object>c.ns
        cdef FastFile f = ns.file
        cdef int opcode = c.opcode
        cdef unsigned int cid = c.cid
        cdef unsigned long long slba = c.slba
        cdef int control = c.control
        if opcode == _READ:
            return self._read(entry, ns, f.fd, <off_t>(slba << ns.lba_shift), length, cid, start)
        if sgl_id == _SGL_TRANSPORT:
            return self._send_r2t(entry, ns, <off_t>(slba << ns.lba_shift), length, cid, header, start)
        return self._write(entry, ns, f.fd, <off_t>(slba << ns.lba_shift), length, cid, data, start,
                           control & _FUA)

    cdef bint _flush(self, unsigned int nsid, unsigned int cid, long long start) except -1:
        """A Flush of one namespace, on the queue's thread: ``fdatasync`` of its file under the
        namespace's hold (what ``FileBackend.flush`` runs in the loop's executor), answered as
        the Python queue answers it; False with nothing done for anything else (NSID_ALL, a
        namespace not served here, a failed ``fdatasync``: the Python queue flushes and
        reports). On the loop the Python queue keeps it: ``fdatasync`` there would stop every
        other connection for as long as the disk takes.

        Each Flush used to hand the socket back to the loop, whose queue ran ``fdatasync`` in
        the executor's thread and answered; the thread took the socket again at the next idle
        receive."""
        entry = self.ctrl.io_namespaces.get(nsid)
        if entry is None:
            return False
        fast = entry.fast
        if fast is None:
            return False
        cdef FastNamespace ns = <FastNamespace?>fast
        if not queue_ready(self.queue, self.ctrl, self.shape.pool) or self.transport.is_closing():
            return False
        cdef int fd = self._hold_namespace(entry, ns)
        if fd < 0:
            return False
        try:
            os.fdatasync(fd)  # (a Python call, as FileBackend.flush makes: it releases the GIL for the sync)
        except OSError:
            return False
        finally:
            self._release_namespace(entry)
        cdef bytes resp = PyBytes_FromStringAndSize(NULL, _RESP_LEN)
        _capsule_resp(<unsigned char*>PyBytes_AS_STRING(resp), self._next_sqhd(), self.shape.qid, cid)
        self.ctrl.traffic_seen = True
        self._complete(ns, _KIND_FLUSH, 0, start)
        self.served += 1
        return self._emit(resp) >= 0

    cdef bint _read(self, nsobj, FastNamespace ns, int fd, off_t offset, unsigned int length, unsigned int cid,
                    long long start) except -1:
        if self._by_reference(length):
            return self._read_by_reference(nsobj, ns, fd, offset, length, cid, start)
        cdef Py_ssize_t total = _DATA_HLEN + length + (0 if self.shape.sqhd_disabled else _RESP_LEN)
        cdef bytes reply = PyBytes_FromStringAndSize(NULL, total)
        cdef unsigned char* p = <unsigned char*>PyBytes_AS_STRING(reply)
        cdef Py_ssize_t got
        cdef bint threaded = self.threaded
        if threaded:
            fd = self._hold_namespace(nsobj, ns)
            if fd < 0:
                return False
        with nogil:
            got = pread(fd, p + _DATA_HLEN, length, offset)
        if threaded:
            self._release_namespace(nsobj)
        if got != length:
            return False  # the Python path reads again and reports the error
        self._read_headers(p, cid, length)
        self.ctrl.traffic_seen = True
        self._complete(ns, _KIND_READ, length, start)
        self.served += 1
        if threaded:
            return self._emit(reply) >= 0
        self.out._send((reply,))
        conn = self.conn
        batched = conn.batched + length
        if batched > self.flush_at or self.unsent.over:
            conn.batched = 0
            self.out._flush()
        else:
            conn.batched = batched
        return True

    cdef int _read_headers(self, unsigned char* p, unsigned int cid, unsigned int length) except -1:
        """The C2HData header of a Read's reply at ``p`` (its ``length`` data bytes after it) and,
        unless the host disabled SQ flow control, the CapsuleResp after the data (SQHD advanced):
        written once the data is known to come (``TargetQueue._complete``'s point)."""
        if self.shape.sqhd_disabled:
            _c2h_header(p, cid, length, _LAST_SUCCESS)  # the data PDU completes the command
        else:
            _c2h_header(p, cid, length, _LAST)
            _capsule_resp(p + _DATA_HLEN + length, self._next_sqhd(), self.shape.qid, cid)
        return 0

    # -- reads by reference (target/file_send.py: why, and the Python twin of each step) ------------

    cdef bint _by_reference(self, unsigned int length) except -1:
        """The one place the compiled path decides whether a Read's data goes by reference: at
        least ``file_send.BY_REFERENCE_MIN`` bytes (read when the connection bound), a socket, and
        the connection's pipe able to hold it (the rest of ``TcpTargetConnection.read_buffer``'s
        conditions, a plain ``FileBackend`` and no digests, hold for every command served here)."""
        if length < self.by_reference_min or self.sock < 0:
            return False
        if length > self.pipe_room:  # the first such read, or a larger one: a Python call
            if not self._connection_pipe().room_for(length):
                return False
            self.pipe_room = length
        return True

    cdef bint _read_by_reference(self, nsobj, FastNamespace ns, int fd, off_t offset, unsigned int length,
                                 unsigned int cid, long long start) except -1:
        """``PipedRead.fill`` and ``ReplyPipe.drain`` in C: the C2HData header and the file range
        into the pipe (False, the pipe emptied, if the range does not come whole: the Python queue
        reads again and answers as always), the CapsuleResp after it, then the pipe to the socket
        when nothing is queued before it, and what the socket does not take through the batcher.

        On the queue's thread the same fill, under the namespace's hold as the thread's
        ``pread`` (``_hold_namespace``), then the replies gathered before it and the whole pipe
        to the thread's blocking socket (``_splice_out``): nothing spills, as nothing of the
        loop's can be queued before it. These reads used to hand the socket back to the loop,
        one hand-back and one re-entry per read, which cost more than the copy they save: 128
        KiB sequential reads through FUSE went from 1.79-1.81x nbdfuse with threads off to
        1.41-1.46x with them on, the target's CPU per read from 41-44 to 74-78 us
        (``run_fuse_bench.py --workloads seqread-128k``, alternated, 2026-12-03)."""
        cdef unsigned char head[64]
        cdef unsigned char resp[64]
        cdef Py_ssize_t got, n, total, left
        cdef off_t pos = offset
        cdef int pw = self.pipe_w, pr = self.pipe_r, sock = self.sock
        cdef bint success = self.shape.sqhd_disabled
        cdef bint threaded = self.threaded
        cdef bint sent
        cdef bytes rest, joined
        cdef unsigned char* p
        pipe = self.pipe
        if pipe.queued:
            if threaded:
                return False  # the loop's to empty (_to_thread never gives it a queued pipe)
            pipe.discard()  # a reply the Python path filled and never sent (its connection was closing)
        if threaded:
            fd = self._hold_namespace(nsobj, ns)
            if fd < 0:
                return False
        _c2h_header(head, cid, length, _LAST_SUCCESS if success else _LAST)
        with nogil:
            write(pw, head, _DATA_HLEN)  # into an empty pipe with room: never short
            got = _splice_all(fd, &pos, pw, length)
        if threaded:  # the pipe holds the pages now, not the file
            self._release_namespace(nsobj)
        if got != length:
            pipe.discard()
            return False
        total = _DATA_HLEN + length
        if not success:
            _capsule_resp(resp, self._next_sqhd(), self.shape.qid, cid)
            write(pw, resp, _RESP_LEN)
            total += _RESP_LEN
        self.ctrl.traffic_seen = True
        self._complete(ns, _KIND_READ, length, start)
        if threaded:
            self.thread_served += 1  # counted before the host can see the reply, as _emit does
            self.served += 1
            self.by_reference += 1
            self._send_replies()  # this receive's earlier replies go first
            if not self._broken:
                fd = self._tfd
                with nogil:
                    sent = _splice_out(pr, fd, total)
                if not sent:
                    self._broken = True  # as a failed sendmsg: the loop sees the socket's error
            if self._broken:
                pipe.discard()
            return True
        # ReplyPipe.drain
        left = total
        cdef list spill = []
        if not self.write_buffer_size():
            pending = self.out._take()
            if pending:  # this receive's earlier replies go first, straight to the socket too
                joined = b"".join(pending)
                n = send(sock, PyBytes_AS_STRING(joined), len(joined), MSG_DONTWAIT | MSG_NOSIGNAL)
                if n < 0:
                    n = 0
                if n < len(joined):
                    spill.append(memoryview(joined)[n:])
            if not spill:
                with nogil:
                    left -= _splice_all(pr, NULL, sock, left)
        if left:
            rest = PyBytes_FromStringAndSize(NULL, left)
            p = <unsigned char*>PyBytes_AS_STRING(rest)
            with nogil:
                _read_pipe(pr, p, left)  # the bytes are in the pipe
            spill.append(rest)
        if spill:
            self.out._send(spill)
            self.conn.batched = 0
            self.out._flush()
            self.spilled += 1
        self.served += 1
        self.by_reference += 1
        return True

    cdef bint _write(self, nsobj, FastNamespace ns, int fd, off_t offset, unsigned int length, unsigned int cid,
                     const unsigned char* data, long long start, bint fua) except -1:
        """An in-capsule Write, answered once written; with ``fua`` (on the queue's thread only)
        once ``fdatasync`` of the file says it is durable, as ``FileBackend.write(fua=True)``
        makes it. A FUA write used to hand the socket back to the loop, whose queue synced in the
        executor; a journal commit from the kernel host (a Flush, then a FUA write) now stays on
        the thread. False with nothing answered when the write or the sync fails: the Python
        path writes again (and syncs) and reports the error."""
        cdef Py_ssize_t done
        cdef bint threaded = self.threaded
        if threaded:
            fd = self._hold_namespace(nsobj, ns)
            if fd < 0:
                return False
        try:
            with nogil:
                done = _pwrite_all(fd, data, length, offset)
            if fua and done == length:
                os.fdatasync(fd)  # (a Python call, as FileBackend.write makes: it releases the GIL for the sync)
        except OSError:
            return False
        finally:
            if threaded:
                self._release_namespace(nsobj)
        if done != length:
            return False  # the Python path writes again and reports the error
        cdef bytes resp = PyBytes_FromStringAndSize(NULL, _RESP_LEN)
        _capsule_resp(<unsigned char*>PyBytes_AS_STRING(resp), self._next_sqhd(), self.shape.qid, cid)
        self.ctrl.traffic_seen = True
        self._complete(ns, _KIND_WRITE, length, start)
        self.served += 1
        if threaded:
            return self._emit(resp) >= 0
        self.out._send((resp,))
        return True

    # -- replicated writes (target/replication/_mirror_io.pyx) ---------------------------------------------

    cdef bint _mirror_write(self, entry, MirrorLane lane, const unsigned char* header, unsigned long long offset,
                            unsigned int length, unsigned int cid, const unsigned char* data, long long start) except -1:
        """Hand an in-capsule Write to a replicated namespace's lane; False (nothing done) when
        it declines. What the queue holds from ``submit`` to ``response_sent`` is taken first (the
        pool slot, the namespace), as for an R2T write, and given back by :class:`MirrorReply`."""
        cdef MirrorReply reply = MirrorReply.__new__(MirrorReply)
        reply.serve = self
        reply.entry = entry
        reply.cid = cid
        reply.length = length
        reply.start = start
        reply.sqe = PyBytes_FromStringAndSize(<const char*>header + _SQE_AT, _SQE_SIZE)  # for an error's request
        self.queue.in_flight += 1
        entry.in_flight += 1
        data_copy = PyBytes_FromStringAndSize(<const char*>data, length)  # staging is reused after this call
        reply.data = data_copy
        if lane.submit(offset, data_copy, reply):
            self.ctrl.traffic_seen = True
            return True
        self.queue.in_flight -= 1
        entry.in_flight -= 1
        return False

    # -- R2T writes ----------------------------------------------------------------------------------------

    cdef bint _send_r2t(self, nsobj, FastNamespace ns, off_t offset, unsigned int length, unsigned int cid,
                        const unsigned char* header, long long start) except -1:
        """Ask for a write's data with one R2T for all of it, as ``TargetQueue.submit`` and
        ``TcpTargetConnection.fetch_data`` do, when both R2T budgets have room for its buffer now
        and no earlier write waits for them (else False: the Python queue makes it wait in line).
        What the queue holds for it from here to ``response_sent`` is taken here: the pool slot
        (``queue.in_flight``), the namespace (``ns.in_flight``, so that a removed namespace keeps
        its file until the write is done) and the buffer's share of the budgets."""
        conn = self.conn
        if conn.r2t_waiting or conn.r2t_held + length > self.r2t_per_queue:
            return False
        if not conn.target.r2t_budget.try_take(length):
            return False  # the Python queue's take leaves the connection's wake-up with the budget
        cdef R2tWrite w = R2tWrite.__new__(R2tWrite)
        w.cid = cid
        w.length = length
        w.data = PyByteArray_FromStringAndSize(NULL, length)
        w.sqe = PyBytes_FromStringAndSize(<const char*>header + _SQE_AT, _SQE_SIZE)
        w.start_ns = start
        w.nsobj = nsobj
        w.ns = ns
        w.offset = offset
        self.queue.in_flight += 1
        self.ctrl.traffic_seen = True
        nsobj.in_flight += 1
        conn.r2t_held += length
        ttag = conn.next_ttag
        conn.next_ttag = (ttag + 1) & 0xFFFF
        conn.r2t_pending[ttag] = (w, 0)
        cdef bytes r2t = PyBytes_FromStringAndSize(NULL, _R2T_LEN)
        _r2t(<unsigned char*>PyBytes_AS_STRING(r2t), cid, ttag, length)
        if self.threaded:  # sent before the thread waits for the socket (_serve_received)
            self._gather(r2t)
        else:
            self.out._send((r2t,))
        return True

    cdef unsigned int _next_sqhd(self) except? 0xFFFFFFFF:
        return next_sqhd(self.queue, &self.shape)

    cdef void _complete(self, FastNamespace ns, int kind, unsigned int length, long long start) noexcept:
        count_io(self.counters, ns, kind, length, start)
