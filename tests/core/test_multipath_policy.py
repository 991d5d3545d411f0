"""The multipath I/O policies (issue 40), named as the Linux host's: numa (its default: here the
first usable path), round-robin and queue-depth, among the optimized paths and falling back to
the non-optimized ones; chosen per connection (``iopolicy``: blockctl connect, [[connection]])."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from blockd.config import ConfigError
from initiator.config import parse as parse_initiator_config
from initiator.params import ConnectParams, connect_params
from target.service import TargetService

from .conftest import NQN, run, until
from .test_multipath import BS, Pair, target_config


def both_optimized(tmp_path: Path) -> Pair:
    pair = Pair(tmp_path)
    pair.b = TargetService(target_config(pair.ports[1], pair.file, "optimized", (100, 199)))
    return pair


@pytest.mark.parametrize("iopolicy, concurrent, expected", [
    ("numa", False, (64, 0)),
    ("round-robin", False, (32, 32)),    # one at a time: each write the next path
    ("queue-depth", True, (32, 32)),     # 64 at once: each to the path with fewer in flight
    ("numa", True, (64, 0)),
])
def test_policies_spread_over_optimized_paths(tmp_path: Path, iopolicy: str, concurrent: bool,
                                               expected: tuple[int, int]) -> None:
    pair = both_optimized(tmp_path)

    async def main() -> None:
        await pair.start()
        mp = await pair.connect(iopolicy=iopolicy)
        try:
            assert mp.describe()["iopolicy"] == iopolicy
            if concurrent:
                await asyncio.gather(*(mp.write(1, i, bytes([i]) * BS) for i in range(64)))
            else:
                for i in range(64):
                    await mp.write(1, i, bytes([i]) * BS)
            assert (pair.writes(pair.a), pair.writes(pair.b)) == expected
            assert await mp.read(1, 0, 64) == b"".join(bytes([i]) * BS for i in range(64))
        finally:
            await mp.close()
            await pair.stop()
    run(main())


@pytest.mark.parametrize("iopolicy", ["round-robin", "queue-depth"])
def test_policies_prefer_optimized_then_fall_back(tmp_path: Path, iopolicy: str) -> None:
    """A non-optimized, B optimized: everything to B; B inaccessible: everything to A; both
    unusable: the writes wait for a path, then go to it."""
    pair = Pair(tmp_path)
    pair.a = TargetService(target_config(pair.ports[0], pair.file, "non-optimized", (1, 99)))
    pair.b = TargetService(target_config(pair.ports[1], pair.file, "optimized", (100, 199)))

    async def main() -> None:
        await pair.start()
        mp = await pair.connect(iopolicy=iopolicy)
        try:
            await asyncio.gather(*(mp.write(1, i, b"o" * BS) for i in range(16)))
            assert (pair.writes(pair.a), pair.writes(pair.b)) == (0, 16)
            await pair.b.op_ana_set("inaccessible")
            await until(lambda: mp.describe_paths()[1]["ana"] == {"1": "inaccessible"})
            await asyncio.gather(*(mp.write(1, i, b"n" * BS) for i in range(16)))
            assert (pair.writes(pair.a), pair.writes(pair.b)) == (16, 16)
            # no usable path: the writes wait (not fail) until one is back
            await pair.a.op_ana_set("inaccessible")
            await until(lambda: mp.describe_paths()[0]["ana"] == {"1": "inaccessible"})
            held = asyncio.gather(*(mp.write(1, i, b"h" * BS) for i in range(4)))
            await pair.b.op_ana_set("optimized")
            await asyncio.wait_for(held, 10)
            assert (pair.writes(pair.a), pair.writes(pair.b)) == (16, 20)
        finally:
            await mp.close()
            await pair.stop()
    run(main())


def test_iopolicy_is_a_connect_option() -> None:
    """The kernel's default; chosen per connection in a request or a [[connection]] table; an
    unknown one refused with a line naming the choices."""
    assert ConnectParams(traddr="x", subnqn=NQN).iopolicy == "numa"
    assert connect_params({"traddr": "x", "nqn": NQN, "iopolicy": "queue-depth"}).iopolicy == "queue-depth"
    with pytest.raises(ValueError, match="'iopolicy' must be numa or round-robin or queue-depth"):
        connect_params({"traddr": "x", "nqn": NQN, "iopolicy": "fastest"})
    cfg = parse_initiator_config({"connection": [{"nqn": NQN, "paths": ["127.0.0.1:4420", "127.0.0.1:4421"],
                                                  "iopolicy": "round-robin"}]})
    assert cfg.connections[0].connect_args()["iopolicy"] == "round-robin"
    with pytest.raises(ConfigError, match="iopolicy"):
        parse_initiator_config({"connection": [{"nqn": NQN, "traddr": "x", "iopolicy": "rr"}]})
