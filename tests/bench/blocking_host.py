"""A minimal NVMe/TCP host on a blocking socket, shared by the bench scripts that drive a real
``blockd target`` over loopback (``bench_target_socket.py``, ``bench_thread_neighbours.py``):
ICReq, whole PDUs, the next completion. Field positions come from ``protocol/`` layouts. Not a
test (pytest does not collect it) and not a host: no digests, no R2T, no error handling beyond
raising when the target closes."""

from __future__ import annotations

import socket
from typing import Any

from core.conftest import icreq
from protocol.nvme import CQE_FAST
from protocol.tcp import CAPSULE_RESP_HLEN, COMMON_HEADER_FAST, COMMON_HEADER_SIZE, PduType


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("target closed")
        buf += chunk
    return bytes(buf)


def recv_pdu(s: socket.socket) -> bytes:
    """One whole PDU: its common header, then PLEN's worth."""
    head = recv_exact(s, COMMON_HEADER_SIZE)
    plen = COMMON_HEADER_FAST.as_dict(head)["plen"]
    return head + recv_exact(s, plen - COMMON_HEADER_SIZE)


def completion(s: socket.socket) -> dict[str, Any]:
    """The next CapsuleResp's CQE fields (data PDUs before it are read and dropped)."""
    while True:
        pdu = recv_pdu(s)
        if pdu[0] == PduType.CAPSULE_RESP:
            return CQE_FAST.as_dict(pdu, CAPSULE_RESP_HLEN - CQE_FAST.size)


def connect(port: int) -> socket.socket:
    """A connection to 127.0.0.1:``port`` past ICReq/ICResp, Nagle off."""
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.sendall(icreq())
    recv_pdu(s)
    return s
