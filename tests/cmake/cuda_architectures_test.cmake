# The default CUDA architectures (cmake/cuda_architectures.cmake), without a GPU or a compiler:
# nvidia-smi is replaced by small scripts that list GPUs, fail, or list none.
#   cmake -DMODULE=<cmake/cuda_architectures.cmake> -DWORK=<scratch folder> -P <this file>
if(NOT MODULE OR NOT WORK)
  message(FATAL_ERROR "pass -DMODULE=... -DWORK=...")
endif()
file(MAKE_DIRECTORY "${WORK}")

# fake_smi(<name> <exit code> <output>): a script that prints <output> and exits with the code.
function(fake_smi name rc text)
  file(WRITE "${WORK}/${name}" "#!/bin/sh\nprintf '${text}'\nexit ${rc}\n")
  file(CHMOD "${WORK}/${name}" PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE)
endfunction()

function(expect what got want)
  if(NOT "${got}" STREQUAL "${want}")
    message(FATAL_ERROR "${what}: got '${got}', want '${want}'")
  endif()
endfunction()

include("${MODULE}")

fake_smi(two_kinds 0 "8.0\\n9.0\\n9.0\\n")
xent_visible_cuda_architectures(got "${WORK}/two_kinds")
expect("an A100 and two H100s" "${got}" "80;90")

fake_smi(fails 9 "NVIDIA-SMI has failed because it could not communicate with the driver\\n")
xent_visible_cuda_architectures(got "${WORK}/fails")
expect("nvidia-smi without a driver" "${got}" "")
xent_visible_cuda_architectures(got "")
expect("no nvidia-smi" "${got}" "")

expect("the portable set" "${XENT_PORTABLE_CUDA_ARCHITECTURES}" "80-real;90-real;100-real;100-virtual")

# A GPU older than sm_80 fails the configuration with a message naming it: run in a child
# cmake, as FATAL_ERROR cannot be caught here.
file(WRITE "${WORK}/old.cmake" "include(\"${MODULE}\")\nxent_check_cuda_architectures(\"70;90\")\n")
execute_process(COMMAND "${CMAKE_COMMAND}" -P "${WORK}/old.cmake"
  RESULT_VARIABLE rc ERROR_VARIABLE err OUTPUT_QUIET)
if(rc EQUAL 0 OR NOT err MATCHES "70 is older than compute capability")
  message(FATAL_ERROR "sm_70 was not refused (rc ${rc}): ${err}")
endif()
file(WRITE "${WORK}/ok.cmake" "include(\"${MODULE}\")\nxent_check_cuda_architectures(\"80-real;90;100-virtual;native\")\n")
execute_process(COMMAND "${CMAKE_COMMAND}" -P "${WORK}/ok.cmake" RESULT_VARIABLE rc ERROR_VARIABLE err)
expect("80, 90, 100 and native accepted (${err})" "${rc}" "0")
message(STATUS "cuda architectures: all checks passed")
