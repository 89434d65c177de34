#!/usr/bin/env bash
# Issue 40 part 5 in ONE short device command: a hybrid (Gated DeltaNet, Qwen3.5 layout: 3 DeltaNet + 1 attention
# layer) and an MLA (DeepSeek-V3: dense then MoE) model of bench/device/models/ through train.py on CUDA, SP=2 on one
# device (two ranks on cuda:0 over gloo, as part 3) vs SP=1, bf16, ZeRO-3, untied + the whole stack
# (bench/device/family_stack.json), 32K tokens. transformers' torch reference recurrence / conv where the image has no
# fla / causal-conv1d. Carry [".whl"]:
#     bash bench/device/run_part5.sh             # on the lent machine; results in $OUT (part5_*.json, log)
#     bash bench/device/run_part5.sh --dry-run   # CPU, fp32, 256 tokens: the same scripts
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LOG="$OUT/part5_log.txt"; : > "$LOG"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
CFG=bench/device/family_stack.json; SEQ=32768; CAP=${PART5_CAP:-130}
if [ "${1:-}" = "--dry-run" ]; then
    PY=python; SEQ=256; CAP=${PART5_CAP:-280}
    export PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}
    python -c "import json; c = json.load(open('$CFG')); c['bf16']['enabled'] = False; json.dump(c, open('/tmp/part5_fp32.json', 'w'))"
    CFG=/tmp/part5_fp32.json
else
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >> "$LOG" 2>&1 || { echo "wheel install failed"; tail -20 "$LOG"; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD TORCH_EXTENSIONS_DIR=/tmp/torch_extensions TORCH_CUDA_ARCH_LIST=9.0
    export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    PY=python3
    nvidia-smi --query-gpu=name,memory.total --format=csv >> "$LOG" 2>&1
fi
$PY -c "import torch, transformers, deepspeed; print('torch', torch.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__)" 2>&1 | tail -1 | tee -a "$LOG"
for m in qwen3_5:4 deepseek_v3:2; do
    name=${m%:*}; depth=${m#*:}
    echo "== $name ($(date -u +%T), cap ${CAP}s)" | tee -a "$LOG"
    timeout -k 5 $((CAP + 20)) $PY bench/alst_compare.py --part 3 --cap3 "$CAP" --config "$CFG" \
        --model-config "bench/device/models/$name-small.json" --seq3 "$SEQ" --depth3 "$depth" \
        --out "$OUT/part5_$name.json" >> "$LOG" 2>&1
    echo "== $name rc=$?" | tee -a "$LOG"
    $PY -c "import json; d = json.load(open('$OUT/part5_$name.json')).get('part3', {}); print('$name', 'losses', d.get('losses'), 'sp2 rcs', d.get('sp2', {}).get('rcs'), (d.get('sp2', {}).get('error') or '')[-600:], (d.get('sp1', {}).get('error') or '')[-600:])" 2>&1 | tee -a "$LOG"
done
