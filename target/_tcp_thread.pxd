# cython: language_level=3
"""Declarations of ``target/_tcp_thread.pyx`` (the receive loop and the queue's thread of one
NVMe/TCP connection) for ``target/_uring_loop.pyx``, whose :class:`TcpUringPath` derives from
:class:`TcpFastPath` and replaces the thread's system calls with an io_uring."""

from posix.types cimport off_t

from blockd._pdu_reader cimport PduReader
from target._file_io cimport FastNamespace
from target._tcp_io cimport R2tWrite, TcpServe


cdef class TcpFastPath(TcpServe):
    cdef int _receive(self, Py_ssize_t nbytes) except -1
    cdef bint _serve_staged(self, PduReader reader, Py_ssize_t plen) except -1
    cdef int _to_thread(self) except -1
    cdef int _serve_thread(self, int fd) except -1
    cdef int _serve_received(self, int fd) except -1
    cdef int _fill(self, int fd) except -2
    cdef int _h2c_on_thread(self, PduReader reader, int fd) except -2
    cdef int _h2c_by_reference(self, PduReader reader, int sock, int fd, R2tWrite w, unsigned int ttag,
                               const unsigned char* staged, Py_ssize_t have) except -2
    cdef bint _pipe_holds(self, Py_ssize_t length) except -1
    cdef bint _awaited(self, const unsigned char* h, Py_ssize_t pending, Py_ssize_t room) noexcept
    cdef bint _written(self, nsobj, FastNamespace ns, off_t offset, data, Py_ssize_t length, unsigned int cid,
                       long long start, held) except -1
    cdef int _write_fd(self, nsobj, FastNamespace ns) except -2
    cdef int _answer_write(self, nsobj, FastNamespace ns, Py_ssize_t length, unsigned int cid, long long start,
                           held) except -1
