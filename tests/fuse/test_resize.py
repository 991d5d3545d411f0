"""A namespace grown on the running target shows in the FUSE file without a reconnect: by a
config reload (SIGHUP to ``blockd target``) and by ``blockctl target resize``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from blockd_stack import NQN, Stack, tool

MIB = 1 << 20
TTL = 0.2
"""Seconds the kernel caches the file's attributes in these mounts."""


def _size_becomes(path: Path, size: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while os.stat(path).st_size != size:
        assert time.monotonic() < deadline, f"{path} is {os.stat(path).st_size} bytes, not {size}"
        time.sleep(0.05)


def _target_ctl(s: Stack, *args: str) -> str:
    return subprocess.run([tool("blockctl"), "target", "--target-socket", str(s.target_socket), *args],
                          capture_output=True, text=True, timeout=60, check=True).stdout


def _cntlids(s: Stack) -> list[int]:
    return [h["cntlid"] for h in json.loads(_target_ctl(s, "hosts", "--json"))["hosts"]]


def test_fuse_file_grows_by_reload_and_by_blockctl(tmp_path: Path) -> None:
    with Stack(tmp_path, size=16 * MIB, attr_ttl=TTL) as s:
        assert os.stat(s.file).st_size == 16 * MIB
        before = _cntlids(s)

        s.size = 32 * MIB
        s.write_config()
        s.target.send_signal(signal.SIGHUP)
        _size_becomes(s.file, 32 * MIB)
        with open(s.file, "r+b") as f:  # the new end is there to write and read back
            f.seek(30 * MIB)
            f.write(b"grown" * 100)
            f.flush()
            os.fsync(f.fileno())
            f.seek(30 * MIB)
            assert f.read(500) == b"grown" * 100

        os.truncate(s.backing, 48 * MIB)
        out = _target_ctl(s, "resize", NQN, "1")
        assert "32MiB -> 48MiB" in out
        _size_becomes(s.file, 48 * MIB)
        assert _cntlids(s) == before  # the same controller throughout: no reconnect
