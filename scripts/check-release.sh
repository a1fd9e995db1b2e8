#!/usr/bin/env bash
# CI's release check: scripts/release.sh builds the sdist and the manylinux
# wheel; then each is installed into a fresh virtualenv, as a user would:
#   - the wheel: the library only, with its shim; the demo; the core tests
#     (fences, waits, the drop queue, the relay) against the installed
#     package, from a copy of tests/ outside the checkout; and the demo on
#     every other CPython 3.10 to 3.13 this machine has (pyenv's), where
#     the same wheel must run;
#   - the sdist: the shim built from it at install; the demo.
#
#   scripts/check-release.sh          (PYTHON: the build's interpreter, default .venv/bin/python)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

PYTHON=$python "$root/scripts/release.sh" "$work/dist"
wheel=$(ls "$work"/dist/asyncfence-*.whl)
sdist=$(ls "$work"/dist/asyncfence-*.tar.gz)
"$python" - "$wheel" <<'PY'
import pathlib, sys, zipfile
wheel = pathlib.Path(sys.argv[1])
python_tag, abi_tag, platform = wheel.stem.split("-")[-3:]
assert (python_tag, abi_tag) == ("py3", "none"), f"{wheel.name} is tied to one Python"
assert "manylinux_2_12_x86_64" in platform.split("."), f"{wheel.name}: not a manylinux tag"
names = zipfile.ZipFile(wheel).namelist()
lab = [n for n in names if not n.startswith(("asyncfence/", "asyncfence-"))]
lab += [n for n in names if any(w in n for w in ("bench", "soak", "measure"))]
assert not lab, f"{wheel.name} carries more than the library: {lab}"
assert "asyncfence/_shim.so" in names, f"{wheel.name} carries no shim"
print(f"wheel: {wheel.name}, {len(names)} files, the library only")
PY

installed_check='
import asyncfence, importlib.metadata, pathlib
from asyncfence._native import shim
assert "site-packages" in asyncfence.__file__, asyncfence.__file__
assert shim() is not None and pathlib.Path(shim().path).is_relative_to(
    pathlib.Path(asyncfence.__file__).parent), "no shim in the installed package"
assert asyncfence.__version__ == importlib.metadata.version("asyncfence")
print("installed:", asyncfence.__file__, asyncfence.__version__)
'

echo "== the wheel, in a fresh virtualenv: the demo, and the core tests against it"
python3 -m venv "$work/wheel"
"$work/wheel/bin/pip" install --quiet --disable-pip-version-check "$wheel[opencl]" \
    pytest pytest-asyncio pytest-timeout trio uvloop hypothesis psutil
tests=$work/tests-outside
mkdir "$tests"
cp -r "$root/tests" "$tests/tests"
cp "$root/pyproject.toml" "$tests/"  # the pytest settings; nothing of the checkout is importable
(cd "$tests" && ../wheel/bin/python -c "$installed_check" \
    && ../wheel/bin/python -m asyncfence demo \
    && ASYNCFENCE_CUDA_DRIVER=none ../wheel/bin/python -m pytest -p no:cacheprovider -q \
        tests/test_fence.py tests/test_poller.py tests/test_drop_queue.py tests/test_relay.py)

for version in 3.10 3.12 3.13; do
    other=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$version".*/bin/python 2>/dev/null | tail -1 || true)
    if [ -z "$other" ]; then
        echo "== (no CPython $version here: the wheel's demo not run on it)"
        continue
    fi
    echo "== the wheel on CPython $version ($other): the demo"
    "$other" -m venv "$work/py$version"
    "$work/py$version/bin/pip" install --quiet --disable-pip-version-check "$wheel[opencl]"
    (cd "$work" && "py$version/bin/python" -c "$installed_check" && "py$version/bin/python" -m asyncfence demo)
done

echo "== the sdist, in a fresh virtualenv: the shim built from it, the demo"
python3 -m venv "$work/sdist"
"$work/sdist/bin/pip" install --quiet --disable-pip-version-check "$sdist[opencl]"
(cd "$work" && sdist/bin/python -c "$installed_check" && sdist/bin/python -m asyncfence demo)
