// Compile-only check that every numeric function is callable from device code (nvcc warns,
// here as an error, when a __host__ function is called from a __device__ one). Not run.
#include "qflash/numeric/numeric.hpp"

namespace qflash {

__global__ void numeric_device_check_kernel(float const* x,       // [512]
                                            float* y,             // [1024]
                                            std::uint8_t* bytes,  // [512]
                                            gguf::BlockQ8_0* q8_0, gguf::BlockQ4K* q4_k) {
  int const i = static_cast<int>(threadIdx.x);
  y[i] = round_to_bf16(x[i]) + round_to_fp16(x[i]) + round_to_fp8_e4m3(x[i]) +
         to_float(to_fp8_e5m2(x[i], Fp8Saturation::kNoSat));
  bytes[i] = int6_get(bytes + 256, static_cast<std::size_t>(i));
  if (i == 0) {
    Int6Params const p = int6_quantize_group(x, 37, bytes);
    int6_dequantize_group(bytes, 37, p, y + 512);
    q8_0[0] = gguf::quantize_q8_0(x);
    gguf::dequantize_row_q8_0(q8_0, 32, y + 600);
    q4_k[0] = gguf::quantize_q4_k(x);
    gguf::dequantize_row_q4_k(q4_k, 256, y + 700);
  }
  if (i < 5) {  // each KV format's codec, one format per thread
    KvFormat const f = static_cast<KvFormat>(i);
    std::uint8_t* stored = bytes + 100 * i;
    kv_encode(f, x + 64 * i, 20, stored);
    kv_decode(f, stored, 20, y + 800 + 20 * i);
    y[1000 + i] = kv_stored_scale(f, stored, 0) + static_cast<float>(kv_head_bytes(f, 20));
  }
}

}  // namespace qflash
