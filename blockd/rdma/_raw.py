"""Raw C pointers out of pyverbs 44 objects, and a small ctypes binding to librdmacm.

pyverbs 44 (Debian python3-pyverbs 44.0) lacks several things an asyncio NVMe-oF transport
needs (docs/wire-facts.md, "RDMA provider quirks"): no fd for ``CMEventChannel`` /
``CompChannel``, no ``id``/``listen_id``/``status``/``responder_resources``/``initiator_depth``
on ``CMEvent``, no ``rdma_migrate_id``/``rdma_notify``.  Cython lays out these extension types as PyObject header
(16) + ``__weakref__`` (8) + ``logger`` (8) + vtable (8), so the class's first C field, the
wrapped C pointer, sits at ``id(obj) + 40`` (same section).  That only holds for this build, so the
module checks ``__basicsize__`` of every class it reads at import time and refuses to load on
any other layout (:class:`LayoutError`) rather than reading garbage.

C layouts used (rdma-core 44 headers, x86-64): ``rdma_event_channel.fd`` @0;
``rdma_cm_event``: id @0, listen_id @8, event @16, status @20, param.conn.private_data @24,
private_data_len @32 (u8), responder_resources @33, initiator_depth @34;
``ibv_comp_channel.fd`` @8; ``rdma_cm_id.route.addr.dst_addr`` @160 (a ``sockaddr``).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import sys
from dataclasses import dataclass

from pyverbs.cmid import CMEvent, CMEventChannel, CMID
from pyverbs.cq import CQ, CompChannel
from pyverbs.device import Context
from pyverbs.pd import PD
from pyverbs.qp import QP


class LayoutError(ImportError):
    """This pyverbs build is laid out differently from the one the raw-pointer reads assume."""


_EXPECTED_BASICSIZE = {
    CMEventChannel: 48,
    CMEvent: 48,
    CMID: 80,
    CompChannel: 64,
    CQ: 96,
    QP: 128,
    PD: 136,
    Context: 184,
}
_PTR_OFFSET = 40


def check_layout() -> None:
    if sys.maxsize != 2**63 - 1:
        raise LayoutError("blockd.rdma raw pointer access needs a 64-bit CPython")
    bad = {cls.__name__: (cls.__basicsize__, size)
           for cls, size in _EXPECTED_BASICSIZE.items() if cls.__basicsize__ != size}
    if bad:
        raise LayoutError(f"pyverbs object layout differs from Debian 44.0 (name: (got, want)) {bad}; "
                          "blockd.rdma's raw pointer reads would be wrong")


check_layout()


def raw_ptr(obj: object) -> int:
    """The C pointer wrapped by a pyverbs object (0 once closed)."""
    if type(obj) not in _EXPECTED_BASICSIZE:
        raise TypeError(f"no known layout for {type(obj).__name__}")
    return ctypes.c_void_p.from_address(id(obj) + _PTR_OFFSET).value or 0


def _read_int(addr: int) -> int:
    return ctypes.c_int.from_address(addr).value


def cm_channel_fd(ch: CMEventChannel) -> int:
    """fd of an rdma_event_channel (``rdma_event_channel.fd`` @0)."""
    p = raw_ptr(ch)
    if not p:
        raise ValueError("CM event channel is closed")
    return _read_int(p)


def comp_channel_fd(ch: CompChannel) -> int:
    """fd of an ibv_comp_channel (``ibv_comp_channel.fd`` @8)."""
    p = raw_ptr(ch)
    if not p:
        raise ValueError("completion channel is closed")
    return _read_int(p + 8)


def set_nonblocking(fd: int) -> None:
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)


@dataclass(frozen=True)
class RawCmEvent:
    """The fields of ``rdma_cm_event`` pyverbs 44 does not expose (read before the ack)."""

    id: int
    listen_id: int
    event: int
    status: int
    private_data: bytes
    responder_resources: int
    initiator_depth: int
    flow_control: int
    retry_count: int
    rnr_retry_count: int
    qp_num: int


def read_cm_event(ev: CMEvent) -> RawCmEvent:
    p = raw_ptr(ev)
    if not p:
        raise ValueError("CM event already acked")
    head = ctypes.string_at(p, 44)
    id_, listen_id, event, status, pd_ptr, pd_len, rr, idepth, fc, rc, rnr, _srq, qpn = \
        struct.unpack_from("<QQiiQBBBBBBBxI", head)
    data = ctypes.string_at(pd_ptr, pd_len) if pd_ptr and pd_len else b""
    return RawCmEvent(id_, listen_id, event, status, data, rr, idepth, fc, rc, rnr, qpn)


# -- librdmacm (the same shared object pyverbs is linked against) ---------------------------------

_rdmacm = ctypes.CDLL("librdmacm.so.1", use_errno=True)
_rdmacm.rdma_migrate_id.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
_rdmacm.rdma_migrate_id.restype = ctypes.c_int
_rdmacm.rdma_notify.argtypes = [ctypes.c_void_p, ctypes.c_int]
_rdmacm.rdma_notify.restype = ctypes.c_int
_rdmacm.rdma_event_str.argtypes = [ctypes.c_int]
_rdmacm.rdma_event_str.restype = ctypes.c_char_p
_rdmacm.rdma_set_option.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                    ctypes.c_void_p, ctypes.c_size_t]
_rdmacm.rdma_set_option.restype = ctypes.c_int

RDMA_OPTION_ID = 0
RDMA_OPTION_ID_TOS = 0
RDMA_OPTION_ID_REUSEADDR = 1
RDMA_OPTION_ID_AFONLY = 2


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def event_str(event: int) -> str:
    """``rdma_event_str()``."""
    return (_rdmacm.rdma_event_str(event) or b"?").decode()


def notify(cmid: CMID, ib_event: int) -> None:
    """``rdma_notify()``: tell the CM about a QP async event (e.g. IBV_EVENT_COMM_EST)."""
    _check(_rdmacm.rdma_notify(raw_ptr(cmid), ib_event), "rdma_notify")


def set_tos(cmid: CMID, tos: int) -> None:
    """``rdma_set_option(RDMA_OPTION_ID, RDMA_OPTION_ID_TOS)`` (pyverbs only offers ACK_TIMEOUT)."""
    v = ctypes.c_uint8(tos)
    _check(_rdmacm.rdma_set_option(raw_ptr(cmid), RDMA_OPTION_ID, RDMA_OPTION_ID_TOS,
                                   ctypes.byref(v), 1), "rdma_set_option(TOS)")


def set_reuseaddr(cmid: CMID, on: bool = True) -> None:
    """``rdma_set_option(RDMA_OPTION_ID, RDMA_OPTION_ID_REUSEADDR)``; call before bind."""
    v = ctypes.c_int(1 if on else 0)
    _check(_rdmacm.rdma_set_option(raw_ptr(cmid), RDMA_OPTION_ID, RDMA_OPTION_ID_REUSEADDR,
                                   ctypes.byref(v), ctypes.sizeof(v)), "rdma_set_option(REUSEADDR)")


def peer_address(cmid: CMID) -> str:
    """The peer's IPv4 ``address:port`` from ``rdma_cm_id.route.addr.dst_addr`` (@160), which
    pyverbs does not expose; "" when it is not IPv4 or cannot be read (it only names the peer
    in logs and in the per-host connection count)."""
    try:
        raw = ctypes.string_at(raw_ptr(cmid) + 160, 8)
    except (TypeError, ValueError):  # not a CMID, or a closed one
        return ""
    if int.from_bytes(raw[0:2], "little") != socket.AF_INET:
        return ""
    return f"{socket.inet_ntoa(raw[4:8])}:{int.from_bytes(raw[2:4], 'big')}"


def migrate_id(cmid: CMID, channel: CMEventChannel) -> None:
    """``rdma_migrate_id()``: move a CM id to another event channel.

    Note: pyverbs' ``CMID.event_channel`` still names the old channel afterwards; it is only used
    by pyverbs to decide between rdma_destroy_ep/rdma_destroy_id, which is unaffected.
    """
    _check(_rdmacm.rdma_migrate_id(raw_ptr(cmid), raw_ptr(channel)), "rdma_migrate_id")
