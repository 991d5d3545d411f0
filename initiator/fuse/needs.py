"""What a mount needs from the controller of its connection: ``initiator.controller.Controller``
is the one implementation, the tests' fakes are others. Every data request goes through
``transfer`` (callback; it splits at the controller's max transfer), an fsync's Flush through
``submit_io`` (callback), the primitive under it; the rest are the awaitable wrappers over it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from initiator.controller import IoDone, NamespaceInfo


class MountController(Protocol):
    namespaces: dict[int, NamespaceInfo]
    """The namespaces, by nsid: the mount's files."""
    failed: BaseException | None
    """Why the controller gave up (ctrl_loss_tmo passed, or closed): every request is EIO then."""

    def transfer(self, write: bool, nsid: int, offset: int, buf: memoryview, done: IoDone,
                 fua: bool = False) -> None:
        """Read into or write from ``buf`` the block-aligned range at byte ``offset``."""

    def hold_sends(self) -> None:
        """Let the commands submitted until ``release_sends`` leave in one send."""

    def release_sends(self) -> None: ...

    async def read_into(self, nsid: int, slba: int, buf: memoryview) -> None:
        """Read whole blocks (at most one command's worth) at block ``slba``."""

    async def write_bytes(self, nsid: int, offset: int, data: bytes | memoryview, fua: bool = False) -> None:
        """Write a block-aligned range of any length (through ``transfer``)."""

    def submit_io(self, sqe: bytearray, data_out: bytes | memoryview | None, data_in: memoryview | None,
                  done: IoDone) -> None:
        """Send one command (fsync's Flush): the primitive ``transfer`` sends through."""

    async def write_zeroes(self, nsid: int, slba: int, nblocks: int, deallocate: bool = False) -> None: ...

    async def deallocate(self, nsid: int, ranges: list[tuple[int, int]]) -> None: ...
