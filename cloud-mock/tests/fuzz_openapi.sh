#!/usr/bin/env bash
# Fuzzes the cloud-mock API from its OpenAPI document with schemathesis and fails on any
# 5xx answer, a crashed server or a panic in its log.
#
#   bash cloud-mock/tests/fuzz_openapi.sh
#
# Needs python3 with venv (schemathesis==4.32.5 from PyPI is installed into
# $FUZZ_VENV, default /tmp/cloud-mock-fuzz-venv, unless `st` is on PATH or SCHEMATHESIS
# names it) and cargo (or CLOUD_MOCK_BIN naming a built binary).
# Bounds: FUZZ_MAX_EXAMPLES examples per operation and phase (default 20); the run is
# stopped, and fails, after FUZZ_MAX_TIME seconds (default 300). The server runs with --dataplane none: fuzzed backend
# addresses are never probed or contacted.
set -euo pipefail

crate_dir=$(cd "$(dirname "$0")/.." && pwd)
max_examples=${FUZZ_MAX_EXAMPLES:-20}
max_time=${FUZZ_MAX_TIME:-300}

bin=${CLOUD_MOCK_BIN:-}
if [[ -z $bin ]]; then
    (cd "$crate_dir" && cargo build -q -p cloud-mock --bin cloud-mock)
    target_dir=${CARGO_TARGET_DIR:-$(cd "$crate_dir" && cargo metadata --format-version 1 --no-deps |
        python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')}
    bin=$target_dir/debug/cloud-mock
fi

st=${SCHEMATHESIS:-$(command -v st || true)}
if [[ -z $st ]]; then
    venv=${FUZZ_VENV:-/tmp/cloud-mock-fuzz-venv}
    if [[ ! -x $venv/bin/st ]]; then
        python3 -m venv "$venv"
        "$venv/bin/pip" install -q "schemathesis==4.32.5"
    fi
    st=$venv/bin/st
fi

work_dir=$(mktemp -d -t cloud-mock-fuzz.XXXXXX)
log=$work_dir/server.log
token=fuzz-$$-$RANDOM
NO_COLOR=1 "$bin" --listen 127.0.0.1:0 --data-dir "$work_dir/data" --token "$token" \
    --vip-pool 127.77.240.0/24 --vip-pool 2001:db8:51:100::/64 --dataplane none --provisioning-delay 0ms --fault-injection >"$log" 2>&1 &
server_pid=$!
cleanup() {
    kill "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
    rm -rf "$work_dir"
}
trap cleanup EXIT

addr=
for _ in $(seq 300); do
    addr=$(sed -n 's/.*listening on \([0-9.]*:[0-9]*\).*/\1/p' "$log" | head -n 1)
    [[ -n $addr ]] && break
    if ! kill -0 "$server_pid" 2>/dev/null; then
        cat "$log" >&2
        echo "fuzz: cloud-mock exited before listening" >&2
        exit 1
    fi
    sleep 0.1
done
[[ -n $addr ]] || { cat "$log" >&2; echo "fuzz: cloud-mock did not listen within 30 s" >&2; exit 1; }
echo "fuzz: cloud-mock (pid $server_pid) on $addr; schemathesis $("$st" --version)"

# The admin faults endpoint is left out: injected 503s are the point of it. One worker:
# with two, the threads race in hypothesis's cache of parsed lambda sources (a KeyError,
# then CPython's "AST constructor recursion depth mismatch") as soon as an operation has
# both a path and a query parameter; one is no slower here.
status=0
timeout "$max_time" "$st" run "$crate_dir/openapi.yaml" \
    --url "http://$addr" \
    --header "Authorization: Bearer $token" \
    --checks not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance \
    --exclude-path /v1/admin/faults \
    --max-examples "$max_examples" \
    --request-timeout 10 \
    --workers 1 \
    --no-color \
    --suppress-health-check all \
    --generation-database none || status=$?

if ! kill -0 "$server_pid" 2>/dev/null; then
    cat "$log" >&2
    echo "fuzz: cloud-mock died during the run" >&2
    exit 1
fi
if grep -q "panicked" "$log"; then
    grep -B2 -A10 "panicked" "$log" >&2
    echo "fuzz: cloud-mock panicked" >&2
    exit 1
fi
if [[ $status -ne 0 ]]; then
    echo "fuzz: schemathesis found failures (exit $status)" >&2
    exit "$status"
fi
echo "fuzz: no 5xx, no crash, no panic"
