// Command-line argument helpers of the qflash program: validators with human-sized messages,
// the llama.cpp spellings qflash accepts or refuses, escapes in --stop, prompt sources.
#pragma once

#include <CLI/CLI.hpp>
#include <algorithm>

#include <charconv>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <iostream>
#include <iterator>
#include <limits>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "qflash/core/error.hpp"
#include "qflash/io/detail/utf8.hpp"

namespace qflash::cli {

/// Exit statuses of the qflash program (also in `qflash --help`).
inline constexpr int kExitOk = 0;
inline constexpr int kExitRuntimeError = 1;  ///< loading or running failed
inline constexpr int kExitUsageError = 2;    ///< the command line is invalid

/// A command-line mistake: reported with a pointer to --help, exit status kExitUsageError.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline std::optional<long long> parse_integer(std::string_view s) {
  long long v = 0;
  auto const [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc{} || end != s.data() + s.size() || s.empty()) return std::nullopt;
  return v;
}

inline std::optional<double> parse_number(std::string_view s) {
  double v = 0;
  auto const [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc{} || end != s.data() + s.size() || s.empty() || !std::isfinite(v)) return std::nullopt;
  return v;
}

/// An integer in [lo, hi], e.g. "must be an integer >= 1" rather than a 10-digit range.
/// `hi` at int's maximum (the option's type) reads as no upper bound in the message.
inline CLI::Validator integer_in(long long lo, long long hi = std::numeric_limits<int>::max()) {
  bool const open = hi >= std::numeric_limits<int>::max();
  std::string const want = open ? "an integer >= " + std::to_string(lo)
                                : "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  return CLI::Validator(
      [=](std::string& s) -> std::string {
        auto v = parse_integer(s);
        if (!v && s.find_first_not_of("-0123456789") == std::string::npos && s.size() > 1)
          return "'" + s + "' is too large";
        if (!v || *v < lo) return "must be " + want + ", got '" + printable(s) + "'";
        if (*v > hi) return "'" + s + "' is too large (at most " + std::to_string(hi) + ")";
        return {};
      },
      "", "integer_in");
}

/// A finite number x with lo <= x (lo < x when `lo_open`) and x <= hi.
inline CLI::Validator number_in(double lo, double hi, bool lo_open = false) {
  auto fmt = [](double x) {
    std::ostringstream os;
    os << x;
    return os.str();
  };
  std::string const want = std::isinf(hi) ? (lo_open ? "a number > " : "a number >= ") + fmt(lo)
                                          : std::string("a number in ") + (lo_open ? "(" : "[") + fmt(lo) + ", " +
                                                fmt(hi) + "]";
  return CLI::Validator(
      [=](std::string& s) -> std::string {
        auto v = parse_number(s);
        if (!v || *v < lo || (lo_open && *v == lo) || *v > hi) return "must be " + want + ", got '" + printable(s) + "'";
        return {};
      },
      "", "number_in");
}

/// A value that is not empty.
inline CLI::Validator not_empty() {
  return CLI::Validator([](std::string& s) -> std::string { return s.empty() ? "must not be empty" : ""; }, "",
                        "not_empty");
}

/// Comma-separated token ids ("1,2,3"); each must fit a token id (int32, non-negative).
inline std::vector<std::int32_t> parse_ids(std::string const& text) {
  std::vector<std::int32_t> ids;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    auto v = parse_integer(item);
    if (!v || *v < 0 || *v > std::numeric_limits<std::int32_t>::max())
      throw UsageError("--prompt-ids: '" + printable(item) + "' is not a token id (expected integers in [0, " +
                       std::to_string(std::numeric_limits<std::int32_t>::max()) + "], e.g. 1,2,3)");
    ids.push_back(static_cast<std::int32_t>(*v));
  }
  if (ids.empty()) throw UsageError("--prompt-ids: no ids given");
  return ids;
}

/// `text` with C-style escapes replaced: \n \t \r \\ \" \' \0 \xNN (what llama.cpp's --stop
/// and -p -e understand); an unknown or cut escape is a UsageError naming `flag`.
inline std::string unescape(std::string_view text, std::string_view flag) {
  std::string out;
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '\\') {
      out += text[i];
      continue;
    }
    if (++i == text.size()) throw UsageError(std::string(flag) + ": '" + printable(text) + "' ends in a lone '\\'");
    switch (text[i]) {
      case 'n': out += '\n'; break;
      case 't': out += '\t'; break;
      case 'r': out += '\r'; break;
      case '0': out += '\0'; break;
      case '\\': out += '\\'; break;
      case '"': out += '"'; break;
      case '\'': out += '\''; break;
      case 'x': {
        unsigned v = 0;
        auto const* b = text.data() + i + 1;
        auto const* e = text.data() + std::min(text.size(), i + 3);
        auto [end, ec] = std::from_chars(b, e, v, 16);
        if (ec != std::errc{} || end != e || e - b != 2)
          throw UsageError(std::string(flag) + ": '\\x' must be followed by two hex digits in '" + printable(text) + "'");
        out += static_cast<char>(v);
        i += 2;
        break;
      }
      default:
        throw UsageError(std::string(flag) + ": unknown escape '\\" + printable(text.substr(i, 1)) + "' in '" +
                         printable(text) + "' (known: \\n \\t \\r \\0 \\\\ \\\" \\' \\xNN)");
    }
  }
  return out;
}

/// Throws UsageError unless `text` (from `what`: a flag, or a flag and its file) is UTF-8.
inline void require_utf8(std::string_view text, std::string const& what) {
  if (std::size_t const bad = io::detail::utf8_find_invalid(text); bad != std::string_view::npos)
    throw UsageError(what + " is not valid UTF-8 (byte " + std::to_string(bad) + " of " + std::to_string(text.size()) +
                     ")");
}

/// The whole of a UTF-8 text file ("-": standard input), for -f, -p - and --text.
inline std::string read_text(std::string const& path, std::string_view flag) {
  std::string text;
  if (path == "-") {
    text.assign(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
  } else {
    std::ifstream f(path, std::ios::binary);
    if (!f) throw UsageError(std::string(flag) + ": cannot open '" + printable(path) + "'");
    text.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  require_utf8(text, std::string(flag) + (path == "-" ? ": standard input" : ": '" + printable(path) + "'"));
  return text;
}

/// Spellings from llama.cpp that CLI11 would misread (`-ngl 99` as `-n gl`) or that mean
/// something qflash does differently: a UsageError that says what to use instead.
inline void refuse_foreign_flags(std::span<char* const> args) {
  for (std::string_view a : args.subspan(1)) {
    if (a == "--") break;
    if (a.starts_with("-ngl") || a.starts_with("--n-gpu-layers") || a.starts_with("--gpu-layers"))
      throw UsageError(std::string(a.substr(0, a.find('='))) +
                       ": qflash does not split layers between CPU and GPU; it runs the whole model on "
                       "one device, chosen with --device (cpu or cuda[:N])");
  }
}

/// Whether this build has the model's CUDA instances (--device cuda).
#ifndef QFLASH_CLI_CUDA
#define QFLASH_CLI_CUDA 0
#endif

/// The CUDA device index --device names ("cuda": 0, "cuda:N": N), or nullopt for "cpu".
inline std::optional<int> cuda_device(std::string const& device) {
  if (device == "cpu") return std::nullopt;
  if (device == "cuda") return 0;
  return std::stoi(device.substr(5));  // device_validator accepted "cuda:N"
}

/// Throws UsageError when --device names a CUDA device and this build has no CUDA.
inline void check_cuda_build(std::string const& device) {
  if (cuda_device(device) && !QFLASH_CLI_CUDA)
    throw UsageError("--device " + device +
                     ": this build has no CUDA kernels (configure with -DQFLASH_ENABLE_CUDA=ON where a CUDA toolkit "
                     "is installed)");
}

/// --device's values: cpu, cuda, cuda:N with N a device index.
inline CLI::Validator device_validator() {
  return CLI::Validator(
      [](std::string const& v) -> std::string {
        if (v == "cpu" || v == "cuda") return {};
        std::string_view const n = std::string_view(v).substr(std::min<std::size_t>(v.size(), 5));
        if (v.starts_with("cuda:") && !n.empty() && n.size() <= 4 &&
            std::all_of(n.begin(), n.end(), [](char c) { return c >= '0' && c <= '9'; }))
          return {};
        return "expected cpu, cuda or cuda:N (N a device index), not '" + v + "'";
      },
      "cpu|cuda[:N]");
}

/// The first argument that is not an option (the command), or empty.
inline std::string_view command_of(std::span<char* const> args) {
  for (std::string_view a : args.subspan(1))
    if (!a.starts_with('-')) return a;
  return {};
}

}  // namespace qflash::cli
