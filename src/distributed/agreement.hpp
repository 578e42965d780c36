#pragma once
// What ranks agree on before a collective (DESIGN.md §14), kept apart from moving data as c10d
// keeps its cross-rank checks (ProcessGroupWrapper) apart from the backends: the text of a
// tree's signature, its hash, the fields of the agreement row and the words for a difference.
// No c10d here.

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "treetensor/distributed/process_group.hpp"
#include "treetensor/tree/path.hpp"

namespace treetensor::distributed::detail {

/// The collective of a request (a row's kOp field; 0: this rank has no such request).
enum class Op : std::int64_t {
  missing = 0,
  all_reduce,
  broadcast,
  all_gather,
  reduce_scatter,
  barrier
};

const char* op_name(Op op);
const char* reduce_name(ReduceOp op);
/// The op as messages name it: "all_reduce(sum)", "broadcast(root 0)", "barrier".
std::string op_text(Op op, ReduceOp reduce, std::int64_t root);
/// A request key in words: "asyncs thread 3, its request 7" or "a non-asyncs thread, ...".
std::string key_text(std::int64_t thread, std::int64_t count);

std::string dtype_text(at::ScalarType t);
/// "float32 [2, 3]": dtype and shape.
std::string leaf_text(const at::Tensor& t);

/// FNV-1a: the same value in every process (std::hash promises nothing across builds).
std::int64_t fnv1a(const std::string& s);

/// One line per leaf, "path\tdtype [shape] on <device type>": what ranks must agree on. The
/// device type (cpu, cuda) and not its index: ranks put their leaves on their own GPU.
std::string signature(const std::vector<tree::Path>& paths, const std::vector<at::Tensor>& leaves);

/// The first difference between the signatures of ranks ra and rb, in words naming the path.
std::string first_difference(int ra, const std::string& a, int rb, const std::string& b);

/// The fields of the row every rank contributes to the agreement allgather.
enum Field {
  kThread,
  kCount,
  kOp,
  kReduce,
  kRoot,
  kLeaves,
  kNumel,
  kHash,
  kSigLen,
  kBuffers,
  kRefused,
  kRow
};
using Row = std::array<std::int64_t, kRow>;

/// The op of a row in words (op_text of its kOp, kReduce and kRoot fields).
std::string row_op_text(const Row& row);

}  // namespace treetensor::distributed::detail
