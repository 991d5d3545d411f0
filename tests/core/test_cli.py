"""The real daemons and blockctl as subprocesses: `blockd target`, `blockd initiator`, `blockctl`."""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from target.tcp import TCP_IO_INLINE

from .conftest import HOSTNQN, NQN, NQN2, free_port

BIN = Path(sys.executable).parent
SIZE = 4 << 20


def target_toml(port: int, vol: Path, extra_ns: Path | None = None) -> str:
    text = f"""
[[port]]
transport = "tcp"
address = "127.0.0.1"
port = {port}

[[subsystem]]
nqn = "{NQN}"
serial = "CLITEST01"
model = "blockd cli test"

[[subsystem.namespace]]
nsid = 1
path = "{vol}"
size = "{SIZE}"

[[subsystem]]
nqn = "{NQN2}"
allow_any_host = false
hosts = ["nqn.2014-08.org.nvmexpress:uuid:someone-else"]

[[subsystem.namespace]]
nsid = 1
path = "{vol}.other"
size = "1MiB"
"""
    if extra_ns is not None:
        text = text.replace('\n[[subsystem]]\nnqn = "' + NQN2, f"""
[[subsystem.namespace]]
nsid = 2
path = "{extra_ns}"
size = "2MiB"
block_size = 4096

[[subsystem]]
nqn = "{NQN2}""", 1)
    return text


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else "exited"
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"port {port} never opened")


def wait_path(path: Path, proc: subprocess.Popen, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, "initiator daemon exited"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


class Env:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.vol = tmp / "vol.img"
        self.config = tmp / "target.toml"
        self.config.write_text(target_toml(self.port, self.vol))
        self.sock = tmp / "ctl" / "initiator.sock"
        self.target: subprocess.Popen | None = None
        self.initiator: subprocess.Popen | None = None

    def start_target(self) -> subprocess.Popen:
        self.target = subprocess.Popen([str(BIN / "blockd"), "target", "--config", str(self.config)],
                                       stdout=subprocess.DEVNULL, stderr=open(self.tmp / "target.log", "wb"))
        wait_port(self.port, self.target)
        return self.target

    def start_initiator(self) -> subprocess.Popen:
        self.initiator = subprocess.Popen([str(BIN / "blockd"), "initiator", "--socket", str(self.sock)],
                                          stdout=subprocess.DEVNULL, stderr=open(self.tmp / "initiator.log", "wb"))
        wait_path(self.sock, self.initiator)
        return self.initiator

    def ctl(self, *args: str, stdin: bytes | None = None, sock: Path | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "blockctl"), "--socket", str(sock or self.sock), *args],
                              input=stdin, capture_output=True, timeout=60)

    def ok(self, *args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
        res = self.ctl(*args, stdin=stdin)
        assert res.returncode == 0, (args, res.stderr.decode())
        return res

    def __enter__(self) -> "Env":
        """Both daemons started (the target first); a failed start stops what did start."""
        try:
            self.start_target()
            self.start_initiator()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        for proc in (self.initiator, self.target):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    with Env(tmp_path) as e:
        yield e


def one_line_error(res: subprocess.CompletedProcess, *needles: str) -> str:
    err = res.stderr.decode()
    assert res.returncode != 0, err
    assert "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    for n in needles:
        assert n.lower() in err.lower(), err
    return err


def test_blockctl_end_to_end(env: Env, tmp_path: Path) -> None:
    res = env.ok("discover", "-a", "127.0.0.1", "-s", str(env.port), "-q", HOSTNQN)
    out = res.stdout.decode()
    assert "Number of Records 2" in out and NQN in out and NQN2 not in out

    res = env.ok("connect", "-t", "tcp", "-a", "127.0.0.1", "-s", str(env.port), "-n", NQN,
                 "-q", HOSTNQN, "--name", "vol", "-i", "2")
    assert "connected vol" in res.stdout.decode() and "2 I/O queue(s)" in res.stdout.decode()
    out = env.ok("list").stdout.decode()
    assert "vol: tcp://127.0.0.1" in out and NQN in out and f"nsid 1: {SIZE} bytes, 512-byte blocks" in out

    rng = random.Random(3)
    pattern = rng.randbytes(3 << 20)  # above CHUNK: several control-socket chunks
    src = tmp_path / "pattern.bin"
    src.write_bytes(pattern)
    env.ok("write", "vol", "--nsid", "1", "--offset", "4096", "-i", str(src))
    back = env.ok("read", "vol", "--offset", "4096", "--length", str(len(pattern))).stdout
    assert back == pattern

    small = rng.randbytes(8 * 512)
    env.ok("write", NQN, "--start-block", "7000", "--block-count", "8", stdin=small)  # by NQN, from stdin
    dst = tmp_path / "out.bin"
    env.ok("read", "vol", "--start-block", "7000", "--block-count", "8", "-o", str(dst))
    assert dst.read_bytes() == small

    ident = env.ok("id-ctrl", "vol").stdout.decode()
    fields = dict(line.split(":", 1) for line in ident.splitlines())
    assert fields["subnqn    "].strip() == NQN and fields["sn        "].strip() == "CLITEST01"
    assert int(fields["cntlid    "]) >= 1 and int(fields["ioccsz    "]) == (64 + TCP_IO_INLINE) // 16
    idns = env.ok("id-ns", "vol", "-N", "1").stdout.decode()
    assert f"nsze      : {SIZE // 512}" in idns and "lbads:9" in idns

    env.ok("disconnect", "vol")
    assert "no connections" in env.ok("list").stdout.decode()
    data = env.vol.read_bytes()
    assert len(data) == SIZE
    assert data[4096:4096 + len(pattern)] == pattern and data[7000 * 512:7008 * 512] == small
    assert data[:4096] == bytes(4096) and data[7008 * 512:] == bytes(SIZE - 7008 * 512)


def test_blockctl_user_mistakes(env: Env, tmp_path: Path) -> None:
    base = ["-t", "tcp", "-a", "127.0.0.1", "-q", HOSTNQN]
    one_line_error(env.ctl("connect", *base, "-s", str(env.port), "-n", "nqn.2026-11.io.blockd:nope"),
                   "no subsystem")
    dead = free_port()
    one_line_error(env.ctl("connect", *base, "-s", str(dead), "-n", NQN), "cannot reach")
    one_line_error(env.ctl("discover", *base, "-s", str(dead)))
    one_line_error(env.ctl("connect", *base, "-s", str(env.port), "-n", NQN2), "not allowed")
    # multipath: -a or --path, not neither nor both; a bad path, or no path reachable, fails the connect
    one_line_error(env.ctl("connect", "-q", HOSTNQN, "-n", NQN), "-a, or every path with --path")
    one_line_error(env.ctl("connect", *base, "-n", NQN, "--path", f"127.0.0.1:{env.port}"), "--path")
    one_line_error(env.ctl("connect", "-q", HOSTNQN, "-n", NQN, "--path", "127.0.0.1:0"), "not 1..65535")
    one_line_error(env.ctl("connect", "-q", HOSTNQN, "-n", NQN, "--path", f"127.0.0.1:{dead}"),
                   f"no path to {NQN} connects: 127.0.0.1:{dead}: cannot reach")
    one_line_error(env.ctl("--socket", str(tmp_path / "nothing.sock"), "list"), "not running")
    one_line_error(env.ctl("list", sock=tmp_path / "nothing.sock"), "not running")
    one_line_error(env.ctl("read", "nosuch", "--length", "512"), "no connection")

    env.ok("connect", *base, "-s", str(env.port), "-n", NQN, "--name", "vol", "-i", "1")
    one_line_error(env.ctl("connect", *base, "-s", str(env.port), "-n", NQN, "--name", "vol"), "already exists")
    one_line_error(env.ctl("read", "vol", "--offset", str(SIZE - 512), "--length", "1024"), "beyond the end")
    one_line_error(env.ctl("read", "vol", "--start-block", str(SIZE // 512), "--block-count", "1"), "beyond")
    one_line_error(env.ctl("write", "vol", "--offset", "100", "--length", "512", stdin=b"x" * 512), "multiple")
    one_line_error(env.ctl("write", "vol", "--offset", "0", stdin=b"x" * 700), "multiple")
    one_line_error(env.ctl("read", "vol", "--offset", "0"), "--length")
    one_line_error(env.ctl("read", "vol", "-N", "9", "--length", "512"), "no namespace 9")
    one_line_error(env.ctl("write", "vol", "-i", str(tmp_path / "missing.bin")), "cannot open")
    one_line_error(env.ctl("id-ns", "vol", "-N", "5"))
    env.ok("disconnect", "vol")
    one_line_error(env.ctl("disconnect", "vol"), "no connection")
    assert env.vol.read_bytes() == bytes(SIZE)  # none of the mistakes wrote anything


@pytest.mark.parametrize("content, needle", [
    ("[[port]]\nport = 'x'\n", "port"),
    ("this is not toml", "target.toml"),
    ("[[subsystem]]\nnqn = 'bad nqn'\n", "nqn"),
    ("[[subsystem]]\nnqn = 'nqn.2026-11.io.blockd:x'\n[[subsystem.namespace]]\npath = '/x'\nsize = 'lots'\n", "size"),
    ("[[port]]\naddress = '127.0.0.1'\nfoo = 1\n", "unknown setting"),
])
def test_bad_config_file(tmp_path: Path, content: str, needle: str) -> None:
    cfg = tmp_path / "target.toml"
    cfg.write_text(content.replace("[[port]]\naddress", f"[[port]]\nport = {free_port()}\naddress"))
    res = subprocess.run([str(BIN / "blockd"), "target", "--config", str(cfg)], capture_output=True, timeout=30)
    assert res.returncode != 0
    err = res.stderr.decode()
    assert "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert needle.lower() in err.lower(), err


def test_unopenable_namespace_file(tmp_path: Path) -> None:
    """A namespace path that cannot be opened: one error line (the daemon also logs its stop)."""
    cfg = tmp_path / "target.toml"
    cfg.write_text(f"[[port]]\nport = {free_port()}\naddress = '127.0.0.1'\n[[subsystem]]\n"
                   "nqn = 'nqn.2026-11.io.blockd:x'\n[[subsystem.namespace]]\npath = '/nonexistent/dir/x.img'\n"
                   "size = '1MiB'\n")
    res = subprocess.run([str(BIN / "blockd"), "target", "--config", str(cfg)], capture_output=True, timeout=30)
    err = res.stderr.decode()
    assert res.returncode == 1 and "Traceback" not in err, err
    errors = [line for line in err.splitlines() if "[error" in line]
    assert len(errors) == 1 and "cannot open /nonexistent/dir/x.img" in errors[0], err


def test_missing_config_file(tmp_path: Path) -> None:
    res = subprocess.run([str(BIN / "blockd"), "target", "--config", str(tmp_path / "none.toml")],
                         capture_output=True, timeout=30)
    one_line_error(res, "cannot read")


def test_sighup_adds_namespace_and_sigterm_drains(env: Env, tmp_path: Path) -> None:
    base = ["-t", "tcp", "-a", "127.0.0.1", "-s", str(env.port), "-n", NQN, "-q", HOSTNQN, "-i", "1"]
    env.ok("connect", *base, "--name", "before")
    env.ok("write", "before", "--offset", "0", stdin=b"\x11" * 65536)
    extra = tmp_path / "extra.img"
    env.config.write_text(target_toml(env.port, env.vol, extra_ns=extra))
    env.target.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while not extra.exists():
        assert time.monotonic() < deadline, "reload did not create the new namespace"
        time.sleep(0.05)
    time.sleep(0.2)
    env.ok("connect", *base, "--name", "after")
    out = env.ok("list").stdout.decode()
    assert "nsid 2: 2097152 bytes, 4096-byte blocks" in out
    env.ok("write", "after", "-N", "2", "--start-block", "3", "--block-count", "1", stdin=b"\x22" * 4096)
    assert env.ok("read", "after", "-N", "2", "--start-block", "3", "--block-count", "1").stdout == b"\x22" * 4096
    # The host connected before the reload was not dropped.
    assert env.ok("read", "before", "--offset", "0", "--length", "65536").stdout == b"\x11" * 65536

    # A bad config on SIGHUP keeps the running configuration.
    env.config.write_text("garbage ][")
    env.target.send_signal(signal.SIGHUP)
    time.sleep(0.3)
    assert env.ok("read", "after", "-N", "2", "--start-block", "3", "--block-count", "1").stdout == b"\x22" * 4096

    env.target.send_signal(signal.SIGTERM)
    assert env.target.wait(20) == 0
    log = (tmp_path / "target.log").read_text()
    assert "target stopped" in log and "Traceback" not in log
    assert extra.read_bytes()[3 * 4096:4 * 4096] == b"\x22" * 4096
    assert env.vol.read_bytes()[:65536] == b"\x11" * 65536


def test_blockctl_loads_no_target_module_for_client_verbs() -> None:
    """blockctl's parser (target verbs included) imports nothing of ``target/``: those imports
    cost seconds per call in the VM bed (blockd/cli/targetctl.py, _TARGET_IMPORTS_ARE_LAZY)."""
    code = ("import sys, blockd.cli.blockctl as b; b._parser(); "
            "print(sorted(m for m in sys.modules if m == 'target' or m.startswith('target.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
