#pragma once
// Environment variables of the runtime and the layers above it (README "Environment
// variables"): parsed strictly, a bad value an error naming the variable and its range.

#include <cstddef>

namespace treetensor::runtime::detail {

/// Parses `text`, the value of environment variable `name` (null when unset), as a decimal
/// count in min..max; `fallback` when unset or empty.
/// @throws std::invalid_argument naming `name`, its value and the valid range.
std::size_t parse_env_count(const char* name, const char* text, std::size_t fallback,
                            std::size_t min, std::size_t max);

}  // namespace treetensor::runtime::detail
