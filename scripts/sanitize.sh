#!/usr/bin/env bash
# The native shim and the emulated CUDA driver built with AddressSanitizer and
# UndefinedBehaviorSanitizer, then the native, poller, wake-model and stress
# tests and a short soak run under them: the sanitizers slow the process,
# which is what exposes races in the wake path. Any report fails the run.
# It all runs in a copy of the checkout (git's files), so the checkout's own
# shim is never touched: other runs may use it at the same time.
#
# Usage: scripts/sanitize.sh [SOAK_MINUTES]   (PYTHON: the interpreter, .venv's by default)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
soak_minutes=${1:-0.5}
cc=${CC:-cc}
flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g -O1"

copy=$(mktemp -d)
trap 'rm -rf "$copy"' EXIT
git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$copy"
python=$(cd "$(dirname "$python")" && pwd)/$(basename "$python")
cd "$copy" # python -m puts the working folder first: the copy's asyncfence is imported
shim=$copy/asyncfence/_shim.so
# shellcheck disable=SC2086
"$cc" -shared -fPIC -std=c11 -fvisibility=hidden $flags -o "$shim" asyncfence/_native.c

asan=$("$cc" -print-file-name=libasan.so)
ubsan=$("$cc" -print-file-name=libubsan.so)
# The runtime is preloaded into an interpreter that was not built with it:
# leaks are Python's own (never ours to report), and the wheels' bundled
# libraries (PoCL's, pyopencl's ICD loader) must be found by the loader.
site=$("$python" -c 'import pathlib, pyopencl; print(pathlib.Path(pyopencl.__file__).parent.parent)')
bundled=$(find "$site" -maxdepth 2 -type d -name .libs | tr '\n' ':')
export LD_PRELOAD="$asan:$ubsan"
export LD_LIBRARY_PATH="$bundled${LD_LIBRARY_PATH:-}"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:allow_user_segv_handler=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export ASYNCFENCE_EMULATOR_CFLAGS="$flags"
export ASYNCFENCE_CUDA_DRIVER=emulated

SANITIZED_SHIM=$shim "$python" - <<'PY'
import os
from asyncfence._native import shim
native = shim()
assert native is not None, "the sanitized shim did not load"
assert native.path == os.environ["SANITIZED_SHIM"], f"not the sanitized shim: {native.path}"
print("sanitized shim:", native.path)
PY
"$python" -m pytest -p no:cacheprovider -q tests/test_native.py tests/test_poller.py \
    tests/test_wake_model.py tests/test_stress.py
"$python" -m asyncfence soak --minutes "$soak_minutes"
echo "sanitizers: nothing reported"
