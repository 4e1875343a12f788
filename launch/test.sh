#!/usr/bin/env bash
# The README's test command: installs what is missing (Debian packages; PyTorch 2.11.0 from PyPI
# for the LibTorch adapter, unless XENT_TORCH=0), builds into build/, runs every ctest test.
# Tests labelled gpu skip where no GPU is visible. Extra arguments go to ctest (e.g. -L unit).
set -euo pipefail
source "$(dirname "$0")/deps.sh"
source "$(dirname "$0")/torch.sh"
xent_install_deps
torch_args=$(xent_torch_cmake_args)
xent_configure_build $torch_args ${XENT_CMAKE_ARGS:-}
xent_say "running the tests (ctest)"
# mpirun refuses root unless told; these apply to the tests' own mpirun calls only.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cd "$XENT_ROOT/build"
ctest --output-on-failure --timeout 600 -j 2 "$@"
