#!/usr/bin/env bash
# Installs what the tests need (apt + .venv), then runs the whole suite: unit and protocol
# tests, NVMe/TCP over loopback, FUSE, and the VM bed (Linux kernel host/target, RDMA over
# Soft-RoCE). Extra arguments go to pytest (e.g. -m 'not vm', -k name).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/python -m pytest -ra "$@"
