#!/usr/bin/env bash
# The GPU check: run asyncfence's CUDA tests, its interop tests and the
# benchmark's CUDA section against the real NVIDIA driver, in a few minutes.
#
#   scripts/gpu-check.sh OUTDIR [WHEELDIR]
#
# OUTDIR receives summary.json, pytest.log, junit.xml and (once the benchmark
# exists) bench.json and bench.txt. WHEELDIR, if given, holds wheels for what the
# machine lacks (pytest, pytest-asyncio, trio, ...); they are installed with
# --no-index into a private folder, so the machine's own packages (torch, CuPy,
# numba-cuda, cuda-bindings, cuda-core, anyio, uvloop) stay as they are.
# ASYNCFENCE_CUDA_DRIVER=emulated runs the same steps on the emulated driver, to
# check the script itself on a machine without a GPU.
set -uo pipefail

out=${1:?usage: scripts/gpu-check.sh OUTDIR [WHEELDIR]}
wheels=${2:-}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)
python=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export ASYNCFENCE_CUDA_DRIVER=${ASYNCFENCE_CUDA_DRIVER:-real}
started=$(date -u +%Y-%m-%dT%H:%M:%SZ)

if [ -n "$wheels" ]; then
  site=$(mktemp -d)
  "$python" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels"/*.whl \
    || { echo "gpu-check: installing wheels from $wheels failed" >&2; exit 2; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
# The project itself from the checkout, without touching site-packages.
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"

cd "$root"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
  >"$out/nvidia-smi.txt" 2>&1 || echo "no nvidia-smi" >"$out/nvidia-smi.txt"

timeout 150 "$python" -m pytest -p no:cacheprovider -o addopts="" -ra \
  --junitxml="$out/junit.xml" tests/test_cuda.py tests/test_interop.py 2>&1 | tee "$out/pytest.log"
tests_rc=${PIPESTATUS[0]}

bench_rc=skipped
if "$python" -c "import asyncfence._bench" 2>/dev/null; then
  timeout 110 "$python" -m asyncfence bench --device cuda --json "$out/bench.json" \
    --plot "$out/bench.png" 2>&1 | tee "$out/bench.txt"
  bench_rc=${PIPESTATUS[0]}
  if [ "$bench_rc" != 0 ]; then  # out of time: the quick form, so something is measured
    timeout 40 "$python" -m asyncfence bench --device cuda --quick --json "$out/bench.json" \
      2>&1 | tee "$out/bench.txt"
    bench_rc="full: $bench_rc, quick: ${PIPESTATUS[0]}"
  fi
fi

"$python" - "$out" "$started" "$tests_rc" "$bench_rc" <<'PY'
import json, platform, sys, xml.etree.ElementTree as ET
from pathlib import Path

out, started, tests_rc, bench_rc = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
summary = {
    "started": started,
    "machine": platform.node(),
    "gpu": (out / "nvidia-smi.txt").read_text().strip(),
    "tests_exit_code": tests_rc,
    "bench_exit_code": bench_rc,
}
header = [l for l in (out / "pytest.log").read_text().splitlines() if "CUDA driver" in l]
summary["driver_used"] = header[0] if header else "unknown"
try:
    suite = ET.parse(out / "junit.xml").getroot().find("testsuite")
    summary["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    summary["failed"] = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
except (OSError, ET.ParseError, AttributeError) as error:
    summary["tests"] = f"no junit report: {error}"
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary, indent=2))
PY
exit "$tests_rc"
