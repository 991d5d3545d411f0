"""Restarting a replicated pair with a configuration that no longer fits what is on disk, as real
processes (test audit, failure mode 10): each is refused with a line that says what differs,
and nothing is written over (no formatting, no copy)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from .nodes import DEVICE, NQN, REGION, Node, all_in_sync


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_replica_of_another_size_is_refused_and_left_untouched(tmp_path: Path) -> None:
    primary, r1 = Node(tmp_path, "primary"), Node(tmp_path, "r1", DEVICE + REGION)
    r1.file.write_bytes(os.urandom(DEVICE + REGION))
    before = sha(r1.file)
    try:
        r1.start()
        primary.start([r1])
        reps = primary.wait_states(lambda reps: "the copies must be the same size" in reps[0]["reason"], timeout=30)
        assert reps[0]["state"] != "in_sync", reps
        assert f"the replica has {DEVICE + REGION} bytes, this copy {DEVICE}" in reps[0]["reason"], reps
    finally:
        primary.stop()
        r1.stop()
    assert sha(r1.file) == before  # no superblock, no bitmap, no data copied onto it


@pytest.mark.parametrize("region", [2 * REGION, REGION // 2])
def test_a_restart_with_another_region_size_is_refused(tmp_path: Path, region: int) -> None:
    primary, r1 = Node(tmp_path, "primary"), Node(tmp_path, "r1")
    try:
        r1.start()
        primary.start([r1])
        primary.wait_states(all_in_sync(settled=True), timeout=40)
        primary.stop()
        before = sha(primary.file)
        seen = primary.log.stat().st_size
        with pytest.raises(AssertionError):  # Node.start: the process ended before "target ready"
            primary.start([r1], ns_keys=f"region_size = {region}\n")
        assert primary.proc is not None and primary.proc.wait(10) == 1
        lines = [ln for ln in primary.log.read_text()[seen:].splitlines() if "cannot start the target" in ln]
        assert lines and (f"the metadata has region_size {REGION}, the configuration {region}" in lines[0]), lines
        assert f"{NQN} namespace 1:" in lines[0] and lines[0].count("namespace 1") == 1, lines
        assert sha(primary.file) == before  # not formatted again
    finally:
        primary.stop()
        r1.stop()
