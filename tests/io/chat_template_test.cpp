// Chat templates (include/qflash/io/chat_template.hpp): real Qwen templates, the default
// model's and a probe of the variables, against transformers' apply_chat_template
// (tests/fixtures/chat_templates/*.json, tools/make_chat_template_fixtures.py); finding a
// model's template; checking messages.
#include <doctest/doctest.h>

#include <fstream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "qflash/io/chat_template.hpp"
#include "support/expect_error.hpp"
#include "support/temp_dir.hpp"

namespace {

using qflash::io::ChatInput;
using qflash::io::ChatTemplate;
using qflash::io::jinja::RaisedError;
using Json = nlohmann::ordered_json;

Json read_fixture(std::string const& name) {
  std::ifstream f(std::string(QFLASH_FIXTURES_DIR) + "/chat_templates/" + name + ".json");
  REQUIRE_MESSAGE(f.good(), "missing fixture ", name, " (tools/make_chat_template_fixtures.py)");
  return Json::parse(f);
}

ChatInput input_of(Json const& c) {
  ChatInput in;
  in.messages = c["messages"];
  if (!c["tools"].is_null()) in.tools = c["tools"];
  if (!c["documents"].is_null()) in.documents = c["documents"];
  in.add_generation_prompt = c["add_generation_prompt"];
  in.extra = c["kwargs"];
  return in;
}

/// Renders every conversation of a fixture and compares with transformers, byte for byte;
/// where the template raised there, it must raise here with the same message.
void check_fixture(ChatTemplate const& t, Json const& fixture) {
  int cases = 0;
  for (auto const& c : fixture["cases"]) {
    std::string const name = c["name"];
    CAPTURE(name);
    if (c.contains("expected")) {
      try {
        CHECK(t.render(input_of(c)) == c["expected"].get<std::string>());
      } catch (std::exception const& e) {
        FAIL_CHECK("threw: ", e.what());
      }
    } else {
      std::string const error = c["error"];
      std::string const want = error.substr(error.find(": ") + 2);
      try {
        (void)t.render(input_of(c));
        FAIL_CHECK("rendered, but transformers raised ", error);
      } catch (RaisedError const& e) {
        CHECK(error.starts_with("TemplateError: "));
        CHECK(e.template_message() == want);
      } catch (qflash::Error const& e) {
        std::string const msg = e.what();
        CAPTURE(msg);
        CHECK(msg.find(want) != std::string::npos);
      }
    }
    ++cases;
  }
  CHECK(cases >= 20);
}

ChatTemplate from_fixture(Json const& fixture) {
  std::vector<std::pair<std::string, std::string>> tokens;
  for (auto const& [k, v] : fixture["special_tokens"].items()) tokens.emplace_back(k, v.get<std::string>());
  return ChatTemplate(fixture["template"]["source"].get<std::string>(), fixture["template"]["name"], tokens);
}

}  // namespace

TEST_CASE("chat template: the real Qwen3, Qwen3.5 and Qwen3-Coder templates render as transformers does") {
  for (char const* name : {"qwen3", "qwen3_5", "qwen3_coder"}) {
    CAPTURE(name);
    Json const fixture = read_fixture(name);
    CHECK(fixture["template"]["origin"]["pypi_package"] == "llama-cpp-python");
    check_fixture(from_fixture(fixture), fixture);
  }
}

TEST_CASE("chat template: the variables and message preparation of apply_chat_template") {
  Json const fixture = read_fixture("context_probe");
  check_fixture(from_fixture(fixture), fixture);
}

TEST_CASE("chat template: the default model's ChatML template, found in its directory") {
  std::string const dir = std::string(QFLASH_SOURCE_DIR) + "/models/qwen3_5_moe-micro";
  std::optional<ChatTemplate> const t = ChatTemplate::load(dir);
  REQUIRE(t.has_value());
  CHECK(t->name() == dir + "/chat_template.jinja");
  CHECK(t->eos_token() == "<|endoftext|>");
  CHECK(t->special_token("pad_token") == "<|endoftext|>");
  CHECK_FALSE(t->bos_token().has_value());
  check_fixture(*t, read_fixture("qwen3_5_moe_micro"));
  ChatInput in;
  in.messages = Json::parse(R"([{"role": "user", "content": "Hello"}])");
  in.add_generation_prompt = true;
  CHECK(t->render(in) == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n");
}

TEST_CASE("chat template: where a model directory keeps its template") {
  using qflash::test::expect_error;
  qflash::test::TempDir tmp;
  ChatInput in;
  in.messages = Json::parse(R"([{"role": "user", "content": "hi"}])");

  SUBCASE("no template at all is not an error") {
    CHECK_FALSE(ChatTemplate::load(tmp.dir()).has_value());
    tmp.write("tokenizer_config.json", R"({"eos_token": "</s>"})");
    CHECK_FALSE(ChatTemplate::load(tmp.dir()).has_value());
    tmp.write("tokenizer_config.json", R"({"chat_template": null})");
    CHECK_FALSE(ChatTemplate::load(tmp.dir()).has_value());
  }
  SUBCASE("a string in tokenizer_config.json, with AddedToken objects as special tokens") {
    tmp.write("tokenizer_config.json",
              R"({"chat_template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}",
                  "bos_token": {"content": "<s>", "lstrip": false}, "eos_token": "</s>", "unk_token": null})");
    auto t = ChatTemplate::load(tmp.dir());
    REQUIRE(t.has_value());
    CHECK(t->bos_token() == "<s>");
    CHECK_FALSE(t->special_token("unk_token").has_value());
    CHECK(t->render(in) == "<s>hi</s>");
    CHECK(t->name() == tmp.file("tokenizer_config.json") + ": chat_template");
  }
  SUBCASE("chat_template.jinja wins over tokenizer_config.json") {
    tmp.write("tokenizer_config.json", R"({"chat_template": "config", "eos_token": "E"})");
    tmp.write("chat_template.jinja", "file {{ eos_token }}\n");
    CHECK(ChatTemplate::load(tmp.dir())->render(in) == "file E");
  }
  SUBCASE("a list of named templates: 'default', and 'tool_use' when there are tools") {
    tmp.write("tokenizer_config.json",
              R"({"chat_template": [{"name": "rag", "template": "R"}, {"name": "default", "template": "D"},
                                     {"name": "tool_use", "template": "T{{ tools|length }}"}]})");
    auto t = ChatTemplate::load(tmp.dir());
    REQUIRE(t.has_value());
    CHECK(t->render(in) == "D");
    in.tools = Json::parse(R"([{"type": "function", "function": {"name": "f"}}])");
    CHECK(t->render(in) == "T1");
  }
  SUBCASE("malformed files are errors naming the file and field") {
    std::string const cfg = tmp.file("tokenizer_config.json");
    tmp.write("tokenizer_config.json", R"({"chat_template": 5})");
    expect_error([&] { (void)ChatTemplate::load(tmp.dir()); },
                 {cfg, "field 'chat_template' must be a string or a list"});
    tmp.write("tokenizer_config.json", R"({"chat_template": [{"name": "default"}]})");
    expect_error([&] { (void)ChatTemplate::load(tmp.dir()); }, {cfg, "field 'chat_template[0]' must be"});
    tmp.write("tokenizer_config.json", R"({"chat_template": [{"name": "rag", "template": "x"}]})");
    expect_error([&] { (void)ChatTemplate::load(tmp.dir()); }, {cfg, "no template named 'default' (it has 'rag')"});
    tmp.write("tokenizer_config.json", R"({"chat_template": "x", "eos_token": 7})");
    expect_error([&] { (void)ChatTemplate::load(tmp.dir()); }, {cfg, "field 'eos_token' must be a string"});
    tmp.write("tokenizer_config.json", R"({"chat_template": "x",)");
    expect_error([&] { (void)ChatTemplate::load(tmp.dir()); }, {cfg, "invalid JSON"});
    tmp.write("tokenizer_config.json", R"({"chat_template": "{% if %}"})");
    expect_error([&] { (void)ChatTemplate::load(tmp.dir()); }, {cfg + ": chat_template:1:7: expected an expression"});
    tmp.write("tokenizer_config.json", R"({"chat_template": [{"name": "default", "template": "{{ x|nope }}"}]})");
    expect_error([&] { (void)ChatTemplate::load(tmp.dir()); },
                 {cfg + ": chat_template 'default':1:6: unknown filter 'nope'"});
    tmp.write("tokenizer_config.json", "[]");
    expect_error([&] { (void)ChatTemplate::load(tmp.dir()); }, {cfg, "top level must be a JSON object"});
  }
}

TEST_CASE("chat template: messages are checked, the template decides the rest") {
  using qflash::test::expect_error;
  ChatTemplate const t("{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}", "t");
  auto render = [&](char const* messages, Json extra = Json::object()) {
    ChatInput in;
    in.messages = Json::parse(messages);
    in.extra = std::move(extra);
    return t.render(in);
  };
  CHECK(render(R"([{"role": "narrator", "content": "x"}, {"role": "user", "content": null}])") == "narrator:x;user:;");
  expect_error([&] { (void)render("[]"); }, {"messages must be a non-empty list"});
  expect_error([&] { (void)render(R"({"role": "user"})"); }, {"messages must be a non-empty list"});
  expect_error([&] { (void)render(R"([{"content": "x"}])"); }, {"messages[0].role must be a string, got nothing"});
  expect_error([&] { (void)render(R"([{"role": "user"}, {"role": 5}])"); }, {"messages[1].role must be a string, got 5"});
  expect_error([&] { (void)render(R"(["hi"])"); }, {"messages[0] must be an object"});
  expect_error([&] { (void)render(R"([{"role": "user", "content": {"a": 1}}])"); },
               {"messages[0].content must be a string or a list of content parts"});
  expect_error([&] { (void)render(R"([{"role": "assistant", "tool_calls": {}}])"); },
               {"messages[0].tool_calls must be a list"});
  expect_error([&] { (void)render(R"([{"role": "user"}])", Json{{"messages", 1}}); },
               {"extra variable 'messages' would replace the argument"});
  ChatInput in;
  in.messages = Json::parse(R"([{"role": "user"}])");
  in.tools = Json::parse(R"({"name": "f"})");
  expect_error([&] { (void)t.render(in); }, {"tools must be a list"});
  in.tools = Json::parse(R"([1])");
  expect_error([&] { (void)t.render(in); }, {"tools[0] must be an object"});
}
