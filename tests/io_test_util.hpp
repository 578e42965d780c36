#pragma once
// Helpers of the io tests: the fixture directory (written by tests/io/fixtures.py at test time),
// running that script, and comparing a loaded Object with a fixture's .expect.json.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <complex>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "run_command.hpp"
#include "treetensor/io/checkpoint.hpp"

namespace io_test {

namespace io = treetensor::io;
namespace tr = treetensor::tree;
using nlohmann::json;

inline std::string fixture(const std::string& name) {
  return std::string(TREETENSOR_IO_FIXTURES) + "/" + name;
}

inline json expectation(const std::string& name) {
  std::ifstream f(fixture(name + ".expect.json"));
  return json::parse(f);
}

/// Runs tests/io/fixtures.py with `args`; returns its exit status and output.
inline tt_test::CommandResult python(const std::string& args) {
  return tt_test::run_command(std::string(TREETENSOR_PYTHON) + " " + TREETENSOR_SOURCE_DIR +
                              "/tests/io/fixtures.py " + args + " 2>&1");
}

inline tr::Path path_of(const json& keys) {
  std::vector<std::string> k;
  for (const auto& key : keys) k.push_back(key.get<std::string>());
  return tr::Path(k);
}

inline std::string torch_name(at::ScalarType t) {
  std::string s = c10::toString(t);  // "Float" -> "float32" as Python prints it
  static const std::map<std::string, std::string> names = {{"Float", "float32"},
                                                           {"Double", "float64"},
                                                           {"Half", "float16"},
                                                           {"BFloat16", "bfloat16"},
                                                           {"Long", "int64"},
                                                           {"Int", "int32"},
                                                           {"Short", "int16"},
                                                           {"Char", "int8"},
                                                           {"Byte", "uint8"},
                                                           {"Bool", "bool"},
                                                           {"ComplexFloat", "complex64"},
                                                           {"ComplexDouble", "complex128"}};
  return names.at(s);
}

// A tensor's values in the expect form: doubles, bools, ints or [re, im] pairs.
inline json values_of(const at::Tensor& t) {
  json out = json::array();
  const at::Tensor flat = t.detach().contiguous().reshape({-1});
  if (t.is_complex()) {
    const at::Tensor d = flat.to(at::kComplexDouble);
    for (int64_t i = 0; i < d.numel(); ++i) {
      const auto z = d[i].item<c10::complex<double>>();
      out.push_back({z.real(), z.imag()});
    }
  } else if (t.scalar_type() == at::kBool) {
    for (int64_t i = 0; i < flat.numel(); ++i) out.push_back(flat[i].item<bool>());
  } else if (at::isFloatingType(t.scalar_type())) {
    const at::Tensor d = flat.to(at::kDouble);
    for (int64_t i = 0; i < d.numel(); ++i) out.push_back(d[i].item<double>());
  } else {
    const at::Tensor d = flat.to(at::kLong);
    for (int64_t i = 0; i < d.numel(); ++i) out.push_back(d[i].item<int64_t>());
  }
  return out;
}

/// The keys of the dict at `path` in the order save() writes them: key_order's, else sorted.
inline std::vector<std::string> file_order(const io::Object& o, const tr::Path& path) {
  if (auto it = o.key_order.find(path); it != o.key_order.end()) return it->second;
  std::vector<std::string> keys;
  const auto* node = o.tree.find(path);
  if (node && !node->is_leaf())
    for (const auto& [key, child] : node->children()) keys.push_back(key);
  return keys;
}

/// Every leaf, container kind and int key of `expect` is in `got`, with the same values, and
/// every dict's keys in the file's order.
inline void expect_matches(const io::Object& got, const json& expect) {
  std::size_t leaves = 0;
  for (const auto& e : expect.at("leaves")) {
    const tr::Path path = path_of(e.at("path"));
    SCOPED_TRACE("leaf " + path.describe());
    const auto* node = got.tree.find(path);
    ASSERT_NE(node, nullptr);
    ASSERT_TRUE(node->is_leaf());
    ++leaves;
    const io::Value& v = node->leaf();
    const std::string type = e.at("type");
    ASSERT_EQ(io::value_type_name(v), type);
    if (type == "Tensor") {
      const auto& t = std::get<at::Tensor>(v);
      EXPECT_EQ(torch_name(t.scalar_type()), e.at("dtype").get<std::string>());
      EXPECT_EQ(json(t.sizes().vec()), e.at("shape"));
      EXPECT_EQ(values_of(t), e.at("values"));
      EXPECT_EQ(t.requires_grad(), e.at("requires_grad").get<bool>());
      EXPECT_EQ(got.parameters.count(path) > 0, e.at("parameter").get<bool>());
    } else if (type == "int") {
      EXPECT_EQ(std::get<std::int64_t>(v), e.at("value").get<std::int64_t>());
    } else if (type == "float") {
      EXPECT_EQ(std::get<double>(v), e.at("value").get<double>());
    } else if (type == "bool") {
      EXPECT_EQ(std::get<bool>(v), e.at("value").get<bool>());
    } else if (type == "str") {
      EXPECT_EQ(std::get<std::string>(v), e.at("value").get<std::string>());
    } else if (type == "bytes") {
      std::string want;
      for (const auto& b : e.at("value")) want += static_cast<char>(b.get<int>());
      EXPECT_EQ(std::get<io::Bytes>(v).data, want);
    } else if (type == "complex") {
      EXPECT_EQ(
          std::get<std::complex<double>>(v),
          std::complex<double>(e.at("value")[0].get<double>(), e.at("value")[1].get<double>()));
    } else if (type == "torch.dtype") {
      EXPECT_EQ(torch_name(std::get<at::ScalarType>(v)), e.at("value").get<std::string>());
    } else if (type == "torch.device") {
      EXPECT_EQ(std::get<at::Device>(v).str(), e.at("value").get<std::string>());
    }
  }
  EXPECT_EQ(got.tree.leaf_count(), leaves) << "no leaves beyond the expected ones";
  for (const auto& c : expect.at("containers")) {
    const tr::Path path = path_of(c.at("path"));
    EXPECT_EQ(io::container_name(got.kind(path)), c.at("kind").get<std::string>())
        << path.describe();
    if (c.contains("keys")) {
      EXPECT_EQ(json(file_order(got, path)), c.at("keys")) << "key order at " << path.describe();
    }
  }
  std::set<tr::Path> int_keys;
  for (const auto& k : expect.at("int_keys")) int_keys.insert(path_of(k));
  EXPECT_EQ(got.int_keys, int_keys);
}

/// A fresh directory for files a test writes.
inline std::filesystem::path scratch(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() /
             ("treetensor_io_" + std::to_string(getpid()) + "_" + name);
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace io_test
