#!/usr/bin/env bash
# afabric.moe on the lent GPU machine (kind nvidia-h200-x2): installs the wheel carried in
# .whl-moe/ (built here with tests/gpu/build_moe_wheel.sh), runs tests/gpu/test_moe.py, then
# `afabric bench moe` over NVLink (decode and prefill, NCCL baseline in the same run) and
# over the host proxy (decode). Logs and JSON go to $OUT (at most 8 files come back):
#   setup.log  moe-tests.log  moe-nvlink.json  moe-proxy.json  bench.log  summary.txt
# MOE_ITERS (default 10000), MOE_BASELINE_ITERS (NCCL calls, default: as MOE_ITERS),
# MOE_TESTS=0 (skip the tests), MOE_PROXY=0 (skip the proxy bench), MOE_PROXY_ITERS (10000),
# MOE_WORKLOAD (decode, prefill or both), MOE_BASELINE=0 (skip the NCCL baseline).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
source tests/gpu/common.sh  # the step runner and environment (cwd is the repo root)
export AFABRIC_REQUIRE_GPU=1
SITE=/tmp/afabric-site
{ nvidia-smi -L; nvidia-smi topo -m; "$PY" -c 'import torch, cupy; print(torch.__version__, cupy.__version__, torch.cuda.device_count())'; } \
    >>"$OUT/setup.log" 2>&1
rm -rf "$SITE"
step setup.log install 120 "$PY" -m pip install -q --no-deps --no-index --no-compile --target "$SITE" .whl-moe/afabric-*.whl
export PYTHONPATH=$SITE PATH=$SITE/bin:$PATH
if [ "${MOE_TESTS:-1}" = 1 ]; then
    step moe-tests.log "pytest test_moe.py" "${MOE_TEST_LIMIT:-300}" "$PY" -m pytest -q -rA -x -p no:cacheprovider \
        --import-mode=importlib --noconftest tests/gpu/test_moe.py
fi
BASELINE=(--baseline-iters "${MOE_BASELINE_ITERS:-0}")
[ "${MOE_BASELINE:-1}" = 1 ] || BASELINE=(--no-baseline)
step bench.log "bench moe nvlink" "${MOE_BENCH_LIMIT:-300}" afabric bench moe --path nvlink --iters "${MOE_ITERS:-10000}" \
    --workload "${MOE_WORKLOAD:-both}" "${BASELINE[@]}" --json "$OUT/moe-nvlink.json"
[ "${MOE_PROXY:-1}" = 1 ] && step bench.log "bench moe proxy" "${MOE_PROXY_LIMIT:-150}" afabric bench moe --path proxy --workload decode \
    --iters "${MOE_PROXY_ITERS:-10000}" --no-baseline --json "$OUT/moe-proxy.json"
{ [ ${#FAILS[@]} -eq 0 ] && echo "all steps passed" || printf 'FAILED: %s\n' "${FAILS[@]}"; } | tee "$OUT/summary.txt"
[ ${#FAILS[@]} -eq 0 ]
