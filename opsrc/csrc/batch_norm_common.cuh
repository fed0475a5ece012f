// Shared pieces of the BatchNorm kernels (batch_norm_fwd.cu, batch_norm_bwd.cu).
//
// Two memory layouts are handled without copies:
//   NCHW  - input viewed as [N, C, HW] contiguous (any (N, C, *) tensor that is contiguous).
//           One block works on one channel and one slice ("split") of that channel's N*HW
//           values; threads walk the slice in packs of V values along HW.
//   NHWC  - input viewed as [R = N*HW, C] with C contiguous (channels_last / channels_last_3d,
//           and every input whose HW is 1). Block (TX, TY): a thread owns V consecutive channels
//           and walks rows; blockIdx.y picks a slice of the rows.
// Reductions are split over many blocks per channel (partials to a workspace [C, splits, 3]),
// merged per channel (by the first warp of each NCHW apply block, or a small finalize kernel
// for NHWC), then an elementwise pass applies the result. The apply passes walk memory in the
// reverse order of the reduction passes, so they start on what the reduction left in L2.
// V is 16 / sizeof(T) (16-byte loads) when the rows are 16-byte aligned, else 1.
// All element offsets are 64-bit.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>

#include "env_setting.h"

namespace cudadoctor_ops {
namespace bn {

constexpr int kThreads = 256;  // threads per block of the streaming kernels
constexpr int kUnroll = 4;     // packs in flight per thread
constexpr int kMaxSplits = 1024;

template <typename T>
struct Acc {
  using type = float;
};
template <>
struct Acc<double> {
  using type = double;
};

template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

// Runtime dtype of the small per-channel tensors (weight, bias, running stats, grads of params).
enum ParamKind : int { kF32 = 0, kF16 = 1, kBF16 = 2, kF64 = 3, kAbsent = 4 };

template <typename A>
__device__ __forceinline__ A load_param(const void* p, int kind, int64_t i, A absent) {
  switch (kind) {
    case kF32:
      return static_cast<A>(static_cast<const float*>(p)[i]);
    case kF16:
      return static_cast<A>(static_cast<float>(static_cast<const c10::Half*>(p)[i]));
    case kBF16:
      return static_cast<A>(static_cast<float>(static_cast<const c10::BFloat16*>(p)[i]));
    case kF64:
      return static_cast<A>(static_cast<const double*>(p)[i]);
    default:
      return absent;
  }
}

template <typename A>
__device__ __forceinline__ void store_param(void* p, int kind, int64_t i, A v) {
  switch (kind) {
    case kF32:
      static_cast<float*>(p)[i] = static_cast<float>(v);
      break;
    case kF16:
      static_cast<c10::Half*>(p)[i] = c10::Half(static_cast<float>(v));
      break;
    case kBF16:
      static_cast<c10::BFloat16*>(p)[i] = c10::BFloat16(static_cast<float>(v));
      break;
    case kF64:
      static_cast<double*>(p)[i] = static_cast<double>(v);
      break;
    default:
      break;
  }
}

template <typename A>
__device__ __forceinline__ A fast_div(A a, A b) {
  return a / b;
}
template <>
__device__ __forceinline__ float fast_div<float>(float a, float b) {
  return __fdividef(a, b);
}

template <typename A>
__device__ __forceinline__ A inv_sqrt(A v) {
  return A(1) / sqrt(v);
}

// Chan et al. parallel merge of (mean, m2, n) with (mb, m2b, nb).
template <typename A>
__device__ __forceinline__ void welford_merge(A& mean, A& m2, A& n, A mb, A m2b, A nb) {
  const A nn = n + nb;
  if (nn == A(0)) return;
  const A delta = mb - mean;
  const A f = fast_div(nb, nn);
  mean += delta * f;
  m2 += m2b + delta * delta * n * f;
  n = nn;
}

template <typename A>
__device__ __forceinline__ void warp_welford(A& mean, A& m2, A& n) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const A mb = __shfl_down_sync(0xffffffffu, mean, o);
    const A m2b = __shfl_down_sync(0xffffffffu, m2, o);
    const A nb = __shfl_down_sync(0xffffffffu, n, o);
    welford_merge(mean, m2, n, mb, m2b, nb);
  }
}

template <typename A>
__device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  return v;
}

// Walk of one thread through the packs of one channel in the NCHW view: pack index j of the
// channel (0 <= j < N*HW/V) lives at element offset (j / HWv) * C*HW + c*HW + (j % HWv) * V.
struct NchwWalk {
  int64_t h;    // pack index inside the current row
  int64_t off;  // element offset of the current pack
  int64_t step_h, step_off, HWv, wrap;
  __device__ __forceinline__ NchwWalk(int64_t j, int64_t stride, int64_t c, int64_t C,
                                      int64_t HW, int V) {
    HWv = HW / V;
    const int64_t n = j / HWv;
    h = j - n * HWv;
    off = (n * C + c) * HW + h * V;
    const int64_t sn = stride / HWv;
    step_h = stride - sn * HWv;
    step_off = sn * C * HW + step_h * V;
    wrap = C * HW - HW;
  }
  __device__ __forceinline__ void advance() {
    h += step_h;
    off += step_off;
    if (h >= HWv) {
      h -= HWv;
      off += wrap;
    }
  }
  __device__ __forceinline__ void retreat() {  // the step back, for reversed traversals
    h -= step_h;
    off -= step_off;
    if (h < 0) {
      h += HWv;
      off -= wrap;
    }
  }
};

// Sum over the block (1-D, at most 32 warps), returned to every thread; red: one slot per warp.
template <typename A>
__device__ __forceinline__ A block_sum(A v, A* red) {
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // red may still be read from the previous call
  if (lane == 0) red[warp] = v;
  __syncthreads();
  const int nw = blockDim.x >> 5;
  const A t = lane < nw ? red[lane] : A(0);
  return __shfl_sync(0xffffffffu, warp_sum(t), 0);
}

// The warps of the whole grid taking one channel each in turn (the channel-finishing phase of the
// one-launch kernels): the calling thread's lane (from the linear thread index: blocks may be
// 2-D), its warp's first channel and the stride over channels.
struct GridWarps {
  int lane;
  int64_t first;
  int64_t stride;
};

__device__ __forceinline__ GridWarps grid_warps() {
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  const int warps_per_block = (blockDim.x * blockDim.y) >> 5;
  const int64_t block = int64_t(blockIdx.y) * gridDim.x + blockIdx.x;
  GridWarps g;
  g.lane = tid & 31;
  g.first = block * warps_per_block + (tid >> 5);
  g.stride = int64_t(gridDim.x) * gridDim.y * warps_per_block;
  return g;
}

// ---- host helpers ----

// A kernel switch from the environment: -1 unset, 0 for a value starting with '0', else 1.
// Finalize kernels with one block of kFinThreads per channel (bn_finalize_fwd_blk,
// bn_bwd_finalize_blk): a thread merges every kFinThreads-th partial, kFinBatch loads in flight
// before it merges them, then the warps' results meet in shared memory. Against one warp per
// channel, a channel's chain of merges is 4x shorter. CUDADOCTOR_OPS_BN_FIN_BLOCK=0: one warp
// per channel as before (read once).
constexpr int kFinThreads = 128;
constexpr int kFinBatch = 4;

// Calls f(p0, p1, p2) for the partials of splits s = first, first + step, ... < splits, in that
// order, with B of them loaded before the calls (B loads in flight instead of one dependent
// round trip per partial); load(s, p0, p1, p2) reads split s's partial. kZeros: f also gets
// (0, 0, 0) for the slots past splits (for sums: no test per slot, so the compiler unrolls
// further).
template <int B, bool kZeros, typename A, typename L, typename F>
__device__ __forceinline__ void for_batched_partials(int splits, int first, int step, L&& load,
                                                     F&& f) {
  for (int s0 = first; s0 < splits; s0 += step * B) {
    A p0[B], p1[B], p2[B];
#pragma unroll
    for (int u = 0; u < B; ++u) {
      const int s = s0 + step * u;
      p0[u] = 0;
      p1[u] = 0;
      p2[u] = 0;
      if (s < splits) load(s, p0[u], p1[u], p2[u]);
    }
#pragma unroll
    for (int u = 0; u < B; ++u)
      if (kZeros || s0 + step * u < splits) f(p0[u], p1[u], p2[u]);
  }
}

// for_batched_partials over one channel's partials p = pc + 3 * s.
template <int B, bool kZeros = false, typename A, typename F>
__device__ __forceinline__ void for_partials(const A* pc, int splits, int first, int step, F&& f) {
  for_batched_partials<B, kZeros, A>(
      splits, first, step,
      [&](int s, A& p0, A& p1, A& p2) {
        p0 = pc[s * 3 + 0];
        p1 = pc[s * 3 + 1];
        p2 = pc[s * 3 + 2];
      },
      f);
}

// One row's pack of V channels into a thread's per-channel Welford states (values shifted by K;
// the channels share the count n).
template <typename A, typename T, int V>
__device__ __forceinline__ void welford_row(const Pack<T, V>& p, const A (&K)[V], A (&mean)[V],
                                            A (&m2)[V], A& n) {
  n += A(1);
  const A f = fast_div(A(1), n);
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const A v = static_cast<A>(p.v[i]) - K[i];
    const A d = v - mean[i];
    mean[i] += d * f;
    m2[i] += d * (v - mean[i]);
  }
}

// Accumulates rows r, r + rstride, .. (< R) of x [R, C] at pack cv, kUnroll loads in flight.
template <typename A, typename T, int V>
__device__ __forceinline__ void welford_rows_nhwc(const T* __restrict__ x, int64_t r, int64_t R,
                                                  int64_t rstride, int64_t C, int64_t cv,
                                                  const A (&K)[V], A (&mean)[V], A (&m2)[V],
                                                  A& n) {
  for (; r < R; r += kUnroll * rstride) {
    Pack<T, V> p[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (r + u * rstride < R)
        p[u] = *reinterpret_cast<const Pack<T, V>*>(x + (r + u * rstride) * C + cv * V);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (r + u * rstride < R) welford_row<A, T, V>(p[u], K, mean, m2, n);
  }
}

// Coordinates of a thread in the channel-tiled kernels (bn_tile_nhwc, bn_bwd_tile_nhwc): blocks
// of THREADS threads, threadIdx.x over the TX = CT / V packs of a tile's channels and threadIdx.y
// over TY rows; grid (channel tiles, row splits). The thread owns pack cv (channels cv * V ..) of
// rows r0, r0 + rstride, ...; active: cv is inside the tensor's C / V packs. Taken apart by a
// structured binding in the kernels.
template <int CT, int V, int THREADS>
struct TileIndex {
  static constexpr int TX = CT / V;
  static constexpr int TY = THREADS / TX;
  int tx, tid, lane, warp, tile, split, splits;
  int64_t cv, rstride, r0;
  bool active;
  __device__ __forceinline__ explicit TileIndex(int64_t C)
      : tx(threadIdx.x),
        tid(threadIdx.y * TX + threadIdx.x),
        lane(tid & 31),
        warp(tid >> 5),
        tile(blockIdx.x),
        split(blockIdx.y),
        splits(gridDim.y),
        cv(int64_t(tile) * TX + tx),
        rstride(int64_t(splits) * TY),
        r0(int64_t(split) * TY + threadIdx.y),
        active(cv < C / V) {}
};

// Calls f(p0, p1, p2) for the partials of channel j of a tile in the channel-tiled kernels
// (bn_tile_nhwc, bn_bwd_tile_nhwc; the tile's partials wt [splits][3][CT]) of splits s = first,
// first + step, ... < splits, in that order, with B of them loaded before the calls. The partials
// were written by the same launch: loads through L2 (__ldcg), never the read-only path.
template <int B, int CT, typename A, typename F>
__device__ __forceinline__ void for_tile_partials(const A* wt, int j, int splits, int first,
                                                  int step, F&& f) {
  for_batched_partials<B, false, A>(
      splits, first, step,
      [&](int s, A& p0, A& p1, A& p2) {
        const A* q = wt + int64_t(s) * 3 * CT + j;
        p0 = __ldcg(q);
        p1 = __ldcg(q + CT);
        p2 = __ldcg(q + 2 * CT);
      },
      f);
}

// Stores block `split`'s partial (p0, p1, p2) of channel j into a tile's partials wt
// [splits][3][CT] (the layout for_tile_partials reads).
template <int CT, typename A>
__device__ __forceinline__ void store_tile_partial(A* wt, int split, int j, A p0, A p1, A p2) {
  A* o = wt + int64_t(split) * 3 * CT + j;
  o[0] = p0;
  o[CT] = p1;
  o[2 * CT] = p2;
}

// The three per-channel coefficients of the V channels of pack tx, from a channel-tiled kernel's
// coef [3][CT] in shared memory.
template <typename A, int CT, int V>
__device__ __forceinline__ void load_tile_coef(const A (&coef)[3][CT], int tx, A (&c0)[V],
                                               A (&c1)[V], A (&c2)[V]) {
#pragma unroll
  for (int i = 0; i < V; ++i) {
    c0[i] = coef[0][tx * V + i];
    c1[i] = coef[1][tx * V + i];
    c2[i] = coef[2][tx * V + i];
  }
}

// Makes the compiler treat the bits of p as unknown from here on: the last phase of the
// register-persistent kernels (bn_persist_nhwc, bn_tile_nhwc, bn_bwd_tile_nhwc) then converts the
// packs held since their first phase again instead of keeping the converted values (2x the
// registers for 16-bit types) alive across the grid barriers.
template <typename P>
__device__ __forceinline__ void persist_opaque(P& p) {
  static_assert(sizeof(P) % 2 == 0, "packs of 16-bit words");
  if constexpr (sizeof(P) % 4 == 0) {
    uint32_t w[sizeof(P) / 4];
    memcpy(w, &p, sizeof(P));
#pragma unroll
    for (int i = 0; i < int(sizeof(P) / 4); ++i) asm volatile("" : "+r"(w[i]));
    memcpy(&p, w, sizeof(P));
  } else {
    unsigned short h[sizeof(P) / 2];
    memcpy(h, &p, sizeof(P));
#pragma unroll
    for (int i = 0; i < int(sizeof(P) / 2); ++i) asm volatile("" : "+h"(h[i]));
    memcpy(&p, h, sizeof(P));
  }
}

// Non-blocking: brings the line of p into L2 for a load later in the kernel.
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// CUDADOCTOR_OPS_BN_FIN_BLOCK (see kFinThreads), read once.
inline int fin_block_setting() {
  static const int v = env_switch("CUDADOCTOR_OPS_BN_FIN_BLOCK");
  return v;
}

// CUDADOCTOR_OPS_BN_SINGLEREAD (single-read contiguous forward and backward), read once.
inline int singleread_setting() {
  static const int v = env_switch("CUDADOCTOR_OPS_BN_SINGLEREAD");
  return v;
}

// Block size of the single-read kernels for channels of `values` values: 256 up to 16384 (more
// channels in flight per SM; on the H200 512 threads cost (64,512,7,7) and (64,2048,7,7) float32
// 30-40%), else 512. CUDADOCTOR_OPS_BN_SR_THREADS=256/512 fixes it (read once).
inline int singleread_threads(int64_t values) {
  static const int fixed = [] {
    const char* e = std::getenv("CUDADOCTOR_OPS_BN_SR_THREADS");
    const int t = e ? std::atoi(e) : 0;
    return (t == 256 || t == 512) ? t : 0;
  }();
  return fixed ? fixed : (values > 16384 ? 512 : 256);
}

// Completion counters of the kernels whose last block to finish does the final step (the apply
// from sums' running-statistics update, the BatchNorm backward's group partials): a __device__
// array of `slots` slots of `per_slot` counters, zero before a launch and after it (the kernels
// set back what they count), one slot per launch in turn, so that launches on different streams
// share one only when `slots` of them are in flight at once. Constructed once per array (a
// function-local static beside it).
class CounterPool {
 public:
  CounterPool(const void* symbol, unsigned slots, size_t per_slot)
      : symbol_(symbol), slots_(slots), per_slot_(per_slot) {}

  // The next slot's counters on `device` (the current device).
  unsigned* next(int device) {
    TORCH_CHECK(device >= 0 && device < 64, "cudadoctor_ops: device index ", device, " out of range");
    unsigned* b;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (base_[device] == nullptr)
        C10_CUDA_CHECK(cudaGetSymbolAddress(reinterpret_cast<void**>(&base_[device]), symbol_));
      b = base_[device];
    }
    return b + size_t(next_.fetch_add(1u, std::memory_order_relaxed) % slots_) * per_slot_;
  }

 private:
  const void* symbol_;
  unsigned slots_;
  size_t per_slot_;
  std::mutex mu_;
  unsigned* base_[64] = {nullptr};
  std::atomic<unsigned> next_{0};
};

// Whether the device supports cooperative launches (cached per device).
inline bool cooperative_ok(int device) {
  static int cached[64] = {0};  // 0 unknown, 1 yes, 2 no
  if (device >= 0 && device < 64 && cached[device] != 0) return cached[device] == 1;
  int v = 0;
  if (cudaDeviceGetAttribute(&v, cudaDevAttrCooperativeLaunch, device) != cudaSuccess) {
    (void)cudaGetLastError();
    v = 0;
  }
  if (device >= 0 && device < 64) cached[device] = v ? 1 : 2;
  return v != 0;
}

// Allows `kernel` `bytes` of dynamic shared memory on `device` (needed above 48 KB): the
// attribute is set once per kernel and device.
inline void allow_dynamic_smem(const void* kernel, int device, size_t bytes) {
  static std::mutex mu;
  static std::set<std::pair<const void*, int>> done;
  std::lock_guard<std::mutex> lock(mu);
  if (done.count({kernel, device})) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(bytes)));
  done.insert({kernel, device});
}

// cudaLaunchCooperativeKernel; false (error cleared) when the grid cannot be resident at once.
inline bool launch_cooperative(const void* kernel, dim3 grid, dim3 block, void** args,
                               size_t smem, cudaStream_t stream) {
  const cudaError_t err = cudaLaunchCooperativeKernel(kernel, grid, block, args, smem, stream);
  if (err == cudaErrorCooperativeLaunchTooLarge) {
    (void)cudaGetLastError();
    return false;
  }
  C10_CUDA_CHECK(err);
  return true;
}

inline int sm_count(int device) {
  static int cached[64] = {0};
  if (device >= 0 && device < 64 && cached[device] > 0) return cached[device];
  int v = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device));
  if (device >= 0 && device < 64) cached[device] = v;
  return v;
}

inline int param_kind(const at::Tensor& t) {
  if (!t.defined()) return kAbsent;
  switch (t.scalar_type()) {
    case at::kFloat:
      return kF32;
    case at::kHalf:
      return kF16;
    case at::kBFloat16:
      return kBF16;
    case at::kDouble:
      return kF64;
    default:
      return kAbsent;
  }
}

inline const void* param_ptr(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

// The layout a kernel sees, see the comment at the top.
struct Layout {
  at::Tensor x;  // the input as the kernels read it (a contiguous copy if it had odd strides)
  bool nhwc = false;
  int64_t N = 0, C = 0, HW = 1;
  at::MemoryFormat format = at::MemoryFormat::Contiguous;
};

inline Layout make_layout(const at::Tensor& input) {
  Layout l;
  l.N = input.size(0);
  l.C = input.size(1);
  l.HW = 1;
  for (int64_t d = 2; d < input.dim(); ++d) l.HW *= input.size(d);
  if (input.dim() == 4 && !input.is_contiguous() &&
      input.is_contiguous(at::MemoryFormat::ChannelsLast)) {
    l.x = input;
    l.nhwc = true;
    l.format = at::MemoryFormat::ChannelsLast;
  } else if (input.dim() == 5 && !input.is_contiguous() &&
             input.is_contiguous(at::MemoryFormat::ChannelsLast3d)) {
    l.x = input;
    l.nhwc = true;
    l.format = at::MemoryFormat::ChannelsLast3d;
  } else {
    l.x = input.is_contiguous() ? input : input.contiguous();
    l.nhwc = (l.HW == 1);
    l.format = at::MemoryFormat::Contiguous;
  }
  return l;
}

// A tensor in the same memory layout as l.x (copied only when its layout differs).
inline at::Tensor like_layout(const at::Tensor& t, const Layout& l) {
  if (t.is_contiguous(l.format)) return t;
  return t.contiguous(l.format);
}

template <typename T>
inline int vec_width(const Layout& l, std::initializer_list<const void*> ptrs) {
  constexpr int V = 16 / sizeof(T);
  const int64_t row = l.nhwc ? l.C : l.HW;
  if (row % V != 0) return 1;
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return 1;
  return V;
}

// Resident blocks of `kernel` per SM with `threads` threads per block and `smem` bytes of dynamic
// shared memory, cached per kernel (every GPU of a process is assumed to be of one kind, and every
// kernel is launched with one block size; the count only sizes grids).
template <typename K>
inline int blocks_per_sm(K kernel, size_t smem, int threads = kThreads) {
  static std::mutex mu;
  static std::unordered_map<const void*, int> cache;
  const void* key = reinterpret_cast<const void*>(kernel);
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem) != cudaSuccess) {
    (void)cudaGetLastError();
    n = 2;
  }
  if (n < 1) n = 1;
  std::lock_guard<std::mutex> lock(mu);
  cache[key] = n;
  return n;
}

// Blocks per channel for the NCHW kernels: one full wave of resident blocks (a partial second
// wave would leave most SMs idle at the end), at least ~2 packs per thread.
inline int nchw_splits(int64_t C, int64_t packs_per_channel, int device, int per_sm) {
  const int64_t wave = int64_t(sm_count(device)) * per_sm;
  int64_t s = wave / C;
  const int64_t by_work = (packs_per_channel + 2 * kThreads - 1) / (2 * kThreads);
  if (s > by_work) s = by_work;
  if (s > kMaxSplits) s = kMaxSplits;
  if (s < 1) s = 1;
  return static_cast<int>(s);
}

struct NhwcGrid {
  dim3 block, grid;
  int splits;
};

inline dim3 nhwc_block(int64_t Cv) {
  int tx = 1;
  while (tx < Cv && tx < 32) tx <<= 1;
  return dim3(tx, kThreads / tx);
}

// Rows per thread (at least) of the NHWC reductions (stats, backward reduce) with elements of
// `elem_bytes` and TY rows per block: each block writes 12 bytes of partials per channel, so a
// block covers at least 96 / elem_bytes rows (partials <= 1/8 of the bytes it reads; at 2 rows
// per thread, (64,256,14,14) float16 wrote partials of 37% of its input), and every thread at
// least 2. CUDADOCTOR_OPS_BN_NHWC_ROWS=K fixes K rows per thread instead (read once).
inline int nhwc_reduce_rows(int elem_bytes, int ty) {
  static const int fixed = [] {
    const char* v = std::getenv("CUDADOCTOR_OPS_BN_NHWC_ROWS");
    const int r = v ? std::atoi(v) : 0;
    return r >= 1 && r <= 1024 ? r : 0;
  }();
  if (fixed > 0) return fixed;
  const int per_block = (96 + elem_bytes - 1) / elem_bytes;
  const int rows = (per_block + ty - 1) / ty;
  return rows > 2 ? rows : 2;
}

inline NhwcGrid nhwc_grid(int64_t Cv, int64_t R, int device, int per_sm, int rows_per_thread = 2) {
  const dim3 block = nhwc_block(Cv);
  const int64_t gx = (Cv + block.x - 1) / block.x;
  const int64_t wave = int64_t(sm_count(device)) * per_sm;
  int64_t s = wave / gx;
  const int64_t rows = int64_t(rows_per_thread) * block.y;
  const int64_t by_work = (R + rows - 1) / rows;
  if (s > by_work) s = by_work;
  if (s > kMaxSplits) s = kMaxSplits;
  if (s < 1) s = 1;
  NhwcGrid g;
  g.block = block;
  g.grid = dim3(static_cast<unsigned>(gx), static_cast<unsigned>(s));
  g.splits = static_cast<int>(s);
  return g;
}

// Grid of one streaming kernel over layout l with packs of V: NHWC kernels take
// nhwc_smem_per_thread bytes of dynamic shared memory per thread (0 for none).
struct Plan {
  dim3 grid, block;
  size_t smem = 0;
  int splits = 1;
};

// reduce_elem_bytes: the element size of a reduction's input (kernels that write per-block
// partials), 0 for the streaming kernels.
template <typename K>
inline Plan plan_launch(K kernel, bool nhwc, int64_t N, int64_t C, int64_t HW, int V,
                        size_t nhwc_smem_per_thread, int device, int reduce_elem_bytes = 0) {
  Plan p;
  if (nhwc) {
    p.smem = size_t(kThreads) * nhwc_smem_per_thread;
    const int ty = static_cast<int>(nhwc_block(C / V).y);
    NhwcGrid g = nhwc_grid(C / V, N * HW, device, blocks_per_sm(kernel, p.smem),
                           reduce_elem_bytes ? nhwc_reduce_rows(reduce_elem_bytes, ty) : 2);
    p.grid = g.grid;
    p.block = g.block;
    p.splits = g.splits;
  } else {
    p.splits = nchw_splits(C, N * (HW / V), device, blocks_per_sm(kernel, 0));
    p.grid = dim3(static_cast<unsigned>(C), static_cast<unsigned>(p.splits));
    p.block = dim3(kThreads);
  }
  return p;
}

inline bool parse_relu(c10::string_view activation) {
  const std::string a(activation.data(), activation.size());
  TORCH_CHECK(a == "none" || a == "relu",
              "cudadoctor_ops.batch_norm: activation must be \"none\" or \"relu\", got \"", a,
              "\"");
  return a == "relu";
}

// Checks one per-channel tensor (weight, bias, running_mean, ...) against the input.
inline void check_param(const c10::optional<at::Tensor>& t, const char* name,
                        const at::Tensor& input, int64_t C) {
  if (!t.has_value() || !t->defined()) return;
  const at::Tensor& p = *t;
  TORCH_CHECK(p.device() == input.device(), "cudadoctor_ops.batch_norm: ", name, " is on ",
              p.device(), " but input is on ", input.device(),
              "; move both to the same CUDA device");
  if (!(p.dim() == 1 && p.size(0) == C)) {
    std::string got = "[";
    for (int64_t d = 0; d < p.dim(); ++d) got += (d ? ", " : "") + std::to_string(p.size(d));
    got += "]";
    TORCH_CHECK(false, "cudadoctor_ops.batch_norm: ", name, " must have shape [", C,
                "] (one value per channel of input, dim 1), got ", got);
  }
  const bool low = input.scalar_type() == at::kHalf || input.scalar_type() == at::kBFloat16;
  TORCH_CHECK(p.scalar_type() == input.scalar_type() || (low && p.scalar_type() == at::kFloat),
              "cudadoctor_ops.batch_norm: ", name, " has dtype ", p.scalar_type(),
              " but input has dtype ", input.scalar_type(), "; ", name,
              " must have the input's dtype", (low ? " or float32" : ""));
}

inline void check_input(const at::Tensor& input, const char* name) {
  TORCH_CHECK(input.is_cuda(), "cudadoctor_ops.batch_norm: ", name,
              " must be a CUDA tensor, got device ", input.device());
  TORCH_CHECK(input.dim() >= 2, "cudadoctor_ops.batch_norm: ", name,
              " must have at least 2 dims (N, C, ...), got shape ", input.sizes());
  const auto st = input.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kHalf || st == at::kBFloat16 || st == at::kDouble,
              "cudadoctor_ops.batch_norm: ", name,
              " must be float32, float16, bfloat16 or float64, got ", st);
}

inline at::Tensor contig_param(const c10::optional<at::Tensor>& t) {
  if (!t.has_value() || !t->defined()) return at::Tensor();
  return t->contiguous();
}

}  // namespace bn
}  // namespace cudadoctor_ops
