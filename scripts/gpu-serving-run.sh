#!/usr/bin/env bash
# One device call of the serving measurements, on the GPU machine (which has no Rust): the
# probe that prices load 1.0 from this machine's engine, the attention kernel's GPU tests,
# `gpu-bench --check` of some sections, then the three-policy sweep and the sleep run. Every
# output goes under $OUT/res as it is written, so a call cut short keeps what ran; a warm
# machine's /tmp (the unpacked bundle, the probe's cost, the sweep's rate) is reused by the
# next call.
#
# Build here: scripts/gpu-bundle.sh candle-example; carry the bundle (BUNDLE, default
# .carry/bundle.tar.xz, or a smaller tar.xz of the same binaries) and the traces (TRACES,
# default .carry/traces, a copy of ../shared/traces). Then on the device:
#   TLIM=560 scripts/gpu-serving-run.sh SEEDS LOADS SECTIONS [sleep]
#     SEEDS     sweep seeds, e.g. 1,2 ("-": no sweep)
#     LOADS     load points, e.g. 0.5,1,1.5
#     SECTIONS  gpu-bench sections to --check, e.g. "attention kv" ("-": none)
#     sleep     also the sleep run (twice the models the budget holds, Prism-like bursts)
#   TLIM: seconds the call may take in all (default 570); BENCHT: seconds for gpu-bench when a
#   sweep follows (default 150); EXTRA: more `serve bench` flags (e.g. --max-batch 256); DUR,
#   DRAIN: seconds of trace and after it (default 12 and 4; a request still running at the
#   end is censored, so a drain shorter than a long request counts it as a miss).
# Three 8B-shaped engines on a GPU under 100 GB, five above (about the same KV per model).
set -u
SEEDS=${1:--}; LOADS=${2:-0.5,1,1.5}; BENCH=${3:--}; SLEEPX=${4:-}
R=$PWD; RES=$OUT/res; mkdir -p "$RES"
BUNDLE=${BUNDLE:-$R/.carry/bundle.tar.xz}; T=${TRACES:-$R/.carry/traces}
left() { echo $(( ${TLIM:-570} - SECONDS )); }
trap 'pkill -x serve' EXIT
if [ ! -x /tmp/bundle/serve ]; then
  mkdir -p /tmp/bundle && tar -xJf "$BUNDLE" -C /tmp/bundle || exit 1
  # A full bundle unpacks into bundle/; a lean one into the folder itself.
  [ -d /tmp/bundle/bundle ] && mv /tmp/bundle/bundle/* /tmp/bundle/
  chmod -R 755 /tmp/bundle
fi
cd /tmp/bundle
git -C "$R" log -1 --format='%H %s' > "$RES/commit.txt" 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv | tee "$RES/gpu.txt"
free -g > "$RES/host-mem.txt"
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$MEM" -gt 100000 ]; then MA=5; else MA=3; fi
if [ ! -s /tmp/cost ]; then
  echo "== probe 8b"
  timeout 170 ./serve probe --gpu 8b > "$RES/probe-8b.log" 2>&1; echo "rc $?" >> "$RES/probe-8b.log"
  grep -v "^decode: batch" "$RES/probe-8b.log" | tail -22
  grep '^cost-ms:' "$RES/probe-8b.log" | awk '{print $2}' > /tmp/cost
  echo "== gpu-tests attention"
  timeout 100 ./gpu-tests --test-threads=1 attention:: > "$RES/gpu-tests-attention.log" 2>&1
  echo "rc $?" >> "$RES/gpu-tests-attention.log"
  grep -E "test result|FAILED|panicked|rc " "$RES/gpu-tests-attention.log" | head
fi
if [ "$BENCH" != "-" ]; then
  W=$(left); [ "$SEEDS" != "-" ] && W=${BENCHT:-150}
  echo "== gpu-bench $BENCH --check ($W s)"
  # shellcheck disable=SC2086 # the sections are words
  EVMM_RESULTS_DIR=$R/docs/results timeout "$W" ./gpu-bench $BENCH --check > "$RES/gpu-bench.log" 2>&1
  echo "rc $?" >> "$RES/gpu-bench.log"
  grep -E "RESULT|^ok|^FAIL|^new|check|rc |panick" "$RES/gpu-bench.log" | tail -40
fi
COST=$(cat /tmp/cost)
[ -n "$COST" ] || { echo "no cost from the probe (see probe-8b.log)"; exit 1; }
if [ "$SEEDS" != "-" ]; then
  W=$(left); [ -n "$SLEEPX" ] && W=$(( W - 200 ))
  D=$RES/sweep-$(echo "$SEEDS" | tr , -)   # no commas: the copy-back refuses them
  echo "== sweep: $MA models, seeds $SEEDS, loads $LOADS, cost $COST, $W s"
  # shellcheck disable=SC2086 # EXTRA is flags
  timeout "$W" ./serve bench --gpu 8b --models $MA --loads "$LOADS" --seeds "$SEEDS" \
    --duration "${DUR:-12}" --drain "${DRAIN:-4}" --cost-ms "$COST" ${EXTRA:-} --traces-dir "$T" --out "$D" > "$D.log" 2>&1
  echo "rc $?" >> "$D.log"
  grep -o 'load 1.0 = [0-9.]*' "$D.log" | head -1 | awk '{print $4}' > /tmp/rate
  grep -E "^\[|bench:|error|knee|^  *(static|elastic)|rc " "$D.log" | cut -c1-260 | head -70
fi
if [ -n "$SLEEPX" ]; then
  HOSTG=$(free -g | awk '/Mem:/{print $2}')
  SM=$(( 2 * MA )); FIT=$(( HOSTG * 3 / 4 / 16 )); [ $SM -gt $FIT ] && SM=$FIT
  RATE=$(cat /tmp/rate 2>/dev/null); [ -n "$RATE" ] || RATE=0.5
  W=$(left)
  echo "== sleep: $SM models, $MA resident, rate $RATE, on 4 s off 8 s, $W s"
  timeout "$W" ./serve bench --gpu 8b --models $SM --resident $MA --policies elastic-sleep,static-sleep \
    --loads 1 --rate "$RATE" --on-off 4,8 --sleep-after 0.5 --seeds 1 --duration 24 --drain "${DRAIN:-4}" \
    --cost-ms "$COST" --traces-dir "$T" --out "$RES/sleep" > "$RES/sleep.log" 2>&1
  echo "rc $?" >> "$RES/sleep.log"
  grep -E "^\[|bench:|error|sleeps|^  *(static|elastic)|rc " "$RES/sleep.log" | cut -c1-260 | head -30
fi
