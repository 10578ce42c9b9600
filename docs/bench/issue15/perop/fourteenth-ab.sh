
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
one_round() {
  local w=$1 p
  for p in shm tcp; do
    echo "--- $w $p $(date +%T)"
    # not -P: trigsplit.py imports latsplit.py from its directory
    PYTHONPATH=/tmp/site-$w timeout 90 "$PY" docs/bench/issue15/trigsplit.py $p writer
    run "$w" 200 -m afabric.cli bench trigger --provider $p | grep -E "^triggered"
  done
}
ab_rounds fourteenth-ab.log one_round
