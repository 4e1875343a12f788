#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck) over a representative subset of the GPU tests of a
# build, and over the device exchange of 2 ranks sharing GPU 0. Logs into $XENT_LOGS (default:
# gpu-logs/); XENT_SANITIZE_FILTER replaces the GPU tests' subset.
# Usage: bash launch/sanitize.sh [build folder, default build/]
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
logs=${XENT_LOGS:-$root/gpu-logs}
mkdir -p "$logs"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
status=0
subset=CudaBackend.Options:CudaBackend.EmptyBatch:CudaBackend.BadTargetIsReported:CudaBackend.GraphCaptureMatchesEager:CudaBackend.OutOfPlaceBackwardMatchesCpu:CudaBackend.FinalizeBlocksReuseOneGroup:CudaReference.*:SinglePass.*:DeviceExchange.OneRankSelfExchange:CudaImage.*:CudaBackend.FusedBackward*
for tool in memcheck racecheck; do
  filter=${XENT_SANITIZE_FILTER:-$subset}
  # TwoRanksMatchCpu runs two ranks as host threads that wait for each other: under racecheck,
  # which serialises the kernels of both, it hung on a 2-GPU machine; memcheck runs it.
  [ "$tool" = memcheck ] && [ -z "${XENT_SANITIZE_FILTER:-}" ] && filter=$filter:CudaBackend.TwoRanksMatchCpu
  timeout 300 compute-sanitizer --tool "$tool" --error-exitcode 9 "$build/tests/gpu/xent_gpu_tests" \
    --gtest_filter="$filter" >"$logs/sanitize_$tool.log" 2>&1 || status=1
  tail -n 3 "$logs/sanitize_$tool.log"
  # The device exchange of 2 ranks, processes sharing GPU 0, each under the sanitizer.
  XENT_TEST_BACKEND=cuda-mpi XENT_TEST_DEVICE_EXCHANGE=1 CUDA_VISIBLE_DEVICES=0 timeout 300 \
    mpirun -np 2 --oversubscribe compute-sanitizer --tool "$tool" --error-exitcode 9 \
    "$build/dist_tests/xent_dist_tests" \
    --gtest_filter='Dist.UnevenShardsPlain:Dist.MediumUneven:Dist.Padded*:Dist.WideShards*' \
    >"$logs/sanitize_dist_exchange_$tool.log" 2>&1 || status=1
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$logs/sanitize_dist_exchange_$tool.log"
done
exit $status
