#!/usr/bin/env bash
# Several nodes from a DeepSpeed hostfile (one "hostname slots=N" line per node; passwordless ssh).
#   HOSTFILE=hostfile launch/multi_node.sh --deepspeed_config ds_configs/llama3-8b-2node-8m.json --model ...
set -euo pipefail
cd "$(dirname "$0")/.."
HOSTFILE=${HOSTFILE:-hostfile}
# this environment's own JIT-extension cache (DeepSpeed ops): a ~/.cache/torch_extensions shared by
# every venv on the machine is rebuilt by each of them (+50-60 s for FusedAdam)
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$(python -c 'import sys; print(sys.prefix)')/torch_extensions}
# (remote nodes get it only through .deepspeed_env: add a TORCH_EXTENSIONS_DIR=... line there)
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
CFG=$(python -c 'import sys; a=sys.argv[1:]; print(a[a.index("--deepspeed_config")+1])' "$@")
# not `python -m ds_longctx.dist.launch`: the package imports ds_longctx.dist.launch first, and runpy then warns
launch_tool() { python -c 'import sys; from ds_longctx.dist.launch import main; sys.exit(main())' "$@"; }
# refuse a hostfile whose slots do not tile the SP groups before any rank starts
launch_tool check-hostfile "$HOSTFILE" --deepspeed_config "$CFG"
MASTER_ADDR=${MASTER_ADDR:-$(awk '!/^#/ && NF {print $1; exit}' "$HOSTFILE")}
# the deepspeed runner through ds_longctx/dist/preemptible.py (see launch/single_node.sh); on several hosts it hands a
# SIGTERM, SIGUSR1 or Ctrl-C to the runner as SIGTERM (DeepSpeed's pdsh path stops launch.py on every node)
exec python -c 'import runpy, sys; runpy.run_path(sys.argv.pop(1), run_name="__main__")' ds_longctx/dist/preemptible.py \
  --hostfile "$HOSTFILE" --master_addr "$MASTER_ADDR" --master_port "${MASTER_PORT:-29500}" \
  train.py "$@"
