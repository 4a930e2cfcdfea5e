#!/bin/sh
# Starts k3s as a node: run by `nsenter --net=/run/netns/NODE -- unshare --mount
# --propagation slave -- sh start.sh RUN_DIR K3S ARGS...`, so every mount below exists only
# in this private mount namespace and vanishes with its last process; nothing is written
# on the host outside RUN_DIR.
set -eu
run=$1
shift

# kubelet, containerd and libcni keep sockets, pod network namespaces and the xtables lock
# under /run.
mount -t tmpfs -o mode=0755 tandem-run /run

# kubelet v1.21 hard-codes /var/lib/kubelet/device-plugins and libcni caches in
# /var/lib/cni; k3s writes /etc/rancher: overlays keep those writes in RUN_DIR.
for dir in var/lib etc; do
    name=$(echo "$dir" | tr / -)
    mkdir -p "$run/overlay/$name/upper" "$run/overlay/$name/work"
    mount -t overlay "tandem-$name" \
        -o "lowerdir=/$dir,upperdir=$run/overlay/$name/upper,workdir=$run/overlay/$name/work" "/$dir"
done
mkdir -p "$run/var-log"
mount --bind "$run/var-log" /var/log

# The kubelet sets these global sysctls when they differ from what it wants: files holding
# exactly those values, bound read-only over the entries, leave the machine's own alone.
for file in "$run"/sysctl/*; do
    entry=/proc/sys/$(basename "$file" | tr . /)
    mount --bind "$file" "$entry"
    mount -o remount,bind,ro "$entry"
done

exec "$@"
