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
