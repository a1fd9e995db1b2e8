#!/usr/bin/env bash
# Run a command with Debian's PoCL (pocl-opencl-icd, PoCL 3.1 on LLVM 15) as the
# only OpenCL platform. PyPI's PoCL 3.0 (LLVM 14) cannot build kernels for CPUs
# newer than its LLVM, Debian's can; CI uses this for the kernel path.
#
# Installs the package if it is missing (root and apt-get needed) and removes it
# again afterwards, so the machine's default OpenCL platform stays PyPI's.
#
#   scripts/with-debian-pocl.sh COMMAND [ARGS...]
set -euo pipefail

icd=/etc/OpenCL/vendors/pocl.icd
installed_here=0
if ! dpkg -s pocl-opencl-icd >/dev/null 2>&1; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        echo "with-debian-pocl: pocl-opencl-icd is not installed, and installing it needs root and apt-get" >&2
        exit 1
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pocl-opencl-icd >/dev/null
    installed_here=1
fi
remove() {
    if [ "$installed_here" = 1 ]; then
        DEBIAN_FRONTEND=noninteractive apt-get purge -y -qq pocl-opencl-icd >/dev/null
    fi
}
trap remove EXIT
OCL_ICD_VENDORS="$icd" "$@"
