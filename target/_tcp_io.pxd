# cython: language_level=3
"""Declarations of ``target/_tcp_io.pyx`` (serving one NVMe/TCP capsule: the twin of
``TcpTargetConnection.queue_response``/``fetch_data`` over the core) for ``target/_tcp_thread.pyx``,
whose :class:`TcpFastPath` derives from :class:`TcpServe`: the PDU layout both read, and the
class's fields and C methods."""

from posix.types cimport off_t

from blockd._iostats cimport IoCounters
from blockd._output cimport OutputBatcher
from blockd._pdu_reader cimport PduReader
from target._file_io cimport FastNamespace
from target._io_core cimport QueueShape
from target.replication._mirror_io cimport MirrorLane


# The PDU layout, from protocol/ at import (target/_tcp_io.pyx's _check_layouts checks it).
cdef Py_ssize_t _SQE_AT, _O_HLEN_CMD, _O_TYPE, _O_PLEN, _O_PDO, _O_HFLAGS, _HDR, _DATA_HLEN, _RESP_LEN
cdef Py_ssize_t _D_CID, _D_TTAG, _D_DATAO, _D_DATAL, _F_SLBA, _F_CONTROL
cdef int _DIGEST_FLAGS, _LAST, _CAPSULE_CMD, _H2C_DATA


cdef class R2tWrite:
    cdef readonly unsigned int cid
    cdef readonly Py_ssize_t length
    cdef readonly bytearray data
    # where the H2CData is placed: uninitialised, as blockd.tcp_pdu.data_buffer gives it (no byte
    # is read before all are received)
    cdef readonly bytes sqe
    cdef readonly long long start_ns
    cdef object nsobj
    cdef FastNamespace ns
    cdef off_t offset


cdef class TcpServe:
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
    # The queue's fixed fields, taken when it binds (``target/_io_core.pxd``).
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
    # The largest R2T write data the pipe is known to hold (:meth:`_pipe_holds`).
    cdef Py_ssize_t pipe_data_refused
    # The smallest it could not be grown to hold: not asked again.
    cdef Py_ssize_t by_reference_min
    cdef public unsigned long long served
    # Commands answered here (the tests check that the fast path ran).
    cdef public unsigned long long by_reference
    # Reads of those whose data went by reference (:meth:`_read_by_reference`).
    cdef public unsigned long long spilled
    # Of those, the ones of which the socket did not take all, the rest going through the
    # transport (the tests check that the fallback ran).
    cdef bint thread_enabled
    cdef readonly bint threaded
    # The socket is the queue's thread's (:meth:`_run`), from the loop's entry to its
    # :meth:`_returned`: the loop does not read it, nor touch the reader.
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
    # Replies of the commands the thread served since its last send (:meth:`_send_replies`).
    cdef list _handoff
    # R2T writes the thread received whole and did not write, left to the loop (:meth:`_returned`):
    # (tag, 0) each, its data in its buffer; or (tag, errno) for one the file refused by splice.
    cdef Py_ssize_t _gathered
    # Their bytes.
    cdef public unsigned long long thread_entries
    # Times the queue went to its thread.
    cdef public unsigned long long thread_served
    # Commands served on the thread (also counted in ``served``).
    cdef public unsigned long long thread_sends
    # Batches of their replies the thread sent (:meth:`_send_replies`).
    cdef public unsigned long long thread_data
    # H2CData PDUs the thread took (:meth:`_h2c_on_thread`).
    cdef public unsigned long long thread_spliced
    # Of the R2T writes it wrote, those whose data went from the socket to the file through
    # the pipe (:meth:`_h2c_by_reference`).

    cdef int _emit(self, bytes reply) except -1
    cdef int _gather(self, bytes reply) except -1
    cdef int _send_replies(self) except -1
    cdef bytes _capsule_reply(self, unsigned int cid)
    cdef object _connection_pipe(self)
    cdef int _hold_namespace(self, nsobj, FastNamespace ns) except -2
    cdef int _release_namespace(self, nsobj) except -1
    cdef bint _bind(self) except -1
    cdef bint _serve(self, const unsigned char* header, Py_ssize_t hlen, const unsigned char* data, Py_ssize_t dlen, long long start) except -1
    cdef bint _flush(self, unsigned int nsid, unsigned int cid, long long start) except -1
    cdef int _read_headers(self, unsigned char* p, unsigned int cid, unsigned int length) except -1
    cdef bint _read(self, nsobj, FastNamespace ns, int fd, off_t offset, unsigned int length, unsigned int cid, long long start) except -1
    cdef bint _by_reference(self, unsigned int length) except -1
    cdef bint _read_by_reference(self, nsobj, FastNamespace ns, int fd, off_t offset, unsigned int length, unsigned int cid, long long start) except -1
    cdef bint _write(self, nsobj, FastNamespace ns, int fd, off_t offset, unsigned int length, unsigned int cid, const unsigned char* data, long long start, bint fua) except -1
    cdef bint _send_r2t(self, nsobj, FastNamespace ns, off_t offset, unsigned int length, unsigned int cid, const unsigned char* header, long long start) except -1
    cdef bint _mirror_write(self, entry, MirrorLane lane, const unsigned char* header, unsigned long long offset, unsigned int length, unsigned int cid, const unsigned char* data, long long start) except -1
    cdef unsigned int _next_sqhd(self) except? 0xFFFFFFFF
    cdef void _complete(self, FastNamespace ns, int kind, unsigned int length, long long start) noexcept
