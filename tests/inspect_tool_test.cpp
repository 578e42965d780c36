// treetensor-inspect end to end on files Python wrote: the tree layout with dtype, shape and
// bytes per tensor and totals, the JSON form, a clear error for a bad file, and hostile files
// (forged keys, a huge sparse file, overflowing sizes) written here by the test.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <string>

#include "pickle_bytes.hpp"
#include "run_command.hpp"
#include "treetensor/io/checkpoint.hpp"

namespace {

tt_test::CommandResult inspect(const std::string& args) {
  return tt_test::run_command(std::string(TREETENSOR_INSPECT_EXE) + " " + args + " 2>&1");
}

std::string fixture(const std::string& name) {
  return std::string(TREETENSOR_IO_FIXTURES) + "/" + name;
}

#define EXPECT_HAS(text, part) EXPECT_NE((text).find(part), std::string::npos) << (text)

}  // namespace

TEST(InspectTool, PrintsTheTreeWithDtypeShapeBytesAndTotals) {
  const auto [status, out] = inspect(fixture("checkpoint.pt"));
  ASSERT_EQ(status, 0) << out;
  EXPECT_HAS(out, "(torch.save, ");
  EXPECT_HAS(out, "├── blob --> bytes 4 bytes");
  EXPECT_HAS(out, "├── epoch --> int 7");
  EXPECT_HAS(out, "├── model --> <OrderedDict>\n│   ├── 'bn.bias' --> Tensor Float [3] 12 B");
  EXPECT_HAS(out, "│   ├── 'bn.num_batches_tracked' --> Tensor Long [] 8 B");
  EXPECT_HAS(out, "│   ├── 'conv.weight' --> Tensor Float [3, 2, 3, 3] 216 B");
  EXPECT_HAS(out, "├── optimizer --> <dict>");
  EXPECT_HAS(out, "│   │   └── 0 --> <dict>");
  EXPECT_HAS(out, "│   └── state --> <dict>");
  // The other leaves' count follows the torch that wrote the file (its Adam's param_groups
  // options): taken from the fixture's expectation, which that torch wrote too.
  std::ifstream expect(fixture("checkpoint.expect.json"));
  const auto leaves = nlohmann::json::parse(expect).at("leaves");
  const auto others = std::count_if(leaves.begin(), leaves.end(),
                                    [](const auto& l) { return l.at("type") != "Tensor"; });
  EXPECT_HAS(out, "total: 27 tensors, 280 elements, 1124 bytes of tensor data; " +
                      std::to_string(others) + " other leaves");
  EXPECT_EQ(out.find("tensor(["), std::string::npos) << "never the values";

  const auto [s2, st] = inspect(fixture("tensors.safetensors"));
  ASSERT_EQ(s2, 0) << st;
  EXPECT_HAS(st, "(safetensors, ");
  EXPECT_HAS(st, "├── encoder --> <dict>\n│   ├── b --> Tensor Long [3] 24 B");
  EXPECT_HAS(st, "metadata: author = fixtures.py\nmetadata: format = pt");
}

TEST(InspectTool, JsonForScripts) {
  const auto [status, out] = inspect("--json " + fixture("module_state.pt"));
  ASSERT_EQ(status, 0) << out;
  const auto j = nlohmann::json::parse(out);
  EXPECT_EQ(j.at("format"), "torch.save");
  EXPECT_EQ(j.at("tensors").size(), 9u);
  EXPECT_EQ(j.at("totals").at("tensors"), 9);
  EXPECT_EQ(j.at("containers")[0].at("kind"), "OrderedDict");
  bool found = false;
  for (const auto& t : j.at("tensors"))
    if (t.at("path") == nlohmann::json::array({"fc.weight"})) {
      found = true;
      EXPECT_EQ(t.at("shape"), nlohmann::json::array({2, 12}));
      EXPECT_EQ(t.at("bytes"), 96);
      EXPECT_EQ(t.at("dtype"), "Float");
    }
  EXPECT_TRUE(found) << out;
}

TEST(InspectTool, BadFilesGiveOneLineErrors) {
  const std::string path = std::string(TREETENSOR_IO_FIXTURES) + "/../inspect_bad.pt";
  std::ofstream(path) << "not a checkpoint";
  const auto [status, out] = inspect(path);
  EXPECT_EQ(status, 1);
  EXPECT_HAS(out, "treetensor-inspect: " + path +
                      ": at byte 0: neither a zip-format nor a legacy torch.save file");
  const auto [s2, missing] = inspect("/nonexistent/x.pt");
  EXPECT_EQ(s2, 1);
  EXPECT_HAS(missing, "/nonexistent/x.pt: cannot open: No such file or directory");
}

// Keys and strings come from the file: a key with a newline and tree glyphs must not forge a
// listing line, an ESC must not reach the terminal; --json keeps them exact.
TEST(InspectTool, EscapesControlCharactersOfKeysAndStrings) {
  namespace io = treetensor::io;
  const std::string path = std::string(TREETENSOR_IO_FIXTURES) + "/../inspect_hostile.pt";
  const std::string forged = "a\n└── forged --> Tensor Float [1] 4 B", red = "\x1b[31mred";
  io::Object o;
  treetensor::tree::Tree<io::Value>::Children children;
  children.emplace_back(forged, io::Value(at::zeros({2})));
  children.emplace_back("s", io::Value(red));
  children.emplace_back(red, io::Value(std::int64_t{1}));
  o.tree = treetensor::tree::Tree<io::Value>::from_children(std::move(children));
  io::save(path, o);
  const auto [status, out] = inspect(path);
  ASSERT_EQ(status, 0) << out;
  EXPECT_EQ(out.find('\x1b'), std::string::npos) << out;
  EXPECT_EQ(out.find("\n└── forged"), std::string::npos) << "a forged line";
  EXPECT_HAS(out, "├── a\\n└── forged --> Tensor Float [1] 4 B --> Tensor Float [2] 8 B");
  EXPECT_HAS(out, "s --> str '\\x1b[31mred'");
  EXPECT_HAS(out, "\\x1b[31mred --> int 1");
  const auto [js, text] = inspect("--json " + path);
  ASSERT_EQ(js, 0) << text;
  const auto j = nlohmann::json::parse(text);
  bool found = false;
  for (const auto& t : j["tensors"]) found = found || t["path"][0] == forged;
  EXPECT_TRUE(found) << text;
  std::remove(path.c_str());
}

// A 30 GiB sparse file: a clean error from the structure, not "cannot map" (a writable private
// mapping of it is commit-charged; a read-only one is not).
TEST(InspectTool, AHugeSparseFileGivesACleanError) {
  const std::string path = std::string(TREETENSOR_IO_FIXTURES) + "/../inspect_huge.pt";
  const int fd = ::open(path.c_str(), O_CREAT | O_WRONLY | O_TRUNC, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, std::int64_t{30} << 30), 0);
  ::close(fd);
  const auto [status, out] = inspect(path);
  EXPECT_EQ(status, 1);
  EXPECT_HAS(out, "at byte 0: neither a zip-format nor a legacy torch.save file");
  EXPECT_EQ(out.find("cannot map"), std::string::npos) << out;
  std::remove(path.c_str());
}

// A valid checkpoint larger than memory (a 30 GiB tensor, a hole): listed from its structure,
// the data never read or mapped (a writable private mapping of it is commit-charged).
TEST(InspectTool, AValidFileLargerThanMemoryIsListed) {
  constexpr std::int64_t numel = (std::int64_t{30} << 30) / 4;
  const std::string path = std::string(TREETENSOR_IO_FIXTURES) + "/../inspect_huge_valid.pt";
  const std::string head =
      pickle_bytes::legacy_head(pickle_bytes::tensor_pickle({numel}, {1}, 0, numel), numel);
  std::ofstream(path, std::ios::binary) << head;
  ASSERT_EQ(::truncate(path.c_str(), std::int64_t(head.size()) + numel * 4), 0);
  const auto [status, out] = inspect(path);
  EXPECT_EQ(status, 0) << out;
  EXPECT_HAS(out, "└── t --> Tensor Float [8053063680] 32212254720 B");
  EXPECT_HAS(out, "total: 1 tensors, 8053063680 elements, 32212254720 bytes of tensor data");
  std::remove(path.c_str());
}

// Sizes whose element or byte count overflows int64 (stride 0 keeps them inside the storage):
// an error naming the file and the tensor's path, not a bare c10::Error or "0 B".
TEST(InspectTool, AnOverflowingSizeIsAnErrorNamingThePath) {
  namespace io = treetensor::io;
  const std::string path = std::string(TREETENSOR_IO_FIXTURES) + "/../inspect_zero_stride.pt";
  at::Tensor big = at::zeros({1});
  big = big.as_strided({std::int64_t{1} << 62}, {0});  // 2^62 floats: 2^64 bytes
  io::save(path, treetensor::TreeTensor{{"w", big}});
  const auto [status, out] = inspect(path);
  EXPECT_EQ(status, 1) << out;
  EXPECT_HAS(out, "treetensor-inspect: " + path + ": at 'w': a tensor of 4611686018427387904");
  std::remove(path.c_str());
}
