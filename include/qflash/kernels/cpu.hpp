/// @file
/// Every op's CPU kernel body. A translation unit that runs Model<S, arch::Cpu> for a spec S
/// outside the build's instance list (QFLASH_SPECS) includes this, so the launchers are
/// compiled for S there (the generated instance TUs include the same headers).
#pragma once

#include "qflash/kernels/add_rmsnorm/cpu.hpp"
#include "qflash/kernels/attention/cpu.hpp"
#include "qflash/kernels/attention_decode/cpu.hpp"
#include "qflash/kernels/causal_conv1d/cpu.hpp"
#include "qflash/kernels/embedding/cpu.hpp"
#include "qflash/kernels/expert_ffn/cpu.hpp"
#include "qflash/kernels/gated_delta/cpu.hpp"
#include "qflash/kernels/gated_rmsnorm/cpu.hpp"
#include "qflash/kernels/gdn_decode/cpu.hpp"
#include "qflash/kernels/gdn_gates/cpu.hpp"
#include "qflash/kernels/kv_append/cpu.hpp"
#include "qflash/kernels/linear/cpu.hpp"
#include "qflash/kernels/linear_group/cpu.hpp"
#include "qflash/kernels/qk_norm_rope/cpu.hpp"
#include "qflash/kernels/router_topk/cpu.hpp"
#include "qflash/kernels/token_candidates/cpu.hpp"
