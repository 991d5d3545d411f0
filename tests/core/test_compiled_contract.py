"""The compiled modules' contract with the Python objects they are handed (issue 36, item 1):
``target/compiled_contract.py`` and ``initiator/compiled_contract.py`` declare it, this holds the
``.pyx`` sources and the Python classes to it. Read from the sources: nothing is compiled or
imported of the compiled plane, so it runs on both planes.

A rename on either side fails here: a compiled module that reads a name its receiver's Protocol
does not declare, or a Python class that no longer defines a declared name (``_batched`` renamed
in ``target/tcp.py`` used to break the compiled plane with no error until a differential test
happened to notice)."""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from initiator import compiled_contract as host_contract
from target import compiled_contract as target_contract
from tests.pyx_source import REPO, Access, attribute_accesses, cdef_names, compiled_sources, getattr_names

CONTRACTS = (target_contract, host_contract)
RECEIVERS: dict[str, dict[str, type]] = {k: v for c in CONTRACTS for k, v in c.RECEIVERS.items()}
IMPLEMENTED_BY: dict[type, tuple[str, ...]] = {k: v for c in CONTRACTS for k, v in c.IMPLEMENTED_BY.items()}


def protocol_members(proto: type) -> set[str]:
    """The names a Protocol declares: its annotated fields and its methods (its own and its
    Protocol bases')."""
    names: set[str] = set()
    for cls in proto.__mro__:
        if cls is object or cls.__name__ in ("Protocol", "Generic"):
            continue
        names.update(getattr(cls, "__annotations__", {}))
        names.update(n for n, v in vars(cls).items() if not n.startswith("__") and callable(v))
    return names


def undeclared(text: str, receivers: dict[str, type]) -> list[Access]:
    """The accesses of a compiled module's code to a named receiver that its Protocol lacks."""
    return [a for a in attribute_accesses(text) + getattr_names(text)
            if a.receiver in receivers and a.name not in protocol_members(receivers[a.receiver])]


def private_reaches(text: str, declared: set[str]) -> list[Access]:
    """Accesses to another object's underscore name that no ``.pxd`` (nor the module's own cdef
    classes) declares at C level: ``self`` is the module's own object, dunders are Python's."""
    own = cdef_names(text)
    return [a for a in attribute_accesses(text) + getattr_names(text)
            if a.receiver != "self" and a.name.startswith("_") and not a.name.startswith("__")
            and a.name not in declared and a.name not in own]


def pxd_declared() -> set[str]:
    return {n for p in compiled_sources(".pxd") for n in cdef_names(p.read_text())}


def defines(obj: type | ModuleType, name: str) -> bool:
    """Whether a class (or its bases) or a module defines ``name``: an attribute of the class or
    module, an annotated field (a dataclass's), or a ``self.name`` assignment in a class's
    source (instance fields)."""
    if hasattr(obj, name):
        return True
    if isinstance(obj, ModuleType):
        return False
    for cls in obj.__mro__:
        if cls is object:
            continue
        if name in vars(cls).get("__annotations__", {}):
            return True
        try:
            src = inspect.getsource(cls)
        except (OSError, TypeError):
            continue
        if re.search(rf"\bself\.{name}\s*(?::|=(?!=)|(?:,\s*self\.\w+)+\s*=(?!=))", src):
            return True
    return False


def _resolve(dotted: str) -> type | ModuleType:
    try:
        return importlib.import_module(dotted)
    except ImportError:
        module, _, name = dotted.rpartition(".")
        return getattr(importlib.import_module(module), name)


def _contract_rows() -> Iterator[tuple[type, str]]:
    for proto, impls in IMPLEMENTED_BY.items():
        for impl in impls:
            yield proto, impl


@pytest.mark.parametrize("path", sorted(RECEIVERS))
def test_each_compiled_module_reads_only_what_its_receivers_declare(path: str) -> None:
    assert not undeclared((REPO / path).read_text(), RECEIVERS[path])


@pytest.mark.parametrize("path", [str(p.relative_to(REPO)) for p in compiled_sources()])
def test_no_compiled_module_reaches_another_objects_private_name(path: str) -> None:
    assert not private_reaches((REPO / path).read_text(), pxd_declared())


@pytest.mark.parametrize(("proto", "impl"), list(_contract_rows()), ids=lambda v: getattr(v, "__name__", v))
def test_each_declared_name_is_defined_by_its_python_class(proto: type, impl: str) -> None:
    obj = _resolve(impl)
    assert [n for n in sorted(protocol_members(proto)) if not defines(obj, n)] == []


def test_every_compiled_module_that_takes_python_objects_is_listed() -> None:
    """A compiled module that reads attributes of the objects the target and host hand it
    (a connection, a queue, a controller, a session) has its receivers named in a contract."""
    handed = {"conn", "queue", "ctrl", "session", "files"}
    unlisted = [str(p.relative_to(REPO)) for p in compiled_sources()
                if str(p.relative_to(REPO)) not in RECEIVERS
                and any(a.receiver in handed for a in attribute_accesses(p.read_text())
                        if not _declared_cdef_receiver(p, a))]
    assert unlisted == []


def _declared_cdef_receiver(path: Path, a: Access) -> bool:
    """``queue``/``conn`` that the module types as a cdef class (the host's compiled queue and
    connection): their fields are declared in a ``.pxd``."""
    return a.name in pxd_declared() | cdef_names(path.read_text())


# -- the detectors themselves -------------------------------------------------------------------------


def test_an_undeclared_attribute_is_found() -> None:
    text = "cdef f(self):\n    conn = self.conn\n    x = conn._batched + conn.flush_at\n    # conn.nope in a comment\n"
    got = undeclared(text, {"conn": target_contract.TcpConnection})
    assert [(a.receiver, a.name) for a in got] == [("conn", "_batched")]
    assert [(a.receiver, a.name) for a in private_reaches(text, set())] == [("conn", "_batched")]


def test_self_chains_getattr_and_strings() -> None:
    text = ('def f(self):\n    """``conn._take`` in prose"""\n    self.conn.r2t_held += 1\n'
            '    lane = getattr(ctrl, "_lane", None)\n    from blockd._le cimport le16\n')
    got = [(a.receiver, a.name) for a in private_reaches(text, set())]
    assert got == [("ctrl", "_lane")]
    assert [(a.receiver, a.name) for a in attribute_accesses(text)] == [("self", "conn"), ("conn", "r2t_held")]


def test_pxd_declared_names_are_allowed() -> None:
    pxd = "cdef class PduReader:\n    cdef unsigned char* _p\n    cdef int _take(self) except -1\n"
    assert {"_p", "_take"} <= cdef_names(pxd)
    assert private_reaches("x = reader._p\nreader._take()\n", cdef_names(pxd)) == []


def test_a_renamed_python_field_is_found() -> None:
    class Renamed:
        def __init__(self) -> None:
            self._batched = 0  # what target/tcp.py had: the Protocol's "batched" is gone

    assert not defines(Renamed, "batched")
    assert defines(Renamed, "_batched")

    class Pair:
        def __init__(self) -> None:
            self.r, self.w = 1, 2
            print(self.x == 1, self.y)

    assert defines(Pair, "r") and defines(Pair, "w")
    assert not defines(Pair, "x") and not defines(Pair, "y")
