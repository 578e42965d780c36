// treetensor-inspect end to end on files Python wrote: the tree layout with dtype, shape and
// bytes per tensor and totals, the JSON form, and a clear error for a bad file.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <string>

#include "run_command.hpp"

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
