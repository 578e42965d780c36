#pragma once
// Operand tracking for asyncs work (DESIGN.md §10; OneFlow parity: its eager VM's
// const/mutable operand rule).
//
// `Thread::submit(fn, reads, writes)` registers the tensors a job reads and writes until the
// job has finished. A tree call made elsewhere must not race with that work, so before it runs
// the tensor layer asks, on every tree call:
//
//     if (asyncs::tracking_active()) asyncs::await_operands(inputs, outputs_written_in_place);
//
// Keying. Tensors are identified by their storage (c10::StorageImpl), not by TensorImpl or
// data pointer: views of one tensor share its storage, so an in-place add_ on a slice must wait
// for a reader of the whole tensor, and two views never compare different. This is
// conservative — two disjoint slices of one storage are treated as overlapping (a needless
// wait, never a missed one). Empty tensors have a storage too (their data pointer is null, so
// data pointers would make every empty tensor alias every other). Tensors without storage
// (e.g. some wrapper subclasses) are keyed by their TensorImpl; undefined tensors are ignored.
// A registered job keeps its operand tensors alive until it has finished, so a key can never be
// reused by a new allocation while it is registered.

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <atomic>
#include <cstddef>

namespace treetensor::asyncs {

namespace detail {
/// Number of submitted, unfinished asyncs jobs that registered at least one operand.
extern std::atomic<std::size_t> tracked_jobs;
}  // namespace detail

/// Whether any asyncs job with registered operands is pending.
///
/// One relaxed atomic load: meant to be called on every tree call so that await_operands() is
/// skipped entirely when no asyncs work is pending. A false result is exact for work submitted
/// by the calling thread (program order); for work submitted concurrently by other threads
/// without synchronisation there is no ordering to respect anyway.
/// Thread safety: safe to call from any thread.
inline bool tracking_active() noexcept {
  return detail::tracked_jobs.load(std::memory_order_relaxed) != 0;
}

/// Blocks until the pending asyncs work that conflicts with a coming access has finished.
///
/// Waits for every pending job that WRITES a tensor in `reads` (read-after-write) and every
/// pending job that READS OR WRITES a tensor in `writes` (write-after-read, write-after-write).
/// "Pending" is judged when the call starts; work submitted later is not waited for.
/// With CUDA, the caller's current stream on each device then waits (device-side event) for
/// the streams those jobs ran on, so kernels issued next see their results.
///
/// Which work is waited for (no self-deadlock, no cycles):
///  - From a thread that is not running an asyncs job: all conflicting pending jobs.
///  - From inside an asyncs job J (on its worker, or in a lane running a leaf of a tree call J
///    made): conflicting jobs submitted before J, plus jobs J itself submitted to other
///    threads. Never jobs queued on J's own asyncs thread: they run after J (FIFO), so waiting
///    for them would deadlock. Every wait thus points to earlier work, so tracking alone never
///    creates a cycle; user code that makes one (jobs waiting on each other's futures) is
///    turned into a WatchdogTimeout when the watchdog is on.
///
/// @param reads   tensors about to be read (any dtype/device/shape; undefined ones ignored).
/// @param writes  tensors about to be written in place (a tensor may appear in both).
/// @throws WatchdogTimeout when the watchdog is on and no asyncs job finishes for its timeout
///         while waiting. Errors of the awaited jobs are NOT thrown here: they stay with their
///         futures and synchronize().
/// Thread safety: safe to call from any thread, concurrently.
void await_operands(c10::ArrayRef<at::Tensor> reads, c10::ArrayRef<at::Tensor> writes);

}  // namespace treetensor::asyncs
