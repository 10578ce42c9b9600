#!/usr/bin/env bash
# The GPU machine (no network), one call: NIXL 1.5.1 against afabric with run.sh, from a
# carried copy of the nixl-cu12 wheel with its nixl_ep_cu12 extension left out (the expert-
# parallel torch kernels, unused here: 108 of its 250 MB), .exp/nixl-stripped.zip, unpacked
# as pip would; afabric from .whl-ab/new. Log: $OUT/nixl-gpu.log.
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels new
rm -rf /tmp/site-nixl && mkdir -p /tmp/site-nixl
python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" \
  "$ROOT/.exp/nixl-stripped.zip" /tmp/site-nixl
printf '#!/bin/sh\nPYTHONPATH=/tmp/site-nixl exec python3 "$@"\n' > /tmp/nixl-py
printf '#!/bin/sh\nPYTHONPATH=/tmp/site-new exec python3 -P "$@"\n' > /tmp/afabric-py
chmod +x /tmp/nixl-py /tmp/afabric-py
{
  echo "=== $(nproc) CPUs, $(lscpu | sed -n 's/^Model name: *//p'), $(python3 -V)"
  /tmp/nixl-py -c "import nixl_cu12._api as n; print('nixl', n.__file__)" 2>&1 | tail -3
  TLS_EXTRA=,cuda_copy NIXL_PY=/tmp/nixl-py AFABRIC_PY=/tmp/afabric-py bash docs/bench/issue15/nixl/run.sh "${ROUNDS:-2}"
} 2>&1 | tee "$OUT/nixl-gpu.log"
