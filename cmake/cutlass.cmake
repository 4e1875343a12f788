# The epilogue engine's sm_90a kernels (src/linear/sm90, docs/linear.md "GEMM engines"), built from
# CUTLASS's C++ headers as PyPI's nvidia-cutlass ships them (pinned: XENT_CUTLASS_VERSION, which
# launch/deps.sh installs and pyproject.toml requires). Nothing of CUTLASS is vendored.
#
# xent_add_sm90_kernels(<target>): where XENT_WITH_CUTLASS is on, the headers are found
# (XENT_CUTLASS_DIR, else the nvidia-cutlass package of the Python that builds: Python_EXECUTABLE,
# Python3_EXECUTABLE or python3 on PATH) and sm_90 is among CMAKE_CUDA_ARCHITECTURES, compiles
# src/linear/sm90/*.cu for sm_90a alone into <target> and defines XENT_HAVE_SM90_GEMMS; else says
# why the build keeps cuBLASLt alone. Sets XENT_HAVE_SM90_GEMMS (ON/OFF) in the caller's scope.
set(XENT_CUTLASS_VERSION 4.2.0.0)
option(XENT_WITH_CUTLASS "Build the fused lm head's sm_90a epilogue GEMMs (CUTLASS headers)" ON)
set(XENT_CUTLASS_DIR "" CACHE PATH
  "CUTLASS's include folder (holding cutlass/ and cute/); empty: nvidia-cutlass's, from Python")

function(xent_find_cutlass out)
  set(dir "${XENT_CUTLASS_DIR}")
  if(NOT dir)
    set(py "${Python_EXECUTABLE}")
    if(NOT py)
      set(py "${Python3_EXECUTABLE}")
    endif()
    if(NOT py)
      find_program(XENT_PYTHON_FOR_CUTLASS NAMES python3 python)
      set(py "${XENT_PYTHON_FOR_CUTLASS}")
    endif()
    if(py)
      # find_spec reads where the package is without importing it (nor its dependencies).
      execute_process(COMMAND "${py}" -c [=[
import importlib.util, os
spec = importlib.util.find_spec("cutlass_library")
print(os.path.join(list(spec.submodule_search_locations)[0], "source", "include") if spec else "")
]=]
        OUTPUT_VARIABLE dir OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    endif()
  endif()
  if(dir AND EXISTS "${dir}/cutlass/version.h" AND EXISTS "${dir}/cute/tensor.hpp")
    set(${out} "${dir}" PARENT_SCOPE)
  else()
    set(${out} "" PARENT_SCOPE)
  endif()
endfunction()

function(xent_add_sm90_kernels target)
  set(XENT_HAVE_SM90_GEMMS OFF PARENT_SCOPE)
  set(sm90 OFF)
  foreach(arch IN LISTS CMAKE_CUDA_ARCHITECTURES)
    if(arch MATCHES "^90")
      set(sm90 ON)
    endif()
  endforeach()
  set(keep "the fused lm head's logits GEMMs are cuBLASLt's alone")
  if(NOT XENT_WITH_CUTLASS)
    message(STATUS "xent: XENT_WITH_CUTLASS=OFF: ${keep}")
    return()
  endif()
  if(NOT sm90)
    message(STATUS "xent: no sm_90 among the CUDA architectures (${CMAKE_CUDA_ARCHITECTURES}): "
      "no epilogue GEMMs; ${keep}")
    return()
  endif()
  xent_find_cutlass(dir)
  if(NOT dir)
    message(STATUS "xent: CUTLASS's headers not found (pip install nvidia-cutlass==${XENT_CUTLASS_VERSION}, "
      "or set XENT_CUTLASS_DIR): no epilogue GEMMs; ${keep}")
    return()
  endif()
  file(STRINGS "${dir}/cutlass/version.h" lines REGEX "#define CUTLASS_(MAJOR|MINOR) ")
  message(STATUS "xent: epilogue GEMMs for sm_90a from CUTLASS's headers in ${dir} (${lines})")
  file(GLOB sources CONFIGURE_DEPENDS "${PROJECT_SOURCE_DIR}/src/linear/sm90/*.cu")
  add_library(xent_sm90 OBJECT ${sources})
  # sm_90a alone (wgmma and TMA): its own -gencode, not the target's architectures.
  set_target_properties(xent_sm90 PROPERTIES CUDA_ARCHITECTURES OFF POSITION_INDEPENDENT_CODE ON)
  target_include_directories(xent_sm90 PRIVATE "${PROJECT_SOURCE_DIR}/include"
    "${PROJECT_SOURCE_DIR}/src")
  target_include_directories(xent_sm90 SYSTEM PRIVATE "${dir}")
  target_compile_options(xent_sm90 PRIVATE -gencode=arch=compute_90a,code=sm_90a
    --expt-relaxed-constexpr -lineinfo)
  target_link_libraries(xent_sm90 PRIVATE CUDA::cudart)
  target_sources(${target} PRIVATE $<TARGET_OBJECTS:xent_sm90>)
  target_compile_definitions(${target} PRIVATE XENT_HAVE_SM90_GEMMS=1)
  set(XENT_HAVE_SM90_GEMMS ON PARENT_SCOPE)
endfunction()
