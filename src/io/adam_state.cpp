// PyTorch's Adam state dict with parameter names (adam_state.hpp; DESIGN.md §11).
#include "treetensor/io/adam_state.hpp"

#include <ATen/ATen.h>

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

std::vector<std::string> choose_names(const Node& group, const std::vector<std::string>& given) {
  const std::vector<std::string> in_file = file_names(group);
  if (!in_file.empty() && !given.empty() && in_file != given)
    bad("the names passed differ from the file's param_names");
  if (!in_file.empty()) return in_file;
  if (given.empty())
    bad("the file has no param_names: pass the parameters' names in id order (e.g. the model "
        "state dict's parameter names, in named_parameters() order), or build the PyTorch "
        "optimizer from model.named_parameters() (PyTorch >= 2.6) so that it saves them");
  return given;
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
}  // namespace

AdamState adam_state_from(const Object& state_dict, const std::vector<std::string>& names) {
  const Node* state = child(state_dict.tree, "state");
  const Node* groups = child(state_dict.tree, "param_groups");
  if (!state || state->is_leaf() || !groups || groups->is_leaf())
    bad("not an optimizer state dict ('state' and 'param_groups' expected)");
  if (groups->size() != 1)
    bad(std::to_string(groups->size()) + " param groups: only one is supported");
  const Node& group = groups->at(Path{"0"});
  std::vector<std::int64_t> ids;
  for (const Value* v : items(group, "params")) {
    const auto* id = std::get_if<std::int64_t>(v);
    if (!id) bad("the group's params hold a " + std::string(value_type_name(*v)) + ", not an id");
    ids.push_back(*id);
  }
  AdamState out;
  out.names = choose_names(group, names);
  if (out.names.size() != ids.size())
    bad(std::to_string(out.names.size()) + " names for the group's " + std::to_string(ids.size()) +
        " parameters");
  std::vector<std::pair<std::string, at::Tensor>> avg, avg_sq;
  for (std::size_t k = 0; k < ids.size(); ++k) {
    const std::string& name = out.names[k];
    const Node* s = child(*state, std::to_string(ids[k]));
    if (!s)
      bad("parameter '" + name + "' (id " + std::to_string(ids[k]) +
          ") has no state (PyTorch keeps none for a parameter that never had a gradient)");
    avg.emplace_back(name, tensor_of(*s, "exp_avg", name));
    avg_sq.emplace_back(name, tensor_of(*s, "exp_avg_sq", name));
    const std::int64_t step = step_of(*s, name);
    if (k > 0 && step != out.step)
      bad("parameter '" + name + "' took " + std::to_string(step) + " steps, '" + out.names[0] +
          "' " + std::to_string(out.step) + " (adam_step takes one step number)");
    out.step = step;
  }
  out.exp_avg = from_state_dict(avg);
  out.exp_avg_sq = from_state_dict(avg_sq);
  const auto betas = items(group, "betas");
  double beta1 = 0.9, beta2 = 0.999;
  if (betas.size() == 2) {
    beta1 = number(*betas[0], "betas");
    beta2 = number(*betas[1], "betas");
  }
  out.options = AdamOptions()
                    .lr(number(group, "lr", 1e-3))
                    .betas(beta1, beta2)
                    .eps(number(group, "eps", 1e-8))
                    .weight_decay(number(group, "weight_decay", 0))
                    .amsgrad(flag(group, "amsgrad"))
                    .maximize(flag(group, "maximize"));
  return out;
}

Object adam_state_dict(const AdamState& state, const Object& base) {
  Object out = base;
  const Path state_at{"state"}, group_at{"param_groups", "0"};
  erase_under(out.kinds, state_at);
  erase_under(out.int_keys, state_at);
  erase_under(out.key_order, state_at);
  erase_under(out.parameters, state_at);
  const auto avg = to_state_dict(state.exp_avg), avg_sq = to_state_dict(state.exp_avg_sq);
  Node::Children entries;
  std::vector<std::string> ids;
  std::vector<Value> params, names;
  for (std::size_t k = 0; k < state.names.size(); ++k) {
    const std::string& name = state.names[k];
    const auto a = avg.find(name), s = avg_sq.find(name);
    if (a == avg.end() || s == avg_sq.end())
      throw std::invalid_argument("adam_state_dict: '" + name + "' has no exp_avg or exp_avg_sq");
    const std::string id = std::to_string(k);
    entries.emplace_back(id,
                         Node{{"step", Value(at::scalar_tensor(double(state.step), at::kFloat))},
                              {"exp_avg", Value(a->second)},
                              {"exp_avg_sq", Value(s->second)}});
    out.int_keys.insert(Path{"state", id});
    out.key_order[Path{"state", id}] = {"step", "exp_avg", "exp_avg_sq"};
    ids.push_back(id);
    params.emplace_back(static_cast<std::int64_t>(k));
    names.emplace_back(name);
  }
  out.key_order[state_at] = ids;
  out.tree.insert(state_at, Node::from_children(std::move(entries)));
  const Node* old = out.tree.find(group_at);
  Node group = old && !old->is_leaf() ? *old : Node{};
  const AdamOptions& o = state.options;
  group.insert(Path{"lr"}, Value(o.lr()));
  group.insert(Path{"betas"}, list_of({Value(o.beta1()), Value(o.beta2())}));
  group.insert(Path{"eps"}, Value(o.eps()));
  group.insert(Path{"weight_decay"}, Value(o.weight_decay()));
  group.insert(Path{"amsgrad"}, Value(o.amsgrad()));
  group.insert(Path{"maximize"}, Value(o.maximize()));
  group.insert(Path{"params"}, list_of(std::move(params)));
  group.insert(Path{"param_names"}, list_of(std::move(names)));
  if (!old)
    out.key_order[group_at] = {"lr",      "betas",    "eps",    "weight_decay",
                               "amsgrad", "maximize", "params", "param_names"};
  out.tree.insert(group_at, std::move(group));
  out.kinds[Path{"param_groups"}] = Container::list;
  out.kinds[Path{"param_groups", "0", "betas"}] = Container::tuple;
  out.kinds[Path{"param_groups", "0", "params"}] = Container::list;
  out.kinds[Path{"param_groups", "0", "param_names"}] = Container::list;
  if (!out.key_order.count({})) out.key_order[{}] = {"state", "param_groups"};
  return out;
}

}  // namespace treetensor::io
