"""``blockctl connect-all``: where to discover, and which discovered entries to connect.

The discovery controllers come from the command line, from ``/etc/nvme/discovery.conf`` (one
controller a line in nvme-cli's flags: ``-t tcp -a 192.0.2.1 -s 8009 -q NQN``, ``#`` starts a
comment) or from the initiator configuration's ``[[discovery]]`` tables. As nvme-cli's
connect-all, every discovery log is read, referrals (entries of subtype referral) are followed to
the discovery controllers they name, and every NVM subsystem entry of a transport this host has
is a connection to make, unless the same subsystem at the same address is connected already.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass
from typing import Any, Iterable

from initiator.discovery import DiscoveryEntry, discover
from initiator.errors import ConnectError
from initiator.params import TRANSPORT_NAMES, check_option
from protocol.constants import DEFAULT_IO_PORT, DEFAULT_TCP_DISCOVERY_PORT, SubsystemType

MAX_REFERRAL_DEPTH = 8
"""Referrals followed from one discovery controller, at most (a loop of referrals ends at the
first controller seen twice; this bounds a chain of distinct ones)."""

DISCOVERY_KEYS = ("transport", "traddr", "trsvcid", "hostnqn", "dhchap_secret", "dhchap_ctrl_secret")
"""What names a discovery controller and how to reach it; the other connect options in a
``discovery.conf`` line or a ``[[discovery]]`` table apply to the connections made from it."""


class DiscoveryConfError(ValueError):
    """A line of a discovery.conf that cannot be used; the message names file and line."""


def _conf_parser() -> argparse.ArgumentParser:
    """nvme-cli's flags as a discovery.conf line spells them (the subset blockd's host has)."""
    p = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    p.add_argument("-t", "--transport")
    p.add_argument("-a", "--traddr")
    p.add_argument("-s", "--trsvcid", type=int)
    p.add_argument("-q", "--hostnqn")
    p.add_argument("-S", "--dhchap-secret", dest="dhchap_secret")
    p.add_argument("-C", "--dhchap-ctrl-secret", dest="dhchap_ctrl_secret")
    p.add_argument("-i", "--nr-io-queues", dest="nr_io_queues", type=int)
    p.add_argument("-Q", "--queue-size", dest="queue_size", type=int)
    p.add_argument("-k", "--keep-alive-tmo", dest="keep_alive_tmo", type=float)
    p.add_argument("-l", "--ctrl-loss-tmo", dest="ctrl_loss_tmo", type=float)
    p.add_argument("-g", "--hdr-digest", dest="hdr_digest", action="store_const", const=True)
    p.add_argument("-G", "--data-digest", dest="data_digest", action="store_const", const=True)
    return p


def parse_discovery_conf(text: str, source: str) -> list[dict[str, Any]]:
    """The discovery controllers of a discovery.conf (each as connect options by their external
    keys, ``initiator.params``): blank and ``#`` lines skipped, any other mistake a
    :class:`DiscoveryConfError` naming the line."""
    parser = _conf_parser()
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{number}"
        try:
            args, extra = parser.parse_known_args(shlex.split(line))
        except (argparse.ArgumentError, ValueError) as exc:
            raise DiscoveryConfError(f"{where}: {exc}") from None
        if extra:
            raise DiscoveryConfError(f"{where}: unsupported {' '.join(extra)} (blockctl takes "
                                     f"-t -a -s -q -S -C -i -Q -k -l -g -G)")
        options = {k: v for k, v in vars(args).items() if v is not None}
        if "traddr" not in options:
            raise DiscoveryConfError(f"{where}: no -a/--traddr")
        for key, value in options.items():
            why = check_option(key, value)
            if why:
                raise DiscoveryConfError(f"{where}: {why}")
        found.append(options)
    return found


def discovery_port(options: dict[str, Any]) -> int:
    """The discovery controller's port: as given, else the transport's well-known one."""
    if options.get("trsvcid"):
        return int(options["trsvcid"])
    return DEFAULT_TCP_DISCOVERY_PORT if options.get("transport", "tcp") == "tcp" else DEFAULT_IO_PORT


@dataclass(frozen=True)
class Found:
    """An NVM subsystem entry, with the options of the discovery controller it came from."""

    entry: DiscoveryEntry
    options: dict[str, Any]

    def connect_options(self) -> dict[str, Any]:
        """The ``connect`` request's options for this entry."""
        return {**self.options, "transport": self.entry.transport, "traddr": self.entry.traddr,
                "trsvcid": int(self.entry.trsvcid), "nqn": self.entry.subnqn}


async def discover_all(sources: Iterable[dict[str, Any]], timeout: float = 5.0) -> tuple[list[Found], list[str]]:
    """Every NVM subsystem entry reachable from ``sources`` through referrals, each once, and
    one line per discovery controller that could not be read (the others still count)."""
    found: list[Found] = []
    failures: list[str] = []
    seen: set[tuple[str, str, int]] = set()
    keys: set[tuple[str, str, str, str]] = set()
    todo = [(dict(s), 0) for s in sources]
    while todo:
        options, depth = todo.pop(0)
        transport = options.get("transport", "tcp")
        where = (transport, options["traddr"], discovery_port(options))
        if where in seen:
            continue
        seen.add(where)
        try:
            log = await discover(options["traddr"], where[2], transport, options.get("hostnqn"), timeout=timeout,
                                 dhchap_secret=options.get("dhchap_secret"),
                                 dhchap_ctrl_secret=options.get("dhchap_ctrl_secret"))
        except (ConnectError, OSError, TimeoutError) as exc:
            failures.append(f"{transport}://{where[1]}:{where[2]}: {exc}")
            continue
        for e in log.entries:
            if e.subtype == SubsystemType.REFERRAL and depth < MAX_REFERRAL_DEPTH:
                todo.append(({**options, "transport": e.transport, "traddr": e.traddr,
                              "trsvcid": int(e.trsvcid)}, depth + 1))
            elif e.subtype == SubsystemType.NVME and e.transport in TRANSPORT_NAMES:
                key = (e.transport, e.traddr, e.trsvcid, e.subnqn)
                if key not in keys:
                    keys.add(key)
                    found.append(Found(e, {k: v for k, v in options.items()
                                           if k not in ("transport", "traddr", "trsvcid")}))
    return found, failures


def connected(found: Found, connections: list[dict[str, Any]]) -> bool:
    """Whether the daemon holds a connection to this entry's subsystem at its address (a
    multipath connection counts when one of its paths is there)."""
    e = found.entry
    for c in connections:
        if c["nqn"] != e.subnqn:
            continue
        for p in [c, *c.get("paths", [])]:
            if p["transport"] == e.transport and p["traddr"] == e.traddr and str(p["trsvcid"]) == e.trsvcid:
                return True
    return False


def connection_name(found: Found, taken: set[str]) -> str:
    """The NQN, as ``blockctl connect`` names a connection; NQN@ADDR:PORT when a connection of
    that name exists already (another path of the subsystem)."""
    e = found.entry
    return e.subnqn if e.subnqn not in taken else f"{e.subnqn}@{e.traddr}:{e.trsvcid}"
