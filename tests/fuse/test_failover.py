"""Failover with ANA through the FUSE mount (issue 14): two ``blockd target`` processes export
the same file as one subsystem and namespace (same NQN, so the same derived NGUID; disjoint
controller id ranges), A optimized and B inaccessible. The initiator daemon connects to both
(``blockctl connect --path A --path B``) and mounts the volume; threads write random 4 KiB
blocks with O_DIRECT and log each write once it returned. A is killed with SIGKILL, B promoted
with ``blockctl target ana promote``: no write fails, and every logged write reads back. A path
whose target is down at connect time joins when that target starts; with every target down the
connect fails with one line."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from blockd_stack import NQN, REPO, Stack, free_port, tool, wait_tcp

BLOCK = 4096
SIZE = 16 << 20


def _config(dir: Path, name: str, port: int, backing: Path, state: str, cntlids: tuple[int, int]) -> Path:
    cfg = dir / f"{name}.toml"
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
nqn = "{NQN}"
serial = "BLOCKDFAILOVER01"
cntlid_min = {cntlids[0]}
cntlid_max = {cntlids[1]}

[[subsystem.namespace]]
nsid = 1
path = "{backing}"
size = {SIZE}
""")
    return cfg


class _Writer:
    """Threads writing random blocks with O_DIRECT; ``acked`` holds what each write returned."""

    def __init__(self, path: Path, jobs: int = 3) -> None:
        self.path = path
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
                offset = ((job * 997 + n * 7) % (SIZE // BLOCK)) * BLOCK
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

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)
        assert not any(t.is_alive() for t in self.threads), "a write never returned"


def _read_back(path: Path, acked: dict[int, bytes]) -> list[int]:
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


class _Pair:
    """Target A (``Stack``'s own, optimized, cntlids 1-99) and target B (inaccessible, cntlids
    100-199) on one file; B is started by :meth:`start_b`."""

    def __init__(self, tmp_path: Path) -> None:
        self.dir = tmp_path
        self.s = Stack(tmp_path, size=SIZE, ctrl_loss_tmo=30)
        self.backing = tmp_path / "vol.img"
        self.port_b = free_port()
        self.cfg_b = _config(tmp_path, "b", self.port_b, self.backing, "inaccessible", (100, 199))
        _config(tmp_path, "target", self.s.port, self.backing, "optimized", (1, 99))  # Stack.start_target's file
        self.b: subprocess.Popen | None = None

    def start_b(self) -> None:
        with open(self.dir / "b.log", "ab") as log:
            self.b = subprocess.Popen([tool("blockd"), "target", "--config", str(self.cfg_b)],
                                      stdout=log, stderr=log, cwd=REPO)
        wait_tcp(self.port_b, self.b)

    def connect(self) -> None:
        self.s.blockctl("connect", "-n", NQN, "--name", "vol", "-l", "30", "-i", "2",
                        "--path", f"127.0.0.1:{self.s.port}", "--path", f"127.0.0.1:{self.port_b}")

    def path_b(self, shown: str) -> str:
        return f"path tcp://127.0.0.1:{self.port_b} {shown}"

    def wait_listed(self, line: str, timeout: float = 20) -> str:
        deadline = time.monotonic() + timeout
        while line not in (listing := self.s.blockctl("list").stdout) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert line in listing, listing
        return listing

    def fail_over(self, writer: _Writer) -> None:
        """Kill A under ``writer``'s load, promote B; the writes go on without an error and
        every acknowledged one reads back, through the mount and from the file."""
        try:
            time.sleep(1.5)
            before_kill = writer.writes
            assert before_kill > 0 and not writer.errors
            self.s.stop_target(signal.SIGKILL)
            time.sleep(1.0)  # the writers wait: the only other path is inaccessible
            promote = subprocess.run([tool("blockctl"), "target", "--target-socket", str(self.dir / "b.sock"),
                                      "ana", "promote"], capture_output=True, text=True, timeout=30)
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
        assert _read_back(self.s.file, writer.acked) == []
        with open(self.backing, "rb") as f:  # and the file itself holds them
            for offset, data in writer.acked.items():
                f.seek(offset)
                assert f.read(BLOCK) == data

    def stop(self) -> None:
        self.s.stop()
        if self.b is not None and self.b.poll() is None:
            self.b.send_signal(signal.SIGTERM)
            self.b.wait(15)


def test_kill_primary_promote_standby_no_error(tmp_path: Path) -> None:
    pair = _Pair(tmp_path)
    s = pair.s
    try:
        s.start_target()
        pair.start_b()
        s.start_initiator()
        pair.connect()
        listing = s.blockctl("list").stdout
        assert f"path tcp://127.0.0.1:{s.port} cntlid 1 live: nsid 1 optimized" in listing, listing
        assert pair.path_b("cntlid 100 live: nsid 1 inaccessible") in listing, listing
        s.mount()
        pair.fail_over(_Writer(s.file))
    finally:
        pair.stop()


def test_a_path_down_at_connect_joins_when_its_target_starts(tmp_path: Path) -> None:
    """B is down when the host connects: the connect succeeds on A, ``blockctl list`` shows B
    connecting; B starts under a write load and joins (its ANA state read, inaccessible), the
    writes never stop; then A is killed and B promoted, and the load goes on through B."""
    pair = _Pair(tmp_path)
    s = pair.s
    try:
        s.start_target()
        s.start_initiator()
        pair.connect()
        listing = s.blockctl("list").stdout
        assert f"path tcp://127.0.0.1:{s.port} cntlid 1 live: nsid 1 optimized" in listing, listing
        assert pair.path_b("cntlid 0 connecting: no ANA state") in listing, listing
        assert " live, " in listing  # the connection itself
        s.mount()
        writer = _Writer(s.file)
        time.sleep(1.0)
        pair.start_b()
        pair.wait_listed(pair.path_b("cntlid 100 live: nsid 1 inaccessible"))
        assert not writer.errors, writer.errors
        pair.fail_over(writer)
        assert "connected after retrying" in s.log("initiator", 200)
    finally:
        pair.stop()


def test_connect_fails_in_one_line_when_no_path_connects(tmp_path: Path) -> None:
    s = Stack(tmp_path, size=SIZE)
    ports = free_port(), free_port()
    try:
        s.start_initiator()
        proc = s.blockctl("connect", "-n", NQN, "--name", "vol", "-l", "30",
                          *(arg for p in ports for arg in ("--path", f"127.0.0.1:{p}")), check=False)
        assert proc.returncode != 0
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr
        assert f"no path to {NQN} connects: 127.0.0.1:{ports[0]}: " in lines[0], lines
        assert f"; 127.0.0.1:{ports[1]}: " in lines[0], lines
        assert "Traceback" not in proc.stderr
        assert s.blockctl("list").stdout.strip() == "no connections"
    finally:
        s.stop()
