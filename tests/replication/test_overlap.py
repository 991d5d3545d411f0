"""Overlapping writes in flight on a replicated namespace, with real daemons: every copy must end
with the same data whatever order the hosts' writes to the same blocks arrive in.

NVMe leaves the result of two overlapping commands in flight at once undefined, so either
write may win; what replication must add is that every copy keeps the *same* winner. Without
ordering, the replica association spreads writes over its queues (``REPLICA_QUEUES``) and the
replica serves each queue on its own thread, so two writes to one block could land on the
replica in the other order than on the primary: every write acknowledged, the copies different,
nothing said until a verify (issue 35)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Iterator

import pytest

from blockd.dataplane import COMPILED
from initiator.control import ControlClient
from initiator.controller import ConnectParams

from .nodes import HOSTNQN, NQN, Node, all_in_sync
from .overlap import BLOCKS, overlapping_rounds

HOSTS = 4
"""With ``BLOCKS`` each: 256 writes in flight, more than one replica queue holds (128)."""
ROUNDS = int(os.environ.get("BLOCKD_OVERLAP_ROUNDS", "40"))


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Node, Node]]:
    primary, replica = Node(tmp_path, "primary"), Node(tmp_path, "replica")
    try:
        replica.start()
        primary.start([replica])
        yield primary, replica
    finally:
        for n in (primary, replica):
            n.stop()


def test_overlapping_writes_of_several_hosts_leave_every_copy_equal(pair: tuple[Node, Node]) -> None:
    primary, replica = pair
    primary.wait_states(all_in_sync())
    params = ConnectParams(traddr="127.0.0.1", trsvcid=primary.port, subnqn=NQN, hostnqn=HOSTNQN,
                           ctrl_loss_tmo=0, command_timeout=10)
    assert asyncio.run(overlapping_rounds(params, HOSTS, ROUNDS)) == ROUNDS * HOSTS * BLOCKS
    view = primary.namespace()
    reps = view["replicas"]
    assert [r["state"] for r in reps] == ["in_sync"], reps  # no write left the replica behind
    if COMPILED:  # the writes that overlapped nothing in flight took the compiled lane (_mirror_io.pyx)
        assert view["compiled_writes"] > 0, view
    with ControlClient(str(primary.sock), timeout=30, daemon="target") as client:
        totals = client.call({"op": "stats", "interval": 0.01})["totals"]
    counted = [(c["ops"]["write"], c["bytes"]["write"], c["errors"]) for c in totals["namespaces"]]
    writes = ROUNDS * HOSTS * BLOCKS  # each counted once on the namespace, whichever path answered it
    assert counted == [(writes, writes * 4096, {})], counted
    assert primary.data_hash() == replica.data_hash()
    res = primary.ctl("verify", NQN, "1")
    assert res.returncode == 0 and b" 0 differ" in res.stdout, (res.stdout, res.stderr)
