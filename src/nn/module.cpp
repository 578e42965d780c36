// treetensor::nn::consolidate_module (DESIGN.md §21): a LibTorch module's tensors moved into
// consolidated buffers in place, the way treetensor.nn does it for Python modules.
#include "treetensor/nn/module.hpp"

#include <algorithm>
#include <stdexcept>
#include <tuple>
#include <unordered_map>
#include <utility>

#include <torch/nn/module.h>

#include "treetensor/tensor/consolidate.hpp"
#include "treetensor/tensor/construct.hpp"
#include "treetensor/tree/flatten.hpp"

namespace treetensor::nn {
namespace {

using Named = std::vector<std::pair<std::string, at::Tensor>>;

TensorTree nest(const Named& named) {
  TensorTree t;
  for (const auto& [name, value] : named) t.insert(name, TensorTree(value));
  return t;
}

// Meta tensors have no data, sparse and mkldnn ones no strided storage to view; two different
// tensors whose memory overlaps (one a slice of another) would be separated by consolidation. Views
// of one buffer that do not overlap (a module consolidated before) are fine.
void check_layout(const Named& named, const char* what) {
  using Span = std::tuple<std::int64_t, std::int64_t, const std::string*>;
  std::unordered_map<const void*, std::vector<Span>> spans;
  for (const auto& [name, t] : named) {
    if (t.is_meta())
      throw std::invalid_argument("treetensor::nn::consolidate_module: " + std::string(what) +
                                  " '" + name +
                                  "' is on the meta device (no data to consolidate): "
                                  "materialize the model first");
    if (t.layout() != at::kStrided)
      throw std::invalid_argument("treetensor::nn::consolidate_module: " + std::string(what) +
                                  " '" + name + "' has layout " + c10::str(t.layout()) +
                                  " (a consolidated buffer holds strided tensors only)");
    if (t.numel() == 0) continue;
    const std::int64_t lo = t.storage_offset() * t.element_size();
    spans[t.storage().unsafeGetStorageImpl()].emplace_back(lo, lo + t.numel() * t.element_size(),
                                                           &name);
  }
  for (auto& [storage, list] : spans) {
    std::sort(list.begin(), list.end());
    for (std::size_t i = 1; i < list.size(); ++i)
      if (std::get<0>(list[i]) < std::get<1>(list[i - 1]))
        throw std::invalid_argument(
            "treetensor::nn::consolidate_module: " + std::string(what) + "s '" +
            *std::get<2>(list[i - 1]) + "' and '" + *std::get<2>(list[i]) +
            "' share memory but are different tensors; consolidating would separate them "
            "(tie them as one tensor)");
  }
}

// The tensors of `named` moved into one buffer per (dtype, device): values copied once, then
// each tensor's data set to its view, so they stay the module's own tensors. consolidate() of
// their tree then recognises the layout and gives the property back without a copy.
TreeTensor consolidate_in_place(const Named& named) {
  if (named.empty()) return TreeTensor(TensorTree());
  Named copies;
  for (const auto& [name, t] : named) copies.emplace_back(name, t.detach());
  const TreeTensor views = consolidate(nest(copies));
  std::unordered_map<std::string, at::Tensor> view_of;
  const auto flat = tree::flatten(views);
  const auto paths = views.paths();
  for (std::size_t i = 0; i < paths.size(); ++i)
    view_of.emplace(paths[i].describe(), flat.leaves[i]);
  {
    at::NoGradGuard no_grad;
    for (const auto& [name, t] : named) t.set_data(view_of.at(name));
  }
  return consolidate(nest(named));
}

std::vector<at::Tensor> buffers_of(const TensorTree& t) {
  std::vector<at::Tensor> out;
  for (auto& g : consolidated_groups(t)) out.push_back(std::move(g.buffer));
  return out;
}

}  // namespace

void ModuleTree::check(std::size_t i) const {
  if (leaves_[i].data_ptr() != data_[i])
    throw std::runtime_error(
        "treetensor::nn: parameter '" + names_[i] +
        "' no longer lies in its consolidated buffer (the module was moved or converted, e.g. "
        "to(torch::kDouble), after consolidate_module): a step would train a stale copy; "
        "call consolidate_module again after moving the model");
  const at::Tensor& g = leaves_[i].grad();
  if (g.defined() && g.requires_grad())
    throw std::runtime_error("treetensor::nn: the gradient of '" + names_[i] +
                             "' has a graph (backward with create_graph); a consolidated "
                             "gradient buffer cannot hold one");
}

const TreeTensor& ModuleTree::grads() {
  at::NoGradGuard no_grad;
  for (std::size_t i = 0; i < leaves_.size(); ++i) {
    check(i);
    at::Tensor& g = leaves_[i].mutable_grad();
    if (g.defined() && g.unsafeGetTensorImpl() == grad_leaves_[i].unsafeGetTensorImpl()) continue;
    // module->zero_grad() left it undefined, or autograd or the user put another tensor there.
    if (g.defined())
      grad_leaves_[i].copy_(g.is_sparse() ? g.to_dense() : g);
    else
      grad_leaves_[i].zero_();
    g = grad_leaves_[i];
  }
  return grads_;
}

void ModuleTree::zero_grad() {
  for (std::size_t i = 0; i < leaves_.size(); ++i) check(i);  // all before anything changes
  for (std::size_t i = 0; i < leaves_.size(); ++i) leaves_[i].mutable_grad() = grad_leaves_[i];
  for (auto& b : grad_buffers) b.zero_();
}

ModuleTree consolidate_module(torch::nn::Module& module) {
  ModuleTree out;
  Named trainable, frozen, buffers;
  std::unordered_map<const void*, std::string> first;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const auto [it, fresh] = first.emplace(item.value().unsafeGetTensorImpl(), item.key());
    if (!fresh) {
      out.aliases.emplace(item.key(), it->second);
      continue;
    }
    (item.value().requires_grad() ? trainable : frozen).emplace_back(item.key(), item.value());
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true))
    buffers.emplace_back(item.key(), item.value());
  Named all = trainable;
  all.insert(all.end(), frozen.begin(), frozen.end());
  check_layout(all, "parameter");
  check_layout(buffers, "buffer");
  out.params = consolidate_in_place(trainable);
  out.frozen = consolidate_in_place(frozen);
  out.buffers = consolidate_in_place(buffers);
  out.param_buffers = buffers_of(out.params);
  out.leaves_ = tree::flatten(out.params).leaves;
  for (const auto& p : out.params.paths()) out.names_.push_back(p.describe());
  for (const auto& p : out.leaves_) out.data_.push_back(p.data_ptr());
  out.grads_ =
      out.leaves_.empty() ? TreeTensor(TensorTree()) : zeros_like(out.params, {}, consolidated);
  out.grad_leaves_ = tree::flatten(out.grads_).leaves;
  out.grad_buffers = buffers_of(out.grads_);
  for (std::size_t i = 0; i < out.leaves_.size(); ++i)
    out.leaves_[i].mutable_grad() = out.grad_leaves_[i];
  return out;
}

}  // namespace treetensor::nn
