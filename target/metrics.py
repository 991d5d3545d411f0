"""Prometheus metrics of a running target, over HTTP (``[metrics]`` in the configuration).

The collector reads the same counters the control socket shows (:mod:`target.control`,
:mod:`blockd.iostats`, :mod:`target.rejections`) when Prometheus scrapes; the endpoint and
the I/O families are :mod:`blockd.prometheus`'s, shared with the initiator daemon. Metric
names (documented in docs/operations.md) are stable: dashboards depend on them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from blockd.prometheus import MetricsServer, io_families
from target.control import counters, hosts, namespaces
from target.rejections import KEEP_ALIVE_TIMEOUT

if TYPE_CHECKING:
    from target.target import Target

PREFIX = "blockd_target"
_LATENCY = "I/O command latency on the target (capsule parsed to response queued)"


class TargetCollector:
    """Reads a :class:`target.target.Target` at each scrape."""

    def __init__(self, target: Target) -> None:
        self.target = target

    def collect(self) -> Iterator[Metric]:
        target = self.target
        snap = counters(target)
        yield from io_families(PREFIX, "namespace", ["subsystem", "nsid"],
                               [([e["subsystem"], str(e["nsid"])], e) for e in snap["namespaces"]], _LATENCY)
        yield from io_families(PREFIX, "host", ["subsystem", "hostnqn", "cntlid"],
                               [([e["subsystem"], e["hostnqn"], str(e["cntlid"])], e) for e in snap["hosts"]],
                               _LATENCY)

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


def target_metrics_server(target: Target, address: str, port: int) -> MetricsServer:
    """The target's ``/metrics`` endpoint (started by :class:`target.service.TargetService`)."""
    return MetricsServer(TargetCollector(target), address, port)
