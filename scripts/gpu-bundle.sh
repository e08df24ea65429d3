#!/usr/bin/env bash
# Build the GPU test target, the GPU benchmark, the command-line tool and (with candle) the
# example in release mode, strip them and pack them into .carry/bundle.tar.xz for the GPU
# machine (which has no Rust); with nixl, also the NIXL runtime (.carry/nixl-runtime.tar.xz).
# Usage: scripts/gpu-bundle.sh [extra features, e.g. candle-example,nixl]
# It installs what each feature needs to build: with candle or candle-example, a CUDA toolchain
# (scripts/cuda-toolchain.sh: the installed toolkit if there is one, else CUDA 13.0 from PyPI
# wheels); with nixl, libclang and the NIXL runtime (scripts/nixl-runtime.sh).
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
has() { [[ ",$features," == *",$1,"* ]]; }
if has candle || has candle-example; then
  eval "$(scripts/cuda-toolchain.sh)"
fi
if has nixl; then
  # nixl-sys's build script needs libclang; the runtime travels beside the bundle.
  if [[ -e .carry/nixl-runtime.tar.xz ]]; then scripts/nixl-runtime.sh; else scripts/nixl-runtime.sh --pack; fi >/dev/null
fi
out=.carry/bundle
rm -rf "$out" && mkdir -p "$out"
json=$(mktemp)
cargo build --release --features "$features" --test gpu --test processes --bench gpu --bins --message-format=json-render-diagnostics >"$json"
if has candle || has candle-example; then
  cargo build --release --features "$features" --example elastic_kv_cache --message-format=json-render-diagnostics >>"$json"
  cargo build --release --features "$features" --example paged_kv_attention --message-format=json-render-diagnostics >>"$json"
  cargo build --release --features "$features" --example quickstart_routing --message-format=json-render-diagnostics >>"$json"
fi
if has candle-example; then
  cargo build --release --features "$features" --example routed_llama --example serve --message-format=json-render-diagnostics >>"$json"
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
ls -la .carry/
