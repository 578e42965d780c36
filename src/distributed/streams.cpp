#include "distributed/streams.hpp"

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>

namespace treetensor::distributed::detail {
namespace {

// Called only with CUDA devices in hand, so the CUDA implementation is registered.
const c10::impl::DeviceGuardImplInterface& cuda() {
  return *c10::impl::getDeviceGuardImpl(c10::kCUDA);
}

const c10::Stream* stream_on(const std::vector<c10::Stream>& streams, c10::Device device) {
  for (const auto& s : streams)
    if (s.device() == device) return &s;
  return nullptr;
}

}  // namespace

std::vector<c10::Device> cuda_devices(c10::ArrayRef<at::Tensor> tensors) {
  std::vector<c10::Device> out;
  for (const auto& t : tensors)
    if (t.defined() && t.is_cuda() && std::find(out.begin(), out.end(), t.device()) == out.end())
      out.push_back(t.device());
  return out;
}

std::vector<c10::Stream> current_streams(const std::vector<c10::Device>& devices) {
  std::vector<c10::Stream> out;
  for (const auto& d : devices) out.push_back(cuda().getStream(d));
  return out;
}

std::vector<c10::Event> record(const std::vector<c10::Stream>& streams) {
  std::vector<c10::Event> out;
  for (const auto& s : streams) {
    out.emplace_back(c10::kCUDA);
    out.back().record(s);
  }
  return out;
}

void block_current(const std::vector<c10::Event>& events) {
  for (const auto& e : events) e.block(cuda().getStream(e.device()));
}

void keep_for(c10::ArrayRef<at::Tensor> tensors, const std::vector<c10::Stream>& streams) {
  for (const auto& t : tensors)
    if (t.defined() && t.is_cuda() && t.has_storage())
      if (const auto* s = stream_on(streams, t.device()))
        cuda().recordDataPtrOnStream(t.storage().data_ptr(), *s);
}

std::vector<c10::Stream> CommStreams::enter(const std::vector<c10::Device>& devices) {
  std::vector<c10::Stream> out;
  for (const auto& d : devices) {
    const c10::Stream* s = stream_on(taken_, d);
    if (!s) {
      taken_.push_back(cuda().getStreamFromGlobalPool(d));
      cuda().exchangeStream(taken_.back());
      s = &taken_.back();
    }
    out.push_back(*s);
  }
  return out;
}

}  // namespace treetensor::distributed::detail
