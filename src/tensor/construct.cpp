// Construction and conversion. Leaf creation goes through runtime::run (build_leaves, map1);
// pure conversions (state dicts, IValue nests) only move tensor handles.
#include "treetensor/tensor/construct.hpp"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cstdint>
#include <mutex>
#include <stdexcept>

#include "tensor/leafwise.hpp"

namespace treetensor {
namespace {

// at:: factories ignore requires_grad in their options (torch:: ones honour it): create
// without it, then mark the new leaf.
at::Tensor with_grad(at::Tensor x, const at::TensorOptions& options) {
  if (options.requires_grad()) x.requires_grad_(true);
  return x;
}

template <class F>
TreeTensor from_shapes(std::string_view op, const ShapeTree& shapes, at::TensorOptions options,
                       F&& f) {
  const auto flat = tree::flatten_refs(shapes);
  return detail::build_leaves(op, flat.spec, [&](std::size_t i) {
    return with_grad(f(*flat.leaves[i], options.requires_grad(false)), options);
  });
}

template <class F>
TreeTensor like(std::string_view op, const TensorTree& t, at::TensorOptions options, F&& f) {
  return detail::map1(op, t, [&](const at::Tensor& x) {
    return with_grad(f(x, options.requires_grad(false)), options);
  });
}

// One seed per leaf, drawn in flatten order from the default CPU generator, so that the
// values do not depend on which lane fills which leaf.
std::vector<uint64_t> leaf_seeds(std::size_t n) {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  auto* impl = at::check_generator<at::CPUGeneratorImpl>(gen);
  std::vector<uint64_t> seeds(n);
  for (auto& s : seeds) s = impl->random64();
  return seeds;
}

// Fills one leaf from its own CPU generator, then moves it to the asked device; requires_grad
// is set last so that the leaf is an autograd leaf.
template <class Fill>
at::Tensor random_leaf(uint64_t seed, at::TensorOptions options, Fill&& fill) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor x = fill(gen, options.device(at::kCPU).requires_grad(false));
  if (options.device().type() != at::kCPU) x = x.to(options.device());
  if (options.requires_grad()) x.requires_grad_(true);
  return x;
}

template <class Fill>
TreeTensor random_shapes(std::string_view op, const ShapeTree& shapes, at::TensorOptions options,
                         Fill&& fill) {
  const auto flat = tree::flatten_refs(shapes);
  const auto seeds = leaf_seeds(flat.leaves.size());
  return detail::build_leaves(op, flat.spec, [&](std::size_t i) {
    return random_leaf(seeds[i], options, [&](at::Generator& g, at::TensorOptions o) {
      return fill(*flat.leaves[i], g, o);
    });
  });
}

template <class Fill>
TreeTensor random_like(std::string_view op, const TensorTree& t, at::TensorOptions options,
                       Fill&& fill) {
  const auto seeds = leaf_seeds(t.leaf_count());
  const Operand args[] = {Operand(t)};
  return detail::map_leaves(detail::CallOptions{op}, args, [&](const detail::LeafArgs& x) {
    const at::Tensor& leaf = x.t(0);
    return random_leaf(
        seeds[x.leaf()], leaf.options().merge_in(options),
        [&](at::Generator& g, at::TensorOptions o) { return fill(leaf.sizes(), g, o); });
  });
}

// The default dtype of torch.tensor for a Python value of this scalar's kind.
at::ScalarType inferred_dtype(const at::Scalar& s) {
  if (s.isBoolean()) return at::kBool;
  if (s.isIntegral(false)) return at::kLong;
  if (s.isComplex()) return at::kComplexFloat;
  return at::typeMetaToScalarType(at::get_default_dtype());
}

// to(options) that also honours requires_grad (Tensor::to refuses it).
at::Tensor converted(const at::Tensor& x, at::TensorOptions options) {
  at::Tensor y = x.to(options.requires_grad(false));
  if (options.requires_grad()) y.requires_grad_(true);
  return y;
}

TreeTensor from_ivalue_at(const c10::IValue& v, Path& path) {
  if (v.isTensor()) return TensorTree(v.toTensor());
  if (!v.isGenericDict())
    throw std::invalid_argument("from_ivalue: the value at '" + path.describe() + "' is a " +
                                v.tagKind() + ", expected a tensor or a dict with string keys");
  TensorTree::Children children;
  for (const auto& entry : v.toGenericDict()) {
    if (!entry.key().isString())
      throw std::invalid_argument("from_ivalue: a key at '" + path.describe() + "' is a " +
                                  entry.key().tagKind() + ", expected a string");
    const std::string key = entry.key().toStringRef();
    path.push_back(key);
    children.emplace_back(key, from_ivalue_at(entry.value(), path));
    path.pop_back();
  }
  return TensorTree::from_children(std::move(children));
}

// The TorchScript type of a converted node: Tensor, or the Dict type it was built with.
c10::TypePtr ivalue_type(const c10::IValue& v) {
  if (v.isTensor()) return c10::TensorType::get();
  if (!v.isGenericDict()) return v.type();  // an undefined tensor leaf converts to None
  const auto dict = v.toGenericDict();
  return c10::DictType::create(dict.keyType(), dict.valueType());
}

// The most specific value type for a node's converted children: their common type, else Any.
c10::TypePtr common_value_type(const std::vector<c10::IValue>& values) {
  if (values.empty()) return c10::TensorType::get();
  c10::TypePtr type = ivalue_type(values[0]);
  for (std::size_t i = 1; i < values.size(); ++i)
    if (*ivalue_type(values[i]) != *type) return c10::AnyType::get();
  return type;
}

c10::IValue to_ivalue_at(const TensorTree& t) {
  if (t.is_leaf()) return t.leaf();
  std::vector<c10::IValue> values;
  values.reserve(t.size());
  for (const auto& entry : t.children()) values.push_back(to_ivalue_at(entry.second));
  c10::impl::GenericDict dict(c10::StringType::get(), common_value_type(values));
  std::size_t i = 0;
  for (const auto& entry : t.children()) dict.insert(entry.first, std::move(values[i++]));
  return dict;
}

}  // namespace

TreeTensor zeros(const ShapeTree& shapes, at::TensorOptions options) {
  return from_shapes("zeros", shapes, options,
                     [](const Shape& s, at::TensorOptions o) { return at::zeros(s, o); });
}
TreeTensor ones(const ShapeTree& shapes, at::TensorOptions options) {
  return from_shapes("ones", shapes, options,
                     [](const Shape& s, at::TensorOptions o) { return at::ones(s, o); });
}
TreeTensor empty(const ShapeTree& shapes, at::TensorOptions options) {
  return from_shapes("empty", shapes, options,
                     [](const Shape& s, at::TensorOptions o) { return at::empty(s, o); });
}
TreeTensor full(const ShapeTree& shapes, const at::Scalar& value, at::TensorOptions options) {
  return from_shapes("full", shapes, options,
                     [&](const Shape& s, at::TensorOptions o) { return at::full(s, value, o); });
}

TreeTensor randn(const ShapeTree& shapes, at::TensorOptions options) {
  return random_shapes(
      "randn", shapes, options,
      [](const Shape& s, at::Generator& g, at::TensorOptions o) { return at::randn(s, g, o); });
}
TreeTensor rand(const ShapeTree& shapes, at::TensorOptions options) {
  return random_shapes(
      "rand", shapes, options,
      [](const Shape& s, at::Generator& g, at::TensorOptions o) { return at::rand(s, g, o); });
}
TreeTensor randint(int64_t low, int64_t high, const ShapeTree& shapes, at::TensorOptions options) {
  return random_shapes("randint", shapes, options,
                       [&](const Shape& s, at::Generator& g, at::TensorOptions o) {
                         return at::randint(low, high, s, g, o);
                       });
}

TreeTensor arange(const tree::Tree<at::Scalar>& ends, at::TensorOptions options) {
  const auto flat = tree::flatten_refs(ends);
  return detail::build_leaves("arange", flat.spec, [&](std::size_t i) {
    return with_grad(at::arange(*flat.leaves[i], options.requires_grad(false)), options);
  });
}

TreeTensor zeros_like(const TensorTree& t, at::TensorOptions options) {
  return like("zeros_like", t, options,
              [](const at::Tensor& x, at::TensorOptions o) { return at::zeros_like(x, o); });
}
TreeTensor ones_like(const TensorTree& t, at::TensorOptions options) {
  return like("ones_like", t, options,
              [](const at::Tensor& x, at::TensorOptions o) { return at::ones_like(x, o); });
}
TreeTensor empty_like(const TensorTree& t, at::TensorOptions options) {
  return like("empty_like", t, options,
              [](const at::Tensor& x, at::TensorOptions o) { return at::empty_like(x, o); });
}
TreeTensor full_like(const TensorTree& t, const at::Scalar& value, at::TensorOptions options) {
  return like("full_like", t, options,
              [&](const at::Tensor& x, at::TensorOptions o) { return at::full_like(x, value, o); });
}

TreeTensor randn_like(const TensorTree& t, at::TensorOptions options) {
  return random_like(
      "randn_like", t, options,
      [](at::IntArrayRef s, at::Generator& g, at::TensorOptions o) { return at::randn(s, g, o); });
}
TreeTensor rand_like(const TensorTree& t, at::TensorOptions options) {
  return random_like(
      "rand_like", t, options,
      [](at::IntArrayRef s, at::Generator& g, at::TensorOptions o) { return at::rand(s, g, o); });
}
TreeTensor randint_like(const TensorTree& t, int64_t low, int64_t high, at::TensorOptions options) {
  return random_like("randint_like", t, options,
                     [&](at::IntArrayRef s, at::Generator& g, at::TensorOptions o) {
                       return at::randint(low, high, s, g, o);
                     });
}

TreeTensor tensor(const tree::Tree<std::vector<double>>& values, at::TensorOptions options) {
  if (!options.has_dtype()) options = options.dtype(at::get_default_dtype());
  const auto flat = tree::flatten_refs(values);
  return detail::build_leaves("tensor", flat.spec, [&](std::size_t i) {
    return converted(at::tensor(at::ArrayRef<double>(*flat.leaves[i]), at::kDouble), options);
  });
}

TreeTensor scalars(const tree::Tree<at::Scalar>& values, at::TensorOptions options) {
  const auto flat = tree::flatten_refs(values);
  return detail::build_leaves("scalars", flat.spec, [&](std::size_t i) {
    const at::Scalar& s = *flat.leaves[i];
    const at::TensorOptions o = options.has_dtype() ? options : options.dtype(inferred_dtype(s));
    return converted(at::scalar_tensor(s, o.requires_grad(false)), o);
  });
}

TreeTensor as_tensor(const TensorTree& t, at::TensorOptions options) {
  return detail::map1("as_tensor", t, [&](const at::Tensor& x) { return converted(x, options); });
}

namespace {
// A dotted key names a path only when no segment is empty ("a..b", ".a" and "a." do not).
void check_dotted_key(const std::string& key, std::size_t entries) {
  if (key.empty() ? entries == 1
                  : key.front() != '.' && key.back() != '.' && key.find("..") == std::string::npos)
    return;
  throw std::invalid_argument(
      "from_state_dict: key '" + key + "' has an empty path segment" +
      (key.empty() ? " (the key \"\" stands only for a lone leaf root)" : ""));
}
}  // namespace

TreeTensor from_state_dict(const std::map<std::string, at::Tensor>& dict) {
  return from_state_dict(std::vector<std::pair<std::string, at::Tensor>>(dict.begin(), dict.end()));
}

TreeTensor from_state_dict(const std::vector<std::pair<std::string, at::Tensor>>& items) {
  for (const auto& [key, value] : items) check_dotted_key(key, items.size());
  return tree::unflatten<at::Tensor>(items);
}

std::map<std::string, at::Tensor> to_state_dict(const TensorTree& t) {
  const auto flat = tree::flatten_refs(t);
  const auto paths = flat.spec.paths();
  std::map<std::string, at::Tensor> out;
  for (std::size_t i = 0; i < paths.size(); ++i) {
    std::string key;
    for (const auto& k : paths[i]) {
      if (k.empty() || k.find('.') != std::string::npos)
        throw std::invalid_argument("to_state_dict: the key '" + k + "' on the path '" +
                                    paths[i].describe() +
                                    "' is empty or contains '.', so no dotted key names it");
      key += key.empty() ? k : "." + k;
    }
    out.emplace(std::move(key), *flat.leaves[i]);
  }
  return out;
}

TreeTensor from_ivalue(const c10::IValue& value) {
  Path path;
  return from_ivalue_at(value, path);
}

c10::IValue to_ivalue(const TensorTree& t) {
  return to_ivalue_at(t);
}

}  // namespace treetensor
