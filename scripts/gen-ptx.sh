#!/usr/bin/env bash
# Regenerate the PTX of the crate's CUDA kernels (src/backend/kernels/*.cu and
# src/candle/kernels/*.cu -> *.ptx), which is
# committed and embedded with include_str!, so that building the crate needs no CUDA compiler.
# The committed PTX is what nvcc V13.0.88 makes of the source; its header
# names that compiler, and another nvcc writes other bytes. So this script uses that nvcc: the one
# on PATH when it is that version, else the one scripts/cuda-toolchain.sh fetches from PyPI wheels
# (about 100 MB, once).
#
#   scripts/gen-ptx.sh            rewrite the committed PTX
#   scripts/gen-ptx.sh --check    regenerate into a temporary folder and fail if it differs
#
# compute_80: a virtual architecture the driver JIT-compiles for the GPU it runs on (A100, H100,
# H200 and later), once per process and context (the driver caches the result).
set -euo pipefail
cd "$(dirname "$0")/.."
check=0
[[ "${1:-}" == "--check" ]] && check=1
want=V13.0.88
have() { nvcc --version 2>/dev/null | sed -n 's/.*release .*, \(V[0-9.]*\).*/\1/p'; }
[[ "$(have)" == "$want" ]] || eval "$(scripts/cuda-toolchain.sh --wheels --compile-only)"
[[ "$(have)" == "$want" ]] || {
  echo "gen-ptx: need nvcc $want, the one on PATH is $(have)" >&2
  exit 1
}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/elastic-vmm-ptx.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
status=0
for cu in src/backend/kernels/*.cu src/candle/kernels/*.cu; do
  ptx=${cu%.cu}.ptx
  # -lineinfo off and no host compilation: the PTX depends on the source and nvcc alone.
  nvcc -ptx -arch=compute_80 -O3 -std=c++17 -o "$tmp/out.ptx" "$cu"
  if [[ $check == 1 ]]; then
    if ! cmp -s "$tmp/out.ptx" "$ptx"; then
      echo "gen-ptx: $ptx is stale or missing: run scripts/gen-ptx.sh and commit it" >&2
      diff -u "$ptx" "$tmp/out.ptx" | head -20 >&2 || true
      status=1
    fi
  else
    cp "$tmp/out.ptx" "$ptx"
    echo "wrote $ptx"
  fi
done
exit $status
