#!/usr/bin/env bash
# The KV-cache transfer on the 2x H200 machine: prefill on cuda:0, decode on cuda:1.
# Run from the repository root after building the wheel here (as for run_device.sh):
#
#     rm -rf .whl && pip wheel -q --no-deps -w .whl .     # here; carried with carry=[".whl"]
#     bash tests/gpu/run_kvcache.sh                        # there; logs go to $OUT
#
# KV_PROVIDER picks the transport between the GPUs (default nvlink, the CUDA-peer provider;
# any provider that registers CUDA memory works, e.g. KV_PROVIDER=shm on a libfabric built
# with FI_HMEM). Steps (each time-limited; the script goes on after a failure and exits
# non-zero at the end if any failed):
#   1. the CUDA layer-clock bump (a CuPy kernel queued on torch's stream) moves a watcher;
#   2. examples/kvcache_disagg.py --device cuda: 6 concurrent prompts, KV bit-identical;
#   3. afabric bench kvcache --device cuda (4K/32K/128K tokens, 32 KiB pages, a Llama-3-8B
#      layer x 8), and the same with --quick as a fallback smoke run.
# Files written to $OUT: kvcache-setup.log kvcache.log kvcache-gpu.json kvcache-summary.txt
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-$ROOT/device-out}
mkdir -p "$OUT"
source tests/gpu/common.sh  # the step runner and environment (cwd is the repo root)
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
P=${KV_PROVIDER:-nvlink}

# ---- install the wheel (unless run_device.sh already did, into the same place) ----
if ! PYTHONPATH=$SITE "$PY" -c 'import afabric.kvcache' 2>/dev/null; then
    shopt -s nullglob
    wheels=(.whl/afabric-*.whl)
    if [ ${#wheels[@]} -ne 1 ]; then
        echo "need exactly one .whl/afabric-*.whl (build it with 'pip wheel --no-deps -w .whl .')" \
            | tee -a "$OUT/kvcache-setup.log"
        echo "FAILED: no wheel" >"$OUT/kvcache-summary.txt"
        exit 2
    fi
    rm -rf "$SITE"
    step kvcache-setup.log install 300 "$PY" -m pip install -q --no-deps --no-index --no-compile \
        --target "$SITE" "${wheels[0]}"
fi
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
export PATH=$SITE/bin:$PATH
{
    nvidia-smi -L 2>/dev/null
    "$PY" -c 'import torch, cupy; print("torch", torch.__version__, "cupy", cupy.__version__, "gpus", torch.cuda.device_count())'
} 2>&1 | tee -a "$OUT/kvcache-setup.log"
if command -v afabric >/dev/null; then AFABRIC=(afabric); else AFABRIC=("$PY" -m afabric.cli); fi
step kvcache-setup.log "afabric info" 120 "${AFABRIC[@]}" info

# ---- 1. the layer-clock bump from a CUDA stream ----
step kvcache.log "cuda bump" 120 "$PY" - <<'EOF'
import asyncio, time, torch
import afabric
from afabric.kvcache.bump import Bumper

async def main():
    async with afabric.Engine("shm") as eng:  # any provider: the watcher is the shim's
        w = eng.uvm_watcher(device=0)
        bump = Bumper(w)
        torch.cuda.set_device(0)
        a = torch.randn(4096, 4096, device="cuda:0")
        t0 = time.monotonic()
        for _ in range(8):  # "layers": a matmul, then the bump queued behind it
            a = (a @ a).clamp_(-1, 1)
            bump()
        enqueued = time.monotonic() - t0
        await asyncio.wait_for(w.wait_for(8), 30)
        print(f"watcher reached {w.value} (8 bumps queued in {enqueued * 1e3:.2f} ms, seen after "
              f"{(time.monotonic() - t0) * 1e3:.2f} ms)")
        assert w.value == 8
        w.close()

asyncio.run(main())
EOF

# ---- 2. the example: prefill cuda:0 -> decode cuda:1, bit-identical ----
step kvcache.log "example --device cuda ($P)" 300 "$PY" examples/kvcache_disagg.py --device cuda --provider "$P"

# ---- 3. the benchmark ----
step kvcache.log "bench kvcache --device cuda ($P)" 540 "${AFABRIC[@]}" bench kvcache --device cuda \
    --provider "$P" --json "$OUT/kvcache-gpu.json"
if [ ! -s "$OUT/kvcache-gpu.json" ]; then
    step kvcache.log "bench kvcache --device cuda --quick ($P)" 240 "${AFABRIC[@]}" bench kvcache \
        --device cuda --provider "$P" --quick --json "$OUT/kvcache-gpu.json"
fi

{
    if [ ${#FAILS[@]} -eq 0 ]; then
        echo "kvcache: all steps passed (provider $P)"
    else
        echo "kvcache: FAILED steps (provider $P):"
        printf '  %s\n' "${FAILS[@]}"
    fi
} | tee "$OUT/kvcache-summary.txt"
[ ${#FAILS[@]} -eq 0 ]
