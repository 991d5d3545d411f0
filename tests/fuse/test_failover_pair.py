"""Failover of a replicated pair through the FUSE mount (issue 14): two ``blockd target``
processes, each with its own file, present one subsystem; each names the other's standby
subsystem as its replica. A (optimized) is the primary and mirrors every write to B
(inaccessible, the standby). The host connects to both and writes under load; A is killed with
SIGKILL, B promoted: no write fails and every acknowledged one reads back from B. A then
returns as the standby: B resyncs it from the write-intent bitmaps (the regions written since,
not the volume) and the two copies' data areas are equal. The host lists A inaccessible (its ANA
log read on the reconnect, issue 40), and a planned switch-back under load (demote B, promote A)
costs no error."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from failover import BLOCK, SIZE, Pair, Writer, read_back

REGION = 64 << 10
SPAN = 16 * REGION
"""The load writes the first 16 regions only, so a full resync (the whole data area, 16 MiB less
the metadata) is told from a bitmap resync by the bytes copied."""


def _data_hash(path: Path, size: int) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read(size)).hexdigest()


def test_kill_primary_promote_standby_then_the_old_primary_returns_and_resyncs_its_bitmap(tmp_path: Path) -> None:
    pair = Pair(tmp_path, replicated=True)
    s = pair.s
    try:
        pair.start_b()
        s.start_target()
        ns = pair.wait_replica("target.sock", "in_sync")
        assert ns["role"] == "primary" and pair.replica_ns("b.sock")["role"] == "secondary"
        data_size = ns["data_size"]
        s.start_initiator()
        pair.connect()
        listing = s.blockctl("list").stdout
        assert f"nsid 1: {data_size} bytes" in listing, listing  # the data area, through both paths
        assert f"path tcp://127.0.0.1:{s.port} cntlid 1 live: nsid 1 optimized" in listing, listing
        assert pair.path_b("cntlid 100 live: nsid 1 inaccessible") in listing, listing
        s.mount()
        writer = Writer(s.file, blocks=SPAN // BLOCK)
        pair.fail_over(writer)  # kill -9 A, promote B: no error, every acknowledged write on B
        ns = pair.replica_ns("b.sock")
        assert ns["role"] == "primary" and ns["replicas"][0]["state"] in ("connecting", "degraded"), ns

        pair.configure_a("inaccessible")  # A returns as the standby
        s.start_target()
        ns = pair.wait_replica("b.sock", "in_sync")
        assert pair.replica_ns("target.sock")["role"] == "secondary"
        copied = ns["replicas"][0]["resynced_bytes"]
        assert 0 < copied <= SPAN, copied  # the regions written around the failover, not the volume
        assert _data_hash(pair.backing, data_size) == _data_hash(pair.backing_b, data_size)
        with open(pair.backing, "rb") as f:  # A holds every acknowledged write again
            for offset, data in writer.acked.items():
                f.seek(offset)
                assert f.read(BLOCK) == data
        verify = pair.target_ctl("b.sock", "verify", "nqn.2026-11.io.blockd:fuse", "1")
        assert verify.returncode == 0 and " 0 differ" in verify.stdout, verify.stdout + verify.stderr
        assert SIZE > data_size > SPAN

        # issue 40: A's ANA log was read on its reconnect: listed as the standby it now is
        # (A's controller ID after its restart is whichever its first association took: B's replica
        # link or the host's reconnect may come first, so the line is matched without it)
        pair.wait_listed(f"path tcp://127.0.0.1:{s.port} cntlid * live: nsid 1 inaccessible")
        # a planned switch-back under load (demote B, then promote A): no error, the writes go
        # on through A, and B's demotion costs at most one ANA-status retry (namespace 1 on B's
        # path: the other writes in flight come back requeued with it)
        writer = Writer(s.file, blocks=SPAN // BLOCK)
        try:
            before = writer.wait_writes(writer.writes + 50)
            for sock, verb in (("b.sock", "demote"), ("target.sock", "promote")):
                res = pair.target_ctl(sock, "ana", verb)
                assert res.returncode == 0, res.stderr
            writer.wait_writes(before + 200)
        finally:
            writer.join()
        assert not writer.errors, writer.errors
        listing = pair.wait_listed(f"path tcp://127.0.0.1:{s.port} cntlid * live: nsid 1 optimized")
        assert pair.path_b("cntlid 100 live: nsid 1 inaccessible") in listing, listing
        retried = re.search(r"(\d+) ANA-status retry\(ies\)", listing)
        assert retried is not None and int(retried[1]) <= 1, listing
        assert read_back(s.file, writer.acked) == []
    finally:
        pair.stop()
