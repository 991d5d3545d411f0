# cython: language_level=3, boundscheck=False, wraparound=False
"""The compiled twin of :class:`blockd.output.OutputBatcher` (see there for what it does and why).

The same state and the same steps, as C fields and C methods (``_hold``, ``_release``,
``_send``, ``_flush``, declared in ``_output.pxd``) that the compiled host I/O and the target's
fast path call without a Python call; the Python methods are thin wrappers of them, for the
Python code of both ends and for the event loop's ``call_soon``. The transport's and the loop's
methods are called in the same order and with the same arguments as the reference's (the
differential test records them: ``tests/core/test_output_differential.py``).
"""

cimport cython

import asyncio

from cpython.list cimport PyList_GET_SIZE

from blockd.output import JOIN_LIMIT

cdef Py_ssize_t _JOIN_LIMIT = JOIN_LIMIT


@cython.final
cdef class OutputBatcher:
    """See :class:`blockd.output.OutputBatcher`."""

    def __init__(self, transport, on_backlog=None, loop=None):
        self.transport = transport
        self.on_backlog = on_backlog
        self._bufs = []
        self._held = 0
        self._scheduled = False
        self._loop = asyncio.get_running_loop() if loop is None else loop

    def hold(self):
        self._held += 1

    def release(self):
        self._release()

    def send(self, bufs):
        self._send(bufs)

    def flush(self):
        self._flush()

    def take(self):
        return self._take()

    cdef void _hold(self) noexcept:
        self._held += 1

    cdef int _release(self) except -1:
        self._held -= 1
        if not self._held and PyList_GET_SIZE(self._bufs):
            self._flush()
        return 0

    cdef int _send(self, bufs) except -1:
        self._bufs.extend(bufs)
        if not self._held and not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)
        return 0

    cdef list _take(self):
        cdef list bufs = self._bufs
        self._bufs = []
        return bufs

    cdef int _flush(self) except -1:
        cdef list bufs = self._bufs
        cdef Py_ssize_t n, i, total
        self._scheduled = False
        self._bufs = []
        n = PyList_GET_SIZE(bufs)
        transport = self.transport
        if not n or transport.is_closing():
            return 0
        if n == 1:
            transport.write(bufs[0])
        else:
            total = 0
            for i in range(n):
                total += len(bufs[i])
                if total > _JOIN_LIMIT:
                    break
            if total <= _JOIN_LIMIT:
                transport.write(b"".join(bufs))
            else:
                transport.writelines(bufs)
        if self.on_backlog is not None and transport.get_write_buffer_size():
            self.on_backlog()
        return 0
