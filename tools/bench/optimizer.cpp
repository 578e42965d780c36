// One Adam step over the trainable parameters of a real model (torchvision shapes), under every
// strategy, side by side.
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>

#include "treetensor/io/checkpoint.hpp"
#include "treetensor/io/safetensors.hpp"
#include "treetensor/runtime/dispatch.hpp"
#include "treetensor/runtime/stream.hpp"
#include "treetensor/tensor/consolidate.hpp"
#include "treetensor/tensor/optim.hpp"
#include "workloads.hpp"

namespace treetensor::bench {
namespace {

using treetensor::TensorTree;
using treetensor::TreeTensor;

// The four trees of an Adam step (same structure, the flat lists' tensors).
struct AdamTrees {
  TreeTensor params;
  TensorTree grads;
  TreeTensor exp_avg, exp_avg_sq;
};

}  // namespace

// Buffers that an optimizer never updates.
bool is_buffer(const std::string& key) {
  for (const char* suffix : {".running_mean", ".running_var", ".num_batches_tracked"})
    if (key.ends_with(suffix) || key == suffix + 1) return true;
  return false;
}

ModelShapes load_model(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw std::runtime_error("cannot open model shapes file '" + path + "'");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error("model shapes file '" + path + "' is not valid JSON: " + e.what());
  }
  ModelShapes m;
  try {
    m.name = j.at("model").get<std::string>();
    const auto& tensors = j.at("tensors");
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      std::string key = tensors[i].at("key").get<std::string>();
      if (is_buffer(key)) {
        ++m.skipped;
        continue;
      }
      auto shape = tensors[i].at("shape").get<std::vector<std::int64_t>>();
      std::int64_t numel = 1;
      for (auto d : shape) numel *= d;
      m.elements += numel;
      m.trainable.push_back({std::move(key), std::move(shape)});
    }
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error("model shapes file '" + path +
                             "' does not match {\"model\", \"tensors\": [{\"key\", \"shape\", "
                             "\"dtype\"}]}: " +
                             e.what());
  }
  return m;
}

namespace {

// The trainable tensors of a checkpoint file: floating leaves that are not buffers, at their
// dotted paths, starting from their stored values.
ModelShapes load_checkpoint(const std::string& path) {
  const bool safetensors = std::filesystem::path(path).extension() == ".safetensors";
  const TreeTensor tensors =
      safetensors ? io::load_safetensors(path).tensors : io::load_tensors(path);
  ModelShapes m;
  m.name = std::filesystem::path(path).filename().string();
  const auto flat = tree::flatten(tensors);
  const auto paths = flat.spec.paths();
  for (std::size_t i = 0; i < paths.size(); ++i) {
    std::string key;
    for (const auto& k : paths[i]) key += (key.empty() ? "" : ".") + k;
    if (is_buffer(key) || !at::isFloatingType(flat.leaves[i].scalar_type())) {
      ++m.skipped;
      continue;
    }
    m.elements += flat.leaves[i].numel();
    m.trainable.push_back({std::move(key), flat.leaves[i].sizes().vec()});
    m.values.push_back(flat.leaves[i]);
  }
  if (m.trainable.empty())
    throw std::runtime_error("checkpoint '" + path + "' holds no floating tensor to optimise");
  return m;
}

// Parameters, gradients and both moments, as flat lists (native, foreach) and as trees built
// from the same tensors (no copies).
struct AdamState {
  std::vector<std::string> keys;
  std::vector<at::Tensor> p, g, m, v;
  AdamTrees trees;

  void build_trees() {
    auto tree_of = [this](const std::vector<at::Tensor>& xs) {
      std::vector<std::pair<std::string, at::Tensor>> pairs;
      for (std::size_t i = 0; i < keys.size(); ++i) pairs.emplace_back(keys[i], xs[i]);
      return tree::unflatten(pairs);
    };
    trees = {tree_of(p), tree_of(g), tree_of(m), tree_of(v)};
  }

  // A copy whose four trees are consolidated (consolidate.hpp): one buffer each.
  AdamState consolidated() const {
    AdamState c{keys, {}, {}, {}, {}, {}};
    c.trees = {treetensor::consolidate(trees.params), treetensor::consolidate(trees.grads),
               treetensor::consolidate(trees.exp_avg), treetensor::consolidate(trees.exp_avg_sq)};
    c.p = tree::flatten(c.trees.params).leaves;
    c.g = tree::flatten(c.trees.grads).leaves;
    c.m = tree::flatten(c.trees.exp_avg).leaves;
    c.v = tree::flatten(c.trees.exp_avg_sq).leaves;
    return c;
  }

  AdamState clone() const {
    AdamState c{keys, {}, {}, {}, {}, {}};
    for (std::size_t i = 0; i < keys.size(); ++i) {
      c.p.push_back(p[i].clone());
      c.g.push_back(g[i].clone());
      c.m.push_back(m[i].clone());
      c.v.push_back(v[i].clone());
    }
    c.build_trees();
    return c;
  }
};

AdamState make_state(const ModelShapes& model, const Config& cfg) {
  AdamState s;
  auto make = [&](const std::vector<std::int64_t>& shape, double scale, bool positive) {
    at::Tensor x = positive ? at::rand(shape) : at::randn(shape);
    return (x * scale).to(cfg.device, cfg.dtype);
  };
  for (std::size_t i = 0; i < model.trainable.size(); ++i) {
    const auto& t = model.trainable[i];
    s.keys.push_back(t.key);
    s.p.push_back(model.values.empty()
                      ? make(t.shape, 0.05, false)
                      : model.values[i].detach().to(cfg.device, cfg.dtype).clone());
    s.g.push_back(make(t.shape, 1e-2, false));
    s.m.push_back(make(t.shape, 1e-3, false));
    s.v.push_back(make(t.shape, 1e-5, true));  // a second moment is never negative
  }
  s.build_trees();
  return s;
}

// torch::optim::Adam's per-parameter arithmetic, as a hand-written LibTorch optimizer does it.
void adam_native(AdamState& s, std::int64_t step, const AdamSettings& o) {
  const double bc1 = 1 - std::pow(o.beta1, double(step));
  const double bc2_sqrt = std::sqrt(1 - std::pow(o.beta2, double(step)));
  for (std::size_t i = 0; i < s.p.size(); ++i) {
    at::Tensor grad = s.g[i];
    if (o.weight_decay != 0) grad = grad.add(s.p[i], o.weight_decay);
    s.m[i].mul_(o.beta1).add_(grad, 1 - o.beta1);
    s.v[i].mul_(o.beta2).addcmul_(grad, grad, 1 - o.beta2);
    at::Tensor denom = (s.v[i].sqrt() / bc2_sqrt).add_(o.eps);
    s.p[i].addcdiv_(s.m[i], denom, -o.lr / bc1);
  }
}

// PyTorch's multi-tensor Adam (torch.optim.Adam(foreach=True)): at::_foreach_* over the lists.
void adam_foreach(AdamState& s, std::int64_t step, const AdamSettings& o) {
  const double bc1 = 1 - std::pow(o.beta1, double(step));
  const double bc2_sqrt = std::sqrt(1 - std::pow(o.beta2, double(step)));
  std::vector<at::Tensor> grads =
      o.weight_decay != 0 ? at::_foreach_add(s.g, s.p, o.weight_decay) : s.g;
  at::_foreach_mul_(s.m, o.beta1);
  at::_foreach_add_(s.m, grads, 1 - o.beta1);
  at::_foreach_mul_(s.v, o.beta2);
  at::_foreach_addcmul_(s.v, grads, grads, 1 - o.beta2);
  std::vector<at::Tensor> denom = at::_foreach_sqrt(s.v);
  at::_foreach_div_(denom, bc2_sqrt);
  at::_foreach_add_(denom, o.eps);
  at::_foreach_addcdiv_(s.p, s.m, denom, -o.lr / bc1);
}

// TreeTensor's Adam step (tree ops, so the stream mode applies to every stage).
void adam_tree(AdamState& s, std::int64_t step, const AdamSettings& o, runtime::StreamMode mode) {
  const auto options = treetensor::AdamOptions()
                           .lr(o.lr)
                           .betas(o.beta1, o.beta2)
                           .eps(o.eps)
                           .weight_decay(o.weight_decay);
  runtime::StreamGuard guard(mode);
  treetensor::adam_step(s.trees.params, s.trees.grads, s.trees.exp_avg, s.trees.exp_avg_sq, step,
                        options);
}

// The single-pass kernel over the consolidated buffers (state must be consolidated()), its
// pieces spread over lanes as stream(automatic) decides.
void adam_flat(AdamState& s, std::int64_t step, const AdamSettings& o) {
  const auto options = treetensor::AdamOptions()
                           .lr(o.lr)
                           .betas(o.beta1, o.beta2)
                           .eps(o.eps)
                           .weight_decay(o.weight_decay);
  runtime::StreamGuard guard(runtime::StreamMode::of(runtime::automatic));
  treetensor::adam_step_single_pass(s.trees.params, s.trees.grads, s.trees.exp_avg,
                                    s.trees.exp_avg_sq, step, options);
}

// The memory-bandwidth floor of one Adam step: one streaming pass reading p, g, m, v (16 bytes
// per float32 element) and writing p, m, v (12 bytes), over the same consolidated buffers and
// pieces, spread over lanes as adam_flat is.
void bandwidth_floor(AdamState& s, std::int64_t, const AdamSettings&) {
  const auto p = treetensor::consolidated_groups(s.trees.params),
             g = treetensor::consolidated_groups(s.trees.grads),
             m = treetensor::consolidated_groups(s.trees.exp_avg),
             v = treetensor::consolidated_groups(s.trees.exp_avg_sq);
  runtime::StreamGuard guard(runtime::StreamMode::of(runtime::automatic));
  for (std::size_t k = 0; k < p.size(); ++k) {
    const int64_t n = p[k].buffer.numel(), piece = 1 << 18;
    const std::size_t pieces = std::size_t((n + piece - 1) / piece);
    auto run = [&](std::size_t i) {
      AT_DISPATCH_FLOATING_TYPES_AND2(
          at::kHalf, at::kBFloat16, p[k].buffer.scalar_type(), "bandwidth_floor", [&] {
            scalar_t *pp = p[k].buffer.data_ptr<scalar_t>(), *mp = m[k].buffer.data_ptr<scalar_t>(),
                     *vp = v[k].buffer.data_ptr<scalar_t>();
            const scalar_t* gp = g[k].buffer.data_ptr<scalar_t>();
            for (int64_t j = int64_t(i) * piece, end = std::min(n, j + piece); j < end; ++j) {
              pp[j] += gp[j];
              mp[j] += gp[j];
              vp[j] += gp[j];
            }
          });
    };
    auto label = [](std::size_t i) { return "piece " + std::to_string(i); };
    auto cost = [&](std::size_t) {
      return runtime::LeafCost{double(3 * piece), 28.0 * double(piece)};
    };
    runtime::LeafCall call;
    call.op = "bandwidth_floor";
    call.leaves = pieces;
    call.run = run;
    call.label = label;
    call.cost = cost;
    runtime::run(call);
  }
}

using Step = std::function<void(AdamState&, std::int64_t)>;

std::vector<std::pair<std::string, Step>> strategies(const Config& cfg) {
  const AdamSettings o = cfg.adam;
  auto tree = [o](runtime::StreamMode mode) {
    return [o, mode](AdamState& s, std::int64_t step) { adam_tree(s, step, o, mode); };
  };
  return {{"native", [o](AdamState& s, std::int64_t step) { adam_native(s, step, o); }},
          {"flat", [o](AdamState& s, std::int64_t step) { adam_flat(s, step, o); }},
          {"limit", [o](AdamState& s, std::int64_t step) { bandwidth_floor(s, step, o); }},
          {"foreach", [o](AdamState& s, std::int64_t step) { adam_foreach(s, step, o); }},
          {"linear", tree(runtime::StreamMode::of(1))},
          {"stream", tree(runtime::StreamMode::of(cfg.lanes))},
          {"auto", tree(runtime::StreamMode::of(runtime::automatic))},
          {"auto-consolidated", tree(runtime::StreamMode::of(runtime::automatic))},
          {"fused", tree(runtime::StreamMode::of(runtime::fused))}};
}

// The updated parameters by key, read through the trees (a tree step may replace leaves).
TensorMap params_by_key(const AdamState& s) {
  TensorMap out;
  auto flat = tree::flatten_refs(s.trees.params);
  auto paths = flat.spec.paths();
  for (std::size_t i = 0; i < paths.size(); ++i) out.emplace(paths[i].str(), *flat.leaves[i]);
  return out;
}

// The rows that run on consolidated trees: the single-pass kernel, and the at:: tree step under
// stream(automatic), which runs each stage as one call per buffer (flat execution).
bool on_consolidated(const std::string& row) {
  return row == "flat" || row == "auto-consolidated";
}

constexpr std::int64_t kVerifyStep = 5;  // a step past the first, so bias correction matters

}  // namespace

WorkloadResult run_optimizer(const Config& cfg, Progress& progress) {
  const ModelShapes model =
      cfg.checkpoint.empty() ? load_model(cfg.model_path) : load_checkpoint(cfg.checkpoint);
  const std::string stage = fmt::format("optimizer {} ({} tensors, {} elements)", model.name,
                                        model.trainable.size(), model.elements);
  progress.update(stage, "making the four trees");
  at::manual_seed(cfg.seed);
  AdamState state = make_state(model, cfg);
  const auto rows = strategies(cfg);

  progress.update(stage, "verifying against native");
  WorkloadResult out;
  AdamState native = state.clone();
  rows[0].second(native, kVerifyStep);
  const TensorMap reference = params_by_key(native);
  native = {};
  // The at:: strategies run the same arithmetic per element: bitwise (DESIGN.md §5). The
  // single-pass kernel rounds where ATen may fuse a multiply-add: the Adam step's rounding
  // bound (rounding.hpp). `limit` computes no Adam step: it is a floor, not verified.
  std::string current;
  std::map<std::string, at::Tensor> bounds;
  const auto inputs = params_by_key(state);
  std::map<std::string, std::size_t> index;
  for (std::size_t i = 0; i < state.keys.size(); ++i) index[state.keys[i]] = i;
  Verification verification(
      model.name,
      [&](const std::string& key, const at::Tensor& got, const at::Tensor& want) {
        if (current != "flat") return rounding::compare_bitwise(got, want);
        const std::size_t i = index.at(key);
        const rounding::AdamStepInputs in{state.p[i],     state.g[i],   state.m[i],
                                          state.v[i],     cfg.adam.lr,  cfg.adam.beta1,
                                          cfg.adam.beta2, cfg.adam.eps, cfg.adam.weight_decay,
                                          kVerifyStep};
        return rounding::compare_within(got, want, rounding::adam_step_bound(in));
      },
      cfg.perturb_row);
  for (const auto& [name, step] : rows) {
    if (name == "limit") continue;
    current = name;
    AdamState trial = on_consolidated(name) ? state.consolidated() : state.clone();
    step(trial, kVerifyStep);
    verification.check(name, reference, params_by_key(trial), reference.size());
  }
  out.notes.push_back(
      "limit: one streaming pass, 16 bytes read and 12 written per element, no Adam "
      "arithmetic (the memory-bandwidth floor; nothing to verify); GB/s: 7 * elements * "
      "element bytes (p, g, m, v read, p, m, v written once) / mean time");
  out.all_verified = verification.all_passed();
  out.notes.push_back(verification.note());

  // Timed steps share one state (flat and limit one consolidated copy each); each run advances
  // the step count.
  auto flat = std::make_shared<AdamState>(state.consolidated());
  auto floor = std::make_shared<AdamState>(state.consolidated());
  auto auto_flat = std::make_shared<AdamState>(state.consolidated());
  auto shared = std::make_shared<AdamState>(std::move(state));
  auto step_count = std::make_shared<std::int64_t>(0);
  std::vector<Candidate> candidates;
  for (const auto& [name, step] : rows) {
    auto s = name == "flat"                ? flat
             : name == "limit"             ? floor
             : name == "auto-consolidated" ? auto_flat
                                           : shared;
    candidates.push_back({name, [s, step_count, step] { step(*s, ++*step_count); }, {}});
  }
  const RoundRobin measured =
      time_round_robin(candidates, rep_plan(cfg), device_synchronizer(cfg.device), progress, stage);
  const auto& timings = measured.timings;
  progress.clear();
  for (std::size_t i = 0, checked = 0; i < rows.size(); ++i) {
    const bool floor_row = rows[i].first == "limit";
    Record r{"optimizer",
             rows[i].first,
             model.name,
             timings[i].mean_ms,
             timings[i].std_ms,
             std::nullopt,
             timings[0].mean_ms / timings[i].mean_ms,
             floor_row || verification.passed(checked),
             measured.reps};
    // Bytes a step must move: p, g, m, v read and p, m, v written, once each.
    r.gbps = 7.0 * double(model.elements) * double(c10::elementSize(cfg.dtype)) /
             (timings[i].mean_ms * 1e6);
    out.records.push_back(std::move(r));
    if (!floor_row) ++checked;
  }

  out.config = {{"model", model.name},
                {"model_file", cfg.checkpoint.empty() ? cfg.model_path : cfg.checkpoint},
                {"trainable_tensors", model.trainable.size()},
                {"trainable_elements", model.elements},
                {"skipped_buffers", model.skipped},
                {"reps_used", {{model.name, measured.reps}}},
                {"adam",
                 {{"lr", cfg.adam.lr},
                  {"beta1", cfg.adam.beta1},
                  {"beta2", cfg.adam.beta2},
                  {"eps", cfg.adam.eps},
                  {"weight_decay", cfg.adam.weight_decay},
                  {"verify_step", kVerifyStep}}}};
  return out;
}

}  // namespace treetensor::bench
