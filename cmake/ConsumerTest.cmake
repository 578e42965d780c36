# ctest driver: installs this build into a fresh prefix, then configures, builds and runs
# examples/consumer against it with find_package(treetensor CONFIG REQUIRED).
# Usage: cmake -DBUILD_DIR=... -DSOURCE_DIR=... -DWORK_DIR=... -DTORCH_DIR=... -P ConsumerTest.cmake
# (TORCH_DIR: the TorchConfig.cmake folder the build used, as a consumer would pass it.)
foreach(var BUILD_DIR SOURCE_DIR WORK_DIR TORCH_DIR)
  if(NOT ${var})
    message(FATAL_ERROR "ConsumerTest.cmake needs -D${var}=...")
  endif()
endforeach()

function(step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer test: '${ARGN}' failed (${rc})")
  endif()
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
step(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${WORK_DIR}/prefix)
step(${CMAKE_COMMAND} -S ${SOURCE_DIR}/examples/consumer -B ${WORK_DIR}/build -G Ninja
     -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DTorch_DIR=${TORCH_DIR} -DCMAKE_BUILD_TYPE=Release)
step(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
step(${WORK_DIR}/build/consumer)

# A build of the library and not every tool (scripts/bench.sh builds two targets) must still
# install: the tools' install rules are OPTIONAL. Checked on this build's own tools install
# script, with the tools' files pointed at a folder where nothing was built.
if(EXISTS ${BUILD_DIR}/tools/cmake_install.cmake)
  file(READ ${BUILD_DIR}/tools/cmake_install.cmake script)
  string(REPLACE "${BUILD_DIR}/tools/" "${WORK_DIR}/not-built/" script "${script}")
  file(WRITE ${WORK_DIR}/tools_not_built.cmake "${script}")
  step(${CMAKE_COMMAND} -DCMAKE_INSTALL_PREFIX=${WORK_DIR}/partial -P
       ${WORK_DIR}/tools_not_built.cmake)
endif()
