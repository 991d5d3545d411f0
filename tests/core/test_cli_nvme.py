"""nvme-cli's habits in blockctl (issue 39): ``-o json`` on the host verbs, referrals and the
"all" listing of a discovery port, ``connect-all`` (discovery.conf, [[discovery]]), the progress
bar on a terminal. The real daemons and blockctl as subprocesses, on loopback.

The VM group tests/vm/test_nvmecli.py holds the same reports up against nvme-cli's own JSON.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import termios
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from blockd.config import ConfigError
from target.config import idle_ports, parse

from .conftest import HOSTNQN, NQN, NQN2, free_port
from .test_cli import BIN, SIZE, Env, one_line_error, wait_path, wait_port

DISC_NQN = "nqn.2014-08.org.nvmexpress.discovery"


def _json(res: subprocess.CompletedProcess) -> Any:
    return json.loads(res.stdout)


class DiscEnv(Env):
    """Env's target plus a discovery-only port with a referral to the I/O port, one listing
    every port (``discovery = "all"``), and one serving nothing; and a control socket."""

    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp)
        self.referring, self.listing, self.idle = free_port(), free_port(), free_port()
        self.target_sock = tmp / "target.sock"
        text = self.config.read_text().replace('allow_any_host = false', 'allow_any_host = false\nports = [1]')
        text = text.replace(f'[[port]]\ntransport = "tcp"\naddress = "127.0.0.1"\nport = {self.port}\n',
                            f'[control]\nsocket = "{self.target_sock}"\n\n'
                            f'[[port]]\nid = 1\ntransport = "tcp"\naddress = "127.0.0.1"\nport = {self.port}\n\n'
                            f'[[port]]\nid = 2\ntransport = "tcp"\naddress = "127.0.0.1"\nport = {self.referring}\n'
                            f'[[port.referral]]\ntransport = "tcp"\naddress = "127.0.0.1"\nport = {self.port}\n'
                            f'port_id = 1\n\n'
                            f'[[port]]\nid = 3\ntransport = "tcp"\naddress = "127.0.0.1"\nport = {self.listing}\n'
                            f'discovery = "all"\n\n'
                            f'[[port]]\nid = 4\ntransport = "tcp"\naddress = "127.0.0.1"\nport = {self.idle}\n', 1)
        text = text.replace(f'nqn = "{NQN}"\n', f'nqn = "{NQN}"\nports = [1]\n', 1)
        self.config.write_text(text)

    def start_target(self) -> subprocess.Popen:
        super().start_target()
        assert self.target is not None
        for port in (self.referring, self.listing, self.idle):
            wait_port(port, self.target)
        wait_path(self.target_sock, self.target)
        return self.target


@pytest.fixture
def denv(tmp_path: Path) -> Iterator[DiscEnv]:
    with DiscEnv(tmp_path) as e:
        yield e


def _discover(env: Env, port: int, *extra: str) -> dict[str, Any]:
    return _json(env.ok("discover", "-a", "127.0.0.1", "-s", str(port), "-q", HOSTNQN, "-o", "json", *extra))


def test_json_on_every_host_verb(denv: DiscEnv, tmp_path: Path) -> None:
    """Each host verb's -o json parses, with nvme-cli's names and forms where nvme-cli has the
    report; the target verbs take -o json and --json alike."""
    log = _discover(denv, denv.port)
    assert isinstance(log["genctr"], int) and [r["subtype"] for r in log["records"]] == [
        "current discovery subsystem", "nvme subsystem"]
    rec = log["records"][1]
    assert rec == {"trtype": "tcp", "adrfam": "ipv4", "subtype": "nvme subsystem",
                   "treq": "not specified, sq flow control disable supported", "portid": 1,
                   "trsvcid": str(denv.port), "subnqn": NQN, "traddr": "127.0.0.1", "eflags": "none",
                   "sectype": "none"}
    text = denv.ok("discover", "-a", "127.0.0.1", "-s", str(denv.port), "-q", HOSTNQN).stdout.decode()
    assert f"Discovery Log Number of Records 2, Generation counter {log['genctr']}" in text
    assert "subtype: nvme subsystem" in text and "treq:    not specified, sq flow" in text

    conn = _json(denv.ok("connect", "-a", "127.0.0.1", "-s", str(denv.port), "-n", NQN, "-q", HOSTNQN,
                         "--name", "vol", "-i", "1", "-o", "json"))
    assert conn["name"] == "vol" and conn["nqn"] == NQN and conn["cntlid"] >= 1

    ctrl = _json(denv.ok("id-ctrl", "vol", "-o", "json"))
    assert ctrl["sn"] == "CLITEST01".ljust(20) and ctrl["mn"] == "blockd cli test".ljust(40)
    assert ctrl["subnqn"] == NQN and ctrl["cntlid"] == conn["cntlid"] and ctrl["ieee"] == 0
    assert ctrl["fguid"] == "00000000-0000-0000-0000-000000000000" and ctrl["tnvmcap"] == "0"
    assert len(ctrl["psds"]) == ctrl["npss"] + 1 and "psd" not in ctrl
    ns = _json(denv.ok("id-ns", "vol", "-N", "1", "-o", "json"))
    assert ns["nsze"] == SIZE // 512 and ns["lbafs"] == [{"ms": 0, "ds": 9, "rp": 0}] and "lbaf" not in ns
    assert isinstance(ns["nguid"], str) and len(ns["nguid"]) == 32

    devices = _json(denv.ok("list", "-o", "json"))["Devices"]
    assert devices == [{"NameSpace": 1, "Firmware": ctrl["fr"].strip(), "ModelNumber": "blockd cli test",
                        "SerialNumber": "CLITEST01", "UsedBytes": ns["nuse"] * 512, "MaximumLBA": SIZE // 512,
                        "PhysicalSize": SIZE, "SectorSize": 512, "Connection": "vol", "SubsystemNQN": NQN,
                        "Transport": "tcp", "Address": f"traddr=127.0.0.1,trsvcid={denv.port}",
                        "Controller": conn["cntlid"], "State": "live", "ReadOnly": False}]
    assert _json(denv.ok("mounts", "-o", "json")) == {"mounts": []}
    lines = denv.ok("iostat", "--initiator", "-o", "json", "0.2", "2").stdout.decode().splitlines()
    assert len(lines) == 2 and [json.loads(x)["connections"][0]["name"] for x in lines] == ["vol", "vol"]

    sock = ["target", "--target-socket", str(denv.target_sock)]
    for verb in ("status", "hosts", "namespaces"):
        by_o = _json(denv.ok(*sock, verb, "-o", "json"))
        assert by_o == _json(denv.ok(*sock, verb, "--json")), verb
    assert [h["hostnqn"] for h in _json(denv.ok(*sock, "hosts", "-o", "json"))["hosts"]] == [HOSTNQN]
    targets = [json.loads(x) for x in denv.ok("iostat", "--target-socket", str(denv.target_sock), "-o", "json",
                                              "0.2", "1").stdout.decode().splitlines()]
    assert [(n["subsystem"], n["nsid"]) for n in targets[0]["namespaces"]] == [(NQN, 1), (NQN2, 1)]
    bad = denv.ctl("list", "-o", "yaml")  # argparse's usage line, then the error
    assert bad.returncode == 2 and "-o/--output-format: invalid choice: 'yaml'" in bad.stderr.decode()


def test_referral_and_listing_ports(denv: DiscEnv) -> None:
    """A discovery-only port refers hosts to the I/O port as nvmet does (referral entry, TREQ
    not specified, the configured PORTID); a port with discovery = "all" lists every allowed
    subsystem at each port that exports it; the idle port lists only itself and the target
    warned about it at start."""
    referring = _discover(denv, denv.referring)["records"]
    assert [(r["subtype"], r["subnqn"], r["trsvcid"], r["portid"], r["treq"]) for r in referring] == [
        ("current discovery subsystem", DISC_NQN, str(denv.referring), 2,
         "not specified, sq flow control disable supported"),
        ("discovery subsystem referral", DISC_NQN, str(denv.port), 1, "not specified")]
    listing = _discover(denv, denv.listing)["records"]
    assert [(r["subtype"], r["subnqn"], r["trsvcid"], r["portid"]) for r in listing] == [
        ("current discovery subsystem", DISC_NQN, str(denv.listing), 3),
        ("nvme subsystem", NQN, str(denv.port), 1)]  # NQN2 does not allow HOSTNQN
    other = "nqn.2014-08.org.nvmexpress:uuid:someone-else"
    assert [(r["subnqn"], r["trsvcid"]) for r in _discover(denv, denv.listing, "-q", other)["records"][1:]] == [
        (NQN, str(denv.port)), (NQN2, str(denv.port))]
    assert [r["subtype"] for r in _discover(denv, denv.idle)["records"]] == ["current discovery subsystem"]
    log = (denv.tmp / "target.log").read_text()
    warned = [line for line in log.splitlines() if "port serves nothing" in line]
    assert len(warned) == 1 and f":{denv.idle}" in warned[0], log


def test_connect_all(denv: DiscEnv, tmp_path: Path) -> None:
    """connect-all follows the referral to the I/O port and connects what it lists; again, it
    connects nothing new; from discovery.conf (nvme-cli's lines) and from [[discovery]] alike."""
    first = _json(denv.ok("connect-all", "-a", "127.0.0.1", "-s", str(denv.referring), "-q", HOSTNQN,
                          "-i", "1", "--discovery-conf", str(tmp_path / "none"), "-o", "json"))
    assert [(r["subnqn"], r["trsvcid"], r["result"]) for r in first["connections"]] == [
        (NQN, str(denv.port), "connected")]
    conns = _json(denv.ok("list", "-o", "json"))["Devices"]
    assert [(d["Connection"], d["SubsystemNQN"], d["State"]) for d in conns] == [(NQN, NQN, "live")]
    again = denv.ok("connect-all", "-a", "127.0.0.1", "-s", str(denv.listing), "-q", HOSTNQN).stdout.decode()
    assert again.strip() == f"tcp://127.0.0.1:{denv.port} {NQN}: already connected"
    denv.ok("disconnect", NQN)

    conf = tmp_path / "discovery.conf"
    conf.write_text(f"# nvme-cli's format\n\n-t tcp -a 127.0.0.1 -s {denv.referring} -q {HOSTNQN}  # referral\n"
                    f"--transport=tcp --traddr=127.0.0.1 --trsvcid={denv.listing} --hostnqn={HOSTNQN} -i 1\n")
    out = _json(denv.ok("connect-all", "--discovery-conf", str(conf), "-o", "json"))
    assert [r["result"] for r in out["connections"]] == ["connected"] and out["discovery_failures"] == []
    assert _json(denv.ok("list", "-o", "json"))["Devices"][0]["Connection"] == NQN
    denv.ok("disconnect", NQN)

    cfg = tmp_path / "initiator.toml"
    cfg.write_text(f'[[discovery]]\ntraddr = "127.0.0.1"\ntrsvcid = {denv.listing}\nhostnqn = "{HOSTNQN}"\n')
    out = _json(denv.ok("connect-all", "--discovery-conf", str(tmp_path / "none"), "--config", str(cfg),
                        "-o", "json"))
    assert [(r["subnqn"], r["result"]) for r in out["connections"]] == [(NQN, "connected")]

    conf.write_text("-t tcp -a 127.0.0.1 -w 10.0.0.1\n")
    one_line_error(denv.ctl("connect-all", "--discovery-conf", str(conf)), f"{conf}:1", "unsupported -w")
    conf.write_text("-t tcp -s 8009\n")
    one_line_error(denv.ctl("connect-all", "--discovery-conf", str(conf)), f"{conf}:1", "-a")
    one_line_error(denv.ctl("connect-all", "--discovery-conf", str(tmp_path / "none")), "no discovery controller")
    dead = free_port()
    res = denv.ctl("connect-all", "-a", "127.0.0.1", "-s", str(dead), "-q", HOSTNQN)
    assert res.returncode == 1 and f"127.0.0.1:{dead}" in res.stderr.decode(), res.stderr


def test_port_options_in_the_config() -> None:
    """Referral and listing settings are checked; idle_ports names exactly the ports that serve
    nothing."""
    def cfg(ports: list[dict[str, Any]], subsystems: list[dict[str, Any]] | None = None) -> Any:
        return parse({"port": [{"transport": "tcp", "address": "127.0.0.1", **p} for p in ports],
                      "subsystem": subsystems or []}, "t")
    sub = {"nqn": NQN, "ports": [1]}
    assert idle_ports(cfg([{"port": 1}, {"port": 2}], [sub])) == [cfg([{"port": 1}, {"port": 2}]).ports[1]]
    assert idle_ports(cfg([{"port": 1}, {"port": 2, "discovery": "all"}], [sub])) == []
    assert [p.port_id for p in idle_ports(cfg([{"port": 1}, {"port": 2, "discovery": "all"}]))] == [1, 2]
    referring = cfg([{"port": 1}, {"port": 2, "referral": [{"address": "192.0.2.1", "port": 4420}]}], [sub])
    assert idle_ports(referring) == [] and referring.ports[1].referrals[0].port_id == 0
    for bad, needle in (({"discovery": "some"}, "discovery must be one of port, all"),
                        ({"referral": [{"address": "x"}]}, "missing 'port'"),
                        ({"referral": [{"address": "x", "port": 0}]}, "out of range"),
                        ({"referral": [{"address": "x", "port": 1, "port_id": 70000}]}, "port_id"),
                        ({"referral": [{"address": "x", "port": 1, "nqn": "y"}]}, "unknown setting"),
                        ({"referral": ["x"]}, "must be a table")):
        with pytest.raises(ConfigError, match=needle):
            cfg([{"port": 1, **bad}])


def _on_a_pty(env: Env, *args: str, stdin: bytes | None = None) -> tuple[int, str]:
    """blockctl with its stderr on a pseudo-terminal: exit status, what the terminal got."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal has a size
    try:
        proc = subprocess.Popen([str(BIN / "blockctl"), "--socket", str(env.sock), *args], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=slave)
        os.close(slave)
        proc.stdin.write(stdin or b"")  # type: ignore[union-attr]
        proc.stdin.close()  # type: ignore[union-attr]
        seen = bytearray()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not chunk:
                break
            seen += chunk
        proc.stdout.read()  # type: ignore[union-attr]
        return proc.wait(30), seen.decode(errors="replace")
    finally:
        os.close(master)


@pytest.fixture
def big_env(tmp_path: Path) -> Iterator[Env]:
    """Env with a 16 MiB namespace (a bar shows from PROGRESS_MIN, 8 MiB)."""
    e = Env(tmp_path)
    e.config.write_text(e.config.read_text().replace(f'size = "{SIZE}"', f'size = "{BIG}"', 1))
    with e:
        yield e


BIG = 16 << 20


def test_progress_on_a_terminal(big_env: Env, tmp_path: Path) -> None:
    """A 16 MiB write and read show tqdm's bar (bytes, rate, ETA) on a terminal; -q, a small
    transfer or a stderr that is a pipe show none."""
    env = big_env
    env.ok("connect", "-a", "127.0.0.1", "-s", str(env.port), "-n", NQN, "-q", HOSTNQN, "--name", "vol", "-i", "1")
    big = BIG
    data = os.urandom(big)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    rc, seen = _on_a_pty(env, "write", "vol", "-i", str(src))
    assert rc == 0, seen
    # tqdm's line: percent, bytes done/total, [elapsed<ETA, rate]
    assert re.search(r"100%\|.*\| 16\.0M/16\.0M \[\d\d:\d\d<\d\d:\d\d, +[\d.]+[kMG]?B/s\]", seen), seen
    assert "wrote" in seen
    rc, seen = _on_a_pty(env, "read", "vol", "--length", str(big), "-o", str(tmp_path / "back.bin"))
    assert rc == 0 and re.search(r"100%\|.*\| 16\.0M/16\.0M \[", seen), seen
    assert (tmp_path / "back.bin").read_bytes() == data
    rc, seen = _on_a_pty(env, "write", "vol", "-q", "-i", str(src))
    assert rc == 0 and seen == "", seen
    rc, seen = _on_a_pty(env, "read", "vol", "--length", str(1 << 20), "-o", str(tmp_path / "small.bin"))
    assert rc == 0 and seen == "", seen
    res = env.ok("write", "vol", "-i", str(src))
    assert res.stderr.decode().strip() == f"wrote {big} bytes at offset 0 of namespace 1"


def test_discovery_tables_of_the_initiator_config() -> None:
    """[[discovery]]: connect options but nqn, traddr required, values checked as connect's."""
    from initiator.config import parse as parse_initiator
    ok = parse_initiator({"discovery": [{"traddr": "192.0.2.1", "trsvcid": 8009, "nr_io_queues": 2}]})
    assert [dict(d) for d in ok.discoveries] == [{"traddr": "192.0.2.1", "trsvcid": 8009, "nr_io_queues": 2}]
    for bad, needle in (({"traddr": "a", "nqn": "nqn.2026-11.io.blockd:x"}, "unknown setting.* nqn"),
                        ({"trsvcid": 8009}, "missing 'traddr'"),
                        ({"traddr": "a", "trsvcid": 70000}, "out of range"),
                        ({"traddr": "a", "colour": "red"}, "unknown setting.* colour")):
        with pytest.raises(ConfigError, match=needle):
            parse_initiator({"discovery": [bad]})


def test_rdma_discovery_record_as_nvme_cli() -> None:
    """An RDMA entry: nvme-cli's json_discovery_log puts rdma_prtype, rdma_qptype, rdma_cms
    (libnvme's names) and rdma_pkey (a number) where a TCP entry has sectype; its text prints
    the P_Key with C's %#04x."""
    from blockd.cli.nvme_json import discovery_record, discovery_text
    from initiator.discovery import DiscoveryEntry
    from protocol.logpage import TSAS_RDMA
    tsas = TSAS_RDMA.build(dict(qptype=1, prtype=4, cms=1, pkey=0xFFFF))
    e = DiscoveryEntry(1, 1, 2, 1, "4420", NQN, "192.0.2.1", 4, 0, tsas)
    record = discovery_record(e)
    assert list(record)[-4:] == ["rdma_prtype", "rdma_qptype", "rdma_cms", "rdma_pkey"] and "sectype" not in record
    assert (record["trtype"], record["rdma_prtype"], record["rdma_qptype"], record["rdma_cms"], record["rdma_pkey"]) \
        == ("rdma", "roce-v2", "connected", "rdma-cm", 0xFFFF)
    assert "rdma_pkey: 0xffff" in discovery_text(1, [e])
    assert "rdma_pkey: 0000" in discovery_text(1, [DiscoveryEntry(1, 1, 2, 1, "4420", NQN, "a", 4, 0, bytes(256))])
