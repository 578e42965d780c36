#pragma once
// What the header of every treetensor-bench report says about the machine.

#include <nlohmann/json.hpp>

#include <string>

namespace treetensor::bench {

/// The machine and library facts a benchmark figure depends on.
struct MachineInfo {
  std::string cpu;             ///< /proc/cpuinfo "model name" (or "unknown")
  unsigned cores = 0;          ///< std::thread::hardware_concurrency()
  std::string torch_version;   ///< LibTorch version, e.g. "1.13.0"
  std::string blas;            ///< BLAS in use: openblas_get_config() and the loaded library
  std::string cpu_capability;  ///< at::get_cpu_capability(): ATen's and our kernels' ISA
  int intra_op_threads = 0;    ///< at::get_num_threads()
  int inter_op_threads = 0;    ///< at::get_num_interop_threads()
  int blas_threads = -1;       ///< openblas_get_num_threads(), -1 when not OpenBLAS
  bool cuda = false;           ///< at::hasCUDA()
  std::string date;            ///< UTC, ISO 8601, when collected
  double load_average = -1;    ///< 1-minute load average when collected (/proc/loadavg), -1 unknown
  /// A warning when OpenBLAS runs kernels older than the CPU supports (it falls back to
  /// Prescott on CPUs newer than its detection table); empty otherwise.
  std::string blas_note;

  /// One line per fact, for the table header.
  std::string describe() const;
  nlohmann::json to_json() const;
};

/// Collects the facts now. Never throws: what cannot be found reads "unknown".
/// Thread safety: thread-safe.
MachineInfo collect_machine_info();

}  // namespace treetensor::bench
