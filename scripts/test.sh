#!/usr/bin/env bash
# The whole test suite: unit, integration, kernel (network namespaces), end-to-end, API
# fuzzing, Helm chart tests and the container images (podman, runc, mmdebstrap: .ci/run
# installs them). Needs root: kernel tests create network namespaces and
# program iptables inside them only.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
    echo "the tests create network namespaces and need root: run as root (sudo $0)" >&2
    exit 1
fi

# Every program the steps below run, with the Debian package that brings it: the missing
# ones are named before the first step, not one by one as steps fail. `.ci/run` installs
# the packages (kubectl aside: any release a user has).
missing=()
for need in cc:gcc kubectl:kubectl iptables:iptables ip6tables:iptables nft:nftables \
    conntrack:conntrack ip:iproute2 podman:podman runc:runc \
    mmdebstrap:mmdebstrap promtool:prometheus haproxy:haproxy curl:curl etcd:etcd-server \
    protoc:protobuf-compiler bird:bird2 birdc:bird2 arping:arping; do
    command -v "${need%%:*}" >/dev/null || missing+=("${need%%:*} (${need#*:})")
done
python3 -c 'import ensurepip, venv' 2>/dev/null || missing+=("python3 -m venv (python3-venv)")
if [ ${#missing[@]} -ne 0 ]; then
    echo "scripts/test.sh cannot find what it runs: ${missing[*]}. Install them (bash .ci/run does)." >&2
    exit 1
fi

# Errors without the library backtraces anyhow would capture under RUST_BACKTRACE (CI sets
# it): those pushed a failure's own message out of the tail that CI keeps. Panics still
# print theirs.
export RUST_LIB_BACKTRACE=0

# Each step's output is kept, and the lines that say why a failed step failed are printed
# again at the very end, where a truncated log still shows them.
step_logs=target/test-steps
rm -rf "$step_logs" && mkdir -p "$step_logs"
failed=()
steps=0
step() {
    local name=$1 start=$SECONDS log
    shift
    steps=$((steps + 1))
    log="$step_logs/$steps.log"
    echo "=== $name"
    # Not a pipe: the step runs in this shell (build_images waits for its child).
    if ! "$@" > >(tee "$log") 2>&1; then
        failed+=("$name|$log")
    fi
    echo "=== $name: $((SECONDS - start)) s"
}

# Binaries that the integration and chart tests start as real processes.
build_start=$SECONDS
cargo build --workspace --locked --bins
echo "=== build: $((SECONDS - build_start)) s"

# The container images (their static release binaries included) build in the background
# while the tests below run, at the lowest CPU priority: they take only the CPU the tests
# leave idle, and the tests mostly wait on packets, processes and timers. The image steps
# further down wait for it. A process group of its own, so an interrupted run stops it.
images_log=target/images-build.log
images_pid=""
stop_images_build() {
    if [ -n "$images_pid" ] && kill -0 "$images_pid" 2>/dev/null; then
        kill -TERM -- "-$images_pid" 2>/dev/null || true
    fi
}
trap stop_images_build EXIT
# A session of its own is a scheduling group of its own (autogroup), whose weight nice
# leaves alone: the build lowers its group's from inside it, once setsid made the group,
# or it takes half the CPU from the tests.
setsid bash -c 'echo 19 >/proc/self/autogroup 2>/dev/null; exec nice -n 19 bash scripts/images.sh --offline' \
    >"$images_log" 2>&1 &
images_pid=$!

step "cargo tests" cargo test --workspace --locked --no-fail-fast

# No two files of a crate import each other in a circle (issue 45).
step "no circles of files" python3 scripts/file-circles.py

# The end-to-end data-path tests again with the node proxies in nftables mode (the run
# above used the default, iptables): both LB modes, the source-range drop, a pod taking the
# LB IP short-cut, externalTrafficPolicy Local, node failure, scaling, and dual-stack and
# IPv6 Services on a dual-stack lab (ip tandem and ip6 tandem), and an IPv6-only lab. With
# a k3s the whole suite runs in nftables mode in the real-cluster steps below, on a
# dual-stack server, so only the IPv6-only lab runs here.
nftables_on_stand_in=(an_ipv6_only)
if [ -z "${TANDEM_K3S:-}" ]; then
    nftables_on_stand_in+=(proxy_mode_spreads passthrough_mode_takes passthrough_serves \
        a_pod_reaching_the_lb_ip external_traffic_policy_local a_failed_node_is_taken_out \
        scaling_pods_changes services_sharing_a_vip dual_stack_and_ipv6)
fi
step "lab end to end, nftables mode" env TANDEM_E2E_PROXY_MODE=nftables \
    cargo test -p tandem-lab --locked --test e2e -- "${nftables_on_stand_in[@]}"

# The proxy LB mode through a real HAProxy at the cloud edge (cloud-mock --dataplane
# haproxy; the runs above used the edge's own listeners), with the node proxies in each
# mode: spread over nodes and pods, the source-range refusal at the edge,
# externalTrafficPolicy Local draining the nodes without a pod (HAProxy's checks), a failed
# node taken out, scaling, shared VIPs and dual-stack VIPs, a UDP port refused in proxy
# mode with a condition and an Event naming it, and a node leaving and joining the node
# pool under traffic (HAProxy's runtime API, no reload). With a k3s these run in the
# real-cluster steps below (the whole suite through HAProxy, on the real API server);
# without one, here on the stand-in.
if [ -z "${TANDEM_K3S:-}" ]; then
    for mode in iptables nftables; do
        step "lab end to end, HAProxy edge, $mode mode" env TANDEM_E2E_EDGE_DATAPLANE=haproxy \
            TANDEM_E2E_PROXY_MODE=$mode cargo test -p tandem-lab --locked --test e2e -- \
            proxy_mode external_traffic_policy_local a_failed_node_is_taken_out \
            scaling_pods_changes services_sharing_a_vip dual_stack_and_ipv6 \
            an_edge_that_proxies a_node_leaving_and_joining_the_node_pool
    done
fi

# The day-2 scenarios again in nftables mode (the run above used iptables): restarts, a
# mode switch, the controller's leader killed, the API server gone for a minute, rules
# flushed and drifted, each under traffic through both LB modes.
step "lab day-2 scenarios, nftables mode" env TANDEM_E2E_PROXY_MODE=nftables \
    cargo test -p tandem-lab --locked --test day2

# The edge cluster again (three edges behind a BIRD router, a 3-member etcd), with the node
# proxies in nftables mode and HAProxy on every edge (the run above used iptables and the
# edges' own listeners): an edge killed, its cable cut, cut off from etcd, the etcd leader
# killed, every edge rolled and all restarted, under traffic through both LB modes; and
# the L2 mode's owner lost and cut off.
step "lab edge cluster, nftables mode, HAProxy edges" env TANDEM_E2E_PROXY_MODE=nftables \
    TANDEM_E2E_EDGE_DATAPLANE=haproxy cargo test -p tandem-lab --locked --test edge_cluster

# The mock cloud's API fuzzed from its OpenAPI document (schemathesis in its own venv).
step "cloud-mock API fuzz" env CLOUD_MOCK_BIN="$PWD/target/debug/cloud-mock" \
    FUZZ_VENV="$PWD/target/pyenv-fuzz" bash cloud-mock/tests/fuzz_openapi.sh

# A virtualenv under target/ with a requirements file installed.
venv_with() {
    local venv=$1 requirements=$2
    # A venv that was moved (its scripts name the old path) is made anew.
    "$venv/bin/pip" --version >/dev/null 2>&1 || python3 -m venv --clear "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$requirements"
}

chart_tests() {
    # checkov's pins clash with pytest's, so it gets a virtualenv of its own.
    venv_with target/pyenv charts/tandem/tests/requirements.txt &&
        venv_with target/pyenv-checkov charts/tandem/tests/requirements-checkov.txt &&
        PATH="$PWD/target/pyenv/bin:$PWD/target/pyenv-checkov/bin:$PATH" \
            target/pyenv/bin/python -m pytest -q charts/tandem/tests
}
step "Helm chart tests" chart_tests

# Container images: built offline in the background since the tests began (on an
# mmdebstrap base: no base image can be pulled here), each checked (size budget, labels, binary starts as its user, tools), then the
# end-to-end LB tests with the mock cloud, the controller and every node proxy running as
# containers in the lab's namespaces. A missing image fails these steps.
image_registry() {
    local ref
    ref=$(scripts/images.sh --print-names | head -1)
    echo "${ref%/*}"
}
build_images() {
    local status=0
    wait "$images_pid" || status=$?
    cat "$images_log"
    return "$status"
}
step "container images: build" build_images
step "container images: checks" bash images/test.sh
step "container images: lab end to end" env TANDEM_E2E_IMAGES="$(image_registry)" \
    cargo test -p tandem-lab --locked --test e2e -- \
    proxy_mode_spreads passthrough_mode_takes a_pod_reaching_the_lb_ip

# A real Kubernetes: TANDEM_K3S names a k3s binary (CI's .ci/run unpacks v1.21.2, the
# oldest release Tandem supports; any newer release works the same). Against a real
# control plane in a network namespace: the controller and lab end-to-end tests, both
# proxy modes. On a real node (kubelet, containerd, runc pods): the chart's images built
# above, installed by Helm, traffic, upgrade and uninstall; then a cluster of three real
# nodes. Without TANDEM_K3S these steps
# say they are skipped and pass nothing.
if [ -n "${TANDEM_K3S:-}" ]; then
    k3s=target/debug/tandem-k3s
    # This lab test starts its own stand-in, so the real server would add nothing to it.
    own_stand_in=the_lab_runs_against_an_api_server_outside_it_through_the_relay
    # Dual-stack, so the controller's IPv6 and dual-stack Services meet a real server too
    # (every other Service there is single-stack IPv4, as on any cluster). The cloud is an
    # edge the suite did not start, as a user's is: cloud-mock with HAProxy as its data
    # plane (tests that inject faults start a cloud of their own), and the provider
    # conformance kit runs against that edge too.
    step "real cluster: controller end to end, dual-stack, HAProxy edge" \
        bash scripts/with-haproxy-edge.sh -- "$k3s" control-plane --ip-family dual -- \
        cargo test -p tandem-controller-bin --locked --test e2e --test conformance
    # The lab's tests on a dual-stack k3s too: its dual-stack and IPv6 Services get their
    # families and cluster IPs from the real server; the others are IPv4, as a Service that
    # names no family is on a cluster whose first family is IPv4. The edge serves proxy
    # mode through HAProxy here (the stand-in runs above used its own listeners).
    for mode in iptables nftables; do
        step "real cluster: lab end to end, dual-stack, HAProxy edge, $mode mode" \
            env TANDEM_E2E_PROXY_MODE=$mode TANDEM_E2E_EDGE_DATAPLANE=haproxy \
            "$k3s" control-plane --ip-family dual -- \
            cargo test -p tandem-lab --locked --test e2e -- --skip "$own_stand_in"
    done
    step "real cluster: the chart on a real node" env TANDEM_K3S_IMAGES=local \
        cargo test -p tandem-k3s --locked --test node -- --ignored --nocapture
    # Three real nodes (a server and two agents, each a kubelet in a namespace of its own):
    # kube-proxy, then the node proxy in each mode, on every node, across nodes; then the
    # chart on the same nodes, day-2 work under traffic through the edge.
    step "real cluster: three nodes, kube-proxy, both proxy modes, the chart" \
        env TANDEM_K3S_IMAGES=local \
        cargo test -p tandem-k3s --locked --test cluster -- --ignored --nocapture
else
    echo "=== real cluster: skipped (set TANDEM_K3S to a k3s binary to run it)"
fi

if [ ${#failed[@]} -ne 0 ]; then
    for entry in "${failed[@]}"; do
        echo "FAILED: ${entry%|*}" >&2
        grep -E '^(FAILED |Error: |---- |test .* FAILED)|panicked at|step\(s\) failed|^  left|^ right' \
            "${entry##*|}" | cut -c1-400 | tail -n 12 | sed 's/^/    /' >&2 || true
    done
    exit 1
fi
echo "all tests passed ($SECONDS s)"
