#include <doctest/doctest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "qflash/core/error.hpp"
#include "qflash/core/log.hpp"
#include "qflash/core/mapped_file.hpp"
#include "qflash/core/parallel.hpp"
#include "qflash/core/tensor_view.hpp"

using namespace qflash;

TEST_CASE("QFLASH_CHECK throws Error with message, file and line") {
  try {
    int const got = 3;
    QFLASH_CHECK(got == 4, "expected 4, got ", got);
    FAIL("did not throw");
  } catch (Error const& e) {
    CHECK(std::string(e.what()) == "expected 4, got 3");
    CHECK(std::string(e.file()).find("core_test.cpp") != std::string::npos);
    CHECK(e.line() > 0);
  }
  CHECK_NOTHROW(QFLASH_CHECK(true, "never"));
  CHECK_THROWS_WITH_AS(QFLASH_CHECK_STATUS(Status::kErrorArchMismatch, "launch"),
                       "launch: arch mismatch", Error);
}

TEST_CASE("log sink receives messages and can be replaced") {
  std::vector<std::pair<LogLevel, std::string>> seen;
  set_log_sink([&](LogLevel l, std::string_view m) { seen.emplace_back(l, std::string(m)); });
  QFLASH_LOG_INFO("loaded ", 3, " tensors");
  QFLASH_LOG_WARN("slow path");
  set_log_sink({});
  QFLASH_LOG_WARN("dropped");
  REQUIRE(seen.size() == 2);
  CHECK(seen[0].first == LogLevel::kInfo);
  CHECK(seen[0].second == "loaded 3 tensors");
  CHECK(seen[1].first == LogLevel::kWarn);
  set_log_sink(detail::default_log_sink);
}

TEST_CASE("Shape and TensorView") {
  Shape s{2, 3, 4};
  CHECK(s.rank == 3);
  CHECK(s.numel() == 24);
  CHECK(to_string(s) == "[2, 3, 4]");
  CHECK(s == Shape{2, 3, 4});
  CHECK_FALSE(s == Shape{2, 3});
  CHECK_THROWS_AS((Shape{1, 2, 3, 4, 5}), Error);

  std::vector<float> data(24);
  TensorView v{data.data(), DType::kF32, s};
  CHECK(v.bytes() == 96);
  CHECK(v.as<float>(DType::kF32) == data.data());
  CHECK_THROWS_WITH_AS((void)v.as<float>(DType::kBF16), "tensor holds f32, expected bf16", Error);
}

TEST_CASE("parallel_for visits every index once") {
  std::vector<int> hits(1000, 0);
  parallel_for(0, 1000, [&](std::int64_t i) { hits[static_cast<std::size_t>(i)] += 1; });
  for (int h : hits) CHECK(h == 1);
  CHECK(max_threads() >= 1);
}

TEST_CASE("MappedFile maps a file read-only and names the path on failure") {
  std::string const path = "qflash_mapped_file_test.bin";
  {
    std::ofstream f(path, std::ios::binary);
    f << "hello qflash";
  }
  {
    MappedFile m(path);
    CHECK(m.size() == 12);
    CHECK(std::string(reinterpret_cast<char const*>(m.data()), m.size()) == "hello qflash");
    MappedFile moved = std::move(m);
    CHECK(moved.size() == 12);
    CHECK(m.data() == nullptr);
  }
  std::remove(path.c_str());
  CHECK_THROWS_WITH_AS(MappedFile("/nonexistent/qflash.bin"),
                       doctest::Contains("/nonexistent/qflash.bin: cannot open"), Error);
}

namespace {
/// Bytes of the mapping starting at `p` that are mapped into this process (/proc/self/smaps'
/// Rss), or -1 when there is no such mapping.
std::int64_t mapped_rss(void const* p) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool in = false;
  while (std::getline(smaps, line)) {
    std::string const first = line.substr(0, line.find(' '));
    if (first.find('-') != std::string::npos && first.find(':') == std::string::npos) {
      in = std::stoull(first.substr(0, first.find('-')), nullptr, 16) == reinterpret_cast<std::uintptr_t>(p);
    } else if (in && line.rfind("Rss:", 0) == 0) {
      return std::stoll(line.substr(4)) * 1024;
    }
  }
  return -1;
}
}  // namespace

TEST_CASE("populate_mapped_pages maps a range's pages in") {
  std::string const path = "qflash_populate_test.bin";
  std::size_t const size = (std::size_t{4} << 20) + 100;
  {
    std::ofstream f(path, std::ios::binary);
    std::vector<char> const bytes(size, 'q');
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  {
    MappedFile const m(path);
    REQUIRE(mapped_rss(m.data()) == 0);
    populate_mapped_pages(m.bytes().subspan(0, 0));
    CHECK(mapped_rss(m.data()) == 0);
    // Bytes [5000, 605000): pages 1..147 of the file.
    populate_mapped_pages(m.bytes().subspan(5000, 600000));
    std::int64_t const page = ::sysconf(_SC_PAGESIZE);
    std::int64_t const want = (605000 + page - 1) / page * page - 5000 / page * page;
    CHECK(mapped_rss(m.data()) >= want);  // or more: the kernel may map a whole folio around a page
  }
  std::remove(path.c_str());
}

TEST_CASE("printable escapes what a terminal would act on and keeps UTF-8") {
  CHECK(printable("plain text, caf\xc3\xa9 \xe2\x80\x94 \xf0\x9f\x98\x80") ==
        "plain text, caf\xc3\xa9 \xe2\x80\x94 \xf0\x9f\x98\x80");
  CHECK(printable("a\nb\tc\rd") == "a\\nb\\tc\\rd");
  CHECK(printable("\x1b]0;title\x07\x1b[31m") == "\\x1b]0;title\\x07\\x1b[31m");
  CHECK(printable(std::string_view("\0\x7f", 2)) == "\\x00\\x7f");
  CHECK(printable("\xc2\x9b" "2J") == "\\u009b2J");  // C1 CSI, as UTF-8
  CHECK(printable("\xff\xc3") == "\\xff\\xc3");     // not UTF-8; a cut sequence
  CHECK(printable("\xc0\xaf") == "\\xc0\\xaf");     // overlong '/'
  CHECK(printable("\xed\xa0\x80") == "\\xed\\xa0\\x80");  // a surrogate
  CHECK(printable(printable("\x1b[1m")) == printable("\x1b[1m"));  // idempotent
  // Error and log messages pass their string parts through it.
  std::string const from_file = "name\x1b[2J";
  CHECK_THROWS_WITH_AS(QFLASH_CHECK(false, "tensor '", from_file, "' is bad"), "tensor 'name\\x1b[2J' is bad",
                       Error);
}

TEST_CASE("MappedFile refuses directories and FIFOs without blocking") {
  auto const dir = std::filesystem::temp_directory_path() / ("qflash_special_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir / "sub");
  std::string const fifo = (dir / "fifo").string();
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK_THROWS_WITH_AS(MappedFile{fifo}, doctest::Contains("fifo: is a FIFO, expected a regular file"), Error);
  CHECK_THROWS_WITH_AS(MappedFile((dir / "sub").string()),
                       doctest::Contains("sub: is a directory, expected a regular file"), Error);
  std::filesystem::remove_all(dir);
}
