#!/usr/bin/env bash
# A Triton newer than the lent GPU machine's (3.6.0, whose Hopper miscompile makes fla refuse its gated backward),
# small enough to carry there: the wheel is ~198 MB, nearly all libtriton.so's debug info. What goes:
#   - debug info and local symbols of every ELF file (strip --strip-unneeded keeps the dynamic symbols);
#   - the nvidia backend's binaries (ptxas, ptxas-blackwell, cuobjdump, nvdisasm): bench/gpu.sh points Triton at the
#     image's Triton 3.6.0 copies (TRITON_PTXAS_PATH ...); 3.7.1 bundles the very same ptxas 12.8.93;
#   - cupti and libproton.so: only the proton profiler loads them;
#   - the test-only libraries (libGPUInstrumentationTestLib.so, libTritonPluginsTestLib.so, FileCheck).
# The dist-info stays (fla reads triton.__version__, pip and importlib.metadata the dist-info), and so does the amd
# backend's Python: Triton imports every backend its entry points name.
#
#   bench/triton_minimal.sh [OUT_DIR]    OUT_DIR/triton-VERSION-minimal.tar.xz (default .whl; unpack into a folder
#                                        on PYTHONPATH). TRITON_VERSION (3.7.1), PYVER (3.12) and PIP choose the wheel.
set -euo pipefail
VERSION=${TRITON_VERSION:-3.7.1}
PYVER=${PYVER:-3.12}
mkdir -p "${1:-.whl}"
OUT=$(cd "${1:-.whl}" && pwd)
read -r -a PIP <<< "${PIP:-python3 -m pip}"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

"${PIP[@]}" download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$tmp/dl" "triton==$VERSION"
wheel=$(ls "$tmp"/dl/triton-"$VERSION"-*.whl)
unzip -q "$wheel" -d "$tmp/pkg"
cd "$tmp/pkg"
[ -d "triton-$VERSION.dist-info" ] || { echo "no triton-$VERSION.dist-info in $wheel" >&2; exit 1; }

nvidia=triton/backends/nvidia
rm -rf "$nvidia"/bin/* "$nvidia/lib/cupti" triton/_C/libproton.so triton/FileCheck \
    triton/instrumentation/libGPUInstrumentationTestLib.so triton/plugins/libTritonPluginsTestLib.so
# RECORD would list the removed files: without it pip still reads the version, and nothing checks the hashes.
rm -f "triton-$VERSION.dist-info/RECORD"
find triton -type f -name '*.so*' -print0 | xargs -0 strip --strip-unneeded
# Anything left over 4 MB is a sign that a new release brought another large file to look at.
big=$(find . -type f -size +4M ! -name libtriton.so)
[ -z "$big" ] || echo "note: large files kept: $big" >&2

tarball="$OUT/triton-$VERSION-minimal.tar.xz"
tar --sort=name --owner=0 --group=0 --numeric-owner -cf - triton "triton-$VERSION.dist-info" \
    | xz -9 -T0 > "$tarball.tmp"
mv "$tarball.tmp" "$tarball"
echo "$tarball: $(stat -c %s "$tarball" | awk '{printf "%.1f", $1 / 2^20}') MiB (the wheel: $(du -m "$wheel" | cut -f1) MiB)"
