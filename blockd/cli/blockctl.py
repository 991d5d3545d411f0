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
import time
from typing import Any, BinaryIO, Iterator

from blockd.cli import targetctl
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

    c = sub.add_parser("connect", help="connect to a subsystem (held by the initiator daemon)")
    for opt in CONNECT_OPTIONS:
        _option_flag(c, opt, **({"required": False} if opt.key == "traddr" else {}))
    c.add_argument("--name", help="connection name (default: the NQN)")
    c.add_argument("--path", action="append", metavar="ADDR[:PORT]",
                   help="one path of a multipath connection (ANA failover); repeat for each target or "
                        "port presenting the subsystem (the port defaults to -s); instead of -a. A path "
                        "down now joins when it comes up; the connect fails only if none connects")

    x = sub.add_parser("disconnect", help="disconnect a connection")
    x.add_argument("name", help="connection name or NQN")
    sub.add_parser("list", help="list connections")

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

    m = sub.add_parser("mount", help="expose a connection's namespaces as files MOUNTPOINT/ns<N> (FUSE)")
    m.add_argument("name", help="connection name or NQN")
    m.add_argument("mountpoint")
    u = sub.add_parser("umount", help="unmount a blockd FUSE mount")
    u.add_argument("mountpoint")
    u.add_argument("-l", "--lazy", action="store_true", help="detach now even if files are open")
    sub.add_parser("mounts", help="list blockd FUSE mounts")

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
    n = sub.add_parser("id-ns", help="Identify Namespace")
    n.add_argument("name")
    n.add_argument("-N", "--nsid", type=int, default=1)
    _reservation_parsers(sub)
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
    entries = eventloop.run(discover(args.traddr, port, args.transport, args.hostnqn,
                                     dhchap_secret=args.dhchap_secret,
                                     dhchap_ctrl_secret=args.dhchap_ctrl_secret))
    print(f"Discovery Log Number of Records {len(entries)}")
    for n, e in enumerate(entries):
        kind = {1: "referral", 2: "nvme subsystem", 3: "current discovery subsystem"}.get(e.subtype, str(e.subtype))
        print(f"=====Discovery Log Entry {n}======\ntrtype:  {e.transport}\nsubtype: {kind}\n"
              f"portid:  {e.portid}\ntrsvcid: {e.trsvcid}\nsubnqn:  {e.subnqn}\ntraddr:  {e.traddr}")
    return 0


def cmd_connect(args: argparse.Namespace) -> int:
    if bool(args.traddr) == bool(args.path):
        raise UsageError("connect: give the target address with -a, or every path with --path")
    with ControlClient(args.socket) as client:
        reply = client.call({"op": "connect", "name": args.name,
                             **{opt.key: getattr(args, opt.key) for opt in CONNECT_OPTIONS},
                             **({"paths": args.path} if args.path else {})})
    paths = f", {len(reply['paths'])} paths" if reply.get("paths") else ""
    print(f"connected {reply['name']}: {reply['nqn']} cntlid {reply['cntlid']}, "
          f"{reply['io_queues']} I/O queue(s), {len(reply['namespaces'])} namespace(s){paths}")
    return 0


def cmd_disconnect(args: argparse.Namespace) -> int:
    with ControlClient(args.socket) as client:
        client.call({"op": "disconnect", "name": args.name})
    print(f"disconnected {args.name}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    with ControlClient(args.socket) as client:
        conns = client.call({"op": "list"})["connections"]
    if not conns:
        print("no connections")
    for c in conns:
        print(f"{c['name']}: {c['transport']}://{c['traddr']}:{c['trsvcid']} {c['nqn']} "
              f"cntlid {c['cntlid']} {c['state']}, {c['io_queues']} I/O queue(s)")
        for ns in c["namespaces"]:
            ro = " read-only" if ns["read_only"] else ""
            print(f"  nsid {ns['nsid']}: {ns['size']} bytes, {ns['block_size']}-byte blocks{ro}")
        if c.get("paths"):
            print(f"  iopolicy {c['iopolicy']}, {c['ana_retries']} command(s) retried after an ANA status, "
                  f"{c['path_retries']} after a path loss")
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


class Progress:
    """A one-line progress bar on stderr, only when stderr is a terminal and the transfer is big."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.start = time.monotonic()
        self.enabled = sys.stderr.isatty() and total >= 8 * CHUNK
        self._last = 0.0

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.1 or self.done == self.total):
            self._last = now
            frac = self.done / self.total
            rate = self.done / max(now - self.start, 1e-6) / 1e6
            bar = "#" * int(frac * 30)
            sys.stderr.write(f"\r[{bar:<30}] {frac:6.1%} {self.done >> 20}/{self.total >> 20} MiB {rate:7.1f} MB/s")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def cmd_read(args: argparse.Namespace) -> int:
    with ControlClient(args.socket) as client:
        ns = _namespace(client, args.name, args.nsid)
    offset, length = _range(args, ns, None)
    out: BinaryIO = sys.stdout.buffer if args.output == "-" else _open(args.output, "wb")
    progress = Progress(length)
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
    progress = Progress(length)

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
        data_in.close()
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


def _print_fields(ident: dict[str, Any], fields: list[str]) -> None:
    for f in fields:
        print(f"{f:<10}: {ident[f]}")


def cmd_id_ctrl(args: argparse.Namespace) -> int:
    with ControlClient(args.socket) as client:
        ident = client.call({"op": "id-ctrl", "name": args.name})["identify"]
    _print_fields(ident, ["vid", "sn", "mn", "fr", "cntlid", "ver", "cmic", "mdts", "kas", "maxcmd",
                          "nn", "oncs", "vwc", "sgls", "ioccsz", "iorcsz", "cntrltype", "subnqn"])
    return 0


def cmd_id_ns(args: argparse.Namespace) -> int:
    with ControlClient(args.socket) as client:
        ident = client.call({"op": "id-ns", "name": args.name, "nsid": args.nsid})["identify"]
    _print_fields(ident, ["nsze", "ncap", "nuse", "nlbaf", "flbas", "nmic", "dlfeat", "nsattr", "nguid", "eui64"])
    lbaf = ident["lbaf"][ident["flbas"] & 0xF]
    print(f"lbaf 0    : ms:{lbaf['ms']} lbads:{lbaf['lbads']} rp:{lbaf['rp']} (in use)")
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
    if not mounts:
        print("no mounts")
    for m in mounts:
        print(f"{m['mountpoint']}: {m['name']} ({', '.join(m['files'])}) reads {m['read']} writes {m['write']} "
              f"errors {m['errors']} via {m.get('transport', '/dev/fuse')} ({m.get('transport_reason', '')}; "
              f"{m.get('ring_requests', 0)} requests from the ring)")
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
    "discover": cmd_discover, "connect": cmd_connect, "disconnect": cmd_disconnect,
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
