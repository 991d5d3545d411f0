# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The compiled FUSE request loop of one mount: :meth:`FuseSession.py_on_readable` and its
replies written for C.

Same behaviour as the Python reference in ``session.py`` and ``blockfile.py`` (``tests/core/test_fuse_differential.py``
feeds both the same request streams): up to ``MAX_BATCH`` requests per readiness callback, sends
held from the second one on; a block-aligned READ or WRITE inside the file sent to the controller
from here (``BlockFiles.read``'s and ``write``'s common case, the reply written from a C
completion object), and so is an FSYNC's Flush (``BlockFiles.fsync``'s common case); every other
READ, WRITE and FSYNC handed to the block files with their fields as C integers, every other
opcode to the session's opcode table (``initiator/fuse/ops.py``, whose ``compiled`` rows are the
ones served here). What changes is the cost per
request: /dev/fuse is read with ``read(2)`` into a preallocated buffer (no FileIO call, no
BlockingIOError object when nothing is queued), the request header and READ/WRITE arguments are
read through a pointer instead of two ``struct.unpack_from`` tuples, and a reply is one
``writev(2)`` of a header built on the stack and the payload's own buffer (no header ``bytes``,
no list); a small write it sends itself is copied out of the request buffer
once, into the bytes its NVMe/TCP capsule is sent as (``initiator/_inline.pyx``), and its range
hold is a C call on the compiled range locks (``_rangelock.pyx``).

Offsets and sizes come from ``initiator/fuse/abi.py``'s ``struct`` layouts at import (bound to
C variables below), so nothing is typed twice.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_FromStringAndSize
from libc.errno cimport EAGAIN, EBADF, EBUSY, EINTR, EIO, ENODEV, ENOENT, errno
from libc.stdint cimport int32_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy, memset
from posix.uio cimport iovec, writev
from posix.unistd cimport read

from libc.stdlib cimport free, malloc

from blockd._liburing cimport (
    IORING_OP_URING_CMD, IORING_SETUP_SINGLE_ISSUER, IORING_SETUP_SQE128, io_uring, io_uring_cq_advance, io_uring_cq_ready,
    io_uring_cqe,
    io_uring_get_sqe, io_uring_peek_batch_cqe, io_uring_queue_exit, io_uring_queue_init, io_uring_sqe, io_uring_submit,
)
from blockd._iostats cimport now_ns
from initiator._inline cimport inline_data
from initiator._lane cimport IoLane
from initiator.fuse._rangelock cimport RangeLocks

import mmap
import os
import struct

from initiator.fuse.abi import (
    FUSE_IO_URING_CMD_COMMIT_AND_FETCH, FUSE_IO_URING_CMD_REGISTER, IN_HEADER, OUT_HEADER, RW_IN, URING_CMD_REQ,
    URING_ENT_IN_OUT, URING_IN_OUT, URING_OP_IN, URING_REQ_HEADER_SIZE, WRITE_OUT,
)
from initiator.fuse.ops import compiled_opcodes
from protocol.commands import flush_command


def _offsets(layout: struct.Struct) -> list:
    """The byte offset of each field of a ``struct`` layout (one code per field in abi.py)."""
    fmt = layout.format
    order, codes = fmt[0], fmt[1:]
    fields = []
    i = 0
    while i < len(codes):  # expand counts ("7I") into one code per field
        j = i
        while codes[j].isdigit():
            j += 1
        count = int(codes[i:j]) if j > i else 1
        fields.extend(codes[j] * count)
        i = j + 1
    return [struct.calcsize(order + "".join(fields[:k])) for k in range(len(fields))]


_in = _offsets(IN_HEADER)
_rw = _offsets(RW_IN)
_out = _offsets(OUT_HEADER)
cdef Py_ssize_t _O_OPCODE = _in[1]
cdef Py_ssize_t _O_UNIQUE = _in[2]
cdef Py_ssize_t _O_NODEID = _in[3]
cdef Py_ssize_t _HDR = IN_HEADER.size
cdef Py_ssize_t _O_OFFSET = _HDR + _rw[1]
cdef Py_ssize_t _O_SIZE = _HDR + _rw[2]
cdef Py_ssize_t _RW_DATA = _HDR + RW_IN.size
cdef Py_ssize_t _OUT = OUT_HEADER.size
cdef Py_ssize_t _O_OUT_ERR = _out[1]
cdef Py_ssize_t _O_OUT_UNIQUE = _out[2]
cdef Py_ssize_t _WRITE_OUT = WRITE_OUT.size
cdef Py_ssize_t _O_WRITE_SIZE = _offsets(WRITE_OUT)[0]
cdef Py_ssize_t _O_IN_LEN = _in[0]
cdef Py_ssize_t _RING_HDR = URING_REQ_HEADER_SIZE
cdef Py_ssize_t _RING_OP = URING_IN_OUT
cdef Py_ssize_t _RING_ENT = URING_IN_OUT + URING_OP_IN
cdef Py_ssize_t _O_ENT_PAYLOAD_SZ = _RING_ENT + _offsets(URING_ENT_IN_OUT)[2]
cdef Py_ssize_t _O_CMD_COMMIT_ID = _offsets(URING_CMD_REQ)[1]
cdef Py_ssize_t _O_CMD_QID = _offsets(URING_CMD_REQ)[2]
cdef Py_ssize_t _O_OP_OFFSET = _rw[1]
cdef Py_ssize_t _O_OP_SIZE = _rw[2]
cdef uint32_t _CMD_REGISTER = FUSE_IO_URING_CMD_REGISTER
cdef uint32_t _CMD_COMMIT = FUSE_IO_URING_CMD_COMMIT_AND_FETCH
cdef unsigned _CQE_BATCH = 64
cdef uint32_t _NO_OPCODE = 0xFFFFFFFF
"""What an opcode served here is set to when its table row is not marked ``compiled`` (no FUSE
opcode has this value): that opcode then goes to the table like any other."""
_SERVED_HERE = frozenset({"READ", "WRITE", "FSYNC"})
# The reads below take native 32/64-bit fields at those offsets (FUSE structs are the kernel's
# native layout; abi.py spells them little-endian, as every host we run on is): a header packed
# by abi.py must read back, and a reply header built here must unpack with OUT_HEADER.
_probe = bytearray(_RW_DATA)
IN_HEADER.pack_into(_probe, 0, 0, 0x11223344, 0x5566778899AABBCC, 0x0102030405060708, 0, 0, 0, 0, 0)
RW_IN.pack_into(_probe, _HDR, 0, 0x0A0B0C0D0E0F1011, 0x21222324, 0, 0, 0, 0)
if (int.from_bytes(_probe[_O_OPCODE:_O_OPCODE + 4], "little"), int.from_bytes(_probe[_O_UNIQUE:_O_UNIQUE + 8], "little"),
        int.from_bytes(_probe[_O_NODEID:_O_NODEID + 8], "little"), int.from_bytes(_probe[_O_OFFSET:_O_OFFSET + 8], "little"),
        int.from_bytes(_probe[_O_SIZE:_O_SIZE + 4], "little")) != (
        0x11223344, 0x5566778899AABBCC, 0x0102030405060708, 0x0A0B0C0D0E0F1011, 0x21222324):
    raise ImportError("initiator.fuse.abi's layouts are not the ones initiator/fuse/_loop.pyx reads")
if _WRITE_OUT > 16 or WRITE_OUT.pack(0x31323334, 0) != (  # the reply _reply_write builds: the size, zeros
        bytes(_O_WRITE_SIZE) + (0x31323334).to_bytes(4, "little") + bytes(_WRITE_OUT - _O_WRITE_SIZE - 4)):
    raise ImportError("initiator.fuse.abi's WRITE_OUT is not the one initiator/fuse/_loop.pyx writes")


cdef extern from "<sched.h>" nogil:
    int sched_yield()

cdef unsigned _AFFINITY_EVERY = 4096
"""Busy-polls between two looks at the CPUs the loop may run on (``FuseLoop._may_spin``)."""


cdef inline uint32_t _u32(const char* p) noexcept:
    cdef uint32_t v
    memcpy(&v, p, 4)
    return v


cdef inline uint64_t _u64(const char* p) noexcept:
    cdef uint64_t v
    memcpy(&v, p, 8)
    return v


cdef class FuseRing:
    """The io_uring of one mount's FUSE connection (FUSE over io_uring, docs/wire-facts.md):
    ``queues`` kernel queues (one per possible CPU: the kernel holds every request until each
    has an entry) of ``per_queue`` entries, each a request header buffer and a payload buffer
    that the kernel fills with a request when it completes the entry's command. A reply goes
    back in the same buffers and one COMMIT_AND_FETCH command both answers it and re-arms the
    entry, so a request costs no read(2) and no writev(2) on /dev/fuse; the commands of a batch
    are submitted together (``hold``, ``flush``).

    Made only by ``FuseLoop.start_ring``; one thread (the event loop's) uses it."""

    cdef io_uring ring
    cdef bint live
    cdef int dev_fd
    cdef public int queues
    cdef public int per_queue
    cdef public Py_ssize_t payload_size
    cdef char* headers
    cdef iovec* iov
    cdef object region
    cdef Py_buffer region_view
    cdef char* base
    cdef Py_ssize_t stride
    cdef readonly list payloads
    """Each entry's payload buffer (a view of the one mapping), as registered."""
    cdef int holding
    cdef int unsubmitted
    cdef public int failed
    cdef public unsigned long long served
    """Requests taken from the ring (``blockctl mounts`` shows them: proof the ring serves)."""
    """Entries whose command ended with an error (the connection ended, or a registration was
    refused): they take no more requests."""

    def __cinit__(self):
        self.live = False
        self.headers = NULL
        self.iov = NULL
        self.base = NULL

    def __init__(self, int dev_fd, int queues, int per_queue, Py_ssize_t payload_size):
        cdef int n = queues * per_queue
        cdef int i, err
        if queues < 1 or per_queue < 1 or payload_size < 1:
            raise ValueError("a FUSE ring needs at least one queue, one entry and a payload")
        self.dev_fd = dev_fd
        self.queues = queues
        self.per_queue = per_queue
        self.payload_size = payload_size
        self.headers = <char*>malloc(n * _RING_HDR)
        self.iov = <iovec*>malloc(2 * n * sizeof(iovec))
        if self.headers == NULL or self.iov == NULL:
            raise MemoryError()
        memset(self.headers, 0, n * _RING_HDR)
        # The payloads are one anonymous mapping, each entry page-aligned (its stride rounded up
        # to whole pages), not a bytearray each: a bytearray's bytes start 16 bytes into malloc's
        # mapping, so the kernel copied a write from the caller's page-aligned buffer with the
        # destination 16 bytes ahead of the source within the page, where this machine's CPU
        # (EPYC) copies at a fifth of its speed (4K aliasing). Measured: pwrite(2) of 1 MiB with
        # the destination 8 or 16 bytes ahead 0.4-0.7 GB/s, at 0, 32 or more 3-7 GB/s; the ring's
        # 1 MiB write took 1,300 us of system time in our thread, /dev/fuse's 470 (its read buffer
        # puts a write's data 96 bytes in). docs/benchmarks.md, 2026-12-07 evening.
        self.stride = (payload_size + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        self.region = mmap.mmap(-1, n * self.stride)
        PyObject_GetBuffer(self.region, &self.region_view, PyBUF_WRITABLE)
        self.base = <char*>self.region_view.buf
        whole = memoryview(self.region)
        self.payloads = [whole[i * self.stride:i * self.stride + payload_size] for i in range(n)]
        # room for every entry's command at once (registration), rounded up by the kernel
        err = io_uring_queue_init(n, &self.ring, IORING_SETUP_SQE128 | IORING_SETUP_SINGLE_ISSUER)
        if err < 0:
            raise OSError(-err, f"io_uring_queue_init: {os.strerror(-err)}")
        self.live = True

    def __dealloc__(self):
        if self.live:
            io_uring_queue_exit(&self.ring)
        free(self.headers)
        free(self.iov)
        if self.base != NULL:
            PyBuffer_Release(&self.region_view)

    @property
    def fd(self) -> int:
        """The ring's fd: readable when completions wait (the event loop watches it)."""
        return self.ring.ring_fd if self.live else -1

    def close(self):
        """Tear the ring down: the kernel cancels the commands it holds (ending the entries)."""
        if self.live:
            self.live = False
            io_uring_queue_exit(&self.ring)

    def register(self):
        """Hand every entry to the kernel (FUSE_IO_URING_CMD_REGISTER), in one submission. A
        refused one completes at once with its error (see ``take``); the kernel then serves the
        connection through /dev/fuse instead."""
        cdef int i
        cdef io_uring_sqe* sqe
        for i in range(self.queues * self.per_queue):
            self.iov[2 * i].iov_base = self.headers + i * _RING_HDR
            self.iov[2 * i].iov_len = _RING_HDR
            self.iov[2 * i + 1].iov_base = self.payload(i)
            self.iov[2 * i + 1].iov_len = self.payload_size
            sqe = self._sqe(i, _CMD_REGISTER)
            sqe.addr = <uint64_t>&self.iov[2 * i]
            sqe.len = 2
        self._submit()

    cdef io_uring_sqe* _sqe(self, int entry, uint32_t cmd_op) except NULL:
        """A zeroed 128-byte SQE for ``cmd_op`` on /dev/fuse, for ``entry``'s queue."""
        cdef io_uring_sqe* sqe = io_uring_get_sqe(&self.ring)
        cdef uint16_t qid = <uint16_t>(entry // self.per_queue)
        if sqe == NULL:  # full: send what is queued, then there is room
            self._submit()
            sqe = io_uring_get_sqe(&self.ring)
            if sqe == NULL:
                raise OSError(EBUSY, "FUSE ring: no free submission entry")
        memset(sqe, 0, 128)
        sqe.opcode = IORING_OP_URING_CMD
        sqe.fd = self.dev_fd
        sqe.cmd_op = cmd_op
        sqe.user_data = <uint64_t>entry
        memcpy(<char*>sqe.cmd + _O_CMD_QID, &qid, 2)
        return sqe

    cdef int _submit(self) except -1:
        cdef int err
        self.unsubmitted = 0
        err = io_uring_submit(&self.ring)
        if err < 0 and err != -EINTR and err != -EAGAIN and err != -EBUSY:
            raise OSError(-err, f"io_uring_submit: {os.strerror(-err)}")
        return 0

    cdef inline char* header(self, int entry) noexcept:
        return self.headers + entry * _RING_HDR

    cdef inline char* payload(self, int entry) noexcept:
        return self.base + entry * self.stride

    cdef int commit(self, int entry, uint64_t unique, int32_t err, const char* data, Py_ssize_t length) except -1:
        """Answer the request in ``entry``: the out header and ``length`` bytes of ``data`` into
        its buffers, then COMMIT_AND_FETCH (submitted now, or by ``flush`` when held)."""
        cdef char* h = self.header(entry)
        cdef uint32_t total
        cdef uint32_t sz
        cdef io_uring_sqe* sqe
        if not self.live:
            return 0
        if length > self.payload_size:  # cannot happen with the sizes INIT set; never overrun
            err = -EIO
            length = 0
        total = <uint32_t>(_OUT + length)
        sz = <uint32_t>length
        memcpy(h, &total, 4)
        memcpy(h + _O_OUT_ERR, &err, 4)
        memcpy(h + _O_OUT_UNIQUE, &unique, 8)
        memcpy(h + _O_ENT_PAYLOAD_SZ, &sz, 4)
        if length:
            memcpy(self.payload(entry), data, length)
        sqe = self._sqe(entry, _CMD_COMMIT)
        memcpy(<char*>sqe.cmd + _O_CMD_COMMIT_ID, &unique, 8)
        if self.holding:
            self.unsubmitted += 1
        else:
            self._submit()
        return 0

    cdef int hold(self) noexcept:
        self.holding += 1
        return 0

    cdef int flush(self) except -1:
        """End a ``hold``: submit the commits it queued, in one system call."""
        self.holding -= 1
        if not self.holding and self.unsubmitted and self.live:
            self._submit()
        return 0

    cdef bint spin(self, long long until) noexcept:
        """Watch the completion queue, without a system call, until it holds a completion
        (True) or the clock passes ``until`` (False). A request the kernel hands to an entry
        reaches us as task work (see ``FuseLoop.on_ring``), which the kernel runs when it
        interrupts this loop (TWA_SIGNAL: an IPI when we run on another CPU), so a spin sees
        it without entering the kernel itself. Each round yields the CPU to whatever else is
        runnable on it: the application our answer woke may be put on our CPU (the scheduler's
        wake-affine choice), and a spin that does not yield holds it off until the spin ends or
        the scheduler preempts it."""
        if not self.live:
            return False
        while not io_uring_cq_ready(&self.ring):
            if now_ns() >= until:
                return False
            sched_yield()
        return True

    cdef unsigned take(self, uint64_t* entries, int32_t* results, unsigned most) noexcept:
        """Up to ``most`` completions: each entry's number and its command's result (0: a
        request waits in the entry; negative: the errno it ended with)."""
        cdef io_uring_cqe* cqes[64]
        cdef unsigned n, i
        if not self.live:
            return 0
        n = io_uring_peek_batch_cqe(&self.ring, cqes, most if most < 64 else 64)
        for i in range(n):
            entries[i] = cqes[i].user_data
            results[i] = cqes[i].res
        io_uring_cq_advance(&self.ring, n)
        return n


cdef class FuseLoop:
    """The request loop and reply calls of one :class:`~initiator.fuse.session.FuseSession`.

    ``fd`` is the session's /dev/fuse (-1 before ``attach`` and after ``close``). The request
    buffer is the loop's own; a big write takes it (as the reference does) and the loop reads
    on into one of the session's spare buffers."""

    cdef public int fd
    cdef object session
    cdef object files_read
    cdef object files_write
    cdef object files_fsync
    cdef dict inflight
    cdef dict tasks
    cdef dict stats
    cdef object fail
    cdef object range_lock
    cdef dict locks
    cdef object recycle
    cdef object connections
    cdef object name
    cdef list spare
    cdef bytearray buf
    cdef char* p
    cdef Py_ssize_t cap
    cdef Py_ssize_t copy_limit
    cdef int max_batch
    cdef object ctrl
    cdef IoLane lane
    cdef uint32_t op_read
    cdef uint32_t op_write
    cdef uint32_t op_fsync
    cdef public FuseRing ring
    """The connection's io_uring once ``start_ring`` made it (None: requests come by /dev/fuse)."""
    cdef dict ring_pending
    """Requests taken from the ring and not yet answered: unique -> entry (a reply goes back
    through its entry; every other reply, INIT's and INTERRUPT's target's aside, by writev)."""
    cdef public long long busy_poll_ns
    """How long the loop spins, once it answered the last request in flight through the ring,
    for the kernel's next one (``_await_request``) rather than return to the event loop and
    sleep there; 0: never. The application's next request often follows its answer within a
    few microseconds, and a sleep in ``epoll_wait`` costs a context switch and a wake-up
    (docs/benchmarks.md, 2026-12-08: four jobs of 4 KiB reads 1.17-1.20x faster with it; the
    unpinned single-job rows within their run-to-run noise). Spinning for the target's answer
    as well (on the queue's socket) was measured and dropped: no gain with it alone, a loss with
    both. Never while the thread may run on one CPU only: the spin would hold the CPU the
    application needs.
    """
    cdef public unsigned long long spins
    """Busy-polls begun."""
    cdef public unsigned long long spins_caught
    """Busy-polls that saw what they waited for before their time was up."""
    cdef unsigned spin_checks
    cdef bint spin_allowed

    def __init__(self, session, Py_ssize_t buffer_size, Py_ssize_t copy_limit, int max_batch):
        compiled = compiled_opcodes()  # the opcode table's rows this loop serves itself
        if set(compiled) - _SERVED_HERE:
            raise ValueError(f"initiator/fuse/ops.py marks {sorted(set(compiled) - _SERVED_HERE)} compiled, "
                             "which initiator/fuse/_loop.pyx does not serve")
        self.op_read = compiled.get("READ", _NO_OPCODE)
        self.op_write = compiled.get("WRITE", _NO_OPCODE)
        self.op_fsync = compiled.get("FSYNC", _NO_OPCODE)
        self.fd = -1
        self.ring = None
        self.ring_pending = None
        self.session = session
        self.connections = session.connections
        self.name = session.name
        self.spare = session.spare
        self.cap = buffer_size
        self.copy_limit = copy_limit
        self.max_batch = max_batch
        self.busy_poll_ns = 0
        self.spins = self.spins_caught = 0
        self.spin_checks = 0
        self._take(bytearray(buffer_size))

    def start(self, int fd):
        """Serve ``fd`` from now on (the session's block files exist by then)."""
        self.files_read = self.session.files.read
        self.files_write = self.session.files.write
        self.files_fsync = self.session.files.fsync
        self.inflight = self.session.inflight
        self.tasks = self.session.tasks
        self.stats = self.session.stats
        self.fail = self.session.fail
        self.range_lock = self.session.files.range_lock
        self.locks = self.session.files.locks
        self.recycle = self.session.recycle
        self.fd = fd

    def make_ring(self, int queues, int per_queue, Py_ssize_t payload_size):
        """Make the connection's io_uring (see ``FuseRing``), before INIT is answered: raises
        OSError when io_uring is unavailable, and INIT then does not ask for it."""
        self.ring = FuseRing(self.fd, queues, per_queue, payload_size)
        self.ring_pending = {}

    def register_ring(self) -> int:
        """Once INIT asked for the ring and was answered: register its entries. Returns the
        ring's fd, for the event loop to call ``on_ring`` on."""
        self.ring.register()
        return self.ring.fd

    def stop_ring(self):
        """Tear the ring down (the connection is closing): the kernel ends its entries."""
        if self.ring is not None:
            self.ring.close()

    def on_ring(self):
        """Serve the requests the ring's completions carry (up to a batch; the event loop
        calls again while more wait). Their commits go out together at the end, in one
        submission, and so do the capsules of a batch of several (as ``on_readable``)."""
        cdef uint64_t entries[64]
        cdef int32_t results[64]
        cdef unsigned n, i
        cdef FuseRing ring = self.ring
        if ring is None:
            return
        n = ring.take(entries, results, _CQE_BATCH)
        if not n:
            return
        ctrl = None
        ring.hold()
        try:
            if n > 1:
                ctrl = self.connections.get(self.name)
                if ctrl is not None:
                    ctrl.hold_sends()
            for i in range(n):
                if results[i] == 0:
                    ring.served += 1
                    self._serve_entry(<int>entries[i])
                else:
                    ring.failed += 1
                    self.session.ring_entry_ended(-results[i], ring.served == 0)
        finally:
            ring.flush()
            if ctrl is not None:
                ctrl.release_sends()

    cdef _serve_entry(self, int entry):
        """Serve the request the kernel put in ``entry`` as ``_serve`` does one read from
        /dev/fuse: its header in the entry's header buffer, its first argument (``fuse_read_in``,
        ``fuse_write_in``...) in the op area, the rest (a write's data, a name) in its payload."""
        cdef FuseRing ring = self.ring
        cdef const char* h = ring.header(entry)
        cdef const char* op = h + _RING_OP
        cdef uint32_t opcode = _u32(h + _O_OPCODE)
        cdef uint64_t unique = _u64(h + _O_UNIQUE)
        cdef uint64_t nodeid = _u64(h + _O_NODEID)
        cdef uint32_t payload_sz = _u32(h + _O_ENT_PAYLOAD_SZ)
        cdef uint32_t size
        cdef Py_ssize_t arg0
        self.ring_pending[unique] = entry
        if opcode == self.op_read:
            self._read(unique, nodeid - 1, _u64(op + _O_OP_OFFSET), _u32(op + _O_OP_SIZE))
        elif opcode == self.op_write:
            size = _u32(op + _O_OP_SIZE)
            if size > payload_sz:  # as the /dev/fuse path clips to what was read
                size = payload_sz
            if size <= self.copy_limit:
                owned = None
            else:
                # copied into a buffer of the session's pool, not sent from the entry: a failed
                # write's data may still sit in a closing transport's buffer, and the entry takes
                # the next request as soon as the error is committed (the /dev/fuse path gives
                # such a buffer up for the same reason: ``recycle``). The data goes where a
                # /dev/fuse read puts it, after room for the request's header: the socket's copy
                # of the H2CData then runs as fast as that path's. At the buffer's start (16
                # bytes into malloc's mapping) it sat 8 bytes behind where the kernel puts it in
                # the send buffer, after the PDU's 24-byte header: the CPU's slow case (see
                # ``FuseRing.__init__``). Measured, pinned, 1 MiB writes: the initiator's system
                # time per write 1,278 us (main), 827 with page-aligned entries alone, 382 with
                # both (/dev/fuse 446 in the same run); 330 -> 932 MB/s, nbdfuse 740-921.
                owned = self.spare.pop() if self.spare else bytearray(self.cap)
                memcpy(PyByteArray_AS_STRING(owned) + _RW_DATA, ring.payload(entry), size)
            self._write(unique, nodeid - 1, _u64(op + _O_OP_OFFSET), ring.payload(entry), size, owned,
                        None if owned is None else memoryview(owned)[_RW_DATA:_RW_DATA + size])
        elif opcode == self.op_fsync:
            self._fsync(unique, nodeid - 1)
        else:
            # the request after its header, as /dev/fuse lays it out: the op area's first
            # argument (the header's length less the header and the payload), then the payload
            arg0 = <Py_ssize_t>_u32(h + _O_IN_LEN) - _HDR - payload_sz
            if arg0 < 0 or arg0 > _RING_ENT - _RING_OP:
                arg0 = 0
            arg = PyByteArray_FromStringAndSize(op, arg0)
            arg += memoryview(ring.payloads[entry])[:payload_sz]
            self.session.serve(opcode, unique, nodeid, memoryview(arg))

    cdef inline void _take(self, bytearray buf):
        self.buf = buf
        self.p = PyByteArray_AS_STRING(buf)

    # -- the request loop ---------------------------------------------------------------------------

    def on_readable(self):
        """Serve what /dev/fuse has queued (see ``FuseSession.py_on_readable``: a request that
        finds nothing else in flight is served alone)."""
        cdef bint busy = len(self.inflight) > 0 or len(self.tasks) > 0
        cdef Py_ssize_t n = self._read_request()
        cdef int i
        if not n:
            return
        if n > 0:
            self._serve(n)
            if not busy:
                return
        ctrl = None
        try:
            for i in range(self.max_batch - 1):
                n = self._read_request()
                if not n:
                    break
                if n > 0:
                    if ctrl is None:
                        ctrl = self.connections.get(self.name)
                        if ctrl is not None:
                            ctrl.hold_sends()
                    self._serve(n)
        finally:
            if ctrl is not None:
                ctrl.release_sends()

    cdef Py_ssize_t _read_request(self) except? -2:
        """The next request's length; 0 when none is queued (or the mount is gone), -1 when it
        was interrupted before we read it."""
        cdef Py_ssize_t n
        if self.fd < 0:
            return 0
        n = read(self.fd, self.p, self.cap)
        if n >= 0:
            return n
        if errno == EAGAIN:
            return 0
        if errno == ENOENT:
            return -1
        if errno == ENODEV:
            self.session.device_gone()
            return 0
        raise OSError(errno, os.strerror(errno))

    cdef _serve(self, Py_ssize_t n):
        cdef const char* p = self.p
        cdef uint32_t opcode = _u32(p + _O_OPCODE)
        cdef uint64_t unique = _u64(p + _O_UNIQUE)
        cdef uint64_t nodeid = _u64(p + _O_NODEID)
        cdef uint32_t size
        cdef Py_ssize_t end
        if opcode == self.op_read:
            self._read(unique, nodeid - 1, _u64(p + _O_OFFSET), _u32(p + _O_SIZE))
        elif opcode == self.op_write:
            size = _u32(p + _O_SIZE)
            end = _RW_DATA + size
            if end > self.cap:  # as the reference's slice of the buffer
                end = self.cap
            if size <= self.copy_limit:
                owned = None
            else:
                owned = self.buf
                self._take(self.spare.pop() if self.spare else bytearray(self.cap))
            self._write(unique, nodeid - 1, _u64(p + _O_OFFSET), p + _RW_DATA, end - _RW_DATA, owned,
                        None if owned is None else memoryview(owned)[_RW_DATA:end])
        elif opcode == self.op_fsync:
            self._fsync(unique, nodeid - 1)
        else:
            self.session.serve(opcode, unique, nodeid, memoryview(self.buf)[_HDR:n])

    cdef _read(self, uint64_t unique, uint64_t nsid, uint64_t offset, uint32_t size):
        """``BlockFiles.read`` for a block-aligned range inside the file on a live controller,
        its reply written by ``_ReadDone``; every other case (clipped, unaligned, empty, no
        controller or namespace, an error) is the Python one's."""
        cdef uint64_t end, file_size, bs
        ctrl = self.connections.get(self.name)
        info = None if ctrl is None or ctrl.failed is not None else ctrl.namespaces.get(nsid)
        if info is not None:
            file_size = info.size
            bs = info.block_size
            end = offset + size
            if offset < file_size and end <= file_size and size and bs and not offset % bs and not end % bs:
                # Not zero-filled (the reference's bytearray(size) is): the read's data fills it
                # before it is answered, and a read that does not fill it (a short transfer is
                # DATA_TRANSFER_ERROR) is answered with an error, never with the buffer. The fill
                # was ~5k of the ~34k instructions per 4 KiB read (callgrind counts each store).
                buf = PyByteArray_FromStringAndSize(NULL, size)
                self.inflight[unique] = True
                try:
                    self._transfer(ctrl, False, nsid, offset, memoryview(buf), _ReadDone(self, unique, buf))
                except Exception as exc:
                    self.inflight.pop(unique, None)
                    self.fail(unique, exc, "read")
                return
        self.files_read(unique, nsid, offset, size)

    cdef int _transfer(self, ctrl, bint write, uint64_t nsid, uint64_t offset, buf, done) except -1:
        """``ctrl.transfer(write, nsid, offset, buf, done)``: for a controller with the compiled
        lane (whose ``transfer`` is the lane's, ``Controller.__init__``), the lane's as a C call,
        ~0.45k instructions per I/O less than the Python call's six arguments (callgrind,
        docs/dataplane.md); for any other (a multipath mount's, the Python plane's), the Python
        call. The lane of the last controller seen is kept (a controller's ``lane`` is set
        once, in its ``__init__``), and looked up again when the mount's name maps to another."""
        if self._lane_of(ctrl) is not None:
            return self.lane._transfer(write, nsid, offset, buf, done, False)
        ctrl.transfer(write, nsid, offset, buf, done)
        return 0

    cdef IoLane _lane_of(self, ctrl):
        """The compiled lane of ``ctrl`` (None for a controller without one), kept for the last
        controller seen (see ``_transfer``)."""
        if ctrl is not self.ctrl:
            lane = getattr(ctrl, "lane", None)
            self.lane = lane if isinstance(lane, IoLane) else None
            self.ctrl = ctrl
        return self.lane

    cdef _fsync(self, uint64_t unique, uint64_t nsid):
        """``BlockFiles.fsync`` for a known namespace on a controller that has not given up: its
        Flush, built by ``flush_command``, sent as ``submit_io`` (the lane's in C, as
        ``_transfer``), the reply written by ``_FsyncDone``; every other case is the Python
        one's."""
        ctrl = self.connections.get(self.name)
        if ctrl is None or ctrl.failed is not None or ctrl.namespaces.get(nsid) is None:
            self.files_fsync(unique, nsid)
            return
        self.inflight[unique] = True
        try:
            sqe = flush_command(nsid)
            if self._lane_of(ctrl) is not None:
                self.lane._submit_io(sqe, None, None, _FsyncDone(self, unique))
            else:
                ctrl.submit_io(sqe, None, None, _FsyncDone(self, unique))
        except Exception as exc:
            self.inflight.pop(unique, None)
            self.fail(unique, exc, "fsync")

    # -- busy-polling (``busy_poll_ns``) ------------------------------------------------------------

    cdef bint _may_spin(self) except -1:
        """Whether this thread may run on more than one CPU, looked at again every
        ``_AFFINITY_EVERY`` calls (a benchmark or an operator may pin it meanwhile)."""
        if self.spin_checks == 0:
            self.spin_allowed = len(os.sched_getaffinity(0)) > 1
            self.spin_checks = _AFFINITY_EVERY
        self.spin_checks -= 1
        return self.spin_allowed

    cdef int _await_request(self) except -1:
        """Nothing is in flight once an answer went back through the ring: spin until the
        kernel's next request is in its completion queue or ``busy_poll_ns`` passed. Not on
        /dev/fuse (a ``poll`` of it each round): measured there in the same run as the ring, it
        gave 0.90x at 4 KiB QD1 read, 0.97x write and 0.98x with four jobs of no spin."""
        if self.ring is None or self.inflight or self.tasks or not self._may_spin():
            return 0
        self.spins += 1
        if self.ring.spin(now_ns() + self.busy_poll_ns):
            self.spins_caught += 1
        return 0

    cdef _fsync_done(self, uint64_t unique, exc):
        """``BlockFiles._fsync_done``: the answer, unless an INTERRUPT gave it already."""
        if not self.inflight.pop(unique, False):
            return
        if exc is not None:
            self.fail(unique, exc, "fsync")
            return
        self._send_reply(unique, 0, NULL, 0)
        if self.busy_poll_ns:
            self._await_request()

    cdef _read_done(self, uint64_t unique, bytearray buf, exc):
        """``BlockFiles._read_done``: the answer, unless an INTERRUPT gave it already."""
        if not self.inflight.pop(unique, False):
            return
        if exc is not None:
            self.fail(unique, exc, "read")
            return
        self.stats["read"] += 1
        self.reply(unique, buf)
        if self.busy_poll_ns:
            self._await_request()

    cdef _write(self, uint64_t unique, uint64_t nsid, uint64_t offset, const char* src, Py_ssize_t length, owned,
                view):
        """``BlockFiles.write`` for a block-aligned range inside a writable file on a live
        controller whose blocks no read-modify-write holds (its shared hold taken here, as
        there); every other case is the Python one's. The data is the ``length`` bytes at
        ``src``, in the request buffer: a big write's data is ``view``, of ``owned`` (the /dev/fuse
        buffer it was read into, taken from the loop, or the pool buffer a ring entry's payload
        was copied into), recycled once written; a small one's is copied out,
        once: into an ``InlineData`` (``initiator/_inline.pyx``: the bytes its NVMe/TCP capsule
        is sent as) for a write sent from here, into a ``bytearray`` for the Python one's, as
        the reference."""
        cdef uint64_t end, file_size, bs
        cdef RangeLocks locks  # the compiled twin, as the compiled loop runs with it (it cimports it)
        ctrl = self.connections.get(self.name)
        info = None if ctrl is None or ctrl.failed is not None else ctrl.namespaces.get(nsid)
        if info is not None and not info.read_only:
            file_size = info.size
            bs = info.block_size
            end = offset + <uint64_t>length
            if offset < file_size and end <= file_size and length and bs and not offset % bs and not end % bs:
                locks = self.locks.get(nsid)  # BlockFiles.range_lock without its frame, once made
                if locks is None:
                    locks = self.range_lock(nsid)
                token = locks._share_now(offset // bs, end // bs)
                if token is not None:
                    data = inline_data(src, length) if view is None else view
                    self.inflight[unique] = True
                    try:
                        self._transfer(ctrl, True, nsid, offset, data, _WriteDone(self, unique, length, owned, locks, token))
                    except BaseException as exc:
                        self.inflight.pop(unique, None)
                        locks._release(token)
                        if not isinstance(exc, Exception):
                            raise
                        self.fail(unique, exc, "write")
                    return
        data = memoryview(PyByteArray_FromStringAndSize(src, length)) if view is None else view
        self.files_write(unique, nsid, offset, data, owned)

    cdef _write_done(self, uint64_t unique, Py_ssize_t length, owned, RangeLocks locks, token, exc):
        """``BlockFiles._write_done``: the blocks released, then the answer (unless an
        INTERRUPT gave it), and a big write's buffer back to the session."""
        locks._release(token)
        if not self.inflight.pop(unique, False):
            return
        if exc is not None:
            self.fail(unique, exc, "write")
            return
        self.stats["write"] += 1
        self._reply_write(unique, <uint32_t>length)
        if owned is not None:
            self.recycle(owned)
        if self.busy_poll_ns:
            self._await_request()

    # -- replies ------------------------------------------------------------------------------------

    cpdef reply(self, uint64_t unique, payload=b""):
        """Answer ``unique`` with ``payload`` (any buffer): one writev of header and payload."""
        cdef Py_buffer view
        PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE)
        try:
            self._send_reply(unique, 0, <char*>view.buf, view.len)
        finally:
            PyBuffer_Release(&view)

    cdef int _reply_write(self, uint64_t unique, uint32_t size) except -1:
        """``reply(unique, WRITE_OUT.pack(size, 0))``, the payload built on the stack."""
        cdef char out[16]
        memset(out, 0, _WRITE_OUT)
        memcpy(out + _O_WRITE_SIZE, &size, 4)
        return self._send_reply(unique, 0, out, _WRITE_OUT)

    cpdef reply_err(self, uint64_t unique, int err):
        self._send_reply(unique, -err, NULL, 0)

    cdef int _send_reply(self, uint64_t unique, int32_t err, char* data, Py_ssize_t length) except -1:
        cdef char header[32]
        cdef uint32_t total = <uint32_t>(_OUT + length)
        cdef iovec iov[2]
        if self.ring_pending is not None:
            entry = self.ring_pending.pop(unique, None)
            if entry is not None:
                return self.ring.commit(<int>entry, unique, err, data, length)
        memcpy(header, &total, 4)
        memcpy(header + _O_OUT_ERR, &err, 4)
        memcpy(header + _O_OUT_UNIQUE, &unique, 8)
        iov[0].iov_base = header
        iov[0].iov_len = _OUT
        iov[1].iov_base = data
        iov[1].iov_len = length
        if writev(self.fd, iov, 2 if length else 1) < 0:
            # ENOENT: the request was interrupted and is gone; ENODEV/EBADF: unmounted meanwhile
            if errno != ENOENT and errno != ENODEV and errno != EBADF:
                raise OSError(errno, os.strerror(errno))
        return 0


cdef class _ReadDone:
    """The ``done`` of a READ the loop sent itself: a C object, not a ``functools.partial``."""

    cdef FuseLoop loop
    cdef uint64_t unique
    cdef bytearray buf

    def __cinit__(self, FuseLoop loop, uint64_t unique, bytearray buf):
        self.loop = loop
        self.unique = unique
        self.buf = buf

    def __call__(self, exc):
        self.loop._read_done(self.unique, self.buf, exc)


cdef class _WriteDone:
    """The ``done`` of a WRITE the loop sent itself (see ``_ReadDone``)."""

    cdef FuseLoop loop
    cdef uint64_t unique
    cdef Py_ssize_t length
    cdef object owned
    cdef RangeLocks locks
    cdef object token

    def __cinit__(self, FuseLoop loop, uint64_t unique, Py_ssize_t length, owned, RangeLocks locks, token):
        self.loop = loop
        self.unique = unique
        self.length = length
        self.owned = owned
        self.locks = locks
        self.token = token

    def __call__(self, exc):
        self.loop._write_done(self.unique, self.length, self.owned, self.locks, self.token, exc)


cdef class _FsyncDone:
    """The ``done`` of an FSYNC's Flush the loop sent itself (see ``_ReadDone``)."""

    cdef FuseLoop loop
    cdef uint64_t unique

    def __cinit__(self, FuseLoop loop, uint64_t unique):
        self.loop = loop
        self.unique = unique

    def __call__(self, exc):
        self.loop._fsync_done(self.unique, exc)
