#!/usr/bin/env bash
# What CI cannot run: on a GPU machine, for each build the package may ship (the default, for the
# visible GPUs, into build/; and one for sm_80 alone, the A100's code, into build-sm80/, which
# newer GPUs run from its PTX: the pre-Hopper paths, tested on the GPU at hand), build with the
# LibTorch adapter (as launch/torch.sh configures it), run every test (GPU ones included: the
# Python suite through `import xent` on CUDA, and over NCCL with 2 GPUs), the NCCL dist tests on
# all GPUs (with and without the device exchange), the fused lm head's bench verified on all GPUs
# (xent_dist_bench --hidden --check), and compute-sanitizer on a representative subset (the
# device exchange of 2 ranks sharing GPU 0 among it).
# Logs go to $XENT_LOGS/<build>/ (default: gpu-logs/); XENT_GPU_BUILDS chooses the builds
# ("default 80" by default: each word "default" or a CMAKE_CUDA_ARCHITECTURES value);
# XENT_GPU_STEPS chooses the steps ("build test sanitize" by default: a machine whose commands
# are time-limited can run them one call each, the build folders kept between calls);
# XENT_CTEST_ARGS adds ctest arguments (say -R or -E), XENT_SANITIZE=0 skips the sanitizers and
# XENT_CMAKE_ARGS adds configure arguments.
# Usage: bash launch/gpu_check.sh
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
logs_root=${XENT_LOGS:-$root/gpu-logs}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# The sm_80 build runs on newer GPUs from PTX that the driver compiles on each kernel's first
# use (on an H100 the device exchange's test took over 150 s the first time, 39 s once cached):
# a cache that holds all of it.
export CUDA_CACHE_MAXSIZE=${CUDA_CACHE_MAXSIZE:-4294967296}
ngpu=$(nvidia-smi -L | wc -l)
echo "== $ngpu GPU(s), compute capability $(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n1)"
nvidia-smi -L
source "$root/launch/torch.sh"
torch_args=$(xent_torch_cmake_args)
status=0

step() { [[ " ${XENT_GPU_STEPS:-build test sanitize} " == *" $1 "* ]]; }

# check_build <default|architectures>
check_build() {
  local name=default build=$root/build arch_args=()
  if [ "$1" != default ]; then
    name=sm$1
    build=$root/build-sm$1
    arch_args=(-DCMAKE_CUDA_ARCHITECTURES="$1")
  fi
  local logs=$logs_root/$name
  mkdir -p "$logs"
  if step build; then
    echo "== build $name (${build#$root/})"
    cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${arch_args[@]}" \
      $torch_args ${XENT_CMAKE_ARGS:-} >"$logs/configure.log" 2>&1 ||
      { tail -n 40 "$logs/configure.log"; status=1; return; }
    grep -E "xent: CUDA architectures" "$logs/configure.log"
    cmake --build "$build" -j "$(nproc)" >"$logs/build.log" 2>&1 ||
      { grep -E "error" -A3 "$logs/build.log" | head -60; status=1; return; }
  fi
  if step test; then
    (cd "$build" && ctest --output-on-failure -j 4 --timeout 600 ${XENT_CTEST_ARGS:-}) >"$logs/ctest.log" 2>&1 || status=1
    tail -n 15 "$logs/ctest.log"
  fi
  if step test && [ "$ngpu" -ge 2 ]; then
    echo "== dist tests over NCCL, $ngpu ranks"
    XENT_TEST_BACKEND=cuda mpirun -np "$ngpu" --oversubscribe "$build/dist_tests/xent_dist_tests" \
      >"$logs/dist_nccl.log" 2>&1 || status=1
    grep -E "PASSED|FAILED|tests ran" "$logs/dist_nccl.log" | sort | uniq -c
    echo "== the same checks as the CPU backend's, opted into (XENT_CHECK_RANKS=1)"
    XENT_CHECK_RANKS=1 XENT_TEST_BACKEND=cuda mpirun -np "$ngpu" --oversubscribe \
      "$build/dist_tests/xent_dist_tests" --gtest_filter='*EveryRankThrows' \
      >"$logs/dist_nccl_check_ranks.log" 2>&1 || status=1
    grep -E "PASSED|FAILED|tests ran" "$logs/dist_nccl_check_ranks.log" | sort | uniq -c
    echo "== dist tests over NCCL with the device exchange, $ngpu ranks"
    XENT_TEST_DEVICE_EXCHANGE=1 XENT_TEST_BACKEND=cuda mpirun -np "$ngpu" --oversubscribe \
      "$build/dist_tests/xent_dist_tests" >"$logs/dist_nccl_exchange.log" 2>&1 || status=1
    grep -E "PASSED|FAILED|tests ran" "$logs/dist_nccl_exchange.log" | sort | uniq -c
    echo "== the fused lm head over NCCL, $ngpu ranks, against the float64 reference"
    mpirun -np "$ngpu" --oversubscribe "$build/bench/xent_dist_bench" --hidden 1024 --tokens 2048 \
      --vocab 32064 --pad-to 128 --label-smoothing 0.1 --check -n 3 -w 1 \
      >"$logs/lm_head_nccl.log" 2>&1 || status=1
    grep -E "#wrong in all" "$logs/lm_head_nccl.log"
  fi
  { [ "${XENT_SANITIZE:-1}" = 0 ] || ! step sanitize; } && return
  echo "== compute-sanitizer ($name)"
  XENT_LOGS=$logs bash "$root/launch/sanitize.sh" "$build" || status=1
}

for b in ${XENT_GPU_BUILDS:-default 80}; do check_build "$b"; done
exit $status
