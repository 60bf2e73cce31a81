/// @file
/// Non-owning, type-erased views of dense row-major tensors (rank <= 4) that carry their
/// shape and element type, so that a shape or dtype mismatch is caught where it is bound.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>

#include "qflash/core/dtype.hpp"
#include "qflash/core/error.hpp"

namespace qflash {

inline constexpr int kMaxRank = 4;

struct Shape {
  std::array<std::int64_t, kMaxRank> dims{};
  int rank = 0;

  Shape() = default;
  Shape(std::initializer_list<std::int64_t> d) {
    QFLASH_CHECK(d.size() <= kMaxRank, "tensor rank ", d.size(), " exceeds ", kMaxRank);
    for (auto v : d) dims[static_cast<std::size_t>(rank++)] = v;
  }

  [[nodiscard]] std::int64_t operator[](int i) const { return dims[static_cast<std::size_t>(i)]; }
  [[nodiscard]] std::int64_t numel() const {
    std::int64_t n = 1;
    for (int i = 0; i < rank; ++i) n *= dims[static_cast<std::size_t>(i)];
    return n;
  }
  friend bool operator==(Shape const& a, Shape const& b) {
    if (a.rank != b.rank) return false;
    for (int i = 0; i < a.rank; ++i)
      if (a.dims[static_cast<std::size_t>(i)] != b.dims[static_cast<std::size_t>(i)]) return false;
    return true;
  }
};

inline std::string to_string(Shape const& s) {
  std::string out = "[";
  for (int i = 0; i < s.rank; ++i) {
    if (i) out += ", ";
    out += std::to_string(s[i]);
  }
  return out + "]";
}

/// A view of contiguous memory holding `shape.numel()` elements of `dtype`.
template <class Void>
struct BasicTensorView {
  Void* data = nullptr;
  DType dtype = DType::kF32;
  Shape shape;

  [[nodiscard]] std::int64_t numel() const { return shape.numel(); }
  [[nodiscard]] std::size_t bytes() const {
    return static_cast<std::size_t>(numel()) * size_of(dtype);
  }

  /// Typed pointer; throws when the view does not hold `expected`.
  template <class T>
  [[nodiscard]] auto as(DType expected) const {
    QFLASH_CHECK(dtype == expected, "tensor holds ", to_string(dtype), ", expected ",
                 to_string(expected));
    if constexpr (std::is_const_v<Void>)
      return static_cast<T const*>(data);
    else
      return static_cast<T*>(data);
  }
};

using TensorView = BasicTensorView<void>;
using ConstTensorView = BasicTensorView<void const>;

}  // namespace qflash
