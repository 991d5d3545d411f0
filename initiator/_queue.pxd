# cython: language_level=3
"""The compiled host command and queue (``initiator/_queue.pyx``), for other ``.pyx`` modules:
``initiator/_tcp_host_io.pyx`` reads and sets a command's fields and takes, looks up and frees
command ids with C calls; ``initiator/_lane.pyx`` counts a completion with ``_count``, and sends
through any compiled transport's connection by :class:`HostConnection`, their C base."""

from libc.stdint cimport uint16_t, uint64_t

from blockd._iostats cimport IoCounters


cdef class HostCommand:
    cdef public bytearray sqe
    cdef public object data_out
    cdef public object data_in
    cdef public int cid
    cdef public Py_ssize_t transferred
    cdef public int status
    cdef public unsigned int dw0
    cdef public unsigned int dw1
    cdef public object on_done
    cdef public double deadline
    cdef public long long sent_ns
    cdef public int attempts
    cdef public double path_retry_until

    cdef int _done(self, exc) except -1
    cdef int _count(self, IoCounters counters, long long now_ns) except -1


cdef class Command(HostCommand):
    cdef public object done
    cdef public double timeout


cdef class HostQueue:
    cdef readonly int qid
    cdef readonly int depth
    cdef list _slots
    cdef uint16_t* _free
    cdef uint64_t* _started
    cdef int _head
    cdef int _count
    cdef uint64_t _starts

    cdef int _start(self, HostCommand cmd) except -1
    cdef HostCommand _get(self, Py_ssize_t cid)
    cdef HostCommand _finish(self, Py_ssize_t cid)


cdef class HostConnection:
    cdef public HostQueue queue
    cdef public bint closed

    cdef int _send_now(self, HostCommand cmd) except -1
