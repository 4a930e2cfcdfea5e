#!/usr/bin/env bash
# Builds Tandem's container images (tandem-controller, tandem-nodeproxy, cloud-mock) from
# images/Containerfile with whichever of podman, buildah or docker is installed.
#
#   scripts/images.sh                      build, tagged <registry>/<name>:<version>
#   scripts/images.sh --offline            same, on a Debian root filesystem made here with
#                                          mmdebstrap (no base image is pulled)
#   scripts/images.sh --save DIR           also write DIR/<name>-<version>.tar (docker
#                                          archives: `kind load image-archive`,
#                                          `k3s ctr images import`)
#   scripts/images.sh --push REGISTRY      also tag as REGISTRY/<name>:<version> and push
#   scripts/images.sh --print-names        print the image references and stop
#
# The version is the chart's appVersion (which must equal the Cargo workspace version); the
# default registry is the chart's image.registry, so the chart's defaults name exactly these
# images.
set -euo pipefail
cd "$(dirname "$0")/.."

NAMES=(tandem-controller tandem-nodeproxy cloud-mock)
CHART=charts/tandem
DEBIAN_SUITE=bookworm
# Keep in step with PACKAGES in images/Containerfile: the offline base must already hold
# them, because nothing can be installed there.
BASE_PACKAGES=ca-certificates,iptables,nftables,conntrack,iproute2,haproxy,arping,procps
TARGET_TRIPLE=x86_64-unknown-linux-gnu

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; }

die() {
    echo "images.sh: $*" >&2
    exit 1
}

# A top-level scalar of a YAML file ("key: value"), quotes stripped.
yaml_scalar() {
    sed -n "s/^$2:[[:space:]]*\"\{0,1\}\([^\"#]*\)\"\{0,1\}[[:space:]]*\(#.*\)\{0,1\}$/\1/p" "$1" | head -1
}

chart_version() {
    local app cargo
    app=$(yaml_scalar "$CHART/Chart.yaml" appVersion)
    cargo=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' Cargo.toml)
    [ -n "$app" ] || die "no appVersion in $CHART/Chart.yaml"
    [ "$app" = "$cargo" ] || die "chart appVersion $app differs from the Cargo workspace version $cargo"
    echo "$app"
}

chart_registry() {
    # image.registry: the "registry:" line inside the top-level "image:" block.
    sed -n '/^image:/,/^[^[:space:]#]/s/^[[:space:]]\{1,\}registry:[[:space:]]*"\{0,1\}\([^"#[:space:]]*\)"\{0,1\}.*$/\1/p' \
        "$CHART/values.yaml" | head -1
}

engine=${TANDEM_IMAGE_ENGINE:-}
registry=""
offline=false
save_dir=""
push_registry=""
print_only=false
while [ $# -gt 0 ]; do
    case $1 in
    --engine) engine=$2; shift 2 ;;
    --registry) registry=$2; shift 2 ;;
    --offline | --base-rootfs) offline=true; shift ;;
    --save) save_dir=$2; shift 2 ;;
    --push) push_registry=$2; shift 2 ;;
    --print-names) print_only=true; shift ;;
    -h | --help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument: $1" ;;
    esac
done

version=$(chart_version)
registry=${registry:-$(chart_registry)}
[ -n "$registry" ] || die "no image.registry in $CHART/values.yaml; pass --registry"

if $print_only; then
    for name in "${NAMES[@]}"; do echo "$registry/$name:$version"; done
    exit 0
fi

if [ -z "$engine" ]; then
    for candidate in podman buildah docker; do
        if command -v "$candidate" >/dev/null; then engine=$candidate; break; fi
    done
fi
[ -n "$engine" ] || die "none of podman, buildah or docker is installed"
command -v "$engine" >/dev/null || die "$engine is not installed"

# Release binaries, statically linked against glibc so that they run on a scratch base.
# The target triple keeps these flags off build scripts and out of target/release.
echo "=== release binaries (static, stripped)"
CARGO_PROFILE_RELEASE_STRIP=symbols CARGO_PROFILE_RELEASE_DEBUG=false \
    RUSTFLAGS="-C target-feature=+crt-static" \
    cargo build --locked --release --target "$TARGET_TRIPLE" \
    -p tandem-controller-bin -p tandem-nodeproxy -p cloud-mock --bins
bin_dir=target/$TARGET_TRIPLE/release

context=target/images/context
rm -rf "$context"
mkdir -p "$context/bin"
cp images/Containerfile images/collect.sh images/passwd images/group "$context/"
for name in "${NAMES[@]}"; do cp "$bin_dir/$name" "$context/bin/"; done

build_args=(
    --build-arg "VERSION=$version"
    --build-arg "REVISION=$(git rev-parse HEAD 2>/dev/null || echo unknown)"
    --build-arg "SOURCE=$(yaml_scalar "$CHART/Chart.yaml" home)"
)

if $offline; then
    # A Debian root filesystem from Debian's packages, cached under target/ by suite and
    # options (package list included), imported as the base image.
    command -v mmdebstrap >/dev/null || die "--offline needs mmdebstrap (apt-get install mmdebstrap)"
    # Minimal: merged /usr through the tiny usr-is-merged (not usrmerge, which needs perl),
    # no Recommends, no documentation or translations.
    mmdebstrap_opts=(
        --variant=minbase --include="$BASE_PACKAGES"
        --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr
        --aptopt='APT::Install-Recommends "false"'
        --dpkgopt='path-exclude=/usr/share/man/*'
        --dpkgopt='path-exclude=/usr/share/locale/*'
        --dpkgopt='path-exclude=/usr/share/doc/*'
        --dpkgopt='path-include=/usr/share/doc/*/copyright'
        --dpkgopt='path-exclude=/usr/share/info/*'
    )
    key=$(echo "$DEBIAN_SUITE ${mmdebstrap_opts[*]}" | sha256sum | cut -c1-12)
    rootfs=target/images/debian-$DEBIAN_SUITE-$key.tar
    if [ ! -s "$rootfs" ]; then
        echo "=== Debian $DEBIAN_SUITE root filesystem ($rootfs)"
        if ! mmdebstrap --quiet --format=tar "${mmdebstrap_opts[@]}" "$DEBIAN_SUITE" \
            "$rootfs.partial" >target/images/mmdebstrap.log 2>&1; then
            tail -n 20 target/images/mmdebstrap.log >&2
            die "mmdebstrap failed (log: target/images/mmdebstrap.log)"
        fi
        mv "$rootfs.partial" "$rootfs"
    fi
    base=localhost/tandem-debian-base:$DEBIAN_SUITE-$key
    case $engine in
    docker) docker import "$rootfs" "$base" >/dev/null ;;
    podman) podman import --quiet "$rootfs" "$base" >/dev/null ;;
    buildah)
        container=$(buildah from scratch)
        buildah add --quiet "$container" "$rootfs" / >/dev/null
        buildah commit --quiet "$container" "$base" >/dev/null
        buildah rm "$container" >/dev/null
        ;;
    esac
    build_args+=(--build-arg "BASE=$base")
    # The base holds every package, so no build step needs a network; without one the
    # engine creates no bridge or firewall rules (CNI chains) in the host's namespace.
    build_args+=(--network none)
fi

build() {
    local target=$1 tag=$2
    case $engine in
    podman) podman build --runtime runc --quiet --layers -f "$context/Containerfile" --target "$target" -t "$tag" "${build_args[@]}" "$context" ;;
    buildah) buildah bud --runtime runc --quiet --layers -f "$context/Containerfile" --target "$target" -t "$tag" "${build_args[@]}" "$context" ;;
    docker) docker build --quiet -f "$context/Containerfile" --target "$target" -t "$tag" "${build_args[@]}" "$context" ;;
    esac
}

image_size() {
    case $engine in
    # buildah shares podman's image store but reports no size of its own.
    buildah) buildah images --noheading --format '{{.Size}}' "$1" | head -1 ;;
    *) "$engine" image inspect --format '{{.Size}}' "$1" ;;
    esac
}

for name in "${NAMES[@]}"; do
    ref=$registry/$name:$version
    echo "=== $ref"
    build "$name" "$ref" >/dev/null
    echo "$ref size $(image_size "$ref")"
done

if [ -n "$save_dir" ]; then
    mkdir -p "$save_dir"
    for name in "${NAMES[@]}"; do
        ref=$registry/$name:$version
        out=$save_dir/$name-$version.tar
        rm -f "$out"
        case $engine in
        buildah) buildah push --quiet "$ref" "docker-archive:$out:$ref" ;;
        *) "$engine" save --quiet -o "$out" "$ref" ;;
        esac
        echo "saved $out"
    done
fi

if [ -n "$push_registry" ]; then
    for name in "${NAMES[@]}"; do
        ref=$registry/$name:$version
        remote=$push_registry/$name:$version
        "$engine" tag "$ref" "$remote"
        "$engine" push "$remote"
        echo "pushed $remote"
    done
fi
