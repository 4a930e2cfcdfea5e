#!/bin/sh
# collect.sh DEST PATH...: copies each PATH (a file, or a directory of modules) into DEST at
# the same place, with every shared library the files load (as ldd resolves them), so that
# they run in a scratch image. Runs inside the Debian build stage.
set -eu
dest=$1
shift
cp --parents -a "$@" "$dest/"
for path in "$@"; do
    find "$path" -type f \( -perm -u+x -o -name '*.so' -o -name '*.so.*' \)
done | while read -r file; do
    ldd "$file" 2>/dev/null || true
done | awk '$(NF-1) ~ /^\// { print $(NF-1) } $1 ~ /^\// { print $1 }' | sort -u |
    while read -r library; do cp --parents -L "$library" "$dest/"; done
