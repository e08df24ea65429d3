#!/usr/bin/env bash
# UCX with the CUDA VMM POSIX-fd path, and NIXL built against it, packed for the GPU machine.
#
# Why: the PyPI wheel nixl-cu13 bundles a UCX whose cuda_ipc transport was configured where
# SYS_pidfd_getfd is not declared, so UCX cannot export VMM memory (cuMemCreate + cuMemMap) as a
# POSIX fd between processes and falls back to "software emulation | tcp" (0.5 GB/s instead of
# ~1400 GB/s on one H100). This script builds UCX where <sys/syscall.h> declares SYS_pidfd_getfd
# (Debian 12 here: kernel headers 6.1), checks that configure saw it and that the built
# libuct_cuda.so contains the POSIX-fd export/import code, builds NIXL (core, C API
# libnixl_capi, UCX plugin) against it, and packs the runtime libraries.
#
#   scripts/build-ucx-nixl.sh                   # clones the pinned tags from github.com
#   UCX_SRC=DIR NIXL_SRC=DIR ... scripts/build-ucx-nixl.sh   # from local sources (no network)
#
# Each *_SRC may be a source tree (copied, .git left out) or a bare git repository (the pinned tag
# is taken from it with git archive). NIXL's meson subprojects (wraps) are never downloaded by
# meson: the script lays them out itself, from *_SRC or from github.com:
#   UCX_SRC       openucx/ucx            tag $UCX_TAG        (default v1.22.0)
#   NIXL_SRC      ai-dynamo/nixl         tag $NIXL_TAG       (default v1.4.0; its CI builds with UCX v1.22.x)
#   ABSEIL_SRC    abseil/abseil-cpp      tag 20250814.1      (NIXL's abseil-cpp.wrap; Debian's is too old)
#   WRAPDB_SRC    mesonbuild/wrapdb      tag abseil-cpp_20250814.1-1 (meson.build for abseil)
#   TASKFLOW_SRC  taskflow/taskflow      tag v3.10.0         (header-only)
#   ASIO_SRC      chriskohlhoff/asio     tag asio-1-30-2     (header-only)
#   TOMLPP_SRC    marzer/tomlplusplus    tag v3.4.0          (header-only)
# The dependency versions are checked against NIXL's own wrap files, so another NIXL_TAG that
# wants other versions stops with a message (set ABSEIL_TAG, WRAPDB_TAG, ... to match).
#
# Other variables: WORK (scratch, default /tmp/ucx-nixl), PREFIX (install, default $WORK/prefix),
# JOBS (default 2), NVCC_GENCODE (UCX's only device code is its perftest; default sm_90 = H100/H200),
# OUT (default .carry/ucx-nixl-runtime.tar.xz). CUDA comes from scripts/cuda-toolchain.sh
# --compile-only (CUDA 13.0 from PyPI wheels when no toolkit is installed); nvml.h from the
# nvidia-nvml-dev wheel when the toolkit lacks it; libcuda/libnvidia-ml are link-only stubs made
# here and never packed. Installs, when missing: autoconf, automake, libtool (apt-get); meson and
# ninja (pip, into a venv under $WORK). Never runs cargo.
#
# On the GPU machine:  tar -xJf ucx-nixl-runtime.tar.xz -C /tmp && . /tmp/ucx-nixl-runtime/env.sh
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)

# ---- Pinned versions -------------------------------------------------------------------------
UCX_TAG=${UCX_TAG:-v1.22.0}
NIXL_TAG=${NIXL_TAG:-v1.4.0}
ABSEIL_TAG=${ABSEIL_TAG:-20250814.1}
WRAPDB_TAG=${WRAPDB_TAG:-abseil-cpp_20250814.1-1}
TASKFLOW_TAG=${TASKFLOW_TAG:-v3.10.0}
ASIO_TAG=${ASIO_TAG:-asio-1-30-2}
TOMLPP_TAG=${TOMLPP_TAG:-v3.4.0}
MESON_VERSION=1.9.1
NINJA_VERSION=1.13.0
NVML_DEV_VERSION=13.0.87 # the nvml.h of CUDA 13.0 (header only; the library is the driver's)

WORK=${WORK:-/tmp/ucx-nixl}
PREFIX=${PREFIX:-$WORK/prefix}
JOBS=${JOBS:-2}
NVCC_GENCODE=${NVCC_GENCODE:--gencode=arch=compute_90,code=sm_90}
OUT=${OUT:-$here/.carry/ucx-nixl-runtime.tar.xz}

SRC=$WORK/src         # unpacked sources
BUILD=$WORK/build     # out-of-tree build folders
EXTRA=$WORK/cuda-extra # nvml.h and the link-only stubs (never installed, never packed)
LOGS=$WORK/logs
mkdir -p "$SRC" "$BUILD" "$EXTRA" "$LOGS"

say() { printf '[build-ucx-nixl %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { say "ERROR: $*"; exit 1; }
declare -A took # seconds per step, for the summary
step_start() { step_name=$1; step_t0=$SECONDS; say "=== $1"; }
step_end() { took[$step_name]=$((SECONDS - step_t0)); say "=== $step_name done in ${took[$step_name]} s"; }
# Runs a long command at low priority with its output in a log; shows the log's tail on failure.
run_logged() {
  local log=$1
  shift
  if ! nice -n 10 "$@" >"$log" 2>&1; then
    say "command failed: $* (log: $log); its last lines:"
    tail -n 40 "$log" >&2
    exit 1
  fi
}

# ---- 1. Sources --------------------------------------------------------------------------------
# get_src NAME URL TAG LOCAL [PATH...]: puts the source of NAME at $SRC/NAME. LOCAL, when set, is
# a source tree or a bare git repository; otherwise a shallow clone of TAG from URL. PATHs, when
# given, limit what is taken from a bare repository (snapshots may lack large unneeded files).
get_src() {
  local name=$1 url=$2 tag=$3 local=$4 dest=$SRC/$1
  shift 4
  rm -rf "$dest"
  mkdir -p "$dest"
  if [[ -n "$local" ]]; then
    [[ -d "$local" ]] || die "$name: $local is not a folder"
    # A bare repository: HEAD, objects/ and refs/ at its top, no work tree (core.bare may be unset).
    if [[ -f "$local/HEAD" && -d "$local/objects" && -d "$local/refs" && ! -e "$local/.git" ]]; then
      say "$name: tag $tag from the bare repository $local"
      git --git-dir="$local" rev-parse -q --verify "refs/tags/$tag" >/dev/null ||
        die "$name: $local has no tag $tag"
      git --git-dir="$local" archive --format=tar "$tag" -- "$@" | tar -x -C "$dest"
    else
      say "$name: copying the source tree $local"
      tar -C "$local" --exclude=.git -cf - . | tar -x -C "$dest"
    fi
  else
    say "$name: cloning $url at $tag"
    rm -rf "$dest"
    git -c advice.detachedHead=false clone --quiet --depth 1 --branch "$tag" "$url" "$dest"
  fi
}

# Versions found in the sources, compared with what the tags promise.
ucx_version() { # 1.22.0 from configure.ac's define([ucx_ver_major], 1) ...
  local f=$1/configure.ac part v=()
  for part in major minor patch; do
    v+=("$(sed -n "s/^define(\[ucx_ver_$part\], *\([0-9]*\)).*/\1/p" "$f")")
  done
  echo "${v[0]}.${v[1]}.${v[2]}"
}
meson_project_version() { # the first "version: 'X'" of a meson.build (its project() call)
  grep -m1 -oE "(^|[^_[:alnum:]])version *: *'[^']+'" "$1" | sed -E "s/.*'([^']+)'/\1/"
}
check_version() { # check_version NAME FOUND WANTED
  [[ "$2" == "$3" ]] || die "$1: the source says version '$2', expected '$3' (wrong tag or folder?)"
  say "$1: version $2 as expected"
}

step_start "sources"
get_src ucx https://github.com/openucx/ucx "$UCX_TAG" "${UCX_SRC:-}"
get_src nixl https://github.com/ai-dynamo/nixl "$NIXL_TAG" "${NIXL_SRC:-}"
get_src abseil-cpp https://github.com/abseil/abseil-cpp "$ABSEIL_TAG" "${ABSEIL_SRC:-}"
get_src wrapdb https://github.com/mesonbuild/wrapdb "$WRAPDB_TAG" "${WRAPDB_SRC:-}"
get_src taskflow https://github.com/taskflow/taskflow "$TASKFLOW_TAG" "${TASKFLOW_SRC:-}"
get_src asio https://github.com/chriskohlhoff/asio "$ASIO_TAG" "${ASIO_SRC:-}" asio/include # headers only
get_src tomlplusplus https://github.com/marzer/tomlplusplus "$TOMLPP_TAG" "${TOMLPP_SRC:-}"

ucx_ver=$(ucx_version "$SRC/ucx")
check_version UCX "$ucx_ver" "${UCX_TAG#v}"
[[ $(printf '%s\n' 1.22.0 "$ucx_ver" | sort -V | head -n1) == 1.22.0 ]] ||
  die "UCX $ucx_ver is older than 1.22, which has the POSIX-fd VMM path"
grep -q 'SYS_pidfd_getfd' "$SRC/ucx/src/uct/cuda/configure.m4" ||
  die "UCX $ucx_ver does not check SYS_pidfd_getfd (src/uct/cuda/configure.m4)"
nixl_ver=$(meson_project_version "$SRC/nixl/meson.build")
check_version NIXL "$nixl_ver" "${NIXL_TAG#v}"

# NIXL's wraps name the dependency versions it wants: the folder meson expects is the wrap's
# "directory", and its version suffix must match the source found.
wrap_dir() { sed -n 's/^directory *= *//p' "$SRC/nixl/subprojects/$1.wrap"; }
absl_found=$(sed -n 's/^#define ABSL_LTS_RELEASE_VERSION //p' "$SRC/abseil-cpp/absl/base/config.h").$(
  sed -n 's/^#define ABSL_LTS_RELEASE_PATCH_LEVEL //p' "$SRC/abseil-cpp/absl/base/config.h")
absl_dir=$(wrap_dir abseil-cpp)
check_version abseil-cpp "$absl_found" "${absl_dir#abseil-cpp-}"
check_version "wrapdb's abseil-cpp meson.build" \
  "$(meson_project_version "$SRC/wrapdb/subprojects/packagefiles/abseil-cpp/meson.build")" "${absl_dir#abseil-cpp-}"
tf=$(sed -n 's/^#define TF_VERSION \([0-9]*\).*/\1/p' "$SRC/taskflow/taskflow/taskflow.hpp")
taskflow_dir=$(wrap_dir taskflow)
check_version taskflow "$((tf / 100000)).$((tf / 100 % 1000)).$((tf % 100))" "${taskflow_dir#taskflow-}"
asio_dir=$(wrap_dir asio)
check_version asio "$(sed -n 's|^#define ASIO_VERSION [0-9]* // \([0-9.]*\).*|\1|p' \
  "$SRC/asio/asio/include/asio/version.hpp")" "${asio_dir#asio-}"
tomlpp_dir=$(wrap_dir tomlplusplus)
check_version tomlplusplus "$(meson_project_version "$SRC/tomlplusplus/meson.build")" "${tomlpp_dir#tomlplusplus-}"
step_end

# ---- 2. Build tools ----------------------------------------------------------------------------
step_start "build tools"
apt_install() {
  local sudo=""
  [[ $(id -u) -ne 0 ]] && sudo=sudo
  $sudo apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" >&2
}
missing=()
command -v autoreconf >/dev/null || missing+=(autoconf)
command -v aclocal >/dev/null || missing+=(automake)
command -v libtoolize >/dev/null || missing+=(libtool)
for tool in gcc g++ make pkg-config git xz strip; do
  command -v $tool >/dev/null || die "$tool is missing (expected on this machine)"
done
if [[ ${#missing[@]} -gt 0 ]]; then
  say "installing ${missing[*]} with apt-get"
  apt_install "${missing[@]}"
fi
# meson and ninja: pinned versions in a venv of our own (Debian's meson 1.0 is older than the
# wrapdb abseil build is tested with).
tools=$WORK/tools
if ! "$tools/bin/meson" --version 2>/dev/null | grep -qx "$MESON_VERSION" ||
  ! "$tools/bin/ninja" --version >/dev/null 2>&1; then
  say "installing meson==$MESON_VERSION ninja==$NINJA_VERSION into $tools (pip)"
  rm -rf "$tools"
  python3 -m venv "$tools" || die "python3 -m venv failed (install python3-venv)"
  "$tools/bin/python" -m pip install --quiet --disable-pip-version-check \
    "meson==$MESON_VERSION" "ninja==$NINJA_VERSION" >&2
fi
base_path=$PATH # without CUDA: NIXL is configured with it (see step 4)
glibc=$(getconf GNU_LIBC_VERSION | awk '{print $2}')
step_end

# ---- 3. UCX with CUDA --------------------------------------------------------------------------
step_start "CUDA toolkit"
eval "$("$here/scripts/cuda-toolchain.sh" --compile-only)"
[[ -n "${CUDA_ROOT:-}" && -e "$CUDA_ROOT/include/cuda.h" ]] || die "no cuda.h under CUDA_ROOT=${CUDA_ROOT:-}"
say "CUDA_ROOT=$CUDA_ROOT ($(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'))"
mkdir -p "$EXTRA/include" "$EXTRA/stubs"
# UCX's cuda module needs nvml.h; the compile-only wheels lack it.
if [[ -e "$CUDA_ROOT/include/nvml.h" ]]; then
  nvml_h=$CUDA_ROOT/include/nvml.h
else
  nvml_h=$EXTRA/include/nvml.h
  if [[ ! -e "$nvml_h" ]]; then
    say "downloading nvml.h (nvidia-nvml-dev==$NVML_DEV_VERSION)"
    rm -rf "$WORK/dl" && mkdir -p "$WORK/dl"
    python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
      -d "$WORK/dl" "nvidia-nvml-dev==$NVML_DEV_VERSION" >&2
    python3 - "$WORK/dl" "$nvml_h" <<'PY'
import glob, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/nvidia_nvml_dev-*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith("/include/nvml.h"))
    open(sys.argv[2], "wb").write(z.read(name))
PY
  fi
fi
# Link-only stubs of the driver's libcuda.so.1 and libnvidia-ml.so.1: every function name the
# headers declare, both as written (configure's AC_CHECK_LIB links e.g. cuDeviceGetUuid and
# nvmlInit literally) and after the headers' macros map them to versioned names (cuMemAlloc_v2).
# Only configure and the linker see them; at run time the GPU machine's driver provides both.
make_stub() { # make_stub HEADER NAME_REGEX SONAME OUTPUT
  local header=$1 re=$2 soname=$3 out=$4 c=${4%.so}.c
  {
    grep -ohE "\\b$re[A-Za-z0-9_]*[[:space:]]*\\(" "$header"
    printf '#include "%s"\n' "$header" | gcc -E -P -I"$CUDA_ROOT/include" -x c - |
      grep -ohE "\\b$re[A-Za-z0-9_]*[[:space:]]*\\("
  } | tr -d ' \t(' | sort -u | awk '{ print "int " $1 "(void) { return 999; }" }' >"$c"
  gcc -shared -fPIC -Wl,-soname,"$soname" -o "$out" "$c"
  say "stub $(basename "$out") ($soname): $(wc -l <"$c") functions"
}
make_stub "$CUDA_ROOT/include/cuda.h" 'cu[A-Z]' libcuda.so.1 "$EXTRA/stubs/libcuda.so"
make_stub "$nvml_h" 'nvml[A-Z]' libnvidia-ml.so.1 "$EXTRA/stubs/libnvidia-ml.so"
step_end

step_start "UCX configure"
ucx_src=$SRC/ucx
ucx_build=$BUILD/ucx
# autogen.sh would also try to fetch the gpunetio git submodule (only for mlx5 GDA, not built).
(cd "$ucx_src" && mkdir -p config/m4 config/aux && run_logged "$LOGS/ucx-autoreconf.log" autoreconf -v --install)
rm -rf "$ucx_build" && mkdir -p "$ucx_build"
# Release flags as in UCX's contrib/configure-release-mt (and NIXL's CI), CUDA on, everything this
# use does not need off: no InfiniBand/RDMA (verbs, rdmacm, mlx5, efa), knem, xpmem, gdrcopy,
# ROCm, ZE, Gaudi, Java, Go, MPI, fuse, docs, examples, tests. The CPPFLAGS/LDFLAGS put nvml.h and
# the stubs in front of the toolkit's own folders (which --with-cuda adds).
ucx_configure=(
  --prefix="$PREFIX"
  --enable-shared --disable-static
  --disable-logging --disable-debug --disable-assertions --disable-params-check
  --enable-mt --enable-optimizations --enable-cma --enable-devel-headers
  --with-cuda="$CUDA_ROOT" --with-nvcc-gencode="$NVCC_GENCODE"
  --without-verbs --without-rdmacm --without-mlx5 --without-efa --without-knem --without-xpmem
  --without-ugni --without-gdrcopy --without-rocm --without-ze --without-gaudi
  --without-java --without-go --without-mpi --without-fuse3 --without-valgrind --without-mad
  --without-bfd
  --disable-doxygen-doc --disable-examples --disable-gtest --disable-test-apps
)
(cd "$ucx_build" && run_logged "$LOGS/ucx-configure.log" "$ucx_src/configure" "${ucx_configure[@]}" \
  CPPFLAGS="-I$EXTRA/include" LDFLAGS="-L$EXTRA/stubs")
# The proof that the POSIX-fd VMM path will be compiled: src/uct/cuda/configure.m4 runs
# AC_CHECK_DECLS([SYS_pidfd_getfd], ..., [#include <sys/syscall.h>]), which defines
# HAVE_DECL_SYS_PIDFD_GETFD to 1 or 0; src/uct/cuda/cuda_ipc/cuda_ipc_{md,cache}.c compile the
# POSIX-fd export and import only under "#if HAVE_DECL_SYS_PIDFD_GETFD".
grep -E 'SYS_pidfd_getfd|cuda\.h|nvml\.h|-lcuda|-lnvidia-ml|CU_MEM_HANDLE_TYPE_FABRIC' "$LOGS/ucx-configure.log" |
  sed 's/^/  configure: /' >&2 || true
grep -qx '#define HAVE_DECL_SYS_PIDFD_GETFD 1' "$ucx_build/config.h" ||
  die "configure did not find SYS_pidfd_getfd: $(grep -h 'PIDFD' "$ucx_build/config.h" || echo 'no HAVE_DECL_SYS_PIDFD_GETFD in config.h')"
grep -qx '#define HAVE_CUDA 1' "$ucx_build/config.h" || die "UCX configure did not enable CUDA (see $LOGS/ucx-configure.log)"
say "config.h: $(grep -h -E '^#define (HAVE_DECL_SYS_PIDFD_GETFD|HAVE_CUDA|HAVE_CUDA_FABRIC|HAVE_CUMEMRETAINALLOCATIONHANDLE) ' "$ucx_build/config.h" | tr '\n' ';')"
step_end

step_start "UCX build"
(cd "$ucx_build" && run_logged "$LOGS/ucx-make.log" make -j"$JOBS")
(cd "$ucx_build" && run_logged "$LOGS/ucx-install.log" make install)
step_end

# ---- 4. NIXL -----------------------------------------------------------------------------------
step_start "NIXL configure"
nixl_src=$SRC/nixl
subp=$nixl_src/subprojects
# Lay the wraps' sources out where meson looks for them; with --wrap-mode=nodownload meson uses
# them as they are and downloads nothing (liburing and prometheus-cpp, optional and unused by the
# UCX plugin, are then simply not found).
rm -rf "${subp:?}/$absl_dir" "$subp/$taskflow_dir" "$subp/$asio_dir" "$subp/$tomlpp_dir"
cp -a "$SRC/abseil-cpp" "$subp/$absl_dir"
cp -a "$SRC/wrapdb/subprojects/packagefiles/abseil-cpp/." "$subp/$absl_dir/" # meson.build
cp -a "$SRC/taskflow" "$subp/$taskflow_dir"
cp -a "$subp/packagefiles/taskflow/." "$subp/$taskflow_dir/" # NIXL's own meson.build for it
mkdir -p "$subp/$asio_dir"
cp -a "$SRC/asio/asio/include" "$subp/$asio_dir/"
# Asio is header-only: a meson.build that declares its include folder is all NIXL needs.
cat >"$subp/$asio_dir/meson.build" <<EOF
project('asio', 'cpp', version: '${asio_dir#asio-}', license: 'BSL-1.0')
asio_dep = declare_dependency(include_directories: include_directories('include'))
EOF
cp -a "$SRC/tomlplusplus" "$subp/$tomlpp_dir"
# NIXL (this version) always builds its Python bindings (pybind11, Python headers), with no
# option to turn them off: drop those two subdir() calls. Nothing else uses them.
for f in src/bindings/meson.build src/api/meson.build; do
  grep -qx "subdir('python')" "$nixl_src/$f" ||
    die "$f has no line \"subdir('python')\" to drop (NIXL changed; update this script)"
  sed -i "s/^subdir('python')$/# subdir('python') # dropped by build-ucx-nixl.sh/" "$nixl_src/$f"
done
nixl_build=$BUILD/nixl
rm -rf "$nixl_build"
# NIXL's UCX plugin and core use no CUDA API themselves (UCX handles device memory), so NIXL is
# configured without the CUDA toolkit on PATH: no nvcc, no CUDA device-API code to compile.
nixl_env=(env -u CUDA_ROOT -u CUDA_PATH -u CUDA_HOME PATH="$tools/bin:$base_path")
nixl_options=(
  --prefix="$PREFIX" --libdir=lib --buildtype=release --wrap-mode=nodownload
  -Dwerror=false # NIXL's default -Werror is tuned to its CI's compilers, not Debian 12's GCC 12
  -Ducx_path="$PREFIX" -Denable_plugins=UCX
  -Dbuild_tests=false -Dbuild_examples=false -Dbuild_docs=false -Drust=false -Dwith_trace=false
)
run_logged "$LOGS/nixl-meson-setup.log" "${nixl_env[@]}" meson setup "${nixl_options[@]}" "$nixl_build" "$nixl_src"
grep -E 'UCX|Abseil|CUDA|etcd|ETCD|plugin' "$LOGS/nixl-meson-setup.log" | grep -v '^Program\|^Run-time' |
  sed 's/^/  meson: /' | head -n 20 >&2 || true
step_end

step_start "NIXL build"
run_logged "$LOGS/nixl-ninja.log" "${nixl_env[@]}" ninja -C "$nixl_build" -j "$JOBS"
run_logged "$LOGS/nixl-install.log" "${nixl_env[@]}" meson install -C "$nixl_build" --no-rebuild
for f in lib/libnixl.so lib/libnixl_capi.so lib/plugins/libplugin_UCX.so; do
  [[ -e "$PREFIX/$f" ]] || die "$PREFIX/$f was not installed"
done
step_end

# ---- 5. Verification ---------------------------------------------------------------------------
step_start "verify"
# Strings that exist only in the POSIX-fd VMM code: the __func__ names that UCX's log macros
# store (uct_cuda_ipc_mem_export_posix_fd in cuda_ipc_md.c, uct_cuda_ipc_open_memhandle_posix_fd
# in cuda_ipc_cache.c) and those functions' own messages. They survive stripping (.rodata).
markers=(
  uct_cuda_ipc_mem_export_posix_fd
  uct_cuda_ipc_open_memhandle_posix_fd
  'unable to export POSIX FD handle for ptr'
  'pidfd_getfd(pidfd='
)
count_markers() { # count_markers LIB: prints "found/total" and the missing ones
  local lib=$1 m n=0 miss=() text
  text=$(strings -a "$lib")
  for m in "${markers[@]}"; do
    if grep -qF -- "$m" <<<"$text"; then n=$((n + 1)); else miss+=("$m"); fi
  done
  echo "$n/${#markers[@]}${miss[*]:+ (missing: ${miss[*]})}"
}
built_cuda=$(readlink -f "$PREFIX/lib/ucx/libuct_cuda.so")
built_result=$(count_markers "$built_cuda")
say "built $built_cuda: POSIX-fd markers $built_result"
[[ $built_result == "${#markers[@]}/${#markers[@]}" ]] || die "the built libuct_cuda.so lacks the POSIX-fd VMM path"
# The wheel's (nixl-cu13, its bundled UCX) for comparison: expected 0.
wheel_libs=$("$here/scripts/nixl-runtime.sh" 2>/dev/null || true)
wheel_cuda=$(ls "$wheel_libs"/../nixl_cu13.libs/ucx/libuct_cuda.so* 2>/dev/null | head -n1 || true)
if [[ -n "$wheel_cuda" ]]; then
  say "wheel $(readlink -f "$wheel_cuda"): POSIX-fd markers $(count_markers "$wheel_cuda")"
else
  say "wheel's libuct_cuda.so not found (scripts/nixl-runtime.sh failed?): comparison skipped"
fi
LD_LIBRARY_PATH=$PREFIX/lib "$PREFIX/bin/ucx_info" -v | sed 's/^/  ucx_info: /' >&2 || true
# Smoke test of the C API against the built libraries (no GPU needed): an agent, its plugin list,
# and a UCX backend. The prototypes are declared here (handles are opaque pointers, status 0 = OK).
cat >"$BUILD/nixl_smoke.c" <<'EOF'
#include <stdio.h>
#include <stddef.h>
typedef void *h;
int nixl_capi_create_agent(const char *name, h *agent);
int nixl_capi_destroy_agent(h agent);
int nixl_capi_get_available_plugins(h agent, h *list);
int nixl_capi_string_list_size(h list, size_t *n);
int nixl_capi_string_list_get(h list, size_t i, const char **s);
int nixl_capi_destroy_string_list(h list);
int nixl_capi_get_plugin_params(h agent, const char *plugin, h *mems, h *params);
int nixl_capi_destroy_mem_list(h mems);
int nixl_capi_destroy_params(h params);
int nixl_capi_create_backend(h agent, const char *plugin, h params, h *backend);
int nixl_capi_destroy_backend(h backend);
int main(void) {
  h agent, list, mems, params, backend;
  size_t n;
  const char *s;
  if (nixl_capi_create_agent("smoke", &agent)) return 1;
  if (nixl_capi_get_available_plugins(agent, &list) || nixl_capi_string_list_size(list, &n)) return 2;
  printf("plugins:");
  for (size_t i = 0; i < n; i++)
    if (!nixl_capi_string_list_get(list, i, &s)) printf(" %s", s);
  printf("\n");
  nixl_capi_destroy_string_list(list);
  if (nixl_capi_get_plugin_params(agent, "UCX", &mems, &params)) return 3;
  int st = nixl_capi_create_backend(agent, "UCX", params, &backend);
  printf("UCX backend: %s (status %d)\n", st ? "FAILED" : "created", st);
  if (!st) nixl_capi_destroy_backend(backend);
  nixl_capi_destroy_mem_list(mems);
  nixl_capi_destroy_params(params);
  nixl_capi_destroy_agent(agent);
  return st ? 4 : 0;
}
EOF
if ! smoke=$(gcc -o "$BUILD/nixl_smoke" "$BUILD/nixl_smoke.c" -L"$PREFIX/lib" -Wl,-rpath-link,"$PREFIX/lib" \
  -lnixl_capi 2>&1); then
  say "WARNING: the C API smoke test did not compile:"
# (env -u: UCX warns about unknown UCX_* variables, and this script's UCX_SRC/UCX_TAG are such.)
elif smoke=$(env -u UCX_SRC -u UCX_TAG LD_LIBRARY_PATH="$PREFIX/lib" timeout 120 "$BUILD/nixl_smoke" 2>&1); then
  say "C API smoke test passed:"
else
  say "WARNING: C API smoke test failed (exit $?); its output:"
fi
printf '%s\n' "$smoke" | tail -n 15 | sed 's/^/  smoke: /' >&2
step_end

# ---- 6. Pack -----------------------------------------------------------------------------------
step_start "pack"
name=ucx-nixl-runtime
stage=$WORK/pack/$name
rm -rf "$WORK/pack" && mkdir -p "$stage/lib/ucx" "$stage/lib/plugins" "$stage/bin"
cp -P "$PREFIX"/lib/*.so* "$stage/lib/"         # UCX (ucp, uct, ucs, ucm) and NIXL libraries
cp -P "$PREFIX"/lib/ucx/*.so* "$stage/lib/ucx/" # UCX modules: cuda (copy, ipc), cma, ucm_cuda
cp -P "$PREFIX"/lib/plugins/*.so "$stage/lib/plugins/" # NIXL plugins: UCX
cp "$PREFIX/bin/ucx_info" "$stage/bin/"         # to check transports there: ucx_info -d
[[ -x "$BUILD/nixl_smoke" ]] && cp "$BUILD/nixl_smoke" "$stage/bin/" # agent + UCX backend check
# libucm_cuda.so (UCX's hooks on cudaFree etc.) needs the CUDA runtime; the GPU machine has no
# toolkit on its library path, so the wheel's libcudart.so.13 (0.7 MB) goes along.
cp -L "$CUDA_ROOT/lib/libcudart.so.13" "$stage/lib/"
find "$stage" -type f -name '*.so*' -exec strip --strip-unneeded {} +
strip --strip-unneeded "$stage/bin/ucx_info"
cat >"$stage/env.sh" <<'EOF'
# Source this file (bash): puts the UCX + NIXL built by scripts/build-ucx-nixl.sh on the library
# path. NIXL finds its plugins in lib/plugins next to libnixl.so, UCX its modules in lib/ucx next
# to libucs.so; both are also set explicitly. Do not mix with the nixl-cu13 wheel's libraries.
_d=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export LD_LIBRARY_PATH="$_d/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NIXL_PLUGIN_DIR="$_d/lib/plugins"
export UCX_MODULE_DIR="$_d/lib/ucx"
export PATH="$_d/bin:$PATH"
unset _d
EOF
{
  echo "Built by scripts/build-ucx-nixl.sh on $(date -u +%Y-%m-%dT%H:%MZ) ($(. /etc/os-release && echo "$PRETTY_NAME"), glibc $glibc)"
  echo "UCX $ucx_ver ($UCX_TAG), NIXL $nixl_ver ($NIXL_TAG), abseil $absl_found (static), CUDA headers $CUDA_ROOT"
  echo "UCX configure: ${ucx_configure[*]}"
  echo "config.h: $(grep -h -E '^#define (HAVE_DECL_SYS_PIDFD_GETFD|HAVE_CUDA|HAVE_CUDA_FABRIC) ' "$ucx_build/config.h" | tr '\n' ';')"
  echo "libuct_cuda.so POSIX-fd markers: $built_result (${markers[*]})"
} >"$stage/BUILDINFO"
mkdir -p "$(dirname "$OUT")"
tar -C "$WORK/pack" -cf - "$name" | xz -9 -T"$JOBS" >"$OUT.tmp"
mv "$OUT.tmp" "$OUT"
say "packed $OUT: $(du -h "$OUT" | cut -f1) ($(du -sh "$stage" | cut -f1) unpacked)"
step_end

say "times (s): $(for k in "${!took[@]}"; do printf '%s=%s ' "${k// /_}" "${took[$k]}"; done)total=$SECONDS"
cat >&2 <<EOF

On the GPU machine (glibc >= $glibc, with the driver's libcuda.so.1 and libnvidia-ml.so.1):
  tar -xJf $(basename "$OUT") -C /tmp
  . /tmp/$name/env.sh      # LD_LIBRARY_PATH=/tmp/$name/lib, NIXL_PLUGIN_DIR=.../lib/plugins, UCX_MODULE_DIR=.../lib/ucx
  ucx_info -d | grep -A3 cuda_ipc
  nixl_smoke               # creates a NIXL agent and a UCX backend through libnixl_capi.so
  # nixl-sys (the project's 'nixl' feature) dlopens libnixl_capi.so from LD_LIBRARY_PATH.
  # Check the protocol UCX picks for VMM memory: UCX_PROTO_INFO=y (expect cuda_ipc, not tcp).
EOF
