# cython: language_level=3
"""The compiled twin of :class:`initiator.fuse.rangelock.RangeLocks` (see there for what the
locks guarantee and why a write takes one).

The same state (``active``, the ``exclusive`` count, the next token) and the same steps, with
``share_now`` and ``release`` as C methods (``_share_now``, ``_release``, declared in
``_rangelock.pxd``) that the compiled FUSE loop calls for every block-aligned write: they were
two Python frames per write, ~3.2k of the ~29.4k instructions of a 4 KiB write through
``tests/bench/bench_fuse_path.py`` (callgrind), of which the C calls save 2.0k (they still
make a token, a tuple and a dict entry, which an exclusive ``acquire`` must find). ``acquire`` (the read-modify-write's and the
waiting write's path) is the reference's coroutine, compiled as it is.
``tests/core/test_rangelock_differential.py`` drives both twins through the same random
acquire, ``share_now``, cancel and release sequences and compares every grant and the state.
"""

cimport cython

import asyncio


@cython.final
cdef class RangeLocks:
    """See :class:`initiator.fuse.rangelock.RangeLocks`."""

    def __init__(self):
        self.active = {}
        self.exclusive = 0
        self._next = 0

    async def acquire(self, start, end, exclusive):
        token = self._next
        self._next += 1
        self.active[token] = (start, end, exclusive, None)
        if exclusive:
            self.exclusive += 1
        elif not self.exclusive:
            return token
        try:
            while True:
                for t, (s, e, x, fut) in self.active.items():
                    if t == token:
                        return token
                    if s < end and start < e and (exclusive or x):
                        if fut is None:
                            fut = asyncio.get_running_loop().create_future()
                            self.active[t] = (s, e, x, fut)
                        await asyncio.wait((fut,))
                        break
        except BaseException:
            self._release(token)
            raise

    def share_now(self, start, end):
        return self._share_now(start, end)

    def release(self, token):
        self._release(token)

    cdef object _share_now(self, object start, object end):
        if self.exclusive:
            return None
        token = self._next
        self._next += 1
        self.active[token] = (start, end, False, None)
        return token

    cdef int _release(self, object token) except -1:
        cdef tuple hold = self.active.pop(token)
        if hold[2]:
            self.exclusive -= 1
        fut = hold[3]
        if fut is not None:
            fut.set_result(None)
        return 0
