// Metrics on an asyncs thread while training goes on (DESIGN.md §10; OneFlow's
// `oneflow.asyncs.thread` use case).
//
// A small MLP trains on random data. After each step, the metrics — training loss and accuracy
// plus a full pass over a validation set with the current weights — are computed and appended
// to a CSV file by a job on a asyncs::Thread, while the main thread already runs the next
// step's forward and backward. The job declares the parameters it reads, so the next
// optimizer step (an in-place update) first calls asyncs::await_operands(): the validation
// pass always sees the weights of its own step.
//
// The program runs the same training twice — metrics inline, then on the metric thread — and
// exits with status 1 unless both CSV files are identical. It prints the step times of both.
//
// Two BLAS callers at once: OpenBLAS built with pthreads hands each call to its own server
// threads, so the main thread's and the metric thread's matmuls fight for the same cores.
// Measured on 2 busy cores (100 steps, defaults): 0.65x with OpenBLAS's default thread count,
// 1.16x with OPENBLAS_NUM_THREADS=1 set at start-up (results identical either way).
//
//   asyncs_metrics [--steps N] [--batch B] [--hidden H] [--val V] [--out DIR]
//                  [--kernels one|process]   (the metric thread's KernelThreads)
#include <treetensor/asyncs/operands.hpp>
#include <treetensor/asyncs/thread.hpp>
#include <treetensor/runtime/dispatch.hpp>

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace rt = treetensor::runtime;
namespace asyncs = treetensor::asyncs;

namespace {

struct Options {
  int steps = 200;
  int batch = 256;
  int hidden = 256;
  int val = 1024;
  int features = 64;
  int classes = 10;
  std::string out = ".";
  asyncs::KernelThreads kernels = asyncs::KernelThreads::one;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument("asyncs_metrics: " + arg + " needs a value");
    const std::string value = argv[++i];
    if (arg == "--steps")
      o.steps = std::stoi(value);
    else if (arg == "--batch")
      o.batch = std::stoi(value);
    else if (arg == "--hidden")
      o.hidden = std::stoi(value);
    else if (arg == "--val")
      o.val = std::stoi(value);
    else if (arg == "--out")
      o.out = value;
    else if (arg == "--kernels" && (value == "one" || value == "process"))
      o.kernels = value == "one" ? asyncs::KernelThreads::one : asyncs::KernelThreads::process;
    else
      throw std::invalid_argument("asyncs_metrics: unknown option " + arg);
  }
  if (o.steps < 1 || o.batch < 1 || o.hidden < 1 || o.val < 1)
    throw std::invalid_argument("asyncs_metrics: sizes must be positive");
  return o;
}

struct Data {
  std::vector<torch::Tensor> x, y;  // one batch per step
  torch::Tensor val_x, val_y;
};

// Labels come from a fixed random linear teacher, so the task is learnable.
Data make_data(const Options& o) {
  torch::manual_seed(1);
  const auto teacher = torch::randn({o.features, o.classes});
  Data d;
  for (int s = 0; s < o.steps; ++s) {
    d.x.push_back(torch::randn({o.batch, o.features}));
    d.y.push_back(d.x.back().matmul(teacher).argmax(1));
  }
  d.val_x = torch::randn({o.val, o.features});
  d.val_y = d.val_x.matmul(teacher).argmax(1);
  return d;
}

torch::nn::Sequential make_model(const Options& o) {
  torch::manual_seed(2);
  return torch::nn::Sequential(torch::nn::Linear(o.features, o.hidden), torch::nn::ReLU(),
                               torch::nn::Linear(o.hidden, o.hidden), torch::nn::ReLU(),
                               torch::nn::Linear(o.hidden, o.classes));
}

// One CSV line of metrics for `step`; reads the model's parameters (validation pass).
std::string metrics_line(int step, const torch::Tensor& loss, const torch::Tensor& logits,
                         const torch::Tensor& y, torch::nn::Sequential& model, const Data& d) {
  torch::NoGradGuard no_grad;
  const auto accuracy = logits.argmax(1).eq(y).to(torch::kDouble).mean();
  const auto val_logits = model->forward(d.val_x);
  const auto val_loss = torch::nn::functional::cross_entropy(val_logits, d.val_y);
  const auto val_accuracy = val_logits.argmax(1).eq(d.val_y).to(torch::kDouble).mean();
  char line[160];
  std::snprintf(line, sizeof line, "%d,%.9g,%.9g,%.9g,%.9g\n", step, loss.item<double>(),
                accuracy.item<double>(), val_loss.item<double>(), val_accuracy.item<double>());
  return line;
}

struct RunResult {
  double seconds_per_step = 0;
};

// Trains; metrics inline (metric_thread == nullptr) or as jobs on `metric_thread`.
RunResult train(const Options& o, const Data& d, const std::string& csv,
                asyncs::Thread* metric_thread) {
  auto model = make_model(o);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  const std::vector<torch::Tensor> params = model->parameters();
  auto file = std::make_shared<std::ofstream>(csv);
  *file << "step,loss,accuracy,val_loss,val_accuracy\n";

  const auto start = std::chrono::steady_clock::now();
  for (int step = 0; step < o.steps; ++step) {
    opt.zero_grad();
    const auto logits = model->forward(d.x[step]);
    const auto loss = torch::nn::functional::cross_entropy(logits, d.y[step]);
    loss.backward();
    // The previous step's metric job reads the parameters: the in-place update waits for it.
    if (asyncs::tracking_active()) asyncs::await_operands({}, params);
    opt.step();
    auto job = [step, loss = loss.detach(), logits = logits.detach(), y = d.y[step], model, &d,
                file]() mutable {
      *file << metrics_line(step, loss, logits, y, model, d) << std::flush;
    };
    if (metric_thread == nullptr) {
      job();
    } else {
      metric_thread->submit(std::move(job), params, {}, "metrics of step " + std::to_string(step));
    }
  }
  rt::synchronize();  // the last metric jobs; rethrows any job error
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return {seconds / o.steps};
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse(argc, argv);
    // The metric thread runs its kernels on one intra-op thread (KernelThreads::one); CPU
    // reductions sum in an order that depends on the thread count, so for bit-identical
    // metrics the inline run uses one intra-op thread too.
    if (o.kernels == asyncs::KernelThreads::one) torch::set_num_threads(1);
    const Data d = make_data(o);
    const std::string sync_csv = o.out + "/asyncs_metrics_sync.csv";
    const std::string async_csv = o.out + "/asyncs_metrics_async.csv";

    const RunResult sync = train(o, d, sync_csv, nullptr);
    RunResult async;
    {
      asyncs::Thread metrics("metrics", o.kernels);
      async = train(o, d, async_csv, &metrics);
    }
    const bool same = read_file(sync_csv) == read_file(async_csv);
    std::printf("steps %d, batch %d, hidden %d, validation %d\n", o.steps, o.batch, o.hidden,
                o.val);
    std::printf("step time, metrics inline:          %8.3f ms\n", sync.seconds_per_step * 1e3);
    std::printf("step time, metrics on asyncs thread: %8.3f ms (%.2fx)\n",
                async.seconds_per_step * 1e3, sync.seconds_per_step / async.seconds_per_step);
    std::printf("metrics files %s: %s, %s\n", same ? "identical" : "DIFFER", sync_csv.c_str(),
                async_csv.c_str());
    return same ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "asyncs_metrics: %s\n", e.what());
    return 2;
  }
}
