#!/usr/bin/env bash
# The KV-cache and weight-transfer systems on the 2x H200 machine, plus all GPU tests as a
# regression, in one device call (the session's device time is scarce):
#
#     pip wheel --no-deps -w .whl .     # here; carried to the machine in .whl/
#     bash tests/gpu/run_systems.sh     # there; logs and JSON go to $OUT (<= 8 files)
#
# Steps (each time-limited; the script goes on after a failed step, exits non-zero if any
# failed): the KV-cache example with prefill on cuda:0 and decode on cuda:1 over nvlink
# (bit-identical check), `afabric bench kvcache --device cuda`, `afabric bench weights`
# with 8 trainers and 4 inference workers (CUDA shards, shm), and every test in tests/gpu.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
source tests/gpu/common.sh  # the step runner and environment (cwd is the repo root)
export AFABRIC_REQUIRE_GPU=1
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
shopt -s nullglob
wheels=(.whl/afabric-*.whl)
[ ${#wheels[@]} -eq 1 ] || { echo "need exactly one .whl/afabric-*.whl" | tee "$OUT/summary.txt"; exit 2; }
rm -rf "$SITE"
step setup.log install 120 "$PY" -m pip install -q --no-deps --no-index --no-compile --target "$SITE" "${wheels[0]}"
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} PATH=$SITE/bin:$PATH
step setup.log "afabric info" 60 afabric info

step kvcache.log "kvcache example (cuda, nvlink)" 120 "$PY" examples/kvcache_disagg.py --device cuda --provider nvlink
step kvcache.log "bench kvcache (cuda, nvlink)" 150 afabric bench kvcache --device cuda --provider nvlink \
    --json "$OUT/kvcache-gpu.json"
step weights.log "bench weights (cuda, shm)" 150 afabric bench weights --trainers 8 --inference 4 \
    --device cuda --provider shm --json "$OUT/weights-cuda-shm.json"
conf=()
"$PY" -c 'import pytest_asyncio' 2>/dev/null || conf=(--noconftest)
step pytest-gpu.log "pytest tests/gpu" 160 "$PY" -m pytest -q -rA -p no:cacheprovider \
    --import-mode=importlib "${conf[@]}" tests/gpu
{ [ ${#FAILS[@]} -eq 0 ] && echo "all steps passed" || { echo "FAILED steps:"; printf '  %s\n' "${FAILS[@]}"; }; } \
    | tee "$OUT/summary.txt"
[ ${#FAILS[@]} -eq 0 ]
