# cython: language_level=3
"""The compiled output batcher's C declarations, for the modules that send through it from C:
``initiator/_tcp_host_io.pyx`` (capsules, H2CData, the receive's hold/release) and
``target/_tcp_io.pyx`` (replies, the receive's hold/release, the read-data flush)."""

cimport cython


@cython.final
cdef class OutputBatcher:
    cdef public object transport
    cdef public object on_backlog
    cdef list _bufs
    cdef Py_ssize_t _held
    cdef bint _scheduled
    cdef object _loop

    cdef void _hold(self) noexcept
    cdef int _release(self) except -1
    cdef int _send(self, bufs) except -1
    cdef int _flush(self) except -1
    cdef list _take(self)
