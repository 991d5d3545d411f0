"""A failover pair in one process: two target services, each with its own file, presenting one
subsystem (ANA), each naming the other as its replica through the other's standby subsystem.
The roles follow ANA: the inaccessible side is the secondary (it mirrors nothing, refuses host
writes, takes its primary's); a promotion is refused, with the reason, while this copy may lack
acknowledged writes, unless forced; every promotion starts a new generation; a demotion stops
the mirroring. The same with real processes, kill -9 and a FUSE mount:
tests/fuse/test_failover_pair.py."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

from blockd.control_socket import RequestError
from initiator.errors import NvmeError
from initiator.replica import open_remote
from protocol.replication import layout
from protocol.status import Status
from target.config import TargetConfig, parse
from target.replication import mirror as mirror_mod
from target.replication.link import IN_SYNC, SPLIT_BRAIN
from target.replication.mirror import ReplicatedBackend, ReplicationError
from target.service import TargetService
from tests.core.conftest import connect, free_port, run, until

NQN = "nqn.2026-11.io.blockd:pair"
STANDBY = "nqn.2026-11.io.blockd:pair-standby"
DEVICE = 4 << 20
REGION = 64 << 10
DATA = layout(DEVICE, REGION, 4).data_size


@pytest.fixture(autouse=True)
def fast_links(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mirror_mod, "RECONNECT_DELAY", 0.05)
    monkeypatch.setattr(mirror_mod, "SWEEP_INTERVAL", 0.05)


class Node:
    """One target service of the pair: ``me`` is 0 (A) or 1 (B)."""

    def __init__(self, tmp: Path, me: int, ports: list[int]) -> None:
        self.tmp, self.me, self.ports = tmp, me, ports
        self.file = tmp / f"{'ab'[me]}.img"
        self.service: TargetService | None = None

    def config(self, state: str, rate: int) -> TargetConfig:
        peer = 1 - self.me
        return parse({
            "port": [{"id": 1, "transport": "tcp", "address": "127.0.0.1", "port": self.ports[self.me]}],
            "control": {"socket": ""}, "ana": [] if state == "optimized" else [{"state": state}],
            "subsystem": [{"nqn": NQN, "serial": "BLOCKDPAIR01", "allow_any_host": True,
                           "cntlid_min": 1 + 100 * self.me, "cntlid_max": 99 + 100 * self.me,
                           "namespace": [{"nsid": 1, "path": str(self.file), "size": DEVICE, "standby_nqn": STANDBY,
                                          "resync_rate": rate, "replica": [
                                              {"address": "127.0.0.1", "port": self.ports[peer], "nqn": STANDBY,
                                               "timeout": 2.0}]}]}]}, "test")

    async def start(self, state: str, rate: int = 1 << 30) -> None:
        self.service = TargetService(self.config(state, rate), open_remote)
        await self.service.start()

    async def stop(self) -> None:
        if self.service is not None:
            await self.service.stop()
            self.service = None

    @property
    def backend(self) -> ReplicatedBackend:
        assert self.service is not None
        backend = self.service.target.subsystems[NQN].namespaces[1].backend
        assert isinstance(backend, ReplicatedBackend)
        return backend

    async def ana(self, state: str, force: bool = False) -> dict[str, Any]:
        assert self.service is not None
        return await self.service.op_ana_set(state, force=force)

    def data(self) -> bytes:
        with open(self.file, "rb") as f:
            return f.read(DATA)


@contextlib.asynccontextmanager
async def pair(tmp: Path) -> AsyncIterator[tuple[Node, Node]]:
    ports = [free_port(), free_port()]
    a, b = Node(tmp, 0, ports), Node(tmp, 1, ports)
    try:
        yield a, b
    finally:
        await a.stop()
        await b.stop()


async def in_sync(primary: Node, timeout: float = 20.0) -> None:
    await until(lambda: primary.backend.links[0].state == IN_SYNC, timeout)


async def host_write(node: Node, offset: int, data: bytes) -> None:
    ctrl = await connect(node.ports[node.me], NQN)
    try:
        await ctrl.write_bytes(1, offset, data)
    finally:
        await ctrl.close()


def test_roles_follow_ana_and_the_standby_takes_its_primarys_writes_only(tmp_path: Path) -> None:
    async def main() -> None:
        async with pair(tmp_path) as (a, b):
            await b.start("inaccessible")
            await a.start("optimized")
            assert a.backend.primary and not b.backend.primary
            assert not b.backend._tasks, "the standby runs links or a sweeper"
            await in_sync(a)
            await host_write(a, 3 * REGION, b"A" * 8192)
            assert b.data()[3 * REGION:3 * REGION + 8192] == b"A" * 8192  # mirrored before the ack
            assert a.data() == b.data()
            # the host-facing namespace exports the data area on both targets
            for node in (a, b):
                ctrl = await connect(node.ports[node.me], NQN)
                try:
                    assert ctrl.namespace(1).size == DATA
                    if node is b:  # the standby's path refuses I/O: 0x302
                        with pytest.raises(NvmeError) as err:
                            await ctrl.write_bytes(1, 0, bytes(4096))
                        assert err.value.status & 0x7FF == Status.ANA_INACCESSIBLE
                finally:
                    await ctrl.close()
            with pytest.raises(ReplicationError) as refused:  # and so does its backend, whatever the path
                await b.backend.write(0, bytes(4096))
            assert refused.value.status == Status.ANA_INACCESSIBLE
            # the primary's standby subsystem serves nobody
            ctrl = await connect(a.ports[0], STANDBY)
            try:
                with pytest.raises(NvmeError) as err:
                    await ctrl.read_bytes(1, 0, 4096)
                assert err.value.status & 0x7FF == Status.NS_NOT_READY
            finally:
                await ctrl.close()
            assert b.backend.view()["role"] == "secondary" and a.backend.view()["role"] == "primary"
    run(main())


def test_switch_over_demote_then_promote(tmp_path: Path) -> None:
    async def main() -> None:
        async with pair(tmp_path) as (a, b):
            await b.start("inaccessible")
            await a.start("optimized")
            await in_sync(a)
            with pytest.raises(RequestError, match="still the primary\\? demote it first"):
                await b.ana("optimized")
            assert not b.backend.primary
            await a.ana("inaccessible")  # demote: the mirroring stops, host writes are refused
            assert not a.backend.primary and a.backend.links[0].io is None and not a.backend._tasks
            with pytest.raises(ReplicationError):
                await a.backend.write(0, bytes(4096))
            before = b.backend.md.current
            await b.ana("optimized")
            assert b.backend.primary and b.backend.md.current != before and before in b.backend.md.history
            await in_sync(b)
            assert b.backend.links[0].copied_total == 0  # in sync already: nothing copied back
            await host_write(b, 5 * REGION, b"B" * 4096)
            assert a.data()[5 * REGION:5 * REGION + 4096] == b"B" * 4096
    run(main())


def test_promotion_refused_while_out_of_sync_unless_forced(tmp_path: Path) -> None:
    async def main() -> None:
        async with pair(tmp_path) as (a, b):
            await b.start("inaccessible")
            with pytest.raises(RequestError, match="never completed a first sync"):
                await b.ana("optimized")
            await a.start("optimized")
            await in_sync(a)
            await b.stop()
            await host_write(a, 0, bytes(range(256)) * (32 * REGION // 256))  # 32 regions B lacks
            await a.stop()
            await b.start("inaccessible")
            await a.start("optimized", rate=4 * REGION)  # a slow resync: 4 regions a second
            await until(lambda: (a.backend.links[0].progress is not None
                                 and a.backend.links[0].progress.copied >= 2 * REGION), 20)
            await a.stop()  # the resync is cut: B holds a mix of two generations
            with pytest.raises(RequestError, match="a resync into this copy is unfinished"):
                await b.ana("optimized")
            assert b.service is not None
            with pytest.raises(RuntimeError, match="not made primary .*unfinished"):  # nor by a reload
                await b.service.reload(b.config("optimized", 1 << 30))
            assert not b.backend.primary
            before = b.backend.md.current
            reply = await b.ana("optimized", force=True)
            assert reply["changed"] and b.backend.primary
            assert b.backend.md.current not in (before, 0)
    run(main())


def test_a_copy_behind_its_peer_is_not_promoted_and_a_forced_one_is_a_split_brain(tmp_path: Path) -> None:
    async def main() -> None:
        async with pair(tmp_path) as (a, b):
            await b.start("inaccessible")
            await a.start("optimized")
            await in_sync(a)
            await b.stop()
            await host_write(a, 0, b"A" * 4096)  # A goes on alone: a new generation B lacks
            await a.ana("inaccessible")
            await b.start("inaccessible")
            with pytest.raises(RequestError, match="has writes this node lacks"):
                await b.ana("optimized")
            await b.ana("optimized", force=True)
            await until(lambda: b.backend.links[0].state == SPLIT_BRAIN, 20)
            assert a.data()[:4096] == b"A" * 4096  # nothing overwritten
            with pytest.raises(RequestError, match="still the primary"):
                await a.ana("optimized")
            # and nothing can be: B copied nothing and hung up at the refusal, its link does not
            # connect again (only a resolve does), and A's standby subsystem has no controller left
            link = b.backend.links[0]
            assert link.io is None and link.copied_total == 0
            assert a.service is not None
            target_a = a.service.target
            await until(lambda: not [c for c in target_a.controllers.values() if c.subsystem.nqn == STANDBY])
            assert link.io is None and link.state == SPLIT_BRAIN
            assert a.data()[:4096] == b"A" * 4096
    run(main())
