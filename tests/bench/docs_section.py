"""Rewrite one runner's generated section of docs/benchmarks.md, leaving the rest as it is.

Each benchmark runner owns the text between its own BEGIN/END markers; the hand-written parts
of the file and the other runners' sections are never touched. One function for all the
runners (run_fuse_bench.py, run_rdma_bench.py, bench_initiator.py), so the three cannot drift
in how they find and replace their blocks.
"""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS_MD = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"


def write_section(begin: str, end: str, heading: str, generated: str, path: Path = BENCHMARKS_MD) -> None:
    """Put ``generated`` between ``begin`` and ``end`` in ``path``; where the markers are not there
    yet, append ``heading`` and the marked block at the end of the file."""
    block = f"{begin}\n{generated.rstrip()}\n{end}\n"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    head, found, rest = text.partition(begin)
    if found and end in rest:
        tail = rest.split(end, 1)[1].lstrip("\n")
        text = head + block + ("\n" + tail if tail else "")
    else:
        text = text.rstrip("\n") + f"\n\n{heading}\n\n{block}"
    path.write_text(text)
    print(f"wrote {path}", file=sys.stderr)
