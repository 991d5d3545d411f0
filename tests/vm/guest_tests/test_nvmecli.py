"""nvme-cli's habits (issue 39), inside the VM: blockctl's JSON against nvme-cli's own for the
same controllers, the kernel host's ``nvme discover`` and ``nvme connect-all`` on blockd's
discovery ports (a listing port on 8009, a referring one on 8010), ``blockctl connect-all``.

Run from the host by tests/vm/test_nvmecli.py (one boot for the file).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest

from .util import ADDR0, RESULTS, Daemon, sh, start_target, tool, wait_path, wait_tcp

NQN = "nqn.2026-11.io.blockd:nvmecli"
VOL = "/dev/shm/nvmecli-vol.img"
KNQN = "nqn.2026-11.io.blockd:nvmecli-kernel"
KVOL = "/dev/shm/nvmecli-kernel.img"
KPORT = 4421
LISTING, REFERRING = 8009, 8010
SOCK = "/run/blockd/nvmecli-initiator.sock"
TARGET_SOCK = "/run/blockd/nvmecli-target.sock"
DISC_NQN = "nqn.2014-08.org.nvmexpress.discovery"

TARGET_TOML = f"""\
[control]
socket = "{TARGET_SOCK}"

[[port]]
id = 1
transport = "tcp"
address = "{ADDR0}"
port = 4420

[[port]]
id = 2
transport = "tcp"
address = "{ADDR0}"
port = {LISTING}
discovery = "all"

[[port]]
id = 3
transport = "tcp"
address = "{ADDR0}"
port = {REFERRING}

[[port.referral]]
transport = "tcp"
address = "{ADDR0}"
port = 4420
port_id = 1

[[subsystem]]
nqn = "{NQN}"
serial = "BLOCKDNVMECLI1"
model = "blockd nvme-cli test"
allow_any_host = true
ports = [1]

[[subsystem.namespace]]
nsid = 1
path = "{VOL}"
size = "32MiB"
"""


def blockctl(*args: str, check: bool = True) -> str:
    return sh(shlex.join([tool("blockctl"), "--socket", SOCK, *args]), timeout=180, check=check)


def nvme_json(cmd: str) -> Any:
    return json.loads(sh(f"nvme {cmd} -o json", timeout=120))


def khost_ctrls(nqn: str) -> list[str]:
    """The kernel host's controllers (nvmeX) connected to ``nqn``."""
    out = sh(f"for c in /sys/class/nvme-fabrics/ctl/nvme*; do [ -e $c/subsysnqn ] && "
             f"[ \"$(cat $c/subsysnqn)\" = {shlex.quote(nqn)} ] && basename $c; done; true")
    return sorted(out.split())


@pytest.fixture(scope="module")
def kernel_target(rxe):
    """nvmet exporting KNQN (a 64 MiB file) on ADDR0:KPORT."""
    sh("modprobe nvme-tcp")
    sh(f"rm -f {KVOL} && truncate -s 64M {KVOL} && nvmet_subsys {KNQN} KERNELNVMECLI && "
       f"nvmet_ns_file {KNQN} 1 {KVOL} && nvmet_port 9 tcp {ADDR0} {KPORT} && nvmet_link 9 {KNQN}")
    wait_tcp(ADDR0, KPORT, timeout=30, what="kernel nvmet-tcp")
    yield
    sh(f"nvme disconnect -n {KNQN}; nvmet_teardown", check=False)


@pytest.fixture(scope="module")
def blockd_target(rxe):
    RESULTS.mkdir(parents=True, exist_ok=True)
    cfg = RESULTS / "nvmecli-target.toml"
    cfg.write_text(TARGET_TOML)
    Path(VOL).unlink(missing_ok=True)
    sh(f"truncate -s 32M {VOL}")
    d = start_target("blockd-target-nvmecli", cfg)
    for port in (LISTING, REFERRING):
        wait_tcp(ADDR0, port, timeout=60, proc=d.proc, what="blockd target")
    yield d
    sh(f"nvme disconnect -n {NQN}", check=False)
    d.stop()


@pytest.fixture(scope="module")
def blockd_initiator():
    os.makedirs(os.path.dirname(SOCK), exist_ok=True)
    d = Daemon("blockd-initiator-nvmecli", [tool("blockd"), "initiator", "--socket", SOCK])
    wait_path(SOCK, timeout=120, proc=d.proc, what="blockd initiator")
    yield d
    d.stop()


def _golden(ours: dict[str, Any], theirs: dict[str, Any], skip: set[str], what: str) -> None:
    """Every field blockctl prints is one nvme-cli prints, with the same value (``skip``: those
    that differ by nature, e.g. the controller id of two different controllers)."""
    foreign = sorted(set(ours) - set(theirs))
    assert not foreign, f"{what}: blockctl fields nvme-cli does not have: {foreign}"
    differ = {k: (ours[k], theirs[k]) for k in ours if k not in skip and ours[k] != theirs[k]}
    assert not differ, f"{what}: (blockctl, nvme-cli) differ: {differ}"
    print(f"{what}: {len(ours)} fields equal to nvme-cli's ({len(theirs)} in nvme-cli's report)")


def _json_as_nvme_cli_prints_it(which: str) -> None:
    """blockctl discover, id-ctrl, id-ns and list with -o json against nvme-cli -o json, both
    looking at the same subsystem (the kernel's nvmet, or blockd's target): the same names,
    the same values."""
    nqn, port = (KNQN, KPORT) if which == "nvmet" else (NQN, 4420)
    ours_log = json.loads(blockctl("discover", "-t", "tcp", "-a", ADDR0, "-s", str(port), "-o", "json"))
    theirs_log = nvme_json(f"discover -t tcp -a {ADDR0} -s {port}")
    assert ours_log == theirs_log

    dev = sh(f"nvmeh_connect tcp {ADDR0} {port} {nqn}", timeout=120).strip().splitlines()[-1]
    blockctl("connect", "-t", "tcp", "-a", ADDR0, "-s", str(port), "-n", nqn, "--name", which, "-i", "1")
    try:
        ctrl = sh(f"nvmeh_ctrl {nqn}").strip()
        _golden(json.loads(blockctl("id-ctrl", which, "-o", "json")), nvme_json(f"id-ctrl /dev/{ctrl}"),
                {"cntlid"}, f"{which} id-ctrl")
        _golden(json.loads(blockctl("id-ns", which, "-N", "1", "-o", "json")), nvme_json(f"id-ns {dev}"),
                set(), f"{which} id-ns")
        ours = [d for d in json.loads(blockctl("list", "-o", "json"))["Devices"] if d["Connection"] == which]
        theirs = [d for d in nvme_json("list")["Devices"] if d["DevicePath"] == dev]
        assert len(ours) == len(theirs) == 1, (ours, theirs)
        shared = {k: v for k, v in ours[0].items() if k in theirs[0]}
        assert set(shared) == {"NameSpace", "Firmware", "ModelNumber", "SerialNumber", "UsedBytes", "MaximumLBA",
                               "PhysicalSize", "SectorSize"}, ours
        _golden(shared, theirs[0], set(), f"{which} list")
    finally:
        blockctl("disconnect", which, check=False)
        sh(f"nvme disconnect -n {nqn}", check=False)


def test_json_as_nvme_cli_prints_it_nvmet(kernel_target, blockd_initiator):
    _json_as_nvme_cli_prints_it("nvmet")


def test_json_as_nvme_cli_prints_it_blockd(blockd_target, blockd_initiator):
    _json_as_nvme_cli_prints_it("blockd")


def test_khost_discover_on_8009_finds_the_volume(blockd_target):
    """The kernel host's nvme discover on the listing port (8009, no subsystem of its own)
    finds the subsystem at its I/O port; blockctl prints the same JSON."""
    records = nvme_json(f"discover -t tcp -a {ADDR0} -s {LISTING}")["records"]
    assert [(r["subtype"], r["subnqn"], r["trsvcid"], r["portid"]) for r in records] == [
        ("current discovery subsystem", DISC_NQN, str(LISTING), 2), ("nvme subsystem", NQN, "4420", 1)]
    ours = json.loads(blockctl("discover", "-t", "tcp", "-a", ADDR0, "-s", str(LISTING), "-o", "json"))
    assert ours["records"] == records


def test_khost_discover_referral(blockd_target):
    """On the referring port the kernel host's nvme discover shows nvmet's referral entry."""
    records = nvme_json(f"discover -t tcp -a {ADDR0} -s {REFERRING}")["records"]
    assert records[1:] == [{"trtype": "tcp", "adrfam": "ipv4", "subtype": "discovery subsystem referral",
                            "treq": "not specified", "portid": 1, "trsvcid": "4420", "subnqn": DISC_NQN,
                            "traddr": ADDR0, "eflags": "none", "sectype": "none"}], records


def _khost_connect_all(port: int) -> None:
    """nvme connect-all on a discovery port connects the volume (through the listing, or by
    following the referral); a second run connects nothing more."""
    assert khost_ctrls(NQN) == []
    try:
        sh(f"nvme connect-all -t tcp -a {ADDR0} -s {port}", timeout=120)
        first = khost_ctrls(NQN)
        assert len(first) == 1, first
        sh(f"nvme connect-all -t tcp -a {ADDR0} -s {port}", timeout=120)
        assert khost_ctrls(NQN) == first
    finally:
        sh(f"nvme disconnect -n {NQN}", check=False)


def test_khost_connect_all_listing(blockd_target):
    _khost_connect_all(LISTING)


def test_khost_connect_all_referral(blockd_target):
    _khost_connect_all(REFERRING)


def test_connect_all_from_discovery_conf(blockd_target, blockd_initiator):
    """The same /etc/nvme/discovery.conf serves nvme connect-all and blockctl connect-all; a
    second blockctl connect-all finds the volume connected already."""
    conf = Path("/etc/nvme/discovery.conf")
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text(f"# written by test_nvmecli\n-t tcp -a {ADDR0} -s {REFERRING}\n")
    try:
        sh("nvme connect-all", timeout=120)
        assert len(khost_ctrls(NQN)) == 1
        report = json.loads(blockctl("connect-all", "-i", "1", "-o", "json"))["connections"]
        assert [(r["subnqn"], r["trsvcid"], r["result"]) for r in report] == [(NQN, "4420", "connected")]
        again = json.loads(blockctl("connect-all", "-o", "json"))["connections"]
        assert [r["result"] for r in again] == ["already connected"]
        listed = json.loads(blockctl("list", "-o", "json"))["Devices"]
        assert [(d["SubsystemNQN"], d["State"]) for d in listed] == [(NQN, "live")]
    finally:
        conf.unlink()
        blockctl("disconnect", NQN, check=False)
        sh(f"nvme disconnect -n {NQN}", check=False)


# ---------------------------------- error statuses: blockd beside nvmet, the same commands ---
STATUS_NQN = "nqn.2026-11.io.blockd:nvmecli-status"
STATUS_VOL = "/dev/shm/nvmecli-status.img"
STATUS_PORT = 4430
STATUS_TOML = f"""\
[control]
socket = ""

[[port]]
transport = "tcp"
address = "{ADDR0}"
port = {STATUS_PORT}

[[subsystem]]
nqn = "{STATUS_NQN}"
allow_any_host = true

[[subsystem.namespace]]
nsid = 1
path = "{STATUS_VOL}"
size = "64MiB"
block_size = 4096
"""
"""Like the kernel target's file namespace: 64 MiB of 4096-byte blocks (nvmet picks 4 KiB)."""

END = (64 << 20) // 4096  # the first block past the end of either namespace

ERROR_CASES = {
    # admin commands, on the controller (nvme admin-passthru)
    "vendor admin opcode": "admin-passthru {ctrl} --opcode=0xc0",
    "identify unknown cns": "admin-passthru {ctrl} --opcode=0x06 --cdw10=0x7f --data-len=4096 -r",
    "identify ns 0xffffffff": "admin-passthru {ctrl} --opcode=0x06 --namespace-id=0xffffffff --data-len=4096 -r",
    "identify ns not there": "admin-passthru {ctrl} --opcode=0x06 --namespace-id=0xdead --data-len=4096 -r",
    "get log page unknown lid": "admin-passthru {ctrl} --opcode=0x02 --cdw10=$((0x7f | 127 << 16)) --data-len=512 -r",
    "get log page past the end": "admin-passthru {ctrl} --opcode=0x02 --cdw10=$((0x0c | 127 << 16)) --cdw12=8192 "
                                 "--data-len=512 -r",
    "get features unknown fid": "admin-passthru {ctrl} --opcode=0x0a --cdw10=0x7e",
    "set features unknown fid": "admin-passthru {ctrl} --opcode=0x09 --cdw10=0x7e",
    "set features save": "admin-passthru {ctrl} --opcode=0x09 --cdw10=$((0x07 | 1 << 31)) --cdw11=0x00010001",
    "abort": "admin-passthru {ctrl} --opcode=0x08 --cdw10=0x00010000",
    # I/O commands, on the namespace (nvme io-passthru)
    "vendor io opcode": "io-passthru {dev} --opcode=0x80 --namespace-id=1",
    "read past the end": f"io-passthru {{dev}} --opcode=0x02 --namespace-id=1 --cdw10={END} --data-len=4096 -r",
    "read across the end": f"io-passthru {{dev}} --opcode=0x02 --namespace-id=1 --cdw10={END - 1} --cdw12=1 "
                           "--data-len=8192 -r",
    "read data length differs": "io-passthru {dev} --opcode=0x02 --namespace-id=1 --data-len=8192 -r",
    "write past the end": f"io-passthru {{dev}} --opcode=0x01 --namespace-id=1 --cdw10={END} --data-len=4096 -w "
                          "-i /dev/zero",
    "write zeroes past the end": f"io-passthru {{dev}} --opcode=0x08 --namespace-id=1 --cdw10={END}",
    "dsm range past the end": "io-passthru {dev} --opcode=0x09 --namespace-id=1 --cdw11=4 --data-len=16 -w "
                              "-i {dsm}",
}
"""Malformed or refused commands, as nvme-cli sends them: each to nvmet's subsystem and to
blockd's, compared by status (DNR and More included) and the Error Information entry behind it.
An I/O command for another NSID cannot be sent this way (the kernel refuses a passthrough whose
NSID is not the device's, EINVAL): the raw client's cases below have those."""

_PAST_END = ((0x6080, (0x4080, 40)), (0x6081, (0x4081, 48)))
"""blockd: LBA Out of Range at SLBA; nvmet's file backend: Capacity Exceeded at NLB (ENOSPC)."""

STATUS_DIFFERENCES: dict[str, tuple[Any, Any]] = {
    "identify ns not there": ((0x600B, (0x400B, 4)), (0, None)),  # nvmet: zeroes for an NSID past NN
    "get log page past the end": ((0x6002, (0x4002, 40)), (0, None)),  # nvmet ignores the ANA log's LPO
    "set features save": ((0x610D, (0x410D, 40)), (0, None)),  # nvmet ignores SV
    "read past the end": _PAST_END,
    "read across the end": _PAST_END,
    "write past the end": _PAST_END,
    "write zeroes past the end": _PAST_END,
    "dsm range past the end": _PAST_END,
}
"""Cases where blockd answers otherwise than nvmet (Linux 6.1, measured 2026-12-07), each right by
the spec (docs/wire-facts.md, "Error statuses beside nvmet"): case -> (blockd's, nvmet's)."""


def _answer(cmd: str, ctrl: str) -> tuple[int, Any]:
    """nvme-cli's status for ``cmd`` (0 for success) and what the Error Information log got
    for it: None when no entry was added, else (status field, parameter error location)."""
    before = json.loads(sh(f"nvme error-log /dev/{ctrl} -e 1 -o json"))["errors"][0]["error_count"]
    r = subprocess.run(["bash", "-c", f"nvme {cmd}"], capture_output=True, text=True, timeout=120)
    print(f"$ nvme {cmd}\n[exit {r.returncode}]\n{r.stdout[-400:]}{r.stderr[-400:]}")
    m = re.search(r"NVMe status: .*\((0x[0-9a-fA-F]+)\)", r.stdout + r.stderr)
    assert m or r.returncode == 0, f"nvme {cmd}: neither success nor an NVMe status\n{r.stdout}{r.stderr}"
    status = int(m.group(1), 16) if m else 0
    newest = json.loads(sh(f"nvme error-log /dev/{ctrl} -e 1 -o json"))["errors"][0]
    entry = None if newest["error_count"] == before else (newest["status_field"], newest["parm_error_location"])
    return status, entry


def test_error_statuses_as_nvmet(rxe, kernel_target, scratch):
    """Every ERROR_CASES command gets from blockd the status nvmet gives (More only with an
    Error Information entry, the same entry), except the documented STATUS_DIFFERENCES."""
    Path(STATUS_VOL).unlink(missing_ok=True)
    sh(f"truncate -s 64M {STATUS_VOL}")
    cfg = RESULTS / "nvmecli-status.toml"
    cfg.write_text(STATUS_TOML)
    dsm = f"{scratch}/dsm-range"
    Path(dsm).write_bytes(bytes(4) + (8).to_bytes(4, "little") + END.to_bytes(8, "little"))  # 8 blocks at END
    target = start_target("blockd-target-status", cfg, STATUS_PORT)
    seen: dict[str, dict[str, Any]] = {}
    try:
        for name, (nqn, port) in (("blockd", (STATUS_NQN, STATUS_PORT)), ("nvmet", (KNQN, KPORT))):
            dev = sh(f"nvmeh_connect tcp {ADDR0} {port} {nqn}", timeout=120).strip().splitlines()[-1]
            try:
                ctrl = sh(f"nvmeh_ctrl {nqn}").strip()
                seen[name] = {case: _answer(cmd.format(ctrl=f"/dev/{ctrl}", dev=dev, dsm=dsm), ctrl)
                              for case, cmd in ERROR_CASES.items()}
            finally:
                sh(f"nvme disconnect -n {nqn}", check=False)
    finally:
        target.stop()
    table = [f"{case:<28} blockd {seen['blockd'][case]!s:<24} nvmet {seen['nvmet'][case]!s}" for case in ERROR_CASES]
    print("\n".join(table))
    (RESULTS / "error-statuses.txt").write_text("\n".join(table) + "\n")
    differ = {case: (seen["blockd"][case], seen["nvmet"][case]) for case in ERROR_CASES
              if seen["blockd"][case] != seen["nvmet"][case]}
    assert differ == STATUS_DIFFERENCES


# ---------------------------------- the raw NVMe/TCP client's cases against nvmet ---
RAW_PORT = 4440
RAW_KINDS = ("fresh", "admin-disabled", "admin", "io")
"""tests/core/test_hostile.py's COMMAND_CASES of these queue kinds (the others need their own
set-up there) run unchanged against nvmet; there each one's status is blockd's, checked."""

_INTERNAL = 0xC00C
"""nvmet's block-device backend past the end: the bio fails, Internal Error (with More)."""

RAW_DIFFERENCES: dict[str, tuple[Any, Any]] = {
    "connect-admin-sqsize-too-big": (0x8304, 0),  # nvmet takes an admin SQ past the ASQSZ it advertises
    "get-log-odd-lpo": (0xC004, 0xC016),  # we check the LPO first, nvmet the SMART log's NSID 0
    "identify-ns-invalid": (0xC016, 0),  # nvmet: zeroes for an NSID past NN
    "identify-ns-list-ffffffff": (0xC016, 0),  # nvmet: an empty list for NSID FFFFFFFFh
    "io-dsm-range-near-2^64": (0xC100, _INTERNAL),
    "io-dsm-range-past-end": (0xC100, _INTERNAL),
    "io-flush-with-data": (0xC004, 0x8004),  # nvmet-tcp's check has no error location: no More
    "io-incapsule-more-than-sent": (0x802C, "no completion (TimeoutError)"),  # nvmet waits for the rest
    "io-incapsule-offset": (0x802C, "no completion (AssertionError)"),  # nvmet closes the connection
    "io-incapsule-read": (0xC004, 0x8004),
    "io-lba-near-2^64-read": (0xC100, _INTERNAL),
    "io-lba-near-2^64-write": (0xC100, _INTERNAL),
    "io-lba-past-end": (0xC100, _INTERNAL),
    "io-lba-straddles-end": (0xC100, _INTERNAL),
    "io-lba-wraps-2^64-write": (0xC100, _INTERNAL),
    "io-read-over-mdts": (0xC01E, 0),  # nvmet-tcp has no MDTS; ours is 1 MiB
    "io-sgl-keyed-over-tcp": (0x8022, 0),  # nvmet-tcp takes any SGL type as a transport data block
    "io-sgl-last-segment": (0x8022, 0),
    "io-sgl-type0-bad-subtype": (0xC004, 0),
    "io-write-zeroes-near-2^64": (0xC100, _INTERNAL),
    "io-write-zeroes-past-end": (0xC100, _INTERNAL),
    "io-write-zeroes-with-data": (0xC004, 0x8004),
    "second-connect": (0x8018, 0xC002),  # nvmet: a Connect on a connected queue is an unknown opcode
}
"""Raw cases where nvmet (Linux 6.1, measured 2026-12-07) answers otherwise than blockd, each
justified in docs/wire-facts.md, "Error statuses beside nvmet": case -> (blockd's wire status,
nvmet's answer)."""


def test_raw_command_statuses_as_nvmet(rxe, scratch):
    """The raw client's malformed commands (the exact bytes of test_hostile's table) sent to
    nvmet: every status as blockd answers it, but the documented RAW_DIFFERENCES."""
    import asyncio

    from tests.core.conftest import NQN as RAW_NQN
    from tests.core.test_hostile import COMMAND_CASES, SIZE, _queue_for

    vol = f"{scratch}/raw.img"
    sh(f"truncate -s {SIZE} {vol} && modprobe loop")
    loop = sh(f"losetup -f --show {vol}").strip()
    sh(f"nvmet_subsys {RAW_NQN} RAWPEER && nvmet_ns_file {RAW_NQN} 1 {loop} 0 && "
       f"nvmet_port 8 tcp 127.0.0.1 {RAW_PORT} && nvmet_link 8 {RAW_NQN}")
    wait_tcp("127.0.0.1", RAW_PORT, timeout=30, what="kernel nvmet-tcp (raw cases)")

    async def answer(kind: str, sqe: bytes, data: bytes) -> Any:
        conn, others, _ = await _queue_for(kind, RAW_PORT)
        try:
            status, *_ = await conn.command(sqe, data, timeout=10)
            return status
        except (AssertionError, asyncio.TimeoutError) as exc:
            return f"no completion ({type(exc).__name__})"
        finally:
            for c in [conn, *others]:
                await c.close()

    seen = {}
    try:
        for name, (kind, sqe, data, want, *_) in sorted(COMMAND_CASES.items()):
            if kind in RAW_KINDS:
                got = asyncio.run(answer(kind, sqe, data))
                seen[name] = (want, got)
    finally:
        sh(f"nvmet_unlink 8 {RAW_NQN}; rmdir /sys/kernel/config/nvmet/ports/8; "
           f"echo 0 >/sys/kernel/config/nvmet/subsystems/{RAW_NQN}/namespaces/1/enable; "
           f"rmdir /sys/kernel/config/nvmet/subsystems/{RAW_NQN}/namespaces/1 "
           f"/sys/kernel/config/nvmet/subsystems/{RAW_NQN}; losetup -d {loop}", check=False)
    table = [f"{name:<36} blockd {want:#06x}  nvmet " + (f"{got:#06x}" if isinstance(got, int) else got)
             for name, (want, got) in seen.items()]
    print("\n".join(table))
    (RESULTS / "raw-statuses.txt").write_text("\n".join(table) + "\n")
    differ = {name: (want, got) for name, (want, got) in seen.items() if want != got}
    # nvmet's answer to a non-zero in-capsule offset depends on timing: it closed the connection
    # in the helper's runs and completed the write (status 0) in a CI run (2026-12-07); blockd's
    # Invalid SGL Offset is the spec's answer either way
    if differ.get("io-incapsule-offset", (None, None))[1] == 0:
        differ["io-incapsule-offset"] = RAW_DIFFERENCES["io-incapsule-offset"]
    assert differ == RAW_DIFFERENCES
