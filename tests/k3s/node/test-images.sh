#!/usr/bin/env bash
# Builds the node's two test images from Debian's static busybox, with buildah from
# scratch (nothing is pulled), and saves them as docker archives into OUT_DIR:
#
#   localhost/pause:3.5          the pod sandbox image: busybox sleeping
#   localhost/tandem-echo:1      busybox httpd on :8080; GET /cgi-bin/echo answers
#                                "pod=<pod name> client=<source address seen>"
#
#   tests/k3s/node/test-images.sh OUT_DIR
set -euo pipefail
out=${1:?usage: test-images.sh OUT_DIR}
busybox=/bin/busybox
# A scratch image has no C library: only the static build works there.
if [ ! -x "$busybox" ] || ldd "$busybox" >/dev/null 2>&1; then
    echo "test-images.sh: no static $busybox: apt-get install busybox-static" >&2
    exit 1
fi

stage=$(mktemp -d "${TMPDIR:-/tmp}/tandem-k3s-images.XXXXXX")
containers=()
cleanup() {
    for c in "${containers[@]}"; do buildah rm "$c" >/dev/null 2>&1 || true; done
    rm -rf "$stage"
}
trap cleanup EXIT

mkdir -p "$stage/root/bin" "$stage/root/www/cgi-bin" "$stage/root/tmp"
install -m 0755 "$busybox" "$stage/root/bin/busybox"
# The applets the images and the tests use (a scratch image has no `busybox --install`).
# Not wget: in Debian's static build it crashes (glibc's NSS cannot load statically).
for applet in sh sleep httpd hostname printf echo cat nc ip ls; do
    ln -s busybox "$stage/root/bin/$applet"
done
cat >"$stage/root/www/cgi-bin/echo" <<'CGI'
#!/bin/sh
printf 'Content-Type: text/plain\r\n\r\n'
echo "pod=$(hostname) client=$REMOTE_ADDR"
CGI
chmod 0755 "$stage/root/www/cgi-bin/echo"

mkdir -p "$out"
build() {
    local ref=$1 archive=$2
    shift 2
    local c
    c=$(buildah from scratch)
    containers+=("$c")
    buildah copy --quiet "$c" "$stage/root" / >/dev/null
    buildah config "$@" "$c"
    buildah commit --quiet "$c" "$ref" >/dev/null
    rm -f "$out/$archive"
    buildah push --quiet "$ref" "docker-archive:$out/$archive:$ref"
    echo "$out/$archive"
}
# PID 1 ignores SIGTERM: the pods using these images set a short grace period.
build localhost/pause:3.5 pause.tar --entrypoint '["/bin/sleep","2147483647"]'
build localhost/tandem-echo:1 tandem-echo.tar \
    --entrypoint '["/bin/httpd","-f","-p","8080","-h","/www"]' --port 8080/tcp
