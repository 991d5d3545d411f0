"""Helpers that keep construct the single source of truth while the hot path stays fast.

construct is interpretive: parsing one 64-byte SQE costs tens of microseconds. The per-I/O path
(SQE, CQE, SGL, NVMe/TCP PDU headers) instead uses a ``struct.Struct`` *derived* from the
construct definition by :func:`fixed_layout`, so both always describe the same bytes; the
derivation refuses any field it cannot express rather than guessing.
"""

from __future__ import annotations

import struct
from typing import Any, Iterable

import construct as c


def at_offsets(size: int, fields: Iterable[tuple[int, str, c.Construct]]) -> c.Struct:
    """Build a fixed-size ``Struct`` from (offset, name, construct) rows, as specs print them.

    Gaps become zero padding, the total is padded to ``size``; overlapping rows or a
    structure that overflows ``size`` raise at import time.
    """
    subcons: list[c.Construct] = []
    pos = 0
    for offset, name, con in fields:
        if offset < pos:
            raise ValueError(f"field {name} at {offset} overlaps the previous field (ends at {pos})")
        if offset > pos:
            subcons.append(c.Padding(offset - pos))
        subcons.append(name / con)
        pos = offset + con.sizeof()
    if pos > size:
        raise ValueError(f"fields end at {pos}, beyond the structure size {size}")
    if pos < size:
        subcons.append(c.Padding(size - pos))
    return c.Struct(*subcons)


def field_offset(con: c.Struct, name: str) -> int:
    """Byte offset of field ``name`` in a fixed-size ``Struct`` (the C ``offsetof``), for error
    locations that point at a field."""
    pos = 0
    for sub in con.subcons:
        if isinstance(sub, c.Renamed) and sub.name == name:
            return pos
        pos += sub.sizeof()
    raise KeyError(f"no field {name!r}")


def _format_of(con: c.Construct) -> str:
    """The ``struct`` format characters for one construct field (no byte order prefix)."""
    if isinstance(con, c.FormatField):
        if con.fmtstr[0] not in "<=":
            raise TypeError(f"only little-endian fields can be derived, got {con.fmtstr!r}")
        return con.fmtstr[1:]
    if isinstance(con, c.Bytes) and isinstance(con.length, int):
        return f"{con.length}s"
    if isinstance(con, c.Padded) and isinstance(con.subcon, type(c.Pass)) and isinstance(con.length, int):
        return f"{con.length}x"
    raise TypeError(f"cannot derive a fixed layout for {con!r}")


class FixedLayout:
    """A ``struct.Struct`` equivalent of a construct ``Struct`` made only of fixed scalars.

    ``names`` lists the named fields in order; ``unpack_from``/``pack`` use that order.
    """

    def __init__(self, con: c.Struct) -> None:
        fmt = "<"
        names: list[str] = []
        for sub in con.subcons:
            inner = sub.subcon if isinstance(sub, c.Renamed) else sub
            part = _format_of(inner)
            fmt += part
            if isinstance(sub, c.Renamed) and not part.endswith("x"):
                names.append(sub.name)
        self.construct = con
        self.struct = struct.Struct(fmt)
        self.size = self.struct.size
        self.names = tuple(names)
        self.unpack_from = self.struct.unpack_from
        self.pack = self.struct.pack
        self.pack_into = self.struct.pack_into
        if self.size != con.sizeof():
            raise AssertionError(f"derived size {self.size} != construct size {con.sizeof()}")

    def index(self, name: str) -> int:
        """Position of ``name`` in the tuples this layout packs and unpacks."""
        return self.names.index(name)

    def as_dict(self, data: bytes | memoryview, offset: int = 0) -> dict[str, Any]:
        """Named view for debugging and tests; the hot path uses the tuple."""
        return dict(zip(self.names, self.unpack_from(data, offset)))


def fixed_layout(con: c.Struct) -> FixedLayout:
    """Derive the fast layout of ``con`` (see module docstring)."""
    return FixedLayout(con)


class SpacePadded(c.Adapter):
    """ASCII text padded with spaces to a fixed width (Identify SN/MN/FR)."""

    def __init__(self, length: int) -> None:
        super().__init__(c.Bytes(length))
        self.length = length

    def _decode(self, obj: bytes, context: Any, path: str) -> str:
        return obj.decode("ascii", "replace").rstrip(" \0")

    def _encode(self, obj: str, context: Any, path: str) -> bytes:
        raw = obj.encode("ascii")
        if len(raw) > self.length:
            raise c.StringError(f"{obj!r} is longer than {self.length} bytes")
        return raw.ljust(self.length, b" ")


def nul_padded(length: int) -> c.Construct:
    """ASCII text NUL padded to a fixed width (NQNs, TRADDR, TRSVCID)."""
    return c.PaddedString(length, "ascii")
