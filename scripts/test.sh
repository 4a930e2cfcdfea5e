#!/usr/bin/env bash
# The whole test suite: unit, integration, kernel (network namespaces), end-to-end and
# Helm chart tests. Needs root: kernel tests create network namespaces and program
# iptables inside them only.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
    echo "the tests create network namespaces and need root: run as root (sudo $0)" >&2
    exit 1
fi

# Binaries that the integration and chart tests start as real processes.
cargo build --workspace --locked --bins
cargo test --workspace --locked --no-fail-fast

# Python tools for the chart tests live in a virtualenv under target/.
venv=target/pyenv
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
"$venv/bin/pip" install --quiet --disable-pip-version-check -r charts/tandem/tests/requirements.txt
PATH="$PWD/$venv/bin:$PATH" "$venv/bin/python" -m pytest -q charts/tandem/tests
