"""Prometheus metrics of the initiator daemon, over HTTP (``[metrics]`` in its configuration):
per connection its I/O (:mod:`blockd.iostats`: commands, bytes, errors, latency), reconnects,
I/O queues and commands in flight; per FUSE mount the requests it served and failed.

Read when Prometheus scrapes, as the target's (:mod:`target.metrics`, same names after
``blockd_initiator_``); the endpoint is :class:`blockd.prometheus.MetricsServer`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from blockd.prometheus import MetricsServer, io_families
from initiator.multipath import MultipathController

if TYPE_CHECKING:
    from initiator.daemon import InitiatorDaemon

PREFIX = "blockd_initiator"
_LATENCY = "I/O command latency on the host (sent to completion)"
_CONNECTION = ["connection", "subsystem"]
_MOUNT = ["mountpoint", "connection"]


class InitiatorCollector:
    """Reads an :class:`initiator.daemon.InitiatorDaemon` at each scrape."""

    def __init__(self, daemon: InitiatorDaemon) -> None:
        self.daemon = daemon

    def collect(self) -> Iterator[Metric]:
        conns = [([name, ctrl.params.subnqn], ctrl) for name, ctrl in self.daemon.connections.items()]
        yield from io_families(PREFIX, "connection", _CONNECTION,
                               [(labels, ctrl.counters.snapshot()) for labels, ctrl in conns], _LATENCY)
        up = GaugeMetricFamily(f"{PREFIX}_connection_up", "1 while the association is live, 0 while "
                               "reconnecting or after giving up", labels=_CONNECTION)
        reconnects = CounterMetricFamily(f"{PREFIX}_connection_reconnects",
                                         "Associations re-established after a lost connection", labels=_CONNECTION)
        queues = GaugeMetricFamily(f"{PREFIX}_connection_io_queues", "I/O queues of the association",
                                   labels=_CONNECTION)
        depth = GaugeMetricFamily(f"{PREFIX}_connection_queue_depth_in_use",
                                  "Commands in flight on the connection's I/O queues", labels=_CONNECTION)
        for labels, ctrl in conns:
            up.add_metric(labels, ctrl.state == "live")
            reconnects.add_metric(labels, ctrl.reconnects)
            queues.add_metric(labels, len(ctrl.io))
            depth.add_metric(labels, sum(len(conn.queue.pending) for conn in ctrl.io))
        yield from (up, reconnects, queues, depth)
        yield from _multipath_families([(labels, ctrl.describe()) for labels, ctrl in conns
                                        if isinstance(ctrl, MultipathController)])

        requests = CounterMetricFamily(f"{PREFIX}_mount_requests", "FUSE reads and writes served, per mount",
                                       labels=[*_MOUNT, "op"])
        errors = CounterMetricFamily(f"{PREFIX}_mount_errors", "FUSE requests answered with an error, per mount",
                                     labels=_MOUNT)
        for mount in self.daemon.mounts.mounts.values():
            labels = [mount.mountpoint, mount.name]
            stats = mount.session.stats
            for op in ("read", "write"):
                requests.add_metric([*labels, op], stats[op])
            errors.add_metric(labels, stats["errors"])
        yield from (requests, errors)


def _multipath_families(conns: list[tuple[list[str], dict[str, Any]]]) -> Iterator[Metric]:
    """Per multipath connection its path-loss retries, per path its ANA log reads, and per
    namespace there its ANA state, ANA-status retries and requeued commands (what ``blockctl
    list`` shows, ``MultipathController.describe``)."""
    ana_retries = CounterMetricFamily(f"{PREFIX}_path_ana_retries", "ANA-status retries of the namespace on the "
                                      "path: at most one per ANA transition (0x301-0x303)",
                                      labels=[*_CONNECTION, "path", "nsid"])
    ana_requeued = CounterMetricFamily(f"{PREFIX}_path_ana_requeued", "Commands of the namespace requeued after "
                                       "an ANA status from the path in a transition already retried",
                                       labels=[*_CONNECTION, "path", "nsid"])
    path_retries = CounterMetricFamily(f"{PREFIX}_connection_path_retries", "Commands sent again on another "
                                       "path after theirs went down or timed out", labels=_CONNECTION)
    reads = CounterMetricFamily(f"{PREFIX}_path_ana_log_reads", "ANA log pages read from the path",
                                labels=[*_CONNECTION, "path"])
    state = GaugeMetricFamily(f"{PREFIX}_path_ana_state", "1 for the ANA state of the namespace on the path "
                              "(unknown: not read since the path connected)",
                              labels=[*_CONNECTION, "path", "nsid", "state"])
    for labels, mp in conns:
        path_retries.add_metric(labels, mp["path_retries"])
        for p in mp["paths"]:
            where = f"{p['traddr']}:{p['trsvcid']}"
            reads.add_metric([*labels, where], p["ana_reads"])
            for nsid, name in p["ana"].items():
                state.add_metric([*labels, where, nsid, name], 1)
                ana_retries.add_metric([*labels, where, nsid], p["ana_retries"].get(nsid, 0))
                ana_requeued.add_metric([*labels, where, nsid], p["ana_requeued"].get(nsid, 0))
    yield from (ana_retries, ana_requeued, path_retries, reads, state)


def initiator_metrics_server(daemon: InitiatorDaemon, address: str, port: int) -> MetricsServer:
    """The initiator daemon's ``/metrics`` endpoint."""
    return MetricsServer(InitiatorCollector(daemon), address, port)
