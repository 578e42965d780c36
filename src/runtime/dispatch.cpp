// Placeholder linear executor until the lane runtime lands (issue 4 replaces this file).
#include "treetensor/runtime/dispatch.hpp"

#include <exception>
#include <stdexcept>
#include <vector>

namespace treetensor::runtime {

void run(const LeafCall& call) {
  std::vector<std::pair<std::size_t, std::exception_ptr>> errors;
  for (std::size_t i = 0; i < call.leaves; ++i) {
    try {
      call.run(i);
    } catch (...) {
      errors.emplace_back(i, std::current_exception());
    }
  }
  if (!errors.empty()) std::rethrow_exception(errors.front().second);
}

}  // namespace treetensor::runtime
