// Checkpoint files both ways (DESIGN.md §11): C++ loads what Python's torch.save wrote (zip and
// legacy formats, every dtype, views, Parameters, optimizer state with int keys, Python
// scalars) and checks values; Python's torch.load reads what C++ wrote and checks values.
// Fixtures are written at test time by tests/io/fixtures.py (ctest fixture io_fixtures).
#include <sys/wait.h>
#include <unistd.h>

#include "io_test_util.hpp"
#include "treetensor/io/adam_state.hpp"
#include "treetensor/io/safetensors.hpp"
#include "treetensor/tensor/tensor.hpp"

using namespace io_test;
namespace tt = treetensor;

namespace {
const char* const kFixtures[] = {"module_state", "adam_state", "checkpoint",   "views",
                                 "dtypes",       "params",     "plain_tensor", "legacy",
                                 "tied",         "adam_named"};
}  // namespace

TEST(IoCheckpoint, LoadsWhatPythonWrote) {
  for (const char* name : kFixtures) {
    SCOPED_TRACE(name);
    expect_matches(io::load(fixture(std::string(name) + ".pt")), expectation(name));
  }
}

TEST(IoCheckpoint, ViewsShareOneStorageAndTheFileIsNeverWritten) {
  const io::Object views = io::load(fixture("views.pt"));
  auto tensor = [&](const char* key) {
    return std::get<at::Tensor>(views.tree.at(tr::Path{key}).leaf());
  };
  const at::Tensor base = tensor("base"), rows = tensor("rows"), t = tensor("t"),
                   col = tensor("col");
  for (const auto& v : {rows, t, col}) EXPECT_TRUE(v.storage().is_alias_of(base.storage()));
  EXPECT_EQ(rows.storage_offset(), 6);
  EXPECT_EQ(t.strides(), (std::vector<int64_t>{1, 6}));
  rows.fill_(-1);  // written through a view: the base sees it, the file does not
  EXPECT_EQ(base[1][0].item<float>(), -1.0f);
  expect_matches(io::load(fixture("views.pt")), expectation("views"));
}

// Trees iterate sorted (DESIGN.md §1); the file's order stays in key_order, and save() writes
// it back (PythonLoadsWhatCppWrote checks the order torch.load sees).
TEST(IoCheckpoint, KeepsTheFileKeyOrder) {
  const io::Object module = io::load(fixture("module_state.pt"));
  const std::vector<std::string> order = module.key_order.at({});
  ASSERT_EQ(order.size(), 9u);
  EXPECT_EQ(order[0], "conv.weight");
  EXPECT_EQ(order[2], "bn.weight");
  EXPECT_EQ(order[8], "fc.bias");
  const io::Object adam = io::load(fixture("adam_named.pt"));
  const std::vector<std::string> ids = adam.key_order.at(tr::Path{"state"});
  ASSERT_EQ(ids.size(), 12u);
  for (std::size_t k = 0; k < ids.size(); ++k) EXPECT_EQ(ids[k], std::to_string(k));
  EXPECT_EQ(adam.key_order.count(tr::Path{"state", "0"}), 1u) << "step, exp_avg, exp_avg_sq";
  // A sorted dict needs no entry; keys added after loading are written after the listed ones.
  EXPECT_EQ(io::load(fixture("checkpoint.pt")).key_order.count(tr::Path{"metrics", "best"}), 0u);
  io::Object grown = module;
  grown.tree.insert(tr::Path{"aaa"}, io::Value(at::ones({1})));
  grown.tree.erase(tr::Path{"bn.bias"});
  const auto dir = scratch("order");
  const std::string out = (dir / "grown.pt").string();
  io::save(out, grown);
  std::vector<std::string> want = order;
  want.erase(std::find(want.begin(), want.end(), "bn.bias"));
  want.push_back("aaa");
  EXPECT_EQ(file_order(io::load(out), {}), want);
  std::filesystem::remove_all(dir);
}

// Tied weights: one tensor at two paths (a memo reference) loads as two views of one storage.
TEST(IoCheckpoint, SharedTensorsLoadAtEveryPath) {
  const io::Object tied = io::load(fixture("tied.pt"));
  const auto& enc = std::get<at::Tensor>(tied.tree.at(tr::Path{"encoder.weight"}).leaf());
  const auto& dec = std::get<at::Tensor>(tied.tree.at(tr::Path{"decoder.weight"}).leaf());
  EXPECT_TRUE(enc.storage().is_alias_of(dec.storage()));
  EXPECT_TRUE(enc.equal(at::arange(24, at::kFloat).reshape({4, 6})));
}

TEST(IoCheckpoint, TensorsAndStateDictForms) {
  const tt::TreeTensor flat = io::load_tensors(fixture("module_state.pt"));
  EXPECT_TRUE(flat.contains(tr::Path{"conv.weight"})) << "keys as written";
  const tt::TreeTensor nested = io::load_state_dict(fixture("module_state.pt"));
  EXPECT_EQ(nested.at("bn.num_batches_tracked").leaf().item<int64_t>(), 1);
  EXPECT_EQ(nested.at("conv.weight").leaf().sizes(), (std::vector<int64_t>{3, 2, 3, 3}));
  EXPECT_EQ(nested.leaf_count(), 9u);
  // A checkpoint's tensors: non-tensor leaves are left out.
  const tt::TreeTensor ckpt = io::load_tensors(fixture("checkpoint.pt"));
  EXPECT_TRUE(ckpt.contains(tr::Path{"optimizer", "state", "0", "exp_avg"}));
  EXPECT_FALSE(ckpt.contains(tr::Path{"epoch"}));
  const tt::TreeTensor moved =
      io::load_tensors(fixture("plain_tensor.pt"), io::LoadOptions().device(at::kCPU));
  EXPECT_TRUE(moved.leaf().equal(at::arange(5)));
}

TEST(IoCheckpoint, PythonLoadsWhatCppWrote) {
  const auto dir = scratch("roundtrip");
  for (const char* name : kFixtures) {
    SCOPED_TRACE(name);
    const std::string out = (dir / (std::string(name) + ".pt")).string();
    io::save(out, io::load(fixture(std::string(name) + ".pt")));
    const auto [status, text] =
        python("check " + out + " " + fixture(std::string(name) + ".expect.json"));
    EXPECT_EQ(status, 0) << text;
    // And back: what C++ wrote, C++ reads as Python wrote it.
    expect_matches(io::load(out), expectation(name));
  }
  std::filesystem::remove_all(dir);
}

TEST(IoCheckpoint, SavedViewsKeepOneStorage) {
  const auto dir = scratch("views");
  const at::Tensor base = at::arange(100'000, at::kFloat).reshape({1000, 100});
  const tt::TreeTensor t{{"base", base}, {"t", base.t()}, {"row", base[2]}};
  const std::string out = (dir / "views.pt").string();
  io::save(out, t);
  const tt::TreeTensor back = io::load_tensors(out);
  EXPECT_TRUE(back.at("t").leaf().storage().is_alias_of(back.at("base").leaf().storage()));
  EXPECT_TRUE(back.at("row").leaf().equal(base[2]));
  EXPECT_LT(std::filesystem::file_size(out), 400'000u + 4096) << "the storage is written once";
  std::filesystem::remove_all(dir);
}

TEST(IoCheckpoint, StateDictSavedFromATreeLoadsIntoTheModule) {
  const auto dir = scratch("module");
  const std::string out = (dir / "state.pt").string();
  io::save_state_dict(out, io::load_state_dict(fixture("module_state.pt")));
  const auto [status, text] = python("check-module " + out);
  EXPECT_EQ(status, 0) << text;
  EXPECT_THROW(io::save_state_dict(out, tt::TreeTensor{{"a.b", at::ones({1})}}),
               std::invalid_argument);
  std::filesystem::remove_all(dir);
}

TEST(IoSafetensors, LoadsTheFormatAndWritesItBack) {
  const io::SafetensorsFile f = io::load_safetensors(fixture("tensors.safetensors"));
  EXPECT_EQ(f.metadata,
            (std::map<std::string, std::string>{{"author", "fixtures.py"}, {"format", "pt"}}));
  // The expectation lists flat names; the tree holds them as paths.
  io::Object as_object;
  tr::Tree<io::Value>::Children children;
  for (const auto& [key, tensor] : tt::to_state_dict(f.tensors))
    children.emplace_back(key, io::Value(tensor));
  as_object.tree = tr::Tree<io::Value>::from_children(std::move(children));
  json expect = expectation("tensors");
  expect["containers"] = json::array();
  expect_matches(as_object, expect);
  EXPECT_EQ(f.tensors.at("encoder.w").leaf().sizes(), (std::vector<int64_t>{3, 4}));

  const auto dir = scratch("safetensors");
  const std::string out = (dir / "out.safetensors").string();
  io::save_safetensors(out, f.tensors, f.metadata);
  const auto [status, text] =
      python("check-safetensors " + out + " " + fixture("tensors.expect.json"));
  EXPECT_EQ(status, 0) << text;
  const io::SafetensorsFile again = io::load_safetensors(out);
  EXPECT_TRUE(tt::equal(again.tensors, f.tensors));
  EXPECT_EQ(again.metadata, f.metadata);
  std::filesystem::remove_all(dir);
}

// Found by the break-it pass: saving over the file a tree views used to truncate the mapping
// under it (SIGBUS) and leave an empty file.
TEST(IoCheckpoint, SavingOverTheLoadedFileIsSafe) {
  const auto dir = scratch("overwrite");
  const std::string file = (dir / "views.pt").string();
  std::filesystem::copy_file(fixture("views.pt"), file);
  const io::Object o = io::load(file);
  io::save(file, o);
  expect_matches(o, expectation("views"));               // the loaded tree still reads its values
  expect_matches(io::load(file), expectation("views"));  // and the file holds them
  const std::string st = (dir / "t.safetensors").string();
  std::filesystem::copy_file(fixture("tensors.safetensors"), st);
  const auto f = io::load_safetensors(st);
  io::save_safetensors(st, f.tensors, f.metadata);
  EXPECT_TRUE(tt::equal(io::load_safetensors(st).tensors, f.tensors));
  std::filesystem::remove_all(dir);
}

// Found by review: a negative view's storage holds the values before the view (safetensors has
// no complex dtypes, so no conjugate view reaches it).
TEST(IoSafetensors, NegativeViewsAreWrittenWithTheirValues) {
  const auto dir = scratch("view-bits");
  const std::string st = (dir / "v.safetensors").string();
  const at::Tensor base = at::arange(1, 4, at::kFloat);
  io::save_safetensors(st, tt::TreeTensor{{"n", at::_neg_view(base)}});
  const io::SafetensorsFile f = io::load_safetensors(st);
  EXPECT_TRUE(at::equal(std::as_const(f.tensors).at("n").leaf(), -base));
  std::filesystem::remove_all(dir);
}

TEST(IoCheckpoint, OneStorageAsTwoDtypesIsRefusedOnSave) {
  const auto dir = scratch("dtypes");
  const at::Tensor x = at::arange(4, at::kFloat);
  try {
    io::save((dir / "x.pt").string(), tt::TreeTensor{{"x", x}, {"y", x.view(at::kInt)}});
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "'x' (Float) and 'y' (Int) view the same data as different dtypes"),
              std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(std::filesystem::exists(dir / "x.pt")) << "nothing half-written";
  std::filesystem::remove_all(dir);
}

// Continuing a PyTorch Adam in C++ by parameter names: from the file's param_names, one step,
// back to a state dict that PyTorch's next step matches (ids in order).
TEST(IoAdamState, ContinuesAPyTorchOptimizerByName) {
  const io::Object file = io::load(fixture("adam_named.pt"));
  io::AdamState s = io::adam_state_from(file);
  ASSERT_EQ(s.names.size(), 12u);
  EXPECT_EQ(s.names[2], "1.weight");
  EXPECT_EQ(s.names[11], "5.bias");
  EXPECT_EQ(s.step, 1);
  EXPECT_DOUBLE_EQ(s.options.lr(), 1e-2);
  EXPECT_DOUBLE_EQ(s.options.beta1(), 0.8);
  EXPECT_DOUBLE_EQ(s.options.beta2(), 0.99);
  EXPECT_DOUBLE_EQ(s.options.weight_decay(), 0.01);
  EXPECT_TRUE(
      s.exp_avg.at(tr::Path{"5", "bias"})
          .leaf()
          .equal(std::get<at::Tensor>(file.tree.at(tr::Path{"state", "11", "exp_avg"}).leaf())))
      << "id 11 is '5.bias', not the 11th key in sorted order";
  tt::TreeTensor params = tt::zeros_like(s.exp_avg);
  const tt::TreeTensor grads = tt::ones_like(s.exp_avg);
  tt::adam_step(params, grads, s.exp_avg, s.exp_avg_sq, ++s.step, s.options);
  const auto dir = scratch("adam");
  const std::string out = (dir / "adam.pt").string();
  io::save(out, io::adam_state_dict(s, file));
  const auto [status, text] = python("check-adam " + fixture("adam_named.pt") + " " + out);
  EXPECT_EQ(status, 0) << text;
  std::filesystem::remove_all(dir);
}

TEST(IoAdamState, NamesComeFromTheFileOrTheCallerNeverAGuess) {
  const io::Object file = io::load(fixture("adam_state.pt"));  // model.parameters(): no names
  auto message = [&](const std::vector<std::string>& names) -> std::string {
    try {
      io::adam_state_from(file, names);
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(message({}).find("the file has no param_names: pass the parameters' names in id "
                             "order"),
            std::string::npos)
      << message({});
  EXPECT_NE(message({"conv.weight"}).find("1 names for the groups' 6 parameters"),
            std::string::npos);
  const std::vector<std::string> names = {"conv.weight", "conv.bias", "bn.weight",
                                          "bn.bias",     "fc.weight", "fc.bias"};
  const io::AdamState s = io::adam_state_from(file, names);
  EXPECT_EQ(s.exp_avg.at(tr::Path{"fc", "weight"}).leaf().sizes(), (std::vector<int64_t>{2, 12}));
  EXPECT_NE(message({"a", "b"}).find("2 names"), std::string::npos);
  EXPECT_NE(io::adam_state_dict(s).key_order.at(tr::Path{"state"}).size(), 0u);
  const io::Object named = io::load(fixture("adam_named.pt"));
  EXPECT_THROW(io::adam_state_from(named, std::vector<std::string>(12, "x")), std::invalid_argument)
      << "names that disagree with the file's param_names";
}

namespace {
// The tensors of the dict at `at` of `o`, in file order (a state dict: dotted keys → paths).
tt::TreeTensor state_dict_at(const io::Object& o, const tr::Path& at) {
  std::vector<std::pair<std::string, at::Tensor>> items;
  for (const auto& [key, child] : o.tree.at(at).children())
    items.emplace_back(key, std::get<at::Tensor>(child.leaf()));
  return tt::from_state_dict(items);
}

io::Object object_at(const io::Object& o, const tr::Path& at) {
  io::Object sub;
  sub.tree = o.tree.at(at);
  return sub;
}

template <class F>
std::string invalid_argument_of(F&& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "no std::invalid_argument";
}
}  // namespace

// The optimizer object: a PyTorch training checkpoint (model + Adam in two param groups, one
// with amsgrad) continued for two steps in C++ and handed back; torch.optim.Adam's own two
// steps from the same checkpoint agree.
TEST(IoAdam, ContinuesAPyTorchRunOfTwoParamGroups) {
  const io::Object checkpoint = io::load(fixture("adam_groups.pt"));
  const io::Object optimizer = object_at(checkpoint, tr::Path{"optimizer"});
  EXPECT_NE(invalid_argument_of([&] {
              io::adam_state_from(optimizer);
            }).find("2 param groups: adam_state_from takes one"),
            std::string::npos);
  tt::TreeTensor params = state_dict_at(checkpoint, tr::Path{"model"});
  io::Adam adam(params);
  adam.load_state_dict(optimizer);
  ASSERT_EQ(adam.groups().size(), 2u);
  EXPECT_EQ(adam.groups()[1].names,
            (std::vector<std::string>{"0.bias", "1.bias", "2.bias", "3.bias"}));
  EXPECT_TRUE(adam.groups()[1].options.amsgrad());
  EXPECT_DOUBLE_EQ(adam.groups()[1].options.lr(), 5e-3);
  EXPECT_DOUBLE_EQ(adam.groups()[0].options.weight_decay(), 0.01);
  EXPECT_EQ(adam.groups()[0].step, 1);
  adam.step(tt::ones_like(params));
  adam.step(params.clone() * 2);
  EXPECT_EQ(adam.groups()[1].step, 3);
  const auto dir = scratch("adam_groups");
  const std::string params_file = (dir / "params.pt").string(), state = (dir / "state.pt").string();
  io::save_state_dict(params_file, adam.params());
  io::save(state, adam.state_dict());
  const auto [status, text] =
      python("check-adam-groups " + fixture("adam_groups.pt") + " " + params_file + " " + state);
  EXPECT_EQ(status, 0) << text;
  std::filesystem::remove_all(dir);
}

// Bad input is refused naming the parameter, before anything changes.
TEST(IoAdam, RefusesAStateOrGradientsThatDoNotFitItsParameters) {
  const io::Object checkpoint = io::load(fixture("adam_groups.pt"));
  const io::Object optimizer = object_at(checkpoint, tr::Path{"optimizer"});
  tt::TreeTensor params = state_dict_at(checkpoint, tr::Path{"model"});
  tt::TreeTensor fewer = params.clone();
  fewer.at(tr::Path{"3"}).erase("bias");
  io::Adam small(fewer);
  EXPECT_NE(invalid_argument_of([&] {
              small.load_state_dict(optimizer);
            }).find("Adam: the state names '3.bias', not a parameter"),
            std::string::npos);
  tt::TreeTensor more = params.clone();
  more.insert(tr::Path{"extra"}, at::zeros({2}));
  io::Adam large(more);
  EXPECT_NE(invalid_argument_of([&] {
              large.load_state_dict(optimizer);
            }).find("Adam: parameter 'extra' is in no param group of the state"),
            std::string::npos);
  tt::TreeTensor reshaped = params.clone();
  reshaped.at(tr::Path{"0", "weight"}).leaf() = at::zeros({2, 2});
  io::Adam wrong(reshaped);
  EXPECT_NE(invalid_argument_of([&] {
              wrong.load_state_dict(optimizer);
            }).find("Adam: at '0.weight': exp_avg has shape [3, 3], expected [2, 2]"),
            std::string::npos);

  io::Adam adam(params);
  adam.load_state_dict(optimizer);
  const tt::TreeTensor before = params.clone();
  tt::TreeTensor grads = tt::ones_like(params);
  grads.at(tr::Path{"3", "bias"}).leaf() = at::ones({3}, at::kDouble);
  EXPECT_NE(invalid_argument_of([&] {
              adam.step(grads);
            }).find("Adam: at '3.bias': grads has dtype Double, expected Float"),
            std::string::npos);
  EXPECT_TRUE(tt::equal(params, before)) << "nothing updated";
  EXPECT_EQ(adam.groups()[0].step, 1);
}
