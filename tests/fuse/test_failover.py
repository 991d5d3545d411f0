"""Failover with ANA through the FUSE mount (issue 14): two ``blockd target`` processes export
the same file as one subsystem and namespace (same NQN, so the same derived NGUID; disjoint
controller id ranges), A optimized and B inaccessible. The initiator daemon connects to both
(``blockctl connect --path A --path B``) and mounts the volume; threads write random 4 KiB
blocks with O_DIRECT and log each write once it returned. A is killed with SIGKILL, B promoted
with ``blockctl target ana promote``: no write fails, and every logged write reads back."""

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


def test_kill_primary_promote_standby_no_error(tmp_path: Path) -> None:
    s = Stack(tmp_path, size=SIZE, ctrl_loss_tmo=30)
    backing = tmp_path / "vol.img"
    port_b = free_port()
    cfg_b = _config(tmp_path, "b", port_b, backing, "inaccessible", (100, 199))
    _config(tmp_path, "target", s.port, backing, "optimized", (1, 99))  # Stack.start_target's file
    b: subprocess.Popen | None = None
    try:
        s.start_target()
        with open(tmp_path / "b.log", "ab") as log:
            b = subprocess.Popen([tool("blockd"), "target", "--config", str(cfg_b)], stdout=log, stderr=log, cwd=REPO)
        wait_tcp(port_b, b)
        s.start_initiator()
        s.blockctl("connect", "-n", NQN, "--name", "vol", "-l", "30", "-i", "2",
                   "--path", f"127.0.0.1:{s.port}", "--path", f"127.0.0.1:{port_b}")
        listing = s.blockctl("list").stdout
        assert f"path tcp://127.0.0.1:{s.port} cntlid 1 live: nsid 1 optimized" in listing, listing
        assert f"path tcp://127.0.0.1:{port_b} cntlid 100 live: nsid 1 inaccessible" in listing, listing
        s.mount()

        writer = _Writer(s.file)
        try:
            time.sleep(1.5)
            before_kill = writer.writes
            assert before_kill > 0 and not writer.errors
            s.stop_target(signal.SIGKILL)
            time.sleep(1.0)  # the writers wait: the only other path is inaccessible
            promote = subprocess.run([tool("blockctl"), "target", "--target-socket", str(tmp_path / "b.sock"),
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
        listing = s.blockctl("list").stdout
        assert f"path tcp://127.0.0.1:{port_b} cntlid 100 live: nsid 1 optimized" in listing, listing
        assert _read_back(s.file, writer.acked) == []
        with open(backing, "rb") as f:  # and the file itself holds them
            for offset, data in writer.acked.items():
                f.seek(offset)
                assert f.read(BLOCK) == data
    finally:
        s.stop()
        if b is not None and b.poll() is None:
            b.send_signal(signal.SIGTERM)
            b.wait(15)
