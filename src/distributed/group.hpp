#pragma once
// A group and its communication thread (DESIGN.md §14): the queue of requests, the agreement
// round before each collective, and the collective itself over the group's backends: Gloo for
// CPU buckets and the agreement, NCCL for CUDA buckets (made at the first request with a CUDA
// leaf, which every rank reaches in the same round because the signatures name devices).

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/util/FunctionRef.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "distributed/agreement.hpp"
#include "distributed/buckets.hpp"
#include "distributed/streams.hpp"
#include "treetensor/asyncs/thread.hpp"
#include "treetensor/distributed/process_group.hpp"
#include "treetensor/tensor/tree_tensor.hpp"
#include "treetensor/tree/flatten.hpp"

namespace treetensor::distributed::detail {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;

/// @throws std::invalid_argument for a rank outside [0, world) or a world below 1.
void check_rank(int rank, int world);

/// `e`'s message for a CollectiveError: a c10::Error's without its C++ backtrace (c10's what()
/// appends one, many lines long), any other's up to its first line break.
std::string error_text(const std::exception& e);

/// One tree collective requested on a group.
struct Request {
  std::int64_t key_thread = 0, key_count = 0;
  Op op = Op::barrier;
  ReduceOp reduce = ReduceOp::sum;
  std::int64_t root = -1;
  tree::TreeSpec spec;
  std::vector<tree::Path> paths;
  std::vector<at::Tensor> leaves;
  std::string sig;
  std::int64_t hash = 0, numel = 0;
  // A consolidated tree's buffers (all_reduce/broadcast): the buffer is the bucket, nothing is
  // copied. `buffers_hash` (their dtypes and lengths, 0 without) must agree on every rank, which
  // round() checks before execute() uses them (`use_buffers`).
  std::vector<at::Tensor> buffers;
  std::int64_t buffers_hash = 0;
  bool use_buffers = false;
  // CUDA leaves (streams.hpp): their devices, the requester's current streams there and events
  // on them at the request (step 1); events on the communication streams once the results are
  // written (step 3), set before the request completes.
  std::vector<c10::Device> devices;
  std::vector<c10::Stream> requester;
  std::vector<c10::Event> ready, finished;
  // Why this rank refused the request (its arguments failed a check; empty: not refused). A
  // refused request still takes its place in the order, with `sig` holding the reason, so that
  // the peers' matching request fails with it instead of pairing with this rank's next one.
  std::string refused;
  std::promise<void> done;
  std::promise<TreeTensor> value;
  std::shared_future<void> done_future{done.get_future().share()};
  std::shared_future<TreeTensor> value_future{value.get_future().share()};
};

class Group {
 public:
  /// Connects Gloo over `store` (loopback: on 127.0.0.1) and starts the communication thread.
  /// @throws CollectiveError when Gloo cannot connect.
  Group(c10::intrusive_ptr<c10d::Store> store, int rank, int world, Options opts, bool loopback);
  /// Drains the waiting thread, then the queued requests; closes NCCL if it was made.
  ~Group();

  int rank() const { return rank_; }
  int world() const { return world_; }
  const Options& options() const { return opts_; }
  std::uint64_t sequence() const { return seq_.load(); }

  /// The asyncs thread whose jobs stand for this group's queued collectives (made on first use).
  asyncs::Thread& waiter();

  /// Keys `r` with the calling thread's next request key and queues it.
  /// @throws the error that broke the group.
  std::shared_ptr<Request> submit(std::shared_ptr<Request> r);

  /// The buckets of `leaves` with this group's limits (plan_buckets).
  std::vector<Bucket> buckets(const std::vector<at::Tensor>& leaves) const {
    return plan_buckets(leaves, opts_.first_bucket_bytes, opts_.bucket_bytes);
  }

  // ---- on the calling thread, over Gloo: not ordered with the collectives (see send()) ----
  int next_tag(bool sending, int peer);
  void plain_all_reduce(const at::Tensor& t);
  void p2p_send(at::Tensor t, int peer, int tag, const std::string& what);
  void p2p_recv(at::Tensor t, int peer, int tag, const std::string& what);

 private:
  void check_usable();
  void loop();
  void break_group(const std::shared_ptr<Request>& mine);
  void round(const std::shared_ptr<Request>& mine);
  std::shared_ptr<Request> next_request(const std::shared_ptr<Request>& mine,
                                        std::vector<Row>& rows);
  bool refused(Request& cur, const std::vector<Row>& rows, const std::string& where);
  std::string mismatch(const Request& cur, const std::vector<Row>& rows);
  Row row_of(const Request* r, std::int64_t thread, std::int64_t count) const;
  std::vector<Row> gather_rows(const Row& row);
  std::vector<std::string> gather_strings(const std::string& mine, std::int64_t max_len);
  std::shared_ptr<Request> wait_for(std::int64_t thread, std::int64_t count);

  // Runs an agreed request and completes it (streams.hpp steps 2 and 3 around perform()).
  void execute(Request& r, std::uint64_t seq);
  TreeTensor perform(Request& r, std::uint64_t seq);
  // all_reduce / broadcast of `leaves` in place, packed into buckets.
  void reduce_buckets(Request& r, std::uint64_t seq, const std::vector<at::Tensor>& leaves);
  // The same over r.buffers (a consolidated tree): one collective per buffer, no copies.
  void reduce_buffers(Request& r, std::uint64_t seq);
  TreeTensor reduce_scatter(Request& r, std::uint64_t seq);
  TreeTensor all_gather(Request& r, std::uint64_t seq);
  // A started all_reduce or broadcast of one buffer: the backend's collective, or the sends
  // and receives of a direct exchange with every peer (DESIGN.md §14), whose `parts` (every
  // rank's copy, this rank's own buffer at rank_) finish() reduces in rank order.
  struct Started {
    WorkPtr work;
    std::vector<WorkPtr> p2p;
    std::vector<at::Tensor> parts;
  };
  // Starts r's all_reduce or broadcast of the 1-D contiguous tensor `buffer`, in place (`what`
  // names it in errors).
  Started start(const Request& r, const at::Tensor& buffer, const std::string& what);
  Started start_exchange(const at::Tensor& buffer, const std::string& what);
  // Waits for `s` and, for an exchange, reduces its parts into `buffer` by r's op.
  void finish(const Request& r, Started& s, const std::string& what, const at::Tensor& buffer);
  // The backend for `buffer`'s device: Gloo for the CPU, NCCL for CUDA (made on first use).
  c10d::Backend& backend_for(const at::Tensor& buffer);
  // Waits for `w` (the result lands in `buffer`): Gloo's on the host, bounded by the timeout;
  // NCCL's on the device (the current, communication, stream waits for NCCL's stream), bounded
  // by the same timeout through c10d's NCCL watchdog.
  void wait(const WorkPtr& w, const std::string& what, const at::Tensor& buffer = {});
  // Issues a c10d call: Gloo throws its own exceptions (gloo::IoException once a pair broke,
  // e.g. after a timeout) when the call is made, not only from wait(); they become a
  // CollectiveError naming this rank and `what` (the op and the peer), as wait()'s do.
  WorkPtr issue(const std::string& what, c10::function_ref<WorkPtr()> start);
  [[noreturn]] void fail_with(const std::string& what, const std::exception& e) const;
  at::Tensor bucket_buffer(std::size_t b, std::int64_t n, const at::TensorOptions& o);
  void check_bucket(std::uint64_t seq, std::size_t b, const at::Tensor& buffer,
                    const std::string& first_path);

  int rank_, world_;
  Options opts_;
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Backend> gloo_;
  c10::intrusive_ptr<c10d::Backend> nccl_;  // comm thread only (and ~Group after the join)
  CommStreams streams_;                     // comm thread only
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Request>> pending_;
  std::map<std::int64_t, std::int64_t> counters_;
  std::map<int, std::int64_t> send_count_, recv_count_;
  std::exception_ptr broken_;
  bool stop_ = false;
  std::atomic<std::uint64_t> seq_{0};
  std::shared_ptr<Request> current_;  // the request of the running round (comm thread only)
  // Bucket buffers by (bucket, dtype, device type, device index, length); comm thread only.
  std::map<std::tuple<std::size_t, int, int, int, std::int64_t>, at::Tensor> buffers_;
  std::int64_t buffered_bytes_ = 0;
  std::thread comm_;
  std::once_flag waiter_once_;
  std::unique_ptr<asyncs::Thread> waiter_;  // destroyed first (see ~Group)
};

}  // namespace treetensor::distributed::detail
