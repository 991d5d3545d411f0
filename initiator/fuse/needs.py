"""What a mount needs from the controller of its connection (``initiator.controller.Controller``
is the one implementation; tests use small fakes)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

if TYPE_CHECKING:
    from initiator.controller import NamespaceInfo

IoDone = Callable[[BaseException | None], None]


class HeldSends(Protocol):
    def release(self) -> None: ...


class MountController(Protocol):
    namespaces: dict[int, NamespaceInfo]
    max_transfer: int
    """Bytes one command may move."""
    state: str
    """"live" while commands can go out now; "reconnecting" or "failed" otherwise."""
    failed: BaseException | None
    """Why the controller gave up (ctrl_loss_tmo passed or closed): every request is EIO then."""

    def hold_sends(self) -> list[HeldSends]: ...
    def submit_read(self, nsid: int, slba: int, buf: memoryview, done: IoDone) -> None: ...
    def submit_write(self, nsid: int, slba: int, data: bytes | memoryview, done: IoDone) -> None: ...
    async def read_into(self, nsid: int, slba: int, buf: memoryview) -> None: ...
    async def write(self, nsid: int, slba: int, data: bytes | memoryview, fua: bool = False) -> None: ...
    async def flush(self, nsid: int) -> Any: ...
    async def write_zeroes(self, nsid: int, slba: int, nblocks: int) -> Any: ...
    async def deallocate(self, nsid: int, ranges: Sequence[tuple[int, int]]) -> Any: ...
