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

step "command-line tool: demo and multi-model run"
cargo run --release --quiet -- --backend host demo --sequences 60 --report-every 1000 >/dev/null
cargo run --release --quiet -- --backend host multi --steps 120 --svg target/multi-model.svg >/dev/null

printf '\nall checks passed\n'
