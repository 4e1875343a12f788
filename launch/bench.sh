#!/usr/bin/env bash
# The README's benchmark command. On a fresh Debian/Ubuntu machine: installs what the build is
# missing, builds into build/, then runs xent_dist_bench under mpirun with
#   - one rank per GPU (nvidia-smi -L) on the CUDA backend, with the Llama 3 preset for that many
#     ranks (configs/llama3-tpN.yaml) when there is one, or
#   - without a GPU (or with --device cpu), the CPU backend and a small sweep (--tokens 64,128,256,
#     also with --config: the presets are sized for GPUs) on as many ranks as the preset's `tp:`
#     with --config, else 4,
# verifying every size (--check) and writing results/xent-*.json for launch/plot.py.
# Extra arguments go to xent_dist_bench and win over these defaults, e.g.
#   launch/bench.sh --config configs/gemma2-tp2.yaml --graph
#   launch/bench.sh --tokens 8192 --vocab 151936 --mode fused
# Environment:
#   XENT_RANKS=N      run N ranks instead (on GPUs, ranks beyond the GPU count share GPUs)
#   XENT_RESULTS=DIR  write the JSON file into DIR instead of results/
#   XENT_BENCH=FILE   run that xent_dist_bench: nothing is installed or built
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$root/launch/deps.sh"
if [ -n "${XENT_BENCH:-}" ]; then
  bin=$XENT_BENCH
else
  xent_install_deps
  xent_configure_build ${XENT_CMAKE_ARGS:-}
  bin="$root/build/bench/xent_dist_bench"
fi
if [ ! -x "$bin" ]; then
  xent_say "$bin was not built (configured with -DXENT_BUILD_BENCH=OFF?)"
  exit 1
fi
if [ -n "${XENT_RANKS:-}" ] && ! [[ "$XENT_RANKS" =~ ^[1-9][0-9]*$ ]]; then
  xent_say "XENT_RANKS = '$XENT_RANKS': must be a positive integer (the number of ranks)"
  exit 2
fi

# What the caller already chose, so that the defaults below stay out of its way.
has_config=0 has_sweep=0 has_vocab=0 has_json=0 config="" device=""
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  a=${args[i]} next=${args[i + 1]:-}
  case "$a" in
    --config) has_config=1 config=$next ;;
    --config=*) has_config=1 config=${a#--config=} ;;
    --device) device=$next ;;
    --device=*) device=${a#--device=} ;;
    --tokens|--tokens=*|--min-tokens*|--max-tokens*|--step-factor*|-b*|-e*|-f*) has_sweep=1 ;;
    --vocab|--vocab=*) has_vocab=1 ;;
    --json|--json=*) has_json=1 ;;
  esac
done

ngpu=0
if [ "$device" != cpu ] && command -v nvidia-smi >/dev/null 2>&1; then
  ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
fi
stamp=$(date +%Y%m%d-%H%M%S)  # with the PID below: two runs in one second write two files
host=$(hostname -s 2>/dev/null || hostname)
results=${XENT_RESULTS:-$root/results}
defaults=(--check)
if [ "$ngpu" -gt 0 ]; then
  np=${XENT_RANKS:-$ngpu}
  defaults=(--device cuda "${defaults[@]}")
  if [ $has_config -eq 0 ] && [ $has_vocab -eq 0 ]; then
    if [ -f "$root/configs/llama3-tp$np.yaml" ]; then
      defaults+=(--config "$root/configs/llama3-tp$np.yaml")
    else
      defaults+=(--vocab 128256 --dtype bf16)
    fi
  fi
  json="$results/xent-$host-${np}gpu-$stamp-$$.json"
  launch=("$root/launch/mpirun.sh" -np "$np")
  xent_say "$ngpu GPU(s): $np rank(s) on the CUDA backend"
else
  # A preset must run on its own tp ranks (xent_dist_bench refuses any other count): take it
  # from the file; an unreadable file or key leaves 4, and the bench says what is wrong.
  np=4 why="the default"
  if [ $has_config -eq 1 ]; then
    tp=$(sed -n "s/^tp:[[:space:]]*[\"']\{0,1\}\([0-9][0-9]*\).*/\1/p" "$config" 2>/dev/null |
      head -n 1 || true)
    [ -z "$tp" ] || np=$tp why="tp: in $config"
  fi
  [ -z "${XENT_RANKS:-}" ] || np=$XENT_RANKS why="XENT_RANKS"
  defaults=(--device cpu "${defaults[@]}" -n 3 -w 1)
  [ $has_vocab -eq 1 ] || [ $has_config -eq 1 ] || defaults+=(--vocab 32000)
  sweep=""
  [ $has_sweep -eq 1 ] || defaults+=(--tokens 64,128,256) sweep=", a small sweep"
  json="$results/xent-$host-cpu-$stamp-$$.json"
  launch=(mpirun -np "$np" --oversubscribe --bind-to none)
  reason="no GPU visible"
  [ "$device" != cpu ] || reason="--device cpu"
  xent_say "$reason: $np rank(s) ($why) on the CPU backend$sweep; the timings say little"
fi
[ $has_json -eq 1 ] || defaults+=(--json "$json")

cmd=("${launch[@]}" "$bin" "${defaults[@]}" "$@")
xent_say "running: ${cmd[*]}"
# mpirun refuses to run as root unless told; this applies to this command only.
rc=0
OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "${cmd[@]}" || rc=$?
# Only a file the run wrote (not after --help, a refusal, or a crash before the end; the bench
# creates it empty while it checks that it can write it). The plot goes next to the results:
# docs/roofline.png is the README's figure, drawn from docs/results/.
if [ $has_json -eq 0 ] && [ -s "$json" ]; then
  dir=$(dirname "$json")
  dir=${dir#"$root"/}
  xent_say "results: $json (plot: python3 launch/plot.py $dir/*.json -o $dir/roofline.png)"
fi
exit $rc
