// treetensor::nn::consolidate_module against LibTorch itself: the trees' leaves are the
// module's own tensors, training through them (the flat Adam kernel over the buffers) follows
// torch::optim::Adam on an unconsolidated copy, and the cases DESIGN.md §21 names (tied,
// frozen, buffers, module->zero_grad(), a moved model, overlapping and meta tensors) are
// handled or refused naming the parameter.
#include <gtest/gtest.h>

#include <limits>
#include <string>

#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include "treetensor/nn/module.hpp"
#include "treetensor/tensor/consolidate.hpp"
#include "treetensor/tensor/construct.hpp"
#include "treetensor/tensor/optim.hpp"
#include "treetensor/tree/flatten.hpp"

namespace tt = treetensor;

namespace {

struct Net : torch::nn::Module {
  explicit Net(bool tied = false, bool frozen = false)
      : conv(register_module("conv", torch::nn::Conv1d(torch::nn::Conv1dOptions(2, 4, 3)))),
        bn(register_module("bn", torch::nn::BatchNorm1d(4))),
        fc(register_module("fc", torch::nn::Linear(24, 24))),
        out(register_module("out", torch::nn::Linear(24, 24))) {
    if (tied) register_parameter("shared", fc->weight);  // one tensor under two names
    if (frozen) {
      conv->weight.set_requires_grad(false);
      conv->bias.set_requires_grad(false);
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    return out->forward(at::tanh(fc->forward(bn->forward(conv->forward(x)).flatten(1))));
  }
  torch::nn::Conv1d conv;
  torch::nn::BatchNorm1d bn;
  torch::nn::Linear fc, out;
};

at::Tensor batch() {
  at::manual_seed(5);
  return at::randn({8, 2, 8});
}

// Two models with equal parameters and buffers.
std::pair<std::shared_ptr<Net>, std::shared_ptr<Net>> pair(bool tied = false, bool frozen = false) {
  at::manual_seed(0);
  auto ref = std::make_shared<Net>(tied, frozen);
  auto ours = std::make_shared<Net>(tied, frozen);
  at::NoGradGuard no_grad;
  for (const auto& item : ref->named_parameters())
    ours->named_parameters()[item.key()].copy_(item.value());
  for (const auto& item : ref->named_buffers())
    ours->named_buffers()[item.key()].copy_(item.value());
  return {ref, ours};
}

const at::Tensor& leaf_at(const tt::TensorTree& t, const std::string& dotted) {
  return t.at(dotted).leaf();
}

// Expects `fn` to throw an E whose message contains `text`.
template <class E, class F>
void expect_error(F&& fn, const std::string& text) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one containing: " << text;
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

TEST(NnModule, LeavesAreTheModuleTensorsInOneBuffer) {
  auto [ref, m] = pair();
  auto tree = tt::nn::consolidate_module(*m);
  ASSERT_TRUE(tt::is_consolidated(tree.params) && tt::is_consolidated(tree.grads()));
  ASSERT_EQ(tree.param_buffers.size(), 1u);
  ASSERT_EQ(tree.grad_buffers.size(), 1u);
  for (const auto& item : m->named_parameters()) {
    const at::Tensor& leaf = leaf_at(tree.params, item.key());
    EXPECT_EQ(leaf.unsafeGetTensorImpl(), item.value().unsafeGetTensorImpl()) << item.key();
    EXPECT_TRUE(leaf.is_alias_of(tree.param_buffers[0])) << item.key();
    EXPECT_EQ(item.value().grad().unsafeGetTensorImpl(),
              leaf_at(tree.grads(), item.key()).unsafeGetTensorImpl())
        << item.key();
    EXPECT_TRUE(item.value().grad().is_alias_of(tree.grad_buffers[0])) << item.key();
    EXPECT_TRUE(at::equal(item.value(), ref->named_parameters()[item.key()])) << item.key();
  }
  EXPECT_EQ(leaf_at(tree.buffers, "bn.running_mean").data_ptr(), m->bn->running_mean.data_ptr());
  EXPECT_EQ(tt::tree::flatten(tree.params).leaves.size(), 8u);  // conv, bn, fc, out: weight, bias
}

// Per step a few ulps of |w| and of the lr-sized update (python/tests/test_optim.py's bound).
void expect_within_adam_bound(Net& ours, Net& ref, double lr, int steps) {
  const double eps = std::numeric_limits<float>::epsilon();
  for (const auto& item : ref.named_parameters()) {
    const at::Tensor w = item.value().detach();
    const at::Tensor bound = (steps + 1) * eps * (w.abs() + 16 * lr);
    EXPECT_TRUE(((ours.named_parameters()[item.key()] - w).abs() <= bound).all().item<bool>())
        << item.key();
  }
}

TEST(NnModule, TrainingFollowsLibTorchAdam) {
  auto [ref, m] = pair();
  auto tree = tt::nn::consolidate_module(*m);
  const double lr = 1e-2;
  torch::optim::Adam opt_ref(ref->parameters(), torch::optim::AdamOptions(lr));
  auto exp_avg = tt::zeros_like(tree.params, {}, tt::consolidated);
  auto exp_avg_sq = tt::zeros_like(tree.params, {}, tt::consolidated);
  const at::Tensor x = batch();
  for (int step = 1; step <= 4; ++step) {
    opt_ref.zero_grad();
    const at::Tensor loss_ref = ref->forward(x).square().mean();
    loss_ref.backward();
    tree.zero_grad();
    const at::Tensor loss = m->forward(x).square().mean();
    loss.backward();
    EXPECT_NEAR(loss.item<double>(), loss_ref.item<double>(), 1e-5 * loss_ref.item<double>());
    if (step == 1) {  // the same model on the same values: the first gradients are torch's
      for (const auto& item : ref->named_parameters())
        EXPECT_TRUE(at::equal(m->named_parameters()[item.key()].grad(), item.value().grad()))
            << item.key();
    }
    opt_ref.step();
    tt::adam_step_single_pass(tree.params, tree.grads(), exp_avg, exp_avg_sq, step,
                              tt::AdamOptions().lr(lr));
    // After one step the parameters are torch's within the bound. Later, conv.bias (right
    // before BatchNorm: zero gradient in exact arithmetic) takes lr-sized Adam steps from
    // rounding noise on either side, so the losses are compared instead.
    if (step == 1) expect_within_adam_bound(*m, *ref, lr, 1);
  }
  // BatchNorm's running statistics were updated through the buffer views.
  EXPECT_EQ(leaf_at(tree.buffers, "bn.running_mean").data_ptr(), m->bn->running_mean.data_ptr());
  EXPECT_TRUE(at::allclose(m->bn->running_mean, ref->bn->running_mean, 1e-2, 1e-3));
  EXPECT_EQ(m->bn->num_batches_tracked.item<int64_t>(), 4);
}

TEST(NnModule, TiedIsOneLeafFrozenStaysOutOfTheGradients) {
  auto [ref, m] = pair(/*tied=*/true, /*frozen=*/true);
  auto tree = tt::nn::consolidate_module(*m);
  // named_parameters() gives a module's own parameters before its children's: "shared" first.
  EXPECT_EQ(tree.aliases, (std::map<std::string, std::string>{{"fc.weight", "shared"}}));
  EXPECT_FALSE(tree.params.contains("fc.weight"));
  EXPECT_EQ(m->fc->weight.unsafeGetTensorImpl(),
            leaf_at(tree.params, "shared").unsafeGetTensorImpl());
  EXPECT_EQ(leaf_at(tree.frozen, "conv.weight").unsafeGetTensorImpl(),
            m->conv->weight.unsafeGetTensorImpl());
  EXPECT_FALSE(tree.params.contains("conv"));
  EXPECT_FALSE(tree.grads().contains("conv"));
  const at::Tensor before = m->conv->weight.detach().clone();
  auto exp_avg = tt::zeros_like(tree.params, {}, tt::consolidated);
  auto exp_avg_sq = tt::zeros_like(tree.params, {}, tt::consolidated);
  for (int step = 1; step <= 2; ++step) {
    tree.zero_grad();
    m->forward(batch()).square().mean().backward();
    tt::adam_step_single_pass(tree.params, tree.grads(), exp_avg, exp_avg_sq, step,
                              tt::AdamOptions().lr(1e-2));
  }
  EXPECT_TRUE(at::equal(m->conv->weight, before));
  EXPECT_FALSE(m->conv->weight.grad().defined());
}

TEST(NnModule, ZeroGradIsOneFillAndModuleZeroGradIsRepaired) {
  auto [ref, m] = pair();
  auto tree = tt::nn::consolidate_module(*m);
  const at::Tensor x = batch();
  m->forward(x).sum().backward();
  ASSERT_GT(tree.grad_buffers[0].abs().sum().item<double>(), 0);
  tree.zero_grad();
  EXPECT_EQ(at::count_nonzero(tree.grad_buffers[0]).item<int64_t>(), 0);

  m->zero_grad();  // LibTorch's default: every grad() undefined
  EXPECT_FALSE(m->fc->weight.grad().defined());
  m->out->forward(at::ones({2, 24})).sum().backward();  // reaches out.* only: new tensors
  ref->zero_grad();
  ref->out->forward(at::ones({2, 24})).sum().backward();
  const auto& grads = tree.grads();
  for (const auto& item : m->named_parameters()) {
    const at::Tensor& g = leaf_at(grads, item.key());
    EXPECT_EQ(item.value().grad().unsafeGetTensorImpl(), g.unsafeGetTensorImpl()) << item.key();
    const at::Tensor& want = ref->named_parameters()[item.key()].grad();
    EXPECT_TRUE(want.defined() ? at::equal(g, want) : at::count_nonzero(g).item<int64_t>() == 0)
        << item.key();  // an unreached parameter gets a zero gradient, never an older one
  }
}

struct Bag : torch::nn::Module {
  Bag()
      : emb(register_module(
            "emb", torch::nn::Embedding(torch::nn::EmbeddingOptions(10, 3).sparse(true)))) {}
  torch::nn::Embedding emb;
};

TEST(NnModule, SparseGradientsBecomeDense) {
  Bag m;
  auto tree = tt::nn::consolidate_module(m);
  const at::Tensor ids = at::tensor({1, 4, 4}, at::kLong);
  m.zero_grad();  // undefined: autograd makes a sparse gradient
  m.emb->forward(ids).sum().backward();
  ASSERT_TRUE(m.emb->weight.grad().is_sparse());
  const at::Tensor g = leaf_at(tree.grads(), "emb.weight");
  EXPECT_EQ(m.emb->weight.grad().unsafeGetTensorImpl(), g.unsafeGetTensorImpl());
  at::Tensor want = at::zeros({10, 3});
  want[1].fill_(1);
  want[4].fill_(2);
  EXPECT_TRUE(at::equal(g, want));
}

TEST(NnModule, AMovedModelIsRefusedNamingThePath) {
  auto [ref, m] = pair();
  auto tree = tt::nn::consolidate_module(*m);
  m->to(torch::kDouble);
  const std::string moved = "parameter 'bn.bias' no longer lies in its consolidated buffer";
  expect_error<std::runtime_error>([&] { tree.grads(); }, moved);
  expect_error<std::runtime_error>([&] { tree.zero_grad(); }, moved);
}

TEST(NnModule, CreateGraphGradientsAreRefused) {
  auto [ref, m] = pair();
  auto tree = tt::nn::consolidate_module(*m);
  m->forward(batch()).square().sum().backward({}, /*retain_graph=*/true, /*create_graph=*/true);
  expect_error<std::runtime_error>([&] { tree.grads(); },
                                   "has a graph (backward with create_graph)");
  for (const auto& p : m->parameters()) p.mutable_grad() = at::Tensor();  // break the cycles
}

struct Overlapping : torch::nn::Module {
  explicit Overlapping(at::Tensor whole) {
    register_parameter("a", whole);
    register_parameter("b", whole.detach().narrow(0, 2, 4).requires_grad_());
  }
};

struct OnMeta : torch::nn::Module {
  OnMeta() { register_parameter("w", at::empty({3}, at::TensorOptions().device(at::kMeta))); }
};

struct SparseParameter : torch::nn::Module {
  SparseParameter() {
    register_parameter("dense", at::ones({2}));
    register_parameter("w", at::eye(3).to_sparse());
  }
};

TEST(NnModule, OverlappingMetaAndSparseTensorsAreRefused) {
  Overlapping overlapping(at::zeros({6}));
  expect_error<std::invalid_argument>([&] { tt::nn::consolidate_module(overlapping); },
                                      "parameters 'a' and 'b' share memory");
  OnMeta meta;
  expect_error<std::invalid_argument>([&] { tt::nn::consolidate_module(meta); },
                                      "parameter 'w' is on the meta device");
  SparseParameter sparse;
  const void* before = sparse.named_parameters()["dense"].data_ptr();
  expect_error<std::invalid_argument>([&] { tt::nn::consolidate_module(sparse); },
                                      "parameter 'w' has layout Sparse");
  EXPECT_EQ(sparse.named_parameters()["dense"].data_ptr(), before);  // nothing moved
}

}  // namespace
