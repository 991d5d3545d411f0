# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The queue's thread of ``target/_tcp_thread.pyx`` on an io_uring (issue 42, Deliver 2):
:class:`TcpUringPath` is :class:`target._tcp_thread.TcpFastPath` whose thread receives, reads or
writes the file and sends through one io_uring per queue instead of ``recv``, ``pread``/``pwrite``
and ``sendmsg``, one ``io_uring_enter`` per receive (docs/dataplane.md, "The target's io_uring
queue loop").

What goes on the ring: a Read below the by-reference size and an in-capsule Write without FUA
that the core's one rule (``target._io_core.eligible``) lets the compiled path serve; the rest
(Flush, FUA, reads by reference, R2T writes and their H2CData, anything ``eligible`` refuses) runs
``TcpServe``'s own code on the thread, after what the ring holds has gone out, or goes back to the
loop exactly as there. Per receive the ring gets one chain, submitted with one
``io_uring_enter`` that also waits:

    read or write of command 1 -> ... -> read or write of command n -> sendmsg(replies) -> recv

linked (``IOSQE_IO_LINK``: each starts when the one before succeeded; a short read or write
fails the link) and the file steps without a completion on success (``IOSQE_CQE_SKIP_SUCCESS``),
so what comes back is the ``sendmsg``'s completion (the file steps and the replies are done: the
namespaces' holds go back), the ``recv``'s (the host's next bytes, in the reader's staging as the
blocking ``recv`` puts them), or the first step that failed (the kernel then cancels the rest).
Both are waited for in one ``io_uring_enter`` (``min_complete`` 2): at queue depth 1 that is one
system call per I/O where the thread makes three. With SQPOLL (``[target] io_uring_sqpoll``) the
kernel's thread submits, and the queue thread looks for the completions in the ring for up to
``io_uring_spin_us`` before it sleeps in the kernel: none while the host answers within the spin.

The reply of a ring command is built before its data is read (its SQHD advanced then, as the one
``sendmsg`` of the chain carries it); a file step that fails therefore undoes the chain: SQHD back
to where the chain began, the namespaces' holds given back, the ``served`` counts taken back, and
every command of the chain handed to the loop, which runs it as the Python queue's own (the read
again, the write again: the same bytes at the same place), so its status and error-log entry are
the reference's. A ring command is counted when its reply is made, before the host can see it, as
``TcpServe`` counts (its latency therefore leaves out the read or write, done inside the chain), and
the count is taken back if its chain fails. Its namespace is held (``ns.in_flight``) until the
chain's ``sendmsg`` has completed: seen in the ring while the thread spins, or when the thread's
sleep in the kernel ends, which lasts at most ``_HOLD_WAIT_NS`` while it holds any (the host's next
bytes, which an idle host never sends, used to end it): a namespace removed meanwhile closes its
file then. Nothing of a chain is outstanding when
the thread handles anything else or hands back: one chain at a time, on the thread that made the
ring (``IORING_SETUP_SINGLE_ISSUER``)."""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.errno cimport EINTR, EOPNOTSUPP, ETIME, errno
from libc.string cimport memcpy, memset
from posix.types cimport off_t

from blockd._iostats cimport now_ns
from blockd._le cimport le32, le64
from blockd._liburing cimport (
    IORING_SETUP_COOP_TASKRUN, IORING_SETUP_DEFER_TASKRUN, IORING_SETUP_SINGLE_ISSUER, IORING_SETUP_SQPOLL,
    IORING_SQ_NEED_WAKEUP, IOSQE_CQE_SKIP_SUCCESS, IOSQE_IO_LINK, io_uring, io_uring_cqe, io_uring_cqe_seen,
    io_uring_get_sqe, io_uring_params, io_uring_peek_cqe, io_uring_prep_read, io_uring_prep_recv, io_uring_prep_sendmsg,
    io_uring_prep_write, io_uring_queue_exit, io_uring_queue_init_params, io_uring_sqe, io_uring_submit,
    io_uring_submit_and_wait, io_uring_submit_and_wait_timeout, io_uring_wait_cqes, __kernel_timespec,
)
from blockd._pdu_reader cimport PduReader
from target._file_io cimport FastNamespace
from target._io_core cimport (
    _FUA, _KIND_READ, _KIND_WRITE, _O_ADDR, _O_LEN, _O_SGL_ID, _READ, _SGL_IN_CAPSULE, _SGL_TRANSPORT, _SQE_SIZE,
    _WRITE, RwCommand, eligible, parse_rw,
)
from target._tcp_io cimport _DATA_HLEN, _RESP_LEN, _SQE_AT, TcpServe
from target._tcp_thread cimport TcpFastPath

import os

import structlog


cdef extern from "<errno.h>" nogil:
    int ECANCELED

cdef extern from "<sys/uio.h>" nogil:
    struct iovec:
        void* iov_base
        size_t iov_len
    Py_ssize_t preadv2(int fd, const iovec* iov, int iovcnt, off_t offset, int flags)
    Py_ssize_t pwritev2(int fd, const iovec* iov, int iovcnt, off_t offset, int flags)
    int RWF_NOWAIT

cdef extern from "<sys/socket.h>" nogil:
    struct msghdr:
        iovec* msg_iov
        size_t msg_iovlen
    int MSG_NOSIGNAL
    int MSG_WAITALL

log = structlog.get_logger("blockd.target.tcp")

cdef enum:
    _MAX_OPS = 62  # ring commands per chain: their replies and the sendmsg's vector stay within _IOV
    _IOV = 64
    _ENTRIES = 128  # submission entries: a chain is at most _MAX_OPS + 2
    _TAG_FILE = 1  # (| the step's index << 8: which command a failed step was)
    _TAG_SEND = 2
    _TAG_RECV = 3
    _HOLD_WAIT_NS = 10000000
    # How long the thread sleeps in the kernel for the host's next command while its chain still
    # holds namespaces (the send's completion not seen yet): then it looks at the completion
    # ring, gives the holds back and sleeps again without a limit. At queue depth 1 under load
    # the host's round trip is far shorter (40-130 us on loopback here: 7.5-25k IOPS through the
    # FUSE mount, docs/benchmarks.md), so this costs an io_uring_enter
    # only per idle gap longer than it; a removed namespace's file closes at most this long
    # after its last command's reply went out, not when the host next sends on the queue.

cdef enum:
    # what a file is known to take without blocking (RWF_NOWAIT), per descriptor: _nowait
    _READ_KNOWN = 1
    _READ_NOWAIT = 2
    _WRITE_KNOWN = 4
    _WRITE_NOWAIT = 8

cdef enum:
    # where _takes_nowait puts a command's file step
    _OFF_RING = 0  # TcpServe's pread/pwrite
    _ON_RING = 1
    _PROBE = 2  # on the ring with RWF_NOWAIT: its completion says whether the file takes such writes

cdef enum:
    # what _chain ended with
    _DONE = 0  # every step succeeded (and the recv brought bytes, when there was one)
    _ENDED = 1  # the socket ended or failed: the thread leaves
    _UNDONE = 2  # a file step failed: the chain's commands are the loop's now (_resubmit)
    _FULL = 3  # a receive was asked and staging has no room: the loop's (what was held went out)


cdef int _ring_init(io_uring* ring, unsigned entries, unsigned sqpoll_idle_ms) noexcept:
    """Make a queue's ring. Without SQPOLL: one submitting thread, completions run only when it
    enters the kernel to wait (no task-work interruptions of its system calls). With SQPOLL
    (``sqpoll_idle_ms`` > 0, its ``sq_thread_idle``): the kernel's thread submits, and the kernel
    refuses the task-run flags beside it (they say how the submitting task is interrupted, and
    that task is then its own thread)."""
    cdef io_uring_params p
    memset(&p, 0, sizeof(p))
    if sqpoll_idle_ms:
        p.flags = IORING_SETUP_SQPOLL
        p.sq_thread_idle = sqpoll_idle_ms
    else:
        p.flags = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_COOP_TASKRUN | IORING_SETUP_DEFER_TASKRUN
    return io_uring_queue_init_params(entries, ring, &p)


def probe(unsigned sqpoll_idle_ms=0) -> str:
    """Why this kernel cannot run the io_uring queue loop ("" when it can): a ring made and closed
    as the loop makes it (io_uring may be missing, disabled by ``kernel.io_uring_disabled``, or
    refused by a seccomp filter; SQPOLL by a kernel before 5.11 without CAP_SYS_ADMIN). The
    target asks once at start and logs the answer."""
    cdef io_uring ring
    cdef int err = _ring_init(&ring, 4, sqpoll_idle_ms)
    if err < 0:
        return f"io_uring_queue_init{' (SQPOLL)' if sqpoll_idle_ms else ''}: {os.strerror(-err)}"
    io_uring_queue_exit(&ring)
    return ""


cdef int _spin(io_uring* ring, io_uring_cqe** cqe, long long spin_ns) noexcept nogil:
    """Poll ``ring`` for a completion for up to ``spin_ns`` (without the GIL: the event loop's
    thread runs meanwhile); ``io_uring_peek_cqe``'s answer at the end. The bounded spin of SPDK's
    reactor: a completion that comes within it costs no system call and no sleep and wake-up."""
    cdef long long deadline = now_ns() + spin_ns
    cdef int err = io_uring_peek_cqe(ring, cqe)
    while err < 0 and now_ns() < deadline:
        err = io_uring_peek_cqe(ring, cqe)
    return err


cdef class TcpUringPath(TcpFastPath):
    """:class:`TcpFastPath` whose queue thread runs its steady Reads and Writes through an io_uring
    (module docstring). The loop's side, the capsule rules and everything handed back are
    :class:`TcpFastPath`'s."""

    cdef io_uring ring
    cdef bint _live
    cdef bint _tried
    cdef int _ops
    cdef Py_ssize_t _ring_bytes
    cdef object _sqhd0
    cdef list _ring_replies
    cdef list _ring_ns
    cdef list _ring_data
    cdef list _resubmit
    cdef dict _nowait
    cdef int _last_fd
    cdef int _last_nowait
    cdef unsigned char _sqes[_MAX_OPS][64]
    cdef int _kind[_MAX_OPS]
    cdef int _probe[_MAX_OPS]  # the descriptor a write step learns (_PROBE), else -1
    cdef unsigned int _len[_MAX_OPS]
    cdef long long _elapsed[_MAX_OPS]
    cdef iovec _iov[_IOV]
    cdef msghdr _msg
    cdef public unsigned long long ring_enters
    # io_uring_enter calls of the thread (the submission of a chain and its wait are one).
    cdef public unsigned long long ring_chains
    # Chains submitted.
    cdef public unsigned long long ring_served
    # Commands whose file I/O and reply went through the ring (also in ``served``).
    cdef public unsigned long long ring_undone
    # Commands of failed chains, handed to the loop.
    cdef public unsigned long long ring_probes_refused
    # First writes of a file whose RWF_NOWAIT probe on the ring it refused (their chains are
    # among the failed ones: undone by design, the loop's queue writes them).
    cdef readonly str ring_reason
    # Why this queue's thread runs without a ring ("" while it has one, or before it starts).
    cdef readonly unsigned int sqpoll_idle_ms
    # The ring is made with SQPOLL and this sq_thread_idle when > 0 (``[target] io_uring_sqpoll``).
    cdef readonly long long spin_ns
    # With SQPOLL: how long the thread polls the ring for its completion before it waits in the
    # kernel (``[target] io_uring_spin_us``).
    cdef public bint all_file_steps
    # Every Read and Write the ring may take goes on it, whether or not its file takes it without
    # blocking (:meth:`_takes_nowait`; io-wq then does the step): for the tests, which must drive
    # the ring's reads and writes on whatever file system holds their files, and for measuring.

    def __init__(self, conn, Py_ssize_t max_transfer, unsigned int sqpoll_idle_ms=0, unsigned int spin_us=0):
        TcpFastPath.__init__(self, conn, max_transfer)
        self.sqpoll_idle_ms = sqpoll_idle_ms
        self.spin_ns = spin_us * 1000 if sqpoll_idle_ms else 0
        self._ring_replies = []
        self._ring_ns = []
        self._ring_data = []
        self._resubmit = []
        self._nowait = {}
        self._last_fd = -1
        self.ring_reason = ""

    def __dealloc__(self):
        if self._live:
            io_uring_queue_exit(&self.ring)

    # -- the thread ----------------------------------------------------------------------------------

    def _run(self):
        """``TcpFastPath._run``, the ring closed when the thread leaves (it made it)."""
        try:
            super()._run()
        finally:
            if self._live:
                self._live = False
                io_uring_queue_exit(&self.ring)

    cdef int _serve_thread(self, int fd) except -1:
        """``TcpFastPath._serve_thread`` with the ring made at the thread's first entry (a ring
        refused here leaves this queue on the thread's system calls, said once), and what the
        ring holds sent before the socket is handed back."""
        cdef int err
        if not self._tried:
            self._tried = True
            err = _ring_init(&self.ring, _ENTRIES, self.sqpoll_idle_ms)
            if err < 0:
                self.ring_reason = f"io_uring_queue_init: {os.strerror(-err)}"
                log.warning("I/O queue thread runs without io_uring", qid=self.shape.qid, reason=self.ring_reason)
            else:
                self._live = True
        try:
            return TcpFastPath._serve_thread(self, fd)
        finally:
            if self._live and self._ops:
                self._chain(fd, False)

    cdef int _fill(self, int fd) except -2:
        """Send what this receive served and receive more: the chain (module docstring)."""
        if not self._live:
            return TcpFastPath._fill(self, fd)
        cdef int how = self._chain(fd, True)
        if how == _DONE:
            return 2
        return 1 if how == _ENDED or self._broken else 0

    cdef bint _serve(self, const unsigned char* header, Py_ssize_t hlen, const unsigned char* data,
                     Py_ssize_t dlen, long long start) except -1:
        """A capsule on the thread: onto the ring if it is one of the ring's commands; otherwise
        what the ring holds goes out first (``TcpServe``'s code sends with its own system calls),
        then ``TcpServe._serve``."""
        cdef int taken
        if self._live and self.threaded:
            taken = self._ring_take(header, hlen, data, dlen, start)
            if taken == 1:
                return True
            if taken == 2 or (self._ops and self._chain(self._tfd, False) != _DONE):
                return False  # the capsule stays in the reader, the loop's after the chain's
        return TcpServe._serve(self, header, hlen, data, dlen, start)

    cdef int _h2c_on_thread(self, PduReader reader, int fd) except -2:
        """``TcpFastPath._h2c_on_thread`` once what the ring holds went out (it sends and receives
        with its own system calls)."""
        if self._ops and self._chain(fd, False) != _DONE:
            return 0
        return TcpFastPath._h2c_on_thread(self, reader, fd)

    def _returned(self):
        """``TcpFastPath._returned``, the commands of a failed chain first: each to the Python
        queue, as the loop's ``take_pdu`` gives it a capsule the compiled path declined."""
        if self._resubmit:
            items, self._resubmit = self._resubmit, []
            self.threaded = False  # (TcpFastPath._returned says so too): the loop's queue now
            queue = self.queue
            for sqe, data in items:
                if self.transport.is_closing():
                    break
                queue.submit(sqe, None if data is None else memoryview(data))
        super()._returned()

    # -- the ring's commands -------------------------------------------------------------------------

    cdef int _ring_take(self, const unsigned char* header, Py_ssize_t hlen, const unsigned char* data,
                        Py_ssize_t dlen, long long start) except -1:
        """1: the capsule's Read or Write is on the ring (its reply with the chain's); 0: not a
        ring command, nothing done; 2: the chain before it failed (the capsule is the loop's)."""
        cdef RwCommand c
        cdef const unsigned char* q
        cdef unsigned int length
        cdef int sgl_id
        if hlen < _SQE_AT + _SQE_SIZE:
            return 0
        q = header + _SQE_AT
        parse_rw(q, &c)
        length = le32(q + _O_LEN)
        sgl_id = q[_O_SGL_ID]
        if c.opcode == _READ:
            if sgl_id != _SGL_TRANSPORT or self._by_reference(length):
                return 0
        elif c.opcode == _WRITE:
            if (sgl_id != _SGL_IN_CAPSULE or c.control & _FUA or le64(q + _O_ADDR) != 0
                    or length > self.shape.inline_size or data == NULL or dlen < length):
                return 0
        else:
            return 0
        entry = eligible(&c, length, False, self.ctrl, self.queue, &self.shape)
        if entry is None or self.transport.is_closing():
            return 0
        cdef FastNamespace ns = <FastNamespace><object>c.ns
        cdef off_t offset = <off_t>(c.slba << ns.lba_shift)
        cdef int fd = self._hold_namespace(entry, ns)
        if fd < 0:
            return 0  # withdrawn meanwhile: TcpServe declines it too
        cdef int how = _ON_RING if self.all_file_steps else self._takes_nowait(fd, c.opcode == _WRITE)
        if how == _OFF_RING:
            self._release_namespace(entry)
            return 0
        # what the ring holds is bounded as TcpServe bounds what it gathers (flush_at); a probing
        # write starts a chain, so that a refusal undoes no step that already ran (nothing is
        # written twice: the refused write wrote nothing, the steps after it were cancelled)
        if ((self._ops == _MAX_OPS or self._ring_bytes > self.flush_at or how == _PROBE and self._ops)
                and self._chain(self._tfd, False) != _DONE):
            self._release_namespace(entry)
            return 2
        if self._replies:  # TcpServe's replies of this receive go first, with its own send
            self._send_replies()
        cdef int i = self._ops
        cdef io_uring_sqe* sqe = io_uring_get_sqe(&self.ring)  # never NULL: _ENTRIES > a chain
        cdef bytes reply, copy = None
        cdef long long elapsed
        cdef unsigned char* p
        if i == 0:
            self._sqhd0 = self.queue.sqhd
        if c.opcode == _READ:
            reply = PyBytes_FromStringAndSize(NULL, _DATA_HLEN + length + (0 if self.shape.sqhd_disabled else _RESP_LEN))
            p = <unsigned char*>PyBytes_AS_STRING(reply)
            self._read_headers(p, c.cid, length)
            io_uring_prep_read(sqe, fd, p + _DATA_HLEN, length, offset)
            self._kind[i] = _KIND_READ
            self._probe[i] = -1
        else:
            # a copy: the reader's staging takes the next receive before the chain writes it
            copy = PyBytes_FromStringAndSize(<const char*>data, length)
            io_uring_prep_write(sqe, fd, PyBytes_AS_STRING(copy), length, offset)
            reply = self._capsule_reply(c.cid)
            self._kind[i] = _KIND_WRITE
            if how == _PROBE:
                sqe.rw_flags = RWF_NOWAIT
                self._probe[i] = fd
            else:
                self._probe[i] = -1
        sqe.flags = IOSQE_IO_LINK | IOSQE_CQE_SKIP_SUCCESS
        sqe.user_data = _TAG_FILE | i << 8
        memcpy(self._sqes[i], q, _SQE_SIZE)
        self._len[i] = length
        # counted now, before the host can see the reply, as TcpServe counts (taken back by _undo)
        elapsed = now_ns() - start
        self._elapsed[i] = elapsed
        self.counters._count(self._kind[i], length, elapsed)
        ns.counters._count(self._kind[i], length, elapsed)
        self._ring_replies.append(reply)
        self._ring_bytes += len(reply)
        self._ring_ns.append(entry)
        self._ring_ns.append(ns)
        self._ring_data.append(copy)
        self._ops = i + 1
        self.ctrl.traffic_seen = True
        self.served += 1  # before the host can see the reply, as TcpServe counts
        self.thread_served += 1
        self.ring_served += 1
        return 1

    cdef int _takes_nowait(self, int fd, bint write) except -1:
        """Where a read (a write) of ``fd`` goes: on the ring only if the file takes it without
        blocking (``RWF_NOWAIT``). A file that cannot (tmpfs for both; ext4 for buffered writes:
        measured, 6.18) makes io_uring hand the step to an io-wq worker thread, two more context
        switches per I/O than the thread's own ``pread``/``pwrite``, so its commands are
        ``TcpServe``'s. Learned once per descriptor: a read by a one-byte ``preadv2(RWF_NOWAIT)``;
        a write by the command's own write on the ring with ``RWF_NOWAIT`` (``_PROBE``): done
        once, it is the command's write; refused, it wrote nothing and the chain is undone (the
        loop's queue writes it). A ``pwritev2(RWF_NOWAIT)`` here, before ``TcpServe``'s own
        write, used to write the bytes twice on a file that takes it (XFS). A descriptor number
        reused by a later namespace keeps what was learned: a wrong answer costs speed only."""
        cdef int known
        cdef unsigned char byte
        cdef iovec v
        cdef Py_ssize_t n
        if fd != self._last_fd:
            self._last_fd = fd
            self._last_nowait = self._nowait.get(fd, 0)
        known = self._last_nowait
        if write:
            if not known & _WRITE_KNOWN:
                return _PROBE
            return _ON_RING if known & _WRITE_NOWAIT else _OFF_RING
        if not known & _READ_KNOWN:
            v.iov_base = &byte
            v.iov_len = 1
            with nogil:
                n = preadv2(fd, &v, 1, 0, RWF_NOWAIT)
            known |= _READ_KNOWN | (0 if n < 0 and errno == EOPNOTSUPP else _READ_NOWAIT)
            self._learned(fd, known)
        return _ON_RING if known & _READ_NOWAIT else _OFF_RING

    cdef int _learned(self, int fd, int known) except -1:
        self._nowait[fd] = known
        if fd == self._last_fd:
            self._last_nowait = known
        return 0

    cdef int _chain(self, int fd, bint receive) except -1:
        """Submit what the ring holds (the file steps, then one ``sendmsg`` of their replies and of
        any TcpServe gathered), then a ``recv`` into the reader's staging when ``receive``; wait
        for the completions the chain posts and settle them (module docstring)."""
        cdef PduReader reader = self.reader
        cdef io_uring_sqe* sqe
        cdef io_uring_cqe* cqe
        cdef Py_ssize_t n = 0, room = 0, i, total = 0
        cdef unsigned char* p = NULL
        cdef unsigned long long tag = 0
        cdef int res = 0, err, left
        cdef bint full = False
        cdef list replies = self._ring_replies
        cdef bytes reply
        if self._replies:
            if self._ops or len(self._replies) > _IOV:  # (never with _ops: _ring_take sent them)
                self._send_replies()  # with TcpServe's own system calls
            else:  # TcpServe's gathered ones, no ring command since: with this chain's send
                replies.extend(self._replies)
                del self._replies[:]
                self._gathered = 0
        if receive:
            reader.get_buffer(-1)  # room for the rest (moves the PDU begun to the front if need be)
            p = reader._p + reader._end
            room = reader._size - reader._end
            if room <= 0:
                receive = False
                full = True
        n = len(replies)
        if n:
            for i in range(n):
                reply = <bytes>replies[i]
                self._iov[i].iov_base = PyBytes_AS_STRING(reply)
                self._iov[i].iov_len = len(reply)
                total += len(reply)
            memset(&self._msg, 0, sizeof(self._msg))
            self._msg.msg_iov = self._iov
            self._msg.msg_iovlen = n
            sqe = io_uring_get_sqe(&self.ring)
            io_uring_prep_sendmsg(sqe, fd, &self._msg, MSG_NOSIGNAL | MSG_WAITALL)
            sqe.user_data = _TAG_SEND
            if receive:  # its completion posted only while the chain holds namespaces (given back then)
                sqe.flags = IOSQE_IO_LINK | (0 if self._ops else IOSQE_CQE_SKIP_SUCCESS)
            self.thread_sends += 1
        if receive:
            sqe = io_uring_get_sqe(&self.ring)
            io_uring_prep_recv(sqe, fd, p, room, 0)
            sqe.user_data = _TAG_RECV
        elif not n:
            return _FULL if full else _DONE
        self.ring_chains += 1
        # the completions the chain posts if every step succeeds: the recv's, and the send's
        # when it is the last step or the chain holds namespaces
        left = (1 if receive else 0) + (1 if n and (self._ops or not receive) else 0)
        cqe = self._submit(left)
        while True:
            # a signal may end a wait before its completions (then wait again); a step the
            # kernel cancelled after a failure may post one (ignored)
            if cqe == NULL:
                with nogil:
                    err = io_uring_peek_cqe(&self.ring, &cqe)
                    if err < 0 and self.spin_ns:
                        err = _spin(&self.ring, &cqe, self.spin_ns)
                if err < 0:
                    cqe = self._wait(left)
                    if cqe == NULL:
                        continue
            tag = cqe.user_data
            res = cqe.res
            io_uring_cqe_seen(&self.ring, cqe)
            cqe = NULL
            if res == -ECANCELED:
                continue
            if tag == _TAG_SEND and res == total and receive:
                self._settle()  # the file steps and the send are done: the holds go back now
                left -= 1
                continue
            break
        if (tag & 0xff) == _TAG_FILE:
            i = tag >> 8
            if self._probe[i] >= 0:
                # as the pwritev2 probe read it: EOPNOTSUPP, the file never takes such writes (off
                # the ring); anything else, it does (EAGAIN: not now; XFS when the file's times
                # need a transaction, measured on 6.18), so io_uring's own retry handles a block
                self.ring_probes_refused += 1
                self._learned(self._probe[i], self._nowait.get(self._probe[i], 0) | _WRITE_KNOWN
                              | (0 if res == -EOPNOTSUPP else _WRITE_NOWAIT))
            self._undo()
            del replies[:]
            return _UNDONE
        self._settle()
        del replies[:]
        if tag == _TAG_SEND and res != total or tag == _TAG_RECV and res <= 0:
            if tag == _TAG_SEND:
                self._broken = True
            else:
                self._eof = res == 0  # else an error: the loop's read meets it too
            return _ENDED
        if tag == _TAG_RECV:
            reader.advance(res)
        return _FULL if full else _DONE

    cdef io_uring_cqe* _submit(self, int left) except? NULL:
        """Submit the chain. Without SQPOLL, and wait for its ``left`` completions in the same
        ``io_uring_enter`` (for at most ``_HOLD_WAIT_NS`` while it holds namespaces); a completion
        it brought, or NULL. With SQPOLL the kernel's thread takes it from the ring: a system call
        only to wake that thread when it has gone idle (``IORING_SQ_NEED_WAKEUP``, which liburing
        checks), counted as liburing will make it; the wait is :meth:`_chain`'s. A signal's
        retry submits only what the kernel has not taken yet (liburing counts from its head)."""
        cdef int err
        cdef io_uring_cqe* cqe = NULL
        cdef __kernel_timespec ts
        ts.tv_sec = 0
        ts.tv_nsec = _HOLD_WAIT_NS
        while True:
            if self.sqpoll_idle_ms:
                if self.ring.sq.kflags[0] & IORING_SQ_NEED_WAKEUP:
                    self.ring_enters += 1
                with nogil:
                    err = io_uring_submit(&self.ring)
            elif self._ops:
                self.ring_enters += 1  # (liburing makes one io_uring_enter when given a timeout)
                with nogil:
                    err = io_uring_submit_and_wait_timeout(&self.ring, &cqe, left, &ts, NULL)
            else:
                self.ring_enters += 1
                with nogil:
                    err = io_uring_submit_and_wait(&self.ring, left)
            if err >= 0 or err == -ETIME or cqe != NULL:
                return cqe
            if err != -EINTR:
                raise OSError(-err, f"io_uring_submit: {os.strerror(-err)}")

    cdef io_uring_cqe* _wait(self, int left) except? NULL:
        """Sleep in the kernel until ``left`` completions are in the ring (the chain's still to
        come), for at most ``_HOLD_WAIT_NS`` while the chain holds namespaces: one
        ``io_uring_enter``. A completion, or NULL (a signal, or that time is up)."""
        cdef int err
        cdef io_uring_cqe* cqe = NULL
        cdef __kernel_timespec ts
        ts.tv_sec = 0
        ts.tv_nsec = _HOLD_WAIT_NS
        self.ring_enters += 1
        with nogil:
            err = io_uring_wait_cqes(&self.ring, &cqe, left, &ts if self._ops else NULL, NULL)
        if err < 0 and cqe == NULL and err != -EINTR and err != -ETIME:
            raise OSError(-err, f"io_uring_wait_cqes: {os.strerror(-err)}")
        return cqe

    cdef int _settle(self) except -1:
        """The chain's commands succeeded: their namespaces given back, and what their probing
        writes taught (the file takes writes with ``RWF_NOWAIT``)."""
        cdef int i
        cdef list held = self._ring_ns
        for i in range(self._ops):
            if self._probe[i] >= 0:
                self._learned(self._probe[i], self._nowait.get(self._probe[i], 0) | _WRITE_KNOWN | _WRITE_NOWAIT)
            self._release_namespace(held[2 * i])
        self._clear()
        return 0

    cdef int _undo(self) except -1:
        """A file step of the chain failed (nothing of it was sent): SQHD back to where the chain
        began, the namespaces and counts given back, each command to the loop (``_returned``)."""
        cdef int i
        cdef list held = self._ring_ns
        cdef list data = self._ring_data
        cdef FastNamespace ns
        if self._ops:
            self.queue.sqhd = self._sqhd0
        for i in range(self._ops):
            ns = <FastNamespace>held[2 * i + 1]
            self.counters._uncount(self._kind[i], self._len[i], self._elapsed[i])
            ns.counters._uncount(self._kind[i], self._len[i], self._elapsed[i])
            self._release_namespace(held[2 * i])
            self._resubmit.append((PyBytes_FromStringAndSize(<const char*>self._sqes[i], _SQE_SIZE), data[i]))
        self.served -= self._ops
        self.thread_served -= self._ops
        self.ring_served -= self._ops
        self.ring_undone += self._ops
        self._clear()
        return 0

    cdef int _clear(self) except -1:
        self._ops = 0
        self._ring_bytes = 0
        del self._ring_ns[:]
        del self._ring_data[:]
        return 0
