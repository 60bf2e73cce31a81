/// @file
/// A one-line progress bar for loading weights: bytes and items done, rate and ETA, redrawn
/// in place at most every 100 ms. Drawn only when enabled (by default: stderr is a terminal),
/// so logs and pipes stay clean. Thread-safe: loader threads may call `advance` concurrently.
/// Host only.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <utility>

namespace qflash::io {

class Progress {
 public:
  /// @param label        text before the bar, e.g. "loading weights"
  /// @param total_bytes  bytes expected in all; 0 draws no bar or ETA
  /// @param enabled      draw at all; default: stderr is a TTY
  /// @param out          where to draw (tests pass a temporary file)
  Progress(std::string label, std::uint64_t total_bytes, bool enabled = ::isatty(2) != 0,
           std::FILE* out = stderr)
      : label_(std::move(label)), total_(total_bytes), enabled_(enabled), out_(out),
        start_(Clock::now()) {}
  Progress(Progress const&) = delete;
  Progress& operator=(Progress const&) = delete;
  ~Progress() { finish(); }

  void advance(std::uint64_t bytes, int items = 1) {
    std::lock_guard lock(mutex_);
    done_ += bytes;
    items_ += items;
    if (!enabled_ || finished_) return;
    auto now = Clock::now();
    if (drawn_ && now - last_draw_ < std::chrono::milliseconds(100) && done_ < total_) return;
    draw(now);
  }

  /// Draws the final state and ends the line; later calls do nothing.
  void finish() {
    std::lock_guard lock(mutex_);
    if (finished_) return;
    finished_ = true;
    if (!enabled_) return;
    draw(Clock::now());
    std::fputc('\n', out_);
    std::fflush(out_);
  }

  [[nodiscard]] std::uint64_t done_bytes() const {
    std::lock_guard lock(mutex_);
    return done_;
  }
  [[nodiscard]] int done_items() const {
    std::lock_guard lock(mutex_);
    return items_;
  }

 private:
  using Clock = std::chrono::steady_clock;

  void draw(Clock::time_point now) {
    constexpr std::size_t kWidth = 30;
    double const gib = 1024.0 * 1024.0 * 1024.0;
    double const secs = std::chrono::duration<double>(now - start_).count();
    double const frac =
        total_ ? std::min(1.0, static_cast<double>(done_) / static_cast<double>(total_)) : 0.0;
    // Appends only: GCC 12 -O3 warns falsely (-Wrestrict, GCC bug 105329) on "\r" + label_.
    std::string line;
    line += '\r';
    line += label_;
    line += ' ';
    if (total_) {
      auto const fill = static_cast<std::size_t>(frac * static_cast<double>(kWidth));
      line += '[';
      line.append(fill, '#');
      line.append(kWidth - fill, '.');
      line += "] ";
    }
    char buf[160];
    double const rate = secs > 0 ? static_cast<double>(done_) / secs : 0.0;
    if (total_)
      std::snprintf(buf, sizeof buf, "%3d%% %.2f/%.2f GiB, %d items, %.2f GiB/s",
                    static_cast<int>(frac * 100), static_cast<double>(done_) / gib,
                    static_cast<double>(total_) / gib, items_, rate / gib);
    else
      std::snprintf(buf, sizeof buf, "%.2f GiB, %d items, %.2f GiB/s",
                    static_cast<double>(done_) / gib, items_, rate / gib);
    line += buf;
    if (total_ && rate > 0 && done_ < total_) {
      std::snprintf(buf, sizeof buf, ", ETA %.0f s",
                    static_cast<double>(total_ - done_) / rate);
      line += buf;
    }
    line += "\x1b[K";  // clear what a longer previous line left
    std::fputs(line.c_str(), out_);
    std::fflush(out_);
    drawn_ = true;
    last_draw_ = now;
  }

  std::string label_;
  std::uint64_t total_;
  bool enabled_;
  std::FILE* out_;
  Clock::time_point start_, last_draw_{};
  mutable std::mutex mutex_;
  std::uint64_t done_ = 0;
  int items_ = 0;
  bool drawn_ = false;
  bool finished_ = false;
};

}  // namespace qflash::io
