// Tests of qflash/io/tokenizer.hpp: small tokenizers built here pin each pipeline stage, the
// malformed-file errors, and the Qwen fixture (generated with Hugging Face `tokenizers` by
// tools/make_tokenizer_fixture.py) pins exact agreement with the reference implementation.
#include <doctest/doctest.h>

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <unistd.h>

#include "qflash/io/tokenizer.hpp"

using qflash::Error;
using namespace qflash::io;
namespace detail = qflash::io::detail;

namespace {

constexpr std::string_view kQwen2Split =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

/// A file under the temp directory, removed when this goes out of scope.
class TempFile {
 public:
  explicit TempFile(std::string const& text) {
    static std::atomic<int> counter{0};
    path_ = (std::filesystem::temp_directory_path() /
             ("qflash_tokenizer_test_" + std::to_string(::getpid()) + "_" +
              std::to_string(counter++) + ".json"))
                .string();
    std::ofstream(path_, std::ios::binary) << text;
  }
  TempFile(TempFile const&) = delete;
  TempFile& operator=(TempFile const&) = delete;
  ~TempFile() {
    std::error_code ec;
    std::filesystem::remove(path_, ec);
  }
  [[nodiscard]] std::string const& path() const { return path_; }

 private:
  std::string path_;
};

std::string byte_level(std::string_view bytes) {
  std::string s;
  detail::append_byte_level(s, bytes);
  return s;
}

/// A small Qwen-shaped tokenizer.json: ids 0..255 are the bytes, then the tokens `merges`
/// create in order, then the added tokens. Merges are written in the byte-level spelling
/// from raw-byte pairs.
Json make_tokenizer(std::vector<std::pair<std::string, std::string>> const& merges,
                    bool tuple_merges = false) {
  Json vocab = Json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_level(std::string(1, static_cast<char>(b)))] = b;
  Json merge_list = Json::array();
  int next = 256;
  for (auto const& [a, b] : merges) {
    std::string const la = byte_level(a), lb = byte_level(b);
    if (!vocab.contains(la + lb)) vocab[la + lb] = next++;
    if (tuple_merges)
      merge_list.push_back(Json::array({la, lb}));
    else
      merge_list.push_back(la + " " + lb);
  }
  auto added = [](int id, char const* content, bool special) {
    return Json{{"id", id},           {"content", content}, {"single_word", false},
                {"lstrip", false},    {"rstrip", false},    {"normalized", false},
                {"special", special}};
  };
  Json j;
  j["version"] = "1.0";
  j["truncation"] = nullptr;
  j["padding"] = nullptr;
  j["added_tokens"] = Json::array({added(1000, "<|endoftext|>", true),
                                   added(1001, "<|im_start|>", true),
                                   added(1002, "<|im_end|>", true),
                                   added(1003, "<think>", false)});
  j["normalizer"] = {{"type", "NFC"}};
  j["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       Json::array({Json{{"type", "Split"},
                         {"pattern", {{"Regex", std::string(kQwen2Split)}}},
                         {"behavior", "Isolated"},
                         {"invert", false}},
                    Json{{"type", "ByteLevel"},
                         {"add_prefix_space", false},
                         {"trim_offsets", false},
                         {"use_regex", false}}})}};
  j["post_processor"] = {{"type", "ByteLevel"},
                         {"add_prefix_space", false},
                         {"trim_offsets", false},
                         {"use_regex", false}};
  j["decoder"] = {{"type", "ByteLevel"},
                  {"add_prefix_space", false},
                  {"trim_offsets", false},
                  {"use_regex", false}};
  j["model"] = {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", nullptr},
                {"continuing_subword_prefix", ""},
                {"end_of_word_suffix", ""},
                {"fuse_unk", false},
                {"byte_fallback", false},
                {"ignore_merges", false},
                {"vocab", vocab},
                {"merges", merge_list}};
  return j;
}

Tokenizer load(Json const& j) {
  TempFile f(j.dump());
  return Tokenizer::from_file(f.path());
}

std::vector<std::string> token_strings(Tokenizer const& t, std::vector<std::int32_t> const& ids) {
  std::vector<std::string> out;
  for (auto id : ids) out.emplace_back(t.token_bytes(id));
  return out;
}

using Strings = std::vector<std::string>;

}  // namespace

TEST_CASE("byte-level table is GPT-2's bytes_to_unicode") {
  auto const& t = detail::kByteLevel;
  CHECK(t.byte_to_cp['A'] == U'A');
  CHECK(t.byte_to_cp[' '] == 0x120);   // Ġ
  CHECK(t.byte_to_cp['\n'] == 0x10A);  // Ċ
  CHECK(t.byte_to_cp[0x00] == 0x100);
  CHECK(t.byte_to_cp[0xAD] == 0x143);  // the last remapped byte
  CHECK(t.byte_to_cp[0xE9] == 0xE9);
  for (int b = 0; b < 256; ++b) CHECK(t.cp_to_byte[t.byte_to_cp[b]] == b);
  std::string bytes;
  REQUIRE(detail::byte_level_to_bytes(byte_level("a b\n\xE4\xBD\xA0"), bytes));
  CHECK(bytes == "a b\n\xE4\xBD\xA0");
  CHECK_FALSE(detail::byte_level_to_bytes("\xE4\xBD\xA0", bytes));  // 你 is not a byte char
}

TEST_CASE("UTF-8 repair matches from_utf8_lossy (one U+FFFD per maximal subpart)") {
  auto lossy = [](std::string_view s) {
    std::string out;
    detail::append_utf8_lossy(out, s, true);
    return out;
  };
  std::string const r = "\xEF\xBF\xBD";
  CHECK(lossy("abc") == "abc");
  CHECK(lossy("Hello\xF0\x90\x80World") == "Hello" + r + "World");  // cut 4-byte character
  CHECK(lossy("\xE0\x80") == r + r);                                 // overlong lead, then stray
  CHECK(lossy("\xED\xA0\x80") == r + r + r);                         // surrogate
  CHECK(lossy("\xF4\x90\x80\x80") == r + r + r + r);                 // above U+10FFFF
  CHECK(lossy("\xC3") == r);
  CHECK(lossy("a\xC3\xA9\xFF") == "a\xC3\xA9" + r);
  std::string out;
  CHECK(detail::append_utf8_lossy(out, "ab\xE4\xBD", false) == 2);  // waits for the rest
  CHECK(out == "ab");
  CHECK(detail::is_valid_utf8("\xF0\x9F\x98\x80"));
  CHECK_FALSE(detail::is_valid_utf8("\xC0\xAF"));
  CHECK(detail::utf8_find_invalid("ok\x80") == 2);
}

TEST_CASE("NFC through utf8proc") {
  CHECK(detail::nfc("e\xCC\x81") == "\xC3\xA9");               // e + U+0301 -> é
  CHECK(detail::nfc("\xE1\x84\x80\xE1\x85\xA1") == "\xEA\xB0\x80");  // Hangul jamo -> 가
  CHECK(detail::nfc("\xE2\x84\xAB") == "\xC3\x85");            // Angstrom sign -> Å
  CHECK(detail::nfc("plain ascii") == "plain ascii");
  // Only runs around code points >= U+0300 go through utf8proc: same result as all of it.
  std::vector<std::string_view> const atoms = {
      "a", "e", " ", "\n", "\xC3\xA9", "\xCC\x81", "\xCC\xA3", "\xCC\x82", "\xE1\x84\x80",
      "\xE1\x85\xA1", "\xE1\x86\xA8", "\xEA\xB0\x80", "\xE2\x84\xAB", "\xE4\xBD\xA0",
      "\xE0\xA4\xA8", "\xE0\xA4\xBC", "\xF0\x9F\x98\x80", "\xC5\xBF", "x"};
  std::uint32_t seed = 12345;
  auto next = [&] { return seed = seed * 1664525u + 1013904223u; };
  for (int round = 0; round < 2000; ++round) {
    std::string s;
    for (std::uint32_t k = next() % 12; k > 0; --k) s += atoms[(next() >> 8) % atoms.size()];
    std::string whole;
    detail::append_nfc_utf8proc(whole, s);
    CAPTURE(s);
    CHECK(detail::nfc(s) == whole);
  }
  CHECK(detail::nfc_trivially_stable("caf\xC3\xA9"));
  CHECK_FALSE(detail::nfc_trivially_stable("\xE4\xBD\xA0"));
}

TEST_CASE("regex escapes mean what they mean in Oniguruma") {
  detail::MatchData md;
  auto matches = [&](std::string_view pattern, std::string_view text) {
    detail::Regex re(pattern, false, "test");
    std::vector<std::string> out;
    re.for_each_match(text, md, [&](std::size_t b, std::size_t e) {
      out.emplace_back(text.substr(b, e - b));
    });
    return out;
  };
  // U+180E MONGOLIAN VOWEL SEPARATOR is \s for PCRE2 10.42, not for Oniguruma.
  CHECK(matches(R"(\s+)", "a\xE1\xA0\x8E" "b\xC2\xA0\xE3\x80\x80" "c") ==
        Strings{"\xC2\xA0\xE3\x80\x80"});
  CHECK(matches(R"([^\s\p{L}]+)", "\xE1\xA0\x8E' x") == Strings{"\xE1\xA0\x8E'"});
  CHECK(matches(R"(\S+)", "\xE1\xA0\x8E x") == Strings{"\xE1\xA0\x8E", "x"});
  CHECK(matches(R"(\w+)", "e\xCC\x81t\xE2\x80\xBF" "1 _") == Strings{"e\xCC\x81t\xE2\x80\xBF" "1", "_"});
  CHECK(matches(R"(\h+)", "zz0fAz") == Strings{"0fA"});
  CHECK(matches(R"(\\s)", "\\s s") == Strings{"\\s"});        // an escaped backslash, then 's'
  CHECK(matches(R"([\]\s]+)", "a] b") == Strings{"] "});          // ']' escaped inside a class
  CHECK(matches(R"([]s]+)", "a]s b") == Strings{"]s"});             // ']' first is literal
  CHECK(matches(R"(\Q\s\E)", "\\s ") == Strings{"\\s"});        // \Q..\E stays literal
  CHECK(matches(R"([[:digit:]\s]+)", "a1 2b") == Strings{"1 2"});  // POSIX class kept
  CHECK(matches("", "abc").empty());                              // empty matches are dropped

  // Through the Qwen split: "\u180E'" is one punctuation piece, so "'d" never merges.
  auto t = load(make_tokenizer({{"'", "d"}}));
  CHECK(token_strings(t, t.encode("\xE1\xA0\x8E'd")) ==
        Strings{"\xE1", "\xA0", "\x8E", "'", "d"});
  CHECK(token_strings(t, t.encode("x'd")) == Strings{"x", "'d"});
}

TEST_CASE("BPE merges by rank, leftmost first") {
  SUBCASE("lower rank wins") {
    auto t = load(make_tokenizer({{"b", "c"}, {"a", "b"}, {"ab", "c"}}));
    CHECK(token_strings(t, t.encode("abc")) == Strings{"a", "bc"});
  }
  SUBCASE("the merged pair can merge again") {
    auto t = load(make_tokenizer({{"a", "b"}, {"b", "c"}, {"ab", "c"}}));
    CHECK(token_strings(t, t.encode("abc")) == Strings{"abc"});
  }
  SUBCASE("ties go to the leftmost pair") {
    auto t = load(make_tokenizer({{"a", "a"}}));
    CHECK(token_strings(t, t.encode("aaa")) == Strings{"aa", "a"});
    CHECK(token_strings(t, t.encode("aaaa")) == Strings{"aa", "aa"});
  }
  SUBCASE("[a, b] pair merges equal \"a b\" strings") {
    auto t1 = load(make_tokenizer({{"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"}}));
    auto t2 = load(make_tokenizer({{"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"}}, true));
    CHECK(token_strings(t1, t1.encode("hello")) == Strings{"hello"});
    CHECK(t1.encode("hello hellx") == t2.encode("hello hellx"));
  }
  SUBCASE("a long word is merged without quadratic work") {
    auto t = load(make_tokenizer({{"a", "a"}, {"aa", "aa"}, {"aaaa", "aaaa"}}));
    std::string const word(200000, 'a');
    auto ids = t.encode(word);
    CHECK(ids.size() == 200000 / 8);
    CHECK(t.decode(ids) == word);
  }
}

TEST_CASE("ignore_merges takes a whole word found in the vocabulary") {
  Json j = make_tokenizer({{"a", "b"}, {"b", "c"}});
  j["model"]["vocab"][byte_level("abc")] = 900;
  auto t1 = load(j);
  CHECK(token_strings(t1, t1.encode("abc")) == Strings{"ab", "c"});
  j["model"]["ignore_merges"] = true;
  auto t2 = load(j);
  CHECK(t2.encode("abc") == std::vector<std::int32_t>{900});
  CHECK(token_strings(t2, t2.encode("abd")) == Strings{"ab", "d"});
}

TEST_CASE("bytes missing from the vocabulary become unk_token, fused with fuse_unk") {
  // Expected ids from tokenizers 0.23.3 on the same vocabulary.
  Json j = make_tokenizer({});
  j["added_tokens"] = Json::array();
  j["model"]["vocab"].erase(byte_level("\xC2"));
  j["model"]["vocab"].erase(byte_level("\x80"));
  j["model"]["vocab"]["<unk>"] = 999;
  j["model"]["unk_token"] = "<unk>";
  using Ids = std::vector<std::int32_t>;
  auto t = load(j);
  CHECK(t.encode("\xC2\x80") == Ids{999, 999});
  CHECK(t.encode("a\xC2\x80\xC2\x80" "b") == Ids{'a', 999, 999, 999, 999, 'b'});
  CHECK(t.encode("\xC3\x80\xC2\x80") == Ids{0xC3, 999, 999, 999});
  j["model"]["fuse_unk"] = true;
  auto f = load(j);
  CHECK(f.encode("\xC2\x80") == Ids{999});
  CHECK(f.encode("a\xC2\x80\xC2\x80" "b") == Ids{'a', 999, 'b'});
  CHECK(f.encode("\xC3\x80\xC2\x80") == Ids{0xC3, 999, 999});
  // Without unk_token they vanish, as in tokenizers.
  j["model"]["unk_token"] = nullptr;
  CHECK(load(j).encode("a\xC2\x80" "b") == Ids{'a', 'b'});
}

TEST_CASE("Qwen split regex keeps merges inside pre-tokens") {
  auto t = load(make_tokenizer({{"o", " "}, {" ", "w"}, {"1", "2"}, {"'", "S"}, {"t", "'"}}));
  // "o" and " w" are separate pre-tokens, so "o " never merges.
  CHECK(token_strings(t, t.encode("o w")) == Strings{"o", " w"});
  CHECK(token_strings(t, t.encode("12")) == Strings{"1", "2"});  // one digit per pre-token
  CHECK(token_strings(t, t.encode("it'S")) == Strings{"i", "t", "'S"});  // (?i:'s)
  // "\s+(?!\S)": the last space before a word goes with the word.
  auto spaces = token_strings(t, t.encode("a   w"));
  CHECK(spaces == Strings{"a", " ", " ", " w"});
}

TEST_CASE("added tokens are matched first and never split") {
  auto t = load(make_tokenizer({{"<", "|"}, {"i", "m"}}));
  auto const start = *t.token_id("<|im_start|>");
  auto const end = *t.token_id("<|im_end|>");
  auto const think = *t.token_id("<think>");
  CHECK(start == 1001);
  CHECK(t.is_special(start));
  CHECK_FALSE(t.is_special(think));
  CHECK(t.is_added(think));

  auto ids = t.encode("<|im_start|>user\nhi<|im_end|><think>");
  REQUIRE(ids.size() >= 4);
  CHECK(ids.front() == start);
  CHECK(ids[ids.size() - 2] == end);
  CHECK(ids.back() == think);
  CHECK(t.decode(ids) == "<|im_start|>user\nhi<|im_end|><think>");
  CHECK(t.decode(ids, /*skip_special=*/true) == "user\nhi<think>");

  SUBCASE("allow_special=false encodes special tokens as text, not other added tokens") {
    auto plain = t.encode("<|im_end|><think>", /*allow_special=*/false);
    CHECK(std::find(plain.begin(), plain.end(), end) == plain.end());
    CHECK(plain.back() == think);
    CHECK(token_strings(t, plain).front() == "<|");
    CHECK(t.decode(plain) == "<|im_end|><think>");
  }
  SUBCASE("leftmost-longest match") {
    Json j = make_tokenizer({});
    j["added_tokens"].push_back({{"id", 1004}, {"content", "<|im"}, {"special", true}});
    auto t2 = load(j);
    CHECK(t2.encode("x<|im_end|>") == std::vector<std::int32_t>{'x', 1002});
    CHECK(t2.encode("<|im") == std::vector<std::int32_t>{1004});
  }
}

TEST_CASE("added token options: lstrip, rstrip, single_word, normalized") {
  Json j = make_tokenizer({});
  j["added_tokens"] = Json::array(
      {Json{{"id", 1000}, {"content", "<mask>"}, {"lstrip", true}, {"rstrip", true},
            {"special", true}, {"normalized", false}},
       Json{{"id", 1001}, {"content", "cat"}, {"single_word", true}, {"special", false},
            {"normalized", false}},
       Json{{"id", 1002}, {"content", "\xC3\xA9t\xC3\xA9"}, {"special", false},
            {"normalized", true}}});
  auto t = load(j);
  CHECK(t.encode("a  <mask>  b") == std::vector<std::int32_t>{'a', 1000, 'b'});
  CHECK(t.encode("cat") == std::vector<std::int32_t>{1001});
  CHECK(t.encode("a cat.") == std::vector<std::int32_t>{'a', ' ', 1001, '.'});
  CHECK(t.encode("cats").size() == 4);  // inside a word: not the token
  // Found in the NFC form of the text: "e\u0301te\u0301" is "été" after NFC.
  CHECK(t.encode("e\xCC\x81te\xCC\x81") == std::vector<std::int32_t>{1002});
}

TEST_CASE("Split behaviours and a lone ByteLevel with the GPT-2 regex") {
  auto pieces_with = [](char const* behavior, bool invert) {
    // Merges across a "-" would show up as one token; none are defined, so count tokens of
    // pre-tokens by merging every pair of letters inside a pre-token instead.
    Json j = make_tokenizer({{"a", "-"}, {"-", "b"}, {"a", "b"}});
    j["pre_tokenizer"]["pretokenizers"][0] = {
        {"type", "Split"}, {"pattern", {{"String", "-"}}}, {"behavior", behavior},
        {"invert", invert}};
    auto t = load(j);
    return token_strings(t, t.encode("a-b"));
  };
  CHECK(pieces_with("Isolated", false) == Strings{"a", "-", "b"});
  CHECK(pieces_with("Removed", false) == Strings{"a", "b"});
  CHECK(pieces_with("MergedWithPrevious", false) == Strings{"a-", "b"});
  CHECK(pieces_with("MergedWithNext", false) == Strings{"a", "-b"});
  CHECK(pieces_with("Contiguous", false) == Strings{"a", "-", "b"});
  CHECK(pieces_with("Removed", true) == Strings{"-"});

  Json j = make_tokenizer({{" ", "w"}, {"o", " "}});
  j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", true},
                        {"trim_offsets", true}, {"use_regex", true}};
  auto t = load(j);
  CHECK(token_strings(t, t.encode("o w")) == Strings{" ", "o", " w"});  // prefix space added
}

TEST_CASE("decode and StreamDecoder") {
  auto t = load(make_tokenizer({{"\xE4", "\xBD"}, {"\xE4\xBD", "\xA0"}}));
  std::string const text = "a\xE4\xBD\xA0 \xF0\x9F\x98\x80!";  // a你 😀!
  auto ids = t.encode(text);
  CHECK(t.decode(ids) == text);
  CHECK(t.token_bytes(*t.token_id(byte_level("\xE4\xBD\xA0"))) == "\xE4\xBD\xA0");

  StreamDecoder s(t);
  std::string joined;
  for (auto id : ids) {
    std::string chunk = s.push(id);
    CHECK(detail::is_valid_utf8(chunk));
    joined += chunk;
  }
  joined += s.flush();
  CHECK(joined == text);

  // The emoji is 4 byte tokens: nothing comes out until its last byte.
  StreamDecoder s2(t);
  CHECK(s2.push(0xF0) == "");
  CHECK(s2.push(0x9F) == "");
  CHECK(s2.push(0x98) == "");
  CHECK(s2.pending_bytes() == 3);
  CHECK(s2.push(0x80) == "\xF0\x9F\x98\x80");
  CHECK(s2.push(0xE4) == "");
  CHECK(s2.flush() == "\xEF\xBF\xBD");  // cut at the end of the stream

  // Invalid bytes come out as U+FFFD as soon as they are known to be invalid.
  std::vector<std::int32_t> bad{'a', 0xFF, 0xE4, 'b'};
  StreamDecoder s3(t);
  std::string out;
  for (auto id : bad) out += s3.push(id);
  out += s3.flush();
  CHECK(out == t.decode(bad));
  CHECK(out == "a\xEF\xBF\xBD\xEF\xBF\xBD" "b");

  // Unknown ids decode to nothing; skip_special drops special tokens.
  CHECK(t.decode(std::vector<std::int32_t>{'x', -5, 999999, 1002, 'y'}) == "x<|im_end|>y");
  StreamDecoder s4(t, /*skip_special=*/true);
  CHECK(s4.push(1002) == "");
  CHECK(s4.push('y') == "y");
  CHECK(t.token(1002) == "<|im_end|>");
  CHECK(t.token(' ') == "\xC4\xA0");  // Ġ
  CHECK(t.token(-1).empty());
  CHECK(t.vocab_size() == 1004);
}

TEST_CASE("encode rejects invalid UTF-8 and handles empty text") {
  auto t = load(make_tokenizer({}));
  CHECK(t.encode("").empty());
  CHECK_THROWS_WITH_AS(t.encode("ab\xC3("), doctest::Contains("not valid UTF-8 (byte 2"), Error);
}

TEST_CASE("concurrent encodes agree") {
  auto t = load(make_tokenizer({{"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"}}));
  std::string text;
  for (int i = 0; i < 300; ++i) text += "hello world " + std::to_string(i) + " ";
  auto const want = t.encode(text);
  std::vector<std::thread> threads;
  std::atomic<int> mismatches{0};
  for (int k = 0; k < 4; ++k)
    threads.emplace_back([&] {
      for (int r = 0; r < 5; ++r)
        if (t.encode(text) != want) ++mismatches;
    });
  for (auto& th : threads) th.join();
  CHECK(mismatches == 0);
}

// --- malformed tokenizer.json ---------------------------------------------------------------

namespace {

/// Loads `text` from a temp file and returns the Error message (empty if it loaded).
std::string load_error(std::string const& text, std::string* path = nullptr) {
  TempFile f(text);
  if (path) *path = f.path();
  try {
    (void)Tokenizer::from_file(f.path());
  } catch (Error const& e) {
    return e.what();
  }
  return {};
}

std::string load_error(Json const& j, std::string* path = nullptr) {
  return load_error(j.dump(), path);
}

}  // namespace

TEST_CASE("malformed tokenizer.json gives errors naming the file and the field") {
  Json const good = make_tokenizer({{"a", "b"}});
  REQUIRE(load_error(good).empty());

  struct Case {
    char const* name;
    Json j;
    std::vector<std::string> expect;  // substrings of the message
  };
  std::vector<Case> cases;
  auto with = [&](char const* name, auto edit, std::vector<std::string> expect) {
    Json j = good;
    edit(j);
    cases.push_back({name, std::move(j), std::move(expect)});
  };
  with("missing model", [](Json& j) { j.erase("model"); }, {"missing field 'model'"});
  with("missing vocab", [](Json& j) { j["model"].erase("vocab"); },
       {"missing field 'model.vocab'"});
  with("vocab not an object", [](Json& j) { j["model"]["vocab"] = Json::array(); },
       {"'model.vocab' must be a JSON object"});
  with("bad id", [](Json& j) { j["model"]["vocab"]["zz"] = "seven"; },
       {"model.vocab[\"zz\"]", "token id"});
  with("negative id", [](Json& j) { j["model"]["vocab"]["zz"] = -3; }, {"model.vocab[\"zz\"]"});
  with("duplicate id", [](Json& j) { j["model"]["vocab"]["zz"] = 5; },
       {"model.vocab", "gives id 5 to both"});
  with("one id far past the others (a 1 GB table from a small file)",
       [](Json& j) { j["model"]["vocab"]["zz"] = (1 << 24) - 1; },
       {"token id 16777215 is far beyond the", "tokens defined"});
  with("unknown model type", [](Json& j) { j["model"]["type"] = "WordPiece"; },
       {"'model.type'", "\"WordPiece\"", "unsupported model type"});
  with("missing merges", [](Json& j) { j["model"].erase("merges"); },
       {"missing field 'model.merges'"});
  with("merge without a space", [](Json& j) { j["model"]["merges"][0] = "ab"; },
       {"'model.merges[0]'", "\"a b\""});
  with("merge with two spaces", [](Json& j) { j["model"]["merges"][0] = "a b c"; },
       {"'model.merges[0]'"});
  with("merge pair of three", [](Json& j) { j["model"]["merges"][0] = {"a", "b", "c"}; },
       {"'model.merges[0]'"});
  with("merge of unknown token", [](Json& j) { j["model"]["merges"][0] = "a qq"; },
       {"'model.merges[0]'", "missing from model.vocab", "\"qq\""});
  with("merge into unknown token", [](Json& j) { j["model"]["merges"][0] = "b a"; },
       {"'model.merges[0]'", "merges into \"ba\""});
  with("dropout", [](Json& j) { j["model"]["dropout"] = 0.1; }, {"'model.dropout'"});
  with("byte_fallback", [](Json& j) { j["model"]["byte_fallback"] = true; },
       {"'model.byte_fallback'"});
  with("unk not in vocab", [](Json& j) { j["model"]["unk_token"] = "<unk>"; },
       {"'model.unk_token'"});
  with("added token without id", [](Json& j) { j["added_tokens"][1].erase("id"); },
       {"missing field 'added_tokens[1].id'"});
  with("added token with empty content", [](Json& j) { j["added_tokens"][0]["content"] = ""; },
       {"'added_tokens[0].content'"});
  with("added token flag not a bool", [](Json& j) { j["added_tokens"][2]["lstrip"] = "yes"; },
       {"'added_tokens[2].lstrip'", "true or false"});
  with("unsupported normalizer", [](Json& j) { j["normalizer"] = {{"type", "NFKC"}}; },
       {"'normalizer.type'", "\"NFKC\"", "unsupported normalizer"});
  with("unsupported normalizer in a sequence",
       [](Json& j) {
         j["normalizer"] = {{"type", "Sequence"},
                            {"normalizers", Json::array({{{"type", "NFC"}}, {{"type", "Lowercase"}}})}};
       },
       {"'normalizer.normalizers[1].type'"});
  with("missing pre_tokenizer", [](Json& j) { j.erase("pre_tokenizer"); },
       {"missing field 'pre_tokenizer'"});
  with("unsupported pre_tokenizer",
       [](Json& j) { j["pre_tokenizer"]["pretokenizers"][0] = {{"type", "Metaspace"}}; },
       {"'pre_tokenizer.pretokenizers[0].type'", "\"Metaspace\"", "unsupported pre_tokenizer"});
  with("no ByteLevel", [](Json& j) { j["pre_tokenizer"]["pretokenizers"].erase(1); },
       {"'pre_tokenizer'", "ByteLevel"});
  with("ByteLevel not last",
       [](Json& j) {
         auto& l = j["pre_tokenizer"]["pretokenizers"];
         l.push_back(l[0]);
       },
       {"'pre_tokenizer.pretokenizers[2]'", "ByteLevel must be the last"});
  with("regex that does not compile",
       [](Json& j) {
         j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(?i:'s|\\p{L}+";
       },
       {"'pre_tokenizer.pretokenizers[0].pattern.Regex'", "failed to compile at offset 13",
        "missing closing parenthesis"});
  with("split pattern of neither kind",
       [](Json& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {{"Glob", "*"}}; },
       {"'pre_tokenizer.pretokenizers[0].pattern'"});
  with("bad split behavior",
       [](Json& j) { j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Sideways"; },
       {"'pre_tokenizer.pretokenizers[0].behavior'", "Isolated"});
  with("post-processor that adds tokens",
       [](Json& j) { j["post_processor"] = {{"type", "TemplateProcessing"}}; },
       {"'post_processor.type'", "\"TemplateProcessing\""});
  with("missing decoder", [](Json& j) { j.erase("decoder"); }, {"missing field 'decoder'"});
  with("unsupported decoder", [](Json& j) { j["decoder"] = {{"type", "WordPiece"}}; },
       {"'decoder.type'"});

  for (auto const& c : cases) {
    std::string const name = c.name;
    CAPTURE(name);
    std::string path;
    std::string const msg = load_error(c.j, &path);
    CAPTURE(msg);
    CHECK(msg.find(path) != std::string::npos);
    for (auto const& e : c.expect) CHECK(msg.find(e) != std::string::npos);
  }

  SUBCASE("not JSON") {
    std::string path;
    std::string const msg = load_error(std::string("{\"model\": "), &path);
    CHECK(msg.find(path) != std::string::npos);
    CHECK(msg.find("invalid JSON") != std::string::npos);
  }
  SUBCASE("no such file") {
    CHECK_THROWS_WITH_AS((void)Tokenizer::from_file("/nonexistent/tokenizer.json"),
                         doctest::Contains("/nonexistent/tokenizer.json"), Error);
  }
}

// --- agreement with Hugging Face tokenizers ---------------------------------------------------

TEST_CASE("Qwen tokenizer fixture: ids, round trip and streaming match tokenizers") {
  std::string const dir = QFLASH_FIXTURES_DIR "/tokenizer";
  REQUIRE_MESSAGE(std::filesystem::exists(dir + "/tokenizer.json"),
                  "missing fixture; generate it with tools/make_tokenizer_fixture.py");
  auto const tok = Tokenizer::from_file(dir + "/tokenizer.json");
  Json const cases = read_json_file(dir + "/encodings.json");
  REQUIRE(cases.is_array());
  REQUIRE(cases.size() > 0);

  std::size_t n_ids = 0;
  for (std::size_t i = 0; i < cases.size(); ++i) {
    std::string const text = cases[i].at("text").get<std::string>();
    auto const want = cases[i].at("ids").get<std::vector<std::int32_t>>();
    CAPTURE(i);
    CAPTURE(text);
    auto const ids = tok.encode(text);
    CHECK(ids == want);
    n_ids += ids.size();

    std::string const decoded = tok.decode(want);
    CHECK(decoded == detail::nfc(text));
    if (cases[i].contains("decoded")) CHECK(decoded == cases[i]["decoded"].get<std::string>());
    if (cases[i].contains("tokens")) {
      auto const tokens = cases[i]["tokens"].get<std::vector<std::string>>();
      REQUIRE(tokens.size() == want.size());
      for (std::size_t k = 0; k < want.size(); ++k) CHECK(tok.token(want[k]) == tokens[k]);
    }

    StreamDecoder stream(tok);
    std::string joined;
    bool chunks_valid = true;
    for (auto id : want) {
      std::string const chunk = stream.push(id);
      chunks_valid = chunks_valid && detail::is_valid_utf8(chunk);
      joined += chunk;
    }
    std::string const tail = stream.flush();
    chunks_valid = chunks_valid && detail::is_valid_utf8(tail);
    joined += tail;
    CHECK(chunks_valid);
    CHECK(joined == decoded);
  }
  MESSAGE(cases.size(), " fixture texts, ", n_ids, " ids");
}
