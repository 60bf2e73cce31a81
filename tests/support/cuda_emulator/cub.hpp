// The block-wide CUB collectives qflash's kernels use, for the CUDA emulator (CUB's own need a
// GPU's warp instructions). Same interface and results: items in thread order (blocked), a
// reduction's result in thread 0 only, a stable radix sort. A reduction and a scan take one
// barrier, no more than CUB's, and their threads may leave before thread 0 (a reduction) or
// the others (a scan) have read TempStorage: reusing it without the __syncthreads that CUB
// asks of the caller can then read items of the next call (the shuffled schedule shows it).
#pragma once

#include <algorithm>
#include <numeric>

namespace cub {

template <class T, int kThreads>
class BlockReduce {
 public:
  struct TempStorage {
    T items[kThreads];
  };
  explicit BlockReduce(TempStorage& s) : s_(s) {}
  T Sum(T v) {
    return Reduce(v, [](T const& a, T const& b) { return a + b; });
  }
  template <class Op>
  T Reduce(T v, Op op) {
    int const tid = static_cast<int>(threadIdx.x);
    s_.items[tid] = v;
    __syncthreads();
    if (tid != 0) return v;  // CUB leaves the other threads' results undefined
    return std::accumulate(s_.items + 1, s_.items + kThreads, s_.items[0], op);
  }

 private:
  TempStorage& s_;
};

template <class T, int kThreads>
class BlockScan {
 public:
  struct TempStorage {
    T items[kThreads];
  };
  explicit BlockScan(TempStorage& s) : s_(s) {}
  void ExclusiveSum(T in, T& out) {
    T total;
    ExclusiveSum(in, out, total);
  }
  void ExclusiveSum(T in, T& out, T& aggregate) {
    int const tid = static_cast<int>(threadIdx.x);
    s_.items[tid] = in;
    __syncthreads();
    out = std::accumulate(s_.items, s_.items + tid, T{});
    aggregate = std::accumulate(s_.items + tid, s_.items + kThreads, out);
  }

 private:
  TempStorage& s_;
};

template <class Key, int kThreads, int kItems, class Value>
class BlockRadixSort {
 public:
  struct TempStorage {
    Key keys[kThreads * kItems];
    Value values[kThreads * kItems];
  };
  explicit BlockRadixSort(TempStorage& s) : s_(s) {}
  /// Keys descending, ties in their input order; thread t ends with sorted items
  /// [t kItems, (t + 1) kItems).
  void SortDescending(Key (&keys)[kItems], Value (&values)[kItems]) {
    int const tid = static_cast<int>(threadIdx.x);
    for (int i = 0; i < kItems; ++i) s_.keys[tid * kItems + i] = keys[i], s_.values[tid * kItems + i] = values[i];
    __syncthreads();
    if (tid == 0) {
      int order[kThreads * kItems];
      std::iota(order, order + kThreads * kItems, 0);
      std::stable_sort(order, order + kThreads * kItems, [&](int a, int b) { return s_.keys[a] > s_.keys[b]; });
      Key k[kThreads * kItems];
      Value v[kThreads * kItems];
      for (int i = 0; i < kThreads * kItems; ++i) k[i] = s_.keys[order[i]], v[i] = s_.values[order[i]];
      std::copy(k, k + kThreads * kItems, s_.keys);
      std::copy(v, v + kThreads * kItems, s_.values);
    }
    __syncthreads();
    for (int i = 0; i < kItems; ++i) keys[i] = s_.keys[tid * kItems + i], values[i] = s_.values[tid * kItems + i];
  }

 private:
  TempStorage& s_;
};

}  // namespace cub
