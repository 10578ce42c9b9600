#!/usr/bin/env bash
# Device, one call: the worker not napping while its own operations are with the provider
# (AFABRIC_EXP_INFLIGHT=1, an experiment switch in the wheel .whl-ab/new, not in the tree:
# worker.c's nap condition gained `&& (!getenv("AFABRIC_EXP_INFLIGHT") || !eng->active.head
# || now - idle_since > 100 ms)`, read once when the worker starts) against the default,
# alternated: bench p2p shm off/on/on/off and tcp off/on (fi_rma_bw beside each
# row), then schedstat.py shm 64 KiB and 1 MiB off/on.
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels new

one() { # one SETTING PROVIDER
  if [ "$1" = on ]; then export AFABRIC_EXP_INFLIGHT=1; else unset AFABRIC_EXP_INFLIGHT; fi
  echo "=== p2p $2 inflight-spin $1 $(date +%T)"
  run new 150 -m afabric.cli bench p2p --quick --sizes 4K,64K,1M,16M --repeat 3 \
    --fabtests "$ROOT/.fabtests" --provider "$2" | sed -n '/^op /,/^awaited/p' | grep -E "^op|^write|^awaited"
}

body() {
  one off shm; one on shm; one on tcp; one off tcp; one on shm; one off shm
  for s in 65536 1048576; do
    for e in off on on off; do
      if [ "$e" = on ]; then export AFABRIC_EXP_INFLIGHT=1; else unset AFABRIC_EXP_INFLIGHT; fi
      echo "--- schedstat shm $s $e"; N=100000 run new 60 docs/bench/issue15/perop/schedstat.py shm $s uvloop
    done
  done
}

logged "${LOG:-twentieth-ab.log}" body
