/// @file
/// A Jinja2 engine for Hugging Face chat templates, so that a server can turn messages into a
/// prompt without Python and get the bytes transformers' `apply_chat_template` gets. It renders
/// as jinja2 3.1 does in the environment transformers builds (utils/chat_template_utils.py:
/// ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, the loopcontrols extension, its
/// own `tojson`, `raise_exception`, `strftime_now`, `namespace`, `dict`, `{% generation %}`).
///
/// The subset: `{{ }}`, `{% %}`, `{# #}`, `{% raw %}` and whitespace control (`-`, `+`); `if`,
/// `for` (loop variables, `else`, an inline `if` filter, unpacking), `break`, `continue`, `set`
/// (also `ns.attr` and block set), `macro` with defaults, `varargs` and `kwargs`, `filter`,
/// `with`, `print`; every expression of jinja2's grammar with Python's semantics (integer
/// division and modulo round down, `%` formats strings printf-style, `~` and printing use
/// str(), so `{{ [1, 'a', None] }}` prints `[1, 'a', None]` and `{{ 0.1 }}` `0.1`); attribute
/// and item lookup as the sandbox
/// does it (missing ones are undefined; mutating methods are refused); the tests of jinja2;
/// the filters in detail::kFilters; the str, dict and list methods templates call.
///
/// Deliberate differences: integers are 64-bit (overflow is an error, not a big integer);
/// case mapping and case tests (upper, lower, title, capitalize, islower, ...) see ASCII
/// letters only; `str.format`, `\N{...}` escapes, recursive loops, `call` blocks, `block`,
/// `extends`/`include`/`import` and the filters in detail::kUnsupportedFilters are refused with
/// an error naming them; `range()` gives a list; generators (what map, select, items, ...
/// return) print as `<generator object>` without an address, and can be read more than once;
/// repr() escapes only the non-printable characters it knows (unassigned code points print
/// raw); a name may hold any non-ASCII character but whitespace. Limits bound nesting, work and
/// output where Python would only hit its recursion limit.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include <nlohmann/json.hpp>

#include "qflash/core/error.hpp"
#include "qflash/io/detail/jinja_parse.hpp"
#include "qflash/io/detail/jinja_render.hpp"
#include "qflash/io/detail/jinja_value.hpp"
#include "qflash/io/detail/utf8.hpp"

namespace qflash::io::jinja {

/// A parsed template: parse once, render many times, from any number of threads at once.
class Template {
 public:
  /// Parses `source`; `name` (e.g. "tokenizer_config.json: chat_template") starts every
  /// error message, followed by line and column. Throws qflash::Error on a malformed template.
  Template(std::string_view source, std::string name, Limits limits = {}) {
    auto impl = std::make_shared<Impl>();
    std::size_t const bad = ::qflash::io::detail::utf8_find_invalid(source);
    QFLASH_CHECK(bad == std::string_view::npos, name, ": the template is not valid UTF-8 (byte ", bad, ")");
    impl->source = normalize(source);
    impl->limits = limits;
    impl->map = std::make_unique<detail::SourceMap>(impl->source, std::move(name));
    detail::Lexer lexer(impl->source, *impl->map);
    detail::Parser parser(lexer.run(), *impl->map, limits.max_parse_depth);
    impl->body = parser.parse();
    impl_ = std::move(impl);
  }

  /// Renders with `context` (a JSON object) as the template's variables. Throws qflash::Error
  /// naming the template, line and column when rendering fails, and RaisedError when the
  /// template calls raise_exception().
  [[nodiscard]] std::string render(nlohmann::ordered_json const& context) const {
    Impl const& t = *impl_;
    QFLASH_CHECK(context.is_object(), t.map->name(), ": the variables must be a JSON object, got ",
                 context.type_name());
    Value vars;
    try {
      vars = detail::from_json(context);
    } catch (Failure const& f) {
      QFLASH_FAIL(t.map->name(), ": variables: ", f.message);
    }
    detail::Renderer r(*t.map, t.limits, vars.dict());
    return r.run(t.body);
  }

  [[nodiscard]] std::string const& name() const { return impl_->map->name(); }

 private:
  struct Impl {
    std::string source;
    Limits limits;
    std::unique_ptr<detail::SourceMap> map;  // refers to `source`
    detail::Body body;
  };

  /// jinja2 reads "\r\n" and "\r" as "\n" and drops one trailing newline
  /// (keep_trailing_newline=False).
  static std::string normalize(std::string_view s) {
    std::string out;
    out.reserve(s.size());
    for (std::size_t i = 0; i < s.size(); ++i) {
      if (s[i] == '\r') {
        out += '\n';
        if (i + 1 < s.size() && s[i + 1] == '\n') ++i;
      } else {
        out += s[i];
      }
    }
    if (!out.empty() && out.back() == '\n') out.pop_back();
    return out;
  }

  std::shared_ptr<Impl const> impl_;
};

}  // namespace qflash::io::jinja
