#pragma once
// Rethrowing an exception with context added while keeping its dynamic type (DESIGN.md §3, §10).
//
// A leaf's exception must reach the caller "with its original type plus the leaf path and op
// name" — a caller that catches c10::IndexError or std::out_of_range must still catch it after
// it has crossed a lane or an asyncs thread. C++ cannot clone an arbitrary exception with a new
// message, so the known standard and c10 types are rebuilt; anything else passes through as is.

#include <exception>
#include <string>
#include <string_view>
#include <vector>

namespace treetensor::runtime {

/// Rethrows `e` as an exception of the same dynamic type whose message is
/// "<context>: <original message>", followed — when `others` is not empty — by
/// "; N other failure(s): <others[0]>; <others[1]>; ..." (the first line of each, all of them;
/// an entry's own "; M other failure(s): ..." list folded to " (and M other failure(s))").
///
/// Rebuilt with the new message (the type is kept exactly):
///  - c10::Error and its subclasses IndexError, ValueError, TypeError, NotImplementedError,
///    EnforceFiniteError, LinAlgError, OutOfMemoryError (present in LibTorch 1.13 and 2.x). The
///    new message is built from `what_without_backtrace()`; the original backtrace and `caller()`
///    are kept.
///  - std::invalid_argument, domain_error, length_error, out_of_range, logic_error,
///    range_error, overflow_error, underflow_error, runtime_error.
///  The dynamic type must be exactly one of these (typeid match), so the type never changes.
///
/// Rethrown unchanged, without the context:
///  - std::bad_alloc (rebuilding it could itself fail to allocate; its message is fixed anyway);
///  - any other type, including user exception types, std::system_error and c10::Error
///    subclasses not listed (e.g. ones added after LibTorch 1.13), since their constructors are
///    unknown and rebuilding them as a base would change the type callers catch. Callers that need
///    the context for such types should derive them from std::runtime_error or c10::Error.
///
/// @param e        the exception to rethrow; must not be null.
/// @param context  text prepended to the message, e.g. "matmul at leaf 'a.b'".
/// @param others   short descriptions of further failures of the same call (each typically
///                 "'<label>': <message>"), appended after the main message.
/// @throws always: the rebuilt or original exception. std::invalid_argument when `e` is null.
/// Thread safety: safe to call concurrently; `e` may be shared between threads.
[[noreturn]] void rethrow_with_context(std::exception_ptr e, std::string_view context,
                                       const std::vector<std::string>& others = {});

/// The message text of `e` without c10's backtrace: c10::Error::what_without_backtrace(),
/// std::exception::what(), "unknown exception" for other types, "no exception" for null.
/// Thread safety: safe to call concurrently.
std::string message_of(const std::exception_ptr& e);

/// A leaf's failure: the leaf's label (its path, e.g. "a.b") and its exception.
struct LeafFailure {
  std::string label;
  std::exception_ptr error;
};

/// Rethrows the failures of one leaf-wise call as runtime::run reports them: the first
/// failure's exception, its type kept as rethrow_with_context keeps it, with the context
/// "<op> at leaf '<label>'", and every other failure listed as "'<label>': <message>".
/// @param failures in leaf order; must not be empty.
/// @throws always: as rethrow_with_context; std::invalid_argument when `failures` is empty.
[[noreturn]] void rethrow_leaf_failures(std::string_view op,
                                        const std::vector<LeafFailure>& failures);

}  // namespace treetensor::runtime
