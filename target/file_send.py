"""Large NVMe/TCP Read data sent by reference: the file's page-cache pages go to the socket with
``splice(2)`` through a pipe of the connection's, not copied into a buffer of ours and out again.

The Python twin; the compiled one is ``TcpFastPath._read_by_reference`` in
``target/_tcp_io.pyx``, which does the same steps on the same pipe with the same syscalls.

Why a pipe of our own rather than ``sendfile(2)`` after the C2HData header (what the issue
asked for, and what commit d39f4b3 tried): ``sendfile`` only finds out that the file is shorter
than expected or that a page cannot be read (EIO) once the header is on the wire, and a started
PDU cannot be taken back, so such a Read could no longer end as it does today (a CapsuleResp with
Unrecovered Read Error and nothing before it); with SQ flow control off the header even carries
SUCCESS. ``sendfile`` is itself a splice through a pipe (the kernel's per-task one, 64 KiB at a
time); doing the two halves ourselves lets the file half run first, before anything is sent:

1. :meth:`PipedRead.fill` (the read): the C2HData header is written into the empty pipe, then
   the file range is spliced in after it (page references, no copy). If the range does not
   come whole (short file, EIO, a file system without ``splice``), the pipe is emptied and the
   caller reads the ordinary way, which answers (or fails) exactly as before.
2. :meth:`ReplyPipe.drain` (the send): the CapsuleResp is written in after the data (unless SQ
   flow control is off and the header's SUCCESS completes the command), and the pipe's
   content goes to the socket with one ``splice``, but only when nothing sent before it is
   still queued in user space: the transport's buffer is empty (uvloop keeps a ``write`` until
   the end of the loop iteration, so writing beside it would reorder bytes), and whatever the
   output batcher holds (replies of this receive batch) is written straight to the socket
   first (joined, one ``write``). What the socket does not take (its buffer is full: EAGAIN, or a partial splice) is
   read out of the pipe and goes through the batcher in order after it, the one copy the
   ordinary path makes; so does everything when the transport has bytes queued.

The bytes on the wire are the ordinary path's, in the same order. What decides whether a Read
goes this way is one place per twin: :meth:`target.tcp.TcpTargetConnection.read_buffer` (the
Python queue asks it for a read's buffer) and ``TcpFastPath._by_reference``.
"""

from __future__ import annotations

import fcntl
import os
from typing import Protocol, Sequence

BY_REFERENCE_MIN = 65536
"""Reads of at least this many bytes go by reference (both twins read it; the compiled one when
its connection binds). Below it the ordinary ``pread`` + one ``send`` stays: see
docs/dataplane.md, "Large reads by reference", for the figures that set it."""

_PAGE = os.sysconf("SC_PAGE_SIZE")
_SPARE_SLOTS = 3
"""Pipe slots beyond the data's pages: the header's, the CapsuleResp's, and one more page when
the file range does not start on a page (each spliced page and each write takes a slot)."""
_DISCARD_CHUNK = 1 << 20
DEVNULL = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
"""Where a pipe is emptied to: spliced there, its pages are dropped without a copy. Not ``read``:
reading pages spliced in from a socket can fail with EFAULT (seen in the VM bed, Debian's 6.1
kernel over veth, with R2T write data on a queue's thread: ``target/_tcp_io.pyx``)."""


class Batcher(Protocol):
    """What the drain needs of the connection's ``OutputBatcher`` (either twin)."""

    def take(self) -> list[bytes | memoryview]: ...

    def send(self, bufs: Sequence[bytes | memoryview]) -> None: ...


class Transport(Protocol):
    def get_write_buffer_size(self) -> int: ...


class ReplyPipe:
    """A connection's pipe for reads sent by reference: non-blocking, empty between replies, sized
    on demand for the largest read that used it (a size the kernel refuses, above
    ``/proc/sys/fs/pipe-max-size`` or the user's pipe pages, leaves larger reads to the ordinary
    path). A queue's thread also passes large R2T writes' data through it, socket to file
    (``TcpFastPath._h2c_on_thread``), and leaves it empty as well."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.size = fcntl.fcntl(self.w, fcntl.F_GETPIPE_SZ)
        self.refused = 1 << 62
        """The smallest size the kernel refused: not asked again."""
        self.queued = 0
        """Bytes in the pipe (a reply filled and not drained yet)."""
        self.sent = 0
        """Replies the Python twin sent from the pipe (the compiled twin counts its own:
        ``TcpFastPath.by_reference``)."""
        self.spilled = 0
        """Of those, the ones the socket did not take whole (the rest went through the transport)."""

    def room_for(self, length: int) -> bool:
        """Whether a read of ``length`` bytes fits with its header and CapsuleResp (growing the
        pipe if it must)."""
        return self.holds(length + _SPARE_SLOTS * _PAGE)

    def holds(self, need: int) -> bool:
        """Whether ``need`` bytes fit, growing the pipe if they do not: a reply's (``room_for``)
        or, on a queue's thread, an R2T write's data on its way from the socket to the file
        (``TcpFastPath._pipe_holds``), which needs no slot beyond its pages."""
        if need <= self.size:
            return True
        if need >= self.refused:
            return False
        try:
            self.size = fcntl.fcntl(self.w, fcntl.F_SETPIPE_SZ, need)
        except OSError:
            self.refused = need
            return False
        return True

    def discard(self) -> None:
        """Empty the pipe (what a failed fill or a reply that was never sent left in it)."""
        self.queued = 0
        try:
            while os.splice(self.r, DEVNULL, _DISCARD_CHUNK, flags=os.SPLICE_F_NONBLOCK):
                pass
        except BlockingIOError:
            pass

    def drain(self, out: Batcher, transport: Transport, sock: int, tail: bytes | None) -> bool:
        """Send the filled reply, ``tail`` (the CapsuleResp, or None) after it: straight to the
        socket ``sock`` as far as it takes it when nothing is queued before it, the rest through
        ``out``. True when some of it went to ``out`` (the caller flushes it)."""
        if tail is not None:
            os.write(self.w, tail)  # a few bytes into a pipe with room: never short
            self.queued += len(tail)
        left = self.queued
        self.queued = 0
        rest: list[bytes | memoryview] = []
        if not transport.get_write_buffer_size():
            rest = _write_direct(sock, out.take())
            if not rest:
                left -= _splice_out(self.r, sock, left)
        if left:
            rest.append(_read_exactly(self.r, left))
        self.sent += 1
        if not rest:
            return False
        self.spilled += 1
        out.send(rest)
        return True

    def close(self) -> None:
        os.close(self.r)
        os.close(self.w)


class PipedRead:
    """A Read's buffer that is a :class:`ReplyPipe`: ``req.buffer`` from the connection's
    ``read_buffer``, and ``req.reply`` once :meth:`fill` took the data."""

    __slots__ = ("pipe", "header", "length")

    def __init__(self, pipe: ReplyPipe, header: bytes, length: int) -> None:
        self.pipe = pipe
        self.header = header
        self.length = length

    def __len__(self) -> int:
        return self.length

    def fill(self, fd: int, offset: int) -> bool:
        """The header, then ``length`` bytes of ``fd`` at ``offset``, into the pipe; False, with
        the pipe empty again, when the range did not come whole."""
        pipe = self.pipe
        if pipe.queued:
            pipe.discard()  # a reply filled and never sent (its connection was closing)
        os.write(pipe.w, self.header)
        got = _splice_in(fd, pipe.w, offset, self.length)
        if got != self.length:
            pipe.discard()
            return False
        pipe.queued = len(self.header) + got
        return True


def _splice_in(fd: int, pipe_w: int, offset: int, length: int) -> int:
    """Bytes of the file range spliced into the pipe (fewer: end of file or an error)."""
    got = 0
    while got < length:
        try:
            n = os.splice(fd, pipe_w, length - got, offset_src=offset + got, flags=os.SPLICE_F_NONBLOCK)
        except OSError:
            break
        if n <= 0:
            break
        got += n
    return got


def _write_direct(sock: int, bufs: list[bytes | memoryview]) -> list[bytes | memoryview]:
    """Write ``bufs`` to the socket, joined, in one ``write``; what it did not take."""
    if not bufs:
        return bufs
    joined = b"".join(bufs)
    try:
        n = os.write(sock, joined)
    except OSError:  # full (EAGAIN), or the connection failed: the transport finds out itself
        n = 0
    return [memoryview(joined)[n:]] if n < len(joined) else []


def _splice_out(pipe_r: int, sock: int, length: int) -> int:
    """Bytes moved from the pipe to the socket before it was full (or failed)."""
    done = 0
    while done < length:
        try:
            n = os.splice(pipe_r, sock, length - done, flags=os.SPLICE_F_NONBLOCK)
        except OSError:  # full (EAGAIN), or the connection failed: the rest goes to the transport
            break
        if n <= 0:
            break
        done += n
    return done


def _read_exactly(pipe_r: int, length: int) -> bytes:
    """The next ``length`` bytes of the pipe (they are in it)."""
    parts = []
    while length:
        part = os.read(pipe_r, length)
        parts.append(part)
        length -= len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)
