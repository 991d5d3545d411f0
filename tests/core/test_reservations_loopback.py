"""Reservations over loopback TCP: two hosts (distinct host identifiers) through the host library
against the target service (its compiled plane when built: a registration must take the
namespace off it), and ``blockctl resv-*`` through the real daemons, with PTPL across a SIGKILL of
the target."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from initiator import reservations
from initiator.errors import NvmeError
from protocol.reservation import AcquireAction, Cptpl, RegisterAction, ReleaseAction, ReservationType
from protocol.status import Status

from .conftest import NQN, config, connect, free_port, ns, run, serving, sub
from .test_cli import Env, one_line_error

HOST_A = "nqn.2014-08.org.example:host-a"
HOST_B = "nqn.2014-08.org.example:host-b"
WE = ReservationType.WRITE_EXCLUSIVE


def test_two_hosts_library_and_both_planes(tmp_path: Path) -> None:
    port = free_port()

    async def main() -> None:
        async with serving(config([port], [sub(namespaces=[ns(tmp_path / "v.img", size=1 << 20)])])) as service:
            namespace = service.target.subsystems[NQN].namespaces[1]
            a = await connect(port, hostnqn=HOST_A)
            b = await connect(port, hostnqn=HOST_B)
            try:
                block = b"\x11" * 512
                await b.write(1, 0, block)  # no reservation: the compiled plane, when built, serves it
                assert namespace.fast is None or namespace.fast.accessible
                await reservations.register(a, 1, RegisterAction.REGISTER, 0, 0xA)
                await reservations.register(b, 1, RegisterAction.REGISTER, 0, 0xB)
                await reservations.acquire(a, 1, AcquireAction.ACQUIRE, WE, 0xA)
                with pytest.raises(NvmeError) as refused:
                    await b.write(1, 0, block)
                assert refused.value.status == Status.RESERVATION_CONFLICT
                assert namespace.fast is None or not namespace.fast.accessible
                assert await b.read(1, 0, 1) == block  # write exclusive: others still read
                await a.write(1, 1, b"\x22" * 512)
                report = await reservations.report(b, 1)
                assert (report.rtype, report.generation, len(report.registrants)) == (WE, 2, 2)
                assert [(r.key, r.holds) for r in report.registrants] == [(0xA, True), (0xB, False)]
                assert report.registrants[0].hostid == a.params.hostid.bytes
                # B fences A: preempt and abort with A's key; now A's writes fail, B's succeed
                await reservations.acquire(b, 1, AcquireAction.PREEMPT_AND_ABORT, ReservationType.EXCLUSIVE_ACCESS,
                                           0xB, prkey=0xA)
                with pytest.raises(NvmeError) as fenced:
                    await a.write(1, 2, block)
                assert fenced.value.status == Status.RESERVATION_CONFLICT
                await b.write(1, 2, block)
                await reservations.release(b, 1, ReleaseAction.CLEAR, 0, 0xB)
                assert namespace.fast is None or namespace.fast.accessible  # back on the compiled plane
                await a.write(1, 3, block)
            finally:
                await a.close()
                await b.close()
    run(main())


def test_blockctl_verbs_and_ptpl_through_sigkill(tmp_path: Path) -> None:
    """The nvme-cli-like verbs end to end; with PTPL the registrations and the reservation are on
    disk when the command returns, so a target killed right after keeps them."""
    env = Env(tmp_path)
    try:
        env.start_target()
        env.start_initiator()
        for name, hostnqn in (("a", HOST_A), ("b", HOST_B)):
            env.ok("connect", "-t", "tcp", "-a", "127.0.0.1", "-s", str(env.port), "-n", NQN, "-q", hostnqn,
                   "--name", name)
        env.ok("resv-register", "a", "-n", "1", "-k", "0xa", "-p", str(int(Cptpl.SET)))
        env.ok("resv-register", "b", "-n", "1", "-k", "0xb")
        env.ok("resv-acquire", "a", "-n", "1", "-c", "0xa", "-t", "1")
        one_line_error(env.ctl("write", "b", "--offset", "0", "--length", "512", stdin=b"x" * 512),
                       "reservation_conflict")
        one_line_error(env.ctl("resv-acquire", "b", "-c", "0xbad", "-t", "1"), "reservation_conflict")
        one_line_error(env.ctl("resv-register", "a", "-k", "0"), "invalid_field")
        env.target.send_signal(signal.SIGKILL)
        env.target.wait()
        env.start_target()
        deadline = time.monotonic() + 30
        while True:  # the initiator daemon reconnects on its own
            res = env.ctl("resv-report", "b")
            if res.returncode == 0:
                break
            assert time.monotonic() < deadline, res.stderr.decode()
            time.sleep(0.2)
        out = res.stdout.decode()
        assert "rtype      : 1" in out and "regctl     : 2" in out and "ptpl       : 1" in out, out
        assert "rcsts 1" in out and "rkey 0xa" in out and "rkey 0xb" in out, out
        one_line_error(env.ctl("write", "b", "--offset", "0", "--length", "512", stdin=b"x" * 512),
                       "reservation_conflict")
        env.ok("resv-acquire", "b", "-c", "0xb", "-p", "0xa", "-t", "2", "-a", "2")
        one_line_error(env.ctl("read", "a", "--offset", "0", "--length", "512"), "reservation_conflict")
        env.ok("resv-release", "b", "-c", "0xb", "-t", "2")
        env.ok("write", "b", "--offset", "0", "--length", "512", stdin=b"y" * 512)
    finally:
        env.stop()
