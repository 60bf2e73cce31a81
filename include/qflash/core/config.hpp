/// @file
/// Compiler portability macros shared by host and device code.
#pragma once

#if defined(__CUDACC__)
#define QFLASH_HD __host__ __device__
#define QFLASH_DEVICE __device__
#define QFLASH_FORCEINLINE __forceinline__
#else
#define QFLASH_HD
#define QFLASH_DEVICE
#define QFLASH_FORCEINLINE inline __attribute__((always_inline))
#endif

#if defined(__CUDA_ARCH__)
#define QFLASH_DEVICE_PASS 1
#else
#define QFLASH_DEVICE_PASS 0
#endif

namespace qflash {

/// A `static_assert(dependent_false<T>, ...)` fires only when the template is instantiated.
template <class...>
inline constexpr bool dependent_false = false;

}  // namespace qflash

/// A CUDA stream without including the CUDA headers: identical to `cudaStream_t`.
struct CUstream_st;
namespace qflash {
using stream_t = CUstream_st*;
}
