#!/usr/bin/env bash
# Every GPU check of issue 21 in ONE device command (bench/device/README.md). On the lent machine, from the
# repo root with .whl carried:
#     bash bench/device/run_all.sh            # whole budget: RUN_ALL_BUDGET seconds (default 530)
# On CPU, before any device time is spent (tiny sizes, same code paths where the CPU has them):
#     bash bench/device/run_all.sh --dry-run
# Results go to $OUT (at most 8 files come back): env.txt, attention.json, checks.json, train_metrics.jsonl,
# train_plan.json, nvme.json, long.json, log.txt. Carry [".whl", ".aio"]. Each step writes as it goes and has a limit cut to what is left of
# the budget, so a slow step cannot take the later ones with it.
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
    timeout -k 5 "$lim" "$@" >> "$LOG" 2>&1; local rc=$?
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
    TRAIN_CFG=ds_configs/llama3.2-1b-1gpu.json; TRAIN_MODEL=ds_configs/models/llama3.2-1b.json
    TRAIN_ARGS="--seq-len 131072 --steps 3 --eval-samples 0"; NGPU=1
    LONG="--seq 524288 --hpc 1 8 --steps 1 --minimal"; NV=""
else
    export PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}
    PY=python; DRYF=--dry-run
    echo "dry run on $(hostname)" > "$OUT/env.txt"
    ATT="$DRYF"; VL="$DRYF"
    TRAIN_CFG=ds_configs/tiny-cpu.json; TRAIN_MODEL=ds_configs/models/tiny-llama.json
    TRAIN_ARGS="--seq-len 256 --steps 2 --eval-samples 0"; NGPU=2
    LONG="$DRYF --minimal"; NV="$DRYF"
fi
$PY -c "import torch, deepspeed, transformers, pydantic; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__, 'pydantic', pydantic.VERSION)" \
    2>&1 | tail -1 | tee -a "$OUT/env.txt"

# first what no earlier GPU run has measured: the planner's reserved bytes (train) and keep_attention_output
# f: train.py, world 1, NCCL (gloo on the dry run), ZeRO-3, full stack, ~1B Llama, 3 steps; the planner's
# prediction for the same config and length first (CPU work, seconds)
step plan 60 bash -c "$PY -m ds_longctx.planner.cli plan --deepspeed_config $TRAIN_CFG --model-config $TRAIN_MODEL \
    --gpus $NGPU --gpu-mem h100 --host-mem none --seq-len $(echo $TRAIN_ARGS | awk '{print $2}') --json \
    > $OUT/train_plan.json"
if [ $DRY = 0 ]; then
    # the caching-allocator model (measure/allocator.py) replayed on steps 1-2's real trace, next to
    # max_memory_reserved: the planner's reserved-bytes check (issue 21); CUDA only
    $PY -c "import json,sys; c=json.load(open(sys.argv[1])); c['long_context'].setdefault('profile', {}).update(allocator_check=True, steps=[1, 2]); json.dump(c, open('/tmp/train_cfg.json', 'w'))" "$TRAIN_CFG"
    TRAIN_CFG=/tmp/train_cfg.json
fi
step train 170 $PY -m deepspeed.launcher.runner --num_gpus $NGPU --master_port 29561 train.py \
    --deepspeed_config $TRAIN_CFG --model-config $TRAIN_MODEL $TRAIN_ARGS --no-progress \
    --metrics "$OUT/train_metrics.jsonl"
# c/d/e: varlen vs per-document loop (64 docs), block Function vs HF in bf16, pinned arena bit-exact;
# keep_attention_output on vs off at 128K (issue 20); the block backward's shared tile passes vs one per GEMM
step checks 200 $PY bench/gpu_checks.py --part keep,passes,varlen,block,arena $VL --out "$OUT/checks.json"
# a/b: kernels vs fp32, native GQA probes, sliding windows 1/7/256 + soft-cap on 4K tokens (dense and varlen, vs
# fp64 and the banded kernel), untied vs tied at 32K and 128K (u=1, 8), auto's measured choice (per window pattern)
step attention 200 $PY bench/gpu_checks.py --part kernels,attention $ATT --out "$OUT/attention.json"
# g: NVMe offload through DeepSpeed's async_io op on this machine's disk (builds the op first)
step nvme 120 $PY bench/gpu_checks.py --part nvme $NV --out "$OUT/nvme.json"
# what is left: tied vs untied at 512K (u=1)
step long 200 $PY bench/gpu_checks.py --part attention $LONG --out "$OUT/long.json"
echo "== done after $(( $(date +%s) - T0 ))s" | tee -a "$LOG"
ls -la "$OUT"
