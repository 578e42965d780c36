// Reductions: per-leaf partials through the runtime, then one small combining op.
#include "treetensor/tensor/reduce.hpp"

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>

#include <cmath>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>

#include "tensor/flat.hpp"
#include "tensor/leafwise.hpp"
#include "tensor/pending.hpp"

namespace treetensor {
namespace {

using detail::map1;
using detail::map1_owned;
using detail::multi1;

// Leaf results in flatten order; on a consolidated tree (flat.hpp), one result per buffer
// group over its leaf elements instead (every reduction here combines partials of any split).
template <class F>
std::vector<at::Tensor> partials(std::string_view op, const TensorTree& t, F&& f) {
  if (t.empty()) return {};
  if (const ConsolidatedTree* c = detail::flat_reducible(t)) {
    std::vector<at::Tensor> out;
    for (std::size_t g = 0; g < c->buffers().size(); ++g)
      out.push_back(f(detail::leaf_elements(*c, g)));
    return out;
  }
  return tree::flatten(map1(op, t, f)).leaves;
}

// The defined partials, cast to their promoted dtype and stacked (autograd follows).
at::Tensor stacked(std::vector<at::Tensor> parts) {
  std::erase_if(parts, [](const at::Tensor& p) { return !p.defined(); });
  if (parts.empty()) return {};
  at::ScalarType type = parts[0].scalar_type();
  for (const auto& p : parts) type = at::promoteTypes(type, p.scalar_type());
  for (auto& p : parts) p = p.to(type);
  return at::stack(parts);
}

int64_t total_numel(const TensorTree& t) {
  if (const ConsolidatedTree* c = consolidated_source(t)) return c->layout().total_numel();
  int64_t n = 0;
  for (const at::Tensor* x : tree::flatten_refs(t).leaves) n += x->numel();
  return n;
}

// torch's promotion of f(dtype) over the leaves' dtypes (the buffers' on a consolidated tree,
// whose leaves have them), or nullopt without leaves; `nonempty`: over those with elements.
template <class F>
std::optional<at::ScalarType> promoted(const TensorTree& t, F f, bool nonempty = false) {
  std::optional<at::ScalarType> out;
  auto take = [&](const at::Tensor& x) {
    if (nonempty && x.numel() == 0) return;
    const at::ScalarType d = f(x.scalar_type());
    out = out ? at::promoteTypes(*out, d) : d;
  };
  if (const ConsolidatedTree* c = consolidated_source(t)) {
    for (const at::Tensor& b : c->buffers()) take(b);
  } else {
    for (const at::Tensor* x : tree::flatten_refs(t).leaves) take(*x);
  }
  return out;
}

at::ScalarType same(at::ScalarType d) {
  return d;
}
at::ScalarType summed(at::ScalarType d) {
  return at::isIntegralType(d, /*includeBool=*/true) ? at::kLong : d;
}

// The dtype torch.cat of the leaves would have, which mean and std need floating or complex
// (as torch's of all elements: int64 and float32 leaves promote to float32; int64 alone fails).
at::ScalarType require_floating(std::string_view op, const TensorTree& t) {
  const auto type = promoted(t, same);
  if (!type) return at::get_default_dtype_as_scalartype();
  if (at::isFloatingType(*type) || at::isComplexType(*type)) return *type;
  const auto flat = tree::flatten_refs(t);
  TORCH_CHECK(false, op, ": needs floating or complex leaves; all are integral or bool (leaf '",
              flat.spec.paths()[0].describe(), "' is ",
              c10::toString(flat.leaves[0]->scalar_type()), ")");
}

// Every element of every leaf as one 1-D tensor (promoted dtype; the default dtype for an
// empty tree): the reference that tree-level reductions agree with.
at::Tensor all_elements(const TensorTree& t) {
  std::vector<at::Tensor> flat;
  for (const at::Tensor* x : tree::flatten_refs(t).leaves) flat.push_back(x->reshape({-1}));
  if (flat.empty()) return at::empty({0}, at::TensorOptions(at::get_default_dtype()));
  return at::cat(flat);
}

at::Tensor default_scalar(double v) {
  return at::full({}, v, at::TensorOptions(at::get_default_dtype()));
}

at::Tensor extreme(std::string_view op, const TensorTree& t, bool is_min) {
  auto s = stacked(partials(op, t, [&](const at::Tensor& x) {
    return x.numel() == 0 ? at::Tensor() : (is_min ? x.min() : x.max());
  }));
  if (!s.defined())
    throw std::invalid_argument(std::string(op) + ": the tree has no elements (" +
                                std::to_string(t.leaf_count()) + " leaves)");
  return is_min ? s.min() : s.max();
}

}  // namespace

// Sums, means and deviations accumulate in the result dtype's op-math type (float32 for float16
// and bfloat16, as ATen's reductions do) and are rounded to the result dtype once, at the end:
// leaf partials rounded to float16 lost 2049 + 1 and overflowed past 65504.
at::Tensor sum(const TensorTree& t) {
  // The dtype at::sum of torch.cat of the leaves has: a float16 leaf beside a float32 one is
  // summed in float32; integral and bool leaves in int64.
  const auto type = promoted(t, summed);
  if (!type) return default_scalar(0.0);
  const at::ScalarType acc = at::toOpMathType(*type);
  return stacked(partials("sum", t, [&](const at::Tensor& x) { return x.sum(acc); }))
      .sum()
      .to(*type);
}

std::optional<at::ScalarType> reduction_dtype(Reduction r, const TensorTree& t) {
  switch (r) {
    case Reduction::all:
    case Reduction::any:
      return at::kBool;
    case Reduction::sum:
      return promoted(t, summed);
    case Reduction::mean:
      return promoted(t, same);
    case Reduction::std: {
      const auto type = promoted(t, same);
      return type ? std::optional(c10::toRealValueType(*type)) : std::nullopt;
    }
    case Reduction::min:
    case Reduction::max:
      return promoted(t, same, /*nonempty=*/true);
  }
  throw std::invalid_argument("reduction_dtype: unknown reduction");
}

namespace {
// The tree-level mean in op-math type `acc`, unrounded (std's centre); NaN without elements.
at::Tensor mean_in(const TensorTree& t, at::ScalarType acc) {
  auto s = stacked(partials("mean", t, [acc](const at::Tensor& x) { return x.sum(acc); }));
  if (!s.defined()) return default_scalar(std::numeric_limits<double>::quiet_NaN());
  return s.sum() / static_cast<double>(total_numel(t));
}
}  // namespace

at::Tensor mean(const TensorTree& t) {
  const at::ScalarType type = require_floating("mean", t);
  const at::Tensor m = mean_in(t, at::toOpMathType(type));
  return t.leaf_count() == 0 ? m : m.to(type);
}

at::Tensor all(const TensorTree& t) {
  auto s = stacked(partials("all", t, [](const at::Tensor& x) { return x.all().to(at::kBool); }));
  return s.defined() ? s.all() : at::ones({}, at::kBool);
}

at::Tensor any(const TensorTree& t) {
  auto s = stacked(partials("any", t, [](const at::Tensor& x) { return x.any().to(at::kBool); }));
  return s.defined() ? s.any() : at::zeros({}, at::kBool);
}

at::Tensor min(const TensorTree& t) {
  return extreme("min", t, true);
}
at::Tensor max(const TensorTree& t) {
  return extreme("max", t, false);
}

at::Tensor std(const TensorTree& t, bool unbiased) {
  const at::ScalarType type = require_floating("std", t);
  const int64_t n = total_numel(t);
  const int64_t dof = n - (unbiased ? 1 : 0);
  // No degree of freedom: NaN as torch gives it for all elements (the leaves' promoted dtype;
  // the default dtype without leaves).
  if (dof <= 0) return all_elements(t).std(unbiased);
  const at::ScalarType acc = at::toOpMathType(type);
  const at::Tensor m = mean_in(t, acc);
  // |x - m|^2 in op-math of the promoted dtype (as torch's std of torch.cat of the leaves: a
  // bool or float16 leaf beside float32 ones is taken as float32); real for complex leaves too.
  auto s = stacked(partials("std", t, [&](const at::Tensor& x) {
    const at::Tensor d = x.to(acc) - m;
    return (d.is_complex() ? d.abs() : d).square().sum();
  }));
  return (s.sum() / static_cast<double>(dof)).sqrt().to(c10::toRealValueType(type));
}

at::Tensor norm(const TensorTree& t, double p) {
  // Finite p != 0: the p-norm of the leaf p-norms is the p-norm of all elements. The other
  // three are not of that form: p = 0 counts nonzero elements (a sum of leaf counts), and
  // p = +-inf is the largest / smallest |x| over the elements that exist (a 0-element leaf
  // has none, so it must not contribute its empty-norm value).
  const bool count = p == 0, extreme = std::isinf(p);
  auto s = stacked(partials("norm", t, [&](const at::Tensor& x) {
    return extreme && x.numel() == 0 ? at::Tensor() : x.norm(p);
  }));
  if (!s.defined()) return all_elements(t).norm(p);  // no element: whatever torch says
  if (count) return s.sum();
  if (extreme) return p > 0 ? s.max() : s.min();
  return s.norm(p);
}

at::Tensor masked_select(const TensorTree& t, const Operand& mask) {
  auto parts = tree::flatten(leaf_masked_select(t, mask)).leaves;
  if (parts.empty()) return at::empty({0}, at::TensorOptions(at::get_default_dtype()));
  at::ScalarType type = parts[0].scalar_type();
  for (const auto& p : parts) type = at::promoteTypes(type, p.scalar_type());
  for (auto& p : parts) p = p.to(type);
  return at::cat(parts);
}

TreeTensor leaf_sum(const TensorTree& t) {
  return map1_owned("sum", t, [](const at::Tensor& x) { return x.sum(); });
}
TreeTensor leaf_sum(const TensorTree& t, at::IntArrayRef dim, bool keepdim) {
  return map1_owned(
      "sum", t, [dim = dim.vec(), keepdim](const at::Tensor& x) { return x.sum(dim, keepdim); });
}
TreeTensor leaf_mean(const TensorTree& t) {
  return map1_owned("mean", t, [](const at::Tensor& x) { return x.mean(); });
}
TreeTensor leaf_mean(const TensorTree& t, at::IntArrayRef dim, bool keepdim) {
  return map1_owned(
      "mean", t, [dim = dim.vec(), keepdim](const at::Tensor& x) { return x.mean(dim, keepdim); });
}
TreeTensor leaf_all(const TensorTree& t) {
  return map1_owned("all", t, [](const at::Tensor& x) { return x.all(); });
}
TreeTensor leaf_all(const TensorTree& t, int64_t dim, bool keepdim) {
  return map1_owned("all", t, [dim, keepdim](const at::Tensor& x) { return x.all(dim, keepdim); });
}
TreeTensor leaf_any(const TensorTree& t) {
  return map1_owned("any", t, [](const at::Tensor& x) { return x.any(); });
}
TreeTensor leaf_any(const TensorTree& t, int64_t dim, bool keepdim) {
  return map1_owned("any", t, [dim, keepdim](const at::Tensor& x) { return x.any(dim, keepdim); });
}
TreeTensor leaf_min(const TensorTree& t) {
  return map1_owned("min", t, [](const at::Tensor& x) { return x.min(); });
}
TreeTensor leaf_max(const TensorTree& t) {
  return map1_owned("max", t, [](const at::Tensor& x) { return x.max(); });
}

namespace {
std::tuple<TreeTensor, TreeTensor> values_indices(std::vector<TreeTensor> trees,
                                                  const TensorTree& t) {
  if (trees.empty()) return {TreeTensor(t), TreeTensor(t)};  // no leaves: two empty trees
  return {std::move(trees[0]), std::move(trees[1])};
}
}  // namespace

std::tuple<TreeTensor, TreeTensor> leaf_min(const TensorTree& t, int64_t dim, bool keepdim) {
  return values_indices(multi1("min", t,
                               [&](const at::Tensor& x) {
                                 auto [v, i] = x.min(dim, keepdim);
                                 return std::vector<at::Tensor>{v, i};
                               }),
                        t);
}
std::tuple<TreeTensor, TreeTensor> leaf_max(const TensorTree& t, int64_t dim, bool keepdim) {
  return values_indices(multi1("max", t,
                               [&](const at::Tensor& x) {
                                 auto [v, i] = x.max(dim, keepdim);
                                 return std::vector<at::Tensor>{v, i};
                               }),
                        t);
}
TreeTensor leaf_std(const TensorTree& t, bool unbiased) {
  return map1_owned("std", t, [unbiased](const at::Tensor& x) { return x.std(unbiased); });
}
TreeTensor leaf_std(const TensorTree& t, at::IntArrayRef dim, bool unbiased, bool keepdim) {
  return map1_owned("std", t, [dim = dim.vec(), unbiased, keepdim](const at::Tensor& x) {
    return x.std(dim, unbiased, keepdim);
  });
}
TreeTensor leaf_norm(const TensorTree& t, double p) {
  return map1_owned("norm", t, [p](const at::Tensor& x) { return x.norm(p); });
}
TreeTensor leaf_masked_select(const TensorTree& t, const Operand& mask) {
  const Operand args[] = {Operand(t), mask};
  return detail::map_owned(
      detail::CallOptions{"masked_select"}, args,
      [](const detail::LeafArgs& x) { return at::masked_select(x.t(0), x.t(1)); });
}

// ---- methods ---------------------------------------------------------------------------------
at::Tensor TreeTensor::sum() const {
  return treetensor::sum(*this);
}
at::Tensor TreeTensor::mean() const {
  return treetensor::mean(*this);
}
at::Tensor TreeTensor::all() const {
  return treetensor::all(*this);
}
at::Tensor TreeTensor::any() const {
  return treetensor::any(*this);
}
at::Tensor TreeTensor::min() const {
  return treetensor::min(*this);
}
at::Tensor TreeTensor::max() const {
  return treetensor::max(*this);
}
at::Tensor TreeTensor::std(bool unbiased) const {
  return treetensor::std(*this, unbiased);
}
at::Tensor TreeTensor::norm(double p) const {
  return treetensor::norm(*this, p);
}

}  // namespace treetensor
