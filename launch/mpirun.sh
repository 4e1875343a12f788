#!/usr/bin/env bash
# One node, one rank per GPU: launch/mpirun.sh [-np N] [xent_dist_bench flags...]
#   N defaults to the number of GPUs (nvidia-smi -L). Ranks are placed in NUMA order (ranks
#   0..N/k-1 on the first of k NUMA domains, and so on, as GPUs are usually numbered) and bound
#   to their domain; each rank takes the GPU of its local rank. Override the placement with
#   XENT_MPIRUN_BIND (e.g. "--bind-to none"), add mpirun options with XENT_MPIRUN_ARGS, and point
#   at another binary with XENT_BENCH.
# Example: launch/mpirun.sh --config configs/qwen2.5-tp8.yaml --check --graph
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bin=${XENT_BENCH:-$root/build/bench/xent_dist_bench}
np=""
if [ "${1:-}" = "-np" ] || [ "${1:-}" = "-n" ]; then
  np=$2
  shift 2
fi
if [ -z "$np" ]; then
  np=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
fi
if ! [ "$np" -ge 1 ] 2>/dev/null; then
  echo "[xent] no GPU found (nvidia-smi -L); pass -np N, or use launch/bench.sh for the CPU backend" >&2
  exit 1
fi
if [ ! -x "$bin" ]; then
  echo "[xent] $bin not found: build first (launch/bench.sh does, or cmake --build build)" >&2
  exit 1
fi

if [ -n "${XENT_MPIRUN_BIND:-}" ]; then
  read -r -a bind <<<"$XENT_MPIRUN_BIND"
else
  numa=$(ls -d /sys/devices/system/node/node[0-9]* 2>/dev/null | wc -l)
  [ "$numa" -ge 1 ] || numa=1
  if [ $((np % numa)) -eq 0 ]; then
    bind=(--map-by "ppr:$((np / numa)):numa" --bind-to numa)
  else
    bind=(--bind-to numa)
  fi
fi
read -r -a extra <<<"${XENT_MPIRUN_ARGS:-}"

cmd=(mpirun -np "$np" "${bind[@]}" "${extra[@]}" "$bin" --device cuda "$@")
echo "[xent] running: ${cmd[*]}"
OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 exec "${cmd[@]}"
