# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Twin of :class:`target.tcp.TcpTargetConnection`'s receive loop (``_receive``, ``take_pdu``) and
of the R2T writes' end (``TargetQueue.data_ready``): :class:`TcpFastPath`, the compiled NVMe/TCP
path of one connection, is :class:`target._tcp_io.TcpServe` (serving one capsule) with the
connection's receive loop in C (:meth:`TcpFastPath.buffer_updated`), the queue's own thread
(docs/dataplane.md, "The target's threaded queue") and the data of the R2T writes it sent.

An R2T write cannot complete inside the call: it holds its pool slot (``queue.in_flight``), its
namespace (``ns.in_flight``) and its buffer's share of the per-queue and daemon-wide R2T budgets
across the host's round trip, as the queue's own R2T writes do. Its R2T is sent here only while
both budgets have room now and no earlier write waits for them (otherwise the queue makes it
wait in line, and the wake-up stays the queue's); its :class:`R2tWrite` stands in
``TcpTargetConnection.r2t_pending`` where the queue's request would, so the connection's checks
and placement of the H2CData are unchanged, and :meth:`TcpFastPath.data_ready` writes and
answers it once the last H2CData is in. The ends left to Python get the request the queue would
have made (``TargetQueue.adopt_write``): a connection lost before the data (Data Transfer Error,
as the queue's), a ``pwrite`` that fails or a namespace changed during the round trip (the queue
writes it). Measured (docs/dataplane.md, "R2T writes in C"): target user time per 1 MiB write
102–117 µs → 65–74 µs through FUSE; the rest is the kernel's copies. On the queue's thread the
thread sends the R2T and takes the H2CData itself (:meth:`TcpFastPath._h2c_on_thread`: exactly
what the connection's checks accept without a word, everything else left to the loop in the
reader): 77-80 → 30 µs of user time per 1 MiB write, ~20 → 6 system calls.
"""

from cpython.bytearray cimport PyByteArray_AS_STRING
from libc.errno cimport EINTR, errno
from libc.string cimport memcpy
from posix.fcntl cimport F_GETFL, F_SETFL, O_NONBLOCK, fcntl
from posix.types cimport off_t
from posix.unistd cimport close, dup

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from blockd._iostats cimport now_ns
from blockd._le cimport le16, le32
from blockd._output cimport OutputBatcher
from blockd._pdu_reader cimport PduReader
from target._file_io cimport _HOST_CLOSED, _SOCKET_FAILED, _SPLICED, FastFile, FastNamespace, _pwrite_all, _splice_write
from target._io_core cimport _FUA, _KIND_WRITE, _SQE_SIZE, _WRITE
from target._tcp_io cimport (
    _CAPSULE_CMD, _D_CID, _D_DATAL, _D_DATAO, _D_TTAG, _DATA_HLEN, _DIGEST_FLAGS, _F_CONTROL, _F_SLBA, _H2C_DATA,
    _HDR, _LAST, _O_HFLAGS, _O_HLEN_CMD, _O_PDO, _O_PLEN, _O_TYPE, _SQE_AT, R2tWrite, TcpServe,
)

import asyncio
import os
import threading

import structlog

from blockd.tcp_frames import DataDigestError, FramingError

cdef extern from "<sys/socket.h>" nogil:
    Py_ssize_t recv(int fd, void* buf, size_t n, int flags)
    int shutdown(int fd, int how)
    int MSG_WAITALL
    int SHUT_RDWR

log = structlog.get_logger("blockd.target.tcp")

THREAD_JOIN_TIMEOUT = 5.0
"""Seconds a closing connection waits for its queue's thread to leave (it is woken by
``shutdown``; only a ``pread``/``pwrite`` that the disk holds can make it take longer)."""


cdef class TcpFastPath(TcpServe):
    """The compiled path of one NVMe/TCP I/O queue (module docstring): what :class:`TcpServe`
    serves, from the connection's receive loop in C or from the queue's thread."""

    # -- the receive loop ----------------------------------------------------------------------------

    def get_buffer(self, Py_ssize_t sizehint):
        """``PduProtocol.get_buffer``: where the socket's next bytes go (the reader's staging)."""
        reader = self.conn.reader
        if reader is self.reader:
            return self.reader.get_buffer(sizehint)
        return reader.get_buffer(sizehint)  # a terminated connection's discarding reader

    def buffer_updated(self, Py_ssize_t nbytes):
        """``PduProtocol.buffer_updated`` with ``TcpTargetConnection._receive`` in C: the
        connection's receive callback (the connection binds it in place of its own, so the
        event loop calls it directly). Every PDU the reader completes is handled in arrival
        order: a whole command capsule in staging that the fast path serves is served from
        there (no ``Pdu``, no ``place`` buffer, no Python call); every other PDU is taken from
        the reader as ``_receive`` takes it and handed to ``TcpTargetConnection.take_pdu``, the
        Python path's own handler, with the same stop when the connection pauses; framing and
        digest errors go to ``terminate`` and ``digest_error`` as there."""
        conn = self.conn
        if self.threaded:
            return  # the thread owns the reader (a resume's take-waiting): _returned takes what it left
        if self.reader is None or conn.reader is not self.reader:
            return self.py_buffer_updated(conn, nbytes)  # terminated: the Python path discards
        cdef OutputBatcher out = conn.out  # the compiled one: the compiled twins run together
        if out is None:  # a refused connection (never connected): what the Python path does with it
            return self.py_buffer_updated(conn, nbytes)
        out._hold()
        try:
            self._receive(nbytes)
        finally:
            out._release()
        if self.thread_enabled:
            self._to_thread()

    cdef int _receive(self, Py_ssize_t nbytes) except -1:
        cdef PduReader reader = self.reader
        cdef Py_ssize_t plen
        conn = self.conn
        while True:
            try:
                if reader.advance(nbytes):
                    while True:
                        if not self._off and (self._bound or self._bind()):
                            plen = reader.whole(_CAPSULE_CMD)
                            if plen >= 0 and self._serve_staged(reader, plen):
                                reader.skip(plen)
                                if conn.paused:  # the rest stays in the reader until resume_writing
                                    return 0
                                continue
                        pdu = reader.take()
                        if pdu is None:
                            return 0
                        if not conn.take_pdu(pdu):
                            return 0
                return 0
            except FramingError as exc:
                conn.terminate(exc)
                return 0
            except DataDigestError as exc:
                conn.digest_error(exc)
                if conn.transport.is_closing():
                    return 0
                nbytes = 0  # the reader skipped the bad PDU; go on with what follows it

    cdef bint _serve_staged(self, PduReader reader, Py_ssize_t plen) except -1:
        """Serve the whole CapsuleCmd at the reader's position from staging, if the fast path can."""
        cdef long long start = now_ns()
        cdef const unsigned char* h = reader._p + reader._start
        cdef Py_ssize_t hlen = h[_O_HLEN_CMD]
        cdef Py_ssize_t dlen = plen - hlen
        if dlen > self.shape.inline_size:
            return False  # the connection's place callback refuses it (a framing error): Python's
        return self._serve(h, hlen, h + hlen if dlen else NULL, dlen, start)

    # -- the queue's thread (docs/dataplane.md, "The target's threaded queue") -----------------------

    cdef int _to_thread(self) except -1:
        """Give the socket to the queue's thread when the queue is idle: bound to this path, no
        command of the Python side in flight (none in the queue, no R2T pending or waiting),
        nothing unsent (batcher, transport, pipe), no part of a PDU in the reader, not paused or
        closing. Then nothing the loop does writes to the socket or reads it until the thread
        hands it back (:meth:`_returned`), so the wire order is the reference's."""
        conn = self.conn
        cdef PduReader reader = self.reader
        if (self.threaded or self._stopping or self._thread_done or not self._bound or self._off
                or self.sock < 0 or conn.paused or conn.reader is not reader or reader._pl_dest is not None
                or reader._end != reader._start or self.out._bufs or self.queue.in_flight
                or conn.r2t_pending or conn.r2t_waiting or self.transport.is_closing() or self.write_buffer_size()):
            return 0
        pipe = conn.pipe
        if pipe is not None and pipe.queued:
            return 0
        if self._thread is None:
            # the thread's own descriptor: a close by the loop can never make it use a number
            # reused by then (the loop ends it with shutdown(), which acts on the socket)
            self._tfd = dup(self.sock)
            if self._tfd < 0:
                self._thread_done = True
                return 0
            self._loop = asyncio.get_running_loop()
            self._wake = threading.Lock()
            self._wake.acquire()
            self._waiting = True
            self._thread = threading.Thread(target=self._run, name=f"blockd-tcp-q{self.shape.qid}", daemon=True)
            self._thread.start()
            log.info("I/O queue served by its own thread", qid=self.shape.qid, peer=self.queue.peer)
        elif not self._waiting:
            return 0  # between its hand-back and its wait: the next idle receive gives it the socket
        self.transport.pause_reading()
        self.threaded = True
        self.thread_entries += 1
        self._waiting = False
        self._wake.release()
        return 0

    def _run(self):
        """The queue's thread: waits to be given the socket, serves steady Reads and Writes
        (in-capsule or by R2T) from it (:meth:`_serve_thread`), hands it back to the loop
        (:meth:`_returned`), and waits again; ends when the connection ends (the loop's
        :meth:`stop_thread`, or the socket did). The GIL is held for the per-command work and
        released around every system call."""
        cdef int ended = 0
        cdef int fd = self._tfd
        cdef int flags
        try:
            while not ended:
                self._wake.acquire()
                if self._stopping:
                    break
                flags = fcntl(fd, F_GETFL)  # one open file with the loop's descriptor: shared flags
                fcntl(fd, F_SETFL, flags & ~O_NONBLOCK)  # the loop neither reads nor writes it now
                try:
                    ended = self._serve_thread(fd)
                except Exception:  # a bug: the connection ends, never left with a stream cut part way
                    log.exception("I/O queue thread failed; ending the connection", qid=self.shape.qid)
                    shutdown(fd, SHUT_RDWR)
                    ended = 1
                finally:
                    fcntl(fd, F_SETFL, flags | O_NONBLOCK)  # before the loop reads it again
                    if self._stopping:  # stop_thread has been: it will not wake a wait any more
                        ended = 1
                    self._waiting = not ended
                    try:
                        self._loop.call_soon_threadsafe(self._returned)
                    except RuntimeError:  # the loop is closed: the daemon has stopped
                        ended = 1
        finally:
            self._thread_done = True
            self._tfd = -1  # under the GIL, so the loop's shutdown() never sees a closed number
            close(fd)

    cdef int _serve_thread(self, int fd) except -1:
        """Serve whole CapsuleCmds from the reader while it has them and receive more into it;
        0: a PDU or command this thread does not serve (left whole or in part in the reader), or
        the queue paused, closing or stopping: the loop goes on from there; 1: the socket ended.
        The replies it gathered are sent before it hands back (the loop's come after them)."""
        self._replies = []
        self._gathered = 0
        try:
            return self._serve_received(fd)
        finally:
            self._send_replies()

    cdef int _serve_received(self, int fd) except -1:
        cdef PduReader reader = self.reader
        cdef Py_ssize_t plen, pending
        cdef int taken, n
        cdef const unsigned char* h
        conn = self.conn
        transport = self.transport
        while True:
            while True:
                if self._broken:
                    return 1
                if self._stopping or conn.paused or transport.is_closing():
                    return 0
                plen = reader.whole(_CAPSULE_CMD)
                if plen >= 0:
                    if not self._serve_staged(reader, plen):
                        return 0
                    reader.skip(plen)
                    continue
                pending = reader._end - reader._start
                if pending >= _HDR:
                    h = reader._p + reader._start
                    if h[_O_TYPE] == _H2C_DATA:
                        if pending < _DATA_HLEN:  # wait for the rest of its header if it can be one
                            if h[_O_HLEN_CMD] != _DATA_HLEN:
                                return 0
                            break
                        taken = self._h2c_on_thread(reader, fd)
                        if taken < 0:
                            return 1
                        if not taken:
                            return 0
                        continue
                    if not self._awaited(h, pending, reader._size):
                        return 0
                break
            n = self._fill(fd)
            if n != 2:
                return n

    cdef int _fill(self, int fd) except -2:
        """Send what this receive served and receive more into the reader: 2 (go on), 1 (the
        socket ended or failed), 0 (staging is full: the loop's). The step
        ``target/_uring_loop.pyx`` replaces with one io_uring submission."""
        cdef PduReader reader = self.reader
        cdef Py_ssize_t room, n
        cdef unsigned char* p
        # every whole capsule received is served: their replies go in one sendmsg, as the
        # loop sends one batch per receive (one send per reply cost the VM bed's QD32 a
        # quarter of its IOPS in system time, 221 -> 348 us per I/O)
        self._send_replies()
        if self._broken:
            return 1
        reader.get_buffer(-1)  # room for the rest (moves the PDU begun to the front if need be)
        p = reader._p + reader._end
        room = reader._size - reader._end
        if room <= 0:
            return 0
        with nogil:
            n = recv(fd, p, room, 0)
            while n < 0 and errno == EINTR:
                n = recv(fd, p, room, 0)
        if n <= 0:
            self._eof = n == 0  # else an error: the loop's read meets it too
            return 1
        reader.advance(n)
        return 2

    cdef int _h2c_on_thread(self, PduReader reader, int fd) except -2:
        """The H2CData at the reader's position (its header in staging) for an R2T write that
        this thread sent, in the steady case: its data into the write's buffer (what staging
        holds of it, then the rest received straight into it), and the write written and answered
        (:meth:`_written`) once its last PDU is in. 1: taken; 0: any other PDU or case, left
        whole in the reader for the loop (``TcpTargetConnection._place`` and ``_h2c_data`` judge
        it as ever, the write still in ``r2t_pending``); -1: the socket ended. A large write in
        one PDU goes through the connection's pipe instead, socket to file
        (:meth:`_h2c_by_reference`).

        What is taken here is exactly what ``PduReader._next``, ``_place`` and ``_h2c_data``
        accept without a word: no digest or other flag but LAST_PDU, and that one on the last
        PDU only; HLEN, PDO, PLEN and DATAL in agreement; no more data than the reader takes;
        a tag of this thread's R2T (its :class:`R2tWrite`), the command's CID, the offset the
        data has reached and the range asked for. The PDU stays at the reader's position
        (``in_pdu``) until its data is all in, so the loop's PDU timeout ends a host that stops
        in the middle as it would on the loop. These writes used to hand the socket back to the
        loop, one hand-back and one re-entry per write, about 20 system calls per 1 MiB write
        (``strace -c``), the target's user time 77-80 us of it."""
        cdef const unsigned char* h = reader._p + reader._start
        cdef int flags = h[_O_HFLAGS]
        cdef Py_ssize_t plen = le32(h + _O_PLEN)
        cdef Py_ssize_t datao = le32(h + _D_DATAO)
        cdef Py_ssize_t datal = le32(h + _D_DATAL)
        cdef Py_ssize_t have, rest, n = 0, got, received
        cdef unsigned int ttag
        cdef unsigned char* dst
        cdef R2tWrite w
        cdef bint last
        cdef int ffd
        conn = self.conn
        if (flags & ~_LAST or h[_O_HLEN_CMD] != _DATA_HLEN or h[_O_PDO] != _DATA_HLEN or datal <= 0
                or plen != _DATA_HLEN + datal or datal > reader.max_data):
            return 0
        ttag = le16(h + _D_TTAG)
        entry = conn.r2t_pending.get(ttag)
        if entry is None or type(entry[0]) is not R2tWrite:
            return 0
        w = <R2tWrite>entry[0]
        received = entry[1]
        last = datao + datal == w.length
        if (w.cid != le16(h + _D_CID) or datao != received or datao + datal > w.length
                or last != (flags == _LAST)):
            return 0
        dst = <unsigned char*>PyByteArray_AS_STRING(w.data) + datao
        have = min(reader._end - reader._start - _DATA_HLEN, datal)
        memcpy(dst, h + _DATA_HLEN, have)
        rest = datal - have
        if rest:
            self._send_replies()  # what this receive served goes out before the thread waits
            if self._broken:
                return -1
            if datao == 0 and last and rest >= self.by_reference_min and self._pipe_holds(rest):
                ffd = self._write_fd(w.nsobj, w.ns)
                if ffd >= 0:
                    return self._h2c_by_reference(reader, fd, ffd, w, ttag, h + _DATA_HLEN, have)
            got = have
            with nogil:
                while rest > 0:
                    n = recv(fd, dst + got, rest, MSG_WAITALL)
                    if n > 0:
                        got += n
                        rest -= n
                    elif n < 0 and errno == EINTR:
                        continue
                    else:
                        break
            if rest:
                self._eof = n == 0  # else an error: the loop's read meets it too
                return -1
        reader.skip(_DATA_HLEN + have)
        self.thread_data += 1
        if self._stopping:
            return -1  # the connection ends: connection_lost fails the write (r2t_pending)
        if not last:
            conn.r2t_pending[ttag] = (w, received + datal)
            return 1
        del conn.r2t_pending[ttag]
        if self._written(w.nsobj, w.ns, w.offset, w.data, w.length, w.cid, w.start_ns, w.length):
            return 1
        # the namespace changed or the write failed: the loop's data_ready, first thing on return
        conn.r2t_pending[ttag] = (w, w.length)
        self._handoff.append((ttag, 0))
        return 0

    cdef int _h2c_by_reference(self, PduReader reader, int sock, int fd, R2tWrite w, unsigned int ttag,
                               const unsigned char* staged, Py_ssize_t have) except -2:
        """A whole R2T write in one H2CData PDU, its first ``have`` bytes in staging after the
        header, the rest in the socket: written to the file through the connection's pipe
        (:func:`_splice_write`: one copy of the data, the file's own, where ``recv`` into the
        buffer and ``pwrite`` make two) and answered as :meth:`_written` answers, 1. The
        namespace was checked when the header came (as a capsule's is when it comes). If the
        file refuses the data, the write goes back to ``r2t_pending`` for the loop's queue to
        fail as its own failed write ends (``TargetQueue.write_failed``), 0; -1: the socket
        ended, the write left to ``connection_lost``.

        Measured before it (1 MiB on loopback TCP into tmpfs, pinned to one CPU as the FUSE
        bench is, alternated): the receiver's system time 247-266 -> 189-210 us per MiB with
        the data put whole in a 1 MiB pipe first, about the same as splicing to the file as the
        data comes (186-211), which is kept for a pipe that fills only: a host that stops part
        way would leave part of the write in the file (docs/dataplane.md, "R2T write data
        through the pipe")."""
        cdef int error = 0, how
        cdef int pr = self.pipe_r, pw = self.pipe_w
        cdef Py_ssize_t length = w.length
        cdef off_t offset = w.offset
        with nogil:
            how = _splice_write(sock, pr, pw, fd, offset, staged, have, length, &error)
        if how == _HOST_CLOSED or how == _SOCKET_FAILED:
            self.pipe.discard()
            self._eof = how == _HOST_CLOSED  # else an error: the loop's read meets it too
            return -1
        reader.skip(_DATA_HLEN + have)
        self.thread_data += 1
        if self._stopping:
            return -1  # the connection ends: connection_lost fails the write (r2t_pending)
        if how == _SPLICED:
            del self.conn.r2t_pending[ttag]
            self.thread_spliced += 1
            self._answer_write(w.nsobj, w.ns, length, w.cid, w.start_ns, length)
            return 1
        self.conn.r2t_pending[ttag] = (w, length)
        self._handoff.append((ttag, error))
        return 0

    cdef bint _pipe_holds(self, Py_ssize_t length) except -1:
        """Whether the connection's pipe can hold ``length`` bytes of an R2T write's data (grown
        if need be; a Python call only for a length larger than any asked before). On the
        queue's thread the pipe is empty between commands (:meth:`_read_by_reference` drains
        it whole; :meth:`_to_thread` gives no queued pipe to the thread)."""
        if length <= self.pipe_data_room:
            return True
        if length >= self.pipe_data_refused:
            return False
        pipe = self._connection_pipe()
        if pipe.queued:
            return False
        if not pipe.holds(length):
            self.pipe_data_refused = length
            return False
        self.pipe_data_room = length
        return True

    cdef bint _awaited(self, const unsigned char* h, Py_ssize_t pending, Py_ssize_t room) noexcept:
        """Whether the begun PDU at ``h`` (its common header in) is a CapsuleCmd that
        ``PduReader.whole`` will give whole once the rest is in, that this path may serve
        (in-capsule data within the queue's size) and that staging holds: only then does the
        thread wait for it. Any other header is the loop's to judge at once, as its reader
        judges headers (a framing error comes when the header does, not when PLEN bytes have)."""
        cdef Py_ssize_t hlen = h[_O_HLEN_CMD]
        cdef Py_ssize_t plen = le32(h + _O_PLEN)
        return (h[_O_TYPE] == _CAPSULE_CMD and not h[_O_HFLAGS] & _DIGEST_FLAGS and hlen == _SQE_AT + _SQE_SIZE
                and hlen <= plen <= hlen + self.shape.inline_size and (plen == hlen or h[_O_PDO] == hlen)
                and pending < plen <= room)

    def _returned(self):
        """The thread handed the socket back (the loop's callback): what it left in the reader
        goes the ordinary way (``take_pdu``, the Python queue), then the loop reads again; the next
        idle receive may give the socket to the thread again."""
        self.threaded = False
        conn = self.conn
        if self._handoff:  # R2T writes whose data the thread took and could not write
            handoff, self._handoff = self._handoff, []
            for ttag, error in handoff:
                entry = conn.r2t_pending.pop(ttag, None)
                if entry is None:
                    continue  # connection_lost failed it already
                if error:  # its data went to the file by splice, which refused it (_h2c_by_reference)
                    self.queue.write_failed(self.request(entry[0]), OSError(error, os.strerror(error)))
                else:
                    self.data_ready(entry[0])
        if self.transport.is_closing() or conn.paused:
            return  # closing: connection_lost follows; paused: resume_writing reads again
        if self._eof:  # the host closed: what the loop does at end of stream, now (its QIDs free at once)
            self.buffer_updated(0)
            if not self.transport.is_closing():
                self.transport.close()
            return
        self.transport.resume_reading()
        self.buffer_updated(0)


    def stop_thread(self):
        """End the queue's thread (the connection closes): ``shutdown`` wakes it from ``recv``
        or ``send``, then the loop waits for it to leave, so no file descriptor or system call
        of it outlives the connection (namespaces close after their connections at stop)."""
        if self._thread is None:
            return
        self._stopping = True
        if self._tfd >= 0:
            shutdown(self._tfd, SHUT_RDWR)
        if self._waiting:
            self._waiting = False
            self._wake.release()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(THREAD_JOIN_TIMEOUT)


    def data_ready(self, req):
        """``TargetQueue.data_ready`` for an R2T write whose H2CData ``TcpTargetConnection`` has
        placed in ``req.data``: written and answered here if it is the steady-state case, else
        False with nothing done and the Python queue runs it. ``req`` is the :class:`R2tWrite` of
        an R2T sent here (always True: one whose write fails goes to the queue as its request), or
        the queue's own request when the queue sent the R2T (it waited for budget, or the path was
        not bound yet): served here if it is a plain Write without FUA to a namespace served here.
        Either holds what the queue holds until ``response_sent`` (:meth:`_send_r2t`); given back
        in :meth:`_written` at the points ``TargetQueue._complete``, ``queue_response`` and
        ``response_sent`` do."""
        cdef R2tWrite w
        if type(req) is R2tWrite:
            w = <R2tWrite>req
            if not self._written(w.nsobj, w.ns, w.offset, w.data, w.length, w.cid, w.start_ns, w.length):
                self.queue.data_ready(self.request(w))  # reports the error, or writes through a new backend
            return True
        if not self._bound or self._off or req.opcode != _WRITE or req.fields[_F_CONTROL] & _FUA:
            return False
        nsobj = req.ns
        fast = nsobj.fast
        if fast is None:
            return False
        cdef FastNamespace ns = <FastNamespace?>fast
        return self._written(nsobj, ns, <off_t>(<unsigned long long>req.fields[_F_SLBA] << ns.lba_shift), req.data,
                             req.length, req.cid, req.start_ns, req.transport_ctx)

    def request(self, req):
        """The queue's :class:`target.request.Request` for an :class:`R2tWrite` (``req`` itself
        if it is one already): the request ``TargetQueue.submit`` would have made and left
        waiting for its data, holding what the R2tWrite holds (so ``TargetQueue.data_failed``
        and ``data_ready`` end it as the queue ends its own)."""
        if type(req) is not R2tWrite:
            return req
        cdef R2tWrite w = <R2tWrite>req
        return self.queue.adopt_write(w.sqe, w.start_ns, w.nsobj, w.data, w.length)

    cdef bint _written(self, nsobj, FastNamespace ns, off_t offset, data, Py_ssize_t length, unsigned int cid,
                       long long start, held) except -1:
        """Write an R2T write's data from its buffer and answer it (:meth:`_answer_write`);
        False with nothing done if the namespace changed since it was checked or the write
        fails (the Python queue writes it then)."""
        cdef int fd = self._write_fd(nsobj, ns)
        if fd < 0:
            return False
        cdef Py_buffer db
        PyObject_GetBuffer(data, &db, PyBUF_SIMPLE)
        cdef const unsigned char* p = <const unsigned char*>db.buf
        cdef Py_ssize_t done = 0
        try:
            if db.len != length:
                return False
            with nogil:
                done = _pwrite_all(fd, p, length, offset)
        finally:
            PyBuffer_Release(&db)
        if done != length:
            return False
        self._answer_write(nsobj, ns, length, cid, start, held)
        return True

    cdef int _write_fd(self, nsobj, FastNamespace ns) except -2:
        """The file an R2T write's data goes to, or -1 if its namespace changed since it was
        checked or the connection is closing (the Python queue writes it then, or fails it)."""
        cdef FastFile f = ns.file
        if (not self._bound or self._off or not ns.accessible or f.fd < 0 or f.read_only
                or nsobj.backend is not ns.backend or self.transport.is_closing()):
            return -1
        return f.fd

    cdef int _answer_write(self, nsobj, FastNamespace ns, Py_ssize_t length, unsigned int cid, long long start,
                           held) except -1:
        """Answer an R2T write whose data is written, and give back what it held.

        On the queue's thread (:meth:`_h2c_on_thread`) the same, with what only the loop may do
        left to it: the namespace's last hold of a removed one closes its file there
        (``_release_namespace``: the loop may remove it while the write runs without the GIL),
        and the daemon-wide budget's waiting queues are woken there (``DataBudget.free``, then
        ``give(0)`` on the loop). No R2T of this connection waits for budget meanwhile: the
        queue goes to its thread only without one, and the thread hands back the capsule whose
        R2T would have to wait."""
        cdef bint threaded = self.threaded
        # TargetQueue._complete: SQHD, the counters from the capsule's arrival, the namespace
        cdef bytes resp = self._capsule_reply(cid)
        self._complete(ns, _KIND_WRITE, length, start)
        if threaded:
            self._release_namespace(nsobj)
        else:
            # a removed namespace's copy is withdrawn (not accessible) before anything else, so
            # the queue, not this, gives back the last hold of one and closes its file
            nsobj.in_flight -= 1
        # TcpTargetConnection.queue_response: the buffer's budget back (and the R2Ts that lets go
        # out before this CapsuleResp), then the CapsuleResp; TargetQueue.response_sent: the slot
        conn = self.conn
        if held:
            conn.r2t_held -= held
            budget = conn.target.r2t_budget
            if not threaded:
                budget.give(held)
                if conn.r2t_waiting:
                    conn.send_r2ts()
            elif budget.free(held):
                self._loop.call_soon_threadsafe(budget.give, 0)
        self.served += 1  # before the reply can reach the host (_emit may send at once)
        if threaded:
            self._emit(resp)
        else:
            self.out._send((resp,))
        self.queue.in_flight -= 1
        return 0
