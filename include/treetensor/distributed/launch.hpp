#pragma once
// Starting N local ranks of a program (the distributed layer's built-in launcher, for tests
// and treetensor-bench): what `torchrun --no-python --nproc-per-node N prog args...` does on
// one machine, with a deadline that kills every rank still running so a hang fails.

#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace treetensor::distributed {

struct LaunchOptions {
  int nprocs = 2;  ///< ranks to start (WORLD_SIZE), >= 1
  /// Wall-clock limit for all ranks together; at the deadline every rank still running gets
  /// SIGKILL and is reported as timed out.
  std::chrono::milliseconds timeout = std::chrono::seconds(120);
  /// Extra environment variables for every rank (on top of the caller's environment).
  std::map<std::string, std::string> env;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  ///< 0: a free TCP port is picked (bound once, then released)
};

/// How one rank ended.
struct RankExit {
  int rank = 0;
  int exit_code = -1;      ///< exit status when it exited, else -1
  int signal = 0;          ///< the signal that ended it, else 0
  bool timed_out = false;  ///< killed at the deadline
};

struct LaunchResult {
  std::vector<RankExit> ranks;  ///< in rank order
  /// Every rank exited with status 0.
  bool ok() const;
  /// One line per rank: "rank 1: exit 3", "rank 0: killed at the 60 s deadline", ...
  std::string describe() const;
};

/// Starts `nprocs` copies of `program` (a path; fork + execv) with `args`, each with torchrun's
/// variables RANK, LOCAL_RANK (0..nprocs-1), WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
/// MASTER_PORT set, and waits for all of them (or the deadline). Their stdout and stderr are
/// the caller's.
/// @throws std::invalid_argument for nprocs < 1; std::system_error when a process cannot be
///         started (the ones already started are killed first).
LaunchResult launch(const std::string& program, const std::vector<std::string>& args,
                    const LaunchOptions& options = {});

/// The running program's path (/proc/self/exe), for a program that launches its own ranks.
std::string self_executable();

}  // namespace treetensor::distributed
