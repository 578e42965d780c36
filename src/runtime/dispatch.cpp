// Placeholder linear executor until the lane runtime lands (issue 4 replaces this file).
#include "treetensor/runtime/dispatch.hpp"

#include "treetensor/runtime/errors.hpp"

#include <exception>
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
  if (errors.empty()) return;
  std::vector<std::string> others;
  for (std::size_t k = 1; k < errors.size(); ++k)
    others.push_back("'" + call.label(errors[k].first) + "': " + message_of(errors[k].second));
  rethrow_with_context(errors.front().second,
                       std::string(call.op) + " at leaf '" + call.label(errors.front().first) + "'",
                       others);
}

}  // namespace treetensor::runtime
