
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
one_round() {
  local w=$1
  echo "=== p2p tcp $w $(date +%T)"
  run "$w" 150 -m afabric.cli bench p2p --quick --sizes 4K,64K,1M,16M --repeat 3 \
    --fabtests "$ROOT/.fabtests" --provider tcp | sed -n '/^op /,/^awaited/p' | grep -v "^read\|^paged"
  echo "--- trigger tcp $w $(date +%T)"
  run "$w" 60 -m afabric.cli bench trigger --quick --provider tcp | grep -E "^triggered"
  echo "--- idle tcp $w"; run "$w" 30 docs/bench/issue15/idle.py tcp
}
ab_rounds arrived-ab.log one_round
for w in old new; do
  echo "=== p2p shm $w $(date +%T)"
  run "$w" 150 -m afabric.cli bench p2p --quick --sizes 4K,64K,1M --repeat 3 \
    --fabtests "$ROOT/.fabtests" --provider shm | sed -n '/^op /,/^awaited/p' | grep -v "^read\|^paged"
done 2>&1 | grep --line-buffered -v "^afabric: [0-9]*/" | tee -a "$OUT/arrived-ab.log"
