"""Which data plane runs: the compiled extensions (``blockd/_*.pyx``) or their Python twins.

Decided once, at import: ``BLOCKD_PURE=1`` in the environment forces the Python path; otherwise
the compiled one runs when its extension was built (``pip install`` builds it where a C compiler
and the Python headers exist, and warns and goes on without it where they do not). Each
compiled module keeps a Python reference beside it that behaves the same, so the choice changes
speed, never behaviour (the differential tests compare the two). :func:`twin` is the one place
that applies this choice to a module.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import overload

import structlog

PURE_ENV = "BLOCKD_PURE"

COMPILED = False
"""True when the compiled data plane is in use."""
REASON = ""
"""Why the Python path runs (empty when compiled): said in the daemons' start-up line."""

FORCED_PURE = os.environ.get(PURE_ENV, "") not in ("", "0")
"""The Python path was asked for; otherwise running it means the extension is missing (a warning)."""

if FORCED_PURE:
    REASON = f"{PURE_ENV} is set"
else:
    try:
        from blockd import _pdu_reader  # noqa: F401  (probing for the built extension)
    except ImportError as exc:
        REASON = f"compiled extension not built ({exc})"
    else:
        COMPILED = True

DATA_PLANE = "data plane: compiled" if COMPILED else "data plane: pure Python"
"""What ``blockd --version`` prints and the daemons log at start."""

NOT_BUILT: dict[str, str] = {}
"""Compiled modules that failed to import on the compiled plane, each with why (``REASON``'s
wording): their references run, and :func:`twin` has said so once."""

log = structlog.get_logger("blockd.dataplane")


@overload
def twin(compiled: str, reference: str, *, hint: str = "") -> ModuleType: ...
@overload
def twin(compiled: str, reference: None, *, hint: str = "") -> ModuleType | None: ...
def twin(compiled: str, reference: str | None, *, hint: str = "") -> ModuleType | None:
    """The module of a compiled component to run: ``compiled`` (a dotted name) on the compiled
    plane, else the Python ``reference``, or None for a component that has no Python twin (its
    callers then take their ordinary Python path).

    A compiled module that fails to import on the compiled plane (its compile failed alone, or a
    module it cimports is missing) falls back to its reference with one warning naming it and the
    error, and ``hint`` (what to install) when given; it is recorded in :data:`NOT_BUILT`. On the
    pure plane nothing is logged: the daemons' start-up line already says which plane runs and
    why. Modules are named by string so that ``blockd/`` can choose for ``target/`` and
    ``initiator/`` without importing them (``tests/test_layers.py``)."""
    if COMPILED:
        try:
            return importlib.import_module(compiled)
        except ImportError as exc:
            if compiled not in NOT_BUILT:
                NOT_BUILT[compiled] = f"compiled extension not built ({exc})"
                log.warning("compiled module not built; its Python twin runs" if reference
                            else "compiled module not built; the Python path serves without it",
                            module=compiled, error=str(exc), **({"hint": hint} if hint else {}))
    return None if reference is None else importlib.import_module(reference)
