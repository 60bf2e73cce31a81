// Every CUDA op's sm90a kernels for kMoe (compiled by nvcc for sm90a alone).
#include <qflash/generated/cuda_sm90a.cuh>

#include "spec.hpp"

QFLASH_CUDA_INSTANCES(kMoe, Sm90a)
