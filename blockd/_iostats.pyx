# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The compiled twin of :class:`blockd.iostats.IoCounters`: the same counters in C arrays.

Every I/O is counted twice on the target (the host's and the namespace's counters) and once on
the host, each time with four adds. Done on Python lists, each add is an attribute read, an
item read, a Python-int add and an item store (``perf`` of both daemons put
``_PyObject_GenericGetAttrWithDict`` first among the user symbols); here the compiled I/O paths
call :meth:`IoCounters._count` (``blockd/_iostats.pxd``), four C adds and a
``__builtin_clzll`` for the bucket, and the Python paths the same through :meth:`count`.

The readers see the reference's interface: ``ops``, ``bytes`` and ``buckets`` are properties
that return new lists, ``latency_ns`` an int, ``errors`` the same dict (errors are rare and
keyed by status or exception name, so they stay a dict), ``snapshot`` the reference's.

Range: the counts are ``uint64_t`` where the reference's are unbounded Python ints. 2**64 I/Os,
bytes (16 EiB) or nanoseconds of summed latency (584 years: at a million I/Os per second of
1 ms each, 213 days) are not reached by a daemon's lifetime; past that a sum wraps to 0, which
Prometheus reads as a counter reset. A latency itself is below 2**63 ns from every caller (a
``monotonic_ns`` difference on the target, clamped by ``HostCommand.count`` on the host).
"""

cimport cython
from libc.stdint cimport uint64_t

from blockd.iostats import BUCKETS, KINDS, add_error, snapshot

if len(KINDS) != N_KINDS or BUCKETS != N_BUCKETS:
    raise ImportError("blockd/_iostats.pxd's N_KINDS/N_BUCKETS are not blockd.iostats' KINDS/BUCKETS")


@cython.final
cdef class IoCounters:
    """See :class:`blockd.iostats.IoCounters` (the reference). C arrays start zeroed (the
    type's allocation clears the object)."""

    def __init__(self):
        self.errors = {}

    def count(self, unsigned int kind, uint64_t length, uint64_t elapsed_ns):
        """One completed command (see the reference)."""
        if kind >= N_KINDS:
            raise IndexError("list index out of range")  # as the reference's ops[kind]
        self._count(kind, length, elapsed_ns)

    def add_error(self, status):
        add_error(self.errors, status)

    def snapshot(self):
        return snapshot(self)

    @property
    def ops(self):
        return [self._ops[i] for i in range(N_KINDS)]

    @property
    def bytes(self):
        return [self._bytes[i] for i in range(N_KINDS)]

    @property
    def buckets(self):
        return [self._buckets[i] for i in range(N_BUCKETS)]

    @property
    def latency_ns(self):
        return self._latency_ns
