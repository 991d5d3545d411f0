"""What the target's and the initiator's configuration files share: one error type worded for
the person who wrote the file, TOML reading, sizes such as ``"64MiB"``, the checks of a table's
keys and types, the rule that a file holding secrets is not readable by others, and the
``[metrics]`` table of both daemons.

Each end's own settings live with that end: :mod:`target.config` and :mod:`initiator.config`.
"""

from __future__ import annotations

import os
import re
import stat
import tomllib
from dataclasses import dataclass
from typing import Any

_SIZE = re.compile(r"^\s*(\d+)\s*([KMGTP]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}


class ConfigError(ValueError):
    """A configuration mistake, worded for the person who made it."""


def parse_size(value: int | str, where: str) -> int:
    """``4096``, ``"64MiB"``, ``"10G"`` → bytes."""
    if isinstance(value, int) and value > 0:
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise ConfigError(f"{where}: size {value!r} is not a number of bytes like 512MiB or 10GiB")
    unit = (m.group(2) or "").upper()[:1]
    size = int(m.group(1)) * _UNITS[unit if unit != "B" else ""]
    if size <= 0:
        raise ConfigError(f"{where}: size must be positive")
    return size


def take(table: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str, default: Any = ...) -> Any:
    """``table[key]`` checked to be of ``kind`` (a bool is no int); ``default`` when missing, or
    a ConfigError naming ``where`` when there is none."""
    if key not in table:
        if default is ...:
            raise ConfigError(f"{where}: missing '{key}'")
        return default
    value = table[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        name = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ConfigError(f"{where}: '{key}' must be {name}, not {value!r}")
    return value


def unknown(table: dict[str, Any], known: set[str], where: str) -> None:
    """A ConfigError naming the keys of ``table`` that are not ``known`` (a typo is not ignored)."""
    extra = set(table) - known
    if extra:
        raise ConfigError(f"{where}: unknown setting(s) {', '.join(sorted(extra))}")


def read_toml(path: str) -> dict[str, Any]:
    """A TOML file as a dict; unreadable or malformed files are one-line ConfigErrors."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def refuse_readable_secrets(path: str) -> None:
    """A file holding DH-HMAC-CHAP secrets must not be readable by others."""
    if os.stat(path).st_mode & stat.S_IROTH:
        raise ConfigError(f"{path} holds DH-HMAC-CHAP secrets but is readable by others "
                          f"(chmod o-r {path})")


@dataclass(frozen=True)
class MetricsConfig:
    """Where a daemon serves its Prometheus metrics (``[metrics]``, off unless ``enabled``)."""

    address: str
    port: int


def metrics_config(table: dict[str, Any], where: str, default_port: int) -> MetricsConfig | None:
    """A ``[metrics]`` table (``enabled``, ``address``, ``port``): None unless enabled; bound
    to loopback unless ``address`` says otherwise."""
    unknown(table, {"enabled", "address", "port"}, where)
    address = take(table, "address", str, where, "127.0.0.1")
    port = take(table, "port", int, where, default_port)
    if not 0 <= port <= 65535:
        raise ConfigError(f"{where}: port {port} is out of range")
    if not take(table, "enabled", bool, where, False):
        return None
    return MetricsConfig(address, port)
