#!/usr/bin/env bash
# The main job: a blockd target exporting a demo volume on loopback, the initiator daemon, and
# blockctl connecting, writing, reading back and verifying. Installs what it needs first.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
work=$(mktemp -d /tmp/blockd-demo.XXXXXX)
bin=.venv/bin
nqn=nqn.2026-11.io.blockd:demo
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

cat > "$work/target.toml" <<TOML
[[port]]
transport = "tcp"
address = "127.0.0.1"
port = 4420

[[port]]
transport = "tcp"
address = "127.0.0.1"
port = 8009

[[subsystem]]
nqn = "$nqn"
serial = "BLOCKDDEMO0001"
model = "blockd demo"
allow_any_host = true

[[subsystem.namespace]]
nsid = 1
path = "$work/demo.img"
size = "256MiB"
block_size = 512
TOML

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
step "starting blockd target (volume $work/demo.img, 256 MiB, tcp 127.0.0.1:4420 and discovery :8009)"
$bin/blockd target --config "$work/target.toml" 2> "$work/target.log" & pids+=($!)
step "starting the initiator daemon"
$bin/blockd initiator --socket "$work/initiator.sock" 2> "$work/initiator.log" & pids+=($!)
for _ in $(seq 100); do
  [ -S "$work/initiator.sock" ] && (exec 3<>/dev/tcp/127.0.0.1/4420) 2>/dev/null && break
  sleep 0.1
done
ctl() { echo "+ blockctl $*"; $bin/blockctl --socket "$work/initiator.sock" "$@"; }

step "discovery"
ctl discover -t tcp -a 127.0.0.1 -s 8009
step "connect"
ctl connect -t tcp -a 127.0.0.1 -s 4420 -n "$nqn" --name demo -i 2
ctl list
ctl id-ctrl demo | grep -E "^(sn|mn|cntlid|subnqn|ioccsz)"
step "write 64 MiB of random data at offset 1 MiB, read it back, compare"
head -c $((64 << 20)) /dev/urandom > "$work/pattern"
ctl write demo --nsid 1 --offset $((1 << 20)) -i "$work/pattern"
ctl read demo --nsid 1 --offset $((1 << 20)) --length $((64 << 20)) -o "$work/readback"
if cmp "$work/pattern" "$work/readback"; then
  echo "verified: the 64 MiB read back through NVMe/TCP equal what was written"
else
  echo "MISMATCH between written and read data" >&2; exit 1
fi
if cmp <(tail -c +$(( (1 << 20) + 1 )) "$work/demo.img" | head -c $((64 << 20))) "$work/pattern"; then
  echo "verified: the target's backing file holds the same bytes"
fi
step "disconnect"
ctl disconnect demo
echo; echo "demo finished OK (target log: last lines)"; tail -n 5 "$work/target.log"
