#!/bin/sh
# rxe-up.sh -- two Soft-RoCE devices on the two ends of a veth pair (guest only).
# Source it (`. "$BLOCKD_VM_GUEST/rxe-up.sh"`) or run it; safe to run twice.
#
#   veth0 192.0.2.1/24 <- rxe0    target side     (RXE_NETDEV0, RXE_ADDR0, RXE_DEV0)
#   veth1 192.0.2.2/24 <- rxe1    initiator side  (RXE_NETDEV1, RXE_ADDR1, RXE_DEV1)
#
# RXE_MODE=pair (default) adds policy routing so that traffic between the two
# addresses really crosses the veth pair: without it Linux routes .1 <-> .2 through
# "lo", rxe drops what arrives there, and rdma_cm puts both ends on rxe0.  A client
# connecting to 192.0.2.1 (rdma_cm, TCP, nvme connect) then runs on rxe1/veth1.
# RXE_MODE=loop skips the routing.  RXE_MTU: veth MTU (1500 -> RoCE MTU 1024).
# rxe in this kernel only works in the initial network namespace: no netns here.
# RXE_TOOL=rdma (default) creates the links with iproute2's `rdma link add`;
# RXE_TOOL=blockd with blockd's own pyroute2 code (`blockctl rxe add`, here run as
# `python -m blockd.rdma.rxe add NETDEV --name NAME` from the repo's .venv).

RXE_MODE=${RXE_MODE:-pair}
RXE_MTU=${RXE_MTU:-1500}
RXE_ADDR0=${RXE_ADDR0:-192.0.2.1}
RXE_ADDR1=${RXE_ADDR1:-192.0.2.2}
RXE_NETDEV0=${RXE_NETDEV0:-veth0}
RXE_NETDEV1=${RXE_NETDEV1:-veth1}
RXE_DEV0=${RXE_DEV0:-rxe0}
RXE_DEV1=${RXE_DEV1:-rxe1}
RXE_TOOL=${RXE_TOOL:-rdma}
export RXE_TOOL
export RXE_MODE RXE_MTU RXE_ADDR0 RXE_ADDR1 RXE_NETDEV0 RXE_NETDEV1 RXE_DEV0 RXE_DEV1

_rxe_add() {  # NAME NETDEV
    if [ "$RXE_TOOL" = blockd ]; then
        _py=${BLOCKD_VM_REPO:-.}/.venv/bin/python
        [ -x "$_py" ] || _py=python3
        "$_py" -m blockd.rdma.rxe add "$2" --name "$1"
    else
        rdma link add "$1" type rxe netdev "$2"
    fi
}

_rxe_up() {
    # crc32_generic first: rxe's ICRC needs it, else `rdma link add` says ENOENT
    for _m in crc32_generic veth rdma_rxe ib_uverbs rdma_ucm rdma_cm; do
        modprobe "$_m" || { echo "rxe-up: modprobe $_m failed" >&2; return 1; }
    done
    ip link set lo up
    if ! ip link show "$RXE_NETDEV0" >/dev/null 2>&1; then
        ip link add "$RXE_NETDEV0" type veth peer name "$RXE_NETDEV1" || return 1
        ip addr add "$RXE_ADDR0/24" dev "$RXE_NETDEV0" || return 1
        ip addr add "$RXE_ADDR1/24" dev "$RXE_NETDEV1" || return 1
    fi
    ip link set "$RXE_NETDEV0" mtu "$RXE_MTU" up || return 1
    ip link set "$RXE_NETDEV1" mtu "$RXE_MTU" up || return 1
    # RPS on both ends: a veth delivers into the backlog of the CPU that sent, and rxe sends one
    # QP's packets from whichever CPU runs its task (a user QP's post_send inline, a tasklet on
    # the other vCPU), so without one CPU per flow the two backlogs reorder a QP's packets, every
    # reordering costs a retry and a reordered READ response a retransmit timeout: the 128 KiB
    # write stall (docs/rdma-read-pacing.md, "Reordering on the veth pair")
    _rps=$(printf '%x' $(( (1 << $(nproc)) - 1 )))
    for _d in "$RXE_NETDEV0" "$RXE_NETDEV1"; do
        echo "$_rps" > "/sys/class/net/$_d/queues/rx-0/rps_cpus" || return 1
    done

    if [ "$RXE_MODE" = pair ]; then
        for _k in all default "$RXE_NETDEV0" "$RXE_NETDEV1"; do
            sysctl -qw "net.ipv4.conf.$_k.rp_filter=0" "net.ipv4.conf.$_k.accept_local=1"
        done
        # consult the "local" table only after our rules
        if ip rule show | grep -q '^0:.*lookup local'; then
            ip rule add pref 100 lookup local
            ip rule del pref 0 lookup local
        fi
        if ! ip rule show | grep -q 'lookup 4791'; then
            ip route add "$RXE_ADDR1" dev "$RXE_NETDEV0" src "$RXE_ADDR0" table 4791
            ip route add "$RXE_ADDR0" dev "$RXE_NETDEV1" src "$RXE_ADDR1" table 4792
            ip rule add pref 10 iif lo to "$RXE_ADDR1" lookup 4791
            ip rule add pref 11 iif lo to "$RXE_ADDR0" lookup 4792
        fi
    fi

    rdma link show "$RXE_DEV0/1" >/dev/null 2>&1 ||
        _rxe_add "$RXE_DEV0" "$RXE_NETDEV0" || return 1
    rdma link show "$RXE_DEV1/1" >/dev/null 2>&1 ||
        _rxe_add "$RXE_DEV1" "$RXE_NETDEV1" || return 1
    _i=0
    while [ $_i -lt 20 ]; do
        [ "$(rdma link show | grep -c 'state ACTIVE')" -ge 2 ] && return 0
        sleep 0.5; _i=$((_i + 1))
    done
    echo "rxe-up: rxe ports did not become ACTIVE" >&2
    rdma link show >&2
    return 1
}

_rxe_up
_rxe_rc=$?
case "$0" in *rxe-up.sh) exit $_rxe_rc ;; esac
[ $_rxe_rc = 0 ]
