"""A backend is one registry row: a backend defined here, registered from the test (no line of
``target/service.py`` or of the configuration's checks names it), serves a host's I/O; the
configuration accepts exactly the registered names; both ends know the same transports."""

from __future__ import annotations

from pathlib import Path

import pytest

from blockd.config import ConfigError
from initiator.transport import TRANSPORTS
from target.backend import MemoryBackend
from target.backend_registry import BACKENDS
from target.config import NamespaceConfig
from target.transport import transport_names

from .conftest import NQN, config, connect, free_port, ns, run, serving, sub

OPENED: dict[str, RecordingBackend] = {}
"""The test backends opened, by the namespace's ``path`` (a name here, not a file)."""


class RecordingBackend(MemoryBackend):
    """RAM, counting the writes that reach it: proof that the host's I/O went through it."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.writes = 0

    async def write(self, offset: int, data: memoryview | bytes, fua: bool = False) -> None:
        self.writes += 1
        await super().write(offset, data, fua)


def open_recording(nc: NamespaceConfig) -> RecordingBackend:
    """The test backend's opener, as the registry calls it."""
    if nc.size is None:
        raise ValueError("the test backend needs a size")
    OPENED[nc.path] = backend = RecordingBackend(nc.size)
    return backend


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(BACKENDS, "test-ram", (__name__, "open_recording"))
    OPENED.clear()
    return "test-ram"


def test_a_registered_backend_serves_io_with_no_edit_to_the_service(tmp_path: Path, registered: str) -> None:
    port = free_port()
    name = str(tmp_path / "not-a-file")
    cfg = config([port], [sub(NQN, [{**ns(name, size=1 << 20), "backend": registered}])])
    assert cfg.subsystems[0].namespaces[0].backend == registered

    async def main() -> None:
        async with serving(cfg):
            host = await connect(port, nr_io_queues=1)
            try:
                await host.write_bytes(1, 8192, b"r" * 4096)
                backend = OPENED[name]
                assert backend.writes == 1 and backend.data[8192:12288] == b"r" * 4096
                backend.data[0:512] = b"m" * 512  # what the host reads is the backend's
                assert await host.read_bytes(1, 0, 512) == b"m" * 512
                assert await host.read_bytes(1, 8192, 4096) == b"r" * 4096
            finally:
                await host.close()

    run(main())
    assert not Path(name).exists()  # the file backend never opened it


def test_the_namespace_backend_is_checked_against_the_registry(tmp_path: Path, registered: str) -> None:
    port = free_port()
    default = config([port], [sub(NQN, [ns(tmp_path / "a.img")])])
    assert default.subsystems[0].namespaces[0].backend == "file"
    with pytest.raises(ConfigError, match="backend must be one of file, rbd, test-ram, not 'nbd'"):
        config([port], [sub(NQN, [{**ns(tmp_path / "a.img"), "backend": "nbd"}])])


def test_both_ends_register_the_same_transport_names() -> None:
    """A replica's transport is checked against the target's registry (target/ may not import
    the host), so the host's must hold the same names."""
    assert transport_names() == tuple(TRANSPORTS) == ("tcp", "rdma")


def test_backend_options_reach_the_opener_which_checks_them(tmp_path: Path) -> None:
    """``[subsystem.namespace.options]`` is the backend's own table: parsed as given, and the
    file backend, which has no options, refuses any with a message naming them."""
    port = free_port()
    cfg = config([port], [sub(NQN, [{**ns(tmp_path / "a.img"), "options": {"zeta": 1, "alpha": "x"}}])])
    assert cfg.subsystems[0].namespaces[0].options == (("alpha", "x"), ("zeta", 1))

    async def main() -> None:
        async with serving(cfg):
            pass
    with pytest.raises(RuntimeError, match="the file backend takes no options .got alpha, zeta."):
        run(main())
