# cmake -DREGEX=<regex> -P expect_refusal.cmake -- <command> [args...]
# Runs the command and passes when it exits with status 2 (xent_dist_bench's "refused") and its
# output matches REGEX. Used by the bench.refuse.* tests.
set(RC 2)
include(${CMAKE_CURRENT_LIST_DIR}/expect_output.cmake)
