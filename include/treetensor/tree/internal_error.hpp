#pragma once
// The second error channel (DESIGN.md §3; c10's TORCH_CHECK vs TORCH_INTERNAL_ASSERT). User
// errors are typed exceptions that name the tree path (tree::StructureError, the leaf errors
// rethrown by runtime::run, std::invalid_argument for a bad argument). A failed internal
// invariant is not the caller's mistake: it throws InternalError, carrying file:line and
// asking for a bug report. It lives in the tree layer, the bottom one, so every layer can use
// it; standard library only.

#include <stdexcept>
#include <string>

namespace treetensor {

/// An internal invariant of treetensor failed: a bug in treetensor, never a usage error.
/// what(): "<file>:<line>: internal invariant '<condition>' failed[: <detail>]; this is a bug
/// in treetensor, please report it with this message".
class InternalError : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

namespace detail {
[[noreturn]] inline void internal_assert_failed(const char* file, int line, const char* condition,
                                                const std::string& detail) {
  throw InternalError(std::string(file) + ":" + std::to_string(line) + ": internal invariant '" +
                      condition + "' failed" + (detail.empty() ? "" : ": " + detail) +
                      "; this is a bug in treetensor, please report it with this message");
}
}  // namespace detail

}  // namespace treetensor

/// Throws treetensor::InternalError when `condition` is false; the optional second argument
/// (anything a std::string can be built from) says what was expected. For invariants only:
/// errors a caller can cause get a typed user error instead.
#define TREETENSOR_INTERNAL_ASSERT(condition, ...)                                 \
  do {                                                                             \
    if (!(condition)) [[unlikely]]                                                 \
      ::treetensor::detail::internal_assert_failed(__FILE__, __LINE__, #condition, \
                                                   std::string(__VA_ARGS__));      \
  } while (false)
