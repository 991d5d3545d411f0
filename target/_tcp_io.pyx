# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Twin of :class:`target.tcp.TcpTargetConnection` (its receive loop, ``take_pdu``, ``fetch_data``
and ``queue_response``) on the core in ``target/_io_core.pyx`` and the file I/O in
``target/_file_io.pyx``: the target's compiled NVMe/TCP I/O path, Read and Write that succeed,
without a Python object per command beyond the reply's bytes.

:class:`TcpFastPath` takes a command capsule from the TCP connection before the
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

An R2T write cannot complete inside the call: it holds its pool slot (``queue.in_flight``), its
namespace (``ns.in_flight``) and its buffer's share of the per-queue and daemon-wide R2T budgets
across the host's round trip, as the queue's own R2T writes do. Its R2T is sent here only while
both budgets have room now and no earlier write waits for them (otherwise the queue makes it
wait in line, and the wake-up stays the queue's); its :class:`R2tWrite` stands in
``TcpTargetConnection.r2t_pending`` where the queue's request would, so the connection's checks
and placement of the H2CData are unchanged, and :meth:`TcpFastPath.data_ready` writes and
answers it once the last H2CData is in. The ends left to Python get the request the queue would
have made (``TargetQueue.adopt_write``): a connection lost before the data (Data Transfer Error,
as the queue's), a ``pwrite`` that fails or a namespace changed during the round trip (the queue
writes it). Measured (docs/dataplane.md, "R2T writes in C"): target user time per 1 MiB write
102–117 µs → 65–74 µs through FUSE; the rest is the kernel's copies. On the queue's thread the
thread sends the R2T and takes the H2CData itself (:meth:`TcpFastPath._h2c_on_thread`: exactly
what the connection's checks accept without a word, everything else left to the loop in the
reader): 77-80 → 30 µs of user time per 1 MiB write, ~20 → 6 system calls.

Replies, and the receive loop's hold and release, go to the connection's compiled output batcher
with C calls (``blockd/_output.pxd``).

A Read of at least ``target.file_send.BY_REFERENCE_MIN`` bytes goes by reference
(:meth:`TcpFastPath._read_by_reference`, the twin of :mod:`target.file_send`, which says why and
how): its header, the file range (``splice``, page references) and its CapsuleResp through the
connection's pipe to the socket, with the same bytes on the wire and the same ends as the
``pread`` path; a range that does not come whole goes to the Python queue like a failed ``pread``.

Every offset comes from ``protocol/`` at import and is checked there against headers built by
``protocol/`` (a changed layout is an ImportError, and the target runs the Python path).
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_FromStringAndSize
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.errno cimport EAGAIN, EINTR, EIO, errno
from libc.string cimport memcpy, memset
from posix.fcntl cimport F_GETFL, F_SETFL, O_NONBLOCK, fcntl
from posix.types cimport off_t
from posix.unistd cimport close, dup, pread, read, write

from blockd._iostats cimport IoCounters, now_ns
from blockd._le cimport le16, le32, le64, st16, st32
from blockd._output cimport OutputBatcher
from blockd._pdu_reader cimport PduReader
from target._file_io cimport (
    _FILE_REFUSED, _HOST_CLOSED, _SOCKET_FAILED, _SPLICED, FastFile, FastNamespace, _pwrite_all, _read_pipe,
    _splice_all, _splice_out, _splice_write,
)
from target._io_core cimport (
    _CQE_SIZE, _FLUSH, _FUA, _KIND_FLUSH, _KIND_READ, _KIND_WRITE, _PSDT_MASK, _PSDT_SGL, _READ, _SGL_IN_CAPSULE,
    _SGL_TRANSPORT, _SQE_SIZE, _WRITE, _O_ADDR, _O_LEN, _O_SGL_ID, QueueShape, RwCommand, bind_queue, count_io,
    eligible, next_sqhd, parse_rw, queue_ready, write_cqe,
)

import asyncio
import os
import threading

import structlog

from blockd.tcp_frames import DataDigestError, FramingError
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
    Py_ssize_t recv(int fd, void* buf, size_t n, int flags)
    int shutdown(int fd, int how)
    int MSG_DONTWAIT
    int MSG_NOSIGNAL
    int MSG_WAITALL
    int SHUT_RDWR

log = structlog.get_logger("blockd.target.tcp")

cdef enum:
    _IOV_BATCH = 64  # replies per sendmsg of the queue's thread (well under IOV_MAX, 1024)

THREAD_JOIN_TIMEOUT = 5.0
"""Seconds a closing connection waits for its queue's thread to leave (it is woken by
``shutdown``; only a ``pread``/``pwrite`` that the disk holds can make it take longer)."""

# -- layouts, from protocol/ (the SQE's fields and the CQE: target/_io_core.pxd) ----------------------

cdef Py_ssize_t _SQE_AT = COMMON_HEADER_SIZE  # the SQE follows the CapsuleCmd's common header
cdef Py_ssize_t _O_HLEN_CMD = field_offset(COMMON_HEADER, "hlen")
cdef Py_ssize_t _O_TYPE = field_offset(COMMON_HEADER, "pdu_type")
cdef Py_ssize_t _O_PLEN = field_offset(COMMON_HEADER, "plen")
cdef Py_ssize_t _O_PDO = field_offset(COMMON_HEADER, "pdo")
cdef Py_ssize_t _O_HFLAGS = field_offset(COMMON_HEADER, "flags")
cdef int _DIGEST_FLAGS = PduFlags.HDGST | PduFlags.DDGST
cdef Py_ssize_t _HDR = COMMON_HEADER_SIZE

cdef Py_ssize_t _DATA_HLEN = DATA_HLEN
cdef Py_ssize_t _RESP_LEN = CAPSULE_RESP_HLEN
cdef Py_ssize_t _D_FLAGS = field_offset(DATA_PDU_HEADER, "flags")
cdef Py_ssize_t _D_PLEN = field_offset(DATA_PDU_HEADER, "plen")
cdef Py_ssize_t _D_CID = field_offset(DATA_PDU_HEADER, "cccid")
cdef Py_ssize_t _D_TTAG = field_offset(DATA_PDU_HEADER, "ttag")  # an R2T's fields sit where a data PDU's do
cdef Py_ssize_t _D_DATAO = field_offset(DATA_PDU_HEADER, "datao")
cdef Py_ssize_t _D_DATAL = field_offset(DATA_PDU_HEADER, "datal")
cdef Py_ssize_t _CQE_AT = COMMON_HEADER_SIZE  # the CQE follows the CapsuleResp's common header

cdef int _LAST = PduFlags.LAST_PDU
cdef int _LAST_SUCCESS = PduFlags.LAST_PDU | PduFlags.SUCCESS
cdef int _CAPSULE_CMD = PduType.CAPSULE_CMD
cdef int _H2C_DATA = PduType.H2C_DATA
cdef Py_ssize_t _F_SLBA = IO_SLBA  # indices into Request.fields (the SQE unpacked as IO_COMMAND)
cdef Py_ssize_t _F_CONTROL = IO_CONTROL

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

    cdef readonly unsigned int cid
    cdef readonly Py_ssize_t length
    cdef readonly bytearray data
    """Where the H2CData is placed: uninitialised, as ``blockd.tcp_pdu.data_buffer`` gives it
    (no byte is read before all are received)."""
    cdef readonly bytes sqe
    cdef readonly long long start_ns
    cdef object nsobj
    cdef FastNamespace ns
    cdef off_t offset


# -- the I/O path of one TCP connection --------------------------------------------------------------

cdef class TcpFastPath:
    """Serves the steady-state Read and Write capsules of one NVMe/TCP I/O queue (module docstring),
    and runs the connection's receive loop in C (:meth:`buffer_updated`)."""

    cdef object conn
    cdef PduReader reader
    cdef object py_buffer_updated
    cdef object queue
    cdef object ctrl
    cdef OutputBatcher out
    cdef object transport
    cdef IoCounters counters
    cdef bint _bound
    cdef bint _off
    cdef QueueShape shape
    """The queue's fixed fields, taken when it binds (``target/_io_core.pxd``)."""
    cdef Py_ssize_t max_transfer
    cdef Py_ssize_t flush_at
    cdef Py_ssize_t r2t_per_queue
    cdef object unsent
    cdef object write_buffer_size
    cdef int sock
    cdef object pipe
    cdef int pipe_r
    cdef int pipe_w
    cdef Py_ssize_t pipe_room
    cdef Py_ssize_t pipe_data_room
    """The largest R2T write data the pipe is known to hold (:meth:`_pipe_holds`)."""
    cdef Py_ssize_t pipe_data_refused
    """The smallest it could not be grown to hold: not asked again."""
    cdef Py_ssize_t by_reference_min
    cdef public unsigned long long served
    """Commands answered here (the tests check that the fast path ran)."""
    cdef public unsigned long long by_reference
    """Reads of those whose data went by reference (:meth:`_read_by_reference`)."""
    cdef public unsigned long long spilled
    """Of those, the ones of which the socket did not take all, the rest going through the
    transport (the tests check that the fallback ran)."""
    cdef bint thread_enabled
    cdef readonly bint threaded
    """The socket is the queue's thread's (:meth:`_run`), from the loop's entry to its
    :meth:`_returned`: the loop does not read it, nor touch the reader."""
    cdef int _tfd
    cdef bint _stopping
    cdef bint _broken
    cdef bint _eof
    cdef bint _waiting
    cdef bint _thread_done
    cdef object _thread
    cdef object _wake
    cdef object _loop
    cdef list _replies
    """Replies of the commands the thread served since its last send (:meth:`_send_replies`)."""
    cdef list _handoff
    """R2T writes the thread received whole and did not write, left to the loop (:meth:`_returned`):
    (tag, 0) each, its data in its buffer; or (tag, errno) for one the file refused by splice."""
    cdef Py_ssize_t _gathered
    """Their bytes."""
    cdef public unsigned long long thread_entries
    """Times the queue went to its thread."""
    cdef public unsigned long long thread_served
    """Commands served on the thread (also counted in ``served``)."""
    cdef public unsigned long long thread_sends
    """Batches of their replies the thread sent (:meth:`_send_replies`)."""
    cdef public unsigned long long thread_data
    """H2CData PDUs the thread took (:meth:`_h2c_on_thread`)."""
    cdef public unsigned long long thread_spliced
    """Of the R2T writes it wrote, those whose data went from the socket to the file through
    the pipe (:meth:`_h2c_by_reference`)."""

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

    # -- the receive loop ----------------------------------------------------------------------------

    def get_buffer(self, Py_ssize_t sizehint):
        """``PduProtocol.get_buffer``: where the socket's next bytes go (the reader's staging)."""
        reader = self.conn.reader
        if reader is self.reader:
            return self.reader.get_buffer(sizehint)
        return reader.get_buffer(sizehint)  # a terminated connection's discarding reader

    def buffer_updated(self, Py_ssize_t nbytes):
        """``PduProtocol.buffer_updated`` with ``TcpTargetConnection._receive`` in C: the
        connection's receive callback (the connection binds it in place of its own, so the
        event loop calls it directly). Every PDU the reader completes is handled in arrival
        order: a whole command capsule in staging that the fast path serves is served from
        there (no ``Pdu``, no ``place`` buffer, no Python call); every other PDU is taken from
        the reader as ``_receive`` takes it and handed to ``TcpTargetConnection.take_pdu``, the
        Python path's own handler, with the same stop when the connection pauses; framing and
        digest errors go to ``terminate`` and ``digest_error`` as there."""
        conn = self.conn
        if self.threaded:
            return  # the thread owns the reader (a resume's take-waiting): _returned takes what it left
        if self.reader is None or conn.reader is not self.reader:
            return self.py_buffer_updated(conn, nbytes)  # terminated: the Python path discards
        cdef OutputBatcher out = conn.out  # the compiled one: the compiled twins run together
        if out is None:  # a refused connection (never connected): what the Python path does with it
            return self.py_buffer_updated(conn, nbytes)
        out._hold()
        try:
            self._receive(nbytes)
        finally:
            out._release()
        if self.thread_enabled:
            self._to_thread()

    cdef int _receive(self, Py_ssize_t nbytes) except -1:
        cdef PduReader reader = self.reader
        cdef Py_ssize_t plen
        conn = self.conn
        while True:
            try:
                if reader.advance(nbytes):
                    while True:
                        if not self._off and (self._bound or self._bind()):
                            plen = reader.whole(_CAPSULE_CMD)
                            if plen >= 0 and self._serve_staged(reader, plen):
                                reader.skip(plen)
                                if conn.paused:  # the rest stays in the reader until resume_writing
                                    return 0
                                continue
                        pdu = reader.take()
                        if pdu is None:
                            return 0
                        if not conn.take_pdu(pdu):
                            return 0
                return 0
            except FramingError as exc:
                conn.terminate(exc)
                return 0
            except DataDigestError as exc:
                conn.digest_error(exc)
                if conn.transport.is_closing():
                    return 0
                nbytes = 0  # the reader skipped the bad PDU; go on with what follows it

    cdef bint _serve_staged(self, PduReader reader, Py_ssize_t plen) except -1:
        """Serve the whole CapsuleCmd at the reader's position from staging, if the fast path can."""
        cdef long long start = now_ns()
        cdef const unsigned char* h = reader._p + reader._start
        cdef Py_ssize_t hlen = h[_O_HLEN_CMD]
        cdef Py_ssize_t dlen = plen - hlen
        if dlen > self.shape.inline_size:
            return False  # the connection's place callback refuses it (a framing error): Python's
        return self._serve(h, hlen, h + hlen if dlen else NULL, dlen, start)

    # -- the queue's thread (docs/dataplane.md, "The target's threaded queue") -----------------------

    cdef int _to_thread(self) except -1:
        """Give the socket to the queue's thread when the queue is idle: bound to this path, no
        command of the Python side in flight (none in the queue, no R2T pending or waiting),
        nothing unsent (batcher, transport, pipe), no part of a PDU in the reader, not paused or
        closing. Then nothing the loop does writes to the socket or reads it until the thread
        hands it back (:meth:`_returned`), so the wire order is the reference's."""
        conn = self.conn
        cdef PduReader reader = self.reader
        if (self.threaded or self._stopping or self._thread_done or not self._bound or self._off
                or self.sock < 0 or conn.paused or conn.reader is not reader or reader._pl_dest is not None
                or reader._end != reader._start or self.out._bufs or self.queue.in_flight
                or conn.r2t_pending or conn.r2t_waiting or self.transport.is_closing() or self.write_buffer_size()):
            return 0
        pipe = conn.pipe
        if pipe is not None and pipe.queued:
            return 0
        if self._thread is None:
            # the thread's own descriptor: a close by the loop can never make it use a number
            # reused by then (the loop ends it with shutdown(), which acts on the socket)
            self._tfd = dup(self.sock)
            if self._tfd < 0:
                self._thread_done = True
                return 0
            self._loop = asyncio.get_running_loop()
            self._wake = threading.Lock()
            self._wake.acquire()
            self._waiting = True
            self._thread = threading.Thread(target=self._run, name=f"blockd-tcp-q{self.shape.qid}", daemon=True)
            self._thread.start()
            log.info("I/O queue served by its own thread", qid=self.shape.qid, peer=self.queue.peer)
        elif not self._waiting:
            return 0  # between its hand-back and its wait: the next idle receive gives it the socket
        self.transport.pause_reading()
        self.threaded = True
        self.thread_entries += 1
        self._waiting = False
        self._wake.release()
        return 0

    def _run(self):
        """The queue's thread: waits to be given the socket, serves steady Reads and Writes
        (in-capsule or by R2T) from it (:meth:`_serve_thread`), hands it back to the loop
        (:meth:`_returned`), and waits again; ends when the connection ends (the loop's
        :meth:`stop_thread`, or the socket did). The GIL is held for the per-command work and
        released around every system call."""
        cdef int ended = 0
        cdef int fd = self._tfd
        cdef int flags
        try:
            while not ended:
                self._wake.acquire()
                if self._stopping:
                    break
                flags = fcntl(fd, F_GETFL)  # one open file with the loop's descriptor: shared flags
                fcntl(fd, F_SETFL, flags & ~O_NONBLOCK)  # the loop neither reads nor writes it now
                try:
                    ended = self._serve_thread(fd)
                except Exception:  # a bug: the connection ends, never left with a stream cut part way
                    log.exception("I/O queue thread failed; ending the connection", qid=self.shape.qid)
                    shutdown(fd, SHUT_RDWR)
                    ended = 1
                finally:
                    fcntl(fd, F_SETFL, flags | O_NONBLOCK)  # before the loop reads it again
                    if self._stopping:  # stop_thread has been: it will not wake a wait any more
                        ended = 1
                    self._waiting = not ended
                    try:
                        self._loop.call_soon_threadsafe(self._returned)
                    except RuntimeError:  # the loop is closed: the daemon has stopped
                        ended = 1
        finally:
            self._thread_done = True
            self._tfd = -1  # under the GIL, so the loop's shutdown() never sees a closed number
            close(fd)

    cdef int _serve_thread(self, int fd) except -1:
        """Serve whole CapsuleCmds from the reader while it has them and receive more into it;
        0: a PDU or command this thread does not serve (left whole or in part in the reader), or
        the queue paused, closing or stopping: the loop goes on from there; 1: the socket ended.
        The replies it gathered are sent before it hands back (the loop's come after them)."""
        self._replies = []
        self._gathered = 0
        try:
            return self._serve_received(fd)
        finally:
            self._send_replies()

    cdef int _serve_received(self, int fd) except -1:
        cdef PduReader reader = self.reader
        cdef Py_ssize_t plen, pending, room, n
        cdef int taken
        cdef const unsigned char* h
        cdef unsigned char* p
        conn = self.conn
        transport = self.transport
        while True:
            while True:
                if self._broken:
                    return 1
                if self._stopping or conn.paused or transport.is_closing():
                    return 0
                plen = reader.whole(_CAPSULE_CMD)
                if plen >= 0:
                    if not self._serve_staged(reader, plen):
                        return 0
                    reader.skip(plen)
                    continue
                pending = reader._end - reader._start
                if pending >= _HDR:
                    h = reader._p + reader._start
                    if h[_O_TYPE] == _H2C_DATA:
                        if pending < _DATA_HLEN:  # wait for the rest of its header if it can be one
                            if h[_O_HLEN_CMD] != _DATA_HLEN:
                                return 0
                            break
                        taken = self._h2c_on_thread(reader, fd)
                        if taken < 0:
                            return 1
                        if not taken:
                            return 0
                        continue
                    if not self._awaited(h, pending, reader._size):
                        return 0
                break
            # every whole capsule received is served: their replies go in one sendmsg, as the
            # loop sends one batch per receive (one send per reply cost the VM bed's QD32 a
            # quarter of its IOPS in system time, 221 -> 348 us per I/O)
            self._send_replies()
            if self._broken:
                return 1
            reader.get_buffer(-1)  # room for the rest (moves the PDU begun to the front if need be)
            p = reader._p + reader._end
            room = reader._size - reader._end
            if room <= 0:
                return 0
            with nogil:
                n = recv(fd, p, room, 0)
                while n < 0 and errno == EINTR:
                    n = recv(fd, p, room, 0)
            if n <= 0:
                self._eof = n == 0  # else an error: the loop's read meets it too
                return 1
            reader.advance(n)

    cdef int _h2c_on_thread(self, PduReader reader, int fd) except -2:
        """The H2CData at the reader's position (its header in staging) for an R2T write that
        this thread sent, in the steady case: its data into the write's buffer (what staging
        holds of it, then the rest received straight into it), and the write written and answered
        (:meth:`_written`) once its last PDU is in. 1: taken; 0: any other PDU or case, left
        whole in the reader for the loop (``TcpTargetConnection._place`` and ``_h2c_data`` judge
        it as ever, the write still in ``r2t_pending``); -1: the socket ended. A large write in
        one PDU goes through the connection's pipe instead, socket to file
        (:meth:`_h2c_by_reference`).

        What is taken here is exactly what ``PduReader._next``, ``_place`` and ``_h2c_data``
        accept without a word: no digest or other flag but LAST_PDU, and that one on the last
        PDU only; HLEN, PDO, PLEN and DATAL in agreement; no more data than the reader takes;
        a tag of this thread's R2T (its :class:`R2tWrite`), the command's CID, the offset the
        data has reached and the range asked for. The PDU stays at the reader's position
        (``in_pdu``) until its data is all in, so the loop's PDU timeout ends a host that stops
        in the middle as it would on the loop. These writes used to hand the socket back to the
        loop, one hand-back and one re-entry per write, about 20 system calls per 1 MiB write
        (``strace -c``), the target's user time 77-80 us of it."""
        cdef const unsigned char* h = reader._p + reader._start
        cdef int flags = h[_O_HFLAGS]
        cdef Py_ssize_t plen = le32(h + _O_PLEN)
        cdef Py_ssize_t datao = le32(h + _D_DATAO)
        cdef Py_ssize_t datal = le32(h + _D_DATAL)
        cdef Py_ssize_t have, rest, n = 0, got, received
        cdef unsigned int ttag
        cdef unsigned char* dst
        cdef R2tWrite w
        cdef bint last
        cdef int ffd
        conn = self.conn
        if (flags & ~_LAST or h[_O_HLEN_CMD] != _DATA_HLEN or h[_O_PDO] != _DATA_HLEN or datal <= 0
                or plen != _DATA_HLEN + datal or datal > reader.max_data):
            return 0
        ttag = le16(h + _D_TTAG)
        entry = conn.r2t_pending.get(ttag)
        if entry is None or type(entry[0]) is not R2tWrite:
            return 0
        w = <R2tWrite>entry[0]
        received = entry[1]
        last = datao + datal == w.length
        if (w.cid != le16(h + _D_CID) or datao != received or datao + datal > w.length
                or last != (flags == _LAST)):
            return 0
        dst = <unsigned char*>PyByteArray_AS_STRING(w.data) + datao
        have = min(reader._end - reader._start - _DATA_HLEN, datal)
        memcpy(dst, h + _DATA_HLEN, have)
        rest = datal - have
        if rest:
            self._send_replies()  # what this receive served goes out before the thread waits
            if self._broken:
                return -1
            if datao == 0 and last and rest >= self.by_reference_min and self._pipe_holds(rest):
                ffd = self._write_fd(w.nsobj, w.ns)
                if ffd >= 0:
                    return self._h2c_by_reference(reader, fd, ffd, w, ttag, h + _DATA_HLEN, have)
            got = have
            with nogil:
                while rest > 0:
                    n = recv(fd, dst + got, rest, MSG_WAITALL)
                    if n > 0:
                        got += n
                        rest -= n
                    elif n < 0 and errno == EINTR:
                        continue
                    else:
                        break
            if rest:
                self._eof = n == 0  # else an error: the loop's read meets it too
                return -1
        reader.skip(_DATA_HLEN + have)
        self.thread_data += 1
        if self._stopping:
            return -1  # the connection ends: connection_lost fails the write (r2t_pending)
        if not last:
            conn.r2t_pending[ttag] = (w, received + datal)
            return 1
        del conn.r2t_pending[ttag]
        if self._written(w.nsobj, w.ns, w.offset, w.data, w.length, w.cid, w.start_ns, w.length):
            return 1
        # the namespace changed or the write failed: the loop's data_ready, first thing on return
        conn.r2t_pending[ttag] = (w, w.length)
        self._handoff.append((ttag, 0))
        return 0

    cdef int _h2c_by_reference(self, PduReader reader, int sock, int fd, R2tWrite w, unsigned int ttag,
                               const unsigned char* staged, Py_ssize_t have) except -2:
        """A whole R2T write in one H2CData PDU, its first ``have`` bytes in staging after the
        header, the rest in the socket: written to the file through the connection's pipe
        (:func:`_splice_write`: one copy of the data, the file's own, where ``recv`` into the
        buffer and ``pwrite`` make two) and answered as :meth:`_written` answers, 1. The
        namespace was checked when the header came (as a capsule's is when it comes). If the
        file refuses the data, the write goes back to ``r2t_pending`` for the loop's queue to
        fail as its own failed write ends (``TargetQueue.write_failed``), 0; -1: the socket
        ended, the write left to ``connection_lost``.

        Measured before it (1 MiB on loopback TCP into tmpfs, pinned to one CPU as the FUSE
        bench is, alternated): the receiver's system time 247-266 -> 189-210 us per MiB with
        the data put whole in a 1 MiB pipe first, about the same as splicing to the file as the
        data comes (186-211), which is kept for a pipe that fills only: a host that stops part
        way would leave part of the write in the file (docs/dataplane.md, "R2T write data
        through the pipe")."""
        cdef int error = 0, how
        cdef int pr = self.pipe_r, pw = self.pipe_w
        cdef Py_ssize_t length = w.length
        cdef off_t offset = w.offset
        with nogil:
            how = _splice_write(sock, pr, pw, fd, offset, staged, have, length, &error)
        if how == _HOST_CLOSED or how == _SOCKET_FAILED:
            self.pipe.discard()
            self._eof = how == _HOST_CLOSED  # else an error: the loop's read meets it too
            return -1
        reader.skip(_DATA_HLEN + have)
        self.thread_data += 1
        if self._stopping:
            return -1  # the connection ends: connection_lost fails the write (r2t_pending)
        if how == _SPLICED:
            del self.conn.r2t_pending[ttag]
            self.thread_spliced += 1
            self._answer_write(w.nsobj, w.ns, length, w.cid, w.start_ns, length)
            return 1
        self.conn.r2t_pending[ttag] = (w, length)
        self._handoff.append((ttag, error))
        return 0

    cdef bint _pipe_holds(self, Py_ssize_t length) except -1:
        """Whether the connection's pipe can hold ``length`` bytes of an R2T write's data (grown
        if need be; a Python call only for a length larger than any asked before). On the
        queue's thread the pipe is empty between commands (:meth:`_read_by_reference` drains
        it whole; :meth:`_to_thread` gives no queued pipe to the thread)."""
        if length <= self.pipe_data_room:
            return True
        if length >= self.pipe_data_refused:
            return False
        pipe = self._connection_pipe()
        if pipe.queued:
            return False
        if not pipe.holds(length):
            self.pipe_data_refused = length
            return False
        self.pipe_data_room = length
        return True

    cdef object _connection_pipe(self):
        """The connection's pipe (made on first use), its descriptors taken as C fields."""
        pipe = self.conn.reply_pipe()
        self.pipe = pipe
        self.pipe_r = pipe.r
        self.pipe_w = pipe.w
        return pipe

    cdef bint _awaited(self, const unsigned char* h, Py_ssize_t pending, Py_ssize_t room) noexcept:
        """Whether the begun PDU at ``h`` (its common header in) is a CapsuleCmd that
        ``PduReader.whole`` will give whole once the rest is in, that this path may serve
        (in-capsule data within the queue's size) and that staging holds: only then does the
        thread wait for it. Any other header is the loop's to judge at once, as its reader
        judges headers (a framing error comes when the header does, not when PLEN bytes have)."""
        cdef Py_ssize_t hlen = h[_O_HLEN_CMD]
        cdef Py_ssize_t plen = le32(h + _O_PLEN)
        return (h[_O_TYPE] == _CAPSULE_CMD and not h[_O_HFLAGS] & _DIGEST_FLAGS and hlen == _SQE_AT + _SQE_SIZE
                and hlen <= plen <= hlen + self.shape.inline_size and (plen == hlen or h[_O_PDO] == hlen)
                and pending < plen <= room)

    def _returned(self):
        """The thread handed the socket back (the loop's callback): what it left in the reader
        goes the ordinary way (``take_pdu``, the Python queue), then the loop reads again; the next
        idle receive may give the socket to the thread again."""
        self.threaded = False
        conn = self.conn
        if self._handoff:  # R2T writes whose data the thread took and could not write
            handoff, self._handoff = self._handoff, []
            for ttag, error in handoff:
                entry = conn.r2t_pending.pop(ttag, None)
                if entry is None:
                    continue  # connection_lost failed it already
                if error:  # its data went to the file by splice, which refused it (_h2c_by_reference)
                    self.queue.write_failed(self.request(entry[0]), OSError(error, os.strerror(error)))
                else:
                    self.data_ready(entry[0])
        if self.transport.is_closing() or conn.paused:
            return  # closing: connection_lost follows; paused: resume_writing reads again
        if self._eof:  # the host closed: what the loop does at end of stream, now (its QIDs free at once)
            self.buffer_updated(0)
            if not self.transport.is_closing():
                self.transport.close()
            return
        self.transport.resume_reading()
        self.buffer_updated(0)

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

    def stop_thread(self):
        """End the queue's thread (the connection closes): ``shutdown`` wakes it from ``recv``
        or ``send``, then the loop waits for it to leave, so no file descriptor or system call
        of it outlives the connection (namespaces close after their connections at stop)."""
        if self._thread is None:
            return
        self._stopping = True
        if self._tfd >= 0:
            shutdown(self._tfd, SHUT_RDWR)
        if self._waiting:
            self._waiting = False
            self._wake.release()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(THREAD_JOIN_TIMEOUT)

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
        if entry is None or self.transport.is_closing():
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
        if self.shape.sqhd_disabled:
            _c2h_header(p, cid, length, _LAST_SUCCESS)  # the data PDU completes the command
        else:
            _c2h_header(p, cid, length, _LAST)
            _capsule_resp(p + _DATA_HLEN + length, self._next_sqhd(), self.shape.qid, cid)
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

    def data_ready(self, req):
        """``TargetQueue.data_ready`` for an R2T write whose H2CData ``TcpTargetConnection`` has
        placed in ``req.data``: written and answered here if it is the steady-state case, else
        False with nothing done and the Python queue runs it. ``req`` is the :class:`R2tWrite` of
        an R2T sent here (always True: one whose write fails goes to the queue as its request), or
        the queue's own request when the queue sent the R2T (it waited for budget, or the path was
        not bound yet): served here if it is a plain Write without FUA to a namespace served here.
        Either holds what the queue holds until ``response_sent`` (:meth:`_send_r2t`); given back
        in :meth:`_written` at the points ``TargetQueue._complete``, ``queue_response`` and
        ``response_sent`` do."""
        cdef R2tWrite w
        if type(req) is R2tWrite:
            w = <R2tWrite>req
            if not self._written(w.nsobj, w.ns, w.offset, w.data, w.length, w.cid, w.start_ns, w.length):
                self.queue.data_ready(self.request(w))  # reports the error, or writes through a new backend
            return True
        if not self._bound or self._off or req.opcode != _WRITE or req.fields[_F_CONTROL] & _FUA:
            return False
        nsobj = req.ns
        fast = nsobj.fast
        if fast is None:
            return False
        cdef FastNamespace ns = <FastNamespace?>fast
        return self._written(nsobj, ns, <off_t>(<unsigned long long>req.fields[_F_SLBA] << ns.lba_shift), req.data,
                             req.length, req.cid, req.start_ns, req.transport_ctx)

    def request(self, req):
        """The queue's :class:`target.request.Request` for an :class:`R2tWrite` (``req`` itself
        if it is one already): the request ``TargetQueue.submit`` would have made and left
        waiting for its data, holding what the R2tWrite holds (so ``TargetQueue.data_failed``
        and ``data_ready`` end it as the queue ends its own)."""
        if type(req) is not R2tWrite:
            return req
        cdef R2tWrite w = <R2tWrite>req
        return self.queue.adopt_write(w.sqe, w.start_ns, w.nsobj, w.data, w.length)

    cdef bint _written(self, nsobj, FastNamespace ns, off_t offset, data, Py_ssize_t length, unsigned int cid,
                       long long start, held) except -1:
        """Write an R2T write's data from its buffer and answer it (:meth:`_answer_write`);
        False with nothing done if the namespace changed since it was checked or the write
        fails (the Python queue writes it then)."""
        cdef int fd = self._write_fd(nsobj, ns)
        if fd < 0:
            return False
        cdef Py_buffer db
        PyObject_GetBuffer(data, &db, PyBUF_SIMPLE)
        cdef const unsigned char* p = <const unsigned char*>db.buf
        cdef Py_ssize_t done = 0
        try:
            if db.len != length:
                return False
            with nogil:
                done = _pwrite_all(fd, p, length, offset)
        finally:
            PyBuffer_Release(&db)
        if done != length:
            return False
        self._answer_write(nsobj, ns, length, cid, start, held)
        return True

    cdef int _write_fd(self, nsobj, FastNamespace ns) except -2:
        """The file an R2T write's data goes to, or -1 if its namespace changed since it was
        checked or the connection is closing (the Python queue writes it then, or fails it)."""
        cdef FastFile f = ns.file
        if (not self._bound or self._off or not ns.accessible or f.fd < 0 or f.read_only
                or nsobj.backend is not ns.backend or self.transport.is_closing()):
            return -1
        return f.fd

    cdef int _answer_write(self, nsobj, FastNamespace ns, Py_ssize_t length, unsigned int cid, long long start,
                           held) except -1:
        """Answer an R2T write whose data is written, and give back what it held.

        On the queue's thread (:meth:`_h2c_on_thread`) the same, with what only the loop may do
        left to it: the namespace's last hold of a removed one closes its file there
        (``_release_namespace``: the loop may remove it while the write runs without the GIL),
        and the daemon-wide budget's waiting queues are woken there (``DataBudget.free``, then
        ``give(0)`` on the loop). No R2T of this connection waits for budget meanwhile: the
        queue goes to its thread only without one, and the thread hands back the capsule whose
        R2T would have to wait."""
        cdef bint threaded = self.threaded
        # TargetQueue._complete: SQHD, the counters from the capsule's arrival, the namespace
        cdef bytes resp = PyBytes_FromStringAndSize(NULL, _RESP_LEN)
        _capsule_resp(<unsigned char*>PyBytes_AS_STRING(resp), self._next_sqhd(), self.shape.qid, cid)
        self._complete(ns, _KIND_WRITE, length, start)
        if threaded:
            self._release_namespace(nsobj)
        else:
            # a removed namespace's copy is withdrawn (not accessible) before anything else, so
            # the queue, not this, gives back the last hold of one and closes its file
            nsobj.in_flight -= 1
        # TcpTargetConnection.queue_response: the buffer's budget back (and the R2Ts that lets go
        # out before this CapsuleResp), then the CapsuleResp; TargetQueue.response_sent: the slot
        conn = self.conn
        if held:
            conn.r2t_held -= held
            budget = conn.target.r2t_budget
            if not threaded:
                budget.give(held)
                if conn.r2t_waiting:
                    conn.send_r2ts()
            elif budget.free(held):
                self._loop.call_soon_threadsafe(budget.give, 0)
        self.served += 1  # before the reply can reach the host (_emit may send at once)
        if threaded:
            self._emit(resp)
        else:
            self.out._send((resp,))
        self.queue.in_flight -= 1
        return 0

    cdef unsigned int _next_sqhd(self) except? 0xFFFFFFFF:
        return next_sqhd(self.queue, &self.shape)

    cdef void _complete(self, FastNamespace ns, int kind, unsigned int length, long long start) noexcept:
        count_io(self.counters, ns, kind, length, start)
