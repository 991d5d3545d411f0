"""Log pages: Discovery (70h), Error Information (01h), Changed Namespace List (04h), Commands
Supported and Effects (05h), ANA (0Ch)."""

from __future__ import annotations

import construct as c

from protocol.layout import at_offsets, nul_padded

DISCOVERY_HEADER_SIZE = 1024
DISCOVERY_ENTRY_SIZE = 1024
ERROR_LOG_ENTRY_SIZE = 64

DISCOVERY_HEADER = at_offsets(DISCOVERY_HEADER_SIZE, [
    (0, "genctr", c.Int64ul),
    (8, "numrec", c.Int64ul),
    (16, "recfmt", c.Int16ul),
])

DISCOVERY_ENTRY = at_offsets(DISCOVERY_ENTRY_SIZE, [
    (0, "trtype", c.Int8ul),
    (1, "adrfam", c.Int8ul),
    (2, "subtype", c.Int8ul),
    (3, "treq", c.Int8ul),
    (4, "portid", c.Int16ul),
    (6, "cntlid", c.Int16ul),
    (8, "asqsz", c.Int16ul),
    (10, "eflags", c.Int16ul),
    (32, "trsvcid", nul_padded(32)),
    (256, "subnqn", nul_padded(256)),
    (512, "traddr", nul_padded(256)),
    (768, "tsas", c.Bytes(256)),
])
"""TREQ: bits 1:0 secure channel, bit 2 SQ flow control disable supported (see
:data:`protocol.constants.TREQ_SQFLOW_DISABLE_SUPPORTED`); TSAS for RDMA: QPTYPE, PRTYPE, CMS."""

ERROR_LOG_ENTRY = at_offsets(ERROR_LOG_ENTRY_SIZE, [
    (0, "error_count", c.Int64ul),
    (8, "sqid", c.Int16ul),
    (10, "cid", c.Int16ul),
    (12, "status", c.Int16ul),
    (14, "param_location", c.Int16ul),
    (16, "lba", c.Int64ul),
    (24, "nsid", c.Int32ul),
    (28, "vs", c.Int8ul),
    (29, "trtype", c.Int8ul),
    (32, "cs", c.Int64ul),
    (40, "trtype_specific", c.Int16ul),
])
"""``status`` is the CQE status word (phase bit included, More bit not: nvmet stores the status
the command failed with); ``param_location`` the byte offset in the SQE of the field at fault."""

CHANGED_NS_LIST = c.Array(1024, c.Int32ul)

COMMANDS_EFFECTS_LOG_SIZE = 4096
COMMANDS_EFFECTS_LOG = at_offsets(COMMANDS_EFFECTS_LOG_SIZE, [
    (0, "acs", c.Array(256, c.Int32ul)),
    (1024, "iocs", c.Array(256, c.Int32ul)),
])
"""Commands Supported and Effects: one entry per admin opcode (ACS), then per I/O opcode (IOCS)."""
EFFECTS_CSUPP = 1 << 0
"""The controller supports the command."""
EFFECTS_LBCC = 1 << 1
"""The command may change the contents of logical blocks (a write)."""

TSAS_RDMA = at_offsets(256, [
    (0, "qptype", c.Int8ul),
    (1, "prtype", c.Int8ul),
    (2, "cms", c.Int8ul),
    (8, "pkey", c.Int16ul),
])

ANA_HEADER_SIZE = 16
ANA_GROUP_SIZE = 32
"""A group descriptor without its NSID list (which follows it, 4 bytes an NSID)."""

ANA_HEADER = at_offsets(ANA_HEADER_SIZE, [
    (0, "chgcnt", c.Int64ul),
    (8, "ngrps", c.Int16ul),
])

ANA_GROUP = c.Struct(
    "grpid" / c.Int32ul,
    "nnsids" / c.Int32ul,
    "chgcnt" / c.Int64ul,
    "state" / c.Int8ul,
    c.Padding(15),
    "nsids" / c.Array(c.this.nnsids, c.Int32ul),
)

ANA_LOG = c.Struct(
    "header" / ANA_HEADER,
    "groups" / c.Array(c.this.header.ngrps, ANA_GROUP),
)
"""The ANA log page: header, then one descriptor per group (with Return Groups Only, every
``nnsids`` is 0). ``state`` is a :class:`protocol.constants.AnaState`."""
