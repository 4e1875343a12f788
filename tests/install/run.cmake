# ctest driver (tests/CMakeLists.txt): install the build tree into a scratch prefix, then
# configure, build and run a consumer project (CMakeLists.txt here) against it, and check that the
# consumer loads the very NCCL file that the build linked (one NCCL: a communicator made by
# PyTorch must be driven by the NCCL that made it).
# Variables:
#   BUILD_DIR, SOURCE_DIR, WORK_DIR   the build tree, this folder, a scratch folder (wiped first)
#   CONSUMER                          core (xent::xent), mpi (xent::mpi) or torch (xent::torch)
#   NCCL_LIBRARY                      the NCCL_LIBRARY the build was configured with
#   WITH_TORCH                        whether the build has the LibTorch adapter
#   CXX_COMPILER                      the build's C++ compiler (optional)
#   BUILD_TORCH_LIBRARY               torch only: the build tree's libxent_torch.so
#   LDD                               ldd (optional; by default found on PATH; readelf too)
# core also checks that find_package fails, naming the path, when the recorded NCCL is missing;
# torch also checks the installed libxent_torch.so's RUNPATH ($ORIGIN, NCCL's and LibTorch's lib
# folders) by resolving its libraries without LD_LIBRARY_PATH.
cmake_minimum_required(VERSION 3.24)
file(REMOVE_RECURSE "${WORK_DIR}")
set(prefix "${WORK_DIR}/prefix")

function(step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    string(REPLACE ";" " " cmd "${ARGN}")
    message(FATAL_ERROR "step failed (${rc}): ${cmd}")
  endif()
endfunction()

# resolve(<file> <prefix>): what the dynamic loader loads for each of <file>'s libraries, with
# LD_LIBRARY_PATH unset (RUNPATH and the system only): <prefix>_<soname> = the file's real path.
if(NOT LDD)
  find_program(LDD ldd)
  if(NOT LDD)
    message(FATAL_ERROR "no ldd on PATH: pass -DLDD=/path/to/ldd")
  endif()
endif()
function(resolve file out)
  execute_process(COMMAND ${CMAKE_COMMAND} -E env --unset=LD_LIBRARY_PATH ${LDD} ${file}
    OUTPUT_VARIABLE text ERROR_VARIABLE err RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "ldd ${file} failed (${rc}): ${err}")
  endif()
  string(REPLACE "\n" ";" lines "${text}")
  set(sonames "")
  foreach(line IN LISTS lines)
    if(line MATCHES "^[ \t]*([^ \t]+) => not found")
      message(FATAL_ERROR "${file}: ${CMAKE_MATCH_1} not found without LD_LIBRARY_PATH:\n${text}")
    elseif(line MATCHES "^[ \t]*([^ \t]+) => ([^ \t]+) \\(")
      get_filename_component(path "${CMAKE_MATCH_2}" REALPATH)
      set(${out}_${CMAKE_MATCH_1} "${path}" PARENT_SCOPE)
      list(APPEND sonames "${CMAKE_MATCH_1}")
    endif()
  endforeach()
  set(${out}_SONAMES "${sonames}" PARENT_SCOPE)
endfunction()

# The consumer must load the NCCL file the build linked, wherever a search would have gone.
get_filename_component(nccl_real "${NCCL_LIBRARY}" REALPATH)
function(check_nccl file)
  if(NCCL_LIBRARY MATCHES "\\.a$")
    message(STATUS "${file}: NCCL is linked statically (${NCCL_LIBRARY}): nothing to load")
    return()
  endif()
  resolve("${file}" dep)
  if(NOT dep_libnccl.so.2)
    message(FATAL_ERROR "${file} does not load libnccl.so.2 (it loads: ${dep_SONAMES})")
  endif()
  if(NOT dep_libnccl.so.2 STREQUAL nccl_real)
    message(FATAL_ERROR "${file} loads the NCCL ${dep_libnccl.so.2}, but xent was built with "
      "${NCCL_LIBRARY} (${nccl_real}): a consumer must link the NCCL that xent was built with")
  endif()
  message(STATUS "${file}: libnccl.so.2 => ${dep_libnccl.so.2}, the build's NCCL")
endfunction()

set(configure_args -DCMAKE_PREFIX_PATH=${prefix} -DXENT_CONSUMER=${CONSUMER}
  -DEXPECT_NCCL_LIBRARY=${NCCL_LIBRARY})
if(CXX_COMPILER)
  list(APPEND configure_args -DCMAKE_CXX_COMPILER=${CXX_COMPILER})
endif()
if(CONSUMER STREQUAL "core")
  if(WITH_TORCH)
    list(APPEND configure_args -DEXPECT_TORCH=ON)
  else()
    list(APPEND configure_args -DEXPECT_TORCH=OFF)
  endif()
endif()

step(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
if(CONSUMER STREQUAL "torch")
  # The installed library: RUNPATH has $ORIGIN, and without LD_LIBRARY_PATH it loads the build's
  # NCCL and the same LibTorch libraries as the build tree's library.
  file(GLOB_RECURSE lib "${prefix}/*/libxent_torch.so")
  if(NOT lib)
    message(FATAL_ERROR "cmake --install put no libxent_torch.so under ${prefix}")
  endif()
  find_program(READELF readelf)
  if(NOT READELF)
    message(FATAL_ERROR "no readelf on PATH (binutils)")
  endif()
  execute_process(COMMAND ${READELF} -d ${lib} OUTPUT_VARIABLE text RESULT_VARIABLE rc)
  set(runpath "")
  if(rc EQUAL 0 AND text MATCHES "Library runpath: \\[([^]\n]*)\\]")
    set(runpath "${CMAKE_MATCH_1}")
  endif()
  message(STATUS "${lib}: RUNPATH ${runpath}")
  string(REPLACE ":" ";" runpath_list "${runpath}")
  if(NOT "$ORIGIN" IN_LIST runpath_list)
    message(FATAL_ERROR "${lib}: RUNPATH '${runpath}' has no $ORIGIN")
  endif()
  check_nccl("${lib}")
  resolve("${lib}" installed)
  resolve("${BUILD_TORCH_LIBRARY}" built)
  foreach(soname IN LISTS built_SONAMES)
    if(soname MATCHES "^lib(torch|c10)" AND NOT installed_${soname} STREQUAL built_${soname})
      message(FATAL_ERROR "${lib} loads ${soname} from '${installed_${soname}}', the build tree's "
        "library from ${built_${soname}}")
    endif()
  endforeach()
endif()
step(${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR}/build ${configure_args})
step(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
step(${WORK_DIR}/build/consumer)
check_nccl("${WORK_DIR}/build/consumer")

if(CONSUMER STREQUAL "core")
  # A package whose recorded NCCL is gone must fail at find_package, naming the path, rather than
  # link some other NCCL.
  set(broken "${WORK_DIR}/broken")
  set(missing "${WORK_DIR}/gone/libnccl.so.2")
  file(GLOB_RECURSE config "${prefix}/*/xentConfig.cmake")
  get_filename_component(config_dir "${config}" DIRECTORY)
  file(RELATIVE_PATH config_rel "${prefix}" "${config_dir}")
  file(COPY "${config_dir}/" DESTINATION "${broken}/${config_rel}")
  file(READ "${config}" text)
  string(FIND "${text}" "\"${NCCL_LIBRARY}\"" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${config} does not record the build's NCCL \"${NCCL_LIBRARY}\"")
  endif()
  string(REPLACE "\"${NCCL_LIBRARY}\"" "\"${missing}\"" text "${text}")
  file(WRITE "${broken}/${config_rel}/xentConfig.cmake" "${text}")
  execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR}/build_broken
    -DCMAKE_PREFIX_PATH=${broken} -DXENT_CONSUMER=core
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  string(REGEX REPLACE "[ \t\r\n]+" " " flat "${out}")  # CMake wraps its messages
  string(FIND "${flat}" "${missing}" at)
  if(rc EQUAL 0 OR at EQUAL -1)
    message(FATAL_ERROR "find_package(xent) with a missing NCCL ${missing} must fail naming it "
      "(rc ${rc}):\n${out}")
  endif()
  message(STATUS "find_package(xent) with its NCCL gone fails, naming ${missing}")
endif()
