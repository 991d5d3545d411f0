# cython: language_level=3
"""The compiled I/O counters' C declarations, for the modules that count from C:
``target/_tcp_io.pyx`` (the host's and the namespace's counters of a served Read or Write) and
``initiator/_queue.pyx`` (a host command's completion, through ``Command.count``)."""

cimport cython
from libc.stdint cimport uint64_t
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

cdef extern from *:
    int _clzll "__builtin_clzll"(unsigned long long) nogil

cdef enum:
    N_KINDS = 4  # len(blockd.iostats.KINDS), checked at import
    N_BUCKETS = 54  # blockd.iostats.BUCKETS, checked at import


cdef inline long long now_ns() noexcept nogil:
    """``time.monotonic_ns()`` (the same clock) without a Python call: the clock both ends'
    latencies are counted on (a target command from its capsule's arrival, a host command from
    its send, ``HostCommand.sent_ns``)."""
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec * 1000000000LL + ts.tv_nsec


@cython.final
cdef class IoCounters:
    cdef uint64_t _ops[N_KINDS]
    cdef uint64_t _bytes[N_KINDS]
    cdef uint64_t _buckets[N_BUCKETS]
    cdef uint64_t _latency_ns
    cdef public dict errors

    cdef inline void _count(self, unsigned int kind, uint64_t length, uint64_t elapsed_ns) noexcept:
        """:meth:`blockd.iostats.IoCounters.count` for ``kind`` < N_KINDS and ``elapsed_ns`` <
        2**63 (every caller's range). The bucket is clamped to the last one all the same, so
        that no argument writes outside the array."""
        cdef uint64_t scaled = elapsed_ns >> 10
        cdef unsigned int bucket = 64 - _clzll(scaled) if scaled else 0
        if bucket >= N_BUCKETS:
            bucket = N_BUCKETS - 1
        self._ops[kind] += 1
        self._bytes[kind] += length
        self._latency_ns += elapsed_ns
        self._buckets[bucket] += 1

    cdef inline void _uncount(self, unsigned int kind, uint64_t length, uint64_t elapsed_ns) noexcept:
        """Take back one :meth:`_count` of the same arguments: a command the target's io_uring
        loop counted when it made the reply, then gave to the Python queue (its chain failed
        before the reply went out; ``target/_uring_loop.pyx``)."""
        cdef uint64_t scaled = elapsed_ns >> 10
        cdef unsigned int bucket = 64 - _clzll(scaled) if scaled else 0
        if bucket >= N_BUCKETS:
            bucket = N_BUCKETS - 1
        self._ops[kind] -= 1
        self._bytes[kind] -= length
        self._latency_ns -= elapsed_ns
        self._buckets[bucket] -= 1
