// Fuzz driver of the file readers (DESIGN.md §13). LLVMFuzzerTestOneInput is the libFuzzer entry
// point (build this file with -fsanitize=fuzzer and -DTREETENSOR_LIBFUZZER to fuzz for real);
// without libFuzzer, main(DIR) replays every file in DIR (the fixtures Python wrote) and a
// fixed, seeded set of mutations of each — truncations, byte flips, overwritten length and
// offset fields, spliced copies — through both readers. Any input may be refused, only with an
// exception: a crash, a sanitizer report or a hang (ctest's timeout) fails the run.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "io/bytes.hpp"

namespace io = treetensor::io;

namespace {
std::size_t accepted = 0, refused = 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const io::detail::Input input{data, size, "fuzz-input", nullptr};
  for (int reader = 0; reader < 2; ++reader) {
    try {
      if (reader == 0)
        (void)io::detail::load_from_bytes(input);
      else
        (void)io::detail::safetensors_from_bytes(input);
      ++accepted;
    } catch (const std::exception&) {
      ++refused;
    }
  }
  return 0;
}

#ifndef TREETENSOR_LIBFUZZER
namespace {

void run(const std::string& bytes) {
  LLVMFuzzerTestOneInput(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
}

// Seeded mutations of one corpus file.
void mutate_all(const std::string& original, std::mt19937_64& rng) {
  run(original);
  for (int k = 1; k <= 64; ++k) run(original.substr(0, original.size() * k / 65));
  std::uniform_int_distribution<std::size_t> at(0, original.empty() ? 0 : original.size() - 1);
  for (int k = 0; k < 2000 && !original.empty(); ++k) {
    std::string m = original;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) m[at(rng)] ^= static_cast<char>(1 + rng() % 255);
    run(m);
  }
  // Length, offset, size and stride fields: 4 and 8 bytes overwritten with extreme values
  // (2^62: a size whose element count fits int64 but whose byte count does not).
  const std::uint64_t extremes[] = {0,     1,         0x7fffffff, 0xffffffff, 0x7fffffffffffffff,
                                    ~0ull, 1ull << 62};
  for (int k = 0; k < 1000 && original.size() > 8; ++k) {
    std::string m = original;
    const std::size_t p = at(rng) % (original.size() - 8);
    const std::uint64_t v = extremes[rng() % std::size(extremes)];
    std::memcpy(m.data() + p, &v, rng() % 2 ? 4 : 8);
    run(m);
  }
  for (int k = 0; k < 20 && !original.empty(); ++k) {  // a piece repeated inside itself
    const std::size_t a = at(rng), b = at(rng);
    run(original.substr(0, std::max(a, b)) + original.substr(std::min(a, b)));
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: io_fuzz DIR (replays every file in DIR and mutations of it)\n");
    return 2;
  }
  std::mt19937_64 rng(20261201);
  std::size_t files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(argv[1])) {
    if (!entry.is_regular_file() || entry.path().extension() == ".json") continue;
    std::ifstream f(entry.path(), std::ios::binary);
    const std::string bytes{std::istreambuf_iterator<char>(f), {}};
    mutate_all(bytes, rng);
    ++files;
  }
  std::printf(
      "io_fuzz: %zu corpus files, %zu reader runs accepted, %zu refused with an exception\n", files,
      accepted, refused);
  return files > 0 ? 0 : 1;
}
#endif
