# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The compiled twin of :mod:`initiator.queue`: a host command and one queue's command ids.

Same behaviour as the Python reference (``tests/core/test_host_queue_differential.py`` drives
both with the same random start/finish/complete/fail/expire/take_all/count sequences and
compares every id, SQE, returned command, callback and counter): ids are handed out oldest-freed first (a FIFO,
so an id just finished is the last to be reused and a late answer for it finds nothing),
``take_all`` and ``expired`` list commands in the order they were started.

What changes is the cost per command: :class:`HostCommand`'s fields are C fields set by a C
``__init__`` (the controller makes one per I/O), the free ids are a C ring and the commands in
flight a preallocated slot list indexed by id (no deque, no dict insert and pop), the id is
stored into the SQE through a pointer, and ``complete``/``fail`` are C methods. ``pending`` is
built on demand for the rare readers (metrics, tests); the per-I/O lookup is ``get``.

The id's and the opcode's offsets in the SQE come from ``protocol/`` at import, the opcode ->
kind table from ``blockd.iostats`` (``count``: the completion's counters, counted from C into
the compiled :class:`blockd._iostats.IoCounters`).
"""

from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport uint8_t, uint16_t, uint64_t

from blockd._iostats cimport IoCounters
from blockd._le cimport st16

import math

from blockd.iostats import KIND_BY_OPCODE
from protocol.commands import SQE_CID_OFFSET
from protocol.layout import field_offset
from protocol.nvme import SQE, SQE_FAST

cdef Py_ssize_t _O_CID = SQE_CID_OFFSET
cdef Py_ssize_t _O_OPCODE = field_offset(SQE, "opcode")
cdef uint8_t _KIND[256]
if len(KIND_BY_OPCODE) != 256:
    raise ImportError("blockd.iostats.KIND_BY_OPCODE is not one kind per opcode byte")
for _op, _kind in enumerate(KIND_BY_OPCODE):
    _KIND[_op] = _kind


cdef class HostCommand:
    """See :class:`initiator.queue.HostCommand` (the reference): the same fields, as C fields."""

    def __init__(self, bytearray sqe, data_out=None, data_in=None, on_done=None, double deadline=math.inf):
        self.sqe = sqe
        self.data_out = data_out
        self.data_in = data_in
        self.cid = -1
        self.transferred = 0
        self.status = 0
        self.dw0 = 0
        self.dw1 = 0
        self.on_done = on_done
        self.deadline = deadline
        self.sent_ns = 0
        self.attempts = 0
        self.path_retry_until = 0.0

    def __repr__(self):
        return f"HostCommand(opcode={SQE_FAST.as_dict(self.sqe)['opcode']:#x}, cid={self.cid}, status={self.status:#x})"

    @property
    def length(self):
        if self.data_out is not None:
            return len(self.data_out)
        if self.data_in is not None:
            return len(self.data_in)
        return 0

    @property
    def finished(self):
        return self.on_done is None

    def count(self, IoCounters counters, long long now_ns):
        """See the reference: the same count, into the compiled counters from C."""
        self._count(counters, now_ns)

    cdef int _count(self, IoCounters counters, long long now_ns) except -1:
        cdef uint64_t ns = 0
        cdef bytearray sqe = self.sqe
        if PyByteArray_GET_SIZE(sqe) <= _O_OPCODE:
            raise IndexError("bytearray index out of range")  # as the reference's sqe[offset]
        if self.sent_ns and now_ns > self.sent_ns:
            ns = <uint64_t>(now_ns - self.sent_ns)
        data = self.data_in if self.data_in is not None else self.data_out
        counters._count(_KIND[<uint8_t>PyByteArray_AS_STRING(sqe)[_O_OPCODE]],
                        len(data) if data is not None else 0, ns)
        return 0

    def complete(self):
        """The target answered (with any status); runs ``on_done`` once."""
        self._done(None)

    def fail(self, exc):
        """The command will not complete; runs ``on_done`` once with ``exc``."""
        self._done(exc)

    cdef int _done(self, exc) except -1:
        done = self.on_done
        self.on_done = None
        if done is not None:
            done(self, exc)
        return 0


cdef class Command(HostCommand):
    """See :class:`initiator.queue.Command`: ``done`` and ``timeout`` as C fields."""

    admin = False
    """Sent on the admin queue (a class attribute, as in the reference)."""


cdef class AdminCommand(Command):
    admin = True


cdef class HostConnection:
    """The C base of a compiled transport's per-queue connection
    (:class:`initiator.controller.QueueConnection` in C): its queue and ``closed`` as C fields, and
    :meth:`_send_now`, the send the compiled lane (``initiator/_lane.pyx``) calls without asking
    which transport it is. A transport that has nothing faster keeps this one, the controller's
    own ``hold``, ``submit`` and ``release``; the compiled TCP connection
    (``initiator/_tcp_host_io.pyx``) overrides it with its batcher's C steps."""

    cdef int _send_now(self, HostCommand cmd) except -1:
        """``hold()``, ``submit(cmd)``, ``release()``, as ``Controller._send`` calls them: the
        command goes out now unless a hold further up keeps it."""
        self.hold()
        try:
            self.submit(cmd)
        finally:
            self.release()
        return 0


cdef class HostQueue:
    """See :class:`initiator.queue.HostQueue` (the reference)."""

    # Fields (in _queue.pxd): ``_slots`` the command in flight under each id (None when free);
    # ``_free`` a ring of the free ids, oldest-freed first, ``_count`` of them from ``_head``;
    # ``_started[cid]`` when that id was started (a counter, ``_starts``): the reference's dict
    # order, for the rare paths that list commands.

    def __cinit__(self, int qid, int depth):
        if not 1 <= depth <= 65536:
            raise ValueError(f"queue depth {depth} is not 1 to 65536")
        self._free = <uint16_t*>PyMem_Malloc(depth * sizeof(uint16_t))
        self._started = <uint64_t*>PyMem_Malloc(depth * sizeof(uint64_t))
        if self._free is NULL or self._started is NULL:
            raise MemoryError()

    def __init__(self, int qid, int depth):
        cdef int i
        self.qid = qid
        self.depth = depth
        self._slots = [None] * depth
        for i in range(depth):
            self._free[i] = <uint16_t>i
        self._head = 0
        self._count = depth
        self._starts = 0

    def __dealloc__(self):
        PyMem_Free(self._free)
        PyMem_Free(self._started)

    @property
    def has_room(self):
        return self._count > 0

    def start(self, HostCommand cmd):
        """Give ``cmd`` a command id and write it into the SQE."""
        self._start(cmd)

    cdef int _start(self, HostCommand cmd) except -1:
        cdef int cid
        cdef bytearray sqe = cmd.sqe
        if self._count == 0:
            raise IndexError("no free command id")  # as the reference's deque.popleft
        if PyByteArray_GET_SIZE(sqe) < _O_CID + 2:
            raise ValueError(f"an SQE of {len(sqe)} bytes has no command id")
        cid = self._free[self._head]
        self._head = (self._head + 1) % self.depth
        self._count -= 1
        cmd.cid = cid
        st16(<uint8_t*>PyByteArray_AS_STRING(sqe) + _O_CID, <uint16_t>cid)
        cmd.transferred = 0
        cmd.status = 0  # a transport may mark a failure (a read's bad data digest) before the completion
        self._slots[cid] = cmd
        self._started[cid] = self._starts
        self._starts += 1
        return 0

    def get(self, Py_ssize_t cid):
        """The command in flight under ``cid``, None for a free or unknown id."""
        return self._get(cid)

    cdef HostCommand _get(self, Py_ssize_t cid):
        if cid < 0 or cid >= self.depth:
            return None
        return <HostCommand>self._slots[cid]

    def finish(self, Py_ssize_t cid):
        """Forget ``cid``; returns its command, or None for an unknown/stale id."""
        return self._finish(cid)

    cdef HostCommand _finish(self, Py_ssize_t cid):
        cdef HostCommand cmd
        if cid < 0 or cid >= self.depth:
            return None
        cmd = <HostCommand>self._slots[cid]
        if cmd is None:
            return None
        self._slots[cid] = None
        self._free[(self._head + self._count) % self.depth] = <uint16_t>cid
        self._count += 1
        return cmd

    def _in_start_order(self):
        """The ids in flight, oldest start first."""
        cdef int cid
        ids = [cid for cid in range(self.depth) if self._slots[cid] is not None]
        ids.sort(key=lambda c: self._started[c])
        return ids

    @property
    def pending(self):
        """Id -> command in flight, in start order (a new dict: for metrics and tests)."""
        return {cid: self._slots[cid] for cid in self._in_start_order()}

    def expired(self, double now):
        """Commands in flight whose deadline has passed."""
        return [cmd for cmd in (self._slots[cid] for cid in self._in_start_order()) if cmd.deadline <= now]

    def take_all(self):
        """Everything still in flight (the connection died); the queue is empty afterwards."""
        return [self.finish(cid) for cid in self._in_start_order()]
