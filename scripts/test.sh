#!/usr/bin/env bash
# The whole test suite: unit, integration, kernel (network namespaces) and end-to-end tests.
# Needs root: kernel tests create network namespaces and program iptables inside them only.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
    echo "the tests create network namespaces and need root: run as root (sudo $0)" >&2
    exit 1
fi

# Binaries that the integration tests start as real processes (echo pods, servers).
cargo build --workspace --locked --bins
cargo test --workspace --locked --no-fail-fast
