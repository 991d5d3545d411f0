# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Twin of :class:`target.backend.FileBackend` and :mod:`target.file_send`: the compiled target
paths' file I/O. The C copies of a plain file backend (:class:`FastFile`) and of a namespace on it
(:class:`FastNamespace`), the check that a Read or Write of a range is theirs to serve
(:func:`served_namespace`), and the ``pwrite``/``splice`` loops that move data between a file, a
pipe and a socket (``file_send.py`` says why by reference, and does the same steps in Python).

Cimported by both transports (``target/_tcp_io.pyx``, ``target/_rdma_fast.pyx``) through
``target/_file_io.pxd``, as the kernel's ``io-cmd-file.c`` serves ``tcp.c`` and ``rdma.c``
alike.
"""

from libc.errno cimport EAGAIN, EINTR, EIO, errno
from posix.types cimport off_t
from posix.unistd cimport read

from blockd._iostats cimport IoCounters

from target import file_send

cdef extern from "<fcntl.h>" nogil:
    Py_ssize_t splice(int fd_in, off_t* off_in, int fd_out, off_t* off_out, size_t n, unsigned int flags)
    unsigned int SPLICE_F_NONBLOCK


cdef Py_ssize_t _splice_all(int fd_in, off_t* off_in, int fd_out, Py_ssize_t length) noexcept nogil:
    """Splice up to ``length`` bytes (from ``*off_in`` of a file, or NULL: from a pipe); the bytes
    moved before the first short or failed call: end of file, EIO, a full socket (EAGAIN)."""
    cdef Py_ssize_t done = 0, n
    while done < length:
        n = splice(fd_in, off_in, fd_out, NULL, length - done, SPLICE_F_NONBLOCK)
        if n <= 0:
            break
        done += n
    return done


cdef bint _splice_out(int pipe_r, int sock, Py_ssize_t length) noexcept nogil:
    """Move ``length`` bytes, all in the pipe, to the blocking socket ``sock`` (the queue's
    thread's); False if the socket failed (as ``_sendv_all``). Not ``_splice_all``: that one
    stops at the first short call, which is right for the loop's non-blocking socket (the rest
    spills to the transport) but would end the thread's connection on a signal's EINTR; here
    the socket blocks until it has taken everything, and only a failed socket stops it."""
    cdef Py_ssize_t n
    while length > 0:
        n = splice(pipe_r, NULL, sock, NULL, length, 0)
        if n < 0 and errno == EINTR:
            continue
        if n <= 0:
            return False
        length -= n
    return True


cdef int _devnull = file_send.DEVNULL


cdef int _splice_write(int sock, int pipe_r, int pipe_w, int fd, off_t offset, const unsigned char* staged,
                       Py_ssize_t have, Py_ssize_t length, int* error) noexcept nogil:
    """An H2CData PDU's data into the file at ``offset``: the ``have`` bytes that came with its
    header (``staged``) and the ``length - have`` still in the blocking socket ``sock``.
    - The socket's bytes go into the empty pipe first, and from it into the file once the
      last has come, so a host that stops part way leaves the file as it was.
    - If the pipe fills first (the data came in more pieces than it has slots), what it holds
      goes to the file each time it fills, as the data comes.
    - What the file refuses (``*error``: its errno) is received all the same, into
      ``/dev/null``, so the stream stays whole.
    The pipe's content is only ever spliced on, never read: a ``read`` of pages spliced in
    from a socket can fail with EFAULT (seen in the VM bed: Debian's 6.1 kernel over veth).
    Returns ``_SPLICED``; ``_HOST_CLOSED`` or ``_SOCKET_FAILED`` (the pipe may hold bytes: the
    caller empties it); or ``_FILE_REFUSED``, the pipe empty."""
    cdef Py_ssize_t rest = length - have, inpipe = 0, n
    cdef off_t pos = offset + have  # (advanced by each splice to the file)
    cdef bint refused = False, staged_out = False
    error[0] = 0
    while rest > 0 or inpipe > 0:
        if rest > 0:
            n = splice(sock, NULL, pipe_w, NULL, rest, 0)
            if n > 0:
                rest -= n
                inpipe += n
                if rest > 0:
                    continue  # more to come: it waits in the pipe
            elif n < 0 and errno == EINTR:
                continue
            elif not (n < 0 and errno == EAGAIN):  # (EAGAIN: the pipe is full; the socket blocks)
                return _HOST_CLOSED if n == 0 else _SOCKET_FAILED
        if not staged_out:  # the file is written in order, as one pwrite would (up to where it refuses)
            staged_out = True
            if _pwrite_all(fd, staged, have, offset) != have:
                refused = True
                error[0] = errno or EIO
        while inpipe > 0:
            n = splice(pipe_r, NULL, _devnull if refused else fd, NULL if refused else &pos, inpipe, 0)
            if n > 0:
                inpipe -= n
            elif n < 0 and errno == EINTR:
                continue
            elif refused:
                return _SOCKET_FAILED  # (/dev/null refusing: never; end the connection)
            else:
                refused = True
                error[0] = errno if n < 0 else EIO
    return _FILE_REFUSED if refused else _SPLICED


cdef Py_ssize_t _read_pipe(int pipe_r, unsigned char* p, Py_ssize_t length) noexcept nogil:
    """Read ``length`` bytes that are in the pipe into ``p``; the bytes read."""
    cdef Py_ssize_t got = 0, n
    while got < length:
        n = read(pipe_r, p + got, length - got)
        if n < 0 and errno == EINTR:
            continue
        if n <= 0:
            break
        got += n
    return got



cdef FastNamespace served_namespace(object entry, unsigned long long slba, unsigned int nlb, unsigned int length):
    """The C copy of the namespace ``entry`` (the controller's, for the command's NSID) when a
    Read or Write of ``nlb`` blocks at ``slba`` and ``length`` bytes is the compiled paths' to
    serve on it: a plain file (its copy made for this backend, not withdrawn, its descriptor open),
    the range inside it and the length the blocks say; else None (the Python queue decides)."""
    fast = entry.fast
    if fast is None:
        return None
    cdef FastNamespace ns = <FastNamespace?>fast
    cdef FastFile f = ns.file
    if not ns.accessible or f.fd < 0 or entry.backend is not ns.backend:
        return None
    cdef unsigned long long blocks = f.size >> ns.lba_shift
    if slba >= blocks or nlb > blocks - slba or (<unsigned long long>nlb << ns.lba_shift) != length:
        return None
    return ns


cdef class FastFile:
    """A :class:`target.backend.FileBackend`'s descriptor and size as C fields, kept in step by the
    backend itself (``resize`` sets ``size``, ``close`` sets ``fd`` to -1: nothing is served from
    it after that). Its fields are declared in ``target/_file_io.pxd``."""

    def __init__(self, int fd, unsigned long long size, bint read_only):
        self.fd = fd
        self.size = size
        self.read_only = read_only


cdef class FastNamespace:
    """What the compiled path needs of a namespace: its file, block size and counters.

    It is valid for the backend it was made from only: once the namespace's ``backend`` is
    another object (a filter wrapped around it, replication), its commands go to the Python
    queue. ``accessible`` False withdraws it as well: every command on the namespace then goes
    to the Python queue, which decides (a removed namespace; an ANA state that refuses I/O,
    0x302, once ANA exists: its code turns this off and lets the Python path answer per port).
    Its fields are declared in ``target/_file_io.pxd``."""

    def __init__(self, FastFile file, backend, int lba_shift, IoCounters counters):
        self.file = file
        self.backend = backend
        self.lba_shift = lba_shift
        self.counters = counters
        self.accessible = True

