/// @file
/// A pluggable log sink, so that `#include` users get no logging dependency. The CLI and the
/// server install spdlog as the sink; the default writes warnings and errors to stderr.
#pragma once

#include <cstdio>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

#include "qflash/core/error.hpp"

namespace qflash {

enum class LogLevel : int { kDebug, kInfo, kWarn, kError };

using LogSink = std::function<void(LogLevel, std::string_view)>;

namespace detail {
inline void default_log_sink(LogLevel level, std::string_view message) {
  if (level < LogLevel::kWarn) return;
  std::fprintf(stderr, "qflash %s: %.*s\n", level == LogLevel::kWarn ? "warning" : "error",
               static_cast<int>(message.size()), message.data());
}
struct LogState {
  std::mutex mutex;
  LogSink sink = default_log_sink;
};
inline LogState& log_state() {
  static LogState state;
  return state;
}
}  // namespace detail

/// Replaces the process-wide sink; an empty function silences logging.
inline void set_log_sink(LogSink sink) {
  auto& s = detail::log_state();
  std::lock_guard lock(s.mutex);
  s.sink = std::move(sink);
}

inline void log(LogLevel level, std::string_view message) {
  auto& s = detail::log_state();
  std::lock_guard lock(s.mutex);
  if (s.sink) s.sink(level, message);
}

}  // namespace qflash

#define QFLASH_LOG_DEBUG(...) ::qflash::log(::qflash::LogLevel::kDebug, ::qflash::detail::concat(__VA_ARGS__))
#define QFLASH_LOG_INFO(...) ::qflash::log(::qflash::LogLevel::kInfo, ::qflash::detail::concat(__VA_ARGS__))
#define QFLASH_LOG_WARN(...) ::qflash::log(::qflash::LogLevel::kWarn, ::qflash::detail::concat(__VA_ARGS__))
