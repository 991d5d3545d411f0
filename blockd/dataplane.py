"""Which data plane runs: the compiled extensions (``blockd/_*.pyx``) or their Python twins.

Decided once, at import: ``BLOCKD_PURE=1`` in the environment forces the Python path; otherwise
the compiled one runs when its extension was built (``pip install`` builds it where a C compiler
and the Python headers exist, and warns and goes on without it where they do not). Each
compiled module keeps a Python reference beside it that behaves the same, so the choice changes
speed, never behaviour (the differential tests compare the two).
"""

from __future__ import annotations

import os

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
