"""blockd.sdnotify against a real AF_UNIX datagram socket, and the daemons' notifications.

The daemon tests run `blockd target` / `blockd initiator` as subprocesses with NOTIFY_SOCKET
pointing at a socket of ours, i.e. exactly what systemd's Type=notify sees.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from blockd.sdnotify import Notifier

REPO = Path(__file__).resolve().parents[2]


class Listener:
    def __init__(self, address: str, bind_to: str | bytes) -> None:
        self.address = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(bind_to)
        self.sock.settimeout(0.05)
        self.pending: list[dict[str, str]] = []   # received, not yet consumed by wait_for

    def recv_all(self, timeout: float = 0.0) -> list[dict[str, str]]:
        out = []
        deadline = time.monotonic() + timeout
        while True:
            try:
                data = self.sock.recv(4096)
            except (TimeoutError, socket.timeout):
                if time.monotonic() >= deadline:
                    return out
                continue
            out.append(dict(line.split("=", 1) for line in data.decode().splitlines()))

    def wait_for(self, key: str, value: str | None = None, timeout: float = 30.0,
                 seen: list | None = None) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.pending += self.recv_all(0.1)
            while self.pending:
                msg = self.pending.pop(0)
                if seen is not None:
                    seen.append(msg)
                if key in msg and (value is None or msg[key] == value):
                    return msg
        raise AssertionError(f"no {key}={value or '*'} within {timeout}s (seen {seen})")

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def path_listener(tmp_path):
    p = str(tmp_path / "notify.sock")
    lst = Listener(p, p)
    yield lst
    lst.close()


@pytest.fixture
def abstract_listener():
    name = f"blockd-test-{uuid.uuid4().hex}"
    lst = Listener("@" + name, "\0" + name)
    yield lst
    lst.close()


def test_no_socket_is_a_noop(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    n = Notifier.from_env()
    assert not n.enabled
    assert n.ready("x") is False and n.watchdog() is False


@pytest.mark.parametrize("kind", ["path", "abstract"])
def test_messages(kind, request):
    lst = request.getfixturevalue(f"{kind}_listener")
    n = Notifier(lst.address)
    assert n.ready("exporting 1 subsystem")
    assert n.status("multi\nline")
    assert n.reloading()
    assert n.stopping()
    assert n.watchdog()
    msgs = lst.recv_all(0.5)
    assert msgs[0] == {"READY": "1", "STATUS": "exporting 1 subsystem"}
    assert msgs[1] == {"STATUS": "multi line"}
    assert msgs[2]["RELOADING"] == "1" and int(msgs[2]["MONOTONIC_USEC"]) > 0
    assert abs(int(msgs[2]["MONOTONIC_USEC"]) - time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000) < 5e6
    assert msgs[3]["STOPPING"] == "1"
    assert msgs[4] == {"WATCHDOG": "1"}
    n.close()


def test_from_env_and_unset(monkeypatch, path_listener):
    monkeypatch.setenv("NOTIFY_SOCKET", path_listener.address)
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    n = Notifier.from_env(unset=True)
    assert n.enabled and n.watchdog_usec == 2_000_000
    assert "NOTIFY_SOCKET" not in os.environ and "WATCHDOG_USEC" not in os.environ


def test_watchdog_pid_of_another_process_is_ignored(monkeypatch, path_listener):
    monkeypatch.setenv("NOTIFY_SOCKET", path_listener.address)
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    monkeypatch.setenv("WATCHDOG_PID", "1")
    assert Notifier.from_env().watchdog_usec is None


def test_send_error_is_not_fatal(tmp_path):
    n = Notifier(str(tmp_path / "nobody-listens"))
    assert n.ready() is False


def test_watchdog_pings_from_the_loop_and_stop_when_it_hangs(path_listener):
    n = Notifier(path_listener.address, watchdog_usec=100_000)   # ping every 50 ms

    async def main():
        n.start_watchdog()
        await asyncio.sleep(0.5)
        running = len(path_listener.recv_all(0.0))
        time.sleep(0.6)                 # the loop hangs: no pings may come meanwhile
        hung = len(path_listener.recv_all(0.0))
        await asyncio.sleep(0.3)
        n.stop_watchdog()
        return running, hung

    running, hung = asyncio.run(main())
    assert running >= 6, running         # ~10 expected
    assert hung <= 1, hung               # at most one queued before the hang


# -- the daemons ---------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _target_config(tmp_path: Path, port: int, nsids: list[int]) -> Path:
    text = (f'[[port]]\ntransport = "tcp"\naddress = "127.0.0.1"\nport = {port}\n\n'
            '[[subsystem]]\nnqn = "nqn.2026-11.io.blockd:sdtest"\nallow_any_host = true\n')
    for nsid in nsids:
        text += (f'\n[[subsystem.namespace]]\nnsid = {nsid}\npath = "{tmp_path}/ns{nsid}.img"\n'
                 'size = "1MiB"\n')
    cfg = tmp_path / "target.toml"
    cfg.write_text(text)
    return cfg


def _spawn(args: list[str], notify: str, tmp_path: Path, watchdog_usec: int | None = None):
    env = {**os.environ, "NOTIFY_SOCKET": notify, "PYTHONPATH": str(REPO)}
    if watchdog_usec:
        env["WATCHDOG_USEC"] = str(watchdog_usec)
    log = open(tmp_path / "daemon.log", "w")
    return subprocess.Popen([sys.executable, "-m", "blockd.cli.daemon", *args], env=env,
                            stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


def _log(tmp_path: Path) -> str:
    return (tmp_path / "daemon.log").read_text()


def test_target_ready_reload_stop(tmp_path, path_listener):
    port = _free_port()
    cfg = _target_config(tmp_path, port, [1])
    proc = _spawn(["target", "--config", str(cfg), "--log-format", "json"], path_listener.address,
                  tmp_path, watchdog_usec=400_000)
    try:
        seen: list = []
        ready = path_listener.wait_for("READY", "1", seen=seen)
        # READY=1 only once the port accepts: connect at once, no retry
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
        assert "1 subsystem(s), 1 namespace(s)" in ready["STATUS"]
        assert f"tcp://127.0.0.1:{port}" in ready["STATUS"]
        assert (tmp_path / "ns1.img").exists()
        path_listener.wait_for("WATCHDOG", "1", timeout=5)
        # reload adding a namespace: RELOADING=1, then READY=1 with the new status
        _target_config(tmp_path, port, [1, 2])
        proc.send_signal(signal.SIGHUP)
        path_listener.wait_for("RELOADING", "1", timeout=15)
        ready2 = path_listener.wait_for("READY", "1", timeout=15)
        assert "2 namespace(s)" in ready2["STATUS"], ready2
        proc.send_signal(signal.SIGTERM)
        path_listener.wait_for("STOPPING", "1", timeout=15)
        assert proc.wait(30) == 0, _log(tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_target_that_cannot_start_sends_no_ready(tmp_path, path_listener):
    port = _free_port()
    cfg = _target_config(tmp_path, port, [1])
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        proc = _spawn(["target", "--config", str(cfg)], path_listener.address, tmp_path)
        rc = proc.wait(60)
    msgs = path_listener.recv_all(0.2)
    assert rc == 1, _log(tmp_path)
    assert not any("READY" in m for m in msgs), msgs
    assert any(m.get("STATUS", "").startswith("cannot start") for m in msgs), msgs


def test_initiator_ready_then_boot_connections(tmp_path, path_listener):
    port = _free_port()
    sock = tmp_path / "initiator.sock"
    conf = tmp_path / "initiator.toml"
    conf.write_text(f'[[connection]]\nname = "v"\ntraddr = "127.0.0.1"\ntrsvcid = {port}\n'
                    'nqn = "nqn.2026-11.io.blockd:sdtest"\n')
    proc = _spawn(["initiator", "--socket", str(sock), "--config", str(conf)],
                  path_listener.address, tmp_path)
    target = None
    try:
        ready = path_listener.wait_for("READY", "1")
        assert sock.exists()                       # READY only once the socket listens
        assert ready["STATUS"] == "0/1 configured connection(s) up"
        # the target comes up later: the daemon keeps retrying and then connects
        cfg = _target_config(tmp_path, port, [1])
        target = subprocess.Popen([sys.executable, "-m", "blockd.cli.daemon", "target", "--config",
                                   str(cfg)], env={**os.environ, "PYTHONPATH": str(REPO)},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
        path_listener.wait_for("STATUS", "1/1 configured connection(s) up", timeout=60)
        out = subprocess.run([sys.executable, "-m", "blockd.cli.blockctl", "--socket", str(sock),
                              "list"], capture_output=True, text=True, cwd=REPO, timeout=30,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
        assert "v: tcp://127.0.0.1" in out.stdout and " live" in out.stdout, out
        proc.send_signal(signal.SIGTERM)
        path_listener.wait_for("STOPPING", "1", timeout=15)
        assert proc.wait(30) == 0, _log(tmp_path)
    finally:
        for p in (proc, target):
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
