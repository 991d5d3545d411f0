"""``blockd.dataplane.twin``, the one rule every compiled component is chosen by: the compiled
module on the compiled plane, its Python reference under ``BLOCKD_PURE=1`` or when the compiled
one does not import (one warning, naming it), and None for a component that shadows methods; and
``TWINS``, the table it reads: every compiled module in it, each with a reference that resolves
and a differential test that exists and names it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from blockd import dataplane

BUILT = importlib.util.find_spec("blockd._pdu_reader") is not None
MISSING = "blockd._no_such_extension"
REPO = Path(__file__).resolve().parents[2]


def _twin_in_subprocess(pure: bool, compiled: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != dataplane.PURE_ENV}
    if pure:
        env[dataplane.PURE_ENV] = "1"
    code = f"from blockd.dataplane import twin; m = twin({compiled!r}); print(m and m.__name__)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                          check=True).stdout.strip()


def test_pure_forces_the_reference() -> None:
    assert _twin_in_subprocess(True, "blockd._pdu_reader") == "blockd.pdu_reader"
    assert _twin_in_subprocess(True, "target._tcp_io") == "None"  # a shadow path: no module stands in


@pytest.mark.skipif(not BUILT, reason="compiled data plane not built")
def test_compiled_plane_takes_the_compiled_module() -> None:
    assert _twin_in_subprocess(False, "blockd._pdu_reader") == "blockd._pdu_reader"
    assert _twin_in_subprocess(False, "target._tcp_io") == "target._tcp_io"


@pytest.fixture
def compiled_plane(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled plane as chosen at import, whether or not this tree built it (the module
    asked for is missing either way), with no failure recorded yet."""
    monkeypatch.setattr(dataplane, "COMPILED", True)
    monkeypatch.setattr(dataplane, "NOT_BUILT", {})
    _missing_rows(monkeypatch)


SHADOW = MISSING + "_shadow"


def _missing_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two rows for modules that do not exist: one with a module reference, one shadowing."""
    rows = dict(dataplane.TWINS)
    rows[MISSING] = dataplane.Twin(MISSING, "blockd.pdu_reader", "tests/core/test_dataplane_twin.py")
    rows[SHADOW] = dataplane.Twin(SHADOW, "blockd.pdu_reader:PduReader.take", "tests/core/test_dataplane_twin.py")
    monkeypatch.setattr(dataplane, "TWINS", rows)


@pytest.mark.usefixtures("compiled_plane")
def test_missing_compiled_module_falls_back_with_one_warning() -> None:
    with capture_logs() as logs:
        first = dataplane.twin(MISSING, hint="install gcc")
        again = dataplane.twin(MISSING)
    assert first is again is importlib.import_module("blockd.pdu_reader")
    assert len(logs) == 1, logs
    (entry,) = logs
    assert entry["log_level"] == "warning" and entry["module"] == MISSING and entry["hint"] == "install gcc"
    assert MISSING in entry["error"]
    assert MISSING in dataplane.NOT_BUILT[MISSING] and "not built" in dataplane.NOT_BUILT[MISSING]


@pytest.mark.usefixtures("compiled_plane")
def test_no_reference_gives_none() -> None:
    with capture_logs() as logs:
        assert dataplane.twin(SHADOW) is None
    assert [entry["module"] for entry in logs] == [SHADOW]


def test_pure_plane_logs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dataplane, "COMPILED", False)
    _missing_rows(monkeypatch)
    with capture_logs() as logs:
        assert dataplane.twin(MISSING) is importlib.import_module("blockd.pdu_reader")
        assert dataplane.twin(SHADOW) is None
    assert logs == []


# -- the table --------------------------------------------------------------------------------------------


def _compiled_modules() -> list[str]:
    """Every compiled module of the tree, by its ``.pyx``."""
    return sorted(".".join(p.relative_to(REPO).with_suffix("").parts)
                  for d in ("blockd", "target", "initiator") for p in (REPO / d).rglob("*.pyx"))


def test_every_compiled_module_has_a_row() -> None:
    assert [m for m in _compiled_modules() if m not in dataplane.TWINS] == []
    assert [m for m in dataplane.TWINS if m not in _compiled_modules()] == []


@pytest.mark.parametrize("row", list(dataplane.TWINS.values()), ids=lambda r: r.compiled)
def test_each_row_has_its_test(row: dataplane.Twin) -> None:
    """The differential test exists and names the compiled module it holds to its reference."""
    test = REPO / row.test
    assert test.is_file(), row.test
    assert row.compiled in test.read_text() or row.compiled.replace(".", "/") + ".pyx" in test.read_text()


@pytest.mark.parametrize("row", list(dataplane.TWINS.values()), ids=lambda r: r.compiled)
def test_each_reference_resolves(row: dataplane.Twin) -> None:
    """A module reference imports; a shadow reference names methods its classes define."""
    if row.module_twin:
        importlib.import_module(row.reference)
        return
    for part in row.reference.split(";"):
        module_name, _, methods = part.strip().partition(":")
        module = importlib.import_module(module_name)
        for dotted in methods.split(","):
            owner, _, method = dotted.strip().partition(".")
            assert callable(getattr(getattr(module, owner), method)), (module_name, dotted)


@pytest.mark.parametrize("row", list(dataplane.TWINS.values()), ids=lambda r: r.compiled)
def test_each_compiled_module_names_its_twin_first(row: dataplane.Twin) -> None:
    """The first lines of a compiled module's source name its reference (a module, or a class
    whose methods it shadows), so a reader knows what it twins before anything else."""
    head = "\n".join((REPO / (row.compiled.replace(".", "/") + ".pyx")).read_text().splitlines()[:8])
    names = set()
    for part in row.reference.split(";"):
        module, _, methods = part.strip().partition(":")
        names.add(module)
        names.update(m.strip().split(".")[0] for m in methods.split(",") if m.strip())
    assert any(name in head for name in names), (row.compiled, sorted(names))
