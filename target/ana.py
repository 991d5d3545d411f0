"""Asymmetric Namespace Access: the state of each ANA group on each port, and the ANA log page.

As nvmet keeps it (``ports/<port>/ana_groups/<group>/ana_state`` in its configfs): the state
is per port and group, every namespace belongs to one group (``ana_grpid``, group 1 unless
configured), group 1 exists from the start and every group is optimized until told otherwise,
so a configuration without ANA settings reports one optimized group. A host reaching the
subsystem through two targets (or two ports) sees each path's state in the log page it reads
over that path, and sends its I/O where the state says.
"""

from __future__ import annotations

from typing import Iterable

from protocol.constants import AnaState
from protocol.logpage import ANA_GROUP, ANA_HEADER
from protocol.status import Status

MAX_ANA_GROUPS = 128
"""ANAGRPMAX and NANAGRPID (nvmet's NVMET_MAX_ANAGRPS); group ids are 1..this."""
DEFAULT_ANA_GROUP = 1
STANDBY_ANA_GROUP = MAX_ANA_GROUPS
"""The group of every standby subsystem's namespace (a failover pair's replication path,
target.replication.standby): never set, so optimized on every port whatever the host-facing
groups' states; its namespace serves I/O by the copy's role instead. A group of its own rather
than an exemption from ANA: the ANA check stays one rule for every namespace."""
ANATT_SECONDS = 10
"""ANA Transition Time (nvmet's value): the Linux host resets a controller whose group stays in
``change`` for twice this long."""
MAX_ANA_NAMESPACES = 1024
"""The MNAN reported at most: the Linux host sizes its ANA log buffer from MNAN and ANAGRPMAX, and
refuses ANA when that buffer exceeds MDTS, so MNAN stays at nvmet's figure."""

IO_STATUS: dict[int, int] = {
    AnaState.INACCESSIBLE: Status.ANA_INACCESSIBLE,
    AnaState.PERSISTENT_LOSS: Status.ANA_PERSISTENT_LOSS,
    AnaState.CHANGE: Status.ANA_TRANSITION,
}
"""What an I/O command gets on a path in that state (nvmet's ``nvmet_check_ana_state``);
optimized and non-optimized paths serve I/O."""


class AnaStates:
    """The state of every (port, group) and the change count the log page reports."""

    def __init__(self) -> None:
        self._states: dict[tuple[int, int], AnaState] = {}
        self.groups: set[int] = {DEFAULT_ANA_GROUP}
        """Groups reported in the log page (those configured or set, and group 1)."""
        self.chgcnt = 0
        """Bumped on every change (the log header's and each descriptor's CHGCNT, as nvmet)."""

    def state(self, port_id: int, group: int) -> AnaState:
        return self._states.get((port_id, group), AnaState.OPTIMIZED)

    def io_status(self, port_id: int, group: int) -> int:
        """The status I/O to ``group`` gets through ``port_id``; 0 when it is served."""
        return IO_STATUS.get(self.state(port_id, group), 0)

    def set(self, port_id: int, group: int, state: AnaState) -> bool:
        """Set one state; True when it changed (the caller then tells the hosts)."""
        if not 1 <= group <= MAX_ANA_GROUPS:
            raise ValueError(f"ANA group {group} is out of range 1..{MAX_ANA_GROUPS}")
        self.groups.add(group)
        if self.state(port_id, group) == state:
            return False
        self._states[port_id, group] = AnaState(state)
        self.chgcnt += 1
        return True

    def namespace_moved(self) -> None:
        """A namespace changed group: the log page changed, so its change count goes up (as
        nvmet's ``ana_grpid`` store bumps ``nvmet_ana_chgcnt``)."""
        self.chgcnt += 1

    def log_page(self, port_id: int, namespaces: Iterable[tuple[int, int]], groups_only: bool) -> bytes:
        """The ANA log page seen through ``port_id``, for a subsystem whose namespaces are
        (nsid, group) pairs: a descriptor per known group, in group order, each listing its
        namespaces unless ``groups_only`` (LSP RGO)."""
        members: dict[int, list[int]] = {g: [] for g in self.groups}
        for nsid, group in namespaces:
            members.setdefault(group, []).append(nsid)
        descriptors = []
        for group in sorted(members):
            nsids = [] if groups_only else sorted(members[group])
            descriptors.append(ANA_GROUP.build(dict(grpid=group, nnsids=len(nsids), chgcnt=self.chgcnt,
                                                    state=self.state(port_id, group), nsids=nsids)))
        return ANA_HEADER.build(dict(chgcnt=self.chgcnt, ngrps=len(descriptors))) + b"".join(descriptors)
