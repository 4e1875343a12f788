# pip install . (scikit-build-core sets SKBUILD and Python_EXECUTABLE): the LibTorch adapter is
# built against the PyTorch of the installing Python, linking that PyTorch's own NCCL, as
# launch/torch.sh arranges for the CMake build.
if(NOT Python_EXECUTABLE)
  find_package(Python COMPONENTS Interpreter REQUIRED)
endif()
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c [=[
import os, torch
nccl = os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), "nvidia", "nccl")
print(torch.utils.cmake_prefix_path)
print(nccl if os.path.isfile(os.path.join(nccl, "lib", "libnccl.so.2")) else "")
print(torch.__version__)
]=]
  OUTPUT_VARIABLE _xent_torch_info ERROR_VARIABLE _xent_torch_err RESULT_VARIABLE _xent_rc
  OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _xent_rc EQUAL 0)
  message(FATAL_ERROR "xent: ${Python_EXECUTABLE} cannot import torch, which the wheel is built "
    "against. Install PyTorch first, then run `pip install --no-build-isolation .` (pip's "
    "isolated build environment has no PyTorch).\n${_xent_torch_err}")
endif()
string(REPLACE "\n" ";" _xent_torch_info "${_xent_torch_info}")
list(GET _xent_torch_info 0 _xent_prefix)
list(GET _xent_torch_info 1 _xent_nccl)
list(GET _xent_torch_info 2 XENT_WHEEL_TORCH_VERSION)
list(APPEND CMAKE_PREFIX_PATH "${_xent_prefix}")
if(_xent_nccl)
  set(XENT_NCCL_ROOT "${_xent_nccl}" CACHE PATH "" FORCE)
  set(NCCL_LIBRARY "${_xent_nccl}/lib/libnccl.so.2" CACHE FILEPATH "" FORCE)
  set(NCCL_INCLUDE_DIR "${_xent_nccl}/include" CACHE PATH "" FORCE)
endif()
message(STATUS "xent: wheel for PyTorch ${XENT_WHEEL_TORCH_VERSION} (${Python_EXECUTABLE}), "
  "NCCL ${_xent_nccl}")
