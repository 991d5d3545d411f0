"""Both daemons' Prometheus endpoints with a FUSE mount (``Stack(metrics=True)``): the
initiator's per-mount and per-connection metrics and the target's per-host metrics agree with
the direct I/O the test did through the mount."""

from __future__ import annotations

import mmap
import os
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from blockd_stack import NQN, Stack

BLOCK = 4096


@pytest.fixture
def metrics_stack(tmp_path: Path) -> Iterator[Stack]:
    s = Stack(tmp_path, size=16 << 20, metrics=True)
    try:
        s.start()
        yield s
    finally:
        s.stop()


def scrape(stack: Stack, daemon: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of one daemon's endpoint: (name, sorted labels) -> value."""
    text = urllib.request.urlopen(stack.metrics_url(daemon), timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def by_op(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> dict[str, float]:
    """Samples of ``name`` by their ``op`` label (the stack has one connection and one host)."""
    return {dict(k[1])["op"]: v for k, v in samples.items() if k[0] == name}


def test_mount_connection_and_target_metrics_agree(metrics_stack: Stack) -> None:
    stack = metrics_stack
    before_i, before_t = scrape(stack, "initiator"), scrape(stack, "target")
    buf = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT wants
    buf.write(b"m" * BLOCK)
    fd = os.open(stack.file, os.O_RDWR | os.O_DIRECT)
    try:
        for i in range(8):
            assert os.pwrite(fd, buf, i * BLOCK) == BLOCK
        for i in range(5):
            assert os.preadv(fd, [buf], i * BLOCK) == BLOCK
    finally:
        os.close(fd)
    after_i, after_t = scrape(stack, "initiator"), scrape(stack, "target")

    mount = (("connection", "vol"), ("mountpoint", str(stack.mnt)))
    for op, n in (("read", 5), ("write", 8)):
        key = ("blockd_initiator_mount_requests_total", tuple(sorted((*mount, ("op", op)))))
        assert after_i[key] - before_i.get(key, 0) == n, (op, after_i[key])

    def delta(after: dict, before: dict, name: str) -> dict[str, float]:
        return {op: v - by_op(before, name).get(op, 0) for op, v in by_op(after, name).items()}

    host_cmds = delta(after_i, before_i, "blockd_initiator_connection_commands_total")
    host_bytes = delta(after_i, before_i, "blockd_initiator_connection_bytes_total")
    target_cmds = delta(after_t, before_t, "blockd_target_host_commands_total")
    target_bytes = delta(after_t, before_t, "blockd_target_host_bytes_total")
    assert (host_cmds["read"], host_cmds["write"]) == (5, 8), host_cmds
    assert (host_bytes["read"], host_bytes["write"]) == (5 * BLOCK, 8 * BLOCK), host_bytes
    assert {op: target_cmds[op] for op in ("read", "write")} == {"read": 5, "write": 8}
    assert {op: target_bytes[op] for op in ("read", "write")} == {"read": 5 * BLOCK, "write": 8 * BLOCK}
    conn = (("connection", "vol"), ("subsystem", NQN))
    assert after_i[("blockd_initiator_connection_up", conn)] == 1
    assert after_i[("blockd_initiator_connection_io_queues", conn)] == stack.nr_io_queues
    assert after_i[("blockd_initiator_connection_reconnects_total", conn)] == 0
