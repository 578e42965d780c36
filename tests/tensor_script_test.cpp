// to_ivalue builds the most specific TorchScript type the tree allows, so a scripted function
// typed Dict[str, Tensor] or Dict[str, Dict[str, Tensor]] accepts the tree as it is.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/jit.h>

#include <string>

#include "treetensor/tensor/tensor.hpp"

namespace tt = treetensor;
using tt::TensorTree;
using tt::TreeTensor;

namespace {

// Functions with typed signatures, as a TorchScript model's forward would have.
const char* const kScript = R"(
def flat(x: Dict[str, Tensor]) -> Tensor:
    total = torch.zeros([1])
    for k in sorted(x.keys()):
        total = total + x[k].sum()
    return total

def nested(x: Dict[str, Dict[str, Tensor]]) -> Tensor:
    total = torch.zeros([1])
    for k in sorted(x.keys()):
        for j in sorted(x[k].keys()):
            total = total + x[k][j].sum() * 10.0
    return total

def mixed(x: Dict[str, Any]) -> int:
    return len(x)
)";

std::string type_of(const c10::IValue& v) {
  const auto dict = v.toGenericDict();
  return c10::DictType::create(dict.keyType(), dict.valueType())->annotation_str();
}

}  // namespace

TEST(TensorScript, TypedDictsReachTypedTorchScriptFunctions) {
  const auto unit = torch::jit::compile(kScript);
  const TreeTensor flat{{"a", at::ones({2})}, {"b", at::full({3}, 2.0f)}};
  EXPECT_EQ(type_of(tt::to_ivalue(flat)), "Dict[str, Tensor]");
  EXPECT_EQ(unit->run_method("flat", tt::to_ivalue(flat)).toTensor().item<float>(), 8.0f);

  const TreeTensor nested{{"enc", TensorTree{{"w", at::ones({2})}}},
                          {"dec", TensorTree{{"w", at::ones({1})}, {"b", at::ones({1})}}}};
  EXPECT_EQ(type_of(tt::to_ivalue(nested)), "Dict[str, Dict[str, Tensor]]");
  EXPECT_EQ(unit->run_method("nested", tt::to_ivalue(nested)).toTensor().item<float>(), 40.0f);

  // Tensors beside dicts: only Any describes the node; an Any-typed function accepts it, a
  // Tensor-typed one refuses it with TorchScript's own message.
  const TreeTensor mixed{{"a", at::ones({1})}, {"b", TensorTree{{"x", at::ones({1})}}}};
  EXPECT_EQ(type_of(tt::to_ivalue(mixed)), "Dict[str, Any]");
  EXPECT_EQ(unit->run_method("mixed", tt::to_ivalue(mixed)).toInt(), 2);
  EXPECT_THROW(unit->run_method("flat", tt::to_ivalue(mixed)), c10::Error);
  // Children that are dicts of different types: Any, one level up only.
  const TreeTensor uneven{{"p", TensorTree{{"x", at::ones({1})}}},
                          {"q", TensorTree{{"y", TensorTree{{"z", at::ones({1})}}}}}};
  EXPECT_EQ(type_of(tt::to_ivalue(uneven)), "Dict[str, Any]");
  EXPECT_EQ(type_of(tt::to_ivalue(uneven).toGenericDict().at("q")), "Dict[str, Dict[str, Tensor]]");
  // Empty nodes are Dict[str, Tensor], so they sit beside other tensor dicts.
  EXPECT_EQ(type_of(tt::to_ivalue(TreeTensor())), "Dict[str, Tensor]");
  const TreeTensor with_empty{{"e", TreeTensor()}, {"f", TensorTree{{"w", at::ones({1})}}}};
  EXPECT_EQ(type_of(tt::to_ivalue(with_empty)), "Dict[str, Dict[str, Tensor]]");
  // The round trip shares the tensors.
  const TreeTensor back = tt::from_ivalue(tt::to_ivalue(nested));
  EXPECT_TRUE(back.at("enc.w").leaf().is_same(nested.at("enc.w").leaf()));
}
