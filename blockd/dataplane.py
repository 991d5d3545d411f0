"""Which data plane runs: the compiled extensions (``blockd/_*.pyx``) or their Python twins.

Decided once, at import: ``BLOCKD_PURE=1`` in the environment forces the Python path; otherwise
the compiled one runs when its extension was built (``pip install`` builds it where a C compiler
and the Python headers exist, and warns and goes on without it where they do not). Each
compiled module keeps a Python reference beside it that behaves the same, so the choice changes
speed, never behaviour (the differential tests compare the two; :data:`TWINS` lists each
module, its reference and its test). :func:`twin` is the one place that applies this choice to a
module.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from types import ModuleType

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


@dataclass(frozen=True)
class Twin:
    """One compiled module and what it twins: one row of :data:`TWINS`."""

    compiled: str
    """The compiled module's dotted name (``blockd._pdu_reader``)."""
    reference: str
    """Its Python reference: a module that runs in its place on the Python plane
    (``blockd.pdu_reader``); or ``module:Class.method, ...``, the methods a compiled path shadows
    (it has no module of its own to stand in: on the Python plane its callers keep their Python
    path, and :func:`twin` gives None)."""
    test: str
    """The test file (from the repository's root) that compares the two."""

    @property
    def module_twin(self) -> bool:
        """The reference is a module that :func:`twin` returns in the compiled one's place."""
        return ":" not in self.reference


TWINS: dict[str, Twin] = {t.compiled: t for t in (
    Twin("blockd._pdu_reader", "blockd.pdu_reader", "tests/protocol/test_reader_differential.py"),
    Twin("blockd._output", "blockd.output", "tests/core/test_output_differential.py"),
    Twin("blockd._iostats", "blockd.iostats", "tests/core/test_iostats_differential.py"),
    Twin("blockd.rdma._fast_verbs", "blockd.rdma._fast", "tests/rdma/test_fast_path.py"),
    Twin("target._file_io", "target.backend:FileBackend.read_into, FileBackend.write, FileBackend.flush; "
                            "target.file_send:PipedRead.fill, ReplyPipe.drain",
         "tests/core/test_read_by_reference.py"),
    Twin("target._io_core", "target.queue:TargetQueue.submit, TargetQueue._complete; "
                            "target.controller:Controller._check_rw",
         "tests/core/test_io_core.py"),
    Twin("target._tcp_io", "target.tcp:TcpTargetConnection.queue_response, TcpTargetConnection.fetch_data",
         "tests/core/test_io_fast.py"),
    Twin("target._tcp_thread", "target.tcp:TcpTargetConnection._receive, TcpTargetConnection.take_pdu; "
                               "target.queue:TargetQueue.data_ready",
         "tests/core/test_tcp_thread.py"),
    Twin("target._uring_loop", "target._tcp_thread:TcpFastPath._run, TcpFastPath._returned",
         "tests/core/test_uring_loop.py"),
    Twin("target._digest", "protocol.digest:Digests.feed; target.backend:FileBackend.read_into",
         "tests/replication/test_digest_fast.py"),
    Twin("target._rdma_fast", "target.rdma:RdmaTargetConnection._completions, RdmaTargetConnection.queue_response",
         "tests/core/test_rdma_fast.py"),
    Twin("target.replication._mirror_io", "target.replication.mirror:ReplicatedBackend.write",
         "tests/replication/test_mirror_fast.py"),
    Twin("initiator._queue", "initiator.queue", "tests/core/test_host_queue_differential.py"),
    Twin("initiator._tcp_host_io", "initiator.tcp_host_io", "tests/core/test_tcp_host_differential.py"),
    Twin("initiator._inline", "initiator.tcp_host_io:TcpHostIo.submit", "tests/core/test_tcp_host_differential.py"),
    Twin("initiator._lane", "initiator.controller:Controller.transfer, Controller.submit_io",
         "tests/core/test_lane_differential.py"),
    Twin("initiator.fuse._rangelock", "initiator.fuse.rangelock", "tests/core/test_rangelock_differential.py"),
    Twin("initiator.fuse._loop", "initiator.fuse.session:FuseSession.py_on_readable, FuseSession._serve",
         "tests/core/test_fuse_differential.py"),
)}
"""Every compiled module, its Python reference and the differential test that holds them together
(aiohttp keeps ``http_parser.py`` beside ``_http_parser.pyx`` the same way). :func:`twin` reads
it; ``tests/core/test_dataplane_twin.py`` fails on a ``.pyx`` missing from it, a row whose test
file does not exist or does not name the module, and a reference that does not resolve."""


def twin(compiled: str, *, hint: str = "") -> ModuleType | None:
    """The module of a compiled component to run: ``compiled`` (a dotted name, a row of
    :data:`TWINS`) on the compiled plane, else its Python reference when that is a module, or
    None for a compiled path that shadows methods (its callers then take their ordinary Python
    path).

    A compiled module that fails to import on the compiled plane (its compile failed alone, or a
    module it cimports is missing) falls back to its reference with one warning naming it and the
    error, and ``hint`` (what to install) when given; it is recorded in :data:`NOT_BUILT`. On the
    pure plane nothing is logged: the daemons' start-up line already says which plane runs and
    why. Modules are named by string so that ``blockd/`` can choose for ``target/`` and
    ``initiator/`` without importing them (``tests/test_layers.py``)."""
    row = TWINS[compiled]
    reference = row.reference if row.module_twin else None
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
