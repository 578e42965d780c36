// The built-in launcher (launch.hpp): fork + execv of N ranks with torchrun's variables.

#include "treetensor/distributed/launch.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <stdexcept>
#include <system_error>
#include <thread>

extern char** environ;

namespace treetensor::distributed {

namespace {

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::system_error(errno, std::generic_category(), "launch: socket()");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const int e = errno;
    ::close(fd);
    throw std::system_error(e, std::generic_category(), "launch: finding a free port");
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

}  // namespace

bool LaunchResult::ok() const {
  for (const auto& r : ranks)
    if (r.exit_code != 0) return false;
  return !ranks.empty();
}

std::string LaunchResult::describe() const {
  std::ostringstream os;
  for (const auto& r : ranks) {
    os << "rank " << r.rank << ": ";
    if (r.timed_out)
      os << "killed at the deadline";
    else if (r.signal)
      os << "killed by signal " << r.signal << " (" << ::strsignal(r.signal) << ")";
    else
      os << "exit " << r.exit_code;
    os << "\n";
  }
  return os.str();
}

std::string self_executable() {
  return std::filesystem::read_symlink("/proc/self/exe").string();
}

LaunchResult launch(const std::string& program, const std::vector<std::string>& args,
                    const LaunchOptions& options) {
  if (options.nprocs < 1)
    throw std::invalid_argument("treetensor launch: nprocs must be >= 1, got " +
                                std::to_string(options.nprocs));
  const int port = options.master_port ? options.master_port : free_port();

  // Everything execve needs is built before fork: past the atfork handlers (treetensor's own
  // allocate, as glibc lets a fork child do) the child only calls async-signal-safe functions
  // (the parent is multithreaded).
  std::vector<std::string> argv_s{program};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);

  std::map<std::string, std::string> base;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    const auto eq = kv.find('=');
    if (eq != std::string::npos) base[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  for (const auto& [k, v] : options.env) base[k] = v;
  base["WORLD_SIZE"] = base["LOCAL_WORLD_SIZE"] = std::to_string(options.nprocs);
  base["MASTER_ADDR"] = options.master_addr;
  base["MASTER_PORT"] = std::to_string(port);

  std::vector<std::vector<std::string>> envs_s(options.nprocs);
  std::vector<std::vector<char*>> envs(options.nprocs);
  for (int r = 0; r < options.nprocs; ++r) {
    auto env = base;
    env["RANK"] = env["LOCAL_RANK"] = std::to_string(r);
    for (const auto& [k, v] : env) envs_s[r].push_back(k + "=" + v);
    for (auto& s : envs_s[r]) envs[r].push_back(s.data());
    envs[r].push_back(nullptr);
  }

  std::vector<pid_t> pids;
  for (int r = 0; r < options.nprocs; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::execve(argv[0], argv.data(), envs[r].data());
      ::_exit(127);
    }
    if (pid < 0) {
      const int e = errno;
      for (pid_t p : pids) ::kill(p, SIGKILL);
      for (pid_t p : pids) ::waitpid(p, nullptr, 0);
      throw std::system_error(e, std::generic_category(), "treetensor launch: fork");
    }
    pids.push_back(pid);
  }

  LaunchResult result;
  result.ranks.resize(options.nprocs);
  std::vector<bool> done(options.nprocs, false);
  int remaining = options.nprocs;
  const auto deadline = std::chrono::steady_clock::now() + options.timeout;
  while (remaining > 0) {
    for (int r = 0; r < options.nprocs; ++r) {
      if (done[r]) continue;
      int status = 0;
      const pid_t got = ::waitpid(pids[r], &status, WNOHANG);
      if (got != pids[r]) continue;
      done[r] = true;
      --remaining;
      result.ranks[r].rank = r;
      if (WIFEXITED(status)) result.ranks[r].exit_code = WEXITSTATUS(status);
      if (WIFSIGNALED(status)) result.ranks[r].signal = WTERMSIG(status);
    }
    if (remaining == 0) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      for (int r = 0; r < options.nprocs; ++r) {
        if (done[r]) continue;
        ::kill(pids[r], SIGKILL);
        ::waitpid(pids[r], nullptr, 0);
        result.ranks[r] = RankExit{r, -1, SIGKILL, true};
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return result;
}

}  // namespace treetensor::distributed
