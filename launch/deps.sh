# Sourced by the README's commands (launch/bench.sh, launch/test.sh). Defines:
#   xent_install_deps      installs what the build needs and is missing (Debian/Ubuntu, apt-get)
#   xent_configure_build   configures and builds into build/ at the repository root
# Set XENT_CUDA_ARCH to override the CUDA architecture (default: the GPU's, else 90).

XENT_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

xent_say() { echo "[xent] $*"; }

# Debian packages, each checked by a file it provides, so that nothing present is reinstalled.
xent_missing_packages() {
  local missing=()
  command -v cmake >/dev/null || missing+=(cmake)
  command -v g++ >/dev/null || missing+=(g++)
  command -v mpirun >/dev/null || missing+=(openmpi-bin)
  [ -e /usr/include/x86_64-linux-gnu/mpi/mpi.h ] || [ -e /usr/include/mpi.h ] ||
    [ -e /usr/lib/x86_64-linux-gnu/openmpi/include/mpi.h ] || missing+=(libopenmpi-dev)
  [ -e /usr/include/gtest/gtest.h ] || missing+=(libgtest-dev libgmock-dev)
  [ -e /usr/include/yaml-cpp/yaml.h ] || missing+=(libyaml-cpp-dev)
  [ -e /usr/include/nlohmann/json.hpp ] || missing+=(nlohmann-json3-dev)
  [ -e /usr/include/CLI/CLI.hpp ] || missing+=(libcli11-dev)
  compgen -G "/usr/lib/*/libopenblas.so" >/dev/null || missing+=(libopenblas-dev)
  echo "${missing[@]}"
}

xent_install_deps() {
  local missing
  missing=$(xent_missing_packages)
  if [ -n "$missing" ]; then
    if [ "$(id -u)" -eq 0 ]; then
      xent_say "installing missing Debian packages: $missing"
      DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null || return 1
    else
      xent_say "missing packages: $missing"
      xent_say "not root: install them with: sudo apt-get install -y $missing"
      return 1
    fi
  else
    xent_say "build dependencies present (cmake, g++, Open MPI, GoogleTest, yaml-cpp, nlohmann-json, CLI11, OpenBLAS)"
  fi
  xent_install_cutlass
  if ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then
    xent_say "the CUDA toolkit (nvcc, with NCCL) is required: install CUDA 12.4+ from NVIDIA"
    xent_say "(https://developer.nvidia.com/cuda-downloads) and NCCL (libnccl-dev), then retry"
    return 1
  fi
}

# CUTLASS's C++ headers for the fused lm head's sm_90a epilogue GEMMs (cmake/cutlass.cmake finds
# them in this package): PyPI's nvidia-cutlass, pure Python, pinned; --no-deps, since only its
# headers are used. Without it the build keeps cuBLASLt alone and says so.
XENT_CUTLASS_PIP=nvidia-cutlass==4.2.0.0
xent_install_cutlass() {
  command -v python3 >/dev/null || return 0
  if python3 -c "import importlib.metadata as m, sys
sys.exit(m.version('nvidia-cutlass') != '${XENT_CUTLASS_PIP#*==}')" 2>/dev/null; then
    return 0
  fi
  xent_say "installing CUTLASS's headers from PyPI (python3 -m pip install --no-deps $XENT_CUTLASS_PIP)"
  python3 -m pip install -q --no-deps "$XENT_CUTLASS_PIP" >&2 ||
    xent_say "pip could not install $XENT_CUTLASS_PIP: building without the sm_90a epilogue GEMMs"
}

xent_cuda_arch() {
  if [ -n "${XENT_CUDA_ARCH:-}" ]; then echo "$XENT_CUDA_ARCH"; return; fi
  local cap
  cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d '.')
  echo "${cap:-90}"
}

# xent_configure_build [extra cmake args...]
xent_configure_build() {
  local gen=()
  # A generator can only be chosen when build/ is first configured.
  [ ! -f "$XENT_ROOT/build/CMakeCache.txt" ] && command -v ninja >/dev/null && gen=(-G Ninja)
  local arch
  arch=$(xent_cuda_arch)
  xent_say "configuring build/ (CUDA architecture $arch)"
  cmake -S "$XENT_ROOT" -B "$XENT_ROOT/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_ARCHITECTURES="$arch" "$@" >"$XENT_ROOT/build.log" 2>&1 ||
    { cat "$XENT_ROOT/build.log"; return 1; }
  xent_say "building (log: build.log)"
  cmake --build "$XENT_ROOT/build" -j "$(nproc)" >>"$XENT_ROOT/build.log" 2>&1 ||
    { tail -n 60 "$XENT_ROOT/build.log"; return 1; }
}
