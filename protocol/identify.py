"""Identify data structures (4096 bytes each): controller, namespace, lists, descriptors."""

from __future__ import annotations

import construct as c

from protocol.layout import SpacePadded, at_offsets, nul_padded

IDENTIFY_SIZE = 4096

def _zero(con: c.Construct) -> c.Construct:
    """A field our controller leaves 0 (built as 0 when not given) but a host reads and
    reports, as nvme-cli's ``id-ctrl``/``id-ns`` do."""
    return c.Default(con, 0)


_U128 = c.BytesInteger(16, swapped=True)

POWER_STATE = c.Struct(
    "mp" / c.Int16ul, c.Padding(1), "flags" / c.Int8ul, "enlat" / c.Int32ul, "exlat" / c.Int32ul,
    "rrt" / c.Int8ul, "rrl" / c.Int8ul, "rwt" / c.Int8ul, "rwl" / c.Int8ul,
    "idlp" / c.Int16ul, "ips" / c.Int8ul, c.Padding(1), "actp" / c.Int16ul, "apws" / c.Int8ul, c.Padding(9),
)
"""A power state descriptor (32 bytes; NVMe Base 2.0, Figure 276): the first is state 0."""

IDENTIFY_CONTROLLER = at_offsets(IDENTIFY_SIZE, [
    (0, "vid", c.Int16ul),
    (2, "ssvid", c.Int16ul),
    (4, "sn", SpacePadded(20)),
    (24, "mn", SpacePadded(40)),
    (64, "fr", SpacePadded(8)),
    (72, "rab", c.Int8ul),
    (73, "ieee", c.Bytes(3)),
    (76, "cmic", c.Int8ul),
    (77, "mdts", c.Int8ul),
    (78, "cntlid", c.Int16ul),
    (80, "ver", c.Int32ul),
    (84, "rtd3r", c.Int32ul),
    (88, "rtd3e", c.Int32ul),
    (92, "oaes", c.Int32ul),
    (96, "ctratt", c.Int32ul),
    (100, "rrls", _zero(c.Int16ul)),
    (111, "cntrltype", c.Int8ul),
    (112, "fguid", c.Bytes(16)),
    (128, "crdt1", c.Int16ul),
    (130, "crdt2", c.Int16ul),
    (132, "crdt3", c.Int16ul),
    (253, "nvmsr", _zero(c.Int8ul)),
    (254, "vwci", _zero(c.Int8ul)),
    (255, "mec", _zero(c.Int8ul)),
    (256, "oacs", c.Int16ul),
    (258, "acl", c.Int8ul),
    (259, "aerl", c.Int8ul),
    (260, "frmw", c.Int8ul),
    (261, "lpa", c.Int8ul),
    (262, "elpe", c.Int8ul),
    (263, "npss", c.Int8ul),
    (264, "avscc", c.Int8ul),
    (265, "apsta", c.Int8ul),
    (266, "wctemp", _zero(c.Int16ul)),
    (268, "cctemp", _zero(c.Int16ul)),
    (270, "mtfa", _zero(c.Int16ul)),
    (272, "hmpre", _zero(c.Int32ul)),
    (276, "hmmin", _zero(c.Int32ul)),
    (280, "tnvmcap", _zero(_U128)),
    (296, "unvmcap", _zero(_U128)),
    (312, "rpmbs", _zero(c.Int32ul)),
    (316, "edstt", _zero(c.Int16ul)),
    (318, "dsto", _zero(c.Int8ul)),
    (319, "fwug", _zero(c.Int8ul)),
    (320, "kas", c.Int16ul),
    (322, "hctma", _zero(c.Int16ul)),
    (324, "mntmt", _zero(c.Int16ul)),
    (326, "mxtmt", _zero(c.Int16ul)),
    (328, "sanicap", _zero(c.Int32ul)),
    (332, "hmminds", _zero(c.Int32ul)),
    (336, "hmmaxd", _zero(c.Int16ul)),
    (338, "nsetidmax", _zero(c.Int16ul)),
    (340, "endgidmax", _zero(c.Int16ul)),
    (342, "anatt", c.Int8ul),
    (343, "anacap", c.Int8ul),
    (344, "anagrpmax", c.Int32ul),
    (348, "nanagrpid", c.Int32ul),
    (352, "pels", _zero(c.Int32ul)),
    (356, "domainid", _zero(c.Int16ul)),
    (368, "megcap", _zero(_U128)),
    (512, "sqes", c.Int8ul),
    (513, "cqes", c.Int8ul),
    (514, "maxcmd", c.Int16ul),
    (516, "nn", c.Int32ul),
    (520, "oncs", c.Int16ul),
    (522, "fuses", c.Int16ul),
    (524, "fna", c.Int8ul),
    (525, "vwc", c.Int8ul),
    (526, "awun", c.Int16ul),
    (528, "awupf", c.Int16ul),
    (530, "icsvscc", c.Int8ul),
    (531, "nwpc", c.Int8ul),
    (532, "acwu", c.Int16ul),
    (534, "ocfs", _zero(c.Int16ul)),
    (536, "sgls", c.Int32ul),
    (540, "mnan", c.Int32ul),
    (544, "maxdna", _zero(_U128)),
    (560, "maxcna", _zero(c.Int32ul)),
    (768, "subnqn", nul_padded(256)),
    (1792, "ioccsz", c.Int32ul),
    (1796, "iorcsz", c.Int32ul),
    (1800, "icdoff", c.Int16ul),
    (1802, "fcatt", c.Int8ul),
    (1803, "msdbd", c.Int8ul),
    (1804, "ofcs", c.Int16ul),
    (2048, "psd", c.Default(c.Array(32, POWER_STATE), [dict(mp=0, flags=0, enlat=0, exlat=0, rrt=0, rrl=0, rwt=0,
                                                           rwl=0, idlp=0, ips=0, actp=0, apws=0)] * 32)),
])

LBA_FORMAT = c.Struct("ms" / c.Int16ul, "lbads" / c.Int8ul, "rp" / c.Int8ul)

IDENTIFY_NAMESPACE = at_offsets(IDENTIFY_SIZE, [
    (0, "nsze", c.Int64ul),
    (8, "ncap", c.Int64ul),
    (16, "nuse", c.Int64ul),
    (24, "nsfeat", c.Int8ul),
    (25, "nlbaf", c.Int8ul),
    (26, "flbas", c.Int8ul),
    (27, "mc", c.Int8ul),
    (28, "dpc", c.Int8ul),
    (29, "dps", c.Int8ul),
    (30, "nmic", c.Int8ul),
    (31, "rescap", c.Int8ul),
    (32, "fpi", c.Int8ul),
    (33, "dlfeat", c.Int8ul),
    (34, "nawun", c.Int16ul),
    (36, "nawupf", c.Int16ul),
    (38, "nacwu", c.Int16ul),
    (40, "nabsn", _zero(c.Int16ul)),
    (42, "nabo", _zero(c.Int16ul)),
    (44, "nabspf", _zero(c.Int16ul)),
    (46, "noiob", c.Int16ul),
    (48, "nvmcap", _zero(_U128)),
    (74, "mssrl", _zero(c.Int16ul)),
    (76, "mcl", _zero(c.Int32ul)),
    (80, "msrc", _zero(c.Int8ul)),
    (82, "nulbaf", _zero(c.Int8ul)),
    (92, "anagrpid", c.Int32ul),
    (99, "nsattr", c.Int8ul),
    (100, "nvmsetid", _zero(c.Int16ul)),
    (102, "endgid", _zero(c.Int16ul)),
    (104, "nguid", c.Bytes(16)),
    (120, "eui64", c.Bytes(8)),
    (128, "lbaf", c.Array(64, LBA_FORMAT)),
])
"""NSATTR bit 0 = write protected; DLFEAT 0x09 = deallocated blocks read as zeroes and
Write Zeroes may deallocate."""

IDENTIFY_CSI_INDEPENDENT_NS = at_offsets(IDENTIFY_SIZE, [
    (0, "nsfeat", c.Int8ul),
    (1, "nmic", c.Int8ul),
    (2, "rescap", c.Int8ul),
    (3, "fpi", c.Int8ul),
    (4, "anagrpid", c.Int32ul),
    (8, "nsattr", c.Int8ul),
    (10, "nvmsetid", c.Int16ul),
    (12, "endgid", c.Int16ul),
    (14, "nstat", c.Int8ul),
])

ACTIVE_NS_LIST = c.Array(IDENTIFY_SIZE // 4, c.Int32ul)

NS_DESCRIPTOR = c.Struct(
    "nidt" / c.Int8ul,
    "nidl" / c.Int8ul,
    c.Padding(2),
    "nid" / c.Bytes(c.this.nidl),
)

NS_DESCRIPTOR_LIST = c.FixedSized(
    IDENTIFY_SIZE, c.RepeatUntil(lambda obj, lst, ctx: obj["nidl"] == 0, NS_DESCRIPTOR))
"""Descriptors end at the first one with NIDL = 0; build with a terminating zero entry."""
