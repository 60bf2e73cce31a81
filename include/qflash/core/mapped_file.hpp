/// @file
/// Read-only memory-mapped files, so that weights used where they lie are never copied.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <utility>

#include "qflash/core/error.hpp"

namespace qflash {

class MappedFile {
 public:
  MappedFile() = default;

  /// Maps `path` read-only; throws Error naming the file when it cannot.
  /// Only a regular file (or a link to one) is opened: a FIFO, device or directory is refused
  /// by name, never waited on (O_NONBLOCK keeps open() of a FIFO from blocking).
  explicit MappedFile(std::string path) : path_(std::move(path)) {
    int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    QFLASH_CHECK(fd >= 0, path_, ": cannot open: ", std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      int err = errno;
      ::close(fd);
      QFLASH_FAIL(path_, ": cannot stat: ", std::strerror(err));
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      QFLASH_FAIL(path_, ": is ", file_kind(st.st_mode), ", expected a regular file");
    }
    size_ = static_cast<std::size_t>(st.st_size);
    if (size_ > 0) {
      void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
      int err = errno;
      ::close(fd);
      QFLASH_CHECK(p != MAP_FAILED, path_, ": cannot map ", size_, " bytes: ", std::strerror(err));
      data_ = static_cast<std::byte const*>(p);
    } else {
      ::close(fd);
    }
  }

  MappedFile(MappedFile&& o) noexcept
      : path_(std::move(o.path_)), data_(std::exchange(o.data_, nullptr)),
        size_(std::exchange(o.size_, 0)) {}
  MappedFile& operator=(MappedFile&& o) noexcept {
    if (this != &o) {
      unmap();
      path_ = std::move(o.path_);
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  MappedFile(MappedFile const&) = delete;
  MappedFile& operator=(MappedFile const&) = delete;
  ~MappedFile() { unmap(); }

  [[nodiscard]] std::span<std::byte const> bytes() const { return {data_, size_}; }
  [[nodiscard]] std::byte const* data() const { return data_; }
  [[nodiscard]] std::size_t size() const { return size_; }
  [[nodiscard]] std::string const& path() const { return path_; }

 private:
  static char const* file_kind(mode_t mode) {
    if (S_ISDIR(mode)) return "a directory";
    if (S_ISFIFO(mode)) return "a FIFO";
    if (S_ISSOCK(mode)) return "a socket";
    if (S_ISCHR(mode) || S_ISBLK(mode)) return "a device";
    return "a special file";
  }

  void unmap() {
    if (data_) ::munmap(const_cast<std::byte*>(data_), size_);
    data_ = nullptr;
  }

  std::string path_;
  std::byte const* data_ = nullptr;
  std::size_t size_ = 0;
};

/// Drops the resident pages that lie wholly inside `range` of a read-only file mapping (what
/// the loader does once a tensor has been converted and its stored bytes are no longer read),
/// so resident memory holds the converted copy only. Later reads fault the pages back in.
inline void release_mapped_pages(std::span<std::byte const> range) {
  auto const page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  auto const begin = (reinterpret_cast<std::uintptr_t>(range.data()) + page - 1) / page * page;
  auto const end = (reinterpret_cast<std::uintptr_t>(range.data()) + range.size()) / page * page;
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

/// Reads the pages of `range` of a file mapping in now, for weights used where they lie: else
/// every page faults on its first read, so the first tokens to route to an expert pay for its
/// pages (a 4-layer Q4_K GGUF decoded its first 8 tokens at 21 tok/s, at 95 with them read in).
/// Best effort: a kernel without MADV_POPULATE_READ (before Linux 5.14) gets each page touched.
inline void populate_mapped_pages(std::span<std::byte const> range) {
  if (range.empty()) return;
  auto const page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  auto const begin = reinterpret_cast<std::uintptr_t>(range.data()) / page * page;
  auto const end = reinterpret_cast<std::uintptr_t>(range.data()) + range.size();
#ifdef MADV_POPULATE_READ
  if (::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_READ) == 0) return;
#endif
  for (std::uintptr_t p = reinterpret_cast<std::uintptr_t>(range.data()); p < end; p += page)
    static_cast<void>(*reinterpret_cast<std::uint8_t const volatile*>(p));
}

}  // namespace qflash
