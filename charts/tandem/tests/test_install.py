"""What an install on a real cluster needs: the images the chart names are the ones
scripts/images.sh builds, and the six findings of the first install on a real cluster
(Kubernetes v1.21, containerd 1.4, Helm 3.9, kube-proxy disabled) stay fixed."""

import pathlib
import re
import subprocess

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from conftest import CHART, REPO, container, find, render

WORKLOADS = [("Deployment", "-controller"), ("DaemonSet", "-nodeproxy"), ("Deployment", "-cloud-mock")]


def pod_specs(objects):
    for kind, suffix in WORKLOADS:
        yield find(objects, kind, suffix)["spec"]["template"]["spec"]
    for job in (o for o in objects if o["kind"] == "Job"):
        yield job["spec"]["template"]["spec"]


def test_default_registry_is_one_no_one_else_can_publish_to():
    """No registry publishes Tandem's images; a default naming a public namespace would run
    whatever someone else publishes there, as root with NET_ADMIN on every node."""
    registry = yaml.safe_load((CHART / "values.yaml").read_text())["image"]["registry"]
    assert registry.split("/")[0] == "localhost", registry
    objects, _ = render()
    for spec in pod_specs(objects):
        for c in spec["containers"]:
            assert c["image"].startswith("localhost/"), c["image"]


def test_default_images_are_what_images_sh_builds():
    built = subprocess.run([str(REPO / "scripts/images.sh"), "--print-names"], check=True,
                           capture_output=True, text=True, timeout=60).stdout.split()
    objects, _ = render()
    named = {c["image"] for spec in pod_specs(objects) for c in spec["containers"]}
    assert named == set(built), f"chart defaults {sorted(named)} != scripts/images.sh {built}"


# 1. kubeVersion: the oldest supported release installs, an older one is refused.

def admits(constraint, version):
    """Helm's check for the one constraint form the chart uses: ">=X.Y.Z-0" (the "-0" lets
    pre-release and vendor builds such as v1.21.2-eks-1 through)."""
    match = re.fullmatch(r">=(\d+)\.(\d+)\.(\d+)-0", constraint)
    assert match, f"unexpected kubeVersion form {constraint!r}"
    core = re.match(r"v?(\d+)\.(\d+)\.(\d+)", version)
    return tuple(map(int, core.groups())) >= tuple(map(int, match.groups()))


def test_kube_version_admits_1_21_and_refuses_1_20():
    constraint = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    assert admits(constraint, "v1.21.2") and admits(constraint, "v1.21.0-gke.1")
    assert admits(constraint, "v1.34.1")
    assert not admits(constraint, "v1.20.15")


def test_lints_for_the_oldest_supported_version():
    report = helm.lint(str(CHART), {}, strict=True, kube_version="v1.21.2")
    assert not [m for m in report["messages"] if m["severity"] >= 2] and not report["errors"], report


def test_only_api_versions_served_since_1_21():
    objects, _ = render({"metrics": {"serviceMonitor": {"enabled": True}}})
    since_1_21 = {"v1", "apps/v1", "batch/v1", "policy/v1", "rbac.authorization.k8s.io/v1",
                  "networking.k8s.io/v1", "monitoring.coreos.com/v1"}
    assert {o["apiVersion"] for o in objects} <= since_1_21


def test_validates_against_the_oldest_schemas_available():
    # kubernetes-validate ships schemas from 1.25 on; 1.21's API versions are checked above.
    schemas = pathlib.Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    versions = [m.group(1) for d in schemas.iterdir() if (m := re.fullmatch(r"v(\d+\.\d+\.\d+)-local-strict", d.name))]
    oldest = min(versions, key=lambda v: tuple(map(int, v.split("."))))
    assert oldest.startswith("1.2"), oldest
    objects, _ = render()
    for obj in objects:
        kubernetes_validate.validate(obj, oldest, strict=True)


# 2. Templates that render on Helm < 3.10 (Go < 1.18): `and`/`or` evaluate every argument.

CALL = re.compile(r"(?:^\s*|\(|\bif\s+|\bwith\s+|=\s*|\|\s*)(and|or)\s")
REF = re.compile(r"\$[\w]*(?:\.[\w]+)*|(?<![\w$)])\.[\w]+(?:\.[\w]+)*")


def split_args(text):
    """The arguments of a call that starts at text[0], up to its closing paren or the end."""
    args, depth, current, quote = [], 0, "", False
    for ch in text:
        if ch == '"':
            quote = not quote
        if not quote:
            if ch == "(":
                depth += 1
            elif ch == ")":
                if depth == 0:
                    break
                depth -= 1
            elif ch.isspace() and depth == 0:
                if current:
                    args.append(current)
                current = ""
                continue
        current += ch
    if current:
        args.append(current)
    return args


def short_circuit_reliance(template):
    """`and`/`or` calls whose later argument dereferences, indexes or passes on what an
    earlier argument guards (e.g. `and $x $x.data`, `and $x (hasKey $x.data "k")`)."""
    found = []
    for action in re.findall(r"{{-?(.*?)-?}}", template, re.S):
        if action.lstrip().startswith("/*"):
            continue
        for call in CALL.finditer(action):
            args = split_args(action[call.end():])
            for i, guard in enumerate(args):
                guarded = set(REF.findall(guard))
                for later in args[i + 1:]:
                    is_call = later.startswith("(")
                    if any(ref.startswith(g + ".") or (is_call and ref == g)
                           for ref in REF.findall(later) for g in guarded):
                        found.append(action.strip())
    return found


@pytest.mark.parametrize("snippet", [
    '{{- if and $existing $existing.data (hasKey $existing.data "token") }}',
    "{{ if or (not .Values.a) .Values.a.b }}",
    "{{ $x := and .Values.s (index .Values.s 0) }}",
])
def test_short_circuit_check_catches_reliance(snippet):
    assert short_circuit_reliance(snippet)


@pytest.mark.parametrize("snippet", [
    "{{- if and (or .Values.controller.enabled .Values.cloudMock.enabled) (not .Values.cloud.existingSecret) }}",
    '{{- if hasKey $data "token" }}',
])
def test_short_circuit_check_passes_independent_arguments(snippet):
    assert not short_circuit_reliance(snippet)


def test_no_template_relies_on_short_circuit():
    offenders = {p.name: short_circuit_reliance(p.read_text()) for p in (CHART / "templates").iterdir()}
    assert not {k: v for k, v in offenders.items() if v}


def test_cloud_secret_keeps_an_issued_token_and_survives_a_secret_without_data():
    # helm_python renders without a cluster, so lookup returns an empty map: the first
    # install path. It must render (Helm 3.9 failed here) and issue a token.
    objects, _ = render()
    secret = find(objects, "Secret", "-cloud")
    assert len(secret["data"]["token"]) > 0


# 3. seccompProfile is a value, on every pod and container.

def seccomp_profiles(objects):
    for spec in pod_specs(objects):
        yield spec["securityContext"]["seccompProfile"]
        for c in spec["containers"]:
            yield c["securityContext"]["seccompProfile"]


@pytest.mark.parametrize("profile", [
    {"type": "RuntimeDefault"},
    {"type": "Unconfined"},
    {"type": "Localhost", "localhostProfile": "profiles/tandem.json"},
])
def test_seccomp_profile_is_a_value(profile):
    values = {} if profile["type"] == "RuntimeDefault" else {"seccompProfile": profile}
    objects, _ = render(values)
    profiles = list(seccomp_profiles(objects))
    assert len(profiles) >= 6
    assert all(p == profile for p in profiles), profiles


def test_localhost_seccomp_needs_a_profile(chart):
    with pytest.raises(Exception, match="localhostProfile"):
        chart.render(values={"seccompProfile": {"type": "Localhost"}}, name="t", namespace="n",
                     is_install=True)


# 4. The node proxy mounts only what it needs, and nothing that must already exist.

def test_nodeproxy_mounts_only_the_xtables_lock_and_tolerates_its_absence():
    objects, _ = render()
    spec = find(objects, "DaemonSet", "-nodeproxy")["spec"]["template"]["spec"]
    host_paths = {v["hostPath"]["path"]: v["hostPath"].get("type") for v in spec["volumes"] if "hostPath" in v}
    assert host_paths == {"/run/xtables.lock": "FileOrCreate"}


def test_nodeproxy_probes_livez_and_healthz():
    c = container(render()[0], "DaemonSet", "-nodeproxy")
    assert c["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "healthz"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}


# 5. The API server's address for a kube-proxy replacement.

def env_of(c):
    return {e["name"]: e.get("value") for e in c.get("env", [])}


def test_api_server_address_reaches_nodeproxy_and_controller():
    objects, _ = render({"apiServer": {"host": "192.0.2.10", "port": 6443}})
    for kind, suffix in WORKLOADS[:2]:
        env = env_of(container(objects, kind, suffix))
        assert env["KUBERNETES_SERVICE_HOST"] == "192.0.2.10"
        assert env["KUBERNETES_SERVICE_PORT"] == "6443"
    objects, _ = render()
    for kind, suffix in WORKLOADS[:2]:
        assert "KUBERNETES_SERVICE_HOST" not in env_of(container(objects, kind, suffix))


@pytest.mark.parametrize("host", ["192.0.2.10", "api.cluster.example.net"])
def test_nodeproxy_resolves_the_api_server_without_the_cluster_dns(host):
    """The cluster DNS's ClusterIP works only once the node proxy has programmed it, so a
    name in apiServer.host must be resolved by the node's resolver (it once ran with
    ClusterFirstWithHostNet)."""
    objects, _ = render({"apiServer": {"host": host}})
    spec = find(objects, "DaemonSet", "-nodeproxy")["spec"]["template"]["spec"]
    assert spec["hostNetwork"] and spec["dnsPolicy"] == "Default"


# 7. Values that would break what another part relies on are refused with the reason.

def test_health_port_other_than_the_controllers_is_refused_while_it_runs(chart):
    """The controller's LBs health-check 10256 whatever nodeProxy.healthzPort says."""
    with pytest.raises(helm.HelmError, match="10256"):
        render({"nodeProxy": {"healthzPort": 10257}})
    objects, _ = render({"controller": {"enabled": False}, "cloudMock": {"enabled": False},
                         "nodeProxy": {"healthzPort": 10257}})
    c = container(objects, "DaemonSet", "-nodeproxy")
    assert "--healthz-bind-address=0.0.0.0:10257" in c["args"]
    assert c["ports"][0]["containerPort"] == 10257


def test_alerts_need_the_service_monitors():
    """Without them TandemNoControllerLeader's absent() fires for ever and the node proxy's
    metrics stay on 127.0.0.1."""
    with pytest.raises(helm.HelmError, match="serviceMonitor"):
        render({"metrics": {"prometheusRule": {"enabled": True}}})
    objects, _ = render({"metrics": {"prometheusRule": {"enabled": True}, "serviceMonitor": {"enabled": True}}})
    assert find(objects, "PrometheusRule", "-alerts")
    args = container(objects, "DaemonSet", "-nodeproxy")["args"]
    assert any(a.startswith("--metrics-bind-address=0.0.0.0:") for a in args), args


# 6. helm uninstall: a pre-delete hook releases what the controller leaves behind.

def test_uninstall_hook_runs_release_load_balancers_as_the_controller():
    from test_chart import accepted_by_parser, binary

    objects, _ = render()
    job = find(objects, "Job", "-release")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
    spec = job["spec"]["template"]["spec"]
    deployment = find(objects, "Deployment", "-controller")["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == deployment["serviceAccountName"]
    args = spec["containers"][0]["args"]
    assert "release-load-balancers" in args and "--release-in-use" not in args
    ok, stderr = accepted_by_parser(binary("tandem-controller"), args)
    assert ok, stderr
    # The Lease it deletes: the controller's Role allows that, in the release namespace.
    role = find(objects, "Role", "-leader-election")
    assert any("leases" in r["resources"] and "delete" in r["verbs"] for r in role["rules"])

    # It reaches the bundled mock cloud through the mock's NetworkPolicy.
    peers = find(objects, "NetworkPolicy", "-cloud-mock")["spec"]["ingress"][0]["from"]
    pod_labels = job["spec"]["template"]["metadata"]["labels"]
    assert any(p["podSelector"]["matchLabels"].items() <= pod_labels.items() for p in peers
               if p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "release")

    objects, _ = render({"uninstall": {"releaseInUse": True}})
    assert "--release-in-use" in find(objects, "Job", "-release")["spec"]["template"]["spec"]["containers"][0]["args"]
    objects, _ = render({"uninstall": {"releaseLoadBalancers": False}})
    assert not [o for o in objects if o["kind"] == "Job"]


def test_every_non_root_pod_can_read_the_secrets_it_mounts():
    # A secret mounted 0400 belongs to root: a pod running as another user reads it only
    # through fsGroup (the uninstall hook once lacked it and every `helm uninstall` failed).
    objects, _ = render()
    for spec in pod_specs(objects):
        secrets = [v for v in spec.get("volumes", []) if "secret" in v]
        context = spec.get("securityContext", {})
        if not secrets or context.get("runAsUser", 0) == 0:
            continue
        for volume in secrets:
            mode = volume["secret"].get("defaultMode", 0o644)
            if mode & 0o004 == 0:
                assert context.get("fsGroup") == context.get("runAsGroup"), (volume, context)
