# cython: language_level=3
"""The compiled range locks' C declarations (``initiator/fuse/_rangelock.pyx``), for
``initiator/fuse/_loop.pyx``: a block-aligned write's shared hold is taken and released with
a C call."""

cimport cython


@cython.final
cdef class RangeLocks:
    cdef public dict active
    cdef public Py_ssize_t exclusive
    cdef Py_ssize_t _next

    cdef object _share_now(self, object start, object end)
    cdef int _release(self, object token) except -1
