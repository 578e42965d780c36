#include "report.hpp"

#include <fmt/format.h>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <stdexcept>

namespace treetensor::bench {
namespace {

std::string size_text(const nlohmann::json& size) {
  return size.is_string() ? size.get<std::string>() : size.dump();
}

template <class Key>
std::vector<std::string> unique_in_order(const std::vector<Record>& records, Key key) {
  std::vector<std::string> out;
  for (const auto& r : records)
    if (std::find(out.begin(), out.end(), key(r)) == out.end()) out.push_back(key(r));
  return out;
}

// Text inside a gnuplot double-quoted string.
std::string gp_quote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

// The PNG terminal gnuplot offers here ("pngcairo" preferred), or "" when gnuplot is missing.
std::string png_terminal() {
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) return "";
  for (const char* term : {"pngcairo", "png"}) {
    std::string cmd = std::string("gnuplot -e 'set terminal ") + term + "' >/dev/null 2>&1";
    if (std::system(cmd.c_str()) == 0) return term;
  }
  return "";
}

}  // namespace

Role role_of(const std::string& strategy) {
  if (strategy == "min" || strategy == "limit" || strategy == "one-call" ||
      strategy == "max-of-parts")
    return Role::bound;
  if (strategy == "compute" || strategy == "native-discard" || strategy == "sum-of-parts" ||
      strategy.ends_with("-alone"))
    return Role::reference;
  return Role::strategy;
}

namespace {
const char* role_name(Role r) {
  return r == Role::bound ? "bound" : r == Role::reference ? "reference" : "strategy";
}

// The speed-up cell: a strategy's as is, a bound's in brackets (a yardstick), none for
// a reference (other work: a ratio to native would read as a speed-up it is not).
std::string speedup_cell(const Record& r) {
  if (!r.verified || r.role() == Role::reference) return "-";
  const std::string x = fmt::format("{:.2f}x", r.speedup_vs_native);
  return r.role() == Role::bound ? "(" + x + ")" : x;
}

std::string verified_cell(const Record& r) {
  const std::string noise = r.noisy() ? ", noisy" : "";
  if (r.role() != Role::strategy) return (r.verified ? role_name(r.role()) : "NO") + noise;
  return (r.verified ? "yes" : "NO") + noise;
}

std::string rate_cell(const std::optional<double>& rate) {
  if (!rate) return "-";
  // Three significant digits from 1 up, two decimals below (0.25 GB/s is not 0.3).
  const int decimals = *rate >= 100 ? 0 : *rate >= 10 ? 1 : 2;
  return fmt::format("{:.{}f}", *rate, decimals);
}

// The records of one size group in table order: strategies, then bounds, then references.
std::vector<const Record*> group_in_table_order(const std::vector<const Record*>& group) {
  std::vector<const Record*> out;
  for (Role role : {Role::strategy, Role::bound, Role::reference})
    for (const Record* r : group)
      if (r->role() == role) out.push_back(r);
  return out;
}
}  // namespace

nlohmann::json Record::to_json() const {
  nlohmann::json j = {
      {"workload", workload},
      {"strategy", strategy},
      {"role", role_name(role())},
      {"size", size},
      {"mean_ms", mean_ms},
      {"std_ms", std_ms},
      {"gflops", gflops ? nlohmann::json(*gflops) : nlohmann::json()},
      {"gbps", gbps ? nlohmann::json(*gbps) : nlohmann::json()},
      {"speedup_vs_native", verified ? nlohmann::json(speedup_vs_native) : nlohmann::json()},
      {"verified", verified},
      {"noisy", noisy()}};
  j.update(extra);
  return j;
}

void print_table(std::ostream& out, const std::vector<Record>& records,
                 const std::string& size_header, const std::string& baseline) {
  std::size_t width = size_header.size(), name = 15;
  bool flops = false, bytes = false;
  for (const auto& r : records) {
    width = std::max(width, size_text(r.size).size());
    name = std::max(name, r.strategy.size() + 1);
    flops = flops || r.gflops;
    bytes = bytes || r.gbps;
  }
  out << fmt::format("{:>{}}  {:<{}}{:>10}{:>9}", size_header, width, "strategy", name, "mean ms",
                     "std ms")
      << (flops ? fmt::format("{:>10}", "GFLOP/s") : "")
      << (bytes ? fmt::format("{:>9}", "GB/s") : "")
      << fmt::format("{:>11}{:>5}  {}\n", "vs " + baseline, "T", "verified");
  for (const auto& size :
       unique_in_order(records, [](const Record& r) { return size_text(r.size); })) {
    std::vector<const Record*> group;
    for (const auto& r : records)
      if (size_text(r.size) == size) group.push_back(&r);
    if (group.front() != &records.front()) out << "\n";
    for (const Record* r : group_in_table_order(group)) {
      // An unverified row's time is not comparable: no speed-up is claimed for it.
      out << fmt::format("{:>{}}  {:<{}}{:>10.3f}{:>9.3f}", size, width, r->strategy, name,
                         r->mean_ms, r->std_ms)
          << (flops ? fmt::format("{:>10}", rate_cell(r->gflops)) : "")
          << (bytes ? fmt::format("{:>9}", rate_cell(r->gbps)) : "")
          << fmt::format("{:>11}{:>5}  {}\n", speedup_cell(*r), r->reps, verified_cell(*r));
    }
  }
  // A row with a wide spread says little: named, so no one reads it (or a ratio to it) as one.
  std::string noisy;
  for (const auto& r : records)
    if (r.noisy()) noisy += (noisy.empty() ? "" : ", ") + size_text(r.size) + " " + r.strategy;
  if (!noisy.empty())
    out << fmt::format("(std > {:.0f}% of the mean, noise, not a finding: {})\n",
                       kNoiseFraction * 100, noisy);
  if (std::any_of(records.begin(), records.end(),
                  [](const Record& r) { return r.role() != Role::strategy; }))
    out << "(in brackets: a bound's speed-up, a yardstick for the strategies, not a way to run "
           "the work; none is shown for a reference row, which times other work)\n";
}

void check_output_path(const std::string& flag, const std::string& path) {
  namespace fs = std::filesystem;
  const auto fail = [&](const std::string& why) {
    throw std::runtime_error(flag + " " + path + ": " + why);
  };
  std::error_code ec;
  if (fs::is_directory(path, ec)) fail("is a directory; give a file name");
  const fs::path parent = fs::path(path).has_parent_path() ? fs::path(path).parent_path() : ".";
  if (!fs::is_directory(parent, ec)) fail("directory '" + parent.string() + "' does not exist");
  if (access(parent.c_str(), W_OK | X_OK) != 0)
    fail("directory '" + parent.string() + "' is not writable");
  if (fs::exists(path, ec) && access(path.c_str(), W_OK) != 0) fail("file is not writable");
}

void write_json(const std::string& path, const nlohmann::json& config,
                const std::vector<Record>& records) {
  nlohmann::json results = nlohmann::json::array();
  for (const auto& r : records) results.push_back(r.to_json());
  std::ofstream f(path);
  if (!f) throw std::runtime_error("cannot open '" + path + "' for writing (--json)");
  f << nlohmann::json{{"config", config}, {"results", results}}.dump(2) << "\n";
  if (!f.flush()) throw std::runtime_error("cannot write '" + path + "' (--json)");
}

namespace {

// Runs gnuplot on `script`, which draws into `path`.
void run_gnuplot(const std::string& path, const std::string& script) {
  // A stale file from an earlier run must not pass for this run's plot.
  std::error_code ec;
  std::filesystem::remove(path, ec);
  FILE* gp = popen("gnuplot >/dev/null", "w");
  if (!gp) throw std::runtime_error("cannot start gnuplot for --plot " + path);
  std::fwrite(script.data(), 1, script.size(), gp);
  if (pclose(gp) != 0)
    throw std::runtime_error("gnuplot failed to draw '" + path + "' (see its message above)");
  if (std::filesystem::file_size(path, ec) == 0 || ec)
    throw std::runtime_error("gnuplot did not write '" + path + "' (see its message above)");
}

// A series: one strategy's (or bound's) speed-ups at x positions 0.. of its panel's sizes.
struct Series {
  std::string name;
  Role role;
  std::vector<std::pair<std::size_t, double>> points;
};

// Records of one panel as series, native left out (it is the line at 1x).
std::vector<Series> series_of(const std::vector<const Record*>& records,
                              const std::vector<std::string>& sizes,
                              const std::function<std::string(const Record&)>& size_of) {
  std::vector<Series> out;
  for (const Record* r : records) {
    if (r->strategy == "native" || r->role() == Role::reference) continue;
    auto it = std::find_if(out.begin(), out.end(),
                           [&](const Series& s) { return s.name == r->strategy; });
    if (it == out.end()) it = out.insert(out.end(), Series{r->strategy, r->role(), {}});
    const auto x = std::find(sizes.begin(), sizes.end(), size_of(*r)) - sizes.begin();
    it->points.emplace_back(static_cast<std::size_t>(x), r->speedup_vs_native);
  }
  return out;
}

// gnuplot's style for a series: strategies coloured (lines only across a numeric sweep),
// bounds grey and dashed or hollow, so that no bound reads as a strategy.
std::string series_style(const Series& s, Axis axis) {
  if (s.role == Role::bound)
    return axis == Axis::numeric ? "with linespoints dashtype 3 lw 2 pt 6 lc rgb \"gray50\""
                                 : "with points pt 6 ps 2 lc rgb \"gray40\"";
  return axis == Axis::numeric ? "with linespoints lw 2 pt 7" : "with points pt 7 ps 1.6";
}

// One panel: its sizes on x, speed-up on a log y axis, native as the dashed line at 1x.
std::string panel_plot(const std::string& tag, const std::vector<const Record*>& records,
                       const std::function<std::string(const Record&)>& size_of, Axis axis) {
  std::vector<std::string> sizes;
  for (const Record* r : records)
    if (std::find(sizes.begin(), sizes.end(), size_of(*r)) == sizes.end())
      sizes.push_back(size_of(*r));
  std::string script = fmt::format("set xrange [-0.5:{}.5]\nset xtics (", sizes.size() - 1);
  for (std::size_t i = 0; i < sizes.size(); ++i)
    script += fmt::format("{}{} {}", i ? ", " : "", gp_quote(sizes[i]), i);
  script += ")\n";
  std::string plot = "plot 1 with lines dashtype 2 lc rgb \"black\" title \"native (1x)\"";
  const auto series = series_of(records, sizes, size_of);
  for (std::size_t s = 0; s < series.size(); ++s) {
    script += fmt::format("${}{} << EOD\n", tag, s);
    for (const auto& [x, y] : series[s].points) script += fmt::format("{} {}\n", x, y);
    script += "EOD\n";
    const std::string title =
        series[s].name + (series[s].role == Role::bound ? " (bound)" : std::string());
    plot += fmt::format(", ${}{} using 1:2 {} title {}", tag, s, series_style(series[s], axis),
                        gp_quote(title));
  }
  return script + plot + "\n";
}

// One size only (an optimizer run): a bar per row, labelled with its speed-up; bounds grey.
std::string bar_plot(const std::vector<const Record*>& records) {
  std::string script = fmt::format(
      "set xrange [-0.6:{}.6]\nset yrange [0:*]\nset style fill solid 0.7\n"
      "set boxwidth 0.6\nunset key\n$d << EOD\n",
      records.size() - 1);
  for (std::size_t i = 0; i < records.size(); ++i) {
    const Record& r = *records[i];
    const bool bound = r.role() == Role::bound;
    script +=
        fmt::format("{} {} {} {}\n", i, gp_quote(bound ? r.strategy + " (bound)" : r.strategy),
                    r.speedup_vs_native, bound ? "0x999999" : "0x3b75af");
  }
  return script +
         "EOD\nplot $d using 1:3:4:xtic(2) with boxes lc rgb variable, "
         "$d using 1:3:(sprintf(\"%.2fx\", $3)) with labels offset 0,1, "
         "1 with lines dashtype 2 lc rgb \"black\"\n";
}

// Draws `records` (all verified) with gnuplot's `term`.
void draw_plot(const std::string& path, const std::vector<const Record*>& records,
               const PlotSpec& spec, const std::string& term) {
  std::vector<std::string> panels;
  for (const Record* r : records) {
    const std::string p = spec.panel_key.empty() ? "" : r->extra.value(spec.panel_key, "");
    if (std::find(panels.begin(), panels.end(), p) == panels.end()) panels.push_back(p);
  }
  std::vector<std::string> sizes;
  for (const Record* r : records)
    if (std::find(sizes.begin(), sizes.end(), size_text(r->size)) == sizes.end())
      sizes.push_back(size_text(r->size));
  const bool bars = sizes.size() == 1;

  // Each panel keeps its own key below it, so the panels stay the same size.
  std::string script =
      fmt::format("set terminal {} size {},{} noenhanced\n", term,
                  panels.size() > 1 ? 640 * panels.size() : 960, panels.size() > 1 ? 720 : 600);
  script += "set output " + gp_quote(path) + "\n";
  script += "set xlabel " +
            gp_quote(bars ? "strategy (" + spec.size_name + " " + sizes[0] + ")" : spec.xlabel) +
            "\nset ylabel \"speed-up vs native (x)\"\nset grid\n";
  if (bars) {
    std::vector<const Record*> shown;
    for (const Record* r : records)
      if (r->role() != Role::reference) shown.push_back(r);
    run_gnuplot(path, script + "set title " + gp_quote(spec.title) + "\n" + bar_plot(shown));
    return;
  }
  // Speed-ups span 0.1x to hundreds: a log axis keeps every row readable.
  script += "set logscale y\nset key below horizontal\nset xtics rotate by -30\n";
  if (panels.size() > 1)
    script +=
        fmt::format("set multiplot layout 1,{} title {}\n", panels.size(), gp_quote(spec.title));
  else
    script += "set title " + gp_quote(spec.title) + "\n";
  for (std::size_t p = 0; p < panels.size(); ++p) {
    std::vector<const Record*> in_panel;
    for (const Record* r : records)
      if (spec.panel_key.empty() || r->extra.value(spec.panel_key, "") == panels[p])
        in_panel.push_back(r);
    // A panel's sizes lose the panel's own name ("200x4 add" -> "200x4").
    const std::string suffix = panels[p].empty() ? "" : " " + panels[p];
    const auto size_of = [suffix](const Record& r) {
      std::string s = size_text(r.size);
      if (!suffix.empty() && s.size() > suffix.size() &&
          s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0)
        s.resize(s.size() - suffix.size());
      return s;
    };
    if (panels.size() > 1) script += "set title " + gp_quote(panels[p]) + "\n";
    script += panel_plot("p" + std::to_string(p) + "s", in_panel, size_of, spec.axis);
  }
  if (panels.size() > 1) script += "unset multiplot\n";
  run_gnuplot(path, script);
}

}  // namespace

std::optional<std::string> write_plot(const std::string& path, const std::vector<Record>& records,
                                      const PlotSpec& spec) {
  const std::string term = png_terminal();
  if (term.empty())
    return "no plot: gnuplot with a PNG terminal is not installed; install it with "
           "`sudo apt-get install gnuplot-nox` (Debian/Ubuntu) and run again to get " +
           path;
  std::vector<const Record*> verified;
  for (const auto& r : records)  // a noisy row is no finding: not drawn
    if (r.verified && (!r.noisy() || r.strategy == "native")) verified.push_back(&r);
  if (verified.empty())
    return "no plot: no row was verified, so there is nothing to draw in " + path;
  draw_plot(path, verified, spec, term);
  return std::nullopt;
}

}  // namespace treetensor::bench
