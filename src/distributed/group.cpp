#include "distributed/group.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "distributed/nccl.hpp"

#ifndef USE_C10D_GLOO
#error "treetensor's distributed layer needs c10d's Gloo backend (define USE_C10D_GLOO)"
#endif

namespace treetensor::distributed::detail {

void check_rank(int rank, int world) {
  if (world < 1 || rank < 0 || rank >= world)
    throw std::invalid_argument("treetensor distributed: rank " + std::to_string(rank) +
                                " is outside [0, world size " + std::to_string(world) + ")");
}

std::string error_text(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  const std::string m = e.what();
  return m.substr(0, m.find('\n'));
}

namespace {

// A second process claiming this rank would meet the others in Gloo's rendezvous, where it
// waits for a pairing that never comes (several timeouts long): count the claims in the store
// first, so that it fails at once. One group per store, as for Gloo's own keys.
void claim_rank(c10d::Store& store, int rank, int world) {
  const std::string who = "rank " + std::to_string(rank) + " of " + std::to_string(world);
  std::int64_t claims = 0;
  try {
    claims = store.add("treetensor/claims/rank_" + std::to_string(rank), 1);
  } catch (const std::exception& e) {
    throw CollectiveError("treetensor distributed: " + who +
                          ": cannot reach the store: " + error_text(e));
  }
  if (claims > 1)
    throw CollectiveError("treetensor distributed: rank " + std::to_string(rank) +
                          " is claimed twice: another process joined the group as " + who +
                          " first (each process needs its own RANK)");
}

// Completes `r` with `e` unless it is completed already.
void fail(Request& r, const std::exception_ptr& e) {
  try {
    r.done.set_exception(e);
  } catch (const std::future_error&) {
  }
  try {
    r.value.set_exception(e);
  } catch (const std::future_error&) {
  }
}

std::int64_t max_sig_len(const std::vector<Row>& rows) {
  std::int64_t n = 0;
  for (const auto& row : rows) n = std::max(n, row[kSigLen]);
  return n;
}

}  // namespace

Group::Group(c10::intrusive_ptr<c10d::Store> store, int rank, int world, Options opts,
             bool loopback)
    : rank_(rank), world_(world), opts_(std::move(opts)), store_(std::move(store)) {
  using Gloo = c10d::ProcessGroupGloo;
  if (const char* d = std::getenv("TREETENSOR_DIST_DEBUG"); d && std::string(d) == "1")
    opts_.debug = true;
  auto o = Gloo::Options::create(opts_.timeout);
  o->devices.push_back(loopback ? Gloo::createDeviceForHostname("127.0.0.1")
                                : Gloo::createDefaultDevice());
  o->threads = 2;
  claim_rank(*store_, rank, world);
  try {
    gloo_ = c10::make_intrusive<Gloo>(store_, rank, world, o);
  } catch (const std::exception& e) {
    throw CollectiveError(
        std::string("treetensor distributed: cannot create the Gloo group (rank ") +
        std::to_string(rank) + " of " + std::to_string(world) + "): " + error_text(e));
  }
  comm_ = std::thread([this] { loop(); });
}

Group::~Group() {
  waiter_.reset();  // drains: its jobs wait for requests only the communication thread completes
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  comm_.join();
  if (!nccl_) return;
  try {
    // NCCL's normal exit waits for its kernels; a broken group's peers may never run theirs.
    broken_ ? nccl_->abort() : nccl_->shutdown();
  } catch (const std::exception& e) {  // nobody is left to take it
    std::fprintf(stderr, "treetensor distributed: rank %d: closing NCCL: %s\n", rank_, e.what());
  }
}

asyncs::Thread& Group::waiter() {
  std::call_once(waiter_once_,
                 [this] { waiter_ = std::make_unique<asyncs::Thread>("distributed-wait"); });
  return *waiter_;
}

std::shared_ptr<Request> Group::submit(std::shared_ptr<Request> r) {
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

void Group::check_usable() {
  std::lock_guard<std::mutex> l(mu_);
  if (broken_) std::rethrow_exception(broken_);
}

int Group::next_tag(bool sending, int peer) {
  std::lock_guard<std::mutex> l(mu_);
  if (broken_) std::rethrow_exception(broken_);
  auto& c = sending ? send_count_[peer] : recv_count_[peer];
  return static_cast<int>((c++ * 4) & 0x3fffffff);
}

void Group::wait(const WorkPtr& w, const std::string& what, const at::Tensor& buffer) {
  try {
    if (buffer.defined() && buffer.is_cuda())
      w->wait();
    else
      w->wait(opts_.timeout);
  } catch (const std::exception& e) {
    fail_with(what, e);
  }
}

WorkPtr Group::issue(const std::string& what, c10::function_ref<WorkPtr()> start) {
  try {
    return start();
  } catch (const std::exception& e) {
    fail_with(what, e);
  }
}

void Group::fail_with(const std::string& what, const std::exception& e) const {
  throw CollectiveError("treetensor distributed: rank " + std::to_string(rank_) + ": " + what +
                        " failed: " + error_text(e));
}

void Group::plain_all_reduce(const at::Tensor& t) {
  check_usable();
  std::vector<at::Tensor> v{t};
  wait(issue("allreduce", [&] { return gloo_->allreduce(v); }), "allreduce");
}

void Group::p2p_send(at::Tensor t, int peer, int tag, const std::string& what) {
  std::vector<at::Tensor> v{std::move(t)};
  wait(issue(what, [&] { return gloo_->send(v, peer, tag); }), what);
}

void Group::p2p_recv(at::Tensor t, int peer, int tag, const std::string& what) {
  std::vector<at::Tensor> v{std::move(t)};
  wait(issue(what, [&] { return gloo_->recv(v, peer, tag); }), what);
}

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
      break_group(mine);
    }
  }
}

// A backend failure or a missing request: the ranks may no longer agree on what comes next, so
// the group is broken and every pending and later request gets the error.
void Group::break_group(const std::shared_ptr<Request>& mine) {
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

Row Group::row_of(const Request* r, std::int64_t thread, std::int64_t count) const {
  Row row{};
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

std::vector<Row> Group::gather_rows(const Row& row) {
  at::Tensor in = at::empty({kRow}, at::kLong);
  std::copy(row.begin(), row.end(), in.data_ptr<std::int64_t>());
  std::vector<std::vector<at::Tensor>> out(1);
  for (int r = 0; r < world_; ++r) out[0].push_back(at::empty({kRow}, at::kLong));
  std::vector<at::Tensor> ins{in};
  const std::string what = "the agreement allgather of collective #" + std::to_string(seq_.load());
  wait(issue(what, [&] { return gloo_->allgather(out, ins); }), what);
  std::vector<Row> rows(world_);
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
  const std::string what = "the structure allgather";
  wait(issue(what, [&] { return gloo_->allgather(out, ins); }), what);
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

// The request every rank runs now, with every rank's row for it in `rows`; null when this rank
// has none (its row then says so).
std::shared_ptr<Request> Group::next_request(const std::shared_ptr<Request>& mine,
                                             std::vector<Row>& rows) {
  rows = gather_rows(row_of(mine.get(), mine->key_thread, mine->key_count));
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
  return cur;
}

// Whether some rank refused `cur`: then it fails on every rank with the reason, no data moves
// and the group stays usable (the refusing rank has thrown its invalid_argument already).
bool Group::refused(Request& cur, const std::vector<Row>& rows, const std::string& where) {
  for (int r = 0; r < world_; ++r) {
    if (!rows[r][kRefused]) continue;
    const auto reasons = gather_strings(cur.sig, max_sig_len(rows));
    fail(cur, cur.refused.empty()
                  ? std::make_exception_ptr(CollectiveMismatch(where + "rank " + std::to_string(r) +
                                                               " refused it: " + reasons[r]))
                  : std::make_exception_ptr(std::invalid_argument(cur.refused)));
    return true;
  }
  return false;
}

// How the ranks' rows for `cur` differ (empty when they agree). Every rank compares the same
// rows, so every rank makes the same gather_strings calls and reaches the same verdict.
std::string Group::mismatch(const Request& cur, const std::vector<Row>& rows) {
  for (int r = 1; r < world_; ++r) {
    const Row &a = rows[0], &b = rows[r];
    if (a[kOp] != b[kOp] || a[kReduce] != b[kReduce] || a[kRoot] != b[kRoot])
      return "rank 0 issued " + row_op_text(a) + ", rank " + std::to_string(r) + " issued " +
             row_op_text(b);
    if (a[kLeaves] != b[kLeaves] || a[kNumel] != b[kNumel] || a[kHash] != b[kHash]) {
      const auto sigs = gather_strings(cur.sig, max_sig_len(rows));
      return first_difference(0, sigs[0], r, sigs[r]);
    }
  }
  return {};
}

void Group::round(const std::shared_ptr<Request>& mine) {
  std::vector<Row> rows;
  const auto cur = next_request(mine, rows);
  const std::uint64_t seq = seq_.fetch_add(1);
  const std::string where = "treetensor distributed: collective #" + std::to_string(seq) + " (" +
                            key_text(rows[0][kThread], rows[0][kCount]) + "): ";
  for (int r = 0; r < world_; ++r)
    if (rows[r][kOp] == 0)
      // Every rank sees this row: all throw, and the group is broken (loop()).
      throw CollectiveMismatch(
          where + "rank " + std::to_string(r) + " made no such request within " +
          std::to_string((opts_.timeout / 2).count()) + " ms (half the timeout)");
  if (refused(*cur, rows, where)) return;
  if (const auto m = mismatch(*cur, rows); !m.empty()) {
    fail(*cur, std::make_exception_ptr(CollectiveMismatch(where + m)));  // the group is fine
    return;
  }
  // Every rank's tree is consolidated with the same buffers, or every rank packs buckets.
  cur->use_buffers = true;
  for (const auto& row : rows)
    cur->use_buffers = cur->use_buffers && row[kBuffers] != 0 && row[kBuffers] == rows[0][kBuffers];
  try {
    execute(*cur, seq);
  } catch (const CollectiveMismatch&) {
    fail(*cur, std::current_exception());
    throw;
  } catch (const std::exception& e) {
    auto ep = std::make_exception_ptr(CollectiveError(where + error_text(e)));
    fail(*cur, ep);
    std::rethrow_exception(ep);
  }
}

void Group::execute(Request& r, std::uint64_t seq) {
  const auto streams = streams_.enter(r.devices);
  block_current(r.ready);  // step 2: after the requester's work on the leaves
  keep_for(r.leaves, streams);
  keep_for(r.buffers, streams);
  TreeTensor value = perform(r, seq);
  r.finished = record(streams);  // step 3
  if (!r.devices.empty()) keep_for(tree::flatten(value).leaves, r.requester);
  r.value.set_value(std::move(value));
  r.done.set_value();
}

TreeTensor Group::perform(Request& r, std::uint64_t seq) {
  switch (r.op) {
    case Op::missing:
    case Op::barrier:
      return {};
    case Op::all_reduce:
    case Op::broadcast:
      if (r.use_buffers)
        reduce_buffers(r, seq);
      else
        reduce_buckets(r, seq, r.leaves);
      return {};
    case Op::reduce_scatter:
      return reduce_scatter(r, seq);
    case Op::all_gather:
      return all_gather(r, seq);
  }
  return {};
}

c10d::Backend& Group::backend_for(const at::Tensor& buffer) {
  if (!buffer.is_cuda()) return *gloo_;
  if (!nccl_) nccl_ = make_nccl(store_, rank_, world_, opts_.timeout);
  return *nccl_;
}

// A bucket's flat buffer, reused from the last collective that had a bucket b of this dtype,
// device and size (a fresh 25 MiB buffer costs its page faults on every call). Only the
// communication thread uses buckets; a buffer is free again once its collective has been
// waited for and copied out, before the next round (for CUDA in the communication stream's
// order, which is the only stream that packs and unpacks it).
at::Tensor Group::bucket_buffer(std::size_t b, std::int64_t n, const at::TensorOptions& o) {
  const auto key = std::make_tuple(b, static_cast<int>(o.dtype().toScalarType()),
                                   static_cast<int>(o.device().type()), o.device().index(), n);
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

void Group::check_bucket(std::uint64_t seq, std::size_t b, const at::Tensor& buffer,
                         const std::string& first_path) {
  Row row{};
  row[kThread] = static_cast<std::int64_t>(seq);
  row[kCount] = static_cast<std::int64_t>(b);
  row[kOp] = static_cast<std::int64_t>(buffer.scalar_type());
  row[kNumel] = buffer.numel();
  const auto rows = gather_rows(row);
  const auto text = [](const Row& x) {
    return "(sequence " + std::to_string(x[kThread]) + ", bucket " + std::to_string(x[kCount]) +
           ", " + dtype_text(static_cast<at::ScalarType>(x[kOp])) + ", " +
           std::to_string(x[kNumel]) + " elements)";
  };
  for (int r = 1; r < world_; ++r)
    if (rows[r] != rows[0])
      throw CollectiveMismatch("debug check: bucket " + std::to_string(b) + " (from path '" +
                               first_path + "'): rank 0 has " + text(rows[0]) + ", rank " +
                               std::to_string(r) + " has " + text(rows[r]));
}

Group::Started Group::start(const Request& r, const at::Tensor& buffer, const std::string& what) {
  const bool reduction = r.op != Op::broadcast;
  if (reduction && exchanges(buffer, r.reduce, world_)) return start_exchange(buffer, what);
  std::vector<at::Tensor> v{wire(buffer, reduction)};
  if (!reduction) {
    c10d::BroadcastOptions o;
    o.rootRank = r.root;
    return {issue(what, [&] { return backend_for(buffer).broadcast(v, o); }), {}, {}};
  }
  c10d::AllreduceOptions o;
  o.reduceOp = wire_op(r.reduce, buffer.scalar_type());
  return {issue(what, [&] { return backend_for(buffer).allreduce(v, o); }), {}, {}};
}

// Every rank posts its sends and receives in the agreed order of the round's buffers, so with
// one tag Gloo pairs them in that order (FIFO per peer and tag).
Group::Started Group::start_exchange(const at::Tensor& buffer, const std::string& what) {
  Started s;
  for (int k = 0; k < world_; ++k) s.parts.push_back(k == rank_ ? buffer : at::empty_like(buffer));
  for (int k = 0; k < world_; ++k) {
    if (k == rank_) continue;
    std::vector<at::Tensor> out{buffer}, in{s.parts[k]};
    s.p2p.push_back(issue(what, [&] { return gloo_->send(out, k, kExchangeTag); }));
    s.p2p.push_back(issue(what, [&] { return gloo_->recv(in, k, kExchangeTag); }));
  }
  return s;
}

void Group::finish(const Request& r, Started& s, const std::string& what,
                   const at::Tensor& buffer) {
  if (s.work) {
    wait(s.work, what, buffer);
    return;
  }
  for (const auto& w : s.p2p) wait(w, what, buffer);
  reduce_in_rank_order(s.parts, rank_, r.reduce);
}

// The padding between leaves is reduced too (it belongs to no leaf; its values do not matter).
void Group::reduce_buffers(Request& r, std::uint64_t seq) {
  std::vector<Started> works;
  auto what = [&](std::size_t b) {
    return std::string(op_name(r.op)) + " of consolidated buffer " + std::to_string(b);
  };
  for (std::size_t b = 0; b < r.buffers.size(); ++b) {
    if (opts_.debug) check_bucket(seq, b, r.buffers[b], "consolidated buffer");
    works.push_back(start(r, r.buffers[b], what(b)));
  }
  for (std::size_t b = 0; b < r.buffers.size(); ++b) {
    finish(r, works[b], what(b), r.buffers[b]);
    if (r.reduce == ReduceOp::avg && r.op != Op::broadcast) r.buffers[b].div_(world_);
  }
}

// all_reduce / broadcast over buckets: pack a bucket, issue it, pack the next...; then wait
// and copy back in order.
void Group::reduce_buckets(Request& r, std::uint64_t seq, const std::vector<at::Tensor>& leaves) {
  const auto plan = buckets(leaves);
  std::vector<at::Tensor> buffers;
  std::vector<Started> works;
  auto what = [&](std::size_t b) {
    return std::string(op_name(r.op)) + " of bucket " + std::to_string(b);
  };
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
    works.push_back(start(r, buffer, what(b)));
    buffers.push_back(buffer);
  }
  for (std::size_t b = 0; b < plan.size(); ++b) {
    finish(r, works[b], what(b), buffers[b]);
    if (r.reduce == ReduceOp::avg && r.op != Op::broadcast) buffers[b].div_(world_);
    if (!is_one_leaf(leaves, plan[b])) unpack(buffers[b], plan[b], leaves);
  }
}

TreeTensor Group::reduce_scatter(Request& r, std::uint64_t seq) {
  std::vector<at::Tensor> copies;
  for (const auto& t : r.leaves) copies.push_back(t.clone(at::MemoryFormat::Contiguous));
  reduce_buckets(r, seq, copies);
  std::vector<at::Tensor> out;
  for (auto& c : copies) {
    const std::int64_t chunk = c.size(0) / world_;
    out.push_back(c.narrow(0, rank_ * chunk, chunk));
  }
  return TreeTensor(tree::unflatten(r.spec, std::move(out)));
}

TreeTensor Group::all_gather(Request& r, std::uint64_t seq) {
  const auto plan = buckets(r.leaves);
  std::vector<at::Tensor> out;
  for (const auto& t : r.leaves) {
    std::vector<std::int64_t> shape{world_};
    shape.insert(shape.end(), t.sizes().begin(), t.sizes().end());
    out.push_back(at::empty(shape, t.options()));
  }
  std::vector<at::Tensor> ins;
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
    std::vector<at::Tensor> wired{wire(in, false)};
    outputs.emplace_back(1);
    for (int k = 0; k < world_; ++k) outputs.back()[0].push_back(at::empty_like(wired[0]));
    works.push_back(issue("all_gather of bucket " + std::to_string(b),
                          [&] { return backend_for(in).allgather(outputs.back(), wired); }));
    ins.push_back(in);
  }
  std::vector<at::Tensor> row(out.size());
  for (std::size_t b = 0; b < plan.size(); ++b) {
    wait(works[b], "all_gather of bucket " + std::to_string(b), ins[b]);
    for (int k = 0; k < world_; ++k) {
      for (const auto& it : plan[b]) row[it.first] = out[it.first][k];
      unpack(outputs[b][0][k].view(r.leaves[plan[b][0].first].scalar_type()), plan[b], row);
    }
  }
  return TreeTensor(tree::unflatten(r.spec, std::move(out)));
}

}  // namespace treetensor::distributed::detail
