"""The connect parameters, declared once: :class:`ConnectParams`.

Each field a user can set carries its nvme-cli flag, its help and its external name (``nqn``
for ``subnqn``) in the field's metadata; ``blockctl connect``'s flags, the daemon's ``connect``
request, and the ``[[connection]]`` tables of the initiator config are all derived from that
(:func:`connect_options`, :func:`connect_params`), so a parameter and its default live in one
place. Fields without that metadata are the host library's own tuning.
"""

from __future__ import annotations

import dataclasses
import math
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

from blockd.dhchap_secret import Secret, SecretError, parse_secret
from initiator.transport import TRANSPORTS
from protocol.constants import DEFAULT_IO_PORT

TRANSPORT_NAMES = tuple(TRANSPORTS)
"""The registered transports (:mod:`initiator.transport`), as they stand when this is imported."""
RDMA_KEY_MODES = ("auto", "mw", "mr")
IOPOLICIES = ("numa", "round-robin", "queue-depth")
"""The multipath I/O policies, named as the Linux host's (its subsystem ``iopolicy``);
:mod:`initiator.multipath` says what each does here."""


def default_hostnqn() -> str:
    """/etc/nvme/hostnqn if nvme-cli set one up, else one derived from the machine id."""
    try:
        with open("/etc/nvme/hostnqn") as f:
            nqn = f.read().strip()
            if nqn:
                return nqn
    except OSError:
        pass
    try:
        with open("/etc/machine-id") as f:
            mid = uuid.UUID(f.read().strip())
    except (OSError, ValueError):
        mid = uuid.uuid5(uuid.NAMESPACE_DNS, os.uname().nodename)
    return f"nqn.2014-08.org.nvmexpress:uuid:{mid}"


def _option(flag: str | None, help: str, key: str | None = None,
            choices: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Field metadata of a user-settable parameter (see the module docstring)."""
    return {"option": True, "flag": flag, "help": help, "key": key, "choices": choices}


@dataclass
class ConnectParams:
    """What nvme-cli's connect takes, plus the host library's own timeouts."""

    traddr: str = field(metadata=_option("-a", "target address"))
    subnqn: str = field(metadata=_option("-n", "subsystem NQN", key="nqn"))
    transport: str = field(default="tcp", metadata=_option("-t", "transport", choices=TRANSPORT_NAMES))
    trsvcid: int = field(default=DEFAULT_IO_PORT, metadata=_option("-s", "target port"))
    hostnqn: str = field(default_factory=default_hostnqn, metadata=_option(
        "-q", "host NQN (default /etc/nvme/hostnqn or one from the machine id)"))
    nr_io_queues: int = field(default=4, metadata=_option("-i", "number of I/O queues"))
    queue_size: int = field(default=128, metadata=_option("-Q", "I/O queue depth"))
    keep_alive_tmo: float = field(default=5.0, metadata=_option("-k", "keep-alive timeout, seconds"))
    ctrl_loss_tmo: float = field(default=60.0, metadata=_option(
        "-l", "seconds to keep reconnecting after a connection is lost; -1 = forever"))
    hdr_digest: bool = field(default=False, metadata=_option("-g", "NVMe/TCP header digests"))
    data_digest: bool = field(default=False, metadata=_option("-G", "NVMe/TCP data digests"))
    rdma_keys: str = field(default_factory=lambda: os.environ.get("BLOCKD_RDMA_KEYS", "auto"), metadata=_option(
        None, "how RDMA commands expose their buffers (see initiator/rdma.py); env BLOCKD_RDMA_KEYS",
        choices=RDMA_KEY_MODES))
    dhchap_secret: str | None = field(default=None, repr=False, metadata=_option(
        "-S", "DH-HMAC-CHAP host secret (DHHC-1:hh:...:, as nvme gen-dhchap-key prints it)"))
    dhchap_ctrl_secret: str | None = field(default=None, repr=False, metadata=_option(
        "-C", "DH-HMAC-CHAP controller secret: authenticate the controller too"))
    iopolicy: str = field(default=IOPOLICIES[0], metadata=_option(
        None, "multipath I/O policy among a connection's paths (--path): numa (the kernel's default: "
        "the first usable path), round-robin, queue-depth", choices=IOPOLICIES))
    hostid: uuid.UUID | None = None
    """Default: derived from ``hostnqn``, so one host NQN always has one host id."""
    command_timeout: float = 30.0
    connect_timeout: float = 5.0
    reconnect_delay: float = 1.0

    def secrets(self) -> tuple[Secret | None, Secret | None]:
        """The host's and the controller's DH-HMAC-CHAP secrets, parsed (None when unset)."""
        return (parse_secret(self.dhchap_secret) if self.dhchap_secret else None,
                parse_secret(self.dhchap_ctrl_secret) if self.dhchap_ctrl_secret else None)

    def __post_init__(self) -> None:
        if self.hostid is None:
            self.hostid = uuid.uuid5(uuid.NAMESPACE_OID, self.hostnqn)
        if self.ctrl_loss_tmo < 0:
            self.ctrl_loss_tmo = math.inf


@dataclass(frozen=True)
class ConnectOption:
    """One user-settable connect parameter, as the CLI, the daemon and the config file see it."""

    key: str
    """External name: the config key, the request key and the long flag (``_`` as ``-``)."""
    attr: str
    """The :class:`ConnectParams` field."""
    type: type
    required: bool
    default: Any
    """None when required or computed when used (see ``help``)."""
    flag: str | None
    help: str
    choices: tuple[str, ...] | None


def connect_options() -> tuple[ConnectOption, ...]:
    """The user-settable fields of :class:`ConnectParams`, in declaration order."""
    hints = {"str": str, "str | None": str, "int": int, "float": float, "bool": bool}
    out = []
    for f in dataclasses.fields(ConnectParams):
        meta = f.metadata
        if not meta.get("option"):
            continue
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        default = None if f.default is dataclasses.MISSING else f.default  # a factory's: see the help
        out.append(ConnectOption(meta["key"] or f.name, f.name, hints[str(f.type)], required, default,
                                 meta["flag"], meta["help"], meta["choices"]))
    return tuple(out)


CONNECT_OPTIONS = connect_options()
OPTIONS_BY_KEY = {o.key: o for o in CONNECT_OPTIONS}


def check_option(key: str, value: Any) -> str | None:
    """Why ``value`` is not valid for the option ``key``, or None."""
    opt = OPTIONS_BY_KEY.get(key)
    if opt is None:
        return f"unknown setting {key!r}"
    kinds: tuple[type, ...] = (int, float) if opt.type is float else (opt.type,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and opt.type is not bool):
        return f"{key!r} must be {' or '.join(k.__name__ for k in kinds)}, not {value!r}"
    if opt.choices and value not in opt.choices:
        return f"{key!r} must be {' or '.join(opt.choices)}, not {value!r}"
    if key == "trsvcid" and not 1 <= value <= 65535:
        return f"trsvcid {value} is out of range"
    if key in ("dhchap_secret", "dhchap_ctrl_secret"):
        try:
            parse_secret(value)
        except SecretError as exc:  # never quotes the secret
            return f"{key}: {exc}"
    return None


def connect_params(options: dict[str, Any]) -> ConnectParams:
    """:class:`ConnectParams` from external keys (a request or a config table); a ValueError
    names the first bad or missing one. Absent and None values take the field's default."""
    given = {k: v for k, v in options.items() if v is not None}
    for key, value in given.items():
        why = check_option(key, value)
        if why:
            raise ValueError(why)
    missing = [o.key for o in CONNECT_OPTIONS if o.required and o.key not in given]
    if missing:
        raise ValueError(f"missing {', '.join(repr(k) for k in missing)}")
    return ConnectParams(**{OPTIONS_BY_KEY[k].attr: v for k, v in given.items()})
