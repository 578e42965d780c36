#pragma once
// Results of a run: the stdout table, the JSON file and the PNG plot.

#include <nlohmann/json.hpp>

#include <optional>
#include <ostream>
#include <string>
#include <vector>

namespace treetensor::bench {

/// One row: a strategy at one size (seed) or on one model (optimizer). Field names are the
/// JSON names other tools read; keep them.
struct Record {
  std::string workload;  ///< "seed" or "optimizer"
  std::string strategy;  ///< "min", "native", "native-discard", "foreach", ...
  nlohmann::json size;   ///< seed: S (number) or "S1xS2xS3"; optimizer: model name
  double mean_ms = 0;
  double std_ms = 0;
  std::optional<double> gflops;  ///< null where not meaningful
  double speedup_vs_native = 0;  ///< native mean / this mean (null in the JSON when unverified)
  bool verified = false;         ///< agrees with native before timing (see Verification)
  std::size_t reps = 0;          ///< timed repetitions (table only; in the JSON config)
  nlohmann::json extra = nlohmann::json::object();  ///< workload fields (elementwise: op, ...)

  nlohmann::json to_json() const;
};

/// Prints the table, one row per record, grouped by size in record order.
/// @param size_header  the first column's title ("S" or "model").
void print_table(std::ostream& out, const std::vector<Record>& records,
                 const std::string& size_header);

/// Writes {"config": config, "results": [records...]} to `path`, indented.
/// @throws std::runtime_error naming the path when it cannot be written.
void write_json(const std::string& path, const nlohmann::json& config,
                const std::vector<Record>& records);

/// Checks, before any measuring, that `path` can be written as the output of `flag`: its
/// parent directory (the current one for a bare name) exists and is writable, and `path`
/// itself is not a directory. Creates nothing.
/// @param flag  the option the path came from ("--json", "--plot"), named in the error.
/// @throws std::runtime_error naming the flag and the path when it cannot be written.
void check_output_path(const std::string& flag, const std::string& path);

/// Draws speed-up against native versus size (verified rows only), one line per strategy, into
/// `path` (PNG) with gnuplot; with a single size (an optimizer run), one labelled bar per strategy
/// instead.
/// @param size_name  what a size is ("S", "model"), for the bar chart's axis label.
/// @param xlabel     the line chart's x-axis label. When gnuplot (or a PNG terminal) is missing,
/// writes nothing and returns a message saying how to install it; returns std::nullopt on success.
/// gnuplot's stdout is discarded (it falls back to stdout when it cannot open `path`, which
/// would put PNG bytes into the table); its error messages go to stderr.
/// @throws std::runtime_error when gnuplot is present but fails or does not write `path`.
std::optional<std::string> write_plot(const std::string& path, const std::vector<Record>& records,
                                      const std::string& title, const std::string& size_name,
                                      const std::string& xlabel);

}  // namespace treetensor::bench
