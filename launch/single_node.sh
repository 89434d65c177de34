#!/usr/bin/env bash
# One node, the deepspeed launcher. Usage:
#   launch/single_node.sh --deepspeed_config ds_configs/llama3-8b-5m.json --model meta-llama/Llama-3.1-8B
#   NUM_GPUS=2 launch/single_node.sh --deepspeed_config ds_configs/tiny-cpu.json      # CPU demo
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${NUM_GPUS:-}" ]]; then
  NUM_GPUS=$(command -v nvidia-smi >/dev/null && nvidia-smi -L | wc -l || echo 2)
fi
# this environment's own JIT-extension cache (DeepSpeed ops): a ~/.cache/torch_extensions shared by
# every venv on the machine is rebuilt by each of them (+50-60 s for FusedAdam)
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$(python -c 'import sys; print(sys.prefix)')/torch_extensions}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
CFG=$(python -c 'import sys; a=sys.argv[1:]; print(a[a.index("--deepspeed_config")+1])' "$@")
# not `python -m ds_longctx.dist.launch`: the package imports ds_longctx.dist.launch first, and runpy then warns
launch_tool() { python -c 'import sys; from ds_longctx.dist.launch import main; sys.exit(main())' "$@"; }
launch_tool layout --deepspeed_config "$CFG" --world "$NUM_GPUS"
# the deepspeed runner through ds_longctx/dist/preemptible.py (run by path: no torch import): a SIGTERM, SIGUSR1 or Ctrl-C
# to this script ends with the step finished, a complete save (with --save) and exit 0; a second SIGTERM ends now
exec python -c 'import runpy, sys; runpy.run_path(sys.argv.pop(1), run_name="__main__")' ds_longctx/dist/preemptible.py \
  --num_gpus "$NUM_GPUS" --master_port "${MASTER_PORT:-29500}" train.py "$@"
