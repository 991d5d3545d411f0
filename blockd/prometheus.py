"""What both daemons' Prometheus exporters share: the I/O families built from
:mod:`blockd.iostats` counters, and a minimal HTTP endpoint on the daemon's own event loop.

A custom collector reads the daemon's counters when Prometheus scrapes: the data path only adds
integers, and no ``prometheus_client`` metric object is touched per command (its ``observe``
takes a lock). The endpoint runs on the daemon's event loop, so a scrape reads the daemon's
dictionaries between two of its callbacks, never while they change (the library's own
``start_http_server`` serves from a thread).

Metric names (documented in docs/operations.md) are stable: dashboards depend on them.
"""

from __future__ import annotations

import asyncio
from typing import Any, Iterator, Protocol

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, HistogramMetricFamily, Metric

from blockd.iostats import BUCKETS, bucket_bound_ns

log = structlog.get_logger("blockd.prometheus")

_BOUNDS_S = [f"{bucket_bound_ns(i) / 1e9:.9g}" for i in range(BUCKETS - 1)] + ["+Inf"]
"""Histogram ``le`` labels: the upper bound of each :mod:`blockd.iostats` bucket, in seconds."""
MAX_REQUEST_HEAD = 8192
"""A scraper's request line and headers fit; anything longer is dropped unanswered."""


class Collector(Protocol):
    def collect(self) -> Iterator[Metric]: ...


def io_families(prefix: str, what: str, names: list[str], rows: list[tuple[list[str], dict[str, Any]]],
                latency_help: str) -> Iterator[Metric]:
    """Commands, bytes, errors and latency of each row (label values, an
    :meth:`blockd.iostats.IoCounters.snapshot`), one family each, named ``{prefix}_{what}_...``."""
    ops = CounterMetricFamily(f"{prefix}_{what}_commands", f"I/O commands completed, per {what}",
                              labels=[*names, "op"])
    nbytes = CounterMetricFamily(f"{prefix}_{what}_bytes", f"Data bytes moved, per {what}",
                                 labels=[*names, "op"])
    errors = CounterMetricFamily(f"{prefix}_{what}_errors", f"I/O commands that failed, per {what} and status",
                                 labels=[*names, "status"])
    latency = HistogramMetricFamily(f"{prefix}_{what}_latency_seconds", f"{latency_help}, per {what}",
                                    labels=names)
    for labels, e in rows:
        for op, n in e["ops"].items():
            ops.add_metric([*labels, op], n)
            nbytes.add_metric([*labels, op], e["bytes"][op])
        for status, n in e["errors"].items():
            errors.add_metric([*labels, status], n)
        cumulative, running = [], 0
        for bound, n in zip(_BOUNDS_S, e["buckets"]):
            running += n
            cumulative.append((bound, running))
        latency.add_metric(labels, cumulative, e["latency_ns"] / 1e9)
    yield from (ops, nbytes, errors, latency)


class MetricsServer:
    """A minimal HTTP/1.0 endpoint: ``GET /metrics`` answers ``collector``'s metrics in the
    text format."""

    def __init__(self, collector: Collector, address: str, port: int) -> None:
        self.address = address
        self.port = port
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)  # type: ignore[arg-type]
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._client, self.address, self.port,
                                                 limit=MAX_REQUEST_HEAD)
        self.port = self.server.sockets[0].getsockname()[1]
        log.info("metrics listening", address=self.address, port=self.port)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
            self.server = None

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10.0)
            method, path, *_ = head.split(b"\r\n", 1)[0].split(b" ")
            if method != b"GET":
                status, body, ctype = b"405 Method Not Allowed", b"GET only\n", b"text/plain"
            elif path.split(b"?", 1)[0] != b"/metrics":
                status, body, ctype = b"404 Not Found", b"see /metrics\n", b"text/plain"
            else:
                status, body, ctype = b"200 OK", generate_latest(self.registry), CONTENT_TYPE_LATEST.encode()
            writer.write(b"HTTP/1.0 " + status + b"\r\nContent-Type: " + ctype +
                         b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError,
                ConnectionError):
            pass
        finally:
            writer.close()
