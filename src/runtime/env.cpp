#include "runtime/env.hpp"

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <string_view>

namespace treetensor::runtime::detail {

std::size_t parse_env_count(const char* name, const char* text, std::size_t fallback,
                            std::size_t min, std::size_t max) {
  if (text == nullptr || *text == '\0') return fallback;
  const std::string_view digits(text);
  // strtoull alone would accept signs ("-5" wraps around) and leading blanks.
  const auto is_digit = [](char c) { return c >= '0' && c <= '9'; };
  const bool decimal = digits.size() <= 19 && std::all_of(digits.begin(), digits.end(), is_digit);
  const unsigned long long v = decimal ? std::strtoull(text, nullptr, 10) : 0;
  if (!decimal || v < min || v > max)
    throw std::invalid_argument(std::string("treetensor: environment variable ") + name + "='" +
                                text + "' must be an integer in " + std::to_string(min) + ".." +
                                std::to_string(max));
  return static_cast<std::size_t>(v);
}

}  // namespace treetensor::runtime::detail
