#!/usr/bin/env bash
# Set-up, the way .ci/run does it: a venv in .venv, torch (CPU build; pass TORCH_SPEC for another),
# ds_longctx with its test extras, libaio-dev (when run as root on Debian/Ubuntu; otherwise install it
# yourself for NVMe offload), and DeepSpeed's JIT ops built once, up front, into the venv's own
# TORCH_EXTENSIONS_DIR (activating the venv sets it). Usage, from the repository root:
#   bash tools/setup.sh && . .venv/bin/activate
# Takes ~4 min for the installs plus a few minutes for the op builds on a 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
if ! command -v c++ >/dev/null 2>&1; then
    echo "setup: no C++ compiler (c++): DeepSpeed builds its ops with one (Debian/Ubuntu: apt-get install g++)" >&2
    exit 1
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && ! dpkg -s libaio-dev >/dev/null 2>&1; then
    echo "setup: installing libaio-dev (DeepSpeed's async_io op: offload=\"nvme\" and its tests)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libaio-dev
fi
[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
# this venv's own JIT-extension cache: one shared ~/.cache/torch_extensions is rebuilt by every venv
export TORCH_EXTENSIONS_DIR="$VIRTUAL_ENV/torch_extensions"
grep -q "TORCH_EXTENSIONS_DIR" .venv/bin/activate ||
    echo 'export TORCH_EXTENSIONS_DIR="$VIRTUAL_ENV/torch_extensions"  # ds_longctx: tools/setup.sh' >> .venv/bin/activate
echo "setup: installing torch and ds_longctx[test] (~4 min)"
python -m pip install -q --upgrade pip
pip install -q "$TORCH_SPEC"
pip install -q -e ".[test]"
# build_op LABEL EXT PYTHON-CODE: run the build, and every 30 s say how long it has run and how many of its object
# files exist (torch's JIT build prints nothing until it ends); a lock left by a killed build is refused first
# (memory.nvme.check_op_build_lock: its path, its age and the fix, within 20 s) instead of waiting on it forever
build_op() {
    local label=$1 ext=$2 code=$3 start=$SECONDS pid n n0
    python -c "from ds_longctx.memory.nvme import check_op_build_lock as c; c('$ext')" || return 1
    # object files anywhere under the extensions directory (async_io builds its pin_memory dependency first)
    n0=$(find "$TORCH_EXTENSIONS_DIR" -name '*.o' 2>/dev/null | wc -l) || n0=0
    python -c "$code" &
    pid=$!
    # if this script ends first (an error, Ctrl-C), the build must not outlive it in a directory being removed
    trap 'kill "$pid" 2>/dev/null || true' EXIT
    while kill -0 "$pid" 2>/dev/null; do
        sleep 1
        if (( (SECONDS - start) % 30 == 0 )) && kill -0 "$pid" 2>/dev/null; then
            # no object file yet is 0, not an error (under pipefail ls's status 2 ended the whole set-up)
            n=$(find "$TORCH_EXTENSIONS_DIR" -name '*.o' 2>/dev/null | wc -l) || n=0
            n=$((n - n0))
            echo "setup: still building $label: $((SECONDS - start)) s, $n object files so far"
        fi
    done
    trap - EXIT
    wait "$pid"
}
echo "setup: building DeepSpeed's FusedAdam op (the first launch would otherwise build it silently, ~3 min)"
build_op FusedAdam fused_adam "from deepspeed.accelerator import get_accelerator as a; a().create_op_builder('FusedAdamBuilder').load()" ||
    echo "setup: warning: FusedAdam did not build; the first launch builds it (or fails with DeepSpeed's message)"
# ranks building the async_io op at once would race, and inside a test it runs under the test's time limit
if python -c "from deepspeed.ops.op_builder import AsyncIOBuilder as B; import sys; sys.exit(not B().is_compatible(verbose=False))"; then
    echo "setup: building DeepSpeed's async_io op (NVMe offload, ~8 min on 2 cores)"
    build_op async_io async_io "from deepspeed.ops.op_builder import AsyncIOBuilder as B; B().load()"
else
    echo "setup: libaio-dev missing: no async_io op; offload=\"nvme\" and its tests are skipped (install it, rerun this)"
fi
echo "setup: done. Next: . .venv/bin/activate"
