// The leaf-wise ops: each is a few lines handing a leaf kernel (and, where one exists in both
// LibTorch 1.13 and 2.x, a batched at::_foreach_* or bmm form) to the dispatch core.
#include "treetensor/tensor/ops.hpp"

#include "tensor/flat.hpp"
#include "tensor/fuse_kernels.hpp"
#include "tensor/leafwise.hpp"
#include "tensor/pending.hpp"

#include <ATen/ATen.h>

#include <algorithm>
#include <optional>
#include <string_view>

namespace treetensor {
namespace {

using detail::CallOptions;
using detail::elementwise;
using detail::FusedArgs;
using detail::integer_safe;
using detail::LeafArgs;
using detail::map1;
using detail::map1_owned;
using detail::map_owned;
using detail::multi1;
using detail::update1;
using detail::update1_owned;
using detail::update_owned;

// ---- unary -----------------------------------------------------------------------------------
using Kernel1 = at::Tensor (*)(const at::Tensor&);
using Update1 = void (*)(const at::Tensor&);

// The fused (stream('fused')) form through the one-pass kernel where every leaf takes it: on
// the CPU at::_foreach_<op> is itself a loop of ATen calls. False (nothing kept) otherwise.
bool direct_fused(std::optional<detail::VectorOp> op, const FusedArgs& f,
                  std::vector<at::Tensor>& out) {
  if (!op || !f.operand(0).is_tree()) return false;
  const at::TensorList a = f.column(0);
  const bool binary = f.operands() > 1;
  const bool tree_b = binary && f.operand(1).is_tree();
  if (binary && !tree_b && f.operand(1).kind() != Operand::Kind::scalar) return false;
  std::vector<at::Tensor> r;
  r.reserve(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    r.push_back(!binary  ? detail::direct_unary(*op, a[i])
                : tree_b ? detail::direct_binary(*op, a[i], f.column(1)[i])
                         : detail::direct_binary(*op, a[i], f.operand(1).scalar()));
    if (!r.back().defined()) return false;
  }
  out = std::move(r);
  return true;
}

// A registry op's fused form (its `foreach` column, codegen/ops.toml): at::_foreach_<name> and
// _foreach_<name>_, or none; one constant an op (ops_generated.inc), no lookup by name.
struct ForeachUnary {
  std::vector<at::Tensor> (*map)(at::TensorList);
  void (*update)(at::TensorList);
};

// Unary table ops are elementwise, except detach: it changes each leaf's autograd state, not
// its data, so it must reach every leaf.
CallOptions unary_options(std::string_view op) {
  CallOptions o = elementwise(op);
  o.elementwise = op != "detach" && op != "detach_";
  return o;
}

// The leaf kernels below try the one-pass kernel first (detail::direct_*: the same values as
// ATen's op, without its dispatcher), then call ATen.
TreeTensor unary_map(std::string_view op, const TensorTree& t, Kernel1 k, const ForeachUnary* fe) {
  const Operand args[] = {Operand(t)};
  const std::optional<detail::VectorOp> direct = detail::direct_op(op);
  auto leaf = [k, direct](const LeafArgs& x) {
    if (direct)
      if (at::Tensor r = detail::direct_unary(*direct, x.t(0)); r.defined()) return r;
    return k(x.t(0));
  };
  if (!fe) return map_owned(unary_options(op), args, leaf);
  auto fused = [fe, direct](const FusedArgs& a, std::vector<at::Tensor>& out) {
    if (direct_fused(direct, a, out)) return true;
    if (!a.foreach_compatible()) return false;
    out = fe->map(a.column(0));
    return true;
  };
  return map_owned(unary_options(op), args, leaf, fused);
}

TreeTensor& unary_update(std::string_view op, TreeTensor& t, Update1 k, const ForeachUnary* fe) {
  const Operand args[] = {Operand(t)};
  auto leaf = [k](const LeafArgs& x) { k(x.t(0)); };
  if (!fe) {
    update_owned(unary_options(op), args, leaf);
  } else {
    auto fused = [fe](const FusedArgs& a) {
      if (!a.foreach_compatible()) return false;
      fe->update(a.column(0));
      return true;
    };
    update_owned(unary_options(op), args, leaf, fused);
  }
  return t;
}

// ---- binary ----------------------------------------------------------------------------------
using KernelTT = at::Tensor (*)(const at::Tensor&, const at::Tensor&);
using KernelTS = at::Tensor (*)(const at::Tensor&, const at::Scalar&);
using UpdateTT = void (*)(const at::Tensor&, const at::Tensor&);
using UpdateTS = void (*)(const at::Tensor&, const at::Scalar&);

// A scalar first operand enters as a wrapped-number tensor (torch's `2 - t` does the same).
CallOptions binary_options(std::string_view op, const Operand& a) {
  CallOptions o = elementwise(op);
  o.wrap_scalars = a.kind() == Operand::Kind::scalar;
  return o;
}

// The binary form of the table's `fused` column: list-list and list-scalar _foreach kernels.
struct ForeachBinary {
  std::vector<at::Tensor> (*map_ll)(at::TensorList, at::TensorList);
  std::vector<at::Tensor> (*map_ls)(at::TensorList, const at::Scalar&);
  void (*update_ll)(at::TensorList, at::TensorList);
  void (*update_ls)(at::TensorList, const at::Scalar&);
};

// The one-pass kernel's result for a binary leaf call (a number or a tensor second operand), or
// an undefined tensor where ATen must compute it.
at::Tensor direct_leaf(std::optional<detail::VectorOp> direct, const LeafArgs& x) {
  if (!direct) return {};
  return x.is_scalar(1) ? detail::direct_binary(*direct, x.t(0), x.s(1))
                        : detail::direct_binary(*direct, x.t(0), x.t(1));
}

TreeTensor binary_map(std::string_view op, const Operand& a, const Operand& b, KernelTT tt,
                      KernelTS ts, const ForeachBinary* fe) {
  const Operand args[] = {a, b};
  const std::optional<detail::VectorOp> direct = detail::direct_op(op);
  auto leaf = [tt, ts, direct](const LeafArgs& x) {
    if (at::Tensor r = direct_leaf(direct, x); r.defined()) return r;
    return x.is_scalar(1) ? ts(x.t(0), x.s(1)) : tt(x.t(0), x.t(1));
  };
  if (!fe) return map_owned(binary_options(op, a), args, leaf);
  auto fused = [fe, direct](const FusedArgs& f, std::vector<at::Tensor>& out) {
    if (direct_fused(direct, f, out)) return true;
    if (!f.operand(0).is_tree() || !f.foreach_compatible()) return false;
    out = f.operand(1).is_tree() ? fe->map_ll(f.column(0), f.column(1))
                                 : fe->map_ls(f.column(0), f.operand(1).scalar());
    return true;
  };
  return map_owned(binary_options(op, a), args, leaf, fused);
}

TreeTensor binary_tensor_map(std::string_view op, const Operand& a, const Operand& b, KernelTT tt) {
  const Operand args[] = {a, b};
  CallOptions o = elementwise(op);
  o.wrap_scalars = true;
  return map_owned(o, args, [tt, direct = detail::direct_op(op)](const LeafArgs& x) {
    if (at::Tensor r = direct_leaf(direct, x); r.defined()) return r;
    return tt(x.t(0), x.t(1));
  });
}

TreeTensor& binary_update(std::string_view op, TreeTensor& a, const Operand& b, UpdateTT tt,
                          UpdateTS ts, const ForeachBinary* fe) {
  const Operand args[] = {Operand(a), b};
  auto leaf = [tt, ts](const LeafArgs& x) {
    x.is_scalar(1) ? ts(x.t(0), x.s(1)) : tt(x.t(0), x.t(1));
  };
  if (!fe) {
    update_owned(elementwise(op), args, leaf);
    return a;
  }
  auto fused = [fe](const FusedArgs& f) {
    if (!f.foreach_compatible()) return false;
    f.operand(1).is_tree() ? fe->update_ll(f.column(0), f.column(1))
                           : fe->update_ls(f.column(0), f.operand(1).scalar());
    return true;
  };
  update_owned(elementwise(op), args, leaf, fused);
  return a;
}

// add and sub: a ± alpha·b, their in-place forms and their _foreach forms. A scalar operand is
// only batched with alpha == 1, where the per-leaf kernel computes exactly what _foreach does.
using CT = const at::Tensor&;
using CS = const at::Scalar&;
using TL = at::TensorList;
struct AlphaOp {
  const char* name;
  const char* inplace_name;
  at::Tensor (*tt)(CT, CT, CS);
  at::Tensor (*ts)(CT, CS, CS);
  void (*tt_)(CT, CT, CS);
  void (*ts_)(CT, CS, CS);
  std::vector<at::Tensor> (*map_ll)(TL, TL, CS);
  std::vector<at::Tensor> (*map_ls)(TL, CS);
  void (*update_ll)(TL, TL, CS);
  void (*update_ls)(TL, CS);
};
// clang-format off
#define TREETENSOR_ALPHA_OP(n)                                                                 \
  AlphaOp{#n, #n "_",                                                                          \
          [](CT x, CT y, CS al) { return at::n(x, y, al); },                                   \
          [](CT x, CS y, CS al) { return at::n(x, y, al); },                                   \
          [](CT x, CT y, CS al) { x.n##_(y, al); },                                            \
          [](CT x, CS y, CS al) { x.n##_(y, al); },                                            \
          [](TL x, TL y, CS al) { return at::_foreach_##n(x, y, al); },                        \
          [](TL x, CS s) { return at::_foreach_##n(x, s); },                                   \
          [](TL x, TL y, CS al) { at::_foreach_##n##_(x, y, al); },                            \
          [](TL x, CS s) { at::_foreach_##n##_(x, s); }}
// clang-format on
constexpr AlphaOp kAdd = TREETENSOR_ALPHA_OP(add);
constexpr AlphaOp kSub = TREETENSOR_ALPHA_OP(sub);
#undef TREETENSOR_ALPHA_OP

bool is_one(const at::Scalar& s) {
  return s.isIntegral(false) ? s.toLong() == 1 : s.toDouble() == 1.0;
}

TreeTensor alpha_map(const AlphaOp& op, const Operand& a, const Operand& b,
                     const at::Scalar& alpha) {
  const Operand args[] = {a, b};
  // `op` is a constexpr table entry (static storage); alpha is copied: the call may be pending.
  // The one-pass kernel only with an int alpha of 1 (vector_alpha; a floating alpha with
  // integer operands is ATen's error).
  const std::optional<detail::VectorOp> direct =
      alpha.isIntegral(false) && detail::vector_alpha(alpha) ? detail::direct_op(op.name)
                                                             : std::nullopt;
  auto leaf = [&op, alpha, direct](const LeafArgs& x) {
    if (at::Tensor r = direct_leaf(direct, x); r.defined()) return r;
    return x.is_scalar(1) ? op.ts(x.t(0), x.s(1), alpha) : op.tt(x.t(0), x.t(1), alpha);
  };
  auto fused = [&op, alpha, direct](const FusedArgs& f, std::vector<at::Tensor>& out) {
    if (direct_fused(direct, f, out)) return true;
    if (!f.operand(0).is_tree() || !f.foreach_compatible()) return false;
    if (f.operand(1).is_tree()) {
      out = op.map_ll(f.column(0), f.column(1), alpha);
      return true;
    }
    if (!is_one(alpha)) return false;
    out = op.map_ls(f.column(0), f.operand(1).scalar());
    return true;
  };
  CallOptions o = binary_options(op.name, a);
  o.integer_safe = true;  // add and sub raise for no integer value
  return map_owned(o, args, leaf, fused);
}

TreeTensor& alpha_update(const AlphaOp& op, TreeTensor& a, const Operand& b,
                         const at::Scalar& alpha) {
  const Operand args[] = {Operand(a), b};
  auto leaf = [&op, alpha](const LeafArgs& x) {
    x.is_scalar(1) ? op.ts_(x.t(0), x.s(1), alpha) : op.tt_(x.t(0), x.t(1), alpha);
  };
  auto fused = [&op, alpha](const FusedArgs& f) {
    if (!f.foreach_compatible()) return false;
    if (f.operand(1).is_tree()) {
      op.update_ll(f.column(0), f.column(1), alpha);
      return true;
    }
    if (!is_one(alpha)) return false;
    op.update_ls(f.column(0), f.operand(1).scalar());
    return true;
  };
  update_owned(integer_safe(op.inplace_name), args, leaf, fused);
  return a;
}

// ---- matrix ----------------------------------------------------------------------------------
runtime::LeafCost matmul_cost(const LeafArgs& x) {
  const at::Tensor &a = x.t(0), &b = x.t(1);
  if (!a.defined() || !b.defined() || a.dim() == 0 || b.dim() == 0) return {};
  const double k = static_cast<double>(a.size(-1));
  const double n = b.dim() >= 2 ? static_cast<double>(b.size(-1)) : 1.0;
  const double rows = k > 0 ? static_cast<double>(a.numel()) / k : 0.0;
  const double item = static_cast<double>(a.element_size());
  return {2 * rows * k * n, (static_cast<double>(a.numel() + b.numel()) + rows * n) * item};
}

// One bmm over stacked leaves when every leaf pair has the same 2-D shapes, dtype and device.
bool fused_bmm(const FusedArgs& f, std::vector<at::Tensor>& out) {
  if (f.leaves() == 0 || !f.operand(0).is_tree() || !f.operand(1).is_tree()) return false;
  const auto a = f.column(0), b = f.column(1);
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].dim() != 2 || b[i].dim() != 2 || !a[i].sizes().equals(a[0].sizes()) ||
        !b[i].sizes().equals(b[0].sizes()) || a[i].scalar_type() != a[0].scalar_type() ||
        b[i].scalar_type() != a[0].scalar_type() || a[i].device() != a[0].device() ||
        b[i].device() != a[0].device() || !at::isFloatingType(a[i].scalar_type()))
      return false;
  }
  if (a[0].size(1) != b[0].size(0)) return false;  // let the per-leaf path report it
  out = at::bmm(at::stack(a), at::stack(b)).unbind(0);
  return true;
}

TreeTensor matrix_op(std::string_view op, const Operand& a, const Operand& b, KernelTT k,
                     bool batch) {
  const Operand args[] = {a, b};
  CallOptions o{op};
  o.wrap_scalars = true;
  o.cost = matmul_cost;
  auto leaf = [k](const LeafArgs& x) { return k(x.t(0), x.t(1)); };
  return batch ? map_owned(o, args, leaf, &fused_bmm, &matmul_cost)
               : map_owned(o, args, leaf, nullptr, &matmul_cost);
}

// ---- ops with a scalar argument: addcmul(self, t1, t2, value), lerp(self, end, weight) --------
// A number operand enters as a wrapped-number tensor. The in-place forms' fused form (the
// registry's foreach column) needs every operand a tree: at::_foreach_f_ takes tensor lists.
using Kernel3S = at::Tensor (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Scalar&);
using Update3S = void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Scalar&);
using Foreach3S = void (*)(at::TensorList, at::TensorList, at::TensorList, const at::Scalar&);
using Kernel2S = at::Tensor (*)(const at::Tensor&, const at::Tensor&, const at::Scalar&);
using Update2S = void (*)(const at::Tensor&, const at::Tensor&, const at::Scalar&);
using Foreach2S = void (*)(at::TensorList, at::TensorList, const at::Scalar&);

CallOptions scalar_arg_options(std::string_view op) {
  CallOptions o = elementwise(op);
  o.wrap_scalars = true;
  return o;
}

TreeTensor ternary_value_map(std::string_view op, const Operand& self, const Operand& t1,
                             const Operand& t2, const at::Scalar& value, Kernel3S k) {
  const Operand args[] = {self, t1, t2};
  return map_owned(scalar_arg_options(op), args,
                   [k, value](const LeafArgs& x) { return k(x.t(0), x.t(1), x.t(2), value); });
}

TreeTensor& ternary_value_update(std::string_view op, TreeTensor& self, const Operand& t1,
                                 const Operand& t2, const at::Scalar& value, Update3S k,
                                 Foreach3S fe) {
  const Operand args[] = {Operand(self), t1, t2};
  auto leaf = [k, value](const LeafArgs& x) { k(x.t(0), x.t(1), x.t(2), value); };
  if (!fe) {
    update_owned(scalar_arg_options(op), args, leaf);
    return self;
  }
  auto fused = [fe, value](const FusedArgs& f) {
    if (!f.operand(1).is_tree() || !f.operand(2).is_tree() || !f.foreach_compatible()) return false;
    fe(f.column(0), f.column(1), f.column(2), value);
    return true;
  };
  update_owned(scalar_arg_options(op), args, leaf, fused);
  return self;
}

TreeTensor binary_weight_map(std::string_view op, const Operand& self, const Operand& end,
                             const at::Scalar& weight, Kernel2S k) {
  const Operand args[] = {self, end};
  return map_owned(scalar_arg_options(op), args,
                   [k, weight](const LeafArgs& x) { return k(x.t(0), x.t(1), weight); });
}

TreeTensor& binary_weight_update(std::string_view op, TreeTensor& self, const Operand& end,
                                 const at::Scalar& weight, Update2S k, Foreach2S fe) {
  const Operand args[] = {Operand(self), end};
  auto leaf = [k, weight](const LeafArgs& x) { k(x.t(0), x.t(1), weight); };
  if (!fe) {
    update_owned(scalar_arg_options(op), args, leaf);
    return self;
  }
  auto fused = [fe, weight](const FusedArgs& f) {
    if (!f.operand(1).is_tree() || !f.foreach_compatible()) return false;
    fe(f.column(0), f.column(1), weight);
    return true;
  };
  update_owned(scalar_arg_options(op), args, leaf, fused);
  return self;
}

// Whether pred holds for every leaf pair of two trees of equal structure (false otherwise).
template <class P>
bool all_pairs(std::string_view op, const TensorTree& a, const TensorTree& b, P&& pred) {
  const Operand args[] = {Operand(a), Operand(b)};
  std::vector<std::uint8_t> ok;
  ok.resize(std::max(a.leaf_count(), b.leaf_count()), 0);
  try {
    detail::map_leaves(CallOptions{op}, args, [&](const LeafArgs& x) {
      ok[x.leaf()] = pred(x.t(0), x.t(1));
      return at::Tensor();
    });
  } catch (const tree::StructureError&) {
    return false;
  }
  return std::all_of(ok.begin(), ok.end(), [](std::uint8_t v) { return v != 0; });
}

}  // namespace

// ---- the op registry (codegen/ops.toml): functions and methods, generated ------------------
#include "tensor/ops_generated.inc"

// ---- add and sub: a ± alpha·b, one body for both --------------------------------------------
TreeTensor add(const Operand& a, const Operand& b, const at::Scalar& alpha) {
  return alpha_map(kAdd, a, b, alpha);
}
TreeTensor& add_(TreeTensor& a, const Operand& b, const at::Scalar& alpha) {
  return alpha_update(kAdd, a, b, alpha);
}
TreeTensor sub(const Operand& a, const Operand& b, const at::Scalar& alpha) {
  return alpha_map(kSub, a, b, alpha);
}
TreeTensor& sub_(TreeTensor& a, const Operand& b, const at::Scalar& alpha) {
  return alpha_update(kSub, a, b, alpha);
}

TreeTensor clamp(const TensorTree& t, c10::optional<at::Scalar> min,
                 c10::optional<at::Scalar> max) {
  return map1_owned(integer_safe("clamp"), t,
                    [min, max](const at::Tensor& x) { return at::clamp(x, min, max); });
}
TreeTensor& clamp_(TreeTensor& t, c10::optional<at::Scalar> min, c10::optional<at::Scalar> max) {
  return update1_owned(integer_safe("clamp_"), t,
                       [min, max](const at::Tensor& x) { x.clamp_(min, max); });
}

TreeTensor& copy_(TreeTensor& self, const Operand& src) {
  const Operand args[] = {Operand(self), src};
  CallOptions o = integer_safe("copy_");
  o.wrap_scalars = true;
  update_owned(o, args, [](const LeafArgs& x) { x.t(0).copy_(x.t(1)); });
  return self;
}

TreeTensor& zero_(TreeTensor& t) {
  const Operand args[] = {Operand(t)};
  auto fused = [](const FusedArgs& f) {
    if (!f.foreach_compatible()) return false;
    at::_foreach_zero_(f.column(0));
    return true;
  };
  update_owned(
      integer_safe("zero_"), args, [](const LeafArgs& x) { x.t(0).zero_(); }, fused);
  return t;
}

TreeTensor& fill_(TreeTensor& t, const at::Scalar& value) {
  return update1_owned(integer_safe("fill_"), t, [value](const at::Tensor& x) { x.fill_(value); });
}

TreeTensor& requires_grad_(TreeTensor& t, bool requires_grad) {
  return update1("requires_grad_", t,
                 [&](const at::Tensor& x) { x.requires_grad_(requires_grad); });
}

// ---- comparison --------------------------------------------------------------------------------
TreeTensor isclose(const Operand& a, const Operand& b, double rtol, double atol, bool equal_nan) {
  const Operand args[] = {a, b};
  CallOptions o = elementwise("isclose");
  o.wrap_scalars = true;
  return map_owned(o, args, [rtol, atol, equal_nan](const LeafArgs& x) {
    return at::isclose(x.t(0), x.t(1), rtol, atol, equal_nan);
  });
}

bool equal(const TensorTree& a, const TensorTree& b) {
  return all_pairs("equal", a, b,
                   [](const at::Tensor& x, const at::Tensor& y) { return at::equal(x, y); });
}

bool allclose(const TensorTree& a, const TensorTree& b, double rtol, double atol, bool equal_nan) {
  return all_pairs("allclose", a, b, [&](const at::Tensor& x, const at::Tensor& y) {
    return x.sizes().equals(y.sizes()) && at::allclose(x, y, rtol, atol, equal_nan);
  });
}

// ---- matrix ------------------------------------------------------------------------------------
TreeTensor matmul(const Operand& a, const Operand& b) {
  return matrix_op(
      "matmul", a, b, [](const at::Tensor& x, const at::Tensor& y) { return at::matmul(x, y); },
      true);
}
TreeTensor mm(const Operand& a, const Operand& b) {
  return matrix_op(
      "mm", a, b, [](const at::Tensor& x, const at::Tensor& y) { return at::mm(x, y); }, true);
}
TreeTensor dot(const Operand& a, const Operand& b) {
  return matrix_op(
      "dot", a, b, [](const at::Tensor& x, const at::Tensor& y) { return at::dot(x, y); }, false);
}

// ---- shape and conversion ----------------------------------------------------------------------
TreeTensor to(const TensorTree& t, at::TensorOptions options, bool non_blocking, bool copy) {
  return map1_owned(integer_safe("to"), t, [options, non_blocking, copy](const at::Tensor& x) {
    return x.to(options, non_blocking, copy);
  });
}
TreeTensor to(const TensorTree& t, at::ScalarType dtype) {
  return map1_owned(integer_safe("to"), t, [dtype](const at::Tensor& x) { return x.to(dtype); });
}
TreeTensor to(const TensorTree& t, at::Device device) {
  return map1_owned(integer_safe("to"), t, [device](const at::Tensor& x) { return x.to(device); });
}
TreeTensor cpu(const TensorTree& t) {
  return map1_owned("cpu", t, [](const at::Tensor& x) { return x.cpu(); });
}
TreeTensor contiguous(const TensorTree& t) {
  return map1_owned("contiguous", t, [](const at::Tensor& x) { return x.contiguous(); });
}
TreeTensor reshape(const TensorTree& t, at::IntArrayRef shape) {
  return map1_owned("reshape", t,
                    [shape = shape.vec()](const at::Tensor& x) { return x.reshape(shape); });
}
TreeTensor view(const TensorTree& t, at::IntArrayRef shape) {
  return map1_owned("view", t,
                    [shape = shape.vec()](const at::Tensor& x) { return x.view(shape); });
}
TreeTensor squeeze(const TensorTree& t) {
  return map1_owned("squeeze", t, [](const at::Tensor& x) { return x.squeeze(); });
}
TreeTensor squeeze(const TensorTree& t, int64_t dim) {
  return map1_owned("squeeze", t, [dim](const at::Tensor& x) { return x.squeeze(dim); });
}
TreeTensor unsqueeze(const TensorTree& t, int64_t dim) {
  return map1_owned("unsqueeze", t, [dim](const at::Tensor& x) { return x.unsqueeze(dim); });
}
TreeTensor transpose(const TensorTree& t, int64_t dim0, int64_t dim1) {
  return map1_owned("transpose", t,
                    [dim0, dim1](const at::Tensor& x) { return x.transpose(dim0, dim1); });
}
TreeTensor permute(const TensorTree& t, at::IntArrayRef dims) {
  return map1_owned("permute", t,
                    [dims = dims.vec()](const at::Tensor& x) { return x.permute(dims); });
}
TreeTensor flatten(const TensorTree& t, int64_t start_dim, int64_t end_dim) {
  return map1_owned("flatten", t, [start_dim, end_dim](const at::Tensor& x) {
    return x.flatten(start_dim, end_dim);
  });
}

TreeTensor index_select(const TensorTree& t, int64_t dim, const Operand& index) {
  const Operand args[] = {Operand(t), index};
  return map_owned(CallOptions{"index_select"}, args,
                   [dim](const LeafArgs& x) { return at::index_select(x.t(0), dim, x.t(1)); });
}

TreeTensor where(const Operand& cond, const Operand& a, const Operand& b) {
  const Operand args[] = {cond, a, b};
  CallOptions o = integer_safe("where");
  o.wrap_scalars = true;
  return map_owned(o, args, [](const LeafArgs& x) { return at::where(x.t(0), x.t(1), x.t(2)); });
}

TreeTensor index(const TensorTree& t, at::ArrayRef<at::indexing::TensorIndex> indices) {
  return map1("index", t, [&](const at::Tensor& x) { return x.index(indices); });
}

TreeTensor index(const TensorTree& t, const TensorTree& indices) {
  const Operand args[] = {Operand(t), Operand(indices)};
  return map_owned(CallOptions{"index"}, args, [](const LeafArgs& x) {
    return x.t(0).index({at::indexing::TensorIndex(x.t(1))});
  });
}

namespace {
template <class F>
TreeTensor join(std::string_view op, const std::vector<TreeTensor>& trees, F f) {
  if (trees.empty()) throw std::invalid_argument(std::string(op) + ": needs at least one tree");
  std::vector<Operand> args(trees.begin(), trees.end());
  return map_owned(CallOptions{op}, args, [n = trees.size(), f = std::move(f)](const LeafArgs& x) {
    std::vector<at::Tensor> parts;
    parts.reserve(n);
    for (std::size_t k = 0; k < n; ++k) parts.push_back(x.t(k));
    return f(parts);
  });
}
}  // namespace

TreeTensor cat(const std::vector<TreeTensor>& trees, int64_t dim) {
  return join("cat", trees, [dim](at::TensorList parts) { return at::cat(parts, dim); });
}
TreeTensor stack(const std::vector<TreeTensor>& trees, int64_t dim) {
  return join("stack", trees, [dim](at::TensorList parts) { return at::stack(parts, dim); });
}
std::vector<TreeTensor> split(const TensorTree& t, int64_t split_size, int64_t dim) {
  return multi1("split", t, [&](const at::Tensor& x) { return x.split(split_size, dim); });
}
std::vector<TreeTensor> chunk(const TensorTree& t, int64_t chunks, int64_t dim) {
  return multi1("chunk", t, [&](const at::Tensor& x) { return x.chunk(chunks, dim); });
}
std::vector<TreeTensor> unbind(const TensorTree& t, int64_t dim) {
  return multi1("unbind", t, [&](const at::Tensor& x) { return x.unbind(dim); });
}

// ---- hand-written methods ----------------------------------------------------------------------
TreeTensor TreeTensor::add(const Operand& o, const at::Scalar& alpha) const {
  return treetensor::add(*this, o, alpha);
}
TreeTensor& TreeTensor::add_(const Operand& o, const at::Scalar& alpha) {
  return treetensor::add_(*this, o, alpha);
}
TreeTensor TreeTensor::sub(const Operand& o, const at::Scalar& alpha) const {
  return treetensor::sub(*this, o, alpha);
}
TreeTensor& TreeTensor::sub_(const Operand& o, const at::Scalar& alpha) {
  return treetensor::sub_(*this, o, alpha);
}
TreeTensor TreeTensor::clamp(c10::optional<at::Scalar> min, c10::optional<at::Scalar> max) const {
  return treetensor::clamp(*this, min, max);
}
TreeTensor& TreeTensor::clamp_(c10::optional<at::Scalar> min, c10::optional<at::Scalar> max) {
  return treetensor::clamp_(*this, min, max);
}
TreeTensor& TreeTensor::copy_(const Operand& src) {
  return treetensor::copy_(*this, src);
}
TreeTensor& TreeTensor::zero_() {
  return treetensor::zero_(*this);
}
TreeTensor& TreeTensor::fill_(const at::Scalar& value) {
  return treetensor::fill_(*this, value);
}
TreeTensor& TreeTensor::requires_grad_(bool r) {
  return treetensor::requires_grad_(*this, r);
}
TreeTensor TreeTensor::isclose(const Operand& o, double rtol, double atol, bool equal_nan) const {
  return treetensor::isclose(*this, o, rtol, atol, equal_nan);
}
TreeTensor TreeTensor::to(at::TensorOptions options, bool non_blocking, bool copy) const {
  return treetensor::to(*this, options, non_blocking, copy);
}
TreeTensor TreeTensor::to(at::ScalarType dtype) const {
  return treetensor::to(*this, dtype);
}
TreeTensor TreeTensor::to(at::Device device) const {
  return treetensor::to(*this, device);
}
TreeTensor TreeTensor::cpu() const {
  return treetensor::cpu(*this);
}
TreeTensor TreeTensor::contiguous() const {
  return treetensor::contiguous(*this);
}
TreeTensor TreeTensor::reshape(at::IntArrayRef s) const {
  return treetensor::reshape(*this, s);
}
TreeTensor TreeTensor::view(at::IntArrayRef s) const {
  return treetensor::view(*this, s);
}
TreeTensor TreeTensor::squeeze() const {
  return treetensor::squeeze(*this);
}
TreeTensor TreeTensor::squeeze(int64_t d) const {
  return treetensor::squeeze(*this, d);
}
TreeTensor TreeTensor::unsqueeze(int64_t d) const {
  return treetensor::unsqueeze(*this, d);
}
TreeTensor TreeTensor::transpose(int64_t a, int64_t b) const {
  return treetensor::transpose(*this, a, b);
}
TreeTensor TreeTensor::permute(at::IntArrayRef d) const {
  return treetensor::permute(*this, d);
}
TreeTensor TreeTensor::flatten(int64_t s, int64_t e) const {
  return treetensor::flatten(*this, s, e);
}
TreeTensor TreeTensor::index_select(int64_t dim, const Operand& index) const {
  return treetensor::index_select(*this, dim, index);
}
TreeTensor TreeTensor::index(at::ArrayRef<at::indexing::TensorIndex> indices) const {
  return treetensor::index(*this, indices);
}
TreeTensor TreeTensor::index(const TensorTree& indices) const {
  return treetensor::index(*this, indices);
}
std::vector<TreeTensor> TreeTensor::split(int64_t size, int64_t dim) const {
  return treetensor::split(*this, size, dim);
}
std::vector<TreeTensor> TreeTensor::chunk(int64_t chunks, int64_t dim) const {
  return treetensor::chunk(*this, chunks, dim);
}

// ---- attributes --------------------------------------------------------------------------------
TreeTensor::TreeTensor(const TensorTree& node, ContinueTrail) : TensorTree(node) {
  auto& trail = tree::detail::access_trail;
  if (trail.node == &node) trail.node = this;
}
TreeTensor TreeTensor::operator[](std::string_view key) const {
  return TreeTensor(TensorTree::operator[](key), ContinueTrail{});
}

tree::Tree<Size> TreeTensor::shape() const {
  return tree::map([](const at::Tensor& x) { return Size(x.sizes().vec()); }, *this);
}
tree::Tree<at::ScalarType> TreeTensor::dtype() const {
  return tree::map([](const at::Tensor& x) { return x.scalar_type(); }, *this);
}
tree::Tree<at::Device> TreeTensor::device() const {
  return tree::map([](const at::Tensor& x) { return x.device(); }, *this);
}
tree::Tree<int64_t> TreeTensor::numel() const {
  return tree::map([](const at::Tensor& x) { return x.numel(); }, *this);
}
tree::Tree<bool> TreeTensor::requires_grad() const {
  return tree::map([](const at::Tensor& x) { return x.requires_grad(); }, *this);
}
TreeTensor TreeTensor::grad() const {
  return tree::map([](const at::Tensor& x) { return x.grad(); }, *this);
}

int64_t batch_size(const TensorTree& t) {
  const auto flat = tree::flatten_refs(t);
  if (flat.leaves.empty()) throw std::invalid_argument("batch_size: the tree has no leaves");
  std::vector<int64_t> sizes;
  sizes.reserve(flat.leaves.size());
  for (std::size_t i = 0; i < flat.leaves.size(); ++i) {
    if (flat.leaves[i]->dim() == 0)
      throw std::invalid_argument("batch_size: leaf '" + flat.spec.paths()[i].describe() +
                                  "' is 0-d (a scalar); it has no leading dimension");
    sizes.push_back(flat.leaves[i]->size(0));
  }
  if (std::all_of(sizes.begin(), sizes.end(), [&](int64_t s) { return s == sizes[0]; }))
    return sizes[0];
  std::vector<const int64_t*> values;
  for (const int64_t& s : sizes) values.push_back(&s);
  throw std::invalid_argument("batch_size: leaves disagree on dim 0: " +
                              detail::disagreement(values, flat.spec.paths()));
}
int64_t TreeTensor::batch_size() const {
  return treetensor::batch_size(*this);
}

}  // namespace treetensor
