#!/bin/sh
# nvme-host.sh -- the Linux kernel NVMe-oF host with nvme-cli (guest only).  Source it, then:
#
#   nvmeh_connect TRTYPE ADDR SVCID NQN [nvme-cli options]   connects, waits for the
#                       namespace block device and prints its path (/dev/nvmeXnY)
#   nvmeh_ctrl NQN      the controller name (nvmeX) connected to NQN
#   nvmeh_disconnect NQN
#
# Or run it: nvme-host.sh connect|disconnect ARGS...

nvmeh_ctrl() {
    for _c in /sys/class/nvme-fabrics/ctl/nvme*; do
        [ -e "$_c/subsysnqn" ] || continue
        [ "$(cat "$_c/subsysnqn")" = "$1" ] && { basename "$_c"; return 0; }
    done
    return 1
}

nvmeh_connect() {
    _t=$1 _a=$2 _s=$3 _q=$4
    shift 4
    # nvme-cli needs /dev/nvme-fabrics, i.e. the transport module loaded
    modprobe "nvme-$_t" || return 1
    nvme connect -t "$_t" -a "$_a" -s "$_s" -n "$_q" "$@" >&2 || return 1
    _i=0
    while [ $_i -lt 100 ]; do
        _c=$(nvmeh_ctrl "$_q") && for _b in /sys/class/nvme/"$_c"/nvme*n*; do
            # namespaces show up as nvmeXnY (or nvmeXcZnY under native multipath)
            [ -e "$_b" ] || continue
            _d=/dev/$(basename "$_b" | sed 's/c[0-9]*n/n/')
            [ -b "$_d" ] && { echo "$_d"; return 0; }
        done
        for _b in /sys/class/nvme-subsystem/*/nvme*n*; do
            [ -e "$_b" ] || continue
            [ "$(cat "$(dirname "$_b")/subsysnqn" 2>/dev/null)" = "$_q" ] || continue
            [ -b "/dev/$(basename "$_b")" ] && { echo "/dev/$(basename "$_b")"; return 0; }
        done
        sleep 0.1; _i=$((_i + 1))
    done
    echo "nvme-host: connected to $_q but no namespace block device appeared" >&2
    return 1
}

nvmeh_disconnect() {
    nvme disconnect -n "$1" >&2
}

case "$0" in
    *nvme-host.sh)
        _cmd=${1:-}; [ $# -gt 0 ] && shift
        case "$_cmd" in
            connect) nvmeh_connect "$@"; exit $? ;;
            disconnect) nvmeh_disconnect "$@"; exit $? ;;
            ctrl) nvmeh_ctrl "$@"; exit $? ;;
            *) echo "usage: nvme-host.sh connect TRTYPE ADDR SVCID NQN [opts] | disconnect NQN | ctrl NQN" >&2; exit 2 ;;
        esac ;;
esac
