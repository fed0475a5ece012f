// BatchNorm forward (training and eval) and the running-statistics update.
//
// Training: bn_stats_* (Welford partials per channel slice, values shifted by K = the channel's
// first value so that large means keep their precision) -> bn_finalize_fwd (per channel merge,
// save_mean / save_invstd / reserve, apply coefficients) -> bn_apply_* (y = (x - K) * a + b,
// optional ReLU). Eval: bn_finalize_fwd from the running statistics -> bn_apply_*.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cooperative_groups.h>
#include <mutex>
#include <set>
#include <type_traits>
#include <utility>

#include "batch_norm.h"
#include "async_copy.cuh"
#include "batch_norm_common.cuh"

namespace cg = cooperative_groups;

namespace cudadoctor_ops {
namespace bn {
namespace {

// Accumulates one pack of V values (already shifted by K) into a thread's Welford state.
template <typename A, typename T, int V>
__device__ __forceinline__ void welford_pack(const Pack<T, V>& p, A K, A& mean, A& m2, A& n) {
  if (V == 1) {
    const A v = static_cast<A>(p.v[0]) - K;
    n += A(1);
    const A d = v - mean;
    mean += fast_div(d, n);
    m2 += d * (v - mean);
  } else {
    A vals[V];
    A s = 0;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      vals[i] = static_cast<A>(p.v[i]) - K;
      s += vals[i];
    }
    const A lm = s * (A(1) / A(V));
    A lm2 = 0;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const A d = vals[i] - lm;
      lm2 += d * d;
    }
    welford_merge(mean, m2, n, lm, lm2, A(V));
  }
}

// x: [N, C, HW] contiguous, packs of V along HW. The block reduces slice `split` of `splits`
// of channel c into ws: [C, splits, 3] = (mean of x - K, M2, count). Ends with a block barrier
// (callers loop over items with the same shared memory).
template <typename T, int V>
__device__ __forceinline__ void stats_nchw_item(const T* __restrict__ x,
                                                typename Acc<T>::type* __restrict__ ws,
                                                int64_t N, int64_t C, int64_t HW, int64_t c,
                                                int64_t split, int splits) {
  using A = typename Acc<T>::type;
  const int64_t packs = N * (HW / V);
  const int64_t chunk = (packs + splits - 1) / splits;
  const int64_t begin = split * chunk;
  const int64_t end = begin + chunk < packs ? begin + chunk : packs;
  const int64_t stride = blockDim.x;
  const A K = static_cast<A>(x[c * HW]);
  A mean = 0, m2 = 0, n = 0;
  int64_t j = begin + threadIdx.x;
  if (j < end) {
    NchwWalk w(j, stride, c, C, HW, V);
    for (; j < end; j += kUnroll * stride) {
      Pack<T, V> p[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (j + u * stride < end) p[u] = *reinterpret_cast<const Pack<T, V>*>(x + w.off);
        w.advance();
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (j + u * stride < end) welford_pack<A, T, V>(p[u], K, mean, m2, n);
    }
  }
  // block merge
  warp_welford(mean, m2, n);
  __shared__ A sm[3][kThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    sm[0][warp] = mean;
    sm[1][warp] = m2;
    sm[2][warp] = n;
  }
  __syncthreads();
  if (warp == 0) {
    const int nw = blockDim.x >> 5;
    mean = lane < nw ? sm[0][lane] : A(0);
    m2 = lane < nw ? sm[1][lane] : A(0);
    n = lane < nw ? sm[2][lane] : A(0);
    warp_welford(mean, m2, n);
    if (lane == 0) {
      A* o = ws + (c * splits + split) * 3;
      o[0] = mean;
      o[1] = m2;
      o[2] = n;
    }
  }
  __syncthreads();
}

// grid (C, splits), block kThreads: one item per block.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    bn_stats_nchw(const T* __restrict__ x, typename Acc<T>::type* __restrict__ ws, int64_t N,
                  int64_t C, int64_t HW) {
  stats_nchw_item<T, V>(x, ws, N, C, HW, blockIdx.x, blockIdx.y, gridDim.y);
}


// Tree merge of the threads' Welford states over threadIdx.y through sm (TY * TX * V * 3
// accumulators); row 0 then writes the block's partials ws [C, splits, 3] for the V channels of
// pack cv (when active).
// Phase 1 of the register-persistent channels-last kernels (bn_persist_nhwc, bn_tile_nhwc): the
// thread loads its packs of rows r0, r0 + rstride, .. (< R; at most MAXR) into p, all loads
// issued before any arithmetic, and accumulates them with welford_row, shifted by K = row 0's
// values of its channels; an inactive thread leaves p alone and returns empty statistics.
// K: the shift used (zeros for an inactive thread), for rows accumulated after these.
template <typename A, typename T, int V, int MAXR>
__device__ __forceinline__ void load_rows_welford(const T* xc, int64_t r0, int64_t rstride,
                                                  int64_t R, int64_t C, bool active,
                                                  Pack<T, V> (&p)[MAXR], A (&mean)[V],
                                                  A (&m2)[V], A& n, A (&K)[V]) {
#pragma unroll
  for (int i = 0; i < V; ++i) {
    K[i] = 0;
    mean[i] = 0;
    m2[i] = 0;
  }
  n = 0;
  if (!active) return;
  const Pack<T, V> k = *reinterpret_cast<const Pack<T, V>*>(xc);
#pragma unroll
  for (int u = 0; u < MAXR; ++u)
    if (r0 + u * rstride < R)
      p[u] = *reinterpret_cast<const Pack<T, V>*>(xc + (r0 + u * rstride) * C);
#pragma unroll
  for (int i = 0; i < V; ++i) K[i] = static_cast<A>(k.v[i]);
#pragma unroll
  for (int u = 0; u < MAXR; ++u)
    if (r0 + u * rstride < R) welford_row<A, T, V>(p[u], K, mean, m2, n);
}

template <typename A, typename T, int V, int MAXR>
__device__ __forceinline__ void load_rows_welford(const T* xc, int64_t r0, int64_t rstride,
                                                  int64_t R, int64_t C, bool active,
                                                  Pack<T, V> (&p)[MAXR], A (&mean)[V],
                                                  A (&m2)[V], A& n) {
  A K[V];
  load_rows_welford<A, T, V, MAXR>(xc, r0, rstride, R, C, active, p, mean, m2, n, K);
}

template <typename A, int V>
__device__ __forceinline__ void merge_rows_to_partials(A* sm, const A (&mean)[V],
                                                       const A (&m2)[V], A n, bool active,
                                                       A* __restrict__ ws, int64_t cv,
                                                       int splits) {
  const int tx = threadIdx.x, TX = blockDim.x;
  auto slot = [&](int ty, int i, int k) -> A& { return sm[((ty * TX + tx) * V + i) * 3 + k]; };
#pragma unroll
  for (int i = 0; i < V; ++i) {
    slot(threadIdx.y, i, 0) = mean[i];
    slot(threadIdx.y, i, 1) = m2[i];
    slot(threadIdx.y, i, 2) = n;
  }
  __syncthreads();
  for (int s = blockDim.y >> 1; s > 0; s >>= 1) {
    if (threadIdx.y < s) {
#pragma unroll
      for (int i = 0; i < V; ++i) {
        A a0 = slot(threadIdx.y, i, 0), a1 = slot(threadIdx.y, i, 1), a2 = slot(threadIdx.y, i, 2);
        welford_merge(a0, a1, a2, slot(threadIdx.y + s, i, 0), slot(threadIdx.y + s, i, 1),
                      slot(threadIdx.y + s, i, 2));
        slot(threadIdx.y, i, 0) = a0;
        slot(threadIdx.y, i, 1) = a1;
        slot(threadIdx.y, i, 2) = a2;
      }
    }
    __syncthreads();
  }
  if (threadIdx.y == 0 && active) {
#pragma unroll
    for (int i = 0; i < V; ++i) {
      A* o = ws + ((cv * V + i) * splits + blockIdx.y) * 3;
      o[0] = slot(0, i, 0);
      o[1] = slot(0, i, 1);
      o[2] = slot(0, i, 2);
    }
  }
}

// x: [R, C] rows, C contiguous, packs of V channels. block (TX, TY), grid (ceil(C/V/TX), splits).
// ws: [C, splits, 3] as above. sm: TY * TX * V * 3 accumulators (dynamic shared memory).
// PU > 0 (2 or 4): whole groups of PU rows run without bounds tests, the next group's loads in
// flight while this group is accumulated (twice the pack registers); the rows and their order,
// hence the results, are the same as with PU = 0.
template <typename T, int V, int PU = 0>
__device__ __forceinline__ void stats_nhwc_block(const T* __restrict__ x,
                                                 typename Acc<T>::type* __restrict__ ws,
                                                 int64_t R, int64_t C,
                                                 typename Acc<T>::type* sm) {
  using A = typename Acc<T>::type;
  const int64_t Cv = C / V;
  const int64_t cv = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool active = cv < Cv;
  const int splits = gridDim.y;
  A K[V], mean[V], m2[V];
  A n = 0;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    K[i] = 0;
    mean[i] = 0;
    m2[i] = 0;
  }
  if (active) {
    const Pack<T, V> k = *reinterpret_cast<const Pack<T, V>*>(x + cv * V);
#pragma unroll
    for (int i = 0; i < V; ++i) K[i] = static_cast<A>(k.v[i]);
    const int64_t rstride = int64_t(gridDim.y) * blockDim.y;
    int64_t r = int64_t(blockIdx.y) * blockDim.y + threadIdx.y;
    if (PU > 0) {
      constexpr int G = PU > 0 ? PU : 1;
      // a group starting at row r is whole when r < whole_end
      const int64_t whole_end = R - (G - 1) * rstride;
      if (r < whole_end) {
        const int64_t step = rstride * C;
        const T* p = x + r * C + cv * V;
        Pack<T, V> cur[G];
#pragma unroll
        for (int u = 0; u < G; ++u) cur[u] = *reinterpret_cast<const Pack<T, V>*>(p + u * step);
        for (r += G * rstride; r < whole_end; r += G * rstride) {
          p += G * step;
          Pack<T, V> nxt[G];
#pragma unroll
          for (int u = 0; u < G; ++u) nxt[u] = *reinterpret_cast<const Pack<T, V>*>(p + u * step);
#pragma unroll
          for (int u = 0; u < G; ++u) welford_row<A, T, V>(cur[u], K, mean, m2, n);
#pragma unroll
          for (int u = 0; u < G; ++u) cur[u] = nxt[u];
        }
#pragma unroll
        for (int u = 0; u < G; ++u) welford_row<A, T, V>(cur[u], K, mean, m2, n);
      }
      // fewer than G rows left: one pass of the loop below
    }
    welford_rows_nhwc<A, T, V>(x, r, R, rstride, C, cv, K, mean, m2, n);
  }
  merge_rows_to_partials<A, V>(sm, mean, m2, n, active, ws, cv, splits);
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    bn_stats_nhwc(const T* __restrict__ x, typename Acc<T>::type* __restrict__ ws, int64_t R,
                  int64_t C) {
  extern __shared__ unsigned char smem_raw[];
  stats_nhwc_block<T, V>(x, ws, R, C, reinterpret_cast<typename Acc<T>::type*>(smem_raw));
}

// bn_stats_nhwc with the pipelined loop in groups of PU rows (stats_nhwc_block), built for MB
// blocks per SM. The second set of packs costs registers; the defaults (stats_pipe_blocks): PU = 4
// at 3 blocks per SM for float16 / float32 (80 registers), 2 for bfloat16 and double (they
// spill at 80); PU = 2 at bn_stats_nhwc's 4 (3 for bfloat16 and double). At the lower counts
// ptxas issues the next group's loads after the first row(s) of this one instead of before.
// CUDADOCTOR_OPS_BN_STATS_PIPE=0 / 2 / 4 selects bn_stats_nhwc / PU, CUDADOCTOR_OPS_BN_STATS_MB=
// 2 / 3 / 4 another MB for float16 (read once).
template <typename T, int V, int PU, int MB>
__global__ void __launch_bounds__(kThreads, MB)
    bn_stats_nhwc_pipe(const T* __restrict__ x, typename Acc<T>::type* __restrict__ ws,
                       int64_t R, int64_t C) {
  extern __shared__ unsigned char smem_raw[];
  stats_nhwc_block<T, V, PU>(x, ws, R, C, reinterpret_cast<typename Acc<T>::type*>(smem_raw));
}

template <typename T>
constexpr int stats_pipe_blocks(int pu) {
  return (std::is_same<T, c10::BFloat16>::value || std::is_same<T, double>::value ? 0 : 1) +
         (pu == 4 ? 2 : 3);
}

// What it takes to finish a channel: its statistics (training: partials ws [C, splits, 3] of
// x - K with K = x[c * k_stride]; eval: the running statistics), the affine parameters, and
// where the saved statistics go.
template <typename A>
struct FwdArgs {
  const A* ws;
  int splits;
  A eps;
  bool training;
  const void* rmean;
  const void* rvar;
  int rkind;
  int rvkind;
  const void* weight;
  int wkind;
  const void* bias;
  int bkind;
  A* save_mean;
  A* save_invstd;
  A* reserve;  // the part of the mean that save_mean's rounding lost
  int64_t k_stride;
  // training only: running statistics updated in place where the saved statistics are stored
  // (running = (1 - momentum) * running + momentum * batch, unbiased variance); null for none
  void* upd_mean;
  void* upd_var;
  int umkind;
  int uvkind;
  A momentum;
  // training only, momentum >= 0: num_batches_tracked (int64 [1]), incremented where channel 0's
  // saved statistics are stored; null for none (and in every kernel that takes it separately)
  int64_t* nbt;
};

// Lane 0 of the calling warp gets the merged (mean of x - K, M2, count) of channel c.
template <typename A>
__device__ __forceinline__ void warp_merge_partials(const A* __restrict__ ws, int splits,
                                                    int64_t c, A& mean, A& m2, A& n) {
  mean = 0;
  m2 = 0;
  n = 0;
  for (int s = threadIdx.x & 31; s < splits; s += 32) {
    const A* p = ws + (c * splits + s) * 3;
    welford_merge(mean, m2, n, p[0], p[1], p[2]);
  }
  warp_welford(mean, m2, n);
}

// Coefficients of y = (x - K) * a + b for channel c; writes the saved statistics when `store`.
// ms, m2, n: merged training statistics (ignored in eval).
template <typename A, typename T>
__device__ __forceinline__ void finish_channel(const T* x, int64_t c, const FwdArgs<A>& f, A ms,
                                               A m2, A n, bool store, A& K, A& a, A& b) {
  A invstd;
  if (f.training) {
    K = static_cast<A>(x[c * f.k_stride]);
    const A var = n > A(0) ? m2 / n : A(0);
    invstd = inv_sqrt(var + f.eps);
  } else {
    K = load_param<A>(f.rmean, f.rkind, c, A(0));
    ms = 0;
    invstd = inv_sqrt(load_param<A>(f.rvar, f.rvkind, c, A(1)) + f.eps);
  }
  const A w = load_param<A>(f.weight, f.wkind, c, A(1));
  const A bias = load_param<A>(f.bias, f.bkind, c, A(0));
  a = w * invstd;
  b = bias - ms * a;
  if (store) {
    const A full = K + ms;
    f.save_mean[c] = full;
    f.save_invstd[c] = invstd;
    f.reserve[c] = (K - full) + ms;
    if (f.training && f.upd_mean != nullptr) {
      // one value per channel (n == 1) gives 0 / 0 = nan like torch; the callers refuse it
      const A unbiased = m2 / (n - A(1));
      const A m = f.momentum;
      const A om = load_param<A>(f.upd_mean, f.umkind, c, A(0));
      const A ov = load_param<A>(f.upd_var, f.uvkind, c, A(0));
      store_param<A>(f.upd_mean, f.umkind, c, (A(1) - m) * om + m * full);
      store_param<A>(f.upd_var, f.uvkind, c, (A(1) - m) * ov + m * unbiased);
    }
    if (f.nbt != nullptr && c == 0) *f.nbt += 1;
  }
}

// finish_channel of a training channel (saved and running statistics stored) with its
// coefficients (K, a, b) into coef [C, 3].
template <typename A, typename T>
__device__ __forceinline__ void finish_to_coef(const T* x, int64_t c, const FwdArgs<A>& f, A ms,
                                               A m2, A n, A* coef) {
  A K, a, b;
  finish_channel(x, c, f, ms, m2, n, true, K, a, b);
  coef[c * 3 + 0] = K;
  coef[c * 3 + 1] = a;
  coef[c * 3 + 2] = b;
}

// Channels-last training only: one warp per channel merges the partials into coef [C, 3].
template <typename T>
__global__ void bn_finalize_fwd(const T* __restrict__ x, FwdArgs<typename Acc<T>::type> f,
                                int64_t C, typename Acc<T>::type* __restrict__ coef) {
  using A = typename Acc<T>::type;
  const int64_t c = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (c >= C) return;
  A ms, m2, n;
  warp_merge_partials(f.ws, f.splits, c, ms, m2, n);
  if ((threadIdx.x & 31) != 0) return;
  finish_to_coef(x, c, f, ms, m2, n, coef);
}

// As bn_finalize_fwd with one block of kFinThreads per channel (grid C): shorter merge chains,
// and the shift K (x's row 0, long out of L2 after a large statistics pass) prefetched while the
// partials merge. Same results up to the order of the merges.
template <typename T>
__global__ void __launch_bounds__(kFinThreads)
    bn_finalize_fwd_blk(const T* __restrict__ x, FwdArgs<typename Acc<T>::type> f,
                        typename Acc<T>::type* __restrict__ coef) {
  using A = typename Acc<T>::type;
  constexpr int W = kFinThreads / 32;
  __shared__ A sh[3][W];
  const int64_t c = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) prefetch_l2(x + c * f.k_stride);
  A ms = 0, m2 = 0, n = 0;
  const auto merge = [&](A pm, A pq, A pn) { welford_merge(ms, m2, n, pm, pq, pn); };
  for_partials<kFinBatch>(f.ws + c * f.splits * 3, f.splits, int(threadIdx.x), kFinThreads, merge);
  warp_welford(ms, m2, n);
  if (lane == 0) {
    sh[0][warp] = ms;
    sh[1][warp] = m2;
    sh[2][warp] = n;
  }
  __syncthreads();
  if (warp != 0) return;
  ms = lane < W ? sh[0][lane] : A(0);
  m2 = lane < W ? sh[1][lane] : A(0);
  n = lane < W ? sh[2][lane] : A(0);
  warp_welford(ms, m2, n);
  if (lane == 0) finish_to_coef(x, c, f, ms, m2, n, coef);
}

template <typename A>
__device__ __forceinline__ A act(A y, bool relu) {
  return (relu && y < A(0)) ? A(0) : y;  // NaN passes through like torch.relu
}

// The ReLU mask of an NCHW pack at element offset e (M of apply_nchw_item): bit i of byte k = 1
// when element 8k + i of y (memory order) is > 0. V = 8: the pack is byte e / 8. V = 4: the packs
// of elements 8k .. 8k+3 and 8k+4 .. 8k+7 are held by lanes 2m and 2m+1 of a warp (the caller
// guarantees it, see apply_nchw_item); the lane of the first writes the byte. Called by both lanes
// of the pair.
template <typename T, int V>
__device__ __forceinline__ void mask_pack_nchw(const Pack<T, V>& o, int64_t e,
                                               uint8_t* __restrict__ mask) {
  using A = typename Acc<T>::type;
  static_assert(V == 4 || V == 8, "mask packs are 4 or 8 elements");
  unsigned bits = 0;
#pragma unroll
  for (int i = 0; i < V; ++i) bits |= (static_cast<A>(o.v[i]) > A(0) ? 1u : 0u) << i;
  if constexpr (V == 8) {
    mask[e >> 3] = static_cast<uint8_t>(bits);
  } else {
    const unsigned lane = threadIdx.x & 31u;
    const unsigned other = __shfl_xor_sync(3u << (lane & 30u), bits, 1);
    if ((e & 7) == 0) mask[e >> 3] = static_cast<uint8_t>(bits | (other << 4));
  }
}

// x, y: [N, C, HW]. The block applies slice `split` of `splits` of channel c. Warp 0 finishes
// the channel first (merging the f.splits training partials, or from the running statistics);
// split 0 stores the saved statistics. Ends with a block barrier (callers loop over items).
// M: also the ReLU mask (relu must be true; HW % 8 == 0). With V = 4 the slices are cut at even
// packs, so that the two packs of a mask byte (even pack j and j + 1: HW / 4 is even) are in the
// same slice and, as pack j = end - 1 - threadIdx.x - k * blockDim.x with end even, on lanes
// 2m + 1 and 2m of the same warp, in or out of the loop together.
template <typename T, int V, bool M = false>
__device__ __forceinline__ void apply_nchw_item(const T* __restrict__ x, T* __restrict__ y,
                                                const FwdArgs<typename Acc<T>::type>& f,
                                                int64_t N, int64_t C, int64_t HW, int64_t c,
                                                int64_t split, int splits, bool relu,
                                                uint8_t* __restrict__ mask = nullptr) {
  using A = typename Acc<T>::type;
  __shared__ A sh[3];
  if (threadIdx.x < 32) {
    A ms = 0, m2 = 0, n = 0;
    if (f.training) warp_merge_partials(f.ws, f.splits, c, ms, m2, n);
    if (threadIdx.x == 0) {
      A K, a, b;
      finish_channel(x, c, f, ms, m2, n, split == 0, K, a, b);
      sh[0] = K;
      sh[1] = a;
      sh[2] = b;
    }
  }
  __syncthreads();
  const A K = sh[0], a = sh[1], b = sh[2];
  const int64_t packs = N * (HW / V);
  int64_t chunk = (packs + splits - 1) / splits;
  if (M && V == 4) chunk += chunk & 1;
  const int64_t begin = split * chunk;
  const int64_t end = begin + chunk < packs ? begin + chunk : packs;
  const int64_t stride = blockDim.x;
  // backwards through the slice: the stats pass read its end last
  int64_t j = end - 1 - threadIdx.x;
  if (j >= begin) {
    NchwWalk w(j, stride, c, C, HW, V);
    for (; j >= begin; j -= kUnroll * stride) {
      Pack<T, V> p[kUnroll];
      int64_t off[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        off[u] = w.off;
        if (j - u * stride >= begin) p[u] = *reinterpret_cast<const Pack<T, V>*>(x + w.off);
        w.retreat();
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (j - u * stride >= begin) {
          Pack<T, V> o;
#pragma unroll
          for (int i = 0; i < V; ++i)
            o.v[i] = static_cast<T>(act((static_cast<A>(p[u].v[i]) - K) * a + b, relu));
          *reinterpret_cast<Pack<T, V>*>(y + off[u]) = o;
          if constexpr (M) mask_pack_nchw<T, V>(o, off[u], mask);
        }
      }
    }
  }
  __syncthreads();
}

// grid (C, splits of the apply), block kThreads; the last channels first (still in L2).
template <typename T, int V, bool M = false>
__global__ void __launch_bounds__(kThreads)
    bn_apply_nchw(const T* __restrict__ x, T* __restrict__ y, FwdArgs<typename Acc<T>::type> f,
                  int64_t N, int64_t C, int64_t HW, bool relu, uint8_t* __restrict__ mask) {
  apply_nchw_item<T, V, M>(x, y, f, N, C, HW, int64_t(gridDim.x) - 1 - blockIdx.x, blockIdx.y,
                           gridDim.y, relu, mask);
}

// NCHW training forward of a small tensor in ONE cooperative launch (every block resident):
// the items (channel, slice) are dealt to the blocks round-robin; stats partials of every item
// -> grid barrier -> each block finishes and applies its items in reverse order (most recently
// read first, still in L2). Saves the apply launch and its gap.
template <typename T, int V, bool M = false>
__global__ void __launch_bounds__(kThreads)
    bn_fused_nchw(const T* __restrict__ x, T* __restrict__ y, FwdArgs<typename Acc<T>::type> f,
                  typename Acc<T>::type* __restrict__ ws, int64_t N, int64_t C, int64_t HW,
                  bool relu, uint8_t* __restrict__ mask) {
  cg::grid_group grid = cg::this_grid();
  const int splits = f.splits;  // f.ws == ws
  const int64_t items = C * splits;
  const int64_t G = gridDim.x;
  for (int64_t it = blockIdx.x; it < items; it += G)
    stats_nchw_item<T, V>(x, ws, N, C, HW, it / splits, it % splits, splits);
  grid.sync();
  if (int64_t(blockIdx.x) >= items) return;
  const int64_t last = blockIdx.x + ((items - 1 - blockIdx.x) / G) * G;
  for (int64_t it = last; it >= 0; it -= G)
    apply_nchw_item<T, V, M>(x, y, f, N, C, HW, it / splits, it % splits, splits, relu, mask);
}

// x, y: [R, C]; block (TX, TY), grid (ceil(C/V/TX), splits). coef [C, 3] from bn_finalize_fwd
// in training; null in eval, where each thread finishes its V channels from the running
// statistics (row-slice 0, threadIdx.y 0 stores the saved statistics).
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    bn_apply_nhwc(const T* __restrict__ x, T* __restrict__ y,
                  const typename Acc<T>::type* __restrict__ coef,
                  FwdArgs<typename Acc<T>::type> f, int64_t R, int64_t C, bool relu) {
  using A = typename Acc<T>::type;
  const int64_t Cv = C / V;
  const int64_t cv = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (cv >= Cv) return;
  A K[V], a[V], b[V];
  const bool store = blockIdx.y == 0 && threadIdx.y == 0;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int64_t c = cv * V + i;
    if (coef != nullptr) {
      K[i] = coef[c * 3 + 0];
      a[i] = coef[c * 3 + 1];
      b[i] = coef[c * 3 + 2];
    } else {
      finish_channel(x, c, f, A(0), A(0), A(0), store, K[i], a[i], b[i]);
    }
  }
  // rows from the last one down: the stats pass read those last
  const int64_t rstride = int64_t(gridDim.y) * blockDim.y;
  for (int64_t r = int64_t(blockIdx.y) * blockDim.y + threadIdx.y; r < R; r += kUnroll * rstride) {
    Pack<T, V> p[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (r + u * rstride < R)
        p[u] = *reinterpret_cast<const Pack<T, V>*>(x + (R - 1 - r - u * rstride) * C + cv * V);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (r + u * rstride < R) {
        Pack<T, V> o;
#pragma unroll
        for (int i = 0; i < V; ++i)
          o.v[i] = static_cast<T>(act((static_cast<A>(p[u].v[i]) - K[i]) * a[i] + b[i], relu));
        *reinterpret_cast<Pack<T, V>*>(y + (R - 1 - r - u * rstride) * C + cv * V) = o;
      }
    }
  }
}

// Pieces of bn_persist_nhwc (the one-launch channels-last forward that reads x once; see the
// comment above it).
constexpr int kPersistMergeBatch = 4;  // partials a lane loads before merging them (phase 2)

// Phase 2 of bn_persist_nhwc: one warp per channel over the whole grid merges the channel's
// partials ws [C, splits, 3] and finishes it (saved and running statistics, coef [C, 3]).
// ws is written by this launch, hence a plain pointer (no read-only cache path).
template <typename T>
__device__ __forceinline__ void persist_finish_channels(const T* __restrict__ x,
                                                        const FwdArgs<typename Acc<T>::type>& f,
                                                        const typename Acc<T>::type* ws,
                                                        typename Acc<T>::type* coef, int64_t C,
                                                        int splits) {
  using A = typename Acc<T>::type;
  const GridWarps gw = grid_warps();
  const int lane = gw.lane;
  for (int64_t c = gw.first; c < C; c += gw.stride) {
    A ms = 0, m2 = 0, n = 0;
    const auto merge = [&](A pm, A pq, A pn) { welford_merge(ms, m2, n, pm, pq, pn); };
    for_partials<kPersistMergeBatch>(ws + c * splits * 3, splits, lane, 32, merge);
    warp_welford(ms, m2, n);
    if (lane == 0) finish_to_coef(x, c, f, ms, m2, n, coef);
  }
}

// Register caps of bn_persist_nhwc (blocks of 256 resident per SM): 64 per thread for MAXR = 4
// (4 blocks), 80 for MAXR = 8 (3); double (twice the registers per accumulator) 128 (2), below
// which it spills.
template <typename T, int MAXR>
struct PersistMinBlocks {
  static constexpr int value = sizeof(typename Acc<T>::type) == 8 ? 2 : (MAXR <= 4 ? 4 : 3);
};

// Channels-last training forward of a small tensor in ONE cooperative launch that reads x once
// (bn_persist_nhwc; bn_fused_nhwc below is the variant that reads x twice).
//   Grid (ceil(C/V/TX), splits), block (TX, TY) = nhwc_block(C/V). Thread (tx, ty) of block
//   (bx, s) owns the V channels cv*V.. (cv = bx*TX + tx) of the rows r_k = s*TY + ty +
//   k*splits*TY, k < MAXR; the launcher picks splits so that ceil(R / (splits*TY)) <= MAXR, i.e.
//   every row is some thread's.
//   Phase 1: the thread issues the loads of all its packs at once and keeps them in registers
//   (MAXR packs; 4*MAXR registers for 16-byte packs), then accumulates them exactly as
//   stats_nhwc_block does (Welford per row of values shifted by K = the channel's first value,
//   tree merge over threadIdx.y in shared memory, partials ws [C, splits, 3]).
//   Grid barrier. Phase 2: every warp of the grid finishes channels from the partials (merged
//   in the order bn_fused_nhwc merges them; a lane's partials are loaded in batches), writing
//   save_mean / save_invstd / reserve, the running statistics and coef [C, 3].
//   Grid barrier. Phase 3: y = (x - K) * a + b (+ ReLU) from the packs still in registers.
// x is read from memory once (bn_fused_nhwc reads it again from L2 in its phase 3), and the grid
// is sized by rows per thread instead of bn_stats_nhwc's rows per block, so a small tensor runs
// with many more threads in flight (one load round per thread). launch_persist_nhwc takes
// MAXR = 4, else 8, whichever fits first (else bn_fused_nhwc runs), with splits from
// persist_splits. Dynamic shared memory: TY * TX * V * 3 accumulators, as bn_stats_nhwc.
template <typename T, int V, int MAXR>
__global__ void __launch_bounds__(kThreads, PersistMinBlocks<T, MAXR>::value)
    bn_persist_nhwc(const T* __restrict__ x, T* __restrict__ y, FwdArgs<typename Acc<T>::type> f,
                    typename Acc<T>::type* __restrict__ ws,
                    typename Acc<T>::type* __restrict__ coef, int64_t R, int64_t C, bool relu) {
  using A = typename Acc<T>::type;
  extern __shared__ unsigned char smem_raw[];
  A* sm = reinterpret_cast<A*>(smem_raw);
  cg::grid_group grid = cg::this_grid();
  const int64_t Cv = C / V;
  const int64_t cv = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool active = cv < Cv;
  const int splits = gridDim.y;
  const int64_t rstride = int64_t(splits) * blockDim.y;
  const int64_t r0 = int64_t(blockIdx.y) * blockDim.y + threadIdx.y;
  const T* xc = x + cv * V;  // this thread's channels in row 0
  Pack<T, V> p[MAXR];

  // ---- phase 1: load every pack of the thread, Welford partials of the block ----
  {
    A mean[V], m2[V];
    A n = 0;
    load_rows_welford<A, T, V, MAXR>(xc, r0, rstride, R, C, active, p, mean, m2, n);
    merge_rows_to_partials<A, V>(sm, mean, m2, n, active, ws, cv, splits);
  }
  grid.sync();

  // ---- phase 2: channel finishing by every warp of the grid ----
  persist_finish_channels<T>(x, f, ws, coef, C, splits);
  grid.sync();

  // ---- phase 3: y from the packs held since phase 1 ----
  if (!active) return;
  A K[V], a[V], b[V];
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int64_t c = cv * V + i;
    K[i] = coef[c * 3 + 0];
    a[i] = coef[c * 3 + 1];
    b[i] = coef[c * 3 + 2];
  }
  T* yc = y + cv * V;
#pragma unroll
  for (int u = 0; u < MAXR; ++u) {
    if (r0 + u * rstride < R) {
      persist_opaque(p[u]);
      Pack<T, V> o;
#pragma unroll
      for (int i = 0; i < V; ++i)
        o.v[i] = static_cast<T>(act((static_cast<A>(p[u].v[i]) - K[i]) * a[i] + b[i], relu));
      *reinterpret_cast<Pack<T, V>*>(yc + (r0 + u * rstride) * C) = o;
    }
  }
}

// ---- bn_tile_nhwc: the channel-tiled, semi-persistent channels-last training forward ----
//
// One cooperative launch with ONE grid barrier. The channels are cut into tiles of CT channels,
// TX = CT / V packs of V = 16 / sizeof(T) channels each; block (TX, TY = THREADS / TX), grid
// (tiles, splits). Thread (tx, ty) of block (tile, s) owns the V channels of pack
// cv = tile * TX + tx in the rows r_k = s * TY + ty + k * splits * TY, k < MAXR (the launcher
// keeps ceil(R / (splits * TY)) <= MAXR, so every row is some thread's); the TX threads of a row
// read TX * 16 contiguous bytes.
//   Phase 1: the thread loads all its packs into registers and accumulates them as
//   bn_persist_nhwc does (Welford per row of the values shifted by K = the channel's first
//   value); the block merges its rows (shuffles inside each warp, then across the warps through
//   shared memory, in a fixed order) into one partial per channel:
//   ws [tiles][splits][3][CT] = (mean of x - K, M2, count).
//   Grid barrier.
//   Phase 2: EVERY block merges the `splits` partials of its own tile (coalesced loads, a fixed
//   order, so the blocks of a tile compute bit-identical coefficients) and finishes its channels
//   with finish_channel; only the blocks with s == 0 store save_mean / save_invstd / reserve and
//   update the running statistics.
//   Phase 3: y = (x - K) * a + b (+ ReLU) from the packs still in registers, 16-byte stores; with
//   `mask` (V == 8 only, else ignored) also one byte per pack at (element offset) / 8, bit i set
//   when output element i of the pack is > 0 (Conv+BN+ReLU's mask format).
// Against bn_persist_nhwc: one grid barrier instead of two; blocks * CT partials instead of
// C * splits (splits = blocks / tiles: (64,512,7,7) float16 writes 128 * 32 partials where
// bn_persist_nhwc writes 512 * 66); no serial warp-per-channel phase (a block
// merges only its own tile's partials, splits * CT of them).
// nbt (optional, int64 [1]): num_batches_tracked, incremented once by block (0, 0) after the
// barrier (every read of it is before); with f.momentum < 0 the running statistics then take the
// cumulative average, momentum = 1 / (num_batches_tracked + 1), as cbr_update_stats does.
constexpr int kTileThreads = 256;  // threads per block of bn_tile_nhwc as launched
constexpr int kTileMaxR = 8;       // packs held per thread
// Partials a thread loads before merging them in phase 2 (the template argument MB): 4 for
// float32 (its registers are full), 8 for 16-bit types unless CUDADOCTOR_OPS_BN_NHWC_TILE_MB=4|16
// (read once). Phase 2 is a chain of about splits / (THREADS / CT * MB) dependent L2 round trips
// per thread. On the H200 (one run, float16, MB 4 / 8 / 16): (64,512,7,7) 13.0 / 11.8 / 14.8 us,
// (64,128,28,28) 24.9 / 23.2 / 28.5 us, (64,256,14,14) 15.5 / 15.1 / 18.4 us; 16 spills.
constexpr int kTileMergeBatch = 4;
constexpr int kTileMergeBatch16 = 8;

// Register caps of bn_tile_nhwc: 16-bit types 80 per thread (3 blocks of 256 per SM: MAXR = 8
// packs are 32 registers, the V = 8 Welford states 24 more), float 64 (4 blocks: 4 channels per
// pack).
template <typename T, int THREADS>
struct TileMinBlocks {
  static constexpr int per256 = sizeof(T) == 4 ? 4 : 3;
  static constexpr int value = per256 * 256 / THREADS > 0 ? per256 * 256 / THREADS : 1;
};

// Chan merge of lane + o's per-channel states into the calling lane's, all lanes of the warp
// calling; the channels of a thread's pack share one count n. One channel at a time: two
// shuffled values live at once.
template <typename A, int V>
__device__ __forceinline__ void shfl_merge_pack(A (&mean)[V], A (&m2)[V], A& n, int o) {
  const A nb = __shfl_down_sync(0xffffffffu, n, o);
  const A nn = n + nb;
  const A f = nn > A(0) ? fast_div(nb, nn) : A(0);
  const A g = n * f;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const A mb = __shfl_down_sync(0xffffffffu, mean[i], o);
    const A qb = __shfl_down_sync(0xffffffffu, m2[i], o);
    const A d = mb - mean[i];
    mean[i] += d * f;
    m2[i] += qb + d * d * g;
  }
  n = nn;
}

// For every channel j < CT: merges the P partials red[k][j][0 .. P-1] (k: mean, M2, count) in a
// fixed order, P consecutive lanes per channel (P divides 32) and a shuffle tree; emit(j, mean,
// M2, count) runs on the first lane of the channel's lanes. Every thread of the block calls it
// (CT * P is a multiple of 32: the loop is warp-uniform).
template <typename A, int CT, int P, int THREADS, int P1, typename F>
__device__ __forceinline__ void tile_merge_slots(const A (&red)[3][CT][P1], int tid, F&& emit) {
  static_assert(32 % P == 0 && (CT * P) % 32 == 0 && P < P1, "slots of tile_merge_slots");
  for (int q = tid; q < CT * P; q += THREADS) {
    const int j = q / P, w = q % P;
    A m = red[0][j][w], s = red[1][j][w], n = red[2][j][w];
#pragma unroll
    for (int o = P / 2; o > 0; o >>= 1) {
      const A mb = __shfl_down_sync(0xffffffffu, m, o);
      const A sb = __shfl_down_sync(0xffffffffu, s, o);
      const A nb = __shfl_down_sync(0xffffffffu, n, o);
      welford_merge(m, s, n, mb, sb, nb);
    }
    if (w == 0) emit(j, m, s, n);
  }
}

// ONCE (CUDADOCTOR_OPS_BN_NHWC_TILE_ONCE=1, launched only where splits >= CT): phase 2 merges
// each channel once instead of in every block of its tile. Block `split` < CT of a tile merges
// channel `split` (one partial per thread, a Welford tree over the block in a fixed order),
// finishes it (saved and running statistics) and writes its coefficients to the workspace after
// the partials, ws [tiles][splits][3][CT] then [tiles][3][CT]; a second grid barrier; every block
// then loads its tile's coefficients. Two barriers and one merge per channel against one barrier
// and `splits` merges per channel.
//
// SR > 0 (the stash): rows k = MAXR .. MAXR + SR - 1 of a thread live in dynamic shared memory,
// stash [SR][THREADS] packs (SR * THREADS * 16 bytes at most; the launcher passes only the rows
// in use), copied there by cp.async before the register rows are loaded, so that a thread has up
// to MAXR + SR packs in flight at once. Phase 1 accumulates the register rows, waits for its own
// copies and accumulates the stashed rows; phase 3 writes y from both. This is what lets tensors
// of up to about a third of the register file plus shared memory (e.g. 25 MB of float16 on an
// H200) be read from memory once.
template <typename T, int CT, int THREADS, int MAXR, int MB = kTileMergeBatch, bool ONCE = false,
          int SR = 0>
__global__ void __launch_bounds__(THREADS, TileMinBlocks<T, THREADS>::value)
    bn_tile_nhwc(const T* __restrict__ x, T* __restrict__ y, uint8_t* __restrict__ mask,
                 FwdArgs<typename Acc<T>::type> f, typename Acc<T>::type* ws, int64_t* nbt,
                 int64_t R, int64_t C, bool relu) {
  using A = typename Acc<T>::type;
  constexpr int V = 16 / int(sizeof(T));
  constexpr int TX = CT / V;
  constexpr int W = THREADS / 32;  // warps: the partials of phase 1's cross-warp merge
  constexpr int G = THREADS / CT;  // thread groups of phase 2, one partial per channel each
  constexpr int P1 = (W > G ? W : G) + 1;  // odd row length: few bank conflicts
  static_assert(CT % V == 0 && 32 % TX == 0 && THREADS % CT == 0 && CT % 32 == 0 &&
                    THREADS % 32 == 0 && W <= 32 && G <= 32,
                "bn_tile_nhwc shape");
  __shared__ A red[3][CT][P1];
  __shared__ A coef[3][CT];
  __shared__ A s_momentum;
  cg::grid_group grid = cg::this_grid();
  const auto [tx, tid, lane, warp, tile, split, splits, cv, rstride, r0, active] =
      TileIndex<CT, V, THREADS>(C);
  const T* xc = x + cv * V;  // this thread's channels in row 0
  A* wt = ws + int64_t(tile) * splits * 3 * CT;  // this tile's partials [splits][3][CT]
  Pack<T, V> p[MAXR];
  int64_t nbt_old = 0;

  // the stash (SR > 0): slot k of this thread at stash[k * THREADS]
  extern __shared__ __align__(16) unsigned char tile_stash_raw[];
  Pack<T, V>* stash = reinterpret_cast<Pack<T, V>*>(tile_stash_raw) + tid;

  // ---- phase 1: load every pack of the thread, the block's partial per channel ----
  {
    if constexpr (SR > 0) {
      if (active) {
#pragma unroll
        for (int k = 0; k < SR; ++k) {
          const int64_t r = r0 + int64_t(MAXR + k) * rstride;
          if (r < R) cp_async16(stash + k * THREADS, xc + r * C);
        }
      }
    }
    A mean[V], m2[V];
    A n = 0;
    A K[V];
    load_rows_welford<A, T, V, MAXR>(xc, r0, rstride, R, C, active, p, mean, m2, n, K);
    if constexpr (SR > 0) {
      // then the stashed rows (their copies have had the longest)
      cp_async_wait_all();  // this thread's own copies: no block barrier needed
      if (active) {
#pragma unroll 4
        for (int k = 0; k < SR; ++k)
          if (r0 + int64_t(MAXR + k) * rstride < R)
            welford_row<A, T, V>(stash[k * THREADS], K, mean, m2, n);
      }
    }
    // the rows of the warp (lanes tx, tx + TX, ...) into lane tx
#pragma unroll
    for (int o = 16; o >= TX; o >>= 1) shfl_merge_pack<A, V>(mean, m2, n, o);
    if (lane < TX) {  // lane == tx here (TX divides 32)
#pragma unroll
      for (int i = 0; i < V; ++i) {
        red[0][lane * V + i][warp] = mean[i];
        red[1][lane * V + i][warp] = m2[i];
        red[2][lane * V + i][warp] = n;
      }
    }
    if (tid == 0) {
      A m = f.momentum;
      if (nbt != nullptr) {
        nbt_old = *nbt;
        if (f.momentum < A(0)) m = A(1) / static_cast<A>(nbt_old + 1);
      }
      s_momentum = m;
    }
    __syncthreads();
    tile_merge_slots<A, CT, W, THREADS, P1>(red, tid, [&](int j, A m, A s, A cnt) {
      store_tile_partial<CT>(wt, split, j, m, s, cnt);
    });
  }
  grid.sync();

  // ---- phase 2: every block merges its tile's partials and finishes its channels ----
  if (nbt != nullptr && tile == 0 && split == 0 && tid == 0) *nbt = nbt_old + 1;
  if constexpr (ONCE) {
    A* cg_ = ws + int64_t(gridDim.x) * splits * 3 * CT + int64_t(tile) * 3 * CT;  // [3][CT]
    if (split < CT) {
      const int j = split;
      A m = 0, s = 0, cnt = 0;
      for (int sp = tid; sp < splits; sp += THREADS) {
        const A* q = wt + int64_t(sp) * 3 * CT + j;
        welford_merge(m, s, cnt, __ldcg(q), __ldcg(q + CT), __ldcg(q + 2 * CT));
      }
      warp_welford(m, s, cnt);  // lane 0 of each warp, lanes merged in a fixed tree
      if (lane == 0) {
        red[0][0][warp] = m;
        red[1][0][warp] = s;
        red[2][0][warp] = cnt;
      }
      __syncthreads();
      if (tid == 0) {
        A mm = red[0][0][0], ss = red[1][0][0], nn = red[2][0][0];
        for (int w = 1; w < W; ++w)
          welford_merge(mm, ss, nn, red[0][0][w], red[1][0][w], red[2][0][w]);
        FwdArgs<A> fa = f;
        fa.momentum = s_momentum;
        const int64_t c = int64_t(tile) * CT + j;
        A K = 0, a = 0, b = 0;
        if (c < C) finish_channel(x, c, fa, mm, ss, nn, true, K, a, b);
        cg_[j] = K;
        cg_[CT + j] = a;
        cg_[2 * CT + j] = b;
      }
    }
    grid.sync();
    if (tid < CT) {
      coef[0][tid] = __ldcg(cg_ + tid);
      coef[1][tid] = __ldcg(cg_ + CT + tid);
      coef[2][tid] = __ldcg(cg_ + 2 * CT + tid);
    }
    __syncthreads();
  } else {
    {
      const int j = tid % CT, g = tid / CT;
      A m = 0, s = 0, cnt = 0;
      for_tile_partials<MB, CT>(wt, j, splits, g, G,
                                [&](A pm, A pq, A pn) { welford_merge(m, s, cnt, pm, pq, pn); });
      red[0][j][g] = m;
      red[1][j][g] = s;
      red[2][j][g] = cnt;
    }
    __syncthreads();
    {
      FwdArgs<A> fa = f;
      fa.momentum = s_momentum;
      tile_merge_slots<A, CT, G, THREADS, P1>(red, tid, [&](int j, A m, A s, A cnt) {
        const int64_t c = int64_t(tile) * CT + j;
        A K = 0, a = 0, b = 0;
        if (c < C) finish_channel(x, c, fa, m, s, cnt, split == 0, K, a, b);
        coef[0][j] = K;
        coef[1][j] = a;
        coef[2][j] = b;
      });
    }
    __syncthreads();
  }

  // ---- phase 3: y (and the mask) from the packs held since phase 1 ----
  if (!active) return;
  A K[V], a[V], b[V];
  load_tile_coef<A, CT, V>(coef, tx, K, a, b);
  T* yc = y + cv * V;
  auto put = [&](const Pack<T, V>& q, int64_t r) {
    Pack<T, V> o;
#pragma unroll
    for (int i = 0; i < V; ++i)
      o.v[i] = static_cast<T>(act((static_cast<A>(q.v[i]) - K[i]) * a[i] + b[i], relu));
    *reinterpret_cast<Pack<T, V>*>(yc + r * C) = o;
    if constexpr (V == 8) {
      if (mask != nullptr) {
        // the pack's 8 elements start at element r * C + cv * 8
        unsigned byte = 0;
#pragma unroll
        for (int i = 0; i < V; ++i) byte |= (static_cast<A>(o.v[i]) > A(0) ? 1u : 0u) << i;
        mask[r * (C / 8) + cv] = static_cast<uint8_t>(byte);
      }
    }
  };
#pragma unroll
  for (int u = 0; u < MAXR; ++u) {
    const int64_t r = r0 + u * rstride;
    if (r < R) {
      persist_opaque(p[u]);
      put(p[u], r);
    }
  }
  if constexpr (SR > 0) {
#pragma unroll 4
    for (int k = 0; k < SR; ++k) {
      const int64_t r = r0 + int64_t(MAXR + k) * rstride;
      if (r < R) put(stash[k * THREADS], r);
    }
  }
}

// Channels-last training forward of a small tensor in ONE cooperative launch (every block
// resident): stats partials as bn_stats_nhwc -> grid barrier -> every warp of the grid finishes
// channels (save_mean / save_invstd / reserve, coef [C, 3]) -> grid barrier -> each block applies
// y = (x - K) * a + b (+ ReLU) to the rows it reduced, which are still in L2. Same grid, block and
// shared memory as bn_stats_nhwc. Saves the finalize and apply launches and their gaps, which
// dominate below ~30 MB.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    bn_fused_nhwc(const T* __restrict__ x, T* __restrict__ y, FwdArgs<typename Acc<T>::type> f,
                  typename Acc<T>::type* __restrict__ ws, typename Acc<T>::type* __restrict__ coef,
                  int64_t R, int64_t C, bool relu) {
  using A = typename Acc<T>::type;
  extern __shared__ unsigned char smem_raw[];
  cg::grid_group grid = cg::this_grid();
  stats_nhwc_block<T, V>(x, ws, R, C, reinterpret_cast<A*>(smem_raw));
  grid.sync();
  {
    // channel finishing: one warp per channel over the whole grid
    const GridWarps gw = grid_warps();
    const int lane = gw.lane;
    const int splits = gridDim.y;
    for (int64_t c = gw.first; c < C; c += gw.stride) {
      A ms = 0, m2 = 0, n = 0;
      for (int s = lane; s < splits; s += 32) {
        const A* p = ws + (c * splits + s) * 3;
        welford_merge(ms, m2, n, p[0], p[1], p[2]);
      }
      warp_welford(ms, m2, n);
      if (lane == 0) finish_to_coef(x, c, f, ms, m2, n, coef);
    }
  }
  grid.sync();
  const int64_t Cv = C / V;
  const int64_t cv = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (cv >= Cv) return;
  A K[V], a[V], b[V];
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int64_t c = cv * V + i;
    K[i] = coef[c * 3 + 0];
    a[i] = coef[c * 3 + 1];
    b[i] = coef[c * 3 + 2];
  }
  // the rows this thread reduced in the stats phase, last ones first (most recently read)
  const int64_t rstride = int64_t(gridDim.y) * blockDim.y;
  const int64_t r0 = int64_t(blockIdx.y) * blockDim.y + threadIdx.y;
  if (r0 >= R) return;
  const int64_t last = r0 + ((R - 1 - r0) / rstride) * rstride;
  for (int64_t r = last; r >= r0; r -= kUnroll * rstride) {
    Pack<T, V> p[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (r - u * rstride >= r0)
        p[u] = *reinterpret_cast<const Pack<T, V>*>(x + (r - u * rstride) * C + cv * V);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (r - u * rstride >= r0) {
        Pack<T, V> o;
#pragma unroll
        for (int i = 0; i < V; ++i)
          o.v[i] = static_cast<T>(act((static_cast<A>(p[u].v[i]) - K[i]) * a[i] + b[i], relu));
        *reinterpret_cast<Pack<T, V>*>(y + (r - u * rstride) * C + cv * V) = o;
      }
    }
  }
}

// NCHW training forward that reads x once ("single read"): one block per channel holds the
// channel's N*HW values in shared memory. Statistics are exact two-pass sums over shared memory
// (values shifted by K = the channel's first value, as everywhere else), thread 0 finishes the
// channel (saved statistics, running statistics), then y is written from shared memory. No
// workspace, no grid barrier, 2x the tensor's bytes instead of 3x. For channels of at most
// kSingleReadMaxBytes and at least one channel per SM.
//
// M: also the ReLU mask (relu must be true), in Conv+BN+ReLU's layout: bit e % 32 of 32-bit word
// e / 32 is set when element e of y (memory order) is > 0, for any H*W. The block gathers the
// bits of each of its N rows (n, c) in shared memory, in the 32-bit words of the mask that the
// row covers (`wr` words per row: at most (H*W + 30) / 32 + 1), then stores each word: with a
// plain store when the row covers all of it, else with atomicOr, as the rows of the neighbouring
// channels share it (the caller zeroes the mask first when H*W % 32 != 0). The mask must hold
// whole words: 4-byte aligned, at least 4 * ceil(numel / 32) bytes.
constexpr int kSingleReadThreads = 512;
constexpr int64_t kSingleReadMaxBytes = int64_t(112) << 10;

// Words of the mask that one row of hw elements can touch, wherever it starts.
inline int64_t mask_words_per_row(int64_t hw) { return (hw + 30) / 32 + 1; }

template <typename T, int V, bool M = false>
__global__ void __launch_bounds__(kSingleReadThreads, 2)
    bn_singleread_nchw(const T* __restrict__ x, T* __restrict__ y,
                       FwdArgs<typename Acc<T>::type> f, int64_t N, int64_t C, int64_t HW,
                       bool relu, uint32_t* __restrict__ mask = nullptr, int wr = 0) {
  using A = typename Acc<T>::type;
  extern __shared__ __align__(16) unsigned char sr_smem[];
  T* s = reinterpret_cast<T*>(sr_smem);  // [N * HW]: element n * HW + h of channel c
  // M: [N * wr] mask words of the block's rows, after the values (16-byte aligned)
  uint32_t* sm = reinterpret_cast<uint32_t*>(sr_smem + ((N * HW * int64_t(sizeof(T)) + 15) & ~int64_t(15)));
  __shared__ A red[kSingleReadThreads / 32];
  __shared__ A coef[3];
  const int64_t c = blockIdx.x;
  const int64_t packs = N * (HW / V);
  const int64_t stride = blockDim.x;
  const A K = static_cast<A>(x[c * HW]);
  if constexpr (M) {  // ordered before the atomics below by the barriers of block_sum
    for (int64_t k = threadIdx.x; k < N * wr; k += stride) sm[k] = 0u;
  }
  // load into shared memory, summing x - K
  A sum = 0;
  int64_t j = threadIdx.x;
  if (j < packs) {
    NchwWalk w(j, stride, c, C, HW, V);
    for (; j < packs; j += kUnroll * stride) {
      Pack<T, V> p[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (j + u * stride < packs) p[u] = *reinterpret_cast<const Pack<T, V>*>(x + w.off);
        w.advance();
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (j + u * stride < packs) {
          *reinterpret_cast<Pack<T, V>*>(s + (j + u * stride) * V) = p[u];
#pragma unroll
          for (int i = 0; i < V; ++i) sum += static_cast<A>(p[u].v[i]) - K;
        }
      }
    }
  }
  const A n = static_cast<A>(packs * V);
  const A ms = block_sum(sum, red) / n;  // mean of x - K (every thread; s is complete too)
  A sq = 0;
  for (int64_t k = threadIdx.x; k < packs; k += stride) {
    const Pack<T, V> p = *reinterpret_cast<const Pack<T, V>*>(s + k * V);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const A d = static_cast<A>(p.v[i]) - K - ms;
      sq += d * d;
    }
  }
  const A m2 = block_sum(sq, red);
  if (threadIdx.x == 0) {
    A Kc, a, b;
    finish_channel(x, c, f, ms, m2, n, true, Kc, a, b);
    coef[0] = Kc;
    coef[1] = a;
    coef[2] = b;
  }
  __syncthreads();
  const A Kc = coef[0], a = coef[1], b = coef[2];
  j = threadIdx.x;
  if (j < packs) {
    NchwWalk w(j, stride, c, C, HW, V);
    for (; j < packs; j += stride) {
      const Pack<T, V> p = *reinterpret_cast<const Pack<T, V>*>(s + j * V);
      Pack<T, V> o;
#pragma unroll
      for (int i = 0; i < V; ++i)
        o.v[i] = static_cast<T>(act((static_cast<A>(p.v[i]) - Kc) * a + b, relu));
      *reinterpret_cast<Pack<T, V>*>(y + w.off) = o;
      if constexpr (M) {
        // bit position of the pack in its row's words: the row starts at bit g0 of the mask
        // (32-bit: the channel's N * H*W values fit in shared memory)
        const int h = static_cast<int>(w.h) * V;
        const int n = static_cast<int>(j) / static_cast<int>(HW / V);
        const int pos = static_cast<int>((w.off - h) & 31) + h;
        unsigned long long bits = 0;
#pragma unroll
        for (int i = 0; i < V; ++i)
          bits |= (static_cast<A>(o.v[i]) > A(0) ? 1ull : 0ull) << i;
        bits <<= (pos & 31);
        // One shared atomic per pack. ORing the bits of the lanes that fill the same word first
        // (__match_any_sync + __reduce_or_sync, one atomic per word and warp) was slower on the
        // H200: (64,256,14,14) float32 16.6 against 11.6 us, (64,512,7,7) 14.7 against 11.7 us.
        uint32_t* row = sm + n * wr + (pos >> 5);
        if (static_cast<uint32_t>(bits) != 0u) atomicOr(row, static_cast<uint32_t>(bits));
        if ((bits >> 32) != 0ull) atomicOr(row + 1, static_cast<uint32_t>(bits >> 32));
      }
      w.advance();
    }
  }
  if constexpr (M) {
    __syncthreads();
    for (int64_t k = threadIdx.x; k < N * wr; k += stride) {
      const int64_t n = k / wr;
      const int64_t g0 = (n * C + c) * HW;  // the row's first bit
      const int64_t wg = (g0 >> 5) + (k - n * wr);
      if (wg > ((g0 + HW - 1) >> 5)) continue;  // past the row's last word
      const uint32_t v = sm[k];
      if (wg * 32 >= g0 && wg * 32 + 32 <= g0 + HW) {
        mask[wg] = v;  // the row covers the whole word
      } else if (v != 0u) {
        atomicOr(mask + wg, v);
      }
    }
  }
}

// Dynamic shared memory of bn_singleread_nchw for layout l (a channel's N * H*W values of
// elem_bytes each, then with the mask (with_mask) its rows' 32-bit words), or 0 where the kernel
// does not apply: switched off, fewer channels than SMs unless forced, more than
// kSingleReadMaxBytes, a mask (numel bytes) not 4-byte aligned or short of the tensor's words.
inline int64_t singleread_smem_bytes(const Layout& l, int64_t elem_bytes, int device,
                                     bool with_mask = false, const void* mask = nullptr,
                                     int64_t mask_numel = 0) {
  const int setting = singleread_setting();
  if (setting == 0 || l.C > int64_t(INT32_MAX) || device < 0 || device >= 64) return 0;
  int64_t bytes = l.N * l.HW * elem_bytes;
  if (bytes > kSingleReadMaxBytes || bytes == 0) return 0;
  if (setting < 0 && l.C < sm_count(device)) return 0;
  if (with_mask) {
    const int64_t words = (l.N * l.C * l.HW + 31) / 32;
    if (reinterpret_cast<uintptr_t>(mask) % 4 != 0 || mask_numel < 4 * words) return 0;
    bytes = ((bytes + 15) & ~int64_t(15)) + l.N * mask_words_per_row(l.HW) * 4;
    if (bytes > kSingleReadMaxBytes) return 0;
  }
  return bytes;
}

// Tries the single-read contiguous training forward; false when it does not apply (nothing
// launched). M: with the ReLU mask (see the kernel; mask: numel bytes, zeroed here when rows
// share words).
template <typename T, int V, bool M = false>
bool launch_singleread_nchw(const Layout& l, const T* x, T* y, const FwdArgs<typename Acc<T>::type>& f,
                            bool relu, int device, cudaStream_t stream, uint8_t* mask = nullptr,
                            int64_t mask_numel = 0) {
  const int64_t bytes = singleread_smem_bytes(l, int64_t(sizeof(T)), device, M, mask, mask_numel);
  if (bytes == 0) return false;
  const int64_t wr = M ? mask_words_per_row(l.HW) : 0;
  allow_dynamic_smem(reinterpret_cast<const void*>(bn_singleread_nchw<T, V, M>), device,
                     kSingleReadMaxBytes);
  if (M && l.HW % 32 != 0) C10_CUDA_CHECK(cudaMemsetAsync(mask, 0, size_t(mask_numel), stream));
  const int threads = singleread_threads(l.N * l.HW);
  bn_singleread_nchw<T, V, M><<<static_cast<unsigned>(l.C), threads, size_t(bytes), stream>>>(
      x, y, f, l.N, l.C, l.HW, relu, reinterpret_cast<uint32_t*>(mask), static_cast<int>(wr));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

// Whether a training forward runs as one cooperative kernel: below a size where the tensor stays
// in L2 between its phases. CUDADOCTOR_OPS_BN_FUSED (channels_last) and
// CUDADOCTOR_OPS_BN_FUSED_NCHW (contiguous) = 0 / 1 force it off / on (read once).
inline int fused_nhwc_setting() {
  static const int v = env_switch("CUDADOCTOR_OPS_BN_FUSED");
  return v;
}

inline int fused_nchw_setting() {
  static const int v = env_switch("CUDADOCTOR_OPS_BN_FUSED_NCHW");
  return v;
}

constexpr int64_t kFusedMaxBytes = int64_t(32) << 20;

// CUDADOCTOR_OPS_BN_STATS_PIPE=0 / 2 / 4: the channels-last statistics kernel without the
// pipelined loop / in groups of 2 or 4 rows (bn_stats_nhwc_pipe; default 4), read once.
inline int stats_pipe_setting() {
  static const int v = env_choice("CUDADOCTOR_OPS_BN_STATS_PIPE", {0, 2, 4}, 4);
  return v;
}

inline int stats_mb_setting() {
  static const int v = env_choice("CUDADOCTOR_OPS_BN_STATS_MB", {2, 3, 4}, 0);
  return v;
}

// The channels-last statistics kernel of the three-launch training forward (settings above).
template <typename T, int V>
auto stats_nhwc_kernel() -> void (*)(const T*, typename Acc<T>::type*, int64_t, int64_t) {
  const int pipe = stats_pipe_setting();
  if (pipe == 0) return bn_stats_nhwc<T, V>;
  if constexpr (std::is_same<T, c10::Half>::value) {
    const int mb = stats_mb_setting();
    if (mb == 2) return pipe == 4 ? bn_stats_nhwc_pipe<T, V, 4, 2> : bn_stats_nhwc_pipe<T, V, 2, 2>;
    if (mb == 3) return pipe == 4 ? bn_stats_nhwc_pipe<T, V, 4, 3> : bn_stats_nhwc_pipe<T, V, 2, 3>;
    if (mb == 4) return pipe == 4 ? bn_stats_nhwc_pipe<T, V, 4, 4> : bn_stats_nhwc_pipe<T, V, 2, 4>;
  }
  return pipe == 4 ? bn_stats_nhwc_pipe<T, V, 4, stats_pipe_blocks<T>(4)>
                   : bn_stats_nhwc_pipe<T, V, 2, stats_pipe_blocks<T>(2)>;
}

// CUDADOCTOR_OPS_BN_NHWC_PERSIST=0 makes the one-launch channels-last forward run bn_fused_nhwc
// (reads x twice) instead of bn_persist_nhwc wherever the latter applies (read once).
// CUDADOCTOR_OPS_BN_NHWC_PERSIST_ROWS=K (1..8) sets the rows per thread that bn_persist_nhwc's
// grid aims at (see persist_splits; K <= 4 tries the MAXR = 4 kernel first; unset: MAXR = 8
// aiming at 8).
inline int persist_nhwc_setting() {
  static const int v = env_switch("CUDADOCTOR_OPS_BN_NHWC_PERSIST");
  return v;
}

inline int persist_nhwc_rows() {
  static const int v = env_positive_int("CUDADOCTOR_OPS_BN_NHWC_PERSIST_ROWS", 8);
  return v;
}

// Splits (grid.y) of bn_persist_nhwc for R rows, gx blocks per row-slice, TY rows per block and
// per_sm resident blocks per SM; 0 when no resident grid gives every thread <= maxr rows. The
// fewest waves that do: b = 1, 2, .. per_sm blocks on every SM (splits = b * SMs / gx, at most
// one block per TY rows, at most kMaxSplits), the first whose rows per thread
// ceil(R / (splits * TY)) are <= target; if none is, the most splits that are resident.
inline int persist_splits(int64_t R, int64_t gx, int64_t ty, int sms, int per_sm, int maxr,
                          int target) {
  const int64_t most = (R + ty - 1) / ty;  // more splits would leave blocks without rows
  int64_t s = 0;
  for (int b = 1; b <= per_sm; ++b) {
    int64_t sb = int64_t(b) * sms / gx;
    if (sb > kMaxSplits) sb = kMaxSplits;
    if (sb > most) sb = most;
    if (sb < 1) continue;
    s = sb;
    if ((R + s * ty - 1) / (s * ty) <= target) break;
  }
  if (s < 1 || (R + s * ty - 1) / (s * ty) > maxr) return 0;
  return static_cast<int>(s);
}

// Launches bn_persist_nhwc<T, V, MAXR> when its resident grid gives every thread <= MAXR rows;
// false otherwise (nothing launched).
template <typename T, int V, int MAXR>
bool launch_persist_nhwc_maxr(const Layout& l, const T* x, T* y,
                              FwdArgs<typename Acc<T>::type>& f,
                              const at::TensorOptions& acc_opts, bool relu, int device,
                              cudaStream_t stream) {
  using A = typename Acc<T>::type;
  const int64_t R = l.N * l.HW;
  const int64_t Cv = l.C / V;
  const dim3 block = nhwc_block(Cv);
  const int64_t gx = (Cv + block.x - 1) / block.x;
  const size_t smem = size_t(kThreads) * V * 3 * sizeof(A);
  const int per_sm = blocks_per_sm(bn_persist_nhwc<T, V, MAXR>, smem);
  const int rows = persist_nhwc_rows();
  const int target = rows > 0 && rows < MAXR ? rows : MAXR;
  const int splits = persist_splits(R, gx, block.y, sm_count(device), per_sm, MAXR, target);
  if (splits < 1) return false;
  // partials [C, splits, 3] and coefficients [C, 3] in one allocation
  at::Tensor ws = at::empty({l.C * (splits + 1) * 3}, acc_opts);
  A* wsp = ws.data_ptr<A>();
  A* cp = wsp + l.C * splits * 3;
  int64_t Rr = R, C = l.C;
  f.ws = wsp;
  f.splits = splits;
  void* args[] = {const_cast<T**>(&x), &y, &f, &wsp, &cp, &Rr, &C, &relu};
  return launch_cooperative(reinterpret_cast<const void*>(bn_persist_nhwc<T, V, MAXR>),
                            dim3(static_cast<unsigned>(gx), static_cast<unsigned>(splits)),
                            block, args, smem, stream);
}

// bn_persist_nhwc with the smallest MAXR (4, 8) that fits; false when neither does.
template <typename T, int V>
bool launch_persist_nhwc(const Layout& l, const T* x, T* y, FwdArgs<typename Acc<T>::type>& f,
                         const at::TensorOptions& acc_opts, bool relu, int device,
                         cudaStream_t stream) {
  if (persist_nhwc_setting() == 0) return false;
  // default: MAXR = 8 at up to 8 rows per thread (the fewest blocks). On the H200 the finer
  // MAXR = 4 grids were 5-8% slower on (64,512,7,7) and (64,256,14,14) float16; a rows target of
  // 1-4 selects them.
  const int rows = persist_nhwc_rows();
  if (rows > 0 && rows <= 4 &&
      launch_persist_nhwc_maxr<T, V, 4>(l, x, y, f, acc_opts, relu, device, stream))
    return true;
  return launch_persist_nhwc_maxr<T, V, 8>(l, x, y, f, acc_opts, relu, device, stream);
}

// CUDADOCTOR_OPS_BN_NHWC_TILE=0 keeps batch_norm off bn_tile_nhwc (read once; the one-launch
// channels-last forward then tries bn_persist_nhwc first, as before). Both also apply to the
// Conv+BN+ReLU forward's use of the kernel: CUDADOCTOR_OPS_BN_NHWC_TILE_CT=32 / 64 fixes the tile
// width (unset: tile_pick chooses), CUDADOCTOR_OPS_BN_NHWC_TILE_SPLITS=S the splits wherever S
// splits fit (unset or not fitting: tile_grid's policy). All read once.
inline int tile_nhwc_setting() {
  static const int v = env_switch("CUDADOCTOR_OPS_BN_NHWC_TILE");
  return v;
}

inline int tile_nhwc_ct() {
  static const int v = env_choice("CUDADOCTOR_OPS_BN_NHWC_TILE_CT", {32, 64}, 0);
  return v;
}

inline int tile_nhwc_splits() {
  static const int v = env_positive_int("CUDADOCTOR_OPS_BN_NHWC_TILE_SPLITS", kMaxSplits);
  return v;
}

// Most splits the default policy gives bn_tile_nhwc: every block merges splits * ct partials in
// phase 2, which outgrows what it saves. On the H200 (one run, float16): 66 splits (64,256,14,14)
// 15.9 us against 21.6 for the kernels without it, 198 splits (64,128,28,28) 25.3 against 25.1,
// and Conv+BN+ReLU (32,64,56,56)->64 at 396 splits no faster than its own three kernels.
constexpr int64_t kTileMaxSplits = 256;

inline int tile_nhwc_once_setting();

// Register-only grids of more than kTileMaxSplits splits where ONCE runs (each channel merged
// once, so the splits no longer multiply every block's merge): on by default,
// CUDADOCTOR_OPS_BN_NHWC_TILE_WIDE=0 turns it off (read once). It applies to 64 channels or fewer
// over about 65k-101k rows, e.g. Conv+BN+ReLU (32,64,56,56)->64 float16: one tile of 64 at 396
// splits instead of two tiles of 32 at 198 splits every block of which merges all 198 * 32
// partials. On the H200 (two interleaved runs, CUDA graph): that block's training forward 53.6 /
// 53.6 -> 46.3 / 45.9 us (torch 54.4), its forward + backward 147.0 / 147.3 -> 139.2 / 138.9 us.
inline bool tile_nhwc_wide() {
  static const bool v = env_switch("CUDADOCTOR_OPS_BN_NHWC_TILE_WIDE") != 0;
  return v;
}

// A grid of bn_tile_nhwc: tiles of ct channels, `splits` blocks per tile (0: no grid fits), at
// most `waves` blocks per SM.
struct TileGrid {
  int ct = 0;
  int64_t tiles = 0;
  int splits = 0;
  int waves = 0;
  int stash_rows = 0;  // rows per thread in shared memory (the stash variant), 0 for none
};

// Splits of bn_tile_nhwc for R rows, C channels in tiles of ct, TY rows per block, sms SMs and
// per_sm resident blocks per SM, every thread holding at most maxr rows. Policy: the fewest
// waves. For b = 1, 2, .. per_sm blocks per SM: splits = floor(b * sms / tiles) (the grid never
// puts more than b blocks on an SM, at most one block per TY rows); the first b whose rows per
// thread ceil(R / (splits * TY)) are <= maxr. Every block of the launch reads its rows at once
// and the phases are latency-bound, so the time follows the most loaded SM: e.g. (64,512,7,7)
// float16 in tiles of 32 runs 8 splits = 128 blocks of <= 7 rows per thread on 128 SMs, where 9
// splits (144 blocks, every SM busy) would put 2 blocks of 6 rows on 12 SMs. The splits also stay
// small (a few to a few dozen: phase 2 merges splits * ct partials per block). A forced
// CUDADOCTOR_OPS_BN_NHWC_TILE_SPLITS wins where it fits.
inline TileGrid tile_grid(int64_t R, int64_t C, int ct, int64_t ty, int sms, int per_sm,
                          int maxr) {
  TileGrid g;
  g.ct = ct;
  g.tiles = (C + ct - 1) / ct;
  const int64_t most = (R + ty - 1) / ty;  // more splits would leave blocks without rows
  auto rows = [&](int64_t s) { return (R + s * ty - 1) / (s * ty); };
  const int64_t resident = int64_t(sms) * per_sm;
  const int forced = tile_nhwc_splits();
  if (forced > 0) {
    const int64_t s = forced < most ? forced : most;
    if (g.tiles * s <= resident && rows(s) <= maxr) {
      g.splits = static_cast<int>(s);
      g.waves = static_cast<int>((g.tiles * s + sms - 1) / sms);
      return g;
    }
  }
  for (int b = 1; b <= per_sm; ++b) {
    int64_t s = int64_t(b) * sms / g.tiles;
    if (s > most) s = most;
    if (s > kMaxSplits) s = kMaxSplits;
    if (s < 1) continue;
    if (rows(s) <= maxr) {
      // see kTileMaxSplits; tile_nhwc_wide() lifts the cap where ONCE runs
      if (s > kTileMaxSplits && !(tile_nhwc_wide() && s >= ct && tile_nhwc_once_setting() != 0))
        return g;
      g.splits = static_cast<int>(s);
      g.waves = b;
      return g;
    }
  }
  return g;
}

// Of two grids (tile widths 32 and 64): 64 wherever it fits, else 32. On the H200 (float16 /
// bfloat16, one run) tiles of 64 were as fast or faster everywhere both fit: (64,512,7,7) 13.0 vs
// 14.8 us, (64,256,14,14) 15.9 vs 21.3 us, (64,128,28,28) 25.3 vs 33.7 us (tiles of 32 need twice
// the splits there, and phase 2 merges them all), (64,512,14,14) 20.6 vs 20.0 us.
inline TileGrid tile_pick(const TileGrid& a32, const TileGrid& b64, int64_t /*C*/) {
  return b64.splits >= 1 ? b64 : a32;
}

// bn_tile_nhwc<ONCE>: CUDADOCTOR_OPS_BN_NHWC_TILE_ONCE=1 wherever splits >= CT, =0 never (read
// once); unset: tiles of 64 at >= kTileOnceSplits splits, and any grid of more than kTileMaxSplits
// splits (the stash grids; without ONCE every block would merge them all). On the H200 (one run,
// float16 / bfloat16): (64,128,28,28) at 198 splits of 64 channels 23.3 -> 21.1 / 25.9 -> 25.1 us
// with ONCE; (64,256,14,14) at 66 splits 16.0 -> 16.9 / 16.0 -> 17.3 us (the second barrier costs
// more than the merges it saves); Conv+BN+ReLU (32,64,56,56)->64 float16 (198 splits of 32
// channels) 54.6 -> 57.4 us.
constexpr int kTileOnceSplits = 128;

inline int tile_nhwc_once_setting() {
  static const int v = env_switch("CUDADOCTOR_OPS_BN_NHWC_TILE_ONCE");
  return v;
}

inline bool tile_once(const TileGrid& g) {
  if (g.splits < g.ct) return false;  // the kernel needs a block per channel of its tile
  const int s = tile_nhwc_once_setting();
  if (g.splits > kTileMaxSplits) return s != 0;
  if (s >= 0) return s == 1;
  return g.ct == 64 && g.splits >= kTileOnceSplits;
}

// Rows a thread keeps in shared memory in the stash variant (float16 only): 16 packs of 16 bytes,
// 64 KB per block of 256, so that 3 blocks still fit an SM of 228 KB next to the static shared
// memory. CUDADOCTOR_OPS_BN_NHWC_TILE_STASH=0 turns the variant off (read once). On the H200 (two
// runs, float16, us, stash / without): (64,256,28,28) 31.4 / 39.2, (64,1024,14,14) 28.6 / 38.9,
// (64,2048,7,7) 21.0 / 26.6, (64,64,56,56) 32.2 / 35.7 (cuDNN 36.3, 33.2, 27.5, 31.3). bfloat16
// stays on the kernels without it: (64,64,56,56) 39.3-44.3 against 34.6 us, (64,256,28,28) 38.2
// against 36.6 us (both still about 2x torch's).
constexpr int kTileStashRows = 16;
constexpr size_t kTileStashBytes = size_t(kTileStashRows) * kTileThreads * 16;

inline int tile_nhwc_stash_setting() {
  static const int v = env_switch("CUDADOCTOR_OPS_BN_NHWC_TILE_STASH");
  return v;
}

inline int tile_nhwc_mb() {
  static const int v = env_choice("CUDADOCTOR_OPS_BN_NHWC_TILE_MB", {4, 8, 16}, kTileMergeBatch16);
  return v;
}

// The bn_tile_nhwc instantiation that runs: MB from tile_nhwc_mb for 16-bit types, else 4;
// `once`: the ONCE kernel (at the default MB); `stash`: the stash variant (float16; ONCE or
// not, default MB; nullptr for other types).
template <typename T, int CT>
const void* tile_kernel(bool once = false, bool stash = false) {
  constexpr int mbd = sizeof(T) == 2 ? kTileMergeBatch16 : kTileMergeBatch;
  if (stash) {
    if constexpr (std::is_same_v<T, c10::Half>) {
      if (once)
        return reinterpret_cast<const void*>(
            bn_tile_nhwc<T, CT, kTileThreads, kTileMaxR, mbd, true, kTileStashRows>);
      return reinterpret_cast<const void*>(
          bn_tile_nhwc<T, CT, kTileThreads, kTileMaxR, mbd, false, kTileStashRows>);
    }
    return nullptr;
  }
  if (once)
    return reinterpret_cast<const void*>(bn_tile_nhwc<T, CT, kTileThreads, kTileMaxR, mbd, true>);
  if constexpr (sizeof(T) == 2) {
    if (tile_nhwc_mb() == 8)
      return reinterpret_cast<const void*>(bn_tile_nhwc<T, CT, kTileThreads, kTileMaxR, 8>);
    if (tile_nhwc_mb() == 16)
      return reinterpret_cast<const void*>(bn_tile_nhwc<T, CT, kTileThreads, kTileMaxR, 16>);
  }
  return reinterpret_cast<const void*>(bn_tile_nhwc<T, CT, kTileThreads, kTileMaxR, 4>);
}

template <typename T, int CT>
TileGrid tile_grid_ct(int64_t R, int64_t C, int device) {
  constexpr int V = 16 / int(sizeof(T));
  constexpr int TY = kTileThreads / (CT / V);
  const int per_sm = blocks_per_sm(tile_kernel<T, CT>(), 0, kTileThreads);
  return tile_grid(R, C, CT, TY, sm_count(device), per_sm, kTileMaxR);
}

// The stash variant's grid (float16, where no register-only grid fits): every block the GPU
// holds at once, as many splits per tile as that gives (fewest rows per thread), as long as every
// thread's rows fit kTileMaxR + kTileStashRows; g.stash_rows: the shared-memory rows in use.
template <typename T, int CT>
TileGrid tile_grid_stash(int64_t R, int64_t C, int device) {
  TileGrid g;
  if constexpr (!std::is_same_v<T, c10::Half>) {
    return g;
  } else {
    if (tile_nhwc_stash_setting() == 0) return g;
    constexpr int V = 16 / int(sizeof(T));
    constexpr int TY = kTileThreads / (CT / V);
    for (bool once : {false, true})
      allow_dynamic_smem(tile_kernel<T, CT>(once, true), device, kTileStashBytes);
    const void* k0 = tile_kernel<T, CT>(false, true);
    const int per_sm = blocks_per_sm(k0, kTileStashBytes, kTileThreads);
    g.ct = CT;
    g.tiles = (C + CT - 1) / CT;
    const int64_t most = (R + TY - 1) / TY;
    int64_t s = int64_t(per_sm) * sm_count(device) / g.tiles;
    const int forced = tile_nhwc_splits();
    if (forced > 0 && forced <= s) s = forced;
    if (s > most) s = most;
    if (s > kMaxSplits) s = kMaxSplits;
    if (s < 1) return g;
    const int64_t rows = (R + s * TY - 1) / (s * TY);
    if (rows > kTileMaxR + kTileStashRows) return g;
    g.splits = static_cast<int>(s);
    if (g.splits > kTileMaxSplits && !tile_once(g)) {
      g.splits = 0;
      return g;
    }
    g.waves = per_sm;
    g.stash_rows = rows > kTileMaxR ? static_cast<int>(rows - kTileMaxR) : 1;
    return g;
  }
}

template <typename T, int CT>
bool launch_tile_grid(const TileGrid& g, const T* x, T* y, uint8_t* mask,
                      FwdArgs<typename Acc<T>::type>& f, int64_t* nbt, int64_t R, int64_t C,
                      bool relu, const at::TensorOptions& acc_opts, bool reserve_in_ws,
                      cudaStream_t stream) {
  using A = typename Acc<T>::type;
  constexpr int V = 16 / int(sizeof(T));
  constexpr int TX = CT / V;
  // partials [tiles][splits][3][CT], (once) the coefficients [tiles][3][CT], then
  // (reserve_in_ws) the reserve [C]
  const bool once = tile_once(g);
  const int64_t parts = g.tiles * g.splits * 3 * CT + (once ? g.tiles * 3 * CT : 0);
  at::Tensor ws = at::empty({parts + (reserve_in_ws ? C : 0)}, acc_opts);
  A* wsp = ws.data_ptr<A>();
  if (reserve_in_ws) f.reserve = wsp + parts;
  int64_t Rr = R, Cc = C;
  void* args[] = {const_cast<T**>(&x), &y, &mask, &f, &wsp, &nbt, &Rr, &Cc, &relu};
  const size_t smem = size_t(g.stash_rows) * kTileThreads * 16;
  return launch_cooperative(
      tile_kernel<T, CT>(once, g.stash_rows > 0),
      dim3(static_cast<unsigned>(g.tiles), static_cast<unsigned>(g.splits)),
      dim3(TX, kTileThreads / TX), args, smem, stream);
}

// bn_tile_nhwc on x, y: [R, C] (C % (16 / sizeof(T)) == 0, 16-byte aligned) when a resident grid
// gives every thread <= kTileMaxR rows (or, for 16-bit types, <= kTileMaxR + kTileStashRows with
// the stash); false otherwise (nothing launched). mask: see the kernel (nullptr for none).
// reserve_in_ws: f.reserve is pointed into the workspace (callers without a reserve output).
template <typename T>
bool launch_tile_nhwc(const T* x, T* y, uint8_t* mask, FwdArgs<typename Acc<T>::type>& f,
                      int64_t* nbt, int64_t R, int64_t C, bool relu,
                      const at::TensorOptions& acc_opts, bool reserve_in_ws, int device,
                      cudaStream_t stream) {
  static_assert(sizeof(T) <= 4, "bn_tile_nhwc: float, float16, bfloat16");
  if (R < 1 || C < 1 || !cooperative_ok(device)) return false;
  const int forced = tile_nhwc_ct();
  TileGrid g32, g64;
  if (forced != 64) g32 = tile_grid_ct<T, 32>(R, C, device);
  if (forced != 32) g64 = tile_grid_ct<T, 64>(R, C, device);
  TileGrid g = tile_pick(g32, g64, C);
  if (g.splits < 1) {
    if (forced != 64) g32 = tile_grid_stash<T, 32>(R, C, device);
    if (forced != 32) g64 = tile_grid_stash<T, 64>(R, C, device);
    g = tile_pick(g32, g64, C);
  }
  if (g.splits < 1) return false;
  if (g.ct == 32)
    return launch_tile_grid<T, 32>(g, x, y, mask, f, nbt, R, C, relu, acc_opts, reserve_in_ws,
                                   stream);
  return launch_tile_grid<T, 64>(g, x, y, mask, f, nbt, R, C, relu, acc_opts, reserve_in_ws,
                                 stream);
}

// batch_norm's channels-last training forward through bn_tile_nhwc where it applies (16-byte
// packs, float / float16 / bfloat16, CUDADOCTOR_OPS_BN_NHWC_TILE not 0, a grid that fits).
template <typename T, int V>
bool launch_tile_nhwc_op(const Layout& l, const T* x, T* y, FwdArgs<typename Acc<T>::type>& f,
                         const at::TensorOptions& acc_opts, bool relu, int device,
                         cudaStream_t stream) {
  if constexpr (sizeof(T) > 4 || V != 16 / int(sizeof(T))) {
    return false;
  } else {
    if (tile_nhwc_setting() == 0) return false;
    return launch_tile_nhwc<T>(x, y, nullptr, f, nullptr, l.N * l.HW, l.C, relu, acc_opts, false,
                               device, stream);
  }
}

// Tries the one-launch channels-last training forward (bn_tile_nhwc where it fits, else
// bn_persist_nhwc where it fits, else bn_fused_nhwc); false when it does not apply (the caller
// then runs stats -> finalize -> apply).
template <typename T, int V>
bool launch_fused_nhwc(const Layout& l, const T* x, T* y, FwdArgs<typename Acc<T>::type>& f,
                       const at::TensorOptions& acc_opts, bool relu, int device,
                       cudaStream_t stream) {
  using A = typename Acc<T>::type;
  const int setting = fused_nhwc_setting();
  if (setting == 0) return false;
  const int64_t R = l.N * l.HW;
  const int64_t bytes = R * l.C * int64_t(sizeof(T));
  if (setting < 0 && bytes > kFusedMaxBytes) return false;
  if (!cooperative_ok(device)) return false;
  if (launch_tile_nhwc_op<T, V>(l, x, y, f, acc_opts, relu, device, stream)) return true;
  if (launch_persist_nhwc<T, V>(l, x, y, f, acc_opts, relu, device, stream)) return true;
  const size_t smem = size_t(kThreads) * V * 3 * sizeof(A);
  const int per_sm = blocks_per_sm(bn_fused_nhwc<T, V>, smem);
  NhwcGrid g = nhwc_grid(l.C / V, R, device, per_sm,
                         nhwc_reduce_rows(sizeof(T), static_cast<int>(nhwc_block(l.C / V).y)));
  // every block must be resident at once
  const int64_t resident = int64_t(sm_count(device)) * per_sm;
  if (int64_t(g.grid.x) * g.grid.y > resident) return false;
  // partials [C, splits, 3] and coefficients [C, 3] in one allocation
  at::Tensor ws = at::empty({l.C * (g.splits + 1) * 3}, acc_opts);
  A* wsp = ws.data_ptr<A>();
  A* cp = wsp + l.C * g.splits * 3;
  int64_t C = l.C;
  f.ws = wsp;
  f.splits = g.splits;
  void* args[] = {const_cast<T**>(&x), &y, &f, &wsp, &cp, const_cast<int64_t*>(&R), &C, &relu};
  return launch_cooperative(reinterpret_cast<const void*>(bn_fused_nhwc<T, V>), g.grid, g.block,
                            args, smem, stream);
}

// Tries the one-launch contiguous (NCHW) training forward; false when it does not apply (the
// caller then runs stats -> apply).
template <typename T, int V, bool M = false>
bool launch_fused_nchw(const Layout& l, const T* x, T* y, FwdArgs<typename Acc<T>::type>& f,
                       const at::TensorOptions& acc_opts, bool relu, int device,
                       cudaStream_t stream, uint8_t* mask = nullptr) {
  using A = typename Acc<T>::type;
  const int setting = fused_nchw_setting();
  if (setting == 0) return false;
  const int64_t bytes = l.N * l.C * l.HW * int64_t(sizeof(T));
  if (setting < 0 && bytes > kFusedMaxBytes) return false;
  if (!cooperative_ok(device)) return false;
  const int per_sm = blocks_per_sm(bn_fused_nchw<T, V, M>, 0);
  const int64_t resident = int64_t(sm_count(device)) * per_sm;
  const int splits = nchw_splits(l.C, l.N * (l.HW / V), device, per_sm);
  const int64_t items = l.C * splits;
  const unsigned grid = static_cast<unsigned>(items < resident ? items : resident);
  at::Tensor ws = at::empty({l.C * splits * 3}, acc_opts);
  A* wsp = ws.data_ptr<A>();
  f.ws = wsp;
  f.splits = splits;
  int64_t N = l.N, C = l.C, HW = l.HW;
  void* args[] = {const_cast<T**>(&x), &y, &f, &wsp, &N, &C, &HW, &relu, &mask};
  return launch_cooperative(reinterpret_cast<const void*>(bn_fused_nchw<T, V, M>), dim3(grid),
                            dim3(kThreads), args, 0, stream);
}

// The kernels' arguments of one forward. rm / rv: the running statistics eval reads (undefined:
// none); urm / urv: the running statistics the training launch updates (undefined: none);
// reserve: the reserve output (nullptr: the launcher points it into its workspace); k_stride:
// elements between a channel's first value and the next channel's (the shift K of the Welford
// sums).
template <typename A>
FwdArgs<A> fwd_args(double eps, bool training, const at::Tensor& rm, const at::Tensor& rv,
                    const at::Tensor& w, const at::Tensor& b, const at::Tensor& save_mean,
                    const at::Tensor& save_invstd, A* reserve, int64_t k_stride,
                    const at::Tensor& urm, const at::Tensor& urv, double momentum) {
  FwdArgs<A> f;
  f.ws = nullptr;
  f.splits = 0;
  f.eps = static_cast<A>(eps);
  f.training = training;
  f.rmean = param_ptr(rm);
  f.rvar = param_ptr(rv);
  f.rkind = param_kind(rm);
  f.rvkind = param_kind(rv);
  f.weight = param_ptr(w);
  f.wkind = param_kind(w);
  f.bias = param_ptr(b);
  f.bkind = param_kind(b);
  f.save_mean = save_mean.data_ptr<A>();
  f.save_invstd = save_invstd.data_ptr<A>();
  f.reserve = reserve;
  f.k_stride = k_stride;
  const bool update = urm.defined() && urv.defined();
  f.upd_mean = update ? urm.data_ptr() : nullptr;
  f.upd_var = update ? urv.data_ptr() : nullptr;
  f.umkind = update ? param_kind(urm) : kAbsent;
  f.uvkind = update ? param_kind(urv) : kAbsent;
  f.momentum = static_cast<A>(momentum);
  f.nbt = nullptr;
  return f;
}

// Launches: NCHW training: stats -> apply (which finishes its channel itself), or bn_fused_nchw
// alone for small tensors; NCHW eval: apply; NHWC training: stats -> finalize -> apply, or one
// cooperative kernel for small tensors (bn_tile_nhwc, bn_persist_nhwc or bn_fused_nhwc, see
// launch_fused_nhwc); NHWC eval: apply. urm / urv (training only, may be
// undefined): running statistics updated in place where the saved statistics are stored.
template <typename T, int V>
void launch_forward(const Layout& l, const at::Tensor& out, bool training, double eps,
                    bool relu, const at::Tensor& rm, const at::Tensor& rv, const at::Tensor& w,
                    const at::Tensor& b, const at::Tensor& save_mean,
                    const at::Tensor& save_invstd, const at::Tensor& reserve,
                    const at::Tensor& urm, const at::Tensor& urv, double momentum) {
  using A = typename Acc<T>::type;
  const int device = l.x.get_device();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  const T* x = l.x.data_ptr<T>();
  T* y = out.data_ptr<T>();
  const auto acc_opts = save_mean.options();
  const int64_t R = l.N * l.HW;
  const bool update = training && urm.defined() && urv.defined();
  FwdArgs<A> f = fwd_args<A>(eps, training, rm, rv, w, b, save_mean, save_invstd,
                             reserve.data_ptr<A>(), l.nhwc ? 1 : l.HW, update ? urm : at::Tensor(),
                             update ? urv : at::Tensor(), momentum);
  if (training && l.nhwc && launch_fused_nhwc<T, V>(l, x, y, f, acc_opts, relu, device, stream)) {
    return;
  }
  if (training && !l.nhwc && launch_singleread_nchw<T, V>(l, x, y, f, relu, device, stream)) {
    return;
  }
  if (training && !l.nhwc && launch_fused_nchw<T, V>(l, x, y, f, acc_opts, relu, device, stream)) {
    return;
  }
  at::Tensor ws;
  int stats_splits = 0;
  if (training) {
    const auto stats_k = stats_nhwc_kernel<T, V>();
    const Plan p = l.nhwc ? plan_launch(stats_k, true, l.N, l.C, l.HW, V, V * 3 * sizeof(A),
                                        device, sizeof(T))
                          : plan_launch(bn_stats_nchw<T, V>, false, l.N, l.C, l.HW, V, 0, device);
    // NHWC: partials [C, splits, 3] and the finalize's coefficients [C, 3] in one allocation
    ws = at::empty({l.C * (p.splits + (l.nhwc ? 1 : 0)) * 3}, acc_opts);
    f.ws = ws.data_ptr<A>();
    f.splits = p.splits;
    stats_splits = p.splits;
    if (l.nhwc) {
      stats_k<<<p.grid, p.block, p.smem, stream>>>(x, ws.data_ptr<A>(), R, l.C);
    } else {
      bn_stats_nchw<T, V><<<p.grid, p.block, 0, stream>>>(x, ws.data_ptr<A>(), l.N, l.C, l.HW);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (l.nhwc) {
    A* coef = nullptr;
    if (training) {
      coef = ws.data_ptr<A>() + l.C * f.splits * 3;
      if (fin_block_setting() != 0) {
        bn_finalize_fwd_blk<T><<<static_cast<unsigned>(l.C), kFinThreads, 0, stream>>>(x, f, coef);
      } else {
        const int warps = 8;
        const unsigned fgrid = static_cast<unsigned>((l.C + warps - 1) / warps);
        bn_finalize_fwd<T><<<fgrid, warps * 32, 0, stream>>>(x, f, l.C, coef);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    const Plan p = plan_launch(bn_apply_nhwc<T, V>, true, l.N, l.C, l.HW, V, 0, device);
    bn_apply_nhwc<T, V><<<p.grid, p.block, 0, stream>>>(x, y, coef, f, R, l.C, relu);
  } else {
    Plan p = plan_launch(bn_apply_nchw<T, V>, false, l.N, l.C, l.HW, V, 0, device);
    if (training) p.grid.y = static_cast<unsigned>(stats_splits);  // same slices, reversed
    bn_apply_nchw<T, V><<<p.grid, p.block, 0, stream>>>(x, y, f, l.N, l.C, l.HW, relu, nullptr);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The forward of batch_norm; with update_mean / update_var defined (training only; contiguous
// [C] tensors of a floating dtype) the running statistics are updated in place by the same
// launch that stores the saved statistics.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_impl(
    const at::Tensor& input, const c10::optional<at::Tensor>& weight_opt,
    const c10::optional<at::Tensor>& bias_opt, const c10::optional<at::Tensor>& rm_opt,
    const c10::optional<at::Tensor>& rv_opt, bool training, double eps,
    c10::string_view activation, const at::Tensor& update_mean, const at::Tensor& update_var,
    double momentum) {
  check_input(input, "input");
  const bool relu = parse_relu(activation);
  const int64_t C = input.size(1);
  check_param(weight_opt, "weight", input, C);
  check_param(bias_opt, "bias", input, C);
  check_param(rm_opt, "running_mean", input, C);
  check_param(rv_opt, "running_var", input, C);
  const bool has_rm = rm_opt.has_value() && rm_opt->defined();
  const bool has_rv = rv_opt.has_value() && rv_opt->defined();
  TORCH_CHECK(training || (has_rm && has_rv),
              "cudadoctor_ops.batch_norm: running_mean and running_var must be given when "
              "training=False (they are the statistics used in eval mode)");
  TORCH_CHECK(eps >= 0, "cudadoctor_ops.batch_norm: eps must be >= 0, got ", eps);
  c10::cuda::CUDAGuard guard(input.device());

  const auto acc_type = input.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto acc_opts = input.options().dtype(acc_type);
  Layout l = make_layout(input);
  at::Tensor out = at::empty_like(l.x);
  at::Tensor save_mean = at::empty({C}, acc_opts);
  at::Tensor save_invstd = at::empty({C}, acc_opts);
  at::Tensor reserve = at::empty({C}, acc_opts);
  if (input.numel() == 0) {
    save_mean.zero_();
    save_invstd.zero_();
    reserve.zero_();
    return {out, save_mean, save_invstd, reserve};
  }
  const at::Tensor w = contig_param(weight_opt), b = contig_param(bias_opt);
  const at::Tensor rm = training ? at::Tensor() : contig_param(rm_opt);
  const at::Tensor rv = training ? at::Tensor() : contig_param(rv_opt);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "bn_fwd", [&] {
    constexpr int VW = 16 / sizeof(scalar_t);
    if (vec_width<scalar_t>(l, {l.x.data_ptr(), out.data_ptr()}) == VW) {
      launch_forward<scalar_t, VW>(l, out, training, eps, relu, rm, rv, w, b, save_mean,
                                   save_invstd, reserve, update_mean, update_var, momentum);
    } else {
      launch_forward<scalar_t, 1>(l, out, training, eps, relu, rm, rv, w, b, save_mean,
                                  save_invstd, reserve, update_mean, update_var, momentum);
    }
  });
  return {out, save_mean, save_invstd, reserve};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> batch_norm_cuda(
    const at::Tensor& input, const c10::optional<at::Tensor>& weight_opt,
    const c10::optional<at::Tensor>& bias_opt, const c10::optional<at::Tensor>& rm_opt,
    const c10::optional<at::Tensor>& rv_opt, bool training, double eps,
    c10::string_view activation) {
  return forward_impl(input, weight_opt, bias_opt, rm_opt, rv_opt, training, eps, activation,
                      at::Tensor(), at::Tensor(), 0.0);
}

// running = (1 - momentum) * running + momentum * batch; unbiased batch var from save_invstd.
template <typename A>
__global__ void bn_update_stats(void* rmean, int mkind, void* rvar, int vkind,
                                const A* __restrict__ save_mean,
                                const A* __restrict__ save_invstd, int64_t C, double momentum,
                                double eps, int64_t count) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const A m = static_cast<A>(momentum);
  const A inv = save_invstd[c];
  A var = A(1) / (inv * inv) - static_cast<A>(eps);
  if (var < A(0)) var = A(0);
  // count == 1 divides by zero (inf/nan) like torch; the Python layer refuses that case first.
  const A unbiased = var * (static_cast<A>(count) / static_cast<A>(count - 1));
  const A old_m = load_param<A>(rmean, mkind, c, A(0));
  const A old_v = load_param<A>(rvar, vkind, c, A(0));
  store_param<A>(rmean, mkind, c, (A(1) - m) * old_m + m * save_mean[c]);
  store_param<A>(rvar, vkind, c, (A(1) - m) * old_v + m * unbiased);
}

void batch_norm_update_stats_cuda(const at::Tensor& running_mean, const at::Tensor& running_var,
                                  const at::Tensor& save_mean, const at::Tensor& save_invstd,
                                  double momentum, double eps, int64_t count) {
  const int64_t C = save_mean.numel();
  TORCH_CHECK(running_mean.is_cuda() && running_var.is_cuda(),
              "cudadoctor_ops.batch_norm_update_stats: running_mean and running_var must be CUDA "
              "tensors, got ", running_mean.device(), " and ", running_var.device());
  TORCH_CHECK(running_mean.device() == save_mean.device() &&
                  running_var.device() == save_mean.device(),
              "cudadoctor_ops.batch_norm_update_stats: running_mean/running_var must be on ",
              save_mean.device());
  TORCH_CHECK(running_mean.dim() == 1 && running_mean.numel() == C,
              "cudadoctor_ops.batch_norm_update_stats: running_mean must have shape [", C,
              "], got ", running_mean.sizes());
  TORCH_CHECK(running_var.dim() == 1 && running_var.numel() == C,
              "cudadoctor_ops.batch_norm_update_stats: running_var must have shape [", C,
              "], got ", running_var.sizes());
  TORCH_CHECK(running_mean.is_contiguous() && running_var.is_contiguous(),
              "cudadoctor_ops.batch_norm_update_stats: running_mean and running_var must be "
              "contiguous (they are updated in place)");
  TORCH_CHECK(save_mean.scalar_type() == save_invstd.scalar_type() &&
                  (save_mean.scalar_type() == at::kFloat ||
                   save_mean.scalar_type() == at::kDouble),
              "cudadoctor_ops.batch_norm_update_stats: save_mean/save_invstd must be float32 or "
              "float64 (as returned by batch_norm)");
  TORCH_CHECK(param_kind(running_mean) != kAbsent && param_kind(running_var) != kAbsent,
              "cudadoctor_ops.batch_norm_update_stats: running stats must be floating point, got ",
              running_mean.scalar_type(), " and ", running_var.scalar_type());
  if (C == 0 || count <= 0) return;
  c10::cuda::CUDAGuard guard(save_mean.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(save_mean.get_device()).stream();
  const at::Tensor sm = save_mean.contiguous(), si = save_invstd.contiguous();
  const unsigned grid = static_cast<unsigned>((C + 255) / 256);
  if (sm.scalar_type() == at::kDouble) {
    bn_update_stats<double><<<grid, 256, 0, stream>>>(
        running_mean.data_ptr(), param_kind(running_mean), running_var.data_ptr(),
        param_kind(running_var), sm.data_ptr<double>(), si.data_ptr<double>(), C, momentum, eps,
        count);
  } else {
    bn_update_stats<float><<<grid, 256, 0, stream>>>(
        running_mean.data_ptr(), param_kind(running_mean), running_var.data_ptr(),
        param_kind(running_var), sm.data_ptr<float>(), si.data_ptr<float>(), C, momentum, eps,
        count);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Whether the contiguous training forward with the mask takes bn_singleread_nchw<M = true>
// (launch_singleread_nchw's conditions, checked before anything is launched: with H*W % 8 != 0
// nothing else can write the mask).
bool singleread_mask_fits(const Layout& l, at::ScalarType st, const at::Tensor& mask, int device) {
  return singleread_smem_bytes(l, int64_t(c10::elementSize(st)), device, true, mask.data_ptr(),
                               mask.numel()) > 0;
}

// Contiguous training forward with ReLU and mask (see batch_norm_relu_mask_train):
// bn_singleread_nchw<M = true> where it applies (16-byte packs when H*W allows them, else
// single elements), else bn_fused_nchw<M = true>, else bn_stats_nchw -> bn_apply_nchw<M = true>
// (these two need H*W % 8 == 0).
template <typename T>
void launch_train_mask_nchw(const Layout& l, const T* x, T* y, uint8_t* mask, int64_t mask_numel,
                            FwdArgs<typename Acc<T>::type>& f, const at::TensorOptions& acc_opts,
                            int device, cudaStream_t stream) {
  using A = typename Acc<T>::type;
  constexpr int V = 16 / int(sizeof(T));
  if (l.HW % V == 0) {
    if (launch_singleread_nchw<T, V, true>(l, x, y, f, true, device, stream, mask, mask_numel))
      return;
  } else if (launch_singleread_nchw<T, 1, true>(l, x, y, f, true, device, stream, mask,
                                                mask_numel)) {
    return;
  }
  TORCH_CHECK(l.HW % 8 == 0, "cudadoctor_ops: internal error: no mask kernel for H*W = ", l.HW);
  if (launch_fused_nchw<T, V, true>(l, x, y, f, acc_opts, true, device, stream, mask)) return;
  const Plan p = plan_launch(bn_stats_nchw<T, V>, false, l.N, l.C, l.HW, V, 0, device);
  at::Tensor ws = at::empty({l.C * p.splits * 3}, acc_opts);
  f.ws = ws.data_ptr<A>();
  f.splits = p.splits;
  bn_stats_nchw<T, V><<<p.grid, p.block, 0, stream>>>(x, ws.data_ptr<A>(), l.N, l.C, l.HW);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  Plan q = plan_launch(bn_apply_nchw<T, V, true>, false, l.N, l.C, l.HW, V, 0, device);
  q.grid.y = static_cast<unsigned>(p.splits);  // the same slices, reversed
  bn_apply_nchw<T, V, true><<<q.grid, q.block, 0, stream>>>(x, y, f, l.N, l.C, l.HW, true, mask);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

bool batch_norm_relu_mask_train(const at::Tensor& x, const at::Tensor& out, const at::Tensor& mask,
                                const at::Tensor& weight, const at::Tensor& bias, double eps,
                                const at::Tensor& save_mean, const at::Tensor& save_invstd,
                                const at::Tensor& running_mean, const at::Tensor& running_var,
                                const at::Tensor& num_batches_tracked, double momentum) {
  const auto st = x.scalar_type();
  if (st != at::kFloat && st != at::kHalf && st != at::kBFloat16) return false;
  if (!x.is_cuda() || x.dim() < 2 || x.numel() == 0) return false;
  const Layout l = make_layout(x);
  if (!l.x.is_same(x) || l.N * l.HW < 2) return false;
  if (l.nhwc) {
    // bn_tile_nhwc: 16-bit packs of 8 channels; out in x's strides
    if (st == at::kFloat || l.C % 8 != 0 || out.strides() != x.strides()) return false;
  } else {
    // bn_singleread_nchw with M (any H*W; see launch_train_mask_nchw), else bn_fused_nchw /
    // bn_apply_nchw with M: whole mask bytes per channel row. The cumulative average reads
    // num_batches_tracked, which these kernels increment unordered.
    if (!x.is_contiguous() || !out.is_contiguous()) return false;
    if (l.HW % 8 != 0 && !singleread_mask_fits(l, x.scalar_type(), mask, x.get_device()))
      return false;
    if (num_batches_tracked.defined() && momentum < 0) return false;
  }
  if (out.scalar_type() != st || out.sizes() != x.sizes()) return false;
  if (reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 != 0)
    return false;
  if (mask.scalar_type() != at::kByte || mask.numel() < (x.numel() + 7) / 8) return false;
  if (save_mean.scalar_type() != at::kFloat || save_invstd.scalar_type() != at::kFloat) return false;
  const bool update = running_mean.defined() && running_var.defined();
  const int device = x.get_device();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  const auto acc_opts = save_mean.options();
  int64_t* nbt = num_batches_tracked.defined() ? num_batches_tracked.data_ptr<int64_t>() : nullptr;
  uint8_t* mp = mask.data_ptr<uint8_t>();
  // no running statistics to read (training); channels-last: the reserve in the workspace
  at::Tensor reserve = l.nhwc ? at::Tensor() : at::empty({l.C}, acc_opts);
  FwdArgs<float> f = fwd_args<float>(eps, true, at::Tensor(), at::Tensor(), weight, bias,
                                     save_mean, save_invstd,
                                     l.nhwc ? nullptr : reserve.data_ptr<float>(),
                                     l.nhwc ? 1 : l.HW, update ? running_mean : at::Tensor(),
                                     update ? running_var : at::Tensor(), momentum);
  if (l.nhwc) {
    const int64_t R = l.N * l.HW;
    if (st == at::kHalf) {
      return launch_tile_nhwc<at::Half>(l.x.data_ptr<at::Half>(), out.data_ptr<at::Half>(), mp,
                                        f, nbt, R, l.C, true, acc_opts, true, device, stream);
    }
    return launch_tile_nhwc<at::BFloat16>(l.x.data_ptr<at::BFloat16>(),
                                          out.data_ptr<at::BFloat16>(), mp, f, nbt, R, l.C, true,
                                          acc_opts, true, device, stream);
  }
  f.nbt = nbt;
  if (st == at::kFloat) {
    launch_train_mask_nchw<float>(l, l.x.data_ptr<float>(), out.data_ptr<float>(), mp,
                                  mask.numel(), f, acc_opts, device, stream);
  } else if (st == at::kHalf) {
    launch_train_mask_nchw<at::Half>(l, l.x.data_ptr<at::Half>(), out.data_ptr<at::Half>(), mp,
                                     mask.numel(), f, acc_opts, device, stream);
  } else {
    launch_train_mask_nchw<at::BFloat16>(l, l.x.data_ptr<at::BFloat16>(),
                                         out.data_ptr<at::BFloat16>(), mp, mask.numel(), f,
                                         acc_opts, device, stream);
  }
  return true;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> batch_norm_train_update_cuda(
    const at::Tensor& input, const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& bias, const at::Tensor& running_mean,
    const at::Tensor& running_var, double momentum, double eps, c10::string_view activation) {
  TORCH_CHECK(running_mean.is_contiguous() && running_var.is_contiguous(),
              "cudadoctor_ops.batch_norm: running_mean and running_var must be contiguous (they "
              "are updated in place)");
  return forward_impl(input, weight, bias, running_mean, running_var, true, eps, activation,
                      running_mean, running_var, momentum);
}

}  // namespace bn
}  // namespace cudadoctor_ops

TORCH_LIBRARY_IMPL(cudadoctor_ops, CUDA, m) {
  m.impl("batch_norm", &cudadoctor_ops::bn::batch_norm_cuda);
  m.impl("batch_norm_update_stats", &cudadoctor_ops::bn::batch_norm_update_stats_cuda);
}
