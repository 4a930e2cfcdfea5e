import pathlib

import helm_python as helm
import pytest
import yaml

CHART = pathlib.Path(__file__).resolve().parent.parent
REPO = CHART.parent.parent


def render(values=None, namespace="tandem-system"):
    """Render the chart with the real Helm engine; returns (objects, manifests by template)."""
    chart = helm.Chart.load(str(CHART))
    manifests = chart.render(values=values or {}, name="tandem", namespace=namespace, is_install=True)
    objects = []
    for path, text in manifests.items():
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                objects.append(doc)
    return objects, manifests


def find(objects, kind, name_suffix=""):
    hits = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(name_suffix)]
    assert hits, f"no {kind} named *{name_suffix} in {[(o['kind'], o['metadata']['name']) for o in objects]}"
    return hits[0]


def container(objects, kind, name_suffix):
    return find(objects, kind, name_suffix)["spec"]["template"]["spec"]["containers"][0]


@pytest.fixture
def chart():
    return helm.Chart.load(str(CHART))
