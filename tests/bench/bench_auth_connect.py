"""Benchmark: what in-band authentication adds to connecting (admin queue + N I/O queues, each
queue authenticating on its own), our host against our target on loopback.

Run: ``.venv/bin/python tests/bench/bench_auth_connect.py [--rounds 10] [--io-queues 4]``

Prints the median connect time (Controller.connect to a live association, namespaces read)
without authentication, and with DH-HMAC-CHAP per hash/group, one way and both ways. Not a
test: the figures go to docs/security.md.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from target.config import parse  # noqa: E402
from blockd.dhchap_secret import generate_secret  # noqa: E402
from initiator.controller import ConnectParams, Controller  # noqa: E402
from target.service import TargetService  # noqa: E402
from tests.core.conftest import free_port  # noqa: E402

NQN = "nqn.2026-11.io.blockd:bench"
HOST = "nqn.2014-08.org.nvmexpress:uuid:bench000-0000-4000-8000-000000000000"
HOST_KEY = generate_secret(HOST, 1).encode()
CTRL_KEY = generate_secret(NQN, 1).encode()
CASES = [("none", None, None, False), ("sha256", "null", "sha256", False),
         ("sha256 ffdhe2048", "ffdhe2048", "sha256", False),
         ("sha512 ffdhe2048 both ways", "ffdhe2048", "sha512", True),
         ("sha512 ffdhe4096 both ways", "ffdhe4096", "sha512", True)]


async def one_case(path: str, group: str | None, hash_name: str | None, bidi: bool,
                   rounds: int, io_queues: int) -> float:
    port = free_port()
    sub = {"nqn": NQN, "namespace": [{"nsid": 1, "path": path, "size": 1 << 20}]}
    if group:
        entry = {"nqn": HOST, "dhchap_key": HOST_KEY, "dhchap_hashes": [hash_name],
                 "dhchap_dhgroups": [group]}
        if bidi:
            entry["dhchap_ctrl_key"] = CTRL_KEY
        sub["host_auth"] = [entry]
    cfg = parse({"port": [{"transport": "tcp", "address": "127.0.0.1", "port": port}],
                 "subsystem": [sub]}, "bench")
    service = TargetService(cfg)
    await service.start()
    times = []
    try:
        for _ in range(rounds):
            params = ConnectParams(traddr="127.0.0.1", trsvcid=port, subnqn=NQN, hostnqn=HOST,
                                   nr_io_queues=io_queues,
                                   dhchap_secret=HOST_KEY if group else None,
                                   dhchap_ctrl_secret=CTRL_KEY if bidi else None)
            t0 = time.perf_counter()
            ctrl = await Controller.connect(params)
            times.append(time.perf_counter() - t0)
            await ctrl.close()
    finally:
        await service.stop()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--io-queues", type=int, default=4)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "vol.img")
        for name, group, hash_name, bidi in CASES:
            t = asyncio.run(one_case(path, group, hash_name, bidi, a.rounds, a.io_queues))
            print(f"connect, {a.io_queues} I/O queues, auth {name:28s} {t * 1000:7.1f} ms (median of {a.rounds})")


if __name__ == "__main__":
    main()
