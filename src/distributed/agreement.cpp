#include "distributed/agreement.hpp"

#include <c10/core/DeviceType.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <sstream>
#include <utility>

#include "treetensor/tensor/dtype.hpp"

namespace treetensor::distributed::detail {

const char* op_name(Op op) {
  switch (op) {
    case Op::missing:
      return "no request";
    case Op::all_reduce:
      return "all_reduce";
    case Op::broadcast:
      return "broadcast";
    case Op::all_gather:
      return "all_gather";
    case Op::reduce_scatter:
      return "reduce_scatter";
    case Op::barrier:
      return "barrier";
  }
  return "?";
}

const char* reduce_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return "sum";
    case ReduceOp::avg:
      return "avg";
    case ReduceOp::min:
      return "min";
    case ReduceOp::max:
      return "max";
    case ReduceOp::product:
      return "product";
  }
  return "?";
}

std::string op_text(Op op, ReduceOp reduce, std::int64_t root) {
  std::string s = op_name(op);
  if (op == Op::all_reduce || op == Op::reduce_scatter)
    s += std::string("(") + reduce_name(reduce) + ")";
  if (op == Op::broadcast) s += "(root " + std::to_string(root) + ")";
  return s;
}

std::string row_op_text(const Row& row) {
  return op_text(static_cast<Op>(row[kOp]), static_cast<ReduceOp>(row[kReduce]), row[kRoot]);
}

std::string key_text(std::int64_t thread, std::int64_t count) {
  return (thread ? "asyncs thread " + std::to_string(thread) : std::string("a non-asyncs thread")) +
         ", its request " + std::to_string(count);
}

std::string dtype_text(at::ScalarType t) {
  return torch_dtype_name(t).value_or(c10::toString(t));
}

std::string leaf_text(const at::Tensor& t) {
  std::string s = dtype_text(t.scalar_type()) + " [";
  for (auto i : c10::irange(t.dim())) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

std::int64_t fnv1a(const std::string& s) {
  std::uint64_t h = 14695981039346656037ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return static_cast<std::int64_t>(h);
}

namespace {

// A path as one signature field: keys may hold any character, so the separators are escaped
// (otherwise keys with tabs and newlines could make two different trees read the same).
std::string path_field(const tree::Path& p) {
  std::string s;
  for (char c : p.describe()) {
    if (c == '\\' || c == '\t' || c == '\n') s += '\\';
    s += c == '\t' ? 't' : c == '\n' ? 'n' : c;
  }
  return s;
}

std::vector<std::pair<std::string, std::string>> parse_signature(const std::string& s) {
  std::vector<std::pair<std::string, std::string>> out;
  std::istringstream in(s);
  std::string line;
  while (std::getline(in, line)) {
    const auto tab = line.find('\t');
    out.emplace_back(line.substr(0, tab), tab == std::string::npos ? "" : line.substr(tab + 1));
  }
  return out;
}

// "path 'p' (what) is on rank a but not on rank b".
std::string only_on(const std::pair<std::string, std::string>& line, int a, int b) {
  return "path '" + line.first + "' (" + line.second + ") is on rank " + std::to_string(a) +
         " but not on rank " + std::to_string(b);
}

}  // namespace

std::string signature(const std::vector<tree::Path>& paths, const std::vector<at::Tensor>& leaves) {
  std::string s;
  for (std::size_t i = 0; i < leaves.size(); ++i)
    s += path_field(paths[i]) + "\t" + leaf_text(leaves[i]) + " on " +
         c10::DeviceTypeName(leaves[i].device().type(), /*lower_case=*/true) + "\n";
  return s;
}

std::string first_difference(int ra, const std::string& a, int rb, const std::string& b) {
  const auto la = parse_signature(a), lb = parse_signature(b);
  for (std::size_t i = 0; i < std::max(la.size(), lb.size()); ++i) {
    if (i >= la.size()) return only_on(lb[i], rb, ra);
    if (i >= lb.size()) return only_on(la[i], ra, rb);
    if (la[i].first != lb[i].first)  // sorted order: the smaller path is the one the other lacks
      return la[i].first < lb[i].first ? only_on(la[i], ra, rb) : only_on(lb[i], rb, ra);
    if (la[i].second != lb[i].second)
      return "at path '" + la[i].first + "': rank " + std::to_string(ra) + " has " + la[i].second +
             ", rank " + std::to_string(rb) + " has " + lb[i].second;
  }
  return "the structures hash differently but read the same";
}

}  // namespace treetensor::distributed::detail
