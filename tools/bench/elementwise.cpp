// The elementwise workload: N leaves of E elements, `add` and the chain (x*2+y).sigmoid_(),
// per leaf (native std::map loop, linear, stream, auto) against flat execution on consolidated
// trees (DESIGN.md §12) and the fused expression (DESIGN.md §19), with one ATen call over all
// N·E elements as the floor.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "treetensor/runtime/stream.hpp"
#include "treetensor/tensor/tensor.hpp"
#include "workloads.hpp"

namespace treetensor::bench {
namespace {

namespace rt = treetensor::runtime;
using Map = std::map<std::string, at::Tensor>;

struct Inputs {
  Map x, y;                 // the native loop's operands
  TreeTensor tx, ty;        // the same tensors as trees
  TreeTensor cx, cy;        // consolidated copies (flat)
  at::Tensor one_x, one_y;  // one tensor of N·E elements each (the floor)
};

Inputs make_inputs(std::size_t leaves, std::int64_t elements, const Config& cfg) {
  Inputs in;
  std::vector<std::pair<std::string, at::Tensor>> px, py;
  for (std::size_t i = 0; i < leaves; ++i) {
    const std::string key = fmt::format("a{}", i);
    at::Tensor a = at::randn({elements}).to(cfg.device, cfg.dtype);
    at::Tensor b = at::randn({elements}).to(cfg.device, cfg.dtype);
    in.x[key] = a;
    in.y[key] = b;
    px.emplace_back(key, a);
    py.emplace_back(key, b);
  }
  in.tx = tree::unflatten(px);
  in.ty = tree::unflatten(py);
  in.cx = consolidate(in.tx);
  in.cy = consolidate(in.ty);
  const auto opts = at::TensorOptions().device(cfg.device).dtype(cfg.dtype);
  in.one_x = at::randn({static_cast<std::int64_t>(leaves) * elements}, opts);
  in.one_y = at::randn({static_cast<std::int64_t>(leaves) * elements}, opts);
  return in;
}

// The two ops as a user writes them: one generic lambda each, for tensors (the native loop),
// trees (op at a time) and fuse() alike.
const auto add_op = [](const auto& x, const auto& y) { return x + y; };
const auto chain_op = [](const auto& x, const auto& y) { return (x * 2 + y).sigmoid_(); };

at::Tensor op_tensor(const std::string& op, const at::Tensor& x, const at::Tensor& y) {
  return op == "add" ? at::add(x, y) : chain_op(x, y);
}
TreeTensor op_tree(const std::string& op, const TreeTensor& x, const TreeTensor& y) {
  return op == "add" ? add_op(x, y) : chain_op(x, y);
}
// The fused row: the same lambda through fuse(), on consolidated trees under automatic.
TreeTensor op_fused(const std::string& op, const TreeTensor& x, const TreeTensor& y) {
  rt::StreamGuard guard(rt::automatic);
  return op == "add" ? fuse(add_op, x, y) : fuse(chain_op, x, y);
}

TensorMap by_key(const TensorTree& t) {
  TensorMap out;
  const auto flat = tree::flatten(t);
  const auto paths = flat.spec.paths();
  for (std::size_t i = 0; i < paths.size(); ++i) out[paths[i].str()] = flat.leaves[i];
  return out;
}

// The chain's sigmoid is a libm-style function: ATen computes a tensor's last (n mod 16)
// elements with the scalar form and the rest with the vector form, so a leaf's tail may differ
// from the same elements inside a buffer by the two forms' accuracy (see tensor_flat_test:
// at most 8 ulp of the result). add is correctly rounded: bitwise.
rounding::Agreement compare(const std::string& op, const at::Tensor& got, const at::Tensor& want) {
  if (op == "add") return rounding::compare_bitwise(got, want);
  const double u = rounding::unit_roundoff(want.scalar_type());
  const at::Tensor bound = want.abs().to(at::kDouble) * (16 * u) + 1e-300;  // 8 ulp = 16 u
  return rounding::compare_within(got, want, bound);
}

struct Row {
  std::string name;
  std::function<void()> run;
};

}  // namespace

WorkloadResult run_elementwise(const Config& cfg, Progress& progress) {
  WorkloadResult out;
  nlohmann::json reps_used = nlohmann::json::object();
  std::vector<std::string> per_leaf;  // sizes where the consolidated call ran per leaf
  RepPlan plan = rep_plan(cfg);
  if (!cfg.reps) plan.budget_s = cfg.elementwise_budget_s;
  plan.slow_min_reps = 3;  // the 65536-element sizes: rounds of seconds on a fresh machine
  plan.min_sample_ms = kMinSampleMs;  // every row replaces its kept result: it may repeat
  for (const std::size_t n : cfg.elementwise_leaves)
    for (const std::int64_t e : cfg.elementwise_elements) {
      at::manual_seed(cfg.seed);
      const Inputs in = make_inputs(n, e, cfg);
      for (const std::string op : {"add", "chain"}) {
        const std::string size = fmt::format("{}x{} {}", n, e, op);
        const std::string stage = "elementwise " + size;
        progress.update(stage, "verifying against native");
        // Verification: every row's result against the native loop's, key by key.
        Map reference;
        for (const auto& [k, x] : in.x) reference[k] = op_tensor(op, x, in.y.at(k));
        Verification verification(
            size,
            [&](const std::string&, const at::Tensor& got, const at::Tensor& want) {
              return compare(op, got, want);
            },
            cfg.perturb_row);
        const std::vector<std::pair<std::string, rt::StreamMode>> modes = {
            {"linear", rt::StreamMode::of(1)},
            {"stream", rt::StreamMode::of(cfg.lanes)},
            {"auto", rt::StreamMode::of(rt::automatic)}};
        for (const auto& [name, mode] : modes) {
          rt::StreamGuard guard(mode);
          verification.check(name, reference, by_key(op_tree(op, in.tx, in.ty)), n);
        }
        const TreeTensor flat = op_tree(op, in.cx, in.cy);
        if (!is_consolidated(flat)) per_leaf.push_back(size);
        verification.check("flat", reference, by_key(flat), n);
        verification.check("fused", reference, by_key(op_fused(op, in.cx, in.cy)), n);
        out.notes.push_back(verification.note());
        out.all_verified = out.all_verified && verification.all_passed();

        // Timed rows keep their result until release, as a caller would.
        auto keep_map = std::make_shared<Map>();
        auto keep_tree = std::make_shared<TreeTensor>();
        auto keep_one = std::make_shared<at::Tensor>();
        auto sink = std::make_shared<double>(0);
        std::vector<Candidate> rows;
        rows.push_back({"native",
                        [&, keep_map] {
                          for (const auto& [k, x] : in.x)
                            (*keep_map)[k] = op_tensor(op, x, in.y.at(k));
                        },
                        [keep_map] { keep_map->clear(); }});
        for (const auto& [name, mode] : modes) {
          const rt::StreamMode m = mode;
          rows.push_back({name,
                          [&, keep_tree, m] {
                            rt::StreamGuard guard(m);
                            *keep_tree = op_tree(op, in.tx, in.ty);
                          },
                          [keep_tree] { *keep_tree = TreeTensor(); }});
        }
        rows.push_back({"flat", [&, keep_tree] { *keep_tree = op_tree(op, in.cx, in.cy); },
                        [keep_tree] { *keep_tree = TreeTensor(); }});
        rows.push_back({"flat+read",
                        [&, keep_tree, sink] {
                          *keep_tree = op_tree(op, in.cx, in.cy);
                          for (const at::Tensor* l : tree::flatten_refs(*keep_tree).leaves)
                            *sink += static_cast<double>(l->numel());  // every leaf made once
                        },
                        [keep_tree] { *keep_tree = TreeTensor(); }});
        rows.push_back({"fused", [&, keep_tree] { *keep_tree = op_fused(op, in.cx, in.cy); },
                        [keep_tree] { *keep_tree = TreeTensor(); }});
        rows.push_back({"one-call",
                        [&, keep_one] { *keep_one = op_tensor(op, in.one_x, in.one_y); },
                        [keep_one] { *keep_one = at::Tensor(); }});
        const RoundRobin measured =
            time_round_robin(rows, plan, device_synchronizer(cfg.device), progress, stage);
        reps_used[size] = measured.reps;
        const auto& t = measured.timings;
        for (std::size_t i = 0; i < rows.size(); ++i) {
          // flat+read runs the verified flat call; one-call is a floor over other data.
          const std::string& name = rows[i].name;
          const std::map<std::string, std::size_t> check_of = {{"linear", 0},    {"stream", 1},
                                                               {"auto", 2},      {"flat", 3},
                                                               {"flat+read", 3}, {"fused", 4}};
          const bool verified =
              name == "native" || name == "one-call" || verification.passed(check_of.at(name));
          Record r{"elementwise",
                   name,
                   size,
                   t[i].mean_ms,
                   t[i].std_ms,
                   std::nullopt,
                   t[0].mean_ms / t[i].mean_ms,
                   verified,
                   measured.reps};
          r.extra = {{"op", op}, {"leaves", n}, {"elements", e}, {"calls", measured.calls[i]}};
          // Bytes the op must move: x and y read, the result written, once each.
          const double bytes = 3.0 * double(n) * double(e) * double(c10::elementSize(cfg.dtype));
          r.gbps = bytes / (t[i].mean_ms * 1e6);
          out.records.push_back(std::move(r));
        }
      }
    }
  progress.clear();
  if (!per_leaf.empty())
    out.notes.push_back(fmt::format(
        "flat at {}: ran per leaf (each result buffer over 32 MiB would be page-faulted in on "
        "every call; under stream(fused) or with the caching allocator it stays flat)",
        fmt::join(per_leaf, ", ")));
  out.notes.push_back(
      fmt::format("each sample is the mean of back-to-back calls that take at least {} ms "
                  "(JSON `calls`; each call replaces the previous call's result, freeing it "
                  "inside the clock as a loop does)",
                  kMinSampleMs));
  out.notes.push_back(
      "GB/s: 3*N*E*element bytes (x and y read, the result written once) / mean time; "
      "flat: consolidated trees, one ATen call per buffer, result leaves not yet made; "
      "flat+read: the same, then every result leaf made once; fused: the same lambda through "
      "fuse() on the consolidated trees under automatic (leaf-major; float32 add and chain in one "
      "pass, 8 KiB blocks, no ATen call); one-call: "
      "one ATen call over a tensor of all N*E elements (the floor, nothing to verify)");
  out.config = {{"leaves", cfg.elementwise_leaves},
                {"elements", cfg.elementwise_elements},
                {"ops", {"add", "(x*2+y).sigmoid_()"}},
                {"reps_used", reps_used}};
  return out;
}

}  // namespace treetensor::bench
