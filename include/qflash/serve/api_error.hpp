/// @file
/// The errors the HTTP server answers with, in OpenAI's shape
/// `{"error": {"message", "type", "param", "code"}}`, so that OpenAI clients raise the
/// exception class that matches the status (openai.BadRequestError for 400, ...). Request
/// parsing (openai_request.hpp) and the server (server.hpp) throw ApiError; the server turns
/// it into the response. Host only.
#pragma once

#include <string>
#include <string_view>
#include <utility>

#include <nlohmann/json.hpp>

#include "qflash/core/error.hpp"

namespace qflash::serve {

/// A request the server refuses or fails: the HTTP status, the request field at fault (empty:
/// none) and OpenAI's machine-readable code (empty: none). The message went through
/// printable() (QFLASH_API_FAIL), so echoing it to a client or a log is safe.
class ApiError : public Error {
 public:
  ApiError(int status, std::string param, std::string code, std::string message, char const* file, int line)
      : Error(std::move(message), file, line), status_(status), param_(std::move(param)), code_(std::move(code)) {}

  [[nodiscard]] int status() const noexcept { return status_; }
  [[nodiscard]] std::string const& param() const noexcept { return param_; }
  [[nodiscard]] std::string const& code() const noexcept { return code_; }

 private:
  int status_;
  std::string param_;
  std::string code_;
};

/// Throws ApiError(status, param, code) with the concatenated message parts.
#define QFLASH_API_FAIL(status, param, code, ...) \
  throw ::qflash::serve::ApiError(status, param, code, ::qflash::detail::concat(__VA_ARGS__), __FILE__, __LINE__)

/// OpenAI's error type for an HTTP status.
constexpr std::string_view error_type(int status) {
  if (status == 429) return "rate_limit_error";
  if (status >= 500) return "server_error";
  return "invalid_request_error";
}

/// The body of an error response.
inline nlohmann::ordered_json error_body(int status, std::string_view message, std::string_view param = {},
                                         std::string_view code = {}) {
  nlohmann::ordered_json e = nlohmann::ordered_json::object();
  e["message"] = message;
  e["type"] = error_type(status);
  e["param"] = param.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(param);
  e["code"] = code.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(code);
  return {{"error", std::move(e)}};
}

inline nlohmann::ordered_json error_body(ApiError const& e) {
  return error_body(e.status(), e.what(), e.param(), e.code());
}

}  // namespace qflash::serve
