#!/usr/bin/env bash
# The README's benchmark command. On a fresh Debian/Ubuntu machine: installs what the build is
# missing, builds into build/, then runs xent_dist_bench under mpirun with
#   - one rank per GPU (nvidia-smi -L) on the CUDA backend, with the Llama 3 preset for that many
#     ranks (configs/llama3-tpN.yaml) when there is one, or
#   - without a GPU, 4 ranks on the CPU backend with a small sweep,
# verifying every size (--check) and writing results/xent-*.json for launch/plot.py.
# Extra arguments go to xent_dist_bench and win over these defaults, e.g.
#   launch/bench.sh --config configs/gemma2-tp2.yaml --graph
#   launch/bench.sh --tokens 8192 --vocab 151936 --mode fused
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$root/launch/deps.sh"
xent_install_deps
xent_configure_build ${XENT_CMAKE_ARGS:-}
bin="$root/build/bench/xent_dist_bench"
if [ ! -x "$bin" ]; then
  xent_say "$bin was not built (configured with -DXENT_BUILD_BENCH=OFF?)"
  exit 1
fi

# What the caller already chose, so that the defaults below stay out of its way.
has_config=0 has_sweep=0 has_vocab=0 has_json=0
for a in "$@"; do
  case "$a" in
    --config|--config=*) has_config=1 ;;
    --tokens|--tokens=*|--min-tokens*|--max-tokens*|--step-factor*|-b*|-e*|-f*) has_sweep=1 ;;
    --vocab|--vocab=*) has_vocab=1 ;;
    --json|--json=*) has_json=1 ;;
  esac
done

ngpu=0
if command -v nvidia-smi >/dev/null 2>&1; then
  ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
fi
stamp=$(date +%Y%m%d-%H%M%S)
host=$(hostname -s 2>/dev/null || hostname)
defaults=(--check)
if [ "$ngpu" -gt 0 ]; then
  np=$ngpu
  defaults=(--device cuda "${defaults[@]}")
  if [ $has_config -eq 0 ] && [ $has_vocab -eq 0 ]; then
    if [ -f "$root/configs/llama3-tp$np.yaml" ]; then
      defaults+=(--config "$root/configs/llama3-tp$np.yaml")
    else
      defaults+=(--vocab 128256 --dtype bf16)
    fi
  fi
  json="$root/results/xent-$host-${np}gpu-$stamp.json"
  launch=("$root/launch/mpirun.sh" -np "$np")
  xent_say "$ngpu GPU(s): $np rank(s) on the CUDA backend"
else
  np=4
  defaults=(--device cpu "${defaults[@]}" -n 3 -w 1)
  if [ $has_config -eq 0 ]; then
    [ $has_vocab -eq 1 ] || defaults+=(--vocab 32000)
    [ $has_sweep -eq 1 ] || defaults+=(--tokens 64,128,256)
  fi
  json="$root/results/xent-$host-cpu-$stamp.json"
  launch=(mpirun -np "$np" --oversubscribe --bind-to none)
  xent_say "no GPU visible: $np ranks on the CPU backend (a small sweep; the timings say little)"
fi
[ $has_json -eq 1 ] || defaults+=(--json "$json")

cmd=("${launch[@]}" "$bin" "${defaults[@]}" "$@")
xent_say "running: ${cmd[*]}"
# mpirun refuses to run as root unless told; this applies to this command only.
OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "${cmd[@]}"
[ $has_json -eq 1 ] || xent_say "results: $json (plot: python3 launch/plot.py results/*.json -o docs/roofline.png)"
