"""The compiled I/O counters (``blockd/_iostats.pyx``) against their Python reference
(:class:`blockd.iostats.IoCounters`): the same random sequences of counts (every kind, lengths
and latencies across every bucket's bounds up to 2**63 - 1 ns) and errors (statuses with and
without the More bit, unknown statuses, exception names) must give the same snapshot and the
same ``ops``/``bytes``/``buckets``/``latency_ns``/``errors`` after every step, and the readers
(``interval``, the control socket's JSON, the multipath sum) must see no difference."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from blockd import iostats
from blockd.iostats import BUCKETS, KINDS, LATENCY_MAX_NS, interval
from protocol.status import MORE, Status

_compiled = pytest.importorskip("blockd._iostats", reason="compiled data plane not built")

_EDGES = [0, 1, 1023, 1024, 1025, 2047, 2048, 10**6, 2**40 - 1, 2**40, 2**62, LATENCY_MAX_NS]


def _view(c: Any) -> tuple[Any, ...]:
    return (c.snapshot(), list(c.ops), list(c.bytes), list(c.buckets), c.latency_ns, dict(c.errors))


def _run(cls: type, seed: int) -> list[Any]:
    rng = random.Random(seed)
    c = cls()
    seen = [_view(c)]
    total = 0  # the latency sum, kept below 2**64 (where the compiled one wraps: the test below)
    for _ in range(rng.randrange(1, 200)):
        if rng.random() < 0.8:
            kind = rng.randrange(len(KINDS))
            length = rng.choice([0, 512, 4096, 131072, 1 << 20, rng.getrandbits(40)])
            ns = rng.choice(_EDGES) if rng.random() < 0.3 else rng.getrandbits(rng.randrange(1, 63))
            if total + ns >= 1 << 64:
                ns = 0
            total += ns
            c.count(kind, length, ns)
        else:
            status = rng.choice([int(Status.LBA_RANGE), int(Status.LBA_RANGE) | MORE, int(Status.INVALID_FIELD),
                                 0x7FF, "QueueLost", "TimeoutError"])
            c.add_error(status)
        seen.append(_view(c))
    return seen


@pytest.mark.parametrize("seed", range(200))
def test_compiled_counters_match_the_reference(seed: int) -> None:
    assert _run(_compiled.IoCounters, seed) == _run(iostats.IoCounters, seed)


def test_the_sequences_reach_every_bucket_and_kind() -> None:
    last = [_run(iostats.IoCounters, seed)[-1][0] for seed in range(200)]
    assert all(any(s["buckets"][i] for s in last) for i in (0, 1, 10, 30, 40, BUCKETS - 1))
    assert all(any(s["ops"][k] for s in last) for k in KINDS)
    assert any(s["errors"].get("lba_range", 0) > 1 for s in last) and any("0x7ff" in s["errors"] for s in last)


@pytest.mark.parametrize("cls", [_compiled.IoCounters, iostats.IoCounters], ids=["compiled", "python"])
def test_the_readers_interface(cls: type) -> None:
    """What the control socket, Prometheus, ``blockctl iostat`` and the multipath sum read."""
    c = cls()
    assert c.ops == [0] * len(KINDS) and c.bytes == [0] * len(KINDS) and c.buckets == [0] * BUCKETS
    assert c.latency_ns == 0 and c.errors == {}
    before = c.snapshot()
    c.count(0, 4096, 3000)
    c.count(1, 8192, 5000)
    c.add_error(int(Status.LBA_RANGE) | MORE)
    after = json.loads(json.dumps(c.snapshot()))
    assert after == {"ops": {"read": 1, "write": 1, "flush": 0, "other": 0},
                     "bytes": {"read": 4096, "write": 8192, "flush": 0, "other": 0},
                     "latency_ns": 8000, "buckets": [0, 0, 1, 1] + [0] * (BUCKETS - 4),
                     "errors": {"lba_range": 1}}
    iv = interval(before, after, 2.0)
    assert iv["iops"]["read"] == 0.5 and iv["mean_latency_us"] == 4.0
    with pytest.raises(IndexError):
        c.count(len(KINDS), 0, 0)


def test_compiled_sums_wrap_at_2_64() -> None:
    """The documented difference (``blockd/_iostats.pyx``): a uint64_t sum past 2**64 wraps (the
    reference's Python int does not); 584 years of summed latency."""
    c = _compiled.IoCounters()
    c.count(0, 0, LATENCY_MAX_NS)
    c.count(0, 0, LATENCY_MAX_NS)
    c.count(0, 0, 3)
    assert c.latency_ns == 1 and c.buckets[BUCKETS - 1] == 2


def test_compiled_counters_take_no_other_fields() -> None:
    """The lists are read-only copies: a reader that assigned to them would be caught here."""
    c = _compiled.IoCounters()
    c.ops[0] += 1  # a copy: the counter is unchanged
    assert c.ops[0] == 0
    with pytest.raises(AttributeError):
        c.ops = [1, 2, 3, 4]  # type: ignore[misc]
