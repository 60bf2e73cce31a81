/// @file
/// Umbrella header: the whole host-side library (CPU kernels included). CUDA kernels live in
/// `kernels/*/*.cuh` and are reached through the launchers declared in each `op.hpp`.
#pragma once

#include "qflash/arch/arch.hpp"
#include "qflash/arch/cpu_features.hpp"
#include "qflash/arch/select.hpp"
#include "qflash/core/config.hpp"
#include "qflash/core/dtype.hpp"
#include "qflash/core/error.hpp"
#include "qflash/core/log.hpp"
#include "qflash/core/mapped_file.hpp"
#include "qflash/core/parallel.hpp"
#include "qflash/core/status.hpp"
#include "qflash/core/tensor_view.hpp"
#include "qflash/kernels/add_rmsnorm/cpu.hpp"
#include "qflash/kernels/add_rmsnorm/op.hpp"
#include "qflash/kernels/add_rmsnorm/ref.hpp"
#include "qflash/spec/kv_scheme.hpp"
#include "qflash/spec/moe_spec.hpp"
#include "qflash/spec/presets.hpp"
