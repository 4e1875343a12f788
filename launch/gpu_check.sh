#!/usr/bin/env bash
# What CI cannot run: on a GPU machine, build (with the LibTorch adapter, as launch/torch.sh
# configures it), run every test (GPU ones included: the Python suite through `import xent` on
# CUDA, and over NCCL with 2 GPUs), the NCCL dist tests on all GPUs (with and without the device
# exchange), and compute-sanitizer on a representative subset (the device exchange of 2 ranks
# sharing GPU 0 among it).
# Logs go to $XENT_LOGS (default: gpu-logs/); XENT_SANITIZE=0 skips the sanitizers and
# XENT_CMAKE_ARGS adds configure arguments. Usage: bash launch/gpu_check.sh
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
logs=${XENT_LOGS:-$root/gpu-logs}
mkdir -p "$logs"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
ngpu=$(nvidia-smi -L | wc -l)
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n1 | tr -d '.')
echo "== $ngpu GPU(s), sm_$arch"
nvidia-smi -L
source "$root/launch/torch.sh"
torch_args=$(xent_torch_cmake_args)
cmake -S "$root" -B "$root/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_ARCHITECTURES="$arch" $torch_args ${XENT_CMAKE_ARGS:-} >"$logs/configure.log" 2>&1 ||
  { tail -n 40 "$logs/configure.log"; exit 1; }
cmake --build "$root/build" -j "$(nproc)" >"$logs/build.log" 2>&1 ||
  { grep -E "error" -A3 "$logs/build.log" | head -60; exit 1; }
echo "== built"
status=0
(cd "$root/build" && ctest --output-on-failure -j 4 --timeout 600) >"$logs/ctest.log" 2>&1 || status=1
tail -n 15 "$logs/ctest.log"
if [ "$ngpu" -ge 2 ]; then
  echo "== dist tests over NCCL, $ngpu ranks"
  XENT_TEST_BACKEND=cuda mpirun -np "$ngpu" --oversubscribe "$root/build/dist_tests/xent_dist_tests" \
    >"$logs/dist_nccl.log" 2>&1 || status=1
  grep -E "PASSED|FAILED|tests ran" "$logs/dist_nccl.log" | sort | uniq -c
  echo "== the same checks as the CPU backend's, opted into (XENT_CHECK_RANKS=1)"
  XENT_CHECK_RANKS=1 XENT_TEST_BACKEND=cuda mpirun -np "$ngpu" --oversubscribe \
    "$root/build/dist_tests/xent_dist_tests" --gtest_filter='*EveryRankThrows' \
    >"$logs/dist_nccl_check_ranks.log" 2>&1 || status=1
  grep -E "PASSED|FAILED|tests ran" "$logs/dist_nccl_check_ranks.log" | sort | uniq -c
  echo "== dist tests over NCCL with the device exchange, $ngpu ranks"
  XENT_TEST_DEVICE_EXCHANGE=1 XENT_TEST_BACKEND=cuda mpirun -np "$ngpu" --oversubscribe \
    "$root/build/dist_tests/xent_dist_tests" >"$logs/dist_nccl_exchange.log" 2>&1 || status=1
  grep -E "PASSED|FAILED|tests ran" "$logs/dist_nccl_exchange.log" | sort | uniq -c
fi
[ "${XENT_SANITIZE:-1}" = 0 ] && exit $status
echo "== compute-sanitizer"
subset=CudaBackend.Options:CudaBackend.EmptyBatch:CudaBackend.BadTargetIsReported:CudaBackend.GraphCaptureMatchesEager:CudaBackend.OutOfPlaceBackwardMatchesCpu:CudaBackend.FinalizeBlocksReuseOneGroup:CudaReference.*:SinglePass.*:DeviceExchange.OneRankSelfExchange
for tool in memcheck racecheck; do
  filter=${XENT_SANITIZE_FILTER:-$subset}
  # TwoRanksMatchCpu runs two ranks as host threads that wait for each other: under racecheck,
  # which serialises the kernels of both, it hung on a 2-GPU machine; memcheck runs it.
  [ "$tool" = memcheck ] && [ -z "${XENT_SANITIZE_FILTER:-}" ] && filter=$filter:CudaBackend.TwoRanksMatchCpu
  timeout 300 compute-sanitizer --tool "$tool" --error-exitcode 9 "$root/build/tests/gpu/xent_gpu_tests" \
    --gtest_filter="$filter" >"$logs/sanitize_$tool.log" 2>&1 || status=1
  tail -n 3 "$logs/sanitize_$tool.log"
  # The device exchange of 2 ranks, processes sharing GPU 0, each under the sanitizer.
  XENT_TEST_BACKEND=cuda-mpi XENT_TEST_DEVICE_EXCHANGE=1 CUDA_VISIBLE_DEVICES=0 timeout 300 \
    mpirun -np 2 --oversubscribe compute-sanitizer --tool "$tool" --error-exitcode 9 \
    "$root/build/dist_tests/xent_dist_tests" \
    --gtest_filter='Dist.UnevenShardsPlain:Dist.MediumUneven:Dist.Padded*:Dist.WideShards*' \
    >"$logs/sanitize_dist_exchange_$tool.log" 2>&1 || status=1
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$logs/sanitize_dist_exchange_$tool.log"
done
exit $status
