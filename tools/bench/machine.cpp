#include "machine.hpp"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>

#if __has_include(<torch/version.h>)
#include <torch/version.h>
#endif

#include <fmt/format.h>

#include <dlfcn.h>
#include <link.h>

#include <chrono>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <string_view>
#include <thread>

namespace treetensor::bench {
namespace {

// The value of the first "<field> : value" line of /proc/cpuinfo, or "".
std::string cpuinfo_field(std::string_view field) {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (!line.starts_with(field)) continue;
    auto colon = line.find(':');
    auto start = line.find_first_not_of(' ', colon + 1);
    if (colon != std::string::npos && start != std::string::npos) return line.substr(start);
  }
  return "";
}

bool has_cpu_flag(const std::string& flags, std::string_view flag) {
  return (" " + flags + " ").find(" " + std::string(flag) + " ") != std::string::npos;
}

// OpenBLAS 0.3.21 maps CPUs newer than its table (e.g. family 6 model 207) to Prescott, whose
// SSE3 kernels ran the seed's matmuls 2.5x slower than SkylakeX's on this machine.
std::string blas_core_note(const std::string& core) {
  static const std::set<std::string> old_cores = {"Prescott", "Core2", "Penryn",     "Dunnington",
                                                  "Nehalem",  "Atom",  "Sandybridge"};
  const std::string flags = cpuinfo_field("flags");
  if (!old_cores.count(core) || !has_cpu_flag(flags, "avx2")) return "";
  const char* better = has_cpu_flag(flags, "avx512f") ? "SkylakeX" : "Haswell";
  return "OpenBLAS runs its " + core + " kernels on this AVX2" +
         (has_cpu_flag(flags, "avx512f") ? std::string("/AVX-512") : "") +
         " CPU (too new for its detection); OPENBLAS_CORETYPE=" + better + " selects faster ones";
}

std::string torch_version() {
#ifdef TORCH_VERSION
  return TORCH_VERSION;
#else
  // LibTorch builds without torch/version.h still print it in their build settings.
  std::smatch m;
  const std::string cfg = at::show_config();
  if (std::regex_search(cfg, m, std::regex("TORCH_VERSION=([0-9][^,\\s]*)"))) return m[1];
  return "unknown";
#endif
}

// Shared libraries loaded into this process whose file name mentions BLAS or MKL: LibTorch's
// own build settings often say only "BLAS_INFO=generic" (Debian's does), so the loaded library
// is the reliable answer.
std::set<std::string> loaded_blas_libraries() {
  std::set<std::string> out;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        std::string path = info->dlpi_name ? info->dlpi_name : "";
        std::string name = std::filesystem::path(path).filename().string();
        // cuBLAS is the GPU's BLAS (loaded by CUDA LibTorch whatever the device): not the CPU's.
        const bool cpu_blas =
            name.find("blas") != std::string::npos && name.find("cublas") == std::string::npos;
        if (cpu_blas || name.find("mkl_core") != std::string::npos) {
          std::error_code ec;
          auto real = std::filesystem::canonical(path, ec);
          static_cast<std::set<std::string>*>(data)->insert(ec ? path : real.string());
        }
        return 0;
      },
      &out);
  return out;
}

// MKL linked into LibTorch itself (PyPI's wheels): no MKL library is loaded, but the build
// settings name its version and its C entry point gives the thread count.
std::string mkl_in_libtorch(int& threads) {
  std::smatch m;
  const std::string cfg = at::show_config();
  if (!std::regex_search(cfg, m, std::regex("Math Kernel Library Version ([^ \n]+)"))) return "";
  using ThreadsFn = int (*)();
  if (auto fn = reinterpret_cast<ThreadsFn>(dlsym(RTLD_DEFAULT, "MKL_Get_Max_Threads")))
    threads = fn();
  return "MKL " + m[1].str() + " (linked into LibTorch)";
}

std::string blas_in_use(int& threads, std::string& note) {
  // OpenBLAS answers through its own entry points when it is the BLAS this process loaded.
  using TextFn = char* (*)();
  using ThreadsFn = int (*)();
  std::string text;
  if (auto fn = reinterpret_cast<TextFn>(dlsym(RTLD_DEFAULT, "openblas_get_config"))) text = fn();
  if (auto fn = reinterpret_cast<TextFn>(dlsym(RTLD_DEFAULT, "openblas_get_corename"))) {
    const std::string core = fn();
    text += ", core " + core;
    note = blas_core_note(core);
  }
  if (auto fn = reinterpret_cast<ThreadsFn>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads")))
    threads = fn();
  std::string libs;
  for (const auto& lib : loaded_blas_libraries()) libs += (libs.empty() ? "" : ", ") + lib;
  if (!libs.empty()) text += (text.empty() ? "" : "; ") + libs;
  if (text.empty()) text = mkl_in_libtorch(threads);
  if (text.empty()) {
    std::smatch m;
    const std::string cfg = at::show_config();
    if (std::regex_search(cfg, m, std::regex("BLAS_INFO=([^,\\s]*)")))
      text = "BLAS_INFO=" + m[1].str() + " (from at::show_config)";
  }
  return text.empty() ? "unknown" : text;
}

std::string utc_now() {
  std::time_t t = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// Other work on a shared machine moves every figure; the load average says how much there was.
double load_average() {
  std::ifstream in("/proc/loadavg");
  double one_minute = -1;
  return in >> one_minute ? one_minute : -1;
}

}  // namespace

MachineInfo collect_machine_info() {
  MachineInfo m;
  m.cpu = cpuinfo_field("model name");
  if (m.cpu.empty()) m.cpu = "unknown";
  m.cores = std::thread::hardware_concurrency();
  m.torch_version = torch_version();
  m.blas = blas_in_use(m.blas_threads, m.blas_note);
  m.cpu_capability = at::get_cpu_capability();
  m.intra_op_threads = at::get_num_threads();
  m.inter_op_threads = at::get_num_interop_threads();
  m.cuda = at::hasCUDA();
  m.date = utc_now();
  m.load_average = load_average();
  return m;
}

std::string MachineInfo::describe() const {
  std::string s;
  s += "machine: " + cpu + ", " + std::to_string(cores) + " cores" +
       (cuda ? ", CUDA available" : "") + "\n";
  s += "LibTorch " + torch_version + " (CPU kernels " + cpu_capability + "); BLAS: " + blas + "\n";
  s += "threads: intra-op " + std::to_string(intra_op_threads) + ", inter-op " +
       std::to_string(inter_op_threads) + ", BLAS " +
       (blas_threads < 0 ? std::string("unknown") : std::to_string(blas_threads)) + "\n";
  s += "date: " + date;
  if (load_average >= 0) s += fmt::format(", load average {:.2f} at start", load_average);
  s += "\n";
  if (!blas_note.empty()) s += "note: " + blas_note + "\n";
  return s;
}

nlohmann::json MachineInfo::to_json() const {
  return {{"cpu", cpu},
          {"cores", cores},
          {"libtorch", torch_version},
          {"blas", blas},
          {"cpu_capability", cpu_capability},
          {"intra_op_threads", intra_op_threads},
          {"inter_op_threads", inter_op_threads},
          {"blas_threads", blas_threads < 0 ? nlohmann::json() : nlohmann::json(blas_threads)},
          {"blas_note", blas_note.empty() ? nlohmann::json() : nlohmann::json(blas_note)},
          {"cuda_available", cuda},
          {"date", date},
          {"load_average", load_average < 0 ? nlohmann::json() : nlohmann::json(load_average)}};
}

}  // namespace treetensor::bench
