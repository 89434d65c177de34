#!/usr/bin/env bash
# Every GPU check of issues 32 and 21 in ONE device command (bench/device/README.md). On the lent machine, from
# the repo root with .whl carried:
#     bash bench/device/run_all.sh            # whole budget: RUN_ALL_BUDGET seconds (default 530)
# On CPU, before any device time is spent (tiny sizes, same code paths where the CPU has them):
#     bash bench/device/run_all.sh --dry-run
# Results go to $OUT (at most 8 files come back): env.txt, log.txt, issue32.json (parts 1-4 merged),
# checks.json, attention.json, nvme.json, long.json. Carry [".whl", ".aio"]. Each step writes as it goes and has
# a limit cut to what is left of the budget, so a slow step cannot take the later ones with it; issue 32's parts
# come first (each with its own cap), issue 21's steps after with what is left.
set -uo pipefail
cd "$(dirname "$0")/../.."
DRY=0; [ "${1:-}" = "--dry-run" ] && DRY=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BUDGET=${RUN_ALL_BUDGET:-530}; T0=$(date +%s)
LOG="$OUT/log.txt"; : > "$LOG"
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
step() {  # step NAME MAX_SECONDS CMD...: runs CMD under min(MAX, what is left - 5 s), output into log.txt
    local name=$1 max=$2; shift 2
    local lim; lim=$(left); lim=$(( lim - 5 < max ? lim - 5 : max ))
    if [ "$lim" -lt 20 ]; then echo "== $name: skipped, ${lim}s left" | tee -a "$LOG"; return; fi
    echo "== $name ($(date -u +%T), limit ${lim}s): $*" | tee -a "$LOG"
    # STEP_LIMIT: bench/alst_compare.py keeps each part's cap under it (writes its JSON before timeout ends it)
    STEP_LIMIT=$lim timeout -k 5 "$lim" "$@" >> "$LOG" 2>&1; local rc=$?
    echo "== $name rc=$rc after $(( $(date +%s) - T0 ))s" | tee -a "$LOG"
}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ $DRY = 0 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >> "$LOG" 2>&1 || { echo "wheel install failed"; tail -20 "$LOG"; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
    # libaio for DeepSpeed's async_io op (NVMe offload): the image lacks it; .aio/ carries Debian's debs
    # (bench/device/fetch_wheels.sh), unpacked outside / and found through the compiler's search paths
    if ls .aio/*.deb >/dev/null 2>&1; then
        mkdir -p /tmp/aioroot && for f in .aio/*.deb; do dpkg -x "$f" /tmp/aioroot; done
        A=/tmp/aioroot/usr; L=$A/lib/x86_64-linux-gnu
        export CFLAGS="-I$A/include" LDFLAGS="-L$L" CPATH=$A/include LIBRARY_PATH=$L LD_LIBRARY_PATH=$L:${LD_LIBRARY_PATH:-}
    fi
    # DeepSpeed 0.19.8's op builder cannot parse the image's arch list ("9.0a": ValueError '0a'), seen 2026-11-26
    export TORCH_CUDA_ARCH_LIST=9.0
    export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    PY=python3
    { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; nproc; free -g; df -h /tmp; } \
        > "$OUT/env.txt" 2>&1
    ATT="--seq 32768 131072 --hpc 1 8 --steps 3"; VL="--varlen-seq 32768 131072 --docs 64 --steps 3 --keep-seq 131072"
    LONG="--seq 524288 --hpc 1 8 --steps 1 --minimal"; NV=""; DRY32=""
else
    export PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}
    PY=python; DRYF=--dry-run
    echo "dry run on $(hostname)" > "$OUT/env.txt"
    ATT="$DRYF"; VL="$DRYF"
    LONG="$DRYF --minimal"; NV="$DRYF"; DRY32="$DRYF"
fi
$PY -c "import torch, deepspeed, transformers, pydantic; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__, 'pydantic', pydantic.VERSION)" \
    2>&1 | tail -1 | tee -a "$OUT/env.txt"

# issue 32 first, parts in order, each with its own cap (bench/alst_compare.py; caps from the measured 25.4 s/step
# of train.py at 128K): 1 ALST vs ds_longctx (shipped, planner's picks) side by side, Llama-3.2-1B shape, 128K,
# bf16, ZeRO-3, 3 steps each, one process per variant, as many a b c rounds as fit (one predicted); 2 reserved
# bytes (allocator_check) and the planner vs (c); 3 SP=2 on one device over gloo vs SP=1; 4 Llama-3-8B shape at 2
# layers, longest length that fits, peak vs the planner. Part 1's (b) is issue 21's former `train` step.
I32="$PY bench/alst_compare.py $DRY32 --out $OUT/issue32.json"
# The H200 call of 2026-11-28 (bench/RESULTS.md "GPU") ran part 1's (a) and (c) side by side, part 4 at 256K and issue
# 21's keep/passes/varlen/block/arena checks; its `attention` step ran out of budget (that step and NVMe/512K ran on
# the H100 on 2026-11-26). Left, in this order: the 8B layer at 512K (256K: 27.8 s step + ~46 s start on the H200;
# 512K predicted ~4x the step), how far the CUDA gradients of keep_attention_output and the shared tile passes are
# from bit-equal, then issue 21's steps again with what is left.
step issue32_part4 200 $I32 --part 4 --cap4 190 --seq4 524288
step checks 120 $PY bench/gpu_checks.py --part keep,passes $VL --out "$OUT/checks.json"
# a/b: kernels vs fp32, native GQA probes, sliding windows 1/7/256 + soft-cap on 4K tokens (dense and varlen, vs
# fp64 and the banded kernel), untied vs tied at 32K and 128K (u=1, 8), auto's measured choice (per window pattern)
step attention 200 $PY bench/gpu_checks.py --part kernels,attention $ATT --out "$OUT/attention.json"
# g: NVMe offload through DeepSpeed's async_io op on this machine's disk (builds the op first)
step nvme 120 $PY bench/gpu_checks.py --part nvme $NV --out "$OUT/nvme.json"
# tied vs untied at 512K (u=1)
step long 120 $PY bench/gpu_checks.py --part attention $LONG --out "$OUT/long.json"
echo "== done after $(( $(date +%s) - T0 ))s" | tee -a "$LOG"
ls -la "$OUT"
