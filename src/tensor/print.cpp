// Printing: treetensor's tree layout with tensors in PyTorch's repr form. This is the only
// place a tensor is ever formatted (DI-treetensor #19: formatting while building cost 16x).
#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <ostream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "treetensor/tensor/dtype.hpp"
#include "treetensor/tensor/tree_tensor.hpp"

namespace treetensor {

std::optional<std::string> torch_dtype_name(c10::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return "float32";
    case at::kDouble:
      return "float64";
    case at::kHalf:
      return "float16";
    case at::kBFloat16:
      return "bfloat16";
    case at::kByte:
      return "uint8";
    case at::kChar:
      return "int8";
    case at::kShort:
      return "int16";
    case at::kInt:
      return "int32";
    case at::kLong:
      return "int64";
    case at::kBool:
      return "bool";
    case at::kComplexFloat:
      return "complex64";
    case at::kComplexDouble:
      return "complex128";
    case at::kComplexHalf:
      return "complex32";
    case at::kUInt16:
      return "uint16";
    case at::kUInt32:
      return "uint32";
    case at::kUInt64:
      return "uint64";
    case at::kFloat8_e4m3fn:
      return "float8_e4m3fn";
    case at::kFloat8_e5m2:
      return "float8_e5m2";
    case at::kFloat8_e4m3fnuz:
      return "float8_e4m3fnuz";
    case at::kFloat8_e5m2fnuz:
      return "float8_e5m2fnuz";
    case at::kFloat8_e8m0fnu:
      return "float8_e8m0fnu";
    default:
      return std::nullopt;
  }
}
namespace {

constexpr int64_t kThreshold = 1000;  // torch's print threshold: summarise above it
constexpr int64_t kEdgeItems = 3;
constexpr std::size_t kLineWidth = 80;

std::string dtype_name(at::ScalarType t) {
  return "torch." + torch_dtype_name(t).value_or(c10::toString(t));
}

// The elements a summarised print shows (torch's get_summarized_data): the first and last
// kEdgeItems along every dimension longer than twice that. The formatter's mode and widths come
// from these only, as torch's do.
at::Tensor summarized(const at::Tensor& t) {
  if (t.dim() == 0) return t;
  const int64_t n = t.size(0);
  if (t.dim() == 1)
    return n > 2 * kEdgeItems ? at::cat({t.slice(0, 0, kEdgeItems), t.slice(0, n - kEdgeItems)})
                              : t;
  std::vector<at::Tensor> rows;
  for (int64_t i = 0; i < n; ++i)
    if (n <= 2 * kEdgeItems || i < kEdgeItems || i >= n - kEdgeItems)
      rows.push_back(summarized(t.select(0, i)));
  return at::stack(rows);
}

// How the elements of one tensor are written (PyTorch's _Formatter, simplified), from the
// elements shown.
class Formatter {
 public:
  explicit Formatter(const at::Tensor& values) : kind_(kind_of(values.scalar_type())) {
    if (kind_ == Kind::complex) {  // torch's: one formatter for the real parts, one for the imag
      const at::Tensor z = values.to(at::kComplexDouble);
      parts_ = std::make_shared<const std::pair<Formatter, Formatter>>(Formatter(at::real(z)),
                                                                       Formatter(at::imag(z)));
      return;
    }
    if (kind_ == Kind::floating) measure_floating(values);
  }

  /// Complex cells come padded (the real part to its parts' width, as torch pads them); the
  /// Writer pads every other kind's cells to width().
  bool pads_itself() const { return kind_ == Kind::complex; }
  /// torch's element width, given the widest cell: the floating formatter's width (of the
  /// nonzero finite elements, so "nan" or "0." may be wider); a complex cell's real width +
  /// imag width + "j"; the widest cell for the other kinds.
  std::size_t width(std::size_t widest_cell) const {
    if (kind_ == Kind::floating) return width_;
    if (kind_ == Kind::complex) return parts_->first.width_ + parts_->second.width_ + 1;
    return widest_cell;
  }

  std::string operator()(const at::Tensor& scalar) const {
    char buf[64];
    switch (kind_) {
      case Kind::boolean:
        return scalar.item<bool>() ? "True" : "False";
      case Kind::integer:
        std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(scalar.item<int64_t>()));
        return buf;
      case Kind::floating:
        return floating(scalar.item<double>());
      case Kind::complex: {  // " 1.5000+2.0000j", "1.-10.j": the imag part unpadded, signed
        const auto z = scalar.to(at::kComplexDouble).item<c10::complex<double>>();
        const std::string re = parts_->first.floating(z.real());
        const std::string im = parts_->second.floating(z.imag());
        return std::string(parts_->first.width_ - std::min(parts_->first.width_, re.size()), ' ') +
               re + (im[0] == '-' ? "" : "+") + im + "j";
      }
      case Kind::other:
        break;
    }
    std::ostringstream os;
    os << scalar.item();
    return os.str();
  }

 private:
  enum class Kind { boolean, integer, floating, complex, other };
  static Kind kind_of(at::ScalarType t) {
    if (t == at::kBool) return Kind::boolean;
    if (at::isIntegralType(t, false)) return Kind::integer;
    if (at::isFloatingType(t)) return Kind::floating;
    if (at::isComplexType(t)) return Kind::complex;
    return Kind::other;
  }

  // The mode (integers, fixed, scientific) and width of floating elements: torch's, from the
  // nonzero finite ones.
  void measure_floating(const at::Tensor& values) {
    int_mode_ = true;
    const at::Tensor v = values.to(at::kDouble).reshape({-1});
    const at::Tensor nonzero = v.masked_select(at::isfinite(v) & v.ne(0)).contiguous();
    if (nonzero.numel() == 0) return;
    const at::Tensor mag = nonzero.abs();
    const double max = mag.max().item<double>(), min = mag.min().item<double>();
    int_mode_ = at::equal(nonzero, nonzero.ceil());
    sci_ = max / min > 1000.0 || max > 1e8 || min < 1e-4;
    const double* x = nonzero.const_data_ptr<double>();
    for (int64_t i = 0; i < nonzero.numel(); ++i) width_ = std::max(width_, floating(x[i]).size());
  }

  std::string floating(double v) const {
    if (std::isnan(v)) return "nan";
    if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
    char buf[64];
    if (sci_)
      std::snprintf(buf, sizeof buf, "%.4e", v);
    else if (int_mode_)
      std::snprintf(buf, sizeof buf, "%.0f.", v);
    else
      std::snprintf(buf, sizeof buf, "%.4f", v);
    return buf;
  }

  Kind kind_;
  bool int_mode_ = false;
  bool sci_ = false;
  std::size_t width_ = 1;  // of the widest nonzero finite floating element (torch's minimum: 1)
  std::shared_ptr<const std::pair<Formatter, Formatter>> parts_;  // complex: real, imag
};

// The elements shown along one dimension: all of them, or the first and last kEdgeItems.
std::vector<int64_t> shown(int64_t size, bool summarise) {
  std::vector<int64_t> idx;
  if (summarise && size > 2 * kEdgeItems) {
    for (int64_t i = 0; i < kEdgeItems; ++i) idx.push_back(i);
    idx.push_back(-1);  // the "..." marker
    for (int64_t i = size - kEdgeItems; i < size; ++i) idx.push_back(i);
  } else {
    for (int64_t i = 0; i < size; ++i) idx.push_back(i);
  }
  return idx;
}

// Collects the element strings (to find the common width) or writes the nested brackets.
class Writer {
 public:
  Writer(const at::Tensor& t, bool summarise, const Formatter& fmt)
      : t_(t), summarise_(summarise), fmt_(fmt) {
    collect(t_);
    std::size_t widest = 0;
    for (const auto& s : cells_) widest = std::max(widest, s.size());
    width_ = fmt_.width(widest);
  }

  void write(std::ostream& os, std::size_t indent) {
    next_ = 0;
    emit(os, t_, indent);
  }

 private:
  void collect(const at::Tensor& t) {
    if (t.dim() == 0) {
      cells_.push_back(fmt_(t));
      return;
    }
    for (int64_t i : shown(t.size(0), summarise_))
      if (i >= 0) collect(t.select(0, i));
  }

  std::string pad(const std::string& s) const {
    if (fmt_.pads_itself()) return s;
    return std::string(width_ - std::min(width_, s.size()), ' ') + s;
  }

  void emit(std::ostream& os, const at::Tensor& t, std::size_t indent) {
    if (t.dim() == 0) {
      os << pad(cells_[next_++]);
      return;
    }
    os << '[';
    const auto idx = shown(t.size(0), summarise_);
    if (t.dim() == 1) {
      const std::size_t per_line = std::max<std::size_t>(
          1, (kLineWidth - std::min(kLineWidth - 1, indent + 1)) / (width_ + 2));
      for (std::size_t k = 0; k < idx.size(); ++k) {
        if (k) os << (k % per_line == 0 ? ",\n" + std::string(indent + 1, ' ') : ", ");
        if (idx[k] < 0)
          os << " ...";  // PyTorch's 1-D ellipsis has a leading space
        else
          os << pad(cells_[next_++]);
      }
    } else {
      const std::string sep = "," + std::string(static_cast<std::size_t>(t.dim() - 1), '\n') +
                              std::string(indent + 1, ' ');
      for (std::size_t k = 0; k < idx.size(); ++k) {
        if (k) os << sep;
        if (idx[k] < 0)
          os << "...";
        else
          emit(os, t.select(0, idx[k]), indent + 1);
      }
    }
    os << ']';
  }

  const at::Tensor& t_;
  bool summarise_;
  const Formatter& fmt_;
  std::vector<std::string> cells_;
  std::size_t width_ = 0;
  std::size_t next_ = 0;
};

// Whether torch's repr names the dtype: an empty tensor's unless it is the default; another's
// unless it is the default, the default complex one (complex128 with a float64 default,
// complex64 otherwise), int64 or bool.
bool names_dtype(at::ScalarType t, bool empty) {
  const at::ScalarType d = at::typeMetaToScalarType(at::get_default_dtype());
  if (empty) return t != d;
  const at::ScalarType complex = d == at::kDouble ? at::kComplexDouble : at::kComplexFloat;
  return t != d && t != complex && t != at::kLong && t != at::kBool;
}

}  // namespace

namespace {
// ", size=(2, 3)" as torch writes it (a 1-d size with its trailing comma).
void write_size(std::ostream& os, const at::Tensor& t) {
  os << ", size=(";
  for (int64_t d = 0; d < t.dim(); ++d) os << (d ? ", " : "") << t.size(d);
  os << (t.dim() == 1 ? ",)" : ")");
}

void write_autograd(std::ostream& os, const at::Tensor& t) {
  if (t.grad_fn())
    os << ", grad_fn=<" << t.grad_fn()->name() << ">";
  else if (t.requires_grad())
    os << ", requires_grad=True";
}

// A meta tensor has no values: torch prints "tensor(..., device='meta', size=(2,))".
std::string format_meta(const at::Tensor& t) {
  std::ostringstream os;
  os << "tensor(..., device='meta'";
  write_size(os, t);
  if (t.scalar_type() != at::typeMetaToScalarType(at::get_default_dtype()))
    os << ", dtype=" << dtype_name(t.scalar_type());
  write_autograd(os, t);
  os << ')';
  return os.str();
}
}  // namespace

std::string format_tensor(const at::Tensor& t) {
  if (!t.defined()) return "None";
  if (t.is_meta()) return format_meta(t);
  if (t.is_sparse()) {
    std::ostringstream os;
    os << t;
    return os.str();
  }
  const at::Tensor v = t.detach().cpu();
  std::ostringstream os;
  os << "tensor(";
  if (v.numel() == 0) {
    os << "[]";
  } else {
    const bool summarise = v.numel() > kThreshold;
    const Formatter fmt(summarise ? summarized(v) : v);
    Writer(v, summarise, fmt).write(os, 7);
  }
  if (v.numel() == 0 && v.dim() != 1) write_size(os, t);
  if (t.device().type() != at::kCPU) os << ", device='" << t.device() << "'";
  if (names_dtype(t.scalar_type(), v.numel() == 0)) os << ", dtype=" << dtype_name(t.scalar_type());
  write_autograd(os, t);
  os << ')';
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const Size& s) {
  os << "torch.Size([";
  for (std::size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  return os << "])";
}

std::ostream& operator<<(std::ostream& os, const TreeTensor& t) {
  tree::print(os, static_cast<const TensorTree&>(t), "<TreeTensor>",
              [](std::ostream& o, const at::Tensor& x) { o << format_tensor(x); });
  return os;
}

}  // namespace treetensor
