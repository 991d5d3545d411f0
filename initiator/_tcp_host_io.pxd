# cython: language_level=3
"""The compiled TCP host I/O (``initiator/_tcp_host_io.pyx``), for ``initiator/_lane.pyx``: the
lane sends its command through :meth:`TcpHostIo._send_now` (the batcher's hold, the submit and
the release in C) instead of three Python method calls (~3.2k instructions per I/O)."""

from libc.stdint cimport uint8_t

from blockd._output cimport OutputBatcher
from blockd._pdu_reader cimport PduReader
from initiator._queue cimport HostCommand, HostConnection, HostQueue


cdef class TcpHostIo(HostConnection):
    cdef public object reader
    cdef public object writer
    cdef public OutputBatcher out
    cdef public Py_ssize_t inline_limit
    cdef public Py_ssize_t maxh2cdata

    cdef int _submit(self, HostCommand cmd) except -1
    cdef int _send_now(self, HostCommand cmd) except -1
    cdef int _receive(self, Py_ssize_t nbytes) except -1
    cdef bint _staged_data(self, PduReader reader, Py_ssize_t plen) except -1
    cdef bint _staged_response(self, PduReader reader, Py_ssize_t plen) except -1
    cdef _response(self, header)
    cdef int _complete(self, const uint8_t* p, header) except -1
    cdef _c2h_data(self, header, int status=*)
    cdef _r2t(self, header)
