#!/usr/bin/env bash
# Download the wheels the GPU check needs on the GPU machine, which cannot reach a
# package registry: the ones listed in scripts/gpu-wheels.txt (anyio, pytest-asyncio, trio
# and trio's needs), for its Python 3.12 (GPU_PYTHON_VERSION: another, for a
# machine that models it with another Python) on x86-64 Linux, without their
# dependencies (every one needed is listed).
#
#   scripts/fetch-gpu-wheels.sh DIR
#
# Then: scripts/gpu-check.sh OUTDIR DIR on the GPU machine. All of them are
# pure-Python (py3-none-any) wheels: pip accepts those for any --platform given.
set -euo pipefail

dir=${1:?usage: scripts/fetch-gpu-wheels.sh DIR}
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python3}
python_version=${GPU_PYTHON_VERSION:-3.12}

mapfile -t wanted < <(sed -e 's/#.*//' "$here/gpu-wheels.txt" | awk 'NF { print $1 }')
if [ "${#wanted[@]}" = 0 ]; then
    echo "fetch-gpu-wheels: no wheels listed in $here/gpu-wheels.txt" >&2
    exit 1
fi
mkdir -p "$dir"
# A second version of one distribution would stop the whole install there.
for requirement in "${wanted[@]}"; do
    name=${requirement%%==*}
    version=${requirement#*==}
    stem=$(echo "$name" | tr '-' '_')
    for old in "$dir/$stem"-*.whl; do
        [ -e "$old" ] || continue
        case "$old" in
        "$dir/$stem-$version"-*.whl) ;;
        *) echo "fetch-gpu-wheels: removing $old (not $requirement)"; rm -f "$old" ;;
        esac
    done
done
"$python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$python_version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform any \
    -d "$dir" "${wanted[@]}"

missing=0
for requirement in "${wanted[@]}"; do
    stem=$(echo "${requirement%%==*}" | tr '-' '_')
    version=${requirement#*==}
    if ! compgen -G "$dir/$stem-$version-*.whl" >/dev/null; then
        echo "fetch-gpu-wheels: no wheel for $requirement in $dir" >&2
        missing=1
    fi
done
[ "$missing" = 0 ] || exit 1
echo "fetch-gpu-wheels: ${#wanted[@]} wheels in $dir:"
(cd "$dir" && printf '  %s\n' *.whl)
