"""The chart, rendered and linted by the real Helm engine, validated against the Kubernetes
schemas, scanned for security problems, and checked against the binaries' real CLIs."""

import json
import os
import pathlib
import re
import subprocess
import tempfile

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from conftest import CHART, REPO, container, find, render

KUBERNETES_VERSION = "1.34.0"

# A matrix of non-default values: each must render, lint and validate.
VALUE_SETS = {
    "defaults": {},
    "production-cloud": {
        "clusterId": "prod-eu1",
        "cloud": {"url": "https://edge.example.net:8443", "existingSecret": "cloud-creds",
                  "existingSecretKey": "api-token", "caSecret": "edge-ca",
                  "clientCertSecret": "controller-client-cert"},
        "cloudMock": {"enabled": False},
        "loadBalancerClass": "tandem.example.net/lb",
        "claimUnclassed": False,
        "controller": {"replicaCount": 3, "concurrency": 32, "priorityClassName": "system-cluster-critical"},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}},
        "log": {"format": "text", "level": "debug"},
    },
    "single-replica-no-election": {
        "controller": {
            "replicaCount": 1,
            "leaderElection": False,
            "podDisruptionBudget": {"enabled": True},
            "defaultAddressPool": "blue",
        },
        "cloud": {"token": "s3cret"},
        "cloudMock": {
            "persistence": {"enabled": False},
            "dataplane": "proxy",
            "vipPool": "198.51.100.0/25",
            "extraVipPools": {"blue": "198.51.100.128/25"},
        },
    },
    "haproxy-edge": {
        "cloudMock": {"dataplane": "haproxy"},
    },
    "dual-stack": {
        "nodeProxy": {
            "clusterCIDR": "10.244.0.0/16,fd00:10:244::/56",
            "serviceClusterIPRange": ["10.96.0.0/16", "fd00:10:96::/112"],
        },
        "cloudMock": {
            "vipPool": "198.51.100.0/24,2001:db8:51:100::/120",
            "extraVipPools": {"blue": "198.51.101.0/24,2001:db8:51:101::/120"},
        },
    },
    # Both proxy modes serve IPv6 (nftables: table ip6 tandem).
    "dual-stack-nftables": {
        "nodeProxy": {"clusterCIDR": "10.244.0.0/16,fd00:10:244::/56", "proxyMode": "nftables"},
    },
    # Local traffic told by interface: a bridge in iptables mode, a name prefix in nftables.
    "detect-local-bridge": {
        "nodeProxy": {"detectLocalMode": "BridgeInterface", "podBridgeInterface": "cni0"},
    },
    "detect-local-prefix": {
        "nodeProxy": {"detectLocalMode": "InterfaceNamePrefix", "podInterfaceNamePrefix": "cali",
                      "proxyMode": "nftables"},
    },
    "nodeproxy-only": {
        "controller": {"enabled": False},
        "cloudMock": {"enabled": False},
        "nodeProxy": {
            "clusterCIDR": "10.42.0.0/16", "proxyMode": "nftables", "iptablesBackend": "legacy",
            "syncPeriod": "1m", "minSyncPeriod": "500ms",
            "nodePortAddresses": ["192.168.7.0/24", "fd00:7::/64"], "masqueradeAll": True,
            "localhostNodePorts": False, "serviceClusterIPRange": ["10.43.0.0/16"],
        },
    },
}


@pytest.mark.parametrize("name", VALUE_SETS)
def test_renders_and_lints_without_errors(name):
    values = VALUE_SETS[name]
    objects, _ = render(values)
    assert objects
    report = helm.lint(str(CHART), values, strict=True, kube_version="v" + KUBERNETES_VERSION)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], report


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_object_validates_against_kubernetes_schemas(name):
    objects, _ = render(VALUE_SETS[name])
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            # A CRD kind: kubernetes-validate has no schema for it; check its shape instead.
            assert obj["spec"]["endpoints"][0]["port"] == "metrics"
            continue
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_standard_labels_on_every_object():
    objects, _ = render(VALUE_SETS["production-cloud"])
    for obj in objects:
        labels = obj["metadata"]["labels"]
        for key in ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
                    "app.kubernetes.io/managed-by", "app.kubernetes.io/component", "helm.sh/chart"):
            assert key in labels, (obj["kind"], obj["metadata"]["name"], key)


def test_token_never_in_a_configmap_or_args():
    objects, manifests = render({"cloud": {"token": "very-secret-token"}})
    # The one ConfigMap is the provider configuration, which names the token's file only.
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "ConfigMap"] == ["tandem-cloud-config"]
    secret = find(objects, "Secret", "-cloud")
    assert secret["data"]["token"]
    rendered = "".join(text for path, text in manifests.items() if not path.endswith("cloud-secret.yaml"))
    assert "very-secret-token" not in rendered


def test_existing_secret_is_used_and_no_secret_rendered():
    objects, _ = render(VALUE_SETS["production-cloud"])
    assert not [o for o in objects if o["kind"] == "Secret"]
    deployment = find(objects, "Deployment", "-controller")
    volume = volume_named(deployment, "cloud-token")
    assert volume["secret"]["secretName"] == "cloud-creds"
    assert cloud_config(objects)["tokenFile"] == "/etc/tandem/cloud/api-token"


def test_controller_is_highly_available_and_locked_down():
    objects, _ = render()
    deployment = find(objects, "Deployment", "-controller")
    spec = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] == 2
    assert "--leader-elect" in spec["containers"][0]["args"]
    assert spec["affinity"]["podAntiAffinity"]
    assert find(objects, "PodDisruptionBudget", "-controller")["spec"]["minAvailable"] == 1
    ctx = spec["containers"][0]["securityContext"]
    assert ctx["readOnlyRootFilesystem"] and ctx["runAsNonRoot"] and not ctx["allowPrivilegeEscalation"]
    assert ctx["capabilities"]["drop"] == ["ALL"] and ctx["seccompProfile"]["type"] == "RuntimeDefault"
    probes = spec["containers"][0]
    assert probes["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert probes["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_nodeproxy_runs_the_chosen_proxy_mode():
    args = container(render()[0], "DaemonSet", "-nodeproxy")["args"]
    assert "--proxy-mode=iptables" in args
    args = container(render(VALUE_SETS["nodeproxy-only"])[0], "DaemonSet", "-nodeproxy")["args"]
    assert "--proxy-mode=nftables" in args


@pytest.mark.parametrize("values", [{}, VALUE_SETS["nodeproxy-only"], {"nodeProxy": {"nodePortAddresses": ["primary"]}}])
def test_nodeproxy_gets_kube_proxys_flags_as_its_cli_reads_them(values):
    """They go in the environment, so `kubectl exec ... tandem-nodeproxy trace` builds the
    same rules; the binary must parse them (it then stops for want of a node name)."""
    env = {e["name"]: e["value"] for e in container(render(values)[0], "DaemonSet", "-nodeproxy")["env"]
           if "value" in e}
    proxy = values.get("nodeProxy", {})
    assert env.get("NODEPORT_ADDRESSES") == (",".join(proxy["nodePortAddresses"]) if proxy.get("nodePortAddresses") else None)
    assert env["MASQUERADE_ALL"] == str(proxy.get("masqueradeAll", False)).lower()
    assert env["IPTABLES_LOCALHOST_NODEPORTS"] == str(proxy.get("localhostNodePorts", True)).lower()
    assert env.get("SERVICE_CLUSTER_IP_RANGE") == (",".join(proxy["serviceClusterIPRange"]) if proxy.get("serviceClusterIPRange") else None)
    flags = {k: v for k, v in env.items()
             if k in ("NODEPORT_ADDRESSES", "MASQUERADE_ALL", "IPTABLES_LOCALHOST_NODEPORTS", "SERVICE_CLUSTER_IP_RANGE")}
    result = subprocess.run([binary("tandem-nodeproxy"), "trace", "--src", "192.0.2.1", "--dst", "192.0.2.2:80"],
                            capture_output=True, text=True, timeout=30,
                            env={"PATH": os.environ.get("PATH", ""), **flags})
    assert "--node-name (or NODE_NAME) is required" in result.stderr, result.stderr


# Flags the trace shares with the node proxy whose value need not reach it.
NOT_FOR_THE_TRACE = {"--log-format": "the trace prints for a person at a terminal, whatever the pod logs"}


def env_of_help(exe, args, env):
    """Each flag of `exe ARGS --help` with the environment variable it reads and the value
    clap shows it has in `env` (`[env: NAME=VALUE]`)."""
    result = subprocess.run([exe, *args, "--help"], capture_output=True, text=True, timeout=30, check=True,
                            env={"PATH": os.environ.get("PATH", ""), **env})
    flags, flag = {}, None
    for line in result.stdout.splitlines():
        head = re.match(r" {2,6}(?:-\w, )?(--[\w-]+)", line)
        if head:
            flag = head.group(1)
        elif flag and (shown := re.search(r"\[env: (\w+)=([^\]]*)\]", line)):
            flags[flag] = (shown.group(1), shown.group(2))
    return flags


@pytest.mark.parametrize("name", ["defaults", "dual-stack", "nodeproxy-only", "detect-local-bridge",
                                  "detect-local-prefix"])
def test_the_trace_sees_every_setting_the_node_proxy_runs_with(name):
    """`kubectl exec ... tandem-nodeproxy trace` is a new process that sees the container's
    environment, not the node proxy's arguments: it once traced the iptables rules on an
    nftables install, because the mode was only an argument."""
    c = container(render(VALUE_SETS[name])[0], "DaemonSet", "-nodeproxy")
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    env["NODE_NAME"] = "node-a"  # what the kubelet puts in from the pod's spec.nodeName
    args = dict(a.split("=", 1) for a in expand_env(c["args"], env))
    seen = env_of_help(binary("tandem-nodeproxy"), ["trace"], env)
    assert "--proxy-mode" in seen and "--cluster-cidr" in seen, seen
    shared = [flag for flag in args if flag in seen and flag not in NOT_FOR_THE_TRACE]
    assert "--proxy-mode" in shared
    for flag in shared:
        assert seen[flag][1] == args[flag], f"trace reads {flag} as {seen[flag]}, the node proxy runs with {args[flag]}"


@pytest.mark.parametrize("values, expected", [
    ({}, ["--detect-local-mode=ClusterCIDR"]),
    ({"detectLocalMode": "NodeCIDR"}, ["--detect-local-mode=NodeCIDR"]),
    (VALUE_SETS["detect-local-bridge"]["nodeProxy"],
     ["--detect-local-mode=BridgeInterface", "--pod-bridge-interface=cni0"]),
    (VALUE_SETS["detect-local-prefix"]["nodeProxy"],
     ["--detect-local-mode=InterfaceNamePrefix", "--pod-interface-name-prefix=cali"]),
])
def test_the_local_traffic_detector_reaches_the_node_proxy(values, expected):
    values = {"nodeProxy": values} if values else {}
    c = container(render(values)[0], "DaemonSet", "-nodeproxy")
    detect = [a for a in c["args"] if a.startswith(("--detect-local-mode", "--pod-"))]
    assert detect == expected
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["DETECT_LOCAL_MODE"] == expected[0].split("=", 1)[1]
    assert ("POD_BRIDGE_INTERFACE" in env) == ("--pod-bridge-interface=cni0" in expected)
    assert ("POD_INTERFACE_NAME_PREFIX" in env) == ("--pod-interface-name-prefix=cali" in expected)
    # The binary takes them as given (it then stops for want of a node name, not a flag).
    flags = {k: v for k, v in env.items()
             if k in ("DETECT_LOCAL_MODE", "POD_BRIDGE_INTERFACE", "POD_INTERFACE_NAME_PREFIX")}
    result = subprocess.run([binary("tandem-nodeproxy"), "trace", "--src", "192.0.2.1", "--dst", "192.0.2.2:80"],
                            capture_output=True, text=True, timeout=30,
                            env={"PATH": os.environ.get("PATH", ""), **flags})
    assert "--node-name (or NODE_NAME) is required" in result.stderr, result.stderr


def test_dual_stack_values_give_a_proxier_and_a_pool_per_family():
    objects, _ = render(VALUE_SETS["dual-stack"])
    proxy = container(objects, "DaemonSet", "-nodeproxy")["args"]
    assert "--cluster-cidr=10.244.0.0/16,fd00:10:244::/56" in proxy
    mock = container(objects, "Deployment", "-cloud-mock")["args"]
    pools = [a for a in mock if a.startswith("--vip-pool=")]
    assert pools == [
        "--vip-pool=198.51.100.0/24",
        "--vip-pool=2001:db8:51:100::/120",
        "--vip-pool=blue=198.51.101.0/24",
        "--vip-pool=blue=2001:db8:51:101::/120",
    ]


def test_nodeproxy_has_only_the_capabilities_it_needs():
    objects, _ = render()
    ds = find(objects, "DaemonSet", "-nodeproxy")
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["tolerations"] == [{"operator": "Exists"}]
    ctx = spec["containers"][0]["securityContext"]
    assert ctx["privileged"] is False
    assert ctx["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN", "NET_RAW"]}
    mounts = {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    assert "/run/xtables.lock" in mounts
    assert ds["spec"]["updateStrategy"]["type"] == "RollingUpdate"


def rules_of(objects, kind, suffix):
    return find(objects, kind, suffix)["rules"]


def test_rbac_is_least_privilege():
    objects, _ = render()
    controller = rules_of(objects, "ClusterRole", "-controller")
    granted = {(g, r, v) for rule in controller for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    assert ("", "services/status", "patch") in granted
    assert ("", "services", "delete") not in granted
    assert not any(r == "secrets" for _, r, _ in granted)
    assert not any(v in ("*",) for _, _, v in granted)
    leases = rules_of(objects, "Role", "-leader-election")
    assert leases[0]["resources"] == ["leases"]
    nodeproxy = rules_of(objects, "ClusterRole", "-nodeproxy")
    assert all(set(rule["verbs"]) <= {"get", "list", "watch"} for rule in nodeproxy)


def test_checkov_security_scan_passes(tmp_path):
    objects, _ = render(VALUE_SETS["production-cloud"])
    objects += render(VALUE_SETS["single-replica-no-election"])[0]
    manifest = tmp_path / "rendered.yaml"
    manifest.write_text(yaml.safe_dump_all(objects))
    result = subprocess.run(
        ["checkov", "--compact", "--framework", "kubernetes", "-f", str(manifest), "-o", "json"],
        capture_output=True, text=True, timeout=600,
    )
    report = json.loads(result.stdout)
    reports = report if isinstance(report, list) else [report]
    assert sum(r["summary"]["passed"] for r in reports) > 100, report
    failed = [c for r in reports for c in r["results"]["failed_checks"]]
    assert not failed, "\n".join(f"{c['check_id']} {c['check_name']} {c['resource']}" for c in failed)
    skipped = [c for r in reports for c in r["results"]["skipped_checks"]]
    # Every skip carries its justification in the chart.
    unjustified = [c["check_id"] for c in skipped if len(c["check_result"].get("suppress_comment") or "") < 20]
    assert not unjustified, unjustified


@pytest.mark.parametrize(
    "values, message",
    [
        ({"controller": {"replicaCount": "two"}}, "replicaCount"),
        ({"controller": {"replicas": 2}}, "replicas"),
        ({"unknownKey": True}, "unknownKey"),
        ({"nodeProxy": {"iptablesBackend": "ebpf"}}, "iptablesBackend"),
        ({"nodeProxy": {"proxyMode": "ipvs"}}, "proxyMode"),
        ({"nodeProxy": {"clusterCIDR": "10.244.0.0"}}, "clusterCIDR"),
        ({"nodeProxy": {"clusterCIDR": "10.244.0.0/16,fd00::/56,10.245.0.0/16"}}, "clusterCIDR"),
        ({"nodeProxy": {"syncPeriod": "soon"}}, "syncPeriod"),
        ({"nodeProxy": {"nodePortAddresses": ["eth0"]}}, "nodePortAddresses"),
        ({"nodeProxy": {"serviceClusterIPRange": "10.96.0.0/12"}}, "serviceClusterIPRange"),
        ({"log": {"format": "xml"}}, "format"),
        ({"nodeProxy": {"detectLocalMode": "ClusterCidr"}}, "detectLocalMode"),
        ({"nodeProxy": {"detectLocalMode": "BridgeInterface"}}, "podBridgeInterface"),
        ({"nodeProxy": {"detectLocalMode": "InterfaceNamePrefix"}}, "podInterfaceNamePrefix"),
        ({"nodeProxy": {"podBridgeInterface": "a-name-too-long-for-linux"}}, "podBridgeInterface"),
        ({"nodeProxy": {"podInterfaceNamePrefix": "veth+"}}, "podInterfaceNamePrefix"),
        ({"clusterId": "Has Spaces"}, "clusterId"),
        ({"clusterId": "a-cluster-id-longer-than-24"}, "clusterId"),
        ({"cloud": {"url": "ftp://x"}}, "url"),
        ({"cloud": {"urls": ["ftp://x"]}}, "urls"),
        ({"cloud": {"provider": "aws"}}, "provider"),
        ({"cloudMock": {"dataplane": "nginx"}}, "dataplane"),
        ({"controller": {"metricsPort": 70000}}, "metricsPort"),
    ],
)
def test_bad_values_are_rejected_with_a_clear_message(chart, values, message):
    with pytest.raises(helm.HelmValuesError) as err:
        chart.render(values=values, name="tandem", namespace="default")
    assert message in str(err.value)


def test_missing_cloud_settings_are_reported():
    with pytest.raises(helm.HelmError) as err:
        render({"cloudMock": {"enabled": False}})
    assert "cloud.url (or cloud.urls) is required" in str(err.value)
    with pytest.raises(helm.HelmError) as err:
        render({"cloudMock": {"enabled": False}, "cloud": {"url": "http://cloud:8080"}})
    assert "cloud.token or cloud.existingSecret is required" in str(err.value)


def test_claiming_unclassed_services_follows_the_value():
    args = container(render()[0], "Deployment", "-controller")["args"]
    assert "--claim-unclassed=true" in args
    args = container(render(VALUE_SETS["production-cloud"])[0], "Deployment", "-controller")["args"]
    assert "--claim-unclassed=false" in args and "--load-balancer-class=tandem.example.net/lb" in args


# ---- the controller's provider and its configuration file ----

def volume_named(workload, name):
    volumes = workload["spec"]["template"]["spec"]["volumes"]
    hits = [v for v in volumes if v["name"] == name]
    assert hits, f"no volume {name} in {[v['name'] for v in volumes]}"
    return hits[0]


def mounted_path(workload, volume, key):
    """The path at which the workload's first container sees `key` of `volume`."""
    c = workload["spec"]["template"]["spec"]["containers"][0]
    mount = next(m for m in c["volumeMounts"] if m["name"] == volume)
    return f"{mount['mountPath']}/{key}"


def cloud_config(objects):
    """The provider configuration the controller reads: cloud-config.json of the ConfigMap."""
    config_map = find(objects, "ConfigMap", "-cloud-config")
    assert list(config_map["data"]) == ["cloud-config.json"]
    return json.loads(config_map["data"]["cloud-config.json"])


def flag(args, name):
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    assert len(values) == 1, (name, args)
    return values[0]


def documented_mockcloud_config():
    """The keys of the example file in the mockcloud provider's own documentation."""
    source = (REPO / "controller/mockcloud/src/config.rs").read_text()
    block = re.search(r"//! ```json\n//! (.*?)\n//! ```", source)
    assert block, "controller/mockcloud/src/config.rs documents no JSON example"
    return json.loads(block.group(1))


@pytest.mark.parametrize("name", ["defaults", "production-cloud"])
def test_controller_and_hook_read_the_provider_config_from_what_they_mount(name):
    """--cloud-provider and --cloud-config (no --cloud-url/--cloud-token-file), and every
    file the configuration names is one the pod mounts, from the object that holds it."""
    objects, _ = render(VALUE_SETS[name])
    config = cloud_config(objects)
    for workload in (find(objects, "Deployment", "-controller"), find(objects, "Job", "-release")):
        args = workload["spec"]["template"]["spec"]["containers"][0]["args"]
        assert flag(args, "cloud-provider") == "mockcloud"
        assert not [a for a in args if a.startswith(("--cloud-url", "--cloud-token-file"))], args
        config_file = flag(args, "cloud-config")
        assert mounted_path(workload, "cloud-config", "cloud-config.json") == config_file
        assert volume_named(workload, "cloud-config")["configMap"]["name"] == "tandem-cloud-config"
        token = volume_named(workload, "cloud-token")["secret"]
        key = VALUE_SETS[name].get("cloud", {}).get("existingSecretKey", "token")
        assert config["tokenFile"] == mounted_path(workload, "cloud-token", key)
        assert token["secretName"] == VALUE_SETS[name].get("cloud", {}).get("existingSecret", "tandem-cloud")
        if "caFile" in config:
            ca = volume_named(workload, "cloud-ca")["secret"]
            assert ca["secretName"] == "edge-ca" and ca["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
            assert config["caFile"] == mounted_path(workload, "cloud-ca", "ca.crt")
        if "clientCertFile" in config:
            client = volume_named(workload, "cloud-client-cert")["secret"]
            assert client["secretName"] == "controller-client-cert"
            assert client["items"] == [{"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"}]
            assert config["clientCertFile"] == mounted_path(workload, "cloud-client-cert", "tls.crt")
            assert config["clientKeyFile"] == mounted_path(workload, "cloud-client-cert", "tls.key")


def test_the_token_secret_is_mounted_whole_so_that_a_rotation_reaches_the_pods():
    """The kubelet never updates a Secret mounted with subPath: the controller, the hook and
    the bundled mock mount the token's Secret as a directory and read the file in it."""
    objects, _ = render()
    config = cloud_config(objects)
    mock = find(objects, "Deployment", "-cloud-mock")
    for workload in (find(objects, "Deployment", "-controller"), find(objects, "Job", "-release"), mock):
        mounts = workload["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
        assert not [m for m in mounts if "subPath" in m or "subPathExpr" in m], mounts
        assert volume_named(workload, "cloud-token")["secret"]["secretName"] == "tandem-cloud"
    args = container(objects, "Deployment", "-cloud-mock")["args"]
    assert flag(args, "token-file") == mounted_path(mock, "cloud-token", "token") == config["tokenFile"]
    assert not [e for e in container(objects, "Deployment", "-cloud-mock").get("env", [])
                if e["name"] == "CLOUD_MOCK_TOKEN"]


def test_provider_config_is_the_mockcloud_providers_format():
    """Keys of the provider's own documented example, which its parser (serde,
    deny_unknown_fields) is tested against; the URLs the chart computes."""
    documented = documented_mockcloud_config()
    objects, _ = render(VALUE_SETS["production-cloud"])
    config = cloud_config(objects)
    assert set(config) == set(documented) - {"urls"}, (config, documented)
    assert config["url"] == "https://edge.example.net:8443"
    assert config["caFile"] == "/etc/tandem/cloud-ca/ca.crt"
    assert config["clientCertFile"] == "/etc/tandem/cloud-client/tls.crt"
    assert config["clientKeyFile"] == "/etc/tandem/cloud-client/tls.key"
    config = cloud_config(render()[0])
    assert set(config) == set(documented) - {"urls", "caFile", "clientCertFile", "clientKeyFile"}
    assert config["url"] == "http://tandem-cloud-mock.tandem-system.svc:8080"
    assert config["tokenFile"] == "/etc/tandem/cloud/token"


def test_several_edges_are_the_url_and_the_urls():
    """An edge cluster: cloud.urls beside cloud.url, or alone; the NOTES name every edge."""
    edges = ["https://edge2.example.net:8443", "https://edge3.example.net:8443"]
    both = {"cloudMock": {"enabled": False},
            "cloud": {"url": "https://edge1.example.net:8443", "urls": edges, "token": "t"}}
    objects, manifests = render(both)
    config = cloud_config(objects)
    assert set(config) <= set(documented_mockcloud_config()), config
    assert (config["url"], config["urls"]) == ("https://edge1.example.net:8443", edges)
    notes = next(text for path, text in manifests.items() if path.endswith("NOTES.txt"))
    assert "on the edge at https://edge1.example.net:8443, https://edge2.example.net:8443, " in notes
    alone = {"cloudMock": {"enabled": False}, "cloud": {"urls": edges, "token": "t"}}
    config = cloud_config(render(alone)[0])
    assert "url" not in config and config["urls"] == edges
    objects, _ = render()
    assert not [v for v in find(objects, "Deployment", "-controller")["spec"]["template"]["spec"]["volumes"]
                if v["name"] == "cloud-ca"]


def test_a_client_certificate_is_mounted_read_only_only_when_named():
    """cloud.clientCertSecret, a kubernetes.io/tls Secret: its two keys in a read-only
    directory of the controller and the hook, never the bundled mock; unset, nothing."""
    named = {"cloud": {"clientCertSecret": "controller-client-cert"}}
    objects, _ = render(named)
    for workload in (find(objects, "Deployment", "-controller"), find(objects, "Job", "-release")):
        mounts = workload["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
        mount = next(m for m in mounts if m["name"] == "cloud-client-cert")
        assert mount == {"name": "cloud-client-cert", "mountPath": "/etc/tandem/cloud-client", "readOnly": True}
        assert volume_named(workload, "cloud-client-cert")["secret"]["defaultMode"] == 0o400
    mock = find(objects, "Deployment", "-cloud-mock")
    assert "cloud-client-cert" not in [v["name"] for v in mock["spec"]["template"]["spec"]["volumes"]]
    objects, _ = render()
    assert not {"clientCertFile", "clientKeyFile"} & set(cloud_config(objects))
    for workload in (find(objects, "Deployment", "-controller"), find(objects, "Job", "-release")):
        spec = workload["spec"]["template"]["spec"]
        assert "cloud-client-cert" not in [v["name"] for v in spec["volumes"]]
        assert "cloud-client-cert" not in [m["name"] for m in spec["containers"][0]["volumeMounts"]]


def test_a_changed_provider_config_rolls_the_controller():
    """The controller reads its configuration once, at start (as it read the flags, whose
    change rolled the pods by itself)."""
    def checksum(values):
        deployment = find(render(values)[0], "Deployment", "-controller")
        return deployment["spec"]["template"]["metadata"]["annotations"]["checksum/cloud-config"]

    base = {"cloudMock": {"enabled": False}, "cloud": {"url": "https://a.example.net", "token": "t"}}
    assert checksum(base) == checksum(base)
    assert checksum(base) != checksum(deep_merge(base, {"cloud": {"url": "https://b.example.net"}}))
    assert checksum(base) != checksum(deep_merge(base, {"cloud": {"caSecret": "edge-ca"}}))
    assert checksum(base) != checksum(deep_merge(base, {"cloud": {"clientCertSecret": "client-cert"}}))
    # Extra pod annotations still reach the pods beside it.
    deployment = find(render({"controller": {"podAnnotations": {"a": "b"}}})[0], "Deployment", "-controller")
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["a"] == "b" and "checksum/cloud-config" in annotations


def deep_merge(base, extra):
    out = json.loads(json.dumps(base))
    for key, value in extra.items():
        out[key] = deep_merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def test_load_balancer_class_is_left_to_the_provider_unless_set():
    args = container(render()[0], "Deployment", "-controller")["args"]
    assert not [a for a in args if a.startswith("--load-balancer-class")], args
    args = container(render({"loadBalancerClass": "example.net/lb"})[0], "Deployment", "-controller")["args"]
    assert flag(args, "load-balancer-class") == "example.net/lb"


def test_haproxy_dataplane_is_passed_and_opens_the_mocks_listeners():
    objects, _ = render(VALUE_SETS["haproxy-edge"])
    assert flag(container(objects, "Deployment", "-cloud-mock")["args"], "dataplane") == "haproxy"
    # HAProxy keeps its sockets and files in DATA_DIR/haproxy: the data volume, writable.
    c = container(objects, "Deployment", "-cloud-mock")
    data_dir = flag(c["args"], "data-dir")
    assert any(m["mountPath"] == data_dir and not m.get("readOnly") for m in c["volumeMounts"])
    # Load-balancer clients reach its listeners from anywhere, as with the proxy data plane.
    assert find(objects, "NetworkPolicy", "-cloud-mock")["spec"]["ingress"] == [{}]
    objects, _ = render()
    assert find(objects, "NetworkPolicy", "-cloud-mock")["spec"]["ingress"][0]["from"]


# ---- the rendered command lines against the binaries' real argument parsers ----

BINARIES = {
    ("Deployment", "-controller"): "tandem-controller",
    ("DaemonSet", "-nodeproxy"): "tandem-nodeproxy",
    ("Deployment", "-cloud-mock"): "cloud-mock",
}


def binary(name):
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    path = target / "debug" / name
    if not path.exists():
        pytest.fail(f"{path} is missing: run `cargo build --workspace --bins` first (scripts/test.sh does)")
    return str(path)


def expand_env(args, env):
    """What the kubelet does with $(VAR) references in container args."""
    out = []
    for arg in args:
        for name, value in env.items():
            arg = arg.replace(f"$({name})", value)
        out.append(arg)
    return out


def accepted_by_parser(exe, args):
    # clap parses left to right and validates each value as it goes; a trailing --help then
    # exits 0 only when every argument before it was a known flag with a valid value.
    result = subprocess.run([exe, *args, "--help"], capture_output=True, text=True, timeout=30,
                            env={"PATH": os.environ.get("PATH", "")})
    return result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", VALUE_SETS)
def test_rendered_args_are_accepted_by_each_binary(name):
    objects, _ = render(VALUE_SETS[name])
    checked = 0
    for (kind, suffix), exe in BINARIES.items():
        hits = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]
        for obj in hits:
            c = obj["spec"]["template"]["spec"]["containers"][0]
            args = expand_env(c["args"], {"NODE_NAME": "node-a"})
            ok, stderr = accepted_by_parser(binary(exe), args)
            assert ok, f"{exe} rejects the chart's args {args}: {stderr}"
            checked += 1
    assert checked >= 1


@pytest.mark.parametrize("exe, bad", [
    ("tandem-controller", ["--concurrency=many"]),
    ("tandem-controller", ["--no-such-flag=1"]),
    ("tandem-nodeproxy", ["--cluster-cidr=not-a-cidr"]),
    ("cloud-mock", ["--no-such-flag"]),
])
def test_parser_check_rejects_bad_args(exe, bad):
    """The check above can fail: bad flags or values are refused even with a trailing --help."""
    ok, _ = accepted_by_parser(binary(exe), bad)
    assert not ok


def test_every_value_is_documented_in_the_readme():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    readme = (CHART / "README.md").read_text()

    def leaves(v, sch, path):
        # Closed objects are documented key by key; free-form maps (nodeSelector,
        # resources, updateStrategy, ...) as a whole.
        if isinstance(v, dict) and v and sch.get("additionalProperties") is False and path[-1:] != ["resources"]:
            for key, sub in v.items():
                yield from leaves(sub, sch["properties"][key], path + [key])
        else:
            yield ".".join(path)

    undocumented = [p for p in leaves(values, schema, []) if f"`{p}`" not in readme]
    assert not undocumented, undocumented
