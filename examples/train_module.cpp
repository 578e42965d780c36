// A LibTorch module trained on treetensor's pieces, data-parallel on local ranks: the C++
// sibling of examples/train_ddp.py (DESIGN.md §21).
//
//  - treetensor::nn::consolidate_module: the model's parameters and gradients in one buffer
//    each (every parameter and its grad() a view);
//  - after backward, the gradient tree averaged across ranks in buckets of that buffer (one
//    Gloo call per bucket, not per parameter);
//  - the flat single-pass Adam step over the buffers;
//  - the step's metrics (loss, gradient norm) reduced and printed on an asyncs thread beside
//    the next step.
//
// Exits with status 1 unless every rank ends with bitwise the same parameters (they apply the
// same averaged gradients) and the loss has fallen below half its first value.
//
//   train_module [--steps N]                         # starts 2 ranks itself
//   torchrun --no-python --nproc-per-node 2 ./train_module
#include <treetensor/asyncs/thread.hpp>
#include <treetensor/distributed/launch.hpp>
#include <treetensor/distributed/process_group.hpp>
#include <treetensor/nn/module.hpp>
#include <treetensor/tensor/construct.hpp>
#include <treetensor/tensor/optim.hpp>
#include <treetensor/tree/flatten.hpp>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

namespace dist = treetensor::distributed;
namespace asyncs = treetensor::asyncs;
namespace tt = treetensor;

namespace {

// The user's model and data: a regression MLP on a fixed synthetic set, each rank its half.
torch::nn::Sequential make_model() {
  at::manual_seed(0);  // the same initial parameters on every rank
  return torch::nn::Sequential(torch::nn::Linear(16, 64), torch::nn::ReLU(),
                               torch::nn::Linear(64, 64), torch::nn::ReLU(),
                               torch::nn::Linear(64, 4));
}

std::pair<at::Tensor, at::Tensor> batch(int step, int rank, std::int64_t rows) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * (rank + 1) + step % 8);
  at::Tensor x = at::randn({rows, 16}, gen);
  return {x, at::sin(x.narrow(1, 0, 4)) * 2};
}

int train(int steps) {
  const auto group = dist::ProcessGroup::from_env();
  const int rank = group.rank();
  auto model = make_model();
  auto tree = tt::nn::consolidate_module(*model);
  auto exp_avg = tt::zeros_like(tree.params, {}, tt::consolidated);
  auto exp_avg_sq = tt::zeros_like(tree.params, {}, tt::consolidated);
  asyncs::Thread metrics("metrics");
  asyncs::Future<void> pending;
  double first_loss = 0, last_loss = 0;
  for (int step = 1; step <= steps; ++step) {
    auto [x, y] = batch(step, rank, 64);
    if (pending.valid()) pending.wait();  // the previous metrics have read the gradients
    tree.zero_grad();
    const at::Tensor loss = torch::nn::functional::mse_loss(model->forward(x), y);
    loss.backward();
    const tt::TreeTensor& grads = tree.grads();
    dist::all_reduce(group, grads, dist::ReduceOp::avg);  // in place, one call per bucket
    last_loss = loss.item<double>();
    if (step == 1) first_loss = last_loss;
    pending = metrics.submit([&tree, rank, step, last_loss] {
      const at::Tensor norm = at::linalg_vector_norm(tree.grad_buffers.front(), 2);
      if (rank == 0 && (step == 1 || step % 20 == 0))
        std::cout << "step " << step << ": loss " << last_loss << ", gradient norm "
                  << norm.item<double>() << std::endl;
    });
    tt::adam_step_single_pass(tree.params, grads, exp_avg, exp_avg_sq, step,
                              tt::AdamOptions().lr(3e-3));
  }
  pending.wait();
  const tt::TreeTensor all = dist::all_gather(group, tree.params);
  bool same = true;
  for (const auto& leaf : tt::tree::flatten(all).leaves) same = same && at::equal(leaf[0], leaf[1]);
  std::cout << "rank " << rank << ": loss " << first_loss << " -> " << last_loss
            << (same ? ", parameters equal on every rank" : ", PARAMETERS DIFFER") << std::endl;
  return same && last_loss < 0.5 * first_loss ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 100;
  for (int i = 1; i + 1 < argc; i += 2)
    if (std::string(argv[i]) == "--steps") steps = std::atoi(argv[i + 1]);
  try {
    if (!std::getenv("RANK")) {  // not under torchrun: start 2 local ranks of this program
      dist::LaunchOptions o;
      o.nprocs = 2;
      o.timeout = std::chrono::seconds(120);
      const auto r =
          dist::launch(dist::self_executable(), std::vector<std::string>(argv + 1, argv + argc), o);
      if (!r.ok()) std::cerr << "train_module: " << r.describe();
      return r.ok() ? 0 : 1;
    }
    at::set_num_threads(1);
    return train(steps);
  } catch (const std::exception& e) {
    std::cerr << "train_module: " << e.what() << std::endl;
    return 1;
  }
}
