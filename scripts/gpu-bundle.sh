#!/usr/bin/env bash
# Build the GPU test target, the GPU benchmark, the command-line tool and (with candle) the
# example in release mode, strip them and pack them into .carry/bundle.tar.xz for the GPU
# machine (which has no Rust); with nixl, also the NIXL runtime (.carry/nixl-runtime.tar.xz).
# Usage: scripts/gpu-bundle.sh [extra features, e.g. candle-example,nixl]
# With candle, set up the CUDA toolchain first: eval "$(../shared/tools/cuda13-toolchain.sh)".
#
# On the GPU machine (carry .carry/bundle.tar.xz and .carry/nixl-runtime.tar.xz):
#   tar -xJf .carry/bundle.tar.xz -C /tmp && tar -xJf .carry/nixl-runtime.tar.xz -C /tmp
#   export LD_LIBRARY_PATH=/tmp/nixl/.nixl_cu13.mesonpy.libs
#   /tmp/bundle/gpu-tests --test-threads=1 && /tmp/bundle/gpu-bench && /tmp/bundle/elastic_kv_cache
#   cd /tmp/bundle && EVMM_PROCESS_BACKEND=cuda EVMM_CLI=$PWD/elastic-vmm ./process-tests broker::
#   (the broker tests with real engine processes, on CUDA chunks)
set -euo pipefail
cd "$(dirname "$0")/.."
features="gpu-tests${1:+,$1}"
out=.carry/bundle
rm -rf "$out" && mkdir -p "$out"
json=$(mktemp)
cargo build --release --features "$features" --test gpu --test processes --bench gpu --bins --message-format=json-render-diagnostics >"$json"
if [[ ",$features," == *",candle,"* || ",$features," == *",candle-example,"* ]]; then
  cargo build --release --features "$features" --example elastic_kv_cache --message-format=json-render-diagnostics >>"$json"
fi
if [[ ",$features," == *",candle-example,"* ]]; then
  cargo build --release --features "$features" --example routed_llama --message-format=json-render-diagnostics >>"$json"
fi
python3 - "$json" "$out" <<'PY'
import json, shutil, sys
src, out = sys.argv[1], sys.argv[2]
names = {("test", "gpu"): "gpu-tests", ("test", "processes"): "process-tests", ("bench", "gpu"): "gpu-bench", ("bin", "elastic-vmm"): "elastic-vmm"}
for line in open(src):
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    kind = m["target"]["kind"][0]
    name = names.get((kind, m["target"]["name"]), m["target"]["name"] if kind == "example" else None)
    if name:
        shutil.copy(m["executable"], f"{out}/{name}")
        print(f"{name}: {m['executable']}")
PY
rm -f "$json"
strip "$out"/*
cp ../shared/tools/torch_probe.py "$out/" 2>/dev/null || true
tar -C .carry -cJf .carry/bundle.tar.xz bundle
rm -rf "$out" # only the archives travel
if [[ ",$features," == *",nixl,"* && ! -e .carry/nixl-runtime.tar.xz ]]; then
  scripts/nixl-runtime.sh --pack >/dev/null
fi
ls -la .carry/
