// rethrow_with_context keeps the dynamic type and adds context (DESIGN.md §3).
#include "treetensor/runtime/errors.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <new>
#include <stdexcept>
#include <string>
#include <typeinfo>

namespace rt = treetensor::runtime;

namespace {

// Rethrows `original` with context and returns what was thrown.
std::exception_ptr rethrown(std::exception_ptr original,
                            const std::vector<std::string>& others = {}) {
  try {
    rt::rethrow_with_context(original, "matmul at leaf 'a.b'", others);
  } catch (...) {
    return std::current_exception();
  }
  ADD_FAILURE() << "rethrow_with_context returned";
  return nullptr;
}

template <class E>
void expect_std_type_kept() {
  auto out = rethrown(std::make_exception_ptr(E("boom")));
  try {
    std::rethrow_exception(out);
  } catch (const std::exception& err) {
    EXPECT_EQ(typeid(err), typeid(E));
    EXPECT_EQ(std::string(err.what()), "matmul at leaf 'a.b': boom");
  }
}

template <class E>
void expect_c10_type_kept() {
  const c10::Backtrace backtrace =
      std::make_shared<c10::PrecomputedLazyValue<std::string>>("the-backtrace");
  auto out = rethrown(std::make_exception_ptr(E("bad shape", backtrace, &typeid(E))));
  try {
    std::rethrow_exception(out);
  } catch (const c10::Error& err) {
    EXPECT_EQ(typeid(err), typeid(E));
    EXPECT_EQ(err.msg(), "matmul at leaf 'a.b': bad shape");
    EXPECT_EQ(err.backtrace()->get(), "the-backtrace");
    EXPECT_EQ(err.caller(), &typeid(E));
  }
}

struct UserError {
  int code;
};

}  // namespace

TEST(RuntimeErrors, StdTypesKeepTypeAndGainContext) {
  expect_std_type_kept<std::invalid_argument>();
  expect_std_type_kept<std::domain_error>();
  expect_std_type_kept<std::length_error>();
  expect_std_type_kept<std::out_of_range>();
  expect_std_type_kept<std::logic_error>();
  expect_std_type_kept<std::range_error>();
  expect_std_type_kept<std::overflow_error>();
  expect_std_type_kept<std::underflow_error>();
  expect_std_type_kept<std::runtime_error>();
}

TEST(RuntimeErrors, C10TypesKeepTypeBacktraceAndCaller) {
  expect_c10_type_kept<c10::Error>();
  expect_c10_type_kept<c10::IndexError>();
  expect_c10_type_kept<c10::ValueError>();
  expect_c10_type_kept<c10::TypeError>();
  expect_c10_type_kept<c10::NotImplementedError>();
  expect_c10_type_kept<c10::EnforceFiniteError>();
  expect_c10_type_kept<c10::LinAlgError>();
  expect_c10_type_kept<c10::OutOfMemoryError>();
}

TEST(RuntimeErrors, RealTorchErrorKeepsTorchMessage) {
  std::exception_ptr original;
  try {
    at::matmul(at::ones({2, 3}), at::ones({4, 5}));
  } catch (...) {
    original = std::current_exception();
  }
  ASSERT_TRUE(original);
  const std::string torch_msg = rt::message_of(original);
  try {
    std::rethrow_exception(rethrown(original));
  } catch (const c10::Error& err) {
    EXPECT_EQ(err.msg().rfind("matmul at leaf 'a.b': ", 0), 0u) << err.msg();
    EXPECT_NE(err.msg().find(torch_msg), std::string::npos) << err.msg();
    EXPECT_NE(std::string(err.what()).find("matmul at leaf 'a.b'"), std::string::npos);
  }
}

TEST(RuntimeErrors, OthersAreCountedAndJoined) {
  auto out = rethrown(std::make_exception_ptr(std::runtime_error("first")),
                      {"'c': second", "'d.e': third"});
  try {
    std::rethrow_exception(out);
  } catch (const std::runtime_error& err) {
    EXPECT_EQ(std::string(err.what()),
              "matmul at leaf 'a.b': first; 2 other failure(s): 'c': second; 'd.e': third");
  }
}

TEST(RuntimeErrors, OthersKeepTheirFirstLineOnly) {
  auto out = rethrown(std::make_exception_ptr(std::runtime_error("first\nsecond line")),
                      {"'c': short\ndispatcher dump\nmore", "'d': one line"});
  try {
    std::rethrow_exception(out);
  } catch (const std::runtime_error& err) {
    EXPECT_EQ(std::string(err.what()),
              "matmul at leaf 'a.b': first\nsecond line; 2 other failure(s): 'c': short; "
              "'d': one line");
  }
}

// A further failure with its own list (a failed tree call, listed by synchronize()) shows as a
// count, so the lists do not run into each other.
TEST(RuntimeErrors, OthersOwnListsAreFoldedIntoACount) {
  auto nested = rethrown(
      std::make_exception_ptr(std::runtime_error("first")),
      {"job 2: add at leaf 'a': bad; 3 other failure(s): 'b': bad; 'c': bad", "job 3: one; two"});
  try {
    std::rethrow_exception(nested);
  } catch (const std::runtime_error& err) {
    EXPECT_EQ(std::string(err.what()),
              "matmul at leaf 'a.b': first; 2 other failure(s): job 2: add at leaf 'a': bad (and "
              "3 other failure(s)); job 3: one; two");
  }
}

TEST(RuntimeErrors, BadAllocAndUnknownTypesPassUnchanged) {
  auto alloc = std::make_exception_ptr(std::bad_alloc());
  EXPECT_THROW(std::rethrow_exception(rethrown(alloc)), std::bad_alloc);

  try {
    std::rethrow_exception(rethrown(std::make_exception_ptr(UserError{42})));
  } catch (const UserError& err) {
    EXPECT_EQ(err.code, 42);
  }
  // A std::exception subclass that is not listed keeps its type (not sliced to runtime_error).
  auto sys = std::make_exception_ptr(std::system_error(std::make_error_code(std::errc::io_error)));
  try {
    std::rethrow_exception(rethrown(sys));
  } catch (const std::exception& err) {
    EXPECT_EQ(typeid(err), typeid(std::system_error));
  }
}

TEST(RuntimeErrors, NullIsAnError) {
  EXPECT_THROW(rt::rethrow_with_context(nullptr, "x"), std::invalid_argument);
  EXPECT_EQ(rt::message_of(nullptr), "no exception");
}
