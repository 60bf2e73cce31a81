/// @file
/// mma.sync.m16n8k8 with tf32 operands, and fp32 products to about fp32's precision from three
/// of them (tf32.hpp's split). sm_80 and later.
#pragma once

#include <cuda_runtime.h>

#include "qflash/kernels/common/tf32.hpp"

namespace qflash::kernels::tf32 {

/// c += a b for one m16n8k8 tile of tf32 operands (fp32 registers whose low 13 bits are zero).
__device__ __forceinline__ void mma(float (&c)[4], float const (&a)[4], float const (&b)[2]) {
#ifdef QFLASH_CUDA_EMULATOR
  ::qflash::emulator::mma_tf32(c, a, b);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(__float_as_uint(a[0])), "r"(__float_as_uint(a[1])), "r"(__float_as_uint(a[2])),
        "r"(__float_as_uint(a[3])), "r"(__float_as_uint(b[0])), "r"(__float_as_uint(b[1])));
#endif
}

/// c += a b to about fp32's precision from the operands' tf32 parts (small products first);
/// b_exact: b's small parts are zero.
__device__ __forceinline__ void mma_3x(float (&c)[4], float const (&a_big)[4], float const (&a_small)[4],
                                       float const (&b_big)[2], float const (&b_small)[2], bool b_exact = false) {
  mma(c, a_small, b_big);
  if (!b_exact) mma(c, a_big, b_small);
  mma(c, a_big, b_big);
}

/// Each of x's values as its two tf32 parts.
template <int N>
__device__ __forceinline__ void split(float const (&x)[N], float (&big)[N], float (&small)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    Tf32Pair const s = split_tf32(x[i]);
    big[i] = s.big;
    small[i] = s.small;
  }
}

}  // namespace qflash::kernels::tf32
