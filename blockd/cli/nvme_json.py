"""blockctl's reports in nvme-cli's JSON: the field names and value forms ``nvme discover``,
``nvme id-ctrl``, ``nvme id-ns`` and ``nvme list`` print with ``-o json`` (nvme-cli 2.3 with
libnvme 1.3, Debian bookworm's, checked against it in tests/vm/guest_tests/test_nvmecli.py), so a
script written for nvme-cli reads blockctl's output unchanged.

The inputs are plain values (the initiator daemon's replies, discovery entries): this module
imports nothing of ``initiator/`` (``tests/test_layers.py``).
"""

from __future__ import annotations

import uuid
from typing import Any, Iterable

# libnvme's names for the discovery log's codes (its nvmf_*_str tables); other values: "unrecognized"
TRTYPES = {1: "rdma", 2: "fc", 3: "tcp", 254: "loop"}
ADRFAMS = {1: "ipv4", 2: "ipv6", 3: "infiniband", 4: "fibre-channel", 254: "loop"}
SUBTYPES = {1: "discovery subsystem referral", 2: "nvme subsystem", 3: "current discovery subsystem"}
TREQS = {0: "not specified", 1: "required", 2: "not required", 4: "not specified, sq flow control disable supported"}
EFLAGS = {0: "none", 1: "explicit discovery connections", 2: "duplicate discovery information",
          3: "explicit discovery connections, duplicate discovery information"}
SECTYPES = {0: "none", 1: "tls", 2: "tls13"}
RDMA_PRTYPES = {1: "not specified", 2: "infiniband", 3: "roce", 4: "roce-v2", 5: "iwarp"}
RDMA_QPTYPES = {1: "connected", 2: "datagram"}
RDMA_CMS = {1: "rdma-cm"}


def _name(table: dict[int, str], code: int) -> str:
    return table.get(code, "unrecognized")


def discovery_record(e: Any) -> dict[str, Any]:
    """One discovery log entry (``initiator.discovery.DiscoveryEntry``) as nvme-cli prints it."""
    record: dict[str, Any] = {
        "trtype": _name(TRTYPES, e.trtype), "adrfam": _name(ADRFAMS, e.adrfam),
        "subtype": _name(SUBTYPES, e.subtype), "treq": _name(TREQS, e.treq), "portid": e.portid,
        "trsvcid": e.trsvcid, "subnqn": e.subnqn, "traddr": e.traddr, "eflags": _name(EFLAGS, e.eflags),
    }
    if e.trtype == 1:  # RDMA: TSAS is QPTYPE, PRTYPE, CMS, PKEY (protocol.logpage.TSAS_RDMA)
        record.update(rdma_prtype=_name(RDMA_PRTYPES, e.tsas[1]), rdma_qptype=_name(RDMA_QPTYPES, e.tsas[0]),
                      rdma_cms=_name(RDMA_CMS, e.tsas[2]), rdma_pkey=int.from_bytes(e.tsas[8:10], "little"))
    elif e.trtype == 3:  # TCP: TSAS byte 0 is SECTYPE
        record["sectype"] = _name(SECTYPES, e.tsas[0])
    return record


def discovery_log(genctr: int, entries: Iterable[Any]) -> dict[str, Any]:
    """``nvme discover -o json``: the generation counter and the records."""
    return {"genctr": genctr, "records": [discovery_record(e) for e in entries]}


def discovery_text(genctr: int, entries: list[Any]) -> str:
    """``nvme discover``'s text: the same records, one block each."""
    lines = [f"Discovery Log Number of Records {len(entries)}, Generation counter {genctr}"]
    for n, e in enumerate(entries):
        lines.append(f"=====Discovery Log Entry {n}======")
        lines += [f"{key + ':':<8} {_c_hex(value) if key == 'rdma_pkey' else value}"
                  for key, value in discovery_record(e).items()]
    return "\n".join(lines)


def _c_hex(value: int) -> str:
    """C's ``%#04x``, as nvme-cli prints the RDMA P_Key: no 0x for zero."""
    return f"{value:#04x}" if value else "0000"


_PADDED = {"sn": 20, "mn": 40, "fr": 8}
"""nvme-cli prints these ASCII fields whole, the trailing spaces included."""
_U128_FIELDS = ("tnvmcap", "unvmcap", "megcap", "maxdna", "nvmcap")
"""128-bit counters: nvme-cli prints them as decimal strings."""
_CTRL_OWN = ("psd",)
"""Our names for what nvme-cli renames (psd becomes psds, below)."""


def id_ctrl(ident: dict[str, Any]) -> dict[str, Any]:
    """``nvme id-ctrl -o json`` from the daemon's Identify Controller (``protocol.identify``
    field names; bytes come as hex text): nvme-cli's names, in its forms."""
    out: dict[str, Any] = {}
    for key, value in ident.items():
        if key in _CTRL_OWN:
            continue
        if key in _PADDED:
            value = value.ljust(_PADDED[key])
        elif key == "ieee":  # three bytes, least significant first
            value = int.from_bytes(bytes.fromhex(value), "little")
        elif key == "fguid":
            value = str(uuid.UUID(bytes=bytes.fromhex(value)))
        elif key in _U128_FIELDS:
            value = str(value)
        out[key] = value
    out["psds"] = [{
        "max_power": p["mp"], "flags": p["flags"], "entry_lat": p["enlat"], "exit_lat": p["exlat"],
        "read_tput": p["rrt"] & 0x1F, "read_lat": p["rrl"] & 0x1F, "write_tput": p["rwt"] & 0x1F,
        "write_lat": p["rwl"] & 0x1F, "idle_power": p["idlp"], "idle_scale": p["ips"] >> 6 & 3,
        "active_power": p["actp"], "active_power_work": p["apws"] & 7, "active_scale": p["apws"] >> 6 & 3,
    } for p in ident["psd"][:ident["npss"] + 1]]
    return out


def id_ns(ident: dict[str, Any]) -> dict[str, Any]:
    """``nvme id-ns -o json`` from the daemon's Identify Namespace: the LBA formats in use
    (NLBAF + 1 of them) as ``lbafs`` with ``ds``, the IDs as hex text."""
    out: dict[str, Any] = {}
    for key, value in ident.items():
        if key == "lbaf":
            out["lbafs"] = [{"ms": f["ms"], "ds": f["lbads"], "rp": f["rp"]} for f in value[:ident["nlbaf"] + 1]]
        elif key in _U128_FIELDS:
            out[key] = str(value)
        else:
            out[key] = value
    return out


def list_devices(connections: list[dict[str, Any]]) -> dict[str, Any]:
    """``nvme list -o json``: one device per namespace of each connection. nvme-cli's fields
    (NameSpace, Firmware, ModelNumber, SerialNumber, UsedBytes, MaximumLBA, PhysicalSize,
    SectorSize) where the connection is live; DevicePath is the FUSE file when the namespace is
    mounted (there is no /dev node); the connection's own fields follow under our names."""
    devices = []
    for c in connections:
        for ns in c["namespaces"]:
            dev: dict[str, Any] = {"NameSpace": ns["nsid"]}
            if ns.get("device_path"):
                dev["DevicePath"] = ns["device_path"]
            ident = c.get("identify")
            if ident is not None:
                dev.update(Firmware=ident["fr"], ModelNumber=ident["mn"], SerialNumber=ident["sn"])
            if "nuse" in ns:
                dev["UsedBytes"] = ns["nuse"] * ns["block_size"]
            dev.update(MaximumLBA=ns["size"] // ns["block_size"], PhysicalSize=ns["size"],
                       SectorSize=ns["block_size"], Connection=c["name"], SubsystemNQN=c["nqn"],
                       Transport=c["transport"], Address=f"traddr={c['traddr']},trsvcid={c['trsvcid']}",
                       Controller=c["cntlid"], State=c["state"], ReadOnly=ns["read_only"])
            devices.append(dev)
    return {"Devices": devices}
