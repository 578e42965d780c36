#pragma once
// Leaf-wise tensor ops on trees: the op-table functions, the hand-written ones (matrix, shape,
// in-place optimizer math), operators, and the generic apply(). DI-treetensor parity: each
// function does what the torch function of the same name does, on every leaf.
//
// Arguments: an `Operand` is a tree (zipped strictly with the other trees: same keys at every
// node, else tree::StructureError naming the path, argument positions and both key sets) or a
// tensor / scalar broadcast to every leaf. At least one argument must be a tree
// (std::invalid_argument otherwise).
// Errors: a torch error in a leaf is rethrown with its type kept and "<op> at leaf '<path>': "
// prepended (runtime::run). In-place ops (`f_`) keep the same leaf tensors (same storage and
// TensorImpl) and, when some leaves fail, say which leaves were updated.
// Thread safety: as at::Tensor; the leaf jobs may run on runtime lanes (stream(M)).

#include <array>
#include <concepts>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "treetensor/tensor/dispatch.hpp"
#include "treetensor/tensor/ops_generated.hpp"
#include "treetensor/tensor/tree_tensor.hpp"

namespace treetensor {

// The op registry's functions (abs, sigmoid, mul, ..., matmul) are declared, each with its
// doc, in ops_generated.hpp, written by scripts/gen_ops.py from codegen/ops.toml.

// ---- arithmetic with extra arguments ---------------------------------------------------------
/// a + alpha·b leaf-wise (at::add). Fused form: at::_foreach_add.
TreeTensor add(const Operand& a, const Operand& b, const at::Scalar& alpha = 1);
TreeTensor& add_(TreeTensor& a, const Operand& b, const at::Scalar& alpha = 1);
/// a - alpha·b leaf-wise (at::sub). Fused form: at::_foreach_sub.
TreeTensor sub(const Operand& a, const Operand& b, const at::Scalar& alpha = 1);
TreeTensor& sub_(TreeTensor& a, const Operand& b, const at::Scalar& alpha = 1);
/// Leaf-wise clamp to [min, max] (either bound optional, at::clamp).
TreeTensor clamp(const TensorTree& t, c10::optional<at::Scalar> min,
                 c10::optional<at::Scalar> max = {});
TreeTensor& clamp_(TreeTensor& t, c10::optional<at::Scalar> min,
                   c10::optional<at::Scalar> max = {});
/// Leaf-wise copy of src into self's tensors (at::Tensor::copy_, broadcasting as torch).
TreeTensor& copy_(TreeTensor& self, const Operand& src);
/// Every leaf set to zero / to `value`, in place.
TreeTensor& zero_(TreeTensor& t);
TreeTensor& fill_(TreeTensor& t, const at::Scalar& value);
/// Leaf-wise requires_grad_ (autograd leaves only, as torch).
TreeTensor& requires_grad_(TreeTensor& t, bool requires_grad = true);

// ---- comparison --------------------------------------------------------------------------------
/// Leaf-wise at::isclose (tree of bool tensors).
TreeTensor isclose(const Operand& a, const Operand& b, double rtol = 1e-5, double atol = 1e-8,
                   bool equal_nan = false);
/// Whether a and b have the same structure and every leaf pair is at::equal (same shape and
/// values). Returns false (never throws) on a structure difference.
bool equal(const TensorTree& a, const TensorTree& b);
/// Whether a and b have the same structure and every leaf pair is at::allclose.
bool allclose(const TensorTree& a, const TensorTree& b, double rtol = 1e-5, double atol = 1e-8,
              bool equal_nan = false);

// ---- matrix ------------------------------------------------------------------------------------
// matmul, mm, dot: the registry's blas ops (ops_generated.hpp). Fused form of matmul and mm:
// when every leaf pair has the same 2-D shapes, dtype and device, one at::bmm over the stacked
// leaves (the results are slices of one tensor; allclose to the per-leaf products).

// ---- shape and conversion ----------------------------------------------------------------------
/// Leaf-wise Tensor::to(options) / to(dtype) / to(device) / cpu() / contiguous(): a leaf that
/// already has the asked properties is returned as is (no copy), as in torch.
TreeTensor to(const TensorTree& t, at::TensorOptions options, bool non_blocking = false,
              bool copy = false);
TreeTensor to(const TensorTree& t, at::ScalarType dtype);
TreeTensor to(const TensorTree& t, at::Device device);
TreeTensor cpu(const TensorTree& t);
TreeTensor contiguous(const TensorTree& t);
/// Leaf-wise reshape / view / squeeze / unsqueeze / transpose / permute / flatten: every leaf
/// gets the same arguments (e.g. reshape(t, {-1}) flattens each leaf).
TreeTensor reshape(const TensorTree& t, at::IntArrayRef shape);
TreeTensor view(const TensorTree& t, at::IntArrayRef shape);
TreeTensor squeeze(const TensorTree& t);
TreeTensor squeeze(const TensorTree& t, int64_t dim);
TreeTensor unsqueeze(const TensorTree& t, int64_t dim);
TreeTensor transpose(const TensorTree& t, int64_t dim0, int64_t dim1);
TreeTensor permute(const TensorTree& t, at::IntArrayRef dims);
TreeTensor flatten(const TensorTree& t, int64_t start_dim = 0, int64_t end_dim = -1);
/// Leaf-wise at::index_select; `index` is a tree of index tensors or one broadcast tensor.
TreeTensor index_select(const TensorTree& t, int64_t dim, const Operand& index);
/// Leaf-wise at::where(cond, a, b); cond is a tree of bool tensors or one broadcast tensor.
TreeTensor where(const Operand& cond, const Operand& a, const Operand& b);
/// Leaf-wise indexing with torch::indexing, the same index for every leaf:
/// index(t, {Slice(), 0}) is leaf[:, 0] on every leaf.
TreeTensor index(const TensorTree& t, at::ArrayRef<at::indexing::TensorIndex> indices);
/// Leaf-wise indexing with a tree of index tensors (long or bool): leaf[indices_leaf].
TreeTensor index(const TensorTree& t, const TensorTree& indices);

/// cat / stack of a vector of trees with the same structure (treevalue's subside): leaf p of
/// the result is at::cat / at::stack of leaf p of every tree, along `dim`.
/// @throws std::invalid_argument for an empty vector; StructureError as the zip.
TreeTensor cat(const std::vector<TreeTensor>& trees, int64_t dim = 0);
TreeTensor stack(const std::vector<TreeTensor>& trees, int64_t dim = 0);
/// split / chunk every leaf (at::split / at::chunk) and rise: result k is the tree of every
/// leaf's k-th piece. @throws StructureError when leaves split into different numbers of
/// pieces (names the leaf).
std::vector<TreeTensor> split(const TensorTree& t, int64_t split_size, int64_t dim = 0);
std::vector<TreeTensor> chunk(const TensorTree& t, int64_t chunks, int64_t dim = 0);
/// Leaf-wise unbind along dim; the same piece-count rule as split.
std::vector<TreeTensor> unbind(const TensorTree& t, int64_t dim = 0);

// ---- operators (at least one side a TreeTensor; the other a tree, tensor or number) ----------
namespace detail {
template <class A>
concept TreeTensorArg = std::derived_from<std::decay_t<A>, TreeTensor>;
template <class A>
concept OperandArg = std::is_convertible_v<const A&, Operand>;
template <class A, class B>
concept OperatorArgs = (TreeTensorArg<A> || TreeTensorArg<B>)&&OperandArg<A>&& OperandArg<B>;
}  // namespace detail

#define TREETENSOR_OPERATOR(op, fn)                                                    \
  template <class A, class B>                                                          \
  requires detail::OperatorArgs<A, B> TreeTensor operator op(const A& a, const B& b) { \
    return fn(Operand(a), Operand(b));                                                 \
  }
TREETENSOR_OPERATOR(+, add)
TREETENSOR_OPERATOR(-, sub)
TREETENSOR_OPERATOR(*, mul)
TREETENSOR_OPERATOR(/, div)
TREETENSOR_OPERATOR(%, remainder)
TREETENSOR_OPERATOR(&, bitwise_and)
TREETENSOR_OPERATOR(|, bitwise_or)
TREETENSOR_OPERATOR(^, bitwise_xor)
TREETENSOR_OPERATOR(==, eq)
TREETENSOR_OPERATOR(!=, ne)
TREETENSOR_OPERATOR(<, lt)
TREETENSOR_OPERATOR(<=, le)
TREETENSOR_OPERATOR(>, gt)
TREETENSOR_OPERATOR(>=, ge)
#undef TREETENSOR_OPERATOR

#define TREETENSOR_COMPOUND(op, fn)                                                   \
  template <class B>                                                                  \
  requires detail::OperandArg<B> TreeTensor& operator op(TreeTensor& a, const B& b) { \
    return fn(a, Operand(b));                                                         \
  }
TREETENSOR_COMPOUND(+=, add_)
TREETENSOR_COMPOUND(-=, sub_)
TREETENSOR_COMPOUND(*=, mul_)
TREETENSOR_COMPOUND(/=, div_)
TREETENSOR_COMPOUND(%=, remainder_)
TREETENSOR_COMPOUND(&=, bitwise_and_)
TREETENSOR_COMPOUND(|=, bitwise_or_)
TREETENSOR_COMPOUND(^=, bitwise_xor_)
#undef TREETENSOR_COMPOUND

/// Leaf-wise negation and bitwise not.
inline TreeTensor operator-(const TreeTensor& t) {
  return neg(t);
}
inline TreeTensor operator~(const TreeTensor& t) {
  return bitwise_not(t);
}

// ---- apply: any torch function or lambda, leaf-wise, through the runtime ----------------------
namespace detail {
template <class F, std::size_t... I>
decltype(auto) call_leaf(F& f, const LeafArgs& x, std::index_sequence<I...>) {
  return f(x.t(I)...);
}

template <class>
using tensor_ref = const at::Tensor&;

template <class R>
struct is_tensor_tuple : std::false_type {};
template <class... T>
struct is_tensor_tuple<std::tuple<T...>>
    : std::bool_constant<(std::is_same_v<std::decay_t<T>, at::Tensor> && ...)> {};

template <class F, class... A>
auto apply_impl(const CallOptions& o, F& f, const A&... args) {
  const std::array<Operand, sizeof...(A)> ops{Operand(args)...};
  using Seq = std::index_sequence_for<A...>;
  using R = std::decay_t<std::invoke_result_t<F&, tensor_ref<A>...>>;
  CallOptions opts = o;
  opts.wrap_scalars = true;
  if constexpr (std::is_same_v<R, at::Tensor>) {
    return map_leaves(opts, ops, [&](const LeafArgs& x) { return call_leaf(f, x, Seq{}); });
  } else if constexpr (std::is_same_v<R, std::vector<at::Tensor>>) {
    return map_leaves_multi(opts, ops, [&](const LeafArgs& x) { return call_leaf(f, x, Seq{}); });
  } else {
    static_assert(is_tensor_tuple<R>::value,
                  "apply: f must return at::Tensor, std::vector<at::Tensor> or a tuple of "
                  "tensors");
    auto trees = map_leaves_multi(opts, ops, [&](const LeafArgs& x) {
      return std::apply([](auto&&... t) { return std::vector<at::Tensor>{t...}; },
                        call_leaf(f, x, Seq{}));
    });
    return [&]<std::size_t... K>(std::index_sequence<K...>) {
      return std::make_tuple(std::move(trees[K])...);
    }
    (std::make_index_sequence<std::tuple_size_v<R>>{});
  }
}
}  // namespace detail

/// Runs f leaf-wise: f(leaf_a, leaf_b, ...) with one `const at::Tensor&` per argument (a
/// broadcast tensor is passed as is, a number as a wrapped-number 0-d tensor). Every leaf job
/// goes through runtime::run(), so every execution strategy applies.
/// Returns a TreeTensor when f returns at::Tensor; a std::vector<TreeTensor> when f returns
/// std::vector<at::Tensor> (every leaf must give the same count); a std::tuple of TreeTensors
/// when f returns a tuple of tensors.
/// @param op   name used in error messages ("apply" by default).
/// @throws as the op functions; f's exceptions with the leaf path added.
/// Example: apply([](const at::Tensor& x) { return at::softmax(x, -1); }, t);
template <class F, class... A>
requires(sizeof...(A) > 0 && (detail::OperandArg<A> && ...)) auto apply(F&& f, const A&... args) {
  return detail::apply_impl(detail::CallOptions{"apply"}, f, args...);
}

/// apply() with zip options (mode, inherit) and, for outer/left zips, a tensor that fills
/// absent leaves (nullptr: absent leaves are an error).
template <class F, class... A>
requires(sizeof...(A) > 0 && (detail::OperandArg<A> && ...)) auto apply(const ZipOptions& zip,
                                                                        const at::Tensor* missing,
                                                                        F&& f, const A&... args) {
  detail::CallOptions o{"apply", zip, missing};
  return detail::apply_impl(o, f, args...);
}

/// Runs the in-place function f(target_leaf, other_leaves...) on every leaf of `target`
/// (strict zip), through the runtime. Says which leaves were updated when some fail.
template <class F, class... A>
requires(detail::OperandArg<A>&&...) TreeTensor& apply_(F&& f, TreeTensor& target,
                                                        const A&... args) {
  const std::array<Operand, sizeof...(A) + 1> ops{Operand(target), Operand(args)...};
  detail::CallOptions o{"apply_"};
  o.wrap_scalars = true;
  detail::update_leaves(o, ops, [&](const detail::LeafArgs& x) {
    detail::call_leaf(f, x, std::make_index_sequence<sizeof...(A) + 1>{});
  });
  return target;
}

}  // namespace treetensor
