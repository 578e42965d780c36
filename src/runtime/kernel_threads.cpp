#include "runtime/kernel_threads.hpp"

#include "runtime/fork.hpp"

#include <ATen/Parallel.h>

#include <dlfcn.h>

#include <atomic>
#include <mutex>

namespace treetensor::runtime::detail {
namespace {

using SetFn = void (*)(int);
using GetFn = int (*)();

struct Symbols {
  SetFn omp_set = nullptr;
  GetFn omp_get = nullptr;
  SetFn blas_set = nullptr;
  GetFn blas_get = nullptr;
  // int MKL_Set_Num_Threads_Local(int), MKL's C interface (PyTorch's wheels link MKL into
  // libtorch_cpu); result unused. Its lowercase mkl_set_num_threads_local is the Fortran
  // interface and takes an int*.
  SetFn mkl_set_local = nullptr;

  Symbols() {
    omp_set = reinterpret_cast<SetFn>(dlsym(RTLD_DEFAULT, "omp_set_num_threads"));
    omp_get = reinterpret_cast<GetFn>(dlsym(RTLD_DEFAULT, "omp_get_max_threads"));
    blas_set = reinterpret_cast<SetFn>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
    blas_get = reinterpret_cast<GetFn>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
    mkl_set_local = reinterpret_cast<SetFn>(dlsym(RTLD_DEFAULT, "MKL_Set_Num_Threads_Local"));
  }
};

// Not a function-local static: a child forked while another thread ran its initialisation
// waited for ever on the static's guard (its first lane worker's pin did, in a child forked
// during the parent's calibration). Made under a lock held over fork instead.
std::mutex symbols_mutex;
const int symbols_mutex_held_over_fork = (hold_over_fork(symbols_mutex), 0);
std::atomic<const Symbols*> made_symbols{nullptr};

const Symbols& symbols() {
  if (const Symbols* s = made_symbols.load(std::memory_order_acquire)) return *s;
  const std::lock_guard lock(symbols_mutex);
  if (const Symbols* s = made_symbols.load(std::memory_order_acquire)) return *s;
  const Symbols* s = new Symbols();  // for the process's lifetime
  made_symbols.store(s, std::memory_order_release);
  return *s;
}

std::mutex blas_mutex;
int blas_users = 0;
int blas_saved = 0;
// Taken by every lane batch: a child forked meanwhile must not inherit it locked.
const int blas_mutex_held_over_fork = (hold_over_fork(blas_mutex), 0);

}  // namespace

int omp_threads() {
  return symbols().omp_get ? symbols().omp_get() : 0;
}
int blas_threads() {
  return symbols().blas_get ? symbols().blas_get() : 0;
}

namespace {
// Held while a thread first sets up the kernel libraries' thread settings, where MKL reads the
// environment under a lock of its own: a fork() meanwhile waits for it, so a child never starts
// with MKL's lock held by a thread it does not have (its first lane worker hung on it).
std::mutex init_mutex;
const int init_mutex_held_over_fork = (hold_over_fork(init_mutex), 0);

// ATen sets a thread's OpenMP count to the process-wide one on the thread's first parallel
// call (lazy_init_num_threads). That function is inline with a thread_local flag, so each
// library has its own flag: ours, and LibTorch's behind at::get_num_threads(). Both run here,
// before the count is changed, or a later first call would undo the change.
void init_kernel_threads_here() {
  thread_local bool done = false;
  if (done) return;
  const std::lock_guard lock(init_mutex);
  at::internal::lazy_init_num_threads();
  (void)at::get_num_threads();
  done = true;
}
}  // namespace

void pin_intra_op_to_one_thread() {
  init_kernel_threads_here();
  if (symbols().omp_set) symbols().omp_set(1);
  if (symbols().mkl_set_local) {
    const std::lock_guard lock(init_mutex);  // MKL's first call on this thread: as above
    symbols().mkl_set_local(1);
  }
}

OneIntraOpThread::OneIntraOpThread() : previous_(0) {
  init_kernel_threads_here();
  previous_ = omp_threads();
  if (previous_ > 1) symbols().omp_set(1);
}

OneIntraOpThread::~OneIntraOpThread() {
  if (previous_ > 1) symbols().omp_set(previous_);
}

OneBlasThread::OneBlasThread() {
  if (!symbols().blas_set) return;
  std::lock_guard lock(blas_mutex);
  if (blas_users++ == 0) {
    blas_saved = symbols().blas_get();
    if (blas_saved != 1) symbols().blas_set(1);
  }
}

OneBlasThread::~OneBlasThread() {
  if (!symbols().blas_set) return;
  std::lock_guard lock(blas_mutex);
  if (--blas_users == 0 && blas_saved != 1) symbols().blas_set(blas_saved);
}

}  // namespace treetensor::runtime::detail
