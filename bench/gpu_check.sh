#!/usr/bin/env bash
# What only a GPU shows, in one command (a lent accelerator's minutes are few): the guard's overhead on a
# ~1B-parameter model, bf16 and fp16 (real dynamic loss scaling), with the CUDA runtime's own count of
# synchronising calls per step (set_sync_debug_mode), the guard's skip paths on real kernels, a small model.
#
#   bash bench/gpu_check.sh [OUT_DIR]        # GPU_CHECK_SMALL=1: tiny sizes, to try the script on a CPU
#
# The machine needs torch; DeepSpeed and pydantic come from wheels in .whl/ when present (installed under
# /tmp/site), trainguard from this checkout. Each run's figures land in OUT_DIR/<name>.json, its log beside.
set -u -o pipefail
OUT_DIR=${1:-${OUT:-gpu-out}}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)  # (absolute: the script works from the checkout's root)
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 DS_BUILD_OPS=0
python3 -c "import torch, deepspeed; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu', 'deepspeed', deepspeed.__version__)" \
    2>&1 | tail -1 | tee "$OUT_DIR/versions.txt"

if [ "${GPU_CHECK_SMALL:-0}" = 1 ]; then
    BIG="--d-model 64 --layers 2 --heads 2 --seq 32 --vocab 128 --batch 2"; STEPS=6; SMALL_STEPS=6
else
    BIG="--d-model 2048 --layers 16 --heads 16 --seq 1024 --vocab 32000 --batch 8"; STEPS=80; SMALL_STEPS=300
fi
run() {  # name, then the bench's arguments
    local name=$1; shift
    echo "== $name: $*"
    timeout 200 python3 bench/guard_overhead.py --ranks 1 --out "/tmp/gpu-check/$name" --json "$OUT_DIR/$name.json" "$@" \
        >"$OUT_DIR/$name.log" 2>&1
    local rc=$?
    grep -v -i "synchroniz" "$OUT_DIR/$name.log" | grep -E "guard overhead|ratio|syncs|baseline|Error|error" | tail -8
    echo "   (rc $rc)"
}
run bf16_1b $BIG --dtype bf16 --zero 2 --steps $STEPS --sync-debug
run fp16_1b $BIG --dtype fp16 --zero 2 --steps $STEPS --sync-debug
# the guard's own paths on real kernels: a NaN loss and a spiked batch under fp16 (skip, loss scale kept)
run fp16_faults $BIG --dtype fp16 --zero 2 --steps 40 --warmup 5 \
    --faults '[{"type": "nan_loss", "step": 15, "rank": 0}, {"type": "spike_batch", "step": 30, "rank": 0}]'
python3 - "$OUT_DIR" <<'PY'
import json, sys
from pathlib import Path
for line in open("/tmp/gpu-check/fp16_faults/bench.jsonl"):
    r = json.loads(line)
    if r.get("type") == "event" and r.get("event") not in ("run_start", "run_end"):
        print("  ", r.get("step"), r.get("event"), r.get("action"), json.dumps(r.get("detail"))[:160])
PY
# a small model, where the host's share of the step is largest
run bf16_small --dtype bf16 --zero 2 --steps $SMALL_STEPS --sync-debug
