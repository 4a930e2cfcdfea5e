#!/usr/bin/env bash
# Runs a command beside a cloud edge it did not start itself: cloud-mock with HAProxy as its
# data plane, in a network namespace of its own, the command in the same namespace with
#   TANDEM_E2E_CLOUD_URL, TANDEM_E2E_CLOUD_TOKEN   the edge's API and its token
# set (what the controller's end-to-end suite reads to use a shared edge).
#
#   scripts/with-haproxy-edge.sh [--cloud-mock BIN] -- COMMAND [ARGS...]
#
# The edge serves the suite's pools (IPv4 and IPv6 `default`, IPv4 `v4only`) on its own
# loopback, and has an interface on the node network (198.18.0.0/24, 2001:db8:18::/64) so
# that passthrough routes to the test's nodes can be installed. Needs root; the namespace,
# the edge and its HAProxy are removed on exit, also when the command fails or is stopped.
set -euo pipefail
cd "$(dirname "$0")/.."

cloud_mock=target/debug/cloud-mock
while [ $# -gt 0 ]; do
    case $1 in
    --cloud-mock) cloud_mock=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "usage: $0 [--cloud-mock BIN] -- COMMAND [ARGS...]" >&2; exit 2 ;;
    esac
done
[ $# -gt 0 ] || { echo "$0: no command given" >&2; exit 2; }
[ -x "$cloud_mock" ] || { echo "$0: $cloud_mock is not built (cargo build -p cloud-mock)" >&2; exit 1; }
command -v haproxy >/dev/null || { echo "$0: haproxy is not installed (apt-get install haproxy)" >&2; exit 1; }

netns=tdm$$-edge
dir=$(mktemp -d "${TMPDIR:-/tmp}/tandem-edge.XXXXXX")
edge_pid=""
cleanup() {
    if [ -n "$edge_pid" ]; then
        kill -TERM "$edge_pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$edge_pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$edge_pid" 2>/dev/null || true
    fi
    # Whatever the edge left running in its namespace (its HAProxy) goes with it.
    if ip netns list | grep -qw "$netns"; then
        for pid in $(ip netns pids "$netns"); do kill -KILL "$pid" 2>/dev/null || true; done
        ip netns del "$netns"
    fi
    rm -rf "$dir"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

ip netns add "$netns"
in_edge() { nsenter --net="/run/netns/$netns" -- "$@"; }
in_edge ip link set lo up
# Both ends inside: the node network is on-link, nothing leaves the namespace.
in_edge ip link add edge0 type veth peer name edge1
in_edge ip addr add 198.18.0.1/24 dev edge0
in_edge ip addr add 2001:db8:18::1/64 dev edge0 nodad
in_edge ip link set edge0 up
in_edge ip link set edge1 up

port=8780
token=edge-token-$$
in_edge "$cloud_mock" --listen "127.0.0.1:$port" --data-dir "$dir/data" --token "$token" \
    --vip-pool 198.51.100.0/24 --vip-pool 2001:db8:51:100::/64 --vip-pool v4only=203.0.113.0/24 \
    --dataplane haproxy --manage-vip-addresses --vip-device lo --provisioning-delay 300ms \
    >"$dir/edge.log" 2>&1 &
edge_pid=$!

url=http://127.0.0.1:$port
for _ in $(seq 100); do
    if in_edge curl -fsS -o /dev/null -H "Authorization: Bearer $token" "$url/v1/pools"; then
        break
    fi
    if ! kill -0 "$edge_pid" 2>/dev/null; then
        echo "$0: the edge exited:" >&2
        cat "$dir/edge.log" >&2
        exit 1
    fi
    sleep 0.1
done
echo "=== HAProxy edge at $url in namespace $netns"

status=0
in_edge env TANDEM_E2E_CLOUD_URL="$url" TANDEM_E2E_CLOUD_TOKEN="$token" "$@" || status=$?
if [ "$status" -ne 0 ]; then
    echo "=== the edge's log (last 100 lines)"
    tail -n 100 "$dir/edge.log"
fi
exit "$status"
