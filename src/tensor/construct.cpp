// Construction and conversion. Leaf creation goes through runtime::run (build_leaves, map1);
// pure conversions (state dicts, IValue nests) only move tensor handles.
#include "treetensor/tensor/construct.hpp"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <mutex>
#include <stdexcept>

#include "tensor/leafwise.hpp"
#include "treetensor/tensor/consolidate.hpp"

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

// ---- consolidated construction (DESIGN.md §12) ------------------------------------------------
namespace {

using MakeBuffer = std::function<at::Tensor(int64_t numel, const at::TensorOptions&)>;

void check_shape(const Shape& s, const Path& path) {
  for (int64_t d : s)
    if (d < 0)
      throw std::invalid_argument("consolidated construction: leaf '" + path.describe() +
                                  "' has a negative dimension " + std::to_string(d));
}

// Leaves with autograd must be fresh leaves that every copy shares: made now.
TreeTensor finish(TreeTensor t, const at::TensorOptions& options) {
  if (!options.requires_grad()) return t;
  const ConsolidatedTree* c = consolidated_source(t);
  auto flat = tree::flatten(t);
  for (auto& v : flat.leaves) v = v.detach().requires_grad_(true);
  auto source = std::make_shared<const ConsolidatedTree>(c->layout_ptr(), c->buffers());
  return TensorTree::tagged(tree::unflatten(flat.spec, std::move(flat.leaves)), std::move(source));
}

TreeTensor consolidated_shapes(const ShapeTree& shapes, at::TensorOptions options,
                               const MakeBuffer& make) {
  const auto flat = tree::flatten_refs(shapes);
  const std::size_t n = flat.leaves.size();
  if (n == 0) return TreeTensor(tree::unflatten(flat.spec, std::vector<at::Tensor>{}));
  const auto paths = flat.spec.paths();
  std::vector<at::IntArrayRef> sizes;
  for (std::size_t i = 0; i < n; ++i) {
    check_shape(*flat.leaves[i], paths[i]);
    sizes.emplace_back(*flat.leaves[i]);
  }
  const auto opts =
      at::TensorOptions(at::typeMetaToScalarType(options.dtype())).device(options.device());
  const auto item = static_cast<int64_t>(c10::elementSize(c10::typeMetaToScalarType(opts.dtype())));
  auto layout = std::make_shared<const ConsolidatedLayout>(
      flat.spec, std::vector<std::size_t>(n, 0), sizes, std::vector<int64_t>(n, item));
  at::Tensor buffer = make(layout->group_numel(0), opts);
  return finish(consolidated_tree(std::move(layout), {std::move(buffer)}), options);
}

TreeTensor consolidated_like(const TensorTree& t, at::TensorOptions options,
                             const MakeBuffer& make) {
  const ConsolidatedTree* c = consolidated_source(t);
  if (c && !options.has_dtype() && !options.has_device()) {
    std::vector<at::Tensor> buffers;
    for (std::size_t g = 0; g < c->buffers().size(); ++g)
      buffers.push_back(
          make(c->layout().group_numel(g),
               at::TensorOptions(c->buffers()[g].scalar_type()).device(c->buffers()[g].device())));
    return finish(consolidated_tree(c->layout_ptr(), std::move(buffers)), options);
  }
  // Any other tree: the layout consolidate() would give the new leaves.
  const TreeTensor shaped =
      like("consolidated_like", t, options, [](const at::Tensor& x, at::TensorOptions o) {
        return at::empty({0}, x.options().merge_in(o));  // dtype and device of the new leaf
      });
  const auto flat = tree::flatten(t), types = tree::flatten(shaped);
  const std::size_t n = flat.leaves.size();
  if (n == 0) return TreeTensor(tree::unflatten(flat.spec, std::vector<at::Tensor>{}));
  std::vector<std::pair<at::ScalarType, at::Device>> groups;
  std::vector<std::size_t> ids;
  std::vector<at::IntArrayRef> sizes;
  std::vector<int64_t> item;
  for (std::size_t i = 0; i < n; ++i) {
    const std::pair<at::ScalarType, at::Device> key{types.leaves[i].scalar_type(),
                                                    types.leaves[i].device()};
    auto it = std::find(groups.begin(), groups.end(), key);
    if (it == groups.end()) it = groups.insert(groups.end(), key);
    ids.push_back(static_cast<std::size_t>(it - groups.begin()));
    sizes.push_back(flat.leaves[i].sizes());
    item.push_back(static_cast<int64_t>(types.leaves[i].element_size()));
  }
  auto layout = std::make_shared<const ConsolidatedLayout>(flat.spec, ids, sizes, item);
  std::vector<at::Tensor> buffers;
  for (std::size_t g = 0; g < groups.size(); ++g)
    buffers.push_back(
        make(layout->group_numel(g), at::TensorOptions(groups[g].first).device(groups[g].second)));
  return finish(consolidated_tree(std::move(layout), std::move(buffers)), options);
}

MakeBuffer filled(const at::Scalar& v) {
  return [v](int64_t n, const at::TensorOptions& o) { return at::full({n}, v, o); };
}
const MakeBuffer kEmpty = [](int64_t n, const at::TensorOptions& o) { return at::empty({n}, o); };
const MakeBuffer kRandn = [](int64_t n, const at::TensorOptions& o) { return at::randn({n}, o); };
const MakeBuffer kRand = [](int64_t n, const at::TensorOptions& o) { return at::rand({n}, o); };

}  // namespace

TreeTensor zeros(const ShapeTree& s, at::TensorOptions o, Consolidated) {
  return consolidated_shapes(s, o, filled(0));
}
TreeTensor ones(const ShapeTree& s, at::TensorOptions o, Consolidated) {
  return consolidated_shapes(s, o, filled(1));
}
TreeTensor empty(const ShapeTree& s, at::TensorOptions o, Consolidated) {
  return consolidated_shapes(s, o, kEmpty);
}
TreeTensor full(const ShapeTree& s, const at::Scalar& v, at::TensorOptions o, Consolidated) {
  return consolidated_shapes(s, o, filled(v));
}
TreeTensor randn(const ShapeTree& s, at::TensorOptions o, Consolidated) {
  return consolidated_shapes(s, o, kRandn);
}
TreeTensor rand(const ShapeTree& s, at::TensorOptions o, Consolidated) {
  return consolidated_shapes(s, o, kRand);
}
TreeTensor zeros_like(const TensorTree& t, at::TensorOptions o, Consolidated) {
  return consolidated_like(t, o, filled(0));
}
TreeTensor ones_like(const TensorTree& t, at::TensorOptions o, Consolidated) {
  return consolidated_like(t, o, filled(1));
}
TreeTensor empty_like(const TensorTree& t, at::TensorOptions o, Consolidated) {
  return consolidated_like(t, o, kEmpty);
}
TreeTensor full_like(const TensorTree& t, const at::Scalar& v, at::TensorOptions o, Consolidated) {
  return consolidated_like(t, o, filled(v));
}
TreeTensor randn_like(const TensorTree& t, at::TensorOptions o, Consolidated) {
  return consolidated_like(t, o, kRandn);
}
TreeTensor rand_like(const TensorTree& t, at::TensorOptions o, Consolidated) {
  return consolidated_like(t, o, kRand);
}

}  // namespace treetensor
