// Fuzz driver of the file readers (DESIGN.md §13). LLVMFuzzerTestOneInput is the libFuzzer entry
// point (build this file with -fsanitize=fuzzer and -DTREETENSOR_LIBFUZZER to fuzz for real);
// without libFuzzer, main(DIR) replays every file in DIR (the fixtures Python wrote) and a
// fixed, seeded set of mutations of each — truncations, byte flips, overwritten length and
// offset fields, spliced copies — through both readers, and the same for generated seeds the
// fixtures cannot hold (memo amplification and long keys, which the expansion budget refuses).
// Any input may be refused, only with an exception: a crash, a sanitizer report, a hang
// (ctest's timeout) or memory without bound fails the run.
#include <caffe2/serialize/inline_container.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "io/bytes.hpp"
#include "pickle_bytes.hpp"

namespace io = treetensor::io;
using namespace std::string_literals;

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

// Seeded mutations of one corpus file; `rounds` scales their number (a generated seed's runs
// each fill the expansion budget: fewer of them).
void mutate_all(const std::string& original, std::mt19937_64& rng, int rounds = 20) {
  run(original);
  for (int k = 1; k <= 64; ++k) run(original.substr(0, original.size() * k / 65));
  std::uniform_int_distribution<std::size_t> at(0, original.empty() ? 0 : original.size() - 1);
  for (int k = 0; k < 100 * rounds && !original.empty(); ++k) {
    std::string m = original;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) m[at(rng)] ^= static_cast<char>(1 + rng() % 255);
    run(m);
  }
  // Length, offset, size and stride fields: 4 and 8 bytes overwritten with extreme values
  // (2^62: a size whose element count fits int64 but whose byte count does not).
  const std::uint64_t extremes[] = {0,     1,         0x7fffffff, 0xffffffff, 0x7fffffffffffffff,
                                    ~0ull, 1ull << 62};
  for (int k = 0; k < 50 * rounds && original.size() > 8; ++k) {
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

// ---- generated seeds: pickle bytes as torch.save lays them out, in a zip archive ----
using pickle_bytes::str;
using pickle_bytes::u32;
std::string repeat(const std::string& piece, std::size_t n) {
  std::string out;
  for (std::size_t k = 0; k < n; ++k) out += piece;
  return out;
}
std::string zip_of(const std::string& pickle) {
  std::string out;
  caffe2::serialize::PyTorchStreamWriter w([&](const void* p, std::size_t n) {
    if (n) out.append(static_cast<const char*>(p), n);
    return n;
  });
  w.writeRecord("data.pkl", pickle.data(), pickle.size());
  w.writeRecord("data/0", std::string(8, '\0').data(), 8);
  w.writeEndOfFile();
  return out;
}

// The break-it pass's memory bombs, scaled to expand to about twice the budget's 64 MiB base.
std::vector<std::string> generated_seeds() {
  const std::string big(64 << 10, 'x');
  const std::string tensor_args = "((" + str("storage") + "ctorch\nFloatStorage\n" + str("0") +
                                  str("cpu") + "K\x02tQK\x00"s + "(" + repeat("K\x01", 10'000) +
                                  "t" + "(" + repeat("K\x00"s, 10'000) + "t" +
                                  "\x89"
                                  "ccollections\nOrderedDict\n)Rtq\x01";
  return {
      // one string referenced 2000 times
      zip_of("\x80\x02](" + str(big) + "q\x00"s + repeat("h\x00"s, 1999) + "e."),
      // 998 nested lists around 4000 references to one empty list (each a 999-key path)
      zip_of("\x80\x02" + std::string(998, ']') + "](]q\x00"s + repeat("h\x00"s, 3999) + "e" +
             std::string(998, 'a') + "."),
      // one long dict key above 2000 lists
      zip_of("\x80\x02}" + str(big) + "](" + std::string(2000, ']') + "es."),
      // _codecs.encode of one memo'd string, 2000 times
      zip_of("\x80\x02(c_codecs\nencode\nq\x00"s + str(big) + str("latin1") + "\x86q\x01" +
             repeat("h\x00h\x01R"s, 2000) + "t."),
      // one tensor's 10k-dim size and stride, re-read by 2000 tensors
      zip_of("\x80\x02](ctorch._utils\n_rebuild_tensor_v2\nq\x00"s + tensor_args + "R" +
             repeat("h\x00h\x01R"s, 1999) + "e."),
  };
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
  for (const std::string& seed : generated_seeds()) {
    mutate_all(seed, rng, 1);
    ++files;
  }
  std::printf(
      "io_fuzz: %zu corpus files, %zu reader runs accepted, %zu refused with an exception\n", files,
      accepted, refused);
  return files > 0 ? 0 : 1;
}
#endif
