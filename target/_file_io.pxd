# cython: language_level=3
"""Declarations of ``target/_file_io.pyx`` (the twin of ``FileBackend`` and ``file_send.py``) for
the transports that cimport it: the C copies of the storage, the range check, and the file's
``pwrite``/``splice`` loops."""

from posix.types cimport off_t
from posix.unistd cimport pwrite

from blockd._iostats cimport IoCounters


cdef class FastFile:
    cdef public int fd
    cdef public unsigned long long size
    cdef public bint read_only


cdef class FastNamespace:
    cdef public FastFile file
    cdef public object backend
    cdef public int lba_shift
    cdef public IoCounters counters
    cdef public bint accessible


cdef enum:
    # how _splice_write ended
    _SPLICED = 0  # all of the data in the file
    _HOST_CLOSED = 1
    _SOCKET_FAILED = 2
    _FILE_REFUSED = 3


cdef inline Py_ssize_t _pwrite_all(int fd, const unsigned char* p, Py_ssize_t length, off_t offset) noexcept nogil:
    """Write ``length`` bytes at ``offset``; the bytes written before the first short or failed
    ``pwrite`` (``length`` when all went). Inline: every in-capsule write runs it."""
    cdef Py_ssize_t done = 0, n
    while done < length:
        n = pwrite(fd, p + done, length - done, offset + done)
        if n <= 0:
            break
        done += n
    return done


cdef FastNamespace served_namespace(object entry, unsigned long long slba, unsigned int nlb, unsigned int length)
cdef Py_ssize_t _splice_all(int fd_in, off_t* off_in, int fd_out, Py_ssize_t length) noexcept nogil
cdef bint _splice_out(int pipe_r, int sock, Py_ssize_t length) noexcept nogil
cdef int _splice_write(int sock, int pipe_r, int pipe_w, int fd, off_t offset, const unsigned char* staged,
                       Py_ssize_t have, Py_ssize_t length, int* error) noexcept nogil
cdef Py_ssize_t _read_pipe(int pipe_r, unsigned char* p, Py_ssize_t length) noexcept nogil
