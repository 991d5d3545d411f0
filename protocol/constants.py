"""NVMe and NVMe-oF numbers: opcodes, feature ids, log ids, CNS values, transport types.

Values follow the NVMe Base 2.0 and NVMe-oF 1.1 specs, as used by the Linux kernel's
include/linux/nvme.h.
"""

from enum import IntEnum

DISCOVERY_NQN = "nqn.2014-08.org.nvmexpress.discovery"
DEFAULT_IO_PORT = 4420
DEFAULT_TCP_DISCOVERY_PORT = 8009
DYNAMIC_CNTLID = 0xFFFF
PSDT_SGL = 0x40
"""FLAGS byte with PSDT=01b: every fabrics SQE carries it (Linux nvmet rejects anything else)."""


class AdminOpcode(IntEnum):
    GET_LOG_PAGE = 0x02
    IDENTIFY = 0x06
    ABORT = 0x08
    SET_FEATURES = 0x09
    GET_FEATURES = 0x0A
    ASYNC_EVENT_REQUEST = 0x0C
    KEEP_ALIVE = 0x18
    FABRICS = 0x7F


class IoOpcode(IntEnum):
    FLUSH = 0x00
    WRITE = 0x01
    READ = 0x02
    WRITE_ZEROES = 0x08
    DATASET_MANAGEMENT = 0x09
    RESERVATION_REGISTER = 0x0D
    RESERVATION_REPORT = 0x0E
    RESERVATION_ACQUIRE = 0x11
    RESERVATION_RELEASE = 0x15
    FABRICS = 0x7F
    BLOCKD_DIGEST = 0x82
    """blockd's own (vendor specific: I/O opcodes 80h-FFh), see :mod:`protocol.digest`."""


class FabricsType(IntEnum):
    PROPERTY_SET = 0x00
    CONNECT = 0x01
    PROPERTY_GET = 0x04
    AUTH_SEND = 0x05
    AUTH_RECEIVE = 0x06
    DISCONNECT = 0x08


class Cns(IntEnum):
    NAMESPACE = 0x00
    CONTROLLER = 0x01
    ACTIVE_NS_LIST = 0x02
    NS_DESCRIPTORS = 0x03
    CSI_CONTROLLER = 0x06
    CSI_INDEPENDENT_NS = 0x08


class FeatureId(IntEnum):
    ARBITRATION = 0x01
    POWER_MANAGEMENT = 0x02
    TEMPERATURE_THRESHOLD = 0x04
    VOLATILE_WRITE_CACHE = 0x06
    NUMBER_OF_QUEUES = 0x07
    INTERRUPT_COALESCING = 0x08
    WRITE_ATOMICITY = 0x0A
    ASYNC_EVENT_CONFIG = 0x0B
    KEEP_ALIVE_TIMER = 0x0F
    HOST_IDENTIFIER = 0x81
    RESERVATION_NOTIFICATION_MASK = 0x82
    RESERVATION_PERSISTENCE = 0x83


class LogPageId(IntEnum):
    ERROR = 0x01
    SMART = 0x02
    FIRMWARE_SLOT = 0x03
    CHANGED_NS_LIST = 0x04
    COMMANDS_EFFECTS = 0x05
    ANA = 0x0C
    DISCOVERY = 0x70
    RESERVATION_NOTIFICATION = 0x80


class Property(IntEnum):
    """Controller properties (register offsets) reachable with Property Get/Set."""

    CAP = 0x00
    VS = 0x08
    CC = 0x14
    CSTS = 0x1C
    NSSR = 0x20


class TransportType(IntEnum):
    RDMA = 1
    FC = 2
    TCP = 3
    LOOP = 254


class AddressFamily(IntEnum):
    IPV4 = 1
    IPV6 = 2
    IB = 3
    FC = 4


class SubsystemType(IntEnum):
    REFERRAL = 1
    NVME = 2
    CURRENT_DISCOVERY = 3


class SglId(IntEnum):
    """Byte 15 of an SGL descriptor: type in bits 7:4, subtype in bits 3:0."""

    DATA_BLOCK_OFFSET = 0x01
    KEYED_DATA_BLOCK = 0x40
    KEYED_DATA_BLOCK_INVALIDATE = 0x4F
    TRANSPORT_DATA_BLOCK = 0x5A


class NidType(IntEnum):
    """Namespace Identification Descriptor types (Identify CNS 03h)."""

    EUI64 = 1
    NGUID = 2
    UUID = 3
    CSI = 4


class AnaState(IntEnum):
    """Asymmetric Namespace Access states of a group on a port (ANA log page descriptor)."""

    OPTIMIZED = 0x01
    NON_OPTIMIZED = 0x02
    INACCESSIBLE = 0x03
    PERSISTENT_LOSS = 0x04
    CHANGE = 0x0F


ANA_STATE_NAMES = {"optimized": AnaState.OPTIMIZED, "non-optimized": AnaState.NON_OPTIMIZED,
                   "inaccessible": AnaState.INACCESSIBLE, "persistent-loss": AnaState.PERSISTENT_LOSS,
                   "change": AnaState.CHANGE}
"""The names nvmet's configfs ``ana_state`` takes, used in the config and by blockctl."""
GET_LOG_PAGE_LSP_RGO = 0x01
"""ANA log LSP bit 0, Return Groups Only: descriptors without their NSID lists."""

# CQE DW0 of an Asynchronous Event Request completion: type notice (2), info, log page.
AEN_NS_ATTR_CHANGED = 0x00040002
AEN_ANA_CHANGED = 0x000C0302
"""Notice, ANA change (info 03h), ANA log page (0Ch)."""
AEN_DISCOVERY_CHANGED = 0x0070F002
AEN_RESERVATION_LOG = 0x00800006
"""I/O command specific status (type 6), Reservation Log Page Available (info 00h), log 80h."""

# Identify Controller fields this implementation advertises.
LPA_COMMANDS_EFFECTS = 1 << 1
"""Identify Controller LPA bit 1: the Commands Supported and Effects log page is served."""
LPA_EXTENDED_DATA = 1 << 2
"""LPA bit 2: Get Log Page takes NUMDU and an offset (extended data)."""
ONCS_DSM = 1 << 2
ONCS_WRITE_ZEROES = 1 << 3
ONCS_RESERVATIONS = 1 << 5
OAES_NS_ATTR = 1 << 8
OAES_ANA_CHANGE = 1 << 11
"""Also the Asynchronous Event Configuration bit that enables the ANA change event."""
CMIC_MULTI_PORT = 1 << 0
CMIC_MULTI_CONTROLLER = 1 << 1
"""A host may hold several controllers of the subsystem (the Linux host refuses a second one
without it)."""
CMIC_ANA = 1 << 3
"""The controller reports ANA: the ANA log page, ANAGRPID, the ANA statuses."""
ANACAP_ALL_STATES = 0x1F
"""ANACAP bits 0..4: reports optimized, non-optimized, inaccessible, persistent loss, change."""
NMIC_SHARED = 1 << 0
OAES_DISCOVERY_CHANGE = 1 << 31
CTRATT_HOST_ID_128 = 1 << 0
"""CTRATT.HIDS: the controller takes a 128-bit host identifier (fabrics hosts always send one)."""
CTRATT_TBKAS = 1 << 6
"""CTRATT.TBKAS: any command restarts the keep-alive timer (traffic-based keep-alive)."""

# Discovery log entry TREQ: bits 1:0 secure channel, bit 2 SQ flow control disable.
TREQ_SECURE_CHANNEL_NOT_SPECIFIED = 0
TREQ_SQFLOW_DISABLE_SUPPORTED = 1 << 2

# Controller properties' fields (NVMe Base 2.0 section 3.1.4), as the host reads and writes them.
CAP_TO_SHIFT = 24
"""CAP.TO (bits 31:24): worst-case time to become ready, in units of CAP_TO_UNIT seconds."""
CAP_TO_UNIT = 0.5
CAP_MPSMIN_SHIFT = 48
"""CAP.MPSMIN (bits 51:48): the smallest memory page size is 2 ** (12 + MPSMIN)."""
CC_EN = 1 << 0
CC_SHN_NORMAL = 1 << 14
CC_SHN_MASK = 3 << 14
CC_IOSQES_64 = 6 << 16
"""CC.IOSQES (bits 19:16): I/O SQ entries of 2 ** 6 = 64 bytes."""
CC_IOCQES_16 = 4 << 20
"""CC.IOCQES (bits 23:20): I/O CQ entries of 2 ** 4 = 16 bytes."""
CSTS_RDY = 1 << 0
CSTS_CFS = 1 << 1
CSTS_SHST_MASK = 3 << 2
CSTS_SHST_COMPLETE = 2 << 2

# Identify Namespace fields the host reads.
FLBAS_FORMAT_MASK = 0x0F
"""FLBAS bits 3:0: the index of the LBA format in use."""
NSATTR_WRITE_PROTECTED = 1 << 0
DLFEAT_READ_MASK = 0x07
"""DLFEAT bits 2:0: what a deallocated block reads as (001b: all zeroes)."""
DLFEAT_READS_ZEROES = 0x01
DLFEAT_DEAC = 1 << 3
"""DLFEAT bit 3: the namespace honours Write Zeroes' Deallocate bit (DEAC)."""

AEN_DW0_MASK = 0x00FFFF07
"""The bits of an Asynchronous Event Request completion's DW0 that say what happened: event
type (2:0), event information (15:8), log page (23:16); compare with AEN_* above."""
