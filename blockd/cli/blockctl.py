"""``blockctl``: discover targets and drive the initiator daemon's connections; look at a
running target (``blockctl target ...``, ``blockctl iostat``: :mod:`blockd.cli.targetctl`).

Connection flags follow nvme-cli (-t/-a/-s/-n/-q/-i/-Q/-k/-l/-g/-G) and come from the one
declaration of the connect parameters, ``initiator.params.ConnectParams``. Every user mistake ends in one line
on stderr and a non-zero exit status, never a traceback.

An entry point on top of the layers: like ``blockd.cli.daemon`` it may import ``initiator/``,
which the shared modules of ``blockd/`` may not (``tests/test_layers.py``); nothing imports it.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any, BinaryIO, Iterator

from blockd.cli import nvme_json, targetctl
from blockd.cli.output import add_format_flag, emit, print_json, wants_json
from initiator.control import CHUNK, ControlClient, ControlError
from initiator.params import CONNECT_OPTIONS, OPTIONS_BY_KEY, ConnectOption
from protocol.constants import DEFAULT_IO_PORT, DEFAULT_TCP_DISCOVERY_PORT


class UsageError(Exception):
    """A mistake in the command line or its files."""


def _option_flag(p: argparse.ArgumentParser, opt: ConnectOption, **overrides: Any) -> None:
    """The flag of one connect option (initiator.params: the one declaration of each)."""
    names = ([opt.flag] if opt.flag else []) + ["--" + opt.key.replace("_", "-")]
    shown = "" if opt.default is None or opt.type is bool else f" (default {opt.default})"
    kw: dict[str, Any] = {"dest": opt.key, "help": opt.help + shown}
    if opt.type is bool:
        kw.update(action="store_const", const=True, default=None)
    else:
        kw.update(type=opt.type, default=opt.default, required=opt.required, choices=opt.choices)
    kw.update(overrides)
    p.add_argument(*names, **kw)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blockctl", description="NVMe over Fabrics host control")
    parser.add_argument("--socket", help="initiator daemon control socket")
    sub = parser.add_subparsers(dest="command", required=True)

    d = sub.add_parser("discover", help="print a target's discovery log")
    for key in ("transport", "traddr", "hostnqn", "dhchap_secret", "dhchap_ctrl_secret"):
        _option_flag(d, OPTIONS_BY_KEY[key])
    _option_flag(d, OPTIONS_BY_KEY["trsvcid"], default=None, help="target port (tcp: 8009, rdma: 4420)")
    add_format_flag(d)

    c = sub.add_parser("connect", help="connect to a subsystem (held by the initiator daemon)")
    for opt in CONNECT_OPTIONS:
        _option_flag(c, opt, **({"required": False} if opt.key == "traddr" else {}))
    c.add_argument("--name", help="connection name (default: the NQN)")
    c.add_argument("--path", action="append", metavar="ADDR[:PORT]",
                   help="one path of a multipath connection (ANA failover); repeat for each target or "
                        "port presenting the subsystem (the port defaults to -s); instead of -a. A path "
                        "down now joins when it comes up; the connect fails only if none connects")

    add_format_flag(c)

    ca = sub.add_parser("connect-all", help="discover, then connect every NVM subsystem the discovery logs "
                                            "name (referrals followed), skipping those connected already")
    for opt in CONNECT_OPTIONS:
        if opt.key != "nqn":
            _option_flag(ca, opt, required=False, default=None)
    ca.add_argument("--discovery-conf", default=DISCOVERY_CONF,
                    help=f"nvme-cli's list of discovery controllers, read when -a is not given (default "
                         f"{DISCOVERY_CONF}; one '-t tcp -a ADDR -s PORT ...' a line)")
    ca.add_argument("--config", help="an initiator configuration whose [[discovery]] tables are read too "
                                     "when -a is not given")
    add_format_flag(ca)

    x = sub.add_parser("disconnect", help="disconnect a connection")
    x.add_argument("name", help="connection name or NQN")
    add_format_flag(sub.add_parser("list", help="list connections"))

    for cmd, helptext in (("read", "read a byte range to a file or stdout"),
                          ("write", "write a file or stdin to a byte range")):
        r = sub.add_parser(cmd, help=helptext)
        r.add_argument("name", help="connection name or NQN")
        r.add_argument("-N", "--nsid", type=int, default=1)
        r.add_argument("--offset", type=int, help="byte offset (multiple of the block size)")
        r.add_argument("--length", type=int, help="bytes (read: required unless --block-count)")
        r.add_argument("--start-block", type=int, help="first block instead of --offset")
        r.add_argument("--block-count", type=int, help="blocks instead of --length")
        if cmd == "read":
            r.add_argument("-o", "--output", default="-", help="file, or - for stdout")
        else:
            r.add_argument("-i", "--input", default="-", help="file, or - for stdin")
            r.add_argument("--fua", action="store_true", help="force unit access (durable on completion)")
        r.add_argument("-q", "--quiet", action="store_true",
                       help="no progress bar (there is none either when stderr is not a terminal)")

    m = sub.add_parser("mount", help="expose a connection's namespaces as files MOUNTPOINT/ns<N> (FUSE)")
    m.add_argument("name", help="connection name or NQN")
    m.add_argument("mountpoint")
    u = sub.add_parser("umount", help="unmount a blockd FUSE mount")
    u.add_argument("mountpoint")
    u.add_argument("-l", "--lazy", action="store_true", help="detach now even if files are open")
    add_format_flag(sub.add_parser("mounts", help="list blockd FUSE mounts"))

    rx = sub.add_parser("rxe", help="Soft-RoCE links: add NETDEV [--name NAME] | del NAME | list")
    rx.add_argument("rxe_args", nargs=argparse.REMAINDER)
    iu = sub.add_parser("install-units", help="install the systemd units (see docs/systemd.md)")
    from blockd.units import add_arguments as units_arguments
    units_arguments(iu)

    g = sub.add_parser("gen-dhchap-key", help="generate a DH-HMAC-CHAP secret (as nvme gen-dhchap-key)")
    g.add_argument("-s", "--secret", help="seed in hexadecimal instead of random bytes")
    g.add_argument("-l", "--key-length", type=int, default=0, choices=(0, 32, 48, 64),
                   help="key length in bytes (32, 48 or 64; default: the hash's, else 32)")
    g.add_argument("-n", "--nqn", help="NQN of the transform (default: this host's NQN)")
    g.add_argument("-m", "--hmac", type=int, default=0, choices=(0, 1, 2, 3),
                   help="transform hash: 0 none, 1 SHA-256, 2 SHA-384, 3 SHA-512")

    i = sub.add_parser("id-ctrl", help="Identify Controller")
    i.add_argument("name")
    add_format_flag(i)
    n = sub.add_parser("id-ns", help="Identify Namespace")
    n.add_argument("name")
    n.add_argument("-N", "--nsid", type=int, default=1)
    _reservation_parsers(sub)

    add_format_flag(n)
    targetctl.add_parsers(sub)
    return parser


def _reservation_parsers(sub: Any) -> None:
    """resv-register|acquire|release|report with nvme-cli's flags (-n -c -k -p -t -a -r -i)."""
    key = functools.partial(int, base=0)
    for verb, helptext in (("resv-register", "register, unregister or replace a reservation key"),
                           ("resv-acquire", "acquire or preempt a reservation"),
                           ("resv-release", "release or clear a reservation"),
                           ("resv-report", "show a namespace's reservation and registrants")):
        p = sub.add_parser(verb, help=helptext)
        p.add_argument("name", help="connection name or NQN")
        p.add_argument("-n", "--namespace-id", dest="nsid", type=int, default=1)
        if verb == "resv-report":
            continue
        p.add_argument("-c", "--crkey", type=key, default=0, help="current reservation key")
        p.add_argument("-i", "--iekey", action="store_true", help="ignore the existing key")
        if verb == "resv-register":
            p.add_argument("-k", "--nrkey", type=key, default=0, help="new reservation key")
            p.add_argument("-r", "--rrega", type=int, default=0, choices=(0, 1, 2),
                           help="0 register, 1 unregister, 2 replace")
            p.add_argument("-p", "--cptpl", type=int, default=0, choices=(0, 2, 3),
                           help="persist through power loss: 0 no change, 2 off, 3 on")
            continue
        p.add_argument("-t", "--rtype", type=int, default=0, choices=range(7),
                       help="1 write exclusive, 2 exclusive access, 3/4 the same for registrants only, "
                            "5/6 for all registrants")
        if verb == "resv-acquire":
            p.add_argument("-p", "--prkey", type=key, default=0, help="preempt reservation key")
            p.add_argument("-a", "--racqa", type=int, default=0, choices=(0, 1, 2),
                           help="0 acquire, 1 preempt, 2 preempt and abort")
        else:
            p.add_argument("-a", "--rrela", type=int, default=0, choices=(0, 1), help="0 release, 1 clear")


# -- commands -----------------------------------------------------------------------------------


def cmd_discover(args: argparse.Namespace) -> int:
    from initiator.discovery import discover

    port = args.trsvcid or (DEFAULT_TCP_DISCOVERY_PORT if args.transport == "tcp" else DEFAULT_IO_PORT)
    from blockd import eventloop
    log = eventloop.run(discover(args.traddr, port, args.transport, args.hostnqn,
                                 dhchap_secret=args.dhchap_secret,
                                 dhchap_ctrl_secret=args.dhchap_ctrl_secret))
    emit(args, nvme_json.discovery_log(log.genctr, log.entries),
         lambda: nvme_json.discovery_text(log.genctr, log.entries))
    return 0


def cmd_connect(args: argparse.Namespace) -> int:
    if bool(args.traddr) == bool(args.path):
        raise UsageError("connect: give the target address with -a, or every path with --path")
    with ControlClient(args.socket) as client:
        reply = client.call({"op": "connect", "name": args.name,
                             **{opt.key: getattr(args, opt.key) for opt in CONNECT_OPTIONS},
                             **({"paths": args.path} if args.path else {})})
    reply.pop("ok", None)
    paths = f", {len(reply['paths'])} paths" if reply.get("paths") else ""
    emit(args, reply, lambda: f"connected {reply['name']}: {reply['nqn']} cntlid {reply['cntlid']}, "
                              f"{reply['io_queues']} I/O queue(s), {len(reply['namespaces'])} namespace(s){paths}")
    return 0


DISCOVERY_CONF = "/etc/nvme/discovery.conf"


def _discovery_sources(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Where connect-all discovers: the command line's -a, else discovery.conf and the
    configuration's [[discovery]] tables; the command line's other options apply to each."""
    from initiator.connect_all import DiscoveryConfError, parse_discovery_conf
    given = {opt.key: getattr(args, opt.key) for opt in CONNECT_OPTIONS
             if opt.key != "nqn" and getattr(args, opt.key) is not None}
    if args.traddr:
        return [given]
    sources = []
    try:
        with open(args.discovery_conf) as f:
            sources += parse_discovery_conf(f.read(), args.discovery_conf)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise UsageError(f"cannot read {args.discovery_conf}: {exc.strerror}") from None
    except DiscoveryConfError as exc:
        raise UsageError(str(exc)) from None
    if args.config:
        from blockd.config import ConfigError
        from initiator.config import load
        try:
            sources += [dict(d) for d in load(args.config).discoveries]
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
    if not sources:
        raise UsageError(f"connect-all: no discovery controller: give -a, or list them in {args.discovery_conf}"
                         + (f" or {args.config}" if args.config else " or an initiator config (--config)"))
    return [{**s, **{k: v for k, v in given.items() if k not in s}} for s in sources]


def cmd_connect_all(args: argparse.Namespace) -> int:
    from blockd import eventloop
    from initiator.connect_all import connected, connection_name, discover_all
    found, failures = eventloop.run(discover_all(_discovery_sources(args)))
    for line in failures:
        print(f"blockctl: discovery failed: {line}", file=sys.stderr)
    with ControlClient(args.socket) as client:
        conns = client.call({"op": "list"})["connections"]
    taken = {c["name"] for c in conns}
    report: list[dict[str, Any]] = []
    for f in found:
        e = f.entry
        row: dict[str, Any] = {"subnqn": e.subnqn, "transport": e.transport, "traddr": e.traddr, "trsvcid": e.trsvcid}
        if connected(f, conns):
            report.append({**row, "result": "already connected"})
            continue
        name = connection_name(f, taken)
        try:
            with ControlClient(args.socket) as client:
                reply = client.call({"op": "connect", "name": name, **f.connect_options()})
        except ControlError as exc:
            report.append({**row, "result": "failed", "error": str(exc)})
            continue
        taken.add(name)
        report.append({**row, "result": "connected", "name": name, "cntlid": reply["cntlid"]})
    emit(args, {"connections": report, "discovery_failures": failures}, lambda: "\n".join(
        f"{r['transport']}://{r['traddr']}:{r['trsvcid']} {r['subnqn']}: {r['result']}"
        + (f" as {r['name']} (cntlid {r['cntlid']})" if "name" in r else "")
        + (f": {r['error']}" if "error" in r else "") for r in report) or "no NVM subsystem discovered")
    failed = failures or any(r["result"] == "failed" for r in report)
    return 1 if failed and not any(r["result"] != "failed" for r in report) else 0


def cmd_disconnect(args: argparse.Namespace) -> int:
    with ControlClient(args.socket) as client:
        client.call({"op": "disconnect", "name": args.name})
    print(f"disconnected {args.name}")
    return 0


def _devices(args: argparse.Namespace, conns: list[dict[str, Any]]) -> dict[str, Any]:
    """``list -o json``: each live connection's identity and namespaces' use (Identify, as
    ``nvme list`` reads them) and the FUSE files of mounted namespaces, then nvme-cli's shape."""
    with ControlClient(args.socket) as client:
        mounts = client.call({"op": "mounts"})["mounts"]
    for c in conns:
        files = {f"{m['mountpoint']}/{f}" for m in mounts if m["name"] == c["name"] for f in m["files"]}
        if c["state"] != "live":
            continue
        with ControlClient(args.socket) as client:
            c["identify"] = client.call({"op": "id-ctrl", "name": c["name"]})["identify"]
        for ns in c["namespaces"]:
            with ControlClient(args.socket) as client:
                ns["nuse"] = client.call({"op": "id-ns", "name": c["name"], "nsid": ns["nsid"]})["identify"]["nuse"]
            ns["device_path"] = next((f for f in sorted(files) if f.endswith(f"/ns{ns['nsid']}")), None)
    return nvme_json.list_devices(conns)


def cmd_list(args: argparse.Namespace) -> int:
    with ControlClient(args.socket) as client:
        conns = client.call({"op": "list"})["connections"]
    if wants_json(args):
        print_json(_devices(args, conns))
        return 0
    if not conns:
        print("no connections")
    for c in conns:
        print(f"{c['name']}: {c['transport']}://{c['traddr']}:{c['trsvcid']} {c['nqn']} "
              f"cntlid {c['cntlid']} {c['state']}, {c['io_queues']} I/O queue(s)")
        for ns in c["namespaces"]:
            ro = " read-only" if ns["read_only"] else ""
            print(f"  nsid {ns['nsid']}: {ns['size']} bytes, {ns['block_size']}-byte blocks{ro}")
        if c.get("paths"):
            print(f"  iopolicy {c['iopolicy']}, {c['ana_retries']} ANA-status retry(ies) (at most one per "
                  f"namespace per path per transition) with {c['ana_requeued']} more command(s) requeued, "
                  f"{c['path_retries']} command(s) retried after a path loss")
        for p in c.get("paths", []):
            ana = ", ".join(f"nsid {n} {state}" for n, state in p["ana"].items()) or "no ANA state"
            print(f"  path {p['transport']}://{p['traddr']}:{p['trsvcid']} cntlid {p['cntlid']} {p['state']}: {ana}"
                  f" ({p['ana_reads']} ANA log read(s))")
    return 0


def _namespace(client: ControlClient, name: str, nsid: int) -> dict[str, Any]:
    for c in client.call({"op": "list"})["connections"]:
        if c["name"] == name or c["nqn"] == name:
            for ns in c["namespaces"]:
                if ns["nsid"] == nsid:
                    return ns
            raise UsageError(f"{name} has no namespace {nsid}")
    raise UsageError(f"no connection named {name!r} (see 'blockctl list')")


def _range(args: argparse.Namespace, ns: dict[str, Any], length: int | None) -> tuple[int, int]:
    """(offset, length) in bytes from --offset/--length or --start-block/--block-count."""
    bs = ns["block_size"]
    if args.start_block is not None and args.offset is not None:
        raise UsageError("give --offset or --start-block, not both")
    offset = args.start_block * bs if args.start_block is not None else (args.offset or 0)
    if args.block_count is not None:
        length = args.block_count * bs
    elif args.length is not None:
        length = args.length
    if length is None:
        raise UsageError("give --length or --block-count")
    if offset < 0 or length < 0:
        raise UsageError("offset and length must not be negative")
    if offset % bs or length % bs:
        raise UsageError(f"offset {offset} and length {length} must be multiples of the {bs}-byte block size")
    if offset + length > ns["size"]:
        raise UsageError(f"range {offset}+{length} is beyond the end of the namespace ({ns['size']} bytes)")
    return offset, length


PROGRESS_MIN = 8 * CHUNK
"""Bytes from which a transfer shows a bar (a smaller one ends before a bar says anything)."""


def _progress(total: int, quiet: bool) -> Any:
    """A progress bar on stderr (bytes, rate, ETA; tqdm) when stderr is a terminal, the transfer
    is at least PROGRESS_MIN and not ``quiet``; otherwise one that prints nothing (tqdm's
    ``disable=None`` is its own terminal test)."""
    from tqdm import tqdm
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                disable=True if quiet or total < PROGRESS_MIN else None, dynamic_ncols=True)


def cmd_read(args: argparse.Namespace) -> int:
    with ControlClient(args.socket) as client:
        ns = _namespace(client, args.name, args.nsid)
    offset, length = _range(args, ns, None)
    out: BinaryIO = sys.stdout.buffer if args.output == "-" else _open(args.output, "wb")
    progress = _progress(length, args.quiet)
    try:
        with ControlClient(args.socket) as client:
            client.send({"op": "read", "name": args.name, "nsid": args.nsid, "offset": offset,
                         "length": length})
            client.reply()
            left = length
            while left:
                chunk = client.read_exact(min(CHUNK, left))
                out.write(chunk)
                left -= len(chunk)
                progress.update(len(chunk))
        out.flush()
    finally:
        progress.close()
        if out is not sys.stdout.buffer:
            out.close()
    return 0


def cmd_write(args: argparse.Namespace) -> int:
    with ControlClient(args.socket) as client:
        ns = _namespace(client, args.name, args.nsid)
    if args.input == "-":
        data_in: BinaryIO = sys.stdin.buffer
        size = None
    else:
        data_in = _open(args.input, "rb")
        size = os.fstat(data_in.fileno()).st_size
    if args.length is None and args.block_count is None:
        if size is None:
            data = data_in.read()
            size = len(data)
            data_in = _BytesSource(data)
        args.length = size
    offset, length = _range(args, ns, size)
    if size is not None and size < length:
        raise UsageError(f"{args.input} has {size} bytes, fewer than the {length} to write")
    progress = _progress(length, args.quiet)

    def payload() -> Iterator[bytes]:
        left = length
        while left:
            chunk = data_in.read(min(CHUNK, left))
            if not chunk:
                raise UsageError(f"input ended {left} bytes short of {length}")
            left -= len(chunk)
            progress.update(len(chunk))
            yield chunk

    try:
        with ControlClient(args.socket) as client:
            client.send({"op": "write", "name": args.name, "nsid": args.nsid, "offset": offset,
                         "length": length, "fua": args.fua}, payload())
            client.reply()
    finally:
        progress.close()
        data_in.close()
    if not args.quiet:
        print(f"wrote {length} bytes at offset {offset} of namespace {args.nsid}", file=sys.stderr)
    return 0


class _BytesSource:
    def __init__(self, data: bytes) -> None:
        self.view = memoryview(data)
        self.pos = 0

    def read(self, n: int) -> bytes:
        chunk = self.view[self.pos:self.pos + n]
        self.pos += len(chunk)
        return bytes(chunk)

    def close(self) -> None:
        self.view.release()


def _open(path: str, mode: str) -> BinaryIO:
    try:
        return open(path, mode)  # noqa: SIM115 - closed by the caller
    except OSError as exc:
        raise UsageError(f"cannot open {path}: {exc.strerror}") from None


def _fields_text(ident: dict[str, Any], fields: list[str]) -> str:
    return "\n".join(f"{f:<10}: {ident[f]}" for f in fields)


def cmd_id_ctrl(args: argparse.Namespace) -> int:
    with ControlClient(args.socket) as client:
        ident = client.call({"op": "id-ctrl", "name": args.name})["identify"]
    emit(args, nvme_json.id_ctrl(ident), lambda: _fields_text(ident, [
        "vid", "sn", "mn", "fr", "cntlid", "ver", "cmic", "mdts", "kas", "maxcmd",
        "nn", "oncs", "vwc", "sgls", "ioccsz", "iorcsz", "cntrltype", "subnqn"]))
    return 0


def cmd_id_ns(args: argparse.Namespace) -> int:
    with ControlClient(args.socket) as client:
        ident = client.call({"op": "id-ns", "name": args.name, "nsid": args.nsid})["identify"]

    def text() -> str:
        lbaf = ident["lbaf"][ident["flbas"] & 0xF]
        return (_fields_text(ident, ["nsze", "ncap", "nuse", "nlbaf", "flbas", "nmic", "dlfeat", "nsattr",
                                     "nguid", "eui64"])
                + f"\nlbaf 0    : ms:{lbaf['ms']} lbads:{lbaf['lbads']} rp:{lbaf['rp']} (in use)")
    emit(args, nvme_json.id_ns(ident), text)
    return 0


def cmd_resv(args: argparse.Namespace) -> int:
    """The four reservation verbs: the daemon sends the command on the connection; a refusal
    (Reservation Conflict and the rest) is one line on stderr and exit status 1."""
    request = {k: v for k, v in vars(args).items() if k not in ("command", "socket", "func")}
    with ControlClient(args.socket) as client:
        reply = client.call({"op": args.command, **request})
    if args.command != "resv-report":
        print(f"{args.command}: success", file=sys.stderr)
        return 0
    print(f"generation : {reply['generation']}\nrtype      : {reply['rtype']}\nptpl       : {int(reply['ptpl'])}"
          f"\nregctl     : {len(reply['registrants'])}")
    for i, r in enumerate(reply["registrants"]):
        print(f"regctl[{i}]  : cntlid {r['cntlid']:#x} rcsts {int(r['holds'])} hostid {r['hostid']} rkey {r['key']:#x}")
    return 0


def cmd_mount(args: argparse.Namespace) -> int:
    with ControlClient(args.socket) as client:
        reply = client.call({"op": "mount", "name": args.name, "mountpoint": os.path.abspath(args.mountpoint)})
    print(f"mounted {reply['name']} on {reply['mountpoint']}: {', '.join(reply['files']) or 'no namespaces'}")
    return 0


def cmd_umount(args: argparse.Namespace) -> int:
    with ControlClient(args.socket) as client:
        reply = client.call({"op": "umount", "mountpoint": os.path.abspath(args.mountpoint), "lazy": args.lazy})
    print(f"unmounted {reply['mountpoint']}")
    return 0


def cmd_mounts(args: argparse.Namespace) -> int:
    with ControlClient(args.socket) as client:
        mounts = client.call({"op": "mounts"})["mounts"]
    if wants_json(args):
        print_json({"mounts": mounts})
        return 0
    if not mounts:
        print("no mounts")
    for m in mounts:
        print(f"{m['mountpoint']}: {m['name']} ({', '.join(m['files'])}) reads {m['read']} writes {m['write']} "
              f"errors {m['errors']} via {m.get('transport', '/dev/fuse')} ({m.get('transport_reason', '')}; "
              f"{m.get('ring_requests', 0)} requests from the ring"
              + (f"; busy-polls {m['busy_polls'][0]}, {m['busy_polls'][1]} in time" if m.get("busy_polls", (0,))[0]
                 else "") + ")")
    return 0


def cmd_rxe(args: argparse.Namespace) -> int:
    from blockd.rdma.rxe import rxe_main
    return rxe_main(args.rxe_args)


def cmd_gen_dhchap_key(args: argparse.Namespace) -> int:
    """Print a new secret; with the same --secret, --nqn and --hmac the same text as nvme-cli."""
    from blockd.dhchap_secret import SecretError, generate_secret
    from initiator.params import default_hostnqn
    try:
        seed = bytes.fromhex(args.secret) if args.secret is not None else None
        secret = generate_secret(args.nqn or default_hostnqn(), args.hmac, args.key_length, seed)
    except (ValueError, SecretError) as exc:
        raise UsageError(f"gen-dhchap-key: {exc}") from None
    print(secret.encode())
    return 0


def cmd_install_units(args: argparse.Namespace) -> int:
    from blockd.units import run
    return run(args)


COMMANDS = {
    "rxe": cmd_rxe, "install-units": cmd_install_units, "gen-dhchap-key": cmd_gen_dhchap_key,
    "discover": cmd_discover, "connect": cmd_connect, "connect-all": cmd_connect_all, "disconnect": cmd_disconnect,
    "list": cmd_list, "read": cmd_read, "write": cmd_write, "id-ctrl": cmd_id_ctrl,
    "id-ns": cmd_id_ns, "mount": cmd_mount, "umount": cmd_umount, "mounts": cmd_mounts,
    "target": targetctl.cmd_target, "iostat": targetctl.cmd_iostat,
    "resv-register": cmd_resv, "resv-acquire": cmd_resv, "resv-release": cmd_resv, "resv-report": cmd_resv,
}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from initiator.errors import ConnectError, NvmeError
    try:
        return COMMANDS[args.command](args)
    except (ControlError, UsageError, ConnectError, NvmeError, TimeoutError) as exc:
        print(f"blockctl: {exc}", file=sys.stderr)
        return 1
    except (ConnectionError, OSError) as exc:
        print(f"blockctl: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
