#include "runtime/device_streams.hpp"

#include "runtime/fork.hpp"

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <map>
#include <utility>

namespace treetensor::runtime {
namespace detail {
namespace {

// c10's device-generic streams and events: CUDA when LibTorch has it, any other registered
// device type too; never compiled against CUDA headers.
class GenericBackend final : public StreamBackend {
 public:
  explicit GenericBackend(c10::DeviceType type) : type_(type), impl_(type) {}

  c10::Stream current(c10::Device device) override { return impl_.getStream(device); }
  c10::Stream exchange(c10::Stream stream) override { return impl_.exchangeStream(stream); }
  c10::Device exchange_device(c10::Device device) override { return impl_.exchangeDevice(device); }

  c10::Stream lane_stream(std::size_t lane, c10::Device device) override {
    std::lock_guard lock(mutex_);
    auto key = std::make_pair(lane, device.index());
    auto it = lanes_.find(key);
    if (it == lanes_.end()) it = lanes_.emplace(key, impl_.getStreamFromGlobalPool(device)).first;
    return it->second;
  }

  std::unique_ptr<Marker> record(const c10::Stream& stream) override {
    auto marker = std::make_unique<EventMarker>(type_);
    marker->event.record(stream);
    return marker;
  }

  void wait(const c10::Stream& waiter, const Marker& marker) override {
    static_cast<const EventMarker&>(marker).event.block(waiter);
  }

  void record_data_ptr(const c10::DataPtr& data, const c10::Stream& stream) override {
    impl_.recordDataPtrOnStream(data, stream);
  }

  void synchronize_lanes() override {
    std::lock_guard lock(mutex_);
    for (const auto& entry : lanes_) impl_.synchronizeStream(entry.second);
  }

 private:
  struct EventMarker final : Marker {
    explicit EventMarker(c10::DeviceType type) : event(type) {}
    c10::Event event;
  };

  c10::DeviceType type_;
  c10::impl::VirtualGuardImpl impl_;
  std::mutex mutex_;
  std::map<std::pair<std::size_t, c10::DeviceIndex>, c10::Stream> lanes_;
};

std::mutex registry_mutex;  // taken by every lane call (backend_for): held over fork()
const int registry_mutex_held_over_fork = (hold_over_fork(registry_mutex), 0);
std::shared_ptr<StreamBackend> test_backend;
testing::ProtocolWaits test_waits;
std::map<c10::DeviceType, std::shared_ptr<StreamBackend>>& generic_backends() {
  static auto* map = new std::map<c10::DeviceType, std::shared_ptr<StreamBackend>>;
  return *map;
}

// The batch whose lane stream the calling thread is running leaves on, for record_for_caller.
thread_local CallerStreams* current_batch = nullptr;

}  // namespace

std::shared_ptr<StreamBackend> backend_for(c10::Device device) {
  std::lock_guard lock(registry_mutex);
  if (test_backend) return test_backend;
  if (device.is_cpu()) return nullptr;
  auto& slot = generic_backends()[device.type()];
  if (!slot) slot = std::make_shared<GenericBackend>(device.type());
  return slot;
}

testing::ProtocolWaits protocol_waits() {
  std::lock_guard lock(registry_mutex);
  return test_waits;
}

CallerStreams::CallerStreams(std::shared_ptr<StreamBackend> backend, c10::Device device)
    : backend_(std::move(backend)),
      device_(device),
      stream_(backend_->current(device)),
      start_(backend_->record(stream_)) {}

void CallerStreams::add_lane_marker(std::unique_ptr<StreamBackend::Marker> marker) {
  std::lock_guard lock(mutex_);
  lane_markers_.push_back(std::move(marker));
}

void CallerStreams::join() {
  if (!protocol_waits().caller_waits_for_lanes) return;
  std::lock_guard lock(mutex_);
  for (const auto& marker : lane_markers_) backend_->wait(stream_, *marker);
}

LaneStreams::LaneStreams(CallerStreams& caller, std::size_t lane)
    : caller_(caller),
      previous_device_(caller.backend().exchange_device(caller.device())),
      lane_stream_(caller.backend().lane_stream(lane, caller.device())),
      previous_(caller.backend().exchange(lane_stream_)),
      outer_(current_batch) {
  current_batch = &caller_;
  if (protocol_waits().lane_waits_for_caller) caller_.backend().wait(lane_stream_, caller_.start());
}

void LaneStreams::finish() {
  caller_.add_lane_marker(caller_.backend().record(lane_stream_));
}

LaneStreams::~LaneStreams() {
  current_batch = outer_;
  caller_.backend().exchange(previous_);
  caller_.backend().exchange_device(previous_device_);
}

}  // namespace detail

void record_for_caller(const c10::DataPtr& data) {
  if (detail::current_batch == nullptr) return;
  detail::current_batch->backend().record_data_ptr(data, detail::current_batch->stream());
}

void synchronize_lane_streams() {
  std::vector<std::shared_ptr<StreamBackend>> backends;
  {
    std::lock_guard lock(detail::registry_mutex);
    if (detail::test_backend) backends.push_back(detail::test_backend);
    for (const auto& entry : detail::generic_backends()) backends.push_back(entry.second);
  }
  for (const auto& backend : backends) backend->synchronize_lanes();
}

namespace testing {

void install_stream_backend(std::shared_ptr<StreamBackend> backend, ProtocolWaits waits) {
  std::lock_guard lock(detail::registry_mutex);
  detail::test_backend = std::move(backend);
  detail::test_waits = waits;
}

}  // namespace testing
}  // namespace treetensor::runtime
