// Every CUDA op's sm80 kernels for kMoe (compiled by nvcc for sm80 alone).
#include <qflash/generated/cuda_sm80.cuh>

#include "spec.hpp"

QFLASH_CUDA_INSTANCES(kMoe, Sm80)
