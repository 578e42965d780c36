// torch.save / torch.load files: the zip and legacy formats (checkpoint.hpp; DESIGN.md §11, §13).
#include "treetensor/io/checkpoint.hpp"

#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>

#include <cerrno>
#include <cstring>
#include <map>

#include "io/bytes.hpp"
#include "io/pickle.hpp"
#include "io/zip.hpp"
#include "treetensor/tensor/construct.hpp"

namespace treetensor::io {

// ---- Object -----------------------------------------------------------------------------------
const char* container_name(Container kind) {
  switch (kind) {
    case Container::dict:
      return "dict";
    case Container::ordered_dict:
      return "OrderedDict";
    case Container::list:
      return "list";
    case Container::tuple:
      return "tuple";
    case Container::set:
      return "set";
  }
  return "?";
}

const char* value_type_name(const Value& v) {
  static constexpr const char* names[] = {"NoneType",     "bool",  "int",   "float",
                                          "complex",      "str",   "bytes", "torch.dtype",
                                          "torch.device", "Tensor"};
  return names[v.index()];
}

Container Object::kind(const tree::Path& path) const {
  auto it = kinds.find(path);
  return it == kinds.end() ? Container::dict : it->second;
}

namespace {
TensorTree tensors_of(const tree::Tree<Value>& t) {
  if (t.is_leaf()) {
    const auto* x = std::get_if<at::Tensor>(&t.leaf());
    return x ? TensorTree(*x) : TensorTree();
  }
  TensorTree::Children children;
  for (const auto& [key, child] : t.children())
    if (!child.is_leaf() || std::holds_alternative<at::Tensor>(child.leaf()))
      children.emplace_back(key, tensors_of(child));
  return TensorTree::from_children(std::move(children));
}

tree::Tree<Value> values_of(const TensorTree& t) {
  if (t.is_leaf()) return Value(t.leaf());
  tree::Tree<Value>::Children children;
  for (const auto& [key, child] : t.children()) children.emplace_back(key, values_of(child));
  return tree::Tree<Value>::from_children(std::move(children));
}
}  // namespace

TreeTensor Object::tensors() const {
  return tensors_of(tree);
}

Object to_object(const TensorTree& t) {
  Object out;
  out.tree = values_of(t);
  return out;
}

namespace {
using detail::Cursor;
using detail::Input;

// ---- loading ----------------------------------------------------------------------------------
// A storage's bytes as an at::Storage: a copy, or with LoadOptions::mmap a view of `record` when
// aligned for its dtype.
at::Storage make_storage(const detail::StorageRef& ref, Input record) {
  const std::uint64_t item = c10::elementSize(ref.dtype);
  std::uint64_t need = 0;
  if (!detail::mul_ok(ref.numel, item, need) || need > record.size)
    record.fail(0, "storage '" + ref.key + "' of " + std::to_string(ref.numel) + " " +
                       c10::toString(ref.dtype) + " elements needs more than its " +
                       std::to_string(record.size) + " bytes");
  if (reinterpret_cast<std::uintptr_t>(record.data) % item != 0) record.views = false;  // copy
  return record.storage(0, need);
}

Object load_zip(const Input& file) {
  const auto records = detail::read_zip(file);
  std::string prefix;
  const Input* pickle = nullptr;
  for (const auto& [name, bytes] : records)
    if (name.size() >= 8 && name.compare(name.size() - 8, 8, "data.pkl") == 0 &&
        (name.size() == 8 || name[name.size() - 9] == '/')) {
      if (pickle) file.fail(0, "two data.pkl records ('" + prefix + "data.pkl', '" + name + "')");
      pickle = &bytes;
      prefix = name.substr(0, name.size() - 8);
    }
  if (!pickle) file.fail(0, "a zip archive without a data.pkl record: not a torch.save file");
  if (auto order = records.find(prefix + "byteorder"); order != records.end()) {
    const std::string text(reinterpret_cast<const char*>(order->second.data), order->second.size);
    if (text != "little")
      file.fail(order->second.data - file.data,
                "byteorder '" + text + "': only little-endian files load here");
  }
  std::uint64_t end = 0;
  const detail::Unpickled u = detail::unpickle(*pickle, 0, end);
  return u.to_object([&](std::size_t i) {
    const detail::StorageRef& ref = u.storages()[i];
    auto it = records.find(prefix + "data/" + ref.key);
    if (it == records.end())
      file.fail(0, "storage record '" + prefix + "data/" + ref.key + "' is missing");
    return make_storage(ref, it->second);
  });
}

// The legacy stream: magic number, protocol, sys info, object, storage keys, raw storages.
constexpr std::string_view kLegacyMagic("\x80\x02\x8a\x0al\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19.",
                                        15);

bool looks_legacy(const Input& b) {
  return b.size >= kLegacyMagic.size() &&
         std::memcmp(b.data, kLegacyMagic.data(), kLegacyMagic.size()) == 0;
}

Object load_legacy(const Input& file) {
  std::uint64_t pos = kLegacyMagic.size();
  const detail::Unpickled protocol = detail::unpickle(file, pos, pos);
  const detail::Unpickled sys_info = detail::unpickle(file, pos, pos);
  (void)protocol;
  (void)sys_info;
  const detail::Unpickled object = detail::unpickle(file, pos, pos);
  const std::uint64_t keys_at = pos;
  const Object keys = detail::unpickle(file, pos, pos).to_object([&](std::size_t) -> at::Storage {
    file.fail(keys_at, "the storage key list refers to a storage");
  });
  std::map<std::string, const detail::StorageRef*> refs;  // by key: one look-up per storage
  for (const auto& r : object.storages()) refs.emplace(r.key, &r);
  std::map<std::string, at::Storage> storages;
  Cursor c(file, pos);
  if (keys.tree.is_leaf() || keys.kind({}) != Container::list)
    file.fail(keys_at, "the storage keys are not a list");
  const std::size_t n = keys.tree.size();
  for (std::size_t k = 0; k < n; ++k) {
    const auto* node = keys.tree.find(tree::Path{std::to_string(k)});
    const auto* key = node && node->is_leaf() ? std::get_if<std::string>(&node->leaf()) : nullptr;
    if (!key) file.fail(keys_at, "storage key " + std::to_string(k) + " is not a string");
    const auto found = refs.find(*key);
    const detail::StorageRef* ref = found == refs.end() ? nullptr : found->second;
    if (!ref) c.fail("storage '" + *key + "' is not used by the object");
    const std::uint64_t numel = c.le(8, "a storage's element count");
    if (numel != ref->numel)
      c.fail("storage '" + *key + "' holds " + std::to_string(numel) +
             " elements, the object says " + std::to_string(ref->numel));
    std::uint64_t bytes = 0;
    if (!detail::mul_ok(numel, c10::elementSize(ref->dtype), bytes))
      c.fail("a storage size overflows");
    Input data = file.slice(c.pos(), bytes, ("storage '" + *key + "'").c_str());
    data.views = false;  // legacy storages are not aligned: copied
    c.take(bytes, "a storage");
    storages.emplace(*key, make_storage(*ref, data));
  }
  return object.to_object([&](std::size_t i) {
    auto it = storages.find(object.storages()[i].key);
    if (it == storages.end())
      file.fail(pos, "storage '" + object.storages()[i].key + "' is missing");
    return it->second;
  });
}

void move_tensors(tree::Tree<Value>& t, const LoadOptions& options) {
  if (!options.map_location) return;
  if (t.is_leaf()) {
    if (auto* x = std::get_if<at::Tensor>(&t.leaf())) {
      const bool grad = x->requires_grad();
      *x = x->detach().to(*options.map_location);
      if (grad) x->requires_grad_(true);
    }
    return;
  }
  for (auto& [key, child] : t.children()) move_tensors(child, options);
}

Object load_bytes(const Input& file, const LoadOptions& options) {
  Object out;
  if (detail::looks_like_zip(file))
    out = load_zip(file);
  else if (looks_legacy(file))
    out = load_legacy(file);
  else
    file.fail(0, "neither a zip-format nor a legacy torch.save file (unknown first bytes)");
  move_tensors(out.tree, options);
  return out;
}

// ---- saving -----------------------------------------------------------------------------------
// The whole storage of `t` as CPU bytes.
at::Tensor storage_bytes(const at::Tensor& t) {
  const auto nbytes = static_cast<std::int64_t>(t.storage().nbytes());
  at::Tensor whole = at::empty({0}, t.options().dtype(at::kByte));
  whole.set_(t.storage(), 0, {nbytes}, {1});
  return whole.cpu().contiguous();
}

}  // namespace

namespace detail {
Object load_from_bytes(const Input& file) {
  return load_bytes(file, {});
}
}  // namespace detail

Object load(const std::string& path, const LoadOptions& options) {
  return load_bytes(detail::map_file(path, options), options);
}

TreeTensor load_tensors(const std::string& path, const LoadOptions& options) {
  return load(path, options).tensors();
}

TreeTensor load_state_dict(const std::string& path, const LoadOptions& options) {
  const Object object = load(path, options);
  std::vector<std::pair<std::string, at::Tensor>> items;
  const auto flat = tree::flatten_refs(object.tree);
  const auto paths = flat.spec.paths();
  for (std::size_t i = 0; i < paths.size(); ++i)
    if (const auto* x = std::get_if<at::Tensor>(flat.leaves[i])) {
      std::string key;
      for (const auto& k : paths[i]) key += (key.empty() ? "" : ".") + k;
      items.emplace_back(std::move(key), *x);
    }
  return from_state_dict(items);
}

namespace {
// The zip archive torch.save writes (records stored, 64-byte aligned), through `f`; false when a
// write failed (errno set). The writer function never reports a short write to the stream
// writer: that makes it throw, and its destructor writes the end of the archive again while
// the exception unwinds, throws again and terminates the process. It records the failure,
// writes nothing more, and the caller checks.
bool write_archive(std::FILE* f, const std::string& data, const std::vector<at::Tensor>& storages) {
  int failed = 0;  // errno of the first failed write
  caffe2::serialize::PyTorchStreamWriter writer([f, &failed](const void* p, std::size_t n) {
    if (!failed && n && std::fwrite(p, 1, n, f) != n) failed = errno ? errno : EIO;
    return n;  // p may be null when n is 0
  });
  writer.writeRecord("data.pkl", data.data(), data.size());
  writer.writeRecord("byteorder", "little", 6);
  for (std::size_t i = 0; i < storages.size(); ++i) {
    const at::Tensor bytes = storage_bytes(storages[i]);
    writer.writeRecord("data/" + std::to_string(i), bytes.data_ptr(), bytes.numel());
  }
  writer.writeEndOfFile();
  errno = failed;
  return !failed;
}
}  // namespace

void save(const std::string& path, const Object& object) {
  std::vector<at::Tensor> storages;
  const std::string data = detail::pickle(object, storages);
  detail::replace_file(path, [&](std::FILE* f) {
    try {
      if (!write_archive(f, data, storages))
        throw IoError(path, std::nullopt, std::string("cannot write: ") + std::strerror(errno));
    } catch (const c10::Error& e) {
      throw IoError(path, std::nullopt, std::string("cannot write: ") + e.what_without_backtrace());
    }
  });
}

void save(const std::string& path, const TensorTree& tree) {
  save(path, to_object(tree));
}

void save_state_dict(const std::string& path, const TensorTree& tree) {
  Object object;
  tree::Tree<Value>::Children children;
  for (const auto& [key, tensor] : to_state_dict(tree)) children.emplace_back(key, Value(tensor));
  object.tree = tree::Tree<Value>::from_children(std::move(children));
  object.kinds[tree::Path{}] = Container::ordered_dict;
  save(path, object);
}

}  // namespace treetensor::io
