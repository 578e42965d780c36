// Tensor ops on trees for Python: the op registry's ops as methods and module functions, operators
// with reflected and in-place forms, reductions, construction, shape ops, attributes and
// autograd. Every call that does leaf work releases the GIL (nogil).
// Module functions of the registry fall back to the torch function of the same name when no
// argument is a tree (DI-treetensor: ttorch.sigmoid(torch_tensor) is torch.sigmoid).

#include <pybind11/stl.h>
#include <torch/csrc/Size.h>
#include <torch/csrc/autograd/autograd.h>

#include "common.hpp"

namespace treetensor::python {
namespace {

py::object torch_attr(const char* name) {
  return py::module_::import("torch").attr(name);
}

bool tree_like(py::handle h) {
  return is_tree(h) || PyDict_Check(h.ptr()) ||
         (!is_tensor(h) && !PyLong_Check(h.ptr()) && !PyFloat_Check(h.ptr()) && is_foreign_tree(h));
}

/// Calls f(const TensorTree&) on x's tree (a tree object's node, or a dict converted).
template <class F>
decltype(auto) with_tree(py::handle x, F&& f) {
  if (is_tree(x)) return f(as_tree(x).operand());
  const TreeTensor t = to_tree(x);
  return f(static_cast<const TensorTree&>(t));
}

/// torch.autograd.backward of ops[0]'s leaves with ops[1]'s (if given) as their gradients,
/// checked leaf by leaf first so that an error names the path (autograd's own names an index).
void tree_backward(const std::vector<Operand>& ops, c10::optional<bool> retain_graph,
                   bool create_graph) {
  detail::CallOptions o{"backward"};
  const std::size_t n = ops[0].tree().leaf_count();  // a strict zip has its leaves, in order
  std::vector<at::Tensor> outs(n), grads(ops.size() > 1 ? n : 0);
  detail::map_leaves_multi(o, ops, [&](const detail::LeafArgs& x) -> std::vector<at::Tensor> {
    const at::Tensor& out = x.t(0);
    if (ops.size() == 1) {
      if (out.numel() != 1)
        throw std::runtime_error("the leaf has " + std::to_string(out.numel()) +
                                 " elements: a gradient can be implied only for one element "
                                 "(pass gradient, a tree of the leaves' structure)");
    } else if (!x.t(1).sizes().equals(out.sizes())) {
      throw std::runtime_error("the gradient has shape " + c10::str(x.t(1).sizes()) +
                               ", the leaf " + c10::str(out.sizes()));
    }
    outs[x.leaf()] = out;  // leaves may run on lanes: each writes its own slot
    if (ops.size() > 1) grads[x.leaf()] = x.t(1);
    return {};
  });
  torch::autograd::backward(outs, grads, retain_graph, create_graph);
}

/// An in-place call on self's leaves: the same leaf tensors change, so a view updates its root.
/// Inside a pending scope the copy comes back pending (asyncs, DESIGN.md §10). A root then
/// stands for it, so that reading it waits for the job; a view waits for the job here instead
/// (GIL released): a pending node below a root would be made by reads that walk into it with
/// the GIL held.
template <class F>
py::object inplace(py::object self, F&& f) {
  PyTree& s = as_tree(self);
  TreeTensor t(s.operand());
  nogil([&] { f(t); });
  if (!t.is_pending()) return self;
  if (s.path.empty()) {
    s.replace(std::move(t));
  } else {
    s.wait_ready(t);
  }
  return self;
}

/// Leaf-wise f(LeafArgs) for ops the core does not name (floor_divide, shifts, ...).
template <class F>
TreeTensor leafwise(std::string_view op, std::vector<Operand>& ops, F&& f) {
  detail::CallOptions o{op};
  o.wrap_scalars = true;
  return nogil(
      [&] { return detail::map_leaves(o, ops, [&](const detail::LeafArgs& x) { return f(x); }); });
}
template <class F>
void leafwise_(std::string_view op, std::vector<Operand>& ops, F&& f) {
  detail::CallOptions o{op};
  o.wrap_scalars = true;
  nogil([&] { detail::update_leaves(o, ops, [&](const detail::LeafArgs& x) { f(x); }); });
}

std::vector<int64_t> int_list(py::handle h) {
  try {
    if (PyLong_Check(h.ptr())) return {h.cast<int64_t>()};
    if (PyUnicode_Check(h.ptr())) throw py::cast_error();
    std::vector<int64_t> out;
    for (auto v : py::reinterpret_borrow<py::iterable>(h)) out.push_back(v.cast<int64_t>());
    return out;
  } catch (py::cast_error&) {
    throw py::type_error("treetensor: expected an int or a sequence of ints, got " +
                         py::repr(h).cast<std::string>());
  }
}
/// `reshape(2, 3)` and `reshape((2, 3))` alike.
std::vector<int64_t> shape_args(const py::args& a) {
  if (a.size() == 1 && !PyLong_Check(a[0].ptr())) return int_list(a[0]);
  std::vector<int64_t> out;
  for (auto v : a) {
    if (!PyLong_Check(v.ptr()))
      throw py::type_error("treetensor: expected ints, got " + py::repr(v).cast<std::string>());
    out.push_back(v.cast<int64_t>());
  }
  return out;
}

// One walk over a nested dict of shapes, as DictWalk (module.cpp) over a dict of tensors.
struct ShapeWalk {
  tree::Path where;
  OpenDicts open;

  ShapeTree value(py::handle h) {
    if (PyDict_Check(h.ptr())) return dict(h);
    if (py::object d = foreign_dict(h); !d.is_none()) return dict(d);
    try {
      return ShapeTree(int_list(h));
    } catch (py::type_error&) {
      throw py::type_error("treetensor: the shape at '" + where.describe() +
                           "' is not a sequence of ints");
    }
  }
  ShapeTree dict(py::handle h) {
    open.enter(h, where);
    ShapeTree::Children ch;
    for (auto [k, v] : py::reinterpret_borrow<py::dict>(h)) {
      if (!PyUnicode_Check(k.ptr()))
        throw py::type_error("treetensor: shape tree key at '" + where.describe() +
                             "' is not a string");
      std::string key = k.cast<std::string>();
      where.push_back(key);
      ShapeTree sub = value(v);
      where.pop_back();
      ch.emplace_back(std::move(key), std::move(sub));
    }
    open.leave(h);
    return ShapeTree::from_children(std::move(ch));
  }
};

/// A tree of shapes from nested dicts (or foreign trees) of int sequences.
/// @throws TypeError naming the path of a key that is not a string or a shape that is not a
///         sequence of ints; ValueError for a dict containing itself or nested too deep.
ShapeTree to_shapes(py::handle h) {
  return ShapeWalk{}.value(h);
}

/// A nested dict of f(leaf) (trees of non-tensor values: shape, dtype, ...).
template <class F>
py::object values(const TensorTree& t, F&& f) {
  if (t.is_leaf()) return f(t.leaf());
  py::dict d;
  for (const auto& [k, v] : t) d[py::str(k)] = values(v, f);
  return d;
}

py::object tuple_of(std::vector<TreeTensor> trees) {
  py::tuple out(trees.size());
  for (std::size_t i = 0; i < trees.size(); ++i) out[i] = wrap(std::move(trees[i]));
  return out;
}

/// split / chunk / unbind of one tree: the tuple of trees whose tree k holds every leaf's
/// piece k (`even`, the parallel tree call); when the leaves give different numbers of pieces
/// (uneven sizes), DI-treetensor's result instead: a treetensor.common.Object of each leaf's
/// tuple of pieces (`leaf` of the leaf, made on the calling thread).
constexpr const char* kPiecesDoc =
    "A tuple of trees, tree k holding every leaf's piece k; when the leaves give different "
    "numbers of pieces, a treetensor.common.Object of each leaf's tuple of pieces (DI-treetensor "
    "parity), made on the calling thread (inside an asyncs scope too) after the tree call found "
    "the counts differ.";

template <class Even, class Leaf>
py::object pieces(const TensorTree& n, Even even, Leaf leaf) {
  try {
    return tuple_of(nogil(even));
  } catch (const tree::StructureError&) {  // NOLINT(bugprone-empty-catch): uneven, see below
    // The only structure error of a one-tree call: the leaves' piece counts differ.
  }
  return object_class()(values(n, [&](const at::Tensor& t) {
    const std::vector<at::Tensor> parts = leaf(t);
    py::tuple out(parts.size());
    for (std::size_t i = 0; i < parts.size(); ++i) out[i] = wrap_tensor(parts[i]);
    return py::object(std::move(out));
  }));
}

std::vector<TreeTensor> tree_list(py::handle seq) {
  std::vector<TreeTensor> out;
  for (auto v : py::reinterpret_borrow<py::iterable>(seq)) out.push_back(to_tree(v));
  return out;
}

py::object finish(TreeTensor t, bool requires_grad) {
  if (requires_grad) treetensor::requires_grad_(t, true);
  return wrap(std::move(t));
}

}  // namespace

void bind_ops(py::module_& m, py::class_<PyTree>& cls) {
  // ---- the op registry (codegen/ops.toml): methods, in-place methods and module functions,
  // generated; docstrings from its doc column.
#include "ops_generated.inc"

  // add / sub with alpha
  auto add_like = [&](const char* name, auto fn, auto fn_) {
    cls.def(
        name,
        [fn](const PyTree& s, py::handle other, const Number& alpha) {
          Args a;
          const Operand x(s.operand()), y = a.add(other);
          return wrap(nogil([&] { return fn(x, y, alpha); }));
        },
        py::arg("other"), py::kw_only(), py::arg("alpha") = 1);
    m.def(
        name,
        [fn, name](py::handle l, py::handle r, const Number& alpha) -> py::object {
          if (!tree_like(l) && !tree_like(r))
            return torch_attr(name)(l, r, py::arg("alpha") = alpha);
          Args a;
          const Operand x = a.add(l), y = a.add(r);
          return wrap(nogil([&] { return fn(x, y, alpha); }));
        },
        py::arg("input"), py::arg("other"), py::kw_only(), py::arg("alpha") = 1);
    cls.def((std::string(name) + "_").c_str(),
            [fn_](py::object self, py::handle other, const Number& alpha) {
              Args a;
              const Operand y = a.add(other);
              return inplace(self, [&](TreeTensor& t) { fn_(t, y, alpha); });
            },
            py::arg("other"), py::kw_only(), py::arg("alpha") = 1);
  };
  add_like(
      "add",
      [](const Operand& a, const Operand& b, const at::Scalar& al) {
        return treetensor::add(a, b, al);
      },
      [](TreeTensor& t, const Operand& b, const at::Scalar& al) { treetensor::add_(t, b, al); });
  add_like(
      "sub",
      [](const Operand& a, const Operand& b, const at::Scalar& al) {
        return treetensor::sub(a, b, al);
      },
      [](TreeTensor& t, const Operand& b, const at::Scalar& al) { treetensor::sub_(t, b, al); });

  // ---- operators ----------------------------------------------------------------------------
  // Binary operator `op` through a core function `fn(Operand, Operand)`: forward, reflected.
  auto binop = [&](const char* fwd, const char* rev, auto fn) {
    cls.def(fwd, [fn](const PyTree& s, py::handle other) -> py::object {
      Args a;
      const Operand x(s.operand());
      Operand y = x;
      try {
        y = a.add(other);
      } catch (py::type_error&) {
        return py::reinterpret_borrow<py::object>(Py_NotImplemented);
      }
      return wrap(nogil([&] { return fn(x, y); }));
    });
    if (rev)
      cls.def(rev, [fn](const PyTree& s, py::handle other) -> py::object {
        Args a;
        const Operand y(s.operand());
        Operand x = y;
        try {
          x = a.add(other);
        } catch (py::type_error&) {
          return py::reinterpret_borrow<py::object>(Py_NotImplemented);
        }
        return wrap(nogil([&] { return fn(x, y); }));
      });
  };
  auto iop = [&](const char* name, auto fn_) {
    cls.def(name, [fn_](py::object self, py::handle other) {
      Args a;
      const Operand y = a.add(other);
      return inplace(self, [&](TreeTensor& t) { fn_(t, y); });
    });
  };
  using O = const Operand&;
  binop("__add__", "__radd__", [](O a, O b) { return treetensor::add(a, b); });
  binop("__sub__", "__rsub__", [](O a, O b) { return treetensor::sub(a, b); });
  binop("__mul__", "__rmul__", [](O a, O b) { return treetensor::mul(a, b); });
  binop("__truediv__", nullptr, [](O a, O b) { return treetensor::div(a, b); });
  // torch's number / tensor is tensor.reciprocal() * number (torch/_tensor.py's __rdiv__),
  // not a division: the same bits need the same two roundings. A tensor / tree divides.
  binop("__rtruediv__", nullptr, [](O t, O other) {
    if (other.kind() != Operand::Kind::scalar) return treetensor::div(other, t);
    return treetensor::mul(treetensor::reciprocal(t.tree()), other);
  });
  binop("__mod__", "__rmod__", [](O a, O b) { return treetensor::remainder(a, b); });
  binop("__pow__", "__rpow__", [](O a, O b) { return treetensor::pow(a, b); });
  binop("__matmul__", "__rmatmul__", [](O a, O b) { return treetensor::matmul(a, b); });
  binop("__and__", "__rand__", [](O a, O b) { return treetensor::bitwise_and(a, b); });
  binop("__or__", "__ror__", [](O a, O b) { return treetensor::bitwise_or(a, b); });
  binop("__xor__", "__rxor__", [](O a, O b) { return treetensor::bitwise_xor(a, b); });
  binop("__eq__", nullptr, [](O a, O b) { return treetensor::eq(a, b); });
  binop("__ne__", nullptr, [](O a, O b) { return treetensor::ne(a, b); });
  binop("__lt__", nullptr, [](O a, O b) { return treetensor::lt(a, b); });
  binop("__le__", nullptr, [](O a, O b) { return treetensor::le(a, b); });
  binop("__gt__", nullptr, [](O a, O b) { return treetensor::gt(a, b); });
  binop("__ge__", nullptr, [](O a, O b) { return treetensor::ge(a, b); });
  auto leaf2 = [](const char* op, auto f) {
    return [op, f](O a, O b) {
      std::vector<Operand> ops{a, b};
      detail::CallOptions o{op};
      o.wrap_scalars = true;
      return detail::map_leaves(o, ops,
                                [&](const detail::LeafArgs& x) { return f(x.t(0), x.t(1)); });
    };
  };
  const auto floordiv = leaf2("floor_divide", [](const at::Tensor& a, const at::Tensor& b) {
    return at::div(a, b, "floor");
  });
  const auto lshift = leaf2("bitwise_left_shift", [](const at::Tensor& a, const at::Tensor& b) {
    return at::bitwise_left_shift(a, b);
  });
  const auto rshift = leaf2("bitwise_right_shift", [](const at::Tensor& a, const at::Tensor& b) {
    return at::bitwise_right_shift(a, b);
  });
  binop("__floordiv__", "__rfloordiv__", floordiv);
  binop("__lshift__", "__rlshift__", lshift);
  binop("__rshift__", "__rrshift__", rshift);
  iop("__iadd__", [](TreeTensor& t, O b) { treetensor::add_(t, b); });
  iop("__isub__", [](TreeTensor& t, O b) { treetensor::sub_(t, b); });
  iop("__imul__", [](TreeTensor& t, O b) { treetensor::mul_(t, b); });
  iop("__itruediv__", [](TreeTensor& t, O b) { treetensor::div_(t, b); });
  iop("__imod__", [](TreeTensor& t, O b) { treetensor::remainder_(t, b); });
  iop("__ipow__", [](TreeTensor& t, O b) { treetensor::pow_(t, b); });
  iop("__iand__", [](TreeTensor& t, O b) { treetensor::bitwise_and_(t, b); });
  iop("__ior__", [](TreeTensor& t, O b) { treetensor::bitwise_or_(t, b); });
  iop("__ixor__", [](TreeTensor& t, O b) { treetensor::bitwise_xor_(t, b); });
  auto leaf2_ = [](const char* op, auto f) {
    return [op, f](TreeTensor& t, O b) {
      std::vector<Operand> ops{Operand(t), b};
      detail::CallOptions o{op};
      o.wrap_scalars = true;
      detail::update_leaves(o, ops, [&](const detail::LeafArgs& x) {
        at::Tensor a = x.t(0);
        f(a, x.t(1));
      });
    };
  };
  iop("__ifloordiv__",
      leaf2_("floor_divide_", [](at::Tensor& a, const at::Tensor& b) { a.div_(b, "floor"); }));
  iop("__ilshift__", leaf2_("bitwise_left_shift_",
                            [](at::Tensor& a, const at::Tensor& b) { a.bitwise_left_shift_(b); }));
  iop("__irshift__", leaf2_("bitwise_right_shift_",
                            [](at::Tensor& a, const at::Tensor& b) { a.bitwise_right_shift_(b); }));
  cls.def("__neg__", [](const PyTree& s) {
    const TensorTree& n = s.operand();
    return wrap(nogil([&] { return treetensor::neg(n); }));
  });
  cls.def("__pos__", [](py::object self) { return self; });
  cls.def("__invert__", [](const PyTree& s) {
    const TensorTree& n = s.operand();
    return wrap(nogil([&] { return treetensor::bitwise_not(n); }));
  });
  cls.def("__abs__", [](const PyTree& s) {
    const TensorTree& n = s.operand();
    return wrap(nogil([&] { return treetensor::abs(n); }));
  });
  cls.def("floor_divide", [floordiv](const PyTree& s, py::handle other) {
    Args a;
    const Operand x(s.operand()), y = a.add(other);
    return wrap(nogil([&] { return floordiv(x, y); }));
  });

  // ---- more leaf-wise functions -----------------------------------------------------------
  cls.def(
      "clamp",
      [](py::object self, py::handle min, py::handle max) {
        // Numbers here; a tensor bound (0-d too: its gradient, no .item()) or a tree bound is
        // torch's per leaf (DI-treetensor's method).
        std::optional<Number> lo, hi;
        try {
          if (is_tensor(min) || is_tensor(max)) throw py::cast_error();
          lo = min.cast<std::optional<Number>>(), hi = max.cast<std::optional<Number>>();
        } catch (const py::cast_error&) {
          py::kwargs bounds;
          bounds["min"] = min, bounds["max"] = max;
          return torch_leafwise(self, "clamp", py::args(), bounds);
        }
        const TensorTree& n = as_tree(self).operand();
        return wrap(nogil([&] { return treetensor::clamp(n, scalar(lo), scalar(hi)); }));
      },
      py::arg("min") = py::none(), py::arg("max") = py::none());
  cls.def(
      "clamp_",
      [](py::object self, std::optional<Number> lo, std::optional<Number> hi) {
        return inplace(self, [&](TreeTensor& t) { treetensor::clamp_(t, scalar(lo), scalar(hi)); });
      },
      py::arg("min") = py::none(), py::arg("max") = py::none());
  cls.def("copy_", [](py::object self, py::handle src) {
    Args a;
    const Operand y = a.add(src);
    return inplace(self, [&](TreeTensor& t) { treetensor::copy_(t, y); });
  });
  cls.def("zero_", [](py::object self) {
    return inplace(self, [](TreeTensor& t) { treetensor::zero_(t); });
  });
  cls.def("fill_", [](py::object self, const Number& v) {
    return inplace(self, [&](TreeTensor& t) { treetensor::fill_(t, v); });
  });
  cls.def(
      "requires_grad_",
      [](py::object self, bool rg) {
        // A flag of each leaf tensor, not data: the tree's own leaves are made first, or a
        // consolidated tree's copy in inplace() would flag views of its own (DESIGN.md §12).
        (void)as_tree(self).node().is_leaf();  // any look inside makes a deferred tree
        return inplace(self, [&](TreeTensor& t) { treetensor::requires_grad_(t, rg); });
      },
      py::arg("requires_grad") = true);
  m.def(
      "where",
      [](py::handle c, py::handle x, py::handle y) -> py::object {
        if (!tree_like(c) && !tree_like(x) && !tree_like(y)) return torch_attr("where")(c, x, y);
        Args a;
        const Operand oc = a.add(c), ox = a.add(x), oy = a.add(y);
        return wrap(nogil([&] { return treetensor::where(oc, ox, oy); }));
      },
      py::arg("condition"), py::arg("input"), py::arg("other"));
  cls.def("where", [](const PyTree& s, py::handle c, py::handle y) {
    Args a;
    const Operand ox(s.operand()), oc = a.add(c), oy = a.add(y);
    return wrap(nogil([&] { return treetensor::where(oc, ox, oy); }));
  });
  cls.def(
      "isclose",
      [](const PyTree& s, py::handle other, double rtol, double atol, bool equal_nan) {
        Args a;
        const Operand x(s.operand()), y = a.add(other);
        return wrap(nogil([&] { return treetensor::isclose(x, y, rtol, atol, equal_nan); }));
      },
      py::arg("other"), py::arg("rtol") = 1e-5, py::arg("atol") = 1e-8,
      py::arg("equal_nan") = false);
  m.def("_equal", [](py::handle a, py::handle b) {
    const TreeTensor x = to_tree(a), y = to_tree(b);
    return nogil([&] { return treetensor::equal(x, y); });
  });
  m.def(
      "_allclose",
      [](py::handle a, py::handle b, double rtol, double atol, bool equal_nan) {
        const TreeTensor x = to_tree(a), y = to_tree(b);
        return nogil([&] { return treetensor::allclose(x, y, rtol, atol, equal_nan); });
      },
      py::arg("input"), py::arg("other"), py::arg("rtol") = 1e-5, py::arg("atol") = 1e-8,
      py::arg("equal_nan") = false);

  // ---- reductions: tree-level without dim (one tensor), per-leaf with dim (a tree) ------
  // Tree-level results go pending inside a pending asyncs scope (tree_level, common.hpp).
  auto reduce = [&](const char* name, Reduction op, at::Tensor (*whole)(const TensorTree&),
                    auto per_leaf) {
    cls.def(
        name,
        [name, op, whole, per_leaf](const PyTree& s, py::handle dim, bool keepdim) -> py::object {
          const TensorTree& n = s.operand();
          if (dim.is_none()) return tree_level(op, name, n, whole);
          const auto d = int_list(dim);
          return wrap(nogil([&] { return per_leaf(n, d, keepdim); }));
        },
        py::arg("dim") = py::none(), py::arg("keepdim") = false);
  };
  using D = const std::vector<int64_t>&;
  using T = const TensorTree&;
  reduce(
      "sum", Reduction::sum, [](T n) { return treetensor::sum(n); },
      [](T n, D d, bool k) { return treetensor::leaf_sum(n, d, k); });
  reduce(
      "mean", Reduction::mean, [](T n) { return treetensor::mean(n); },
      [](T n, D d, bool k) { return treetensor::leaf_mean(n, d, k); });
  reduce(
      "all", Reduction::all, [](T n) { return treetensor::all(n); },
      [](T n, D d, bool k) { return treetensor::leaf_all(n, d.at(0), k); });
  reduce(
      "any", Reduction::any, [](T n) { return treetensor::any(n); },
      [](T n, D d, bool k) { return treetensor::leaf_any(n, d.at(0), k); });
  reduce(
      "std", Reduction::std, [](T n) { return treetensor::std(n); },
      [](T n, D d, bool k) { return treetensor::leaf_std(n, d, true, k); });
  for (const char* name : {"min", "max"}) {
    const bool is_min = name[1] == 'i';
    cls.def(
        name,
        [is_min, name](const PyTree& s, py::handle dim, bool keepdim) -> py::object {
          const TensorTree& n = s.operand();
          if (dim.is_none())
            return is_min
                       ? tree_level(Reduction::min, name, n, [](T t) { return treetensor::min(t); })
                       : tree_level(Reduction::max, name, n,
                                    [](T t) { return treetensor::max(t); });
          const int64_t d = dim.cast<int64_t>();
          auto [v, i] = nogil([&] {
            return is_min ? treetensor::leaf_min(n, d, keepdim)
                          : treetensor::leaf_max(n, d, keepdim);
          });
          return py::make_tuple(wrap(std::move(v)), wrap(std::move(i)));
        },
        py::arg("dim") = py::none(), py::arg("keepdim") = false);
  }
  cls.def(
      "_leaf_norm",
      [](const PyTree& s, double p) {
        const TensorTree& n = s.operand();
        return wrap(nogil([&] { return treetensor::leaf_norm(n, p); }));
      },
      py::arg("p") = 2.0,
      "at::norm(leaf, p) of every leaf (a tree; pending inside an asyncs scope): what "
      "treetensor.torch's Tensor.norm(p) runs (DI-treetensor: per leaf).");
  cls.def("masked_select", [](const PyTree& s, py::handle mask) {
    Args a;
    const Operand mk = a.add(mask);
    const TensorTree& n = s.operand();
    return wrap_tensor(nogil([&] { return treetensor::masked_select(n, mk); }));
  });

  // ---- shape ---------------------------------------------------------------------------------
  // One shape for every leaf here; a tree of shapes (`t.reshape(u.shape)`, an Object), a
  // dtype (`t.view(torch.int32)`) or keywords (`view(dtype=...)`) are torch's per leaf
  // (DI-treetensor's).
  auto one_shape = [](const py::args& shape) {
    const PyObject* a = shape.size() == 1 ? shape[0].ptr() : nullptr;
    return a == nullptr || PyLong_Check(a) || PyTuple_Check(a) || PyList_Check(a);
  };
  cls.def("reshape", [one_shape](py::object self, py::args shape, py::kwargs kw) {
    if (!kw.empty() || !one_shape(shape)) return torch_leafwise(self, "reshape", shape, kw);
    const auto sh = shape_args(shape);
    const TensorTree& n = as_tree(self).operand();
    return wrap(nogil([&] { return treetensor::reshape(n, sh); }));
  });
  cls.def("view", [one_shape](py::object self, py::args shape, py::kwargs kw) {
    if (!kw.empty() || !one_shape(shape)) return torch_leafwise(self, "view", shape, kw);
    const auto sh = shape_args(shape);
    const TensorTree& n = as_tree(self).operand();
    return wrap(nogil([&] { return treetensor::view(n, sh); }));
  });
  cls.def(
      "squeeze",
      [](const PyTree& s, c10::optional<int64_t> dim) {
        const TensorTree& n = s.operand();
        return wrap(
            nogil([&] { return dim ? treetensor::squeeze(n, *dim) : treetensor::squeeze(n); }));
      },
      py::arg("dim") = py::none());
  cls.def(
      "unsqueeze",
      [](const PyTree& s, int64_t dim) {
        const TensorTree& n = s.operand();
        return wrap(nogil([&] { return treetensor::unsqueeze(n, dim); }));
      },
      py::arg("dim"));
  cls.def("transpose", [](const PyTree& s, int64_t d0, int64_t d1) {
    const TensorTree& n = s.operand();
    return wrap(nogil([&] { return treetensor::transpose(n, d0, d1); }));
  });
  cls.def("permute", [](const PyTree& s, py::args dims) {
    const auto d = shape_args(dims);
    const TensorTree& n = s.operand();
    return wrap(nogil([&] { return treetensor::permute(n, d); }));
  });
  cls.def(
      "flatten",
      [](const PyTree& s, int64_t a, int64_t b) {
        const TensorTree& n = s.operand();
        return wrap(nogil([&] { return treetensor::flatten(n, a, b); }));
      },
      py::arg("start_dim") = 0, py::arg("end_dim") = -1);
  cls.def("index_select", [](const PyTree& s, int64_t dim, py::handle index) {
    Args a;
    const Operand idx = a.add(index);
    const TensorTree& n = s.operand();
    return wrap(nogil([&] { return treetensor::index_select(n, dim, idx); }));
  });
  cls.def(
      "split",
      [](const PyTree& s, py::handle size, int64_t dim) {
        const TensorTree& n = s.operand();
        if (PyLong_Check(size.ptr())) {
          const int64_t k = size.cast<int64_t>();
          return pieces(
              n, [&] { return treetensor::split(n, k, dim); },
              [&](const at::Tensor& t) { return t.split(k, dim); });
        }
        const auto sizes = int_list(size);
        std::vector<Operand> ops{Operand(n)};
        detail::CallOptions o{"split"};
        return tuple_of(nogil([&] {  // as many pieces as sizes in every leaf
          return detail::map_leaves_multi(o, ops, [&](const detail::LeafArgs& x) {
            return x.t(0).split_with_sizes(sizes, dim);
          });
        }));
      },
      py::arg("split_size_or_sections"), py::arg("dim") = 0, kPiecesDoc);
  cls.def(
      "chunk",
      [](const PyTree& s, int64_t chunks, int64_t dim) {
        const TensorTree& n = s.operand();
        return pieces(
            n, [&] { return treetensor::chunk(n, chunks, dim); },
            [&](const at::Tensor& t) { return t.chunk(chunks, dim); });
      },
      py::arg("chunks"), py::arg("dim") = 0, kPiecesDoc);
  cls.def(
      "unbind",
      [](const PyTree& s, int64_t dim) {
        const TensorTree& n = s.operand();
        return pieces(
            n, [&] { return treetensor::unbind(n, dim); },
            [&](const at::Tensor& t) { return t.unbind(dim); });
      },
      py::arg("dim") = 0, kPiecesDoc);
  m.def(
      "_cat",
      [](py::handle seq, int64_t dim) {
        const auto trees = tree_list(seq);
        return wrap(nogil([&] { return treetensor::cat(trees, dim); }));
      },
      py::arg("tensors"), py::arg("dim") = 0);
  m.def(
      "_stack",
      [](py::handle seq, int64_t dim) {
        const auto trees = tree_list(seq);
        return wrap(nogil([&] { return treetensor::stack(trees, dim); }));
      },
      py::arg("tensors"), py::arg("dim") = 0);

  // ---- conversion ------------------------------------------------------------------------------
  cls.def(
      "_to",
      [](const PyTree& s, py::handle dtype, py::handle device, bool non_blocking, bool copy) {
        const at::TensorOptions o = options(dtype, device);
        const TensorTree& n = s.operand();
        return wrap(nogil([&] { return treetensor::to(n, o, non_blocking, copy); }));
      },
      py::arg("dtype") = py::none(), py::arg("device") = py::none(),
      py::arg("non_blocking") = false, py::arg("copy") = false);
  cls.def("cpu", [](const PyTree& s) {
    const TensorTree& n = s.operand();
    return wrap(nogil([&] { return treetensor::cpu(n); }));
  });
  cls.def("contiguous", [](const PyTree& s) {
    const TensorTree& n = s.operand();
    return wrap(nogil([&] { return treetensor::contiguous(n); }));
  });
  cls.def(
      "consolidate",
      [](const PyTree& s) {
        const TensorTree& n = s.operand();
        return wrap(nogil([&] { return treetensor::consolidate(n); }));
      },
      "A copy whose leaves are views into one buffer per (dtype, device) (C++ consolidate()). "
      "requires_grad is kept, but the leaves are fresh autograd leaves: no history is carried, "
      "so gradients of the result do not reach this tree's leaves (not as torch's clone()).");
  cls.def("is_consolidated", [](const PyTree& s) { return treetensor::is_consolidated(s.node()); });

  // ---- attributes (nested dicts; treetensor.torch wraps them as trees of values) -----------
  cls.def("_shape", [](const PyTree& s) {
    // torch.Size(sizes): libtorch_python 2.x exports the type but not THPSize_New.
    const py::handle size_type(reinterpret_cast<PyObject*>(&THPSizeType));
    return values(s.node(),
                  [size_type](const at::Tensor& t) { return size_type(t.sizes().vec()); });
  });
  cls.def("_dtype", [](const PyTree& s) {
    return values(s.node(), [](const at::Tensor& t) {
      return py::reinterpret_borrow<py::object>(
          reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type())));
    });
  });
  cls.def("_device", [](const PyTree& s) {
    return values(s.node(), [](const at::Tensor& t) { return wrap_tensor(t).attr("device"); });
  });
  cls.def("_requires_grad", [](const PyTree& s) {
    return values(s.node(), [](const at::Tensor& t) { return py::bool_(t.requires_grad()); });
  });
  cls.def("_numel", [](const PyTree& s) {
    return values(s.node(), [](const at::Tensor& t) { return py::int_(t.numel()); });
  });
  cls.def_property_readonly(
      "grad", [](const PyTree& s) { return wrap(TreeTensor(s.node()).grad()); },
      "The tree of leaf gradients (None leaves where a leaf has none).");
  cls.def(
      "backward",
      [](py::object self, py::handle gradient, c10::optional<bool> retain_graph,
         bool create_graph) {
        if (!is_tree(self))  // Tensor.backward(x) unbound
          throw py::type_error(std::string("treetensor: backward: self must be a tree, not ") +
                               Py_TYPE(self.ptr())->tp_name);
        Args keep;
        std::vector<Operand> ops{keep.add(self)};
        if (!gradient.is_none()) {
          if (!is_tree(gradient) && !PyDict_Check(gradient.ptr()))
            throw py::type_error(std::string("treetensor: backward: gradient must be a tree of the "
                                             "leaves' structure or None, not ") +
                                 Py_TYPE(gradient.ptr())->tp_name);
          ops.push_back(keep.add(gradient));
        }
        nogil([&] { tree_backward(ops, retain_graph, create_graph); });
      },
      py::arg("gradient") = py::none(), py::arg("retain_graph") = py::none(),
      py::arg("create_graph") = false,
      "torch.autograd.backward over every leaf. gradient: a tree of the same structure (zipped "
      "strictly: ValueError naming the path where keys differ), each leaf of its leaf's shape "
      "(RuntimeError naming the path otherwise), or None when every leaf holds one element.");

  // ---- construction ---------------------------------------------------------------------------
  auto shaped = [&](const char* name, TreeTensor (*fn)(const ShapeTree&, at::TensorOptions)) {
    m.def(
        name,
        [fn](py::handle shapes, py::handle dtype, py::handle device, bool rg) {
          const ShapeTree sh = to_shapes(shapes);
          const at::TensorOptions o = options(dtype, device);
          return finish(nogil([&] { return fn(sh, o); }), rg);
        },
        py::arg("shapes"), py::kw_only(), py::arg("dtype") = py::none(),
        py::arg("device") = py::none(), py::arg("requires_grad") = false);
  };
  shaped("_zeros", &treetensor::zeros);
  shaped("_ones", &treetensor::ones);
  shaped("_empty", &treetensor::empty);
  m.def(
      "_full",
      [](py::handle shapes, const Number& v, py::handle dtype, py::handle device, bool rg) {
        const ShapeTree sh = to_shapes(shapes);
        const at::TensorOptions o = options(dtype, device);
        return finish(nogil([&] { return treetensor::full(sh, v, o); }), rg);
      },
      py::arg("shapes"), py::arg("fill_value"), py::kw_only(), py::arg("dtype") = py::none(),
      py::arg("device") = py::none(), py::arg("requires_grad") = false);
  auto like = [&](const char* name, TreeTensor (*fn)(const TensorTree&, at::TensorOptions)) {
    m.def(
        name,
        [fn](py::handle t, py::handle dtype, py::handle device, bool rg) {
          const at::TensorOptions o = options(dtype, device);
          return finish(
              with_tree(t, [&](const TensorTree& n) { return nogil([&] { return fn(n, o); }); }),
              rg);
        },
        py::arg("input"), py::kw_only(), py::arg("dtype") = py::none(),
        py::arg("device") = py::none(), py::arg("requires_grad") = false);
  };
  like("_zeros_like", &treetensor::zeros_like);
  like("_ones_like", &treetensor::ones_like);
  like("_empty_like", &treetensor::empty_like);
  m.def(
      "_full_like",
      [](py::handle t, const Number& v, py::handle dtype, py::handle device) {
        const at::TensorOptions o = options(dtype, device);
        return wrap(with_tree(t, [&](const TensorTree& n) {
          return nogil([&] { return treetensor::full_like(n, v, o); });
        }));
      },
      py::arg("input"), py::arg("fill_value"), py::kw_only(), py::arg("dtype") = py::none(),
      py::arg("device") = py::none());
  m.def(
      "_as_tensor",
      [](py::handle t, py::handle dtype, py::handle device) {
        const at::TensorOptions o = options(dtype, device);
        return wrap(with_tree(t, [&](const TensorTree& n) {
          return nogil([&] { return treetensor::as_tensor(n, o); });
        }));
      },
      py::arg("data"), py::kw_only(), py::arg("dtype") = py::none(),
      py::arg("device") = py::none());
}

}  // namespace treetensor::python
