/// @file
/// Umbrella for the number formats: bf16, fp16, fp8 e4m3/e5m2, INT6 and the GGUF Q8_0 / Q4_K
/// weight blocks. Every header here compiles with g++ alone and with nvcc (host + device).
#pragma once

#include "qflash/numeric/bf16.hpp"
#include "qflash/numeric/fp16.hpp"
#include "qflash/numeric/fp8.hpp"
#include "qflash/numeric/gguf_blocks.hpp"
#include "qflash/numeric/int6.hpp"
#include "qflash/numeric/kv_format.hpp"
#include "qflash/numeric/minifloat.hpp"
