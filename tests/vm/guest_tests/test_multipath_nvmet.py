"""blockd's host multipath judged by the Linux kernel's nvmet, then by a blockd replicated pair
(issue 40).

Inside the VM; run from the host by tests/vm/test_multipath_nvmet.py (one boot for the file).
Both cases: blockd's host connects to two paths of one subsystem (``blockctl connect --path
--path``), mounts the connection (FUSE), and fio writes with crc32c verify through the mount
(four jobs, each its own region, so up to four writes are in flight at each change; verified as
it goes, ``verify_backlog``) while the test changes the paths' ANA states. Each step waits for
the host to list the new state and for the load to go on (the connection's write count), not
for a time; fio is stopped (its trigger file) when the steps are done. fio must end without an
error; per path, the ANA-status retries must stay within one per change of that path, and
every ANA status the paths answered must be a retry or a command requeued with one (none
reached fio).

1. The kernel's nvmet exports the subsystem (a file) on two NVMe/TCP ports of 127.0.0.1; the
   ANA state of each port's group changes through configfs: optimized -> change ->
   inaccessible -> optimized on one port, the non-optimized pair swapped, the same on the
   other port, then a port removed and added again (its log read on the reconnect).
2. Two ``blockd target`` processes on loopback, A primary and B its replica (tests/fuse/
   failover.py's replicated pair): a planned switch-over (``blockctl target ana demote`` on A,
   ``promote`` on B, sent over their control sockets: a blockctl process takes seconds to start
   under TCG) and switch-back, then A killed with SIGKILL and B promoted, and A back as the
   standby, resynced from the bitmaps.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from initiator.control import ControlClient

from .util import REPO, RESULTS, Daemon, sh, tool, wait_path, wait_tcp

sys.path.insert(0, str(REPO / "tests" / "fuse"))
from failover import Pair  # noqa: E402  (the replicated pair's start-up, shared with the FUSE tests)

NQN = "nqn.2026-11.io.blockd:mp-nvmet"
ADDR = "127.0.0.1"
VOL = "/dev/shm/mp-nvmet.img"
SOCK = "/run/blockd/mp-initiator.sock"
MNT = "/tmp/mp-nvmet-mnt"
PORTS = {1: 4430, 2: 4431}
CFS = "/sys/kernel/config/nvmet"
ANA_CODES = {"ana_persistent_loss", "ana_inaccessible", "ana_transition"}


def _is_ana(label: str) -> bool:
    """An error label of the counters (blockd.iostats.status_label) that is an ANA status: its
    name, or its hex code when a bit (DNR) made it nameless."""
    if label in ANA_CODES:
        return True
    return label.startswith("0x") and 0x301 <= int(label, 16) & 0x7FF <= 0x303


def blockctl(*args: str, check: bool = True) -> str:
    return sh(" ".join([tool("blockctl"), "--socket", SOCK, *args]), check=check, timeout=120)


def set_ana(port: int, state: str) -> None:
    sh(f"echo {state} > {CFS}/ports/{port}/ana_groups/1/ana_state")


def connection(sock: str | Path, op: str = "list") -> dict[str, Any]:
    """The one connection of the initiator daemon at ``sock``, as ``op`` (list, counters) shows
    it. Asked over the control socket: a blockctl process takes seconds to start under TCG."""
    with ControlClient(str(sock)) as client:
        (conn,) = client.call({"op": op})["connections"]
    return conn


def path_shown(sock: str | Path, trsvcid: int) -> tuple[str, str]:
    """The path to port ``trsvcid`` as listed: its state and namespace 1's ANA state there."""
    (path,) = [p for p in connection(sock)["paths"] if p["trsvcid"] == trsvcid]
    return path["state"], path["ana"].get("1", "")


def wait_listed(sock: str | Path, trsvcid: int, *shown: tuple[str, str], timeout: float = 120) -> None:
    """Wait until the path to ``trsvcid`` is listed as one of ``shown`` ((state, ANA state))."""
    deadline = time.monotonic() + timeout
    while (now := path_shown(sock, trsvcid)) not in shown:
        assert time.monotonic() < deadline, f"path {trsvcid} shown {now}, never {shown}: {connection(sock)}"
        time.sleep(0.2)


class Fio:
    """fio writing 4 KiB blocks with crc32c verify through the mount until :meth:`stop`: four
    jobs at 10 writes/s each, each on its own 2 MiB region, every 16 writes read back and
    checked (``verify_backlog``), a bad block fatal."""

    def __init__(self, filename: str | Path, log: Path) -> None:
        self.log = log
        self.trigger = Path(f"/tmp/{log.stem}.stop")
        self.trigger.unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            ["fio", "--name=mp", f"--filename={filename}", "--rw=randwrite", "--bs=4k", "--size=2M",
             "--offset_increment=2M", "--numjobs=4", "--direct=1", "--ioengine=psync", "--rate_iops=,10",
             "--verify=crc32c", "--verify_backlog=16", "--verify_fatal=1", "--randrepeat=0",
             "--time_based", "--runtime=900", f"--trigger-file={self.trigger}"],
            stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd="/tmp")  # its verify state file: not the repo

    def running(self) -> None:
        assert self.proc.poll() is None, f"fio ended before the changes did:\n{self.log.read_text()}"

    def load_on(self, sock: str | Path, writes: int = 20, timeout: float = 60) -> None:
        """Wait until ``writes`` more writes went through the connection (the load goes on)."""
        target = connection(sock, "counters")["ops"]["write"] + writes
        deadline = time.monotonic() + timeout
        while connection(sock, "counters")["ops"]["write"] < target:
            self.running()
            assert time.monotonic() < deadline, f"the load stopped:\n{self.log.read_text()}"
            time.sleep(0.2)

    def stop(self) -> str:
        """Stop fio (its trigger file) and check its end: exit 0, no error, no bad block."""
        self.running()
        self.trigger.touch()
        rc = self.proc.wait(120)
        output = self.log.read_text()
        print(output)
        assert rc == 0 and "err= 0" in output, output
        assert not re.search(r"verify: bad|io_u error|Input/output error", output), output
        return output

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def retries_within_bound(sock: str | Path, changes: dict[int, int], record_property: Any) -> None:
    """Per path (its port), namespace 1's ANA-status retries at most ``changes[port]`` (the ANA
    changes made to that path: one retry per transition at most); every ANA status answered is
    a retry or a command requeued with one. The counts are recorded for the report."""
    conn = connection(sock)
    errors = connection(sock, "counters")["errors"]
    statuses = sum(n for label, n in errors.items() if _is_ana(label))
    retries = {p["trsvcid"]: p["ana_retries"].get("1", 0) for p in conn["paths"]}
    requeued = {p["trsvcid"]: p["ana_requeued"].get("1", 0) for p in conn["paths"]}
    record_property("ana_retries", str(retries))
    record_property("ana_requeued", str(requeued))
    record_property("path_retries", str(conn["path_retries"]))
    record_property("ana_statuses", str(statuses))
    record_property("errors", str(errors))
    assert all(retries[port] <= n for port, n in changes.items()), (retries, changes)
    assert sum(retries.values()) + sum(requeued.values()) == statuses, (retries, requeued, errors)


@pytest.fixture(scope="module")
def mounted(nvmet_module):
    os.makedirs(os.path.dirname(SOCK), exist_ok=True)
    os.makedirs(MNT, exist_ok=True)
    init = Daemon("mp-initiator", [tool("blockd"), "initiator", "--socket", SOCK])
    try:
        wait_path(SOCK, timeout=120, proc=init.proc, what="blockd initiator")
        blockctl("connect", "-n", NQN, "--name", "mp", "-l", "60", "-i", "2",
                 "--path", f"{ADDR}:{PORTS[1]}", "--path", f"{ADDR}:{PORTS[2]}")
        wait_listed(SOCK, PORTS[1], ("live", "optimized"))
        wait_listed(SOCK, PORTS[2], ("live", "non-optimized"))
        blockctl("mount", "mp", MNT)
        yield f"{MNT}/ns1"
    finally:
        blockctl("umount", MNT, check=False)
        blockctl("disconnect", "mp", check=False)
        init.stop()


@pytest.fixture(scope="module")
def nvmet_module():
    """One subsystem, namespace 1 on a file, on ports 1 and 2 of 127.0.0.1 (port 2's group
    non-optimized; loopback: no veth/rxe to set up)."""
    sh(f"nvmet_init && rm -f {VOL} && truncate -s 64M {VOL} && nvmet_subsys {NQN} MPNVMET01 && "
       f"nvmet_ns_file {NQN} 1 {VOL} && "
       f"nvmet_port 1 tcp {ADDR} {PORTS[1]} && nvmet_port 2 tcp {ADDR} {PORTS[2]} && "
       f"echo non-optimized > {CFS}/ports/2/ana_groups/1/ana_state && "
       f"nvmet_link 1 {NQN} && nvmet_link 2 {NQN}")
    for port in PORTS.values():
        wait_tcp(ADDR, port, timeout=60, what="kernel nvmet-tcp")
    yield
    sh("nvmet_teardown", check=False)


def test_our_host_follows_nvmet_ana_changes_under_fio_verify(mounted, record_property):
    steps = [
        (1, "change"), (1, "inaccessible"), (1, "optimized"),
        (2, "optimized"), (1, "non-optimized"),  # the non-optimized pair swapped (both optimized a moment)
        (2, "change"), (2, "inaccessible"), (2, "optimized"),
    ]
    fio = Fio(mounted, RESULTS / "mp-nvmet-fio.log")
    try:
        fio.load_on(SOCK)
        for port, state in steps:
            set_ana(port, state)
            print(f"port {port} -> {state}")
            wait_listed(SOCK, PORTS[port], ("live", state))
            fio.load_on(SOCK)  # load on the new state
        # port 1 removed, then added again: its path reconnects and reads its state anew
        sh(f"nvmet_unlink 1 {NQN}")
        wait_listed(SOCK, PORTS[1], ("reconnecting", "unknown"), ("live", "unknown"))
        fio.load_on(SOCK)
        sh(f"nvmet_link 1 {NQN}")
        wait_listed(SOCK, PORTS[1], ("live", "non-optimized"))
        fio.load_on(SOCK)
        fio.stop()
    finally:
        fio.kill()
    print(connection(SOCK))
    # one change per port takes a path in use out of use (optimized -> change): the others start
    # from a state that takes no I/O, or end in one that takes it (non-optimized, optimized)
    retries_within_bound(SOCK, {PORTS[1]: 1, PORTS[2]: 1}, record_property)


def test_our_host_follows_a_blockd_pair_under_fio_verify(tmp_path, record_property):
    """A (primary) and B (its replica) on loopback, one subsystem, two paths: planned
    switch-over and switch-back (demote, then promote) under load, then A killed with SIGKILL
    and B promoted, then A back as the standby (resynced): fio verify ends without error."""
    pair = Pair(tmp_path, replicated=True, start_timeout=120, ctrl_loss_tmo=120)  # A's restart is slow in TCG
    s = pair.s
    a, b = s.port, pair.port_b
    fio = None
    t0 = time.monotonic()

    def step(what: str) -> None:
        print(f"{time.monotonic() - t0:6.1f}s {what}", flush=True)

    def switch(demote: str, promote: str) -> None:
        pair.ana_set(demote, "inaccessible")  # blockctl target ana demote
        pair.ana_set(promote, "optimized")    # blockctl target ana promote

    try:
        pair.start_b()
        s.start_target()
        pair.wait_replica("target.sock", "in_sync")
        s.start_initiator()
        pair.connect()
        wait_listed(s.socket, a, ("live", "optimized"))
        wait_listed(s.socket, b, ("live", "inaccessible"))
        s.mount()
        step("mounted")
        fio = Fio(s.file, RESULTS / "mp-pair-fio.log")
        fio.load_on(s.socket)
        step("switch-over: demote A, promote B")
        switch("target.sock", "b.sock")
        wait_listed(s.socket, b, ("live", "optimized"))
        wait_listed(s.socket, a, ("live", "inaccessible"))
        pair.wait_replica("b.sock", "in_sync")  # B mirrors to A: A may be promoted again
        fio.load_on(s.socket)
        step("switch-back: demote B, promote A")
        switch("b.sock", "target.sock")
        wait_listed(s.socket, a, ("live", "optimized"))
        wait_listed(s.socket, b, ("live", "inaccessible"))
        pair.wait_replica("target.sock", "in_sync")
        fio.load_on(s.socket)
        step("kill -9 A, promote B")
        s.stop_target(signal.SIGKILL)
        wait_listed(s.socket, a, ("reconnecting", "unknown"))
        pair.ana_set("b.sock", "optimized")
        wait_listed(s.socket, b, ("live", "optimized"))
        fio.load_on(s.socket)
        step("A back as the standby")
        pair.configure_a("inaccessible")
        s.start_target()
        resynced = pair.wait_replica("b.sock", "in_sync")["replicas"][0]["resynced_bytes"]
        wait_listed(s.socket, a, ("live", "inaccessible"))
        fio.load_on(s.socket)
        fio.stop()
        step("fio stopped")
        print(connection(s.socket))
        record_property("resynced_bytes", str(resynced))
        # A: demoted once (its kill is a path loss, not an ANA change); B: demoted once
        retries_within_bound(s.socket, {a: 1, b: 1}, record_property)
    finally:
        if fio is not None:
            fio.kill()
        pair.stop()
        for log in tmp_path.glob("*.log"):
            shutil.copy(log, RESULTS / f"mp-pair-{log.name}")
