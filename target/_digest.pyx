# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Twin of :meth:`protocol.digest.Digests.feed` fed by :meth:`target.backend.FileBackend.read_into`
(the loops in ``target/digest.py`` and ``target/replication/verify.py``): a plain file's range read
and hashed in one call, XXH3-128 per chunk, with the GIL released throughout.

Why: in Python a verify ran at 0.08x reading both copies (docs/benchmarks.md), its time in the
Python around the pieces (an executor hop per 1 MiB piece, python-xxhash holding the GIL for each
64 KiB region, the event loop waiting for the GIL), while XXH3 hashes 8 MiB in ~1 ms. Here one
executor call reads and hashes a whole command's or unit's range, and the event loop never waits.

The digests are the C library's (Debian's libxxhash, ``-lxxhash``) in the byte order
``XXH128_canonicalFromHash`` writes, which is python-xxhash's ``digest()`` (the differential test
``tests/replication/test_digest_fast.py`` holds the two together).
"""

from libc.errno cimport EINTR, EIO, errno
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, strerror
from posix.types cimport off_t
from posix.unistd cimport pread

from target._file_io cimport FastFile

cdef extern from "<xxhash.h>" nogil:
    ctypedef struct XXH3_state_t:
        pass
    ctypedef unsigned long long XXH64_hash_t
    ctypedef struct XXH128_hash_t:
        XXH64_hash_t low64
        XXH64_hash_t high64
    ctypedef struct XXH128_canonical_t:
        unsigned char digest[16]
    XXH3_state_t* XXH3_createState()
    int XXH3_freeState(XXH3_state_t* state)
    int XXH3_128bits_reset(XXH3_state_t* state)
    int XXH3_128bits_update(XXH3_state_t* state, const void* data, size_t length)
    XXH128_hash_t XXH3_128bits_digest(const XXH3_state_t* state)
    void XXH128_canonicalFromHash(XXH128_canonical_t* dst, XXH128_hash_t hash)

cdef enum:
    DIGEST = 16  # protocol.digest.DIGEST_SIZE

PIECE = 256 << 10
"""Bytes read at a time into the call's buffer and then hashed: small enough that the hash finds
them still in the CPU's cache after ``pread`` copied them there."""


cdef int _hash_range(int fd, off_t offset, Py_ssize_t length, Py_ssize_t chunk, unsigned char* out,
                     unsigned char* buf, Py_ssize_t piece, XXH3_state_t* state, off_t* end) noexcept nogil:
    """Read ``length`` bytes at ``offset`` in pieces and write one digest a ``chunk`` into
    ``out``; 0, or the errno of the failed ``pread`` (EIO with ``*end`` set where the file ended
    inside the range)."""
    cdef Py_ssize_t done = 0, want, got, n, at, in_chunk = 0
    cdef XXH128_canonical_t canonical
    XXH3_128bits_reset(state)
    while done < length:
        want = min(piece, length - done)
        got = 0
        while got < want:
            n = pread(fd, buf + got, want - got, offset + done + got)
            if n < 0 and errno == EINTR:
                continue
            if n < 0:
                return errno
            if n == 0:  # the file ends inside the range (as FileBackend.read_into: a short read)
                end[0] = offset + done + got
                return EIO
            got += n
        at = 0
        while at < want:
            n = min(want - at, chunk - in_chunk)
            XXH3_128bits_update(state, buf + at, n)
            at += n
            in_chunk += n
            if in_chunk == chunk or done + at == length:
                XXH128_canonicalFromHash(&canonical, XXH3_128bits_digest(state))
                memcpy(out, canonical.digest, DIGEST)
                out += DIGEST
                XXH3_128bits_reset(state)
                in_chunk = 0
        done += want
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
    cdef int fd = file.fd, error
    cdef Py_ssize_t piece = min(PIECE, length)
    cdef off_t end = -1
    cdef unsigned char* buf = <unsigned char*>malloc(max(piece, 1))
    cdef XXH3_state_t* state = XXH3_createState()
    if buf == NULL or state == NULL:
        free(buf)
        XXH3_freeState(state)
        raise MemoryError()
    with nogil:
        error = _hash_range(fd, offset, length, chunk, &out[0] if out.shape[0] else NULL, buf, piece, state,
                            &end)
    free(buf)
    XXH3_freeState(state)
    if end >= 0:
        raise OSError(EIO, f"short read: the file ends at {end}, inside {offset} + {length} bytes")
    if error:
        raise OSError(error, strerror(error).decode())
