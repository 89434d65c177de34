#!/usr/bin/env bash
# What the lent GPU machine (bench/device/README.md) lacks, as wheels in .whl/ at the repo root (git-ignored
# through .git/info/exclude): pydantic (+ its core for CPython 3.12, the machine's python), hjson, and
# DeepSpeed built here as a pure-Python wheel (its ops JIT-compile there). 4.8 MB, measured 2026-11-26.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.whl/' >> .git/info/exclude; }
rm -rf .whl && mkdir .whl
PYD=$(python -c "import pydantic; print(pydantic.VERSION)")
CORE=$(python -c "import pydantic_core; print(pydantic_core.__version__)")
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    "pydantic==$PYD" "pydantic-core==$CORE" annotated-types typing-inspection hjson
python -m pip wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
ls -la .whl && du -sh .whl
# libaio (runtime + headers) for DeepSpeed's async_io op there: Debian's debs, unpacked by run_all.sh
grep -qx '/.aio/' .git/info/exclude || echo '/.aio/' >> .git/info/exclude
rm -rf .aio && mkdir .aio && (cd .aio && apt-get download libaio-dev libaio1) && ls -la .aio
