"""``blockd.dataplane.twin``, the one rule every compiled component is chosen by: the compiled
module on the compiled plane, its Python reference under ``BLOCKD_PURE=1`` or when the compiled
one does not import (one warning, naming it), and None for a component without a twin."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from structlog.testing import capture_logs

from blockd import dataplane

BUILT = importlib.util.find_spec("blockd._pdu_reader") is not None
MISSING = "blockd._no_such_extension"


def _twin_in_subprocess(pure: bool, compiled: str, reference: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != dataplane.PURE_ENV}
    if pure:
        env[dataplane.PURE_ENV] = "1"
    code = f"from blockd.dataplane import twin; m = twin({compiled!r}, {reference!r}); print(m and m.__name__)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                          check=True).stdout.strip()


def test_pure_forces_the_reference() -> None:
    assert _twin_in_subprocess(True, "blockd._pdu_reader", "blockd.pdu_reader") == "blockd.pdu_reader"
    assert _twin_in_subprocess(True, "blockd._pdu_reader", None) == "None"


@pytest.mark.skipif(not BUILT, reason="compiled data plane not built")
def test_compiled_plane_takes_the_compiled_module() -> None:
    assert _twin_in_subprocess(False, "blockd._pdu_reader", "blockd.pdu_reader") == "blockd._pdu_reader"
    assert _twin_in_subprocess(False, "blockd._pdu_reader", None) == "blockd._pdu_reader"


@pytest.fixture
def compiled_plane(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled plane as chosen at import, whether or not this tree built it (the module
    asked for is missing either way), with no failure recorded yet."""
    monkeypatch.setattr(dataplane, "COMPILED", True)
    monkeypatch.setattr(dataplane, "NOT_BUILT", {})


@pytest.mark.usefixtures("compiled_plane")
def test_missing_compiled_module_falls_back_with_one_warning() -> None:
    with capture_logs() as logs:
        first = dataplane.twin(MISSING, "blockd.pdu_reader", hint="install gcc")
        again = dataplane.twin(MISSING, "blockd.pdu_reader")
    assert first is again is importlib.import_module("blockd.pdu_reader")
    assert len(logs) == 1, logs
    (entry,) = logs
    assert entry["log_level"] == "warning" and entry["module"] == MISSING and entry["hint"] == "install gcc"
    assert MISSING in entry["error"]
    assert MISSING in dataplane.NOT_BUILT[MISSING] and "not built" in dataplane.NOT_BUILT[MISSING]


@pytest.mark.usefixtures("compiled_plane")
def test_no_reference_gives_none() -> None:
    with capture_logs() as logs:
        assert dataplane.twin(MISSING, None) is None
    assert [entry["module"] for entry in logs] == [MISSING]


def test_pure_plane_logs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dataplane, "COMPILED", False)
    with capture_logs() as logs:
        assert dataplane.twin(MISSING, "blockd.pdu_reader") is importlib.import_module("blockd.pdu_reader")
        assert dataplane.twin(MISSING, None) is None
    assert logs == []
