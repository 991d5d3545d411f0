"""Benchmark (not a test): resync and verify against copying and reading the same data.

On loopback, a primary `blockd target` and one replica `blockd target` (tests/replication/nodes.py),
``resync_rate`` high enough never to limit. Each round, in this order, on the same files:

* **full sync**: the primary's file holds ``--size`` of random data (written before replication:
  its metadata is formatted at start, a new replica gets everything); time from the start of the
  resync to its end, from the primary's log (``replica in sync ... mb_per_s``), against
  ``cp`` of the primary's file to a new file followed by ``sync`` of it (the resync also ends
  with a flush of the replica), and ``dd bs=1M conv=fdatasync``;
* **sparse full sync**: the same with a file that is one quarter data (1 MiB of every 4), three
  quarters holes, against ``cp`` of it (coreutils skips holes too);
* **bitmap resync**: the replica stopped, 1 MiB of every 4 MiB rewritten through the host, the
  replica back; MB/s of the dirty bytes, against ``cp`` MB/s of the full run;
* **verify**: ``blockctl target verify`` of the in-sync pair, MB/s of the data area (its time from
  the primary's log: ``verify done ... seconds``), against
  reading both files one after the other (``cat a b > /dev/null``; the same bytes a verify reads),
  and against reading them the way a verify must, right after it: the primary's file with ``cat``,
  then the replica's data area over NVMe/TCP with this tree's host library, 8 MiB at a time, two
  at once (:func:`fabric_read`; the transport's share of the verify's time, with no compare).

With ``--verify-only``, verify alone on one in-sync pair (one full sync first): each round, in an
order that alternates, this tree's verify (by digests against its blockd replica: blockd's Digest
command), the ``--before`` tree's (by reading the replica's data: main's verify, which is this
tree's fallback for a replica without the command, unchanged), and ``cat`` of both copies' files
(the issue's peer); both trees' processes are restarted on the same files for their pass.

Each round runs the blockd figures and the tools' on fresh files; with ``--before DIR`` (another
tree's ``.venv/bin``, e.g. main's) that tree's blockd is measured in the same rounds too, the order
alternating, so that the page cache and the machine's other load treat them alike. The figures are
per run, with the ratio of each run to the tools' figure of the same round.

    flock /tmp/blockd-bench.lock .venv/bin/python tests/bench/bench_resync.py [--size 512MiB] [--rounds 3] \\
        [--before /work/main/.venv/bin] [--verify-only]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from blockd.config import parse_size  # noqa: E402
from initiator.replica import open_remote  # noqa: E402
from tests.replication import nodes  # noqa: E402
from tests.replication.nodes import NQN, RNQN, Node, all_in_sync, connect  # noqa: E402

CHUNK = 1 << 20


def timed(cmd: str) -> float:
    """Seconds ``cmd`` (a shell line) takes."""
    t = time.perf_counter()
    subprocess.run(cmd, shell=True, check=True)
    return time.perf_counter() - t


def fill(node: Node, every: int = 1) -> int:
    """A new file for ``node``: random data in 1 MiB of every ``every`` MiB of its data area
    (holes between; the metadata area blank, so the primary formats it at start); the bytes of
    data written."""
    node.file.unlink(missing_ok=True)
    written = 0
    with open(node.file, "wb") as f:
        f.truncate(node.device)
        for off in range(0, node.data, CHUNK * every):
            f.seek(off)
            f.write(os.urandom(min(CHUNK, node.data - off)))
            written += min(CHUNK, node.data - off)
    return written


def last_sync_rate(node: Node, seen: int) -> float:
    """MB/s of the last 'replica in sync' line the primary logged after byte ``seen`` of its log."""
    lines = [ln for ln in node.log.read_text()[seen:].splitlines() if "replica in sync" in ln]
    assert lines, node.log.read_text()[-2000:]
    return float(re.search(r"mb_per_s[\"=:\s]+([\d.]+)", lines[-1]).group(1))  # type: ignore[union-attr]


def logged_seconds(node: Node, seen: int) -> float:
    """The seconds of the last 'verify done' line the primary logged after byte ``seen``."""
    lines = [ln for ln in node.log.read_text()[seen:].splitlines() if "verify done" in ln]
    assert lines, node.log.read_text()[-2000:]
    return float(re.search(r"seconds[\"=:\s]+([\d.]+)", lines[-1]).group(1))  # type: ignore[union-attr]


def sync_once(primary: Node, replica: Node) -> float:
    """Start the replica (blank) and the primary; MB/s of the full sync it gets."""
    seen = primary.log.stat().st_size if primary.log.exists() else 0
    replica.start()
    primary.start([replica], nqn=NQN, resync_rate="64GiB")
    primary.wait_states(all_in_sync(), timeout=900)
    return last_sync_rate(primary, seen)


async def dirty(primary: Node, every: int) -> int:
    """Rewrite 1 MiB of every ``every`` MiB of the data area; the bytes written."""
    ctrl = await connect(primary)
    chunk, n = os.urandom(CHUNK), 0
    for off in range(0, primary.data - CHUNK + 1, CHUNK * every):
        await ctrl.write_bytes(1, off, chunk)
        n += CHUNK
    await ctrl.close()
    return n


async def fabric_read(node: Node, length: int) -> float:
    """Seconds to read ``length`` bytes of ``node``'s namespace over NVMe/TCP with the host
    library, in 8 MiB reads two at once (as a verify reads a replica)."""
    ns = await open_remote("tcp", "127.0.0.1", node.port, RNQN, 1, None, 30.0)
    unit = 8 << 20
    free: asyncio.Queue[bytearray] = asyncio.Queue()
    for _ in range(2):
        free.put_nowait(bytearray(unit))

    async def one(off: int, buf: bytearray) -> None:
        await ns.read_into(off, memoryview(buf)[:min(unit, length - off)])
        free.put_nowait(buf)
    t = time.perf_counter()
    reads = [asyncio.ensure_future(one(off, await free.get())) for off in range(0, length, unit)]
    await asyncio.gather(*reads)
    seconds = time.perf_counter() - t
    await ns.close()
    return seconds


def ratio_line(name: str, runs: list[float], peers: list[float], peer: str) -> str:
    ratios = [r / p for r, p in zip(runs, peers)]
    return (f"| {name} | {' / '.join(f'{r:.0f}' for r in runs)} | {peer} {' / '.join(f'{p:.0f}' for p in peers)} | "
            f"{' / '.join(f'{x:.2f}' for x in ratios)} | {statistics.median(ratios):.2f} |")


def replicated(base: Path, size: int) -> dict[str, float]:
    """One pass of the blockd figures (with ``nodes.BIN``'s blockd), MB/s each: full sync,
    bitmap resync, verify, then the full sync of a sparse volume."""
    primary, replica = Node(base, "p", size), Node(base, "r", size)
    fill(primary)
    replica.file.unlink(missing_ok=True)
    out: dict[str, float] = {}
    try:
        out["full"] = sync_once(primary, replica)
        # bitmap resync: the replica away while a quarter of the volume is rewritten
        replica.stop()
        dirty_bytes = asyncio.run(dirty(primary, 4))
        seen = primary.log.stat().st_size
        replica.start()
        primary.wait_states(all_in_sync(), timeout=900)
        out["bitmap"] = last_sync_rate(primary, seen)
        assert primary.replicas()[0]["resynced_bytes"] >= dirty_bytes
        seen = primary.log.stat().st_size
        res = primary.ctl("verify", NQN, "1")
        assert res.returncode == 0, res.stdout + res.stderr
        out["verify"] = primary.data / 1e6 / logged_seconds(primary, seen)
        out["fabric read both"] = primary.data / 1e6 / (timed(f"cat {primary.file} > /dev/null")
                                                        + asyncio.run(fabric_read(replica, primary.data)))
    finally:
        primary.stop()
        replica.stop()
    for f in (primary.log, replica.log, replica.file):
        f.unlink(missing_ok=True)
    fill(primary, every=4)  # a sparse volume: a quarter data
    try:
        out["sparse"] = sync_once(primary, replica)
    finally:
        primary.stop()
        replica.stop()
    for f in (primary.file, replica.file, primary.log, replica.log):
        f.unlink(missing_ok=True)
    return out


def peers(base: Path, size: int) -> dict[str, float]:
    """The same data with the plain tools, MB/s each: cp + sync and dd of the full volume, cp +
    sync of the sparse one, and reading both copies of the full one."""
    primary, other = Node(base, "p", size), base / "other.img"
    copy = base / "copy.img"
    fill(primary)
    # the copies first, from the state the full sync starts in (the source just written, nothing
    # else of ours dirty). Timed after the second copy that "read both" reads, at 1 GiB the page
    # cache held 3 GiB of ours dirty, past the background write-back threshold (10 % of ~23 GB
    # here): cp+sync ran at 470-495 MB/s against 1262-1304 timed first (2026-12-08, 01:24 and
    # 01:32 UTC), and the full sync (2 GiB dirty) looked 2.6-3.1x cp+sync
    out = {"cp": size / 1e6 / timed(f"cp {primary.file} {copy} && sync {copy}")}
    copy.unlink()
    out["dd"] = size / 1e6 / timed(f"dd if={primary.file} of={copy} bs=1M conv=fdatasync status=none")
    copy.unlink()
    subprocess.run(["cp", primary.file, other], check=True)
    out["read both"] = size / 1e6 / timed(f"cat {primary.file} {other} > /dev/null")
    fill(primary, every=4)
    out["cp sparse"] = size / 1e6 / timed(f"cp {primary.file} {copy} && sync {copy}")
    for f in (copy, other, primary.file):
        f.unlink()
    return out


ROWS = (("full sync", "full", "cp+sync", "cp"), ("full sync", "full", "dd", "dd"),
        ("sparse full sync", "sparse", "cp+sync", "cp sparse"), ("bitmap resync", "bitmap", "cp+sync", "cp"),
        ("verify", "verify", "reading both", "read both"))
OWN_PEERS = (("verify", "verify", "cat + replica over NVMe/TCP", "fabric read both"),)
"""Rows whose peer is measured in the tree's own pass (right after its verify), not the tools'."""


def verify_pass(primary: Node, replica: Node, bin_dir: Path) -> tuple[float, str]:
    """Start the in-sync pair with ``bin_dir``'s blockd, verify it once, stop it: MB/s of the
    data area (the time from the primary's log) and how it compared (the result's ``method``;
    a tree without it read the data)."""
    nodes.BIN = bin_dir
    replica.start()
    primary.start([replica], nqn=NQN, resync_rate="64GiB")
    try:
        primary.wait_states(all_in_sync(), timeout=900)
        seen = primary.log.stat().st_size
        res = primary.ctl("verify", NQN, "1", "--json")
        assert res.returncode == 0, res.stdout + res.stderr
        method = json.loads(res.stdout)["replicas"][0].get("method", "read")
        return primary.data / 1e6 / logged_seconds(primary, seen), method
    finally:
        primary.stop()
        replica.stop()


def verify_only(base: Path, size: int, rounds: int, trees: dict[str, Path]) -> None:
    """``--verify-only``: see the module docstring."""
    primary, replica = Node(base, "p", size), Node(base, "r", size)
    fill(primary)
    replica.file.unlink(missing_ok=True)
    nodes.BIN = trees["this tree"]
    sync_once(primary, replica)
    primary.stop()
    replica.stop()
    steps = [*trees, "cat"]
    got: dict[str, list[float]] = {name: [] for name in steps}
    methods: dict[str, set[str]] = {name: set() for name in trees}
    for rnd in range(rounds):
        for name in steps if rnd % 2 == 0 else reversed(steps):
            if name == "cat":
                got[name].append(size / 1e6 / timed(f"cat {primary.file} {replica.file} > /dev/null"))
                continue
            rate, method = verify_pass(primary, replica, trees[name])
            got[name].append(rate)
            methods[name].add(method)
        print(f"round {rnd + 1}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in got.items()), flush=True)
    print(f"\n{size >> 20} MiB, {rounds} rounds, verify only; MB/s of the data area (verify) or of the volume "
          "(cat of both files: each file once, so MB/s of one copy); a ratio is a run over its round's peer\n")
    print("| tree | measured | runs MB/s | peer runs MB/s | ratio per run | median ratio |")
    print("|---|---|---|---|---|---|")
    for name in trees:
        label = f"verify ({', '.join(sorted(methods[name]))})"
        print(f"| {name} " + ratio_line(label, got[name], got["cat"], "cat of both files"))
    if "before" in trees:
        print("| this tree " + ratio_line(f"verify ({', '.join(sorted(methods['this tree']))})", got["this tree"],
                                          got["before"], "before's verify"))
    for f in (primary.file, replica.file, primary.log, replica.log):
        f.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="512MiB", help="device size (default 512MiB)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", help="directory of another tree's blockd and blockctl (e.g. main's "
                                         ".venv/bin), measured in the same rounds")
    parser.add_argument("--dir", help="where the files go (default: a new directory in $TMPDIR)")
    parser.add_argument("--verify-only", action="store_true", help="measure verify alone (see the docstring)")
    args = parser.parse_args()
    size = parse_size(args.size, "--size")
    trees = {"this tree": nodes.BIN, **({"before": Path(args.before)} if args.before else {})}
    if args.verify_only:
        with tempfile.TemporaryDirectory(prefix="blockd-bench-verify-", dir=args.dir) as tmp:
            verify_only(Path(tmp), size, args.rounds, trees)
        return
    got: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    tools: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="blockd-bench-resync-", dir=args.dir) as tmp:
        base = Path(tmp)
        for rnd in range(args.rounds):
            order = list(trees.items()) if rnd % 2 == 0 else list(reversed(trees.items()))
            for name, bin_dir in order[:1]:
                nodes.BIN = bin_dir
                got[name].append(replicated(base, size))
            tools.append(peers(base, size))
            for name, bin_dir in order[1:]:
                nodes.BIN = bin_dir
                got[name].append(replicated(base, size))
            print(f"round {rnd + 1}: " + "; ".join(f"{name} " + ", ".join(f"{k} {v:.0f}" for k, v in got[name][-1].items())
                                                  for name in trees)
                  + "; tools " + ", ".join(f"{k} {v:.0f}" for k, v in tools[-1].items()), flush=True)
    print(f"\n{args.size}, {args.rounds} rounds; MB/s per run, of the data area (blockd) or the file (tools); "
          "a ratio is a run over its round's peer\n")
    print("| tree | measured | runs MB/s | peer runs MB/s | ratio per run | median ratio |")
    print("|---|---|---|---|---|---|")
    for name in trees:
        for label, key, peer_label, peer_key in ROWS:
            print(f"| {name} " + ratio_line(label, [r[key] for r in got[name]], [t[peer_key] for t in tools], peer_label))
        for label, key, peer_label, peer_key in OWN_PEERS:
            print(f"| {name} " + ratio_line(label, [r[key] for r in got[name]], [r[peer_key] for r in got[name]],
                                            peer_label))


if __name__ == "__main__":
    main()
