#pragma once
// Buckets of the distributed layer (DESIGN.md §14), as c10d's reducer.cpp keeps them apart
// from the backends: which leaves share a flat buffer (DDP's limits, per dtype and device),
// packing and unpacking, what each backend takes on the wire and which leaves a collective
// may write.

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "treetensor/distributed/process_group.hpp"
#include "treetensor/tree/path.hpp"

namespace treetensor::distributed::detail {

/// One bucket: (leaf index, element count) of each of its leaves, in flatten order.
using Bucket = std::vector<std::pair<std::size_t, std::int64_t>>;

/// The buckets of `leaves`, ordered by their first leaf: per (dtype, device) in flatten order,
/// the first bucket of each up to `first_bytes`, the others up to `bytes` (DDP's limits); a
/// leaf larger than a bucket gets its own; empty leaves get none. A bucket never mixes devices,
/// so each goes to one backend.
std::vector<Bucket> plan_buckets(const std::vector<at::Tensor>& leaves, std::int64_t first_bytes,
                                 std::int64_t bytes);

std::int64_t bucket_numel(const Bucket& items);
/// A bucket of one contiguous leaf is communicated as the leaf itself: nothing to copy.
bool is_one_leaf(const std::vector<at::Tensor>& leaves, const Bucket& items);
/// Copies the bucket's leaves into `buffer` (bucket_numel elements) in order: one call.
void pack(const std::vector<at::Tensor>& leaves, const Bucket& items, at::Tensor buffer);
/// Copies `buffer`'s pieces back, the piece of leaf i into dest[i] (dest is indexed like the
/// leaves; a leaf's piece has its shape).
void unpack(const at::Tensor& buffer, const Bucket& items, const std::vector<at::Tensor>& dest);

/// Whether all_reduce can reduce `t` by `op` on the backend of `device` (Gloo for CPU, NCCL
/// for CUDA): the backend's own dtypes; bool (as uint8, with NCCL's meaning: sum and max are
/// "any", product and min "all"); complex by sum (and avg) of its real and imaginary parts, as
/// torch.distributed.all_reduce does.
bool reducible(at::ScalarType t, ReduceOp op, c10::DeviceType device);
/// What a refusal says the backend of `device` reduces: "Gloo cannot reduce <t> by <op>
/// (it reduces ...)".
std::string irreducible_text(at::ScalarType t, ReduceOp op, c10::DeviceType device);

/// The tensor the backend gets for the 1-D contiguous `buffer` (a view, so results land in
/// `buffer`): the backend's dtypes as they are; for a reduction bool as uint8 and complex as its
/// real pairs; for data movement (broadcast, all_gather) any other dtype as its bytes.
at::Tensor wire(const at::Tensor& buffer, bool reduction);
/// The c10d reduction for a buffer of dtype `t`.
c10d::ReduceOp wire_op(ReduceOp op, at::ScalarType t);

/// The most bytes a rank receives, (world - 1) x the buffer's, for all_reduce to reduce a
/// buffer by direct exchange instead of the backend's collective (DESIGN.md §14): Gloo's
/// all_reduce between local ranks costs 0.5-2 ms from 64 B to 512 KiB, the exchange 0.1-0.5 ms;
/// from 1 MiB Gloo's pipelined ring is as fast or faster.
inline constexpr std::int64_t kExchangeMaxBytes = std::int64_t{512} << 10;
/// The Gloo tag of the exchange's sends and receives: above every tag next_tag() gives the
/// point-to-point calls, so they never pair with those.
inline constexpr int kExchangeTag = 0x74726565;  // "tree"
/// Whether all_reduce by `op` of the 1-D contiguous `buffer` on `world` ranks goes by direct
/// exchange: a non-empty CPU buffer of a Gloo dtype within kExchangeMaxBytes, by sum or avg,
/// or by min or max of an integer dtype (floats: NaN, where Gloo's min and max are not
/// at::minimum and at::maximum).
bool exchanges(const at::Tensor& buffer, ReduceOp op, int world);
/// Reduces every rank's copy of a buffer (`parts`, in rank order; parts[own] is this rank's
/// own buffer) by `op` (sum for avg) in rank order, ((p0 + p1) + p2) + ..., into parts[0]
/// (rank 0's own buffer, elsewhere the received copy), then copies the result into parts[own].
/// Every rank runs the same operations on the same operands, so all hold the same bits, NaNs
/// included (x86 keeps one operand's NaN: a + b and b + a can differ there).
void reduce_in_rank_order(const std::vector<at::Tensor>& parts, int own, ReduceOp op);

/// Why leaves that a collective writes cannot be written (empty when they can): a leaf with
/// elements that share memory (an expanded view), or two leaves that share memory (tied
/// weights: a per-leaf loop would reduce the shared memory twice, buckets would race).
std::string write_conflict(const std::vector<tree::Path>& paths,
                           const std::vector<at::Tensor>& leaves);

}  // namespace treetensor::distributed::detail
