#!/usr/bin/env bash
# The README's test command: installs what is missing, builds into build/, runs every ctest test.
# Tests labelled gpu skip where no GPU is visible. Extra arguments go to ctest (e.g. -L unit).
set -euo pipefail
source "$(dirname "$0")/deps.sh"
xent_install_deps
xent_configure_build ${XENT_CMAKE_ARGS:-}
xent_say "running the tests (ctest)"
# mpirun refuses root unless told; these apply to the tests' own mpirun calls only.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cd "$XENT_ROOT/build"
ctest --output-on-failure --timeout 600 -j 2 "$@"
