"""NVMe-oF RDMA transport: RDMA CM private data (NVMe RDMA Transport spec; Linux ``nvme-rdma.h``).

Three messages ride in rdma_cm private data:

* CONNECT request (32 bytes): RECFMT, QID, HRQSIZE (1's based), HSQSIZE (0's based), CNTLID.
* ACCEPT (32 bytes): RECFMT, CRQSIZE.
* REJECT (4 bytes): RECFMT, STS (one of :data:`REJECT_STS`).

What a receiver sees is *transport padded* (IB/RoCE: 56 bytes for a REQ, 196 for a REP, 148
for a REJ), so the ``parse_*`` helpers parse only the prefix and ignore the rest; they raise
:class:`PrivateDataError` (carrying the REJECT STS a target should answer with) when the prefix
is too short or RECFMT is not 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import construct as c

from protocol.layout import at_offsets, fixed_layout

RECFMT = 0

CmConnectRequest = at_offsets(32, [
    (0, "recfmt", c.Int16ul),
    (2, "qid", c.Int16ul),
    (4, "hrqsize", c.Int16ul),
    (6, "hsqsize", c.Int16ul),
    (8, "cntlid", c.Int16ul),
])
CmAccept = at_offsets(32, [
    (0, "recfmt", c.Int16ul),
    (2, "crqsize", c.Int16ul),
])
CmReject = at_offsets(4, [
    (0, "recfmt", c.Int16ul),
    (2, "sts", c.Int16ul),
])

REQUEST = fixed_layout(CmConnectRequest)
ACCEPT = fixed_layout(CmAccept)
REJECT = fixed_layout(CmReject)

# REJECT STS values (NVMe RDMA transport spec; Linux enum nvme_rdma_cm_status)
STS_INVALID_LEN = 0x01
STS_INVALID_RECFMT = 0x02
STS_INVALID_QID = 0x03
STS_INVALID_HSQSIZE = 0x04
STS_INVALID_HRQSIZE = 0x05
STS_NO_RESOURCES = 0x06
STS_INVALID_IRD = 0x07
STS_INVALID_ORD = 0x08
STS_INVALID_CNTLID = 0x09

REJECT_STS = {
    STS_INVALID_LEN: "invalid private data length",
    STS_INVALID_RECFMT: "invalid RECFMT",
    STS_INVALID_QID: "invalid QID",
    STS_INVALID_HSQSIZE: "invalid HSQSIZE",
    STS_INVALID_HRQSIZE: "invalid HRQSIZE",
    STS_NO_RESOURCES: "no resources",
    STS_INVALID_IRD: "invalid IRD",
    STS_INVALID_ORD: "invalid ORD",
    STS_INVALID_CNTLID: "invalid CNTLID",
}


class PrivateDataError(ValueError):
    """Malformed NVMe-oF CM private data; ``sts`` is the REJECT status to answer with."""

    def __init__(self, message: str, sts: int) -> None:
        super().__init__(message)
        self.sts = sts


@dataclass(frozen=True)
class ConnectRequest:
    qid: int
    hrqsize: int  # host receive queue size, 1's based
    hsqsize: int  # host send queue size, 0's based
    cntlid: int = 0
    recfmt: int = RECFMT

    def pack(self) -> bytes:
        return REQUEST.pack(self.recfmt, self.qid, self.hrqsize, self.hsqsize, self.cntlid)


@dataclass(frozen=True)
class Accept:
    crqsize: int  # controller receive queue size
    recfmt: int = RECFMT

    def pack(self) -> bytes:
        return ACCEPT.pack(self.recfmt, self.crqsize)


@dataclass(frozen=True)
class Reject:
    sts: int
    recfmt: int = RECFMT

    def pack(self) -> bytes:
        return REJECT.pack(self.recfmt, self.sts)

    def describe(self) -> str:
        return REJECT_STS.get(self.sts, f"unknown status {self.sts:#x}")


def _prefix(data: bytes | memoryview | None, need: int, what: str) -> bytes:
    if data is None or len(data) < need:
        n = 0 if data is None else len(data)
        raise PrivateDataError(f"{what} private data is {n} bytes, need {need}", STS_INVALID_LEN)
    return bytes(data[:need])


def parse_request(data: bytes | memoryview | None) -> ConnectRequest:
    """Parse a CONNECT request prefix (32 of the 56 bytes IB/RoCE delivers)."""
    recfmt, qid, hrqsize, hsqsize, cntlid = REQUEST.unpack_from(
        _prefix(data, REQUEST.size, "connect request"))
    if recfmt != RECFMT:
        raise PrivateDataError(f"connect request RECFMT {recfmt} != 0", STS_INVALID_RECFMT)
    return ConnectRequest(qid=qid, hrqsize=hrqsize, hsqsize=hsqsize, cntlid=cntlid)


def parse_accept(data: bytes | memoryview | None) -> Accept:
    """Parse the ACCEPT prefix (first 4 of the 32 bytes are meaningful; 196 arrive on IB/RoCE).

    Only the first 4 bytes are required: a peer that sends a short accept is still decoded.
    """
    recfmt, crqsize = REJECT.unpack_from(_prefix(data, 4, "accept"))
    if recfmt != RECFMT:
        raise PrivateDataError(f"accept RECFMT {recfmt} != 0", STS_INVALID_RECFMT)
    return Accept(crqsize=crqsize)


def parse_reject(data: bytes | memoryview | None) -> Reject:
    """Parse a REJECT prefix (4 bytes; 148 arrive on IB/RoCE)."""
    recfmt, sts = REJECT.unpack_from(_prefix(data, REJECT.size, "reject"))
    return Reject(sts=sts, recfmt=recfmt)
