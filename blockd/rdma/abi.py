"""libibverbs ABI values the fast data path posts with (``<infiniband/verbs.h>``).

Plain constants, so the transports can name them without importing pyverbs or loading
libibverbs; :class:`blockd.rdma._fast.FastQP` checks them against pyverbs before the first post.
"""

from __future__ import annotations

# enum ibv_wr_opcode
WR_RDMA_WRITE = 0
WR_SEND = 2
WR_RDMA_READ = 4
WR_SEND_WITH_INV = 9
# enum ibv_send_flags
SEND_SIGNALED = 2


def check_against_pyverbs() -> None:
    """Raise if pyverbs (hence verbs.h) disagrees with the values above."""
    import pyverbs.enums as e
    ours = (WR_RDMA_WRITE, WR_SEND, WR_RDMA_READ, WR_SEND_WITH_INV, SEND_SIGNALED)
    theirs = (e.IBV_WR_RDMA_WRITE, e.IBV_WR_SEND, e.IBV_WR_RDMA_READ, e.IBV_WR_SEND_WITH_INV,
              e.IBV_SEND_SIGNALED)
    if ours != theirs:
        raise RuntimeError(f"libibverbs ABI values {theirs} differ from blockd.rdma.abi's {ours}")
