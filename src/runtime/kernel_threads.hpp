#pragma once
// One intra-op thread and one BLAS thread for leaf kernels inside lanes (DESIGN.md §6).
//
// Found by reading ATen/ParallelOpenMP.cpp (LibTorch 1.13 and 2.x) and OpenBLAS 0.3.21:
//  - at::set_num_threads(n) is process-wide: it stores a global atomic that every thread's lazy
//    init copies, resizes the global pthreadpool and (with MKL) MKL's global count. Calling it
//    from a lane would change every other thread's kernels. But at::parallel_for with the
//    OpenMP backend opens `#pragma omp parallel` with the calling thread's own nthreads-var ICV,
//    so omp_set_num_threads(1) on a lane thread limits exactly that thread. The ICV must be set
//    after ATen's per-thread lazy init, which otherwise overwrites it on the thread's first
//    parallel_for — hence the lazy init first (in 2.x once per library: the inline function's
//    thread_local flag is not shared between our code and LibTorch's).
//  - OpenBLAS built with pthreads (Debian's 0.3.21, NO_AFFINITY) keeps one global thread count
//    (blas_cpu_number) that gemm reads per call; openblas_set_num_threads only stores it. What
//    serialises concurrent BLAS calls is the threaded path: gemm asks for m·n·k / 2^18 threads
//    (interface/gemm.c; SMP_THRESHOLD_MIN·GEMM_MULTITHREAD_THRESHOLD), capped by the count, so
//    from m·n·k ≥ 2^19 — S=64 and up in the seed experiment's S×2S @ 2S×4S grid (DESIGN.md,
//    the main job), just where lanes lost —
//    it enters driver/level3/level3_thread.c's gemm_driver, which holds a process-wide static
//    mutex (level3_lock) for the whole call and hands work to OpenBLAS's server threads. Two lanes
//    with a count of 2 thus run their gemms one at a time, each also competing with the server
//    threads for the 2 cores. Setting the count per leaf and restoring it (what a naive lane
//    does) lets one lane's restore flip another lane's in-flight calls back onto that path.
//    And set at run time, the server threads created at load stay alive: after a multithreaded
//    call they busy-wait (sched_yield) for OpenBLAS's thread timeout before sleeping, while
//    OPENBLAS_NUM_THREADS=1 at start-up never creates them — the start-up/run-time difference
//    the seed experiment measured. So here the count is set to 1 while any parallel tree call is in
//    flight (reference-counted across threads) and restored when the last one ends.
//  - MKL (PyTorch's x86 wheels link it into libtorch_cpu, over GNU OpenMP): its per-thread
//    MKL_Set_Num_Threads_Local(1) is called on lane threads beside the OpenMP count.
// All symbols are looked up with dlsym, so nothing is hard-linked and a missing library is a
// no-op.

namespace treetensor::runtime::detail {

/// Makes the calling thread run ATen intra-op work on itself only, for good. For lane workers.
void pin_intra_op_to_one_thread();

/// RAII: one intra-op thread on the calling thread, restored on destruction.
class OneIntraOpThread {
 public:
  OneIntraOpThread();
  ~OneIntraOpThread();
  OneIntraOpThread(const OneIntraOpThread&) = delete;
  OneIntraOpThread& operator=(const OneIntraOpThread&) = delete;

 private:
  int previous_;
};

/// RAII: one BLAS thread process-wide while at least one instance lives (reference-counted);
/// the count in effect before the first instance is restored when the last one dies.
class OneBlasThread {
 public:
  OneBlasThread();
  ~OneBlasThread();
  OneBlasThread(const OneBlasThread&) = delete;
  OneBlasThread& operator=(const OneBlasThread&) = delete;
};

/// Current OpenBLAS thread count, or 0 when OpenBLAS is not loaded.
int blas_threads();
/// Current OpenMP nthreads-var of the calling thread, or 0 without OpenMP.
int omp_threads();

}  // namespace treetensor::runtime::detail
