#!/usr/bin/env bash
# GPU checks of the LibTorch adapter, from the repository root of a bare GPU machine:
#
#   bash tests/torch/run_gpu.sh          # 2 GPUs (nvidia-h200-x2): build, ctest -L torch (NCCL
#                                        # suite included), the torchrun example, perf_torch
#   bash tests/torch/run_gpu.sh perf     # 1 GPU (nvidia-h100-x1): build, perf_torch only
#
# Logs (and perf_torch.txt) go to $OUT if set, else build-torch/gpu-logs. Exit status: non-zero if any
# step failed (every step still runs). Needs PyTorch 2.11 importable (the machines' torch venv);
# launch/torch.sh pip-installs it otherwise.
set -uo pipefail
mode=${1:-all}
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root" || exit 1
logs=${OUT:-$root/build-torch/gpu-logs}
mkdir -p "$logs"
# The machines' rules (GPU.md): no NVLink multicast; root may run mpirun.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
status=0
step() {  # step NAME COMMAND...: runs, logs to $logs/NAME.log, reports
  local name=$1
  shift
  local t0=$SECONDS
  if "$@" >"$logs/$name.log" 2>&1; then
    echo "[torch-gpu] $name: ok ($((SECONDS - t0)) s)"
  else
    echo "[torch-gpu] $name: FAILED ($((SECONDS - t0)) s); last lines of $logs/$name.log:"
    tail -n 40 "$logs/$name.log"
    status=1
  fi
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$logs/gpus.txt" 2>&1
cat "$logs/gpus.txt"
source launch/torch.sh
args=$(xent_torch_cmake_args 2>"$logs/torch_args.log")
cat "$logs/torch_args.log"
if [ -z "$args" ]; then
  echo "[torch-gpu] no usable PyTorch: nothing to do"
  exit 1
fi
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d '.')
tests=ON
targets=(xent_torch xent_torch_tests xent_torch_dist_tests xent_perf_torch)
[ "$mode" = perf ] && targets=(xent_perf_torch)
# shellcheck disable=SC2086  # $args is a list of -D options
step configure cmake -S . -B build-torch "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_ARCHITECTURES="${arch:-90}" -DXENT_BUILD_BENCH=OFF -DXENT_BUILD_TESTS=$tests $args
step build cmake --build build-torch -j "$(nproc)" --target "${targets[@]}"

if [ "$mode" != perf ]; then
  step ctest ctest --test-dir build-torch -L torch --output-on-failure --timeout 600
  step example_bf16 env XENT_TORCH_LIB="$root/build-torch/src/torch/libxent_torch.so" \
    torchrun --standalone --nproc-per-node "$(nvidia-smi -L | wc -l)" examples/train_step.py \
    --tokens 8192 --vocab 128256 --hidden 1024
  step example_deferred env XENT_TORCH_LIB="$root/build-torch/src/torch/libxent_torch.so" \
    torchrun --standalone --nproc-per-node "$(nvidia-smi -L | wc -l)" examples/train_step.py \
    --grad-mode deferred --dtype fp32
  grep -h "rank " "$logs"/example_*.log
fi
step perf_torch env CUDA_VISIBLE_DEVICES=0 build-torch/tests/torch/xent_perf_torch
cp "$logs/perf_torch.log" "$logs/perf_torch.txt" 2>/dev/null
cat "$logs/perf_torch.log"
exit $status
