"""The registry of namespace backends by name: ``backend = "file"`` in a namespace's table.

Shaped like :mod:`target.transport`'s registry (and SPDK's ``SPDK_NVMF_TRANSPORT_REGISTER``, a
list of ops by name): a name maps to the module that implements the backend and its opener, a
function ``open(nc: NamespaceConfig) -> Backend`` that raises ``OSError`` or ``ValueError`` with
a message for the user. The configuration accepts exactly the names here and the service opens
a namespace through :func:`open_backend`, so adding a backend is one module plus one row (or,
for a backend kept outside the tree, one ``BACKENDS[name] = (module, opener)`` before the
configuration is read); neither the service nor the configuration's checks change.

Replication is not a backend: it is a filter the service stacks on whatever backend opened
(:class:`target.replication.mirror.ReplicatedBackend`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from target.backend import Backend
    from target.config import NamespaceConfig

DEFAULT_BACKEND = "file"

BACKENDS: dict[str, tuple[str, str]] = {"file": ("target.backend", "open_file"),
                                         "rbd": ("target.rbd_backend", "open_rbd")}
"""Configuration name -> (module, its opener's name); the module is imported on first use, so
reading a configuration loads no backend's dependencies."""


def backend_names() -> tuple[str, ...]:
    """The names a namespace's ``backend`` key may take, the default (``file``) first."""
    return tuple(BACKENDS)


def open_backend(nc: NamespaceConfig) -> Backend:
    """Open the storage of namespace ``nc`` with the backend its configuration names."""
    module, name = BACKENDS[nc.backend]
    opener: Callable[[NamespaceConfig], Backend] = getattr(importlib.import_module(module), name)
    return opener(nc)
