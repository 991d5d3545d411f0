"""Reservations on a replicated pair (issue 38): the state travels to the standby in the
replication metadata on every change, and a host fenced on the primary stays fenced through the
standby once it is promoted (PTPL off: a failover is no power loss). The pair is
``test_roles``'s: two target services in one process, each the other's replica."""

from __future__ import annotations

from pathlib import Path

import pytest

from initiator import reservations
from initiator.errors import NvmeError
from protocol.reservation import AcquireAction, RegisterAction, ReservationType
from protocol.status import Status
from tests.core.conftest import connect, run

from blockd import dataplane
from target.replication import mirror as mirror_mod

from .test_roles import NQN, fast_links, in_sync, pair  # noqa: F401 (fast_links: an autouse fixture)

HOST_A = "nqn.2014-08.org.example:cluster-a"
HOST_B = "nqn.2014-08.org.example:cluster-b"


def test_a_fence_holds_after_failover_to_the_standby(tmp_path: Path) -> None:
    async def main() -> None:
        async with pair(tmp_path) as (a, b):
            await b.start("inaccessible")
            await a.start("optimized")
            await in_sync(a)
            port_a = a.ports[0]
            host_a = await connect(port_a, NQN, hostnqn=HOST_A)
            host_b = await connect(port_a, NQN, hostnqn=HOST_B)
            try:
                await reservations.register(host_a, 1, RegisterAction.REGISTER, 0, 0xA)
                await reservations.register(host_b, 1, RegisterAction.REGISTER, 0, 0xB)
                await reservations.acquire(host_a, 1, AcquireAction.ACQUIRE, ReservationType.WRITE_EXCLUSIVE, 0xA)
                # B fences A: A's registration is gone, B holds Exclusive Access
                await reservations.acquire(host_b, 1, AcquireAction.PREEMPT_AND_ABORT,
                                           ReservationType.EXCLUSIVE_ACCESS, 0xB, prkey=0xA)
                with pytest.raises(NvmeError) as fenced:
                    await host_a.write_bytes(1, 0, bytes(4096))
                assert fenced.value.status == Status.RESERVATION_CONFLICT
            finally:
                await host_a.close()
                await host_b.close()
            # failover: the primary goes away, the standby is promoted
            await a.stop()
            await b.ana("optimized", force=True)
            port_b = b.ports[1]
            host_a = await connect(port_b, NQN, hostnqn=HOST_A)
            host_b = await connect(port_b, NQN, hostnqn=HOST_B)
            try:
                with pytest.raises(NvmeError) as still:
                    await host_a.write_bytes(1, 0, bytes(4096))
                assert still.value.status == Status.RESERVATION_CONFLICT
                await host_b.write_bytes(1, 0, b"B" * 4096)
                report = await reservations.report(host_b, 1)
                assert report.rtype == ReservationType.EXCLUSIVE_ACCESS and not report.ptpl
                assert [(r.key, r.holds) for r in report.registrants] == [(0xB, True)]
                assert report.registrants[0].hostid == host_b.params.hostid.bytes
            finally:
                await host_a.close()
                await host_b.close()
    run(main())


def test_a_standby_that_was_down_gets_the_state_when_it_reconnects(tmp_path: Path) -> None:
    async def main() -> None:
        async with pair(tmp_path) as (a, b):
            await a.start("optimized")  # the standby is down while the reservation is taken
            host_a = await connect(a.ports[0], NQN, hostnqn=HOST_A)
            try:
                await reservations.register(host_a, 1, RegisterAction.REGISTER, 0, 0xA)
                await reservations.acquire(host_a, 1, AcquireAction.ACQUIRE, ReservationType.WRITE_EXCLUSIVE, 0xA)
            finally:
                await host_a.close()
            await b.start("inaccessible")
            await in_sync(a)
            await a.stop()
            await b.ana("optimized", force=True)
            host_b = await connect(b.ports[1], NQN, hostnqn=HOST_B)
            try:
                with pytest.raises(NvmeError) as refused:
                    await host_b.write_bytes(1, 0, bytes(4096))
                assert refused.value.status == Status.RESERVATION_CONFLICT
                report = await reservations.report(host_b, 1)
                assert report.rtype == ReservationType.WRITE_EXCLUSIVE and [r.key for r in report.registrants] == [0xA]
            finally:
                await host_b.close()
    run(main())


def test_the_compiled_lane_refuses_a_fenced_host_as_the_queue_does(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A replicated namespace's host writes may take the compiled lane (``_mirror_io.pyx``),
    which the reservation's withdrawal of the compiled plane (``fast.accessible``) does not
    reach: ``mirror_eligible`` must leave a reserved namespace's writes to the Python queue, which
    checks them. The region's write-intent bit is set by the holder's write first (sweeper slowed
    down), so the lane would take the fenced host's write if the rule let it; it took the
    holder's writes when nothing was registered (``compiled_writes``), where the plane is
    built. Found when issues 35 (the lane) and 38 (reservations) met in one merge."""
    monkeypatch.setattr(mirror_mod, "SWEEP_INTERVAL", 60.0)

    async def main() -> None:
        async with pair(tmp_path) as (a, b):
            await b.start("inaccessible")
            await a.start("optimized")
            await in_sync(a)
            host_a = await connect(a.ports[0], NQN, hostnqn=HOST_A)
            host_b = await connect(a.ports[0], NQN, hostnqn=HOST_B)
            try:
                for _ in range(2):  # the first sets the region's bit, the second may take the lane
                    await host_a.write_bytes(1, 0, b"a" * 4096)
                lane_before = a.backend.view()["compiled_writes"]
                await reservations.register(host_b, 1, RegisterAction.REGISTER, 0, 0xB)
                await reservations.acquire(host_b, 1, AcquireAction.ACQUIRE, ReservationType.WRITE_EXCLUSIVE, 0xB)
                await host_b.write_bytes(1, 0, b"B" * 4096)  # the holder writes: the bit stays set
                with pytest.raises(NvmeError) as fenced:
                    await host_a.write_bytes(1, 4096, b"A" * 4096)
                assert fenced.value.status == Status.RESERVATION_CONFLICT
                assert await host_b.read_bytes(1, 4096, 4096) == bytes(4096)  # nothing of A's landed
                assert a.backend.view()["compiled_writes"] == lane_before
                assert lane_before >= 1 or not dataplane.COMPILED  # the lane was there to refuse
            finally:
                await host_a.close()
                await host_b.close()
    run(main())
