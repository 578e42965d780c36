#pragma once
// Device streams for lanes (DESIGN.md §7): the synchronisation protocol and its backend.
//
// When a tree call on a device with streams (CUDA) runs on M lanes, each worker lane runs its
// leaves on its own stream for that device, and run() keeps results correct with no user
// synchronize:
//   1. the caller records a marker (event) on its current stream before handing work out;
//   2. each lane's stream waits on that marker before the lane enqueues leaf work
//      ("lane waits for caller": inputs the caller produced are ready);
//   3. each lane records a marker on its stream after its last leaf;
//   4. after the join, the caller's current stream waits on every lane marker
//      ("caller waits for lanes": results are ready for whatever the caller enqueues next).
// The caller's own share of the leaves runs on its current stream and needs no marker.
// Memory a lane allocates is owned by the lane's stream in a caching allocator; a leaf that
// returns such memory to the caller calls record_for_caller(), so the allocator does not reuse
// it until the caller's stream is done with it (CUDA's record_stream).
//
// The protocol talks to a StreamBackend. The real one uses c10's device-generic API
// (c10::impl::VirtualGuardImpl, c10::Stream, c10::Event: present in LibTorch 1.13 and 2.x), so
// the same source builds with CPU-only and CUDA LibTorch. Tests install a simulated backend
// (host threads as streams) to check the protocol on CPU.

#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <cstddef>
#include <memory>

namespace c10 {
class DataPtr;
}

namespace treetensor::runtime {

/// A device-stream implementation the lane protocol runs against.
/// Thread safety: every method may be called from any lane concurrently.
class StreamBackend {
 public:
  /// A completion marker: becomes complete when all work enqueued on the stream it was
  /// recorded on, up to the record, has finished.
  struct Marker {
    virtual ~Marker() = default;
  };

  virtual ~StreamBackend() = default;
  /// The calling thread's current stream on `device`.
  virtual c10::Stream current(c10::Device device) = 0;
  /// Makes `stream` current on the calling thread; returns the stream it replaces.
  virtual c10::Stream exchange(c10::Stream stream) = 0;
  /// Makes `device` the calling thread's current device; returns the previous one. Lanes call
  /// it first, since the current device is per thread and not part of at::ThreadLocalState.
  /// The default does nothing (devices without a current-device notion, simulated backends).
  virtual c10::Device exchange_device(c10::Device device) { return device; }
  /// The stream lane `lane` (1..workers) uses on `device`; the same one on every call.
  virtual c10::Stream lane_stream(std::size_t lane, c10::Device device) = 0;
  /// Records a marker on `stream`.
  virtual std::unique_ptr<Marker> record(const c10::Stream& stream) = 0;
  /// Makes work enqueued on `waiter` after this call wait until `marker` completes (without
  /// blocking the host).
  virtual void wait(const c10::Stream& waiter, const Marker& marker) = 0;
  /// Keeps `data` from being reused until the work enqueued on `stream` so far is done.
  virtual void record_data_ptr(const c10::DataPtr& data, const c10::Stream& stream) = 0;
  /// Blocks the host until every lane stream created so far is idle.
  virtual void synchronize_lanes() = 0;
};

/// Inside a leaf job run by a lane on a device with streams: keeps `data` (an output the
/// caller will use) valid until the caller's stream is done with it. A no-op on the caller's
/// own share, on CPU, and outside run().
/// Thread safety: call from the leaf job's thread.
void record_for_caller(const c10::DataPtr& data);

/// Blocks until every lane stream (all devices) is idle; for runtime::synchronize().
/// A no-op when no lane ever ran device work.
void synchronize_lane_streams();

namespace testing {

/// Which protocol waits run() performs; tests switch one off to show it is needed.
struct ProtocolWaits {
  bool lane_waits_for_caller = true;
  bool caller_waits_for_lanes = true;
};

/// Installs `backend` for every lane batch regardless of the call's device (nullptr restores
/// the device-generic one, used only for non-CPU devices) and sets which waits run. Not for
/// production use; call only while no tree call is running.
void install_stream_backend(std::shared_ptr<StreamBackend> backend, ProtocolWaits waits = {});

}  // namespace testing
}  // namespace treetensor::runtime
