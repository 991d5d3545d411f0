"""Property-based round trips for every wire structure, fast layouts vs construct, TCP framing.

* ``parse(build(x)) == x`` for arbitrary field values of each construct definition (the values
  are drawn from the definition itself, so a new field is covered automatically);
* each derived ``*_FAST`` struct layout packs and unpacks exactly what its construct does;
* the hand-sliced keyed-SGL parser agrees with ``SGL_KEYED``;
* blockd.tcp_pdu: what ``PduWriter`` writes, ``PduReader`` gives back, whatever the chunking,
  with and without digests; damaged framing raises ``FramingError`` (``DataDigestError`` for a
  data digest).
"""

from __future__ import annotations

import string
from typing import Any

import construct as c
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from blockd.tcp_pdu import DataDigestError, FramingError, PduReader, PduWriter, term_req
from protocol import fabrics, identify, logpage, nvme, rdma_cm, status, tcp
from protocol.layout import SpacePadded
from protocol.tcp import PduFlags, PduType, TermReqFes

settings.register_profile("protocol", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                         HealthCheck.large_base_example])
settings.load_profile("protocol")

# --------------------------------------------------------------------------------------------
# strategies derived from construct definitions

_PRINTABLE = "".join(ch for ch in string.printable if ch not in "\t\n\r\x0b\x0c")


def strategy_for(con: c.Construct) -> st.SearchStrategy[Any]:
    """Values that ``con`` can build and that survive a parse unchanged."""
    if isinstance(con, (c.Renamed, c.Default)):  # a Default field round-trips as its field
        return strategy_for(con.subcon)
    if isinstance(con, c.FormatField):
        bits = 8 * con.sizeof()
        if con.fmtstr[-1].islower():  # signed struct code
            return st.integers(-(1 << (bits - 1)), (1 << (bits - 1)) - 1)
        return st.integers(0, (1 << bits) - 1)
    if isinstance(con, c.BytesInteger):
        bits = 8 * con.length
        return st.integers(-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if con.signed \
            else st.integers(0, (1 << bits) - 1)
    if isinstance(con, SpacePadded):  # trailing spaces/NULs are padding, not content
        return st.text(_PRINTABLE, max_size=con.length).map(lambda s: s.rstrip(" "))
    if isinstance(con, c.StringEncoded) and isinstance(con.subcon, c.FixedSized):
        # NUL padded ASCII: any 7-bit text without NUL, up to the full width
        return st.text(st.characters(min_codepoint=1, max_codepoint=0x7F),
                       max_size=con.subcon.length)
    if isinstance(con, c.Bytes) and isinstance(con.length, int):
        return st.binary(min_size=con.length, max_size=con.length)
    if isinstance(con, c.Array) and isinstance(con.count, int):
        return st.lists(strategy_for(con.subcon), min_size=con.count, max_size=con.count)
    if isinstance(con, c.Struct):
        fields = {sub.name: strategy_for(sub) for sub in con.subcons
                  if isinstance(sub, c.Renamed) and sub.name}
        return st.fixed_dictionaries(fields)
    raise TypeError(f"no strategy for {con!r}")


def plain(obj: Any) -> Any:
    """Containers/ListContainers to dicts/lists (without construct's ``_io``)."""
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items() if not k.startswith("_")}
    if isinstance(obj, list):
        return [plain(v) for v in obj]
    return obj


STRUCTURES = {
    "SQE": nvme.SQE,
    "CQE": nvme.CQE,
    "SGL_DATA_BLOCK": nvme.SGL_DATA_BLOCK,
    "SGL_KEYED": nvme.SGL_KEYED,
    "RW_COMMAND": nvme.RW_COMMAND,
    "DSM_RANGE": nvme.DSM_RANGE,
    "GET_LOG_PAGE_COMMAND": nvme.GET_LOG_PAGE_COMMAND,
    "IDENTIFY_COMMAND": nvme.IDENTIFY_COMMAND,
    "FABRICS_COMMAND": fabrics.FABRICS_COMMAND,
    "CONNECT_COMMAND": fabrics.CONNECT_COMMAND,
    "CONNECT_DATA": fabrics.CONNECT_DATA,
    "PROPERTY_COMMAND": fabrics.PROPERTY_COMMAND,
    "IDENTIFY_CONTROLLER": identify.IDENTIFY_CONTROLLER,
    "IDENTIFY_NAMESPACE": identify.IDENTIFY_NAMESPACE,
    "IDENTIFY_CSI_INDEPENDENT_NS": identify.IDENTIFY_CSI_INDEPENDENT_NS,
    "ACTIVE_NS_LIST": identify.ACTIVE_NS_LIST,
    "DISCOVERY_HEADER": logpage.DISCOVERY_HEADER,
    "DISCOVERY_ENTRY": logpage.DISCOVERY_ENTRY,
    "ERROR_LOG_ENTRY": logpage.ERROR_LOG_ENTRY,
    "CHANGED_NS_LIST": logpage.CHANGED_NS_LIST,
    "TSAS_RDMA": logpage.TSAS_RDMA,
    "COMMON_HEADER": tcp.COMMON_HEADER,
    "IC_REQ": tcp.IC_REQ,
    "IC_RESP": tcp.IC_RESP,
    "DATA_PDU_HEADER": tcp.DATA_PDU_HEADER,
    "TERM_REQ_HEADER": tcp.TERM_REQ_HEADER,
    "CmConnectRequest": rdma_cm.CmConnectRequest,
    "CmAccept": rdma_cm.CmAccept,
    "CmReject": rdma_cm.CmReject,
}


@pytest.mark.parametrize("name", list(STRUCTURES))
def test_construct_round_trip(name):
    con = STRUCTURES[name]

    @settings(max_examples=10 if con.sizeof() > 1024 else 150)
    @given(strategy_for(con))
    def run(value):
        raw = con.build(value)
        assert len(raw) == con.sizeof()
        assert plain(con.parse(raw)) == value
        assert con.build(con.parse(raw)) == raw

    run()


# structures with ASCII text fields cannot parse arbitrary (non-ASCII) bytes
_BINARY_ONLY = [n for n in STRUCTURES if n not in ("CONNECT_DATA", "IDENTIFY_CONTROLLER",
                                                    "DISCOVERY_ENTRY")]


@pytest.mark.parametrize("name", _BINARY_ONLY)
def test_reparse_arbitrary_bytes(name):
    """Any byte string parses, and building the result is stable (reserved bytes become 0)."""
    con = STRUCTURES[name]
    size = con.sizeof()

    @settings(max_examples=50)
    @given(st.binary(min_size=size, max_size=size))
    def run(raw):
        once = con.build(con.parse(raw))
        assert con.build(con.parse(once)) == once

    run()


# (optional Identify/NQN text fields can carry any byte; keep them ASCII here)
ns_descriptor = st.one_of(
    st.tuples(st.just(1), st.binary(min_size=8, max_size=8)),
    st.tuples(st.just(2), st.binary(min_size=16, max_size=16)),
    st.tuples(st.just(3), st.binary(min_size=16, max_size=16)),
    st.tuples(st.just(4), st.binary(min_size=1, max_size=1)),
)


@given(st.lists(ns_descriptor, max_size=8))
def test_ns_descriptor_list_round_trip(descs):
    value = [dict(nidt=t, nidl=len(nid), nid=nid) for t, nid in descs]
    value.append(dict(nidt=0, nidl=0, nid=b""))
    raw = identify.NS_DESCRIPTOR_LIST.build(value)
    assert len(raw) == 4096
    assert plain(identify.NS_DESCRIPTOR_LIST.parse(raw)) == value
    # the spec layout: 4-byte header + NID, back to back
    expected = b"".join(bytes([t, len(nid), 0, 0]) + nid for t, nid in descs)
    assert raw == expected.ljust(4096, b"\0")


# --------------------------------------------------------------------------------------------
# fast layouts == construct


FAST = {
    "SQE_FAST": (nvme.SQE_FAST, nvme.SQE),
    "CQE_FAST": (nvme.CQE_FAST, nvme.CQE),
    "RW_FAST": (nvme.RW_FAST, nvme.RW_COMMAND),
    "IO_COMMAND_FAST": (nvme.IO_COMMAND_FAST, nvme.IO_COMMAND),
    "DSM_RANGE_FAST": (nvme.DSM_RANGE_FAST, nvme.DSM_RANGE),
    "DATA_PDU_HEADER_FAST": (tcp.DATA_PDU_HEADER_FAST, tcp.DATA_PDU_HEADER),
    "COMMON_HEADER_FAST": (tcp.COMMON_HEADER_FAST, tcp.COMMON_HEADER),
    "SGL_DATA_BLOCK_FAST": (nvme.SGL_DATA_BLOCK_FAST, nvme.SGL_DATA_BLOCK),
    "rdma_cm.REQUEST": (rdma_cm.REQUEST, rdma_cm.CmConnectRequest),
    "rdma_cm.ACCEPT": (rdma_cm.ACCEPT, rdma_cm.CmAccept),
    "rdma_cm.REJECT": (rdma_cm.REJECT, rdma_cm.CmReject),
}


@pytest.mark.parametrize("name", list(FAST))
def test_fast_layout_matches_construct(name):
    fast, con = FAST[name]
    named = [sub.name for sub in con.subcons if isinstance(sub, c.Renamed) and sub.name]
    assert list(fast.names) == named
    assert fast.size == con.sizeof()

    @settings(max_examples=200)
    @given(strategy_for(con), st.binary(min_size=con.sizeof(), max_size=con.sizeof()))
    def run(value, raw):
        ordered = tuple(value[n] for n in fast.names)
        built = con.build(value)
        assert fast.pack(*ordered) == built
        assert fast.unpack_from(built) == ordered
        buf = bytearray(3 + fast.size)
        fast.pack_into(buf, 3, *ordered)
        assert bytes(buf[3:]) == built
        # arbitrary bytes (reserved ones too) decode identically, also at an offset
        parsed = con.parse(raw)
        assert fast.unpack_from(raw) == tuple(parsed[n] for n in fast.names)
        assert fast.unpack_from(b"\xff" + raw, 1) == fast.unpack_from(raw)
        assert fast.as_dict(raw) == {n: parsed[n] for n in fast.names}

    run()


@given(st.binary(min_size=16, max_size=16))
def test_parse_sgl_keyed_matches_construct(raw):
    parsed = nvme.SGL_KEYED.parse(raw)
    want = (parsed.address, parsed.length, parsed.key, parsed.sgl_id)
    assert nvme.parse_sgl_keyed(raw) == want
    assert nvme.parse_sgl_keyed(memoryview(raw)) == want
    assert nvme.parse_sgl_keyed(bytearray(b"\0" * 24 + raw)[24:]) == want


@given(strategy_for(nvme.SGL_KEYED))
def test_build_sgl_keyed_matches_construct(v):
    raw = nvme.build_sgl_keyed(v["address"], v["length"], v["key"], v["sgl_id"])
    assert raw == nvme.SGL_KEYED.build(v)
    assert nvme.parse_sgl_keyed(raw) == (v["address"], v["length"], v["key"], v["sgl_id"])


@given(strategy_for(nvme.SGL_DATA_BLOCK))
def test_build_sgl_data_block_matches_construct(v):
    assert nvme.build_sgl_data_block(v["sgl_id"], v["address"], v["length"]) == \
        nvme.SGL_DATA_BLOCK.build(v)


@given(strategy_for(nvme.SQE))
def test_build_sqe_matches_construct(v):
    v = dict(v, mptr=0)  # build_sqe always sends MPTR 0 (unused over fabrics)
    kw = {k: v[k] for k in ("flags", "nsid", "dptr", "cdw2", "cdw3", "cdw10", "cdw11", "cdw12",
                            "cdw13", "cdw14", "cdw15")}
    assert nvme.build_sqe(v["opcode"], v["cid"], **kw) == nvme.SQE.build(v)


@given(st.integers(0, 0x7FFF))
def test_status_wire_round_trip(code):
    word = status.to_wire(code)
    assert word & 1 == 0                      # phase bit 0
    assert status.from_wire(word) == code
    assert status.from_wire(word | 1) == code
    assert (word >> 1) & 0xFF == code & 0xFF            # SC
    assert (word >> 9) & 0x7 == (code >> 8) & 0x7      # SCT
    assert bool(word & 0x8000) == bool(code & status.DNR)
    status.describe(code)  # never raises


@given(st.integers(0, 0xFFFF), st.integers(0, 0xFFFF), st.integers(0, 0xFFFF),
       st.integers(0, 0xFFFF), st.binary(max_size=200))
def test_rdma_cm_round_trip(qid, hrq, hsq, cntlid, pad):
    req = rdma_cm.ConnectRequest(qid=qid, hrqsize=hrq, hsqsize=hsq, cntlid=cntlid)
    assert rdma_cm.parse_request(req.pack() + pad) == req
    acc = rdma_cm.Accept(crqsize=hrq)
    assert rdma_cm.parse_accept(acc.pack() + pad) == acc
    rej = rdma_cm.Reject(sts=hsq)
    assert rdma_cm.parse_reject(rej.pack() + pad) == rej


# --------------------------------------------------------------------------------------------
# blockd.tcp_pdu: writer -> reader

ALL_TYPES = frozenset(PduType)
MAX_DATA = 2048
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)


@st.composite
def pdu_specs(draw, with_ic: bool):
    """(ptype, header_rest, data, flags) for one PDU, as PduWriter / term_req take them."""
    kinds = ["cmd", "resp", "h2c", "c2h", "r2t", "term"] + (["icreq", "icresp"] if with_ic else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "cmd":
        data = draw(st.binary(max_size=300))
        return PduType.CAPSULE_CMD, draw(st.binary(min_size=64, max_size=64)), data, 0
    if kind == "resp":
        return PduType.CAPSULE_RESP, draw(st.binary(min_size=16, max_size=16)), b"", 0
    if kind in ("h2c", "c2h"):
        ptype = PduType.H2C_DATA if kind == "h2c" else PduType.C2H_DATA
        flags = draw(st.sampled_from([0, PduFlags.LAST_PDU] +
                                     ([PduFlags.LAST_PDU | PduFlags.SUCCESS] if kind == "c2h" else [])))
        data = draw(st.binary(min_size=1, max_size=300))
        rest = draw(u16).to_bytes(2, "little") + draw(u16).to_bytes(2, "little") + \
            draw(u32).to_bytes(4, "little") + len(data).to_bytes(4, "little") + bytes(4)
        return ptype, rest, data, flags
    if kind == "r2t":
        rest = draw(u16).to_bytes(2, "little") + draw(u16).to_bytes(2, "little") + \
            draw(u32).to_bytes(4, "little") + draw(u32).to_bytes(4, "little") + bytes(4)
        return PduType.R2T, rest, b"", 0
    if kind == "term":
        ptype = draw(st.sampled_from([PduType.H2C_TERM_REQ, PduType.C2H_TERM_REQ]))
        return ptype, (draw(st.integers(1, 6)), draw(u32)), draw(st.binary(max_size=200)), 0
    ptype = PduType.IC_REQ if kind == "icreq" else PduType.IC_RESP
    return ptype, draw(st.binary(min_size=120, max_size=120)), b"", 0


def write(writer: PduWriter, spec) -> bytes:
    ptype, rest, data, flags = spec
    if ptype in (PduType.H2C_TERM_REQ, PduType.C2H_TERM_REQ):
        fes, fei = rest
        return term_req(ptype, fes, fei, data)
    if ptype in (PduType.IC_REQ, PduType.IC_RESP):
        return tcp.COMMON_HEADER_FAST.pack(ptype, 0, 128, 0, 128) + rest
    return b"".join(bytes(part) for part in writer.pdu(ptype, rest, data or None, flags))


def expected(spec, hdgst: bool, ddgst: bool) -> tuple[int, int, bytes, bytes | None]:
    """What the reader must yield for ``spec`` (header without its digest)."""
    ptype, rest, data, flags = spec
    if ptype in (PduType.H2C_TERM_REQ, PduType.C2H_TERM_REQ):
        fes, fei = rest
        copy = data[:128]
        header = tcp.COMMON_HEADER_FAST.pack(ptype, 0, 24, 0, 24 + len(copy)) + \
            fes.to_bytes(2, "little") + fei.to_bytes(4, "little") + bytes(10)
        return ptype, 0, header, copy or None
    if ptype in (PduType.IC_REQ, PduType.IC_RESP):
        return ptype, 0, tcp.COMMON_HEADER_FAST.pack(ptype, 0, 128, 0, 128) + rest, None
    hlen = 8 + len(rest)
    hd = 4 if hdgst else 0
    dd = 4 if ddgst and data else 0
    flags |= (PduFlags.HDGST if hd else 0) | (PduFlags.DDGST if dd else 0)
    pdo = hlen + hd if data else 0
    plen = hlen + hd + len(data) + dd
    header = tcp.COMMON_HEADER_FAST.pack(ptype, flags, hlen, pdo, plen) + rest
    return ptype, flags, header, data or None


def drain(reader: PduReader, chunk: bytes, out: list) -> None:
    # Pdu views are only valid until the next feed: copy them, and let them go before it.
    for pdu in reader.feed(chunk):
        out.append((pdu.pdu_type, pdu.flags, bytes(pdu.header),
                    None if pdu.data is None else bytes(pdu.data)))


def chunked(stream: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(x, len(stream)) for x in cuts})
    pieces, prev = [], 0
    for p in points + [len(stream)]:
        pieces.append(stream[prev:p])
        prev = p
    return pieces


def make(hdgst: bool, ddgst: bool) -> tuple[PduWriter, PduReader]:
    writer, reader = PduWriter(), PduReader(ALL_TYPES, max_data=MAX_DATA)
    writer.hdgst = reader.hdgst = hdgst
    writer.ddgst = reader.ddgst = ddgst
    return writer, reader


@pytest.mark.parametrize("hdgst,ddgst", [(False, False), (True, False), (False, True), (True, True)])
def test_writer_reader_any_chunking(hdgst, ddgst):
    @settings(max_examples=150)
    @given(st.lists(pdu_specs(with_ic=not (hdgst or ddgst)), min_size=1, max_size=12),
           st.lists(st.integers(0, 5000), max_size=40))
    def run(specs, cuts):
        writer, reader = make(hdgst, ddgst)
        stream = b"".join(write(writer, s) for s in specs)
        out: list = []
        for piece in chunked(stream, cuts):
            drain(reader, piece, out)
        assert out == [expected(s, hdgst, ddgst) for s in specs]

    run()


def test_byte_at_a_time():
    for hdgst, ddgst in [(False, False), (True, True)]:
        writer, reader = make(hdgst, ddgst)
        specs = [(PduType.CAPSULE_CMD, bytes(range(64)), b"in-capsule", 0),
                 (PduType.C2H_DATA, bytes(16), b"\x01" * 33, PduFlags.LAST_PDU),
                 (PduType.R2T, bytes(16), b"", 0)]
        stream = b"".join(write(writer, s) for s in specs)
        out: list = []
        for i in range(len(stream)):
            drain(reader, stream[i:i + 1], out)
        assert out == [expected(s, hdgst, ddgst) for s in specs]


def placing(hdgst: bool, ddgst: bool) -> tuple[PduWriter, PduReader, list[memoryview]]:
    """A reader that places every data PDU's data in a buffer of its own, as the transports do."""
    writer, reader = make(hdgst, ddgst)
    placed: list[memoryview] = []

    def place(ptype: int, header: memoryview, length: int) -> memoryview:
        buf = memoryview(bytearray(length))
        placed.append(buf)
        return buf
    reader.place = place
    return writer, reader, placed


@pytest.mark.parametrize("hdgst,ddgst", [(False, False), (True, False), (False, True), (True, True)])
def test_placed_data_any_chunking(hdgst, ddgst):
    """Data received straight into the place()d buffers: the same PDUs, the data in those buffers."""
    @settings(max_examples=150)
    @given(st.lists(pdu_specs(with_ic=not (hdgst or ddgst)), min_size=1, max_size=12),
           st.lists(st.integers(0, 5000), max_size=40))
    def run(specs, cuts):
        writer, reader, placed = placing(hdgst, ddgst)
        stream = b"".join(write(writer, s) for s in specs)
        out: list = []
        flags_placed = []
        for piece in chunked(stream, cuts):
            for pdu in reader.feed(piece):
                flags_placed.append(pdu.placed)
                out.append((pdu.pdu_type, pdu.flags, bytes(pdu.header),
                            None if pdu.data is None else bytes(pdu.data)))
        assert out == [expected(s, hdgst, ddgst) for s in specs]
        with_data = [s[2] for s in specs if s[2] and s[0] not in (PduType.H2C_TERM_REQ, PduType.C2H_TERM_REQ)]
        assert [bytes(b) for b in placed] == with_data
        assert flags_placed.count(True) == len(with_data)

    run()


def test_placed_data_larger_than_staging():
    """A 1 MiB H2CData goes to its buffer in the pieces the socket gives, never into staging."""
    for ddgst in (False, True):
        writer, reader, placed = placing(False, ddgst)
        reader.max_data = 1 << 20
        big = bytes(range(256)) * 4096
        stream = b"".join(bytes(p) for p in writer.data_pdu(PduType.H2C_DATA, 1, 2, 0, big, PduFlags.LAST_PDU))
        stream += b"".join(bytes(p) for p in writer.pdu(PduType.CAPSULE_CMD, bytes(64)))
        out = []
        for i in range(0, len(stream), 70001):
            out += [(p.pdu_type, p.placed) for p in reader.feed(stream[i:i + 70001])]
        assert out == [(PduType.H2C_DATA, True), (PduType.CAPSULE_CMD, False)]
        assert bytes(placed[0]) == big
        assert len(reader._buf) == 64 << 10  # staging never grew


def test_placed_data_digest_error_skips_the_pdu():
    writer, reader, placed = placing(False, True)
    bad = bytearray(b"".join(bytes(p) for p in writer.data_pdu(PduType.H2C_DATA, 1, 2, 0, b"x" * 2000, PduFlags.LAST_PDU)))
    bad[-1] ^= 0xFF
    good = b"".join(bytes(p) for p in writer.data_pdu(PduType.H2C_DATA, 1, 3, 0, b"next", PduFlags.LAST_PDU))
    with pytest.raises(DataDigestError):  # data placed from staging, then the rest received into it
        for _ in reader.feed(bytes(bad[:1000])):
            pass
        for _ in reader.feed(bytes(bad[1000:])):
            pass
    assert [d for _, _, _, d in feed_all(reader, good)] == [b"next"]


def test_placed_data_digest_error_whole_in_staging():
    """A bad data PDU that arrived whole with the next one: it is skipped, the next is served."""
    writer, reader, placed = placing(False, True)
    bad = bytearray(b"".join(bytes(p) for p in writer.data_pdu(PduType.H2C_DATA, 1, 2, 0, b"x" * 2000, PduFlags.LAST_PDU)))
    bad[-1] ^= 0xFF
    good = b"".join(bytes(p) for p in writer.data_pdu(PduType.H2C_DATA, 1, 3, 0, b"next", PduFlags.LAST_PDU))
    with pytest.raises(DataDigestError):
        for _ in reader.feed(bytes(bad) + good):
            pass
    assert [(p.placed, bytes(p.data)) for p in reader.buffer_updated(0)] == [(True, b"next")]
    assert bytes(placed[1]) == b"next"


# --- damaged framing ------------------------------------------------------------------------


def one_pdu(kind: str, hdgst: bool, ddgst: bool, data: bytes = b"\x5a" * 64) -> bytes:
    writer, _ = make(hdgst, ddgst)
    if kind == "h2c":
        return b"".join(bytes(p) for p in writer.data_pdu(PduType.H2C_DATA, 1, 2, 0, data,
                                                           PduFlags.LAST_PDU))
    if kind == "cmd":
        return b"".join(bytes(p) for p in writer.pdu(PduType.CAPSULE_CMD, bytes(64), data))
    if kind == "resp":
        return b"".join(bytes(p) for p in writer.pdu(PduType.CAPSULE_RESP, bytes(16)))
    raise ValueError(kind)


def feed_all(reader: PduReader, raw: bytes) -> list:
    out: list = []
    drain(reader, raw, out)
    return out


@given(st.sampled_from(["h2c", "cmd", "resp"]), st.data())
def test_corrupt_header_digest(kind, data):
    raw = bytearray(one_pdu(kind, True, False))
    hlen = raw[2]
    # any bit past the common header, in the rest of the header or in the digest itself
    bit = data.draw(st.integers(8 * 8, 8 * (hlen + 4) - 1))
    raw[bit // 8] ^= 1 << (bit % 8)
    _, reader = make(True, False)
    with pytest.raises(FramingError) as ei:
        feed_all(reader, bytes(raw))
    assert ei.value.fes == TermReqFes.HEADER_DIGEST_ERROR


@given(st.sampled_from(["h2c", "cmd"]), st.booleans(), st.data())
def test_corrupt_data_digest(kind, hdgst, data):
    raw = bytearray(one_pdu(kind, hdgst, True))
    start = raw[3]  # PDO: data, then its digest, run to the end
    bit = data.draw(st.integers(8 * start, 8 * len(raw) - 1))
    raw[bit // 8] ^= 1 << (bit % 8)
    _, reader = make(hdgst, True)
    with pytest.raises(DataDigestError) as ei:
        feed_all(reader, bytes(raw))
    assert ei.value.pdu_type == raw[0]
    assert ei.value.header == bytes(raw[:raw[2]])


def test_data_digest_error_skips_the_bad_pdu():
    """A data digest error fails one command; the stream goes on with the next PDU."""
    bad = bytearray(one_pdu("h2c", False, True))
    bad[-1] ^= 0xFF
    good = one_pdu("h2c", False, True, b"next")
    _, reader = make(False, True)
    with pytest.raises(DataDigestError) as ei:  # kept: its traceback must not pin the buffer
        feed_all(reader, bytes(bad))
    out = feed_all(reader, good)
    assert [d for _, _, _, d in out] == [b"next"]
    assert ei.value.header == bytes(bad[:24])
    # PDUs queued behind the bad one in the same chunk come out on the next feed
    _, reader = make(False, True)
    with pytest.raises(DataDigestError):
        feed_all(reader, bytes(bad) + good)
    assert [d for _, _, _, d in feed_all(reader, b"")] == [b"next"]


@pytest.mark.parametrize("hdgst", [False, True])
@given(kind=st.sampled_from(["h2c", "cmd", "resp"]), hlen=st.integers(0, 255))
def test_bad_hlen(hdgst, kind, hlen):
    raw = bytearray(one_pdu(kind, hdgst, False))
    assume(hlen != raw[2])
    raw[2] = hlen
    _, reader = make(hdgst, False)
    with pytest.raises(FramingError) as ei:
        feed_all(reader, bytes(raw[:8]))  # the common header alone is enough to judge
    assert (ei.value.fes, ei.value.fei) == (TermReqFes.INVALID_HEADER_FIELD, 2)
    assert ei.value.header == bytes(raw[:8])


@pytest.mark.parametrize("hdgst", [False, True])
@given(kind=st.sampled_from(["h2c", "cmd"]), pdo=st.integers(0, 255))
def test_bad_pdo(hdgst, kind, pdo):
    raw = bytearray(one_pdu(kind, hdgst, False))
    assume(pdo != raw[3])
    raw[3] = pdo
    _, reader = make(hdgst, False)
    with pytest.raises(FramingError) as ei:
        feed_all(reader, bytes(raw))
    assert (ei.value.fes, ei.value.fei) == (TermReqFes.INVALID_HEADER_FIELD, 3)


@pytest.mark.parametrize("hdgst,ddgst", [(False, False), (True, True)])
@given(kind=st.sampled_from(["h2c", "cmd"]), extra=st.integers(1, 1 << 20))
def test_oversize_data(hdgst, ddgst, kind, extra):
    raw = bytearray(one_pdu(kind, hdgst, ddgst, b"\0" * MAX_DATA))
    plen = int.from_bytes(raw[4:8], "little") + extra
    raw[4:8] = plen.to_bytes(4, "little")
    _, reader = make(hdgst, ddgst)
    with pytest.raises(FramingError) as ei:
        feed_all(reader, bytes(raw[:raw[2]]))  # refused before the data arrives
    assert ei.value.fes == TermReqFes.DATA_OUT_OF_RANGE


def test_exactly_max_data_is_accepted():
    for hdgst, ddgst in [(False, False), (True, True)]:
        _, reader = make(hdgst, ddgst)
        out = feed_all(reader, one_pdu("h2c", hdgst, ddgst, b"\1" * MAX_DATA))
        assert len(out) == 1 and out[0][3] == b"\1" * MAX_DATA


@given(ptype=st.integers(0, 255))
def test_unexpected_type(ptype):
    reader = PduReader(frozenset({PduType.CAPSULE_CMD, PduType.H2C_DATA}), max_data=MAX_DATA)
    assume(ptype not in reader.accepted)
    with pytest.raises(FramingError) as ei:
        feed_all(reader, bytes([ptype, 0, 24, 0, 24, 0, 0, 0]))
    assert (ei.value.fes, ei.value.fei) == (TermReqFes.INVALID_HEADER_FIELD, 0)


@given(kind=st.sampled_from(["h2c", "cmd", "resp"]), hdgst=st.booleans(), data=st.data())
def test_plen_shorter_than_header(kind, hdgst, data):
    raw = bytearray(one_pdu(kind, hdgst, False))
    plen = data.draw(st.integers(0, raw[2] + (4 if hdgst else 0) - 1))
    raw[4:8] = plen.to_bytes(4, "little")
    _, reader = make(hdgst, False)
    with pytest.raises(FramingError) as ei:
        feed_all(reader, bytes(raw))
    assert (ei.value.fes, ei.value.fei) == (TermReqFes.INVALID_HEADER_FIELD, 4)


@pytest.mark.parametrize("kind", ["h2c", "cmd", "resp"])
def test_digest_flags_must_match_negotiation(kind):
    # header digest negotiated but HDGSTF clear, and the other way round
    for written, negotiated in [(False, True), (True, False)]:
        raw = one_pdu(kind, written, False)
        _, reader = make(negotiated, False)
        with pytest.raises(FramingError) as ei:
            feed_all(reader, raw)
        assert ei.value.fei in (1, 3, 4) and ei.value.fes == TermReqFes.INVALID_HEADER_FIELD
    if kind != "resp":  # data digest flag
        for written, negotiated in [(False, True), (True, False)]:
            raw = one_pdu(kind, False, written)
            _, reader = make(False, negotiated)
            with pytest.raises(FramingError) as ei:
                feed_all(reader, raw)
            assert (ei.value.fes, ei.value.fei) == (TermReqFes.INVALID_HEADER_FIELD, 1)


def test_data_on_a_pdu_that_carries_none():
    raw = bytearray(one_pdu("resp", False, False)) + b"xxxx"
    raw[4:8] = (28).to_bytes(4, "little")
    _, reader = make(False, False)
    with pytest.raises(FramingError) as ei:
        feed_all(reader, bytes(raw))
    assert (ei.value.fes, ei.value.fei) == (TermReqFes.INVALID_HEADER_FIELD, 4)


def test_term_req_too_long():
    raw = bytearray(term_req(PduType.H2C_TERM_REQ, 1, 0, bytes(128)))
    _, reader = make(False, False)
    assert len(feed_all(reader, bytes(raw))) == 1
    raw[4:8] = (24 + 129).to_bytes(4, "little")
    _, reader = make(False, False)
    with pytest.raises(FramingError):
        feed_all(reader, bytes(raw) + b"\0")
