// Tree collectives over c10d (process_group.hpp). Every c10d type is used in this file only,
// so LibTorch's version differences stay here: 1.13's ProcessGroupGloo derives from
// c10d::ProcessGroup, 2.x's from c10d::Backend; both have the constructor, Options (timeout,
// devices), the collectives with these signatures and c10d::Work::wait(timeout) used below.

#include "treetensor/distributed/process_group.hpp"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/util/irange.h>
#include <torch/csrc/api/include/torch/version.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <array>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>
#include <tuple>

#include "treetensor/asyncs/operands.hpp"
#include "treetensor/asyncs/thread.hpp"
#include "treetensor/tensor/consolidate.hpp"
#include "treetensor/tensor/dtype.hpp"
#include "treetensor/tree/flatten.hpp"

#ifndef USE_C10D_GLOO
#error "treetensor's distributed layer needs c10d's Gloo backend (define USE_C10D_GLOO)"
#endif

namespace treetensor::distributed {

namespace detail {

namespace {

using GlooGroup = c10d::ProcessGroupGloo;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

enum class Op : std::int64_t {
  missing = 0,
  all_reduce,
  broadcast,
  all_gather,
  reduce_scatter,
  barrier
};

const char* op_name(Op op) {
  switch (op) {
    case Op::missing:
      return "no request";
    case Op::all_reduce:
      return "all_reduce";
    case Op::broadcast:
      return "broadcast";
    case Op::all_gather:
      return "all_gather";
    case Op::reduce_scatter:
      return "reduce_scatter";
    case Op::barrier:
      return "barrier";
  }
  return "?";
}

const char* reduce_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return "sum";
    case ReduceOp::avg:
      return "avg";
    case ReduceOp::min:
      return "min";
    case ReduceOp::max:
      return "max";
    case ReduceOp::product:
      return "product";
  }
  return "?";
}

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      return c10d::ReduceOp(c10d::ReduceOp::SUM);
    case ReduceOp::min:
      return c10d::ReduceOp(c10d::ReduceOp::MIN);
    case ReduceOp::max:
      return c10d::ReduceOp(c10d::ReduceOp::MAX);
    case ReduceOp::product:
      return c10d::ReduceOp(c10d::ReduceOp::PRODUCT);
  }
  return c10d::ReduceOp(c10d::ReduceOp::SUM);
}

std::string dtype_text(at::ScalarType t) {
  return torch_dtype_name(t).value_or(c10::toString(t));
}

std::string leaf_text(const at::Tensor& t) {
  std::string s = dtype_text(t.scalar_type()) + " [";
  for (auto i : c10::irange(t.dim())) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

// FNV-1a: the same value in every process (std::hash promises nothing across builds).
std::int64_t fnv1a(const std::string& s) {
  std::uint64_t h = 14695981039346656037ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return static_cast<std::int64_t>(h);
}

// A path as one signature field: keys may hold any character, so the separators are escaped
// (otherwise keys with tabs and newlines could make two different trees read the same).
std::string path_field(const tree::Path& p) {
  std::string s;
  for (char c : p.describe()) {
    if (c == '\\' || c == '\t' || c == '\n') s += '\\';
    s += c == '\t' ? 't' : c == '\n' ? 'n' : c;
  }
  return s;
}

// One line per leaf, "path\tdtype [shape]": what ranks must agree on.
std::string signature(const std::vector<tree::Path>& paths, const std::vector<at::Tensor>& leaves) {
  std::string s;
  for (std::size_t i = 0; i < leaves.size(); ++i)
    s += path_field(paths[i]) + "\t" + leaf_text(leaves[i]) + "\n";
  return s;
}

std::vector<std::pair<std::string, std::string>> parse_signature(const std::string& s) {
  std::vector<std::pair<std::string, std::string>> out;
  std::istringstream in(s);
  std::string line;
  while (std::getline(in, line)) {
    const auto tab = line.find('\t');
    out.emplace_back(line.substr(0, tab), tab == std::string::npos ? "" : line.substr(tab + 1));
  }
  return out;
}

// The first difference between two ranks' signatures, in words naming the path.
std::string first_difference(int ra, const std::string& a, int rb, const std::string& b) {
  const auto la = parse_signature(a), lb = parse_signature(b);
  for (std::size_t i = 0; i < std::max(la.size(), lb.size()); ++i) {
    if (i >= la.size())
      return "path '" + lb[i].first + "' (" + lb[i].second + ") is on rank " + std::to_string(rb) +
             " but not on rank " + std::to_string(ra);
    if (i >= lb.size())
      return "path '" + la[i].first + "' (" + la[i].second + ") is on rank " + std::to_string(ra) +
             " but not on rank " + std::to_string(rb);
    if (la[i].first != lb[i].first) {
      // Sorted order: the smaller path is the one the other rank lacks.
      const bool a_first = la[i].first < lb[i].first;
      const auto& p = a_first ? la[i] : lb[i];
      return "path '" + p.first + "' (" + p.second + ") is on rank " +
             std::to_string(a_first ? ra : rb) + " but not on rank " +
             std::to_string(a_first ? rb : ra);
    }
    if (la[i].second != lb[i].second)
      return "at path '" + la[i].first + "': rank " + std::to_string(ra) + " has " + la[i].second +
             ", rank " + std::to_string(rb) + " has " + lb[i].second;
  }
  return "the structures hash differently but read the same";
}

std::string key_text(std::int64_t thread, std::int64_t count) {
  return (thread ? "asyncs thread " + std::to_string(thread) : std::string("a non-asyncs thread")) +
         ", its request " + std::to_string(count);
}

// One bucket: (leaf index, element count) of each of its leaves, in flatten order.
using Bucket = std::vector<std::pair<std::size_t, std::int64_t>>;

std::int64_t bucket_numel(const Bucket& items) {
  std::int64_t n = 0;
  for (const auto& it : items) n += it.second;
  return n;
}

// A bucket of one contiguous leaf is communicated as the leaf itself: nothing to copy.
bool is_one_leaf(const std::vector<at::Tensor>& leaves, const Bucket& items) {
  return items.size() == 1 && leaves[items[0].first].is_contiguous();
}

// Copies the bucket's leaves into `buffer` (bucket_numel elements) in order: one call.
void pack(const std::vector<at::Tensor>& leaves, const Bucket& items, at::Tensor buffer) {
  std::vector<at::Tensor> flat;
  for (const auto& it : items) flat.push_back(leaves[it.first].reshape({-1}));
  at::cat_out(buffer, flat);
}

// Copies `buffer`'s pieces back, the piece of leaf i into dest[i] (dest is indexed like the
// leaves; a leaf's piece has its shape).
void unpack(const at::Tensor& buffer, const Bucket& items, const std::vector<at::Tensor>& dest) {
  std::int64_t off = 0;
  for (const auto& [i, numel] : items) {
    dest[i].copy_(buffer.narrow(0, off, numel).view(dest[i].sizes()));
    off += numel;
  }
}

// The dtypes ProcessGroupGloo (1.13) takes for every collective.
bool gloo_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kChar:
    case at::kByte:
    case at::kInt:
    case at::kLong:
      return true;
    default:
      return false;
  }
}

// Whether all_reduce can reduce `t` by `op`: Gloo's dtypes; bool (as uint8, with NCCL's
// meaning: sum and max are "any", product and min "all"); complex by sum (and avg) of its
// real and imaginary parts, as torch.distributed.all_reduce does.
bool reducible(at::ScalarType t, ReduceOp op) {
  if (gloo_dtype(t) || t == at::kBool) return true;
  return at::isComplexType(t) && (op == ReduceOp::sum || op == ReduceOp::avg);
}

// The tensor Gloo gets for the 1-D contiguous `buffer` (a view, so results land in `buffer`):
// Gloo's dtypes as they are; for a reduction bool as uint8 and complex as its real pairs; for
// data movement (broadcast, all_gather) any other dtype as its bytes.
at::Tensor wire(const at::Tensor& buffer, bool reduction) {
  const auto t = buffer.scalar_type();
  if (gloo_dtype(t)) return buffer;
  if (reduction && at::isComplexType(t)) return at::view_as_real(buffer).view({-1});
  return buffer.view(at::kByte);
}

// The c10d reduction for a buffer of dtype `t`.
c10d::ReduceOp wire_op(ReduceOp op, at::ScalarType t) {
  if (t == at::kBool && op == ReduceOp::sum) return to_c10d(ReduceOp::max);
  if (t == at::kBool && op == ReduceOp::product) return to_c10d(ReduceOp::min);
  return to_c10d(op);
}

// Memory extent [first, last] byte of a non-empty CPU tensor (non-negative strides).
std::pair<std::uintptr_t, std::uintptr_t> extent(const at::Tensor& t) {
  std::int64_t last = 0;
  for (auto d : c10::irange(t.dim())) last += (t.size(d) - 1) * std::abs(t.stride(d));
  const auto first = reinterpret_cast<std::uintptr_t>(t.data_ptr());
  return {first, first + static_cast<std::uintptr_t>((last + 1) * t.element_size()) - 1};
}

// Why leaves that a collective writes cannot be written (empty when they can): a leaf with
// elements that share memory (an expanded view), or two leaves that share memory (tied
// weights: a per-leaf loop would reduce the shared memory twice, buckets would race).
std::string write_conflict(const std::vector<tree::Path>& paths,
                           const std::vector<at::Tensor>& leaves) {
  struct Span {
    std::uintptr_t first, last;
    std::size_t leaf;
  };
  std::vector<Span> spans;
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    if (leaves[i].numel() == 0) continue;
    if (at::has_internal_overlap(leaves[i]) == at::MemOverlap::Yes)
      return "path '" + paths[i].describe() +
             "': elements of the leaf share memory (an expanded or stride-0 view); a collective "
             "cannot write it";
    const auto [first, last] = extent(leaves[i]);
    spans.push_back({first, last, i});
  }
  std::sort(spans.begin(), spans.end(),
            [](const Span& a, const Span& b) { return a.first < b.first; });
  // A sweep: each leaf against the one reaching furthest among those that start before it.
  for (std::size_t k = 1, reach = 0; k < spans.size(); ++k) {
    const Span &s = spans[k], &r = spans[reach];
    if (s.first <= r.last) {
      const auto status = at::get_overlap_status(leaves[s.leaf], leaves[r.leaf]);
      if (status == at::MemOverlapStatus::Full || status == at::MemOverlapStatus::Partial)
        return "paths '" + paths[r.leaf].describe() + "' and '" + paths[s.leaf].describe() +
               "' share memory; a collective that writes both would write it twice (pass one)";
    }
    if (s.last > r.last) reach = k;
  }
  return {};
}

}  // namespace

// One tree collective requested on a group.
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
  // Why this rank refused the request (its arguments failed a check; empty: not refused). A
  // refused request still takes its place in the order, with `sig` holding the reason, so that
  // the peers' matching request fails with it instead of pairing with this rank's next one.
  std::string refused;
  std::promise<void> done;
  std::promise<TreeTensor> value;
  std::shared_future<void> done_future{done.get_future().share()};
  std::shared_future<TreeTensor> value_future{value.get_future().share()};

  std::string describe() const {
    std::string s = op_name(op);
    if (op == Op::all_reduce || op == Op::reduce_scatter)
      s += std::string("(") + reduce_name(reduce) + ")";
    if (op == Op::broadcast) s += "(root " + std::to_string(root) + ")";
    return s + " from " + key_text(key_thread, key_count);
  }
};

// The row every rank contributes to the agreement allgather.
enum Field {
  kThread,
  kCount,
  kOp,
  kReduce,
  kRoot,
  kLeaves,
  kNumel,
  kHash,
  kSigLen,
  kBuffers,
  kRefused,
  kRow
};

class Group {
 public:
  Group(c10::intrusive_ptr<c10d::Store> store, int rank, int world, Options opts, bool loopback)
      : rank_(rank), world_(world), opts_(std::move(opts)) {
    if (const char* d = std::getenv("TREETENSOR_DIST_DEBUG"); d && std::string(d) == "1")
      opts_.debug = true;
    auto o = GlooGroup::Options::create(opts_.timeout);
    o->devices.push_back(loopback ? GlooGroup::createDeviceForHostname("127.0.0.1")
                                  : GlooGroup::createDefaultDevice());
    o->threads = 2;
    try {
      pg_ = c10::make_intrusive<GlooGroup>(store, rank, world, o);
    } catch (const std::exception& e) {
      throw CollectiveError(
          std::string("treetensor distributed: cannot create the Gloo group (rank ") +
          std::to_string(rank) + " of " + std::to_string(world) + "): " + e.what());
    }
    comm_ = std::thread([this] { loop(); });
  }

  ~Group() {
    waiter_.reset();  // drains: its jobs wait for requests only the communication thread completes
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    comm_.join();
  }

  int rank() const { return rank_; }
  int world() const { return world_; }
  const Options& options() const { return opts_; }
  std::uint64_t sequence() const { return seq_.load(); }

  // The asyncs thread whose jobs stand for this group's queued collectives (made on first use).
  asyncs::Thread& waiter() {
    std::call_once(waiter_once_,
                   [this] { waiter_ = std::make_unique<asyncs::Thread>("distributed-wait"); });
    return *waiter_;
  }

  // Completes `r` with `e` unless it is completed already.
  static void fail(Request& r, const std::exception_ptr& e) {
    try {
      r.done.set_exception(e);
    } catch (const std::future_error&) {
    }
    try {
      r.value.set_exception(e);
    } catch (const std::future_error&) {
    }
  }

  std::shared_ptr<Request> submit(std::shared_ptr<Request> r) {
    {
      std::lock_guard<std::mutex> l(mu_);
      if (broken_) std::rethrow_exception(broken_);
      r->key_thread = asyncs::current_thread_id().value_or(0);
      r->key_count = ++counters_[r->key_thread];
      pending_.push_back(r);
    }
    cv_.notify_all();
    return r;
  }

  // ---- point to point (not ordered with the collectives; see send()) -----------------------
  int next_tag(bool sending, int peer) {
    std::lock_guard<std::mutex> l(mu_);
    if (broken_) std::rethrow_exception(broken_);
    auto& c = sending ? send_count_[peer] : recv_count_[peer];
    return static_cast<int>((c++ * 4) & 0x3fffffff);
  }
  void wait(const WorkPtr& w, const std::string& what) {
    try {
      w->wait(opts_.timeout);
    } catch (const std::exception& e) {
      throw CollectiveError("treetensor distributed: rank " + std::to_string(rank_) + ": " + what +
                            " failed: " + e.what());
    }
  }
  void plain_all_reduce(const at::Tensor& t) {
    {
      std::lock_guard<std::mutex> l(mu_);
      if (broken_) std::rethrow_exception(broken_);
    }
    std::vector<at::Tensor> v{t};
    wait(pg_->allreduce(v), "allreduce");
  }
  void p2p_send(at::Tensor t, int peer, int tag, const std::string& what) {
    std::vector<at::Tensor> v{std::move(t)};
    wait(pg_->send(v, peer, tag), what);
  }
  void p2p_recv(at::Tensor t, int peer, int tag, const std::string& what) {
    std::vector<at::Tensor> v{std::move(t)};
    wait(pg_->recv(v, peer, tag), what);
  }

  std::vector<Bucket> buckets(const std::vector<at::Tensor>& leaves) const;

 private:
  void loop();
  void round(const std::shared_ptr<Request>& mine);
  std::vector<std::array<std::int64_t, kRow>> gather_rows(
      const std::array<std::int64_t, kRow>& row);
  std::vector<std::string> gather_strings(const std::string& mine, std::int64_t max_len);
  std::shared_ptr<Request> wait_for(std::int64_t thread, std::int64_t count);
  void execute(Request& r, std::uint64_t seq);
  // all_reduce / broadcast of `leaves` in place, packed into buckets.
  void reduce_buckets(Request& r, std::uint64_t seq, const std::vector<at::Tensor>& leaves);
  // The same over r.buffers (a consolidated tree): one collective per buffer, no copies.
  void reduce_buffers(Request& r, std::uint64_t seq);
  // Starts r's all_reduce or broadcast of the 1-D tensor `buffer`, in place.
  WorkPtr start(const Request& r, const at::Tensor& buffer);
  // A bucket's flat buffer, reused from the last collective that had a bucket b of this dtype
  // and size (a fresh 25 MiB buffer costs its page faults on every call). Only the
  // communication thread uses buckets; a buffer is free again once its collective has been
  // waited for and copied out, before the next round.
  at::Tensor bucket_buffer(std::size_t b, std::int64_t n, const at::TensorOptions& o) {
    const auto key = std::make_tuple(b, static_cast<int>(o.dtype().toScalarType()), n);
    if (auto it = buffers_.find(key); it != buffers_.end()) return it->second;
    at::Tensor t = at::empty({n}, o);
    const std::int64_t bytes = n * static_cast<std::int64_t>(t.element_size());
    if (buffered_bytes_ + bytes > (std::int64_t{256} << 20)) {  // sizes that keep changing
      buffers_.clear();
      buffered_bytes_ = 0;
    }
    buffered_bytes_ += bytes;
    return buffers_[key] = t;
  }
  void check_bucket(std::uint64_t seq, std::size_t b, const at::Tensor& buffer,
                    const std::string& first_path);

  std::array<std::int64_t, kRow> row_of(const Request* r, std::int64_t thread,
                                        std::int64_t count) const {
    std::array<std::int64_t, kRow> row{};
    row[kThread] = thread;
    row[kCount] = count;
    if (!r) return row;  // op 0: this rank has no such request
    row[kOp] = static_cast<std::int64_t>(r->op);
    row[kReduce] = static_cast<std::int64_t>(r->reduce);
    row[kRoot] = r->root;
    row[kLeaves] = static_cast<std::int64_t>(r->leaves.size());
    row[kNumel] = r->numel;
    row[kHash] = r->hash;
    row[kSigLen] = static_cast<std::int64_t>(r->sig.size());
    row[kBuffers] = r->buffers_hash;
    row[kRefused] = r->refused.empty() ? 0 : 1;
    return row;
  }

  int rank_, world_;
  Options opts_;
  c10::intrusive_ptr<GlooGroup> pg_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Request>> pending_;
  std::map<std::int64_t, std::int64_t> counters_;
  std::map<int, std::int64_t> send_count_, recv_count_;
  std::exception_ptr broken_;
  bool stop_ = false;
  std::atomic<std::uint64_t> seq_{0};
  std::shared_ptr<Request> current_;  // the request of the running round (comm thread only)
  std::map<std::tuple<std::size_t, int, std::int64_t>, at::Tensor> buffers_;  // comm thread only
  std::int64_t buffered_bytes_ = 0;
  std::thread comm_;
  std::once_flag waiter_once_;
  std::unique_ptr<asyncs::Thread> waiter_;  // destroyed first (see ~Group)
};

void Group::loop() {
  // Collectives write leaves that may require grad, as torch.distributed does (outside autograd).
  at::NoGradGuard no_grad;
  for (;;) {
    std::shared_ptr<Request> mine;
    {
      std::unique_lock<std::mutex> l(mu_);
      cv_.wait(l, [&] { return stop_ || !pending_.empty(); });
      if (pending_.empty()) return;
      mine = pending_.front();
    }
    try {
      round(mine);
      current_.reset();
    } catch (...) {
      // A backend failure or a missing request: the ranks may no longer agree on what comes
      // next, so the group is broken and every pending and later request gets the error.
      std::deque<std::shared_ptr<Request>> failed;
      {
        std::lock_guard<std::mutex> l(mu_);
        broken_ = std::current_exception();
        failed.swap(pending_);
      }
      // The request of this round may have left the queue already (round() took it).
      failed.push_back(mine);
      if (current_) failed.push_back(current_);
      current_.reset();
      for (auto& r : failed) fail(*r, broken_);
    }
  }
}

std::vector<std::array<std::int64_t, kRow>> Group::gather_rows(
    const std::array<std::int64_t, kRow>& row) {
  at::Tensor in = at::empty({kRow}, at::kLong);
  std::copy(row.begin(), row.end(), in.data_ptr<std::int64_t>());
  std::vector<std::vector<at::Tensor>> out(1);
  for (int r = 0; r < world_; ++r) out[0].push_back(at::empty({kRow}, at::kLong));
  std::vector<at::Tensor> ins{in};
  wait(pg_->allgather(out, ins),
       "the agreement allgather of collective #" + std::to_string(seq_.load()));
  std::vector<std::array<std::int64_t, kRow>> rows(world_);
  for (int r = 0; r < world_; ++r)
    std::copy_n(out[0][r].data_ptr<std::int64_t>(), kRow, rows[r].begin());
  return rows;
}

std::vector<std::string> Group::gather_strings(const std::string& mine, std::int64_t max_len) {
  at::Tensor in = at::zeros({std::max<std::int64_t>(max_len, 1)}, at::kByte);
  std::copy(mine.begin(), mine.end(), in.data_ptr<std::uint8_t>());
  std::vector<std::vector<at::Tensor>> out(1);
  for (int r = 0; r < world_; ++r) out[0].push_back(at::empty_like(in));
  std::vector<at::Tensor> ins{in};
  wait(pg_->allgather(out, ins), "the structure allgather");
  std::vector<std::string> s(world_);
  for (int r = 0; r < world_; ++r) {
    const auto* p = reinterpret_cast<const char*>(out[0][r].data_ptr<std::uint8_t>());
    s[r] = std::string(p, strnlen(p, static_cast<std::size_t>(in.numel())));
  }
  return s;
}

std::shared_ptr<Request> Group::wait_for(std::int64_t thread, std::int64_t count) {
  std::unique_lock<std::mutex> l(mu_);
  std::shared_ptr<Request> found;
  // Half the timeout: the peers wait in the second agreement allgather meanwhile, and must get
  // this rank's "no such request" row before their own collective timeout ends it.
  cv_.wait_for(l, opts_.timeout / 2, [&] {
    for (auto& r : pending_)
      if (r->key_thread == thread && r->key_count == count) return (found = r) != nullptr;
    return false;
  });
  return found;
}

void Group::round(const std::shared_ptr<Request>& mine) {
  auto rows = gather_rows(row_of(mine.get(), mine->key_thread, mine->key_count));
  const std::int64_t kt = rows[0][kThread], kc = rows[0][kCount];
  std::shared_ptr<Request> cur = mine;
  bool agree = true;
  for (const auto& row : rows) agree = agree && row[kThread] == kt && row[kCount] == kc;
  if (!agree) {
    // Rank 0's oldest request goes first: the others find theirs (it may not be asked yet).
    if (mine->key_thread != kt || mine->key_count != kc) cur = wait_for(kt, kc);
    rows = gather_rows(row_of(cur.get(), kt, kc));
  }
  if (cur) {
    std::lock_guard<std::mutex> l(mu_);
    pending_.erase(std::find(pending_.begin(), pending_.end(), cur));
  }
  current_ = cur;  // failed by loop() if this round throws
  const std::uint64_t seq = seq_.fetch_add(1);
  const std::string where = "treetensor distributed: collective #" + std::to_string(seq) + " (" +
                            (key_text(kt, kc)) + "): ";
  for (int r = 0; r < world_; ++r)
    if (rows[r][kOp] == 0)
      // Every rank sees this row: all throw, and the group is broken (loop()).
      throw CollectiveMismatch(
          where + "rank " + std::to_string(r) + " made no such request within " +
          std::to_string((opts_.timeout / 2).count()) + " ms (half the timeout)");
  std::int64_t max_sig = 0;
  for (int r = 0; r < world_; ++r) max_sig = std::max(max_sig, rows[r][kSigLen]);
  for (int r = 0; r < world_; ++r) {
    if (!rows[r][kRefused]) continue;
    // No data moves and the group stays usable: the refusing rank has thrown its
    // invalid_argument already; the others learn why.
    const auto reasons = gather_strings(cur->sig, max_sig);
    auto e = cur->refused.empty()
                 ? std::make_exception_ptr(CollectiveMismatch(where + "rank " + std::to_string(r) +
                                                              " refused it: " + reasons[r]))
                 : std::make_exception_ptr(std::invalid_argument(cur->refused));
    cur->done.set_exception(e);
    cur->value.set_exception(e);
    return;
  }
  std::string mismatch;
  for (int r = 1; r < world_ && mismatch.empty(); ++r) {
    const auto &a = rows[0], &b = rows[r];
    auto describe = [&](const std::array<std::int64_t, kRow>& x) {
      Request tmp;
      tmp.op = static_cast<Op>(x[kOp]);
      tmp.reduce = static_cast<ReduceOp>(x[kReduce]);
      tmp.root = x[kRoot];
      std::string s = op_name(tmp.op);
      if (tmp.op == Op::all_reduce || tmp.op == Op::reduce_scatter)
        s += std::string("(") + reduce_name(tmp.reduce) + ")";
      if (tmp.op == Op::broadcast) s += "(root " + std::to_string(tmp.root) + ")";
      return s;
    };
    if (a[kOp] != b[kOp] || a[kReduce] != b[kReduce] || a[kRoot] != b[kRoot])
      mismatch =
          "rank 0 issued " + describe(a) + ", rank " + std::to_string(r) + " issued " + describe(b);
    else if (a[kLeaves] != b[kLeaves] || a[kNumel] != b[kNumel] || a[kHash] != b[kHash]) {
      const auto sigs = gather_strings(cur->sig, max_sig);
      mismatch = first_difference(0, sigs[0], r, sigs[r]);
    }
  }
  if (!mismatch.empty()) {
    // Every rank compared the same rows, so every rank fails this request; the group is fine.
    auto e = std::make_exception_ptr(CollectiveMismatch(where + mismatch));
    cur->done.set_exception(e);
    cur->value.set_exception(e);
    return;
  }
  // Every rank's tree is consolidated with the same buffers, or every rank packs buckets.
  cur->use_buffers = true;
  for (int r = 0; r < world_; ++r)
    cur->use_buffers =
        cur->use_buffers && rows[r][kBuffers] != 0 && rows[r][kBuffers] == rows[0][kBuffers];
  try {
    execute(*cur, seq);
  } catch (const CollectiveMismatch&) {
    auto e = std::current_exception();
    cur->done.set_exception(e);
    cur->value.set_exception(e);
    throw;
  } catch (const std::exception& e) {
    auto ep = std::make_exception_ptr(CollectiveError(where + e.what()));
    cur->done.set_exception(ep);
    cur->value.set_exception(ep);
    std::rethrow_exception(ep);
  }
}

std::vector<Bucket> Group::buckets(const std::vector<at::Tensor>& leaves) const {
  // Per (dtype, device) group in flatten order: DDP's limits, the first bucket of each group
  // small so that its communication could start early.
  struct Open {
    Bucket items;
    std::int64_t bytes = 0;
    bool first = true;
  };
  std::map<std::pair<int, std::string>, Open> open;
  std::vector<Bucket> closed;
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    const auto& t = leaves[i];
    if (t.numel() == 0) continue;
    auto& o = open[{static_cast<int>(t.scalar_type()), t.device().str()}];
    const std::int64_t bytes = t.numel() * static_cast<std::int64_t>(t.element_size());
    const std::int64_t cap = o.first ? opts_.first_bucket_bytes : opts_.bucket_bytes;
    if (!o.items.empty() && o.bytes + bytes > cap) {
      closed.push_back(std::move(o.items));
      o.items.clear();
      o.bytes = 0;
      o.first = false;
    }
    o.items.emplace_back(i, t.numel());
    o.bytes += bytes;
  }
  for (auto& [k, o] : open)
    if (!o.items.empty()) closed.push_back(std::move(o.items));
  std::sort(closed.begin(), closed.end(),
            [](const auto& a, const auto& b) { return a[0].first < b[0].first; });
  return closed;
}

void Group::check_bucket(std::uint64_t seq, std::size_t b, const at::Tensor& buffer,
                         const std::string& first_path) {
  std::array<std::int64_t, kRow> row{};
  row[kThread] = static_cast<std::int64_t>(seq);
  row[kCount] = static_cast<std::int64_t>(b);
  row[kOp] = static_cast<std::int64_t>(buffer.scalar_type());
  row[kNumel] = buffer.numel();
  const auto rows = gather_rows(row);
  for (int r = 1; r < world_; ++r)
    if (rows[r] != rows[0])
      throw CollectiveMismatch(
          "debug check: bucket " + std::to_string(b) + " (from path '" + first_path +
          "'): rank 0 has (sequence " + std::to_string(rows[0][kThread]) + ", bucket " +
          std::to_string(rows[0][kCount]) + ", " +
          dtype_text(static_cast<at::ScalarType>(rows[0][kOp])) + ", " +
          std::to_string(rows[0][kNumel]) + " elements), rank " + std::to_string(r) +
          " has (sequence " + std::to_string(rows[r][kThread]) + ", bucket " +
          std::to_string(rows[r][kCount]) + ", " +
          dtype_text(static_cast<at::ScalarType>(rows[r][kOp])) + ", " +
          std::to_string(rows[r][kNumel]) + " elements)");
}

WorkPtr Group::start(const Request& r, const at::Tensor& buffer) {
  const bool reduction = r.op != Op::broadcast;
  std::vector<at::Tensor> v{wire(buffer, reduction)};
  if (!reduction) {
    c10d::BroadcastOptions o;
    o.rootRank = r.root;
    return pg_->broadcast(v, o);
  }
  c10d::AllreduceOptions o;
  o.reduceOp = wire_op(r.reduce, buffer.scalar_type());
  return pg_->allreduce(v, o);
}

// The padding between leaves is reduced too (it belongs to no leaf; its values do not matter).
void Group::reduce_buffers(Request& r, std::uint64_t seq) {
  std::vector<WorkPtr> works;
  for (std::size_t b = 0; b < r.buffers.size(); ++b) {
    if (opts_.debug) check_bucket(seq, b, r.buffers[b], "consolidated buffer");
    works.push_back(start(r, r.buffers[b]));
  }
  for (std::size_t b = 0; b < r.buffers.size(); ++b) {
    wait(works[b], std::string(op_name(r.op)) + " of consolidated buffer " + std::to_string(b));
    if (r.reduce == ReduceOp::avg && r.op != Op::broadcast) r.buffers[b].div_(world_);
  }
}

// all_reduce / broadcast over buckets: pack a bucket, issue it, pack the next...; then wait
// and copy back in order.
void Group::reduce_buckets(Request& r, std::uint64_t seq, const std::vector<at::Tensor>& leaves) {
  const auto plan = buckets(leaves);
  std::vector<at::Tensor> buffers;
  std::vector<WorkPtr> works;
  for (std::size_t b = 0; b < plan.size(); ++b) {
    const auto& items = plan[b];
    at::Tensor buffer;
    if (is_one_leaf(leaves, items)) {
      buffer = leaves[items[0].first].view({-1});
    } else {
      buffer = bucket_buffer(b, bucket_numel(items), leaves[items[0].first].options());
      pack(leaves, items, buffer);
    }
    if (opts_.debug) check_bucket(seq, b, buffer, r.paths[items[0].first].describe());
    works.push_back(start(r, buffer));
    buffers.push_back(buffer);
  }
  for (std::size_t b = 0; b < plan.size(); ++b) {
    wait(works[b], std::string(op_name(r.op)) + " of bucket " + std::to_string(b));
    if (r.reduce == ReduceOp::avg && r.op != Op::broadcast) buffers[b].div_(world_);
    if (!is_one_leaf(leaves, plan[b])) unpack(buffers[b], plan[b], leaves);
  }
}

void Group::execute(Request& r, std::uint64_t seq) {
  switch (r.op) {
    case Op::missing:
    case Op::barrier:
      r.done.set_value();
      r.value.set_value({});
      return;
    case Op::all_reduce:
    case Op::broadcast:
      if (r.use_buffers)
        reduce_buffers(r, seq);
      else
        reduce_buckets(r, seq, r.leaves);
      r.done.set_value();
      r.value.set_value({});
      return;
    case Op::reduce_scatter: {
      std::vector<at::Tensor> copies;
      for (const auto& t : r.leaves) copies.push_back(t.clone(at::MemoryFormat::Contiguous));
      reduce_buckets(r, seq, copies);
      std::vector<at::Tensor> out;
      for (auto& c : copies) {
        const std::int64_t chunk = c.size(0) / world_;
        out.push_back(c.narrow(0, rank_ * chunk, chunk));
      }
      r.value.set_value(TreeTensor(tree::unflatten(r.spec, std::move(out))));
      r.done.set_value();
      return;
    }
    case Op::all_gather: {
      const auto plan = buckets(r.leaves);
      std::vector<at::Tensor> out;
      for (const auto& t : r.leaves) {
        std::vector<std::int64_t> shape{world_};
        shape.insert(shape.end(), t.sizes().begin(), t.sizes().end());
        out.push_back(at::empty(shape, t.options()));
      }
      std::vector<std::vector<std::vector<at::Tensor>>> outputs;
      std::vector<WorkPtr> works;
      for (std::size_t b = 0; b < plan.size(); ++b) {
        const auto& items = plan[b];
        at::Tensor in;
        if (is_one_leaf(r.leaves, items)) {
          in = r.leaves[items[0].first].view({-1});
        } else {
          in = at::empty({bucket_numel(items)}, r.leaves[items[0].first].options());
          pack(r.leaves, items, in);
        }
        if (opts_.debug) check_bucket(seq, b, in, r.paths[items[0].first].describe());
        std::vector<at::Tensor> ins{wire(in, false)};
        outputs.emplace_back(1);
        for (int k = 0; k < world_; ++k) outputs.back()[0].push_back(at::empty_like(ins[0]));
        works.push_back(pg_->allgather(outputs.back(), ins));
      }
      std::vector<at::Tensor> row(out.size());
      for (std::size_t b = 0; b < plan.size(); ++b) {
        wait(works[b], "all_gather of bucket " + std::to_string(b));
        for (int k = 0; k < world_; ++k) {
          for (const auto& it : plan[b]) row[it.first] = out[it.first][k];
          unpack(outputs[b][0][k].view(r.leaves[plan[b][0].first].scalar_type()), plan[b], row);
        }
      }
      r.value.set_value(TreeTensor(tree::unflatten(r.spec, std::move(out))));
      r.done.set_value();
      return;
    }
  }
}

}  // namespace detail

namespace {

using detail::Op;
using detail::Request;

int env_int(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v)
    throw std::invalid_argument(
        std::string("treetensor distributed: environment variable ") + name +
        " is not set (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)");
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (*end || x < 0 || x > 65535 * 16)
    throw std::invalid_argument(std::string("treetensor distributed: environment variable ") +
                                name + "='" + v + "' is not a non-negative integer");
  return static_cast<int>(x);
}

void check_rank(int rank, int world) {
  if (world < 1 || rank < 0 || rank >= world)
    throw std::invalid_argument("treetensor distributed: rank " + std::to_string(rank) +
                                " is outside [0, world size " + std::to_string(world) + ")");
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
    if (!x.device().is_cpu())
      return at() + "the leaf is on " + x.device().str() + "; the Gloo backend takes CPU tensors";
    const auto t = x.scalar_type();
    if (reduction && r.reduce == ReduceOp::avg && !at::isFloatingType(t) && !at::isComplexType(t))
      return at() + "ReduceOp::avg needs a floating dtype, the leaf is " + detail::dtype_text(t);
    if (reduction && !detail::reducible(t, r.reduce))
      return at() + "Gloo cannot reduce " + detail::dtype_text(t) + " by " +
             detail::reduce_name(r.reduce) +
             " (it reduces float32, float64, float16, int8, uint8, int32, int64 and bool; "
             "complex by sum and avg)";
    if (r.op == Op::reduce_scatter && (x.dim() == 0 || x.size(0) % world != 0))
      return at() + "reduce_scatter splits dim 0 into " + std::to_string(world) +
             " equal chunks; the leaf is " + detail::leaf_text(x);
  }
  if (r.op == Op::all_reduce || r.op == Op::broadcast)
    if (auto why = detail::write_conflict(r.paths, r.leaves); !why.empty())
      return "treetensor distributed: " + op + " at " + why;
  return {};
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
  if (!r->refused.empty()) {
    const std::string why = r->refused;
    r->leaves.clear();
    r->sig = why;
    try {
      g.impl().submit(std::move(r));
    } catch (const std::exception&) {  // a broken group: the arguments are still the error
    }
    throw std::invalid_argument(why);
  }
  // Pending asyncs work on the leaves finishes first, as before any tree call (DESIGN.md §10).
  if (asyncs::tracking_active()) {
    const bool writes = op == Op::all_reduce || op == Op::broadcast;
    asyncs::await_operands(writes ? c10::ArrayRef<at::Tensor>() : r->leaves,
                           writes ? r->leaves : c10::ArrayRef<at::Tensor>());
  }
  for (const auto& x : r->leaves) r->numel += x.numel();
  r->sig = detail::signature(r->paths, r->leaves);
  r->hash = detail::fnv1a(r->sig);
  if (const auto* c = consolidated_source(t); c && (op == Op::all_reduce || op == Op::broadcast)) {
    // Equal signatures can still lie differently (a comparison's bool result keeps its float
    // operands' offsets), so the offsets are hashed too.
    std::string text;
    for (const auto& b : c->buffers())
      text += detail::dtype_text(b.scalar_type()) + " " + std::to_string(b.numel()) + "\n";
    for (std::size_t i = 0; i < c->layout().leaves(); ++i)
      text += std::to_string(c->layout().offset(i)) + " ";
    r->buffers = c->buffers();
    r->buffers_hash = detail::fnv1a(text) | 1;  // never 0 (0: not consolidated)
  }
  return g.impl().submit(std::move(r));
}

}  // namespace

ProcessGroup ProcessGroup::with_file_store(const std::string& path, int rank, int world_size,
                                           Options options) {
  check_rank(rank, world_size);
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::FileStore>(path, world_size);
    store->setTimeout(options.timeout);
  } catch (const std::exception& e) {
    throw CollectiveError("treetensor distributed: cannot open the FileStore '" + path +
                          "': " + e.what());
  }
  return from_impl(std::make_shared<detail::Group>(store, rank, world_size, options, true));
}

namespace {

// A TCPStore client or server; under torchrun's agent (TORCHELASTIC_USE_AGENT_STORE=True) the
// agent already serves MASTER_PORT, so every rank is a client, behind the prefix
// torch.distributed uses there ("/worker/attempt_<TORCHELASTIC_RESTART_COUNT>").
ProcessGroup make_tcp_group(const std::string& host, int port, int rank, int world_size,
                            const Options& options, bool agent_store) {
  check_rank(rank, world_size);
  if (port <= 0 || port > 65535)
    throw std::invalid_argument("treetensor distributed: port " + std::to_string(port) +
                                " is outside 1..65535");
  c10::intrusive_ptr<c10d::Store> store;
  try {
    c10d::TCPStoreOptions o;
    o.port = static_cast<std::uint16_t>(port);
    o.isServer = rank == 0 && !agent_store;
    o.numWorkers = agent_store ? c10::nullopt : c10::optional<std::size_t>(world_size);
    o.waitWorkers = !agent_store;
    o.timeout = options.timeout;
    store = c10::make_intrusive<c10d::TCPStore>(host, o);
    if (agent_store) {
      const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
      store = c10::make_intrusive<c10d::PrefixStore>(
          std::string("/worker/attempt_") + (attempt ? attempt : "0"), store);
    }
  } catch (const std::exception& e) {
    throw CollectiveError("treetensor distributed: cannot reach the TCPStore at " + host + ":" +
                          std::to_string(port) + " (rank " + std::to_string(rank) +
                          "): " + e.what());
  }
  const bool loopback = host == "localhost" || host.rfind("127.", 0) == 0;
  return ProcessGroup::from_impl(
      std::make_shared<detail::Group>(store, rank, world_size, options, loopback));
}

}  // namespace

ProcessGroup ProcessGroup::with_tcp_store(const std::string& host, int port, int rank,
                                          int world_size, Options options) {
  return make_tcp_group(host, port, rank, world_size, options, false);
}

ProcessGroup ProcessGroup::from_env(Options options) {
  const int rank = env_int("RANK"), world = env_int("WORLD_SIZE"), port = env_int("MASTER_PORT");
  const char* addr = std::getenv("MASTER_ADDR");
  if (!addr || !*addr)
    throw std::invalid_argument(
        "treetensor distributed: environment variable MASTER_ADDR is not set");
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  return make_tcp_group(addr, port, rank, world, options, agent && std::string(agent) == "True");
}

int ProcessGroup::rank() const {
  return impl_->rank();
}
int ProcessGroup::world_size() const {
  return impl_->world();
}
const Options& ProcessGroup::options() const {
  return impl_->options();
}
std::uint64_t ProcessGroup::sequence() const {
  return impl_->sequence();
}

int local_rank() {
  const char* v = std::getenv("LOCAL_RANK");
  return v && *v ? std::atoi(v) : 0;
}

namespace {
// A queued request as an asyncs job on the group's waiting thread, with the tree's leaves as
// its operands (DESIGN.md §10): later tree calls on them wait for the collective. The request
// (and its key) was made on the caller's thread, so the order across ranks is the caller's.
template <class F>
auto tracked(const ProcessGroup& g, const TensorTree& t, bool writes, F&& wait, const char* op) {
  const std::vector<at::Tensor> leaves = tree::flatten(t).leaves;
  const c10::ArrayRef<at::Tensor> none;
  return g.impl().waiter().submit(std::forward<F>(wait), writes ? none : leaves,
                                  writes ? leaves : none, op);
}
}  // namespace

asyncs::Future<void> all_reduce_async(const ProcessGroup& g, const TensorTree& t, ReduceOp op) {
  auto done = make_request(g, Op::all_reduce, t, op, -1)->done_future;
  return tracked(
      g, t, true, [done] { done.get(); }, "all_reduce");
}
void all_reduce(const ProcessGroup& g, const TensorTree& t, ReduceOp op) {
  make_request(g, Op::all_reduce, t, op, -1)->done_future.get();
}

asyncs::Future<void> broadcast_async(const ProcessGroup& g, const TensorTree& t, int root) {
  auto done = make_request(g, Op::broadcast, t, ReduceOp::sum, root)->done_future;
  return tracked(
      g, t, true, [done] { done.get(); }, "broadcast");
}
void broadcast(const ProcessGroup& g, const TensorTree& t, int root) {
  make_request(g, Op::broadcast, t, ReduceOp::sum, root)->done_future.get();
}

asyncs::Future<TreeTensor> all_gather_async(const ProcessGroup& g, const TensorTree& t) {
  auto value = make_request(g, Op::all_gather, t, ReduceOp::sum, -1)->value_future;
  return tracked(
      g, t, false, [value] { return value.get(); }, "all_gather");
}
TreeTensor all_gather(const ProcessGroup& g, const TensorTree& t) {
  return make_request(g, Op::all_gather, t, ReduceOp::sum, -1)->value_future.get();
}

TreeTensor reduce_scatter(const ProcessGroup& g, const TensorTree& t, ReduceOp op) {
  return make_request(g, Op::reduce_scatter, t, op, -1)->value_future.get();
}

void all_reduce_each(const ProcessGroup& g, const std::vector<at::Tensor>& tensors) {
  for (std::size_t i = 0; i < tensors.size(); ++i)
    if (!tensors[i].is_contiguous() || !tensors[i].device().is_cpu())
      throw std::invalid_argument("treetensor distributed: all_reduce_each: tensor " +
                                  std::to_string(i) + " must be a contiguous CPU tensor");
  for (const auto& t : tensors) g.impl().plain_all_reduce(t);
}

void barrier(const ProcessGroup& g) {
  make_request(g, Op::barrier, TensorTree{}, ReduceOp::sum, -1)->done_future.get();
}

// send/recv: header [signature length, hash], the signature, the receiver's verdict
// [0 = agree / its signature length], then (if agreed) one message per bucket. A side that
// refuses its arguments still answers in this exchange, with a negative length and the reason
// in place of the signature, so that its peer fails with the reason instead of waiting.
namespace {

// Why this rank cannot send or receive `leaves` (empty when it can).
std::string p2p_refusal(const char* op, const std::vector<tree::Path>& paths,
                        const std::vector<at::Tensor>& leaves) {
  for (std::size_t i = 0; i < leaves.size(); ++i)
    if (!leaves[i].defined() || !leaves[i].device().is_cpu())
      return std::string("treetensor distributed: ") + op + " at path '" + paths[i].describe() +
             "': the leaf must be a defined CPU tensor";
  if (std::string(op) == "recv")
    if (auto why = detail::write_conflict(paths, leaves); !why.empty())
      return "treetensor distributed: recv at " + why;
  return {};
}

void check_peer(const ProcessGroup& g, int peer, const char* op) {
  check_rank(peer, g.world_size());
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
