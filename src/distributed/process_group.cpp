// ProcessGroup's constructors (process_group.hpp): the c10d stores every rank meets on
// (FileStore, TCPStore, torchrun's agent store) and the group made over them (group.hpp).

#include "treetensor/distributed/process_group.hpp"

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstdlib>
#include <string>

#include "distributed/group.hpp"

namespace treetensor::distributed {

using detail::check_rank;

namespace {

int env_int(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v)
    throw std::invalid_argument(
        std::string("treetensor distributed: environment variable ") + name +
        " is not set (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)");
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (*end || x < 0 || x > 65535 * 16)
    throw std::invalid_argument(std::string("treetensor distributed: environment variable ") +
                                name + "='" + v + "' is not a non-negative integer");
  return static_cast<int>(x);
}

}  // namespace

ProcessGroup ProcessGroup::with_file_store(const std::string& path, int rank, int world_size,
                                           Options options) {
  check_rank(rank, world_size);
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::FileStore>(path, world_size);
    store->setTimeout(options.timeout);
  } catch (const std::exception& e) {
    throw CollectiveError("treetensor distributed: cannot open the FileStore '" + path +
                          "': " + detail::error_text(e));
  }
  return from_impl(std::make_shared<detail::Group>(store, rank, world_size, options, true));
}

namespace {

// A TCPStore client or server; under torchrun's agent (TORCHELASTIC_USE_AGENT_STORE=True) the
// agent already serves MASTER_PORT, so every rank is a client, behind the prefix
// torch.distributed uses there ("/worker/attempt_<TORCHELASTIC_RESTART_COUNT>").
ProcessGroup make_tcp_group(const std::string& host, int port, int rank, int world_size,
                            const Options& options, bool agent_store) {
  check_rank(rank, world_size);
  if (port <= 0 || port > 65535)
    throw std::invalid_argument("treetensor distributed: port " + std::to_string(port) +
                                " is outside 1..65535");
  c10::intrusive_ptr<c10d::Store> store;
  try {
    c10d::TCPStoreOptions o;
    o.port = static_cast<std::uint16_t>(port);
    o.isServer = rank == 0 && !agent_store;
    o.numWorkers = agent_store ? c10::nullopt : c10::optional<std::size_t>(world_size);
    o.waitWorkers = !agent_store;
    o.timeout = options.timeout;
    store = c10::make_intrusive<c10d::TCPStore>(host, o);
    if (agent_store) {
      const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
      store = c10::make_intrusive<c10d::PrefixStore>(
          std::string("/worker/attempt_") + (attempt ? attempt : "0"), store);
    }
  } catch (const std::exception& e) {
    throw CollectiveError("treetensor distributed: cannot reach the TCPStore at " + host + ":" +
                          std::to_string(port) + " (rank " + std::to_string(rank) +
                          "): " + detail::error_text(e));
  }
  const bool loopback = host == "localhost" || host.rfind("127.", 0) == 0;
  return ProcessGroup::from_impl(
      std::make_shared<detail::Group>(store, rank, world_size, options, loopback));
}

}  // namespace

ProcessGroup ProcessGroup::with_tcp_store(const std::string& host, int port, int rank,
                                          int world_size, Options options) {
  return make_tcp_group(host, port, rank, world_size, options, false);
}

ProcessGroup ProcessGroup::from_env(Options options) {
  const int rank = env_int("RANK"), world = env_int("WORLD_SIZE"), port = env_int("MASTER_PORT");
  const char* addr = std::getenv("MASTER_ADDR");
  if (!addr || !*addr)
    throw std::invalid_argument(
        "treetensor distributed: environment variable MASTER_ADDR is not set");
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  return make_tcp_group(addr, port, rank, world, options, agent && std::string(agent) == "True");
}

int ProcessGroup::rank() const {
  return impl_->rank();
}
int ProcessGroup::world_size() const {
  return impl_->world();
}
const Options& ProcessGroup::options() const {
  return impl_->options();
}
std::uint64_t ProcessGroup::sequence() const {
  return impl_->sequence();
}

int local_rank() {
  const char* v = std::getenv("LOCAL_RANK");
  return v && *v ? std::atoi(v) : 0;
}

}  // namespace treetensor::distributed
