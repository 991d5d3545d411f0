# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Twin of :meth:`protocol.digest.Digests.feed` fed by :meth:`target.backend.FileBackend.read_into`
(the loops in ``target/digest.py`` and ``target/replication/verify.py``): a plain file's range read
and hashed in one call, XXH3-128 per chunk, with the GIL released throughout.

Why: in Python a verify ran at 0.08x reading both copies (docs/benchmarks.md), its time in the
Python around the pieces (an executor hop per 1 MiB piece, python-xxhash holding the GIL for each
64 KiB region, the event loop waiting for the GIL), while XXH3 hashes 8 MiB in ~1 ms. Here one
executor call reads and hashes a whole command's or unit's range, and the event loop never waits.

The range is hashed where it lies in the page cache, through a read-only mapping of
:data:`WINDOW` bytes at a time, not copied out by ``pread`` first: measured on a cached 256 MiB
file (scratch scripts, 8 MiB a call, 2026-12-08), ``pread`` into a buffer and hashing it ran at
5.5-7.7 GB/s whatever the piece size (16 KiB to 1 MiB), python-xxhash over a mapping of the whole
file at 12.6-16.6 GB/s on a quiet machine: the copy cost about as much as the hash. Both ends of a verify hash at once on this 2-CPU machine, so
the CPU time per byte is what bounds it against ``cat`` of both copies, which copies once.

A mapped read cannot come back short: past the end of a file that shrank it raises SIGBUS. The
call looks at a regular file's size first (a range past its end fails as ``read_into``'s short
read, EIO), and a file cut shorter while it is hashed is caught by a SIGBUS handler that jumps
back out of the hash of that window (``bd_feed_mapped``) to the same EIO; a SIGBUS anywhere else
goes to the handler that was there before, or ends the process as it would have.

The call works on its own duplicate of the file's descriptor, taken with the GIL held:
``FileBackend.close`` withdraws ``fd`` (sets -1, also with the GIL) before it closes the number,
so a namespace closed during the call cannot have its number reused under the call for another
file; the duplicate keeps the file open until the call ends.

The digests are the C library's (Debian's libxxhash, ``-lxxhash``) in the byte order
``XXH128_canonicalFromHash`` writes, which is python-xxhash's ``digest()`` (the differential test
``tests/replication/test_digest_fast.py`` holds the two together).
"""

from libc.errno cimport EBADF, EIO, errno
from libc.string cimport strerror
from posix.mman cimport MAP_FAILED, MAP_POPULATE, MAP_SHARED, PROT_READ, mmap, munmap
from posix.stat cimport S_ISREG, fstat, struct_stat
from posix.types cimport off_t
from posix.unistd cimport _SC_PAGESIZE, close, dup, sysconf

from target._file_io cimport FastFile

cdef extern from *:
    """
    #include <setjmp.h>
    #include <signal.h>
    #include <string.h>
    #include <xxhash.h>

    /* Where a SIGBUS in this thread jumps to: set only while a mapped window is hashed. */
    static __thread sigjmp_buf *bd_digest_jump;
    static __thread const unsigned char *bd_digest_fault;
    static struct sigaction bd_digest_previous;

    static void bd_digest_on_sigbus(int sig, siginfo_t *info, void *context) {
        sigjmp_buf *jump = bd_digest_jump;
        if (jump != NULL) {  /* a read past the end of a mapped file that shrank: back out of the hash */
            bd_digest_jump = NULL;
            bd_digest_fault = (const unsigned char *)info->si_addr;
            siglongjmp(*jump, 1);
        }
        if (bd_digest_previous.sa_flags & SA_SIGINFO) {
            bd_digest_previous.sa_sigaction(sig, info, context);
        } else if (bd_digest_previous.sa_handler != SIG_DFL && bd_digest_previous.sa_handler != SIG_IGN) {
            bd_digest_previous.sa_handler(sig);
        } else {  /* the faulting access runs again, and the default action ends the process */
            signal(sig, SIG_DFL);
        }
    }

    static int bd_digest_catch_sigbus(void) {
        struct sigaction action;
        memset(&action, 0, sizeof action);
        action.sa_sigaction = bd_digest_on_sigbus;
        action.sa_flags = SA_SIGINFO | SA_ONSTACK;
        sigemptyset(&action.sa_mask);
        return sigaction(SIGBUS, &action, &bd_digest_previous);
    }

    /* The digests of a range, fed in order: one chunk's state, where the next digest goes. */
    typedef struct {
        XXH3_state_t *state;
        size_t chunk, in_chunk, left;
        unsigned char *out;
    } bd_chunks;

    static void bd_feed(bd_chunks *c, const unsigned char *data, size_t length) {
        XXH128_canonical_t canonical;
        while (length) {
            size_t n = length < c->chunk - c->in_chunk ? length : c->chunk - c->in_chunk;
            XXH3_128bits_update(c->state, data, n);
            data += n;
            length -= n;
            c->in_chunk += n;
            c->left -= n;
            if (c->in_chunk == c->chunk || !c->left) {
                XXH128_canonicalFromHash(&canonical, XXH3_128bits_digest(c->state));
                memcpy(c->out, canonical.digest, sizeof canonical.digest);
                c->out += sizeof canonical.digest;
                XXH3_128bits_reset(c->state);
                c->in_chunk = 0;
            }
        }
    }

    /* bd_feed of mapped bytes: NULL, or the address whose read raised SIGBUS (the state is then
       of no use: the caller fails the range). */
    static const unsigned char *bd_feed_mapped(bd_chunks *c, const unsigned char *data, size_t length) {
        sigjmp_buf jump;
        if (sigsetjmp(jump, 1))
            return bd_digest_fault;
        bd_digest_jump = &jump;
        bd_feed(c, data, length);
        bd_digest_jump = NULL;
        return NULL;
    }
    """
    ctypedef struct XXH3_state_t:
        pass
    ctypedef struct bd_chunks:
        XXH3_state_t* state
        size_t chunk
        size_t in_chunk
        size_t left
        unsigned char* out
    XXH3_state_t* XXH3_createState() nogil
    int XXH3_freeState(XXH3_state_t* state) nogil
    int XXH3_128bits_reset(XXH3_state_t* state) nogil
    int bd_digest_catch_sigbus()
    const unsigned char* bd_feed_mapped(bd_chunks* c, const unsigned char* data, size_t length) nogil

cdef enum:
    DIGEST = 16  # protocol.digest.DIGEST_SIZE

WINDOW = 8 << 20
"""Most bytes mapped (populated in one system call, ``MAP_POPULATE``) and hashed at a time: a
verify unit (:data:`target.replication.verify.UNIT`). CPU time of one call an 8 MiB unit over a
cached 256 MiB file (three runs of three passes, 2026-12-08, load average ~3): windows of 256 KiB
6.0-6.3 GB/s, 1 MiB 6.5-7.3, 4 MiB 7.7-8.1, 8 MiB 7.6-8.7; ``pread`` in 256 KiB pieces (the loop
before) 4.7-6.1 in the same runs. A smaller window maps and unmaps more often for the same bytes."""

if bd_digest_catch_sigbus():
    raise OSError(errno, f"SIGBUS handler for mapped reads: {strerror(errno).decode()}")
cdef off_t _page = sysconf(_SC_PAGESIZE)


cdef int _hash_range(int fd, off_t offset, Py_ssize_t length, Py_ssize_t window, bd_chunks* chunks,
                     off_t* end) noexcept nogil:
    """Hash ``length`` bytes at ``offset`` window by window into ``chunks``; 0, or an errno (EIO
    with ``*end`` set where the file ends inside the range)."""
    cdef struct_stat st
    if fstat(fd, &st):
        return errno
    if S_ISREG(st.st_mode) and offset + length > st.st_size:  # as FileBackend.read_into: a short read
        end[0] = st.st_size
        return EIO
    cdef Py_ssize_t done = 0, n, skip
    cdef off_t at
    cdef unsigned char* mapped
    cdef const unsigned char* fault
    while done < length:
        at = offset + done
        skip = at % _page
        n = min(window, length - done)
        mapped = <unsigned char*>mmap(NULL, skip + n, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, at - skip)
        if <void*>mapped == MAP_FAILED:
            return errno
        fault = bd_feed_mapped(chunks, mapped + skip, n)
        munmap(mapped, skip + n)
        if fault != NULL:  # the file was cut shorter while it was hashed: it ends on that page
            end[0] = at - skip + (fault - mapped) // _page * _page
            return EIO
        done += n
    return 0


def file_digests(FastFile file, unsigned long long offset, Py_ssize_t length, Py_ssize_t chunk,
                 unsigned char[::1] out not None) -> None:
    """Hash ``length`` bytes of ``file`` from ``offset`` in chunks of ``chunk`` bytes (the last one
    shorter) into ``out``, :data:`protocol.digest.DIGEST_SIZE` bytes a chunk, as
    ``Digests(XXH3_128, length, chunk, out).feed`` of the bytes ``read_into`` gives. Blocks its
    thread for the whole range: the caller runs it in an executor. A failed read is an
    ``OSError`` (EIO for a file that ends inside the range), as ``FileBackend.read_into``'s."""
    if chunk <= 0 or length < 0:
        raise ValueError(f"chunk {chunk} and length {length}: a chunk of at least one byte, a length of none or more")
    cdef Py_ssize_t chunks = (length + chunk - 1) // chunk  # (C division: -(-a // b) rounds toward 0)
    if out.shape[0] < chunks * DIGEST:
        raise ValueError(f"{out.shape[0]} bytes for the digests of {chunks} chunks")
    if file.fd < 0:  # withdrawn by FileBackend.close: the number may already be another file's
        raise OSError(EBADF, strerror(EBADF).decode())
    cdef int fd = dup(file.fd)  # with the GIL, so before any close of it (see the module docstring)
    if fd < 0:
        raise OSError(errno, strerror(errno).decode())
    cdef bd_chunks state
    state.state = XXH3_createState()
    if state.state == NULL:
        close(fd)
        raise MemoryError()
    XXH3_128bits_reset(state.state)
    state.chunk, state.in_chunk, state.left = chunk, 0, length
    state.out = &out[0] if out.shape[0] else NULL
    cdef Py_ssize_t window = WINDOW
    cdef off_t end = -1
    cdef int error
    with nogil:
        error = _hash_range(fd, offset, length, window, &state, &end)
    close(fd)
    XXH3_freeState(state.state)
    if end >= 0:
        raise OSError(EIO, f"short read: the file ends at {end}, inside {offset} + {length} bytes")
    if error:
        raise OSError(error, strerror(error).decode())
