#!/usr/bin/env bash
# Issue 48's device call: every GPU check in ONE command (bench/device/README.md). On the lent machine, from the repo
# root, carry [".whl"] (bench/device/fetch_wheels.sh), timeout_s 570:
#     bash bench/device/run_all.sh                 # RUN_ALL_BUDGET seconds in all (default 555)
# On CPU first, before any device time is spent (tiny sizes, the same scripts and code paths where the CPU has them):
#     bash bench/device/run_all.sh --dry-run
# Steps, in RUN_ALL_ORDER (default below: what did not fit the last call first, issue 48 item (e)); each runs under
# min(its cap, what is left of the budget - 5 s), is skipped with a line when under 20 s is left, and leaves a JSON
# in $OUT with device, date and command at its top level (bench/device/stamp.py; a step that failed or was skipped
# leaves its reason and log tail). Copy them to bench/results/ with the machine and date in the name.
#   mem8b_512k   (a) Llama-3-8B shape, 2 layers, 512K, 1 step, allocator trace (profile.allocator_check, with stacks):
#                max_memory_allocated/reserved, the real reserved per stream, the frames that stranded memory
#                -> issue48_mem8b.json (+ traces in alloc_traces.tar); did not fit the 2026-11-28 call
#   attention    (c) untied vs tied attention at 32K/128K (u=1, 8) -> issue48_attention.json; did not fit either
#   mem8b_256k   (a) the same at 256K, 2 steps, both traced (step 2: steady state) -> issue48_mem8b.json
#   mfu_1b       (b) Llama-3.2-1B shape at 128K: the planner's picks (c) next to DeepSpeed's ALST (a), 2 steps each,
#                tokens/s and MFU (989 TFLOP/s, the one formula) -> issue48_mfu_1b.json
#   rates        the planner's rates on this device (GEMM, HBM, cuDNN attention d=64/128) -> issue48_rates.json
#   hybrid_fla   (d) Qwen3.5-layout hybrid with fla's Gated DeltaNet kernels, SP=2 on one device vs SP=1
#   rl_logprob   (d) the RL log-prob step, SP=2 on one device vs SP=1 (bench/rl_logprob_step.py, when it exists)
#   ring_ulysses (d) ring x Ulysses, SP=2 on one device vs SP=1 (bench/ring_step.py, when it exists)
#                the three (d) steps -> issue48_new_paths.json
# Files back (8 at most): log.txt, issue48_mem8b.json, issue48_attention.json, issue48_mfu_1b.json,
# issue48_rates.json, issue48_new_paths.json, alloc_traces.tar.
set -uo pipefail
cd "$(dirname "$0")/../.."
DRY=0; [ "${1:-}" = "--dry-run" ] && DRY=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BUDGET=${RUN_ALL_BUDGET:-555}; T0=$(date +%s)
LOG="$OUT/log.txt"; : > "$LOG"
ORDER=${RUN_ALL_ORDER:-"mem8b_512k attention mem8b_256k mfu_1b rates hybrid_fla rl_logprob ring_ulysses"}
export RUN_ALL_COMMAND="bash bench/device/run_all.sh${1:+ $1} (RUN_ALL_ORDER='$ORDER' RUN_ALL_BUDGET=$BUDGET)"
TRACES=/tmp/alloc_traces; rm -rf "$TRACES"; mkdir -p "$TRACES"
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ $DRY = 0 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >> "$LOG" 2>&1 || { echo "wheel install failed"; tail -20 "$LOG"; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
    # DeepSpeed 0.19.8's op builder cannot parse the image's arch list ("9.0a": ValueError '0a'), seen 2026-11-26
    export TORCH_CUDA_ARCH_LIST=9.0
    export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    PY=python3; DRYF=""
    export RUN_ALL_DEVICE="$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)"
    { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; nproc; free -g; df -h /tmp; } \
        >> "$LOG" 2>&1
    S512=524288; S256=262144; S128=131072; ATT="--seq 32768 131072 --hpc 1 8 --steps 2 --minimal"
    HYB="--seq3 32768 --depth3 4"; HYBCFG=bench/device/family_stack.json; HYBCAP=95
else
    # the extensions folder of the checkout's venv (or the one the shell names): nothing is built in a dry run
    export PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}
    PY=python; DRYF=--dry-run
    export RUN_ALL_DEVICE="CPU dry run on $(hostname) ($(nproc) cores)"
    S512=256; S256=128; S128=256; ATT="--dry-run"
    # (the torch reference recurrence on a shared 2-core box: two DeepSpeed starts need more than the GPU's cap)
    HYB="--seq3 128 --depth3 4"; HYBCFG=/tmp/run_all_family_fp32.json; HYBCAP=240
    python -c "import json; c = json.load(open('bench/device/family_stack.json')); c['bf16']['enabled'] = False; json.dump(c, open('$HYBCFG', 'w'))"
fi
export DS_LONGCTX_ALLOCATOR_TRACE_DIR=$TRACES
echo "== run_all on $RUN_ALL_DEVICE: order $ORDER, budget ${BUDGET}s" | tee -a "$LOG"
$PY -c "import torch, deepspeed, transformers, pydantic; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__, 'pydantic', pydantic.VERSION)" \
    2>&1 | tail -1 | tee -a "$LOG"

step() {  # step NAME MAX_SECONDS JSON MERGE CMD...: CMD under min(MAX, left - 5 s); then stamp JSON (MERGE: shared file)
    local name=$1 max=$2 json=$3 merge=$4; shift 4
    local lim; lim=$(left); lim=$(( lim - 5 < max ? lim - 5 : max ))
    local mflag=(); [ "$merge" != "-" ] && mflag=(--merge-into "$merge")
    if [ "$lim" -lt 20 ]; then
        echo "== $name: skipped, ${lim}s of the budget left" | tee -a "$LOG"
        $PY bench/device/stamp.py --file "$json" --step "$name" --command "$*" --skipped "${lim}s of the budget left" \
            "${mflag[@]}" >> "$LOG" 2>&1
        return
    fi
    echo "== $name ($(date -u +%T), limit ${lim}s): $*" | tee -a "$LOG"
    local t=$(date +%s)
    # STEP_LIMIT: bench/alst_compare.py keeps each part's cap under it (it writes its JSON before timeout ends it)
    STEP_LIMIT=$lim timeout -k 5 "$lim" "$@" >> "$LOG" 2>&1; local rc=$?
    echo "== $name rc=$rc after $(( $(date +%s) - T0 ))s" | tee -a "$LOG"
    $PY bench/device/stamp.py --file "$json" --step "$name" --command "$*" --rc $rc --wall $(( $(date +%s) - t )) \
        --budget-left "$(left)" --log "$LOG" "${mflag[@]}" >> "$LOG" 2>&1
}
skip() {  # skip NAME WHY JSON MERGE: a step whose path is not in this tree
    echo "== $1: skipped, $2" | tee -a "$LOG"
    $PY bench/device/stamp.py --file "$3" --step "$1" --command "-" --skipped "$2" --merge-into "$4" >> "$LOG" 2>&1
}

MEM="$OUT/issue48_mem8b.json"; NEW="$OUT/issue48_new_paths.json"
for s in $ORDER; do
    case $s in
    mem8b_512k)
        A4=""; [ $DRY = 0 ] && A4="--alloc-check4 1"
        step mem8b_512k 165 "$MEM" - $PY bench/alst_compare.py $DRYF --out "$MEM" --part 4 --seq4 $S512 --steps4 1 \
            $A4 --no-plan4 --cap4 160 ;;
    mem8b_256k)
        A4=""; [ $DRY = 0 ] && A4="--alloc-check4 1,2"
        step mem8b_256k 135 "$MEM" - $PY bench/alst_compare.py $DRYF --out "$MEM" --part 4 --seq4 $S256 --steps4 2 \
            $A4 --no-plan4 --cap4 130 ;;
    attention)
        step attention 60 "$OUT/issue48_attention.json" - $PY bench/gpu_checks.py --part attention $ATT \
            --out "$OUT/issue48_attention.json" ;;
    mfu_1b)
        step mfu_1b 170 "$OUT/issue48_mfu_1b.json" - $PY bench/alst_compare.py $DRYF --out "$OUT/issue48_mfu_1b.json" \
            --part 1 --variants alst,ds_longctx_planned --steps 2 --rounds 1 --seq $S128 --cap1 165 ;;
    rates)
        if [ $DRY = 1 ]; then skip rates "CUDA only (bench/gpu_rates.py)" "$OUT/issue48_rates.json" "$OUT/issue48_rates.json"
        else step rates 40 "$OUT/issue48_rates.json" - env OUT=/tmp/rates_out bash -c \
            "mkdir -p /tmp/rates_out && $PY bench/gpu_rates.py && cp /tmp/rates_out/rates.json $OUT/issue48_rates.json"; fi ;;
    hybrid_fla)
        if [ $DRY = 0 ] && ! $PY -c "import fla" >/dev/null 2>&1; then
            skip hybrid_fla "fla (flash-linear-attention) is not importable: carry its wheels (fetch_wheels.sh)" \
                /tmp/hybrid_fla.json "$NEW"
        else
            step hybrid_fla $((HYBCAP + 5)) /tmp/hybrid_fla.json "$NEW" $PY bench/alst_compare.py --part 3 --cap3 $HYBCAP \
                --config $HYBCFG --model-config bench/device/models/qwen3_5-small.json $HYB \
                --out /tmp/hybrid_fla.json
        fi ;;
    rl_logprob|ring_ulysses)
        f=bench/rl_logprob_step.py; [ $s = ring_ulysses ] && f=bench/ring_step.py
        if [ -f $f ]; then
            step $s 80 /tmp/$s.json "$NEW" $PY $f $DRYF --cap 75 --out /tmp/$s.json
        else
            skip $s "$f is not in this tree (its helper's path has not landed): nothing to run" /tmp/$s.json "$NEW"
        fi ;;
    *) echo "== $s: unknown step (RUN_ALL_ORDER)" | tee -a "$LOG" ;;
    esac
done
if ls "$TRACES"/* >/dev/null 2>&1; then tar -C "$TRACES" -cf "$OUT/alloc_traces.tar" . && ls -la "$TRACES" >> "$LOG"; fi
echo "== done after $(( $(date +%s) - T0 ))s" | tee -a "$LOG"
ls -la "$OUT"
