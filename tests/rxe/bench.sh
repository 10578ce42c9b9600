#!/bin/sh
# Numbers for the verbs provider on Soft-RoCE, run INSIDE the qemu guest, next to perftest's
# on the same device in the same boot (Soft-RoCE under TCG emulation is slow: compare the
# ratios, not the absolute figures). From the host:
#   python -m tests.rxe.guest --timeout 590 -- sh tests/rxe/bench.sh
# The p2p run is --quick with one repetition: the full one takes longer than a guest call.
set -u
sizes_h="${SIZES:-8,64K,1M}"
sizes_b="${SIZES_BYTES:-8 65536 1048576}"
echo "== afabric bench p2p --provider verbs --quick --repeat 1 --sizes $sizes_h"
afabric bench p2p --provider verbs --quick --repeat 1 --sizes "$sizes_h" 2>&1
echo
echo "== perftest on rxe0 (GID index 1), same boot"
# the client's -n/-t are what matter; the server follows the client's parameters
for s in $sizes_b; do
    ib_write_bw -d rxe0 -x 1 -s "$s" -n 1000 -t 64 >/dev/null 2>&1 &
    sleep 1
    ib_write_bw -d rxe0 -x 1 -s "$s" -n 1000 -t 64 192.0.2.1 2>&1 | grep -A1 '#bytes' | tail -n +1
    wait
done
ib_write_lat -d rxe0 -x 1 -s 8 -n 2000 >/dev/null 2>&1 &
sleep 1
ib_write_lat -d rxe0 -x 1 -s 8 -n 2000 192.0.2.1 2>&1 | grep -A1 '#bytes'
wait
