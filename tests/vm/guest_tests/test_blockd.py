"""blockd's own target and initiator against the Linux kernel's NVMe-oF host and target.

Inside the VM; run from the host by tests/vm/test_blockd.py (one boot for the file).
Tests follow the blockd CLI contract:

    blockd target --config FILE            (foreground, logs to stderr)
    blockd initiator --socket PATH         (foreground)
    blockctl [--socket PATH] connect -t tcp -a ADDR -s PORT -n NQN [-q HOSTNQN] --name NAME
    blockctl read NAME --nsid 1 --offset B --length B -o FILE|-
    blockctl write NAME --nsid 1 --offset B -i FILE
    blockctl disconnect NAME;  blockctl id-ctrl NAME;  blockctl id-ns NAME --nsid 1

The tests of one scenario share a module-scoped setup and run in file order; each checks
one thing so that it can fail on its own.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest

from .util import ADDR0, RESULTS, Daemon, sh, tool, wait_path, wait_tcp

NQN = "nqn.2026-11.io.blockd:vmtest"
SERIAL = "BLOCKDVM0001"
MODEL = "blockd"
VOL = "/tmp/vol1.img"
VOL_SIZE = 64 << 20
BLOCK = 512
SOCK = "/run/blockd/initiator.sock"
KNQN = "nqn.2026-11.io.blockd:kernel"
KPORT = 4421                    # the kernel target's port (blockd's target has 4420)
IO = 16 << 20                   # bytes fio writes through the kernel host (TCG is slow)

TARGET_TOML = f"""\
[[port]]
transport = "tcp"
address = "{ADDR0}"
port = 4420

[[subsystem]]
nqn = "{NQN}"
serial = "{SERIAL}"
model = "{MODEL}"
allow_any_host = true

[[subsystem.namespace]]
nsid = 1
path = "{VOL}"
size = "64MiB"
block_size = {BLOCK}
"""


def blockctl(*args: str, timeout: float = 180, check: bool = True) -> str:
    return sh(shlex.join([tool("blockctl"), "--socket", SOCK, *args]), timeout=timeout,
              check=check)


def _scratch(name: str) -> str:
    d = f"/dev/shm/blockd-{name}"
    os.makedirs(d, exist_ok=True)
    return d


@pytest.fixture(scope="module")
def blockd_target(rxe):
    """`blockd target` on 192.0.2.1:4420 exporting VOL (64 MiB, 512-byte blocks)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    cfg = RESULTS / "target.toml"
    cfg.write_text(TARGET_TOML)
    Path(VOL).unlink(missing_ok=True)
    sh(f"truncate -s {VOL_SIZE} {VOL}")
    d = Daemon("blockd-target", [tool("blockd"), "target", "--config", str(cfg)])
    try:
        wait_tcp(ADDR0, 4420, timeout=120, proc=d.proc, what="blockd target")
    except AssertionError as e:
        d.stop()
        raise AssertionError(f"{e}\n--- blockd target log\n{d.log_tail()}") from None
    yield d
    rc = d.stop()
    print(f"blockd target exit status {rc}")


@pytest.fixture(scope="module")
def blockd_initiator():
    """`blockd initiator` listening on SOCK."""
    os.makedirs(os.path.dirname(SOCK), exist_ok=True)
    d = Daemon("blockd-initiator", [tool("blockd"), "initiator", "--socket", SOCK])
    try:
        wait_path(SOCK, timeout=120, proc=d.proc, what="blockd initiator")
    except AssertionError as e:
        d.stop()
        raise AssertionError(f"{e}\n--- blockd initiator log\n{d.log_tail()}") from None
    yield d
    d.stop()


# ------------------------------------------ kernel nvme-tcp host -> blockd target ---
@pytest.fixture(scope="module")
def khost(blockd_target):
    """The kernel host connected to blockd's target; {"dev": /dev/nvmeXnY, "ctrl": nvmeX}."""
    out = sh(f"nvmeh_connect tcp {ADDR0} 4420 {NQN}", timeout=120)
    dev = out.strip().splitlines()[-1]
    ctrl = sh(f"nvmeh_ctrl {NQN}").strip()
    state = {"dev": dev, "ctrl": ctrl, "connected": True}
    yield state
    if state["connected"]:
        sh(f"nvmeh_disconnect {NQN}", check=False)


def test_khost_connect_and_list(khost):
    assert khost["dev"].startswith("/dev/nvme"), khost
    out = sh("nvme list")
    line = next((ln for ln in out.splitlines() if ln.startswith(khost["dev"] + " ")), None)
    assert line is not None, f"{khost['dev']} not in nvme list:\n{out}"
    assert SERIAL in line and MODEL in line, line
    assert sh(f"cat /sys/class/nvme/{khost['ctrl']}/transport").strip() == "tcp"


def test_khost_id_ctrl(khost):
    ic = json.loads(sh(f"nvme id-ctrl /dev/{khost['ctrl']} -o json"))
    assert ic["sn"].strip() == SERIAL, ic["sn"]
    assert ic["mn"].strip() == MODEL, ic["mn"]
    assert ic["subnqn"].strip() == NQN, ic["subnqn"]
    # also what the kernel read from it
    c = f"/sys/class/nvme/{khost['ctrl']}"
    assert sh(f"cat {c}/serial").strip() == SERIAL
    assert sh(f"cat {c}/model").strip() == MODEL
    assert sh(f"cat {c}/subsysnqn").strip() == NQN


def test_khost_id_ns(khost):
    ns = json.loads(sh(f"nvme id-ns {khost['dev']} -o json"))
    lbaf = ns["lbafs"][ns["flbas"] & 0xF]
    assert 1 << lbaf["ds"] == BLOCK, ns
    assert ns["nsze"] == VOL_SIZE // BLOCK, ns
    assert ns["ncap"] == VOL_SIZE // BLOCK, ns
    assert int(sh(f"blockdev --getsize64 {khost['dev']}").strip()) == VOL_SIZE


def test_khost_fio_write_verify(khost, record_property):
    import time

    t0 = time.monotonic()
    sh(f"fio --name=verify --filename={khost['dev']} --rw=write --bs=64k --size={IO} --direct=1 "
       "--ioengine=psync --verify=crc32c --do_verify=1 --verify_fatal=1 "
       "--output-format=terse --minimal >/dev/null", timeout=300)
    record_property("fio_write_verify_16MiB_s", round(time.monotonic() - t0, 1))
    # and the bytes reached the backing file
    s = _scratch("khost")
    sh(f"dd if={khost['dev']} of={s}/kernel-view bs=1M count={IO >> 20} iflag=direct status=none "
       f"&& cmp -n {IO} {s}/kernel-view {VOL}")


def test_khost_disconnect(khost):
    sh(f"nvmeh_disconnect {NQN}")
    khost["connected"] = False
    assert not sh(f"nvmeh_ctrl {NQN} || true", check=False).strip()


def test_blockctl_reads_what_khost_wrote(blockd_target, blockd_initiator):
    """blockctl (blockd's initiator) reads back, through blockd's target, what the kernel
    host wrote with fio (the backing file has the same bytes)."""
    s = _scratch("khost")
    blockctl("connect", "-t", "tcp", "-a", ADDR0, "-s", "4420", "-n", NQN, "--name", "vm1")
    try:
        blockctl("read", "vm1", "--nsid", "1", "--offset", "0", "--length", str(IO),
                 "-o", f"{s}/blockctl-view", timeout=300)
    finally:
        blockctl("disconnect", "vm1", check=False)
    sh(f"cmp -n {IO} {s}/blockctl-view {VOL}")
    if os.path.exists(f"{s}/kernel-view"):
        sh(f"cmp {s}/blockctl-view {s}/kernel-view")
    # fio wrote something, not zeros
    assert sh(f"cmp -s -n {IO} {s}/blockctl-view /dev/zero && echo zeros || echo data").strip() \
        == "data"


# ------------------------------------------------ blockctl -> kernel nvmet-tcp target ---
@pytest.fixture(scope="module")
def kernel_target(rxe):
    vol = "/dev/shm/kernel-target.img"
    sh(f"rm -f {vol} && truncate -s 64M {vol} && nvmet_subsys {KNQN} KERNELTGT01 && "
       f"nvmet_ns_file {KNQN} 1 {vol} && nvmet_port 2 tcp {ADDR0} {KPORT} && nvmet_link 2 {KNQN}")
    wait_tcp(ADDR0, KPORT, timeout=30, what="kernel nvmet-tcp")
    yield vol
    sh(f"nvmet_unlink 2 {KNQN}; rmdir /sys/kernel/config/nvmet/ports/2; "
       f"echo 0 >/sys/kernel/config/nvmet/subsystems/{KNQN}/namespaces/1/enable; "
       f"rmdir /sys/kernel/config/nvmet/subsystems/{KNQN}/namespaces/1 "
       f"/sys/kernel/config/nvmet/subsystems/{KNQN}", check=False)


@pytest.fixture(scope="module")
def bc_kernel(kernel_target, blockd_initiator):
    blockctl("connect", "-t", "tcp", "-a", ADDR0, "-s", str(KPORT), "-n", KNQN, "--name", "kt")
    yield kernel_target
    blockctl("disconnect", "kt", check=False)


def test_blockctl_kernel_target_identify(bc_kernel):
    ic = blockctl("id-ctrl", "kt")
    assert KNQN in ic and "KERNELTGT01" in ic, ic
    ns = blockctl("id-ns", "kt", "--nsid", "1")
    fields = {k.strip(): v.strip() for k, v in (ln.split(":", 1) for ln in ns.splitlines() if ":" in ln)}
    lbads = int(ns.split("lbads:")[1].split()[0])
    # the kernel target picks its own block size for a file namespace (4 KiB here)
    assert int(fields["nsze"]) << lbads == 64 << 20, ns


def test_blockctl_kernel_target_write_read(bc_kernel):
    s = _scratch("kt")
    off, n = 1 << 20, 1 << 20
    sh(f"head -c {n} /dev/urandom >{s}/pattern")
    blockctl("write", "kt", "--nsid", "1", "--offset", str(off), "-i", f"{s}/pattern")
    blockctl("read", "kt", "--nsid", "1", "--offset", str(off), "--length", str(n),
             "-o", f"{s}/back")
    sh(f"cmp {s}/pattern {s}/back")
    # the kernel target's backing file (buffered_io) holds the same bytes at that offset
    sh(f"cmp -n {n} {s}/pattern <(tail -c +{off + 1} {bc_kernel})")
    # and to stdout
    sh(f"{shlex.join([tool('blockctl'), '--socket', SOCK])} read kt --nsid 1 --offset {off} "
       f"--length 4096 -o - | cmp - <(head -c 4096 {s}/pattern)")
