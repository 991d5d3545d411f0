"""blockd under real systemd (PID 1 in the VM): the units of systemd/ as `blockctl install-units`
writes them.  Runs inside the VM booted with systemd (tests/vm/test_systemd.py, VM_SYSTEMD).

The tests form one sequence (start -> host writes -> reload -> kill -9 -> stop -> watchdog)
over one target; a host is the kernel's nvme-tcp (ctrl-loss-tmo -1: reconnects forever) and
the blockd initiator service holds a second connection.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .util import IN_VM, RESULTS, sh, tool

pytestmark = pytest.mark.skipif(not (IN_VM and os.path.isdir("/run/systemd/system")),
                                reason="needs the VM booted with systemd as PID 1")

NQN = "nqn.2026-11.io.blockd:sdvm"
PORT = 4420
ADDR = "127.0.0.1"
VOL1 = "/var/lib/blockd/vol1.img"
VOL2 = "/var/lib/blockd/vol2.img"
BLOCK = 64 << 10
STATE: dict = {}

WRITER = r'''
import mmap, os, sys
dev, first, count, seed, ack = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
B = 64 << 10
fd = os.open(dev, os.O_WRONLY | os.O_DIRECT)
buf = mmap.mmap(-1, B)
with open(ack, "a") as log:
    for i in range(first, first + count):
        buf.seek(0)
        tag = f"blk{i:08d}-seed{seed:04d}-".encode()
        buf.write((tag * (B // len(tag) + 1))[:B])
        os.pwrite(fd, buf, i * B)          # returns once the host acknowledged the write
        log.write(f"{i}\n"); log.flush()
os.close(fd)
'''


def pattern(i: int, seed: int) -> bytes:
    tag = f"blk{i:08d}-seed{seed:04d}-".encode()
    return (tag * (BLOCK // len(tag) + 1))[:BLOCK]


def target_toml(nsids: list[int]) -> str:
    text = (f'[logging]\nformat = "json"\n\n[[port]]\ntransport = "tcp"\naddress = "{ADDR}"\n'
            f'port = {PORT}\n\n[[subsystem]]\nnqn = "{NQN}"\nserial = "BLOCKDSD0001"\n'
            'allow_any_host = true\n')
    for nsid, (path, size) in {1: (VOL1, "64MiB"), 2: (VOL2, "32MiB")}.items():
        if nsid in nsids:
            text += f'\n[[subsystem.namespace]]\nnsid = {nsid}\npath = "{path}"\nsize = "{size}"\n'
    return text


def show(unit: str, *props: str) -> dict[str, str]:
    out = subprocess.run(["systemctl", "show", unit, *[f"-p{p}" for p in props]],
                         capture_output=True, text=True, check=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def wait_until(pred, timeout: float, what: str, step: float = 0.5):
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(step)


def journal(unit: str) -> list[dict]:
    out = subprocess.run(["journalctl", "-u", unit, "-o", "json", "--no-pager"],
                         capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def journal_events(unit: str) -> list[tuple[int, dict]]:
    """(monotonic usec, parsed JSON log line) of the daemon's structlog lines."""
    evs = []
    for e in journal(unit):
        msg = e.get("MESSAGE")
        if isinstance(msg, str) and msg.startswith("{"):
            try:
                evs.append((int(e["__MONOTONIC_TIMESTAMP"]), json.loads(msg)))
            except (ValueError, KeyError):
                pass
    return evs


def save_journal() -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    for unit in ("blockd-target", "blockd-initiator"):
        out = subprocess.run(["journalctl", "-u", unit, "--no-pager", "-o", "short-monotonic"],
                             capture_output=True, text=True).stdout
        (RESULTS / f"{unit}.journal.txt").write_text(out)


@pytest.fixture(scope="module", autouse=True)
def installed():
    sh(f"{tool('blockctl')} install-units")
    os.makedirs("/etc/blockd", exist_ok=True)
    Path("/etc/blockd/target.toml").write_text(target_toml([1]))
    yield
    save_journal()
    sh("systemctl stop blockd-initiator blockd-target || true; "
       f"nvmeh_disconnect {NQN} || true", check=False)


def test_start_active_only_when_listening():
    t0 = time.monotonic()
    sh("systemctl start blockd-target", timeout=120)
    # the start job finished: the port must accept right now, without any retry
    with socket.create_connection((ADDR, PORT), timeout=5):
        pass
    print(f"systemctl start took {time.monotonic() - t0:.1f}s")
    p = show("blockd-target", "ActiveState", "SubState", "Type", "StatusText", "MainPID",
             "ActiveEnterTimestampMonotonic", "ExecMainStartTimestampMonotonic", "NRestarts")
    print(p)
    STATE["pid"] = int(p["MainPID"])  # later tests need it even if a check below fails
    assert p["ActiveState"] == "active" and p["SubState"] == "running" and p["Type"] == "notify"
    assert "1 subsystem(s), 1 namespace(s)" in p["StatusText"] and f"{ADDR}:{PORT}" in p["StatusText"]
    # the daemon logged "target ready" (after every listen()) after it started. The proof that
    # the unit went active only once the port listened is the immediate connect above: the
    # journal stamps stdout lines when journald reads them, which can be after the READY=1
    # datagram (seen: 22 ms late), so the journal cannot order the two.
    ready = [ts for ts, ev in journal_events("blockd-target") if ev.get("event") == "target ready"]
    assert ready, "no 'target ready' JSON line in the journal"
    active_at = int(p["ActiveEnterTimestampMonotonic"])
    assert int(p["ExecMainStartTimestampMonotonic"]) < min(ready[0], active_at), (ready, p)
    print(f"process start -> ready log {(ready[0] - int(p['ExecMainStartTimestampMonotonic'])) / 1e6:.2f}s, "
          f"ready log -> active {(active_at - ready[0]) / 1e6:.3f}s")
    assert os.path.getsize(VOL1) == 64 << 20
    # hardening as applied: only CAP_IPC_LOCK in the bounding set, NoNewPrivs
    status = Path(f"/proc/{STATE['pid']}/status").read_text()
    capbnd = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("CapBnd")), 16)
    assert capbnd == 1 << 14, hex(capbnd)          # CAP_IPC_LOCK = 14
    assert "NoNewPrivs:\t1" in status


def test_hosts_connect_and_write():
    dev = sh(f"nvmeh_connect tcp {ADDR} {PORT} {NQN} --ctrl-loss-tmo=-1 --reconnect-delay=1",
             timeout=120).strip().splitlines()[-1]
    STATE["dev"] = dev
    STATE["ctrl"] = sh(f"nvmeh_ctrl {NQN}").strip()
    ack = RESULTS / "ack-a.txt"
    ack.unlink(missing_ok=True)
    subprocess.run([sys.executable, "-c", WRITER, dev, "0", "64", "1", str(ack)], check=True,
                   timeout=120)
    got = sh(f"dd if={dev} bs={BLOCK} count=64 iflag=direct status=none | sha256sum")
    want = __import__("hashlib").sha256(b"".join(pattern(i, 1) for i in range(64))).hexdigest()
    assert got.split()[0] == want
    # the blockd initiator service holds a second connection from /etc/blockd/initiator.toml
    Path("/etc/blockd/initiator.toml").write_text(
        f'[[connection]]\nname = "sdvm"\ntraddr = "{ADDR}"\ntrsvcid = {PORT}\nnqn = "{NQN}"\n'
        'nr_io_queues = 1\n')
    sh("systemctl start blockd-initiator", timeout=120)
    wait_until(lambda: "1/1" in show("blockd-initiator", "StatusText")["StatusText"], 60,
               "the initiator's boot connection")
    out = sh(f"{tool('blockctl')} list")
    assert "sdvm: tcp://127.0.0.1:4420" in out and " live" in out
    sh(f"head -c 65536 /dev/urandom > /tmp/i.bin; {tool('blockctl')} write sdvm --offset {100 * BLOCK} "
       f"-i /tmp/i.bin; {tool('blockctl')} read sdvm --offset {100 * BLOCK} --length 65536 -o /tmp/o.bin; "
       "cmp /tmp/i.bin /tmp/o.bin")


def test_reload_adds_namespace_host_sees_it():
    ctrl = STATE["ctrl"]
    Path("/etc/blockd/target.toml").write_text(target_toml([1, 2]))
    sh("systemctl reload blockd-target", timeout=60)
    wait_until(lambda: "2 namespace(s)" in show("blockd-target", "StatusText")["StatusText"], 30,
               "STATUS= with 2 namespaces")
    # the kernel host learns it from the namespace-attribute-changed AEN and rescans
    dev2 = wait_until(lambda: sh(f"ls /sys/class/nvme/{ctrl}/ | grep -E '^nvme[0-9]+(c[0-9]+)?n2$' || true")
                      .strip(), 60, "the new namespace on the kernel host")
    print("kernel host sees", dev2)
    p = show("blockd-target", "MainPID", "NRestarts", "ActiveState")
    assert int(p["MainPID"]) == STATE["pid"] and p["NRestarts"] == "0" and p["ActiveState"] == "active"
    assert sh(f"cat /sys/class/nvme/{ctrl}/state").strip() == "live"
    # blockd's initiator keeps its connection across the reload (it does not act on the
    # namespace AEN yet, so it is not asked to show nsid 2)
    assert " live" in sh(f"{tool('blockctl')} list")


def test_kill9_restarts_and_hosts_finish_io():
    dev, ctrl = STATE["dev"], STATE["ctrl"]
    ack = RESULTS / "ack-b.txt"
    ack.unlink(missing_ok=True)
    w = subprocess.Popen([sys.executable, "-c", WRITER, dev, "64", "256", "2", str(ack)])
    wait_until(lambda: ack.exists() and len(ack.read_text().split()) >= 32, 120, "32 acked writes")
    before = len(ack.read_text().split())
    old = STATE["pid"]
    sh(f"kill -9 {old}")
    p = wait_until(lambda: (lambda q: q if q["ActiveState"] == "active" and q["NRestarts"] == "1"
                            and int(q["MainPID"]) not in (0, old) else None)(
        show("blockd-target", "ActiveState", "NRestarts", "MainPID", "Result")), 90,
        "systemd to restart the target")
    print(f"restarted: {p}; writes acked before the kill: {before}")
    STATE["pid"] = int(p["MainPID"])
    assert w.wait(240) == 0
    acked = [int(x) for x in ack.read_text().split()]
    assert acked == list(range(64, 320))
    # The writer may finish before the kernel host even notices the kill (on a fast bed all 256
    # writes were acked within the 0.2 s the kill took: CI 2026-12-02, "connecting" seen here);
    # the host then reconnects after its reconnect delay (10 s by default): wait for that.
    wait_until(lambda: sh(f"cat /sys/class/nvme/{ctrl}/state", check=False).strip() == "live", 60,
               "the kernel host to reconnect to the restarted target")
    # every acknowledged write (before, across and after the crash) reads back intact
    got = sh(f"dd if={dev} bs={BLOCK} count=320 iflag=direct status=none | sha256sum").split()[0]
    want = __import__("hashlib").sha256(
        b"".join(pattern(i, 1) for i in range(64)) + b"".join(pattern(i, 2) for i in range(64, 320))
    ).hexdigest()
    assert got == want
    # the blockd initiator reconnected too
    wait_until(lambda: " live" in sh(f"{tool('blockctl')} list", check=False), 90,
               "the blockd initiator to reconnect")
    sh(f"{tool('blockctl')} read sdvm --offset {100 * BLOCK} --length 65536 -o /tmp/o2.bin; "
       f"dd if={dev} bs={BLOCK} skip=100 count=1 iflag=direct status=none | cmp - /tmp/o2.bin")


def test_stop_drains_flushes_exits_0():
    dev = STATE["dev"]
    ack = RESULTS / "ack-c.txt"
    ack.unlink(missing_ok=True)
    # the initiator service first (it would otherwise keep reconnecting to a stopped target)
    sh("systemctl stop blockd-initiator", timeout=60)
    w = subprocess.Popen([sys.executable, "-c", WRITER, dev, "320", "512", "3", str(ack)])
    wait_until(lambda: ack.exists() and len(ack.read_text().split()) >= 16, 120, "16 acked writes")
    t0 = time.monotonic()
    sh("systemctl stop blockd-target", timeout=120)
    print(f"systemctl stop took {time.monotonic() - t0:.1f}s")
    p = show("blockd-target", "ActiveState", "Result", "ExecMainCode", "ExecMainStatus")
    print(p)
    assert p["ActiveState"] == "inactive" and p["Result"] == "success"
    # Result=success: exited with status 0 (a signal gives "signal", exit 1 gives "exit-code")
    assert p["ExecMainStatus"] == "0"
    events = [ev.get("event") for _, ev in journal_events("blockd-target")]
    assert "stopping: draining in-flight I/O" in events and "target stopped" in events
    # the writer is now stuck reconnecting (ctrl-loss-tmo -1): take the host away
    sh(f"nvmeh_disconnect {NQN}", check=False, timeout=60)
    try:
        w.wait(60)
    except subprocess.TimeoutExpired:
        w.kill()
        w.wait()
    acked = [int(x) for x in ack.read_text().split()]
    print(f"{len(acked)} writes acknowledged in the last round")
    # every acknowledged write is in the volume file once the daemon has exited
    with open(VOL1, "rb") as f:
        for i in acked:
            f.seek(i * BLOCK)
            assert f.read(BLOCK) == pattern(i, 3), f"block {i} lost"
        for i in range(64, 320):
            f.seek(i * BLOCK)
            assert f.read(BLOCK) == pattern(i, 2), f"block {i} lost"


def test_watchdog_restarts_a_hung_daemon():
    os.makedirs("/run/systemd/system/blockd-target.service.d", exist_ok=True)
    Path("/run/systemd/system/blockd-target.service.d/wd.conf").write_text(
        "[Service]\nWatchdogSec=4s\nTimeoutAbortSec=2s\n")
    sh("systemctl daemon-reload; systemctl start blockd-target", timeout=120)
    old = int(show("blockd-target", "MainPID")["MainPID"])
    n0 = int(show("blockd-target", "NRestarts")["NRestarts"])
    time.sleep(6)       # pings keep it alive past WatchdogSec
    p = show("blockd-target", "MainPID", "ActiveState")
    assert int(p["MainPID"]) == old and p["ActiveState"] == "active", p
    sh(f"kill -STOP {old}")         # a hung event loop: no more pings
    p = wait_until(lambda: (lambda q: q if q["ActiveState"] == "active" and int(q["NRestarts"]) > n0
                            and int(q["MainPID"]) not in (0, old) else None)(
        show("blockd-target", "ActiveState", "NRestarts", "MainPID")), 90,
        "systemd to restart the hung target")
    print("restarted after watchdog:", p)
    # systemd's own "Watchdog timeout" line goes to the journal (or the console with
    # systemd.log_target=console); the restart of a process nobody killed is the evidence here
    log = subprocess.run(["journalctl", "-u", "blockd-target", "--no-pager", "-g", "Watchdog"],
                         capture_output=True, text=True).stdout
    print("journal:", log)
    os.unlink("/run/systemd/system/blockd-target.service.d/wd.conf")
    sh("systemctl daemon-reload; systemctl stop blockd-target", timeout=120)
