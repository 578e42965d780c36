#include "report.hpp"

#include <fmt/format.h>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
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

nlohmann::json Record::to_json() const {
  nlohmann::json j = {
      {"workload", workload},
      {"strategy", strategy},
      {"size", size},
      {"mean_ms", mean_ms},
      {"std_ms", std_ms},
      {"gflops", gflops ? nlohmann::json(*gflops) : nlohmann::json()},
      {"speedup_vs_native", verified ? nlohmann::json(speedup_vs_native) : nlohmann::json()},
      {"verified", verified}};
  j.update(extra);
  return j;
}

void print_table(std::ostream& out, const std::vector<Record>& records,
                 const std::string& size_header) {
  std::size_t width = size_header.size(), name = 15;
  for (const auto& r : records) {
    width = std::max(width, size_text(r.size).size());
    name = std::max(name, r.strategy.size() + 1);
  }
  out << fmt::format("{:>{}}  {:<{}}{:>10}{:>9}{:>10}{:>11}{:>5}  {}\n", size_header, width,
                     "strategy", name, "mean ms", "std ms", "GFLOP/s", "vs native", "T",
                     "verified");
  std::string previous;
  for (const auto& r : records) {
    std::string size = size_text(r.size);
    if (!previous.empty() && size != previous) out << "\n";
    previous = size;
    // An unverified row's time is not comparable: no speed-up is claimed for it.
    out << fmt::format("{:>{}}  {:<{}}{:>10.3f}{:>9.3f}{:>10}{:>11}{:>5}  {}\n", size, width,
                       r.strategy, name, r.mean_ms, r.std_ms,
                       r.gflops ? fmt::format("{:.1f}", *r.gflops) : "-",
                       r.verified ? fmt::format("{:.2f}x", r.speedup_vs_native) : "-", r.reps,
                       r.verified ? "yes" : "NO");
  }
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

// One line per strategy across the sizes.
std::string line_plot(const std::vector<Record>& records, const std::vector<std::string>& sizes,
                      const std::vector<std::string>& strategies) {
  std::string script = fmt::format("set xrange [-0.5:{}.5]\n", sizes.size() - 1);
  std::string plot = "plot ";
  for (std::size_t s = 0; s < strategies.size(); ++s) {
    script += fmt::format("$d{} << EOD\n", s);
    for (const auto& r : records)
      if (r.strategy == strategies[s]) {
        auto x = std::find(sizes.begin(), sizes.end(), size_text(r.size)) - sizes.begin();
        script += fmt::format("{} {} {}\n", x, gp_quote(size_text(r.size)), r.speedup_vs_native);
      }
    script += "EOD\n";
    const bool reference = strategies[s] == "native";
    plot += fmt::format("{}$d{} using 1:3:xtic(2) with linespoints {} title {}", s ? ", " : "", s,
                        reference ? "dashtype 2 lc rgb \"black\"" : "lw 2 pt 7",
                        gp_quote(strategies[s]));
  }
  return script + plot + "\n";
}

// One size only (an optimizer run): a bar per strategy, labelled with its speed-up.
std::string bar_plot(const std::vector<Record>& records) {
  std::string script = fmt::format(
      "set xrange [-0.6:{}.6]\nset style fill solid 0.7\n"
      "set boxwidth 0.6\nunset key\n$d << EOD\n",
      records.size() - 1);
  for (std::size_t i = 0; i < records.size(); ++i)
    script +=
        fmt::format("{} {} {}\n", i, gp_quote(records[i].strategy), records[i].speedup_vs_native);
  return script +
         "EOD\nplot $d using 1:3:xtic(2) with boxes lc rgb \"#3b75af\", "
         "$d using 1:3:(sprintf(\"%.2fx\", $3)) with labels offset 0,1, "
         "1 with lines dashtype 2 lc rgb \"black\"\n";
}

// Draws `records` (all verified) with gnuplot's `term`.
void draw_plot(const std::string& path, const std::vector<Record>& records,
               const std::string& title, const std::string& size_name, const std::string& xlabel,
               const std::string& term) {
  const auto sizes = unique_in_order(records, [](const Record& r) { return size_text(r.size); });
  const auto strategies = unique_in_order(records, [](const Record& r) { return r.strategy; });
  const bool bars = sizes.size() == 1;

  std::string script = "set terminal " + term + " size 960,600 noenhanced\n";
  script += "set output " + gp_quote(path) + "\n";
  script += "set title " + gp_quote(title) + "\n";
  script += "set xlabel " +
            gp_quote(bars ? "strategy (" + size_name + " " + sizes[0] + ")" : xlabel) +
            "\nset ylabel \"speed-up vs native (x)\"\n";
  script += "set grid\nset key outside right\nset yrange [0:*]\n";
  script += bars ? bar_plot(records) : line_plot(records, sizes, strategies);

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

}  // namespace

std::optional<std::string> write_plot(const std::string& path, const std::vector<Record>& records,
                                      const std::string& title, const std::string& size_name,
                                      const std::string& xlabel) {
  const std::string term = png_terminal();
  if (term.empty())
    return "no plot: gnuplot with a PNG terminal is not installed; install it with "
           "`sudo apt-get install gnuplot-nox` (Debian/Ubuntu) and run again to get " +
           path;
  std::vector<Record> verified;
  std::copy_if(records.begin(), records.end(), std::back_inserter(verified),
               [](const Record& r) { return r.verified; });
  if (verified.empty())
    return "no plot: no row was verified, so there is nothing to draw in " + path;
  draw_plot(path, verified, title, size_name, xlabel, term);
  return std::nullopt;
}

}  // namespace treetensor::bench
