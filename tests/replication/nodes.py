"""`blockd target` processes for the replication tests and benchmark: a :class:`Node` is one
target exporting a plain namespace (a replica) or a replicated one (a primary), with its
control socket, log and backing file; plus a host connection and a write load that records
what was acknowledged."""

from __future__ import annotations

import asyncio
import hashlib
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from initiator.control import ControlClient
from initiator.controller import ConnectParams, Controller
from protocol.replication import layout

BIN = Path(sys.executable).parent
NQN = "nqn.2026-11.io.blockd:mirror"
RNQN = "nqn.2026-11.io.blockd:copy"
HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:12121212-3434-5656-7878-909090909090"
DEVICE = 8 << 20
REGION = 64 << 10
DATA = layout(DEVICE, REGION, 4).data_size
"""What the replicated namespace exports: the device less its metadata (4 peer slots)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Endpoint(Protocol):
    """Where a primary reaches a replica: a :class:`Node`, or a proxy in front of one."""

    port: int


class Node:
    """One `blockd target` process: a plain namespace (a replica), or a replicated one."""

    def __init__(self, tmp: Path, name: str, device: int = DEVICE) -> None:
        self.tmp = tmp
        self.name = name
        self.device = device
        self.data = layout(device, REGION, 4).data_size
        self.port = free_port()
        self.file = tmp / f"{name}.img"
        self.sock = tmp / "run" / f"{name}.sock"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = tmp / f"{name}.log"
        self.cfg = tmp / f"{name}.toml"

    def config(self, nqn: str, replicas: Sequence[Endpoint], min_in_sync: int = 1,
               resync_rate: str = "1GiB", ns_keys: str = "") -> str:
        """The TOML: a plain namespace, or a replicated one over ``replicas`` (2 s timeout);
        ``ns_keys``: more lines of the namespace's table (``metadata_path = ...``)."""
        text = f"""
[control]
socket = "{self.sock}"

[[port]]
transport = "tcp"
address = "127.0.0.1"
port = {self.port}

[[subsystem]]
nqn = "{nqn}"
allow_any_host = true

[[subsystem.namespace]]
nsid = 1
path = "{self.file}"
size = {self.device}
"""
        if replicas:
            text += f"min_in_sync = {min_in_sync}\nresync_rate = \"{resync_rate}\"\n{ns_keys}"
        for r in replicas:
            text += f"""
[[subsystem.namespace.replica]]
address = "127.0.0.1"
port = {r.port}
nqn = "{RNQN}"
timeout = 2.0
"""
        return text

    def start(self, replicas: Sequence[Endpoint] | None = None, nqn: str | None = None, min_in_sync: int = 1,
              resync_rate: str = "1GiB", ns_keys: str = "") -> None:
        cfg = self.cfg
        cfg.write_text(self.config(nqn or (NQN if replicas else RNQN), replicas or [], min_in_sync, resync_rate,
                                   ns_keys))
        seen = self.log.stat().st_size if self.log.exists() else 0  # the log of earlier runs stays
        self.proc = subprocess.Popen([str(BIN / "blockd"), "target", "--config", str(cfg)],
                                     stdout=subprocess.DEVNULL, stderr=open(self.log, "ab"))
        deadline = time.monotonic() + 20
        while b"target ready" not in self.log.read_bytes()[seen:]:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, "target never became ready"
            time.sleep(0.05)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def ctl(self, *args: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([str(BIN / "blockctl"), "target", "--target-socket", str(self.sock), *args],
                              capture_output=True, timeout=60)

    def replicas(self) -> list[dict[str, Any]]:
        """The first namespace's replicas as ``blockctl target replicas --json`` shows them,
        asked on the control socket from this process (polled often: no blockctl per look)."""
        return self.namespace()["replicas"]

    def namespace(self) -> dict[str, Any]:
        """The first replicated namespace as ``blockctl target replicas --json`` shows it."""
        with ControlClient(str(self.sock), timeout=30, daemon="target") as client:
            return client.call({"op": "replicas"})["namespaces"][0]

    def counters(self) -> dict[str, Any]:
        """The first namespace's I/O counters (``ops``/``bytes`` by kind), as the control
        socket's ``counters`` shows them."""
        with ControlClient(str(self.sock), timeout=30, daemon="target") as client:
            return client.call({"op": "counters"})["namespaces"][0]

    def wait_states(self, want: Callable[[list[dict[str, Any]]], bool], timeout: float = 30.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            reps = self.replicas()
            if want(reps):
                return reps
            assert time.monotonic() < deadline, f"replica states never as wanted: {reps}"
            time.sleep(0.1)

    def data_hash(self) -> str:
        with open(self.file, "rb") as f:
            return hashlib.sha256(f.read(self.data)).hexdigest()


def all_in_sync(settled: bool = False) -> Callable[[list[dict[str, Any]]], bool]:
    """Every replica in sync (``settled``: and every write-intent bit cleared)."""
    return lambda reps: all(r["state"] == "in_sync" and (not settled or r["dirty_regions"] == 0) for r in reps)


async def connect(node: Node) -> Controller:
    return await Controller.connect(ConnectParams(traddr="127.0.0.1", trsvcid=node.port, subnqn=NQN, hostnqn=HOSTNQN,
                                                  ctrl_loss_tmo=0, command_timeout=10))


def block_of(seq: int) -> bytes:
    return hashlib.sha256(seq.to_bytes(8, "little")).digest() * 128  # 4 KiB, one per sequence number


async def load(ctrl: Controller, blocks: list[int], stop: asyncio.Event, acked: list[int],
               errors: list[BaseException], depth: int = 8, once: bool = False,
               latencies: list[float] | None = None) -> None:
    """Write ``block_of(seq)`` at block ``blocks[seq % len(blocks)]`` (4 KiB blocks) at queue
    depth ``depth`` until ``stop`` (``once``: or every block was written once, so that each
    holds its one write); ``acked`` gets every sequence number whose write completed, and
    ``latencies`` (if given) the seconds each took."""
    seq = 0

    async def worker() -> None:
        nonlocal seq
        while not stop.is_set() and not (once and seq >= len(blocks)):
            mine = seq
            seq += 1
            began = time.monotonic()
            try:
                await ctrl.write_bytes(1, blocks[mine % len(blocks)] * 4096, block_of(mine))
            except Exception as exc:  # the primary's death ends the load: recorded, not raised
                errors.append(exc)
                return
            if latencies is not None:
                latencies.append(time.monotonic() - began)
            acked.append(mine)
    await asyncio.gather(*(worker() for _ in range(depth)))
