/// @file
/// File names that a model directory's own metadata names (SHA256SUMS lines, the shards of a
/// safetensors index, adapter files): they must stay inside that directory.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>

#include "qflash/core/error.hpp"

namespace qflash::io {

/// `dir/name` for a file name read from `source` (a file in `dir`). Throws Error naming
/// `source` unless `name` is a plain relative path with no '..' component, so that metadata
/// cannot make qflash read outside the directory. Symbolic links inside `dir` are followed
/// (a Hugging Face cache snapshot links every file into its blob store).
inline std::string path_inside(std::string const& dir, std::string_view name,
                               std::string const& source) {
  namespace fs = std::filesystem;
  fs::path const rel(name);
  QFLASH_CHECK(!name.empty(), source, ": empty file name");
  QFLASH_CHECK(!rel.is_absolute() && !rel.has_root_name() && !rel.has_root_directory(), source,
               ": file name '", name, "' is absolute; names must be relative to ", dir);
  for (auto const& part : rel)
    QFLASH_CHECK(part != "..", source, ": file name '", name,
                 "' leaves the model directory ('..' is not allowed)");
  return (fs::path(dir) / rel).string();
}

}  // namespace qflash::io
