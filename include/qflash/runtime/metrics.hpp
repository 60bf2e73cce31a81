/// @file
/// The Prometheus text exposition format (version 0.0.4), written directly: counters, gauges
/// and histograms with fixed buckets. Debian packages no Prometheus C++ client, and the format
/// is a few lines of text per metric. Not thread-safe: the owner guards its metrics.
#pragma once

#include <charconv>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace qflash::runtime::prom {

/// A sample value as Prometheus reads it: shortest round-trip decimal, +Inf, -Inf or NaN.
inline std::string number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[32];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  return ec == std::errc{} ? std::string(buf, end) : "NaN";
}

/// The `# HELP` and `# TYPE` lines of a metric.
inline void header(std::string& out, std::string_view name, std::string_view help, std::string_view type) {
  out.append("# HELP ").append(name).append(" ").append(help).append("\n");
  out.append("# TYPE ").append(name).append(" ").append(type).append("\n");
}

/// One sample line; `labels` is the inside of the braces (e.g. `layer="3"`), or empty.
inline void sample(std::string& out, std::string_view name, double value, std::string_view labels = {}) {
  out.append(name);
  if (!labels.empty()) out.append("{").append(labels).append("}");
  out.append(" ").append(number(value)).append("\n");
}

/// A metric with one sample.
inline void single(std::string& out, std::string_view name, std::string_view help, std::string_view type,
                   double value) {
  header(out, name, help, type);
  sample(out, name, value);
}

/// Observations counted in buckets with the given upper bounds (and +Inf).
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

  void observe(double v) {
    std::size_t i = 0;
    while (i < bounds_.size() && v > bounds_[i]) ++i;
    ++counts_[i];
    sum_ += v;
    ++count_;
  }
  [[nodiscard]] std::int64_t count() const { return count_; }
  [[nodiscard]] double sum() const { return sum_; }

  void write(std::string& out, std::string_view name, std::string_view help) const {
    header(out, name, help, "histogram");
    std::string const bucket = std::string(name) + "_bucket";
    std::int64_t cumulative = 0;
    for (std::size_t i = 0; i <= bounds_.size(); ++i) {
      cumulative += counts_[i];
      std::string const le = i < bounds_.size() ? number(bounds_[i]) : "+Inf";
      sample(out, bucket, static_cast<double>(cumulative), "le=\"" + le + "\"");
    }
    sample(out, std::string(name) + "_sum", sum_);
    sample(out, std::string(name) + "_count", static_cast<double>(count_));
  }

 private:
  std::vector<double> bounds_;
  std::vector<std::int64_t> counts_;  ///< per bucket, not cumulative
  double sum_ = 0;
  std::int64_t count_ = 0;
};

/// Latency buckets in seconds, 1 ms to 5 minutes.
inline std::vector<double> latency_buckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300};
}

}  // namespace qflash::runtime::prom
