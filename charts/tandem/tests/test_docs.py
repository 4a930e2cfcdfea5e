"""The documents' Helm commands are run: every `helm install`, `helm upgrade` and
`helm template` that README.md, docs/ and the chart's README tell a user to type is split
as the shell splits it, its `--set` arguments are parsed by Helm's own parser, and the chart
renders with the values they make. A documented command that Helm or the chart's schema
would refuse fails here, not on a user's cluster. NOTES.txt is checked for the values that
change what it must say, and docs/operations.md's error categories against the code."""

import os
import pathlib
import re
import shlex
import subprocess

import helm_python as helm
import pytest

from conftest import CHART, REPO, container, find, render

DOCUMENTS = ["README.md", "docs/install.md", "docs/operations.md", "charts/tandem/README.md"]

# Helm's flags that the documents may use: those taking a value, and switches.
VALUE_FLAGS = {"-n", "--namespace", "--set", "--set-string", "--set-json", "--timeout", "--version",
               "--kube-version"}
SWITCHES = {"--create-namespace", "--reuse-values", "--reset-values", "--wait", "--atomic", "--no-hooks",
            "--dry-run", "--debug", "--install"}
RENDERING = {"install", "upgrade", "template"}
PARSERS = {"--set": helm.parse_set_string, "--set-string": helm.parse_set_string_values,
           "--set-json": helm.parse_set_json}


def shell_snippets(markdown):
    """Shell lines of fenced sh/bash blocks (continuations joined) and inline code spans
    holding a whole helm command."""
    # Every fence is paired (a block in another language, ```yaml or ```ini, included), so
    # that no closing fence is taken for an opening one.
    for block in re.finditer(r"^[ \t]*```([a-z]*)\n(.*?)^[ \t]*```", markdown, re.S | re.M):
        if block.group(1) not in ("sh", "bash", "shell", "console", ""):
            continue
        if not block.group(1) and "helm " not in block.group(2):
            continue
        text = re.sub(r"\\\n", " ", block.group(2))
        yield from (line.strip() for line in text.splitlines() if line.strip())
    # In prose, a span that names the release is a command to type; `helm uninstall` alone
    # names the command.
    prose = re.sub(r"^[ \t]*```.*?^[ \t]*```", "", markdown, flags=re.S | re.M)
    yield from (span for span in re.findall(r"`(helm [^`]+)`", prose.replace("\n", " "))
                if " tandem" in f" {span} ")


def helm_commands(line):
    """The helm invocations of one shell line, as argument lists (comments dropped, `&&`,
    `;` and `|` separate commands)."""
    words = shlex.split(line, comments=True)
    command = []
    for word in words + [";"]:
        if word in ("&&", ";", "|", "||"):
            if command[:1] == ["helm"]:
                yield command[1:]
            command = []
        else:
            command.append(word)


def documented_commands():
    found = []
    for doc in DOCUMENTS:
        text = (REPO / doc).read_text()
        for snippet in shell_snippets(text):
            for args in helm_commands(snippet):
                found.append(pytest.param(args, id=f"{doc}: helm {' '.join(args)}"[:150]))
    return found


def deep_merge(base, extra):
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            deep_merge(base[key], value)
        else:
            base[key] = value
    return base


def values_of(args):
    """The values one helm command gives the chart, parsed by Helm's own --set parsers;
    raises what Helm would refuse."""
    verb, rest = args[0], args[1:]
    values, positional = {}, []
    i = 0
    while i < len(rest):
        word = rest[i]
        flag, eq, inline = word.partition("=")
        if flag in VALUE_FLAGS:
            value = inline if eq else rest[i + 1]
            i += 1 if eq else 2
            if flag in PARSERS:
                deep_merge(values, PARSERS[flag](value))
        elif word in SWITCHES:
            i += 1
        elif word.startswith("-"):
            raise AssertionError(f"helm {verb}: flag {word} is not one this test knows; add it")
        else:
            positional.append(word)
            i += 1
    return verb, positional, values


COMMANDS = documented_commands()


def test_the_documents_hold_helm_commands():
    assert len(COMMANDS) >= 10, [c.id for c in COMMANDS]
    ids = " ".join(c.id for c in COMMANDS)
    for wanted in ("nodeProxy.clusterCIDR=10.244.0.0/16\\,fd00:10:244::/56", "controller.replicaCount=0",
                   "image.registry=registry.example.net/tandem", "uninstall tandem"):
        assert wanted in ids, wanted


@pytest.mark.parametrize("args", COMMANDS)
def test_documented_helm_command_renders(args):
    verb, positional, values = values_of(args)
    assert verb in RENDERING | {"uninstall"}, f"helm {verb} is not a command these docs should need"
    if verb == "uninstall":
        assert positional == ["tandem"], positional
        return
    assert positional == ["tandem", "charts/tandem"], f"release and chart: {positional}"
    objects, _ = render(values)
    assert objects


def test_the_dual_stack_commands_give_each_family():
    """docs/operations.md once said `--set-string nodeProxy.clusterCIDR='A,B'`, which Helm
    refuses: `key "fd00:10:244::/56" has no value`."""
    with pytest.raises(helm.HelmValuesError, match="has no value"):
        values_of(next(helm_commands(
            "helm upgrade tandem charts/tandem --set-string nodeProxy.clusterCIDR='10.244.0.0/16,fd00:10:244::/56'")))
    dual = [c.values[0] for c in COMMANDS if "fd00:10:244::/56" in " ".join(c.values[0])]
    assert dual
    for args in dual:
        objects, _ = render(values_of(args)[2])
        assert "--cluster-cidr=10.244.0.0/16,fd00:10:244::/56" in container(objects, "DaemonSet", "-nodeproxy")["args"]
        pools = [a for a in container(objects, "Deployment", "-cloud-mock")["args"] if a.startswith("--vip-pool=")]
        assert "--vip-pool=198.51.100.0/24" in pools and "--vip-pool=2001:db8:51:100::/120" in pools, pools


def test_the_documented_way_to_give_up_lbs_in_use_stops_the_controller():
    """docs/install.md's `helm upgrade ... --set controller.replicaCount=0 --set
    uninstall.releaseInUse=true` was refused by the schema (minimum 1)."""
    upgrade = [c.values[0] for c in COMMANDS if "uninstall.releaseInUse=true" in c.values[0]]
    assert upgrade
    objects, _ = render(values_of(upgrade[0])[2])
    assert find(objects, "Deployment", "-controller")["spec"]["replicas"] == 0
    assert not [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    job = find(objects, "Job", "-release")
    assert "--release-in-use" in job["spec"]["template"]["spec"]["containers"][0]["args"]


# ---- what the chart's texts say ----

def notes(values=None):
    _, manifests = render(values)
    return next(text for path, text in manifests.items() if path.endswith("NOTES.txt"))


def test_notes_name_the_services_the_controller_takes():
    text = notes()
    assert "spec.loadBalancerClass=tandem.io/mockcloud, and for every one without a loadBalancerClass" in text
    text = notes({"loadBalancerClass": "example.net/lb", "claimUnclassed": False})
    assert "spec.loadBalancerClass=example.net/lb" in text
    assert "without a loadBalancerClass are left to another implementation" in text
    # Its example Service is then one the controller takes.
    expose = next(line for line in text.splitlines() if "kubectl expose" in line)
    assert '"loadBalancerClass":"example.net/lb"' in expose, expose


@pytest.mark.parametrize("values, says, never", [
    ({}, "the KUBE-* iptables chains", "nftables"),
    ({"nodeProxy": {"proxyMode": "nftables"}}, "the nftables table ip tandem", "iptables chains"),
    ({"nodeProxy": {"proxyMode": "nftables", "clusterCIDR": "10.244.0.0/16,fd00:10:244::/56"}},
     "the nftables tables ip tandem and ip6 tandem", "iptables chains"),
])
def test_notes_name_the_data_path_of_the_mode(values, says, never):
    line = next(line for line in notes(values).splitlines() if line.startswith("The node proxy programs"))
    assert says in line and never not in line, line


def test_notes_say_what_the_mock_and_the_images_need():
    text = notes()
    assert "default StorageClass" in text and "localhost/tandem" in text
    text = notes({"cloudMock": {"persistence": {"storageClassName": "fast"}},
                  "image": {"registry": "registry.example.net/tandem"}})
    assert "StorageClass" not in text and "localhost/tandem" not in text


def chart_texts():
    """What the chart says about its values: values.yaml's comments, the schema, its README."""
    return {name: (CHART / name).read_text() for name in ("values.yaml", "values.schema.json", "README.md")}


def test_no_chart_text_keeps_ipv6_to_one_mode():
    """Both proxy modes serve IPv6 (the nftables mode in table ip6 tandem)."""
    for name, text in chart_texts().items():
        flat = " ".join(text.split())
        assert not re.search(r"IPv6[^.|]*\biptables mode only|IPv6 in the iptables mode", flat), name


def test_notes_name_the_provider_and_its_edge():
    text = notes()
    assert "(provider mockcloud) provisions a load balancer on the edge at http://tandem-cloud-mock." in text
    text = notes({"cloudMock": {"enabled": False}, "cloud": {"url": "https://edge.example.net:8443", "token": "t"}})
    assert "on the edge at https://edge.example.net:8443 for every" in text


def test_each_text_says_what_cloud_url_must_speak():
    """Only a server of the edge's API answers the controller, not any cloud (issue 32)."""
    texts = dict(chart_texts())
    texts.update({doc: (REPO / doc).read_text() for doc in ("README.md", "docs/install.md")})
    for name, text in texts.items():
        assert "openapi.yaml" in text, name
    flat = " ".join(texts["docs/install.md"].split())
    assert "## Running the edge on its own host" in texts["docs/install.md"]
    assert "--dataplane haproxy" in flat and "unsupported-protocol" in flat


def test_the_pvc_needs_a_default_storage_class_says_each_text():
    for name, text in chart_texts().items():
        assert "default StorageClass" in " ".join(text.split()), name
    assert "default StorageClass" in (REPO / "docs/install.md").read_text()


# ---- the edge on its own host (docs/install.md) against the files and the binary ----

EDGE_UNIT = REPO / "images/cloud-mock.service"
EDGE_ENV = REPO / "images/cloud-mock.env"


def fenced_blocks(markdown):
    return [m.group(1) for m in re.finditer(r"^```[a-z]*\n(.*?)^```", markdown, re.S | re.M)]


def test_install_shows_the_edges_unit_and_environment_file_as_they_are():
    blocks = fenced_blocks((REPO / "docs/install.md").read_text())
    assert EDGE_UNIT.read_text() in blocks
    assert EDGE_ENV.read_text() in blocks


def edge_settings():
    """The unit's ExecStart arguments and the environment file's variables."""
    unit = EDGE_UNIT.read_text()
    exec_start = re.search(r"^ExecStart=(.*)$", unit, re.M).group(1)
    program, *args = shlex.split(exec_start)
    assert program == "/usr/local/bin/cloud-mock"
    assert re.search(r"^EnvironmentFile=/etc/tandem/cloud-mock.env$", unit, re.M)
    env = dict(line.split("=", 1) for line in EDGE_ENV.read_text().splitlines()
               if line.strip() and not line.startswith("#"))
    return args, env


def test_the_edges_unit_and_environment_are_what_cloud_mock_takes():
    """Every variable is one of cloud-mock's (clap ignores unknown ones), and with the
    unit's arguments they all parse: the edge gets past its flags to opening its store."""
    from test_chart import binary

    exe = binary("cloud-mock")
    args, env = edge_settings()
    help_text = subprocess.run([exe, "--help"], capture_output=True, text=True, check=True).stdout
    # The commented ones too (TLS).
    for name in set(env) | set(re.findall(r"^#(CLOUD_MOCK_[A-Z_]+)=", EDGE_ENV.read_text(), re.M)):
        assert f"[env: {name}" in help_text, f"cloud-mock has no variable {name}"
    assert env["CLOUD_MOCK_DATAPLANE"] == "haproxy"
    # The data directory is the unit's StateDirectory.
    assert "--data-dir=/var/lib/cloud-mock" in args and "StateDirectory=cloud-mock\n" in EDGE_UNIT.read_text()
    args = [a for a in args if not a.startswith("--data-dir")] + ["--data-dir=/dev/null/not-a-directory"]
    result = subprocess.run([exe, *args], capture_output=True, text=True, timeout=30,
                            env={"PATH": os.environ.get("PATH", ""), **env})
    assert result.returncode == 1 and "opening the database" in result.stderr, result.stderr


# ---- docs/operations.md against the code ----

def category_labels():
    """Every label a `fn category` of the controller returns."""
    labels = set()
    for source in (REPO / "controller/src").rglob("*.rs"):
        text = source.read_text()
        for body in re.finditer(r"fn category\(&?(?:self)\) -> &'static str \{(.*?)\n    \}", text, re.S):
            labels.update(re.findall(r'=> "([a-z_]+)"', body.group(1)))
    return labels


def test_operations_lists_every_reconcile_error_category():
    row = next(line for line in (REPO / "docs/operations.md").read_text().splitlines()
               if line.startswith("| `reconcile_errors_total`"))
    documented = set(re.findall(r"`([a-z_]+)`", row)) - {"reconcile_errors_total", "category"}
    labels = category_labels()
    assert "pool_lacks_family" in labels and len(labels) > 10, labels
    assert labels <= documented, f"not in docs/operations.md: {sorted(labels - documented)}"
