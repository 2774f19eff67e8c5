# tests/install_find_package.cmake (ctest InstallAndFindPackage, cmake -P): installs the build
# into WORK_DIR/prefix, then builds examples/cpp there as a project of its own through
# find_package(cpidx) and runs it (the CPU reference; the GPU too where one is found), and
# checks that a component cpidx does not have fails find_package with its name.
# -D: BUILD_DIR, SOURCE_DIR, WORK_DIR, CXX, CXX_FLAGS, CUDA_ROOT (empty without CUDA), VERSION
#     (the project's), LIBDIR
#     (CMAKE_INSTALL_LIBDIR: lib, or lib64 where GNUInstallDirs picks it),
#     COMPONENTS (the optional components the build made, comma-separated: "comm_mpi,comm_peer").
foreach(var BUILD_DIR SOURCE_DIR WORK_DIR CXX LIBDIR VERSION)
  if(NOT ${var})
    message(FATAL_ERROR "install_find_package.cmake: -D${var}= is required")
  endif()
endforeach()
file(REMOVE_RECURSE ${WORK_DIR})

function(run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${out}\n${err}")
  endif()
  set(run_out "${out}" PARENT_SCOPE)
endfunction()

run("cmake --install" ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${WORK_DIR}/prefix)
foreach(f include/cpidx/indexer.h include/cpidx/reference.h include/cpidx/version.h
          ${LIBDIR}/cmake/cpidx/cpidxConfig.cmake ${LIBDIR}/cmake/cpidx/cpidxConfigVersion.cmake
          ${LIBDIR}/cmake/cpidx/cpidxTargets.cmake)
  if(NOT EXISTS ${WORK_DIR}/prefix/${f})
    message(FATAL_ERROR "not installed: ${f}")
  endif()
endforeach()

set(consumer_args -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_CXX_COMPILER=${CXX}
                  "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}" -DCMAKE_BUILD_TYPE=Release)
if(CUDA_ROOT)
  list(APPEND consumer_args -DCUDAToolkit_ROOT=${CUDA_ROOT})
endif()
run("configuring examples/cpp" ${CMAKE_COMMAND} -S ${SOURCE_DIR}/examples/cpp
    -B ${WORK_DIR}/example ${consumer_args})
run("building examples/cpp" ${CMAKE_COMMAND} --build ${WORK_DIR}/example)
run("decode_step" ${WORK_DIR}/example/decode_step)
message(STATUS "decode_step:\n${run_out}")
# The installed headers and the CMake package name the build's version.
if(NOT run_out MATCHES "^cpidx ([^ ]+) \\(headers\\), ([^ ]+) \\(CMake package\\)\n" OR
   NOT CMAKE_MATCH_1 STREQUAL VERSION OR NOT CMAKE_MATCH_2 STREQUAL VERSION)
  message(FATAL_ERROR "decode_step's first line does not name version ${VERSION} twice")
endif()
# Request 1 has 33 blocks: 16 distinct ids in [0, 33), none -1.
if(NOT run_out MATCHES "head 0, request 1 \\(4100 tokens\\):([ 0-9-]+)\n")
  message(FATAL_ERROR "decode_step printed no row for request 1")
endif()
string(STRIP "${CMAKE_MATCH_1}" ids)
string(REPLACE " " ";" ids "${ids}")
list(LENGTH ids n)
set(distinct ${ids})
list(REMOVE_DUPLICATES distinct)
list(LENGTH distinct n_distinct)
foreach(id ${ids})
  if(id LESS 0 OR id GREATER_EQUAL 33)
    set(n_distinct -1)
  endif()
endforeach()
if(NOT n EQUAL 16 OR NOT n_distinct EQUAL 16)
  message(FATAL_ERROR "request 1's ids are not 16 distinct blocks in [0, 33): ${ids}")
endif()

# Where a Hopper GPU is promised (CPIDX_EXPECT_GPU=1 in the environment: scripts/device_single.sh),
# the example's Decoder step must have run and matched the reference.
if("$ENV{CPIDX_EXPECT_GPU}" STREQUAL "1" AND
   NOT run_out MATCHES "gpu: [0-9]+ rows exact, [0-9]+ near ties, 0 wrong")
  message(FATAL_ERROR "CPIDX_EXPECT_GPU=1, but decode_step's GPU step did not run and match")
endif()

# Every component the build made is found when required; one it lacks fails by name.
file(MAKE_DIRECTORY ${WORK_DIR}/components)
file(WRITE ${WORK_DIR}/components/CMakeLists.txt
     "cmake_minimum_required(VERSION 3.25)\nproject(components LANGUAGES CXX)\n"
     "string(REPLACE \",\" \";\" want \"\${WANT}\")\n"
     "find_package(cpidx 0.2 CONFIG REQUIRED COMPONENTS \${want})\n")
if(COMPONENTS)
  run("find_package(cpidx COMPONENTS ${COMPONENTS})" ${CMAKE_COMMAND} -S ${WORK_DIR}/components
      -B ${WORK_DIR}/components/ok ${consumer_args} -DWANT=${COMPONENTS})
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S ${WORK_DIR}/components -B ${WORK_DIR}/components/bad
                        ${consumer_args} -DWANT=no_such
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT "${out}${err}" MATCHES "component no_such: no such component")
  message(FATAL_ERROR
          "find_package(cpidx COMPONENTS no_such) did not fail by name:\n${out}\n${err}")
endif()
message(STATUS "InstallAndFindPackage: installed, found, built, ran; components: ${COMPONENTS}")
