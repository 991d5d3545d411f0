"""I/O counters, shared by both ends: the target's per namespace and per host (controller),
read by its control socket and Prometheus exporter; the host's per connection, read by the
initiator daemon's ``counters`` verb (``blockctl iostat --initiator``).

Each I/O command is counted once, when it completes (:meth:`target.queue.TargetQueue._complete`,
:meth:`initiator.controller.Controller._complete`, and their compiled twins), with
:meth:`IoCounters.count`: integer adds into lists that exist before the first command (C
arrays in the compiled twin, ``blockd/_iostats.pyx``), nothing allocated per command. Latency is one clock pair per
command, kept as a sum (for the mean) and a histogram of power-of-two buckets, so a percentile
over any interval is the difference of two snapshots.

Bucket ``i`` holds latencies with ``(ns >> 10).bit_length() == i``: below 1.024 us for bucket 0,
then ``[1.024 us * 2**(i-1), 1.024 us * 2**i)``. ``bit_length`` is one C call, no comparison
chain, and 54 buckets cover any ``monotonic_ns`` difference, so the index needs no clamp.
"""

from __future__ import annotations

from typing import Any

from protocol.constants import IoOpcode
from protocol.status import MORE, Status

READ, WRITE, FLUSH, OTHER = range(4)
KINDS = ("read", "write", "flush", "other")
"""Command kinds as they are counted and shown, in index order."""

KIND_BY_OPCODE: tuple[int, ...] = tuple(
    {int(IoOpcode.READ): READ, int(IoOpcode.WRITE): WRITE, int(IoOpcode.FLUSH): FLUSH}.get(op, OTHER)
    for op in range(256))
"""NVM opcode -> kind, a tuple so the lookup per command is one index."""

BUCKETS = 54
BUCKET_UNIT_NS = 1 << 10


def bucket_bound_ns(i: int) -> int:
    """Exclusive upper bound of bucket ``i`` in nanoseconds."""
    return BUCKET_UNIT_NS << i


class IoCounters:
    """Cumulative counts of one namespace or one host; only ever grow.

    The Python reference of ``blockd/_iostats.pyx`` (C arrays, counted from C by the compiled
    I/O paths); which one the daemons count in is chosen by :mod:`blockd.iocounters`. Both
    ends' Python paths count through :meth:`count`, the compiled ones through its C twin."""

    __slots__ = ("ops", "bytes", "latency_ns", "buckets", "errors")

    def __init__(self) -> None:
        self.ops = [0] * len(KINDS)
        self.bytes = [0] * len(KINDS)
        """Data moved (a read's or write's transfer length); commands without data add 0."""
        self.latency_ns = 0
        """Sum of every counted command's latency, from capsule parsed to response queued."""
        self.buckets = [0] * BUCKETS
        self.errors: dict[int | str, int] = {}
        """Status (the :class:`protocol.status.Status` value), or on the host the name of the
        error that ended a command without one (``QueueLost``, ``TimeoutError``) -> commands."""

    def count(self, kind: int, length: int, elapsed_ns: int) -> None:
        """One completed command of ``kind`` (an index of :data:`KINDS`) that moved ``length``
        bytes in ``elapsed_ns`` (0 <= elapsed_ns < 2**63, which keeps the bucket below
        :data:`BUCKETS`)."""
        self.ops[kind] += 1
        self.bytes[kind] += length
        self.latency_ns += elapsed_ns
        self.buckets[(elapsed_ns >> 10).bit_length()] += 1

    def add_error(self, status: int | str) -> None:
        add_error(self.errors, status)

    def snapshot(self) -> dict[str, Any]:
        return snapshot(self)


LATENCY_MAX_NS = (1 << 63) - 1
"""The longest latency counted (292 years): a longer one counts as this, so that its bucket
exists and it fits the compiled counters' ``uint64_t``. Neither end computes one that long: both
count ``monotonic_ns`` differences."""


def add_error(errors: dict[int | str, int], status: int | str) -> None:
    """One more command ended with ``status`` (both twins' ``add_error``)."""
    errors[status] = errors.get(status, 0) + 1


def snapshot(counters: Any) -> dict[str, Any]:
    """A JSON-ready copy of either twin's counters (the control socket's reply, the input of
    :func:`interval`)."""
    return {
        "ops": dict(zip(KINDS, counters.ops)),
        "bytes": dict(zip(KINDS, counters.bytes)),
        "latency_ns": counters.latency_ns,
        "buckets": list(counters.buckets),
        "errors": {status_label(s) if isinstance(s, int) else s: n for s, n in counters.errors.items()},
    }


def status_label(status: int) -> str:
    """A status as shown and exported: its name in :class:`protocol.status.Status`, lower case
    (``lba_range``), else its kernel encoding in hex. The More bit (an error-log entry stands
    behind it) is not part of the name: the same failure counts under one label."""
    try:
        return Status(status & ~MORE).name.lower()
    except ValueError:
        return f"{status:#x}"


def percentile_ns(buckets: list[int], fraction: float) -> int:
    """The upper bound of the bucket holding the ``fraction`` quantile (0 when empty): an
    over-estimate by at most a factor of two, the price of counting with one ``bit_length``."""
    total = sum(buckets)
    if not total:
        return 0
    rank = fraction * total
    seen = 0
    for i, n in enumerate(buckets):
        seen += n
        if seen >= rank:
            return bucket_bound_ns(i)
    return bucket_bound_ns(len(buckets) - 1)


def interval(before: dict[str, Any] | None, after: dict[str, Any], seconds: float) -> dict[str, Any]:
    """What happened between two :meth:`IoCounters.snapshot` s: per-second rates, mean and p99
    latency of the commands completed in between (``before`` None: since the start)."""
    def delta(key: str) -> dict[str, int]:
        old = before[key] if before else {}
        return {k: v - old.get(k, 0) for k, v in after[key].items()}

    ops, nbytes = delta("ops"), delta("bytes")
    old_buckets = before["buckets"] if before else [0] * len(after["buckets"])
    buckets = [a - b for a, b in zip(after["buckets"], old_buckets)]
    count = sum(ops.values())
    latency = after["latency_ns"] - (before["latency_ns"] if before else 0)
    errors = {k: v for k, v in delta("errors").items() if v}
    per_s = 1.0 / seconds if seconds > 0 else 0.0
    return {
        "seconds": seconds,
        "ops": ops,
        "bytes": nbytes,
        "iops": {k: v * per_s for k, v in ops.items()},
        "bytes_per_s": {k: v * per_s for k, v in nbytes.items()},
        "errors": errors,
        "mean_latency_us": latency / count / 1000 if count else 0.0,
        "p99_latency_us": percentile_ns(buckets, 0.99) / 1000,
    }
