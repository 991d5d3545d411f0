"""The bed itself, inside the VM: rxe RDMA and the kernel's NVMe-oF host against its target.

Run from the host by tests/vm/test_bed.py (one boot for the whole file).
"""

from __future__ import annotations

import json
import re
import subprocess
import time

from .util import ADDR0, sh

NQN = "nqn.2026-11.io.blockd:bed"
_BW_LINE = re.compile(r"^\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$", re.M)


def _perftest(bin_: str, iters: int = 500, size: int = 65536, attempts: int = 3):
    """Server on rxe0, client on rxe1 -> 192.0.2.1 over rdma_cm; the client's report."""
    last = ""
    for attempt in range(1, attempts + 1):
        srv = subprocess.Popen([bin_, "-d", "rxe0", "-R", "-F", "-n", str(iters), "-s", str(size)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            # wait until the server's rdma_cm id listens (else the client is rejected)
            deadline = time.monotonic() + 30
            while "LISTEN" not in sh("rdma res show cm_id || true", check=False):
                assert srv.poll() is None, f"{bin_} server exited early: {srv.stdout.read()}"
                assert time.monotonic() < deadline, "perftest server never listened"
                time.sleep(0.3)
            cli = subprocess.run([bin_, "-d", "rxe1", "-R", "-F", "-n", str(iters), "-s", str(size),
                                  ADDR0], capture_output=True, text=True, timeout=120)
            srv_out = srv.communicate(timeout=60)[0]
        finally:
            if srv.poll() is None:
                srv.kill()
                srv.wait()
        last = (f"attempt {attempt}: client exit {cli.returncode}\n{cli.stdout}\n{cli.stderr}\n"
                f"--- server\n{srv_out}")
        print(last)
        m = _BW_LINE.search(cli.stdout)
        if cli.returncode == 0 and m:
            return {"bytes": int(m.group(1)), "iterations": int(m.group(2)),
                    "bw_peak_MBps": float(m.group(3)), "bw_average_MBps": float(m.group(4)),
                    "msg_rate_Mpps": float(m.group(5))}
    raise AssertionError(f"{bin_} gave no bandwidth report after {attempts} attempts:\n{last}")


def test_rxe_devices(rxe):
    out = sh("rdma link show")
    assert re.search(r"link rxe0/1 state ACTIVE .* netdev veth0", out), out
    assert re.search(r"link rxe1/1 state ACTIVE .* netdev veth1", out), out


def test_ib_write_bw(rxe, record_property):
    rep = _perftest("ib_write_bw")
    for k, v in rep.items():
        record_property(k, v)
    assert rep["bytes"] == 65536 and rep["iterations"] == 500
    assert rep["bw_average_MBps"] > 0


def _kernel_tcp_target(scratch: str, trtype: str = "tcp", port: int = 4420, size: str = "64M"):
    vol = f"{scratch}/vol.img"
    sh(f"truncate -s {size} {vol} && nvmet_subsys {NQN} BEDSERIAL01 && nvmet_ns_file {NQN} 1 {vol} "
       f"&& nvmet_port 1 {trtype} {ADDR0} {port} && nvmet_link 1 {NQN}")
    return vol


def test_kernel_nvme_tcp(rxe, nvmet, scratch, record_property):
    """Kernel nvme-tcp host -> kernel nvmet-tcp target over the veth pair; fio verify + cmp."""
    vol = _kernel_tcp_target(scratch)
    dev = sh(f"nvmeh_connect tcp {ADDR0} 4420 {NQN}").strip().splitlines()[-1]
    assert dev.startswith("/dev/nvme"), dev
    # the host really connected over veth1 -> 192.0.2.1
    out = sh(f"c=$(nvmeh_ctrl {NQN}); cat /sys/class/nvme/$c/transport /sys/class/nvme/$c/address")
    assert out.splitlines()[0] == "tcp" and f"traddr={ADDR0}" in out, out
    # identify as nvme-cli shows it (the parsing tests/vm/guest_tests/test_blockd.py relies on)
    line = next((ln for ln in sh("nvme list").splitlines() if ln.startswith(dev + " ")), "")
    assert "BEDSERIAL01" in line, line
    ctrl = sh(f"nvmeh_ctrl {NQN}").strip()
    ic = json.loads(sh(f"nvme id-ctrl /dev/{ctrl} -o json"))
    assert ic["sn"].strip() == "BEDSERIAL01" and ic["subnqn"].strip() == NQN, ic
    assert ic["mn"].strip() == sh(f"cat /sys/class/nvme/{ctrl}/model").strip()
    ns = json.loads(sh(f"nvme id-ns {dev} -o json"))
    assert ns["nsze"] << ns["lbafs"][ns["flbas"] & 0xF]["ds"] == 64 << 20, ns
    t0 = time.monotonic()
    sh(f"fio --name=verify --filename={dev} --rw=write --bs=64k --size=16M --direct=1 "
       "--ioengine=psync --verify=crc32c --do_verify=1 --verify_fatal=1 --output-format=terse "
       "--minimal >/dev/null")
    record_property("fio_write_verify_16MiB_s", round(time.monotonic() - t0, 1))
    # the same bytes through the block device and in the target's backing file
    sh(f"dd if={dev} of={scratch}/readback bs=1M count=16 iflag=direct status=none && "
       f"cmp -n 16777216 {scratch}/readback {vol}")
    sh(f"nvmeh_disconnect {NQN}")
    assert not sh(f"nvmeh_ctrl {NQN} || true", check=False).strip()


def test_kernel_nvme_rdma(rxe, nvmet, scratch):
    """Kernel nvme-rdma host on rxe1 -> kernel nvmet-rdma target on rxe0; 4 MiB write + cmp."""
    vol = _kernel_tcp_target(scratch, trtype="rdma")
    dev = sh(f"nvmeh_connect rdma {ADDR0} 4420 {NQN}").strip().splitlines()[-1]
    sh(f"head -c 4194304 /dev/urandom >{scratch}/pat && "
       f"dd if={scratch}/pat of={dev} bs=1M oflag=direct status=none && "
       f"dd if={dev} of={scratch}/back bs=1M count=4 iflag=direct status=none && "
       f"cmp {scratch}/pat {scratch}/back && cmp -n 4194304 {scratch}/pat {vol}")
    sh(f"nvmeh_disconnect {NQN}")
