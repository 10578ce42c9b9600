#!/usr/bin/env bash
# Device, one call: the twenty-third session's tree (.whl-ab/new): the issue's table in one
# run — the standard rows (bench p2p shm, tcp, cma against fi_rma_bw; trigger; idle), the
# `--polling spin` shm column, fabtests' pair.sh rows — then NIXL 1.5.1 against afabric with
# both sides' buffers in huge pages (nixl/run.sh, NIXL_HUGEPAGES=1; carry .exp with
# nixl-stripped.zip), which the twenty-second session measured on the 2-core machine only.
# Here (2-core): LOG=local-twentythird-final.log PY=.venv/bin/python OUT=/tmp NIXL_PY=... AFABRIC_PY=...
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels new

rows() {
  standard_rows new
  echo "=== p2p shm --polling spin new $(date +%T)"
  run new 200 -m afabric.cli bench p2p --quick --sizes 4K,64K,1M,16M --repeat 3 \
    --fabtests "$ROOT/.fabtests" --provider shm --polling spin | sed -n '/^op /,/^awaited/p'
  fi_pairs
}

logged "${LOG:-twentythird-final.log}" rows
if [ -z "${NIXL_PY:-}" ]; then
  rm -rf /tmp/site-nixl && mkdir -p /tmp/site-nixl
  "$PY" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" \
    "$ROOT/.exp/nixl-stripped.zip" /tmp/site-nixl
  printf '#!/bin/sh\nPYTHONPATH=/tmp/site-nixl exec python3 "$@"\n' > /tmp/nixl-py
  printf '#!/bin/sh\nPYTHONPATH=/tmp/site-new exec python3 -P "$@"\n' > /tmp/afabric-py
  chmod +x /tmp/nixl-py /tmp/afabric-py
  NIXL_PY=/tmp/nixl-py AFABRIC_PY=/tmp/afabric-py TLS_EXTRA=,cuda_copy
fi
{
  echo "=== NIXL against afabric, huge pages, $(nproc) CPUs, $(lscpu | sed -n 's/^Model name: *//p')"
  NIXL_HUGEPAGES=1 NIXL_PY=$NIXL_PY AFABRIC_PY=${AFABRIC_PY:-/tmp/afabric-py} TLS_EXTRA=${TLS_EXTRA:-} \
    bash docs/bench/issue15/nixl/run.sh "${ROUNDS:-2}"
} 2>&1 | grep --line-buffered -v "^afabric: [0-9]*/" | tee "$OUT/nixl-${LOG:-twentythird-final.log}"
