#!/usr/bin/env bash
# The project's test command (README, command 2); CI's .ci/run calls it on a clean clone.
# On a fresh machine of this kind (Debian, 2 cores, no GPU) it installs what it needs by itself.
#
#   scripts/test.sh          format, lints, every host test
#
# GPU tests are a separate target run on a GPU machine: see README, "GPU tests".
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n== %s\n' "$*"; }

step "format"
cargo fmt --all -- --check

step "lint (default features, GPU targets included)"
cargo clippy --all-targets --features gpu-tests -- -D warnings

step "tests on the host backend (real memfd memory)"
cargo test --release

step "NIXL: the real library (PyPI wheel nixl-cu13), registration and transfers on host memory"
nixl_libs=$(scripts/nixl-runtime.sh) # installs libclang-dev and g++ when missing; cached
# UCX fails on an empty UCX_TLS; it moves host memory with CMA, and over TCP where CMA is blocked.
[[ -v UCX_TLS && -z "$UCX_TLS" ]] && unset UCX_TLS
if [[ -z "${UCX_TLS:-}" ]] && ! python3 - <<'PY'
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
src, dst = ctypes.create_string_buffer(b"cma", 64), ctypes.create_string_buffer(64)
local, remote = iovec(ctypes.cast(dst, ctypes.c_void_p), 64), iovec(ctypes.cast(src, ctypes.c_void_p), 64)
n = libc.process_vm_readv(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
raise SystemExit(0 if n == 64 and dst.raw == src.raw else 1)
PY
then
  echo "CMA (process_vm_readv) is blocked here: UCX_TLS=tcp"
  export UCX_TLS=tcp
fi
# A missing library fails these tests instead of skipping them.
LD_LIBRARY_PATH="$nixl_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ELASTIC_VMM_REQUIRE_NIXL=1 \
  cargo test --release --features nixl --test nixl -- --nocapture

step "every feature (candle with its CUDA backend, NIXL): build and lint, no GPU needed"
# The CUDA 13 compiler comes from PyPI wheels (../shared/tools/cuda13-toolchain.sh, ~130 MB once,
# cached in ~/.cache/cuda13-wheels); candle's kernels take ~5 minutes to compile on 2 cores.
command -v unzip >/dev/null || {
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends unzip
}
(
  eval "$(CUDA13_LINK=0 ../shared/tools/cuda13-toolchain.sh)"
  cargo clippy --all-targets --features gpu-tests,candle,nixl -- -D warnings
)

step "command-line tool: demo and multi-model run"
cargo run --release --quiet -- --backend host demo --sequences 60 --report-every 1000 >/dev/null
cargo run --release --quiet -- --backend host multi --steps 120 --svg target/multi-model.svg >/dev/null

printf '\nall checks passed\n'
