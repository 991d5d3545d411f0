"""NVMe-oF RDMA CM private data (no RDMA needed)."""

import pytest

from protocol import rdma_cm as pcm


def test_request_layout_and_padding():
    raw = pcm.ConnectRequest(qid=2, hrqsize=128, hsqsize=127, cntlid=5).pack()
    assert len(raw) == 32
    assert raw[:10] == bytes.fromhex("0000 0200 8000 7f00 0500".replace(" ", ""))
    assert raw == pcm.CmConnectRequest.build(dict(recfmt=0, qid=2, hrqsize=128, hsqsize=127, cntlid=5))
    # IB/RoCE delivers 56 bytes: only the prefix counts
    assert pcm.parse_request(raw + b"\xff" * 24) == pcm.ConnectRequest(2, 128, 127, 5)


def test_accept_and_reject():
    assert pcm.Accept(crqsize=32).pack() == b"\0\0\x20\0" + bytes(28)
    assert pcm.parse_accept(pcm.Accept(crqsize=32).pack() + bytes(164)).crqsize == 32
    rej = pcm.Reject(sts=pcm.STS_INVALID_HSQSIZE).pack()
    assert rej == b"\0\0\x04\0"
    assert pcm.parse_reject(rej + bytes(144)).sts == 4
    assert pcm.parse_reject(rej).describe() == "invalid HSQSIZE"


def test_bad_request():
    with pytest.raises(pcm.PrivateDataError) as ei:
        pcm.parse_request(b"\0" * 10)
    assert ei.value.sts == pcm.STS_INVALID_LEN
    with pytest.raises(pcm.PrivateDataError) as ei:
        pcm.parse_request(pcm.ConnectRequest(1, 2, 3, recfmt=1).pack())
    assert ei.value.sts == pcm.STS_INVALID_RECFMT
    with pytest.raises(pcm.PrivateDataError):
        pcm.parse_request(None)
