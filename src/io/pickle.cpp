// The allowlisted pickle reader and the protocol-2 writer (see pickle.hpp; DESIGN.md §13).
#include "io/pickle.hpp"

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <map>
#include <optional>
#include <unordered_map>
#include <utility>

#include "treetensor/tensor/dtype.hpp"

namespace treetensor::io::detail {

namespace {

using Node = PyNode;

constexpr int kMaxDepth = 1000;

// ---- the allowlist --------------------------------------------------------------------------
struct Allowed {
  Global global;
  c10::ScalarType dtype = c10::kFloat;
};

const std::unordered_map<std::string, Allowed>& allowlist() {
  static const auto* table = [] {
    auto* t = new std::unordered_map<std::string, Allowed>{
        {"collections.OrderedDict", {Global::ordered_dict}},
        {"torch._utils._rebuild_tensor_v2", {Global::rebuild_v2}},
        {"torch._utils._rebuild_tensor_v3", {Global::rebuild_v3}},
        {"torch._utils._rebuild_parameter", {Global::rebuild_parameter}},
        {"torch._utils._rebuild_parameter_with_state", {Global::rebuild_parameter_state}},
        {"torch.Size", {Global::size}},
        {"torch.device", {Global::device}},
        {"_codecs.encode", {Global::codecs_encode}},
        {"torch.UntypedStorage", {Global::storage_class, c10::kByte}},
        // torch.save's storage of the dtypes without a typed storage class (uint16, float8_*,
        // complex32, ...): bytes, with the dtype given to _rebuild_tensor_v3.
        {"torch.storage.UntypedStorage", {Global::storage_class, c10::kByte}},
        // A tree torch.save wrote: treetensor.torch._tree(its nested dict of tensors).
        {"treetensor.torch._tree", {Global::tree}},
    };
    for (const char* b : {"__builtin__", "builtins"}) {
      (*t)[std::string(b) + ".set"] = {Global::set};
      (*t)[std::string(b) + ".complex"] = {Global::complex};
      (*t)[std::string(b) + ".bytes"] = {Global::bytes};
    }
    // The dtypes and typed storage classes torch.save names: the writer's own tables
    // (torch_dtype_name, typed_storage_class), so reading and writing agree, and torch's
    // aliases of the dtypes (torch.float is torch.float32).
    for (int i = 0; i < static_cast<int>(c10::ScalarType::NumOptions); ++i) {
      const auto dtype = static_cast<c10::ScalarType>(i);
      if (const auto name = torch_dtype_name(dtype))
        (*t)["torch." + *name] = {Global::dtype, dtype};
      if (const auto name = typed_storage_class(dtype))
        (*t)["torch." + *name] = {Global::storage_class, dtype};
    }
    const std::pair<const char*, c10::ScalarType> aliases[] = {{"float", c10::kFloat},
                                                               {"double", c10::kDouble},
                                                               {"half", c10::kHalf},
                                                               {"long", c10::kLong},
                                                               {"int", c10::kInt},
                                                               {"short", c10::kShort},
                                                               {"cfloat", c10::kComplexFloat},
                                                               {"cdouble", c10::kComplexDouble},
                                                               {"chalf", c10::kComplexHalf}};
    for (const auto& [name, dtype] : aliases)
      (*t)[std::string("torch.") + name] = {Global::dtype, dtype};
    return t;
  }();
  return *table;
}

// ---- the reader -----------------------------------------------------------------------------
class Reader {
 public:
  Reader(const Input& bytes, std::uint64_t start) : in_(bytes, start), start_(start) {
    out_.name = bytes.name;
    out_.nodes.emplace_back();  // index 0: unused
  }

  Unpickled run(std::uint64_t& end) {
    while (!step()) {
    }
    if (!marks_.empty()) in_.fail_at(in_.pos() - 1, "STOP inside an unclosed MARK");
    if (stack_.size() != 1)
      in_.fail_at(in_.pos() - 1, "STOP with " + std::to_string(stack_.size()) +
                                     " values on the stack (1 expected)");
    out_.root = stack_.back();
    end = in_.pos();
    out_.pickle_bytes = end - start_;
    return std::move(out_);
  }

 private:
  Node& node(std::uint32_t i) { return out_.nodes[i]; }

  std::uint32_t add(Node n) {
    n.at = op_at_;
    out_.nodes.push_back(std::move(n));
    return static_cast<std::uint32_t>(out_.nodes.size() - 1);
  }
  std::uint32_t add(Kind k) {
    Node n;
    n.kind = k;
    return add(std::move(n));
  }

  void push(std::uint32_t i) { stack_.push_back(i); }
  std::uint32_t pop(const char* for_what) {
    if (stack_.size() <= floor())
      in_.fail_at(op_at_, std::string("stack underflow at ") + for_what);
    const std::uint32_t v = stack_.back();
    stack_.pop_back();
    return v;
  }
  std::size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  // The values above the last MARK, which is removed.
  std::vector<std::uint32_t> pop_mark(const char* for_what) {
    if (marks_.empty()) in_.fail_at(op_at_, std::string(for_what) + " without a MARK");
    const std::size_t m = marks_.back();
    marks_.pop_back();
    std::vector<std::uint32_t> items(stack_.begin() + static_cast<std::ptrdiff_t>(m), stack_.end());
    stack_.resize(m);
    return items;
  }
  std::uint32_t& top(const char* for_what) {
    if (stack_.size() <= floor())
      in_.fail_at(op_at_, std::string("stack underflow at ") + for_what);
    return stack_.back();
  }

  // Charges `bytes` that an op copies from objects already read (a memo reference makes such
  // copies repeatable) against the expansion budget of the pickle read so far (pickle.hpp).
  void charge(std::uint64_t bytes) {
    const std::uint64_t limit = kExpansionPerByte * (in_.pos() - start_) + kExpansionBase;
    if (bytes > limit - out_.charged)
      in_.fail_at(op_at_, "the pickle would expand to more than " + std::to_string(limit) +
                              " bytes in memory here (copies of objects it refers to again, "
                              "e.g. a memo bomb; at most " +
                              std::to_string(kExpansionPerByte) +
                              " bytes per pickle byte plus 64 MiB)");
    out_.charged += bytes;
  }

  Node& expect(std::uint32_t i, std::initializer_list<Kind> kinds, const char* what) {
    for (Kind k : kinds)
      if (node(i).kind == k) return node(i);
    in_.fail_at(op_at_, std::string(what));
  }

  void memo_put(std::uint64_t key) { memo_[key] = top("a memo store"); }
  void memo_get(std::uint64_t key) {
    auto it = memo_.find(key);
    if (it == memo_.end())
      in_.fail_at(op_at_, "memo key " + std::to_string(key) + " was never stored");
    push(it->second);
  }

  std::uint32_t str_node(Kind k, std::string_view s) {
    Node n;
    n.kind = k;
    n.s.assign(s);
    return add(std::move(n));
  }
  std::uint32_t int_node(std::int64_t v) {
    Node n;
    n.kind = Kind::integer;
    n.i = v;
    return add(std::move(n));
  }

  std::int64_t long1() {
    const std::uint8_t n = in_.u8("a LONG1 length");
    if (n > 8) in_.fail("an integer of " + std::to_string(n) + " bytes is out of the int64 range");
    const std::string_view b = in_.take(n, "a LONG1 integer");
    std::uint64_t v = 0;
    for (int k = n - 1; k >= 0; --k) v = (v << 8) | static_cast<std::uint8_t>(b[k]);
    if (n > 0 && n < 8 && (static_cast<std::uint8_t>(b[n - 1]) & 0x80))
      v |= ~std::uint64_t{0} << (8 * n);  // sign-extend
    return static_cast<std::int64_t>(v);
  }

  std::string_view line(const char* what) {
    const std::uint64_t start = in_.pos();
    for (int k = 0; k < 256; ++k)
      if (in_.u8(what) == '\n')
        return {reinterpret_cast<const char*>(in_.bytes().data + start),
                static_cast<std::size_t>(in_.pos() - start - 1)};
    in_.fail_at(start, std::string(what) + " longer than 256 bytes");
  }

  void global(const std::string& module, const std::string& name) {
    const std::string full = module + "." + name;
    auto it = allowlist().find(full);
    if (it == allowlist().end())
      in_.fail_at(op_at_, "global '" + full + "' is not allowed" +
                              (full.rfind("torch.", 0) == 0
                                   ? " (this reader builds dense tensors, containers and numbers "
                                     "and runs no pickle code; torch.load(weights_only=True) also "
                                     "reads sparse, quantized and nested tensors)"
                                   : " (only what torch.save writes; as "
                                     "torch.load(weights_only=True))"));
    Node n;
    n.kind = it->second.global == Global::dtype ? Kind::dtype : Kind::global;
    n.global = it->second.global;
    n.dtype = it->second.dtype;
    n.s = full;
    push(add(std::move(n)));
  }

  void set_items(std::uint32_t dict, const std::vector<std::uint32_t>& kv) {
    Node& d =
        expect(dict, {Kind::dict, Kind::ordered_dict}, "SETITEM(S) on a value that is not a dict");
    if (kv.size() % 2) in_.fail_at(op_at_, "SETITEMS with an odd number of values");
    d.items.insert(d.items.end(), kv.begin(), kv.end());
  }
  void append(std::uint32_t list, const std::vector<std::uint32_t>& items, Kind kind) {
    Node& l = expect(list, {kind},
                     kind == Kind::list ? "APPEND(S) on a value that is not a list"
                                        : "ADDITEMS on a value that is not a set");
    if (l.flag) in_.fail_at(op_at_, "ADDITEMS on a set made from a list");
    l.items.insert(l.items.end(), items.begin(), items.end());
  }

  bool step();
  void reduce();
  void persistent_id();
  std::uint32_t rebuild_tensor(std::uint32_t args_i, bool v3);
  void view_bits(Node& t, std::uint32_t metadata_i);

  Cursor in_;
  Unpickled out_;
  std::vector<std::uint32_t> stack_;
  std::vector<std::size_t> marks_;
  std::unordered_map<std::uint64_t, std::uint32_t> memo_;
  std::map<std::string, std::size_t> storage_index_;
  std::uint64_t op_at_ = 0;
  std::uint64_t start_;
};

std::string opcode_name(std::uint8_t op) {
  const char c = static_cast<char>(op);
  std::string hex = "0x";
  const char* digits = "0123456789abcdef";
  hex += digits[op >> 4];
  hex += digits[op & 15];
  return op >= 0x20 && op < 0x7f ? hex + " ('" + c + "')" : hex;
}

bool Reader::step() {
  op_at_ = in_.pos();
  const std::uint8_t op = in_.u8("a pickle opcode (the pickle has no STOP)");
  switch (op) {
    case 0x80: {  // PROTO
      const std::uint8_t v = in_.u8("the protocol number");
      if (v > 5) in_.fail_at(op_at_, "pickle protocol " + std::to_string(v) + " (at most 5)");
      break;
    }
    case 0x95:
      in_.le(8, "a FRAME length");
      break;  // FRAME: framing only
    case '.':
      return true;  // STOP
    case '(':
      marks_.push_back(stack_.size());
      break;
    case ')':
      push(add(Kind::tuple));
      break;
    case 't': {
      Node n;
      n.kind = Kind::tuple;
      n.items = pop_mark("TUPLE");
      push(add(std::move(n)));
      break;
    }
    case 0x85:
    case 0x86:
    case 0x87: {  // TUPLE1..3
      Node n;
      n.kind = Kind::tuple;
      n.items.resize(op - 0x84);
      for (auto it = n.items.rbegin(); it != n.items.rend(); ++it) *it = pop("TUPLEn");
      push(add(std::move(n)));
      break;
    }
    case ']':
      push(add(Kind::list));
      break;
    case '}':
      push(add(Kind::dict));
      break;
    case 0x8f:
      push(add(Kind::set));
      break;  // EMPTY_SET
    case 'a': {
      const std::uint32_t v = pop("APPEND");
      append(top("APPEND"), {v}, Kind::list);
      break;
    }
    case 'e': {
      auto items = pop_mark("APPENDS");
      append(top("APPENDS"), items, Kind::list);
      break;
    }
    case 0x90: {  // ADDITEMS
      auto items = pop_mark("ADDITEMS");
      append(top("ADDITEMS"), items, Kind::set);
      break;
    }
    case 's': {
      const std::uint32_t v = pop("SETITEM"), k = pop("SETITEM");
      set_items(top("SETITEM"), {k, v});
      break;
    }
    case 'u': {
      auto kv = pop_mark("SETITEMS");
      set_items(top("SETITEMS"), kv);
      break;
    }
    case 'q':
      memo_put(in_.u8("a BINPUT key"));
      break;
    case 'r':
      memo_put(in_.le(4, "a LONG_BINPUT key"));
      break;
    case 0x94:
      memo_put(memo_.size());
      break;  // MEMOIZE
    case 'h':
      memo_get(in_.u8("a BINGET key"));
      break;
    case 'j':
      memo_get(in_.le(4, "a LONG_BINGET key"));
      break;
    case 'J':
      push(int_node(static_cast<std::int32_t>(in_.le(4, "a BININT"))));
      break;
    case 'K':
      push(int_node(in_.u8("a BININT1")));
      break;
    case 'M':
      push(int_node(static_cast<std::int64_t>(in_.le(2, "a BININT2"))));
      break;
    case 0x8a:
      push(int_node(long1()));
      break;
    case 'G': {
      Node n;
      n.kind = Kind::floating;
      n.re = std::bit_cast<double>(in_.be(8, "a BINFLOAT"));
      push(add(std::move(n)));
      break;
    }
    case 'X':
      push(str_node(Kind::str, in_.take(in_.le(4, "a BINUNICODE length"), "a BINUNICODE string")));
      break;
    case 0x8c:
      push(str_node(Kind::str,
                    in_.take(in_.u8("a SHORT_BINUNICODE length"), "a SHORT_BINUNICODE string")));
      break;
    case 'B':
      push(str_node(Kind::bytes, in_.take(in_.le(4, "a BINBYTES length"), "BINBYTES")));
      break;
    case 'C':
      push(str_node(Kind::bytes, in_.take(in_.u8("a SHORT_BINBYTES length"), "SHORT_BINBYTES")));
      break;
    case 'N':
      push(add(Kind::none));
      break;
    case 0x88:
    case 0x89: {
      Node n;
      n.kind = Kind::boolean;
      n.flag = op == 0x88;
      push(add(std::move(n)));
      break;
    }
    case 'c': {
      const std::string module(line("a GLOBAL module name"));
      const std::string name(line("a GLOBAL name"));
      global(module, name);
      break;
    }
    case 0x93: {  // STACK_GLOBAL
      const std::uint32_t name = pop("STACK_GLOBAL"), module = pop("STACK_GLOBAL");
      if (node(name).kind != Kind::str || node(module).kind != Kind::str)
        in_.fail_at(op_at_, "STACK_GLOBAL needs two strings");
      global(node(module).s, node(name).s);
      break;
    }
    case 'R':
      reduce();
      break;
    case 'b': {  // BUILD: the state of an OrderedDict (its _metadata) or a Parameter is dropped
      pop("BUILD");
      Node& target = node(top("BUILD"));
      if (target.kind != Kind::ordered_dict && target.kind != Kind::tensor)
        in_.fail_at(op_at_, "BUILD on a value that is not an OrderedDict or a Parameter");
      break;
    }
    case 'Q':
      persistent_id();
      break;
    default:
      in_.fail_at(op_at_,
                  "opcode " + opcode_name(op) + " is not allowed (only what torch.save writes)");
  }
  return false;
}

// Whether a storage's location is a device name torch.save writes ("cpu", "cuda:0", "meta").
bool names_a_device(const std::string& location) {
  try {
    (void)c10::Device(location);
    return true;
  } catch (const c10::Error&) {
    return false;
  }
}

void Reader::persistent_id() {
  const Node& pid = expect(pop("BINPERSID"), {Kind::tuple}, "a persistent id that is not a tuple");
  if (pid.items.size() != 5 && pid.items.size() != 6)
    in_.fail_at(op_at_, "a persistent id of " + std::to_string(pid.items.size()) +
                            " items (('storage', class, key, location, numel) expected)");
  const Node& tag = node(pid.items[0]);
  if (tag.kind != Kind::str || tag.s != "storage")
    in_.fail_at(op_at_, "a persistent id that is not a 'storage'");
  const Node& cls = node(pid.items[1]);
  if (cls.kind != Kind::global || cls.global != Global::storage_class)
    in_.fail_at(op_at_, "a persistent id whose class is not a storage class");
  const Node& key = node(pid.items[2]);
  const Node& location = node(pid.items[3]);
  const Node& numel = node(pid.items[4]);
  if (key.kind != Kind::str || location.kind != Kind::str || numel.kind != Kind::integer ||
      numel.i < 0)
    in_.fail_at(op_at_, "a persistent id with a bad key, location or element count");
  if (pid.items.size() == 6 && node(pid.items[5]).kind != Kind::none)
    in_.fail_at(op_at_, "legacy storage views (view_metadata) are not supported");
  if (!names_a_device(location.s))  // torch.load: "don't know how to restore data location"
    in_.fail_at(op_at_, "storage '" + key.s + "' has the location '" + location.s +
                            "', which names no device ('cpu', 'cuda:0', ... expected)");
  auto [it, fresh] = storage_index_.emplace(key.s, out_.storages_.size());
  if (fresh) {
    out_.storages_.push_back({key.s, cls.dtype, static_cast<std::uint64_t>(numel.i), location.s});
  } else {
    const StorageRef& seen = out_.storages_[it->second];
    if (seen.dtype != cls.dtype || seen.numel != static_cast<std::uint64_t>(numel.i))
      in_.fail_at(op_at_, "storage '" + key.s + "' is referred to with two types or sizes");
  }
  Node n;
  n.kind = Kind::storage;
  n.i = static_cast<std::int64_t>(it->second);
  n.dtype = cls.dtype;
  push(add(std::move(n)));
}

// A tuple of ints (a size or stride).
std::vector<std::int64_t> ints_of(const Unpickled& u, const Node& t, Cursor& in, std::uint64_t at,
                                  const char* what) {
  if (t.kind != Kind::tuple) in.fail_at(at, std::string(what) + " is not a tuple");
  std::vector<std::int64_t> out;
  for (std::uint32_t i : t.items) {
    const Node& v = u.nodes[i];
    if (v.kind != Kind::integer) in.fail_at(at, std::string(what) + " holds a non-integer");
    out.push_back(v.i);
  }
  return out;
}

std::uint32_t Reader::rebuild_tensor(std::uint32_t args_i, bool v3) {
  const std::size_t want = v3 ? 7 : 6;  // then torch's metadata dict, when the tensor has some
  const std::size_t n_args = node(args_i).items.size();
  if (n_args < want)
    in_.fail_at(op_at_, std::string(v3 ? "_rebuild_tensor_v3" : "_rebuild_tensor_v2") + " with " +
                            std::to_string(n_args) + " arguments (" + std::to_string(want) +
                            " expected)");
  std::uint32_t args[7];  // the arguments used (a memo'd tuple may be long: never copied)
  std::copy_n(node(args_i).items.begin(), want, args);
  const Node& storage = expect(args[0], {Kind::storage}, "a tensor whose storage is not a storage");
  const Node& offset = node(args[1]);
  const Node& grad = node(args[4]);
  if (offset.kind != Kind::integer || grad.kind != Kind::boolean)
    in_.fail_at(op_at_, "a tensor with a bad storage offset or requires_grad");
  Node t;
  t.kind = Kind::tensor;
  t.i = offset.i;
  t.flag = grad.flag;
  t.dtype = storage.dtype;
  t.re = static_cast<double>(storage.i);  // storage index
  charge(sizeof(Node) + 8 * (node(args[2]).items.size() + node(args[3]).items.size()));
  t.size = ints_of(out_, node(args[2]), in_, op_at_, "a tensor's size");
  t.stride = ints_of(out_, node(args[3]), in_, op_at_, "a tensor's stride");
  if (v3) t.dtype = expect(args[6], {Kind::dtype}, "_rebuild_tensor_v3 without a dtype").dtype;
  if (n_args > want) view_bits(t, node(args_i).items[want]);
  if (t.size.size() != t.stride.size())
    in_.fail_at(op_at_, "a tensor with " + std::to_string(t.size.size()) + " sizes and " +
                            std::to_string(t.stride.size()) + " strides");
  return add(std::move(t));
}

// torch's tensor metadata (torch._utils.get_tensor_metadata): {'conj': True} for a conjugate
// view, {'neg': True} for a negative view, whose storage holds the values before the view.
void Reader::view_bits(Node& t, std::uint32_t metadata_i) {
  if (node(metadata_i).kind == Kind::none) return;  // the signature's default, written out
  const Node& m = expect(metadata_i, {Kind::dict}, "tensor metadata that is not a dict");
  for (std::size_t k = 0; k + 1 < m.items.size(); k += 2) {
    const Node& key = node(m.items[k]);
    const Node& value = node(m.items[k + 1]);
    if (key.kind != Kind::str || (key.s != "conj" && key.s != "neg") || value.kind != Kind::boolean)
      in_.fail_at(op_at_, "tensor metadata other than {'conj': bool, 'neg': bool}");
    (key.s == "conj" ? t.conj : t.neg) = value.flag;
  }
}

void Reader::reduce() {
  const std::uint32_t args_i = pop("REDUCE"), fn_i = pop("REDUCE");
  expect(fn_i, {Kind::global}, "REDUCE of a value that is not a callable global");
  expect(args_i, {Kind::tuple}, "REDUCE whose arguments are not a tuple");
  // Nodes are read through indices: add() may move the arena, and a tuple may be large.
  const std::size_t n_args = node(args_i).items.size();
  auto arg_index = [&](std::size_t k) {
    if (k >= n_args)
      in_.fail_at(op_at_, node(fn_i).s + " called with " + std::to_string(n_args) + " arguments");
    return node(args_i).items[k];
  };
  auto arg = [&](std::size_t k) -> Node& { return node(arg_index(k)); };
  const Global global = node(fn_i).global;
  switch (global) {
    case Global::ordered_dict: {
      if (n_args != 0) in_.fail_at(op_at_, "OrderedDict(...) with arguments");
      push(add(Kind::ordered_dict));
      return;
    }
    case Global::rebuild_v2:
    case Global::rebuild_v3:
      push(rebuild_tensor(args_i, global == Global::rebuild_v3));
      return;
    case Global::rebuild_parameter:
    case Global::rebuild_parameter_state: {
      Node& data = arg(0);
      if (data.kind != Kind::tensor || arg(1).kind != Kind::boolean)
        in_.fail_at(op_at_, "_rebuild_parameter of a value that is not a tensor");
      charge(sizeof(Node) + 8 * (data.size.size() + data.stride.size()));
      Node p = data;
      p.parameter = true;
      p.flag = arg(1).flag;
      push(add(std::move(p)));
      return;
    }
    case Global::tree: {  // _tree(dict) is that dict (shared, not copied)
      if (n_args != 1 || arg(0).kind != Kind::dict)
        in_.fail_at(op_at_, "treetensor.torch._tree of a value that is not a dict");
      push(arg_index(0));
      return;
    }
    case Global::size: {  // torch.Size(tuple) is that tuple (shared, not copied)
      if (arg(0).kind != Kind::tuple)
        in_.fail_at(op_at_, "torch.Size of a value that is not a tuple");
      push(arg_index(0));
      return;
    }
    case Global::device: {
      Node& type = arg(0);
      if (type.kind != Kind::str)
        in_.fail_at(op_at_, "torch.device of a value that is not a string");
      charge(sizeof(Node) + type.s.size());
      Node d;
      d.kind = Kind::device;
      d.s = type.s;
      if (n_args > 1) {
        if (arg(1).kind != Kind::integer) in_.fail_at(op_at_, "torch.device with a bad index");
        d.s += ":" + std::to_string(arg(1).i);
      }
      push(add(std::move(d)));
      return;
    }
    case Global::codecs_encode: {  // bytes at protocol 2: _codecs.encode(str, 'latin1')
      if (arg(0).kind != Kind::str || arg(1).kind != Kind::str || arg(1).s != "latin1")
        in_.fail_at(op_at_, "_codecs.encode other than (str, 'latin1')");
      charge(sizeof(Node) + arg(0).s.size());
      Node b;
      b.kind = Kind::bytes;
      const std::string& text = arg(0).s;  // UTF-8 of code points < 256
      for (std::size_t k = 0; k < text.size(); ++k) {
        const auto c = static_cast<std::uint8_t>(text[k]);
        if (c < 0x80) {
          b.s += static_cast<char>(c);
        } else if ((c == 0xc2 || c == 0xc3) && k + 1 < text.size()) {
          b.s +=
              static_cast<char>(((c & 0x03) << 6) | (static_cast<std::uint8_t>(text[++k]) & 0x3f));
        } else {
          in_.fail_at(op_at_, "_codecs.encode of text that is not latin1");
        }
      }
      push(add(std::move(b)));
      return;
    }
    case Global::set: {  // set(list): refers to the list's items, never copies them
      Node s;
      s.kind = Kind::set;
      if (n_args != 0) {
        const Node& l = arg(0);
        if (l.kind != Kind::list && l.kind != Kind::tuple)
          in_.fail_at(op_at_, "set() of a non-list");
        s.flag = true;
        s.i = arg_index(0);
      }
      push(add(std::move(s)));
      return;
    }
    case Global::complex: {
      Node c;
      c.kind = Kind::complex;
      for (std::size_t k = 0; k < 2; ++k) {
        const Node& part = arg(k);
        if (part.kind != Kind::floating && part.kind != Kind::integer)
          in_.fail_at(op_at_, "complex() of a non-number");
        (k ? c.im : c.re) = part.kind == Kind::floating ? part.re : double(part.i);
      }
      push(add(std::move(c)));
      return;
    }
    case Global::bytes: {
      if (n_args != 0) in_.fail_at(op_at_, "bytes() with arguments");
      push(add(Kind::bytes));
      return;
    }
    default:
      in_.fail_at(op_at_, "'" + node(fn_i).s + "' cannot be called");
  }
}

// ---- conversion into an Object --------------------------------------------------------------
class Converter {
 public:
  Converter(const Unpickled& u, const std::function<at::Storage(std::size_t)>& storage)
      : u_(u),
        storage_(storage),
        limit_(kExpansionPerByte * u.pickle_bytes + kExpansionBase),
        used_(u.charged) {}

  Object run() {
    Object out;
    tree::Path path;
    out.tree = convert(u_.root, path, out, 0);
    return out;
  }

 private:
  [[noreturn]] void fail(const tree::Path& path, const std::string& what,
                         std::optional<std::uint64_t> at = std::nullopt) const {
    // A deep path (a cycle, a nesting bomb) by its first keys, a long key by its first bytes.
    std::vector<std::string> keys(path.begin(),
                                  path.begin() + std::min<std::size_t>(12, path.size()));
    for (auto& k : keys)
      if (k.size() > 64) k = k.substr(0, 32) + " (" + std::to_string(k.size()) + " bytes in all)";
    std::string where = tree::Path(std::move(keys)).describe();
    if (path.size() > 12) where += ". ... (" + std::to_string(path.size()) + " keys)";
    throw IoError(u_.name, at, "at '" + where + "': " + what);
  }

  // A pickle may refer to one object many times (the memo), and the tree holds a copy at each
  // place, with every recorded path stored whole. Python shares such objects, so a small file
  // could ask for gigabytes: what the tree costs is charged, before it is built, against the
  // expansion budget (pickle.hpp), and `n` (the object being placed) named when it runs out.
  void charge(const Node& n, const tree::Path& path, std::uint64_t bytes) {
    if (bytes <= limit_ - used_) {
      used_ += bytes;
      return;
    }
    fail(path,
         "the object made at byte " + std::to_string(n.at) + " would expand to more than " +
             std::to_string(limit_) +
             " bytes in memory (an object placed at many paths, e.g. a memo bomb, or long keys "
             "above many containers; at most " +
             std::to_string(kExpansionPerByte) + " bytes per pickle byte plus 64 MiB)",
         n.at);
  }
  // Recording the current path in one of the Object's maps: a map node and the path's keys.
  void charge_path(const Node& n, const tree::Path& path) { charge(n, path, 64 + path_bytes_); }
  void push_key(tree::Path& path, std::string key) {
    path_bytes_ += sizeof(std::string) + key.size();
    path.push_back(std::move(key));
  }
  void pop_key(tree::Path& path) {
    path_bytes_ -= sizeof(std::string) + path.keys().back().size();
    path.pop_back();
  }

  tree::Tree<Value> convert(std::uint32_t i, tree::Path& path, Object& out, int depth) {
    if (depth > kMaxDepth)
      fail(path, "nesting deeper than " + std::to_string(kMaxDepth) + " (or a cycle)");
    const Node& n = u_.nodes[i];
    charge(n, path, sizeof(tree::Tree<Value>::Entry) + n.s.size());
    switch (n.kind) {
      case Kind::none:
        return Value(std::monostate{});
      case Kind::boolean:
        return Value(n.flag);
      case Kind::integer:
        return Value(n.i);
      case Kind::floating:
        return Value(n.re);
      case Kind::complex:
        return Value(std::complex<double>(n.re, n.im));
      case Kind::str:
        return Value(n.s);
      case Kind::bytes:
        return Value(io::Bytes{n.s});
      case Kind::dtype:
        return Value(n.dtype);
      case Kind::device:
        return Value(device(n.s, path));
      case Kind::tensor: {
        charge(n, path, sizeof(c10::TensorImpl) + 16 * n.size.size());
        if (n.parameter) {
          charge_path(n, path);
          out.parameters.insert(path);
        }
        return Value(tensor(n, path));
      }
      case Kind::dict:
      case Kind::ordered_dict:
        return dict(n, path, out, depth);
      case Kind::tuple:
      case Kind::list:
      case Kind::set:
        return sequence(n, path, out, depth);
      case Kind::global:
      case Kind::storage:
        fail(path, "a bare " + (n.kind == Kind::global ? "'" + n.s + "'" : std::string("storage")) +
                       " is not a value treetensor loads");
    }
    fail(path, "unknown value");
  }

  tree::Tree<Value> dict(const Node& n, tree::Path& path, Object& out, int depth) {
    if (n.kind == Kind::ordered_dict) {
      charge_path(n, path);
      out.kinds[path] = Container::ordered_dict;
    }
    tree::Tree<Value>::Children children;
    for (std::size_t k = 0; k + 1 < n.items.size(); k += 2) {
      const Node& key = u_.nodes[n.items[k]];
      std::string name;
      if (key.kind == Kind::str) {
        charge(key, path, key.s.size());
        name = key.s;
      } else if (key.kind == Kind::integer) {
        name = std::to_string(key.i);
      } else {
        fail(path, "a dict key that is neither str nor int");
      }
      push_key(path, name);
      if (key.kind == Kind::integer) {
        charge_path(key, path);
        out.int_keys.insert(path);
      }
      children.emplace_back(std::move(name), convert(n.items[k + 1], path, out, depth + 1));
      pop_key(path);
    }
    record_order(n, path, children, out);
    try {
      return tree::Tree<Value>::from_children(std::move(children));
    } catch (const std::invalid_argument& e) {
      fail(path,
           std::string(e.what()) + " (the same key twice, or an int and a str that read alike)");
    }
  }

  // The file's key order, where it is not the tree's sorted order (object.hpp: key_order).
  void record_order(const Node& n, const tree::Path& path,
                    const tree::Tree<Value>::Children& children, Object& out) {
    auto by_key = [](const auto& a, const auto& b) { return a.first < b.first; };
    if (std::is_sorted(children.begin(), children.end(), by_key)) return;
    charge_path(n, path);
    std::vector<std::string> order;
    order.reserve(children.size());
    for (const auto& [key, child] : children) {
      charge(n, path, sizeof(std::string) + key.size());
      order.push_back(key);
    }
    out.key_order.emplace(path, std::move(order));
  }

  tree::Tree<Value> sequence(const Node& n, tree::Path& path, Object& out, int depth) {
    charge_path(n, path);
    out.kinds[path] = n.kind == Kind::tuple  ? Container::tuple
                      : n.kind == Kind::list ? Container::list
                                             : Container::set;
    const auto& items =
        n.flag ? u_.nodes[static_cast<std::size_t>(n.i)].items : n.items;  // set(list)
    tree::Tree<Value>::Children children;
    for (std::size_t k = 0; k < items.size(); ++k) {
      push_key(path, std::to_string(k));
      children.emplace_back(path.keys().back(), convert(items[k], path, out, depth + 1));
      pop_key(path);
    }
    return tree::Tree<Value>::from_children(std::move(children));
  }

  c10::Device device(const std::string& text, const tree::Path& path) const {
    try {
      return c10::Device(text);
    } catch (const c10::Error&) {
      fail(path, "torch.device('" + text + "') is not a device this LibTorch knows");
    }
  }

  at::Tensor tensor(const Node& n, const tree::Path& path) {
    const auto index = static_cast<std::size_t>(n.re);
    auto it = cache_.find(index);
    if (it == cache_.end()) it = cache_.emplace(index, storage_(index)).first;
    const at::Storage& storage = it->second;
    const std::uint64_t item = c10::elementSize(n.dtype);
    // Extent in elements: offset + sum((size - 1) * stride) + 1, overflow-checked.
    std::uint64_t extent = 0, numel = 1;
    if (n.i < 0) fail(path, "negative storage offset " + std::to_string(n.i));
    for (std::size_t d = 0; d < n.size.size(); ++d) {
      if (n.size[d] < 0 || n.stride[d] < 0)
        fail(path, "negative size or stride in dim " + std::to_string(d));
      std::uint64_t step = 0;
      if (!mul_ok(numel, static_cast<std::uint64_t>(n.size[d]), numel) ||
          (n.size[d] > 0 && (!mul_ok(static_cast<std::uint64_t>(n.size[d] - 1),
                                     static_cast<std::uint64_t>(n.stride[d]), step) ||
                             !add_ok(extent, step, extent))))
        fail(path, "size × stride overflows");
    }
    std::uint64_t nbytes = 0;  // at::Tensor counts elements and bytes in int64
    if (numel > std::uint64_t(INT64_MAX) || !mul_ok(numel, item, nbytes) ||
        nbytes > std::uint64_t(INT64_MAX))
      fail(path, "a tensor of " + std::to_string(numel) + " elements of " + std::to_string(item) +
                     " bytes: more bytes than int64 counts");
    std::uint64_t end = 0, bytes = 0;
    if (numel > 0 && (!add_ok(extent, static_cast<std::uint64_t>(n.i) + 1, end) ||
                      !mul_ok(end, item, bytes) || bytes > storage.nbytes()))
      fail(path, "the tensor reaches past its storage '" + u_.storages_[index].key + "' (" +
                     std::to_string(storage.nbytes()) + " bytes)");
    at::Tensor t = at::empty({0}, at::TensorOptions().dtype(n.dtype).device(storage.device()));
    t.set_(storage, n.i, n.size, n.stride);
    if (n.conj) {
      if (!at::isComplexType(n.dtype))
        fail(path, std::string("a conjugate view of a ") + c10::toString(n.dtype) + " tensor");
      t._set_conj(true);
    }
    if (n.neg) t._set_neg(true);
    if (n.flag) {
      if (!at::isFloatingType(n.dtype) && !at::isComplexType(n.dtype))
        fail(path, std::string("requires_grad on a ") + c10::toString(n.dtype) + " tensor");
      t.requires_grad_(true);
    }
    return t;
  }

  const Unpickled& u_;
  const std::function<at::Storage(std::size_t)>& storage_;
  std::map<std::size_t, at::Storage> cache_;
  const std::uint64_t limit_;
  std::uint64_t used_;
  std::uint64_t path_bytes_ = 0;  // what the current path's keys cost (charge_path)
};

// ---- the writer -----------------------------------------------------------------------------
class Writer {
 public:
  Writer(const Object& object, std::vector<at::Tensor>& storages)
      : object_(object), storages_(storages) {}

  std::string run() {
    out_ = "\x80\x02";
    tree::Path path;
    value(object_.tree, path);
    out_ += '.';
    return std::move(out_);
  }

 private:
  void op(char c) { out_ += c; }
  void global(std::string_view module, std::string_view name) {
    out_ += 'c';
    out_.append(module);
    out_ += '\n';
    out_.append(name);
    out_ += '\n';
  }
  void integer(std::int64_t v) {
    if (v >= 0 && v < 256) {
      op('K');
      out_ += static_cast<char>(v);
    } else if (v >= INT32_MIN && v <= INT32_MAX) {
      op('J');
      le(static_cast<std::uint32_t>(v), 4);
    } else {
      out_ += '\x8a';
      out_ += '\x08';
      le(static_cast<std::uint64_t>(v), 8);
    }
  }
  void le(std::uint64_t v, int n) {
    for (int k = 0; k < n; ++k) out_ += static_cast<char>((v >> (8 * k)) & 0xff);
  }
  void str(std::string_view s) {
    op('X');
    le(s.size(), 4);
    out_.append(s);
  }
  void floating(double d) {
    op('G');
    const auto bits = std::bit_cast<std::uint64_t>(d);
    for (int k = 7; k >= 0; --k) out_ += static_cast<char>((bits >> (8 * k)) & 0xff);
  }
  void empty_ordered_dict() {
    global("collections", "OrderedDict");
    op(')');
    op('R');
  }
  void ints(at::IntArrayRef v) {
    op('(');
    for (auto x : v) integer(x);
    op('t');
  }

  void value(const tree::Tree<Value>& t, tree::Path& path) {
    if (t.is_leaf()) return leaf(t.leaf(), path);
    const Container kind = object_.kind(path);
    switch (kind) {
      case Container::dict:
      case Container::ordered_dict: {
        if (kind == Container::dict)
          op('}');
        else
          empty_ordered_dict();
        if (t.size() == 0) return;
        op('(');
        for (const auto* entry : in_file_order(t, path)) {
          const auto& [key, child] = *entry;
          path.push_back(key);
          if (object_.int_keys.count(path))
            integer(int_key(key, path));
          else
            str(key);
          value(child, path);
          path.pop_back();
        }
        op('u');
        return;
      }
      case Container::list:
      case Container::tuple:
      case Container::set: {
        if (kind == Container::set) global("__builtin__", "set");
        if (kind != Container::tuple) op(']');  // EMPTY_LIST, then APPENDS
        op('(');
        for (std::size_t k = 0; k < t.size(); ++k) {
          path.push_back(std::to_string(k));
          const auto* child = t.find(tree::Path{std::to_string(k)});
          if (!child)
            throw std::invalid_argument("save: the " + std::string(container_name(kind)) + " at '" +
                                        path.describe() + "' has no item " + std::to_string(k) +
                                        " (its keys must be 0.." + std::to_string(t.size() - 1) +
                                        ")");
          value(*child, path);
          path.pop_back();
        }
        op(kind == Container::tuple ? 't' : 'e');
        if (kind == Container::set) out_ += "\x85R";  // TUPLE1, REDUCE: set([...])
        return;
      }
    }
  }

  // A dict's children in the order save() writes them (object.hpp: key_order).
  std::vector<const tree::Tree<Value>::Entry*> in_file_order(const tree::Tree<Value>& t,
                                                             const tree::Path& path) const {
    std::vector<const tree::Tree<Value>::Entry*> out;
    out.reserve(t.size());
    const auto& children = t.children();
    auto it = object_.key_order.find(path);
    if (it == object_.key_order.end()) {
      for (const auto& entry : children) out.push_back(&entry);
      return out;
    }
    std::vector<bool> written(children.size());
    auto by_key = [](const auto& entry, const std::string& key) { return entry.first < key; };
    for (const std::string& key : it->second) {
      const auto at = std::lower_bound(children.begin(), children.end(), key, by_key);
      const auto k = static_cast<std::size_t>(at - children.begin());
      if (at == children.end() || at->first != key || written[k]) continue;
      written[k] = true;
      out.push_back(&*at);
    }
    for (std::size_t k = 0; k < children.size(); ++k)
      if (!written[k]) out.push_back(&children[k]);
    return out;
  }

  std::int64_t int_key(const std::string& key, const tree::Path& path) const {
    std::size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(key, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != key.size() || key.empty())
      throw std::invalid_argument("save: the key at '" + path.describe() +
                                  "' is recorded as an int but is not one");
    return v;
  }

  void leaf(const Value& v, const tree::Path& path) {
    std::visit(
        [&](const auto& x) {
          using T = std::decay_t<decltype(x)>;
          if constexpr (std::is_same_v<T, std::monostate>) {
            op('N');
          } else if constexpr (std::is_same_v<T, bool>) {
            out_ += x ? '\x88' : '\x89';
          } else if constexpr (std::is_same_v<T, std::int64_t>) {
            integer(x);
          } else if constexpr (std::is_same_v<T, double>) {
            floating(x);
          } else if constexpr (std::is_same_v<T, std::complex<double>>) {
            global("__builtin__", "complex");
            floating(x.real());
            floating(x.imag());
            out_ += "\x86R";
          } else if constexpr (std::is_same_v<T, std::string>) {
            str(x);
          } else if constexpr (std::is_same_v<T, io::Bytes>) {
            global("_codecs", "encode");
            std::string latin1;  // bytes as the UTF-8 of code points 0..255
            for (unsigned char c : x.data) {
              if (c < 0x80) {
                latin1 += static_cast<char>(c);
              } else {
                latin1 += static_cast<char>(0xc0 | (c >> 6));
                latin1 += static_cast<char>(0x80 | (c & 0x3f));
              }
            }
            str(latin1);
            str("latin1");
            out_ += "\x86R";
          } else if constexpr (std::is_same_v<T, at::ScalarType>) {
            global("torch", dtype_name(x));
          } else if constexpr (std::is_same_v<T, at::Device>) {
            global("torch", "device");
            str(x.str());
            out_ += "\x85R";
          } else {
            tensor(x, path);
          }
        },
        v);
  }

  static std::string dtype_name(at::ScalarType t) {
    if (auto name = torch_dtype_name(t)) return *name;
    throw std::invalid_argument(std::string("save: dtype ") + c10::toString(t) +
                                " has no torch name");
  }

  void tensor(const at::Tensor& t, const tree::Path& path) {
    if (!t.defined())
      throw std::invalid_argument("save: the tensor at '" + path.describe() + "' is undefined");
    if (const std::string kind = non_dense_kind(t); !kind.empty())
      throw std::invalid_argument("save: the tensor at '" + path.describe() + "' is " + kind +
                                  "; these files hold dense tensors (make it one: .to_dense(), "
                                  ".dequantize(), .to_padded_tensor(0); or use torch.save)");
    // A conjugate or negative view's storage holds the values before the view: its values go
    // to the file instead (torch.save writes the bit as metadata; torch.load reads either).
    if (t.is_conj() || t.is_neg()) return tensor(t.resolve_conj().resolve_neg(), path);
    if (!torch_dtype_name(t.scalar_type()))
      throw std::invalid_argument("save: the tensor at '" + path.describe() + "' is " +
                                  c10::toString(t.scalar_type()) +
                                  ", a dtype a torch.save file of dense tensors cannot hold");
    const bool parameter = object_.parameters.count(path) > 0;
    // Dtypes without a typed storage class (uint16, float8_*, complex32): torch.save's form,
    // bytes in a torch.storage.UntypedStorage and the dtype given to _rebuild_tensor_v3.
    const std::optional<std::string> typed = typed_storage_class(t.scalar_type());
    if (parameter) global("torch._utils", "_rebuild_parameter");
    if (parameter) op('(');
    global("torch._utils", typed ? "_rebuild_tensor_v2" : "_rebuild_tensor_v3");
    op('(');
    // The persistent id: ('storage', torch.<T>Storage, key, location, numel).
    const auto* impl = t.storage().unsafeGetStorageImpl();
    auto [it, fresh] = keys_.emplace(impl, storages_.size());
    if (fresh) {
      storages_.push_back(t);
      paths_.push_back(path);
    } else if (storages_[it->second].scalar_type() != t.scalar_type()) {
      throw std::invalid_argument("save: '" + paths_[it->second].describe() + "' (" +
                                  c10::toString(storages_[it->second].scalar_type()) + ") and '" +
                                  path.describe() + "' (" + c10::toString(t.scalar_type()) +
                                  ") view the same data as different dtypes, which a torch.save "
                                  "file cannot hold (as torch.save)");
    }
    const std::uint64_t item = typed ? t.element_size() : 1;  // an untyped storage counts bytes
    op('(');
    str("storage");
    if (typed)
      global("torch", *typed);
    else
      global("torch.storage", "UntypedStorage");
    str(std::to_string(it->second));
    str(t.device().is_cpu() ? "cpu" : t.device().str());
    integer(static_cast<std::int64_t>(t.storage().nbytes() / item));
    op('t');
    op('Q');
    integer(t.storage_offset());
    ints(t.sizes());
    ints(t.strides());
    out_ += (t.requires_grad() && !parameter) ? '\x88' : '\x89';
    empty_ordered_dict();  // backward hooks
    if (!typed) global("torch", dtype_name(t.scalar_type()));
    op('t');
    op('R');
    if (parameter) {
      out_ += t.requires_grad() ? '\x88' : '\x89';
      empty_ordered_dict();
      op('t');
      op('R');
    }
  }

  const Object& object_;
  std::vector<at::Tensor>& storages_;
  std::map<const void*, std::size_t> keys_;
  std::vector<tree::Path> paths_;  // the first path that wrote each storage
  std::string out_;
};

}  // namespace

Object Unpickled::to_object(const std::function<at::Storage(std::size_t)>& storage) const {
  return Converter(*this, storage).run();
}

Unpickled unpickle(const Input& bytes, std::uint64_t start, std::uint64_t& end) {
  return Reader(bytes, start).run(end);
}

std::string pickle(const Object& object, std::vector<at::Tensor>& storages) {
  return Writer(object, storages).run();
}

std::string non_dense_kind(const at::Tensor& t) {
  if (t.is_nested()) return "a nested tensor";
  if (t.is_quantized()) return "a quantized tensor";
  switch (t.layout()) {
    case at::kStrided:
      return "";
    case at::kSparse:
      return "a sparse_coo tensor";
    case at::kSparseCsr:
      return "a sparse_csr tensor";
    case at::kSparseCsc:
      return "a sparse_csc tensor";
    case at::kSparseBsr:
      return "a sparse_bsr tensor";
    case at::kSparseBsc:
      return "a sparse_bsc tensor";
    default:
      return "a tensor of layout " + c10::str(t.layout());
  }
}

std::optional<std::string> typed_storage_class(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kFloat:
      return "FloatStorage";
    case c10::kDouble:
      return "DoubleStorage";
    case c10::kHalf:
      return "HalfStorage";
    case c10::kBFloat16:
      return "BFloat16Storage";
    case c10::kLong:
      return "LongStorage";
    case c10::kInt:
      return "IntStorage";
    case c10::kShort:
      return "ShortStorage";
    case c10::kChar:
      return "CharStorage";
    case c10::kByte:
      return "ByteStorage";
    case c10::kBool:
      return "BoolStorage";
    case c10::kComplexFloat:
      return "ComplexFloatStorage";
    case c10::kComplexDouble:
      return "ComplexDoubleStorage";
    default:
      return std::nullopt;
  }
}

}  // namespace treetensor::io::detail
