"""Reservations with the Linux kernel host as the judge, inside the VM (6.12 kernel): the kernel's
``nvme resv-*`` (nvme-cli) and the block layer's persistent reservation ioctls on the namespace's
block device, against ``blockd target``; blockd's own host is the other host.

Run from the host by tests/vm/test_resv.py (one boot for the file).
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import struct
import subprocess
import time
from pathlib import Path

import pytest

from initiator import reservations
from initiator.controller import ConnectParams, Controller
from initiator.errors import NvmeError
from protocol.reservation import AcquireAction, RegisterAction, ReleaseAction, ReservationType
from protocol.status import Status

from .util import ADDR0, RESULTS, sh, start_target

NQN = "nqn.2026-11.io.blockd:resv"
VOL = "/dev/shm/resv-vol.img"
KHOST = "nqn.2014-08.org.nvmexpress:uuid:cccccccc-0000-4000-8000-000000000001"
KHOSTID = "cccccccc-0000-4000-8000-000000000001"
OURHOST = "nqn.2014-08.org.example:blockd-cluster-node"

# linux/pr.h: _IOW('p', nr, struct); pr_registration and pr_preempt are 24 bytes, pr_reservation 16
_IOW = lambda nr, size: (1 << 30) | (size << 16) | (ord("p") << 8) | nr  # noqa: E731
IOC_PR_REGISTER, IOC_PR_RESERVE = _IOW(200, 24), _IOW(201, 16)
PR_WRITE_EXCLUSIVE = 1
PR_STS_RESERVATION_CONFLICT = 0x18


def _pr_ioctl(fd: int, request: int, arg: bytes) -> int:
    """The ioctl's return value (a PR_STS_* status, 0 for success): with a mutable buffer
    ``fcntl.ioctl`` returns it; with bytes it would return the buffer."""
    return fcntl.ioctl(fd, request, bytearray(arg), True)


def _target_toml() -> str:
    return f"""\
[[port]]
transport = "tcp"
address = "{ADDR0}"
port = 4420

[[subsystem]]
nqn = "{NQN}"

[[subsystem.namespace]]
nsid = 1
path = "{VOL}"
size = "16MiB"
"""


@pytest.fixture(scope="module")
def resv_target(rxe):
    RESULTS.mkdir(parents=True, exist_ok=True)
    cfg = RESULTS / "resv-target.toml"
    cfg.write_text(_target_toml())
    Path(VOL).unlink(missing_ok=True)
    Path(VOL + ".resv").unlink(missing_ok=True)
    d = start_target("blockd-resv-target", cfg)
    yield d
    d.stop()


@pytest.fixture
def khost(resv_target):
    """The kernel host connected (its own host NQN and host id): the block device's path."""
    dev = sh(f"nvmeh_connect tcp {ADDR0} 4420 {NQN} --hostnqn={KHOST} --hostid={KHOSTID}",
             timeout=120).strip().splitlines()[-1]
    try:
        yield dev
    finally:
        sh(f"nvmeh_disconnect {NQN}", check=False)


async def _our_host() -> Controller:
    return await Controller.connect(ConnectParams(traddr=ADDR0, trsvcid=4420, subnqn=NQN, hostnqn=OURHOST,
                                                  nr_io_queues=1, connect_timeout=30.0, command_timeout=30.0))


def _dd_write(dev: str, count: int = 1) -> subprocess.CompletedProcess:
    return subprocess.run(["dd", "if=/dev/zero", f"of={dev}", "bs=4096", f"count={count}", "oflag=direct",
                           "status=none"], capture_output=True, text=True, timeout=120)


def test_khost_nvme_resv_commands_and_conflicts(khost):
    dev = khost
    sh(f"nvme resv-register {dev} -n 1 -k 0xa1 -r 0")
    sh(f"nvme resv-acquire {dev} -n 1 -c 0xa1 -t 1 -a 0")

    async def ours() -> None:
        ctrl = await _our_host()
        try:
            await reservations.register(ctrl, 1, RegisterAction.REGISTER, 0, 0xB2)
            with pytest.raises(NvmeError) as refused:  # the kernel host holds Write Exclusive
                await ctrl.write_bytes(1, 0, bytes(4096))
            assert refused.value.status == Status.RESERVATION_CONFLICT
            report = await reservations.report(ctrl, 1)
            assert report.rtype == ReservationType.WRITE_EXCLUSIVE
            assert sorted((r.key, r.holds) for r in report.registrants) == [(0xA1, True), (0xB2, False)]
            kernel = next(r for r in report.registrants if r.key == 0xA1)
            assert kernel.hostid.hex() == KHOSTID.replace("-", "")  # Connect's HOSTID is the registrant
            # the kernel host releases; blockd's host takes Exclusive Access
            sh(f"nvme resv-release {dev} -n 1 -c 0xa1 -t 1 -a 0")
            await reservations.acquire(ctrl, 1, AcquireAction.ACQUIRE, ReservationType.EXCLUSIVE_ACCESS, 0xB2)
            await ctrl.write_bytes(1, 0, b"\xb2" * 4096)
        finally:
            await ctrl.close()
    asyncio.run(ours())

    res = _dd_write(dev)
    assert res.returncode != 0 and "Invalid exchange" in res.stderr, res  # EBADE, BLK_STS_RESV_CONFLICT
    out = sh(f"nvme resv-report {dev} -n 1 -e -o json")
    assert '"rtype":2' in out.replace(" ", "") and '"regctl":2' in out.replace(" ", ""), out

    async def clear() -> None:
        ctrl = await _our_host()
        try:
            await reservations.release(ctrl, 1, ReleaseAction.CLEAR, 0, 0xB2)
        finally:
            await ctrl.close()
    asyncio.run(clear())
    assert _dd_write(dev).returncode == 0


def _writes_completed(dev: str) -> int:
    """Writes the kernel counted as completed on ``dev`` (/sys/block/X/stat field 5)."""
    return int(Path(f"/sys/block/{os.path.basename(dev)}/stat").read_text().split()[4])


def test_ioctl_preempt_and_abort_fences_a_writer_mid_load(khost):
    dev = khost
    fd = os.open(dev, os.O_RDWR)
    try:
        assert _pr_ioctl(fd, IOC_PR_REGISTER, struct.pack("<QQII", 0, 0xC1, 0, 0)) == 0
        assert _pr_ioctl(fd, IOC_PR_RESERVE, struct.pack("<QII", 0xC1, PR_WRITE_EXCLUSIVE, 0)) == 0
    finally:
        os.close(fd)
    writer = subprocess.Popen(["dd", "if=/dev/zero", f"of={dev}", "bs=4096", "count=1000000", "oflag=direct"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        start = _writes_completed(dev)
        deadline = time.monotonic() + 60
        while _writes_completed(dev) < start + 50:  # the writer is under way
            assert writer.poll() is None, writer.communicate()
            assert time.monotonic() < deadline, "the writer wrote nothing"
            time.sleep(0.05)

        async def fence() -> None:
            ctrl = await _our_host()
            try:
                await reservations.register(ctrl, 1, RegisterAction.REGISTER, 0, 0xD4)
                with pytest.raises(NvmeError):
                    await ctrl.write_bytes(1, 1 << 20, b"\xd4" * 4096)  # the kernel host holds it
                await reservations.acquire(ctrl, 1, AcquireAction.PREEMPT_AND_ABORT,
                                           ReservationType.WRITE_EXCLUSIVE, 0xD4, prkey=0xC1)
                await ctrl.write_bytes(1, 1 << 20, b"\xd4" * 4096)
            finally:
                await ctrl.close()
        asyncio.run(fence())
        _, err = writer.communicate(timeout=120)
        assert writer.returncode != 0 and "Invalid exchange" in err, err
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    with open(VOL, "rb") as f:
        f.seek(1 << 20)
        assert f.read(4096) == b"\xd4" * 4096
    # the kernel host, preempted, is no registrant any more: its ioctl reserve is refused
    fd = os.open(dev, os.O_RDWR)
    try:
        assert _pr_ioctl(fd, IOC_PR_RESERVE, struct.pack("<QII", 0xC1, PR_WRITE_EXCLUSIVE, 0)) \
            == PR_STS_RESERVATION_CONFLICT
    finally:
        os.close(fd)
