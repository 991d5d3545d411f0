# cython: language_level=3
"""The compiled I/O lane (``initiator/_lane.pyx``), for ``initiator/fuse/_loop.pyx``: the compiled
FUSE loop calls :meth:`IoLane._transfer` in C rather than the lane's ``transfer`` as a Python
call with six arguments parsed, and :meth:`IoLane._submit_io` for an FSYNC's Flush."""

from libc.stdint cimport uint64_t

from blockd._iostats cimport IoCounters


cdef class IoLane:
    cdef object ctrl
    cdef object reference
    cdef object complete
    cdef object on_done
    cdef bint ready
    cdef list io
    cdef dict namespaces
    cdef uint64_t max_transfer
    cdef object time
    cdef IoCounters counters
    cdef object parked_io
    cdef object parked_admin
    cdef double timeout

    cdef int _transfer(self, bint write, nsid, offset, buf, done, fua) except -1
    cdef bint _send(self, bint write, nsid, offset, buf, done, fua) except -1
    cdef int _submit_io(self, sqe, data_out, data_in, done) except -1
    cdef bint _send_sqe(self, sqe, data_out, data_in, done) except -1
