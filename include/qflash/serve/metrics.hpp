/// @file
/// The HTTP server's own counters, which /metrics shows after the engine's: requests by
/// endpoint and status, their durations, requests in flight, and streams whose client went
/// away. Prometheus text format, names under `qflash:` like the engine's. Thread-safe. Host only.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

namespace qflash::serve {

/// What a request asked for; unknown paths share kOther so that labels stay few.
enum class Route { kCompletions, kChat, kGenerate, kModels, kHealth, kMetrics, kOther };
inline constexpr std::size_t kRouteCount = 7;

constexpr std::string_view route_label(Route r) {
  switch (r) {
    case Route::kCompletions: return "/v1/completions";
    case Route::kChat: return "/v1/chat/completions";
    case Route::kGenerate: return "/generate";
    case Route::kModels: return "/v1/models";
    case Route::kHealth: return "/health";
    case Route::kMetrics: return "/metrics";
    case Route::kOther: return "other";
  }
  return "other";
}

class HttpMetrics {
 public:
  /// Upper bounds (seconds) of the request duration histogram: health checks take
  /// milliseconds, long generations minutes.
  static constexpr std::array<double, 14> kBuckets = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                                      1,     2.5,  5,     10,   30,  60,  300};

  void started() { in_flight_.fetch_add(1, std::memory_order_relaxed); }

  /// A request `started()` earlier has been answered (for a stream: its last byte sent).
  void finished(Route r, int status, double seconds) {
    in_flight_.fetch_sub(1, std::memory_order_relaxed);
    std::lock_guard lock(mutex_);
    ++requests_[{r, status}];
    Histogram& h = durations_[static_cast<std::size_t>(r)];
    for (std::size_t i = 0; i < kBuckets.size(); ++i) h.le[i] += seconds <= kBuckets[i];
    h.sum += seconds;
    ++h.count;
  }

  /// A streamed response ended because its client stopped reading.
  void stream_disconnected() { disconnects_.fetch_add(1, std::memory_order_relaxed); }

  [[nodiscard]] std::int64_t in_flight() const { return in_flight_.load(std::memory_order_relaxed); }

  void write(std::string& out) const {
    std::lock_guard lock(mutex_);
    out += "# HELP qflash:http_requests_total HTTP requests answered, by endpoint and status.\n"
           "# TYPE qflash:http_requests_total counter\n";
    for (auto const& [key, n] : requests_)
      out += "qflash:http_requests_total{endpoint=\"" + std::string(route_label(key.first)) + "\",status=\"" +
             std::to_string(key.second) + "\"} " + std::to_string(n) + "\n";
    out += "# HELP qflash:http_request_duration_seconds Time from a request's arrival to its last byte sent.\n"
           "# TYPE qflash:http_request_duration_seconds histogram\n";
    for (std::size_t r = 0; r < kRouteCount; ++r) {
      Histogram const& h = durations_[r];
      if (h.count == 0) continue;
      std::string const label = "endpoint=\"" + std::string(route_label(static_cast<Route>(r))) + "\"";
      for (std::size_t i = 0; i < kBuckets.size(); ++i)
        out += "qflash:http_request_duration_seconds_bucket{" + label + ",le=\"" + number(kBuckets[i]) + "\"} " +
               std::to_string(h.le[i]) + "\n";
      out += "qflash:http_request_duration_seconds_bucket{" + label + ",le=\"+Inf\"} " + std::to_string(h.count) +
             "\n";
      out += "qflash:http_request_duration_seconds_sum{" + label + "} " + number(h.sum) + "\n";
      out += "qflash:http_request_duration_seconds_count{" + label + "} " + std::to_string(h.count) + "\n";
    }
    out += "# HELP qflash:http_requests_in_flight HTTP requests being answered.\n"
           "# TYPE qflash:http_requests_in_flight gauge\n"
           "qflash:http_requests_in_flight " + std::to_string(in_flight()) + "\n";
    out += "# HELP qflash:http_stream_disconnects_total Streamed responses cut off by their client (the request "
           "was cancelled).\n"
           "# TYPE qflash:http_stream_disconnects_total counter\n"
           "qflash:http_stream_disconnects_total " + std::to_string(disconnects_.load()) + "\n";
  }

 private:
  struct Histogram {
    std::array<std::uint64_t, kBuckets.size()> le{};  // observations <= kBuckets[i] (cumulative)
    double sum = 0;
    std::uint64_t count = 0;
  };

  static std::string number(double x) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.9g", x);
    return buf;
  }

  mutable std::mutex mutex_;
  std::map<std::pair<Route, int>, std::uint64_t> requests_;
  std::array<Histogram, kRouteCount> durations_{};
  std::atomic<std::int64_t> in_flight_{0};
  std::atomic<std::uint64_t> disconnects_{0};
};

}  // namespace qflash::serve
