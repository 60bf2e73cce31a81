/// @file
/// Host-layer errors: `qflash::Error` carries where it was raised; `QFLASH_CHECK` throws it.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "qflash/core/status.hpp"

namespace qflash {

class Error : public std::runtime_error {
 public:
  Error(std::string message, char const* file, int line)
      : std::runtime_error(std::move(message)), file_(file), line_(line) {}

  [[nodiscard]] char const* file() const noexcept { return file_; }
  [[nodiscard]] int line() const noexcept { return line_; }

 private:
  char const* file_;
  int line_;
};

namespace detail {
template <class... Parts>
std::string concat(Parts const&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}
}  // namespace detail

}  // namespace qflash

/// Throws qflash::Error with the concatenated message parts when `cond` is false.
#define QFLASH_CHECK(cond, ...)                                                        \
  do {                                                                                 \
    if (!(cond)) [[unlikely]]                                                          \
      throw ::qflash::Error(::qflash::detail::concat(__VA_ARGS__), __FILE__, __LINE__); \
  } while (0)

/// Throws qflash::Error unconditionally.
#define QFLASH_FAIL(...) \
  throw ::qflash::Error(::qflash::detail::concat(__VA_ARGS__), __FILE__, __LINE__)

/// Turns a kernel-layer Status into an Error naming the operation.
#define QFLASH_CHECK_STATUS(expr, what)                                                   \
  do {                                                                                    \
    ::qflash::Status qflash_status_ = (expr);                                             \
    QFLASH_CHECK(qflash_status_ == ::qflash::Status::kSuccess, what, ": ",                \
                 ::qflash::to_string(qflash_status_));                                    \
  } while (0)
