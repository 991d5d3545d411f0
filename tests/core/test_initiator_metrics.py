"""The initiator daemon's Prometheus metrics: an in-process daemon connected to a real target
over loopback TCP, scraped over HTTP and parsed with the library's own parser, checked against
the I/O the test did, a reconnect it caused and commands it kept in flight."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from blockd.config import ConfigError
from initiator.config import DEFAULT_METRICS_PORT, parse
from initiator.daemon import InitiatorDaemon
from initiator.errors import NvmeError

from .conftest import NQN, config, free_port, ns, run, serving, sub, until

Families = dict[str, Any]


def _families(text: str) -> Families:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(fams: Families, family: str, sample: str, **labels: str) -> float:
    (v,) = [s.value for s in fams[family].samples if s.name == sample and s.labels == labels]
    return v


def _scrape(port: int) -> Families:
    return _families(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode())


def test_metrics_config_is_off_by_default_and_on_loopback() -> None:
    assert parse({}).metrics is None
    assert parse({"metrics": {"enabled": False, "port": 1}}).metrics is None
    on = parse({"metrics": {"enabled": True}}).metrics
    assert on is not None and (on.address, on.port) == ("127.0.0.1", DEFAULT_METRICS_PORT) != ("127.0.0.1", 9469)
    with pytest.raises(ConfigError, match="unknown setting"):
        parse({"metrics": {"enabled": True, "bind": "0.0.0.0"}})


def test_connection_metrics_match_what_the_host_did(tmp_path: Path) -> None:
    """5 writes of 8 KiB, 3 reads of 4 KiB, a flush and one read past the end (refused), then
    the target drops the association and the host reconnects once."""
    port, mport = free_port(), free_port()
    cfg = config([port], [sub(NQN, [ns(tmp_path / "a.img")])])
    conf = parse({"metrics": {"enabled": True, "port": mport}})

    async def main() -> tuple[Families, Families]:
        async with serving(cfg) as service:
            daemon = InitiatorDaemon(str(tmp_path / "initiator.sock"), conf.metrics)
            await daemon.start()
            try:
                await daemon.op_connect(name="vol", traddr="127.0.0.1", trsvcid=port, nqn=NQN, nr_io_queues=2)
                ctrl = daemon.connections["vol"]
                for i in range(5):
                    await ctrl.write_bytes(1, i * 8192, bytes([i]) * 8192)
                for i in range(3):
                    await ctrl.read_bytes(1, i * 4096, 4096)
                await ctrl.flush(1)
                with pytest.raises(NvmeError):
                    await ctrl.read_into(1, (8 << 20) // 512, memoryview(bytearray(512)))
                before = await asyncio.to_thread(_scrape, mport)
                for c in list(service.target.controllers.values()):
                    c.shutdown("test drops the association")
                await until(lambda: ctrl.reconnects == 1 and ctrl.state == "live", timeout=10)
                return before, await asyncio.to_thread(_scrape, mport)
            finally:
                await daemon.stop()

    before, after = run(main())
    conn = {"connection": "vol", "subsystem": NQN}
    commands = "blockd_initiator_connection_commands"
    assert before[commands].type == "counter"
    assert {s.labels["op"]: s.value for s in before[commands].samples if s.name == commands + "_total"} == {
        "read": 4, "write": 5, "flush": 1, "other": 0}
    assert _value(before, "blockd_initiator_connection_bytes", "blockd_initiator_connection_bytes_total",
                  **conn, op="write") == 5 * 8192
    assert _value(before, "blockd_initiator_connection_bytes", "blockd_initiator_connection_bytes_total",
                  **conn, op="read") == 3 * 4096 + 512
    assert _value(before, "blockd_initiator_connection_errors", "blockd_initiator_connection_errors_total",
                  **conn, status="lba_range") == 1
    latency = "blockd_initiator_connection_latency_seconds"
    assert before[latency].type == "histogram"
    assert _value(before, latency, latency + "_count", **conn) == 10
    assert _value(before, latency, latency + "_bucket", **conn, le="+Inf") == 10
    assert _value(before, latency, latency + "_sum", **conn) > 0
    assert _value(before, "blockd_initiator_connection_io_queues", "blockd_initiator_connection_io_queues",
                  **conn) == 2
    assert _value(before, "blockd_initiator_connection_up", "blockd_initiator_connection_up", **conn) == 1
    reconnects = ("blockd_initiator_connection_reconnects", "blockd_initiator_connection_reconnects_total")
    assert _value(before, *reconnects, **conn) == 0
    assert _value(after, *reconnects, **conn) == 1
    assert _value(after, "blockd_initiator_connection_up", "blockd_initiator_connection_up", **conn) == 1
    assert _value(after, "blockd_initiator_connection_queue_depth_in_use",
                  "blockd_initiator_connection_queue_depth_in_use", **conn) == 0


def test_queue_depth_in_use_counts_commands_in_flight(tmp_path: Path) -> None:
    """Six reads started and not yet answered (the target runs on the same event loop, so none
    can complete before the loop turns again): the gauge says six, then zero."""
    port = free_port()
    cfg = config([port], [sub(NQN, [ns(tmp_path / "a.img")])])
    conf = parse({"metrics": {"enabled": True, "port": 0}})

    async def main() -> tuple[Families, Families]:
        async with serving(cfg):
            daemon = InitiatorDaemon(str(tmp_path / "initiator.sock"), conf.metrics)
            await daemon.start()
            try:
                await daemon.op_connect(name="vol", traddr="127.0.0.1", trsvcid=port, nqn=NQN)
                ctrl = daemon.connections["vol"]
                reads = [asyncio.ensure_future(ctrl.read_bytes(1, i * 4096, 4096)) for i in range(6)]
                await asyncio.sleep(0)  # each read's first step: its command is sent
                busy = _families(generate_latest(daemon.metrics.registry).decode())
                await asyncio.gather(*reads)
                return busy, _families(generate_latest(daemon.metrics.registry).decode())
            finally:
                await daemon.stop()

    busy, idle = run(main())
    depth = "blockd_initiator_connection_queue_depth_in_use"
    assert _value(busy, depth, depth, connection="vol", subsystem=NQN) == 6
    assert _value(idle, depth, depth, connection="vol", subsystem=NQN) == 0
