"""Two ``blockd target`` processes presenting one subsystem (ANA) to the initiator daemon, for
the failover tests: their configurations (one shared file, or a replicated pair, each target on
its own file), a write load that logs every acknowledged write, and the failover itself (kill
the primary, promote the standby)."""

from __future__ import annotations

import mmap
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from blockd_stack import NQN, REPO, Stack, free_port, tool, wait_tcp

from initiator.control import ControlClient

STANDBY = "nqn.2026-11.io.blockd:fuse-standby"
"""The standby subsystem of a replicated pair (the same NQN on both targets)."""
BLOCK = 4096
SIZE = 16 << 20


def target_config(dir: Path, name: str, port: int, backing: Path, state: str, cntlids: tuple[int, int],
                  peer_port: int | None = None, nqn: str = NQN, size: int = SIZE) -> Path:
    """One target of the pair (subsystem ``nqn``, namespace 1 of ``size`` bytes on
    ``backing``); with ``peer_port`` its namespace is replicated, the peer's standby subsystem
    (at that port) its replica, and its own is :data:`STANDBY`."""
    cfg = dir / f"{name}.toml"
    replicated = "" if peer_port is None else f"""standby_nqn = "{STANDBY}"
resync_rate = "1GiB"

[[subsystem.namespace.replica]]
address = "127.0.0.1"
port = {peer_port}
nqn = "{STANDBY}"
timeout = 2.0
"""
    cfg.write_text(f"""
[control]
socket = "{dir / (name + '.sock')}"

[[port]]
transport = "tcp"
address = "127.0.0.1"
port = {port}

[[ana]]
state = "{state}"

[[subsystem]]
nqn = "{nqn}"
serial = "BLOCKDFAILOVER01"
cntlid_min = {cntlids[0]}
cntlid_max = {cntlids[1]}

[[subsystem.namespace]]
nsid = 1
path = "{backing}"
size = {size}
{replicated}""")
    return cfg


class Writer:
    """Threads writing blocks with O_DIRECT among the first ``blocks`` blocks; ``acked`` holds
    what each write returned.

    Each thread owns the blocks ``b % jobs == job``: two threads writing one block at the same
    time leave it holding either write, whatever order their ``acked`` entries were made in, so
    shared blocks could fail the read-back of a correct target. (The replicated-pair test failed
    its read-back once in CI while the threads strode over the same 256 blocks; whether that was
    this race is not known, so the message now counts and names the blocks that differ.)"""

    def __init__(self, path: Path, jobs: int = 3, blocks: int = SIZE // BLOCK) -> None:
        self.path = path
        self.blocks = blocks
        self.jobs = jobs
        self.acked: dict[int, bytes] = {}
        """Offset -> the data of the last write there that returned."""
        self.writes = 0
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(j,)) for j in range(jobs)]
        for t in self.threads:
            t.start()

    def _run(self, job: int) -> None:
        buf = mmap.mmap(-1, BLOCK)
        fd = os.open(self.path, os.O_RDWR | os.O_DIRECT)
        try:
            n = 0
            while not self.stop.is_set():
                offset = (((job * 997 + n * 11) % (self.blocks // self.jobs)) * self.jobs + job) * BLOCK
                data = os.urandom(BLOCK)
                buf[:] = data
                try:
                    os.pwritev(fd, [buf], offset)
                except OSError as exc:
                    self.errors.append(f"write at {offset}: {exc}")
                    return
                self.acked[offset] = data
                self.writes += 1
                n += 1
        finally:
            os.close(fd)

    def wait_writes(self, n: int, timeout: float = 20) -> int:
        """Wait until ``n`` writes in all have returned (or one failed); the count."""
        deadline = time.monotonic() + timeout
        while self.writes < n and not self.errors and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.writes >= n and not self.errors, (self.writes, self.errors)
        return self.writes

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)
        assert not any(t.is_alive() for t in self.threads), "a write never returned"


def read_back(path: Path, acked: dict[int, bytes]) -> list[int]:
    buf = mmap.mmap(-1, BLOCK)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        wrong = []
        for offset, data in acked.items():
            os.preadv(fd, [buf], offset)
            if buf[:] != data:
                wrong.append(offset)
        return wrong
    finally:
        os.close(fd)


class Pair:
    """Target A (``Stack``'s own, optimized, cntlids 1-99) and target B (inaccessible, cntlids
    100-199) on one file, or (``replicated``) each on its own file, a replicated pair; B is
    started by :meth:`start_b`."""

    def __init__(self, tmp_path: Path, replicated: bool = False, start_timeout: float = 20.0,
                 ctrl_loss_tmo: float = 30) -> None:
        self.dir = tmp_path
        self.replicated = replicated
        self.s = Stack(tmp_path, size=SIZE, ctrl_loss_tmo=ctrl_loss_tmo, start_timeout=start_timeout)
        self.backing = tmp_path / "vol.img"
        self.backing_b = tmp_path / "b.img" if replicated else self.backing
        """B's file: the same as A's (shared storage), or its own copy."""
        self.port_b = free_port()
        self.cfg_b = target_config(tmp_path, "b", self.port_b, self.backing_b, "inaccessible", (100, 199),
                                   self.s.port if replicated else None)
        self.configure_a("optimized")
        self.b: subprocess.Popen | None = None

    def configure_a(self, state: str) -> None:
        """A's configuration (``Stack.start_target``'s file), in ANA state ``state``."""
        target_config(self.dir, "target", self.s.port, self.backing, state, (1, 99),
                      self.port_b if self.replicated else None)

    def start_b(self) -> None:
        with open(self.dir / "b.log", "ab") as log:
            self.b = subprocess.Popen([tool("blockd"), "target", "--config", str(self.cfg_b)],
                                      stdout=log, stderr=log, cwd=REPO)
        wait_tcp(self.port_b, self.b, self.s.start_timeout)

    def connect(self) -> None:
        self.s.blockctl("connect", "-n", NQN, "--name", "vol", "-l", str(self.s.ctrl_loss_tmo), "-i", "2",
                        "--path", f"127.0.0.1:{self.s.port}", "--path", f"127.0.0.1:{self.port_b}")

    def path_b(self, shown: str) -> str:
        return f"path tcp://127.0.0.1:{self.port_b} {shown}"

    def wait_listed(self, line: str, timeout: float = 20) -> str:
        """Wait until ``blockctl list`` shows ``line`` (``cntlid *``: any controller ID)."""
        pattern = re.compile(re.escape(line).replace(r"cntlid\ \*", r"cntlid\ \d+"))
        deadline = time.monotonic() + timeout
        while not pattern.search(listing := self.s.blockctl("list").stdout) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pattern.search(listing), listing
        return listing

    def fail_over(self, writer: Writer) -> None:
        """Kill A under ``writer``'s load, promote B; the writes go on without an error and
        every acknowledged one reads back, through the mount and from the file."""
        try:
            before_kill = writer.wait_writes(writer.writes + 50)  # under way, whatever the machine's speed
            self.s.stop_target(signal.SIGKILL)
            # the host has seen A go (the writers now wait: the only other path is inaccessible)
            self.wait_listed(f"path tcp://127.0.0.1:{self.s.port} cntlid 1 reconnecting")
            promote = self.target_ctl("b.sock", "ana", "promote")
            assert promote.returncode == 0, promote.stderr
            assert "now optimized" in promote.stdout
            deadline = time.monotonic() + 20
            while writer.writes < before_kill + 50 and time.monotonic() < deadline and not writer.errors:
                time.sleep(0.1)
        finally:
            writer.join()
        assert not writer.errors, writer.errors
        assert writer.writes >= before_kill + 50, "writes did not go on through the standby"
        self.wait_listed(self.path_b("cntlid 100 live: nsid 1 optimized"))
        wrong = read_back(self.s.file, writer.acked)
        assert wrong == [], f"{len(wrong)} of {len(writer.acked)} acknowledged blocks differ: {wrong[:8]}"
        with open(self.backing_b, "rb") as f:  # and B's file itself holds them
            for offset, data in writer.acked.items():
                f.seek(offset)
                assert f.read(BLOCK) == data

    def target_call(self, sock: str, request: dict[str, Any]) -> dict[str, Any]:
        """A request to A's (``target.sock``) or B's (``b.sock``) control socket, as ``blockctl
        target`` sends it, without its process (which takes seconds to start in the VM bed)."""
        with ControlClient(str(self.dir / sock), timeout=60, daemon="target") as client:
            return client.call(request)

    def replica_ns(self, sock: str) -> dict[str, Any]:
        """The replicated namespace as ``sock``'s target shows it: its role, its replica's state
        (``blockctl target replicas --json``)."""
        return self.target_call(sock, {"op": "replicas"})["namespaces"][0]

    def ana_set(self, sock: str, state: str) -> None:
        """Group 1's ANA state on every port of ``sock``'s target, as ``blockctl target ana
        promote`` (optimized) and ``demote`` (inaccessible) set it."""
        self.target_call(sock, {"op": "ana-set", "state": state, "group": 1, "port": None, "force": False})

    def wait_replica(self, sock: str, state: str, timeout: float = 60) -> dict[str, Any]:
        """Wait until the replica of ``sock``'s target (the primary) is in ``state``."""
        deadline = time.monotonic() + timeout
        while (ns := self.replica_ns(sock))["replicas"][0]["state"] != state:
            assert time.monotonic() < deadline, ns
            time.sleep(0.2)
        return ns

    def target_ctl(self, sock: str, *args: str) -> subprocess.CompletedProcess:
        """``blockctl target`` on A's (``target.sock``) or B's (``b.sock``) control socket."""
        return subprocess.run([tool("blockctl"), "target", "--target-socket", str(self.dir / sock), *args],
                              capture_output=True, text=True, timeout=60)

    def stop(self) -> None:
        self.s.stop()
        if self.b is not None and self.b.poll() is None:
            self.b.send_signal(signal.SIGTERM)
            self.b.wait(15)
