#!/usr/bin/env bash
# The Megatron tests of the Python suite under a given Python and megatron-core, in a virtual
# environment of their own that this script makes once and reuses:
#
#   bash launch/megatron_env.sh PYTHON_VERSION MEGATRON_CORE_VERSION VENV_DIR [pytest args...]
#   bash launch/megatron_env.sh 3.12 0.19.2 build/megatron-envs/py3.12-megatron-core-0.19.2
#
# ctest's torch_python_megatron_0_19 runs the second line (megatron-core 0.17 and later need
# Python 3.12 or newer); torch_python runs the same tests with megatron-core 0.16.1 under the
# default python3 (launch/torch.sh installs it there). Each step says on stdout what it does:
#
#  1. finds pythonX.Y: on PATH, else pyenv's ($PYENV_ROOT, else ~/.pyenv), /usr/local/bin and
#     /usr/bin; where there is none it exits with 77, which ctest counts as skipped.
#  2. the virtual environment VENV_DIR: made with that Python's venv module where VENV_DIR has
#     none of that Python; then, only where something is missing or of another version,
#     pip-installs torch==2.11.0 (from PyPI, as launch/torch.sh does: its CUDA wheels, a few GB;
#     the tests run on the CPU), megatron-core==VERSION, pytest and scikit-build-core, and
#     cmake and ninja where the system's are missing (cmake: or older than 3.24).
#  3. xent for that Python: pip install --no-deps --no-build-isolation of this checkout into the
#     environment, its build folder kept in VENV_DIR/xent-build (a later run recompiles only
#     what changed); CUDA architectures $XENT_PIP_CUDA_ARCH (ctest sets its build's), else
#     $XENT_CUDA_ARCH, else the GPU's, else 90.
#  4. pytest in that environment, from the repository root: by default tests/python/
#     test_megatron_functions.py, test_megatron_patch.py, test_megatron_gpt.py and the Megatron
#     tests of test_linear_one_rank.py and test_exact_grad.py (other arguments replace that
#     list). conftest.py imports xent from python/ of this checkout; XENT_TORCH_LIB points it at
#     the library (and xent._C) that step 3 installed.
# Two runs on one VENV_DIR take turns (flock on VENV_DIR.lock).
set -euo pipefail
source "$(dirname "$0")/deps.sh"  # XENT_ROOT, xent_say, xent_cuda_arch

if [ $# -lt 3 ]; then
  echo "usage: bash launch/megatron_env.sh PYTHON_VERSION MEGATRON_CORE_VERSION VENV_DIR [pytest args...]" >&2
  exit 2
fi
want_py=$1 want_mcore=$2 venv=$3
shift 3
want_torch=2.11.0
start=$SECONDS
elapsed() { echo "$((SECONDS - start)) s"; }

# 1. the Python
python_ok() {  # a pythonX.Y that runs (a pyenv shim of an unselected version does not)
  [ -x "$1" ] || command -v "$1" >/dev/null || return 1
  "$1" -c "import sys, venv; sys.exit(sys.version_info[:2] != tuple(map(int, '$want_py'.split('.'))))" \
    >/dev/null 2>&1
}
python=""
candidates=("python$want_py")
pyenv_root=${PYENV_ROOT:-$HOME/.pyenv}
while IFS= read -r dir; do
  candidates+=("$dir/bin/python$want_py")
done < <(find "$pyenv_root/versions" -mindepth 1 -maxdepth 1 -name "$want_py.*" 2>/dev/null |
         sort -rV)
candidates+=("/usr/local/bin/python$want_py" "/usr/bin/python$want_py")
for c in "${candidates[@]}"; do
  if python_ok "$c"; then python=$(command -v "$c" || echo "$c"); break; fi
done
if [ -z "$python" ]; then
  xent_say "no working Python $want_py (with its venv module) found (looked at: ${candidates[*]}):"
  xent_say "skipping the megatron-core $want_mcore tests; install Python $want_py (e.g. pyenv install $want_py)"
  exit 77
fi
if [ "$python" = "python$want_py" ] || [[ "$python" == */shims/* ]]; then
  # a pyenv shim resolves to an interpreter: the venv is made from that one
  python=$("$python" -c 'import sys; print(sys.executable)')
fi

mkdir -p "$(dirname "$venv")"
venv=$(cd "$(dirname "$venv")" && pwd)/$(basename "$venv")
exec 9>"$venv.lock"
flock 9

# 2. the environment and its packages
vpy=$venv/bin/python
if ! [ -x "$vpy" ] || ! "$vpy" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$want_py'.split('.'))))" 2>/dev/null; then
  xent_say "making the virtual environment $venv ($python -m venv)"
  "$python" -m venv --clear "$venv"
fi
have=$("$vpy" -I - <<'EOF' 2>/dev/null || true
import importlib.metadata as md
for name in ("torch", "megatron-core", "pytest", "scikit-build-core"):
    try:
        print(f"{name}=={md.version(name).split('+')[0]}")
    except md.PackageNotFoundError:
        print(f"{name} missing")
EOF
)
want=("torch==$want_torch" "megatron-core==$want_mcore")
grep -qx "torch==$want_torch" <<<"$have" || need=1
grep -qx "megatron-core==$want_mcore" <<<"$have" || need=1
grep -q "^pytest==" <<<"$have" || need=1
grep -q "^scikit-build-core==" <<<"$have" || need=1
tools=()
cmake_ok() {
  local v
  v=$(cmake --version 2>/dev/null | sed -n 's/^cmake version \([0-9]*\)\.\([0-9]*\).*/\1 \2/p')
  [ -n "$v" ] && { read -r major minor <<<"$v"; [ "$major" -gt 3 ] || { [ "$major" -eq 3 ] && [ "$minor" -ge 24 ]; }; }
}
cmake_ok || [ -x "$venv/bin/cmake" ] || tools+=(cmake)
command -v ninja >/dev/null || [ -x "$venv/bin/ninja" ] || tools+=(ninja)
if [ -n "${need:-}" ] || [ ${#tools[@]} -gt 0 ]; then
  xent_say "installing into $venv from PyPI: ${want[*]} pytest scikit-build-core ${tools[*]}"
  xent_say "(torch's CUDA wheels, as launch/torch.sh installs them; had: ${have//$'\n'/ })"
  "$vpy" -m pip install "${want[@]}" pytest scikit-build-core "${tools[@]}"
  xent_say "installed ($(elapsed) so far)"
else
  xent_say "reusing $venv: ${have//$'\n'/ } ($(elapsed) so far)"
fi
PATH=$venv/bin:$PATH  # its cmake and ninja, where it has them

# 3. xent, built for this Python
build=$venv/xent-build
if [ -f "$build/CMakeCache.txt" ] &&
   ! grep -qx "CMAKE_HOME_DIRECTORY:INTERNAL=$XENT_ROOT" "$build/CMakeCache.txt"; then
  xent_say "$build was configured for another checkout: building afresh"
  rm -rf "$build"
fi
arch=${XENT_PIP_CUDA_ARCH:-$(xent_cuda_arch)}
archs=${arch//,/;}
xent_say "building xent for Python $want_py into $venv: pip install --no-deps --no-build-isolation" \
  "-Cbuild-dir=$build (CUDA architectures $archs; log: $venv/xent-build.log)"
if ! "$vpy" -m pip install --no-deps --no-build-isolation --no-index \
    "-Cbuild-dir=$build" "-Ccmake.define.CMAKE_CUDA_ARCHITECTURES=$archs" \
    "$XENT_ROOT" >"$venv/xent-build.log" 2>&1; then
  tail -n 60 "$venv/xent-build.log"
  xent_say "the build failed (log: $venv/xent-build.log)"
  exit 1
fi
lib=$("$vpy" -I - <<'EOF'
import importlib.util, pathlib
spec = importlib.util.find_spec("xent")
print(pathlib.Path(spec.origin).parent / "libxent_torch.so")
EOF
)
[ -f "$lib" ] || { xent_say "the install has no $lib"; exit 1; }
xent_say "xent built and installed ($(elapsed) so far)"

# 4. the tests
tests=("$@")
if [ ${#tests[@]} -eq 0 ]; then
  tests=(tests/python/test_megatron_functions.py
         tests/python/test_megatron_patch.py
         tests/python/test_megatron_gpt.py
         tests/python/test_linear_one_rank.py::test_megatron_one_rank
         tests/python/test_linear_one_rank.py::test_megatron_patch_covers_the_linear_path_where_it_exists
         tests/python/test_exact_grad.py::test_megatron_drop_in_is_rounded_once)
fi
versions=$("$vpy" -I - <<'EOF'
import importlib.metadata as md, sys, torch
print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, "
      f"megatron-core {md.version('megatron-core')}")
EOF
)
xent_say "running pytest with $versions; xent's library $lib"
cd "$XENT_ROOT"
status=0
XENT_TORCH_LIB=$lib OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} \
  "$vpy" -m pytest -q -p no:cacheprovider "${tests[@]}" || status=$?
xent_say "megatron-core $want_mcore under Python $want_py: pytest exit status $status ($(elapsed) in all)"
exit $status
