# cython: language_level=3
"""The compiled in-capsule write data's C declarations (``initiator/_inline.pyx``), for the
compiled FUSE loop (which makes it) and the compiled NVMe/TCP host I/O (which frames it)."""

cimport cython


@cython.final
cdef class InlineData:
    cdef bytes buf
    cdef Py_ssize_t n

    cdef char* _room(self) noexcept


cdef InlineData inline_data(const char* data, Py_ssize_t n)
