// Operand tracking (OneFlow's const/mutable operand rule); see operands.hpp for the contract.
#include "treetensor/asyncs/operands.hpp"

#include "asyncs/internal.hpp"
#include "treetensor/tree/internal_error.hpp"

#include <algorithm>
#include <limits>

namespace treetensor::asyncs {
namespace detail {

std::atomic<std::size_t> tracked_jobs{0};

namespace {

// Storage identity: views share it (see operands.hpp for why not the data pointer).
const void* key_of(const at::Tensor& t) {
  if (t.has_storage()) return t.storage().unsafeGetStorageImpl();
  return t.unsafeGetTensorImpl();
}

void add_keys(c10::ArrayRef<at::Tensor> tensors, bool write, std::vector<OperandKey>& keys,
              std::vector<at::Tensor>* keep) {
  for (const auto& t : tensors) {
    if (!t.defined()) continue;
    keys.push_back({key_of(t), write});
    if (keep != nullptr) keep->push_back(t);
  }
}

// Whether the caller must wait for `job`: see await_operands' contract in operands.hpp.
bool must_wait_for(const JobState& job, const Acting& self) {
  if (job.done.load(std::memory_order_relaxed)) return false;
  if (self.worker == nullptr) return true;
  if (job.thread == self.worker->id) return false;
  return job.seq < self.seq || job.submitter == self.seq;
}

}  // namespace

std::vector<OperandKey> operand_keys(c10::ArrayRef<at::Tensor> reads,
                                     c10::ArrayRef<at::Tensor> writes,
                                     std::vector<at::Tensor>* keep) {
  std::vector<OperandKey> keys;
  keys.reserve(reads.size() + writes.size());
  if (keep != nullptr) keep->reserve(keep->size() + reads.size() + writes.size());
  add_keys(reads, false, keys, keep);
  add_keys(writes, true, keys, keep);
  // Sort by key with writes first, keep the first of each key: a write wins over a read.
  std::sort(keys.begin(), keys.end(), [](const OperandKey& a, const OperandKey& b) {
    return a.key != b.key ? std::less<const void*>()(a.key, b.key) : a.write > b.write;
  });
  keys.erase(std::unique(keys.begin(), keys.end(),
                         [](const OperandKey& a, const OperandKey& b) { return a.key == b.key; }),
             keys.end());
  return keys;
}

namespace {

// Counts `state` among the tracked jobs once (caller holds AsyncsState::mu).
void count_tracked(JobState& state) {
  if (state.tracked) return;
  state.tracked = true;
  tracked_jobs.fetch_add(1, std::memory_order_relaxed);
}

// Removes one registration of `state` under `key` (caller holds AsyncsState::mu).
void remove_use(AsyncsState& rt, const void* key, const JobState* state) {
  auto it = rt.uses.find(key);
  TREETENSOR_INTERNAL_ASSERT(it != rt.uses.end(), "a finished job's operand is registered");
  auto& list = it->second;
  list.erase(std::find_if(list.begin(), list.end(), [&](const Use& u) { return u.job == state; }));
  if (list.empty()) rt.uses.erase(it);
}

}  // namespace

void register_operands(AsyncsState& rt, const Job& job) {
  if (job.keys.empty()) return;
  for (const auto& k : job.keys) rt.uses[k.key].push_back({job.state.get(), k.write});
  count_tracked(*job.state);
}

void add_operands(const std::shared_ptr<JobState>& state, c10::ArrayRef<at::Tensor> reads,
                  c10::ArrayRef<at::Tensor> writes) {
  std::vector<at::Tensor> keep;
  const std::vector<OperandKey> keys = operand_keys(reads, writes, &keep);
  if (keys.empty()) return;
  AsyncsState& rt = asyncs_state();
  std::lock_guard lock(rt.mu);
  if (state->done.load(std::memory_order_relaxed)) return;  // finished: nothing to order
  for (const auto& k : keys) {
    rt.uses[k.key].push_back({state.get(), k.write});
    state->late_keys.emplace_back(k.key, k.write);
  }
  state->late_operands.insert(state->late_operands.end(), std::make_move_iterator(keep.begin()),
                              std::make_move_iterator(keep.end()));
  count_tracked(*state);
}

void await_keys(const std::vector<OperandKey>& keys, const Acting& self, const JobState* job) {
  if (keys.empty()) return;
  AsyncsState& rt = asyncs_state();
  std::unique_lock lock(rt.mu);
  // The conflicting jobs pending now; work submitted later is not waited for.
  std::vector<std::shared_ptr<JobState>> awaited;
  for (const auto& k : keys) {
    const auto it = rt.uses.find(k.key);
    if (it == rt.uses.end()) continue;
    for (const auto& use : it->second)
      if ((use.write || k.write) && must_wait_for(*use.job, self) &&
          (awaited.empty() || awaited.back().get() != use.job))
        awaited.push_back(use.job->shared_from_this());  // held past the lock
  }
  if (awaited.empty()) return;
  wait_progress(
      lock,
      [&] {
        return std::all_of(awaited.begin(), awaited.end(),
                           [](const auto& j) { return j->done.load(std::memory_order_relaxed); });
      },
      job == nullptr ? std::string("await_operands") : "operands of " + job_context(*job));
  lock.unlock();
  for (const auto& j : awaited) block_current(j->finished);
}

void unregister_operands(AsyncsState& rt, const Job& job) {
  JobState& state = *job.state;
  for (const auto& k : job.keys) remove_use(rt, k.key, &state);
  for (const auto& [key, write] : state.late_keys) remove_use(rt, key, &state);
  state.late_keys.clear();
  if (!state.tracked) return;
  state.tracked = false;
  tracked_jobs.fetch_sub(1, std::memory_order_relaxed);
}

}  // namespace detail

void await_operands(c10::ArrayRef<at::Tensor> reads, c10::ArrayRef<at::Tensor> writes) {
  detail::await_keys(detail::operand_keys(reads, writes, nullptr), detail::acting(), nullptr);
}

}  // namespace treetensor::asyncs
