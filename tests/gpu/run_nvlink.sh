#!/usr/bin/env bash
# The nvlink provider's checks on a lent GPU machine: installs the wheel built here, runs
# tests/gpu/test_nvlink.py, test_nvlink_read.py (and test_cuda_register.py as a smoke) and
# `afabric bench p2p --provider nvlink` (nvlink writes against cudaMemcpyPeerAsync of the same
# bytes, same run). On one GPU (kind nvidia-h200) everything runs between processes sharing
# cuda0 and the cross-GPU cases skip; on two or more (nvidia-h200-x2) both run. Run after
#
#     rm -rf .whl && pip wheel -q --no-deps -w .whl .       # here; carried in .whl/
#     bash tests/gpu/run_nvlink.sh                          # there; logs go to $OUT
#
# Writes (at most 8 files come back): setup.log pytest-nvlink.log bench-nvlink.log
# p2p-nvlink.json summary.txt. Goes on after a failed step; exits non-zero if any failed.
# BENCH_ARGS adds arguments to the bench (e.g. "--quick"); WHEEL_DIR is where the wheel is (.whl).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
# NVLink multicast stays off on the shared GPU hosts (afabric never asks for it).
source tests/gpu/common.sh  # the step runner and environment (cwd is the repo root)
export AFABRIC_REQUIRE_GPU=${AFABRIC_REQUIRE_GPU:-1}

{
    echo "date: $(date -Is)  host: $(hostname)  cpus: $(nproc)"
    nvidia-smi -L
    nvidia-smi topo -m
    nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1
} 2>&1 | tee -a "$OUT/setup.log"

shopt -s nullglob
WHEEL_DIR=${WHEEL_DIR:-.whl}
wheels=("$WHEEL_DIR"/afabric-*.whl)
if [ ${#wheels[@]} -ne 1 ]; then
    echo "need exactly one $WHEEL_DIR/afabric-*.whl (found ${#wheels[@]})" | tee -a "$OUT/setup.log"
    echo "FAILED: no wheel" >"$OUT/summary.txt"
    exit 2
fi
rm -rf "$SITE"
step setup.log install 300 "$PY" -m pip install -q --no-deps --no-index --no-compile --target "$SITE" "${wheels[0]}"
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
step setup.log "afabric info" 120 "$PY" -m afabric.cli info

step pytest-nvlink.log "pytest test_nvlink*.py test_cuda_register.py" ${PYTEST_LIMIT:-240} "$PY" -m pytest -q -rA \
    -p no:cacheprovider --import-mode=importlib --noconftest -o timeout=90 --durations=0 \
    tests/gpu/test_nvlink.py tests/gpu/test_nvlink_read.py tests/gpu/test_cuda_register.py
# shellcheck disable=SC2086 # BENCH_ARGS is a list of words
step bench-nvlink.log "bench p2p nvlink" ${BENCH_LIMIT:-200} "$PY" -m afabric.cli bench p2p --provider nvlink \
    --json "$OUT/p2p-nvlink.json" ${BENCH_ARGS:-}
ls /dev/shm | grep -c afabric-nvl | sed 's/^/nvlink segments left in \/dev\/shm: /' | tee -a "$OUT/setup.log"

{
    if [ ${#FAILS[@]} -eq 0 ]; then echo "all steps passed"; else echo "FAILED steps:"; printf '  %s\n' "${FAILS[@]}"; fi
} | tee "$OUT/summary.txt"
[ ${#FAILS[@]} -eq 0 ]
