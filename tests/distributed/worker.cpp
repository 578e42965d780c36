// One rank of a distributed test scenario, started by distributed_test.cpp through the
// built-in launcher (or by torchrun). Exits 0 when every check on this rank passed; prints
// what failed to stderr otherwise.
//
//   distributed_worker <scenario> [tcp|file:<path>]
//
// Values are small integers (or integer-valued floats below 2^24), so sums, products, min and
// max over ranks are exact in every dtype and results are compared exactly.

#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "treetensor/asyncs/thread.hpp"
#include "treetensor/distributed/process_group.hpp"
#include "treetensor/runtime/dispatch.hpp"
#include "treetensor/tensor/consolidate.hpp"
#include "treetensor/tree/flatten.hpp"

namespace dist = treetensor::distributed;
namespace asyncs = treetensor::asyncs;
using treetensor::TensorTree;
using treetensor::TreeTensor;

namespace {

int failures = 0;
int rank_ = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::cerr << "rank " << rank_ << ": FAILED: " << what << std::endl;
  }
}

bool same(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() && at::equal(a, b);
}

std::string show(const at::Tensor& t) {
  std::ostringstream os;
  os << t;
  return os.str();
}

void expect_equal(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  check(same(got, want), what + ": got\n" + show(got) + "\nwant\n" + show(want));
}

// Runs `fn`, which must throw E with a message containing each of `parts`.
template <class E>
void expect_throw(const std::function<void()>& fn, const std::vector<std::string>& parts,
                  const std::string& what) {
  try {
    fn();
    check(false, what + ": no exception");
  } catch (const E& e) {
    const std::string m = e.what();
    for (const auto& p : parts)
      check(m.find(p) != std::string::npos, what + ": '" + p + "' not in: " + m);
  } catch (const std::exception& e) {
    check(false, what + ": wrong exception type: " + e.what());
  }
}

dist::ProcessGroup make_group(const std::string& store, dist::Options o = {}) {
  if (store.rfind("file:", 0) == 0)
    return dist::ProcessGroup::with_file_store(store.substr(5), std::atoi(std::getenv("RANK")),
                                               std::atoi(std::getenv("WORLD_SIZE")), o);
  return dist::ProcessGroup::from_env(o);
}

// Buckets of a few leaves each, so that trees span several buckets and dtypes.
dist::Options small_buckets(std::chrono::milliseconds timeout) {
  dist::Options o;
  o.first_bucket_bytes = 64;
  o.bucket_bytes = 256;
  o.timeout = timeout;
  return o;
}

// Every collective against values computed by hand, with small buckets so that trees span
// several buckets and dtypes.
void scenario_values(const std::string& store) {
  auto g = make_group(store, small_buckets(std::chrono::seconds(60)));
  const int r = g.rank(), w = g.world_size();
  const double rr = r + 1;  // rank r contributes multiples of r + 1
  auto ar = [](std::int64_t n, at::ScalarType t) { return at::arange(n, at::TensorOptions(t)); };
  // Sum over ranks of (r + 1) = w(w + 1)/2; product = w!; min 1; max w.
  const double S = w * (w + 1) / 2.0;
  double P = 1;
  for (int k = 1; k <= w; ++k) P *= k;

  auto make = [&] {
    TreeTensor t =
        TensorTree{{"a", ar(40, at::kFloat) * rr},
                   {"b",
                    {{"i", ar(6, at::kLong).reshape({2, 3}) * static_cast<std::int64_t>(r + 1)},
                     {"d", ar(100, at::kDouble) * rr},
                     {"e", at::empty({0}, at::kFloat)}}},
                   {"n", (ar(12, at::kFloat).reshape({3, 4}) * rr).t()}};  // non-contiguous
    return t;
  };
  {
    auto t = make();
    dist::all_reduce(g, t, dist::ReduceOp::sum);
    expect_equal(t["a"].leaf(), ar(40, at::kFloat) * S, "all_reduce sum a");
    expect_equal(t["b"]["i"].leaf(),
                 ar(6, at::kLong).reshape({2, 3}) * static_cast<std::int64_t>(S), "sum b.i");
    expect_equal(t["b"]["d"].leaf(), ar(100, at::kDouble) * S, "sum b.d");
    check(t["b"]["e"].leaf().numel() == 0, "empty leaf stays empty");
    expect_equal(t["n"].leaf(), (ar(12, at::kFloat).reshape({3, 4}) * S).t(),
                 "sum of non-contiguous n");
  }
  {
    auto t = make();
    t.erase("b.i");  // avg needs floating leaves
    dist::all_reduce(g, t, dist::ReduceOp::avg);
    // (S / w) = (w + 1) / 2: 1.5 or 2, exact in binary.
    expect_equal(t["a"].leaf(), ar(40, at::kFloat) * (S / w), "avg a");
    expect_equal(t["b"]["d"].leaf(), ar(100, at::kDouble) * (S / w), "avg b.d");
  }
  for (auto [op, factor, name] : {std::tuple{dist::ReduceOp::min, 1.0, "min"},
                                  std::tuple{dist::ReduceOp::max, double(w), "max"},
                                  std::tuple{dist::ReduceOp::product, P, "product"}}) {
    TreeTensor t = TensorTree{{"x", at::full({5}, rr, at::kFloat)},
                              {"y", at::full({3}, static_cast<std::int64_t>(r + 1), at::kLong)}};
    dist::all_reduce(g, t, op);
    expect_equal(t["x"].leaf(), at::full({5}, factor, at::kFloat), std::string(name) + " x");
    expect_equal(t["y"].leaf(), at::full({3}, static_cast<std::int64_t>(factor), at::kLong),
                 std::string(name) + " y");
  }
  for (int root = 0; root < w; ++root) {
    auto t = make();
    dist::broadcast(g, t, root);
    const double f = root + 1;
    expect_equal(t["a"].leaf(), ar(40, at::kFloat) * f, "broadcast a from " + std::to_string(root));
    expect_equal(t["b"]["d"].leaf(), ar(100, at::kDouble) * f, "broadcast b.d");
    expect_equal(t["n"].leaf(), (ar(12, at::kFloat).reshape({3, 4}) * f).t(), "broadcast n");
  }
  {
    // Consolidated trees: the buffers are the buckets (reduced in place, no copy), the tree
    // stays consolidated over the same buffers; a rank whose tree is not consolidated makes
    // every rank pack buckets instead (values the same).
    auto ct = treetensor::consolidate(make());
    const void* before = treetensor::consolidated_groups(ct)[0].buffer.data_ptr();
    dist::all_reduce(g, ct, dist::ReduceOp::sum);
    check(treetensor::is_consolidated(ct), "a reduced consolidated tree stays consolidated");
    check(treetensor::consolidated_groups(ct)[0].buffer.data_ptr() == before,
          "reduced in its own buffer");
    expect_equal(ct["a"].leaf(), ar(40, at::kFloat) * S, "consolidated sum a");
    expect_equal(ct["b"]["i"].leaf(),
                 ar(6, at::kLong).reshape({2, 3}) * static_cast<std::int64_t>(S),
                 "consolidated sum b.i");
    expect_equal(ct["b"]["d"].leaf(), ar(100, at::kDouble) * S, "consolidated sum b.d");
    expect_equal(ct["n"].leaf(), (ar(12, at::kFloat).reshape({3, 4}) * S).t().contiguous(),
                 "consolidated sum n");
    auto floats = make();
    floats.erase("b.i");
    auto cf = treetensor::consolidate(floats);
    dist::all_reduce(g, cf, dist::ReduceOp::avg);
    expect_equal(cf["a"].leaf(), ar(40, at::kFloat) * (S / w), "consolidated avg a");
    expect_equal(cf["b"]["d"].leaf(), ar(100, at::kDouble) * (S / w), "consolidated avg b.d");
    auto cb = treetensor::consolidate(make());
    dist::broadcast(g, cb, w - 1);
    expect_equal(cb["b"]["d"].leaf(), ar(100, at::kDouble) * double(w), "consolidated broadcast");
    auto mixed = r == 0 ? treetensor::consolidate(make()) : make();
    dist::all_reduce(g, mixed, dist::ReduceOp::sum);
    expect_equal(mixed["b"]["d"].leaf(), ar(100, at::kDouble) * S, "consolidated on rank 0 only");
    expect_equal(mixed["n"].leaf(), (ar(12, at::kFloat).reshape({3, 4}) * S).t(),
                 "consolidated on rank 0 only, n");
  }
  {
    auto t = make();
    auto out = dist::all_gather(g, t);
    for (int k = 0; k < w; ++k) {
      expect_equal(out["a"].leaf()[k], ar(40, at::kFloat) * (k + 1.0),
                   "all_gather a[" + std::to_string(k) + "]");
      expect_equal(out["b"]["i"].leaf()[k], ar(6, at::kLong).reshape({2, 3}) * std::int64_t{k + 1},
                   "all_gather b.i");
      expect_equal(out["n"].leaf()[k], (ar(12, at::kFloat).reshape({3, 4}) * (k + 1.0)).t(),
                   "all_gather n");
    }
    check(out["b"]["e"].leaf().sizes() == at::IntArrayRef({w, 0}),
          "all_gather of an empty leaf is [w, 0]");
  }
  {
    TreeTensor t = TensorTree{{"a", ar(6 * w, at::kFloat).reshape({2 * w, 3}) * rr},
                              {"b", ar(w, at::kLong) * static_cast<std::int64_t>(r + 1)}};
    auto out = dist::reduce_scatter(g, t);
    expect_equal(out["a"].leaf(),
                 (ar(6 * w, at::kFloat).reshape({2 * w, 3}) * S).narrow(0, 2 * r, 2),
                 "reduce_scatter a");
    expect_equal(out["b"].leaf(), (ar(w, at::kLong) * static_cast<std::int64_t>(S)).narrow(0, r, 1),
                 "reduce_scatter b");
    expect_equal(t["a"].leaf(), ar(6 * w, at::kFloat).reshape({2 * w, 3}) * rr,
                 "reduce_scatter leaves its input alone");
    expect_throw<std::invalid_argument>(
        [&] {
          dist::reduce_scatter(g, TensorTree{{"z", {{"q", ar(w + 1, at::kFloat)}}}});
        },
        {"z.q", "equal chunks"}, "reduce_scatter of an odd leaf");
  }
  {
    // Small buffers go by direct exchange (DESIGN.md §14): every rank adds the ranks' copies in
    // rank order, so all hold the bits of ((x0 + x1) + x2) ..., here for float32 values whose
    // sum depends on that order (world 3: checked), in buckets and in a consolidated buffer;
    // a buffer above the limit goes by Gloo's ring, exact here (small integers).
    auto spread = [](int k) {
      const auto i = at::arange(64, at::kDouble);
      const auto exponent = at::remainder(i * 7 + k * 5, 13) - 6;
      return (at::pow(10.0, exponent) * (1 + 0.37 * k) * at::cos(i + k)).to(at::kFloat);
    };
    at::Tensor want = spread(0);
    for (int k = 1; k < w; ++k) want = want + spread(k);
    if (w == 3)
      check(!at::equal(want, (spread(0) + spread(2)) + spread(1)),
            "the exchange's values do not depend on the order of addition");
    TreeTensor t = TensorTree{{"s", spread(r)}};
    dist::all_reduce(g, t, dist::ReduceOp::sum);
    expect_equal(t["s"].leaf(), want, "exchange sum in rank order");
    auto ct = treetensor::consolidate(TreeTensor(TensorTree{{"s", spread(r)}}));
    dist::all_reduce(g, ct, dist::ReduceOp::sum);
    expect_equal(ct["s"].leaf(), want, "exchange sum of a consolidated buffer in rank order");
    const std::int64_t big = (std::int64_t{512} << 10) / 4 + 1;  // over the exchange's 512 KiB
    TreeTensor large = TensorTree{{"x", at::full({big}, rr, at::kFloat)}};
    dist::all_reduce(g, large, dist::ReduceOp::sum);
    expect_equal(large["x"].leaf(), at::full({big}, S, at::kFloat),
                 "sum above the exchange's limit");
  }
  {
    // A leaf on neither the CPU nor CUDA (here the meta device) is refused on every rank before
    // anything moves. The group stays usable (the collectives after this block). Refusals on
    // one rank only: scenario_refusals; CUDA leaves: scenario_cuda.
    const TensorTree off{{"p", {{"w", at::empty({2}, at::device(at::kMeta))}}}};
    expect_throw<std::invalid_argument>([&] { dist::all_reduce(g, off); },
                                        {"p.w", "meta", "CPU", "CUDA"},
                                        "all_reduce of a meta leaf");
    // A negative view reads its storage through its bit, which communication would not.
    const TensorTree neg{{"n", at::_neg_view(at::ones({2}))}};
    expect_throw<std::invalid_argument>([&] { dist::broadcast(g, neg, 0); },
                                        {"'n'", "negative view", "resolve_neg()"},
                                        "broadcast of a negative view");
  }
  {
    // Ring: every rank sends its tree to the next and receives the previous one's.
    auto mine = make();
    auto into = make();
    into.zero_();
    const int next = (r + 1) % w, prev = (r + w - 1) % w;
    if (r == 0) {
      dist::send(g, mine, next);
      dist::recv(g, into, prev);
    } else {
      dist::recv(g, into, prev);
      dist::send(g, mine, next);
    }
    const double f = prev + 1;
    expect_equal(into["a"].leaf(), ar(40, at::kFloat) * f, "recv a");
    expect_equal(into["b"]["d"].leaf(), ar(100, at::kDouble) * f, "recv b.d");
    expect_equal(into["n"].leaf(), (ar(12, at::kFloat).reshape({3, 4}) * f).t(),
                 "recv n (non-contiguous)");
  }
  {
    // Async forms from the main thread, several in flight.
    std::vector<TreeTensor> ts;
    std::vector<asyncs::Future<void>> fs;
    for (int k = 0; k < 5; ++k) {
      ts.push_back(TensorTree{{"v", at::full({k + 1}, rr * (k + 1), at::kFloat)}});
      fs.push_back(dist::all_reduce_async(g, ts.back()));
    }
    for (int k = 0; k < 5; ++k) {
      fs[k].get();
      expect_equal(ts[k]["v"].leaf(), at::full({k + 1}, S * (k + 1), at::kFloat),
                   "async all_reduce " + std::to_string(k));
    }
  }
  {
    // Operand tracking: a tree call on leaves being reduced waits for the collective (an
    // in-place add that ran first would be summed across ranks: S + w instead of S + 1).
    // The last rank joins each collective 100 ms late, so on the other ranks a tree call that
    // did not wait would return while the collective is still pending: checked with ready().
    const bool late = g.rank() == w - 1;
    std::vector<TreeTensor> ts;
    for (int k = 0; k < 5; ++k) {
      ts.push_back(TensorTree{{"v", at::full({1000 * (k + 1)}, rr * (k + 1), at::kFloat)}});
      if (late) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      auto f = dist::all_reduce_async(g, ts.back());
      ts.back().add_(1);
      check(f.ready(), "add_ after all_reduce_async " + std::to_string(k) +
                           " returned before the collective finished");
    }
    auto gathered_from = TreeTensor(TensorTree{{"v", at::full({3}, rr, at::kDouble)}});
    if (late) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    auto gathered = dist::all_gather_async(g, gathered_from);
    gathered_from.mul_(0);  // waits until the leaves have been sent
    check(gathered.ready(), "mul_ after all_gather_async returned before the collective finished");
    for (int k = 0; k < 5; ++k)
      expect_equal(ts[k]["v"].leaf(), at::full({1000 * (k + 1)}, S * (k + 1) + 1, at::kFloat),
                   "tracked async all_reduce " + std::to_string(k));
    at::Tensor want = at::empty({w, 3}, at::kDouble);
    for (int q = 0; q < w; ++q) want[q].fill_(q + 1);
    expect_equal(gathered.get()["v"].leaf(), want, "tracked async all_gather");
    treetensor::runtime::synchronize();  // rethrows an error of the dropped futures' jobs
  }
  dist::barrier(g);
  check(g.sequence() > 0, "sequence counts collectives");
}

// Arguments one rank refuses, dtypes Gloo lacks, leaves that need grad, share memory or have
// a pending asyncs writer (2 ranks).
void scenario_refusals(const std::string& store) {
  auto g = make_group(store, small_buckets(std::chrono::seconds(20)));
  const int r = g.rank(), peer = 1 - r;
  const double rr = r + 1;
  auto bools = [](std::vector<int> v) { return at::tensor(v, at::kInt).to(at::kBool); };
  auto tree = [&](double step) {
    return TreeTensor(TensorTree{{"w", at::full({4}, 10 * rr + step, at::kDouble)},
                                 {"b", at::full({2}, 10 * rr + step, at::kDouble)}});
  };
  {
    // A check that fails on rank 1 only (an unused parameter's undefined grad) fails that
    // request on both ranks, with the reason; the next steps pair up as they should (before,
    // rank 0's step 0 was summed with rank 1's step 1, silently).
    for (int step = 0; step < 3; ++step) {
      TreeTensor t = tree(step);
      if (r == 1 && step == 0) t.at("b") = at::Tensor();
      if (step == 0 && r == 1) {
        expect_throw<std::invalid_argument>([&] { dist::all_reduce(g, t); },
                                            {"path 'b'", "undefined"}, "refusing rank");
      } else if (step == 0) {
        expect_throw<dist::CollectiveMismatch>([&] { dist::all_reduce(g, t); },
                                               {"rank 1 refused it", "path 'b'", "undefined"},
                                               "the peer of a refusing rank");
      } else {
        dist::all_reduce(g, t);
        expect_equal(t["w"].leaf(), at::full({4}, 30.0 + 2 * step, at::kDouble),
                     "step " + std::to_string(step) + " after a refusal");
      }
    }
    // A root outside the world on one rank only, the async form: the same.
    TreeTensor t = tree(0);
    if (r == 0)
      expect_throw<std::invalid_argument>([&] { (void)dist::broadcast_async(g, t, 7); }, {"root 7"},
                                          "broadcast root refused");
    else
      expect_throw<dist::CollectiveMismatch>([&] { dist::broadcast(g, t, 0); },
                                             {"rank 0 refused it", "root 7"},
                                             "broadcast peer of a refusing rank");
  }
  {
    // Two overlapping rows with a column reaching over both: the column hides no overlap.
    const at::Tensor m = at::zeros({10, 10}, at::kDouble);
    TreeTensor rows =
        TensorTree{{"a", m.narrow(0, 0, 5)}, {"b", m.select(1, 0)}, {"c", m.select(0, 2)}};
    expect_throw<std::invalid_argument>([&] { dist::all_reduce(g, rows); },
                                        {"paths 'a' and 'c' share memory"},
                                        "overlap under a column");
  }
  {
    // send/recv: either side's refusal reaches the other instead of a wait for the timeout;
    // then a good pair still matches.
    const TreeTensor good = tree(0);
    TreeTensor into = tree(0);
    const TensorTree meta{{"b", at::empty({2}, at::device(at::kMeta).dtype(at::kDouble))},
                          {"w", at::empty({4}, at::kDouble)}};
    if (r == 0) {
      expect_throw<std::invalid_argument>([&] { dist::send(g, meta, peer); }, {"path 'b'", "CPU"},
                                          "send refused");
      expect_throw<dist::CollectiveMismatch>([&] { dist::send(g, good, peer); },
                                             {"receiver refused it", "'b'", "share memory"},
                                             "send to a refusing receiver");
      dist::send(g, good, peer);
    } else {
      expect_throw<dist::CollectiveMismatch>([&] { dist::recv(g, into, peer); },
                                             {"sender refused it", "path 'b'"},
                                             "recv from a refusing sender");
      const at::Tensor x = at::zeros({4}, at::kDouble);
      const TensorTree tied{{"b", x.narrow(0, 0, 2)}, {"w", x}};
      expect_throw<std::invalid_argument>([&] { dist::recv(g, tied, peer); },
                                          {"'b'", "'w'", "share memory"}, "recv refused");
      dist::recv(g, into, peer);
      expect_equal(into["w"].leaf(), at::full({4}, 10.0, at::kDouble), "recv after refusals");
    }
    expect_throw<std::invalid_argument>([&] { dist::send(g, good, r); }, {"itself"},
                                        "send to the calling rank");
  }
  {
    // Dtypes outside Gloo's: bool reduces as any/all (NCCL's meaning), complex by sum of its
    // parts, and data movement takes every dtype as bytes; what cannot be reduced is refused
    // on every rank and the group stays usable.
    TreeTensor t = TensorTree{{"any", bools({r == 0, false, true})},
                              {"z", at::full({3}, c10::complex<float>(rr, -rr))}};
    dist::all_reduce(g, t);
    expect_equal(t["any"].leaf(), bools({true, false, true}), "bool sum (any)");
    expect_equal(t["z"].leaf(), at::full({3}, c10::complex<float>(3, -3)), "complex sum");
    TreeTensor all = TensorTree{{"flag", bools({r == 1})}};
    dist::all_reduce(g, all, dist::ReduceOp::product);
    expect_equal(all["flag"].leaf(), bools({false}), "bool product (all)");
    const TensorTree moved{{"bf", at::full({5}, rr / 4, at::kBFloat16)},
                           {"h", at::full({2}, static_cast<std::int64_t>(r), at::kShort)},
                           {"ok", bools({r == 1})}};
    auto gathered = dist::all_gather(g, moved);
    at::Tensor bf = at::empty({2, 5}, at::kBFloat16);
    bf[0].fill_(0.25);
    bf[1].fill_(0.5);
    expect_equal(gathered["bf"].leaf(), bf, "all_gather bfloat16");
    expect_equal(gathered["h"].leaf(), at::tensor({0, 1}, at::kShort).unsqueeze(1).expand({2, 2}),
                 "all_gather int16");
    expect_equal(gathered["ok"].leaf(), bools({false, true}).unsqueeze(1), "all_gather bool");
    TreeTensor b = moved;
    b = b.clone();
    dist::broadcast(g, b, 1);
    expect_equal(b["bf"].leaf(), at::full({5}, 0.5, at::kBFloat16), "broadcast bfloat16");
    TreeTensor bad = TensorTree{{"x", {{"bf", at::ones({2}, at::kBFloat16)}}}};
    expect_throw<std::invalid_argument>([&] { dist::all_reduce(g, bad); },
                                        {"path 'x.bf'", "bfloat16"}, "all_reduce of bfloat16");
    TreeTensor zmax = TensorTree{{"z", at::ones({1}, at::kComplexFloat)}};
    expect_throw<std::invalid_argument>([&] { dist::all_reduce(g, zmax, dist::ReduceOp::max); },
                                        {"path 'z'", "complex64", "max"}, "max of complex");
  }
  {
    // Leaves that need grad are written outside autograd, as torch.distributed does.
    TreeTensor p = TensorTree{{"w", at::full({2, 2}, rr, at::kFloat).requires_grad_()},
                              {"b", at::full({100}, rr, at::kFloat).requires_grad_()}};
    dist::all_reduce(g, p, dist::ReduceOp::avg);
    expect_equal(p["w"].leaf().detach(), at::full({2, 2}, 1.5, at::kFloat), "avg of grad leaves");
    expect_equal(p["b"].leaf().detach(), at::full({100}, 1.5, at::kFloat), "avg of a grad leaf");
    dist::broadcast(g, p, 1);
    auto gathered = dist::all_gather(g, p);
    expect_equal(gathered["w"].leaf(), at::full({2, 2, 2}, 1.5, at::kFloat),
                 "all_gather of grad leaves");
  }
  {
    // Leaves that share memory cannot be written: refused on every rank, naming the paths.
    const at::Tensor x = at::ones({100}, at::kFloat);
    TreeTensor tied = TensorTree{{"a", x}, {"b", x}};
    expect_throw<std::invalid_argument>([&] { dist::all_reduce(g, tied); },
                                        {"'a'", "'b'", "share memory"}, "tied leaves");
    TreeTensor expanded = TensorTree{{"e", at::ones({1}).expand({4})}, {"f", at::ones({2})}};
    expect_throw<std::invalid_argument>([&] { dist::all_reduce(g, expanded); },
                                        {"path 'e'", "expanded"}, "an expanded leaf");
    auto gathered = dist::all_gather(g, expanded);  // read only: fine
    expect_equal(gathered["e"].leaf(), at::ones({2, 4}), "all_gather of an expanded leaf");
  }
  {
    // A blocking collective waits for a pending asyncs writer of its leaves (as a tree call
    // does): the writer multiplies by r + 2 after 300 ms.
    asyncs::Thread writer("writer");
    TreeTensor t = TensorTree{{"x", at::ones({1000}, at::kFloat)}};
    std::vector<at::Tensor> leaves{std::as_const(t)["x"].leaf()};
    auto f = writer.submit(
        [leaves, r] {
          std::this_thread::sleep_for(std::chrono::milliseconds(300));
          leaves[0].mul_(r + 2);
        },
        {}, leaves);
    dist::all_reduce(g, t);
    expect_equal(t["x"].leaf(), at::full({1000}, 5.0f), "all_reduce after a pending writer");
    f.get();
  }
  {
    // Keys holding the signature's separators cannot make two different trees read the same.
    TreeTensor t = r == 0
                       ? TreeTensor(TensorTree{{"a\tfloat64 [2]\nb", at::zeros({2}, at::kDouble)},
                                               {"c", at::zeros({3}, at::kDouble)}})
                       : TreeTensor(TensorTree{{"a", at::zeros({2}, at::kDouble)},
                                               {"b\tfloat64 [2]\nc", at::zeros({3}, at::kDouble)}});
    expect_throw<dist::CollectiveMismatch>([&] { dist::all_reduce(g, t); }, {"rank"},
                                           "keys with tabs and newlines");
  }
  TreeTensor t = tree(9);
  dist::all_reduce(g, t);  // the group is still usable after all of the above
  expect_equal(t["b"].leaf(), at::full({2}, 48.0, at::kDouble), "after the refusals");
}

// OneFlow's shape: 7 asyncs threads per rank, each all-reducing trees whose sizes grow with the
// iteration and whose values differ per rank and per thread; `reverse`: rank 1 submits to the
// threads in the opposite order (and the threads then race anyway).
void scenario_stress(const std::string& store, bool reverse) {
  int iterations = 200;
  if (const char* e = std::getenv("TREETENSOR_DIST_ITERATIONS")) iterations = std::atoi(e);
  dist::Options o;
  o.timeout = std::chrono::seconds(60);
  auto g = make_group(store, o);
  const int r = g.rank(), w = g.world_size();
  constexpr int kThreads = 7;
  std::vector<asyncs::Thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back("allreduce-" + std::to_string(t));
  std::vector<asyncs::Future<int>> futures;
  for (int i = 0; i < iterations; ++i) {
    for (int k = 0; k < kThreads; ++k) {
      const int t = reverse && r == 1 ? kThreads - 1 - k : k;
      futures.push_back(threads[t].submit([&g, r, w, t, i] {
        // Element j of leaf a on rank r: (r + 1)(t + 1) + (j mod 7) + i. Sum over ranks:
        // (t + 1) w(w + 1)/2 + w((j mod 7) + i): below 2^24, exact in float32.
        const std::int64_t n = 16 + 8 * i + t;
        auto j = at::arange(n, at::kFloat);
        auto base = at::remainder(j, 7) + i;
        TreeTensor tree = TensorTree{
            {"a", base + double((r + 1) * (t + 1))},
            {"b", {{"c", at::full({3 + (i + t) % 5}, std::int64_t{100} * r + t + i, at::kLong)}}}};
        dist::all_reduce(g, tree);
        int bad = 0;
        const double s = w * (w + 1) / 2.0;
        if (!same(tree["a"].leaf(), base * double(w) + (t + 1) * s)) ++bad;
        const std::int64_t c = 100 * std::int64_t(w) * (w - 1) / 2 + std::int64_t(w) * (t + i);
        if (!same(tree["b"]["c"].leaf(), at::full({3 + (i + t) % 5}, c, at::kLong))) ++bad;
        return bad;
      }));
    }
  }
  int bad = 0;
  for (auto& f : futures) bad += f.get();
  check(bad == 0, std::to_string(bad) + " wrong results of " + std::to_string(futures.size() * 2));
  std::cout << "rank " << r << ": " << futures.size() << " tree all_reduces from " << kThreads
            << " asyncs threads, " << bad << " wrong" << std::endl;
}

// Ranks that disagree: each gives a CollectiveMismatch on every rank, naming the path; the
// group stays usable after each.
void scenario_mismatch(const std::string& store) {
  dist::Options o;
  o.timeout = std::chrono::seconds(30);
  auto g = make_group(store, o);
  const int r = g.rank();
  {
    TreeTensor t = TensorTree{{"x", at::ones({3})}, {"y", {{"w", at::ones({2})}}}};
    if (r == 1) t.insert("y.extra", TensorTree(at::ones({1})));
    expect_throw<dist::CollectiveMismatch>([&] { dist::all_reduce(g, t); },
                                           {"y.extra", "rank 1", "not on rank 0"},
                                           "extra key on rank 1");
  }
  {
    TreeTensor t = TensorTree{{"x", at::ones({3})},
                              {"y", {{"w", at::ones({2}, r == 0 ? at::kFloat : at::kDouble)}}}};
    expect_throw<dist::CollectiveMismatch>([&] { dist::all_reduce(g, t); },
                                           {"at path 'y.w'", "float32 [2]", "float64 [2]"},
                                           "dtype mismatch");
  }
  {
    TreeTensor t = TensorTree{{"x", at::ones({r == 0 ? 3 : 4})}};
    expect_throw<dist::CollectiveMismatch>([&] { dist::all_reduce(g, t); },
                                           {"at path 'x'", "[3]", "[4]"}, "shape mismatch");
  }
  {
    TreeTensor t = TensorTree{{"x", at::ones({3})}};
    expect_throw<dist::CollectiveMismatch>(
        [&] {
          if (r == 0)
            dist::all_reduce(g, t);
          else
            dist::broadcast(g, t, 0);
        },
        {"issued all_reduce(sum)", "issued broadcast(root 0)"}, "op mismatch");
  }
  {
    TreeTensor t = TensorTree{{"p", at::ones({2})}, {r == 0 ? "q" : "s", at::ones({2})}};
    expect_throw<dist::CollectiveMismatch>(
        [&] {
          if (r == 0)
            dist::send(g, t, 1);
          else if (r == 1)
            dist::recv(g, t, 0);
          else
            throw dist::CollectiveMismatch("path 'q' not on rank 1: no part in it");
        },
        {"path 'q'", "not on rank 1"}, "send/recv structure mismatch");
  }
  // Still usable: a right all_reduce.
  TreeTensor t = TensorTree{{"x", at::full({3}, r + 1.0)}};
  dist::all_reduce(g, t);
  const double w = g.world_size();
  expect_equal(t["x"].leaf(), at::full({3}, w * (w + 1) / 2), "all_reduce after the mismatches");
}

// Rank 1 dies after one collective: the next collective on the others fails within the
// timeout, and later ones fail at once.
void scenario_dead(const std::string& store) {
  dist::Options o;
  o.timeout = std::chrono::seconds(5);
  auto g = make_group(store, o);
  TreeTensor t = TensorTree{{"x", at::ones({4})}};
  dist::all_reduce(g, t);
  if (g.rank() == 1) std::_Exit(0);  // no destructor, no goodbye: a crash as the peers see it
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const auto start = std::chrono::steady_clock::now();
  expect_throw<dist::CollectiveError>([&] { dist::all_reduce(g, t); },
                                      {"rank " + std::to_string(g.rank())},
                                      "all_reduce with a dead peer");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  check(s < 5.0 + 3.0, "the error came after " + std::to_string(s) + " s, timeout 5 s");
  expect_throw<dist::CollectiveError>([&] { dist::all_reduce(g, t); }, {}, "a later all_reduce");
  std::cout << "rank " << g.rank() << ": dead peer reported after " << s << " s" << std::endl;
  std::_Exit(failures ? 1 : 0);  // the broken Gloo group is not torn down
}

// Rank 0 all-reduces from its main thread, rank 1 from an asyncs thread: the requests' keys
// differ, so rank 1 never makes the request rank 0 runs first. Both get a CollectiveMismatch
// after the timeout, and the group is broken (later calls throw at once).
void scenario_missing(const std::string& store) {
  dist::Options o;
  o.timeout = std::chrono::seconds(3);
  auto g = make_group(store, o);
  TreeTensor t = TensorTree{{"x", at::ones({2})}};
  const std::vector<std::string> parts = {"rank 1 made no such request", "a non-asyncs thread"};
  if (g.rank() == 0) {
    expect_throw<dist::CollectiveMismatch>([&] { dist::all_reduce(g, t); }, parts,
                                           "request rank 1 never makes");
  } else {
    asyncs::Thread thread("other");
    auto f = thread.submit([&] { dist::all_reduce(g, t); });
    expect_throw<dist::CollectiveMismatch>([&] { f.get(); }, parts, "rank 1's own request");
  }
  expect_throw<dist::CollectiveMismatch>([&] { dist::all_reduce(g, t); }, parts,
                                         "a later call on the broken group");
}

// Rank 1 stalls (alive, never calls): rank 0's collective fails within the timeout.
void scenario_stall(const std::string& store) {
  dist::Options o;
  o.timeout = std::chrono::seconds(3);
  auto g = make_group(store, o);
  if (g.rank() == 1) {
    std::this_thread::sleep_for(std::chrono::seconds(6));
    std::_Exit(0);
  }
  TreeTensor t = TensorTree{{"x", at::ones({4})}};
  const auto start = std::chrono::steady_clock::now();
  expect_throw<dist::CollectiveError>([&] { dist::all_reduce(g, t); }, {},
                                      "all_reduce with a stalled peer");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  check(s < 3.0 + 3.0, "the error came after " + std::to_string(s) + " s, timeout 3 s");
  std::_Exit(failures ? 1 : 0);
}

// `m` is one line: no C++ backtrace (c10::Error::what() appends one) and no gloo internals.
void expect_one_line(const std::string& m, const std::string& what) {
  check(m.find('\n') == std::string::npos && m.find("Exception raised from") == std::string::npos,
        what + ": the message is more than one line: " + m);
}

// Runs `fn`, which must throw CollectiveError naming every part (gloo::IoException escaped
// raw from send/recv after a timeout); returns the message.
std::string expect_collective_error(const std::function<void()>& fn,
                                    const std::vector<std::string>& parts,
                                    const std::string& what) {
  std::string m;
  expect_throw<dist::CollectiveError>(
      [&] {
        try {
          fn();
        } catch (const dist::CollectiveError& e) {
          m = e.what();
          throw;
        }
      },
      parts, what);
  expect_one_line(m, what);
  return m;
}

// Rank 1 never answers: rank 0's recv times out, and its later send and recv fail as a
// CollectiveError naming the op, this rank and the peer, in one line each.
void scenario_p2p_timeout(const std::string& store) {
  dist::Options o;
  o.timeout = std::chrono::seconds(2);
  auto g = make_group(store, o);
  if (g.rank() == 1) {
    std::this_thread::sleep_for(std::chrono::seconds(7));
    std::_Exit(0);
  }
  const TensorTree t{{"x", at::ones({3})}};
  const auto start = std::chrono::steady_clock::now();
  expect_collective_error([&] { dist::recv(g, t, 1); }, {"rank 0", "recv from rank 1"},
                          "recv from a silent peer");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  check(s < 2.0 + 3.0, "the recv timeout came after " + std::to_string(s) + " s, timeout 2 s");
  expect_collective_error([&] { dist::send(g, t, 1); }, {"rank 0", "send to rank 1"},
                          "send after the timeout");
  expect_collective_error([&] { dist::recv(g, t, 1); }, {"rank 0", "recv from rank 1"},
                          "recv after the timeout");
  std::_Exit(failures ? 1 : 0);  // the broken Gloo pair is not torn down
}

// Launched with 3 processes for a world of 2: processes 1 and 2 both claim rank 1. The later
// claim fails at once ("claimed twice"), well within the timeout; the other pair works.
void scenario_duplicate_rank() {
  dist::Options o;
  o.timeout = std::chrono::seconds(4);
  const int claimed = std::min(std::atoi(std::getenv("RANK")), 1);
  const auto start = std::chrono::steady_clock::now();
  try {
    auto g = dist::ProcessGroup::with_tcp_store(
        std::getenv("MASTER_ADDR"), std::atoi(std::getenv("MASTER_PORT")), claimed, 2, o);
    TreeTensor t = TensorTree{{"x", at::ones({2})}};
    dist::all_reduce(g, t);
    expect_equal(t["x"].leaf(), at::full({2}, 2.0), "all_reduce of the pair that met");
    std::cout << "rank " << rank_ << ": joined as rank " << claimed << std::endl;
    // The group (and rank 0's store) stays up until the duplicate has surely tried.
    std::this_thread::sleep_for(std::chrono::seconds(3));
  } catch (const dist::CollectiveError& e) {
    const std::string m = e.what();
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    check(claimed == 1, "rank 0 failed: " + m);
    check(m.find("rank 1 is claimed twice") != std::string::npos, "the message: " + m);
    check(s < 4.0, "the duplicate gave up after " + std::to_string(s) + " s, timeout 4 s");
    expect_one_line(m, "duplicate rank");
    std::cout << "rank " << rank_ << ": refused after " << s << " s: " << m << std::endl;
  }
}

// ---- CUDA leaves over NCCL: distributed_test runs these only where CUDA devices exist, and
// they use c10's device-generic API only, so this file builds with any LibTorch. --------------

const c10::impl::DeviceGuardImplInterface& cuda() {
  return *c10::impl::getDeviceGuardImpl(c10::kCUDA);
}

// This rank's GPU, LOCAL_RANK's as torchrun programs choose it (NCCL needs one GPU per rank).
c10::Device rank_gpu() {
  const c10::Device d(c10::kCUDA,
                      static_cast<c10::DeviceIndex>(dist::local_rank() % cuda().deviceCount()));
  cuda().setDevice(d);
  return d;
}

// A stream of c10's pool current on this thread for a scope: not the default stream, so the
// checks see whether collectives order themselves against the caller's own stream.
class SideStream {
 public:
  explicit SideStream(c10::Device d)
      : previous_(cuda().exchangeStream(cuda().getStreamFromGlobalPool(d))) {}
  ~SideStream() { cuda().exchangeStream(previous_); }
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;

 private:
  c10::Stream previous_;
};

// Tens of milliseconds of matmuls on the current stream of a's device: what is enqueued after
// them is still pending when the host moves on.
void keep_stream_busy(const at::Tensor& a) {
  for (int i = 0; i < 8; ++i) (void)at::mm(a, a);
}

// Every dtype NCCL takes, an empty and a non-contiguous leaf, each arange(n) * f, on `d`.
TensorTree cuda_tree(std::int64_t f, c10::Device d) {
  auto ar = [&](std::int64_t n, at::ScalarType t) {
    return (at::arange(n, at::kLong) * f).to(t).to(d);
  };
  return TensorTree{{"f", ar(40, at::kFloat)},
                    {"d", ar(100, at::kDouble)},
                    {"h", ar(8, at::kHalf)},
                    {"bf", ar(8, at::kBFloat16)},
                    {"i", {{"l", ar(6, at::kLong).reshape({2, 3})}, {"b", ar(5, at::kChar)}}},
                    {"n", ar(12, at::kFloat).reshape({3, 4}).t()},
                    {"e", at::empty({0}, at::device(d))}};
}

// `got` holds `want`'s values (CPU) on the devices of `like`'s leaves, path by path.
void expect_tree(const TensorTree& got, const TensorTree& want, const TensorTree& like,
                 const std::string& what) {
  const auto g = treetensor::tree::flatten(got), e = treetensor::tree::flatten(want),
             l = treetensor::tree::flatten(like);
  check(g.leaves.size() == e.leaves.size(), what + ": leaf count");
  const auto paths = e.spec.paths();
  for (std::size_t i = 0; i < std::min(g.leaves.size(), e.leaves.size()); ++i) {
    const std::string at_path = what + " at '" + paths[i].describe() + "'";
    check(g.leaves[i].device() == l.leaves[i].device(), at_path + ": on the wrong device");
    expect_equal(g.leaves[i].to(at::kCPU), e.leaves[i], at_path);
  }
}

std::int64_t triangle(int w) {  // the sum over ranks of r + 1
  return std::int64_t{w} * (w + 1) / 2;
}

// all_reduce by every op of CUDA leaves of every dtype NCCL takes.
void cuda_reductions(const dist::ProcessGroup& g, c10::Device gpu) {
  const int r = g.rank(), w = g.world_size();
  const std::int64_t S = triangle(w);
  const c10::Device cpu(at::kCPU);
  TreeTensor t = cuda_tree(r + 1, gpu);
  dist::all_reduce(g, t);
  expect_tree(t, cuda_tree(S, cpu), cuda_tree(1, gpu), "cuda all_reduce sum");
  auto floats = [](TreeTensor x) {  // avg needs floating leaves
    x.erase("i");
    return x;
  };
  t = floats(cuda_tree(r + 1, gpu));
  dist::all_reduce(g, t, dist::ReduceOp::avg);
  TreeTensor avg = floats(cuda_tree(S, cpu));
  avg /= w;
  expect_tree(t, avg, floats(cuda_tree(1, gpu)), "cuda all_reduce avg");
  std::int64_t P = 1;
  for (int k = 1; k <= w; ++k) P *= k;
  for (auto [op, want, name] : {std::tuple{dist::ReduceOp::min, std::int64_t{1}, "min"},
                                std::tuple{dist::ReduceOp::max, std::int64_t{w}, "max"},
                                std::tuple{dist::ReduceOp::product, P, "product"}}) {
    auto full = [&](std::int64_t v, c10::Device d) {
      return TensorTree{{"x", at::full({5}, v, at::device(d).dtype(at::kHalf))},
                        {"y", at::full({3}, v, at::device(d).dtype(at::kLong))}};
    };
    const TensorTree mine = full(r + 1, gpu);
    dist::all_reduce(g, mine, op);
    expect_tree(mine, full(want, cpu), full(1, gpu), std::string("cuda all_reduce ") + name);
  }
}

// bool reduces as any (sum) and all (product), complex by the sum of its parts, on NCCL too.
void cuda_any_all_complex(const dist::ProcessGroup& g, c10::Device gpu) {
  const int r = g.rank(), w = g.world_size();
  const auto S = static_cast<float>(triangle(w));
  auto bools = [](std::vector<int> v) { return at::tensor(v, at::kInt).to(at::kBool); };
  const TensorTree any{{"any", bools({r == 0, 0, 1}).to(gpu)},
                       {"z", at::full({3}, c10::complex<float>(r + 1, -(r + 1))).to(gpu)}};
  const TensorTree all{{"all", bools({r == 0, 1}).to(gpu)}};
  dist::all_reduce(g, any);
  dist::all_reduce(g, all, dist::ReduceOp::product);
  expect_tree(
      any, TensorTree{{"any", bools({1, 0, 1})}, {"z", at::full({3}, c10::complex<float>(S, -S))}},
      any, "cuda bool sum (any), complex sum");
  expect_tree(all, TensorTree{{"all", bools({w == 1, 1})}}, all, "cuda bool product (all)");
}

// broadcast, all_gather (leaves stacked in rank order) and reduce_scatter of CUDA leaves.
void cuda_movement(const dist::ProcessGroup& g, c10::Device gpu) {
  const int r = g.rank(), w = g.world_size();
  const std::int64_t S = triangle(w);
  const c10::Device cpu(at::kCPU);
  const TensorTree like = cuda_tree(1, gpu);
  for (int root = 0; root < w; ++root) {
    TreeTensor t = cuda_tree(r + 1, gpu);
    dist::broadcast(g, t, root);
    expect_tree(t, cuda_tree(root + 1, cpu), like, "cuda broadcast from " + std::to_string(root));
  }
  std::vector<std::vector<at::Tensor>> ranks;
  for (int k = 0; k < w; ++k)
    ranks.push_back(treetensor::tree::flatten(cuda_tree(k + 1, cpu)).leaves);
  std::vector<at::Tensor> stacked;
  for (std::size_t i = 0; i < ranks[0].size(); ++i) {
    std::vector<at::Tensor> column;
    for (const auto& leaves : ranks) column.push_back(leaves[i]);
    stacked.push_back(at::stack(column));
  }
  expect_tree(dist::all_gather(g, cuda_tree(r + 1, gpu)),
              treetensor::tree::unflatten(treetensor::tree::flatten(like).spec, stacked), like,
              "cuda all_gather");
  auto scattered = [&](std::int64_t f, c10::Device d) {
    return TensorTree{{"a", (at::arange(6 * w, at::kFloat).reshape({2 * w, 3}) * f).to(d)},
                      {"b", (at::arange(w, at::kLong) * f).to(d)}};
  };
  const TensorTree sum = scattered(S, cpu);
  expect_tree(dist::reduce_scatter(g, scattered(r + 1, gpu)),
              TensorTree{{"a", sum["a"].leaf().narrow(0, 2 * r, 2)},
                         {"b", sum["b"].leaf().narrow(0, r, 1)}},
              scattered(1, gpu), "cuda reduce_scatter");
}

// Trees mixing CPU and CUDA leaves (Gloo and NCCL in one request), and consolidated trees
// whose buffers are on CUDA (or on both): their buffers are the buckets.
void cuda_mixed_and_consolidated(const dist::ProcessGroup& g, c10::Device gpu) {
  const int r = g.rank(), w = g.world_size();
  const std::int64_t S = triangle(w);
  const c10::Device cpu(at::kCPU);
  // The CPU half goes through Gloo, which cannot sum bfloat16: that leaf is on the GPU half only.
  auto mixed = [&](std::int64_t f, c10::Device d) {
    TensorTree host = cuda_tree(f, cpu);
    host.erase("bf");
    return TensorTree{{"cpu", std::move(host)}, {"gpu", cuda_tree(f, d)}};
  };
  const TensorTree like = mixed(1, gpu);
  TreeTensor t = mixed(r + 1, gpu);
  dist::all_reduce(g, t);
  expect_tree(t, mixed(S, cpu), like, "mixed all_reduce");
  t = mixed(r + 1, gpu);
  dist::broadcast(g, t, w - 1);
  expect_tree(t, mixed(w, cpu), like, "mixed broadcast");
  const auto gathered = dist::all_gather(g, mixed(r + 1, gpu));
  for (int k = 0; k < w; ++k) {
    expect_equal(gathered["gpu"]["d"].leaf()[k].to(at::kCPU),
                 at::arange(100, at::kDouble) * (k + 1), "mixed all_gather, gpu part");
    expect_equal(gathered["cpu"]["d"].leaf()[k], at::arange(100, at::kDouble) * (k + 1),
                 "mixed all_gather, cpu part");
  }
  auto ct = treetensor::consolidate(TreeTensor(cuda_tree(r + 1, gpu)));
  const at::Tensor buffer = treetensor::consolidated_groups(ct)[0].buffer;
  check(buffer.is_cuda(), "a consolidated CUDA tree has CUDA buffers");
  dist::all_reduce(g, ct);
  check(treetensor::is_consolidated(ct), "a reduced consolidated CUDA tree stays consolidated");
  check(treetensor::consolidated_groups(ct)[0].buffer.data_ptr() == buffer.data_ptr(),
        "reduced in its own CUDA buffer");
  expect_tree(ct, cuda_tree(S, cpu), cuda_tree(1, gpu), "consolidated CUDA all_reduce");
  auto cm = treetensor::consolidate(TreeTensor(mixed(r + 1, gpu)));
  dist::broadcast(g, cm, 0);
  expect_tree(cm, mixed(1, cpu), like, "consolidated mixed broadcast");
  dist::all_reduce(g, cm);
  expect_tree(cm, mixed(w, cpu), like, "consolidated mixed all_reduce");
}

// A caller on a non-default stream whose leaves get their values behind pending work, reading
// the results on that stream with no synchronize: wrong values if the collective did not wait
// for the caller's stream, or the caller's stream for the collective.
void cuda_streams(const dist::ProcessGroup& g, c10::Device gpu) {
  const int r = g.rank(), w = g.world_size();
  const std::int64_t S = triangle(w);
  SideStream side(gpu);
  const at::Tensor a = at::randn({4096, 4096}, at::device(gpu));
  for (std::int64_t k = 1; k <= 4; ++k) {
    at::Tensor x = at::zeros({1 << 20}, at::device(gpu));
    at::Tensor y = at::zeros({1000}, at::device(gpu).dtype(at::kDouble));
    keep_stream_busy(a);
    x.fill_(k * (r + 1));
    y.fill_(k * (r + 1));
    TreeTensor t = TensorTree{{"x", x}, {"y", y}};
    const auto gathered = dist::all_gather(g, t);
    dist::all_reduce(g, t);
    const std::string step = " (step " + std::to_string(k) + ")";
    expect_equal(x.to(at::kCPU), at::full({1 << 20}, k * S, at::kFloat),
                 "side stream all_reduce" + step);
    expect_equal(y.to(at::kCPU), at::full({1000}, k * S, at::kDouble),
                 "side stream all_reduce y" + step);
    for (int q = 0; q < w; ++q)
      expect_equal(gathered["x"].leaf()[q].to(at::kCPU),
                   at::full({1 << 20}, k * (q + 1), at::kFloat), "side stream all_gather" + step);
  }
}

// The _async forms read through asyncs: a job taking the leaves as operands, a job calling
// get(), and a tree call on the leaves, each after the collective with no synchronize.
void cuda_async(const dist::ProcessGroup& g, c10::Device gpu) {
  const int r = g.rank(), w = g.world_size();
  const std::int64_t S = triangle(w);
  SideStream side(gpu);
  asyncs::Thread reader("reader");
  const at::Tensor a = at::randn({4096, 4096}, at::device(gpu));
  for (std::int64_t k = 1; k <= 3; ++k) {
    at::Tensor x = at::zeros({1 << 20}, at::device(gpu));
    keep_stream_busy(a);
    x.fill_(k * (r + 1));
    TreeTensor t = TensorTree{{"x", x}};
    const auto gathered = dist::all_gather_async(g, t);
    (void)dist::all_reduce_async(g, t);
    auto read = reader.submit([x] { return x.to(at::kCPU); }, {x}, {}, "read x");
    auto rows = reader.submit([gathered] { return gathered.get()["x"].leaf().to(at::kCPU); }, {},
                              {}, "read gathered");
    const std::string step = " (step " + std::to_string(k) + ")";
    expect_equal(read.get(), at::full({1 << 20}, k * S, at::kFloat),
                 "job reading all_reduce_async" + step);
    for (int q = 0; q < w; ++q)
      expect_equal(rows.get()[q], at::full({1 << 20}, k * (q + 1), at::kFloat),
                   "job reading all_gather_async" + step);
    (void)dist::all_reduce_async(g, t);
    t.add_(1);  // waits for the reduction (operand tracking), then runs on this stream
    expect_equal(x.to(at::kCPU), at::full({1 << 20}, k * S * w + 1, at::kFloat),
                 "tree call after all_reduce_async" + step);
  }
  treetensor::runtime::synchronize();
}

// What NCCL cannot reduce is refused on every rank, naming the path; data movement takes it.
void cuda_refusals(const dist::ProcessGroup& g, c10::Device gpu) {
  const TensorTree shorts{{"q", {{"s", at::ones({4}, at::device(gpu).dtype(at::kShort))}}}};
  expect_throw<std::invalid_argument>([&] { dist::all_reduce(g, shorts); },
                                      {"path 'q.s'", "NCCL cannot reduce int16"},
                                      "all_reduce of an int16 CUDA leaf");
  const auto moved = dist::all_gather(g, shorts);
  expect_equal(moved["q"]["s"].leaf().to(at::kCPU), at::ones({g.world_size(), 4}, at::kShort),
               "all_gather of int16 CUDA leaves");
}

// Every collective on CUDA leaves, one GPU per rank.
void scenario_cuda(const std::string& store) {
  auto g = make_group(store, small_buckets(std::chrono::seconds(60)));
  const c10::Device gpu = rank_gpu();
  cuda_reductions(g, gpu);
  cuda_any_all_complex(g, gpu);
  cuda_movement(g, gpu);
  cuda_mixed_and_consolidated(g, gpu);
  cuda_streams(g, gpu);
  cuda_async(g, gpu);
  cuda_refusals(g, gpu);
  dist::barrier(g);
}

// 2 ranks, only rank 0 on a GPU (so one GPU is enough: NCCL is never started): a leaf on CUDA
// on one rank and on the CPU on the other is a mismatch naming the path on both; send of a
// CUDA leaf is refused, and the receiver hears why.
void scenario_cuda_mismatch(const std::string& store) {
  dist::Options o;
  o.timeout = std::chrono::seconds(30);
  auto g = make_group(store, o);
  const int r = g.rank();
  const c10::Device d = r == 0 ? rank_gpu() : c10::Device(at::kCPU);
  const TensorTree t{{"x", {{"w", at::ones({3}, at::device(d))}}}, {"y", at::ones({2})}};
  expect_throw<dist::CollectiveMismatch>(
      [&] { dist::all_reduce(g, t); },
      {"at path 'x.w'", "float32 [3] on cuda", "float32 [3] on cpu"},
      "a leaf on cuda on rank 0, on cpu on rank 1");
  if (r == 0)
    expect_throw<std::invalid_argument>([&] { dist::send(g, t, 1); }, {"path 'x.w'", "cuda"},
                                        "send of a CUDA leaf");
  else
    expect_throw<dist::CollectiveMismatch>(
        [&] {
          dist::recv(g, TensorTree{{"x", {{"w", at::ones({3})}}}, {"y", at::ones({2})}}, 0);
        },
        {"sender refused it", "path 'x.w'", "CPU"}, "recv from a sender of a CUDA leaf");
  const TensorTree c{{"v", at::full({3}, r + 1.0)}};
  dist::all_reduce(g, c);
  expect_equal(c["v"].leaf(), at::full({3}, 3.0), "all_reduce after the mismatch");
}

// A build without NCCL on a machine with a GPU: a CUDA leaf is refused naming the path.
void scenario_cuda_without_nccl(const std::string& store) {
  auto g = make_group(store);
  const TensorTree t{{"x", at::ones({3}, at::device(rank_gpu()))}};
  expect_throw<std::invalid_argument>([&] { dist::all_reduce(g, t); }, {"path 'x'", "no NCCL"},
                                      "a CUDA leaf without NCCL");
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: distributed_worker "
                 "values|refusals|stress|stress-reverse|mismatch|missing|dead|stall|p2p-timeout|"
                 "duplicate-rank|cuda|"
                 "cuda-mismatch|cuda-without-nccl "
                 "[tcp|file:PATH]\n";
    return 2;
  }
  const std::string scenario = argv[1];
  const std::string store = argc > 2 ? argv[2] : "tcp";
  if (const char* rk = std::getenv("RANK")) rank_ = std::atoi(rk);
  try {
    if (scenario == "values")
      scenario_values(store);
    else if (scenario == "stress")
      scenario_stress(store, false);
    else if (scenario == "stress-reverse")
      scenario_stress(store, true);
    else if (scenario == "refusals")
      scenario_refusals(store);
    else if (scenario == "mismatch")
      scenario_mismatch(store);
    else if (scenario == "dead")
      scenario_dead(store);
    else if (scenario == "missing")
      scenario_missing(store);
    else if (scenario == "stall")
      scenario_stall(store);
    else if (scenario == "p2p-timeout")
      scenario_p2p_timeout(store);
    else if (scenario == "duplicate-rank")
      scenario_duplicate_rank();
    else if (scenario == "cuda")
      scenario_cuda(store);
    else if (scenario == "cuda-mismatch")
      scenario_cuda_mismatch(store);
    else if (scenario == "cuda-without-nccl")
      scenario_cuda_without_nccl(store);
    else {
      std::cerr << "unknown scenario " << scenario << "\n";
      return 2;
    }
  } catch (const std::exception& e) {
    std::cerr << "rank " << rank_ << ": " << scenario << ": uncaught: " << e.what() << std::endl;
    return 1;
  }
  if (failures)
    std::cerr << "rank " << rank_ << ": " << failures << " check(s) failed" << std::endl;
  return failures ? 1 : 0;
}
