"""blockd over Ceph RBD with the kernel host's native multipath (inside the VM; run from the host
by tests/vm/test_ceph.py, one boot for the file, tests in file order).

The single-node cluster of tests/ceph/cluster.py starts in the guest on 127.0.0.1. Two
``blockd target`` processes on 192.0.2.1 (ports 4420, 4421) export one image as one subsystem
with ``failover = true``: A optimized, B inaccessible. The kernel host connects to both. No test
promotes anything: the standby takes the image's lock over when the active gateway's watch ends,
fencing it (docs/ceph.md)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from .util import ADDR0, REPO, RESULTS, Daemon, nvme_path_attr, sh, start_target

sys.path.insert(0, str(REPO))

from tests.ceph.cluster import Cluster  # noqa: E402

NQN = "nqn.2026-11.io.blockd:rbd-gw"
PORTS = {"a": 4420, "b": 4421}
CNTLIDS = {"a": (1, 99), "b": (100, 199)}
IMAGE = "gw"
SIZE = 128 << 20


def _config(name: str, state: str, cluster: Cluster) -> Path:
    cfg = RESULTS / f"rbd-{name}.toml"
    cfg.write_text(f"""\
[control]
socket = "/run/blockd/rbd-{name}.sock"

[[port]]
transport = "tcp"
address = "{ADDR0}"
port = {PORTS[name]}

[[ana]]
state = "{state}"

[[subsystem]]
nqn = "{NQN}"
allow_any_host = true
cntlid_min = {CNTLIDS[name][0]}
cntlid_max = {CNTLIDS[name][1]}

[[subsystem.namespace]]
nsid = 1
backend = "rbd"
path = "{cluster.pool}/{IMAGE}"
options = {{ conf = "{cluster.conf}", failover = true, takeover_after = 1.0, poll = 0.3 }}
""")
    return cfg


def _start(name: str, state: str, cluster: Cluster) -> Daemon:
    os.makedirs("/run/blockd", exist_ok=True)
    return start_target(f"rbd-{name}", _config(name, state, cluster), port=PORTS[name])


def _ana_state(port: int) -> str:
    return nvme_path_attr(NQN, port, "ana_state")


def _wait(cond, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if cond():
                return
        except (AssertionError, OSError):
            pass
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.5)


def _locked(cluster: Cluster) -> bool:
    """The image's exclusive lock has an owner (A took it at start)."""
    import rados
    import rbd
    r = rados.Rados(conffile=str(cluster.conf))
    r.connect()
    try:
        io = r.open_ioctx(cluster.pool)
        with rbd.Image(io, IMAGE) as img:  # not read-only: lock_get_owners refuses that (EINVAL)
            return bool(list(img.lock_get_owners()))
    finally:
        r.shutdown()


def _fio_verify(dev: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        ["bash", "-c", f"fio --name=rbd-failover --filename={dev} --rw=randwrite --bs=4k --size=2M "
                       "--direct=1 --ioengine=libaio --iodepth=4 --rate_iops=200 --verify=crc32c "
                       f"--do_verify=1 --verify_fatal=1 --randrepeat=0 >{log} 2>&1"])


def _fio_done(fio: subprocess.Popen, log: Path) -> None:
    try:
        rc = fio.wait(900)
    finally:
        if fio.poll() is None:
            fio.kill()
    output = log.read_text()
    print(output)
    assert rc == 0, output
    assert "err= 0" in output, output
    assert not re.search(r"verify: bad|io_u error|Input/output error", output), output


@pytest.fixture(scope="module")
def gateways(rxe):
    # under qemu TCG a client's pings can lag several seconds: Ceph's 3 s of the host tests would
    # end the active gateway's own watch (and its lock) while it lives
    cluster = Cluster(Path(tempfile.mkdtemp(prefix="ceph-", dir="/dev/shm")), watch_timeout=15).start()
    print(f"ceph in the guest: up in {cluster.start_seconds:.1f} s")
    cluster.create_image(IMAGE, SIZE)
    daemons: dict[str, Daemon] = {}
    state = {"cluster": cluster, "daemons": daemons}
    try:
        daemons["a"] = _start("a", "optimized", cluster)
        _wait(lambda: _locked(cluster), "A holds the image's lock", timeout=60)
        daemons["b"] = _start("b", "inaccessible", cluster)
        for name in ("a", "b"):
            state["dev"] = sh(f"nvmeh_connect tcp {ADDR0} {PORTS[name]} {NQN} --reconnect-delay=1 "
                              "--ctrl-loss-tmo=1200", timeout=120).strip().splitlines()[-1]
        yield state
    finally:
        sh(f"nvme disconnect -n {NQN}", check=False)
        for d in daemons.values():
            if d.proc.poll() is None:
                os.kill(d.proc.pid, signal.SIGCONT)
            d.stop()
        cluster.stop()


def test_khost_rbd_one_subsystem_two_paths(gateways):
    assert re.fullmatch(r"/dev/nvme\d+n1", gateways["dev"]), gateways["dev"]
    assert _ana_state(PORTS["a"]) == "optimized"
    assert _ana_state(PORTS["b"]) == "inaccessible"


@pytest.mark.timeout(900)  # fio writes at ~10 IOPS through TCG, librbd and a guest OSD
def test_khost_rbd_fio_verify_through_kill_9(gateways):
    log = RESULTS / "rbd-kill9-fio.log"
    fio = _fio_verify(gateways["dev"], log)
    a = gateways["daemons"]["a"]
    try:
        time.sleep(4)
        assert fio.poll() is None, log.read_text()
        a.proc.kill()
        a.proc.wait(30)
        _wait(lambda: _ana_state(PORTS["b"]) == "optimized", "B took over by itself", timeout=180)
    finally:
        _fio_done(fio, log)
    b_log = gateways["daemons"]["b"].log_tail(400)
    assert "fencing the image's previous owner" in b_log and b_log.count("took the image over") == 1, b_log


@pytest.mark.timeout(900)
def test_khost_rbd_fio_verify_through_sigstop(gateways):
    cluster = gateways["cluster"]
    gateways["daemons"]["a"].stop()
    gateways["daemons"]["a"] = _start("a", "inaccessible", cluster)  # back, as the standby
    _wait(lambda: _ana_state(PORTS["a"]) == "inaccessible", "the kernel reconnected to A", timeout=180)
    b = gateways["daemons"]["b"]
    log = RESULTS / "rbd-sigstop-fio.log"
    fio = _fio_verify(gateways["dev"], log)
    try:
        time.sleep(4)
        assert fio.poll() is None, log.read_text()
        os.kill(b.proc.pid, signal.SIGSTOP)
        _wait(lambda: _ana_state(PORTS["a"]) == "optimized", "A took over by itself", timeout=240)
        time.sleep(2)  # fio writes through A meanwhile
        os.kill(b.proc.pid, signal.SIGCONT)  # the zombie wakes
        _wait(lambda: "fenced" in b.log_tail(400), "B saw it was fenced", timeout=120)
    finally:
        if b.proc.poll() is None:
            os.kill(b.proc.pid, signal.SIGCONT)
        _fio_done(fio, log)


@pytest.mark.timeout(600)
def test_khost_rbd_ext4_tree_fsck_sha256(gateways):
    """ext4 through the kernel host on the pair's namespace (A serving, after both failovers): a
    copied tree, e2fsck -fn clean after unmount, the same sha256 sums after a remount with the
    guest's caches dropped (so the sums are of what the image gives back)."""
    dev, mnt = gateways["dev"], "/mnt/rbd-ext4"
    sums = RESULTS / "rbd-ext4.sha256"
    sh(f"cd {REPO} && find blockd -type f -not -path '*/__pycache__/*' -print0 | sort -z | xargs -0 sha256sum >{sums}")
    assert len(sums.read_text().splitlines()) > 20, sums.read_text()
    sh(f"mkfs.ext4 -q -F -E nodiscard,lazy_itable_init=0,lazy_journal_init=0 {dev} && mkdir -p {mnt} "
       f"&& mount {dev} {mnt} && cp -a {REPO}/blockd {mnt}/ && umount {mnt}", timeout=400)
    sh(f"e2fsck -fn {dev}", timeout=120)
    sh(f"""echo 3 >/proc/sys/vm/drop_caches
mount {dev} {mnt}
rc=0
(cd {mnt} && sha256sum --quiet -c {sums}) || rc=$?
umount {mnt}
exit $rc""", timeout=120)
