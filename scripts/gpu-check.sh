#!/usr/bin/env bash
# The GPU check: asyncfence's CUDA tests, its interop tests (PyTorch, CuPy,
# numba-cuda, cuda.core), a parked wait's wake path and completion signal, the
# PyTorch example and the full benchmark's CUDA section, against the real NVIDIA
# driver, in under nine minutes (one 10-minute call of the device tool).
#
#   scripts/gpu-check.sh OUTDIR [WHEELDIR]
#
# OUTDIR receives at most eleven files: summary.json (rewritten after every step,
# so a hang or a kill loses nothing already done), steps.log, pytest.log,
# tests.jsonl (one line per test phase, written as the tests run), junit.xml,
# the full benchmark's bench.json (rewritten after every scenario: a time-out
# leaves what was measured), bench.txt and bench.png, and, only where the full
# run did not finish and time was left, the quick run's bench-quick.json,
# bench-quick.txt and bench-quick.png beside it. WHEELDIR holds the wheels the GPU machine
# lacks (scripts/fetch-gpu-wheels.sh makes it; scripts/gpu-wheels.txt lists
# them): they are installed with --no-index into a private folder, so the
# machine's own packages stay as they are, and each is imported at once. Without
# WHEELDIR the check still runs: trio's cases skip, and pytest-asyncio's ini keys
# are ignored.
#
# The project is used from this checkout (PYTHONPATH), never installed; the
# native wake shim is compiled in place first where a C compiler exists. The
# commit tested is git's where .git is present, else the one that
# scripts/stamp-commit.sh wrote into the tree before it travelled
# (.gpu-check-commit).
#
# Environment: PYTHON (default python3); ASYNCFENCE_CUDA_DRIVER=real (default),
# emulated or auto: emulated runs every step on the test suite's emulated driver
# (tests/cuda_emulator), to check this script on a machine without a GPU, with
# ASYNCFENCE_EMULATED_DRIVER_VERSION=13000 to model a CUDA 13.0 driver;
# ASYNCFENCE_GPU_CHECK_BUDGET, the seconds all steps share (default 520);
# ASYNCFENCE_GPU_CHECK_TEST_TIMEOUT, the seconds one test may take (default 45);
# ASYNCFENCE_GPU_CHECK_BENCH_CAP, the most seconds the full benchmark may take
# (default: what the budget has left, less a minute for the quick fallback);
# ASYNCFENCE_GPU_CHECK_STEPS, the steps to run of probe, tests, example and bench
# (default: all; the others are recorded as not requested, and the check is not
# ok), to check the script itself;
# CUDA_DEVICE_MAX_CONNECTIONS (default here 32, the driver's own is 8): past that
# many streams share hardware queues, which the 64-queue scenarios assume apart.
#
# Exit status: 0 when every step passed, 1 when one failed (summary.json's
# failed_steps says which), 2 when the check could not start.
set -euo pipefail

usage="usage: scripts/gpu-check.sh OUTDIR [WHEELDIR]"
out=${1:?$usage}
wheels=${2:-}
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
report=$root/scripts/gpu_check_report.py
budget=${ASYNCFENCE_GPU_CHECK_BUDGET:-520}
reserve=10 # seconds kept back for the last summary
# Seconds per test (pytest-timeout's signal method: the test fails, the run goes on).
test_timeout=${ASYNCFENCE_GPU_CHECK_TEST_TIMEOUT:-45}
SECONDS=0

fail() { # the check cannot go on: say why, keep what is known, exit 2
    echo "gpu-check: $*" >&2
    if [ -n "${work:-}" ] && [ -d "$work" ]; then
        echo "gpu-check: stopped: $*" >>"$out/steps.log"
        "$python" "$report" note "$work" stopped "reason=$*" || true
        summarize
    fi
    exit 2
}

mode=${ASYNCFENCE_CUDA_DRIVER:-real}
case $mode in
auto) if [ -e /dev/nvidiactl ]; then mode=real; else mode=emulated; fi ;;
real | emulated) ;;
*) fail "ASYNCFENCE_CUDA_DRIVER must be real, emulated or auto; got '$mode'" ;;
esac
export ASYNCFENCE_CUDA_DRIVER=$mode PYTHONUNBUFFERED=1
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}
command -v "$python" >/dev/null || fail "no Python '$python' (set PYTHON)"
command -v timeout >/dev/null || fail "no timeout(1) (coreutils)"

mkdir -p "$out"
out=$(cd "$out" && pwd)
rm -f "$out"/{summary.json,steps.log,pytest.log,tests.jsonl,junit.xml} \
    "$out"/{bench.json,bench.txt,bench.png,bench-quick.json,bench-quick.txt,bench-quick.png}
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
trap 'rm -rf "$work"' EXIT
: >"$out/steps.log"

log() {
    echo "gpu-check: $*" | tee -a "$out/steps.log"
}

summarize() { # rewrite summary.json from what the steps have left so far
    timeout 30 "$python" "$report" summary "$out" "$work" >/dev/null 2>>"$out/steps.log" || true
}

# requested NAME: whether ASYNCFENCE_GPU_CHECK_STEPS asks for step NAME (all by default).
requested() {
    local steps=" ${ASYNCFENCE_GPU_CHECK_STEPS:-probe tests example bench} "
    [[ $steps == *" $1 "* ]]
}

# step NAME CAP LOG COMMAND...: run COMMAND under a timeout of CAP seconds, or of
# what is left of the budget where that is less; its output goes to stdout and to
# LOG. Records the exit status (124: timed out) and returns it.
step() {
    local name=$1 cap=$2 step_log=$3
    shift 3
    local left=$((budget - reserve - SECONDS))
    if [[ " probe tests example bench " == *" ${name%_quick} "* ]] && ! requested "${name%_quick}"; then
        printf '%s\tskipped: not requested\t0\t0\n' "$name" >>"$work/steps.tsv"
        log "$name: not requested (ASYNCFENCE_GPU_CHECK_STEPS)"
        return 0
    fi
    if ((left < 5)); then
        printf '%s\tskipped: out of time\t0\t0\n' "$name" >>"$work/steps.tsv"
        log "$name: skipped, the budget of $budget s is spent"
        summarize
        return 0
    fi
    local limit=$((cap < left ? cap : left)) start=$SECONDS rc=0
    log "== $name (at most $limit s; $left s of the budget left)"
    timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$step_log" || rc=$?
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$limit" "$((SECONDS - start))" >>"$work/steps.tsv"
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        log "$name: timed out after $limit s"
    elif [ "$rc" != 0 ]; then
        log "$name: exit status $rc"
    fi
    summarize
    return "$rc"
}

# The commit: git's, else the stamp written before the tree travelled.
commit=$(git -C "$root" rev-parse HEAD 2>/dev/null || true)
commit_source=git
if [ -z "$commit" ] && [ -s "$root/.gpu-check-commit" ]; then
    commit=$(head -n 1 "$root/.gpu-check-commit")
    commit_source=".gpu-check-commit ($(sed -n 2p "$root/.gpu-check-commit"))"
elif [ -z "$commit" ]; then
    commit=null commit_source="none: no .git and no .gpu-check-commit (scripts/stamp-commit.sh)"
fi
"$python" "$report" note "$work" meta \
    "started=$(date -u +%Y-%m-%dT%H:%M:%SZ)" "machine=$(uname -n)" "driver_mode=$mode" \
    "commit=$commit" "commit_source=$commit_source" \
    "CUDA_DEVICE_MAX_CONNECTIONS=$CUDA_DEVICE_MAX_CONNECTIONS" \
    "emulated_driver_version=${ASYNCFENCE_EMULATED_DRIVER_VERSION:-null}" \
    "wheel_dir=${wheels:-null}" "budget_s=$budget" "python_command=$python" \
    || fail "$python cannot run $report"
log "driver: $mode; commit: $commit ($commit_source); CUDA_DEVICE_MAX_CONNECTIONS=$CUDA_DEVICE_MAX_CONNECTIONS"
log "python: $("$python" -c 'import sys; print(sys.version.split()[0], sys.executable)')"

# -- the carried wheels, imported at once ----------------------------------------------
site=
if [ -n "$wheels" ]; then
    [ -d "$wheels" ] || fail "WHEELDIR '$wheels' is not a folder"
    wheels=$(cd "$wheels" && pwd)
    compgen -G "$wheels/*.whl" >/dev/null \
        || fail "no wheels in '$wheels': make them with scripts/fetch-gpu-wheels.sh '$wheels'"
    site=$work/site
    step wheels 60 "$out/steps.log" "$python" -m pip install -q --no-index --no-deps \
        --no-compile --no-cache-dir --disable-pip-version-check --target "$site" "$wheels"/*.whl \
        || fail "installing the wheels from $wheels failed (see $out/steps.log)"
    export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
fi
# The project itself from the checkout, without touching site-packages.
export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
if [ -n "$site" ]; then
    step imports 30 "$out/steps.log" \
        "$python" "$report" imports "$site" "$root/scripts/gpu-wheels.txt" \
        || fail "a carried wheel does not import (above): WHEELDIR lacks one, or it does not fit"
else
    log "no WHEELDIR: what scripts/gpu-wheels.txt lists comes from the machine, or is missing"
    timeout 30 "$python" "$report" imports "" "$root/scripts/gpu-wheels.txt" 2>&1 \
        | tee -a "$out/steps.log" || true
fi
timeout 60 "$python" -c 'import anyio, asyncfence, cuda.bindings, pytest, pytest_timeout' \
    2>&1 | tee -a "$out/steps.log" \
    || fail "$python needs anyio, cuda-bindings, pytest and pytest-timeout; asyncfence from $root"

# -- the native wake shim, compiled in place ---------------------------------------------
# A plain shared library (no Python C-API), as setup.py builds it: one name for every Python.
shim=$root/asyncfence/_shim.so
source_c=$root/asyncfence/_native.c
read -ra cc <<<"${CC:-cc}"
if [ ! -e "$source_c" ]; then
    "$python" "$report" note "$work" shim built=false "error=no $source_c to build"
    log "no $source_c: the shim is not built"
elif command -v "${cc[0]}" >/dev/null; then
    compiler=$("${cc[@]}" --version 2>/dev/null | head -n 1 || true)
    if step shim 60 "$out/steps.log" "${cc[@]}" -shared -fPIC -O2 -std=c11 -fvisibility=hidden \
        -o "$shim.partial" "$source_c"; then
        mv -f "$shim.partial" "$shim"
        "$python" "$report" note "$work" shim built=true "path=$shim" "compiler=$compiler"
    else
        rm -f "$shim.partial"
        stale=$([ -e "$shim" ] && echo "$shim" || echo null)
        "$python" "$report" note "$work" shim built=false "compiler=$compiler" \
            "error=the compiler failed (steps.log)" "stale=$stale"
    fi
else
    "$python" "$report" note "$work" shim built=false "error=no C compiler (${cc[0]})" \
        "stale=$([ -e "$shim" ] && echo "$shim" || echo null)"
    log "no C compiler (${cc[0]}): the shim is not built; parked waits are re-checked on the loop"
fi

# -- the driver: the real one, or the emulated one for every process -------------------------
with_driver=(env)
if [ "$mode" = emulated ]; then
    emulator=$(timeout 120 "$python" -c 'from tests.cuda_emulator import build; print(build())') \
        || fail "cannot build the emulated driver (tests/cuda_emulator; it needs a C compiler)"
    # The tests load it themselves (tests/conftest.py); the other steps find it here.
    with_driver=(env "LD_LIBRARY_PATH=$(dirname "$emulator")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
    log "emulated driver: $emulator (version ${ASYNCFENCE_EMULATED_DRIVER_VERSION:-its default})"
fi

step versions 40 "$out/steps.log" "${with_driver[@]}" "$python" "$report" versions "$work" || true
step probe 40 "$out/steps.log" "${with_driver[@]}" "$python" "$report" probe "$work" || true

# -- the tests -------------------------------------------------------------------------------
cd "$root"
test_files=(tests/test_cuda.py tests/test_interop.py tests/test_torch_cpu.py tests/test_torch_server.py
    tests/test_relay.py tests/test_engine.py)
pytest_args=(
    -p no:cacheprovider -o addopts= --strict-markers -rA --durations=20
    -o timeout_method=signal --timeout "$test_timeout"
)
# pyproject.toml's asyncio_* ini keys are pytest-asyncio's: without it pytest warns
# that they are unknown, and filterwarnings = error makes that fatal. The CUDA and
# interop tests need only anyio's plugin.
without_asyncio=(-p no:asyncio -W "ignore:Unknown config option:pytest.PytestConfigWarning")
if ! "$python" -c 'import importlib.metadata as m, sys
sys.exit(all(e.name != "asyncfence" for e in m.entry_points(group="pytest11")))'; then
    pytest_args+=(-p asyncfence.pytest_plugin) # not installed: load the plugin by hand
fi
if "$python" -c 'import pytest_asyncio' 2>/dev/null; then
    # Collect once first: should pytest-asyncio not load with this pytest, run without it.
    if timeout 60 "$python" -m pytest "${pytest_args[@]}" --strict-config --collect-only -q \
        "${test_files[@]}" >"$work/collect.txt" 2>&1; then
        pytest_args+=(--strict-config)
        asyncio_plugin=used
    else
        tail -n 25 "$work/collect.txt" | tee -a "$out/steps.log"
        log "collecting with pytest-asyncio failed (above): the tests run without it"
        pytest_args+=("${without_asyncio[@]}")
        asyncio_plugin="dropped: collecting with it failed (steps.log)"
    fi
else
    log "pytest-asyncio is absent: its ini keys are ignored"
    pytest_args+=("${without_asyncio[@]}")
    asyncio_plugin=absent
fi
"$python" "$report" note "$work" pytest "asyncio_plugin=$asyncio_plugin" \
    "args=${pytest_args[*]} ${test_files[*]}"
step tests 130 "$out/pytest.log" env "ASYNCFENCE_GPU_CHECK_LOG=$out/tests.jsonl" \
    "PYTHONPATH=$root/scripts:$PYTHONPATH" "$python" -m pytest "${pytest_args[@]}" \
    --junitxml="$out/junit.xml" -p gpu_check_log "${test_files[@]}" || true

# -- the PyTorch example (it says so and exits 0 where torch or a GPU is missing) ---------------
# Never on the emulated driver: PyTorch would load it and fail beyond what it emulates.
step example 45 "$work/example.txt" "$python" "$root/examples/torch_pipeline.py" || true
cat "$work/example.txt" >>"$out/steps.log" 2>/dev/null || true
# Fences across processes on CUDA: the consumer's device waits on the producer's event.
step cross_process 45 "$work/cross_process.txt" "${with_driver[@]}" "$python" \
    "$root/examples/cross_process.py" cuda || true
cat "$work/cross_process.txt" >>"$out/steps.log" 2>/dev/null || true

# -- the benchmark's CUDA section: the full run, and a quick one only beside it --------------
# The full run rewrites bench.json after every scenario, so a time-out keeps
# what it measured; the quick fallback writes files of its own, never those.
bench_files() { # bench_files STEM: the --json (and --plot) arguments for OUTDIR/STEM.*
    echo --json "$out/$1.json"
    if "$python" -c 'import matplotlib' 2>/dev/null; then echo --plot "$out/$1.png"; fi
}
quick_reserve=60
left=$((budget - reserve - SECONDS))
bench_cap=${ASYNCFENCE_GPU_CHECK_BENCH_CAP:-$((left - quick_reserve))}
if ((bench_cap < 30)); then bench_cap=30; fi # step() still stops at the budget
# shellcheck disable=SC2046
if ! step bench "$bench_cap" "$out/bench.txt" "${with_driver[@]}" \
    "$python" -m benchmarks bench --device cuda $(bench_files bench); then
    # Out of time or failed: a quick run too, beside it, so that every
    # scenario is measured at least roughly; the full run's partial result stays.
    # shellcheck disable=SC2046
    step bench_quick 50 "$out/bench-quick.txt" "${with_driver[@]}" \
        "$python" -m benchmarks bench --quick --device cuda $(bench_files bench-quick) || true
fi

touch "$work/done"
log "all steps done in $SECONDS s; the summary: $out/summary.json"
rc=0
timeout 30 "$python" "$report" summary "$out" "$work" || rc=$?
[ "$rc" = 0 ] || [ "$rc" = 1 ] || rc=1
exit "$rc"
