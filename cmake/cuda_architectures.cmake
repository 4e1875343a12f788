# Which GPUs the kernels are built for when CMAKE_CUDA_ARCHITECTURES is not given
# (xent_default_cuda_architectures, called before project(), so that the CUDA language is enabled
# with the choice):
#   - the visible GPUs' own architectures, as CMake's `native` would give them (read with
#     nvidia-smi, which needs no CUDA compiler yet): a build on the machine it runs on;
#   - with no GPU visible, a portable set: machine code for sm_80 (A100), sm_90 (H100, H200) and
#     sm_100 (B200), and compute_100 PTX that the driver compiles for newer GPUs.
# Either way a GPU older than sm_80 is refused: its architectures cannot be chosen.
# `-DCMAKE_CUDA_ARCHITECTURES=90` (pip: `-C cmake.define.CMAKE_CUDA_ARCHITECTURES=90`) or the
# CUDAARCHS environment variable chooses them instead.

set(XENT_PORTABLE_CUDA_ARCHITECTURES 80-real 90-real 100-real 100-virtual)

# xent_visible_cuda_architectures(<out> <nvidia-smi>): "80;90" for the GPUs that <nvidia-smi>
# lists (each architecture once), "" where it lists none or fails.
function(xent_visible_cuda_architectures out smi)
  set(archs "")
  if(smi)
    execute_process(COMMAND "${smi}" --query-gpu=compute_cap --format=csv,noheader
      OUTPUT_VARIABLE caps RESULT_VARIABLE rc ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
    if(rc EQUAL 0)
      string(REGEX MATCHALL "[0-9]+\\.[0-9]+" caps "${caps}")
      foreach(cap IN LISTS caps)
        string(REPLACE "." "" arch "${cap}")
        list(APPEND archs "${arch}")
      endforeach()
      list(REMOVE_DUPLICATES archs)
    endif()
  endif()
  set(${out} "${archs}" PARENT_SCOPE)
endfunction()

# xent_check_cuda_architectures(<list>): fails for an architecture below 80.
function(xent_check_cuda_architectures archs)
  foreach(arch IN LISTS archs)
    if(arch MATCHES "^([0-9]+)" AND CMAKE_MATCH_1 LESS 80)
      message(FATAL_ERROR "xent: CMAKE_CUDA_ARCHITECTURES = ${archs}: ${arch} is older than "
        "compute capability 8.0, which xent needs (A100, H100 and newer); choose 80 or newer")
    endif()
  endforeach()
endfunction()

# xent_default_cuda_architectures(): sets CMAKE_CUDA_ARCHITECTURES (cache) as above, unless it or
# CUDAARCHS is given.
macro(xent_default_cuda_architectures)
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT DEFINED ENV{CUDAARCHS})
    find_program(XENT_NVIDIA_SMI nvidia-smi)
    xent_visible_cuda_architectures(_xent_visible "${XENT_NVIDIA_SMI}")
    if(_xent_visible)
      xent_check_cuda_architectures("${_xent_visible}")
      set(_xent_why "the visible GPUs'")
    else()
      set(_xent_visible ${XENT_PORTABLE_CUDA_ARCHITECTURES})
      set(_xent_why "no GPU visible: the portable set")
    endif()
    set(CMAKE_CUDA_ARCHITECTURES "${_xent_visible}" CACHE STRING "CUDA architectures (xent)")
    message(STATUS "xent: CUDA architectures ${CMAKE_CUDA_ARCHITECTURES} (${_xent_why}; "
      "-DCMAKE_CUDA_ARCHITECTURES=... chooses others)")
  endif()
endmacro()
