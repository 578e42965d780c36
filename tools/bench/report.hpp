#pragma once
// Results of a run: the stdout table, the JSON file and the PNG plot.

#include <nlohmann/json.hpp>

#include <optional>
#include <ostream>
#include <string>
#include <vector>

namespace treetensor::bench {

/// What a row is. Only strategies are ways to run the user's work; a bound is a floor no strategy
/// can beat by construction (seed `min`, optimizer and allreduce `limit`, elementwise `one-call`),
/// a reference is other work timed beside them (allreduce `compute`, seed `native-discard`).
/// Tables and plots show bounds and references apart, never as strategies.
enum class Role { strategy, bound, reference };

/// The role of a row by its strategy name (names are unique across the workloads).
Role role_of(const std::string& strategy);

/// One row: a strategy at one size (seed) or on one model (optimizer). Field names are the
/// JSON names other tools read; keep them.
/// The spread (std / mean) above which a row is flagged as noise rather than a finding.
inline constexpr double kNoiseFraction = 0.25;

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
  /// GB/s (1e9 bytes per second) where bytes are the cost: the bytes the work must move
  /// (each workload's footer says which) / mean time; null where not meaningful.
  std::optional<double> gbps;

  Role role() const { return role_of(strategy); }
  /// A spread above kNoiseFraction of the mean: noise, not a finding (flagged in the table,
  /// `noisy` in the JSON, not drawn).
  bool noisy() const { return std_ms > kNoiseFraction * mean_ms; }

  nlohmann::json to_json() const;
};

/// Prints the table, one row per record, grouped by size in record order; in each group the
/// strategies first, then bounds with their speed-up in brackets and references without one. A
/// GFLOP/s or GB/s column appears when a row has one.
/// @param size_header  the first column's title ("S" or "model").
/// @param baseline     the row the speed-up column is relative to ("native", "sequential").
void print_table(std::ostream& out, const std::vector<Record>& records,
                 const std::string& size_header, const std::string& baseline = "native");

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

/// How the sizes of a run are drawn.
enum class Axis {
  numeric,      ///< sizes are a sweep (seed's S): one line per strategy across them
  categorical,  ///< sizes are unrelated (models, N x E): points, never joined by lines
};

/// Draws speed-up against native (log scale) versus size (verified rows whose std is below their
/// mean only) into `path` (PNG)
/// with gnuplot: one series per strategy, bounds as grey dashed or hollow marks named
/// "(bound)"; references are left out. With a single size (an optimizer run), one labelled bar
/// per row instead. With `panel_key`, one panel per distinct value of that `extra` field
/// (elementwise: one per op), sizes stripped of it.
/// @param size_name  what a size is ("S", "model"), for the bar chart's axis label.
/// @param xlabel     the x-axis label. When gnuplot (or a PNG terminal) is missing,
/// writes nothing and returns a message saying how to install it; returns std::nullopt on success.
/// gnuplot's stdout is discarded (it falls back to stdout when it cannot open `path`, which
/// would put PNG bytes into the table); its error messages go to stderr.
/// @throws std::runtime_error when gnuplot is present but fails or does not write `path`.
struct PlotSpec {
  std::string title;
  std::string size_name;
  std::string xlabel;
  Axis axis = Axis::categorical;
  std::string panel_key;  ///< empty: one panel
};
std::optional<std::string> write_plot(const std::string& path, const std::vector<Record>& records,
                                      const PlotSpec& spec);

}  // namespace treetensor::bench
