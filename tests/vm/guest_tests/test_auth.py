"""DH-HMAC-CHAP with the Linux kernel as the judge, inside the VM on the 6.12 kernel (the
bookworm 6.1 kernel has no NVMe in-band authentication): the kernel's host (nvme-cli) against
`blockd target`, and blockd's host against the kernel's nvmet with secrets in configfs.

Run from the host by tests/vm/test_auth.py (one boot for the file).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from blockd.dhchap_secret import generate_secret
from initiator.controller import ConnectError, ConnectParams, Controller

from .util import ADDR0, RESULTS, sh, start_target, wait_tcp

NQN = "nqn.2026-11.io.blockd:auth"
KNQN = "nqn.2026-11.io.blockd:kernel-auth"
KPORT = 4421
VOL = "/dev/shm/auth-vol.img"
HOST_UNI = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-4000-8000-000000000001"
HOST_BI = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-4000-8000-000000000002"
KEY_UNI = generate_secret(HOST_UNI, 1).encode()          # SHA-256 transform
KEY_BI = generate_secret(HOST_BI, 3).encode()            # SHA-512 transform
CTRL_KEY = generate_secret(NQN, 0, 48).encode()          # no transform, 48 bytes


def _target_toml() -> str:
    return f"""\
[[port]]
transport = "tcp"
address = "{ADDR0}"
port = 4420

[[subsystem]]
nqn = "{NQN}"

[[subsystem.namespace]]
nsid = 1
path = "{VOL}"
size = "16MiB"

[[subsystem.host_auth]]
nqn = "{HOST_UNI}"
dhchap_key = "{KEY_UNI}"
dhchap_hashes = ["sha256"]
dhchap_dhgroups = ["null"]

[[subsystem.host_auth]]
nqn = "{HOST_BI}"
dhchap_key = "{KEY_BI}"
dhchap_ctrl_key = "{CTRL_KEY}"
dhchap_hashes = ["sha512"]
dhchap_dhgroups = ["ffdhe2048"]
"""


@pytest.fixture(scope="module")
def auth_target(rxe):
    RESULTS.mkdir(parents=True, exist_ok=True)
    cfg = RESULTS / "auth-target.toml"
    cfg.write_text(_target_toml())
    cfg.chmod(0o600)
    Path(VOL).unlink(missing_ok=True)
    d = start_target("blockd-auth-target", cfg)
    yield d
    d.stop()


def _kernel_connect(hostnqn: str, *secrets: str) -> tuple[str, str]:
    """Connect the kernel host; its block device and what the kernel logged meanwhile."""
    opts = " ".join(f"'{s}'" for s in secrets)
    sh("dmesg -C")
    dev = sh(f"nvmeh_connect tcp {ADDR0} 4420 {NQN} --hostnqn={hostnqn} {opts}",
             timeout=120).strip().splitlines()[-1]
    return dev, sh("dmesg")


def _io_through(dev: str) -> None:
    sh(f"head -c 1048576 /dev/urandom >/dev/shm/auth-pattern && "
       f"dd if=/dev/shm/auth-pattern of={dev} bs=64k oflag=direct status=none && "
       f"dd if={dev} of=/dev/shm/auth-back bs=64k count=16 iflag=direct status=none && "
       f"cmp /dev/shm/auth-pattern /dev/shm/auth-back")


def test_khost_dhchap_sha256_null(auth_target):
    dev, kmsg = _kernel_connect(HOST_UNI, f"--dhchap-secret={KEY_UNI}")
    try:
        assert "qid 0: authenticated with hash hmac(sha256) dhgroup null" in kmsg, kmsg
        assert "controller authenticated" not in kmsg, kmsg
        _io_through(dev)
    finally:
        sh(f"nvmeh_disconnect {NQN}", check=False)


def test_khost_dhchap_sha512_ffdhe2048_bidirectional(auth_target):
    dev, kmsg = _kernel_connect(HOST_BI, f"--dhchap-secret={KEY_BI}",
                                f"--dhchap-ctrl-secret={CTRL_KEY}")
    try:
        assert "qid 0: authenticated with hash hmac(sha512) dhgroup ffdhe2048" in kmsg, kmsg
        assert "qid 0: controller authenticated" in kmsg, kmsg
        _io_through(dev)
    finally:
        sh(f"nvmeh_disconnect {NQN}", check=False)


def test_khost_wrong_secret_refused(auth_target):
    wrong = generate_secret(HOST_UNI, 1).encode()
    out = sh(f"nvmeh_connect tcp {ADDR0} 4420 {NQN} --hostnqn={HOST_UNI} "
             f"--dhchap-secret='{wrong}' && echo CONNECTED || echo REFUSED", timeout=120)
    sh(f"nvmeh_disconnect {NQN}", check=False)
    assert "REFUSED" in out and "CONNECTED" not in out, out
    assert "authentication failed" in auth_target.log_tail(), auth_target.log_tail()


def test_khost_missing_secret_refused(auth_target):
    out = sh(f"nvmeh_connect tcp {ADDR0} 4420 {NQN} --hostnqn={HOST_UNI} "
             f"&& echo CONNECTED || echo REFUSED", timeout=120)
    sh(f"nvmeh_disconnect {NQN}", check=False)
    assert "REFUSED" in out and "CONNECTED" not in out, out


# ------------------------------------------ blockd's host -> kernel nvmet with dhchap_key ---
KHOST = "nqn.2014-08.org.nvmexpress:uuid:bbbbbbbb-0000-4000-8000-000000000003"
KKEY = generate_secret(KHOST, 2).encode()                # SHA-384 transform
KCTRL = generate_secret(KNQN, 1).encode()


@pytest.fixture(scope="module")
def auth_nvmet(rxe):
    vol = "/dev/shm/kernel-auth.img"
    cfs = "/sys/kernel/config/nvmet"
    sh(f"rm -f {vol} && truncate -s 16M {vol} && nvmet_subsys {KNQN} KAUTH01 && "
       f"echo 0 >{cfs}/subsystems/{KNQN}/attr_allow_any_host && "
       f"mkdir -p {cfs}/hosts/{KHOST} && "
       f"echo '{KKEY}' >{cfs}/hosts/{KHOST}/dhchap_key && "
       f"echo '{KCTRL}' >{cfs}/hosts/{KHOST}/dhchap_ctrl_key && "
       f"echo 'hmac(sha384)' >{cfs}/hosts/{KHOST}/dhchap_hash && "
       f"echo ffdhe3072 >{cfs}/hosts/{KHOST}/dhchap_dhgroup && "
       f"ln -s {cfs}/hosts/{KHOST} {cfs}/subsystems/{KNQN}/allowed_hosts/{KHOST} && "
       f"nvmet_ns_file {KNQN} 1 {vol} && nvmet_port 2 tcp {ADDR0} {KPORT} && nvmet_link 2 {KNQN}")
    wait_tcp(ADDR0, KPORT, timeout=30, what="kernel nvmet-tcp")
    yield vol
    sh(f"nvmet_unlink 2 {KNQN}; rmdir {cfs}/ports/2; "
       f"rm -f {cfs}/subsystems/{KNQN}/allowed_hosts/{KHOST}; "
       f"echo 0 >{cfs}/subsystems/{KNQN}/namespaces/1/enable; "
       f"rmdir {cfs}/subsystems/{KNQN}/namespaces/1 {cfs}/subsystems/{KNQN} {cfs}/hosts/{KHOST}",
       check=False)


def _our_host(secret: str, ctrl_secret: str | None) -> bytes:
    async def main() -> bytes:
        ctrl = await Controller.connect(ConnectParams(
            traddr=ADDR0, trsvcid=KPORT, subnqn=KNQN, hostnqn=KHOST, nr_io_queues=2,
            dhchap_secret=secret, dhchap_ctrl_secret=ctrl_secret, connect_timeout=20.0))
        try:
            data = os.urandom(65536)
            await ctrl.write_bytes(1, 1 << 20, data)
            assert await ctrl.read_bytes(1, 1 << 20, len(data)) == data
            return data
        finally:
            await ctrl.close()
    return asyncio.run(main())


def test_our_host_dhchap_to_kernel_nvmet(auth_nvmet):
    data = _our_host(KKEY, KCTRL)
    with open(auth_nvmet, "rb") as f:
        f.seek(1 << 20)
        assert f.read(len(data)) == data


def test_our_host_wrong_secret_refused_by_kernel_nvmet(auth_nvmet):
    # nvmet answers Failure1 and tears the association down at once: either may reach us first
    with pytest.raises(ConnectError, match="authentication with .* failed: (controller refused: "
                                           "FAILED|the target closed)"):
        _our_host(generate_secret(KHOST, 2).encode(), None)
