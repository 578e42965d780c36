#pragma once
// Collectives on tree tensors over c10d (DESIGN.md §14): the distributed layer, above asyncs
// and tensor. Nothing below this layer includes it.
//
//     auto group = distributed::ProcessGroup::from_env();   // torchrun's RANK, WORLD_SIZE, ...
//     distributed::all_reduce(group, grads, distributed::ReduceOp::avg);   // in place
//
// Rules that hold for every collective below:
//  - Backends: c10d's ProcessGroupGloo for CPU leaves and for the cross-rank agreement, and
//    c10d's ProcessGroupNCCL for CUDA leaves when this build has NCCL (see CUDA below). Results
//    are those of the matching torch.distributed call (named at each function).
//  - Buckets: leaves are packed DDP-style into flat buffers per (dtype, device) in flatten
//    (sorted-path) order, the first bucket up to Options::first_bucket_bytes (1 MiB), the
//    others up to Options::bucket_bytes (25 MiB); a leaf larger than a bucket gets its own. One
//    c10d collective per bucket; results are copied back into the leaves. all_reduce and
//    broadcast of a consolidated tree (tensor/consolidate.hpp) use its buffers as the buckets
//    (one collective per buffer, padding included, nothing copied) when every rank's tree is
//    consolidated with the same buffers and offsets; otherwise every rank packs buckets.
//  - Ordering across ranks: every request carries a key (asyncs thread id of the caller, or 0
//    for a thread that is not running an asyncs job; and the caller's count of requests on
//    this group). One communication thread per group issues them; before each collective the
//    ranks agree (one small allgather) on which request runs next: rank 0's oldest pending one.
//    So collectives requested from several asyncs threads never cross between ranks, whatever
//    order the threads run in, as long as each asyncs thread (and the non-asyncs caller)
//    makes the same sequence of requests on every rank. Requests made concurrently by two
//    threads that are not asyncs jobs share key 0 and are NOT ordered: make them from one.
//  - Checks: the same allgather compares (key, op, reduce op, root, leaf count, element count,
//    structure hash over paths, dtypes, shapes and device types) across ranks. A disagreement is a
//    CollectiveMismatch thrown on every rank, naming the first differing path (or field) and
//    what each rank has; no data moves and the group stays usable. A request that some rank
//    does not make within half of Options::timeout (rank 0 ran it first) is a
//    CollectiveMismatch on every rank too, but the ranks no longer agree on what comes next:
//    the group is broken.
//    With Options::debug (or TREETENSOR_DIST_DEBUG=1) every bucket is also checked
//    (sequence, bucket, dtype, element count) before it moves.
//  - Refusals: arguments that fail a check on this rank (an undefined leaf, a leaf on neither
//    the CPU nor CUDA, a CUDA leaf in a build without NCCL, a dtype its backend cannot reduce,
//    a root outside the world, leaves that share memory in a collective that writes them)
//    throw std::invalid_argument naming the path at the call; the request still takes its
//    place in the order, so every peer's matching request fails with a CollectiveMismatch
//    saying which rank refused and why (before this, a check failing on one rank only would
//    pair the peers' request with that rank's next one). No data moves; the group stays usable.
//  - Dtypes: the backend's own, Gloo's (float32/64, float16, int8, uint8, int32, int64) on the
//    CPU, NCCL's (the same and bfloat16) on CUDA; bool is reduced as uint8 with NCCL's meaning
//    (sum and max: any; product and min: all), complex by sum and avg of its real and
//    imaginary parts (torch.distributed's rule); broadcast, all_gather and send/recv move any
//    dtype (as bytes). Other reductions are refused.
//  - Leaves may require grad: collectives write them outside autograd, as torch.distributed
//    does. Before a collective reads or writes its leaves, pending asyncs jobs that write them
//    (or, for a written leaf, read them) finish, as before any tree call (DESIGN.md §10).
//  - Time: every wait (a peer's request, a c10d collective) is bounded by Options::timeout.
//    A peer that died or stalls gives a CollectiveError on the survivors within about that
//    time, never a hang; the group is then broken and every later request throws. (Inside an
//    NCCL collective, see CUDA below.) send/recv after such a failure (Gloo's pair to that
//    peer is closed) throw CollectiveError too, naming the op, this rank and the peer. Error
//    messages are one line: c10's C++ backtraces are left out.
//  - CUDA (DESIGN.md §7, §14): when this build has NCCL (TREETENSOR_WITH_NCCL at configure:
//    a CUDA LibTorch and nccl.h), the buckets of CUDA leaves, and a consolidated tree's CUDA
//    buffers, go to ProcessGroupNCCL, which the group makes at its first request with a CUDA
//    leaf; CPU leaves of the same request still go to Gloo. Each rank uses its own GPU (NCCL
//    cannot put two ranks of a group on one device); ranks compare device types, not indices.
//    Streams: the collective starts after the work enqueued so far on the calling thread's
//    current stream of each device it uses, and runs on the group's own streams; by the time
//    the blocking form returns, the caller's current stream waits (device-side) for the
//    results, so work the caller enqueues next sees them with no synchronize: the host does
//    not wait for the GPU. For the _async forms the future's job's stream waits instead, so
//    get(), tree calls ordered after it by operand tracking and asyncs jobs that take the
//    leaves as operands see the results. New tensors (all_gather, reduce_scatter) are
//    recorded for the caching allocator on the requesting thread's stream; another stream
//    that uses them must wait for that one (or record them itself).
//    Errors: an NCCL failure when a collective is issued (two ranks on one GPU, no NCCL
//    library) is a CollectiveError that breaks the group. A peer that dies or stalls inside
//    an NCCL collective is caught by c10d's NCCL watchdog after Options::timeout, which by
//    default (TORCH_NCCL_ASYNC_ERROR_HANDLING) ends the process, as under torch.distributed;
//    the agreement over Gloo before every collective usually reports a dead peer first.
//    Without NCCL a CUDA leaf is refused (std::invalid_argument naming the path: "this build
//    has no NCCL").
//  - Errors name the tree path where one leaf is at fault (std::invalid_argument).

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "treetensor/asyncs/thread.hpp"
#include "treetensor/tensor/tree_tensor.hpp"

namespace treetensor::distributed {

/// Reduction of all_reduce and reduce_scatter (torch.distributed.ReduceOp). avg is sum then a
/// division by the world size (floating dtypes only; Gloo has no AVG).
enum class ReduceOp { sum, avg, min, max, product };

/// Ranks disagree on a collective: a different op, structure, dtype, shape or request key.
/// Thrown on every rank taking part.
class CollectiveMismatch : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A collective failed in the backend or timed out (dead or stalled peer), or the group is
/// broken by an earlier such failure.
class CollectiveError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Options {
  /// Bound on every wait for peers (Gloo's timeout, NCCL's watchdog timeout, the store's, and
  /// the wait for a peer's request). torch.distributed's default is 30 minutes; ours is 5.
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
  std::int64_t first_bucket_bytes = std::int64_t{1} << 20;  ///< DDP's first bucket, bytes
  std::int64_t bucket_bytes = std::int64_t{25} << 20;       ///< DDP's bucket_cap_mb, bytes
  /// Per-bucket cross-rank checks; also on when TREETENSOR_DIST_DEBUG=1 at group creation.
  bool debug = false;
};

namespace detail {
class Group;
}

/// A handle on one c10d process group with its communication thread. Copies share the group;
/// the last one to go stops the thread (after the queued requests) and closes the group.
/// Thread safety: every function taking a ProcessGroup may be called from any thread.
class ProcessGroup {
 public:
  /// From torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (LOCAL_RANK is
  /// read by local_rank()). Rank 0 hosts a c10d::TCPStore on MASTER_PORT, except under
  /// torchrun's agent (TORCHELASTIC_USE_AGENT_STORE=True), which hosts it: then every rank is a
  /// client, as in torch.distributed.init_process_group("gloo").
  /// @throws std::invalid_argument naming a missing or malformed variable; CollectiveError
  ///         when the store or Gloo cannot connect within options.timeout, or at once when
  ///         another process joined the group with this rank first ("rank 1 is claimed
  ///         twice"; one group per store, as Gloo's own rendezvous keys require).
  static ProcessGroup from_env(Options options = {});
  /// With a c10d::FileStore at `path` (a file every rank can reach; removed by c10d when all
  /// ranks are done with it): for tests and single-machine runs without a port.
  /// @throws std::invalid_argument for rank outside [0, world_size); CollectiveError as above.
  static ProcessGroup with_file_store(const std::string& path, int rank, int world_size,
                                      Options options = {});
  /// With a TCPStore at host:port; rank 0 serves it.
  static ProcessGroup with_tcp_store(const std::string& host, int port, int rank, int world_size,
                                     Options options = {});

  int rank() const;
  int world_size() const;
  const Options& options() const;
  /// Collectives this group has completed (the sequence number of the next one).
  std::uint64_t sequence() const;

  detail::Group& impl() const { return *impl_; }
  static ProcessGroup from_impl(std::shared_ptr<detail::Group> g) {
    return ProcessGroup(std::move(g));
  }

 private:
  explicit ProcessGroup(std::shared_ptr<detail::Group> g) : impl_(std::move(g)) {}
  std::shared_ptr<detail::Group> impl_;
};

/// LOCAL_RANK from the environment (torchrun), else 0.
int local_rank();

/// Sums (or reduces by `op`) every leaf across ranks, in place, as
/// torch.distributed.all_reduce on each leaf. Leaves may be any dtype reduced as the rules
/// above say, and non-contiguous, on the CPU or (with NCCL) CUDA. @throws CollectiveMismatch,
/// CollectiveError; std::invalid_argument naming the path of an undefined leaf, of a leaf on
/// another device (or on CUDA without NCCL), of an integer leaf with ReduceOp::avg, of a dtype
/// that cannot be reduced by `op` on its backend, of a leaf whose elements share memory (an
/// expanded view), or the two paths of leaves that share memory (tied weights: a per-leaf loop
/// would reduce them twice).
void all_reduce(const ProcessGroup& group, const TensorTree& tree, ReduceOp op = ReduceOp::sum);
/// The same, queued: returns at once. The key is taken at the call, so program order on the
/// calling thread is the order across ranks. The future is an asyncs job (on the group's
/// waiting thread) that finishes when the leaves hold the result, registered with the leaves
/// as written operands: a later tree call that reads or writes them waits for it (asyncs
/// operand tracking, DESIGN.md §10), as does asyncs::synchronize(). get() rethrows the errors
/// above (an error nobody collects is reported by the next synchronize()). Raw at:: use of the
/// leaves is not tracked: wait() first.
asyncs::Future<void> all_reduce_async(const ProcessGroup& group, const TensorTree& tree,
                                      ReduceOp op = ReduceOp::sum);

/// Every rank's leaves become root's, in place (torch.distributed.broadcast). @throws as
/// all_reduce; std::invalid_argument for a root outside [0, world_size).
void broadcast(const ProcessGroup& group, const TensorTree& tree, int root);
/// Queued as all_reduce_async (the leaves are written operands).
asyncs::Future<void> broadcast_async(const ProcessGroup& group, const TensorTree& tree, int root);

/// A tree of the same structure whose leaves are every rank's leaf stacked along a new first
/// dimension: leaf shape [world_size, ...] in rank order (torch.distributed.all_gather, then
/// torch.stack).
TreeTensor all_gather(const ProcessGroup& group, const TensorTree& tree);
/// Queued as all_reduce_async; the leaves are read operands (a later in-place tree call on
/// them waits until they have been sent).
asyncs::Future<TreeTensor> all_gather_async(const ProcessGroup& group, const TensorTree& tree);

/// Each leaf reduced across ranks, then split along dim 0 into world_size equal chunks; rank r
/// gets chunk r (torch.distributed.reduce_scatter_tensor). Done as an all_reduce and a narrow
/// (the same on both backends). @throws std::invalid_argument naming the path of a leaf
/// whose dim 0 is not a multiple of world_size (or that is 0-d).
TreeTensor reduce_scatter(const ProcessGroup& group, const TensorTree& tree,
                          ReduceOp op = ReduceOp::sum);

/// Sends every leaf of `tree` to rank `dst` (torch.distributed.send per leaf), which must call
/// recv() with a tree of the same structure, dtypes and shapes. Both sides exchange the
/// structure first: a mismatch throws CollectiveMismatch on both, naming the first differing
/// path, and no data moves. Point-to-point: not part of the group's collective order; messages
/// between one pair of ranks match in call order (call send/recv to a peer from one thread).
/// Blocks until the peer has received. CPU leaves only, over Gloo on the calling thread: CUDA
/// leaves are refused (point-to-point over NCCL is not built; copy them to the CPU, or use
/// broadcast). A side whose arguments fail a check (an undefined or non-CPU leaf; for recv,
/// leaves that share memory) throws std::invalid_argument naming the
/// path after telling its peer, which throws CollectiveMismatch with the reason instead of
/// waiting for the timeout. @throws std::invalid_argument for `dst` outside the world or the
/// calling rank itself; CollectiveMismatch; CollectiveError as above.
void send(const ProcessGroup& group, const TensorTree& tree, int dst);
/// Receives into `tree`'s leaves (in place) what rank `src` sent with send(). @throws as send.
void recv(const ProcessGroup& group, const TensorTree& tree, int src);

/// A baseline for measurement (treetensor-bench allreduce), not a tree collective: one plain
/// c10d allreduce (sum) per tensor, each issued and waited before the next, on the calling
/// thread, as a hand-written loop over torch.distributed.all_reduce does. No ordering and no
/// checks: call it from one thread, while no tree collective of this group is pending, in the
/// same sequence on every rank. Tensors must be contiguous CPU tensors (Gloo).
/// @throws CollectiveError as above; std::invalid_argument for a non-contiguous tensor.
void all_reduce_each(const ProcessGroup& group, const std::vector<at::Tensor>& tensors);

/// Blocks until every rank has reached its barrier (in the group's collective order).
void barrier(const ProcessGroup& group);

}  // namespace treetensor::distributed
