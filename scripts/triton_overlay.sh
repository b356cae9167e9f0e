#!/usr/bin/env bash
# Run the GPU machine's checks under another Triton than its own (3.6), e.g. the one CI installs.
# A wheel is 190-290 MB and a device call carries at most 64 MiB, so `pack` keeps only what an
# NVIDIA Hopper run needs (no AMD libraries, profilers, CUPTI or ptxas: the machine's Triton lends
# its ptxas, whose version also caps the PTX the newer Triton emits) and strips libtriton's debug
# symbols: Triton 3.9.0 for CPython 3.12 packs to 39 MB. `use`, sourced on the GPU machine, puts
# it in front of the machine's Triton for this shell (PYTHONPATH) without installing anything.
#
#   bash scripts/triton_overlay.sh pack 3.9.0          # here: .triton-overlay/triton-3.9.0.tar.xz
#   source scripts/triton_overlay.sh use 3.9.0         # there (carry .triton-overlay), then e.g.
#   PYTHONPATH=$TRITON_OVERLAY:$PWD python3 -m pytest tests -n 12 -q
cmd=${1:?usage: triton_overlay.sh pack|use VERSION}
version=${2:?usage: triton_overlay.sh pack|use VERSION}
dir=.triton-overlay
archive=$dir/triton-$version.tar.xz
case $cmd in
  pack) (
    set -euo pipefail
    work=$(mktemp -d)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 -d "$work" "triton==$version"
    (cd "$work" && unzip -q triton-*.whl && rm triton-*.whl)
    t=$work/triton
    # the AMD backend keeps its Python files: the wheel's entry points import them
    rm -rf "$t/backends/amd/lib" "$t/backends/amd/include" "$t/backends/nvidia/lib/cupti"* "$t/instrumentation" \
      "$t/plugins" "$t/include" "$t/FileCheck" "$t/_C/libproton.so" "$t/backends/nvidia/bin/ptxas"* \
      "$t/backends/nvidia/bin/nvdisasm"
    find "$t" -name __pycache__ -prune -exec rm -rf {} +
    strip --strip-unneeded "$t/_C/libtriton.so"
    mkdir -p "$dir"
    (cd "$work" && tar -cf - triton triton-*.dist-info) | xz -9 -T0 > "$archive"
    rm -rf "$work"
    echo "$archive: $(du -h "$archive" | cut -f1)" ) ;;
  use)
    native=$(python3 -c "import os, triton; print(os.path.dirname(triton.__file__))")
    export TRITON_OVERLAY=/tmp/triton-overlay-$version
    [ -d "$TRITON_OVERLAY/triton" ] || { mkdir -p "$TRITON_OVERLAY" && tar -xJf "$archive" -C "$TRITON_OVERLAY"; }
    # Triton 3.9 compiles sm_90 with the ptxas it calls ptxas-blackwell: both names get the native one
    export TRITON_PTXAS_PATH=$native/backends/nvidia/bin/ptxas
    export TRITON_PTXAS_BLACKWELL_PATH=$TRITON_PTXAS_PATH
    export TRITON_NVDISASM_PATH=$native/backends/nvidia/bin/nvdisasm
    echo "Triton $version at $TRITON_OVERLAY (ptxas: $("$TRITON_PTXAS_PATH" --version | tail -1))" ;;
  *) echo "triton_overlay.sh: unknown command '$cmd' (expected pack or use)" >&2; return 2 2>/dev/null || exit 2 ;;
esac
