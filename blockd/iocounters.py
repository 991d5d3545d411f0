"""The :class:`~blockd.iostats.IoCounters` class the daemons count in: the compiled one
(``blockd/_iostats.pyx``, which the compiled I/O paths cimport) on the compiled plane, else the
Python reference. One choice for both ends, made here rather than in :mod:`blockd.iostats`,
which the compiled module imports its constants from (no import cycle)."""

from __future__ import annotations

from blockd.dataplane import twin

IoCounters: type = twin("blockd._iostats").IoCounters
"""Every namespace's and host's counters on the target, every connection's on the host."""
