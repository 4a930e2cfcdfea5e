#!/bin/sh
# collect.sh DEST PATH...: copies each PATH into DEST at the same place (a file as the file
# it resolves to, a directory of modules as it is) with every shared library the files
# load (as ldd resolves them), so that they run in a scratch image. Runs inside the Debian
# build stage.
set -eu
dest=$1
shift
for path in "$@"; do
    if [ -d "$path" ]; then
        cp --parents -a "$path" "$dest/"
    else
        mkdir -p "$dest/$(dirname "$path")"
        cp -L "$path" "$dest/$path"
    fi
done
for path in "$@"; do
    find -L "$path" -type f \( -perm -u+x -o -name '*.so' -o -name '*.so.*' \)
done | while read -r file; do
    ldd "$file" 2>/dev/null || true
done | awk '$(NF-1) ~ /^\// { print $(NF-1) } $1 ~ /^\// { print $1 }' | sort -u |
    while read -r library; do cp --parents -L "$library" "$dest/"; done
