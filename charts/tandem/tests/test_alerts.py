"""The chart's alerts and dashboard: rendered with the real Helm engine, checked and unit
tested with promtool (Debian's `prometheus` package), and every metric they name is one the
components export."""

import json
import pathlib
import re
import shutil
import subprocess

import pytest
import yaml

from conftest import CHART, REPO, find, render

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (apt-get install prometheus)")


def exported_metrics():
    """Every sample name the controller, node proxy and mock cloud export, read from where
    their Rust code registers them (prometheus-client adds `_total` to counters and the
    `_bucket`/`_sum`/`_count` series to histograms)."""
    names = set()
    for source in [*REPO.glob("controller/src/**/*.rs"), *REPO.glob("nodeproxy/src/**/*.rs"),
                   *REPO.glob("cloud-mock/src/**/*.rs")]:
        text = source.read_text()
        prefixes = re.findall(r'sub_registry_with_prefix\(\s*"(\w+)"', text)
        if not prefixes:
            continue
        registered = re.findall(r'(?:\.register|encode_descriptor)\(\s*"(\w+)"', text)
        for prefix in prefixes:
            for name in registered:
                base = f"{prefix}_{name}"
                names |= {base, f"{base}_total", f"{base}_bucket", f"{base}_sum", f"{base}_count"}
    return names


def metric_names(expr):
    return set(re.findall(r"\b(tandem_[a-z_]+)\b", expr))


def rendered_rules(values=None):
    objects, _ = render({"metrics": {"prometheusRule": {"enabled": True, **(values or {})},
                                     "serviceMonitor": {"enabled": True}}})
    return find(objects, "PrometheusRule")


def dashboard():
    objects, _ = render({"metrics": {"grafanaDashboard": {"enabled": True}}})
    config_map = find(objects, "ConfigMap", "-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    return json.loads(config_map["data"]["tandem.json"])


def test_alerts_and_dashboard_are_off_by_default():
    objects, _ = render()
    assert not [o for o in objects if o["kind"] == "PrometheusRule"]
    assert not [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-dashboard")]


def test_every_alert_names_only_exported_metrics():
    exported = exported_metrics()
    assert "tandem_nodeproxy_sync_proxy_rules_total" in exported and "tandem_controller_cloud_calls_total" in exported
    rules = [r for g in rendered_rules()["spec"]["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} >= {
        "TandemServicePending", "TandemCloudErrors", "TandemCloudRateLimited", "TandemNoControllerLeader",
        "TandemNodeProxySyncFailing", "TandemNodeProxySyncDivergence", "TandemNetworkProgrammingSlow"}
    for rule in rules:
        names = metric_names(rule["expr"])
        assert names and names <= exported, (rule["alert"], names - exported)


def test_every_dashboard_panel_names_only_exported_metrics():
    exported = exported_metrics()
    panels = dashboard()["panels"]
    assert len(panels) >= 8
    for panel in panels:
        for target in panel["targets"]:
            names = metric_names(target["expr"])
            assert names and names <= exported, (panel["title"], names - exported)


@needs_promtool
def test_alerts_pass_promtool_check_and_unit_tests(tmp_path):
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rendered_rules()["spec"]))
    shutil.copy(CHART / "tests/alerts_test.yaml", tmp_path / "alerts_test.yaml")
    check = subprocess.run([PROMTOOL, "check", "rules", "rules.yaml"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    test = subprocess.run([PROMTOOL, "test", "rules", "alerts_test.yaml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert test.returncode == 0, test.stdout + test.stderr


@needs_promtool
def test_alert_thresholds_follow_the_values(tmp_path):
    rules = rendered_rules({"servicePendingMinutes": 3, "networkProgrammingP99Seconds": 0.5})
    exprs = {r["alert"]: r["expr"] for g in rules["spec"]["groups"] for r in g["rules"]}
    assert exprs["TandemServicePending"].strip().endswith("> 180")
    assert exprs["TandemNetworkProgrammingSlow"].strip().endswith("> 0.5")
    # The unit tests are written for the defaults: with other thresholds they must fail.
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules["spec"]))
    shutil.copy(CHART / "tests/alerts_test.yaml", tmp_path / "alerts_test.yaml")
    test = subprocess.run([PROMTOOL, "test", "rules", "alerts_test.yaml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert test.returncode != 0


@needs_promtool
def test_every_dashboard_query_parses(tmp_path):
    # promtool parses expressions in rule files: each panel query becomes a recording rule.
    rules = [{"record": f"tandem:panel{i}:{j}", "expr": t["expr"].replace("$__rate_interval", "5m")}
             for i, p in enumerate(dashboard()["panels"]) for j, t in enumerate(p["targets"])]
    (tmp_path / "panels.yaml").write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    check = subprocess.run([PROMTOOL, "check", "rules", "panels.yaml"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
