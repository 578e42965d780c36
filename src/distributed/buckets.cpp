#include "distributed/buckets.hpp"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <tuple>

#include "distributed/agreement.hpp"

namespace treetensor::distributed::detail {

std::vector<Bucket> plan_buckets(const std::vector<at::Tensor>& leaves, std::int64_t first_bytes,
                                 std::int64_t bytes) {
  struct Open {
    Bucket items;
    std::int64_t bytes = 0;
    bool first = true;  // small, so that its communication could start early
  };
  std::map<std::tuple<int, int, int>, Open> open;  // by (dtype, device type, device index)
  std::vector<Bucket> closed;
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    const auto& t = leaves[i];
    if (t.numel() == 0) continue;
    auto& o = open[{static_cast<int>(t.scalar_type()), static_cast<int>(t.device().type()),
                    t.device().index()}];
    const std::int64_t size = t.numel() * static_cast<std::int64_t>(t.element_size());
    if (!o.items.empty() && o.bytes + size > (o.first ? first_bytes : bytes)) {
      closed.push_back(std::move(o.items));
      o.items.clear();
      o.bytes = 0;
      o.first = false;
    }
    o.items.emplace_back(i, t.numel());
    o.bytes += size;
  }
  for (auto& [k, o] : open)
    if (!o.items.empty()) closed.push_back(std::move(o.items));
  std::sort(closed.begin(), closed.end(),
            [](const auto& a, const auto& b) { return a[0].first < b[0].first; });
  return closed;
}

std::int64_t bucket_numel(const Bucket& items) {
  std::int64_t n = 0;
  for (const auto& it : items) n += it.second;
  return n;
}

bool is_one_leaf(const std::vector<at::Tensor>& leaves, const Bucket& items) {
  return items.size() == 1 && leaves[items[0].first].is_contiguous();
}

void pack(const std::vector<at::Tensor>& leaves, const Bucket& items, at::Tensor buffer) {
  std::vector<at::Tensor> flat;
  for (const auto& it : items) flat.push_back(leaves[it.first].reshape({-1}));
  at::cat_out(buffer, flat);
}

void unpack(const at::Tensor& buffer, const Bucket& items, const std::vector<at::Tensor>& dest) {
  std::int64_t off = 0;
  for (const auto& [i, numel] : items) {
    dest[i].copy_(buffer.narrow(0, off, numel).view(dest[i].sizes()));
    off += numel;
  }
}

namespace {

// The dtypes the backend of `device` takes for every collective: ProcessGroupGloo's on the
// CPU; NCCL's (ncclDataType_t) on CUDA, which adds bfloat16.
bool native_dtype(at::ScalarType t, c10::DeviceType device) {
  switch (t) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kChar:
    case at::kByte:
    case at::kInt:
    case at::kLong:
      return true;
    case at::kBFloat16:
      return device == c10::kCUDA;
    default:
      return false;
  }
}

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      return c10d::ReduceOp(c10d::ReduceOp::SUM);
    case ReduceOp::min:
      return c10d::ReduceOp(c10d::ReduceOp::MIN);
    case ReduceOp::max:
      return c10d::ReduceOp(c10d::ReduceOp::MAX);
    case ReduceOp::product:
      return c10d::ReduceOp(c10d::ReduceOp::PRODUCT);
  }
  return c10d::ReduceOp(c10d::ReduceOp::SUM);
}

// Memory extent [first, last] byte of a non-empty tensor (non-negative strides).
std::pair<std::uintptr_t, std::uintptr_t> extent(const at::Tensor& t) {
  std::int64_t last = 0;
  for (auto d : c10::irange(t.dim())) last += (t.size(d) - 1) * std::abs(t.stride(d));
  const auto first = reinterpret_cast<std::uintptr_t>(t.data_ptr());
  return {first, first + static_cast<std::uintptr_t>((last + 1) * t.element_size()) - 1};
}

}  // namespace

bool reducible(at::ScalarType t, ReduceOp op, c10::DeviceType device) {
  if (native_dtype(t, device) || t == at::kBool) return true;
  return at::isComplexType(t) && (op == ReduceOp::sum || op == ReduceOp::avg);
}

std::string irreducible_text(at::ScalarType t, ReduceOp op, c10::DeviceType device) {
  const bool nccl = device == c10::kCUDA;
  const std::string dtypes = nccl ? "float32, float64, float16, bfloat16, int8, uint8, int32, int64"
                                  : "float32, float64, float16, int8, uint8, int32, int64";
  return (nccl ? "NCCL cannot reduce " : "Gloo cannot reduce ") + dtype_text(t) + " by " +
         reduce_name(op) + " (it reduces " + dtypes + " and bool; complex by sum and avg)";
}

at::Tensor wire(const at::Tensor& buffer, bool reduction) {
  const auto t = buffer.scalar_type();
  if (native_dtype(t, buffer.device().type())) return buffer;
  if (reduction && at::isComplexType(t)) return at::view_as_real(buffer).view({-1});
  return buffer.view(at::kByte);
}

c10d::ReduceOp wire_op(ReduceOp op, at::ScalarType t) {
  if (t == at::kBool && op == ReduceOp::sum) return to_c10d(ReduceOp::max);
  if (t == at::kBool && op == ReduceOp::product) return to_c10d(ReduceOp::min);
  return to_c10d(op);
}

bool exchanges(const at::Tensor& buffer, ReduceOp op, int world) {
  const auto t = buffer.scalar_type();
  if (world < 2 || !buffer.device().is_cpu() || !native_dtype(t, c10::kCPU) || buffer.numel() == 0)
    return false;
  if ((world - 1) * buffer.numel() * std::int64_t(buffer.element_size()) > kExchangeMaxBytes)
    return false;
  if (op == ReduceOp::sum || op == ReduceOp::avg) return true;
  return (op == ReduceOp::min || op == ReduceOp::max) && at::isIntegralType(t, false);
}

void reduce_in_rank_order(const std::vector<at::Tensor>& parts, int own, ReduceOp op) {
  at::Tensor acc = parts[0];  // a handle: rank 0's own buffer, elsewhere its received copy
  for (std::size_t k = 1; k < parts.size(); ++k) {
    if (op == ReduceOp::min)
      at::minimum_out(acc, acc, parts[k]);
    else if (op == ReduceOp::max)
      at::maximum_out(acc, acc, parts[k]);
    else
      acc.add_(parts[k]);
  }
  if (own != 0) parts[own].copy_(acc);
}

std::string write_conflict(const std::vector<tree::Path>& paths,
                           const std::vector<at::Tensor>& leaves) {
  struct Span {
    std::uintptr_t first, last;
    std::size_t leaf;
  };
  std::vector<Span> spans;
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    if (leaves[i].numel() == 0) continue;
    if (at::has_internal_overlap(leaves[i]) == at::MemOverlap::Yes)
      return "path '" + paths[i].describe() +
             "': elements of the leaf share memory (an expanded or stride-0 view); a collective "
             "cannot write it";
    const auto [first, last] = extent(leaves[i]);
    spans.push_back({first, last, i});
  }
  std::sort(spans.begin(), spans.end(),
            [](const Span& a, const Span& b) { return a.first < b.first; });
  // A sweep: each leaf against every one that starts before it and reaches its start (one
  // reaching furthest, e.g. a column, must not hide an overlap of two rows under it).
  std::vector<const Span*> open;
  for (const Span& s : spans) {
    open.erase(
        std::remove_if(open.begin(), open.end(), [&](const Span* o) { return o->last < s.first; }),
        open.end());
    for (const Span* o : open) {
      const auto status = at::get_overlap_status(leaves[s.leaf], leaves[o->leaf]);
      if (status == at::MemOverlapStatus::Full || status == at::MemOverlapStatus::Partial) {
        const auto [a, b] = std::minmax(o->leaf, s.leaf);
        return "paths '" + paths[a].describe() + "' and '" + paths[b].describe() +
               "' share memory; a collective that writes both would write it twice (pass one)";
      }
    }
    open.push_back(&s);
  }
  return {};
}

}  // namespace treetensor::distributed::detail
