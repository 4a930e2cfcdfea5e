#!/usr/bin/env bash
# Checks the images scripts/images.sh built: each within its size budget, with its OCI
# labels, its binary starting inside it (as the image's user, read-only root, no
# capabilities), the non-root user where that applies, CA certificates, and the node
# proxy's tools working in an empty network namespace. Needs podman (and runc).
# Prints "N passed, N failed" and exits non-zero on any failure or missing image.
set -uo pipefail
cd "$(dirname "$0")/.."

MIB=$((1024 * 1024))
declare -A BUDGET=([tandem-controller]=$((30 * MIB)) [cloud-mock]=$((30 * MIB)) [tandem-nodeproxy]=$((100 * MIB)))
NONROOT=(tandem-controller cloud-mock)
NODEPROXY_TOOLS="iptables-nft iptables-nft-save iptables-nft-restore iptables-legacy
iptables-legacy-save iptables-legacy-restore ip6tables-nft ip6tables-nft-save
ip6tables-nft-restore ip6tables-legacy ip6tables-legacy-save ip6tables-legacy-restore
conntrack nft"
# Every container of this run has this prefix, so the trap removes exactly these.
RUN=tandem-image-test-$$
trap 'podman ps -aq --filter "name=^$RUN-" | xargs -r podman rm -f >/dev/null 2>&1' EXIT

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
        ;;
    esac
done

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
