// What a checkpoint file's life can do to a program (DESIGN.md §13): saving is atomic (a full
// disk, a planted symlink, two threads on one path), keeps the target's mode, and never aborts;
// loaded tensors never see the file change after loading (unless mapped on request); a huge
// sparse file can be looked at; a legacy file of many storages loads in linear time.
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <future>
#include <thread>

#include "io_test_util.hpp"
#include "pickle_bytes.hpp"
#include "treetensor/io/safetensors.hpp"
#include "treetensor/tensor/tensor.hpp"

using namespace io_test;
namespace tt = treetensor;
namespace fs = std::filesystem;

namespace {

// A tree whose every value is `v`: loading a mix of two such trees shows as two values.
tt::TreeTensor filled(float v, std::int64_t n = 1 << 14) {
  return tt::TreeTensor{
      {"a", at::full({n}, v)}, {"b", {{"c", at::full({n, 2}, v)}}}, {"d", at::full({3}, v)}};
}

// The one value every tensor of `t` holds, or NaN when they differ.
float only_value(const tt::TreeTensor& t) {
  float v = std::nanf("");
  bool first = true;
  for (const at::Tensor& x : tt::tree::flatten(t).leaves) {
    const float lo = x.min().item<float>(), hi = x.max().item<float>();
    if (lo != hi || (!first && lo != v)) return std::nanf("");
    v = lo;
    first = false;
  }
  return v;
}

std::vector<std::string> leftovers(const fs::path& dir, const std::string& keep) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename() != keep) out.push_back(e.path().filename().string());
  return out;
}

mode_t mode_of(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::stat(path.c_str(), &st), 0);
  return st.st_mode & 07777;
}

// Runs `f` with writes limited to `bytes` per file (EFBIG past it, as on a full disk).
template <class F>
void with_file_size_limit(rlim_t bytes, F&& f) {
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  const auto handler = ::signal(SIGXFSZ, SIG_IGN);
  rlimit lim = old;
  lim.rlim_cur = bytes;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &lim), 0);
  try {
    f();
  } catch (...) {
    ::setrlimit(RLIMIT_FSIZE, &old);
    ::signal(SIGXFSZ, handler);
    throw;
  }
  ::setrlimit(RLIMIT_FSIZE, &old);
  ::signal(SIGXFSZ, handler);
}

}  // namespace

TEST(IoSave, AFullDiskIsAnIoErrorAndTheOriginalStays) {
  const auto dir = scratch("full");
  const std::string pt = (dir / "x.pt").string(), st = (dir / "x.safetensors").string();
  io::save(pt, filled(1, 4));
  io::save_safetensors(pt + ".st", filled(1, 4));
  fs::rename(pt + ".st", st);
  with_file_size_limit(64 * 1024, [&] {
    for (const auto& [path, save] : std::vector<std::pair<std::string, std::function<void()>>>{
             {pt, [&] { io::save(pt, filled(2)); }},
             {st, [&] { io::save_safetensors(st, filled(2)); }}}) {
      SCOPED_TRACE(path);
      try {
        save();
        ADD_FAILURE() << "no error";
      } catch (const io::IoError& e) {
        EXPECT_EQ(e.file(), path);
        EXPECT_NE(std::string(e.what()).find("cannot write: File too large"), std::string::npos)
            << e.what();
      }
    }
  });
  EXPECT_EQ(only_value(io::load_tensors(pt)), 1.0f);
  EXPECT_EQ(only_value(io::load_safetensors(st).tensors), 1.0f);
  EXPECT_EQ(leftovers(dir, "x.pt"), std::vector<std::string>{"x.safetensors"})
      << "no temporary file left";
  fs::remove_all(dir);
}

TEST(IoSave, KeepsTheModeOfTheFileItReplaces) {
  const auto dir = scratch("mode");
  const std::string file = (dir / "x.pt").string();
  const mode_t mask = ::umask(022);
  ::umask(mask);
  io::save(file, filled(1, 4));
  EXPECT_EQ(mode_of(file), 0666 & ~mask) << "a new file: as fopen makes it";
  ASSERT_EQ(::chmod(file.c_str(), 0600), 0);
  io::save(file, filled(2, 4));
  EXPECT_EQ(mode_of(file), 0600u);
  io::save_safetensors(file, filled(3, 4));
  EXPECT_EQ(mode_of(file), 0600u);
  fs::remove_all(dir);
}

TEST(IoSave, APlantedSymlinkIsNotFollowed) {
  const auto dir = scratch("symlink");
  const std::string file = (dir / "x.pt").string(), victim = (dir / "victim").string();
  std::ofstream(victim) << "precious";
  // The names a predictable writer would use: this process's pid, and a few guesses.
  for (const std::string& suffix : {std::to_string(::getpid()), std::string("0"), std::string("")})
    fs::create_symlink(victim, file + ".tmp-" + suffix);
  io::save(file, filled(1, 4));
  EXPECT_EQ(only_value(io::load_tensors(file)), 1.0f);
  std::ifstream in(victim);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), "precious");
  EXPECT_FALSE(fs::is_symlink(file));
  fs::remove_all(dir);
}

TEST(IoSave, ASymlinkKeepsItsLinkAndAFifoOrHardLinkIsWrittenInPlace) {
  const auto dir = scratch("kinds");
  const std::string target = (dir / "epoch1.pt").string(), link = (dir / "latest.pt").string();
  io::save(target, filled(1, 4));
  fs::create_symlink(target, link);
  io::save(link, filled(2, 4));
  EXPECT_TRUE(fs::is_symlink(link)) << "the link's file is replaced, not the link";
  EXPECT_EQ(only_value(io::load_tensors(target)), 2.0f);
  const std::string twin = (dir / "twin.pt").string();
  fs::create_hard_link(target, twin);
  io::save(twin, filled(3, 4));
  EXPECT_EQ(fs::hard_link_count(target), 2u);
  EXPECT_EQ(only_value(io::load_tensors(target)), 3.0f) << "written in place, as torch.save";
  const std::string fifo = (dir / "pipe").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto read = std::async(std::launch::async, [&] {
    std::ifstream in(fifo, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  });
  io::save(fifo, filled(4, 4));
  ASSERT_EQ(read.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  const std::string bytes = read.get();
  EXPECT_TRUE(fs::is_fifo(fifo));
  const std::string copy = (dir / "copy.pt").string();
  std::ofstream(copy, std::ios::binary) << bytes;
  EXPECT_EQ(only_value(io::load_tensors(copy)), 4.0f);
  fs::remove_all(dir);
}

TEST(IoSave, AFifoWhoseReaderLeavesIsAnErrorNotASigpipe) {
  // The default SIGPIPE action kills this process: the save must hold it back.
  const auto dir = scratch("fifo-closed");
  const std::string fifo = (dir / "pipe").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto reader = std::async(std::launch::async, [&] {
    const int fd = ::open(fifo.c_str(), O_RDONLY);
    char c;
    const bool got = fd >= 0 && ::read(fd, &c, 1) == 1;  // the writer is in; then it is gone
    if (fd >= 0) ::close(fd);
    return got;
  });
  EXPECT_THROW(io::save(fifo, filled(1, 1 << 20)), io::IoError) << "4 MiB into a closed pipe";
  EXPECT_TRUE(reader.get());
  sigset_t pending;
  sigpending(&pending);
  EXPECT_EQ(sigismember(&pending, SIGPIPE), 0) << "no SIGPIPE left pending on this thread";
  fs::remove_all(dir);
}

TEST(IoError, MessagesAreValidUtf8WithOtherBytesEscaped) {
  const io::IoError e("y\xff.pt", 7, "global 'caf\xc3\xa9\xa3' is not allowed");
  EXPECT_STREQ(e.what(), "y\\xff.pt: at byte 7: global 'caf\xc3\xa9\\xa3' is not allowed");
  EXPECT_EQ(e.file(), "y\xff.pt") << "the path as given";
  const std::string nul("a\0b", 3);
  try {
    io::save(nul, filled(1, 4));
    ADD_FAILURE() << "a path with a NUL byte was written";
  } catch (const io::IoError& e) {
    EXPECT_STREQ(e.what(), "a\\x00b: the path holds a NUL byte");
  }
}

TEST(IoSave, TwoThreadsSavingOnePathEachLeaveOneWholeTree) {
  const auto dir = scratch("threads");
  const std::string file = (dir / "x.pt").string();
  auto saver = [&](float v) {
    int mixed = 0;
    for (int k = 0; k < 30; ++k) {
      io::save(file, filled(v));
      const float got = only_value(io::load_tensors(file));
      if (got != 1.0f && got != 2.0f) ++mixed;
    }
    return mixed;
  };
  auto a = std::async(std::launch::async, saver, 1.0f);
  auto b = std::async(std::launch::async, saver, 2.0f);
  // The watchdog: a deadlock fails here rather than hanging the suite.
  ASSERT_EQ(a.wait_for(std::chrono::seconds(120)), std::future_status::ready);
  ASSERT_EQ(b.wait_for(std::chrono::seconds(120)), std::future_status::ready);
  EXPECT_EQ(a.get(), 0);
  EXPECT_EQ(b.get(), 0);
  EXPECT_EQ(leftovers(dir, "x.pt"), std::vector<std::string>{});
  fs::remove_all(dir);
}

// Overwrites every byte of `path` in place (same inode), then truncates it to 0 bytes.
void scribble_then_truncate(const std::string& path) {
  const auto size = fs::file_size(path);
  {
    std::fstream f(path, std::ios::binary | std::ios::in | std::ios::out);
    const std::string junk(size, '\x7f');
    f.write(junk.data(), static_cast<std::streamsize>(size));
  }
  fs::resize_file(path, 0);
}

TEST(IoLoad, ChangesToTheFileNeverReachLoadedTensors) {
  const auto dir = scratch("changes");
  const std::string pt = (dir / "x.pt").string(), st = (dir / "x.safetensors").string(),
                    legacy = (dir / "legacy.pt").string();
  io::save(pt, filled(1));
  io::save_safetensors(st, filled(2));
  fs::copy_file(fixture("legacy.pt"), legacy);
  const tt::TreeTensor a = io::load_tensors(pt);
  const tt::TreeTensor b = io::load_safetensors(st).tensors;
  const io::Object c = io::load(legacy);
  for (const auto& f : {pt, st, legacy}) scribble_then_truncate(f);
  EXPECT_EQ(only_value(a), 1.0f);  // no SIGBUS, no changed value
  EXPECT_EQ(only_value(b), 2.0f);
  expect_matches(c, expectation("legacy"));
  fs::remove_all(dir);
}

TEST(IoLoad, MappedTensorsAreCopyOnWrite) {
  const auto dir = scratch("mapped");
  const std::string pt = (dir / "x.pt").string(), st = (dir / "x.safetensors").string();
  io::save(pt, filled(1));
  io::save_safetensors(st, filled(2));
  const auto mapped = io::LoadOptions().mapped();
  tt::TreeTensor a = io::load_tensors(pt, mapped);
  tt::TreeTensor b = io::load_safetensors(st, mapped).tensors;
  for (const at::Tensor& x : tt::tree::flatten(a).leaves) x.fill_(5);  // no SIGSEGV
  for (const at::Tensor& x : tt::tree::flatten(b).leaves) x.fill_(6);
  EXPECT_EQ(only_value(a), 5.0f);
  EXPECT_EQ(only_value(b), 6.0f);
  EXPECT_EQ(only_value(io::load_tensors(pt)), 1.0f) << "the file is never written";
  EXPECT_EQ(only_value(io::load_safetensors(st).tensors), 2.0f);
  fs::remove_all(dir);
}

TEST(IoLoad, AHugeSparseFileGivesACleanError) {
  const auto dir = scratch("sparse");
  for (const std::string name : {"huge.pt", "huge.safetensors"}) {
    const std::string file = (dir / name).string();
    const int fd = ::open(file.c_str(), O_CREAT | O_WRONLY, 0644);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::ftruncate(fd, std::int64_t{30} << 30), 0);  // 30 GiB of holes
    ::close(fd);
    try {
      if (name == "huge.pt")
        io::load(file);
      else
        io::load_safetensors(file);
      ADD_FAILURE() << "no error";
    } catch (const io::IoError& e) {
      const std::string what = e.what();
      EXPECT_EQ(what.find("cannot map"), std::string::npos) << what;
      EXPECT_NE(what.find(name == "huge.pt" ? "neither a zip-format nor a legacy"
                                            : "the header is not valid UTF-8 JSON"),
                std::string::npos)
          << what;
    }
  }
  fs::remove_all(dir);
}

// Valid files whose one tensor (30 GiB, a hole) is larger than this machine's memory, as
// torch.load(map_location="meta") takes them: legacy torch.save and safetensors.
std::vector<std::string> write_huge_valid_files(const fs::path& dir) {
  constexpr std::int64_t numel = (std::int64_t{30} << 30) / 4;  // float32
  const std::string legacy = (dir / "huge_valid.pt").string();
  const std::string head =
      pickle_bytes::legacy_head(pickle_bytes::tensor_pickle({numel}, {1}, 0, numel), numel);
  std::ofstream(legacy, std::ios::binary) << head;
  const std::string header = R"({"w":{"dtype":"F32","shape":[)" + std::to_string(numel) +
                             R"(],"data_offsets":[0,)" + std::to_string(numel * 4) + "]}}";
  std::string length(8, '\0');
  for (int k = 0; k < 8; ++k) length[k] = static_cast<char>((header.size() >> (8 * k)) & 0xff);
  const std::string st = (dir / "huge_valid.safetensors").string();
  std::ofstream(st, std::ios::binary) << length + header;
  EXPECT_EQ(::truncate(legacy.c_str(), std::int64_t(head.size()) + numel * 4), 0);
  EXPECT_EQ(::truncate(st.c_str(), std::int64_t(8 + header.size()) + numel * 4), 0);
  return {legacy, st};
}

// map_location meta: the structure (dtype, shape, stride, storage size) and no data read, so a
// checkpoint larger than memory loads at once. Copying or mapping it would need 30 GiB.
TEST(IoLoad, OnTheMetaDeviceAFileLargerThanMemoryLoadsItsStructure) {
  const auto dir = scratch("meta_huge");
  const auto files = write_huge_valid_files(dir);
  const auto meta = io::LoadOptions().device(c10::kMeta);
  for (const at::Tensor& w :
       {std::get<at::Tensor>(io::load(files[0], meta).tree.at(tt::tree::Path{"t"}).leaf()),
        io::load_safetensors(files[1], meta).tensors.at("w").leaf()}) {
    EXPECT_TRUE(w.is_meta());
    EXPECT_EQ(w.scalar_type(), at::kFloat);
    EXPECT_EQ(w.sizes(), at::IntArrayRef({(std::int64_t{30} << 30) / 4}));
    EXPECT_EQ(w.storage().nbytes(), std::size_t{30} << 30);
  }
  fs::remove_all(dir);
}

// A real checkpoint on meta: every path, dtype, shape and stride as loaded on the CPU.
TEST(IoLoad, OnTheMetaDeviceTheStructureIsTheCpuLoads) {
  const std::string file = fixture("checkpoint.pt");
  const tt::TreeTensor cpu = io::load_tensors(file);
  const tt::TreeTensor meta = io::load_tensors(file, io::LoadOptions().device(c10::kMeta));
  const auto a = tt::tree::flatten(cpu), b = tt::tree::flatten(meta);
  ASSERT_EQ(a.spec.paths(), b.spec.paths());
  ASSERT_FALSE(a.leaves.empty());
  for (std::size_t k = 0; k < a.leaves.size(); ++k) {
    EXPECT_TRUE(b.leaves[k].is_meta());
    EXPECT_EQ(a.leaves[k].scalar_type(), b.leaves[k].scalar_type());
    EXPECT_EQ(a.leaves[k].sizes(), b.leaves[k].sizes());
    EXPECT_EQ(a.leaves[k].strides(), b.leaves[k].strides());
    EXPECT_EQ(a.leaves[k].requires_grad(), b.leaves[k].requires_grad());
  }
}

TEST(IoLoad, ALegacyFileOfManyStoragesLoads) {
  const auto dir = scratch("legacy_many");
  const std::string file = (dir / "many.pt").string();
  const auto [status, out] = python("write-legacy-many 20000 " + file);
  ASSERT_EQ(status, 0) << out;
  const auto start = std::chrono::steady_clock::now();
  const tt::TreeTensor t = io::load_tensors(file);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("legacy file of 20000 one-element tensors: loaded in %.3f s\n", s);
  const auto flat = tt::tree::flatten(t);
  ASSERT_EQ(flat.leaves.size(), 20000u);
  EXPECT_EQ(t.at(tt::tree::Path{"t19999"}).leaf().item<float>(), 19999.0f);
  fs::remove_all(dir);
}
