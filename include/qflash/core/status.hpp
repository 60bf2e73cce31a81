/// @file
/// Kernel-layer result codes. Kernels never throw; host layers turn a bad Status into an Error.
#pragma once

#include <string_view>

#include "qflash/core/config.hpp"

namespace qflash {

enum class Status : int {
  kSuccess,
  kErrorInvalidProblem,      ///< arguments inconsistent with each other or with the spec
  kErrorNotSupported,        ///< a valid problem this instance does not implement
  kErrorMisalignedOperand,   ///< a pointer or stride breaks the kernel's alignment rule
  kErrorArchMismatch,        ///< no compiled arch can run on this device
  kErrorCuda,                ///< the CUDA runtime reported an error
  kErrorInternal,
};

constexpr std::string_view to_string(Status s) {
  switch (s) {
    case Status::kSuccess: return "success";
    case Status::kErrorInvalidProblem: return "invalid problem";
    case Status::kErrorNotSupported: return "not supported";
    case Status::kErrorMisalignedOperand: return "misaligned operand";
    case Status::kErrorArchMismatch: return "arch mismatch";
    case Status::kErrorCuda: return "CUDA error";
    case Status::kErrorInternal: return "internal error";
  }
  return "unknown status";
}

}  // namespace qflash
