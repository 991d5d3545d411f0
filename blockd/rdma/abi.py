"""libibverbs ABI values the fast data path posts with (``<infiniband/verbs.h>``).

Plain constants, so the transports can name them without importing pyverbs or loading
libibverbs; :func:`blockd.rdma._fast.qp_pointers` checks them against pyverbs before the first post.
"""

from __future__ import annotations

# enum ibv_wr_opcode
WR_RDMA_WRITE = 0
WR_SEND = 2
WR_RDMA_READ = 4
WR_SEND_WITH_INV = 9
# enum ibv_send_flags
SEND_SIGNALED = 2
# enum ibv_wc_status, by value
WC_STATUS = (
    "SUCCESS", "LOC_LEN_ERR", "LOC_QP_OP_ERR", "LOC_EEC_OP_ERR", "LOC_PROT_ERR", "WR_FLUSH_ERR",
    "MW_BIND_ERR", "BAD_RESP_ERR", "LOC_ACCESS_ERR", "REM_INV_REQ_ERR", "REM_ACCESS_ERR",
    "REM_OP_ERR", "RETRY_EXC_ERR", "RNR_RETRY_EXC_ERR", "LOC_RDD_VIOL_ERR", "REM_INV_RD_REQ_ERR",
    "REM_ABORT_ERR", "INV_EECN_ERR", "INV_EEC_STATE_ERR", "FATAL_ERR", "RESP_TIMEOUT_ERR",
    "GENERAL_ERR", "TM_ERR", "TM_RNDV_INCOMPLETE")

WC_WR_FLUSH_ERR = WC_STATUS.index("WR_FLUSH_ERR")


def wc_status_name(status: int) -> str:
    """``IBV_WC_RETRY_EXC_ERR (12)`` for a work completion's status, for logs."""
    name = WC_STATUS[status] if 0 <= status < len(WC_STATUS) else "?"
    return f"IBV_WC_{name} ({status})"


def check_against_pyverbs() -> None:
    """Raise if pyverbs (hence verbs.h) disagrees with the values above."""
    import pyverbs.enums as e
    ours = (WR_RDMA_WRITE, WR_SEND, WR_RDMA_READ, WR_SEND_WITH_INV, SEND_SIGNALED)
    theirs = (e.IBV_WR_RDMA_WRITE, e.IBV_WR_SEND, e.IBV_WR_RDMA_READ, e.IBV_WR_SEND_WITH_INV,
              e.IBV_SEND_SIGNALED)
    ours += tuple(WC_STATUS)
    theirs += tuple(e.ibv_wc_status(i).name.removeprefix("IBV_WC_") for i in range(len(WC_STATUS)))
    if ours != theirs:
        raise RuntimeError(f"libibverbs ABI values {theirs} differ from blockd.rdma.abi's {ours}")
