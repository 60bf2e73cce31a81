// The Jinja engine (include/qflash/io/jinja.hpp) against jinja2 as transformers runs it
// (tests/fixtures/chat_templates/jinja_cases.json, tools/make_chat_template_fixtures.py), and
// its own errors and limits.
#include <doctest/doctest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "qflash/io/jinja.hpp"
#include "support/expect_error.hpp"

namespace {

using qflash::io::jinja::Limits;
using qflash::io::jinja::RaisedError;
using qflash::io::jinja::Template;
using Json = nlohmann::ordered_json;

Json read_fixture(std::string const& name) {
  std::ifstream f(std::string(QFLASH_FIXTURES_DIR) + "/chat_templates/" + name);
  REQUIRE_MESSAGE(f.good(), "missing fixture ", name, " (tools/make_chat_template_fixtures.py)");
  return Json::parse(f);
}

std::string render(std::string const& source, Json const& vars = Json::object(), Limits limits = {}) {
  return Template(source, "t", limits).render(vars);
}

/// The message of an "ExceptionType: message" fixture error.
std::string python_message(std::string const& error) { return error.substr(error.find(": ") + 2); }

}  // namespace

TEST_CASE("jinja: every fixture case renders as jinja2 does under transformers") {
  Json const fixture = read_fixture("jinja_cases.json");
  REQUIRE(fixture["cases"].size() > 100);
  int rendered = 0, failed_alike = 0;
  for (auto const& c : fixture["cases"]) {
    std::string const name = c["name"];
    std::string const source = c["template"];
    CAPTURE(name);
    CAPTURE(source);
    if (c.contains("expected")) {
      std::string out;
      try {
        out = render(source, c["variables"]);
      } catch (std::exception const& e) {
        FAIL_CHECK("threw: ", e.what());
        continue;
      }
      CHECK(out == c["expected"].get<std::string>());
      ++rendered;
      continue;
    }
    // Python raised: so must we, with the same message (ours adds the template and position).
    std::string const want = python_message(c["error"]);
    try {
      (void)render(source, c["variables"]);
      FAIL_CHECK("rendered, but jinja2 raised ", c["error"].get<std::string>());
    } catch (RaisedError const& e) {
      CHECK(e.template_message() == want);
      ++failed_alike;
    } catch (qflash::Error const& e) {
      std::string const msg = e.what();
      CAPTURE(msg);
      CHECK(msg.starts_with("t:"));
      CHECK(msg.find(want) != std::string::npos);
      ++failed_alike;
    }
  }
  MESSAGE(rendered, " rendered, ", failed_alike, " failed as in Python");
}

TEST_CASE("jinja: parse errors name the template, line, column and what was expected") {
  using qflash::test::expect_error;
  expect_error([] { Template("a\n{{ x|frobnicate }}", "chat_template"); },
               {"chat_template:2:6: unknown filter 'frobnicate'"});
  expect_error([] { Template("{{ x|wordwrap }}", "t"); }, {"t:1:6: filter 'wordwrap' is not supported"});
  expect_error([] { Template("{{ x is frob }}", "t"); }, {"t:1:9: unknown test 'frob'"});
  expect_error([] { Template("x\n{% for m in messages %}\n{{ m }}", "t"); },
               {"t:3:8: unexpected end of template (expected 'endfor' or 'else' to close 'for' opened at 2:1)"});
  expect_error([] { Template("{% if a %}{% for b in c %}{% endif %}", "t"); },
               {"t:1:30: unexpected 'endif' (expected 'endfor' or 'else' to close 'for' opened at 1:11)"});
  expect_error([] { Template("{% endif %}", "t"); }, {"t:1:4: unexpected 'endif'"});
  expect_error([] { Template("{% frob %}", "t"); }, {"t:1:4: unknown tag 'frob'"});
  expect_error([] { Template("{{ 1 + }}", "t"); }, {"t:1:8: unexpected end of print statement '}}'"});
  expect_error([] { Template("{{ (1 }}", "t"); }, {"t:1:7: unexpected '}', expected ')'"});
  expect_error([] { Template("{{ x ", "t"); }, {"t:1:1: unexpected end of template: '{{' is not closed"});
  expect_error([] { Template("{# x", "t"); }, {"t:1:1: missing end of comment tag"});
  expect_error([] { Template("{% break %}", "t"); }, {"t:1:4: 'break' outside of a for loop"});
  expect_error([] { Template("{% for x in y %}{% macro m() %}{% continue %}{% endmacro %}{% endfor %}", "t"); },
               {"'continue' outside of a for loop"});
  expect_error([] { Template("{% include 'x' %}", "t"); }, {"'include' is not supported"});
  expect_error([] { Template("{{ 'a' ! 'b' }}", "t"); }, {"t:1:8: unexpected character '!'"});
  expect_error([] { Template("{{ 'abc }}", "t"); }, {"t:1:4: unterminated string literal"});
  expect_error([] { Template("{{ '\\x4' }}", "t"); }, {"truncated \\xXX escape"});
  expect_error([] { Template("{% set 1 = 2 %}", "t"); }, {"t:1:8: cannot assign to a constant"});
  expect_error([] { Template("{% macro m(a=1, b) %}{% endmacro %}", "t"); },
               {"non-default argument follows default argument"});
  expect_error([] { Template("{{ 99999999999999999999 }}", "t"); }, {"does not fit in 64 bits"});
  expect_error([] { Template(std::string("ok \xff"), "t"); }, {"t: the template is not valid UTF-8 (byte 3)"});
  // columns count characters, not bytes
  expect_error([] { Template("é{{ x|nope }}", "t"); }, {"t:1:7: unknown filter 'nope'"});
}

TEST_CASE("jinja: render errors name the position of the failing expression") {
  using qflash::test::expect_error;
  expect_error([] { (void)render("line\n  {{ messages[0].content.x }}"); },
               {"t:2:14: 'messages' is undefined"});
  expect_error([] { (void)render("{{ x.y.z }}", Json{{"x", Json::object()}}); },
               {"t:1:7: 'dict object' has no attribute 'y'"});
  expect_error([] { (void)render("{{ 1 + 'a' }}"); }, {"t:1:6: unsupported operand type(s) for +: 'int' and 'str'"});
  expect_error([] { (void)render("{% set x = 1 %}{% set x.a = 2 %}"); },
               {"t:1:16: cannot assign attribute on non-namespace object"});
  expect_error([] { (void)render("{{ 2 ** 64 }}"); }, {"integer overflow"});
  expect_error([] { (void)render("{{ 9223372036854775807 + 1 }}"); }, {"integer overflow"});
  expect_error([] { (void)render("{{ 'a'.format(1) }}"); }, {"str.format() is not supported"});
  expect_error([] { (void)render("{{ cycler(1) }}"); }, {"cycler() is not supported"});
  expect_error([] { (void)Template("{{ x }}", "t").render(Json::array()); },
               {"t: the variables must be a JSON object, got array"});
}

TEST_CASE("jinja: raise_exception throws RaisedError with the template's own message") {
  Template const t("{% if not messages %}\n  {{- raise_exception('No messages provided.') }}\n{% endif %}ok", "tpl");
  CHECK(t.render(Json{{"messages", Json::array({1})}}) == "ok");
  try {
    (void)t.render(Json{{"messages", Json::array()}});
    FAIL("no exception");
  } catch (RaisedError const& e) {
    CHECK(e.template_message() == "No messages provided.");
    CHECK(std::string(e.what()) == "tpl:2:7: No messages provided.");
  }
}

TEST_CASE("jinja: hostile templates hit limits, not the stack or the clock") {
  using qflash::test::expect_error;
  SUBCASE("macro recursion") {
    expect_error([] { (void)render("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"); },
                 {"macro calls nest deeper than 100"});
  }
  SUBCASE("deeply nested source") {
    std::string deep = "{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}";
    expect_error([&] { Template(deep, "t"); }, {"t:1:", "template nests deeper than 100 levels"});
    std::string blocks;
    for (int i = 0; i < 200; ++i) blocks += "{% if true %}";
    expect_error([&] { Template(blocks, "t"); }, {"template nests deeper than 100 levels"});
    std::string nots = "{{ " + [] {
      std::string s;
      for (int i = 0; i < 300; ++i) s += "not ";
      return s;
    }() + "1 }}";
    expect_error([&] { Template(nots, "t"); }, {"template nests deeper than 100 levels"});
  }
  SUBCASE("render depth") {
    Limits l;
    l.max_render_depth = 50;
    expect_error([&] { (void)render("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", Json::object(), l); },
                 {"deeper than 50 levels while rendering"});
  }
  SUBCASE("output size") {
    Limits l;
    l.max_output = 1000;
    expect_error([&] { (void)render("{% for i in range(2000) %}x{% endfor %}", Json::object(), l); },
                 {"output exceeds 1000 bytes"});
    expect_error([&] { (void)render("{% set s = 'x' * 2000 %}", Json::object(), l); },
                 {"more than 1000 bytes"});
    // captured output (macros, set blocks) counts while it is being made
    expect_error([&] { (void)render("{% set s %}{% for i in range(2000) %}x{% endfor %}{% endset %}", Json::object(), l); },
                 {"output exceeds 1000 bytes"});
    CHECK(render("{% for i in range(999) %}x{% endfor %}", Json::object(), l).size() == 999);
    // a small value holding one list many times prints large: printing stops at the limit
    for (char const* print : {"{{ b }}", "{{ b|tojson }}", "{{ b|string|length }}", "{{ b|join(',') }}", "{{ 'x' ~ b }}"})
      expect_error([&] { (void)render(std::string("{% set a = range(100)|list %}{% set b = [a] * 100 %}") + print,
                                      Json::object(), l); },
                   {"a string of more than 1000 bytes"});
  }
  SUBCASE("work") {
    Limits l;
    l.max_steps = 100000;
    expect_error([&] { (void)render("{% for i in range(1000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}",
                                    Json::object(), l); },
                 {"template exceeded 100000 evaluation steps"});
    // building a dict whose keys are not strings costs a step per key compared
    expect_error([&] { (void)render("{{ dict(range(4000)|batch(2)|list)|length }}", Json::object(), l); },
                 {"evaluation steps"});
  }
  SUBCASE("range") {
    expect_error([] { (void)render("{{ range(10**9)|length }}"); }, {"Range too big"});
    CHECK(render("{{ range(100000)|length }}") == "100000");
  }
  SUBCASE("self-referencing values print and free") {
    CHECK(render("{% set ns = namespace(a=1) %}{% set ns.self = ns %}{{ ns }}") ==
          "<Namespace {'a': 1, 'self': <Namespace {...}>}>");
    CHECK(render("{% macro m() %}{{ m is defined }}{% endmacro %}{{ m() }}") == "True");
    expect_error([] { (void)render("{% set ns = namespace(x=[]) %}{% for i in range(300) %}{% set ns.x = [ns.x] %}{% endfor %}"); },
                 {"value nests deeper than 256 lists or dicts"});
    // a chain of namespaces is fine to build, not to print
    expect_error([] { (void)render("{% set ns = namespace(x=none) %}{% for i in range(2000) %}"
                                   "{% set ns.x = namespace(prev=ns.x) %}{% endfor %}{{ ns }}"); },
                 {"a value nests too deeply to print"});
  }
  SUBCASE("a big dict's str keys are found by hash") {
    Json big = Json::object();
    for (int i = 0; i < 20000; ++i) big[std::string("k").append(std::to_string(i))] = i;  // not "k" + s: GCC 12 -Wrestrict
    CHECK(render("{% set ns = namespace(n=0) %}{% for k in d %}{% set ns.n = ns.n + d[k] %}{% endfor %}{{ ns.n }}",
                 Json{{"d", big}}) == "199990000");
  }
}

TEST_CASE("jinja: variables come from JSON with Python's types") {
  Json const vars = Json::parse(R"({"i": 3, "u": 18446744073709551615, "f": 2.0, "s": "é", "o": {"b": 1, "a": 2}})");
  CHECK(render("{{ i }} {{ f }} {{ s|length }} {{ o }}", Json{{"i", 3}, {"f", 2.0}, {"s", "é"}, {"o", vars["o"]}}) ==
        "3 2.0 1 {'b': 1, 'a': 2}");
  qflash::test::expect_error([&] { (void)render("{{ u }}", vars); }, {"does not fit in 64 bits"});
  qflash::test::expect_error([] { (void)render("{{ s }}", Json{{"s", std::string("\xc3")}}); }, {"not valid UTF-8"});
}

TEST_CASE("jinja: a template renders the same from many threads at once") {
  Template const t("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + m|length %}"
                   "{{ loop.index }}:{{ m|upper }};{% endfor %}{{ ns.n }}",
                   "t");
  Json vars{{"messages", Json::array()}};
  for (int i = 0; i < 50; ++i) vars["messages"].push_back("message " + std::to_string(i));
  std::string const want = t.render(vars);
  std::vector<std::string> got(4);
  std::vector<std::thread> threads;
  for (std::size_t k = 0; k < got.size(); ++k)
    threads.emplace_back([&, k] {
      for (int r = 0; r < 20; ++r) got[k] = t.render(vars);
    });
  for (auto& th : threads) th.join();
  for (auto const& g : got) CHECK(g == want);
  Template const copy = t;  // copies share the parsed tree
  CHECK(copy.render(vars) == want);
}
