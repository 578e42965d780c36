#pragma once
// Runs a shell command for the end-to-end tests (tools, Python checks): its exit status and
// stdout+stderr (append " 2>&1" to the command for the latter).

#include <sys/wait.h>

#include <cstdio>
#include <string>

namespace tt_test {

struct CommandResult {
  int status = -1;     ///< exit status; 128 + signal when killed; -1 when it could not start
  std::string output;  ///< what the command printed
};

inline CommandResult run_command(const std::string& cmd) {
  CommandResult out;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return out;
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) out.output.append(buf, n);
  const int raw = pclose(p);
  out.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
  return out;
}

}  // namespace tt_test
