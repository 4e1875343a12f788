# shellcheck shell=bash
# Sourced by the README's commands. Defines:
#   xent_torch_cmake_args   prints the CMake arguments that build the LibTorch adapter
#                           (src/torch, tests/torch), or nothing, so that the build goes on
#                           without it.
#
# With python3 present: if `import torch` fails it pip-installs torch==2.11.0 from PyPI (with its
# CUDA and NCCL wheels; a few GB), and pytest and scikit-build-core if they are missing, and
# megatron-core==0.16.1, transformers==5.17.0 with accelerate==1.15.0, and torchtitan==0.3.0, if
# missing or of another version (for tests/python and tests/package), then prints
#   -DXENT_WITH_TORCH=ON -DCMAKE_PREFIX_PATH=<torch.utils.cmake_prefix_path>
#   -DPython3_EXECUTABLE=<that python3, for xent._C>
#   -DXENT_NCCL_ROOT=<site-packages/nvidia/nccl> -DNCCL_LIBRARY=<.../lib/libnccl.so.2>
#   -DNCCL_INCLUDE_DIR=<.../include>
# so that everything links the NCCL that PyTorch uses: a communicator adopted from PyTorch must be
# driven by the library that made it (docs/torch.md). That NCCL ships only libnccl.so.2, which
# find_library(NAMES nccl) does not find, hence the two cache variables. Messages go to stderr;
# set XENT_TORCH=0 to skip the adapter altogether.

xent_torch_say() { echo "[xent] $*" >&2; }

xent_torch_cmake_args() {
  if [ "${XENT_TORCH:-1}" = "0" ]; then
    xent_torch_say "XENT_TORCH=0: building without the LibTorch adapter"
    return 0
  fi
  if ! command -v python3 >/dev/null; then
    xent_torch_say "no python3: building without the LibTorch adapter"
    return 0
  fi
  if ! python3 -c 'import torch' >/dev/null 2>&1; then
    local cmd="python3 -m pip install torch==2.11.0"
    xent_torch_say "PyTorch is not importable: installing torch==2.11.0 from PyPI ($cmd)"
    if ! $cmd >&2; then
      xent_torch_say "pip could not install it as $(id -un) (see above); install it yourself, e.g. in a"
      xent_torch_say "venv (python3 -m venv .venv && . .venv/bin/activate), then rerun: $cmd"
      xent_torch_say "building without the LibTorch adapter"
      return 0
    fi
  fi
  # The Python suite (ctest torch_python) runs under pytest; python_package builds the wheel with
  # scikit-build-core (pyproject.toml).
  if ! python3 -c 'import pytest' >/dev/null 2>&1; then
    xent_torch_say "pytest is not importable: installing it from PyPI (python3 -m pip install pytest)"
    python3 -m pip install pytest >&2 || xent_torch_say "pip could not install pytest: torch_python will fail"
  fi
  # tests/python/test_megatron_*.py check xent.megatron against Megatron-core itself: 0.16.1 here
  # (ctest torch_python), 0.19.2 under Python 3.12 in a virtual environment of its own (ctest
  # torch_python_megatron_0_19, launch/megatron_env.sh).
  local mc_want=megatron-core==0.16.1 mc_have
  mc_have=$(python3 -c 'import importlib.metadata as md, megatron.core
print("megatron-core==" + md.version("megatron-core"))' 2>/dev/null)
  if [ "$mc_have" != "$mc_want" ]; then
    xent_torch_say "${mc_have:-megatron-core is not importable}: installing $mc_want from PyPI (python3 -m pip install $mc_want)"
    if ! python3 -m pip install "$mc_want" >&2; then
      if [ -z "$mc_have" ]; then
        xent_torch_say "pip could not install $mc_want: its tests will skip"
      else
        xent_torch_say "pip could not install $mc_want: the Megatron tests run with $mc_have"
      fi
    fi
  fi
  # tests/python/test_transformers_*.py check xent.transformers against the Transformers version
  # it was written for; the tensor-parallel test needs accelerate (tp_plan requires it).
  local hf_tf=transformers==5.17.0 hf_acc=accelerate==1.15.0 hf_want hf_have
  hf_want="$hf_tf $hf_acc"
  hf_have=$(python3 -c 'import transformers, accelerate
print(f"transformers=={transformers.__version__} accelerate=={accelerate.__version__}")' 2>/dev/null)
  if [ "$hf_have" != "$hf_want" ]; then
    xent_torch_say "${hf_have:-transformers or accelerate is not importable}: installing $hf_want from PyPI (python3 -m pip install $hf_want)"
    if ! python3 -m pip install "$hf_tf" "$hf_acc" >&2; then
      if [ -z "$hf_have" ]; then
        xent_torch_say "pip could not install $hf_want: tests/python/test_transformers_*.py skip without"
        xent_torch_say "transformers, and their Trainer and tp_plan tests without accelerate"
      else
        xent_torch_say "pip could not install $hf_want: the Transformers tests run with $hf_have"
      fi
    fi
  fi
  # tests/python/test_titan.py trains TorchTitan's own Trainer (examples/titan_train.py).
  if [ "$(python3 -c 'import importlib.metadata as m; print(m.version("torchtitan"))' 2>/dev/null)" != "0.3.0" ]; then
    xent_torch_say "torchtitan 0.3.0 is not installed: installing it from PyPI (python3 -m pip install torchtitan==0.3.0)"
    python3 -m pip install torchtitan==0.3.0 >&2 ||
      xent_torch_say "pip could not install torchtitan==0.3.0: tests/python/test_titan.py skips"
  fi
  if ! python3 -c 'import scikit_build_core' >/dev/null 2>&1; then
    xent_torch_say "scikit-build-core is not importable: installing it from PyPI (python3 -m pip install scikit-build-core)"
    python3 -m pip install scikit-build-core >&2 ||
      xent_torch_say "pip could not install scikit-build-core: python_package will skip"
  fi
  local info
  if ! info=$(python3 - <<'EOF' 2>/dev/null
import os, torch
prefix = torch.utils.cmake_prefix_path
nccl = ""
for base in [os.path.dirname(os.path.dirname(torch.__file__))]:
    root = os.path.join(base, "nvidia", "nccl")
    if os.path.isfile(os.path.join(root, "lib", "libnccl.so.2")):
        nccl = root
print(prefix)
print(nccl)
print(torch.__version__)
EOF
  ); then
    xent_torch_say "could not ask PyTorch for its CMake prefix: building without the LibTorch adapter"
    return 0
  fi
  local prefix nccl version
  prefix=$(echo "$info" | sed -n 1p)
  nccl=$(echo "$info" | sed -n 2p)
  version=$(echo "$info" | sed -n 3p)
  # Python3_EXECUTABLE: xent._C is built for this Python (the one that has this PyTorch).
  local args="-DXENT_WITH_TORCH=ON -DCMAKE_PREFIX_PATH=$prefix -DPython3_EXECUTABLE=$(command -v python3)"
  if [ -n "$nccl" ]; then
    args="$args -DXENT_NCCL_ROOT=$nccl -DNCCL_LIBRARY=$nccl/lib/libnccl.so.2"
    args="$args -DNCCL_INCLUDE_DIR=$nccl/include"
    xent_torch_say "LibTorch adapter on: PyTorch $version, its NCCL at $nccl"
  else
    xent_torch_say "LibTorch adapter on: PyTorch $version (no nvidia/nccl wheel found: the default NCCL is used)"
  fi
  echo "$args"
}
