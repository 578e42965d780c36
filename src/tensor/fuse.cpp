// Fused tree expressions (fuse.hpp, DESIGN.md §19): the recorder behind Expr, and the leaf
// job that runs the recorded program on one leaf (or buffer), tile by tile.
#include "treetensor/tensor/fuse.hpp"

#include <ATen/ATen.h>
#include <ATen/ScalarOps.h>
#include <ATen/Version.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <cstddef>
#include <exception>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "tensor/fuse_kernels.hpp"
#include "tensor/kernel_isa.hpp"
#include "tensor/leafwise.hpp"
#include "treetensor/runtime/errors.hpp"

namespace treetensor {
namespace detail {

using CT = const at::Tensor&;
using CS = const at::Scalar&;

// Each op's functional, in-place and out= forms (out=: at::f_out, writing into its first
// argument, which the tiles use to write the result's step straight into the leaf's result).
struct UnaryKernels {
  at::Tensor (*map)(CT);
  void (*update)(CT);  // nullptr: no in-place form
  void (*out)(CT, CT);
};

// `alpha` is used by add and sub only. ts/ts_/ts_out are nullptr where at::f takes tensors
// only: the scalar then enters as a wrapped number, as the tree call passes it.
struct BinaryKernels {
  at::Tensor (*tt)(CT, CT, CS alpha);
  at::Tensor (*ts)(CT, CS, CS alpha);
  void (*tt_)(CT, CT, CS alpha);
  void (*ts_)(CT, CS, CS alpha);
  void (*tt_out)(CT, CT, CT, CS alpha);
  void (*ts_out)(CT, CT, CS, CS alpha);
};

namespace {

enum class SlotKind : std::uint8_t { input, constant, result };

// One operand of a step: a slot, or a scalar (with its wrapped-number tensor, made once).
struct StepOperand {
  static constexpr std::uint32_t kScalar = UINT32_MAX;
  std::uint32_t slot = kScalar;
  at::Scalar scalar;
  at::Tensor wrapped;
};

struct Step {
  std::string name;  // e.g. "mul" or "sigmoid_"
  const UnaryKernels* unary = nullptr;
  const BinaryKernels* binary = nullptr;
  bool inplace = false;
  std::uint32_t dst = 0;
  StepOperand a, b;
  at::Scalar alpha = 1;
};

}  // namespace

struct FuseProgram {
  std::size_t inputs = 0;
  std::vector<SlotKind> kinds;                // by slot
  std::vector<std::uint32_t> constant_slots;  // broadcast tensors written in the function,
  std::vector<at::Tensor> constants;          // operands inputs, inputs + 1, ... of the call
  std::vector<Step> steps;
  std::uint32_t root = 0;
  std::size_t root_step = 0;            // the out-of-place step that makes the root's slot
  std::string name;                     // "fuse(mul, add, sigmoid_)": the op of the tree call
  std::optional<VectorProgram> vector;  // the one-pass form, where every step has one
};

void FuseProgramDeleter::operator()(FuseProgram* p) const noexcept {
  delete p;
}

FuseRecorder::FuseRecorder(std::size_t inputs) : p_(new FuseProgram) {
  p_->inputs = inputs;
  p_->kinds.assign(inputs, SlotKind::input);
}
FuseRecorder::~FuseRecorder() = default;

namespace {

std::uint32_t new_slot(FuseProgram& p, SlotKind kind) {
  p.kinds.push_back(kind);
  return static_cast<std::uint32_t>(p.kinds.size() - 1);
}

void check_writable(const FuseProgram& p, std::string_view op, std::uint32_t slot) {
  if (p.kinds[slot] == SlotKind::result) return;
  const std::string what = p.kinds[slot] == SlotKind::input
                               ? "argument " + std::to_string(slot) + " of fuse()"
                               : std::string("a broadcast tensor");
  throw std::invalid_argument("fuse: " + std::string(op) + " in place on " + what +
                              ": fuse() writes a new tree and never its inputs; use the "
                              "out-of-place form");
}

}  // namespace

Expr FuseRecorder::unary(std::string_view op, const UnaryKernels& k, const Expr& a, bool inplace) {
  if (a.rec_ != this)
    throw std::invalid_argument("fuse: " + std::string(op) + " on an Expr of another fuse() call");
  if (op.rfind("detach", 0) == 0)
    throw std::invalid_argument("fuse: " + std::string(op) +
                                " is not arithmetic (it changes autograd state); detach the "
                                "result of fuse() instead");
  if (inplace) check_writable(*p_, op, a.slot_);
  Step s;
  s.name = std::string(op);
  s.unary = &k;
  s.inplace = inplace;
  s.a.slot = a.slot_;
  s.dst = inplace ? a.slot_ : new_slot(*p_, SlotKind::result);
  p_->steps.push_back(std::move(s));
  return Expr(this, p_->steps.back().dst);
}

namespace {

// A broadcast tensor written in the function becomes an extra operand of the tree call (after
// the arguments), so that the dispatch core's rules for tensor operands (flat execution only
// for 0-d ones, operand tracking) apply to it as to a tensor argument.
StepOperand operand_of(FuseProgram& p, const ExprOperand::Kind kind, std::uint32_t slot,
                       const at::Scalar& scalar, const at::Tensor& tensor) {
  StepOperand o;
  switch (kind) {
    case ExprOperand::Kind::expr:
      o.slot = slot;
      break;
    case ExprOperand::Kind::scalar:
      o.scalar = scalar;
      o.wrapped = at::native::wrapped_scalar_tensor(scalar);
      break;
    case ExprOperand::Kind::tensor:
      if (!tensor.defined())
        throw std::invalid_argument("fuse: an undefined tensor as an operand of the expression");
      o.slot = new_slot(p, SlotKind::constant);
      p.constant_slots.push_back(o.slot);
      p.constants.push_back(tensor);
      break;
  }
  return o;
}

}  // namespace

Expr FuseRecorder::binary(std::string_view op, const BinaryKernels& k, const ExprOperand& a,
                          const ExprOperand& b, const at::Scalar& alpha, bool inplace) {
  auto convert = [&](const ExprOperand& x) {
    using K = ExprOperand::Kind;
    if (x.kind_ == K::expr && x.expr_->rec_ != this)
      throw std::invalid_argument("fuse: " + std::string(op) + " mixes Exprs of two fuse() calls");
    return operand_of(*p_, x.kind_, x.kind_ == K::expr ? x.expr_->slot_ : 0, x.scalar_, x.tensor_);
  };
  Step s;
  s.name = std::string(op);
  s.binary = &k;
  s.inplace = inplace;
  s.alpha = alpha;
  s.a = convert(a);
  s.b = convert(b);
  if (inplace) check_writable(*p_, op, s.a.slot);
  s.dst = inplace ? s.a.slot : new_slot(*p_, SlotKind::result);
  p_->steps.push_back(std::move(s));
  return Expr(this, p_->steps.back().dst);
}

namespace {

// The one-pass form of an operand of `op`: a slot, or a number cast as ATen casts it.
std::optional<VectorOperand> vector_operand(VectorOp op, const StepOperand& o) {
  if (o.slot == StepOperand::kScalar) return vector_number(op, o.scalar);
  VectorOperand v;
  v.slot = static_cast<std::int32_t>(o.slot);
  return v;
}

// The one-pass form of the whole program, or nothing when a step has none: another op, an
// alpha or a number the kernels do not take (vector_alpha, vector_number), a broadcast tensor
// (its dtype and shape take part in promotion and broadcasting), or too many slots.
std::optional<VectorProgram> vector_program(const FuseProgram& p) {
  if (!p.constants.empty() || p.kinds.size() > std::size_t{kMaxVectorSlots}) return std::nullopt;
  VectorProgram v;
  v.inputs = static_cast<std::int32_t>(p.inputs);
  v.slots = static_cast<std::int32_t>(p.kinds.size());
  v.root = static_cast<std::int32_t>(p.root);
  for (const Step& s : p.steps) {
    std::string_view name = s.name;
    if (s.inplace) name.remove_suffix(1);
    const std::optional<VectorOp> op = vector_op(name);
    if (!op || (s.binary && !vector_alpha(s.alpha))) return std::nullopt;
    VectorStep step{*op, static_cast<std::int32_t>(s.dst), {}, {}};
    const auto a = vector_operand(*op, s.a);
    const auto b =
        s.binary ? vector_operand(*op, s.b) : std::optional<VectorOperand>(VectorOperand{});
    if (!a || !b) return std::nullopt;
    step.a = *a;
    step.b = *b;
    v.steps.push_back(step);
  }
  return v;
}

}  // namespace

FuseProgramPtr FuseRecorder::finish(const Expr& root) {
  if (root.rec_ != this)
    throw std::invalid_argument("fuse: the function returned an Expr of another fuse() call");
  p_->root = root.slot_;
  for (std::size_t i = 0; i < p_->steps.size(); ++i)
    if (!p_->steps[i].inplace && p_->steps[i].dst == root.slot_) p_->root_step = i;
  p_->name = "fuse(";
  for (std::size_t i = 0; i < p_->steps.size(); ++i)
    p_->name += (i ? ", " : "") + p_->steps[i].name;
  p_->name += ")";
  p_->vector = vector_program(*p_);
  return std::move(p_);
}

// ---- running a program ---------------------------------------------------------------------

namespace {

using Registers = c10::SmallVector<at::Tensor, 16>;

const at::Tensor& tensor_of(const Registers& r, const StepOperand& o) {
  return o.slot == StepOperand::kScalar ? o.wrapped : r[o.slot];
}

void apply(const Step& s, Registers& r) {
  if (s.unary) {
    if (s.inplace)
      s.unary->update(r[s.a.slot]);
    else
      r[s.dst] = s.unary->map(r[s.a.slot]);
    return;
  }
  const BinaryKernels& k = *s.binary;
  const at::Tensor& a = tensor_of(r, s.a);
  const bool scalar_b = s.b.slot == StepOperand::kScalar;
  if (scalar_b && (s.inplace ? k.ts_ != nullptr : k.ts != nullptr)) {
    if (s.inplace)
      k.ts_(a, s.b.scalar, s.alpha);
    else
      r[s.dst] = k.ts(a, s.b.scalar, s.alpha);
    return;
  }
  const at::Tensor& b = tensor_of(r, s.b);
  if (s.inplace)
    k.tt_(a, b, s.alpha);
  else
    r[s.dst] = k.tt(a, b, s.alpha);
}

// The root's step with its out= form, writing into `out` (a slice of the leaf's result).
void apply_out(const Step& s, Registers& r, const at::Tensor& out) {
  if (s.unary) {
    s.unary->out(out, r[s.a.slot]);
  } else if (s.b.slot == StepOperand::kScalar && s.binary->ts_out) {
    s.binary->ts_out(out, tensor_of(r, s.a), s.b.scalar, s.alpha);
  } else {
    s.binary->tt_out(out, tensor_of(r, s.a), tensor_of(r, s.b), s.alpha);
  }
  r[s.dst] = out;
}

// The program on one set of operand tensors (a leaf, a buffer or a tile of either): the
// arguments, then the broadcast tensors written in the function. With `out`, the root's step
// writes into it (same kernel, same values; no temporary and no copy).
at::Tensor run_program(const FuseProgram& p, c10::ArrayRef<at::Tensor> inputs,
                       const at::Tensor* out = nullptr) {
  Registers r(p.kinds.size());
  for (std::size_t k = 0; k < p.inputs; ++k) r[k] = inputs[k];
  for (std::size_t c = 0; c < p.constant_slots.size(); ++c)
    r[p.constant_slots[c]] = inputs[p.inputs + c];
  for (std::size_t i = 0; i < p.steps.size(); ++i) {
    try {
      if (out && i == p.root_step)
        apply_out(p.steps[i], r, *out);
      else
        apply(p.steps[i], r);
    } catch (...) {
      runtime::rethrow_with_context(std::current_exception(),
                                    p.steps[i].name + " (step " + std::to_string(i + 1) + " of " +
                                        std::to_string(p.steps.size()) + ")");
    }
  }
  return r[p.root];
}

// Elements per tile: tile_bytes of the widest tree operand, a multiple of 64 elements (so a
// tile's vector body and scalar tail split as the whole leaf's does) and at least 64.
int64_t tile_elements(int64_t tile_bytes, int64_t widest) {
  return std::max<int64_t>(64, tile_bytes / std::max<int64_t>(widest, 1) / 64 * 64);
}

// Whether the leaf can run tile by tile; sets `widest` (bytes of the widest tree operand's
// element). Tiles are views along the flattened elements, so every tree operand must be a
// contiguous CPU tensor of one shape, every broadcast tensor 0-d, and nothing needs autograd
// (the chain then runs whole, with ATen's own graph).
bool tileable(const FuseProgram& p, c10::ArrayRef<at::Tensor> in, c10::ArrayRef<Operand> args,
              int64_t& widest) {
  if (p.kinds[p.root] != SlotKind::result) return false;
  const bool grad = at::GradMode::is_enabled();
  const at::Tensor* shape = nullptr;
  widest = 0;
  for (std::size_t k = 0; k < in.size(); ++k) {
    const at::Tensor& t = in[k];
    if (!t.defined() || (grad && t.requires_grad())) return false;
    if (!args[k].is_tree()) {
      if (t.dim() != 0) return false;
      continue;
    }
    if (!t.device().is_cpu() || !t.is_contiguous()) return false;
    if (shape && !t.sizes().equals(shape->sizes())) return false;
    shape = &t;
    widest = std::max<int64_t>(widest, static_cast<int64_t>(t.element_size()));
  }
  return shape != nullptr;
}

// Whether the one-pass kernels take this leaf: every operand a tree leaf (tileable() has
// checked them contiguous CPU tensors of one shape) of one dtype, float32 or float64, that
// ATen would compute as a plain CPU tensor, on a thread that forces no dispatch key.
bool one_pass(const FuseProgram& p, c10::ArrayRef<at::Tensor> in, c10::ArrayRef<Operand> args) {
  if (!p.vector || !plain_cpu_thread()) return false;
  const at::ScalarType dtype = in[0].scalar_type();
  if (dtype != at::kFloat && dtype != at::kDouble) return false;
  for (std::size_t k = 0; k < in.size(); ++k)
    if (!args[k].is_tree() || in[k].scalar_type() != dtype || !plain_cpu_operand(in[k]))
      return false;
  return true;
}

// The chain in one pass over the leaf, block by block (fuse_kernels.hpp), on this leaf job's
// thread: the runtime spreads leaves (and a consolidated tree's pieces) over lanes.
at::Tensor run_one_pass(const VectorProgram& v, c10::ArrayRef<at::Tensor> in, int64_t tile_bytes) {
  const at::Tensor& first = in[0];
  const int64_t element = static_cast<int64_t>(first.element_size());
  // A smaller tile_bytes makes smaller blocks.
  const int64_t block = std::min(tile_elements(tile_bytes, element), kVectorBlockBytes / element);
  at::Tensor out = at::empty(first.sizes(), first.options());
  run_vector_program(v, in, out, block, 0, first.numel());
  return out;
}

// One leaf job: the whole chain on this leaf's operands, in one pass or tile by tile where it
// can. The first
// tile runs as written and is copied into the result; later tiles write the root's step into
// the result's slice (out=).
at::Tensor run_leaf(const FuseProgram& p, int64_t tile_bytes, c10::ArrayRef<Operand> args,
                    const LeafArgs& x) {
  c10::SmallVector<at::Tensor, 8> in;
  for (std::size_t k = 0; k < args.size(); ++k) in.push_back(x.t(k));
  int64_t widest = 0;
  if (!tileable(p, in, args, widest)) return run_program(p, in);
  if (one_pass(p, in, args)) return run_one_pass(*p.vector, in, tile_bytes);
  const at::Tensor* first = nullptr;
  for (std::size_t k = 0; k < args.size() && !first; ++k)
    if (args[k].is_tree()) first = &in[k];
  const int64_t n = first->numel(), tile = tile_elements(tile_bytes, widest);
  if (n <= tile) return run_program(p, in);
  const at::IntArrayRef sizes = first->sizes();
  c10::SmallVector<at::Tensor, 8> flat(in.begin(), in.end()), slice(in.begin(), in.end());
  for (std::size_t k = 0; k < args.size(); ++k)
    if (args[k].is_tree()) flat[k] = in[k].view({n});
  at::Tensor out;
  for (int64_t lo = 0; lo < n; lo += tile) {
    const int64_t len = std::min(tile, n - lo);
    for (std::size_t k = 0; k < args.size(); ++k)
      if (args[k].is_tree()) slice[k] = flat[k].narrow(0, lo, len);
    if (out.defined()) {
      const at::Tensor part = out.narrow(0, lo, len);
      (void)run_program(p, slice, &part);
      continue;
    }
    const at::Tensor r = run_program(p, slice);  // the first tile tells the result's dtype
    out = at::empty({n}, r.options());
    out.narrow(0, lo, len).copy_(r);
  }
  return out.view(sizes);
}

}  // namespace

TreeTensor run_fuse(const FuseOptions& o, const FuseProgram& p, c10::ArrayRef<Operand> args) {
  for (std::size_t k = 0; k < args.size(); ++k)
    if (args[k].kind() == Operand::Kind::scalar)
      throw std::invalid_argument("fuse: argument " + std::to_string(k) +
                                  " is a number; write numbers inside the function (x * 2)");
  if (p.kinds[p.root] == SlotKind::input && args[p.root].is_tree())
    return TreeTensor(args[p.root].tree());  // f returned its argument, as eager f would
  if (p.kinds[p.root] != SlotKind::result)
    throw std::invalid_argument("fuse: the function returned a broadcast tensor, not a tree");
  std::vector<Operand> all(args.begin(), args.end());
  for (const at::Tensor& c : p.constants) all.emplace_back(c);
  CallOptions co = elementwise(p.name);
  const double steps = static_cast<double>(p.steps.size());
  auto cost = [&](const LeafArgs& x) {
    double bytes = 0, elements = 0;
    for (std::size_t k = 0; k < all.size(); ++k) {
      if (!all[k].is_tree() || !x.t(k).defined()) continue;
      bytes += static_cast<double>(x.t(k).numel()) * static_cast<double>(x.t(k).element_size());
      elements = std::max(elements, static_cast<double>(x.t(k).numel()));
    }
    // Inputs read and the result written once; temporaries stay in cache.
    return runtime::LeafCost{elements * steps, bytes + bytes / static_cast<double>(all.size())};
  };
  co.cost = cost;
  const int64_t tile_bytes = o.tile_bytes;
  return map_leaves(co, all, [&](const LeafArgs& x) { return run_leaf(p, tile_bytes, all, x); });
}

// ---- the kernels and the Expr methods of the op registry ------------------------------------

namespace {
// The out= forms take the result as a non-const handle. ATen has no detach_out, isfinite_out
// or clone_out; these three compute as written and copy into the result (the same values).
namespace outs {
using namespace at;  // NOLINT: f_out resolves to ATen's where it exists
at::Tensor& detach_out(at::Tensor& o, CT x) {
  return o.copy_(x);
}
at::Tensor& isfinite_out(at::Tensor& o, CT x) {
  return o.copy_(at::isfinite(x));
}
at::Tensor& clone_out(at::Tensor& o, CT x) {
  return o.copy_(x);
}
}  // namespace outs

#define TREETENSOR_FUSE_ALPHA(n)                                               \
  const BinaryKernels k_##n{[](CT x, CT y, CS al) { return at::n(x, y, al); }, \
                            [](CT x, CS y, CS al) { return at::n(x, y, al); }, \
                            [](CT x, CT y, CS al) { (void)x.n##_(y, al); },    \
                            [](CT x, CS y, CS al) { (void)x.n##_(y, al); },    \
                            [](CT o, CT x, CT y, CS al) {                      \
                              at::Tensor r = o;                                \
                              (void)at::n##_out(r, x, y, al);                  \
                            },                                                 \
                            [](CT o, CT x, CS y, CS al) {                      \
                              at::Tensor r = o;                                \
                              (void)at::n##_out(r, x, y, al);                  \
                            }};
TREETENSOR_FUSE_ALPHA(add)
TREETENSOR_FUSE_ALPHA(sub)
#undef TREETENSOR_FUSE_ALPHA
}  // namespace
}  // namespace detail

// The op registry's elementwise ops (codegen/ops.toml): their kernels (detail::k_<name>) and
// Expr methods, generated.
#include "tensor/fuse_ops.inc"

namespace detail {
Expr FuseRecorder::operate(std::string_view op, const ExprOperand& a, const ExprOperand& b) {
  const BinaryKernels& k = op == "add" ? k_add : op == "sub" ? k_sub : op == "mul" ? k_mul : k_div;
  FuseRecorder* rec = a.kind_ == ExprOperand::Kind::expr ? a.expr_->rec_ : b.expr_->rec_;
  return rec->binary(op, k, a, b, 1, false);
}

}  // namespace detail

// ---- the one-pass kernels (fuse_kernels.hpp), per instruction set ---------------------------

namespace detail {
namespace {

VectorDtype vector_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return VectorDtype::f32;
    case at::kDouble:
      return VectorDtype::f64;
    case at::kLong:
      return VectorDtype::i64;
    case at::kInt:
      return VectorDtype::i32;
    default:
      TORCH_INTERNAL_ASSERT(false, "one-pass kernel: dtype ", t);
  }
}

}  // namespace

// The instruction set ATen's own CPU kernels run with here (it honours ATEN_CPU_CAPABILITY), so
// that an op computes with the vector width, and the SLEEF functions, of its ATen kernel.
void run_vector_program(const VectorProgram& p, c10::ArrayRef<at::Tensor> in, const at::Tensor& out,
                        int64_t block, int64_t begin, int64_t end) {
  const VectorDtype dtype = vector_dtype(out.scalar_type());
  TORCH_INTERNAL_ASSERT(in.size() == std::size_t(p.inputs) && p.slots <= kMaxVectorSlots);
  c10::SmallVector<const void*, 8> ptrs;
  for (const at::Tensor& t : in) {
    TORCH_INTERNAL_ASSERT(t.scalar_type() == out.scalar_type() && t.is_contiguous());
    ptrs.push_back(t.const_data_ptr());
  }
  thread_local std::vector<std::max_align_t> scratch;
  const std::size_t bytes =
      std::size_t(p.slots - p.inputs) * std::size_t(block) * out.element_size();
  scratch.resize(std::max(scratch.size(), bytes / sizeof(std::max_align_t) + 1));
  void* const o = out.data_ptr();
#if defined(__x86_64__)
  const KernelIsa isa = kernel_isa();
  if (isa == KernelIsa::avx512)
    return isa_avx512::run_vector_kernel(p, dtype, ptrs.data(), o, scratch.data(), block, begin,
                                         end);
  if (isa == KernelIsa::avx2)
    return isa_avx2::run_vector_kernel(p, dtype, ptrs.data(), o, scratch.data(), block, begin, end);
#endif
  isa_default::run_vector_kernel(p, dtype, ptrs.data(), o, scratch.data(), block, begin, end);
}

bool vector_alpha(const c10::Scalar& alpha) {
  return !alpha.isComplex() && !alpha.isSymbolic() && !alpha.isBoolean() && alpha.toDouble() == 1.0;
}

std::optional<VectorOperand> vector_number(VectorOp op, const c10::Scalar& s) {
  VectorOperand v;
  if (s.isSymbolic() || (op == VectorOp::sub && s.isBoolean())) return std::nullopt;
  if (s.isBoolean() || s.isIntegral(false)) {
    v.i = s.isBoolean() ? int64_t{s.toBool()} : s.toLong();
    v.f = static_cast<float>(v.i);
    v.d = static_cast<double>(v.i);
    v.integral = true;
  } else if (s.isFloatingPoint()) {
    v.d = s.toDouble();
    v.f = static_cast<float>(v.d);
  } else {
    return std::nullopt;
  }
  return v;
}

std::optional<VectorOp> vector_op(std::string_view name) {
  static constexpr std::pair<std::string_view, VectorOp> kOps[] = {
      {"add", VectorOp::add},         {"sub", VectorOp::sub},
      {"mul", VectorOp::mul},         {"div", VectorOp::div},
      {"maximum", VectorOp::maximum}, {"minimum", VectorOp::minimum},
      {"neg", VectorOp::neg},         {"abs", VectorOp::abs},
      {"sqrt", VectorOp::sqrt},       {"reciprocal", VectorOp::reciprocal},
      {"square", VectorOp::square},   {"relu", VectorOp::relu},
      {"exp", VectorOp::exp},         {"log", VectorOp::log},
      {"tanh", VectorOp::tanh},       {"sigmoid", VectorOp::sigmoid}};
  for (const auto& [n, op] : kOps)
    if (n == name) return op;
  return std::nullopt;
}
}  // namespace detail

FuseOptions& FuseOptions::tile(std::int64_t bytes) {
  if (bytes < 1)
    throw std::invalid_argument("FuseOptions::tile: tile_bytes must be at least 1, got " +
                                std::to_string(bytes));
  tile_bytes = bytes;
  return *this;
}

Expr Expr::add(const ExprOperand& other, const at::Scalar& alpha) const {
  return rec_->binary("add", detail::k_add, *this, other, alpha, false);
}
Expr& Expr::add_(const ExprOperand& other, const at::Scalar& alpha) {
  *this = rec_->binary("add_", detail::k_add, *this, other, alpha, true);
  return *this;
}
Expr Expr::sub(const ExprOperand& other, const at::Scalar& alpha) const {
  return rec_->binary("sub", detail::k_sub, *this, other, alpha, false);
}
Expr& Expr::sub_(const ExprOperand& other, const at::Scalar& alpha) {
  *this = rec_->binary("sub_", detail::k_sub, *this, other, alpha, true);
  return *this;
}

}  // namespace treetensor
