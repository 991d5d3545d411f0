"""structlog set-up shared by the daemons and the CLI: human console lines or JSON, to stderr."""

from __future__ import annotations

import logging
import sys

import structlog


def setup(fmt: str = "console", level: str = "info") -> None:
    """Configure structlog (and stdlib logging, which asyncio and pyverbs use) once."""
    numeric = getattr(logging, level.upper(), None)
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    renderer: structlog.typing.Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso" if fmt == "json" else "%Y-%m-%d %H:%M:%S"),
        structlog.processors.format_exc_info if fmt == "json" else structlog.dev.set_exc_info,
        renderer,
    ]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    root = logging.getLogger()
    root.handlers[:] = [logging.StreamHandler(sys.stderr)]
    root.setLevel(max(numeric, logging.WARNING))
