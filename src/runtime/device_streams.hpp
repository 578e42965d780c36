#pragma once
// Internal side of the lane stream protocol (see treetensor/runtime/device_streams.hpp).

#include "treetensor/runtime/device_streams.hpp"

#include <mutex>
#include <optional>
#include <vector>

namespace treetensor::runtime::detail {

/// The backend for lane batches on `device`: the test backend when installed, else the
/// device-generic one for non-CPU devices, else nullptr (CPU needs no protocol).
std::shared_ptr<StreamBackend> backend_for(c10::Device device);
/// The waits tests left on.
testing::ProtocolWaits protocol_waits();

/// Caller side of one lane batch: step 1 at construction, step 4 in join().
class CallerStreams {
 public:
  CallerStreams(std::shared_ptr<StreamBackend> backend, c10::Device device);
  /// The marker lanes wait on (step 2).
  const StreamBackend::Marker& start() const { return *start_; }
  const c10::Stream& stream() const { return stream_; }
  StreamBackend& backend() const { return *backend_; }
  c10::Device device() const { return device_; }
  /// Called by a lane after its last leaf (step 3's marker).
  void add_lane_marker(std::unique_ptr<StreamBackend::Marker> marker);
  /// Step 4: the caller's stream waits on every lane marker.
  void join();

 private:
  std::shared_ptr<StreamBackend> backend_;
  c10::Device device_;
  c10::Stream stream_;
  std::unique_ptr<StreamBackend::Marker> start_;
  std::mutex mutex_;
  std::vector<std::unique_ptr<StreamBackend::Marker>> lane_markers_;
};

/// Lane side: switches the lane to the call's device and its stream and waits on the caller's
/// marker (step 2); finish() records the lane's marker (step 3); the destructor restores the lane's
/// stream.
class LaneStreams {
 public:
  LaneStreams(CallerStreams& caller, std::size_t lane);
  ~LaneStreams();
  void finish();
  LaneStreams(const LaneStreams&) = delete;
  LaneStreams& operator=(const LaneStreams&) = delete;

 private:
  CallerStreams& caller_;
  c10::Device previous_device_;
  c10::Stream lane_stream_;
  c10::Stream previous_;
  CallerStreams* outer_;
};

}  // namespace treetensor::runtime::detail
