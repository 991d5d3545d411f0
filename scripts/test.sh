#!/usr/bin/env bash
# Installs what the tests need (apt + .venv), then runs the whole suite: unit and protocol
# tests, NVMe/TCP over loopback, FUSE, and the VM bed (Linux kernel host/target, RDMA over
# Soft-RoCE). Extra arguments go to pytest (e.g. -m 'not vm', -k name); without any, the protocol,
# core and FUSE suites run a second time on the pure-Python data plane (BLOCKD_PURE=1).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/blockd --version
if [ "${CI:-}" = true ]; then
  # CI must test the compiled data plane: a build that silently fell back would test Python twice
  .venv/bin/blockd --version | grep -q 'data plane: compiled'
fi
status=0
.venv/bin/python -m pytest -ra "$@" || status=$?
if [ "$#" -eq 0 ]; then
  # The same suites once more on the Python twins of the compiled data plane (BLOCKD_PURE=1): the
  # reference and fallback must keep passing too. The quick suites only (a few minutes).
  echo "test.sh: protocol, core and FUSE suites again with BLOCKD_PURE=1" >&2
  BLOCKD_PURE=1 .venv/bin/python -m pytest -ra tests/protocol tests/core tests/fuse || status=$?
fi
exit "$status"
