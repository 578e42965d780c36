# What the LibTorch found by find_package(Torch) brings for the CUDA half (DESIGN.md §18):
#   TREETENSOR_WITH_CUDA  LibTorch is a CUDA build (libtorch_cuda, c10_cuda): the per-lane CUDA
#                         streams (§7), the asyncs workers' streams (§10) and device moves are
#                         compiled and linked against it, whether or not a GPU exists here.
#   TREETENSOR_WITH_NCCL  and c10d's ProcessGroupNCCL can be compiled: nccl.h is found (the wheel's
#                         nvidia-nccl package first, the version libtorch_cuda loads, else the
#                         CUDA toolkit's). The distributed layer then routes CUDA leaves to NCCL (§14).
# Prints one line saying what was found, e.g.
#   treetensor: PyTorch 2.11.0, CUDA compiled: yes (CUDA 13.0), NCCL compiled: yes
set(TREETENSOR_WITH_CUDA OFF)
set(TREETENSOR_WITH_NCCL OFF)
if(CAFFE2_USE_CUDA)
  set(TREETENSOR_WITH_CUDA ON)
  find_path(TREETENSOR_NCCL_INCLUDE_DIR nccl.h
            HINTS ${TORCH_INSTALL_PREFIX}/../nvidia/nccl/include ${CUDAToolkit_INCLUDE_DIRS}
            NO_DEFAULT_PATH)
  if(TREETENSOR_NCCL_INCLUDE_DIR)
    set(TREETENSOR_WITH_NCCL ON)
  endif()
endif()
set(_tt_cuda "no (a CPU-only LibTorch)")
if(TREETENSOR_WITH_CUDA)
  set(_tt_cuda "yes (CUDA ${CUDAToolkit_VERSION})")
endif()
set(_tt_nccl "no")
if(TREETENSOR_WITH_NCCL)
  set(_tt_nccl "yes (${TREETENSOR_NCCL_INCLUDE_DIR})")
endif()
message(STATUS "treetensor: PyTorch ${Torch_VERSION}, CUDA compiled: ${_tt_cuda}, NCCL compiled: ${_tt_nccl}")
