/// @file
/// The CUB block collectives the kernels use (the CUDA emulator brings its own).
#pragma once

#ifndef QFLASH_CUDA_EMULATOR
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#endif
