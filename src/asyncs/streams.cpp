// Device streams of asyncs workers, through c10's device-generic API only, so that one source
// builds against CPU-only LibTorch 1.13 and CUDA LibTorch 2.x. Without a CUDA guard
// implementation or without CUDA devices every function here is a cheap no-op.
#include "asyncs/internal.hpp"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace treetensor::asyncs::detail {
namespace {

const c10::impl::DeviceGuardImplInterface* cuda_impl() {
  if (!c10::impl::hasDeviceGuardImpl(c10::kCUDA)) return nullptr;
  const auto* impl = c10::impl::getDeviceGuardImpl(c10::kCUDA);
  return impl->deviceCount() > 0 ? impl : nullptr;
}

const c10::Stream* stream_for(const std::vector<c10::Stream>& streams, c10::DeviceIndex index) {
  for (const auto& s : streams)
    if (s.device_index() == index) return &s;
  return nullptr;
}

}  // namespace

std::vector<c10::Stream> pool_streams() {
  std::vector<c10::Stream> out;
  const auto* impl = cuda_impl();
  if (impl == nullptr) return out;
  try {
    for (c10::DeviceIndex d = 0; d < impl->deviceCount(); ++d)
      out.push_back(impl->getStreamFromGlobalPool(c10::Device(c10::kCUDA, d)));
  } catch (const c10::Error&) {
    // A CUDA guard with no stream pool (after torch.compile in a process without a GPU, one
    // that counts devices but "doesn't support acquiring a stream from pool"): no CUDA work
    // can run here, so the thread needs no device streams.
    out.clear();
  }
  return out;
}

void install_streams(const std::vector<c10::Stream>& streams) {
  if (streams.empty()) return;
  const auto* impl = c10::impl::getDeviceGuardImpl(c10::kCUDA);
  for (const auto& s : streams) impl->exchangeStream(s);
}

std::vector<c10::Event> record_submitter(const std::vector<at::Tensor>& tensors,
                                         const std::vector<c10::Stream>& worker_streams) {
  std::vector<c10::Event> events;
  if (worker_streams.empty()) return events;
  const auto* impl = c10::impl::getDeviceGuardImpl(c10::kCUDA);
  std::vector<c10::DeviceIndex> devices;
  for (const auto& t : tensors) {
    if (!t.defined() || !t.is_cuda()) continue;
    const auto index = t.device().index();
    // The caching allocator must not recycle this memory before the worker stream is done.
    if (const auto* s = stream_for(worker_streams, index); s && t.has_storage())
      impl->recordDataPtrOnStream(t.storage().data_ptr(), *s);
    if (std::find(devices.begin(), devices.end(), index) != devices.end()) continue;
    devices.push_back(index);
    events.emplace_back(c10::kCUDA);
    events.back().record(impl->getStream(c10::Device(c10::kCUDA, index)));
  }
  return events;
}

void block_streams(const std::vector<c10::Event>& events, const std::vector<c10::Stream>& streams) {
  for (const auto& e : events)
    if (const auto* s = stream_for(streams, e.device_index())) e.block(*s);
}

std::vector<c10::Event> record_on(const std::vector<c10::Stream>& streams) {
  std::vector<c10::Event> events;
  for (const auto& s : streams) {
    events.emplace_back(c10::kCUDA);
    events.back().record(s);
  }
  return events;
}

void block_current(const std::vector<c10::Event>& events) {
  if (events.empty()) return;
  const auto* impl = c10::impl::getDeviceGuardImpl(c10::kCUDA);
  for (const auto& e : events) e.block(impl->getStream(e.device()));
}

void synchronize_streams(const std::vector<c10::Stream>& streams) {
  const auto* impl = cuda_impl();
  if (impl == nullptr) return;
  for (const auto& s : streams) impl->synchronizeStream(s);
  for (c10::DeviceIndex d = 0; d < impl->deviceCount(); ++d)
    impl->synchronizeStream(impl->getStream(c10::Device(c10::kCUDA, d)));
}

}  // namespace treetensor::asyncs::detail
