#!/usr/bin/env bash
# A CUDA build toolchain for the `candle` features (candle-kernels compiles its kernels with
# nvcc) and for scripts/gen-ptx.sh. Prints `export` lines on stdout, nothing else:
#
#   eval "$(scripts/cuda-toolchain.sh)"                  # to build and link (scripts/gpu-bundle.sh)
#   eval "$(scripts/cuda-toolchain.sh --compile-only)"   # enough for cargo check/clippy/doc
#   eval "$(scripts/cuda-toolchain.sh --wheels)"         # CUDA 13.0 from PyPI even if one is installed
#
# 1. An installed CUDA toolkit is used as it is: the first of $CUDA_ROOT, $CUDA_PATH, $CUDA_HOME
#    that holds bin/nvcc, else the nvcc on PATH, else /usr/local/cuda. Any CUDA 12 or 13 toolkit
#    builds candle; the binaries need a driver of CUDA 13.0 or later (cudarc is pinned to the
#    13.0 driver API, feature cuda-13000).
# 2. Otherwise (a machine with no toolkit, e.g. building on a CPU box for a GPU box) the CUDA 13.0
#    compiler, headers and libraries come from NVIDIA's PyPI wheels, downloaded once with pip and
#    unpacked into ${XDG_CACHE_HOME:-~/.cache}/elastic-vmm/cuda-13.0: about 100 MB to download
#    (0.3 GB unpacked) with --compile-only; linking adds cuBLAS, cuRAND and NVRTC, about 550 MB
#    more (1.3 GB in all). To link, the wheels lack libcuda, which the driver provides: a
#    link-only stub is made, lib/stubs/libcuda.so (SONAME libcuda.so.1, every function returns
#    CUDA_ERROR_STUB_LIBRARY). Never ship it or put it on LD_LIBRARY_PATH on the GPU machine:
#    there the driver's libcuda.so.1 must load.
#
# CUDA_COMPUTE_CAP (the GPU candle's kernels are compiled for) is left alone when set or when
# nvidia-smi can name this machine's GPU; otherwise it is set to 90 (H100, H200). CUDAFORGE_THREADS
# (how many nvcc candle-kernels runs at once) is set to the number of cores unless set.
set -euo pipefail

compile_only=0
wheels=0
for arg in "$@"; do
  case "$arg" in
    --compile-only) compile_only=1 ;;
    --wheels) wheels=1 ;;
    -h | --help)
      sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "cuda-toolchain: unknown argument $arg (--compile-only, --wheels)" >&2
      exit 2
      ;;
  esac
done
say() { printf 'cuda-toolchain: %s\n' "$*" >&2; }

build_lines() {
  if [[ -z "${CUDA_COMPUTE_CAP:-}" ]] &&
    ! nvidia-smi --query-gpu=compute_cap --format=csv,noheader >/dev/null 2>&1; then
    echo 'export CUDA_COMPUTE_CAP=90'
  fi
  # candle-kernels' build tool (cudaforge) runs nvcc on half the cores unless told otherwise.
  [[ -n "${CUDAFORGE_THREADS:-}" ]] || echo "export CUDAFORGE_THREADS=$(nproc)"
}

# 1. An installed toolkit.
root=""
if [[ $wheels == 0 ]]; then
  for var in CUDA_ROOT CUDA_PATH CUDA_HOME; do
    dir=${!var:-}
    if [[ -n "$dir" && -x "$dir/bin/nvcc" ]]; then
      root=$dir
      break
    fi
  done
  if [[ -z "$root" ]] && nvcc=$(command -v nvcc); then
    root=$(dirname "$(dirname "$(readlink -f "$nvcc")")")
  fi
  if [[ -z "$root" && -x /usr/local/cuda/bin/nvcc ]]; then
    root=/usr/local/cuda
  fi
fi
if [[ -n "$root" ]]; then
  release=$("$root/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')
  say "using the installed CUDA toolkit in $root (nvcc $release)"
  printf 'export CUDA_ROOT=%q\n' "$root"
  printf 'export PATH=%q:"$PATH"\n' "$root/bin"
  build_lines
  exit 0
fi

# 2. CUDA 13.0 from PyPI wheels: nvcc V13.0.88 (which made the committed PTX, scripts/gen-ptx.sh)
# and the libraries of the same release.
cache="${XDG_CACHE_HOME:-$HOME/.cache}/elastic-vmm/cuda-13.0"
compile=(nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88
  nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85)
link=(nvidia-cuda-nvrtc==13.0.88 nvidia-cublas==13.1.0.3 nvidia-curand==10.4.0.35)
wanted=("${compile[@]}")
[[ $compile_only == 1 ]] || wanted+=("${link[@]}")
root="$cache/nvidia/cu13"

# A wheel is unpacked once; its marker says so (an interrupted unpack has none and is redone).
missing=()
for w in "${wanted[@]}"; do
  [[ -e "$cache/.unpacked-$w" ]] || missing+=("$w")
done
if [[ ${#missing[@]} -gt 0 ]]; then
  if ! python3 -m pip --version >/dev/null 2>&1; then
    say "installing pip (python3-pip) to download the wheels"
    sudo=""
    [[ $(id -u) -ne 0 ]] && sudo=sudo
    $sudo apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends python3-pip >&2
  fi
  say "downloading ${missing[*]}"
  mkdir -p "$cache/wheels"
  # For this machine's architecture (nvcc runs here); the wheels are py3-none, any python 3.
  python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$cache/wheels" "${missing[@]}" >&2
  for w in "${missing[@]}"; do
    name=${w%%==*}
    version=${w#*==}
    wheel=$(ls "$cache/wheels/${name//-/_}-$version-"*.whl | head -n1)
    say "unpacking $(basename "$wheel")"
    # Python's zipfile, keeping the files' modes (nvcc, ptxas, cicc must stay executable).
    python3 - "$wheel" "$cache" <<'PY'
import os, sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    for info in z.infolist():
        if info.filename.startswith("nvidia/"):
            path = z.extract(info, out)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                os.chmod(path, mode)
PY
    touch "$cache/.unpacked-$w"
    rm -f "$wheel" # unpacked: the wheel is not needed again
  done
fi
[[ -x "$root/bin/nvcc" ]] || {
  say "no nvcc in $root after unpacking the wheels"
  exit 1
}

# The wheels ship versioned libraries only; the linker looks for the plain names.
ln -sf libcudart.so.13 "$root/lib/libcudart.so"
if [[ $compile_only == 0 ]]; then
  for l in nvrtc cublas cublasLt; do ln -sf "lib$l.so.13" "$root/lib/lib$l.so"; done
  ln -sf libcurand.so.10 "$root/lib/libcurand.so"
  # The link-only libcuda stub: one function for every driver entry point cudarc's bindings
  # declare (candle links cudarc with `dynamic-linking`, so each one it uses must resolve).
  if [[ ! -e "$root/lib/stubs/libcuda.so" ]]; then
    here=$(cd "$(dirname "$0")/.." && pwd)
    manifest=$(cd "$here" && cargo metadata --format-version 1 2>/dev/null | python3 -c '
import json, sys
for p in json.load(sys.stdin)["packages"]:
    if p["name"] == "cudarc":
        print(p["manifest_path"])
        break
')
    sys_rs="$(dirname "$manifest")/src/driver/sys/mod.rs"
    [[ -n "$manifest" && -e "$sys_rs" ]] || {
      say "cannot find cudarc's driver bindings for the libcuda stub (run cargo fetch first)"
      exit 1
    }
    mkdir -p "$root/lib/stubs"
    grep -oE '^ *pub unsafe fn cu[A-Za-z0-9_]+' "$sys_rs" | awk '{print $4}' | sort -u |
      awk '{print "int " $1 "(void) { return 34; }"}' >"$cache/libcuda-stub.c"
    cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$root/lib/stubs/libcuda.so" "$cache/libcuda-stub.c"
  fi
fi

say "using CUDA 13.0 from PyPI wheels in $root"
printf 'export CUDA_ROOT=%q\n' "$root"
printf 'export PATH=%q:"$PATH"\n' "$root/bin"
build_lines
