"""``blockctl target ...`` and ``blockctl iostat``: look at a running target through its
control socket (:mod:`target.control`), or with ``iostat --initiator`` at the initiator
daemon's connections.

Human tables by default, the control socket's own JSON with ``-o json`` (``--json`` too;
:mod:`blockd.cli.output`). An entry point on top
of the layers, as the rest of ``blockd/cli/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any, Callable

from blockd.cli.output import add_format_flag, print_json, wants_json
from blockd.config import ConfigError, parse_size
from blockd.iostats import interval
from initiator.control import ControlClient
from protocol.constants import ANA_STATE_NAMES

# _TARGET_IMPORTS_ARE_LAZY: the target's modules (target.config pulls in the backends and the
# compiled data plane) are imported inside the verbs that use them. blockctl builds its whole
# parser, this module's included, for every command; in the VM bed (qemu TCG, the userland over
# 9p) importing them cost ~8 s of the ~16 s each `blockctl` call took, and the guest tests make
# about seventy such calls. tests/core/test_cli.py keeps the client verbs free of them.


def add_parsers(sub: Any) -> None:
    """``target`` (with its verbs) and ``iostat`` on blockctl's subcommand parser."""
    t = sub.add_parser("target", help="look at a running target (its control socket)")
    t.add_argument("--target-socket", help="target control socket (default $BLOCKD_TARGET_SOCKET "
                                           "or /run/blockd/target.sock)")
    verbs = t.add_subparsers(dest="verb", required=True)
    for verb, helptext in (("status", "ports, namespaces and connected hosts"),
                           ("hosts", "connected hosts: NQN, controller, peer, queues, keep-alive"),
                           ("namespaces", "namespaces: size, block size, backend, read-only"),
                           ("stats", "per-namespace and per-host counters over an interval"),
                           ("replicas", "replicated namespaces: each replica's state (in sync, degraded, "
                                        "resyncing with progress, split brain)")):
        v = verbs.add_parser(verb, help=helptext)
        add_format_flag(v, json_alias=True)
        if verb == "stats":
            v.add_argument("-i", "--interval", type=float, default=1.0, help="seconds (default 1)")

    r = verbs.add_parser("resize", help="grow a namespace online (hosts are told at once); "
                                        "shrinking is refused while hosts are connected")
    r.add_argument("nqn", help="subsystem NQN")
    r.add_argument("nsid", type=int)
    r.add_argument("size", nargs="?", type=_size_arg, help="new size (e.g. 20GiB); default: the file's size now, "
                                           "after you grew it")

    a = verbs.add_parser("ana", help="ANA group states per port (show), or change one: promote "
                                     "(optimized), demote (inaccessible), set STATE; hosts are told at once")
    a.add_argument("action", nargs="?", choices=("show", "promote", "demote", "set"), default="show")
    a.add_argument("state", nargs="?", choices=tuple(ANA_STATE_NAMES), help="the state, for 'set'")
    a.add_argument("-g", "--group", type=int, default=1, help="ANA group (default 1)")
    a.add_argument("-p", "--port", type=int, help="port id (default: every port)")
    a.add_argument("--force", action="store_true",
                   help="promote although a namespace's copy may lack acknowledged writes (starts a new "
                        "replication generation; see docs/replication.md)")
    add_format_flag(a, json_alias=True)
    v = verbs.add_parser("verify", help="compare a replicated namespace's copies region by region (online); "
                                        "regions that differ are reported and resynced")
    v.add_argument("nqn", help="subsystem NQN")
    v.add_argument("nsid", type=int)
    v.add_argument("--replica", help="slot number or name of one replica (default: every one in sync)")
    add_format_flag(v, json_alias=True)
    v = verbs.add_parser("resolve", help="end a split brain by discarding one side's data")
    v.add_argument("nqn", help="subsystem NQN")
    v.add_argument("nsid", type=int)
    v.add_argument("replica", help="slot number or name of the replica")
    v.add_argument("--discard", choices=("replica", "local"), required=True,
                   help="whose writes are thrown away: 'replica' overwrites it from this copy (at its next "
                        "connection); 'local' copies the replica over this copy now (one replica only; "
                        "host I/O gets Namespace Not Ready until done)")

    v = verbs.add_parser("create-md", help="write the replication metadata onto a namespace's volume that already "
                                           "holds data, keeping the data (offline: the target stopped)")
    v.add_argument("nqn", help="subsystem NQN")
    v.add_argument("nsid", type=int)
    v.add_argument("--config", "-c", default="/etc/blockd/target.toml",
                   help="the target's configuration, with the namespace's replica tables (default %(default)s)")
    v.add_argument("--force", action="store_true",
                   help="overwrite a metadata area that is not blank (earlier metadata, or data there)")
    add_format_flag(v, json_alias=True)

    io = sub.add_parser("iostat", help="per-second IOPS, MB/s and latency per namespace of a running "
                                       "target (or per connection of the initiator daemon)")
    io.add_argument("--target-socket", help="target control socket")
    io.add_argument("--initiator", action="store_true",
                    help="the initiator daemon's connections (its socket: blockctl --socket)")
    io.add_argument("interval", nargs="?", type=_positive, default=1.0, help="seconds between reports (default 1)")
    io.add_argument("count", nargs="?", type=int, help="reports to print (default: until interrupted)")
    add_format_flag(io)


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be more than 0")
    return value


def _size_arg(text: str) -> int:
    try:
        return parse_size(text, "size")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _call(args: argparse.Namespace, request: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
    from target.control import socket_path  # lazy: _TARGET_IMPORTS_ARE_LAZY
    with ControlClient(socket_path(args.target_socket), timeout=timeout, daemon="target") as client:
        return client.call(request)


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    """Left-aligned columns, two spaces apart (numbers right-aligned)."""
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(isinstance(r[i], (int, float)) for r in rows) and bool(rows) for i in range(len(headers))]
    return "\n".join("  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric)).rstrip()
                     for r in cells)


def _size(n: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and not n % (1 << (shift - 10)):
            return f"{n / (1 << shift):g}{unit}"
    return f"{n}B"


def _bytes(n: int) -> str:
    """``n bytes``, with the unit when it is round."""
    short = _size(n)
    return f"{n} bytes" + ("" if short == f"{n}B" else f" ({short})")


def _ports_text(ports: list[dict[str, Any]]) -> str:
    return _table(["PORT", "TRANSPORT", "ADDRESS"],
                  [[p["id"], p["transport"], f"{p['address']}:{p['service']}"] for p in ports])


def _namespaces_text(nss: list[dict[str, Any]]) -> str:
    return _table(["SUBSYSTEM", "NSID", "SIZE", "BLOCK", "BACKEND", "RO", "PATH"],
                  [[n["subsystem"], n["nsid"], _size(n["size"]), n["block_size"], n["backend"],
                    "yes" if n["read_only"] else "no", n["path"]] for n in nss])


def _hosts_text(hosts: list[dict[str, Any]]) -> str:
    rows = []
    for h in hosts:
        io = [q for q in h["queues"] if q["qid"]]
        depth = f"{len(io)}x{io[0]['depth']}" if io else "0"
        rows.append([h["hostnqn"], h["cntlid"], h["subsystem"], h["peer"], h["transport"], depth,
                     sum(q["in_flight"] for q in io), f"{h['keep_alive_ms'] / 1000:g}s", h["connected_since"]])
    return _table(["HOST", "CNTLID", "SUBSYSTEM", "PEER", "TRANSPORT", "IOQ", "INFLIGHT", "KATO", "SINCE"], rows)


def _stats_rows(entries: list[dict[str, Any]], first: Callable[[dict[str, Any]], list[Any]]) -> list[list[Any]]:
    rows = []
    for e in entries:
        ops = e["ops"]
        rows.append([*first(e), round(e["iops"]["read"], 1), round(e["iops"]["write"], 1),
                     round(e["bytes_per_s"]["read"] / 1e6, 2), round(e["bytes_per_s"]["write"] / 1e6, 2),
                     ops["flush"], ops["other"], round(e["mean_latency_us"], 1), round(e["p99_latency_us"], 1),
                     ",".join(f"{k}:{v}" for k, v in e["errors"].items()) or "-"])
    return rows


_STATS_HEADERS = ["r/s", "w/s", "rMB/s", "wMB/s", "flush", "other", "lat_us", "p99_us", "errors"]


def _rejections_text(iv: dict[str, Any], totals: dict[str, Any]) -> str:
    """Refusals by reason: in the interval and since the start, only the reasons seen."""
    rows = [[reason, iv["rejections"].get(reason, 0), n] for reason, n in sorted(totals["rejections"].items()) if n]
    return _table(["REJECTED", "INTERVAL", "TOTAL"], rows) if rows else "rejected: none"


def _stats_text(iv: dict[str, Any], totals: dict[str, Any]) -> str:
    return "\n\n".join([
        _table(["SUBSYSTEM", "NSID", *_STATS_HEADERS],
               _stats_rows(iv["namespaces"], lambda e: [e["subsystem"], e["nsid"]])),
        _table(["HOST", "CNTLID", *_STATS_HEADERS],
               _stats_rows(iv["hosts"], lambda e: [e["hostnqn"], e["cntlid"]])),
        _rejections_text(iv, totals),
    ])


_ANA_ACTIONS = {"promote": "optimized", "demote": "inaccessible"}


def _ana(args: argparse.Namespace) -> int:
    if args.action == "show":
        reply = _call(args, {"op": "ana"})
    else:
        state = _ANA_ACTIONS.get(args.action) or args.state
        if state is None or args.action != "set" and args.state is not None:
            raise SystemExit("blockctl target ana: 'set' takes a STATE, 'promote' and 'demote' none")
        reply = _call(args, {"op": "ana-set", "state": state, "group": args.group, "port": args.port,
                             "force": args.force})
    reply.pop("ok", None)
    if wants_json(args):
        print_json(reply)
    elif args.action == "show":
        print(_table(["PORT", "GROUP", "STATE", "NAMESPACES"],
                     [[e["port"], e["group"], e["state"], " ".join(e["namespaces"]) or "-"] for e in reply["ana"]]))
    else:
        what = "now" if reply["changed"] else "already"
        print(f"ANA group {reply['group']} {what} {reply['state']} on port(s) "
              f"{', '.join(map(str, reply['ports']))}")
    return 0


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    return f"{int(seconds) // 60}m{int(seconds) % 60:02d}s"


def _replicas_text(namespaces: list[dict[str, Any]]) -> str:
    blocks = []
    for ns in namespaces:
        if ns["role"] == "secondary":  # the standby: its primary holds the links
            blocks.append(f"{ns['subsystem']} namespace {ns['nsid']}: secondary (standby, written by its primary), "
                          f"data {_size(ns['data_size'])}, region {_size(ns['region_size'])}, generation "
                          f"{ns['generation']}" + (", inconsistent (a resync into it is unfinished)"
                                                   if ns["inconsistent"] else ""))
            continue
        head = (f"{ns['subsystem']} namespace {ns['nsid']}: primary, {ns['copies_in_sync']} of {len(ns['replicas']) + 1} "
                f"copies in sync (min_in_sync {ns['min_in_sync']}), data {_size(ns['data_size'])}, "
                f"region {_size(ns['region_size'])}, generation {ns['generation']}")
        rows = []
        for r in ns["replicas"]:
            state = r["state"]
            if "resync" in r:
                p = r["resync"]
                state += f" {p['percent']:.1f}% {p['mb_per_s']:.1f}MB/s eta {_eta(p['eta_s'])}"
            rows.append([r["slot"] if r["slot"] is not None else "-", r["replica"], state,
                         r["missing_regions"], r["reason"] or "-"])
        blocks.append(head + "\n" + _table(["SLOT", "REPLICA", "STATE", "MISSING", "REASON"], rows))
    return "\n\n".join(blocks) or "no replicated namespaces"


def _verify_text(reply: dict[str, Any]) -> str:
    lines = []
    for r in reply["replicas"]:
        bad = r["mismatched"]
        how = "by digests" if r["method"] == "digest" else "by reading its data"
        lines.append(f"{r['replica']}: {r['regions']} regions compared {how}, {len(bad)} differ"
                     + (" (marked for resync)" if bad else ""))
        lines += [f"  region {m['region']}: bytes {m['offset']}..{m['offset'] + m['length'] - 1}" for m in bad]
    return "\n".join(lines)


def _create_md(args: argparse.Namespace) -> int:
    """``create-md``: offline, from the configuration (no control socket)."""
    from target.config import MAX_REPLICAS, load  # lazy: _TARGET_IMPORTS_ARE_LAZY
    from target.replication.volume import create_md
    try:
        config = load(args.config)
    except (OSError, ConfigError) as exc:
        raise SystemExit(f"blockctl target create-md: {exc}") from None
    found = [ns for sub in config.subsystems if sub.nqn == args.nqn for ns in sub.namespaces if ns.nsid == args.nsid]
    if not found:
        raise SystemExit(f"blockctl target create-md: {args.config} has no namespace {args.nsid} in {args.nqn}")
    nc = found[0]
    if not nc.replicas:
        raise SystemExit(f"blockctl target create-md: {args.nqn} namespace {args.nsid} has no replica table in "
                         f"{args.config}: add its [[subsystem.namespace.replica]] first (its region_size and "
                         "metadata_path decide the layout)")
    try:
        made = create_md(nc, MAX_REPLICAS, force=args.force)
    except (OSError, ValueError) as exc:  # MetadataError (not blank) is a ValueError
        raise SystemExit(f"blockctl target create-md: {nc.path}: {exc}") from None
    if wants_json(args):
        print_json({**dataclasses.asdict(made), "generation": f"{made.generation:016x}"})
        return 0
    where = (f"in {made.metadata_path} ({_size(made.metadata_length)}); the data area is all of {nc.path}, unchanged"
             if made.metadata_path else
             f"at the end of {nc.path}; the data area shrinks by {_bytes(made.shrink)}")
    print(f"replication metadata written {where}.\n"
          f"The namespace exports {_bytes(made.data_size)}; generation {made.generation:016x}.\n"
          f"Each replica's namespace must have {_bytes(made.device_size)}; it gets a full sync from this copy.")
    return 0


def cmd_target(args: argparse.Namespace) -> int:
    if args.verb == "create-md":
        return _create_md(args)
    if args.verb == "ana":
        return _ana(args)
    if args.verb == "resolve":
        reply = _call(args, {"op": "resolve", "nqn": args.nqn, "nsid": args.nsid, "replica": args.replica,
                             "discard": args.discard})
        if args.discard == "replica":
            print(f"{reply['replica']}: its data is discarded; it is {reply['state']} and is overwritten from this copy")
        else:
            print(f"this copy now holds {reply['replica']}'s data; the replica is {reply['state']}")
        return 0
    if args.verb == "verify":
        reply = _call(args, {"op": "verify", "nqn": args.nqn, "nsid": args.nsid, "replica": args.replica},
                      timeout=None)  # the reply comes when every region was compared
        reply.pop("ok", None)
        if wants_json(args):
            print_json(reply)
        else:
            print(_verify_text(reply))
        return 1 if any(r["mismatched"] for r in reply["replicas"]) else 0
    if args.verb == "resize":
        reply = _call(args, {"op": "resize", "nqn": args.nqn, "nsid": args.nsid, "size": args.size})
        print(f"{reply['nqn']} namespace {reply['nsid']}: {_size(reply['old_size'])} -> {_size(reply['size'])}")
        return 0
    if args.verb == "stats":
        reply = _call(args, {"op": "stats", "interval": args.interval}, timeout=args.interval + 30)
    else:
        reply = _call(args, {"op": args.verb})
    reply.pop("ok", None)
    if wants_json(args):
        print_json(reply)
    elif args.verb == "status":
        print(reply["status"])
        print(f"\n{_ports_text(reply['ports'])}\n\n{_namespaces_text(reply['namespaces'])}\n\n"
              f"{_hosts_text(reply['hosts'])}")
    elif args.verb == "hosts":
        print(_hosts_text(reply["hosts"]))
    elif args.verb == "namespaces":
        print(_namespaces_text(reply["namespaces"]))
    elif args.verb == "replicas":
        print(_replicas_text(reply["namespaces"]))
    else:
        print(f"over {reply['interval']['seconds']:.2f}s:\n{_stats_text(reply['interval'], reply['totals'])}")
    return 0


def _host_counters(args: argparse.Namespace) -> dict[str, Any]:
    with ControlClient(args.socket, timeout=30) as client:
        return client.call({"op": "counters"})


def _host_interval(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    seconds = (after["time_ns"] - before["time_ns"]) / 1e9
    old = {c["name"]: c for c in before["connections"]}
    return {"seconds": seconds,
            "connections": [{**c, **interval(old.get(c["name"]), c, seconds)} for c in after["connections"]]}


def _host_table(iv: dict[str, Any]) -> str:
    return _table(["CONNECTION", "CNTLID", *_STATS_HEADERS],
                  _stats_rows(iv["connections"], lambda e: [e["name"], e["cntlid"]]))


def _target_interval(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    from target.control import counters_interval  # lazy: _TARGET_IMPORTS_ARE_LAZY
    iv = counters_interval(before, after)
    return {"seconds": iv["seconds"], "namespaces": iv["namespaces"]}


def _target_table(iv: dict[str, Any]) -> str:
    return _table(["SUBSYSTEM", "NSID", *_STATS_HEADERS],
                  _stats_rows(iv["namespaces"], lambda e: [e["subsystem"], e["nsid"]]))


def cmd_iostat(args: argparse.Namespace) -> int:
    """Like ``iostat -x INTERVAL [COUNT]``: one table per interval, per namespace of the target
    (or per connection of the initiator daemon); with ``-o json`` one JSON line per interval."""
    if args.initiator:
        fetch, between, table = (lambda: _host_counters(args)), _host_interval, _host_table
    else:
        fetch, between, table = (lambda: _call(args, {"op": "counters"})), _target_interval, _target_table
    before = fetch()
    printed = 0
    while args.count is None or printed < args.count:
        time.sleep(args.interval)
        after = fetch()
        iv = between(before, after)
        if wants_json(args):
            print_json({"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **iv}, lines=True)
        else:
            print(time.strftime("%H:%M:%S"))
            print(table(iv))
            print(flush=True)
        before = after
        printed += 1
    return 0
