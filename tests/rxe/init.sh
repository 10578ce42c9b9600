#!/bin/busybox sh
# /init of the Soft-RoCE guest (tests/rxe/guest.py builds the initramfs around it).
# Loads the RDMA and 9p modules, mounts the host's / read-only and the work tree and the
# exchange folder read-write, adds rxe0 on dummy0, runs /xfer/cmd.sh inside the host's
# root and leaves its exit status in /xfer/rc. Never returns: powers the guest off.
/bin/busybox --install -s /bin
export PATH=/bin
mkdir -p /proc /sys /dev /host
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
say() { echo "rxe-guest: $*" > /dev/console; }
fail() { say "FAILED: $*"; echo "$*" > /host/tmp/xfer/harness_error 2>/dev/null; poweroff -f; }

while read -r mod args; do
    insmod "/modules/$mod" $args || fail "insmod $mod"
done < /modules/order

arg() { sed -n "s/.*\b$1=\([^ ]*\).*/\1/p" /proc/cmdline; }
WORK=$(arg afabric.work)
MSIZE=512000
mount -t 9p -o trans=virtio,version=9p2000.L,msize=$MSIZE,ro,cache=loose hostroot /host \
    || fail "mount host root"
mount -t tmpfs -o mode=1777 tmp /host/tmp || fail "tmpfs"
mkdir -p /host/tmp/xfer
mount -t 9p -o trans=virtio,version=9p2000.L,msize=$MSIZE xfer /host/tmp/xfer || fail "mount xfer"
# a work tree under /tmp has no mount point on the fresh tmpfs above: make it
[ -d "/host$WORK" ] || mkdir -p "/host$WORK" || fail "no mount point for the work tree"
mount -t 9p -o trans=virtio,version=9p2000.L,msize=$MSIZE work "/host$WORK" || fail "mount work"
mount -t proc proc /host/proc
mount -t sysfs sys /host/sys
mount -t devtmpfs dev /host/dev
mkdir -p /host/dev/pts /host/dev/shm
mount -t devpts devpts /host/dev/pts
mount -t tmpfs -o mode=1777 shm /host/dev/shm
mount -t tmpfs tmp /host/run 2>/dev/null

ip link set lo up
ip link set dummy0 up || fail "no dummy0"
ip addr add 192.0.2.1/24 dev dummy0
chroot /host rdma link add rxe0 type rxe netdev dummy0 || fail "rdma link add"

say "running at $(cut -d" " -f1 /proc/uptime)"
chroot /host /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HOME=/tmp XDG_CACHE_HOME=/tmp/cache AFABRIC_IN_RXE_GUEST=1 AFABRIC_WORK="$WORK" \
    /bin/sh /tmp/xfer/cmd.sh > /host/tmp/xfer/out.log 2>&1
echo $? > /host/tmp/xfer/rc
sync
say "done (exit $(cat /host/tmp/xfer/rc))"
poweroff -f
