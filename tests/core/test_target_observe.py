"""Watching a running target: the control socket's views and counters, ``blockctl target`` and
the Prometheus endpoint, against two of our hosts doing known I/O over loopback TCP."""

from __future__ import annotations

import asyncio
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from blockd.iostats import KINDS, bucket_bound_ns, interval, percentile_ns
from initiator.control import ControlClient, ControlError
from initiator.errors import NvmeError
from protocol.status import Status

from .conftest import HOSTNQN, NQN, config, connect, free_port, ns, run, serving, sub

HOST2 = "nqn.2014-08.org.nvmexpress:uuid:99999999-2222-3333-4444-555555555555"
IO_QUEUES = 2


async def _call(path: str, request: dict[str, Any]) -> dict[str, Any]:
    def call() -> dict[str, Any]:
        with ControlClient(path, timeout=10, daemon="target") as client:
            return client.call(request)
    return await asyncio.to_thread(call)


async def _workload(port: int) -> tuple[int, int]:
    """Host 1 on nsid 1: 5 writes of 8 KiB, 3 reads of 4 KiB, 1 flush. Host 2 on nsid 2:
    2 writes of 4 KiB, 1 read of 64 KiB, one read past the end (refused: LBA Out of Range).
    Returns the two hosts' controller ids."""
    h1 = await connect(port, nr_io_queues=IO_QUEUES)
    h2 = await connect(port, hostnqn=HOST2, nr_io_queues=IO_QUEUES)
    try:
        for i in range(5):
            await h1.write_bytes(1, i * 8192, bytes([i]) * 8192)
        for i in range(3):
            await h1.read_bytes(1, i * 4096, 4096)
        await h1.flush(1)
        for i in range(2):
            await h2.write_bytes(2, i * 4096, b"x" * 4096)
        await h2.read_bytes(2, 0, 65536)
        with pytest.raises(NvmeError):
            await h2.read_into(2, (8 << 20) // 4096, memoryview(bytearray(4096)))
        return h1.cntlid, h2.cntlid
    finally:
        await h1.close()
        await h2.close()


def _by(entries: list[dict[str, Any]], key: str, value: Any) -> dict[str, Any]:
    (found,) = [e for e in entries if e[key] == value]
    return found


def _cfg(tmp_path: Path, port: int, **kw: Any) -> Any:
    return config([port], [sub(NQN, [ns(tmp_path / "a.img", 1), ns(tmp_path / "b.img", 2, block_size=4096)])],
                  control=str(tmp_path / "run" / "target.sock"), **kw)


def test_counters_match_what_two_hosts_did(tmp_path: Path) -> None:
    port = free_port()
    sock = str(tmp_path / "run" / "target.sock")

    async def main() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], tuple[int, int]]:
        async with serving(_cfg(tmp_path, port)):
            before = await _call(sock, {"op": "counters"})
            h1 = await connect(port, nr_io_queues=IO_QUEUES)
            h2 = await connect(port, hostnqn=HOST2, nr_io_queues=IO_QUEUES)
            hosts = await _call(sock, {"op": "hosts"})
            await h1.close()
            await h2.close()
            cntlids = await _workload(port)
            return before, hosts, await _call(sock, {"op": "counters"}), cntlids

    before, hosts, after, (c1, c2) = run(main())
    for e in before["namespaces"]:
        assert set(e["ops"].values()) == {0} and sum(e["buckets"]) == 0

    assert {h["hostnqn"] for h in hosts["hosts"]} == {HOSTNQN, HOST2}
    h = _by(hosts["hosts"], "hostnqn", HOST2)
    assert h["subsystem"] == NQN and h["transport"] == "tcp" and h["peer"].startswith("127.0.0.1:")
    assert [q["qid"] for q in h["queues"]] == [0, 1, 2] and h["keep_alive_ms"] > 0

    n1, n2 = _by(after["namespaces"], "nsid", 1), _by(after["namespaces"], "nsid", 2)
    assert n1["ops"] == {"read": 3, "write": 5, "flush": 1, "other": 0}
    assert n1["bytes"] == {"read": 3 * 4096, "write": 5 * 8192, "flush": 0, "other": 0}
    assert n1["errors"] == {}
    assert sum(n1["buckets"]) == 9 and n1["latency_ns"] > 0
    # the refused read counts as a read (no data moved past the end, but its length was asked)
    assert n2["ops"] == {"read": 2, "write": 2, "flush": 0, "other": 0}
    assert n2["bytes"]["write"] == 2 * 4096 and n2["bytes"]["read"] == 65536 + 4096
    assert n2["errors"] == {Status.LBA_RANGE.name.lower(): 1}
    # the hosts closed: their counters went with their controllers (the namespaces' stay)
    assert after["hosts"] == []
    assert c1 != c2


def test_host_counters_while_connected(tmp_path: Path) -> None:
    port = free_port()
    sock = str(tmp_path / "run" / "target.sock")

    async def main() -> dict[str, Any]:
        async with serving(_cfg(tmp_path, port)):
            h1 = await connect(port, nr_io_queues=IO_QUEUES)
            try:
                for i in range(4):
                    await h1.write_bytes(1, i * 512, b"y" * 512)
                await h1.read_bytes(2, 0, 8192)
                return await _call(sock, {"op": "counters"})
            finally:
                await h1.close()

    snap = run(main())
    (host,) = snap["hosts"]
    assert host["hostnqn"] == HOSTNQN
    # other: the I/O queues' own Connect commands (counted once the queue belongs to the host)
    assert host["ops"] == {"read": 1, "write": 4, "flush": 0, "other": IO_QUEUES}
    assert host["bytes"]["read"] == 8192 and host["bytes"]["write"] == 4 * 512
    assert sum(host["buckets"]) == 5 + IO_QUEUES


async def _blockctl(*argv: str) -> str:
    """blockctl as a user runs it (its own process), its standard output."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "blockd.cli.blockctl", *argv,
                                                stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    assert proc.returncode == 0, argv
    return out.decode()


def test_blockctl_target_verbs(tmp_path: Path) -> None:
    port = free_port()
    sock = str(tmp_path / "run" / "target.sock")

    written: list[int] = []

    async def main() -> list[str]:
        async with serving(_cfg(tmp_path, port)):
            h1 = await connect(port, nr_io_queues=IO_QUEUES)
            try:
                outs = [await _blockctl("target", "--target-socket", sock, *argv)
                        for argv in (["status", "--json"], ["namespaces"], ["hosts"])]

                stats = asyncio.ensure_future(
                    _blockctl("target", "--target-socket", sock, "stats", "--interval", "1", "--json"))
                i = 0
                while not stats.done():  # writes all through the interval, however late it starts
                    await h1.write_bytes(1, i % 64 * 4096, b"z" * 4096)
                    i += 1
                written.append(i)
                return [*outs, await stats]
            finally:
                await h1.close()

    status_json, ns_table, hosts_table, stats_json = run(main())
    status = json.loads(status_json)
    assert [p["service"] for p in status["ports"]] == [str(port)]
    assert {(n["nsid"], n["size"], n["block_size"], n["backend"], n["read_only"]) for n in status["namespaces"]} == {
        (1, 8 << 20, 512, "FileBackend", False), (2, 8 << 20, 4096, "FileBackend", False)}
    assert status["hosts"][0]["hostnqn"] == HOSTNQN
    assert ns_table.split()[:7] == ["SUBSYSTEM", "NSID", "SIZE", "BLOCK", "BACKEND", "RO", "PATH"]
    assert ns_table.splitlines()[1].split()[:6] == [NQN, "1", "8MiB", "512", "FileBackend", "no"]
    assert HOSTNQN in hosts_table and "2x128" in hosts_table
    stats = json.loads(stats_json)
    n1 = _by(stats["interval"]["namespaces"], "nsid", 1)
    (total,) = written
    assert 0 < n1["ops"]["write"] <= total and n1["bytes"]["write"] == n1["ops"]["write"] * 4096
    assert 0.9 < n1["iops"]["write"] / n1["ops"]["write"] < 1.1  # over one second
    # both measured; no order between them: one stall of the loaded machine can lift the mean
    # above the p99 bucket (seen in CI)
    assert n1["p99_latency_us"] > 0 and n1["mean_latency_us"] > 0
    # the counters at the interval's end (the loop wrote on until the child had exited)
    assert n1["ops"]["write"] <= _by(stats["totals"]["namespaces"], "nsid", 1)["ops"]["write"] <= total


def test_control_socket_refusals(tmp_path: Path) -> None:
    port = free_port()
    sock = str(tmp_path / "run" / "target.sock")

    async def main() -> list[str]:
        errors = []
        async with serving(_cfg(tmp_path, port)):
            import os
            assert os.stat(sock).st_mode & 0o777 == 0o600
            for req in ({"op": "nope"}, {"op": "stats", "interval": 0}, {"op": "hosts", "x": 1}):
                try:
                    await _call(sock, req)
                except ControlError as exc:
                    errors.append(str(exc))
        return errors

    errors = run(main())
    assert "unknown request 'nope'" in errors[0]
    assert "interval must be" in errors[1]
    assert "bad request" in errors[2]
    assert not (tmp_path / "run" / "target.sock").exists()


def test_interval_and_percentile() -> None:
    buckets = [0] * 54
    buckets[3] = 98  # 4.096..8.192 us
    buckets[10] = 2  # up to 1.048576 ms
    assert percentile_ns(buckets, 0.98) == bucket_bound_ns(3)
    assert percentile_ns(buckets, 0.99) == bucket_bound_ns(10) == 1024 << 10
    assert percentile_ns([0] * 54, 0.99) == 0
    zero = dict.fromkeys(KINDS, 0)
    before = {"ops": zero, "bytes": zero, "latency_ns": 0, "buckets": [0] * 54, "errors": {}}
    after = {"ops": {**zero, "read": 100}, "bytes": {**zero, "read": 409600}, "latency_ns": 100_000,
             "buckets": buckets, "errors": {"lba_range": 1}}
    iv = interval(before, after, 2.0)
    assert iv["iops"]["read"] == 50 and iv["bytes_per_s"]["read"] == 204800
    assert iv["mean_latency_us"] == 1.0 and iv["p99_latency_us"] == 1048.576
    assert iv["errors"] == {"lba_range": 1}


def test_prometheus_scrape(tmp_path: Path) -> None:
    port = free_port()
    mport = free_port()

    async def main() -> tuple[str, int]:
        async with serving(_cfg(tmp_path, port, metrics={"enabled": True, "port": mport})) as service:
            assert service.metrics is not None and service.metrics.address == "127.0.0.1"
            h1 = await connect(port, nr_io_queues=IO_QUEUES)
            try:
                for i in range(3):
                    await h1.write_bytes(1, i * 4096, b"m" * 4096)
                await h1.read_bytes(1, 0, 16384)
                text = await asyncio.to_thread(
                    lambda: urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10).read().decode())
                missing = await asyncio.to_thread(_status_of, f"http://127.0.0.1:{mport}/other")
                return text, missing
            finally:
                await h1.close()

    text, missing = run(main())
    assert missing == 404
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    ns_labels = {"subsystem": NQN, "nsid": "1"}

    def value(fam: str, sample: str, **labels: str) -> float:
        (v,) = [s.value for s in fams[fam].samples if s.name == sample and s.labels == labels]
        return v

    assert fams["blockd_target_namespace_commands"].type == "counter"
    assert value("blockd_target_namespace_commands", "blockd_target_namespace_commands_total",
                 **ns_labels, op="write") == 3
    assert value("blockd_target_namespace_commands", "blockd_target_namespace_commands_total",
                 **ns_labels, op="read") == 1
    assert value("blockd_target_namespace_bytes", "blockd_target_namespace_bytes_total",
                 **ns_labels, op="read") == 16384
    assert fams["blockd_target_namespace_latency_seconds"].type == "histogram"
    assert value("blockd_target_namespace_latency_seconds", "blockd_target_namespace_latency_seconds_count",
                 **ns_labels) == 4
    assert value("blockd_target_namespace_latency_seconds", "blockd_target_namespace_latency_seconds_bucket",
                 **ns_labels, le="+Inf") == 4
    assert value("blockd_target_namespace_size_bytes", "blockd_target_namespace_size_bytes",
                 subsystem=NQN, nsid="2") == 8 << 20
    host = {"subsystem": NQN, "hostnqn": HOSTNQN}
    (cntlid,) = {s.labels["cntlid"] for s in fams["blockd_target_host_commands"].samples}
    assert value("blockd_target_host_commands", "blockd_target_host_commands_total",
                 **host, cntlid=cntlid, op="write") == 3
    assert value("blockd_target_host_queues", "blockd_target_host_queues", **host, cntlid=cntlid) == 1 + IO_QUEUES
    assert value("blockd_target_host_queue_depth_in_use", "blockd_target_host_queue_depth_in_use",
                 **host, cntlid=cntlid) == 0
    assert value("blockd_target_connections", "blockd_target_connections", transport="tcp") == 1
    assert value("blockd_target_keep_alive_expiries", "blockd_target_keep_alive_expiries_total") == 0


def _status_of(url: str) -> int:
    try:
        urllib.request.urlopen(url, timeout=10)
    except urllib.error.HTTPError as exc:
        return exc.code
    return 200


def test_metrics_off_by_default_and_loopback(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, free_port())
    assert cfg.metrics is None
    on = _cfg(tmp_path, free_port(), metrics={"enabled": True})
    assert on.metrics.address == "127.0.0.1" and on.metrics.port == 9469


def test_blockctl_iostat(tmp_path: Path) -> None:
    """``blockctl iostat 0.5 2``: two reports, one row per namespace, the writes in MB/s."""
    port = free_port()
    sock = str(tmp_path / "run" / "target.sock")

    async def main() -> str:
        async with serving(_cfg(tmp_path, port)):
            h1 = await connect(port, nr_io_queues=IO_QUEUES)
            try:
                report = asyncio.ensure_future(_blockctl("iostat", "--target-socket", sock, "0.5", "2"))
                i = 0
                while not report.done():
                    await h1.write_bytes(2, i % 64 * 4096, b"w" * 4096)
                    i += 1
                return await report
            finally:
                await h1.close()

    out = run(main())
    reports = [r for r in out.strip().split("\n\n") if r]
    assert len(reports) == 2
    for r in reports:
        _, header, *rows = r.splitlines()
        assert header.split()[:6] == ["SUBSYSTEM", "NSID", "r/s", "w/s", "rMB/s", "wMB/s"]
        by_nsid = {row.split()[1]: row.split() for row in rows}
        assert set(by_nsid) == {"1", "2"}
        assert float(by_nsid["1"][3]) == 0 and float(by_nsid["2"][3]) > 0
        assert float(by_nsid["2"][5]) == pytest.approx(float(by_nsid["2"][3]) * 4096 / 1e6, rel=0.05, abs=0.01)


def test_host_counters_per_connection(tmp_path: Path) -> None:
    """Our host counts its own I/O per connection: the same commands and bytes the target saw;
    a command refused by the target counts under its status on both ends."""
    port = free_port()
    sock = str(tmp_path / "run" / "target.sock")

    async def main() -> tuple[dict[str, Any], dict[str, Any]]:
        async with serving(_cfg(tmp_path, port)):
            h1 = await connect(port, nr_io_queues=IO_QUEUES)
            try:
                for i in range(6):
                    await h1.write_bytes(1, i * 4096, b"h" * 4096)
                await h1.read_bytes(1, 0, 3 * 4096)
                await h1.flush(1)
                with pytest.raises(NvmeError):
                    await h1.read_into(1, (8 << 20) // 512, memoryview(bytearray(512)))
                (target_side,) = (await _call(sock, {"op": "counters"}))["hosts"]
                return h1.counters.snapshot(), target_side
            finally:
                await h1.close()

    host, target_side = run(main())
    assert host["ops"] == {"read": 2, "write": 6, "flush": 1, "other": 0}
    assert host["bytes"] == {"read": 3 * 4096 + 512, "write": 6 * 4096, "flush": 0, "other": 0}
    assert host["errors"] == {"lba_range": 1} == target_side["errors"]
    for kind in ("read", "write", "flush"):
        assert host["ops"][kind] == target_side["ops"][kind]
        assert host["bytes"][kind] == target_side["bytes"][kind]
    assert sum(host["buckets"]) == 9 and host["latency_ns"] > 0
    # The target also counts each I/O queue's Connect (an "other" command of the host), which
    # the host does not: its latency sum is not comparable with the host's (a slow Connect on a
    # loaded machine made it the larger).
    assert target_side["ops"]["other"] == IO_QUEUES and sum(target_side["buckets"]) == 9 + IO_QUEUES


@pytest.mark.parametrize("table", [{"threaded_queues": False}, {}, {"io_uring_queues": True}],
                         ids=["loop", "thread", "ring"])
def test_the_queue_plane_as_chosen_in_the_log_and_in_hosts(tmp_path: Path, table: dict[str, Any]) -> None:
    """The start-up log names what serves the NVMe/TCP I/O queues as chosen, not as asked (the
    Python plane has no queue threads, so its queues are the event loop's whatever ``[target]``
    says), and ``hosts`` shows, per queue, what served its commands: the loop's compiled path,
    the queue's thread, or the thread's io_uring (with its ``io_uring_enter`` calls)."""
    from structlog.testing import capture_logs

    from target.io_fast import TcpFastPath, uring_queues

    port = free_port()
    sock = str(tmp_path / "run" / "target.sock")

    async def main() -> dict[str, Any]:
        async with serving(_cfg(tmp_path, port, target=table)):
            h1 = await connect(port, nr_io_queues=1)
            try:
                for i in range(20):
                    await h1.write_bytes(1, i * 4096, bytes([i]) * 4096)
                    await h1.read_bytes(1, i * 4096, 4096)
                return await _call(sock, {"op": "hosts"})
            finally:
                await h1.close()

    with capture_logs() as logs:
        hosts = run(main())
    said = [e for e in logs if e["event"].startswith("NVMe/TCP")]
    (served,) = [q["served_by"] for q in hosts["hosts"][0]["queues"] if q["qid"]]
    assert len(said) == 1, said
    if TcpFastPath is None:
        assert said[0]["event"] == "NVMe/TCP I/O queues on the event loop", said
        assert "not running on this plane" in said[0]["reason"] and served == {}, (said, served)
    elif not table.get("threaded_queues", True):
        assert said[0]["event"] == "NVMe/TCP I/O queues on the event loop", said
        assert served["compiled"] >= 30 and served["thread"] == 0 and "io_uring" not in served, served
    elif table.get("io_uring_queues") and uring_queues(True)[0]:
        assert said[0]["event"] == "NVMe/TCP queue threads on io_uring", said
        # the file steps may be the thread's (tmp_path's file system refuses RWF_NOWAIT): the
        # sends and receives are the ring's whatever it is
        assert served["thread"] >= 30 and served["io_uring_enters"] >= 30, served
    else:
        assert said[0]["event"] == "NVMe/TCP queue threads on system calls", said
        assert served["thread"] >= 30 and "io_uring" not in served, served
