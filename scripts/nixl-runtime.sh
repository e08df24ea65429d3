#!/usr/bin/env bash
# The real NIXL library for the `nixl` feature, on a machine that has none (recipe and pitfalls:
# ../shared/recipes/nixl.md). Idempotent and cached:
#   - installs what building nixl-sys needs (libclang-dev, g++) with apt-get when missing;
#   - downloads the PyPI wheel nixl-cu13==1.5.1 once (cached in ~/.cache/elastic-vmm) and unpacks
#     only its two library folders, side by side, into .nixl/ (their RPATHs are relative);
#   - prints, on stdout and nothing else, the directory to put on LD_LIBRARY_PATH.
#
#   LD_LIBRARY_PATH=$(scripts/nixl-runtime.sh) cargo test --features nixl --test nixl
#   scripts/nixl-runtime.sh --pack    # also packs .carry/nixl-runtime.tar.xz (~17 MB) for the GPU
#                                     # machine; there: tar -xJf nixl-runtime.tar.xz -C /tmp and
#                                     # LD_LIBRARY_PATH=/tmp/nixl/.nixl_cu13.mesonpy.libs
set -euo pipefail
cd "$(dirname "$0")/.."

version=1.5.1
dest=.nixl
libs="$dest/.nixl_cu13.mesonpy.libs"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/elastic-vmm/nixl-$version"
say() { printf 'nixl-runtime: %s\n' "$*" >&2; }
apt_install() {
  local sudo=""
  [[ $(id -u) -ne 0 ]] && sudo=sudo
  $sudo apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" >&2
}

# nixl-sys runs bindgen (libclang) and compiles C++ (g++) in its build script.
if ! ls /usr/lib/llvm-*/lib/libclang.so* /usr/lib/x86_64-linux-gnu/libclang*.so* >/dev/null 2>&1 ||
  ! command -v g++ >/dev/null; then
  say "installing libclang-dev and g++"
  apt_install libclang-dev g++
fi

if [[ ! -e "$libs/libnixl.so" ]]; then
  if ! python3 -m pip --version >/dev/null 2>&1; then
    say "installing pip (python3-pip) to download the wheel"
    apt_install python3-pip
  fi
  wheel=$(ls "$cache"/nixl_cu13-"$version"-*.whl 2>/dev/null | head -n1 || true)
  if [[ -z "$wheel" ]]; then
    say "downloading nixl-cu13==$version (about 59 MB)"
    mkdir -p "$cache"
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
      --platform manylinux_2_28_x86_64 -d "$cache" "nixl-cu13==$version" >&2
    wheel=$(ls "$cache"/nixl_cu13-"$version"-*.whl | head -n1)
  fi
  say "unpacking the libraries of $(basename "$wheel") into $dest/"
  rm -rf "$dest.tmp" && mkdir -p "$dest.tmp"
  python3 - "$wheel" "$dest.tmp" <<'PY'
import sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist()
             if n.startswith((".nixl_cu13.mesonpy.libs/", "nixl_cu13.libs/"))]
    if not names:
        sys.exit(f"{wheel} holds no library folders")
    for n in names:
        z.extract(n, out)
PY
  rm -rf "$dest" && mv "$dest.tmp" "$dest"
  [[ -e "$libs/libnixl.so" ]] || { say "libnixl.so missing from the wheel"; exit 1; }
fi

if [[ "${1:-}" == "--pack" ]]; then
  mkdir -p .carry
  rm -rf .carry/nixl && mkdir -p .carry/nixl
  cp -a "$dest"/. .carry/nixl/
  tar -C .carry -cf - nixl | xz -9 -T0 >.carry/nixl-runtime.tar.xz
  rm -rf .carry/nixl
  say "packed .carry/nixl-runtime.tar.xz ($(du -h .carry/nixl-runtime.tar.xz | cut -f1))"
fi

printf '%s\n' "$(pwd)/$libs"
