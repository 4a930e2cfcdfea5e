#!/usr/bin/env bash
# Checks the images scripts/images.sh built: each within its size budget, with its OCI
# labels, its binary starting inside it (as the image's user, read-only root, no
# capabilities), the non-root user where that applies, CA certificates, the node
# proxy's tools working in an empty network namespace, and the mock cloud's HAProxy:
# `haproxy -v`, `haproxy -c` of a small configuration, and a load balancer served by
# HAProxy in master-worker mode (and reloaded) in a network namespace made here. Needs
# podman (and runc), and ip and curl for the last check.
# Prints "N passed, N failed" and exits non-zero on any failure or missing image.
set -uo pipefail
cd "$(dirname "$0")/.."

MIB=$((1024 * 1024))
# cloud-mock's: 30 MiB, plus the 16 MiB that Debian's HAProxy and its libraries add.
declare -A BUDGET=([tandem-controller]=$((30 * MIB)) [cloud-mock]=$((46 * MIB)) [tandem-nodeproxy]=$((100 * MIB)))
NONROOT=(tandem-controller cloud-mock)
NODEPROXY_TOOLS="iptables-nft iptables-nft-save iptables-nft-restore iptables-legacy
iptables-legacy-save iptables-legacy-restore ip6tables-nft ip6tables-nft-save
ip6tables-nft-restore ip6tables-legacy ip6tables-legacy-save ip6tables-legacy-restore
conntrack nft"
# Every container, network namespace and file of this run has this prefix, so the trap
# removes exactly these.
RUN=tandem-image-test-$$
WORK=$(mktemp -d "/tmp/$RUN.XXXX")
cleanup() {
    podman ps -aq --filter "name=^$RUN-" | xargs -r podman rm -f >/dev/null 2>&1
    ip netns list 2>/dev/null | awk -v p="$RUN-" 'index($1, p) == 1 { print $1 }' |
        xargs -r -n1 ip netns delete 2>/dev/null
    rm -rf "$WORK"
}
trap cleanup EXIT

passed=0
failed=0
check() {
    local what=$1
    shift
    if out=$("$@" 2>&1); then
        passed=$((passed + 1))
        echo "ok   $what"
    else
        failed=$((failed + 1))
        echo "FAIL $what"
        printf '%s\n' "$out" | tail -n 5 | sed 's/^/     /'
    fi
}

run() { # image, podman run options..., -- , args...
    local image=$1
    shift
    local opts=()
    while [ "$1" != -- ]; do opts+=("$1"); shift; done
    shift
    podman run --rm --runtime runc --name "$RUN-$RANDOM$RANDOM" --network none --read-only \
        --cap-drop ALL "${opts[@]}" "$image" "$@"
}

mapfile -t refs < <(scripts/images.sh --print-names)
version=${refs[0]##*:}

within_budget() { [ "$(podman image inspect --format '{{.Size}}' "$1")" -le "$2" ]; }

has_labels() {
    local key value
    for key in source version revision licenses; do
        value=$(podman image inspect --format "{{index .Labels \"org.opencontainers.image.$key\"}}" "$1")
        [ -n "$value" ] && [ "$value" != "<no value>" ] || { echo "label $key missing"; return 1; }
    done
    [ "$(podman image inspect --format '{{index .Labels "org.opencontainers.image.version"}}' "$1")" = "$version" ]
}

prints_version() { run "$1" -- --version | grep -F "$version"; }

runs_as_nonroot() {
    local user
    user=$(podman image inspect --format '{{.Config.User}}' "$1")
    echo "user $user"
    [ -n "$user" ] && [ "${user%%:*}" != 0 ] && [ "${user%%:*}" != root ]
}

has_ca_certificates() {
    local container out
    container=$(podman create --name "$RUN-ca-$RANDOM" "$1") || return 1
    out=$(podman cp "$container:/etc/ssl/certs/ca-certificates.crt" - | tar -xO | grep -c 'BEGIN CERTIFICATE')
    podman rm -f "$container" >/dev/null
    echo "$out certificates"
    [ "$out" -gt 100 ]
}

# Every front end the node proxy (or a person debugging) runs, started in the image. The
# image has no shell: each runs as the entrypoint.
has_tools() {
    local tool
    for tool in $NODEPROXY_TOOLS; do
        run "$1" --entrypoint "/usr/sbin/$tool" -- --version || { echo "$tool does not run"; return 1; }
    done
}

# The node proxy's own rules, installed and removed with iptables-nft-restore in the
# container's empty network namespace: the front end, its modules and the lock all work.
cleans_up_with_nft() {
    run "$1" --cap-add NET_ADMIN,NET_RAW -- --cleanup --iptables-backend nft
}

ip_runs() { run "$1" --entrypoint /usr/sbin/ip -- -brief address; }

# What Maglev steering (nft) and the L2 mode (arping, sysctl) run, each with its libraries.
steering_and_l2_tools_run() {
    run "$1" --entrypoint /usr/sbin/nft -- --version || { echo "nft does not run"; return 1; }
    run "$1" --entrypoint /usr/sbin/arping -- --help 2>&1 | grep '^ARPing 2\.' ||
        { echo "arping does not run"; return 1; }
    run "$1" --entrypoint /usr/sbin/sysctl -- -n net.ipv4.conf.lo.arp_ignore ||
        { echo "sysctl does not run"; return 1; }
}

# Debian's HAProxy (what --dataplane haproxy runs) starts in the scratch image, as its user.
haproxy_version() { run "$1" --entrypoint /usr/sbin/haproxy -- -v | grep -E '^HAProxy version 2\.'; }

# A small configuration of the kind the edge renders (a TCP listen section with a checked
# server, the runtime socket) is accepted by `haproxy -c`, as the image's user.
haproxy_checks_config() {
    cat >"$WORK/haproxy.cfg" <<'CFG'
global
    stats socket /var/lib/cloud-mock/haproxy/runtime.sock mode 600 level admin
defaults
    mode tcp
    timeout connect 3s
    timeout client 1h
    timeout server 1h
listen lb-1_80_v4
    bind 198.51.100.10:80
    tcp-request connection reject unless { src 203.0.113.0/24 }
    server 192.0.2.11 192.0.2.11:30080 check inter 1000 rise 2 fall 2
CFG
    chmod 644 "$WORK/haproxy.cfg"
    run "$1" -v "$WORK/haproxy.cfg:/etc/tandem-test/haproxy.cfg:ro" --entrypoint /usr/sbin/haproxy \
        -- -c -f /etc/tandem-test/haproxy.cfg
}

# The mock cloud with --dataplane haproxy in its image, as its user on a read-only root
# with no capabilities and a writable data directory: HAProxy starts in master-worker
# mode, serves a proxy-mode load balancer on a loopback VIP (to the edge's own API as the
# backend), and a second load balancer reloads it (the master re-executes itself) with
# both answering. Everything stays in a network namespace of this run.
api() { # namespace, method, path, body...
    ip netns exec "$1" curl -sS -m 5 -X "$2" -H 'Authorization: Bearer image-test' \
        -H 'Content-Type: application/json' "http://127.0.0.1:8780$3" ${4:+-d "$4"}
}
answers() { # namespace, VIP:port: GET /healthz through HAProxy, retried for 10 s
    local i
    for i in $(seq 50); do
        ip netns exec "$1" curl -sf -m 2 "http://$2/healthz" && return 0
        sleep 0.2
    done
    echo "no answer on $2"
    return 1
}
serves_through_haproxy() {
    local ns=$RUN-haproxy name=$RUN-haproxy-edge port answer vip served=()
    ip netns add "$ns" && ip -n "$ns" link set lo up || return 1
    podman run -d --runtime runc --name "$name" --network "ns:/run/netns/$ns" --read-only \
        --cap-drop ALL --tmpfs /var/lib/cloud-mock:rw,mode=1777 "$1" \
        --listen 127.0.0.1:8780 --data-dir /var/lib/cloud-mock --token image-test \
        --vip-pool 127.77.0.0/24 --dataplane haproxy --provisioning-delay 0s \
        --health-interval 200ms >/dev/null || return 1
    for port in 8081 8082; do
        answer=$(api "$ns" POST /v1/loadbalancers "{\"name\": \"lb-$port\", \"mode\": \"proxy\",
            \"listeners\": [{\"protocol\": \"TCP\", \"port\": $port, \"backendPort\": 8780}],
            \"backends\": [{\"ip\": \"127.0.0.1\"}]}") || { echo "$answer"; return 1; }
        vip=$(printf '%s' "$answer" | grep -o '"vip":"[^"]*"' | cut -d'"' -f4)
        [ -n "$vip" ] || { echo "no VIP in $answer"; return 1; }
        answers "$ns" "$vip:$port" || { podman logs "$name" 2>&1 | tail -n 20; return 1; }
        served+=("$vip:$port")
    done
    # Each new listener was a new frontend, so HAProxy reloaded: the first LB still answers.
    for vip in "${served[@]}"; do answers "$ns" "$vip" || return 1; done
    podman logs "$name" 2>&1 | grep 'HAProxy reloaded'
}

# What the image holds must not be a shell or a package manager: only what runs.
has_no_shell() { ! run "$1" --entrypoint /bin/sh -- -c true; }

for ref in "${refs[@]}"; do
    name=${ref##*/}
    name=${name%%:*}
    if ! podman image exists "$ref"; then
        failed=$((failed + 1))
        echo "FAIL $ref is missing: run scripts/images.sh first"
        continue
    fi
    size=$(podman image inspect --format '{{.Size}}' "$ref")
    awk -v r="$ref" -v s="$size" -v b="${BUDGET[$name]}" \
        'BEGIN { printf "size %s: %.1f MiB (budget %d MiB)\n", r, s / 1048576, b / 1048576 }'
    check "$name: size within budget" within_budget "$ref" "${BUDGET[$name]}"
    check "$name: OCI labels (source, version, revision, licenses)" has_labels "$ref"
    check "$name: --version in the image" prints_version "$ref"
    check "$name: --help in the image" run "$ref" -- --help
    check "$name: CA certificates" has_ca_certificates "$ref"
    if [[ " ${NONROOT[*]} " == *" $name "* ]]; then
        check "$name: runs as a non-root user" runs_as_nonroot "$ref"
    fi
    check "$name: no shell in the image" has_no_shell "$ref"
    case $name in
    tandem-nodeproxy)
        check "$name: iptables (nft, legacy), nft, conntrack" has_tools "$ref"
        check "$name: --cleanup programs nf_tables in the image" cleans_up_with_nft "$ref"
        ;;
    cloud-mock)
        check "$name: ip runs in the scratch image" ip_runs "$ref"
        check "$name: nft, arping and sysctl run in the scratch image" steering_and_l2_tools_run "$ref"
        check "$name: haproxy -v runs in the scratch image" haproxy_version "$ref"
        check "$name: haproxy -c accepts a configuration as the image's user" haproxy_checks_config "$ref"
        check "$name: --dataplane haproxy serves and reloads as the image's user" serves_through_haproxy "$ref"
        ;;
    esac
done

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
