"""Prometheus metrics of a running target, over HTTP (``[metrics]`` in the configuration).

A custom collector reads the same counters the control socket shows (:mod:`target.control`,
:mod:`blockd.iostats`) when Prometheus scrapes: the data path only adds integers, and no
``prometheus_client`` metric object is touched per command (its ``observe`` takes a lock).
The HTTP endpoint runs on the target's own event loop, so a scrape reads the target's
dictionaries between two of its callbacks, never while a reload changes them (the library's
own ``start_http_server`` serves from a thread).

Metric names (documented in docs/operations.md) are stable: dashboards depend on them.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Iterator

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import (
    CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric,
)

from blockd.iostats import BUCKETS, bucket_bound_ns
from target.control import counters, hosts, namespaces
from target.rejections import KEEP_ALIVE_TIMEOUT

if TYPE_CHECKING:
    from target.target import Target

log = structlog.get_logger("blockd.target.metrics")

PREFIX = "blockd_target"
_BOUNDS_S = [f"{bucket_bound_ns(i) / 1e9:.9g}" for i in range(BUCKETS - 1)] + ["+Inf"]
"""Histogram ``le`` labels: the upper bound of each :mod:`blockd.iostats` bucket, in seconds."""
MAX_REQUEST_HEAD = 8192
"""A scraper's request line and headers fit; anything longer is dropped unanswered."""


class TargetCollector:
    """Reads a :class:`target.target.Target` at each scrape."""

    def __init__(self, target: Target) -> None:
        self.target = target

    def collect(self) -> Iterator[Metric]:
        target = self.target
        snap = counters(target)
        yield from _io_families("namespace", ["subsystem", "nsid"],
                                [([e["subsystem"], str(e["nsid"])], e) for e in snap["namespaces"]])
        yield from _io_families("host", ["subsystem", "hostnqn", "cntlid"],
                                [([e["subsystem"], e["hostnqn"], str(e["cntlid"])], e) for e in snap["hosts"]])

        size = GaugeMetricFamily(f"{PREFIX}_namespace_size_bytes", "Namespace size",
                                 labels=["subsystem", "nsid"])
        for ns in namespaces(target):
            size.add_metric([ns["subsystem"], str(ns["nsid"])], ns["size"])
        yield size

        live = hosts(target)
        conns = GaugeMetricFamily(f"{PREFIX}_connections", "Live host associations (controllers)",
                                  labels=["transport"])
        by_transport: dict[str, int] = {}
        for h in live:
            by_transport[h["transport"]] = by_transport.get(h["transport"], 0) + 1
        for transport, n in sorted(by_transport.items()):
            conns.add_metric([transport], n)
        yield conns
        queues = GaugeMetricFamily(f"{PREFIX}_host_queues", "Connected queues of a host (admin included)",
                                   labels=["subsystem", "hostnqn", "cntlid"])
        depth = GaugeMetricFamily(f"{PREFIX}_host_queue_depth_in_use",
                                  "Commands in flight on a host's I/O queues",
                                  labels=["subsystem", "hostnqn", "cntlid"])
        for h in live:
            labels = [h["subsystem"], h["hostnqn"], str(h["cntlid"])]
            queues.add_metric(labels, len(h["queues"]))
            depth.add_metric(labels, sum(q["in_flight"] for q in h["queues"] if q["qid"]))
        yield queues
        yield depth
        rejected = target.rejections.counts
        yield CounterMetricFamily(f"{PREFIX}_keep_alive_expiries", "Controllers torn down by keep-alive timeout",
                                  value=rejected[KEEP_ALIVE_TIMEOUT])
        rejections = CounterMetricFamily(f"{PREFIX}_rejections", "Hostile or over-limit input refused, by reason",
                                         labels=["reason"])
        for reason, n in sorted(rejected.items()):
            rejections.add_metric([reason], n)
        yield rejections


def _io_families(what: str, names: list[str], rows: list[tuple[list[str], dict[str, Any]]]) -> Iterator[Metric]:
    """Commands, bytes, errors and latency of namespaces or hosts (``what``), one family each."""
    ops = CounterMetricFamily(f"{PREFIX}_{what}_commands", f"I/O commands completed, per {what}",
                              labels=[*names, "op"])
    nbytes = CounterMetricFamily(f"{PREFIX}_{what}_bytes", f"Data bytes moved, per {what}",
                                 labels=[*names, "op"])
    errors = CounterMetricFamily(f"{PREFIX}_{what}_errors", f"I/O commands that failed, per {what} and status",
                                 labels=[*names, "status"])
    latency = HistogramMetricFamily(f"{PREFIX}_{what}_latency_seconds",
                                    f"I/O command latency on the target (capsule parsed to response queued), per {what}",
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
    """A minimal HTTP/1.0 endpoint: ``GET /metrics`` answers the registry's text format."""

    def __init__(self, target: Target, address: str, port: int) -> None:
        self.address = address
        self.port = port
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(TargetCollector(target))
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
