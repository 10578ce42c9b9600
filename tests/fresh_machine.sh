#!/usr/bin/env bash
# The README's first command, literally, on a fresh Debian machine: a bookworm minbase root
# made with debootstrap (no compiler, no -dev packages, no rdma-core), a copy of this
# checkout in it, the command run as root in a chroot, and a check that the benchmark
# printed its table. Needs root (debootstrap, chroot, mounts) and Debian's mirror.
#
#   bash tests/fresh_machine.sh            # prints the command's output, then "fresh_machine: OK"
#
# The pristine root is cached as a tarball under $AFABRIC_CACHE (~/.cache/afabric), so a
# second run only unpacks it; nothing that ran in a chroot is ever cached. Every step has a
# timeout; the chroot's mounts are undone on every exit path.
#   AFABRIC_FRESH_SUITE   (bookworm)  AFABRIC_FRESH_MIRROR (http://deb.debian.org/debian)
#   AFABRIC_FRESH_TIMEOUT  (seconds for the README command, 900)
#   AFABRIC_FRESH_DEADLINE (seconds for the whole script, 1500: every step's timeout is cut
#                          to what is left of it, so the script ends within it plus ~40 s)
#   AFABRIC_FRESH_CA      (a CA bundle pip in the chroot must trust; default $PIP_CERT)
#   AFABRIC_FRESH_QUICK=1 appends --quick to the command's final `afabric bench p2p`
#                         (the same sweep as its default; kept for scripts that pass it)
set -euo pipefail
cd "$(dirname "$0")/.."
src=$PWD

suite=${AFABRIC_FRESH_SUITE:-bookworm}
mirror=${AFABRIC_FRESH_MIRROR:-http://deb.debian.org/debian}
cache=${AFABRIC_CACHE:-$HOME/.cache/afabric}
cmd_timeout=${AFABRIC_FRESH_TIMEOUT:-900}
deadline=$(($(date +%s) + ${AFABRIC_FRESH_DEADLINE:-1500}))
# limit SECONDS: SECONDS, or what is left before the deadline if that is less (at least 1)
limit() {
    local left=$((deadline - $(date +%s)))
    [ "$left" -lt "$1" ] || left=$1
    [ "$left" -ge 1 ] || left=1
    echo "$left"
}
tarball=$cache/debian-$suite-minbase-root.tar

say() { printf 'fresh_machine: %s\n' "$*" >&2; }
die() { say "FAIL: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (debootstrap, chroot, mounts)"
if ! command -v debootstrap >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    timeout "$(limit 300)" apt-get update -qq
    timeout "$(limit 300)" apt-get install -y -qq debootstrap >/dev/null
fi

# The README's first command: the first line of the first ```sh block.
readme_cmd=$(awk '/^```sh$/ {inblock=1; next} inblock {print; exit}' README.md)
[ -n "$readme_cmd" ] || die "no \`\`\`sh block in README.md"
run_cmd=$readme_cmd
if [ "${AFABRIC_FRESH_QUICK:-0}" = 1 ]; then
    case "$run_cmd" in
        *"afabric bench p2p") run_cmd="$run_cmd --quick" ;;
        *) die "README's first command does not end in 'afabric bench p2p': $readme_cmd" ;;
    esac
fi

work=$(mktemp -d /var/tmp/afabric-fresh.XXXXXX)
root=$work/root
mounted=()
cleanup() {
    local i
    for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do
        umount -l "${mounted[$i]}" 2>/dev/null || true
    done
    rm -rf --one-file-system "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP  # so that cleanup runs

t0=$(date +%s)
mkdir -p "$cache" "$root"
if [ ! -s "$tarball" ]; then
    say "debootstrap --variant=minbase $suite (cached afterwards in $tarball)"
    fresh=$work/bootstrap
    mkdir -p "$fresh"
    timeout "$(limit 900)" debootstrap --variant=minbase "$suite" "$fresh" "$mirror" >"$work/debootstrap.log" 2>&1 \
        || { tail -20 "$work/debootstrap.log" >&2; die "debootstrap failed"; }
    tar -C "$fresh" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
    rm -rf --one-file-system "$fresh"
fi
timeout "$(limit 300)" tar -C "$root" -xf "$tarball" || die "unpacking $tarball"
t_root=$(date +%s)

# What a fresh machine lacks, this root must lack too (or the check proves nothing).
for f in usr/bin/gcc usr/bin/cc usr/include/infiniband/verbs.h usr/include/rdma/fabric.h; do
    [ ! -e "$root/$f" ] || die "the fresh root already has /$f"
done

# A copy of the checkout: tracked files and untracked ones git does not ignore (no .venv,
# no built libraries, no .git).
mkdir -p "$root/src/afabric"
git -C "$src" ls-files -z --cached --others --exclude-standard \
    | (cd "$src" && xargs -0 -r sh -c 'for f; do [ -e "$f" ] && printf "%s\0" "$f"; done' sh) \
    | tar -C "$src" --null -T - -cf - | tar -C "$root/src/afabric" -xf -
cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
# A network that intercepts TLS (a proxy with its own CA) needs that CA for pip to reach
# PyPI: AFABRIC_FRESH_CA (default: this machine's $PIP_CERT) is handed to the chroot as
# PIP_CERT. It is the only thing of this machine's environment the command sees.
host_ca=${AFABRIC_FRESH_CA-${PIP_CERT:-}}
ca_env=()
if [ -n "$host_ca" ] && [ -f "$host_ca" ]; then
    cp "$host_ca" "$root/etc/afabric-host-ca.crt"
    ca_env=(PIP_CERT=/etc/afabric-host-ca.crt)
    say "pip in the chroot trusts $host_ca (as PIP_CERT)"
fi

mnt() { mount "$@" && mounted+=("${@: -1}"); }
mnt -t proc proc "$root/proc"
mnt --rbind /dev "$root/dev"
mount --make-rslave "$root/dev"
mkdir -p "$root/dev/shm"
mnt -t tmpfs -o mode=1777 shm "$root/dev/shm"
mnt -t sysfs sysfs "$root/sys"

say "running, as root in the chroot, in /src/afabric: $run_cmd"
set +e
# env -i: the chroot sees none of this machine's environment (pip indexes, CC, ...).
timeout --kill-after=30 "$(limit "$cmd_timeout")" chroot "$root" /usr/bin/env -i \
    HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 TERM=dumb DEBIAN_FRONTEND=noninteractive "${ca_env[@]}" \
    /bin/bash -c "cd /src/afabric && $run_cmd" 2>&1 | tee "$work/out.log"
rc=${PIPESTATUS[0]}
set -e
t_end=$(date +%s)
say "root ready in $((t_root - t0)) s; command exit $rc after $((t_end - t_root)) s"
[ "$rc" = 0 ] || die "the README's command exited $rc"
# The build it just did had no rdma-core headers to use (libfabric-dev does not bring them).
[ ! -e "$root/usr/include/infiniband/verbs.h" ] || die "the command installed rdma-core's headers"
# The benchmark's table (afabric/bench/p2p.py render): its header, then at least one row.
grep -Eq '^op +size +win +py GB/s +raw GB/s' "$work/out.log" || die "no benchmark table in the output"
rows=$(grep -Ec '^[a-z]+ +[0-9]+ (B|KiB|MiB)(/pg)? +[0-9]+ +[0-9.]+ +[0-9.]+' "$work/out.log" || true)
[ "$rows" -ge 1 ] || die "the benchmark table has no rows"
say "OK ($rows table rows)"
