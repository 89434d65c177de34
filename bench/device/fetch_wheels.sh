#!/usr/bin/env bash
# What the lent GPU machine (bench/device/README.md) lacks, as wheels in .whl/ at the repo root (git-ignored through
# the checkout's info/exclude), for `run` with carry [".whl"]:
#   pydantic (+ its core for CPython 3.12, the machine's python), annotated-types, typing-inspection, hjson;
#   DeepSpeed 0.19.8 built here as a pure-Python wheel (its ops JIT-compile there);
#   flash-linear-attention + fla-core 0.6.0 (pure Python, Triton kernels: transformers' Gated DeltaNet path for the
#   Qwen3.5 hybrid, issue 48 (d)); causal-conv1d only if PyPI has a binary wheel for the machine (it has none:
#   transformers then runs its torch convolution, said so in the log).
# 6.1 MB in all, measured 2026-11-29 on the 2-core CPU box (12 s). --aio: also libaio's debs into .aio/ (the NVMe
# offload step of older calls; run_all.sh of issue 48 does not use them).
set -euo pipefail
cd "$(dirname "$0")/../.."
EXCL=$(git rev-parse --git-path info/exclude)  # a worktree's own info/exclude, not .git/info (a file there)
mkdir -p "$(dirname "$EXCL")"
grep -qx '/.whl/' "$EXCL" 2>/dev/null || echo '/.whl/' >> "$EXCL"
rm -rf .whl && mkdir .whl
PLAT=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64)
PYD=$(python -c "import pydantic; print(pydantic.VERSION)")
CORE=$(python -c "import pydantic_core; print(pydantic_core.__version__)")
python -m pip download -q --no-deps --only-binary=:all: "${PLAT[@]}" -d .whl \
    "pydantic==$PYD" "pydantic-core==$CORE" annotated-types typing-inspection hjson
python -m pip wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
python -m pip download -q --no-deps --only-binary=:all: "${PLAT[@]}" -d .whl \
    flash-linear-attention==0.6.0 fla-core==0.6.0
python -m pip download -q --no-deps --only-binary=:all: "${PLAT[@]}" -d .whl causal-conv1d 2>/dev/null \
    || echo "causal-conv1d: PyPI has no binary wheel for CPython 3.12 x86_64 (source only, a CUDA build): not fetched"
ls -la .whl && du -sh .whl
if [ "${1:-}" = "--aio" ]; then
    grep -qx '/.aio/' "$EXCL" || echo '/.aio/' >> "$EXCL"
    rm -rf .aio && mkdir .aio && (cd .aio && apt-get download libaio-dev libaio1) && ls -la .aio
fi
