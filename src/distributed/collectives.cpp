// The public tree collectives (process_group.hpp): each checks its arguments on the calling
// thread, becomes a Request queued on its group (group.hpp), and waits for it or returns an
// asyncs future standing for it; send and recv run on the calling thread.

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "distributed/group.hpp"
#include "distributed/nccl.hpp"
#include "treetensor/asyncs/operands.hpp"
#include "treetensor/distributed/process_group.hpp"
#include "treetensor/tensor/consolidate.hpp"

namespace treetensor::distributed {
namespace {

using detail::Op;
using detail::Request;

// Why a collective cannot take leaf `x` on its device (empty when it can).
std::string device_refusal(const at::Tensor& x) {
  if (x.device().is_cpu()) return {};
  if (!x.is_cuda())
    return "the leaf is on " + x.device().str() +
           "; collectives take CPU tensors (Gloo) and CUDA tensors (NCCL)";
  if (!detail::kNcclBuilt)
    return "the leaf is on " + x.device().str() +
           ", and this build has no NCCL (c10d's ProcessGroupNCCL: TREETENSOR_WITH_NCCL was off "
           "at configure); only CPU tensors (Gloo) can be communicated";
  return {};
}

// Why this rank cannot take part with these arguments (empty when it can): the checks the
// header names, each message naming the leaf's path.
std::string refusal(const Request& r, int world) {
  const std::string op = detail::op_name(r.op);
  if (r.op == Op::broadcast && (r.root < 0 || r.root >= world))
    return "treetensor distributed: broadcast: root " + std::to_string(r.root) +
           " is outside [0, world size " + std::to_string(world) + ")";
  const bool reduction = r.op == Op::all_reduce || r.op == Op::reduce_scatter;
  for (std::size_t i = 0; i < r.leaves.size(); ++i) {
    const auto& x = r.leaves[i];
    // Made only for a message: this loop runs on every collective, over every leaf.
    const auto at = [&] {
      return "treetensor distributed: " + op + " at path '" + r.paths[i].describe() + "': ";
    };
    if (!x.defined()) return at() + "the leaf is an undefined tensor";
    // Communication moves raw storage, which such a view reads through its bit.
    if (x.is_conj() || x.is_neg())
      return at() + "the leaf is a " + (x.is_conj() ? "conjugate" : "negative") +
             " view; resolve_conj() / resolve_neg() it first";
    if (auto why = device_refusal(x); !why.empty()) return at() + why;
    const auto t = x.scalar_type();
    if (reduction && r.reduce == ReduceOp::avg && !at::isFloatingType(t) && !at::isComplexType(t))
      return at() + "ReduceOp::avg needs a floating dtype, the leaf is " + detail::dtype_text(t);
    if (reduction && !detail::reducible(t, r.reduce, x.device().type()))
      return at() + detail::irreducible_text(t, r.reduce, x.device().type());
    if (r.op == Op::reduce_scatter && (x.dim() == 0 || x.size(0) % world != 0))
      return at() + "reduce_scatter splits dim 0 into " + std::to_string(world) +
             " equal chunks; the leaf is " + detail::leaf_text(x);
  }
  if (r.op == Op::all_reduce || r.op == Op::broadcast)
    if (auto why = detail::write_conflict(r.paths, r.leaves); !why.empty())
      return "treetensor distributed: " + op + " at " + why;
  return {};
}

// A refused request still takes its place in the order (group.hpp, Request::refused); the
// arguments are the caller's error.
[[noreturn]] void submit_refused(const ProcessGroup& g, std::shared_ptr<Request> r) {
  const std::string why = r->refused;
  r->leaves.clear();
  r->sig = why;
  try {
    g.impl().submit(std::move(r));
  } catch (const std::exception&) {  // a broken group: the arguments are still the error
  }
  throw std::invalid_argument(why);
}

// Equal signatures can still lie differently (a comparison's bool result keeps its float
// operands' offsets), so a consolidated tree's offsets are hashed with its buffers.
void take_buffers(Request& r, const ConsolidatedTree& c) {
  std::string text;
  for (const auto& b : c.buffers())
    text += detail::dtype_text(b.scalar_type()) + " " + std::to_string(b.numel()) + "\n";
  for (std::size_t i = 0; i < c.layout().leaves(); ++i)
    text += std::to_string(c.layout().offset(i)) + " ";
  r.buffers = c.buffers();
  r.buffers_hash = detail::fnv1a(text) | 1;  // never 0 (0: not consolidated)
}

std::shared_ptr<Request> make_request(const ProcessGroup& g, Op op, const TensorTree& t,
                                      ReduceOp reduce, int root) {
  auto r = std::make_shared<Request>();
  r->op = op;
  r->reduce = reduce;
  r->root = root;
  auto flat = tree::flatten(t);
  r->spec = flat.spec;
  r->paths = flat.spec.paths();
  r->leaves = std::move(flat.leaves);
  r->refused = refusal(*r, g.world_size());
  if (!r->refused.empty()) submit_refused(g, std::move(r));
  const bool writes = op == Op::all_reduce || op == Op::broadcast;
  // Pending asyncs work on the leaves finishes first, as before any tree call (DESIGN.md §10).
  if (asyncs::tracking_active())
    asyncs::await_operands(writes ? c10::ArrayRef<at::Tensor>() : r->leaves,
                           writes ? r->leaves : c10::ArrayRef<at::Tensor>());
  for (const auto& x : r->leaves) r->numel += x.numel();
  r->sig = detail::signature(r->paths, r->leaves);
  r->hash = detail::fnv1a(r->sig);
  if (const auto* c = consolidated_source(t); c && writes) take_buffers(*r, *c);
  // streams.hpp step 1, after await_operands has made this stream wait for asyncs writers.
  r->devices = detail::cuda_devices(r->leaves);
  r->requester = detail::current_streams(r->devices);
  r->ready = detail::record(r->requester);
  return g.impl().submit(std::move(r));
}

// The request's end for the thread that takes its result: its current stream waits for the
// communication streams (streams.hpp step 4). @throws the request's error.
void complete(const Request& r) {
  r.done_future.get();
  detail::block_current(r.finished);
}

TreeTensor result(const Request& r) {
  complete(r);
  return r.value_future.get();
}

// A queued request as an asyncs job on the group's waiting thread, with the tree's leaves as
// its operands (DESIGN.md §10): later tree calls on them wait for the collective, and their
// streams for the job's, which waited for the communication streams. The request (and its key)
// was made on the caller's thread, so the order across ranks is the caller's.
template <class F>
auto tracked(const ProcessGroup& g, const TensorTree& t, bool writes, F&& wait, const char* op) {
  const std::vector<at::Tensor> leaves = tree::flatten(t).leaves;
  const c10::ArrayRef<at::Tensor> none;
  return g.impl().waiter().submit(std::forward<F>(wait), writes ? none : leaves,
                                  writes ? leaves : none, op);
}

}  // namespace

asyncs::Future<void> all_reduce_async(const ProcessGroup& g, const TensorTree& t, ReduceOp op) {
  auto r = make_request(g, Op::all_reduce, t, op, -1);
  return tracked(
      g, t, true, [r] { complete(*r); }, "all_reduce");
}
void all_reduce(const ProcessGroup& g, const TensorTree& t, ReduceOp op) {
  complete(*make_request(g, Op::all_reduce, t, op, -1));
}

asyncs::Future<void> broadcast_async(const ProcessGroup& g, const TensorTree& t, int root) {
  auto r = make_request(g, Op::broadcast, t, ReduceOp::sum, root);
  return tracked(
      g, t, true, [r] { complete(*r); }, "broadcast");
}
void broadcast(const ProcessGroup& g, const TensorTree& t, int root) {
  complete(*make_request(g, Op::broadcast, t, ReduceOp::sum, root));
}

asyncs::Future<TreeTensor> all_gather_async(const ProcessGroup& g, const TensorTree& t) {
  auto r = make_request(g, Op::all_gather, t, ReduceOp::sum, -1);
  return tracked(
      g, t, false, [r] { return result(*r); }, "all_gather");
}
TreeTensor all_gather(const ProcessGroup& g, const TensorTree& t) {
  return result(*make_request(g, Op::all_gather, t, ReduceOp::sum, -1));
}

TreeTensor reduce_scatter(const ProcessGroup& g, const TensorTree& t, ReduceOp op) {
  return result(*make_request(g, Op::reduce_scatter, t, op, -1));
}

void all_reduce_each(const ProcessGroup& g, const std::vector<at::Tensor>& tensors) {
  for (std::size_t i = 0; i < tensors.size(); ++i)
    if (!tensors[i].is_contiguous() || !tensors[i].device().is_cpu())
      throw std::invalid_argument("treetensor distributed: all_reduce_each: tensor " +
                                  std::to_string(i) + " must be a contiguous CPU tensor");
  for (const auto& t : tensors) g.impl().plain_all_reduce(t);
}

void barrier(const ProcessGroup& g) {
  complete(*make_request(g, Op::barrier, TensorTree{}, ReduceOp::sum, -1));
}

// send/recv: header [signature length, hash], the signature, the receiver's verdict
// [0 = agree / its signature length], then (if agreed) one message per bucket, over Gloo on
// the calling thread. A side that refuses its arguments still answers in this exchange, with a
// negative length and the reason in place of the signature, so that its peer fails with the
// reason instead of waiting.
namespace {

// Why this rank cannot send or receive `leaves` (empty when it can). CUDA leaves are refused by
// choice: send and recv run on the calling thread, where NCCL point-to-point would need a second
// stream protocol beside the communication thread's (streams.hpp) and ProcessGroupNCCL used
// from two threads at once.
std::string p2p_refusal(const char* op, const std::vector<tree::Path>& paths,
                        const std::vector<at::Tensor>& leaves) {
  for (std::size_t i = 0; i < leaves.size(); ++i)
    if (!leaves[i].defined() || !leaves[i].device().is_cpu())
      return std::string("treetensor distributed: ") + op + " at path '" + paths[i].describe() +
             "': the leaf must be a defined CPU tensor" +
             (leaves[i].defined() ? " (it is on " + leaves[i].device().str() +
                                        "; send and recv move CPU leaves only, over Gloo: copy "
                                        "it to the CPU, or use broadcast)"
                                  : "");
  if (std::string(op) == "recv")
    if (auto why = detail::write_conflict(paths, leaves); !why.empty())
      return "treetensor distributed: recv at " + why;
  return {};
}

void check_peer(const ProcessGroup& g, int peer, const char* op) {
  detail::check_rank(peer, g.world_size());
  if (peer == g.rank())
    throw std::invalid_argument(std::string("treetensor distributed: ") + op + " with rank " +
                                std::to_string(peer) + ", the calling rank itself");
}

at::Tensor text_bytes(const std::string& s) {
  at::Tensor bytes =
      at::zeros({static_cast<std::int64_t>(std::max<std::size_t>(s.size(), 1))}, at::kByte);
  std::copy(s.begin(), s.end(), bytes.data_ptr<std::uint8_t>());
  return bytes;
}

std::string recv_text(detail::Group& impl, std::int64_t len, int peer, int tag,
                      const std::string& what) {
  at::Tensor bytes = at::empty({std::max<std::int64_t>(len, 1)}, at::kByte);
  impl.p2p_recv(bytes, peer, tag, what);
  const auto* p = reinterpret_cast<const char*>(bytes.data_ptr<std::uint8_t>());
  return std::string(p, strnlen(p, static_cast<std::size_t>(len)));
}

}  // namespace

void send(const ProcessGroup& g, const TensorTree& t, int dst) {
  check_peer(g, dst, "send");
  at::NoGradGuard no_grad;  // leaves may require grad, as with torch.distributed.send
  auto& impl = g.impl();
  auto flat = tree::flatten(t);
  const auto paths = flat.spec.paths();
  const std::string refused = p2p_refusal("send", paths, flat.leaves);
  const std::string sig = refused.empty() ? detail::signature(paths, flat.leaves) : refused;
  const auto len = static_cast<std::int64_t>(sig.size());
  const int tag = impl.next_tag(true, dst);
  const std::string what = "send to rank " + std::to_string(dst);
  impl.p2p_send(at::tensor({refused.empty() ? len : -len, detail::fnv1a(sig)}, at::kLong), dst, tag,
                what);
  impl.p2p_send(text_bytes(sig), dst, tag + 1, what);
  if (!refused.empty()) throw std::invalid_argument(refused);
  at::Tensor verdict = at::empty({1}, at::kLong);
  impl.p2p_recv(verdict, dst, tag + 2, what);
  const std::string head = "treetensor distributed: send from rank " + std::to_string(g.rank()) +
                           " to rank " + std::to_string(dst) + ": ";
  if (const std::int64_t v = verdict.item<std::int64_t>(); v < 0) {
    throw CollectiveMismatch(head +
                             "the receiver refused it: " + recv_text(impl, -v, dst, tag + 3, what));
  } else if (v > 0) {
    const std::string other = recv_text(impl, v, dst, tag + 3, what);
    throw CollectiveMismatch(head + detail::first_difference(g.rank(), sig, dst, other));
  }
  if (asyncs::tracking_active()) asyncs::await_operands(flat.leaves, {});
  for (const auto& items : impl.buckets(flat.leaves)) {
    if (detail::is_one_leaf(flat.leaves, items)) {
      impl.p2p_send(flat.leaves[items[0].first].view({-1}), dst, tag + 3, what);
      continue;
    }
    at::Tensor buffer =
        at::empty({detail::bucket_numel(items)}, flat.leaves[items[0].first].options());
    detail::pack(flat.leaves, items, buffer);
    impl.p2p_send(buffer, dst, tag + 3, what);
  }
}

void recv(const ProcessGroup& g, const TensorTree& t, int src) {
  check_peer(g, src, "recv");
  at::NoGradGuard no_grad;
  auto& impl = g.impl();
  auto flat = tree::flatten(t);
  const auto paths = flat.spec.paths();
  const std::string refused = p2p_refusal("recv", paths, flat.leaves);
  const std::string sig = refused.empty() ? detail::signature(paths, flat.leaves) : refused;
  const int tag = impl.next_tag(false, src);
  const std::string what = "recv from rank " + std::to_string(src);
  at::Tensor header = at::empty({2}, at::kLong);
  impl.p2p_recv(header, src, tag, what);
  const std::int64_t len = header[0].item<std::int64_t>();
  const std::string other = recv_text(impl, std::abs(len), src, tag + 1, what);
  const std::string head = "treetensor distributed: send from rank " + std::to_string(src) +
                           " to rank " + std::to_string(g.rank()) + ": ";
  if (len < 0) {  // the sender refused: it waits for no verdict
    if (!refused.empty()) throw std::invalid_argument(refused);
    throw CollectiveMismatch(head + "the sender refused it: " + other);
  }
  const bool agree = refused.empty() && other == sig;
  const auto mine = static_cast<std::int64_t>(std::max<std::size_t>(sig.size(), 1));
  impl.p2p_send(at::tensor({agree             ? 0
                            : refused.empty() ? mine
                                              : -mine},
                           at::kLong),
                src, tag + 2, what);
  if (!agree) {
    impl.p2p_send(text_bytes(sig), src, tag + 3, what);
    if (!refused.empty()) throw std::invalid_argument(refused);
    throw CollectiveMismatch(head + detail::first_difference(src, other, g.rank(), sig));
  }
  if (asyncs::tracking_active()) asyncs::await_operands({}, flat.leaves);
  for (const auto& items : impl.buckets(flat.leaves)) {
    if (detail::is_one_leaf(flat.leaves, items)) {
      impl.p2p_recv(flat.leaves[items[0].first].view({-1}), src, tag + 3, what);
      continue;
    }
    at::Tensor buffer =
        at::empty({detail::bucket_numel(items)}, flat.leaves[items[0].first].options());
    impl.p2p_recv(buffer, src, tag + 3, what);
    detail::unpack(buffer, items, flat.leaves);
  }
}

}  // namespace treetensor::distributed
