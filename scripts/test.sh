#!/usr/bin/env bash
# The project's test command (README, command 2); CI's .ci/run calls it on a clean clone.
# On a fresh machine of this kind (Debian, 2 cores, no GPU) it installs what it needs by itself.
#
#   scripts/test.sh          format, lints, docs, the crate as packaged, every host test, NIXL,
#                            every feature (candle, NIXL), the CLI
#
# Everything is built and run in ONE cargo profile, `ci` (Cargo.toml): optimised like release,
# with debug assertions and overflow checks on, so the tests catch broken invariants and
# wrapping arithmetic at release speed, and nothing is built twice for two profiles. It lives in
# <target dir>/ci, wherever CARGO_TARGET_DIR points; files the script writes go to a temporary
# folder, never into ./target. Each step's wall time is printed at the end.
#
# GPU tests are a separate target run on a GPU machine: see README, "GPU tests".
set -euo pipefail
cd "$(dirname "$0")/.."

profile=ci
tmp=$(mktemp -d "${TMPDIR:-/tmp}/elastic-vmm-test.XXXXXX")

# Step timing: microseconds from bash's EPOCHREALTIME, no external tools.
now_us() { local t=${EPOCHREALTIME/[.,]/}; echo "$((10#$t))"; }
script_start=$(now_us)
step_name=""
step_start=0
timings=()
end_step() {
  [[ -n "$step_name" ]] || return 0
  local ms=$((($(now_us) - step_start) / 1000))
  timings+=("$(printf '%6d.%01ds  %s' $((ms / 1000)) $((ms % 1000 / 100)) "$step_name")")
  step_name=""
}
step() {
  end_step
  step_name="$*"
  step_start=$(now_us)
  printf '\n== %s\n' "$*"
}
finish() {
  local rc=$?
  end_step
  rm -rf "$tmp"
  local ms=$((($(now_us) - script_start) / 1000))
  printf '\nwall time per step (profile %s):\n' "$profile"
  printf '  %s\n' "${timings[@]}"
  printf '  %6d.%01ds  total%s\n' $((ms / 1000)) $((ms % 1000 / 100)) "$([[ $rc -ne 0 ]] && echo ", FAILED (exit $rc)")"
}
trap finish EXIT
# A value from the package's manifest (cargo metadata): m is the metadata, p our package.
manifest() {
  cargo metadata --no-deps --format-version 1 |
    python3 -c "import json, sys; m = json.load(sys.stdin); p = m['packages'][0]; print($1)"
}

step "format"
cargo fmt --all -- --check

step "lint (default features, GPU targets included)"
cargo clippy --profile "$profile" --all-targets --features gpu-tests -- -D warnings

step "lint (the library alone, no default features: no clap, no tracing-subscriber)"
cargo clippy --profile "$profile" --lib --no-default-features -- -D warnings

step "docs, warnings and broken intra-doc links as errors (default features; the library alone)"
# After the lints: the dependencies' metadata they checked is what rustdoc reads.
RUSTDOCFLAGS="-D warnings" cargo doc --profile "$profile" --no-deps
RUSTDOCFLAGS="-D warnings" cargo doc --profile "$profile" --no-deps --lib --no-default-features

step "the crate as published (cargo package): its default features and docs build from it alone"
# What the package holds is Cargo.toml's `include`. Unpacked into the temporary folder and checked
# in our target folder, it shares the lints' dependencies (cargo package's own verification would
# build them all again, unoptimised).
cargo package --no-verify --allow-dirty --quiet
target_dir=$(manifest 'm["target_directory"]')
version=$(manifest 'p["version"]')
# -m: the files get the time of unpacking, not the package's fixed one (long past: cargo
# would take an earlier check of changed sources as fresh).
tar -xzmf "$target_dir/package/elastic-vmm-$version.crate" -C "$tmp"
packaged="$tmp/elastic-vmm-$version"
cargo check --profile "$profile" --manifest-path "$packaged/Cargo.toml" --target-dir "$target_dir"
RUSTDOCFLAGS="-D warnings" cargo doc --profile "$profile" --no-deps \
  --manifest-path "$packaged/Cargo.toml" --target-dir "$target_dir"

step "tests on the host backend (real memfd memory), debug assertions and overflow checks on"
# The broker's process tests drive `elastic-vmm top` in a real terminal: tmux.
command -v tmux >/dev/null || {
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends tmux
}
cargo test --profile "$profile"

step "command-line tool: demo and multi-model run (the binary the tests built)"
# Not `cargo run`: without the dev-dependencies the tests pull in, some dependencies resolve
# with other features and the tool would be built a second time. Ask cargo (nothing to build)
# where the test build put it.
cli=$(cargo test --profile "$profile" --no-run --quiet --message-format=json | python3 -c '
import json, sys
exes = [m["executable"] for m in map(json.loads, sys.stdin)
        if m.get("reason") == "compiler-artifact" and m["target"]["kind"] == ["bin"]
        and m["target"]["name"] == "elastic-vmm" and not m["profile"]["test"] and m["executable"]]
print(exes[0] if exes else "")
')
[[ -x "$cli" ]] || {
  echo "cargo reported no elastic-vmm binary" >&2
  exit 1
}
"$cli" --backend host demo --steps 120 --report-every 1000 --svg "$tmp/cli/demo.svg" >/dev/null
head -c 5 "$tmp/cli/demo.svg" | grep -q '^<svg' || {
  echo "demo wrote no SVG plot to $tmp/cli/demo.svg" >&2
  exit 1
}
# A folder that does not exist yet: the tool creates it.
svg="$tmp/cli/plots/multi-model.svg"
"$cli" --backend host multi --steps 120 --svg "$svg" >/dev/null
head -c 5 "$svg" | grep -q '^<svg' || {
  echo "multi wrote no SVG plot to $svg" >&2
  exit 1
}

step "serving benchmark (examples/serve): the process deployment and the in-process driver, host backend, simulated compute"
# `serve bench`: a broker and three engine processes per run, wall clock, open loop, 2 seeds x
# 2 loads x 3 policies of 1.5 s traces (about 25 s), the sleep policies once each (about 10 s),
# the real traces beside the repository
# when there (../shared/traces), the generator's otherwise; then the in-process virtual-clock
# driver (a second or two). tests/serve.rs tests the parts. The example the tests built,
# found as the CLI is above.
serve=$(cargo test --profile "$profile" --no-run --quiet --message-format=json | python3 -c '
import json, sys
exes = [m["executable"] for m in map(json.loads, sys.stdin)
        if m.get("reason") == "compiler-artifact" and m["target"]["kind"] == ["example"]
        and m["target"]["name"] == "serve" and m["executable"]]
print(exes[0] if exes else "")
')
[[ -x "$serve" ]] || {
  echo "cargo reported no serve example" >&2
  exit 1
}
traces=synthetic
[[ -f ../shared/traces/azure-llm-2023-conv.csv ]] && traces=conv,code,mooncake
"$serve" bench --sim --seeds 1,2 --loads 0.5,1.5 --duration 1.5 --drain 0.5 --traces "$traces" \
  --traces-dir ../shared/traces --out "$tmp/serve-bench" >/dev/null
# The sleep policies: four engines on a budget of two bases, Prism-like bursts, one run each.
"$serve" bench --sim --models 4 --resident 2 --policies static-sleep,elastic-sleep --loads 1 \
  --seeds 1 --duration 3 --drain 1 --on-off 1,2 --sleep-after 0.2 --traces "$traces" \
  --traces-dir ../shared/traces --out "$tmp/serve-sleep" >"$tmp/serve-sleep.log"
[[ $(grep -c 'sleeps [1-9]' "$tmp/serve-sleep.log") -eq 2 ]] || {
  echo "serve bench's sleep policies did not sleep and wake in both runs:" >&2
  cat "$tmp/serve-sleep.log" >&2
  exit 1
}
# The same table again from the saved runs alone (how a sweep over several commands is summed).
"$serve" bench --from "$tmp/serve-bench" --out "$tmp/serve-again" >/dev/null
cmp "$tmp/serve-bench/table.txt" "$tmp/serve-again/table.txt" || {
  echo "serve bench --from did not give the sweep's own table" >&2
  exit 1
}
runs=$(find "$tmp/serve-bench/runs" -name '*.json' | wc -l)
[[ "$runs" -eq 12 && -s "$tmp/serve-bench/table.txt" && -s "$tmp/serve-bench/summary.json" ]] &&
  head -c 5 "$tmp/serve-bench/slo-attainment.svg" | grep -q '^<svg' || {
  echo "serve bench wrote $runs of 12 runs, or no table, summary or plot, to $tmp/serve-bench" >&2
  exit 1
}
"$serve" --sim --duration 20 --out "$tmp/serve" >/dev/null
"$serve" --sim --duration 20 --sweep-models 2,3,4 --resident 2 --policies static,sleep \
  --out "$tmp/serve" >/dev/null
[[ -s "$tmp/serve/small-ttft-p99.svg" && -s "$tmp/serve/small-p4-sleep.json" \
  && -s "$tmp/serve/small-models.txt" ]] || {
  echo "serve --sim wrote no summaries or plots to $tmp/serve" >&2
  exit 1
}

step "README quick starts (examples/quickstart_*) on the host backend: they run and check themselves"
# tests/readme.rs checks the README's lines are theirs; quickstart_routing needs a GPU (the
# candle lint below builds it). The examples the tests built, found as the CLI is above.
quickstarts=(quickstart_models quickstart_engine quickstart_broker)
mapfile -t quickstart_exes < <(cargo test --profile "$profile" --no-run --quiet --message-format=json |
  python3 -c '
import json, sys
want = sys.argv[1:]
exes = {m["target"]["name"]: m["executable"] for m in map(json.loads, sys.stdin)
        if m.get("reason") == "compiler-artifact" and m["target"]["kind"] == ["example"]
        and m["target"]["name"] in want and m["executable"]}
print("\n".join(exes.get(w, "") for w in want))
' "${quickstarts[@]}")
for i in "${!quickstarts[@]}"; do
  [[ -x "${quickstart_exes[$i]:-}" ]] || {
    echo "cargo reported no ${quickstarts[$i]} example" >&2
    exit 1
  }
  TMPDIR="$tmp" "${quickstart_exes[$i]}" >/dev/null
done

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
  cargo test --profile "$profile" --features nixl --test nixl -- --nocapture
# The NIXL module's own unit tests (the transfer path's copy checks).
LD_LIBRARY_PATH="$nixl_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  cargo test --profile "$profile" --features nixl --lib nixl::

step "docs as docs.rs builds them (the features in Cargo.toml's docs.rs metadata), warnings as errors"
# Here, where libclang (for nixl-sys) is installed.
docs_rs_features=$(manifest '",".join(p["metadata"]["docs"]["rs"]["features"])')
RUSTDOCFLAGS="-D warnings" cargo doc --profile "$profile" --no-deps --features "$docs_rs_features"

step "every feature (candle with its CUDA backend, NIXL): lint, docs, examples; committed PTX up to date"
(
  # A CUDA compiler: the installed toolkit, else CUDA 13.0 from PyPI wheels (~100 MB once, cached).
  eval "$(scripts/cuda-toolchain.sh --compile-only)"
  # The committed PTX of our kernels (src/backend/kernels) is what nvcc 13.0.88 makes of the
  # source (the script fetches that nvcc if the one here is another).
  scripts/gen-ptx.sh --check
  # candle-kernels' build script compiles candle's CUDA kernels (11 PTX files, and a static
  # library of 15 MoE and GGUF kernels) even for a lint, which only needs them to exist. At -O3
  # for sm_90a that took 406 s of CPU on this 2-core machine; in nvcc's fast-compile mode
  # (-Ofc=max, nvcc 12.8 and later, appended through NVCC_APPEND_FLAGS) 112 s, every kernel still
  # compiled by the real nvcc. A profile setting only this step uses gives candle-kernels'
  # build-script output a folder of its own, so no other build in this profile can pick up
  # kernels compiled for a lint. The examples that need candle (elastic_kv_cache, routed_llama,
  # quickstart_routing, paged_kv_attention) are among the targets clippy checks; hotloop and the
  # other quick starts, which need no optional feature, are built by the tests.
  lint=(--profile "$profile" --features gpu-tests,candle-example,nixl
    --config "profile.$profile.package.candle-kernels.opt-level=0")
  if [[ "$(nvcc --help)" == *--Ofast-compile* ]]; then
    export NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:+$NVCC_APPEND_FLAGS }-Ofc=max"
  fi
  cargo clippy "${lint[@]}" --all-targets -- -D warnings
  RUSTDOCFLAGS="-D warnings" cargo doc "${lint[@]}" --no-deps
)

step "the serving engine's model and the prefill and write ops' argument checks on candle's CPU backend"
(
  # Built as the lint above (its candle kernels reused); linking needs CUDA's libraries (the
  # full toolchain: cuBLAS, cuRAND). Nothing here calls the driver: on a machine without one,
  # the toolchain's link-only libcuda stub lets the binary load.
  eval "$(scripts/cuda-toolchain.sh)"
  lint=(--profile "$profile" --features gpu-tests,candle-example,nixl
    --config "profile.$profile.package.candle-kernels.opt-level=0")
  if [[ "$(nvcc --help)" == *--Ofast-compile* ]]; then
    export NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:+$NVCC_APPEND_FLAGS }-Ofc=max"
  fi
  libs=$CUDA_ROOT/lib
  [[ -d $CUDA_ROOT/lib64 ]] && libs=$CUDA_ROOT/lib64
  if ! grep -q 'libcuda\.so\.1' <<<"$(ldconfig -p 2>/dev/null || true)"; then
    stub=$(find "$CUDA_ROOT/" -path '*/stubs/libcuda.so' -print -quit)
    [[ -n $stub ]] || {
      echo "no libcuda.so.1 here and no stub under $CUDA_ROOT" >&2
      exit 1
    }
    mkdir -p "$tmp/libcuda"
    ln -sf "$stub" "$tmp/libcuda/libcuda.so.1"
    libs=$tmp/libcuda:$libs
  fi
  LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    cargo test "${lint[@]}" --lib --test serve -- paged_llama candle::prefill candle::kv_write
)

end_step
printf '\nall checks passed\n'
