"""Failover with ANA, the Linux kernel's native multipath as judge (issue 14).

Inside the VM; run from the host by tests/vm/test_failover.py (one boot for the file). Two
``blockd target`` processes on 192.0.2.1 (ports 4420 and 4421) export one subsystem and
namespace (same NQN, so the same derived NGUID/UUID; disjoint controller id ranges), each from
its own file: a replicated pair (docs/replication.md), each naming the other's standby
subsystem as its replica. A is optimized (the primary, mirroring every write to B), B
inaccessible (the standby). The kernel host connects to both: one subsystem, two
paths, one multipath block device. Both targets then move the namespace to ANA group 2 and
back on a reload: the kernel follows without losing the device. Under load, the primary is
killed with SIGKILL and the standby promoted with ``blockctl target ana promote``; the load
must end without an error.
First fio with verify on the raw device (A dies, B takes over), then A comes back as the
standby and B resyncs it from the bitmaps (less than the volume), then ext4 (B dies, A takes
over) and fsck.

The tests share the module's setup and run in file order.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from .util import ADDR0, RESULTS, Daemon, sh, start_target, tool

NQN = "nqn.2026-11.io.blockd:failover"
STANDBY = "nqn.2026-11.io.blockd:failover-standby"
VOLS = {"a": "/tmp/failover-a.img", "b": "/tmp/failover-b.img"}
SIZE = 64 << 20
PORTS = {"a": 4420, "b": 4421}
CNTLIDS = {"a": (1, 99), "b": (100, 199)}


def _config(name: str, state: str, group: int = 1) -> Path:
    """Target ``name``'s file: groups 1 and 2 in ``state``, the namespace in ``group``,
    replicated to the other target's standby subsystem."""
    peer = "b" if name == "a" else "a"
    cfg = RESULTS / f"failover-{name}.toml"
    cfg.write_text(f"""\
[control]
socket = "/run/blockd/{name}.sock"

[[port]]
transport = "tcp"
address = "{ADDR0}"
port = {PORTS[name]}

[[ana]]
state = "{state}"

[[ana]]
group = 2
state = "{state}"

[[subsystem]]
nqn = "{NQN}"
allow_any_host = true
cntlid_min = {CNTLIDS[name][0]}
cntlid_max = {CNTLIDS[name][1]}

[[subsystem.namespace]]
nsid = 1
path = "{VOLS[name]}"
size = {SIZE}
ana_group = {group}
standby_nqn = "{STANDBY}"
resync_rate = "1GiB"

[[subsystem.namespace.replica]]
address = "{ADDR0}"
port = {PORTS[peer]}
nqn = "{STANDBY}"
timeout = 2.0
""")
    return cfg


def _start(name: str, state: str) -> Daemon:
    os.makedirs("/run/blockd", exist_ok=True)
    return start_target(f"failover-{name}", _config(name, state), port=PORTS[name])


def _targetctl(name: str, *args: str) -> str:
    return sh(shlex.join([tool("blockctl"), "target", "--target-socket", f"/run/blockd/{name}.sock", *args]))


def _promote(name: str) -> str:
    return _targetctl(name, "ana", "promote")


def _replicated(name: str) -> dict:
    """Target ``name``'s replicated namespace (``blockctl target replicas --json``)."""
    return json.loads(_targetctl(name, "replicas", "--json"))["namespaces"][0]


def _wait_in_sync(primary: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while (ns := _replicated(primary))["replicas"][0]["state"] != "in_sync":
        assert time.monotonic() < deadline, ns
        time.sleep(0.5)
    return ns


def _kill(d: Daemon) -> None:
    d.proc.kill()
    d.proc.wait(30)


def _ctrl_of(port: int) -> str:
    """The kernel controller (nvmeX) connected to 192.0.2.1:``port`` for NQN."""
    for c in glob.glob("/sys/class/nvme-fabrics/ctl/nvme*"):
        if Path(c, "subsysnqn").read_text().strip() != NQN:
            continue
        if f"trsvcid={port}" in Path(c, "address").read_text():
            return os.path.basename(c)
    raise AssertionError(f"no controller of {NQN} on port {port}")


def _path_attr(port: int, name: str) -> str:
    """An attribute (ana_state, ana_grpid) of the path device of the controller on ``port``."""
    ctrl = _ctrl_of(port)
    paths = glob.glob(f"/sys/class/nvme/{ctrl}/nvme*c*n1/{name}")
    assert paths, f"{ctrl} has no path device (native multipath off?)"
    return Path(paths[0]).read_text().strip()


def _ana_state(port: int) -> str:
    return _path_attr(port, "ana_state")


def _wait_state(port: int, state: str, timeout: float = 60, attr: str = "ana_state") -> None:
    deadline = time.monotonic() + timeout
    while _path_attr(port, attr) != state:
        assert time.monotonic() < deadline, f"port {port}: {attr} {_path_attr(port, attr)}, not {state}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def pair(rxe):
    for vol in VOLS.values():
        Path(vol).unlink(missing_ok=True)
        sh(f"truncate -s {SIZE} {vol}")
    daemons = {"a": _start("a", "optimized"), "b": _start("b", "inaccessible")}
    dev = ""
    try:
        _wait_in_sync("a")  # B's first full sync: only then may it be promoted
        assert _replicated("b")["role"] == "secondary"
        for name in ("a", "b"):
            # a short reconnect delay, so the restarted target is a path again soon
            dev = sh(f"nvmeh_connect tcp {ADDR0} {PORTS[name]} {NQN} --reconnect-delay=1 "
                     "--ctrl-loss-tmo=120", timeout=120).strip().splitlines()[-1]
        yield {"dev": dev, "daemons": daemons}
    finally:
        sh(f"nvme disconnect -n {NQN}", check=False)
        for d in daemons.values():
            d.stop()


def test_khost_one_subsystem_two_paths(pair):
    """nvme list-subsys: one subsystem, two paths (a controller on each target); the path
    devices show each target's ANA state; one multipath block device."""
    text = sh(f"nvme list-subsys {pair['dev']}")
    assert f"trsvcid={PORTS['a']}" in text and f"trsvcid={PORTS['b']}" in text, text
    subsys = [d for d in glob.glob("/sys/class/nvme-subsystem/nvme-subsys*")
              if Path(d, "subsysnqn").read_text().strip() == NQN]
    assert len(subsys) == 1, subsys
    ctrls = [n for n in os.listdir(subsys[0]) if re.fullmatch(r"nvme\d+", n)]
    assert len(ctrls) == 2, ctrls
    assert _ana_state(PORTS["a"]) == "optimized"
    assert _ana_state(PORTS["b"]) == "inaccessible"
    cntlids = sorted(int(Path(f"/sys/class/nvme/{c}/cntlid").read_text()) for c in ctrls)
    assert cntlids[0] in range(1, 100) and cntlids[1] in range(100, 200), cntlids
    assert re.fullmatch(r"/dev/nvme\d+n1", pair["dev"]), pair["dev"]


def test_khost_follows_a_namespace_moved_to_another_group(pair):
    """Both targets move the namespace to ANA group 2 on a reload (SIGHUP), then back to 1: the
    kernel keeps the same controllers and block device, each path's ana_grpid follows (read
    from the ANA log after the ANA change event: no namespace is removed or added) and its
    state stays; data written before reads back after each move and a write goes through."""
    dev = pair["dev"]
    sh(f"head -c 65536 /dev/urandom >/tmp/move-before && dd if=/tmp/move-before of={dev} bs=4k oflag=direct")
    ctrls = {port: _ctrl_of(port) for port in PORTS.values()}
    for group in (2, 1):
        for name, state in (("a", "optimized"), ("b", "inaccessible")):
            _config(name, state, group)
            pair["daemons"][name].proc.send_signal(signal.SIGHUP)
        for name, state in (("a", "optimized"), ("b", "inaccessible")):
            _wait_state(PORTS[name], str(group), attr="ana_grpid")
            assert _ana_state(PORTS[name]) == state
        assert {port: _ctrl_of(port) for port in PORTS.values()} == ctrls
        sh(f"test -b {dev} && dd if={dev} of=/tmp/move-after bs=4k count=16 iflag=direct status=none "
           f"&& cmp /tmp/move-before /tmp/move-after")
        sh(f"dd if=/dev/urandom of={dev} bs=4k seek={16 + group} count=1 oflag=direct status=none")
    for d in pair["daemons"].values():
        assert "namespace removed" not in d.log_tail(200)


def test_khost_fio_verify_survives_primary_kill(pair):
    """fio writes with crc32c verify on the multipath device; A is killed mid-run, B promoted:
    fio ends with status 0 and the verify pass found every block."""
    log = RESULTS / "failover-fio.log"
    fio = subprocess.Popen(
        ["bash", "-c", f"fio --name=failover --filename={pair['dev']} --rw=randwrite --bs=4k --size=8M "
                       "--direct=1 --ioengine=libaio --iodepth=4 --rate_iops=300 --verify=crc32c "
                       f"--do_verify=1 --verify_fatal=1 --randrepeat=0 >{log} 2>&1"])
    try:
        time.sleep(4)
        assert fio.poll() is None, log.read_text()
        _kill(pair["daemons"]["a"])
        time.sleep(2)  # I/O waits: the only other path is inaccessible
        assert fio.poll() is None, log.read_text()
        print(_promote("b"))
        _wait_state(PORTS["b"], "optimized")
        rc = fio.wait(600)
    finally:
        if fio.poll() is None:
            fio.kill()
    output = log.read_text()
    print(output)
    assert rc == 0, output
    assert "err= 0" in output, output
    assert not re.search(r"verify: bad|io_u error|Input/output error", output), output


def test_khost_ext4_survives_standby_takeover(pair):
    """A comes back as the standby (inaccessible), the kernel reconnects to it, B resyncs it from
    the bitmaps (the regions fio wrote, not the volume); ext4 on the
    multipath device under a writing loop; B is killed, A promoted; the loop goes on without
    an error, and after unmount e2fsck is clean and every file written reads back."""
    pair["daemons"]["a"] = _start("a", "inaccessible")
    _wait_state(PORTS["a"], "inaccessible", timeout=120)
    ns = _wait_in_sync("b")  # A resynced from the bitmaps: the regions written around the failover
    copied = ns["replicas"][0]["resynced_bytes"]
    assert 0 < copied <= (8 << 20) + (1 << 20) < ns["data_size"], ns  # fio's 8 MiB (+ a region each end)
    assert _replicated("a")["role"] == "secondary"
    dev, mnt = pair["dev"], "/mnt/failover"
    os.makedirs(mnt, exist_ok=True)
    sh(f"mkfs.ext4 -q -F {dev} && mount {dev} {mnt}", timeout=300)
    log = RESULTS / "failover-ext4.log"
    script = (f"set -e; i=0; while [ ! -e /tmp/failover-stop ]; do "
              f"head -c 65536 /dev/urandom >{mnt}/f$i; sha256sum {mnt}/f$i >>{mnt}/sums; "
              f"[ $((i % 8)) -ne 7 ] || sync; i=$((i + 1)); done; sync; echo wrote $i")
    Path("/tmp/failover-stop").unlink(missing_ok=True)
    writer = subprocess.Popen(["bash", "-c", f"({script}) >{log} 2>&1"])
    try:
        time.sleep(4)
        assert writer.poll() is None, log.read_text()
        _kill(pair["daemons"]["b"])
        before = len(os.listdir(mnt))
        time.sleep(2)
        print(_promote("a"))
        _wait_state(PORTS["a"], "optimized")
        deadline = time.monotonic() + 120
        # more than two sync rounds (every 8th file) past the kill: the device took writes again
        while len(os.listdir(mnt)) < before + 17 and time.monotonic() < deadline and writer.poll() is None:
            time.sleep(0.5)  # writing through A now
        assert len(os.listdir(mnt)) >= before + 17, "the writes did not go on through A"
        Path("/tmp/failover-stop").touch()
        rc = writer.wait(600)
    finally:
        Path("/tmp/failover-stop").touch()
        if writer.poll() is None:
            writer.kill()
    output = log.read_text()
    print(output)
    assert rc == 0, output
    sh(f"cd {mnt} && sha256sum -c --quiet sums", timeout=300)
    sh(f"umount {mnt} && e2fsck -fn {dev}", timeout=300)
    assert "I/O error" not in sh("dmesg | grep -i 'ext4\\|buffer i/o' || true")
