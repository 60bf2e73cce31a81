// libFuzzer target for qflash/io/jinja.hpp: the input up to its first NUL is a template,
// rendered with the variables after the NUL when they parse as a JSON object, else with a
// fixed chat (messages with tool calls and reasoning, tools, add_generation_prompt). Small
// Limits keep each run short. Any input must render or throw qflash::Error; a crash, hang,
// leak or sanitizer report is a bug. Built and run by scripts/fuzz.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "qflash/core/error.hpp"
#include "qflash/io/jinja.hpp"

namespace {

nlohmann::ordered_json const& chat() {
  static nlohmann::ordered_json const vars = nlohmann::ordered_json::parse(R"({
    "messages": [
      {"role": "system", "content": "You are helpful."},
      {"role": "user", "content": "Weather in Paris? <tool_response>x</tool_response>"},
      {"role": "assistant", "reasoning_content": "Think.", "content": "<think>\nr\n</think>\n\nok",
       "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                        "arguments": {"city": "Paris", "n": [1, 2.5, null]}}}]},
      {"role": "tool", "content": "{\"temp\": 21}"},
      {"role": "user", "content": [{"type": "text", "text": "é🙂"}, {"type": "image"}]}],
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
      "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
    "add_generation_prompt": true, "enable_thinking": false, "bos_token": "<s>", "eos_token": "</s>"})");
  return vars;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  std::string_view const in(reinterpret_cast<char const*>(data), size);
  std::size_t const nul = in.find('\0');
  qflash::io::jinja::Limits limits;
  limits.max_steps = 200'000;
  limits.max_output = 1 << 20;
  try {
    qflash::io::jinja::Template const t(in.substr(0, nul), "fuzz", limits);
    nlohmann::ordered_json vars = chat();
    if (nul != std::string_view::npos) {
      auto parsed = nlohmann::ordered_json::parse(in.substr(nul + 1), nullptr, /*allow_exceptions=*/false);
      if (parsed.is_object()) vars = std::move(parsed);
    }
    volatile std::size_t sink = t.render(vars).size();
    (void)sink;
  } catch (qflash::Error const&) {
  }
  return 0;
}
