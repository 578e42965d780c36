#pragma once
// The compiled core every tree-tensor op is a thin shim over (STYLE.md: thin templates over a
// compiled core). It zips the tree arguments (strict by default, treevalue's modes on request),
// hands the leaf jobs to runtime::run() as one LeafCall, and builds the result trees.
// Public so that users can add their own ops the same way; apply() / apply_() (ops.hpp) are
// the convenient forms.

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/FunctionRef.h>

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "treetensor/runtime/dispatch.hpp"
#include "treetensor/tensor/tree_tensor.hpp"

namespace treetensor::detail {

/// The operands of one leaf job: operand k is the leaf of tree argument k at this leaf's path,
/// or the broadcast tensor / scalar argument k.
class LeafArgs {
 public:
  LeafArgs(const at::Tensor* const* row, const Operand* ops, std::size_t leaf) noexcept
      : row_(row), ops_(ops), leaf_(leaf) {}
  /// Operand k as a tensor. A scalar operand reads as a wrapped-number 0-d tensor when the
  /// call asked for it (CallOptions::wrap_scalars), else as an undefined tensor.
  const at::Tensor& t(std::size_t k) const noexcept { return *row_[k]; }
  bool is_scalar(std::size_t k) const noexcept { return ops_[k].kind() == Operand::Kind::scalar; }
  /// Operand k's scalar (only meaningful when is_scalar(k)).
  const at::Scalar& s(std::size_t k) const noexcept { return ops_[k].scalar(); }
  /// The leaf index (flatten order of the result).
  std::size_t leaf() const noexcept { return leaf_; }

 private:
  const at::Tensor* const* row_;
  const Operand* ops_;
  std::size_t leaf_;
};

/// The operands of a fused (batched) call, column-wise.
class FusedArgs {
 public:
  FusedArgs(c10::ArrayRef<Operand> ops, std::vector<std::vector<at::Tensor>> columns)
      : ops_(ops), columns_(std::move(columns)) {}
  /// Every leaf's tensor for operand k in leaf order (a broadcast tensor or wrapped scalar
  /// repeats in every position).
  at::TensorList column(std::size_t k) const { return columns_[k]; }
  const Operand& operand(std::size_t k) const { return ops_[k]; }
  std::size_t operands() const noexcept { return ops_.size(); }
  std::size_t leaves() const noexcept { return columns_.empty() ? 0 : columns_[0].size(); }
  /// Whether `_foreach_*` kernels give the same values as the per-leaf loop here: for every
  /// leaf all tensor operands have one shape, and every tensor of the call has the same
  /// floating dtype and device, and none needs a gradient while grad mode is on (LibTorch 1.13
  /// has no autograd for `_foreach_*`). Scalar operands are allowed; broadcast tensors are not.
  bool foreach_compatible() const;

 private:
  c10::ArrayRef<Operand> ops_;
  std::vector<std::vector<at::Tensor>> columns_;
};

using LeafFn = c10::function_ref<at::Tensor(const LeafArgs&)>;
using LeafFnMulti = c10::function_ref<std::vector<at::Tensor>(const LeafArgs&)>;
using LeafUpdate = c10::function_ref<void(const LeafArgs&)>;
/// Batched form of a map: fills `out` with one tensor per leaf and returns true, or returns
/// false without side effects when it cannot run these operands.
using FusedFn = c10::function_ref<bool(const FusedArgs&, std::vector<at::Tensor>& out)>;
/// Batched form of an in-place update (same contract, no outputs).
using FusedUpdate = c10::function_ref<bool(const FusedArgs&)>;
using CostFn = c10::function_ref<runtime::LeafCost(const LeafArgs&)>;
/// What is wrong with one leaf's operands (e.g. "grads has dtype float64, expected float32
/// (the dtype of params)"), or an empty string when they are fine.
using CheckFn = c10::function_ref<std::string(const LeafArgs&)>;

/// How one tree call zips its arguments and what the runtime is told.
struct CallOptions {
  /// Op name for errors and the policy, e.g. "add" or "add_"; it leads every error message.
  std::string_view op;
  /// Zip mode and inherit (DESIGN.md §2); strict without inherit by default.
  ZipOptions zip = {};
  /// Fills absent leaves in outer/left zips; without it an absent leaf is a StructureError.
  const at::Tensor* missing = nullptr;
  /// Give scalar operands to the kernel as wrapped-number tensors (for at:: functions that
  /// take tensors only). Costs one 0-d tensor per scalar operand per call.
  bool wrap_scalars = false;
  /// Cost of leaf i for the policy; by default the bytes of its tensor operands, read and
  /// written once.
  CostFn cost = nullptr;
  /// update_leaves(): how many leading tree arguments the update writes (args[0] always; an
  /// optimizer step writes its parameter and state trees). Operand tracking and the aliasing
  /// rule treat these as written, the rest as read.
  std::size_t written = 1;
  /// The leaf function is elementwise and shape-preserving (each output element depends only
  /// on the operands' elements at its position): on consolidated trees of one layout it may
  /// then run once per buffer instead of once per leaf (flat execution, DESIGN.md §12).
  bool elementwise = false;
  /// With elementwise: the leaf function also takes integer tensors and raises for no value of
  /// them (unlike division by zero or a negative integer power), so consolidated integer
  /// buffers run flat too; otherwise they run per leaf, where an error stops at the leaf the
  /// loop would stop at. Registry ops need not set it: their `integer` column
  /// (codegen/ops.toml) says it.
  bool integer_safe = false;
  /// The user's names of the arguments, by position in `args` (e.g. {"params", "exp_avg",
  /// "exp_avg_sq", "grads"} for a call that passes grads last): structure errors say "grads"
  /// instead of "argument 3". Empty: errors say "argument <position>".
  c10::ArrayRef<std::string_view> arg_names = {};
  /// update_leaves(): checks every leaf's operands before any leaf is updated (an in-place
  /// call that must not half-apply on a dtype, device or shape mismatch). A problem throws
  /// std::invalid_argument "<op>: at '<path>': <problem>", with nothing updated.
  CheckFn check = nullptr;
};

/// Runs `f` on every leaf of the zipped arguments and returns the tree of its results, with
/// the zipped structure (strict: the arguments' common structure).
/// Flat execution (under every stream mode): when o.elementwise, every tree argument is
/// consolidated with one layout, tensor arguments are 0-d (none when a leaf is 0-d), every
/// buffer is floating, complex or bool (or integral, for an op no value can make fail: add,
/// mul, comparisons, bitwise, ...), and no operand needs a gradient while grad mode is on,
/// `f` runs once per buffer group instead (LeafArgs::leaf() is then the group) and the result
/// is a consolidated tree of that layout whose leaves are made on first access. Out of place
/// on CPU buffers over 32 MiB it runs per leaf unless the mode is fused or treetensor's caching
/// allocator is installed (a fresh buffer that large is page-faulted in on every call).
/// Values: bitwise those of the per-leaf loop for correctly rounded ops; for libm-style
/// functions (exp, sigmoid, sinh, atan2, ...) ATen computes a tensor's last n mod 16 elements
/// with its scalar form, so a leaf's tail may differ in the last bits (within the functions'
/// accuracy, 8 ulp; tensor_flat_test). If a flat call throws, the call runs per leaf, so errors
/// name the leaf path as always.
/// @throws tree::StructureError when the trees do not zip (names the path, the argument
///         positions and both key sets); std::invalid_argument when no argument is a tree;
///         whatever a leaf job throws, with the op and leaf path added (runtime::run).
TreeTensor map_leaves(const CallOptions& o, c10::ArrayRef<Operand> args, LeafFn f,
                      FusedFn fused = nullptr);

/// Like map_leaves() for a leaf function returning several tensors: result k is the tree of
/// every leaf's k-th tensor (treevalue's rise).
/// @throws tree::StructureError naming the first leaf whose count differs from the first
///         leaf's (e.g. split into a different number of pieces); as map_leaves() otherwise.
std::vector<TreeTensor> map_leaves_multi(const CallOptions& o, c10::ArrayRef<Operand> args,
                                         LeafFnMulti f);

/// Runs the in-place update `f` on every leaf of args[0] (which must be a tree), zipped
/// strictly with the other arguments. Before running, waits for pending asyncs work that
/// reads or writes the updated tensors (operand tracking).
/// Aliasing: when the memory a leaf updates overlaps memory another leaf's job reads or writes
/// (tied weights: one tensor at two paths), those leaves run as one job, in flatten order,
/// and the fused form is not used — so values equal the linear loop's under every strategy.
/// Disjoint views of one storage (split/chunk results) stay independent.
/// @throws as map_leaves(); when leaf jobs fail, the message also lists which leaves were
///         updated and which were not (DESIGN.md §3: never a silently half-updated tree).
void update_leaves(const CallOptions& o, c10::ArrayRef<Operand> args, LeafUpdate f,
                   FusedUpdate fused = nullptr);

/// Builds a tree with the structure `spec` whose leaf i (flatten order) is f(i), running the
/// leaf jobs through runtime::run() (construction ops).
/// @throws whatever f throws, with the op and leaf path added.
TreeTensor build_leaves(std::string_view op, const tree::TreeSpec& spec,
                        c10::function_ref<at::Tensor(std::size_t)> f);

}  // namespace treetensor::detail
