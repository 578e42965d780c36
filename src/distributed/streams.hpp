#pragma once
// CUDA streams and events of collectives (DESIGN.md §7, §14), through c10's device-generic
// API so that this builds with any LibTorch; used only for requests with CUDA leaves.
//
// A request's CUDA work runs on the communication thread's own stream per device, ordered
// against the requester's stream by events on both sides and never by a host synchronize:
//   1. request (requester's thread): an event on its current stream of each device;
//   2. the communication stream waits on it before packing or issuing anything;
//   3. after the results are written (NCCL's wait() makes the current stream wait for NCCL's
//      own), an event on the communication stream;
//   4. whoever takes the result makes its current stream wait on that event.
// Memory crossing streams is recorded on the stream that uses it last (the caching allocator's
// hazard): the leaves on the communication stream, results on the requester's stream.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/util/ArrayRef.h>

#include <vector>

namespace treetensor::distributed::detail {

/// The CUDA devices of `tensors`, each once, in first-seen order.
std::vector<c10::Device> cuda_devices(c10::ArrayRef<at::Tensor> tensors);

/// The calling thread's current stream on each of `devices`.
std::vector<c10::Stream> current_streams(const std::vector<c10::Device>& devices);

/// An event recorded on each of `streams` (after the work enqueued there so far).
std::vector<c10::Event> record(const std::vector<c10::Stream>& streams);

/// Makes the calling thread's current stream of each event's device wait for it, device-side.
void block_current(const std::vector<c10::Event>& events);

/// Keeps the memory of `tensors` from being reused before the work enqueued so far on the
/// stream of their device among `streams` is done (CUDA tensors only; others are skipped).
void keep_for(c10::ArrayRef<at::Tensor> tensors, const std::vector<c10::Stream>& streams);

/// The communication thread's streams: one from c10's pool per device, made the thread's
/// current stream at first use (never the legacy default stream, which would serialise with
/// every stream of the device). Communication thread only.
class CommStreams {
 public:
  /// The streams of `devices`, made current (step 2 follows with block_current).
  std::vector<c10::Stream> enter(const std::vector<c10::Device>& devices);

 private:
  std::vector<c10::Stream> taken_;
};

}  // namespace treetensor::distributed::detail
