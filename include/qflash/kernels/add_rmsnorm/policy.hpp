/// @file
/// Launch shapes of the add + RMSNorm CUDA kernels, per arch (CUB `policy_selector` style: a
/// constexpr function of the arch tag and the spec returning a plain struct). Host-compilable,
/// so tests and benches can print what a launch will use.
///
/// None of these numbers has been measured yet: the dev machines have no GPU. They are the
/// usual starting point for a bandwidth-bound row op (FlashInfer norm.cuh, vLLM
/// layernorm_kernels.cu: one row per block, 16-byte vector accesses, the row's partial sums
/// reduced with CUB). bench/gpu/add_rmsnorm_gpu_bench.cpp measures them; replace each comment
/// with `// <GPU>, <shape>: <GB/s> (bench/gpu/add_rmsnorm_gpu_bench)` when tuned.
#pragma once

#include "qflash/arch/arch.hpp"
#include "qflash/spec/moe_spec.hpp"

namespace qflash::kernels {

struct AddRmsNormPolicy {
  /// Bytes each thread moves per access of x, residual and y: 16 = one LDG.128/STG.128, the
  /// widest global access, so 8 bf16 or 4 fp32 per instruction.
  int vec_bytes;
  /// Threads of the one-row-per-block kernels; for a static width, the most threads (fewer
  /// when the row has fewer vectors). 256: d_model 2048 in bf16 is exactly one vector per
  /// thread, and 8 blocks fill an SM's 2048 thread slots.
  int block_threads;
  /// A static-width row is held in registers (one pass over DRAM, weights loaded once per
  /// block) when each thread holds at most this many vectors; wider rows re-read L2.
  int max_vectors_per_thread;
  /// Rows of at most 32 * this many vectors run one per warp (no block barrier), e.g. widths
  /// up to 128 scalar / 512 fp32 / 1024 bf16 elements; wider rows one per block.
  int warp_max_vectors_per_lane;
  /// Threads of the one-row-per-warp kernel (rows per block = this / 32).
  int warp_block_threads;
  /// Grid cap; blocks loop over further rows.
  int max_blocks;
};

/// A100-class (sm_80) and any newer GPU running the sm_80 build.
constexpr AddRmsNormPolicy select_add_rmsnorm_policy(arch::Sm80, MoeSpec const&) {
  return AddRmsNormPolicy{
      .vec_bytes = 16,                 // unmeasured (see @file)
      .block_threads = 256,            // unmeasured
      .max_vectors_per_thread = 8,     // unmeasured; 8 x 16 B = 32 fp32 registers per thread
      .warp_max_vectors_per_lane = 4,  // unmeasured
      .warp_block_threads = 256,       // unmeasured
      .max_blocks = 65536,             // >> resident blocks (108 SMs x 8), so no tail effect
  };
}

/// H100/H200 (sm_90a). The op is a stream of loads and stores: TMA and wgmma do not apply,
/// so the kernels are the sm_80 ones; only the shape may differ once measured.
constexpr AddRmsNormPolicy select_add_rmsnorm_policy(arch::Sm90a, MoeSpec const& s) {
  return select_add_rmsnorm_policy(arch::Sm80{}, s);  // unmeasured: same as sm_80 until then
}

}  // namespace qflash::kernels
