/// @file
/// Scalar reference for kernels/linear_group: linear's reference for each part.
#pragma once

#include "qflash/kernels/linear/ref.hpp"
#include "qflash/kernels/linear_group/op.hpp"

namespace qflash::kernels::ref {

inline void linear_group(LinearGroupArgs const& a) {
  for (LinearArgs const& p : a.used()) linear(p);
}

}  // namespace qflash::kernels::ref
