// SHA256SUMS parsing and verification (io/checksums.hpp): names outside the model directory,
// CRLF and --tag lines, duplicates, required files the list leaves out, missing, mismatching
// and non-regular files, chunked hashing and the progress bar.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "support/expect_error.hpp"
#include "support/temp_dir.hpp"
#include "qflash/core/error.hpp"
#include "qflash/core/log.hpp"
#include "qflash/core/mapped_file.hpp"
#include "qflash/io/checksums.hpp"
#include "qflash/io/progress.hpp"

using namespace qflash;
using namespace qflash::io;
namespace fs = std::filesystem;

namespace {

using qflash::test::expect_error;
using qflash::test::TempDir;

// FIPS 180-2 test vectors: SHA-256("abc"), SHA-256("abd") and SHA-256 of 10^6 'a'.
constexpr std::string_view kAbc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
constexpr std::string_view kMillionA =
    "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0";

std::string line(std::string_view digest, std::string_view file, std::string_view eol = "\n") {
  return std::string(digest) + "  " + std::string(file) + std::string(eol);
}

/// Collects the warnings logged while it lives.
struct WarningLog {
  std::vector<std::string> warnings;
  WarningLog() {
    set_log_sink([this](LogLevel l, std::string_view m) {
      if (l == LogLevel::kWarn) warnings.emplace_back(m);
    });
  }
  ~WarningLog() { set_log_sink(qflash::detail::default_log_sink); }
  WarningLog(WarningLog const&) = delete;
  WarningLog& operator=(WarningLog const&) = delete;
};

/// Points fd 2 at `fd` while it lives.
struct StderrTo {
  int saved;
  explicit StderrTo(int fd) : saved(::dup(2)) {
    std::fflush(stderr);
    ::dup2(fd, 2);
  }
  ~StderrTo() {
    std::fflush(stderr);
    ::dup2(saved, 2);
    ::close(saved);
  }
  StderrTo(StderrTo const&) = delete;
  StderrTo& operator=(StderrTo const&) = delete;
};

}  // namespace

TEST_CASE("SHA256SUMS: names outside the model directory are rejected, naming the line") {
  TempDir const parent;
  fs::create_directories(parent.path / "model");
  parent.write("outside.bin", "abc");  // right digest: the old code hashed it and passed
  std::string const dir = parent.file("model");
  std::string const sums = dir + "/SHA256SUMS";
  auto write_sums = [&](std::string const& text) { parent.write("model/SHA256SUMS", text); };
  parent.write("model/a.bin", "abc");

  write_sums(line(kAbc, "a.bin") + line(kAbc, "../outside.bin"));
  expect_error([&] { verify_checksums(dir); },
               {sums + ":2: file name '../outside.bin' leaves the model directory"});
  write_sums(line(kAbc, "a.bin") + "\n" + line(kAbc, "sub/../../outside.bin"));
  expect_error([&] { verify_checksums(dir); }, {sums + ":3: ", "leaves the model directory"});
  write_sums(line(kAbc, parent.file("outside.bin")));
  expect_error([&] { verify_checksums(dir); }, {sums + ":1: ", "is absolute"});
  write_sums("SHA256 (../outside.bin) = " + std::string(kAbc) + "\n");
  expect_error([&] { verify_checksums(dir); }, {sums + ":1: ", "leaves the model directory"});

  // The pure parser says the same without touching the disk.
  expect_error([&] { (void)parse_checksums(line(kAbc, "/etc/passwd"), "S", "/m"); },
               {"S:1: file name '/etc/passwd' is absolute"});
  expect_error([&] { (void)parse_checksums(line(kAbc, std::string("a\0b", 3)), "S", "/m"); },
               {"S:1: file name contains a NUL byte"});
}

TEST_CASE("SHA256SUMS: CRLF line endings and the --tag form verify") {
  TempDir const tmp;
  tmp.write("a.bin", "abc");
  tmp.write("SHA256SUMS", line(kAbc, "a.bin", "\r\n"));
  CHECK_NOTHROW(verify_checksums(tmp.dir()));
  tmp.write("SHA256SUMS", "\r\n" + std::string(kAbc) + " *a.bin\r\n\r\n");
  CHECK_NOTHROW(verify_checksums(tmp.dir()));
  tmp.write("SHA256SUMS", "SHA256 (a.bin) = " + std::string(kAbc) + "\r\n");
  CHECK_NOTHROW(verify_checksums(tmp.dir()));

  auto const e = parse_checksums("  \n\n" + line("BA7816BF8F01CFEA414140DE5DAE2223B00361A396177A9CB410FF61F20015AD",
                                                 "dir/x y.bin", "\r\n"),
                                 "S", "/m");
  REQUIRE(e.size() == 1);
  CHECK(e[0].digest == kAbc);
  CHECK(e[0].file == "dir/x y.bin");
}

TEST_CASE("SHA256SUMS: malformed lines and empty lists name the line") {
  expect_error([&] { (void)parse_checksums("xyz  a.bin\n", "S", "/m"); }, {"S:1: expected"});
  expect_error([&] { (void)parse_checksums(line(kAbc, "a") + line(kAbc, ""), "S", "/m"); },
               {"S:2: expected"});
  expect_error([&] { (void)parse_checksums(std::string(kAbc) + "\ta.bin\n", "S", "/m"); },
               {"S:1: expected"});
  expect_error([&] { (void)parse_checksums("SHA256 (a) = abc\n", "S", "/m"); }, {"S:1: expected"});
  expect_error([&] { (void)parse_checksums("\r\n \n", "S", "/m"); }, {"S: lists no files"});
}

TEST_CASE("SHA256SUMS: a name listed twice must have one digest") {
  std::string const other(64, '0');
  expect_error([&] { (void)parse_checksums(line(kAbc, "a.bin") + line(other, "./a.bin"), "S", "/m"); },
               {"S:2: './a.bin' is listed again with digest " + other, "line 1 says " + std::string(kAbc)});

  TempDir const tmp;
  tmp.write("a.bin", "abc");
  tmp.write("SHA256SUMS", line(kAbc, "a.bin") + line(kAbc, "a.bin"));
  CHECK(read_checksums(tmp.dir()).size() == 1);
  CHECK_NOTHROW(verify_checksums(tmp.dir()));
}

TEST_CASE("SHA256SUMS: required files it does not list give one warning") {
  TempDir const tmp;
  tmp.write("a.bin", "abc");
  tmp.write("b.bin", "abc");
  tmp.write("SHA256SUMS", line(kAbc, "./a.bin"));
  std::vector<std::string> const required{"a.bin", "b.bin", "config.json"};
  {
    WarningLog log;
    verify_checksums(tmp.dir(), required);
    REQUIRE(log.warnings.size() == 1);
    CHECK(log.warnings[0] == tmp.dir() + "/SHA256SUMS does not list b.bin, config.json: "
                                         "those files are not verified");
  }
  {
    WarningLog log;
    verify_checksums(tmp.dir(), std::span(required).first(2));
    REQUIRE(log.warnings.size() == 1);
    CHECK(log.warnings[0].ends_with("does not list b.bin: that file is not verified"));
  }
  {
    WarningLog log;
    verify_checksums(tmp.dir(), std::span(required).first(1));
    verify_checksums(tmp.dir());
    CHECK(log.warnings.empty());
  }
}

TEST_CASE("SHA256SUMS: every listed file is opened before any is hashed") {
  TempDir const tmp;
  tmp.write("a.bin", "abd");  // mismatches: reported only when nothing is missing
  std::string const listed_a = line(kAbc, "a.bin");

  tmp.write("SHA256SUMS", listed_a + line(kAbc, "gone.bin"));
  expect_error([&] { verify_checksums(tmp.dir()); },
               {tmp.file("gone.bin") + ": listed in SHA256SUMS but missing"});

  fs::create_directories(tmp.path / "sub");
  tmp.write("SHA256SUMS", listed_a + line(kAbc, "sub"));
  expect_error([&] { verify_checksums(tmp.dir()); },
               {tmp.file("sub") + ": is a directory, expected a regular file"});

  REQUIRE(::mkfifo(tmp.file("fifo").c_str(), 0600) == 0);  // must not block
  tmp.write("SHA256SUMS", listed_a + line(kAbc, "fifo"));
  expect_error([&] { verify_checksums(tmp.dir()); }, {tmp.file("fifo") + ": is a FIFO"});

  tmp.write("SHA256SUMS", listed_a);
  expect_error([&] { verify_checksums(tmp.dir()); },
               {tmp.file("a.bin") + ": SHA-256 mismatch (SHA256SUMS says " + std::string(kAbc),
                "file has a", "pass --no-verify"});
}

TEST_CASE("SHA-256 in chunks equals the one-shot digest and advances the progress") {
  TempDir const tmp;
  tmp.write("a.bin", "abc");
  tmp.write("m.bin", std::string(1000000, 'a'));
  CHECK(sha256_hex(tmp.file("a.bin")) == kAbc);
  CHECK(sha256_hex(tmp.file("m.bin")) == kMillionA);
  for (std::size_t chunk : {std::size_t{1}, std::size_t{4093}, std::size_t{1} << 20}) {
    CAPTURE(chunk);
    Progress p("hash", 1000003, /*enabled=*/false);
    CHECK(io::detail::sha256_hex(MappedFile(tmp.file("a.bin")), &p, chunk) == kAbc);
    CHECK(io::detail::sha256_hex(MappedFile(tmp.file("m.bin")), &p, chunk) == kMillionA);
    CHECK(p.done_bytes() == 1000003);
  }
  tmp.write("empty.bin", "");
  CHECK(sha256_hex(tmp.file("empty.bin")) ==
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
}

TEST_CASE("SHA256SUMS: the progress bar is drawn on a terminal only") {
  TempDir const tmp;
  tmp.write("a.bin", "abc");
  tmp.write("m.bin", std::string(1000000, 'a'));
  tmp.write("SHA256SUMS", line(kAbc, "a.bin") + line(kMillionA, "m.bin"));

  {  // stderr is a file: nothing is written
    int const fd = ::open(tmp.file("stderr.txt").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    REQUIRE(fd >= 0);
    {
      StderrTo redirect(fd);
      verify_checksums(tmp.dir(), {}, /*progress=*/true);
    }
    ::close(fd);
    CHECK(fs::file_size(tmp.path / "stderr.txt") == 0);
  }

  int const master = ::posix_openpt(O_RDWR | O_NOCTTY);
  if (master < 0 || ::grantpt(master) != 0 || ::unlockpt(master) != 0) {
    MESSAGE("no pseudo-terminal here; the terminal case is not checked");
    if (master >= 0) ::close(master);
    return;
  }
  int const slave = ::open(::ptsname(master), O_RDWR | O_NOCTTY);
  REQUIRE(slave >= 0);
  {
    StderrTo redirect(slave);
    verify_checksums(tmp.dir(), {}, /*progress=*/false);  // not asked: nothing drawn
    verify_checksums(tmp.dir(), {}, /*progress=*/true);
  }
  ::close(slave);
  ::fcntl(master, F_SETFL, O_NONBLOCK);
  std::string drawn;
  char buf[4096];
  for (ssize_t got; (got = ::read(master, buf, sizeof buf)) > 0;) drawn.append(buf, static_cast<std::size_t>(got));
  ::close(master);
  INFO("drawn: ", drawn);
  CHECK(drawn.starts_with("\rverifying SHA256SUMS ["));
  CHECK(drawn.find("100% 0.00/0.00 GiB, 2 items") != std::string::npos);
  CHECK(drawn.find('\n') == drawn.size() - 1);  // one line
}
