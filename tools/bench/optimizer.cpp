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
#include "treetensor/runtime/stream.hpp"
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

struct ParamShape {
  std::string key;
  std::vector<std::int64_t> shape;
};

struct ModelShapes {
  std::string name;
  std::vector<ParamShape> trainable;
  std::vector<at::Tensor> values;  ///< a checkpoint's stored parameters (empty for shape files)
  std::size_t skipped = 0;
  std::int64_t elements = 0;
};

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

// The trainable tensors of a checkpoint file: floating leaves that are not buffers, at their
// dotted paths, starting from their stored values.
ModelShapes load_checkpoint(const std::string& path) {
  const bool safetensors = std::filesystem::path(path).extension() == ".safetensors";
  const TreeTensor tensors = safetensors ? io::load_safetensors(path).tensors : io::load_tensors(path);
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
    s.p.push_back(model.values.empty() ? make(t.shape, 0.05, false)
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

using Step = std::function<void(AdamState&, std::int64_t)>;

std::vector<std::pair<std::string, Step>> strategies(const Config& cfg) {
  const AdamSettings o = cfg.adam;
  auto tree = [o](runtime::StreamMode mode) {
    return [o, mode](AdamState& s, std::int64_t step) { adam_tree(s, step, o, mode); };
  };
  return {{"native", [o](AdamState& s, std::int64_t step) { adam_native(s, step, o); }},
          {"foreach", [o](AdamState& s, std::int64_t step) { adam_foreach(s, step, o); }},
          {"linear", tree(runtime::StreamMode::of(1))},
          {"stream", tree(runtime::StreamMode::of(cfg.lanes))},
          {"auto", tree(runtime::StreamMode::of(runtime::automatic))},
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

constexpr std::int64_t kVerifyStep = 5;  // a step past the first, so bias correction matters

}  // namespace

WorkloadResult run_optimizer(const Config& cfg, Progress& progress) {
  const ModelShapes model = cfg.checkpoint.empty() ? load_model(cfg.model_path) : load_checkpoint(cfg.checkpoint);
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
  // Every strategy runs the same elementwise arithmetic per element: bitwise (DESIGN.md §5).
  Verification verification(
      model.name,
      [](const std::string&, const at::Tensor& got, const at::Tensor& want) {
        return rounding::compare_bitwise(got, want);
      },
      cfg.perturb_row);
  for (const auto& [name, step] : rows) {
    AdamState trial = state.clone();
    step(trial, kVerifyStep);
    verification.check(name, reference, params_by_key(trial), reference.size());
  }
  out.all_verified = verification.all_passed();
  out.notes.push_back(verification.note());

  // Timed steps share one state; each run advances the step count.
  auto shared = std::make_shared<AdamState>(std::move(state));
  auto step_count = std::make_shared<std::int64_t>(0);
  std::vector<Candidate> candidates;
  for (const auto& [name, step] : rows)
    candidates.push_back({name, [shared, step_count, step] { step(*shared, ++*step_count); }, {}});
  const RoundRobin measured =
      time_round_robin(candidates, rep_plan(cfg), device_synchronizer(cfg.device), progress, stage);
  const auto& timings = measured.timings;
  progress.clear();
  for (std::size_t i = 0; i < rows.size(); ++i)
    out.records.push_back({"optimizer", rows[i].first, model.name, timings[i].mean_ms,
                           timings[i].std_ms, std::nullopt, timings[0].mean_ms / timings[i].mean_ms,
                           verification.passed(i), measured.reps});

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
