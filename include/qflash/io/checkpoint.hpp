/// @file
/// A Hugging Face model directory: `model.safetensors`, or `model.safetensors.index.json` plus
/// the shards it names, or neither (a config-only directory). Every shard is mapped and
/// validated when opened, and the index is checked against the shards both ways, so a tensor
/// found by name is exactly the one the index promises. Host only.
#pragma once

#include <cstddef>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "qflash/core/error.hpp"
#include "qflash/core/tensor_view.hpp"
#include "qflash/io/json.hpp"
#include "qflash/io/safetensors.hpp"

namespace qflash::io {

class Checkpoint {
 public:
  static constexpr std::string_view kSingleFile = "model.safetensors";
  static constexpr std::string_view kIndexFile = "model.safetensors.index.json";

  /// Opens `dir`. Like transformers, a single `model.safetensors` wins over an index when both
  /// exist. Throws Error naming the directory, index or shard on any inconsistency.
  static Checkpoint open(std::string const& dir) {
    namespace fs = std::filesystem;
    Checkpoint c;
    c.dir_ = dir;
    std::error_code ec;
    QFLASH_CHECK(fs::is_directory(dir, ec), dir, ": not a directory");
    fs::path const single = fs::path(dir) / kSingleFile;
    fs::path const index = fs::path(dir) / kIndexFile;
    if (fs::exists(single, ec)) {
      c.files_.emplace_back(single.string());
      for (auto const& t : c.files_.back().tensors()) c.index_.emplace(t.name, &t);
      for (auto const& [name, rank] : c.files_.back().skipped())
        c.skipped_.emplace(name, &c.files_.back().path());
    } else if (fs::exists(index, ec)) {
      c.open_sharded(index.string());
    } else {
      // Config-only, unless other safetensors files suggest a layout we do not understand.
      for (auto const& e : fs::directory_iterator(dir, ec)) {
        QFLASH_CHECK(e.path().extension() != ".safetensors", dir, ": has ",
                     e.path().filename().string(), " but neither ", kSingleFile, " nor ",
                     kIndexFile);
      }
    }
    return c;
  }

  /// False for a config-only directory.
  [[nodiscard]] bool has_weights() const { return !files_.empty(); }

  [[nodiscard]] TensorRecord const* find(std::string_view name) const {
    auto it = index_.find(name);
    return it == index_.end() ? nullptr : it->second;
  }

  /// Throws "<dir>: missing tensor 'x'" when absent.
  [[nodiscard]] TensorRecord const& get(std::string_view name) const {
    TensorRecord const* t = find(name);
    if (!t) {
      auto it = skipped_.find(name);
      if (it != skipped_.end())
        QFLASH_FAIL(*it->second, ": tensor '", name, "' has rank ",
                    rank_of_skipped(*it->second, name), ", above the supported ", kMaxRank);
      QFLASH_FAIL(dir_, ": missing tensor '", name, "'");
    }
    return *t;
  }

  /// Also checks the shape: "<file>: tensor 'x' has shape [a, b], expected [c, d]".
  [[nodiscard]] TensorRecord const& get(std::string_view name, Shape const& expected) const {
    TensorRecord const& t = get(name);
    QFLASH_CHECK(t.shape == expected, detail::record_file(t), ": tensor '", name,
                 "' has shape ", to_string(t.shape), ", expected ", to_string(expected));
    return t;
  }

  /// Names of tensors that are present and valid but of a rank above kMaxRank (vision
  /// tower convolutions); they are not in names() and get() rejects them.
  [[nodiscard]] std::vector<std::string> skipped_names() const {
    std::vector<std::string> out;
    for (auto const& [name, file] : skipped_) out.push_back(name);
    return out;
  }

  /// Every tensor name, sorted.
  [[nodiscard]] std::vector<std::string> names() const {
    std::vector<std::string> out;
    out.reserve(index_.size());
    for (auto const& [name, t] : index_) out.push_back(name);
    return out;
  }

  [[nodiscard]] std::string const& dir() const { return dir_; }

  /// Bytes of tensor data over all shards.
  [[nodiscard]] std::size_t weight_bytes() const {
    std::size_t n = 0;
    for (auto const& f : files_) n += f.weight_bytes();
    return n;
  }

  /// The mapped files (one, or the shards in file-name order).
  [[nodiscard]] std::vector<SafetensorsFile> const& files() const { return files_; }

 private:
  Checkpoint() = default;

  void open_sharded(std::string const& index_path) {
    namespace fs = std::filesystem;
    Json j = read_json_file(index_path);
    JsonFields top(j, index_path);
    Json const* wm = top.find("weight_map");
    if (!wm || !wm->is_object())
      top.fail("weight_map", "an object mapping tensor names to shard file names");

    // shard file name -> tensor names the index puts there
    std::map<std::string, std::vector<std::string>> by_shard;
    for (auto const& [name, shard] : wm->items()) {
      QFLASH_CHECK(shard.is_string(), index_path, ": weight_map entry for tensor '", name,
                   "' must be a shard file name, got ", json_excerpt(shard));
      auto const& s = shard.get_ref<std::string const&>();
      QFLASH_CHECK(!s.empty() && s.find('/') == std::string::npos && s != "." && s != "..",
                   index_path, ": tensor '", name, "' maps to shard '", s,
                   "', which is not a file name in the checkpoint directory");
      by_shard[s].push_back(name);
    }
    QFLASH_CHECK(!by_shard.empty(), index_path, ": weight_map is empty");

    files_.reserve(by_shard.size());
    for (auto const& [shard, tensors] : by_shard) {
      fs::path p = fs::path(dir_) / shard;
      std::error_code ec;
      QFLASH_CHECK(fs::is_regular_file(p, ec), index_path, ": shard '", shard,
                   "' (listed for tensor '", tensors.front(), "'",
                   tensors.size() > 1 ? " and " + std::to_string(tensors.size() - 1) + " more"
                                      : std::string(),
                   ") is missing");
      files_.emplace_back(p.string());
    }

    // Index -> shards: every listed tensor is where the index says.
    std::size_t i = 0;
    for (auto const& [shard, tensors] : by_shard) {
      SafetensorsFile const& f = files_[i++];
      for (auto const& name : tensors) {
        if (f.skipped().contains(name)) {
          skipped_.emplace(name, &f.path());
          continue;
        }
        TensorRecord const* t = f.find(name);
        QFLASH_CHECK(t != nullptr, index_path, ": tensor '", name, "' is listed in shard '",
                     shard, "', but ", f.path(), " does not contain it");
        index_.emplace(name, t);
      }
    }
    // Shards -> index: no shard holds a tensor the index does not put there.
    i = 0;
    for (auto const& entry : by_shard) {
      std::string const& shard = entry.first;  // a named reference: lambdas cannot capture bindings in C++20
      SafetensorsFile const& f = files_[i++];
      auto check = [&](std::string const& name) {
        auto it = wm->find(name);
        QFLASH_CHECK(it != wm->end(), f.path(), ": tensor '", name,
                     "' is not listed in the index ", index_path,
                     " (index and shards are from different revisions?)");
        QFLASH_CHECK(it->get_ref<std::string const&>() == shard, f.path(), ": tensor '", name,
                     "' is in this shard, but the index ", index_path, " maps it to '",
                     it->get_ref<std::string const&>(), "'");
      };
      for (auto const& t : f.tensors()) check(t.name);
      for (auto const& [name, rank] : f.skipped()) check(name);
    }
  }

  int rank_of_skipped(std::string const& file, std::string_view name) const {
    for (auto const& f : files_)
      if (f.path() == file) return f.skipped().find(name)->second;
    return 0;
  }

  std::string dir_;
  std::vector<SafetensorsFile> files_;
  // Records live in the SafetensorsFile objects' heap storage, so these survive moves.
  std::map<std::string, TensorRecord const*, std::less<>> index_;
  std::map<std::string, std::string const*, std::less<>> skipped_;  // name -> shard path
};

}  // namespace qflash::io
