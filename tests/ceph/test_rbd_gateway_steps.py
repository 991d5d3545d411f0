"""One step of the failover loop (target/rbd_gateway.py) against a scripted image: what the
gateway does with the lock and its ANA group for each thing librbd may say. No cluster."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("rbd", reason="python3-rbd is missing (scripts/setup.sh installs it)")

from target.backend import NamespaceHooks  # noqa: E402
from target.rbd_backend import RbdOptions  # noqa: E402
from target.rbd_gateway import Gateway  # noqa: E402

ME, OTHER = "127.0.0.1:0/1", "127.0.0.1:0/2"


@dataclass
class ScriptedImage:
    """What librbd says about the lock and the watchers, and what the gateway did to them."""

    owner_flag: bool = False
    owners: list[str] = field(default_factory=list)
    watchers: list[str] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)

    def is_exclusive_lock_owner(self) -> bool:
        return self.owner_flag

    def lock_get_owners(self) -> list[dict[str, Any]]:
        return [{"mode": 0, "owner": o} for o in self.owners]

    def watchers_list(self) -> list[dict[str, Any]]:
        return [{"addr": w, "id": 1, "cookie": 1} for w in self.watchers]

    def lock_break(self, mode: int, owner: str) -> None:
        self.calls.append(f"break {owner}")
        self.owners.remove(owner)

    def lock_acquire(self, mode: int) -> None:
        self.calls.append("acquire")
        self.owners, self.owner_flag = [ME], True

    def lock_release(self) -> None:
        self.calls.append("release")
        self.owners, self.owner_flag = [], False


class Cluster:
    def get_addrs(self) -> str:
        return ME


@dataclass
class Backend:
    image: ScriptedImage
    opts: RbdOptions = RbdOptions("rbd", "img", failover=True, takeover_after=0.0)
    cluster: Cluster = field(default_factory=Cluster)
    fenced: bool = False


def _step(image: ScriptedImage, serving: bool) -> tuple[list[bool], list[str]]:
    """Run one step; (the ANA changes it asked for, what it did to the lock)."""
    asked: list[bool] = []

    async def set_serving(on: bool) -> None:
        asked.append(on)
        image.calls.append(f"serve {on}")  # in order with the lock calls

    async def main() -> None:
        gw = Gateway(Backend(image), NamespaceHooks(lambda: None, lambda: serving, set_serving))  # type: ignore[arg-type]
        await gw._step()
    asyncio.run(main())
    return asked, image.calls


def test_a_serving_gateway_whose_own_lock_librbd_is_retaking_stays_optimized() -> None:
    """librbd says 'not the owner' for a moment while the lock names this client: not another
    gateway's lock (the VM run's flapping)."""
    assert _step(ScriptedImage(owner_flag=False, owners=[ME], watchers=[ME, OTHER]), serving=True) == ([], [])


def test_a_serving_gateway_without_the_lock_goes_inaccessible_when_another_lives() -> None:
    assert _step(ScriptedImage(owners=[OTHER], watchers=[ME, OTHER]), serving=True) == ([False], ["serve False"])


def test_a_standby_fences_a_dead_owner_before_it_serves() -> None:
    image = ScriptedImage(owners=[OTHER], watchers=[ME])  # OTHER's watch is gone
    asked, calls = _step(image, serving=False)
    assert calls == [f"break {OTHER}", "acquire", "serve True"] and asked == [True]  # fenced, then served


def test_a_standby_leaves_a_live_owner_alone() -> None:
    assert _step(ScriptedImage(owners=[OTHER], watchers=[ME, OTHER]), serving=False) == ([], [])


def test_a_demoted_owner_releases_the_lock() -> None:
    assert _step(ScriptedImage(owner_flag=True, owners=[ME], watchers=[ME]), serving=False)[1] == ["release"]
