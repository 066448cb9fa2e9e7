# Compile SOURCE with FLAGS and expect the build to fail with detdit's
# fast-math message. A build that succeeds, or fails for another reason, fails
# the test.
set(work ${CMAKE_CURRENT_BINARY_DIR}/expect_refused_${LANG})
file(MAKE_DIRECTORY ${work})
file(WRITE ${work}/probe.${LANG} "#include \"${SOURCE}\"\nint main() { return 0; }\n")
if(LANG STREQUAL "cu")
  set(args ${FLAGS} -std=c++17 -I${INCLUDE} -c ${work}/probe.cu -o ${work}/probe.o)
else()
  set(args ${FLAGS} -std=c++17 -I${INCLUDE} -x c++ -c ${work}/probe.c++ -o ${work}/probe.o)
endif()
execute_process(COMMAND ${COMPILER} ${args} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0)
  message(FATAL_ERROR "compiling with ${FLAGS} succeeded; detdit must refuse fast math")
endif()
if(NOT "${out}${err}" MATCHES "must not be built with")
  message(FATAL_ERROR "compiling with ${FLAGS} failed for another reason:\n${out}${err}")
endif()
message(STATUS "refused as expected: ${FLAGS}")
