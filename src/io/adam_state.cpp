// PyTorch's Adam state dict with parameter names (adam_state.hpp; DESIGN.md §11).
#include "treetensor/io/adam_state.hpp"

#include <ATen/ATen.h>

#include <map>
#include <set>
#include <stdexcept>
#include <utility>

#include "treetensor/tensor/construct.hpp"

namespace treetensor::io {

namespace {
using Node = tree::Tree<Value>;
using tree::Path;

[[noreturn]] void bad(const std::string& what) {
  throw std::invalid_argument("adam_state_from: " + what);
}

const Node* child(const Node& n, const std::string& key) {
  return n.is_leaf() ? nullptr : n.find(Path{key});
}

const Value* leaf(const Node& n, const std::string& key) {
  const Node* c = child(n, key);
  return c && c->is_leaf() ? &c->leaf() : nullptr;
}

double number(const Value& v, const std::string& what) {
  if (const auto* d = std::get_if<double>(&v)) return *d;
  if (const auto* i = std::get_if<std::int64_t>(&v)) return static_cast<double>(*i);
  if (const auto* t = std::get_if<at::Tensor>(&v); t && t->numel() == 1) return t->item<double>();
  bad("param group entry '" + what + "' is a " + value_type_name(v) + ", not a number");
}

double number(const Node& group, const std::string& key, double fallback) {
  const Value* v = leaf(group, key);
  return v ? number(*v, key) : fallback;
}

bool flag(const Node& group, const std::string& key) {
  const Value* v = leaf(group, key);
  const auto* b = v ? std::get_if<bool>(v) : nullptr;
  return b && *b;
}

// The items of the list (or tuple) at `key` of `group`, in order.
std::vector<const Value*> items(const Node& group, const std::string& key) {
  std::vector<const Value*> out;
  const Node* list = child(group, key);
  if (!list) return out;
  for (std::size_t k = 0; k < list->size(); ++k) {
    const Value* v = leaf(*list, std::to_string(k));
    if (!v) bad("'" + key + "' item " + std::to_string(k) + " is not a value");
    out.push_back(v);
  }
  return out;
}

std::vector<std::string> file_names(const Node& group) {
  std::vector<std::string> names;
  for (const Value* v : items(group, "param_names")) {
    const auto* s = std::get_if<std::string>(v);
    if (!s) bad("param_names holds a " + std::string(value_type_name(*v)) + ", not a str");
    names.push_back(*s);
  }
  return names;
}

at::Tensor tensor_of(const Node& s, const std::string& key, const std::string& name) {
  const Value* v = leaf(s, key);
  const auto* t = v ? std::get_if<at::Tensor>(v) : nullptr;
  if (!t) bad("the state of '" + name + "' has no tensor '" + key + "'");
  return *t;
}

std::int64_t step_of(const Node& s, const std::string& name) {
  const Value* v = leaf(s, "step");
  if (v) {
    if (const auto* t = std::get_if<at::Tensor>(v); t && t->numel() == 1)
      return static_cast<std::int64_t>(t->item<double>());
    if (const auto* i = std::get_if<std::int64_t>(v)) return *i;
    if (const auto* d = std::get_if<double>(v)) return static_cast<std::int64_t>(*d);
  }
  bad("the state of '" + name + "' has no step number");
}

// Removes every entry of `m` at `prefix` or below it.
template <class M>
void erase_under(M& m, const Path& prefix) {
  for (auto it = m.begin(); it != m.end();) {
    const Path& p = [&]() -> const Path& {
      if constexpr (requires { it->first; })
        return it->first;
      else
        return *it;
    }();
    const bool under =
        p.size() >= prefix.size() && std::equal(prefix.begin(), prefix.end(), p.begin());
    it = under ? m.erase(it) : std::next(it);
  }
}

Node list_of(std::vector<Value> values) {
  Node::Children children;
  for (std::size_t k = 0; k < values.size(); ++k)
    children.emplace_back(std::to_string(k), std::move(values[k]));
  return Node::from_children(std::move(children));
}

// The ids of a group's params, in order.
std::vector<std::int64_t> ids_of(const Node& group) {
  std::vector<std::int64_t> ids;
  for (const Value* v : items(group, "params")) {
    const auto* id = std::get_if<std::int64_t>(v);
    if (!id) bad("the group's params hold a " + std::string(value_type_name(*v)) + ", not an id");
    ids.push_back(*id);
  }
  return ids;
}

// Every group's names, concatenated in id order: the file's param_names, or the caller's.
std::vector<std::string> choose_names(const Node& groups, std::size_t count,
                                      const std::vector<std::string>& given) {
  std::vector<std::string> in_file;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const auto names = file_names(groups.at(Path{std::to_string(g)}));
    in_file.insert(in_file.end(), names.begin(), names.end());
  }
  if (!in_file.empty() && !given.empty() && in_file != given)
    bad("the names passed differ from the file's param_names");
  if (!in_file.empty() && in_file.size() != count)
    bad("param_names names " + std::to_string(in_file.size()) + " of the " + std::to_string(count) +
        " parameters (a group without param_names?)");
  if (!in_file.empty()) return in_file;
  if (given.empty())
    bad("the file has no param_names: pass the parameters' names in id order (e.g. the model "
        "state dict's parameter names, in named_parameters() order), or build the PyTorch "
        "optimizer from model.named_parameters() (PyTorch >= 2.6) so that it saves them");
  if (given.size() != count)
    bad(std::to_string(given.size()) + " names for the groups' " + std::to_string(count) +
        " parameters");
  return given;
}

AdamOptions options_of(const Node& group) {
  const auto betas = items(group, "betas");
  double beta1 = 0.9, beta2 = 0.999;
  if (betas.size() == 2) {
    beta1 = number(*betas[0], "betas");
    beta2 = number(*betas[1], "betas");
  }
  return AdamOptions()
      .lr(number(group, "lr", 1e-3))
      .betas(beta1, beta2)
      .eps(number(group, "eps", 1e-8))
      .weight_decay(number(group, "weight_decay", 0))
      .amsgrad(flag(group, "amsgrad"))
      .maximize(flag(group, "maximize"));
}

// One group's state: `names` are its parameters' names, in the order of its ids.
AdamState group_state(const Node& state, const Node& group, std::vector<std::string> names) {
  const std::vector<std::int64_t> ids = ids_of(group);
  AdamState out;
  out.names = std::move(names);
  out.options = options_of(group);
  std::vector<std::pair<std::string, at::Tensor>> avg, avg_sq, max_sq;
  for (std::size_t k = 0; k < ids.size(); ++k) {
    const std::string& name = out.names[k];
    const Node* s = child(state, std::to_string(ids[k]));
    if (!s)
      bad("parameter '" + name + "' (id " + std::to_string(ids[k]) +
          ") has no state (PyTorch keeps none for a parameter that never had a gradient)");
    avg.emplace_back(name, tensor_of(*s, "exp_avg", name));
    avg_sq.emplace_back(name, tensor_of(*s, "exp_avg_sq", name));
    if (out.options.amsgrad()) max_sq.emplace_back(name, tensor_of(*s, "max_exp_avg_sq", name));
    const std::int64_t step = step_of(*s, name);
    if (k > 0 && step != out.step)
      bad("parameter '" + name + "' took " + std::to_string(step) + " steps, '" + out.names[0] +
          "' " + std::to_string(out.step) + " (a group takes one step number)");
    out.step = step;
  }
  out.exp_avg = from_state_dict(avg);
  out.exp_avg_sq = from_state_dict(avg_sq);
  if (out.options.amsgrad()) out.max_exp_avg_sq = from_state_dict(max_sq);
  return out;
}
}  // namespace

std::vector<AdamState> adam_states_from(const Object& state_dict,
                                        const std::vector<std::string>& names) {
  const Node* state = child(state_dict.tree, "state");
  const Node* groups = child(state_dict.tree, "param_groups");
  if (!state || state->is_leaf() || !groups || groups->is_leaf())
    bad("not an optimizer state dict ('state' and 'param_groups' expected)");
  std::size_t count = 0;
  for (std::size_t g = 0; g < groups->size(); ++g)
    count += ids_of(groups->at(Path{std::to_string(g)})).size();
  const std::vector<std::string> all = choose_names(*groups, count, names);
  std::vector<AdamState> out;
  std::size_t first = 0;
  for (std::size_t g = 0; g < groups->size(); ++g) {
    const Node& group = groups->at(Path{std::to_string(g)});
    const std::size_t n = ids_of(group).size();
    out.push_back(group_state(*state, group, {all.begin() + first, all.begin() + first + n}));
    first += n;
  }
  return out;
}

AdamState adam_state_from(const Object& state_dict, const std::vector<std::string>& names) {
  std::vector<AdamState> groups = adam_states_from(state_dict, names);
  if (groups.size() != 1)
    bad(std::to_string(groups.size()) +
        " param groups: adam_state_from takes one (adam_states_from or io::Adam take several)");
  return std::move(groups[0]);
}

namespace {
// A state dict entry's tensor `name` of `tree` (one of a group's moment trees).
at::Tensor moment(const std::map<std::string, at::Tensor>& tree, const std::string& name,
                  const char* what) {
  const auto it = tree.find(name);
  if (it == tree.end())
    throw std::invalid_argument("adam_state_dict: '" + name + "' has no " + what);
  return it->second;
}

// Group `g` of `base` (or a new one) with `s`'s options and the ids [first, first + n).
Node group_entry(const Object& base, std::size_t g, const AdamState& s, std::size_t first,
                 Object& out) {
  const Path at{"param_groups", std::to_string(g)};
  const Node* old = base.tree.find(at);
  Node group = old && !old->is_leaf() ? *old : Node{};
  const AdamOptions& o = s.options;
  std::vector<Value> params, names;
  for (std::size_t k = 0; k < s.names.size(); ++k) {
    params.emplace_back(static_cast<std::int64_t>(first + k));
    names.emplace_back(s.names[k]);
  }
  group.insert(Path{"lr"}, Value(o.lr()));
  group.insert(Path{"betas"}, list_of({Value(o.beta1()), Value(o.beta2())}));
  group.insert(Path{"eps"}, Value(o.eps()));
  group.insert(Path{"weight_decay"}, Value(o.weight_decay()));
  group.insert(Path{"amsgrad"}, Value(o.amsgrad()));
  group.insert(Path{"maximize"}, Value(o.maximize()));
  group.insert(Path{"params"}, list_of(std::move(params)));
  group.insert(Path{"param_names"}, list_of(std::move(names)));
  if (!old)
    out.key_order[at] = {"lr",      "betas",    "eps",    "weight_decay",
                         "amsgrad", "maximize", "params", "param_names"};
  out.kinds[Path{"param_groups", std::to_string(g), "betas"}] = Container::tuple;
  out.kinds[Path{"param_groups", std::to_string(g), "params"}] = Container::list;
  out.kinds[Path{"param_groups", std::to_string(g), "param_names"}] = Container::list;
  return group;
}
}  // namespace

Object adam_state_dict(const std::vector<AdamState>& groups, const Object& base) {
  Object out = base;
  const Path state_at{"state"}, groups_at{"param_groups"};
  auto forget = [&](const Path& p) {  // what `base` recorded of a subtree written anew
    erase_under(out.kinds, p);
    erase_under(out.int_keys, p);
    erase_under(out.key_order, p);
    erase_under(out.parameters, p);
  };
  forget(state_at);
  const Node* old_groups = base.tree.find(groups_at);
  for (std::size_t g = groups.size();
       old_groups && !old_groups->is_leaf() && g < old_groups->size(); ++g)
    forget(Path{"param_groups", std::to_string(g)});
  Node::Children entries, group_nodes;
  std::vector<std::string> ids;
  for (std::size_t g = 0, first = 0; g < groups.size(); first += groups[g].names.size(), ++g) {
    const AdamState& s = groups[g];
    const auto avg = to_state_dict(s.exp_avg), avg_sq = to_state_dict(s.exp_avg_sq);
    const auto max_sq = to_state_dict(s.max_exp_avg_sq);
    for (std::size_t k = 0; k < s.names.size(); ++k) {
      const std::string& name = s.names[k];
      const std::string id = std::to_string(first + k);
      Node entry{{"step", Value(at::scalar_tensor(double(s.step), at::kFloat))},
                 {"exp_avg", Value(moment(avg, name, "exp_avg"))},
                 {"exp_avg_sq", Value(moment(avg_sq, name, "exp_avg_sq"))}};
      std::vector<std::string> order = {"step", "exp_avg", "exp_avg_sq"};
      if (s.options.amsgrad()) {
        entry.insert(Path{"max_exp_avg_sq"}, Value(moment(max_sq, name, "max_exp_avg_sq")));
        order.push_back("max_exp_avg_sq");
      }
      entries.emplace_back(id, std::move(entry));
      out.int_keys.insert(Path{"state", id});
      out.key_order[Path{"state", id}] = std::move(order);
      ids.push_back(id);
    }
    group_nodes.emplace_back(std::to_string(g), group_entry(base, g, s, first, out));
  }
  out.key_order[state_at] = ids;
  out.tree.insert(state_at, Node::from_children(std::move(entries)));
  out.tree.insert(groups_at, Node::from_children(std::move(group_nodes)));
  out.kinds[groups_at] = Container::list;
  if (!out.key_order.count({})) out.key_order[{}] = {"state", "param_groups"};
  return out;
}

Object adam_state_dict(const AdamState& state, const Object& base) {
  return adam_state_dict(std::vector<AdamState>{state}, base);
}

// ---- the optimizer object ----------------------------------------------------------------
namespace {
[[noreturn]] void refuse(const std::string& what) {
  throw std::invalid_argument("Adam: " + what);
}

// The leaves of `leaves` (a dotted state dict) named `names`, as a tree sharing them.
TreeTensor select(const std::map<std::string, at::Tensor>& leaves,
                  const std::vector<std::string>& names, const char* tree_name) {
  std::vector<std::pair<std::string, at::Tensor>> items;
  items.reserve(names.size());
  for (const std::string& name : names) {
    const auto it = leaves.find(name);
    if (it == leaves.end()) refuse(std::string(tree_name) + " has no leaf '" + name + "'");
    items.emplace_back(name, it->second);
  }
  return from_state_dict(items);
}

// "fc.weight: dtype float64, expected float32 (the parameter's)", or "" when `t` fits `p`.
std::string mismatch(const at::Tensor& t, const at::Tensor& p) {
  if (t.scalar_type() != p.scalar_type())
    return std::string("dtype ") + c10::toString(t.scalar_type()) + ", expected " +
           c10::toString(p.scalar_type());
  if (t.device() != p.device())
    return "device " + t.device().str() + ", expected " + p.device().str();
  if (t.sizes() != p.sizes())
    return "shape " + c10::str(t.sizes()) + ", expected " + c10::str(p.sizes());
  return "";
}

// Every leaf of `tree` (named `tree_name`) fits the parameter of its name.
void check_leaves(const std::map<std::string, at::Tensor>& params, const TensorTree& tree,
                  const char* tree_name) {
  for (const auto& [name, t] : to_state_dict(tree)) {
    const auto it = params.find(name);
    if (it == params.end()) refuse(std::string(tree_name) + " has '" + name + "', not a parameter");
    if (const std::string m = mismatch(t, it->second); !m.empty())
      refuse("at '" + name + "': " + tree_name + " has " + m + " (the parameter's)");
  }
}

// `groups` name every parameter once, and their moments fit the parameters.
void check_groups(const TreeTensor& params, const std::vector<AdamState>& groups) {
  const auto leaves = to_state_dict(params);
  std::set<std::string> seen;
  for (const AdamState& g : groups) {
    for (const std::string& name : g.names) {
      if (!leaves.count(name)) refuse("the state names '" + name + "', not a parameter");
      if (!seen.insert(name).second) refuse("the state names '" + name + "' twice");
    }
    check_leaves(leaves, g.exp_avg, "exp_avg");
    check_leaves(leaves, g.exp_avg_sq, "exp_avg_sq");
    if (g.options.amsgrad()) check_leaves(leaves, g.max_exp_avg_sq, "max_exp_avg_sq");
  }
  for (const auto& [name, t] : leaves)
    if (!seen.count(name)) refuse("parameter '" + name + "' is in no param group of the state");
}

std::vector<std::string> dotted_paths(const TreeTensor& t) {
  std::vector<std::string> out;
  for (const auto& [name, leaf] : to_state_dict(t)) out.push_back(name);
  return out;
}
}  // namespace

Adam::Adam(TreeTensor params, AdamOptions options, const std::vector<std::string>& names)
    : params_(std::move(params)) {
  options.validate();
  AdamState g;
  g.names = names.empty() ? dotted_paths(params_) : names;
  g.options = options;
  const auto leaves = to_state_dict(params_);
  for (const std::string& name : g.names)
    if (!leaves.count(name)) refuse("names '" + name + "', not a parameter");
  const TreeTensor chosen = select(leaves, g.names, "params");
  g.exp_avg = zeros_like(chosen);
  g.exp_avg_sq = zeros_like(chosen);
  if (options.amsgrad()) g.max_exp_avg_sq = zeros_like(chosen);
  std::vector<AdamState> groups{std::move(g)};
  check_groups(params_, groups);
  groups_ = std::move(groups);
}

void Adam::load_state_dict(const Object& state_dict, const std::vector<std::string>& names) {
  std::vector<AdamState> groups = adam_states_from(state_dict, names);
  check_groups(params_, groups);
  groups_ = std::move(groups);
}

void Adam::step(const TensorTree& grads) {
  const auto leaves = to_state_dict(params_), given = to_state_dict(grads);
  check_leaves(leaves, grads, "grads");
  if (given.size() != leaves.size())
    for (const auto& [name, p] : leaves)
      if (!given.count(name)) refuse("grads has no leaf '" + name + "'");
  for (AdamState& g : groups_) {
    TreeTensor p = select(leaves, g.names, "params");
    const TreeTensor dp = select(given, g.names, "grads");
    adam_step_single_pass(p, dp, g.exp_avg, g.exp_avg_sq, g.step + 1, g.options,
                          g.options.amsgrad() ? &g.max_exp_avg_sq : nullptr);
    ++g.step;
  }
}

Object Adam::state_dict(const Object& base) const {
  return adam_state_dict(groups_, base);
}

}  // namespace treetensor::io
