"""``tests/fuse/blockd_stack.Stack`` with its namespace on an RBD image of a test cluster: real
``blockd target``/``blockd initiator`` processes, blockctl and the FUSE mount, over Ceph."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.ceph.cluster import Cluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fuse"))

from blockd_stack import Stack  # noqa: E402


class RbdStack(Stack):
    def __init__(self, workdir: str | Path, cluster: Cluster, image: str, size: int, **kw: object) -> None:
        super().__init__(workdir, size=size, **kw)  # type: ignore[arg-type]
        self.cluster = cluster
        self.image = image

    def write_config(self) -> Path:
        cfg = super().write_config()
        text = cfg.read_text()
        file_ns = f'path = "{self.backing}"\nsize = {self.size}\n'
        assert file_ns in text
        cfg.write_text(text.replace(file_ns, f'backend = "rbd"\npath = "{self.cluster.pool}/{self.image}"\n'
                                              f'options = {{ conf = "{self.cluster.conf}" }}\n'))
        return cfg
