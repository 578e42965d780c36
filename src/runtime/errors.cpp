#include "treetensor/runtime/errors.hpp"

#include <c10/util/Exception.h>

#include <new>
#include <stdexcept>
#include <typeinfo>

namespace treetensor::runtime {
namespace {

constexpr std::string_view kOthers = " other failure(s)";

// One further failure as a list entry: its first line (a torch error's later lines, dispatcher
// dumps and backtraces, would bury the list; the first failure keeps its whole message), and
// its own list of failures, if it has one (a failed tree call reported by synchronize()),
// folded into a count so that the lists do not run into each other.
std::string entry(std::string_view other) {
  other = other.substr(0, other.find('\n'));
  const std::size_t list = other.find(std::string(kOthers) + ": ");
  if (list == std::string_view::npos) return std::string(other);
  const std::size_t count = other.rfind("; ", list);
  if (count == std::string_view::npos) return std::string(other);
  const std::string_view n = other.substr(count + 2, list - count - 2);
  return std::string(other.substr(0, count)) + " (and " + std::string(n) + std::string(kOthers) +
         ")";
}

std::string with_context(std::string_view context, std::string_view message,
                         const std::vector<std::string>& others) {
  std::string text;
  text.reserve(context.size() + message.size() + 2);
  text.append(context).append(": ").append(message);
  if (others.empty()) return text;
  text += "; " + std::to_string(others.size()) + std::string(kOthers) + ": ";
  for (std::size_t i = 0; i < others.size(); ++i) text += (i > 0 ? "; " : "") + entry(others[i]);
  return text;
}

// Throws a copy of `err` with message `text` when its dynamic type is exactly E.
template <class E>
void rebuild_c10_if(const c10::Error& err, const std::string& text) {
  if (typeid(err) == typeid(E)) throw E(text, err.backtrace(), err.caller());
}

template <class E>
void rebuild_std_if(const std::exception& err, const std::string& text) {
  if (typeid(err) == typeid(E)) throw E(text);
}

[[noreturn]] void rethrow_c10(const c10::Error& err, const std::exception_ptr& e,
                              std::string_view context, const std::vector<std::string>& others) {
  const std::string text = with_context(context, err.what_without_backtrace(), others);
  rebuild_c10_if<c10::Error>(err, text);
  rebuild_c10_if<c10::IndexError>(err, text);
  rebuild_c10_if<c10::ValueError>(err, text);
  rebuild_c10_if<c10::TypeError>(err, text);
  rebuild_c10_if<c10::NotImplementedError>(err, text);
  rebuild_c10_if<c10::EnforceFiniteError>(err, text);
  rebuild_c10_if<c10::LinAlgError>(err, text);
  rebuild_c10_if<c10::OutOfMemoryError>(err, text);
  std::rethrow_exception(e);
}

[[noreturn]] void rethrow_std(const std::exception& err, const std::exception_ptr& e,
                              std::string_view context, const std::vector<std::string>& others) {
  const std::string text = with_context(context, err.what(), others);
  rebuild_std_if<std::invalid_argument>(err, text);
  rebuild_std_if<std::domain_error>(err, text);
  rebuild_std_if<std::length_error>(err, text);
  rebuild_std_if<std::out_of_range>(err, text);
  rebuild_std_if<std::logic_error>(err, text);
  rebuild_std_if<std::range_error>(err, text);
  rebuild_std_if<std::overflow_error>(err, text);
  rebuild_std_if<std::underflow_error>(err, text);
  rebuild_std_if<std::runtime_error>(err, text);
  std::rethrow_exception(e);
}

}  // namespace

void rethrow_with_context(std::exception_ptr e, std::string_view context,
                          const std::vector<std::string>& others) {
  if (!e) throw std::invalid_argument("rethrow_with_context: null exception_ptr");
  try {
    std::rethrow_exception(e);
  } catch (const std::bad_alloc&) {
    throw;
  } catch (const c10::Error& err) {
    rethrow_c10(err, e, context, others);
  } catch (const std::exception& err) {
    rethrow_std(err, e, context, others);
  }
  // Unknown non-std types propagate from the try block unchanged.
}

void rethrow_leaf_failures(std::string_view op, const std::vector<LeafFailure>& failures) {
  if (failures.empty()) throw std::invalid_argument("rethrow_leaf_failures: no failure");
  std::vector<std::string> others;
  others.reserve(failures.size() - 1);
  for (std::size_t k = 1; k < failures.size(); ++k)
    others.push_back("'" + failures[k].label + "': " + message_of(failures[k].error));
  rethrow_with_context(failures.front().error,
                       std::string(op) + " at leaf '" + failures.front().label + "'", others);
}

std::string message_of(const std::exception_ptr& e) {
  if (!e) return "no exception";
  try {
    std::rethrow_exception(e);
  } catch (const c10::Error& err) {
    return err.what_without_backtrace();
  } catch (const std::exception& err) {
    return err.what();
  } catch (...) {
    return "unknown exception";
  }
}

}  // namespace treetensor::runtime
