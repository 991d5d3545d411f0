"""Which local IPv4 addresses an RDMA listener can bind: those of netdevs an RDMA device sits on.

The device -> netdev map comes from sysfs (``/sys/class/infiniband/<dev>/ports/<n>/gid_attrs/
ndevs/*``, filled for RoCE and Soft-RoCE ports), the netdevs' addresses from rtnetlink through
pyroute2. An RDMA port names one of these addresses (pyverbs 44 crashes binding an address with
no RDMA device behind it), or a wildcard meaning all of them.
"""

from __future__ import annotations

import os
import socket

SYSFS_INFINIBAND = "/sys/class/infiniband"


def _rdma_netdevs() -> dict[str, str]:
    """Netdev name -> the (first) RDMA device on it."""
    netdevs: dict[str, str] = {}
    try:
        devs = os.listdir(SYSFS_INFINIBAND)
    except OSError:
        return {}
    for dev in devs:
        ports = os.path.join(SYSFS_INFINIBAND, dev, "ports")
        for port in os.listdir(ports) if os.path.isdir(ports) else []:
            nd = os.path.join(ports, port, "gid_attrs", "ndevs")
            for ent in os.listdir(nd) if os.path.isdir(nd) else []:
                try:
                    with open(os.path.join(nd, ent)) as f:
                        name = f.read().strip()
                except OSError:
                    continue
                if name:
                    netdevs.setdefault(name, dev)
    return netdevs


def rdma_netdev_addresses() -> dict[str, str]:
    """IPv4 address -> RDMA device name, for every netdev an RDMA device sits on. Synchronous
    (pyroute2's ``IPRoute`` runs its own event loop): call it from an executor."""
    netdevs = _rdma_netdevs()
    if not netdevs:
        return {}
    from pyroute2 import IPRoute
    out: dict[str, str] = {}
    with IPRoute() as ipr:
        names = {link["index"]: link.get_attr("IFLA_IFNAME") for link in ipr.get_links()}
        for msg in ipr.get_addr(family=socket.AF_INET):
            name = names.get(msg["index"])
            addr = msg.get_attr("IFA_LOCAL") or msg.get_attr("IFA_ADDRESS")
            if name in netdevs and addr:
                out[addr] = netdevs[name]
    return out
