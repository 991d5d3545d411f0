"""Failover with ANA through the FUSE mount (issue 14): two ``blockd target`` processes export
the same file as one subsystem and namespace (same NQN, so the same derived NGUID; disjoint
controller id ranges), A optimized and B inaccessible. The initiator daemon connects to both
(``blockctl connect --path A --path B``) and mounts the volume; threads write random 4 KiB
blocks with O_DIRECT and log each write once it returned. A is killed with SIGKILL, B promoted
with ``blockctl target ana promote``: no write fails, and every logged write reads back. A path
whose target is down at connect time joins when that target starts; with every target down the
connect fails with one line."""

from __future__ import annotations

from pathlib import Path

from blockd_stack import NQN, Stack, free_port
from failover import SIZE, Pair, Writer


def test_kill_primary_promote_standby_no_error(tmp_path: Path) -> None:
    pair = Pair(tmp_path)
    s = pair.s
    try:
        s.start_target()
        pair.start_b()
        s.start_initiator()
        pair.connect()
        listing = s.blockctl("list").stdout
        assert f"path tcp://127.0.0.1:{s.port} cntlid 1 live: nsid 1 optimized" in listing, listing
        assert pair.path_b("cntlid 100 live: nsid 1 inaccessible") in listing, listing
        s.mount()
        pair.fail_over(Writer(s.file))
    finally:
        pair.stop()


def test_a_path_down_at_connect_joins_when_its_target_starts(tmp_path: Path) -> None:
    """B is down when the host connects: the connect succeeds on A, ``blockctl list`` shows B
    connecting; B starts under a write load and joins (its ANA state read, inaccessible), the
    writes never stop; then A is killed and B promoted, and the load goes on through B."""
    pair = Pair(tmp_path)
    s = pair.s
    try:
        s.start_target()
        s.start_initiator()
        pair.connect()
        listing = s.blockctl("list").stdout
        assert f"path tcp://127.0.0.1:{s.port} cntlid 1 live: nsid 1 optimized" in listing, listing
        assert pair.path_b("cntlid 0 connecting: no ANA state") in listing, listing
        assert " live, " in listing  # the connection itself
        s.mount()
        writer = Writer(s.file)
        writer.wait_writes(20)  # B starts under the load
        pair.start_b()
        pair.wait_listed(pair.path_b("cntlid 100 live: nsid 1 inaccessible"))
        assert not writer.errors, writer.errors
        pair.fail_over(writer)
        assert "connected after retrying" in s.log("initiator", 200)
    finally:
        pair.stop()


def test_connect_fails_in_one_line_when_no_path_connects(tmp_path: Path) -> None:
    s = Stack(tmp_path, size=SIZE)
    ports = free_port(), free_port()
    try:
        s.start_initiator()
        proc = s.blockctl("connect", "-n", NQN, "--name", "vol", "-l", "30",
                          *(arg for p in ports for arg in ("--path", f"127.0.0.1:{p}")), check=False)
        assert proc.returncode != 0
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr
        assert f"no path to {NQN} connects: 127.0.0.1:{ports[0]}: " in lines[0], lines
        assert f"; 127.0.0.1:{ports[1]}: " in lines[0], lines
        assert "Traceback" not in proc.stderr
        assert s.blockctl("list").stdout.strip() == "no connections"
    finally:
        s.stop()
