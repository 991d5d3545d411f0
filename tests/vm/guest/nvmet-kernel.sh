#!/bin/sh
# nvmet-kernel.sh -- the Linux kernel NVMe-oF target (nvmet) through configfs (guest only).
# Source it, then:
#
#   nvmet_subsys NQN [SERIAL] [MODEL]     subsystem, any host allowed
#   nvmet_ns_file NQN NSID FILE [BUF]     namespace backed by FILE, enabled; BUF = buffered_io
#                                         (default 1: tmpfs and the overlay reject O_DIRECT, -22)
#   nvmet_port ID TRTYPE ADDR SVCID       port; TRTYPE tcp|rdma|loop, ipv4
#   nvmet_link ID NQN                     expose NQN on port ID (the port starts listening)
#   nvmet_unlink ID NQN
#   nvmet_teardown                        remove every link, port, namespace and subsystem
#
# nvmet-tcp / nvmet-rdma load on demand when a port is linked.

NVMET_CFS=/sys/kernel/config/nvmet

nvmet_init() {
    [ -d "$NVMET_CFS" ] && return 0
    modprobe nvmet || return 1
    [ -d /sys/kernel/config/nvmet ] || mount -t configfs configfs /sys/kernel/config 2>/dev/null
    [ -d "$NVMET_CFS" ]
}

nvmet_subsys() {
    nvmet_init || return 1
    _s=$NVMET_CFS/subsystems/$1
    mkdir -p "$_s" || return 1
    echo 1 >"$_s/attr_allow_any_host" || return 1
    [ -z "${2:-}" ] || echo "$2" >"$_s/attr_serial" || return 1
    [ -z "${3:-}" ] || [ ! -e "$_s/attr_model" ] || echo "$3" >"$_s/attr_model" || return 1
}

nvmet_ns_file() {
    _n=$NVMET_CFS/subsystems/$1/namespaces/$2
    mkdir -p "$_n" || return 1
    printf %s "$3" >"$_n/device_path" &&
        echo "${4:-1}" >"$_n/buffered_io" &&
        echo 1 >"$_n/enable"
}

nvmet_port() {
    nvmet_init || return 1
    _p=$NVMET_CFS/ports/$1
    mkdir -p "$_p" || return 1
    echo "$2" >"$_p/addr_trtype" &&
        echo ipv4 >"$_p/addr_adrfam" &&
        echo "$3" >"$_p/addr_traddr" &&
        echo "$4" >"$_p/addr_trsvcid"
}

nvmet_link() {
    ln -s "$NVMET_CFS/subsystems/$2" "$NVMET_CFS/ports/$1/subsystems/$2"
}

nvmet_unlink() {
    rm -f "$NVMET_CFS/ports/$1/subsystems/$2"
}

nvmet_teardown() {
    [ -d "$NVMET_CFS" ] || return 0
    for _l in "$NVMET_CFS"/ports/*/subsystems/*; do [ -L "$_l" ] && rm -f "$_l"; done
    for _p in "$NVMET_CFS"/ports/*; do [ -d "$_p" ] && rmdir "$_p"; done
    for _s in "$NVMET_CFS"/subsystems/*; do
        [ -d "$_s" ] || continue
        for _n in "$_s"/namespaces/*; do
            [ -d "$_n" ] || continue
            echo 0 >"$_n/enable"
            rmdir "$_n"
        done
        rmdir "$_s"
    done
    return 0
}

# run as a script: nvmet-kernel.sh FUNCTION ARGS...
case "$0" in *nvmet-kernel.sh) [ $# -gt 0 ] && { "$@"; exit $?; } ;; esac
