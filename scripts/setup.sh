#!/usr/bin/env bash
# Installs everything blockd, its tests and its benchmarks need on a Debian/Ubuntu machine
# (run as root), then makes .venv with Debian's python3 and --system-site-packages so that
# Debian's python3-pyverbs (matching the system rdma-core) is importable. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

# gcc (build-essential) and python3-dev compile the data plane (setup.py, Cython); without them
# pip still installs blockd, with a warning, and it runs its pure-Python data plane.
# libibverbs-dev: <infiniband/verbs.h> for the compiled RDMA data path (blockd/rdma/_fast_verbs.pyx);
# without it that one extension is skipped and RDMA runs its ctypes path.
# liburing-dev: <liburing.h> for FUSE over io_uring in the compiled FUSE loop (initiator/fuse/_loop.pyx)
# and for the target's NVMe/TCP queue threads on io_uring (target/_uring_loop.pyx).
APT_PACKAGES=(
  python3 python3-venv python3-dev python3-pyverbs build-essential libibverbs-dev liburing-dev
  rdma-core ibverbs-utils perftest librdmacm1
  fio nbdkit libnbd-bin nvme-cli fuse3
  qemu-system-x86 busybox-static cpio kmod iproute2
  systemd dmsetup
  e2fsprogs xfsprogs  # mkfs/fsck in tests; create-md's file-system checks are tested on both
  # the single-node Ceph test bed and the rbd backend (tests/ceph, docs/ceph.md)
  ceph-mon ceph-mgr ceph-osd ceph-common python3-rbd python3-rados
  rbd-nbd  # tests/bench/bench_rbd_vm.py (krbd is in ceph-common)
  python3-xxhash  # XXH3-128 of blockd's Digest command (protocol/digest.py: a verify's digests)
  libxxhash-dev  # the same in C, for target/_digest.pyx (a plain file's digests without the GIL)
)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import pyverbs' 2>/dev/null; then
  rm -rf .venv
  /usr/bin/python3 -m venv --system-site-packages .venv
fi
stamp=.venv/.blockd-installed
# setup.py and the .pyx sources: a changed compiled data plane is rebuilt (pip install -e builds
# the extensions in place).
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ] \
   || [ -n "$(find blockd target initiator -name '*.pyx' -newer "$stamp")" ] \
   || ! ls blockd/_*.so blockd/rdma/_*.so target/_*.so target/replication/_*.so initiator/_*.so initiator/fuse/_*.so >/dev/null 2>&1; then
  .venv/bin/pip install -q --disable-pip-version-check -e '.[test]'
  touch "$stamp"
fi
# pip -q hides the build's own warning: say it here when the compiled data plane did not build
if ! env -u BLOCKD_PURE .venv/bin/blockd --version | grep -q 'data plane: compiled'; then
  echo "setup: WARNING: the compiled data plane did not build (no C compiler or Python headers?);" \
       "blockd runs its pure-Python data plane" >&2
fi
if ! env -u BLOCKD_PURE .venv/bin/python -c 'import blockd.rdma._fast_verbs' 2>/dev/null; then
  echo "setup: WARNING: the compiled RDMA data path did not build (libibverbs-dev missing?);" \
       "RDMA runs its ctypes path (blockd/rdma/_fast.py)" >&2
fi
if ! env -u BLOCKD_PURE .venv/bin/python -c 'import target._digest' 2>/dev/null; then
  echo "setup: WARNING: the compiled digest loop did not build (libxxhash-dev missing?);" \
       "a verify's digests are read and hashed in Python (target/digest.py)" >&2
fi
