#!/usr/bin/env python3
"""Reference renderings for qflash's Jinja engine (include/qflash/io/jinja.hpp) and chat-template
layer (include/qflash/io/chat_template.hpp), made by transformers itself.

    tools/setup_venv && tools/.venv/bin/python tools/make_chat_template_fixtures.py

Writes tests/fixtures/chat_templates/:
  jinja_cases.json   small templates, one construct or filter each, rendered by jinja2 in the
                     environment transformers' apply_chat_template compiles templates in
                     (transformers.utils.chat_template_utils._compile_jinja_template), or the
                     exception they raise there;
  <template>.json    a chat template and a set of conversations (system, multi-turn, reasoning,
                     tools, generation prompt, enable_thinking, non-ASCII, quoting), each rendered
                     by the tokenizer's apply_chat_template(tokenize=False), or the exception it
                     raises.

Templates:
  qwen3_5_moe_micro  models/qwen3_5_moe-micro/chat_template.jinja, the default model's ChatML
                     template, loaded by AutoTokenizer from the model directory.
  context_probe      written here: prints the variables apply_chat_template passes (special
                     tokens, tools, documents, extra keyword arguments) and each message's keys,
                     so that the C++ side's preparation of messages is checked too.
  qwen3, qwen3_5,    the Qwen chat templates as llama.cpp keeps them in models/templates/, taken at
  qwen3_coder        generation time from the sdist of llama-cpp-python (PyPI, pinned below, its
                     SHA-256 checked), which vendors llama.cpp. Each fixture records the package,
                     version, path and the template's SHA-256.

Deterministic: the same files, byte for byte, for the same pinned versions.
"""
import hashlib
import json
import os
import subprocess
import sys
import tarfile

import jinja2
import transformers
from transformers import AutoTokenizer
from transformers.utils.chat_template_utils import _compile_jinja_template

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "chat_templates")
MICRO = os.path.join(ROOT, "models", "qwen3_5_moe-micro")
CACHE = os.path.join(ROOT, "tools", ".venv", "cache")

# The PyPI sdist that carries llama.cpp's copies of the Qwen chat templates.
TEMPLATE_PACKAGE = "llama-cpp-python"
TEMPLATE_PACKAGE_VERSION = "0.3.36"
TEMPLATE_SDIST = "llama_cpp_python-0.3.36.tar.gz"
TEMPLATE_SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
REAL_TEMPLATES = {
    # fixture name: (path in the sdist, the Hugging Face model whose template it is)
    "qwen3": ("llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/Qwen-Qwen3-0.6B.jinja",
              "Qwen/Qwen3-0.6B (the Qwen3 family template, Qwen3-30B-A3B included)"),
    "qwen3_5": ("llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/Qwen3.5-4B.jinja",
                "Qwen3.5-4B (the Qwen3.5 family template)"),
    "qwen3_coder": ("llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/Qwen3-Coder.jinja",
                    "Qwen3-Coder (qwen3_moe, e.g. Qwen3-Coder-30B-A3B-Instruct)"),
}


def sha256_bytes(data):
    return hashlib.sha256(data).hexdigest()


def template_sdist():
    """The pinned sdist, downloaded once into tools/.venv/cache with pip."""
    path = os.path.join(CACHE, TEMPLATE_SDIST)
    if not os.path.exists(path):
        os.makedirs(CACHE, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                        "--no-deps", "--no-binary", ":all:", "--dest", CACHE,
                        f"{TEMPLATE_PACKAGE}=={TEMPLATE_PACKAGE_VERSION}"], check=True)
    with open(path, "rb") as f:
        digest = sha256_bytes(f.read())
    if digest != TEMPLATE_SDIST_SHA256:
        sys.exit(f"{path}: SHA-256 {digest}, expected {TEMPLATE_SDIST_SHA256}")
    return path


def real_templates():
    out = {}
    with tarfile.open(template_sdist(), "r:gz") as tar:
        for name, (member, model) in REAL_TEMPLATES.items():
            data = tar.extractfile(member).read()
            out[name] = (data.decode("utf-8"), {
                "pypi_package": TEMPLATE_PACKAGE, "version": TEMPLATE_PACKAGE_VERSION,
                "sdist_sha256": TEMPLATE_SDIST_SHA256, "path": member, "sha256": sha256_bytes(data),
                "model": model,
                "note": "llama.cpp's copy of the model's chat template (models/templates/), as the "
                        "sdist vendors it"})
    return out


def python_error(e):
    return f"{type(e).__name__}: {e}"


# --- jinja_cases.json -------------------------------------------------------------------------

USERS = [{"name": "ann", "age": 31, "admin": True, "tags": ["x", "y"]},
         {"name": "bob", "age": 25, "admin": False, "tags": ["z"]},
         {"name": "cy", "age": 40, "admin": False}]
MSGS = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}]
NESTED = {"a": {"b": [10, 20, {"c": "deep"}]}, "items": "key", "n": None}
JSONISH = {"name": "Zoë \"Z\" <x>", "path": "C:\\dir\\f", "text": "line1\nline2\ttab", "n": 3,
           "f": 1.5, "whole": 2.0, "tiny": 1e-06, "ok": True, "none": None, "list": [1, "two", [3]],
           "emoji": "🙂", "nested": {"z": 1, "a": {"deep": []}}}

# (name, template, variables). An expected error is recorded as "<Python exception>: <message>".
CASES = [
    # printing values as Python's str() does
    ("print_scalars", "{{ none }}|{{ None }}|{{ true }}|{{ False }}|{{ 1 }}|{{ -3 }}", {}),
    ("print_floats", "{{ 1.0 }} {{ 0.1 }} {{ 1e-06 }} {{ 0.0001 }} {{ 1e16 }} {{ 1e15 }} {{ 123456789.123 }} "
                     "{{ -0.0 }} {{ 2.5e-5 }} {{ 1.5e300 }} {{ 0.1 + 0.2 }} {{ 1 / 3 }} {{ 2 / 2 }} "
                     "{{ 1e308 * 10 }} {{ -1e308 * 10 }} {{ 100.0 }} {{ 1.5e-10 }} {{ 12345678901234567.0 }}", {}),
    ("print_containers", "{{ [1, 'a', none, true, 1.5, [2], {'k': 'v'}, (1,), (1, 2), ()] }}", {}),
    ("print_str_repr", "{{ [\"it's\", 'say \"hi\"', 'both \\' and \"', 'tab\\tnl\\nbs\\\\', 'é🙂', "
                       "'\\x00\\x7f\\x85\\xa0\\u200b\\u2028', '\\r'] }}", {}),
    ("print_dict_context", "{{ d }}", {"d": {"a": [1, {"b": None}], "é": "ü", "f": 2.0}}),
    ("print_tuple_output", "{{ 1, 'a' }}", {}),
    ("print_undefined", "[{{ missing }}]", {}),
    ("print_context_types", "{{ i }} {{ f }} {{ g }} {{ b }} {{ n }} {{ l }} {{ big }}",
     {"i": 7, "f": 1.0, "g": 2.5, "b": False, "n": None, "l": [1.0, "x", None], "big": 9007199254740993}),
    ("print_markup_repr", "{{ ['<b>'|safe] }}", {}),
    ("print_dict_views", "{{ {'a': 1}.items() }} {{ {'a': 1}.keys() }} {{ {'a': 1}.values() }}", {}),
    ("print_macro_namespace", "{% macro m() %}{% endmacro %}{{ m }}|{{ namespace(a=1, b='x') }}", {}),
    ("print_loop", "{% for i in [1, 2] %}{{ loop }}{% endfor %}", {}),
    # whitespace control with trim_blocks and lstrip_blocks
    ("ws_trim_blocks", "{% if true %}\nyes\n{% endif %}\nend", {}),
    ("ws_lstrip_blocks", "  {% if true %}\n    x\n  {% endif %}\n  y", {}),
    ("ws_minus", "a  \n  {%- if true -%}  \n  b  \n  {%- endif -%}  \n  c", {}),
    ("ws_var_minus", "a \n {{- 'x' -}} \n b", {}),
    ("ws_plus", "  {%+ if true %}x{% endif +%}\ny", {}),
    ("ws_comment", "a\n  {# comment #}\nb\n{#- c -#}  c\n {#+ d #}e", {}),
    ("ws_no_lstrip_for_variables", "  {{ 'x' }}\n  {{- 'y' }}", {}),
    ("ws_crlf", "a\r\n{% if true %}\r\nb\r\n{% endif %}\r\nc\r\n", {}),
    ("ws_trailing_newline", "x\n\n", {}),
    ("ws_raw", "{% raw %}{{ not parsed }} {% if %}{% endraw %}", {}),
    ("ws_raw_minus", "a  {%- raw -%}  {{ x }}  {%- endraw -%}  b", {}),
    ("ws_indented_loop", "<ul>\n{% for i in [1, 2] %}\n    <li>{{ i }}</li>\n{% endfor %}\n</ul>", {}),
    ("ws_tab_and_unicode_space", "\t{% if true %}x{% endif %}\n\u3000{% if true %}y{% endif %}", {}),
    ("ws_not_at_line_start", "text {% if true %}x{% endif %}  {% if true %}y{% endif %}", {}),
    ("ws_block_after_block", "{% if true %}a{% endif %}\n  {% if true %}b{% endif %}\n", {}),
    ("ws_trim_only_first_newline", "{% if true %}\n\nx{% endif %}", {}),
    # statements
    ("if_elif_else", "{% for x in [1, 2, 3, 0] %}{% if x == 1 %}one{% elif x == 2 %}two{% elif x %}many"
                     "{% else %}zero{% endif %},{% endfor %}", {}),
    ("for_loop_variables", "{% for x in ['a', 'b', 'c'] %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}"
                           "{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}"
                           "{{ loop.previtem }}{{ loop.nextitem }}{{ loop.depth }};{% endfor %}", {}),
    ("for_else", "{% for x in [] %}x{% else %}empty{% endfor %}|{% for x in [1] %}x{% else %}empty{% endfor %}", {}),
    ("for_inline_filter", "{% for x in range(10) if x is odd %}{{ x }}:{{ loop.index }}/{{ loop.length }} {% endfor %}", {}),
    ("for_unpack_items", "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{% for k, v in d|items %}{{ k }}{% endfor %}",
     {"d": {"b": 1, "a": [2]}}),
    ("for_dict_and_string", "{% for k in d %}{{ k }}{% endfor %}|{% for c in 'héllo' %}[{{ c }}]{% endfor %}",
     {"d": {"x": 1, "y": 2}}),
    ("for_nested", "{% for a in [1, 2] %}{% for b in 'xy' %}{{ loop.index }}{{ a }}{{ b }}{% endfor %}"
                   "{{ loop.index }}|{% endfor %}", {}),
    ("for_break_continue", "{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}"
                           "{% if i == 5 %}{% break %}{% endif %}{{ i }}{% endfor %}", {}),
    ("for_scope", "{% set x = 0 %}{% for i in [1, 2, 3] %}{{ x }}{% set x = i %}{{ x }}{% endfor %}{{ x }}", {}),
    ("for_scope_per_iteration", "{% for i in [1, 2] %}{% if loop.first %}{% set a = 5 %}{% endif %}[{{ a }}]{% endfor %}", {}),
    ("for_else_scope", "{% for x in [] %}{% else %}{% set q = 1 %}{% endfor %}[{{ q }}]", {}),
    ("if_does_not_scope", "{% if true %}{% set z = 3 %}{% endif %}{{ z }}", {}),
    ("loop_cycle_changed", "{% for i in [1, 1, 2, 3, 3] %}{{ loop.cycle('a', 'b') }}{% if loop.changed(i) %}*{% endif %}{% endfor %}", {}),
    ("namespace_counter", "{% set ns = namespace(count=0, found=false) %}{% for m in msgs %}{% if m.role == 'user' %}"
                          "{% set ns.count = ns.count + 1 %}{% set ns.found = true %}{% endif %}{% endfor %}"
                          "{{ ns.count }} {{ ns.found }}", {"msgs": MSGS}),
    ("namespace_args", "{% set ns = namespace({'a': 1}, b=2) %}{{ ns.a }}{{ ns.b }}{{ ns['a'] }}{{ ns.c is defined }}", {}),
    ("namespace_reversed_messages", "{% set ns = namespace(multi_step_tool=true, last_query_index=msgs|length - 1) %}"
                                    "{% for message in msgs[::-1] %}{% set index = (msgs|length - 1) - loop.index0 %}"
                                    "{% if ns.multi_step_tool and message.role == 'user' and not (message.content.startswith('<tool_response>') "
                                    "and message.content.endswith('</tool_response>')) %}{% set ns.multi_step_tool = false %}"
                                    "{% set ns.last_query_index = index %}{% endif %}{% endfor %}{{ ns.last_query_index }}",
     {"msgs": MSGS + [{"role": "user", "content": "<tool_response>r</tool_response>"}]}),
    ("set_tuple", "{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set (c, d) = [3, 4] %}{{ c }}{{ d }}{% set e, f = 'xy' %}{{ f }}", {}),
    ("set_block", "{% set x %}a{{ 1 + 1 }}\nb{% endset %}[{{ x }}]", {}),
    ("set_block_filter", "{% set x | upper | trim %}  abc  {% endset %}[{{ x }}]", {}),
    ("set_overrides_context", "{{ v }}{% set v = 2 %}{{ v }}", {"v": 1}),
    ("macro_defaults", "{% macro m(a, b=2, c=a) %}{{ a }}-{{ b }}-{{ c }}{% endmacro %}{{ m(1) }}|{{ m(1, 3) }}|"
                       "{{ m(1, c=9) }}|{{ m(a=5) }}", {}),
    ("macro_missing_argument", "{% macro m(a, b) %}[{{ a }}][{{ b }}][{{ b is defined }}]{% endmacro %}{{ m(1) }}", {}),
    ("macro_varargs_kwargs", "{% macro m(a) %}{{ a }}{{ varargs }}{{ kwargs }}{% endmacro %}{{ m(1, 2, 3, x=4) }}", {}),
    ("macro_sees_later_globals", "{% macro m() %}{{ y }}{% endmacro %}{% set y = 1 %}{{ m() }}{% set y = 2 %}{{ m() }}", {}),
    ("macro_lexical_scope", "{% set y = 1 %}{% macro m() %}{{ y }}{% endmacro %}{% for y in [5] %}{{ m() }}{% endfor %}", {}),
    ("macro_recursive", "{% macro f(n) %}{% if n > 0 %}{{ n }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(5) }}", {}),
    ("macro_result_is_string", "{% macro m() %} x {% endmacro %}[{{ m()|trim }}]{{ m() is string }}{{ m()|length }}", {}),
    ("macro_namespace_side_effect", "{% set count = namespace(value=0) %}{% macro bump() %}{% set count.value = count.value + 1 %}"
                                    "{{ count.value }}{% endmacro %}{{ bump() }}{{ bump() }}{{ count.value }}", {}),
    ("macro_in_loop", "{% for i in [1, 2] %}{% macro m() %}{{ i }}{% endmacro %}{{ m() }}{% endfor %}", {}),
    ("filter_block", "{% filter upper %}abc{{ 'd' }}{% endfilter %}|{% filter replace('a', 'b') | trim %} aa {% endfilter %}", {}),
    ("with_block", "{% with a = 1, b = 2 %}{{ a + b }}{% endwith %}[{{ a }}]", {}),
    ("print_tag", "{% print 'a' %}{% print 1, 2 %}", {}),
    ("generation_block", "{% generation %}gen{{ 1 }}{% set g = 1 %}{% endgeneration %}[{{ g }}]", {}),
    # expressions
    ("literals", "{{ 'a' 'b' }} {{ \"dq\" }} {{ 0x1F }} {{ 0o17 }} {{ 0b101 }} {{ 1_000 }} {{ 1.5e3 }} {{ 2E-2 }} "
                 "{{ 1_0.5 }} {{ True }} {{ [1,] }} {{ (1) }} {{ ((1, 2),) }} {{ {'a': 1,} }}", {}),
    ("string_escapes", "{{ 'a\\nb\\tc\\\\d\\'e\\\"f\\x41\\u00e9\\U0001F600\\101\\q\\é|' }}", {}),
    ("arithmetic", "{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 // -2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 7 % -3 }} {{ 7.5 // 2 }} "
                   "{{ -7.5 % 2 }} {{ 7.5 % -2 }} {{ -0.0 % 5 }} {{ 2 ** 10 }} {{ 2 ** -1 }} {{ 2.0 ** 3 }} {{ 2 ** 3 ** 2 }} "
                   "{{ -2 ** 2 }} {{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ 10 - 3 - 2 }} {{ true + 1 }} {{ 3 * 'ab' }} "
                   "{{ 'ab' * 2 }} {{ [1] * 3 }} {{ [1, 2] + [3] }} {{ (1,) + (2,) }} {{ 'a' + 'b' }} {{ 5 / 2 }} {{ -5 // 2.0 }} "
                   "{{ 1e300 * 1e300 }} {{ 'x' * 0 }} {{ 'x' * -1 }} {{ -(-3) }} {{ +3 }} {{ - 1.5 }} {{ 9 ** 0.5 }}", {}),
    ("percent_format", "{{ '%s-%d' % ('a', 3) }}|{{ '%5.2f|%-4s|%03d|%+d' % (3.14159, 'ab', 7, 5) }}|{{ '%s' % [1, 2] }}|"
                       "{{ '%r %%' % ('x',) }}|{{ '%(a)s=%(b)05.1f' % {'a': 'k', 'b': 2.25} }}|{{ '%x %X %o %#o %#x' % (255, 255, 8, 8, 255) }}|"
                       "{{ '%5x|%-6x|' % (-255, -255) }}{{ '%e %g %G' % (12345.678, 0.0001, 1e20) }}|{{ '%c%c' % (65, 'é') }}|"
                       "{{ '%.2s|%5s|%-5s|' % ('abc', 'é', 'é') }}{{ 'abc' % () }}|{{ 'abc' % [] }}|{{ '%d' % 3.9 }}|{{ '%i %u' % (1, 2) }}", {}),
    ("concat", "{{ 'a' ~ 1 ~ 1.5 ~ none ~ true ~ [1] ~ missing ~ 'z' }}", {}),
    ("comparisons", "{{ 1 < 2 }} {{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ 1 == 1.0 }} {{ 'a' < 'b' }} {{ [1, 2] < [1, 3] }} "
                    "{{ (1, 2) == [1, 2] }} {{ none == none }} {{ 1 != 2 }} {{ 2 >= 2 }} {{ 'abc' <= 'abd' }} "
                    "{{ true == 1 }} {{ {'a': 1} == {'a': 1.0} }} {{ missing == missing }} {{ missing == none }} "
                    "{{ 'é' > 'z' }} {{ [1] < [1, 0] }}", {}),
    ("logic", "{{ 1 and 2 }} {{ 0 and 2 }} {{ 0 or 'x' }} {{ '' or [] }} {{ not 0 }} {{ not not 'a' }} {{ none or 'd' }} "
              "{{ [] or {} }} {{ missing or 'fallback' }}", {}),
    ("membership", "{{ 'b' in 'abc' }} {{ 2 in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 3 not in [1] }} {{ 'x' in missing }} "
                   "{{ 1 in (1, 2) }} {{ '' in 'abc' }} {{ 'tool_calls' in m }} {{ 'a' in m.keys() }} {{ 1.0 in [1] }}",
     {"m": {"role": "user"}}),
    ("conditional_expression", "{{ 'y' if true else 'n' }} {{ 'y' if 0 else 'n' }} [{{ 'y' if false }}] "
                               "{{ 1 if false else 2 if true else 3 }} {{ ('y' if false) is defined }}", {}),
    ("attribute_and_item", "{{ d.a.b[1] }} {{ d['a']['b'][-1].c }} {{ d.a.b.0 }} [{{ d.missing }}] {{ d.a.missing is defined }} "
                           "{{ d['items'] }} {{ d.items is defined }} {{ d.get('a').b|length }} {{ d.get('zz', 'dflt') }} "
                           "{{ d.get('zz') }} {{ d.n is none }} {{ d.n.x is defined }} {{ d['a'].b[5] is defined }} "
                           "{{ d.a.b[1.0] is defined }} {{ 'abc'.nope is defined }} {{ [1].append is defined }}", {"d": NESTED}),
    ("slicing", "{{ 'hello'[1:3] }} {{ 'hello'[::-1] }} {{ 'hello'[-3:] }} {{ 'héllo'[1:3] }} {{ [1, 2, 3, 4, 5][1::2] }} "
                "{{ [1, 2, 3][:-1] }} {{ (1, 2, 3)[1:] }} {{ [1, 2, 3][5:] }} {{ 'abc'[10] is defined }} "
                "{{ [1, 2][-5] is defined }} {{ [1, 2, 3, 4][::-2] }} {{ 'abcdef'[-2:1:-1] }} {{ 'abc'[1] }} "
                "{{ 'héllo'[-4] }} {{ [1, 2, 3][-1:-4:-1] }} {{ 'abc'[:100] }} {{ msgs[::-1][0].content }}", {"msgs": MSGS}),
    ("dict_literals", "{{ {'a': 1, 'a': 2} }} {{ {1: 'x', true: 'y'} }} {{ {} }} {{ {(1, 2): 'tuple key'}[(1, 2)] }} "
                      "{{ {none: 1}[none] }}", {}),
    ("undefined_behaviour", "[{{ missing }}][{{ missing|length }}][{{ missing|default('d') }}][{{ missing is defined }}]"
                            "[{{ missing is undefined }}][{% for x in missing %}x{% endfor %}][{{ missing|list }}]"
                            "[{{ missing|join(',') }}][{{ missing|string }}][{{ missing|upper }}][{{ not missing }}]"
                            "[{{ missing|first is defined }}][{{ missing|trim }}][{{ missing|items|list }}][{{ missing|sort }}]"
                            "[{{ missing|reverse|list }}][{{ missing|map('upper')|list }}][{{ missing|sum }}][{{ missing|safe }}]"
                            "[{{ missing|escape }}][{{ missing ~ 'x' }}][{{ missing is string }}]", {}),
    ("names_as_keywords", "{% set in_ = 1 %}{{ in_ }} {{ dict is defined }} {{ range is defined }}", {}),
    # tests
    ("tests_by_type", "{% for v in [none, true, 1, 1.5, 'a', [1], {'a': 1}, (1,)] %}{{ v is none }}{{ v is boolean }}"
                      "{{ v is true }}{{ v is false }}{{ v is integer }}{{ v is float }}{{ v is number }}{{ v is string }}"
                      "{{ v is mapping }}{{ v is iterable }}{{ v is sequence }}{{ v is callable }}|{% endfor %}", {}),
    ("tests_more_types", "{{ missing is iterable }}{{ missing is sequence }}{{ missing is callable }}{{ missing is string }}"
                         "{{ namespace() is mapping }}{{ range is callable }}{{ {'a': 1}.items() is sequence }}"
                         "{{ {'a': 1}.items() is iterable }}{{ [1]|map('string') is iterable }}{{ [1]|map('string') is sequence }}", {}),
    ("tests_values", "{{ 3 is odd }}{{ 4 is even }}{{ 3.0 is odd }}{{ 9 is divisibleby 3 }}{{ 9 is divisibleby(4) }}"
                     "{{ 1 is eq 1 }}{{ 1 is equalto(2) }}{{ 2 is gt 1 }}{{ 2 is lt 1 }}{{ 2 is ge 2 }}{{ 2 is le 1 }}"
                     "{{ 2 is ne 2 }}{{ 2 is in [1, 2] }}{{ 'a' is lower }}{{ 'A' is upper }}{{ 'aB' is lower }}"
                     "{{ 'tojson' is filter }}{{ 'odd' is test }}{{ 'nope' is filter }}{{ none is sameas none }}"
                     "{{ true is sameas true }}{{ 'x'|safe is escaped }}{{ 'x' is escaped }}{{ 2 is greaterthan 1 }}"
                     "{{ 1 is lessthan 2 }}", {}),
    ("tests_negated", "{{ 1 is not none }} {{ not 1 is none }} {{ x is not defined }} {{ x is not string }}", {}),
    ("markup_methods", "{{ ('<b>'|safe).replace('b', '<') }} {{ ('<b> '|safe).strip() is escaped }} "
                       "{{ ('x'|safe)|trim is escaped }} {{ '<'|safe|upper is escaped }} {{ ('a'|safe) ~ '<' }} "
                       "{{ ('a'|safe)|string is escaped }} {{ d|tojson|safe }} {{ ('<b>'|safe)[1:] is escaped }}",
     {"d": {"k": "<v>"}}),
    ("loop_else_after_filter", "{% for x in [1, 2] if x > 5 %}{{ x }}{% else %}none{% endfor %}", {}),
    ("text_outside_tags", "héllo {{ 'wörld' }} ✓ } { %} #} {{ \"{{ not a tag }}\" }}{{ '{%' ~ '%}' }}", {}),
    ("lazy_generators", "{{ ([1]|map('nope')) is iterable }} {{ [1, 'a']|select('odd')|first }} "
                        "{{ [1]|items is iterable }} {{ []|map(nope)|list }} {{ [1]|reject('odd', 'equalto', 'x') is sequence }} "
                        "{{ 1 in [1, 'a']|select('odd') }}", {}),
    ("markup_iteration", "{{ ('<b>'|safe)|list }} {{ ('ab'|safe)[0] is escaped }} {% for c in 'x'|safe %}{{ c is escaped }}{% endfor %}", {}),
    ("unicode_names", "{% set größe = 2 %}{{ größe }} {{ 名前 is defined }}", {}),
    ("raw_at_end", "x{% raw %}", {}),
    ("comment_at_end", "y{#", {}),
    ("undefined_is_hashable", "{{ {nope: 1}|length }} {{ [nope, nope]|unique|list }} {{ {nope: 1}[none] is defined }}", {}),
    # filters
    ("filter_trim", "[{{ '  a b \\n'|trim }}][{{ 'xxaxx'|trim('x') }}][{{ ' \u3000a\u3000 '|trim }}][{{ 5|trim }}]", {}),
    ("filter_length_count", "{{ 'héllo'|length }} {{ [1, 2]|count }} {{ {'a': 1}|length }} {{ ''|length }} {{ (1, 2, 3)|length }}", {}),
    ("filter_first_last", "{{ [1, 2, 3]|first }} {{ [1, 2, 3]|last }} {{ 'abc'|first }} {{ 'abc'|last }} "
                          "{{ {'a': 1, 'b': 2}|first }} {{ {'a': 1, 'b': 2}|last }} [{{ []|first }}] {{ [4, 5]|map('string')|first }}", {}),
    ("filter_join", "{{ [1, 'a', none]|join }} {{ ['a', 'b']|join(', ') }} {{ users|join(', ', attribute='name') }} "
                    "{{ 'abc'|join('-') }} {{ [1.0, [2]]|join('|') }}", {"users": USERS}),
    ("filter_case", "{{ 'hello World'|upper }} {{ 'Hello'|lower }} {{ 'hELLO world'|capitalize }} "
                    "{{ 'hello wORLD-foo (bar) x_y z.w'|title }} {{ none|upper }}", {}),
    ("filter_replace", "{{ 'aaa'|replace('a', 'b') }} {{ 'aaa'|replace('a', 'b', 2) }} {{ 'abc'|replace('', '-') }} "
                       "{{ 123|replace(2, 9) }} {{ 'héé'|replace('é', 'e') }}", {}),
    ("filter_default", "{{ missing|default('d') }} [{{ ''|default('d') }}] {{ ''|default('d', true) }} {{ none|default('d') }} "
                       "{{ none|d('d', true) }} {{ 0|d(5, boolean=true) }} [{{ missing|default }}]", {}),
    ("filter_tojson", "{{ d|tojson }}", {"d": JSONISH}),
    ("filter_tojson_indent", "{{ d|tojson(indent=2) }}|{{ d|tojson(indent='\\t') }}|{{ {}|tojson(indent=2) }}"
                             "{{ []|tojson(indent=2) }}|{{ [1]|tojson(indent=0) }}", {"d": JSONISH}),
    ("filter_tojson_options", "{{ d|tojson(separators=(',', ':')) }}|{{ d|tojson(sort_keys=true) }}|"
                              "{{ 'é😀'|tojson(ensure_ascii=true) }}|{{ 'é'|tojson(true) }}|{{ d|tojson(false, 1) }}",
     {"d": {"b": [1, {"y": 2, "x": 1}], "a": "é"}}),
    ("filter_tojson_values", "{{ [1.0, 1e-06, 1e16, none, true, (1, 2), 'x'|safe]|tojson }} "
                             "{{ {1: 'a', none: 'b', true: 'c', 1.5: 'd'}|tojson }} {{ '</script>&\\'\"'|tojson }} "
                             "{{ '\\x00\\x1f\\x7f\\u2028\\b\\f\\r'|tojson }}", {}),
    ("filter_string_int_float", "{{ 1|string }}{{ 1.5|string }}{{ none|string }}{{ [1]|string }} {{ '42'|int }} "
                                "{{ ' 42 '|int }} {{ '4.7'|int }} {{ 'x'|int }} {{ 'x'|int(-1) }} {{ 3.9|int }} {{ -3.9|int }} "
                                "{{ true|int }} {{ '1A'|int(base=16) }} {{ '1_000'|int }} {{ '-7'|int }} {{ '2.5'|float }} "
                                "{{ 'x'|float }} {{ 3|float }} {{ '1e3'|float }} {{ ' -inf '|float }} {{ none|int }} "
                                "{{ none|float(1.5) }} {{ '+5'|int }} {{ '0x1A'|int(0) }} {{ '0x1A'|int(base=16) }} "
                                "{{ '1A'|int(base=73) }} {{ '010'|int(0) }} {{ '0b101'|int(0) }} {{ '0o17'|int(8) }}", {}),
    ("filter_list_items", "{{ 'abc'|list }} {{ {'a': 1, 'b': 2}|list }} {{ (1, 2)|list }} {{ {'a': 1}|items|list }} {{ [3, 1]|list }}", {}),
    ("filter_dictsort", "{{ d|dictsort }} {{ d|dictsort(reverse=true) }} {{ d|dictsort(by='value') }} {{ d|dictsort(true) }}",
     {"d": {"b": 1, "A": 3, "a": 2}}),
    ("filter_map", "{{ users|map(attribute='name')|list }} {{ users|map(attribute='missing', default=0)|list }} "
                   "{{ ['a', 'b']|map('upper')|list }} {{ [1.5, 2.5]|map('round')|list }} {{ users|map(attribute='tags.0', default='-')|list }} "
                   "{{ [[1, 2], [3]]|map('join', ',')|list }} {{ []|map('upper')|list }}", {"users": USERS}),
    ("filter_select_reject", "{{ [1, 2, 3, 4]|select('odd')|list }} {{ [1, 2, 3, 4]|reject('odd')|list }} "
                             "{{ [0, 1, '', 'a', none]|select|list }} {{ users|selectattr('admin')|map(attribute='name')|list }} "
                             "{{ users|rejectattr('admin')|map(attribute='name')|list }} "
                             "{{ users|selectattr('age', 'gt', 30)|map(attribute='name')|join(',') }} "
                             "{{ msgs|selectattr('role', 'equalto', 'user')|list|length }} {{ [1, 2, 3]|select('in', [2, 3])|list }} "
                             "{{ users|selectattr('name', '==', 'bob')|list|length }} {{ users|selectattr('tags')|list|length }} "
                             "{{ users|selectattr('tags', 'defined')|list|length }}", {"users": USERS, "msgs": MSGS}),
    ("filter_unique_sort", "{{ [3, 1, 2, 1]|unique|list }} {{ ['a', 'A', 'b']|unique|list }} {{ ['a', 'A', 'b']|unique(true)|list }} "
                           "{{ [3, 1, 2]|sort }} {{ [3, 1, 2]|sort(reverse=true) }} {{ ['b', 'A', 'a', 'B']|sort }} "
                           "{{ ['b', 'A', 'a', 'B']|sort(case_sensitive=true) }} {{ users|sort(attribute='age')|map(attribute='name')|list }} "
                           "{{ users|sort(attribute='admin,name')|map(attribute='name')|list }} "
                           "{{ [[2, 'b'], [1, 'z'], [2, 'a']]|sort }} {{ users|unique(attribute='admin')|map(attribute='name')|list }}",
     {"users": USERS}),
    ("filter_reverse", "{{ 'abc'|reverse }} {{ [1, 2, 3]|reverse|list }} {{ {'a': 1, 'b': 2}|reverse|list }} {{ 'héllo'|reverse }}", {}),
    ("filter_numbers", "{{ -3|abs }} {{ -2.5|abs }} {{ 2.5|round }} {{ 3.5|round }} {{ 2.675|round(2) }} {{ 2.7|round(method='floor') }} "
                       "{{ 2.1|round(method='ceil') }} {{ 5|round }} {{ 1234|round(-2) }} {{ 1250|round(-2) }} {{ 1350|round(-2) }} "
                       "{{ [1, 2, 3]|sum }} {{ users|sum(attribute='age') }} {{ [1.5, 2]|sum(start=10) }} {{ [1, 5, 3]|max }} "
                       "{{ [1, 5, 3]|min }} {{ ['b', 'A']|max }} {{ ['b', 'A']|max(case_sensitive=true) }} "
                       "{{ (users|max(attribute='age')).name }} {{ []|max is defined }} {{ 0.125|round(2) }} {{ -0.5|round }}",
     {"users": USERS}),
    ("filter_safe_escape", "{{ '<a href=\"x\">&\\'</a>'|e }} {{ '<b>'|safe }} {{ '<b>'|safe + '<i>' }} {{ '<i>' + '<b>'|safe }} "
                           "{{ '<b>'|safe ~ '<i>' }} {{ ('<b>'|safe)|escape }} {{ 5|escape }} {{ ('<b>'|safe)|string is escaped }}", {}),
    ("filter_indent", "{{ 'a\\nb\\n\\nc'|indent }}|{{ 'a\\nb'|indent(2, true) }}|{{ 'a\\n\\nb'|indent('> ', blank=true) }}|"
                      "{{ 'a\\nb\\n'|indent(first=true) }}|{{ ''|indent(first=true) }}|{{ 'a\\r\\nb'|indent(1) }}", {}),
    ("filter_center_batch_attr", "[{{ 'ab'|center(7) }}][{{ 'abc'|center(8) }}] {{ [1, 2, 3, 4, 5]|batch(2)|list }} "
                                 "{{ [1, 2, 3]|batch(2, 'x')|list }} {{ users[0]|attr('name') }} [{{ {'a': 1}|attr('a') }}]",
     {"users": USERS}),
    ("filter_chained", "{{ '  Hello  '|trim|lower|replace('l', 'L')|length }} {{ -3|abs|string|length }}", {}),
    # methods
    ("str_methods_split", "{{ 'a,b,,c'.split(',') }} {{ ' a  b '.split() }} {{ 'a b c'.split(None, 1) }} {{ '  a b c '.split(maxsplit=1) }} "
                          "{{ 'a,b,c'.rsplit(',', 1) }} {{ '  a b  '.rsplit(None, 1) }} {{ ''.split() }} {{ ''.split(',') }} "
                          "{{ 'a</think>b</think>c'.split('</think>')[-1] }} {{ 'x'.split('x') }}", {}),
    ("str_methods_strip", "[{{ 'xxhixx'.strip('x') }}][{{ '\\n\\nhi\\n'.lstrip('\\n') }}][{{ 'hi\\n\\n'.rstrip() }}]"
                          "[{{ ' \\t hi \\u3000'.strip() }}][{{ 'abcba'.strip('ab') }}][{{ 'hi'.strip(none) }}]", {}),
    ("str_methods_misc", "{{ 'abc'.startswith('ab') }} {{ 'abc'.startswith(('x', 'a')) }} {{ 'abc'.endswith('bc') }} "
                         "{{ 'abc'.startswith('b', 1) }} {{ 'a-b-c'.replace('-', '+', 1) }} {{ 'Hello'.upper() }} {{ 'Hello'.lower() }} "
                         "{{ 'hello world'.title() }} {{ \"they're 2nd\".title() }} {{ 'hELLO'.capitalize() }} "
                         "{{ 'hello'.find('l') }} {{ 'héllo'.find('l') }} {{ 'hello'.rfind('l') }} {{ 'hello'.find('z') }} "
                         "{{ 'hello'.find('l', 3) }} {{ 'hello'.count('l') }} {{ 'aaaa'.count('aa') }} {{ 'abc'.count('') }} "
                         "{{ ', '.join(['a', 'b']) }} {{ 'abc'.removeprefix('a') }} {{ 'abc'.removesuffix('c') }} "
                         "{{ 'a\\nb\\r\\nc'.splitlines() }} {{ 'a\\nb\\n'.splitlines(true) }} {{ 'a=b=c'.partition('=') }} "
                         "{{ 'a=b=c'.rpartition('=') }} {{ 'abc'.isalpha() }} {{ '123'.isdigit() }} {{ '  '.isspace() }} "
                         "{{ 'ab'.islower() }} {{ 'AB1'.isupper() }} {{ 'x'.ljust(3, '.') }}| {{ 'x'.rjust(3) }} {{ '-5'.zfill(4) }} "
                         "{{ 'ab'.center(5, '*') }} {{ 'hello'.index('l') }} {{ 'a1'.isalnum() }} {{ 'Ab'.swapcase() }}", {}),
    ("dict_and_list_methods", "{{ d.keys()|list }} {{ d.values()|list }} {% for k, v in d.items() %}{{ k }}{{ v }}{% endfor %} "
                              "{{ d.get('a') }} {{ d.get('a', 9) }} {{ d.items()|length }} {{ [1, 2, 1].count(1) }} "
                              "{{ [1, 2, 3].index(2) }} {{ (1, 2).count(2) }} {{ d.copy() }} {{ d.keys()|first }}",
     {"d": {"a": 1, "b": 2}}),
    # Qwen-style constructs
    ("think_split", "[{{ c.split('</think>')[-1].lstrip('\\n') }}][{{ c.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') }}]",
     {"c": "<think>\nreason\nmore\n</think>\n\nanswer"}),
    ("tool_call_arguments", "{% for tc in calls %}{% if tc.function %}{% set tc = tc.function %}{% endif %}"
                            "{{ tc.name }}:{% if tc.arguments is string %}{{ tc.arguments }}{% else %}{{ tc.arguments|tojson }}{% endif %};"
                            "{% if tc.arguments is mapping %}{% for k, v in tc.arguments|items if k != 'e' %}{{ k }}={{ v|tojson if v is mapping or "
                            "(v is sequence and v is not string) else v|string }},{% endfor %}{% endif %}{% endfor %}",
     {"calls": [{"function": {"name": "f", "arguments": {"a": 1, "b": [1, "x"], "c": {"d": None}, "e": "s"}}},
                {"name": "g", "arguments": "{\"raw\": true}"}]}),
    ("globals", "{{ range(3)|list }} {{ range(1, 10, 3)|list }} {{ range(5, 0, -2)|list }} {{ range(0)|list }} {{ range(3)|length }} "
                "{{ dict(a=1, b=2) }} {{ dict({'x': 1}, y=2) }} {{ dict([('k', 'v')]) }} {{ range(-3)|list }} "
                "{{ strftime_now('%Y')|length }}", {}),
    # errors
    ("err_undefined_attribute", "{{ missing.attr }}", {}),
    ("err_none_attribute_chain", "{{ none.x.y }}", {}),
    ("err_dict_missing_chain", "{{ d.a.b }}", {"d": {}}),
    ("err_add_str_int", "{{ 'a' + 1 }}", {}),
    ("err_add_int_str", "{{ 1 + 'a' }}", {}),
    ("err_add_list_tuple", "{{ [1] + (2,) }}", {}),
    ("err_compare", "{{ 1 < 'a' }}", {}),
    ("err_compare_ge", "{{ [1] >= 'a' }}", {}),
    ("err_div_zero", "{{ 1 / 0 }}", {}),
    ("err_floordiv_zero", "{{ 1 // 0 }}", {}),
    ("err_mod_zero", "{{ 1 % 0 }}", {}),
    ("err_float_div_zero", "{{ 1.5 / 0 }}", {}),
    ("err_raise_exception", "a{{ raise_exception('bad input: ' ~ 3) }}", {}),
    ("err_unpack_too_many", "{% for a, b in [[1, 2, 3]] %}{% endfor %}", {}),
    ("err_unpack_not_enough", "{% set a, b = [1] %}", {}),
    ("err_range_too_big", "{{ range(100001)|length }}", {}),
    ("err_list_append", "{{ [1].append(2) }}", {}),
    ("err_dict_update", "{% set d = {} %}{{ d.update({'a': 1}) }}", {}),
    ("err_assign_non_namespace", "{% set x = 1 %}{% set x.a = 2 %}", {}),
    ("err_namespace_underscore", "{% set ns = namespace() %}{% set ns._x = 1 %}", {}),
    ("err_tojson_undefined", "{{ missing|tojson }}", {}),
    ("err_items_not_mapping", "{{ [1]|items|list }}", {}),
    ("err_macro_too_many_arguments", "{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}", {}),
    ("err_macro_keyword", "{% macro m(a) %}{% endmacro %}{{ m(b=1) }}", {}),
    ("err_call_string", "{{ 'a'() }}", {}),
    ("err_call_undefined", "{{ missing() }}", {}),
    ("err_generator_length", "{{ [1]|map('string')|length }}", {}),
    ("err_not_iterable", "{% for x in 5 %}{% endfor %}", {}),
    ("err_in_string_int", "{{ 1 in 'abc' }}", {}),
    ("err_in_none", "{{ 1 in none }}", {}),
    ("err_undefined_arithmetic", "{{ missing + 1 }}", {}),
    ("err_undefined_int", "{{ missing|int }}", {}),
    ("err_slice_step_zero", "{{ 'abc'[::0] }}", {}),
    ("err_split_empty_separator", "{{ 'a'.split('') }}", {}),
    ("err_join_non_strings", "{{ ', '.join([1, 2]) }}", {}),
    ("err_unhashable_key", "{{ {[1]: 2} }}", {}),
    ("err_dictsort_by", "{{ {'a': 1}|dictsort(by='x') }}", {}),
    ("err_sort_mixed", "{{ [1, 'a']|sort }}", {}),
    ("err_abs_string", "{{ 'a'|abs }}", {}),
    ("err_index_missing", "{{ [1, 2].index(5) }}", {}),
    ("err_unary_minus_string", "{{ -'a' }}", {}),
    ("err_multiply_float_sequence", "{{ 'a' * 1.5 }}", {}),
    ("err_undefined_subscript", "{{ missing[0] }}", {}),
    ("err_undefined_compare", "{{ missing < 1 }}", {}),
    ("err_str_index_missing", "{{ 'abc'.index('z') }}", {}),
    ("err_startswith_int", "{{ 'abc'.startswith(1) }}", {}),
    ("err_none_compare", "{{ none < 1 }}", {}),
    ("err_percent_not_all_converted", "{{ 'abc' % 5 }}", {}),
    ("err_percent_not_enough", "{{ '%s %s' % ('a',) }}", {}),
    ("err_percent_number_required", "{{ '%d' % 'x' }}", {}),
    ("err_generator_read", "{{ [1]|map('nope')|list }}", {}),
    ("err_generator_read_after_items", "{{ [1, 'a']|select('odd')|list }}", {}),
    ("err_sort_reverse_not_int", "{{ [2, 1]|sort(reverse='yes') }}", {}),
    ("err_namespace_undefined_argument", "{% set ns = namespace(nope) %}", {}),
    ("err_assign_undefined_namespace", "{% set ns.x = 1 %}", {}),
]


def jinja_cases():
    cases = []
    for name, source, variables in CASES:
        case = {"name": name, "template": source, "variables": variables}
        try:
            case["expected"] = _compile_jinja_template(source).render(**variables)
            if name.startswith("err_"):
                sys.exit(f"{name}: expected an error, rendered {case['expected']!r}")
        except Exception as e:  # noqa: BLE001 - every failure is a fixture
            if not name.startswith("err_"):
                sys.exit(f"{name}: {python_error(e)}")
            case["error"] = python_error(e)
        cases.append(case)
    return cases


# --- chat templates ---------------------------------------------------------------------------

CONTEXT_PROBE = """\
{{- bos_token if bos_token is defined else '[no bos]' }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token is defined }}
{%- if tools is none %}|tools=None{% else %}|tools={{ tools|length }}:{{ tools|map(attribute='function.name')|join(',') }}{% endif %}
|docs={{ documents }}|gen={{ add_generation_prompt }}|think={{ enable_thinking if enable_thinking is defined else 'undefined' }}
{%- for m in messages %}
[{{ loop.index0 }}:{{ m.role }}|keys={{ m.keys()|list|join(',') }}|{{ m.content if m.content is string else m.content|tojson }}
{%- if m.reasoning_content is defined %}|reasoning={{ m.reasoning_content }}|thinking={{ m.thinking }}{% endif %}
{%- if m.tool_calls %}|calls={{ m.tool_calls|tojson }}{% endif %}]
{%- endfor %}
{%- if add_generation_prompt %}{{ '\\n<|im_start|>assistant\\n' }}{% endif %}
"""

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name, e.g. \"Paris\""},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
SEARCH_TOOL = {"type": "function", "function": {
    "name": "search", "description": "Search the web.\nReturns the top results.",
    "parameters": {"type": "object", "properties": {
        "query": {"type": "string"},
        "filters": {"type": "array", "items": {"type": "string"}, "description": "Optional filters"},
        "limit": {"type": "integer", "minimum": 1}}, "required": ["query"]}}}
TOOLS = [WEATHER_TOOL, SEARCH_TOOL]

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
USER = {"role": "user", "content": "What is 2 + 2?"}
CALLS = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}},
         {"type": "function", "function": {"name": "search", "arguments": "{\"query\": \"Lyon weather\", \"filters\": [\"news\"]}"}}]
DICT_CALL = {"type": "function", "function": {"name": "search", "arguments": {
    "query": "Lyon \"weather\"", "filters": ["news", "local"], "limit": 3, "options": {"safe": True}}}}

# (name, messages, options): options are apply_chat_template's tools, documents,
# add_generation_prompt and extra keyword arguments.
CONVERSATIONS = [
    ("system_user", [SYSTEM, USER], {"add_generation_prompt": True}),
    ("user_no_generation_prompt", [USER], {"add_generation_prompt": False}),
    ("multi_turn", [SYSTEM, USER, {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3 + 3?"}],
     {"add_generation_prompt": True}),
    ("reasoning_content_history", [USER, {"role": "assistant", "reasoning_content": "Add them.\nTwo and two.",
                                          "content": "4."}, {"role": "user", "content": "Thanks"}],
     {"add_generation_prompt": True}),
    ("reasoning_content_last", [USER, {"role": "assistant", "reasoning_content": "\nAdd them.\n", "content": "\n4."}],
     {"add_generation_prompt": False}),
    ("think_tags_in_content", [USER, {"role": "assistant", "content": "<think>\nInline reasoning.\n</think>\n\nInline answer."}],
     {"add_generation_prompt": False}),
    ("reasoning_alias_thinking", [USER, {"role": "assistant", "thinking": "Aliased reasoning.", "content": "4"}],
     {"add_generation_prompt": False}),
    ("enable_thinking_false", [USER], {"add_generation_prompt": True, "kwargs": {"enable_thinking": False}}),
    ("enable_thinking_true", [USER], {"add_generation_prompt": True, "kwargs": {"enable_thinking": True}}),
    ("tools_calls_and_responses", [SYSTEM, {"role": "user", "content": "Weather in Paris and news for Lyon?"},
                                   {"role": "assistant", "content": "Let me check.", "tool_calls": CALLS},
                                   {"role": "tool", "content": "{\"temp\": 21}"},
                                   {"role": "tool", "content": "3 results"},
                                   {"role": "assistant", "content": "Paris is at 21 degrees."}],
     {"add_generation_prompt": False, "tools": TOOLS}),
    ("tools_dict_arguments", [{"role": "user", "content": "Weather in Paris?"},
                              {"role": "assistant", "content": "", "tool_calls": [CALLS[0], DICT_CALL]},
                              {"role": "tool", "content": "{\"temp\": 21}"},
                              {"role": "tool", "content": "nothing found"}],
     {"add_generation_prompt": True, "tools": TOOLS}),
    ("tools_without_system", [USER], {"add_generation_prompt": True, "tools": [WEATHER_TOOL]}),
    ("tool_call_content_null", [USER, {"role": "assistant", "content": None, "tool_calls": CALLS[:1]},
                                {"role": "tool", "content": "ok"}], {"add_generation_prompt": True, "tools": TOOLS}),
    ("multi_step_tools", [USER, {"role": "assistant", "content": "", "tool_calls": CALLS[:1]},
                          {"role": "tool", "content": "r1"},
                          {"role": "assistant", "reasoning_content": "Need more.", "content": "", "tool_calls": [DICT_CALL]},
                          {"role": "tool", "content": "r2"}],
     {"add_generation_prompt": True, "tools": TOOLS, "kwargs": {"enable_thinking": True}}),
    ("non_ascii", [{"role": "system", "content": "Réponds en français 🇫🇷"},
                   {"role": "user", "content": "Grüße aus Köln — 東京はどう？ 🌍"}], {"add_generation_prompt": True}),
    ("quotes_backslashes_newlines", [{"role": "user", "content": "He said \"hi\" and 'bye'\\n \\\\ C:\\dir\n\nSecond\tline\r\n"}],
     {"add_generation_prompt": True}),
    ("content_parts", [{"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image"},
                                                    {"type": "text", "text": " describe it."}]}],
     {"add_generation_prompt": True}),
    ("documents_and_extra_kwargs", [USER], {"add_generation_prompt": True, "documents": [{"title": "T", "text": "body"}],
                                            "kwargs": {"custom_flag": "on"}}),
    ("empty_tools_list", [USER], {"add_generation_prompt": True, "tools": []}),
    ("empty_content", [{"role": "user", "content": ""}], {"add_generation_prompt": True}),
    ("system_not_first", [USER, SYSTEM], {"add_generation_prompt": True}),
    ("no_user_message", [SYSTEM, {"role": "assistant", "content": "Hi"}], {"add_generation_prompt": True}),
]


def render_chat(tokenizer, source, messages, options):
    kwargs = dict(options.get("kwargs", {}))
    if source is not None:
        kwargs["chat_template"] = source
    return tokenizer.apply_chat_template(
        messages, tools=options.get("tools"), documents=options.get("documents"),
        add_generation_prompt=options["add_generation_prompt"], tokenize=False, **kwargs)


def chat_fixture(tokenizer, name, source, origin, use_model_template=False):
    cases = []
    for conv_name, messages, options in CONVERSATIONS:
        case = {"name": conv_name, "messages": messages, "tools": options.get("tools"),
                "documents": options.get("documents"), "add_generation_prompt": options["add_generation_prompt"],
                "kwargs": options.get("kwargs", {})}
        try:
            case["expected"] = render_chat(tokenizer, None if use_model_template else source, messages, options)
        except Exception as e:  # noqa: BLE001 - a template refusing a conversation is a fixture too
            case["error"] = python_error(e)
        cases.append(case)
    return {"generator": "tools/make_chat_template_fixtures.py", "versions": versions(),
            "template": {"name": name, "source": source, "origin": origin},
            "special_tokens": tokenizer.special_tokens_map, "cases": cases}


def versions():
    return {"transformers": transformers.__version__, "jinja2": jinja2.__version__}


def write(name, data):
    path = os.path.join(OUT, name)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"  {os.path.relpath(path, ROOT)}")


def main():
    os.makedirs(OUT, exist_ok=True)
    print("writing:")
    write("jinja_cases.json", {"generator": "tools/make_chat_template_fixtures.py", "versions": versions(),
                               "renderer": "transformers.utils.chat_template_utils._compile_jinja_template(template)"
                                           ".render(**variables)",
                               "cases": jinja_cases()})
    tokenizer = AutoTokenizer.from_pretrained(MICRO)
    with open(os.path.join(MICRO, "chat_template.jinja"), encoding="utf-8") as f:
        micro_source = f.read()
    if tokenizer.chat_template != micro_source:
        sys.exit("AutoTokenizer did not load models/qwen3_5_moe-micro/chat_template.jinja")
    write("qwen3_5_moe_micro.json", chat_fixture(
        tokenizer, "qwen3_5_moe_micro", micro_source,
        {"path": "models/qwen3_5_moe-micro/chat_template.jinja", "note": "loaded by AutoTokenizer from the model directory"},
        use_model_template=True))
    write("context_probe.json", chat_fixture(
        tokenizer, "context_probe", CONTEXT_PROBE,
        {"path": "tools/make_chat_template_fixtures.py", "note": "written for these fixtures"}))
    for name, (source, origin) in real_templates().items():
        write(f"{name}.json", chat_fixture(tokenizer, name, source, origin))


if __name__ == "__main__":
    main()
