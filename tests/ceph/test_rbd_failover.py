"""Two ``blockd target`` processes (gateways A and B) export one RBD image as one subsystem with
``failover = true``: A optimized, B inaccessible. blockd's multipath host writes through them.

- kill -9 of A: B sees A's lock without a watch, breaks it (blocklisting A), takes it, and only
  then goes optimized; no host write fails and every acknowledged one reads back.
- SIGSTOP of A (a zombie): a write sent to A while it sleeps, run by A once B has taken over and
  the host has written the same block through B, is refused by Ceph (A was blocklisted) and never
  lands. Without the fence (``rbd_blocklist_on_break_lock = false`` on B) it lands: this test
  then fails (docs/ceph.md)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

rados = pytest.importorskip("rados", reason="python3-rados is missing (scripts/setup.sh installs it)")
rbd = pytest.importorskip("rbd", reason="python3-rbd is missing (scripts/setup.sh installs it)")

from initiator.control import ControlClient
from initiator.controller import Controller
from initiator.errors import NvmeError, QueueLost
from initiator.multipath import MultipathController
from protocol.status import Status
from tests.ceph.cluster import Cluster
from tests.core.conftest import NQN, free_port, params, run, until
from tests.core.test_cli import wait_port

BIN = Path(sys.executable).parent
BS = 512
TAKEOVER_AFTER = 0.5


def gateway_toml(port: int, cluster: Cluster, image: str, state: str, cntlids: tuple[int, int], sock: Path) -> str:
    return f"""
[control]
socket = "{sock}"

[[port]]
transport = "tcp"
address = "127.0.0.1"
port = {port}

[[subsystem]]
nqn = "{NQN}"
allow_any_host = true
cntlid_min = {cntlids[0]}
cntlid_max = {cntlids[1]}

[[subsystem.namespace]]
nsid = 1
backend = "rbd"
path = "{cluster.pool}/{image}"
options = {{ conf = "{cluster.conf}", failover = true, takeover_after = {TAKEOVER_AFTER}, poll = 0.2 }}

[[ana]]
state = "{state}"
"""


class Gateway:
    """One ``blockd target`` process."""

    def __init__(self, tmp: Path, name: str, cluster: Cluster, image: str, state: str, cntlids: tuple[int, int]) -> None:
        self.port = free_port()
        self.sock = tmp / f"{name}.sock"
        self.config = tmp / f"{name}.toml"
        self.config.write_text(gateway_toml(self.port, cluster, image, state, cntlids, self.sock))
        self.log = tmp / f"{name}.log"
        self.proc = subprocess.Popen([str(BIN / "blockd"), "target", "--config", str(self.config)],
                                     stdout=subprocess.DEVNULL, stderr=open(self.log, "wb"))
        wait_port(self.port, self.proc, timeout=30)

    def ana(self) -> str:
        with ControlClient(str(self.sock), timeout=10, daemon="target") as client:
            return client.call({"op": "ana"})["ana"][0]["state"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def pair(ceph: Cluster, image: str, tmp_path: Path) -> Iterator[tuple[Gateway, Gateway]]:
    a = Gateway(tmp_path, "a", ceph, image, "optimized", (1, 99))
    b = None
    try:
        _wait(lambda: _owner(ceph, image) is not None, "A took the lock")
        b = Gateway(tmp_path, "b", ceph, image, "inaccessible", (100, 199))
        yield a, b
    finally:
        for g in (a, b):
            if g is not None:
                g.stop()


def _client(cluster: Cluster, image: str) -> tuple[Any, Any, Any]:
    r = rados.Rados(conffile=str(cluster.conf))
    r.conf_set("rbd_cache", "false")
    r.connect()
    io = r.open_ioctx(cluster.pool)
    return r, io, rbd.Image(io, image)  # lock_get_owners refuses a read-only handle (EINVAL)


def _owner(cluster: Cluster, image: str) -> str | None:
    r, io, img = _client(cluster, image)
    try:
        owners = list(img.lock_get_owners())
        return owners[0]["owner"] if owners else None
    finally:
        img.close()
        io.close()
        r.shutdown()


def _read_image(cluster: Cluster, image: str, offset: int, length: int) -> bytes:
    r, io, img = _client(cluster, image)
    try:
        return img.read(offset, length)
    finally:
        img.close()
        io.close()
        r.shutdown()


def _wait(cond: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.1)


def _blocklisted(cluster: Cluster, addr: str) -> bool:
    return addr in cluster.run("ceph", "osd", "blocklist", "ls")


async def _mp(pair: tuple[Gateway, Gateway]) -> MultipathController:
    return await MultipathController.connect([params(g.port, ctrl_loss_tmo=60.0, reconnect_delay=0.2)
                                              for g in pair])


def test_kill_9_of_the_active_gateway(ceph: Cluster, image: str, pair: tuple[Gateway, Gateway]) -> None:
    a, b = pair
    a_client = _owner(ceph, image)
    assert a_client is not None and b.ana() == "inaccessible"

    async def main() -> dict[int, bytes]:
        mp = await _mp(pair)
        acked: dict[int, bytes] = {}
        writes = [0]
        stop = asyncio.Event()

        async def writer(k: int) -> None:
            i = 0
            while not stop.is_set():
                lba = (k * 1000 + i) % 4096
                data = os.urandom(BS)
                await mp.write(1, lba, data)
                acked[lba] = data
                writes[0] += 1
                i += 1
        try:
            tasks = [asyncio.create_task(writer(k)) for k in range(4)]
            await until(lambda: writes[0] > 50, timeout=20)
            a.proc.kill()  # kill -9
            await asyncio.to_thread(a.proc.wait)
            before = writes[0]
            await until(lambda: writes[0] > before + 50, timeout=60)  # B took over, by itself
            stop.set()
            await asyncio.gather(*tasks)  # raises if any write failed
            for lba, data in acked.items():
                assert await mp.read(1, lba, 1) == data
            return acked
        finally:
            stop.set()
            await mp.close()

    acked = run(main(), timeout=120)
    assert b.ana() == "optimized"
    assert _owner(ceph, image) not in (None, a_client)  # B holds the lock now
    assert _blocklisted(ceph, a_client)  # A was fenced before B served
    lba, data = next(iter(acked.items()))
    assert _read_image(ceph, image, lba * BS, BS) == data


def test_a_zombie_gateways_write_never_lands(ceph: Cluster, image: str, pair: tuple[Gateway, Gateway]) -> None:
    a, b = pair
    lba = 123
    a_client = _owner(ceph, image)

    async def main() -> tuple[Any, bytes]:
        mp = await _mp(pair)
        zombie_path = await Controller.connect(params(a.port, ctrl_loss_tmo=0.0, keep_alive_tmo=0.0))
        try:
            await mp.write(1, lba, b"1" * BS)  # through A
            os.kill(a.proc.pid, signal.SIGSTOP)
            zombie = asyncio.create_task(zombie_path.write(1, lba, b"Z" * BS))  # waits in A's socket
            await asyncio.sleep(0)  # sent
            await until(lambda: b.ana() == "optimized", timeout=60)  # B fenced A, took the lock
            await mp.write(1, lba, b"B" * BS)  # through B
            os.kill(a.proc.pid, signal.SIGCONT)  # A wakes and runs the zombie write
            outcome: Any
            try:
                await asyncio.wait_for(zombie, 30)
                outcome = "completed"
            except (NvmeError, QueueLost) as exc:
                outcome = getattr(exc, "status", type(exc).__name__)
            await until(lambda: a.ana() == "inaccessible", timeout=30)  # A saw it was fenced
            return outcome, bytes(await mp.read(1, lba, 1))
        finally:
            await zombie_path.close()
            await mp.close()

    outcome, through_host = run(main(), timeout=180)
    assert _blocklisted(ceph, a_client)
    assert b"write failed" in a.log.read_bytes()  # A did try the zombie write, after B took over
    assert outcome == Status.ANA_INACCESSIBLE  # refused with a path status, not a medium error
    assert through_host == b"B" * BS
    assert _read_image(ceph, image, lba * BS, BS) == b"B" * BS  # the zombie's write never landed


def test_a_demoted_gateway_hands_the_image_over_without_a_fence(ceph: Cluster, image: str,
                                                                pair: tuple[Gateway, Gateway]) -> None:
    """``blockctl target ana demote`` on A: A releases the lock, B takes the ownerless lock by
    itself and goes optimized; A's client is not blocklisted (nothing to fence)."""
    a, b = pair
    a_client = _owner(ceph, image)
    with ControlClient(str(a.sock), timeout=10, daemon="target") as client:
        client.call({"op": "ana-set", "state": "inaccessible"})
    _wait(lambda: b.ana() == "optimized", "B took the released lock")
    assert _owner(ceph, image) not in (None, a_client)
    assert a.ana() == "inaccessible" and not _blocklisted(ceph, a_client)


def test_a_gateway_told_to_serve_while_another_lives_stays_inaccessible(
        ceph: Cluster, image: str, pair: tuple[Gateway, Gateway], tmp_path: Path) -> None:
    """A third gateway configured optimized on the image A holds: it cannot take the lock from a
    live owner, so it makes its group inaccessible rather than serve without it."""
    a, _ = pair
    a_client = _owner(ceph, image)
    c = Gateway(tmp_path, "c", ceph, image, "optimized", (200, 299))
    try:
        _wait(lambda: c.ana() == "inaccessible", "C gave up its group")
        assert _owner(ceph, image) == a_client and a.ana() == "optimized"
    finally:
        c.stop()
