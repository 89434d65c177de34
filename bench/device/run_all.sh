#!/usr/bin/env bash
# One device call's worth of GPU checks (bench/device/README.md). Runs on the lent machine from the repo
# root with .whl carried:   bash bench/device/run_all.sh attention   (then: bash bench/device/run_all.sh memory)
# Writes JSON and logs under $OUT (what comes back). Each step has its own time limit so one slow step
# cannot eat the call's 10 minutes.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, deepspeed, transformers, pydantic; print(torch.__version__, torch.version.cuda, deepspeed.__version__, transformers.__version__, pydantic.VERSION)" | tee "$OUT/versions.txt"
step() {  # step NAME SECONDS CMD...
    local name=$1 secs=$2; shift 2
    echo "== $name ($(date -u +%T), limit ${secs}s): $*"
    timeout "$secs" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log"; tail -3 "$OUT/$name.log"
}
case "${1:-attention}" in
  attention)  # kernel parity vs fp32 + untied vs tied speed/memory (issue 13's targets: >= 0.97x @128K)
    step gpu_attention_short 200 python3 bench/gpu_attention.py --seq 32768 --steps 3 --json "$OUT/gpu_attention_32k.json"
    step gpu_attention_long 330 python3 bench/gpu_attention.py --seq 131072 --steps 3 --hpc 1 8 --json "$OUT/gpu_attention_128k.json"
    ;;
  memory)     # memory stack ablation (incl. the block Function and the pinned arena) + planner vs max_memory_*
    step gpu_memory_stack 300 python3 bench/gpu_memory_stack.py --out "$OUT/gpu_memory_stack.json"
    step gpu_planner_check 240 python3 bench/gpu_planner_check.py --out "$OUT/gpu_planner_check.json"
    ;;
  *) echo "usage: run_all.sh attention|memory"; exit 2 ;;
esac
