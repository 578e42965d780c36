// Loading a ~100 MB state dict (ResNet-50's 320 tensors, 25.6 M floats + buffers) against
// reading the file's bytes, side by side in one run (DESIGN.md §11). The file is written once in
// torch.save's zip format; every timing runs with it in the page cache.
//   read     open + read() of every byte into one buffer
//   load     io::load_state_dict: the pickle parsed, every storage copied (the default)
//   load+sum load, then every tensor summed
//   mmap, mmap+sum   the same with LoadOptions::mmap: tensors view a private mapping of the file
// Usage: io_bench [DIR] (default: the system temporary directory); prints a table.
#include <ATen/ATen.h>
#include <fcntl.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <vector>

#include "treetensor/io/checkpoint.hpp"
#include "treetensor/tensor/construct.hpp"

namespace tt = treetensor;

namespace {

tt::TreeTensor resnet50() {
  std::ifstream f(TREETENSOR_SOURCE_DIR "/data/models/resnet50.json");
  const auto doc = nlohmann::json::parse(f);
  std::vector<std::pair<std::string, at::Tensor>> items;
  for (const auto& e : doc.at("tensors")) {
    const auto shape = e.at("shape").get<std::vector<int64_t>>();
    items.emplace_back(e.at("key").get<std::string>(),
                       e.at("dtype") == "int64" ? at::zeros(shape, at::kLong) : at::randn(shape));
  }
  return tt::from_state_dict(items);
}

double read_all(const std::string& path, std::vector<char>& buffer) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  std::size_t got = 0;
  for (ssize_t n; (n = ::read(fd, buffer.data() + got, buffer.size() - got)) > 0;) got += n;
  ::close(fd);
  return double(got);
}

double ms(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const std::filesystem::path dir = argc > 1 ? argv[1] : std::filesystem::temp_directory_path();
  const std::string file = (dir / "treetensor_io_bench_resnet50.pt").string();
  at::manual_seed(0);
  tt::io::save_state_dict(file, resnet50());
  const auto bytes = std::filesystem::file_size(file);
  std::vector<char> buffer(bytes);
  std::vector<double> read_ms, load_ms[2], sum_ms[2];
  double checksum = 0;
  for (int rep = 0; rep < 9; ++rep) {  // interleaved, so load and noise hit each alike
    read_ms.push_back(ms([&] { checksum += read_all(file, buffer); }));
    for (int mapped = 0; mapped < 2; ++mapped) {
      const auto options = tt::io::LoadOptions().mapped(mapped == 1);
      load_ms[mapped].push_back(
          ms([&] { checksum += double(tt::io::load_state_dict(file, options).leaf_count()); }));
      sum_ms[mapped].push_back(ms([&] {
        const auto t = tt::io::load_state_dict(file, options);
        for (const auto& x : tt::tree::flatten(t).leaves) checksum += x.sum().item<double>();
      }));
    }
  }
  std::printf(
      "io_bench: %s, %.1f MB (ResNet-50 state dict, zip format), median of 9, page cache warm\n",
      file.c_str(), double(bytes) / 1e6);
  std::printf("%-10s %10s %12s\n", "what", "median ms", "vs read");
  const double r = median(read_ms);
  for (const auto& [name, v] : {std::pair<const char*, std::vector<double>&>{"read", read_ms},
                                {"load", load_ms[0]},
                                {"load+sum", sum_ms[0]},
                                {"mmap", load_ms[1]},
                                {"mmap+sum", sum_ms[1]}})
    std::printf("%-10s %10.2f %11.2fx\n", name, median(v), median(v) / r);
  std::printf("(checksum %g)\n", checksum);
  std::filesystem::remove(file);
  return 0;
}
