"""Soft-RoCE (rdma_rxe) link management over RDMA netlink (NLDEV), with pyroute2.

This is what ``rdma link add NAME type rxe netdev NETDEV`` / ``rdma link delete NAME`` /
``rdma link show`` do, spoken directly on a ``NETLINK_RDMA`` socket: pyroute2 0.9 has no RDMA
netlink module, so the NLDEV message and its attributes are declared here on pyroute2's generic
``nlmsg``/``NetlinkSocket``.  The netdev is looked up with pyroute2's ``IPRoute``.  Nothing is
shelled out.

Constants checked against the kernel's ``include/uapi/rdma/rdma_netlink.h`` (as installed in
``/usr/include/rdma/rdma_netlink.h`` by linux-libc-dev, compiled and printed):
RDMA_NL_NLDEV = 5; CMD_GET 1, NEWLINK 3, DELLINK 4, PORT_GET 5; ATTR DEV_INDEX 1, DEV_NAME 2,
PORT_INDEX 3, ..., PORT_STATE 12, PORT_PHYS_STATE 13, DEV_NODE_TYPE 14, NDEV_INDEX 50,
NDEV_NAME 51, LINK_TYPE 65, DEV_PROTOCOL 67.  The message type is
``RDMA_NL_GET_TYPE(client, op) = client << 10 | op``; NLDEV messages carry no family header,
attributes follow ``nlmsghdr`` directly.

Kernel behaviour that shapes the errors below (drivers/infiniband/core/nldev.c
``nldev_newlink``): the link type is resolved with ``request_module("rdma-link-%s")``; if no
driver registers "rxe" the kernel answers EINVAL, if the netdev is missing it answers ENODEV.
rxe additionally needs ``crc32_generic`` (its crc32 shash): without it the answer is ENOENT.
We look the netdev up ourselves first, so ENODEV/ENOENT/EINVAL from the kernel are reported as a
driver problem with a one-line hint.

CLI: :func:`rxe_main` implements ``blockctl rxe add NETDEV [--name NAME] | del NAME | list``;
``python -m blockd.rdma.rxe ...`` runs the same.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from dataclasses import dataclass

from pyroute2 import IPRoute
from pyroute2.netlink import NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, nlmsg
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.nlsocket import AsyncNetlinkSocket, Marshal, NetlinkSocket

__all__ = [
    "NETLINK_RDMA",
    "RdmaLink",
    "RxeError",
    "add_rxe",
    "del_rxe",
    "list_rdma_links",
    "rxe_main",
]

NETLINK_RDMA = 20
RDMA_NL_NLDEV = 5

RDMA_NLDEV_CMD_GET = 1
RDMA_NLDEV_CMD_NEWLINK = 3
RDMA_NLDEV_CMD_DELLINK = 4
RDMA_NLDEV_CMD_PORT_GET = 5

# IB port states (enum ib_port_state) as reported in RDMA_NLDEV_ATTR_PORT_STATE
PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
PHYS_STATES = {1: "SLEEP", 2: "POLLING", 3: "DISABLED", 4: "PORT_CONFIGURATION_TRAINING",
               5: "LINK_UP", 6: "LINK_ERROR_RECOVERY", 7: "PHY_TEST"}


def rdma_nl_type(client: int, op: int) -> int:
    """``RDMA_NL_GET_TYPE(client, op)`` from rdma_netlink.h."""
    return (client << 10) + op


class nldevmsg(nlmsg):
    """An RDMA NLDEV message: nlmsghdr followed directly by attributes (no family header)."""

    fields = ()
    prefix = "RDMA_NLDEV_ATTR_"
    nla_map = (
        (0, "RDMA_NLDEV_ATTR_UNSPEC", "none"),
        (1, "RDMA_NLDEV_ATTR_DEV_INDEX", "uint32"),
        (2, "RDMA_NLDEV_ATTR_DEV_NAME", "asciiz"),
        (3, "RDMA_NLDEV_ATTR_PORT_INDEX", "uint32"),
        (4, "RDMA_NLDEV_ATTR_CAP_FLAGS", "uint64"),
        (5, "RDMA_NLDEV_ATTR_FW_VERSION", "asciiz"),
        (6, "RDMA_NLDEV_ATTR_NODE_GUID", "uint64"),
        (7, "RDMA_NLDEV_ATTR_SYS_IMAGE_GUID", "uint64"),
        (8, "RDMA_NLDEV_ATTR_SUBNET_PREFIX", "uint64"),
        (9, "RDMA_NLDEV_ATTR_LID", "uint32"),
        (10, "RDMA_NLDEV_ATTR_SM_LID", "uint32"),
        (11, "RDMA_NLDEV_ATTR_LMC", "uint8"),
        (12, "RDMA_NLDEV_ATTR_PORT_STATE", "uint8"),
        (13, "RDMA_NLDEV_ATTR_PORT_PHYS_STATE", "uint8"),
        (14, "RDMA_NLDEV_ATTR_DEV_NODE_TYPE", "uint8"),
        (50, "RDMA_NLDEV_ATTR_NDEV_INDEX", "uint32"),
        (51, "RDMA_NLDEV_ATTR_NDEV_NAME", "asciiz"),
        (65, "RDMA_NLDEV_ATTR_LINK_TYPE", "asciiz"),
        (67, "RDMA_NLDEV_ATTR_DEV_PROTOCOL", "asciiz"),
    )


class NldevMarshal(Marshal):
    default_message_class = nldevmsg
    msg_map = {
        rdma_nl_type(RDMA_NL_NLDEV, op): nldevmsg
        for op in (RDMA_NLDEV_CMD_GET, RDMA_NLDEV_CMD_NEWLINK, RDMA_NLDEV_CMD_DELLINK,
                   RDMA_NLDEV_CMD_PORT_GET)
    }


class AsyncRdmaNetlinkSocket(AsyncNetlinkSocket):
    marshal_class = NldevMarshal


class RdmaNetlinkSocket(NetlinkSocket):
    """A pyroute2 netlink socket on ``NETLINK_RDMA`` that decodes NLDEV messages.

    Synchronous (pyroute2's ``NetlinkSocket`` runs a private event loop): from asyncio code call
    these functions through ``loop.run_in_executor``.
    """

    async_class = AsyncRdmaNetlinkSocket

    def __init__(self) -> None:
        super().__init__(NETLINK_RDMA)

    def request(self, op: int, attrs: list[tuple[str, object]], flags: int) -> list[nldevmsg]:
        msg = nldevmsg()
        msg["attrs"] = attrs
        return list(self.nlm_request(msg, msg_type=rdma_nl_type(RDMA_NL_NLDEV, op),
                                     msg_flags=flags))


class RxeError(RuntimeError):
    """A one-line, human-readable failure of an rxe/NLDEV operation."""


@dataclass(frozen=True)
class RdmaLink:
    """One port of an RDMA device as ``rdma link show`` lists it."""

    dev: str
    dev_index: int
    port: int
    state: str
    phys_state: str
    netdev: str | None
    netdev_index: int | None

    def __str__(self) -> str:
        nd = f" netdev {self.netdev}" if self.netdev else ""
        return f"link {self.dev}/{self.port} state {self.state} physical_state {self.phys_state}{nd}"


def _open() -> RdmaNetlinkSocket:
    try:
        return RdmaNetlinkSocket()
    except OSError as e:
        if e.errno in (errno.EPROTONOSUPPORT, errno.ENOENT):
            raise RxeError("this kernel has no RDMA netlink (CONFIG_INFINIBAND unset or ib_core "
                           "not loaded); RDMA needs a kernel with rdma_rxe") from None
        raise RxeError(f"cannot open an RDMA netlink socket: {e.strerror}") from None


def _netdev_index(netdev: str) -> int:
    with IPRoute() as ipr:
        idx = ipr.link_lookup(ifname=netdev)
    if not idx:
        raise RxeError(f"network device {netdev!r} does not exist")
    return idx[0]


def _rxe_module_state() -> str:
    """Best-effort hint on why the kernel refused an rxe link."""
    if not os.path.exists("/sys/module/rdma_rxe"):
        return ("the rdma_rxe kernel module is missing or could not be loaded "
                "(modprobe rdma_rxe; it also needs crc32_generic)")
    if not os.path.exists("/sys/module/crc32_generic") and not os.path.exists(
            "/sys/module/crc32_pclmul"):
        return "rdma_rxe is loaded but its crc32 shash is missing (modprobe crc32_generic)"
    return "rdma_rxe is loaded"


def list_rdma_links() -> list[RdmaLink]:
    """All ports of all RDMA devices, rxe or not (NLDEV GET dump, then PORT_GET per device)."""
    links = []
    with _open() as nl:
        try:
            devs = [(m.get_attr("RDMA_NLDEV_ATTR_DEV_INDEX"), m.get_attr("RDMA_NLDEV_ATTR_DEV_NAME"))
                    for m in nl.request(RDMA_NLDEV_CMD_GET, [], NLM_F_REQUEST | NLM_F_DUMP)
                    if m.get_attr("RDMA_NLDEV_ATTR_DEV_NAME") is not None]
            for index, name in devs:
                # the port dump needs the device index (nldev_port_get_dumpit)
                for m in nl.request(RDMA_NLDEV_CMD_PORT_GET,
                                    [("RDMA_NLDEV_ATTR_DEV_INDEX", index)],
                                    NLM_F_REQUEST | NLM_F_DUMP):
                    if m.get_attr("RDMA_NLDEV_ATTR_PORT_INDEX") is None:
                        continue
                    links.append(RdmaLink(
                        dev=name,
                        dev_index=index,
                        port=m.get_attr("RDMA_NLDEV_ATTR_PORT_INDEX"),
                        state=PORT_STATES.get(m.get_attr("RDMA_NLDEV_ATTR_PORT_STATE"), "?"),
                        phys_state=PHYS_STATES.get(
                            m.get_attr("RDMA_NLDEV_ATTR_PORT_PHYS_STATE"), "?"),
                        netdev=m.get_attr("RDMA_NLDEV_ATTR_NDEV_NAME"),
                        netdev_index=m.get_attr("RDMA_NLDEV_ATTR_NDEV_INDEX"),
                    ))
        except NetlinkError as e:
            raise RxeError(f"RDMA netlink dump failed: {os.strerror(e.code)}") from None
    return links


def add_rxe(netdev: str, name: str | None = None) -> str:
    """Create an rxe device on ``netdev`` (NLDEV NEWLINK, type "rxe"); return its name.

    ``name`` defaults to ``rxe_<netdev>``.  Raises :class:`RxeError` when the netdev does not
    exist, the name is taken, or the kernel has no usable rdma_rxe.
    """
    _netdev_index(netdev)
    name = name or f"rxe_{netdev}"
    if len(name.encode()) >= 64:  # IB_DEVICE_NAME_MAX
        raise RxeError(f"device name {name!r} is too long (max 63 bytes)")
    with _open() as nl:
        try:
            nl.request(RDMA_NLDEV_CMD_NEWLINK,
                       [("RDMA_NLDEV_ATTR_DEV_NAME", name),
                        ("RDMA_NLDEV_ATTR_LINK_TYPE", "rxe"),
                        ("RDMA_NLDEV_ATTR_NDEV_NAME", netdev)],
                       # no NLM_F_CREATE/EXCL: EXCL (0x200) is NLM_F_MATCH, and rdma_nl_rcv_msg
                       # treats any NLM_F_DUMP bit as a dump request (NEWLINK has none -> EINVAL)
                       NLM_F_REQUEST | NLM_F_ACK)
        except NetlinkError as e:
            if e.code == errno.EEXIST:
                raise RxeError(f"RDMA device {name!r} already exists") from None
            if e.code in (errno.EINVAL, errno.ENOENT, errno.ENODEV, errno.EOPNOTSUPP):
                raise RxeError(f"kernel refused rxe link {name!r} on {netdev!r} "
                               f"({os.strerror(e.code)}): {_rxe_module_state()}") from None
            if e.code == errno.EPERM:
                raise RxeError("adding an rxe link needs CAP_NET_ADMIN (run as root)") from None
            raise RxeError(f"adding rxe link {name!r} on {netdev!r} failed: "
                           f"{os.strerror(e.code)}") from None
    return name


def del_rxe(name: str) -> None:
    """Delete the RDMA link ``name`` (NLDEV DELLINK by device index)."""
    index = None
    for link in list_rdma_links():
        if link.dev == name:
            index = link.dev_index
            break
    if index is None:
        raise RxeError(f"RDMA device {name!r} does not exist")
    with _open() as nl:
        try:
            nl.request(RDMA_NLDEV_CMD_DELLINK, [("RDMA_NLDEV_ATTR_DEV_INDEX", index)],
                       NLM_F_REQUEST | NLM_F_ACK)
        except NetlinkError as e:
            if e.code == errno.EINVAL:
                raise RxeError(f"RDMA device {name!r} is not a software link "
                               "(only rxe/siw links can be deleted)") from None
            raise RxeError(f"deleting RDMA link {name!r} failed: {os.strerror(e.code)}") from None


def rxe_main(argv: list[str] | None = None, prog: str = "blockctl rxe") -> int:
    """``blockctl rxe add NETDEV [--name NAME] | del NAME | list``; returns an exit status."""
    p = argparse.ArgumentParser(prog=prog, description="Soft-RoCE (rxe) links")
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("add", help="create an rxe device on a network device")
    a.add_argument("netdev")
    a.add_argument("--name", help="RDMA device name (default rxe_NETDEV)")
    d = sub.add_parser("del", help="delete an RDMA link")
    d.add_argument("name")
    sub.add_parser("list", help="list RDMA links")
    args = p.parse_args(argv)
    try:
        if args.cmd == "add":
            print(add_rxe(args.netdev, args.name))
        elif args.cmd == "del":
            del_rxe(args.name)
        else:
            for link in list_rdma_links():
                print(link)
    except RxeError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(rxe_main(sys.argv[1:], prog="python -m blockd.rdma.rxe"))
