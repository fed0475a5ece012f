// Fused Conv2d -> BatchNorm2d -> ReLU (CBR).
//
// Training forward (conv_bn_relu_train):
//   conv_out = conv(input, weight, conv_bias)            cuDNN through ATen (or the depthwise op)
//   cbr_stats_*      per-channel Welford partials of conv_out, many blocks per channel
//   cbr_finalize_fwd one warp per channel merges the partials: save_mean, save_invstd and the
//                    apply coefficients (mean, gamma * invstd, beta)
//   cbr_apply        ONE elementwise pass: y = relu((x - mean) * a + beta), and a bit-packed
//                    ReLU mask (bit i of the mask = 1 when element i, in memory order, is > 0)
// What backward needs: input and weight (for the convolution gradients), conv_out (x_hat is
// recomputed from it with save_mean / save_invstd), and the mask: 1 bit per element instead of
// the full-size BatchNorm or ReLU output.
//
// Training backward (conv_bn_relu_backward):
//   cbr_reduce_*        per-channel partial sums of g = dy * mask and g * (x - mean)
//   cbr_finalize_bwd    merges them: grad of BN weight / bias, elementwise coefficients
//   cbr_grad_conv_out   ONE elementwise pass: dconv = g * k1 - k2 - (x - mean) * k3
//   then the convolution's input / weight / bias gradients through ATen (or the depthwise ops).
//
// Inference (conv_bias_relu): the BatchNorm is folded into the weights on the Python side; this
// op runs conv + bias + ReLU as one cuDNN call (at::cudnn_convolution_relu) or, where that is not
// available, the convolution followed by one in-place bias + ReLU epilogue kernel.
//
// Layouts: conv_out is read in the layout the convolution produced, NCHW ([N, C, HW]) or NHWC
// ([N*HW, C]); elementwise passes walk memory linearly in groups of 8 elements (one mask byte per
// group). All element offsets are 64-bit.
//
// Two kernel sets for NHWC: v2 (default; see "NHWC kernels, v2") and v1, selected with the
// environment variable CUDADOCTOR_OPS_CBR_V1=1 (read at every call). Both write and read the same
// mask and statistics, so a forward of one may be followed by a backward of the other. NCHW
// takes the v1 kernels where BatchNorm's (bn::batch_norm_relu_mask_train) do not apply.
#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/convolution.h>
#include <ATen/ops/convolution_backward.h>
#include <ATen/ops/cudnn_convolution_relu.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cooperative_groups.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <numeric>
#include <optional>
#include <type_traits>

#include "batch_norm.h"
#include "batch_norm_common.cuh"
#include "conv3x3_hmma.h"
#include "conv3x3_tf32.h"
#include "host_util.h"

namespace cg = cooperative_groups;

namespace cudadoctor_ops {
namespace cbr {
namespace {

using bn::Acc;
using bn::kThreads;
using bn::kUnroll;
using bn::Layout;
using bn::NchwWalk;
using bn::Pack;

constexpr int kGroup = 8;  // elements per mask byte
constexpr int kApplyRound = 8;  // groups per lane whose loads the apply passes issue at once

template <typename T>
struct alignas(16) Group {
  T v[kGroup];
};

template <typename A>
struct Coef4 {
  A v[4];
};

// Where the element at memory offset `off` lives: its channel.
struct ChannelOf {
  int64_t C, HW;
  bool nhwc;
  __device__ __forceinline__ int64_t operator()(int64_t off) const {
    return nhwc ? off % C : (off / HW) % C;
  }
};

// ---------------------------------------------------------------- reductions

template <typename A>
__device__ __forceinline__ void welford_values(const A* vals, int V, A& mean, A& m2, A& n) {
  if (V == 1) {
    n += A(1);
    const A d = vals[0] - mean;
    mean += bn::fast_div(d, n);
    m2 += d * (vals[0] - mean);
    return;
  }
  A s = 0;
  for (int i = 0; i < V; ++i) s += vals[i];
  const A lm = s / A(V);
  A lm2 = 0;
  for (int i = 0; i < V; ++i) {
    const A d = vals[i] - lm;
    lm2 += d * d;
  }
  bn::welford_merge(mean, m2, n, lm, lm2, A(V));
}

// Block-wide Welford merge of a 1-D block; thread 0 gets the result.
template <typename A>
__device__ __forceinline__ void block_welford(A& mean, A& m2, A& n) {
  bn::warp_welford(mean, m2, n);
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
    bn::warp_welford(mean, m2, n);
  }
}

template <typename A>
__device__ __forceinline__ void block_sum2(A& a, A& b) {
  a = bn::warp_sum(a);
  b = bn::warp_sum(b);
  __shared__ A sm[2][kThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    sm[0][warp] = a;
    sm[1][warp] = b;
  }
  __syncthreads();
  if (warp == 0) {
    const int nw = blockDim.x >> 5;
    a = lane < nw ? sm[0][lane] : A(0);
    b = lane < nw ? sm[1][lane] : A(0);
    a = bn::warp_sum(a);
    b = bn::warp_sum(b);
  }
}

// x: [N, C, HW]; grid (C, splits), block kThreads; ws [C, splits, 3] = (mean, M2, count).
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    cbr_stats_nchw(const T* __restrict__ x, typename Acc<T>::type* __restrict__ ws, int64_t N,
                   int64_t C, int64_t HW) {
  using A = typename Acc<T>::type;
  const int64_t c = blockIdx.x;
  const int splits = gridDim.y;
  const int64_t packs = N * (HW / V);
  const int64_t chunk = (packs + splits - 1) / splits;
  const int64_t begin = blockIdx.y * chunk;
  const int64_t end = begin + chunk < packs ? begin + chunk : packs;
  const int64_t stride = blockDim.x;
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
      for (int u = 0; u < kUnroll; ++u) {
        if (j + u * stride < end) {
          A vals[V];
#pragma unroll
          for (int i = 0; i < V; ++i) vals[i] = static_cast<A>(p[u].v[i]);
          welford_values(vals, V, mean, m2, n);
        }
      }
    }
  }
  block_welford(mean, m2, n);
  if (threadIdx.x == 0) {
    A* o = ws + (c * splits + blockIdx.y) * 3;
    o[0] = mean;
    o[1] = m2;
    o[2] = n;
  }
}

// x: [R, C], C contiguous; block (TX, TY), grid (ceil(C/V/TX), splits). A thread owns V
// consecutive channels. Dynamic shared memory: TY * TX * V * 3 accumulators.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    cbr_stats_nhwc(const T* __restrict__ x, typename Acc<T>::type* __restrict__ ws, int64_t R,
                   int64_t C) {
  using A = typename Acc<T>::type;
  extern __shared__ unsigned char smem_raw[];
  A* sm = reinterpret_cast<A*>(smem_raw);
  const int64_t Cv = C / V;
  const int64_t cv = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool active = cv < Cv;
  const int splits = gridDim.y;
  A mean[V], m2[V], K[V];  // no shift (K = 0): x - 0 is x
  A n = 0;
#pragma unroll
  for (int i = 0; i < V; ++i) mean[i] = m2[i] = K[i] = 0;
  if (active) {
    const int64_t rstride = int64_t(gridDim.y) * blockDim.y;
    bn::welford_rows_nhwc<A, T, V>(x, int64_t(blockIdx.y) * blockDim.y + threadIdx.y, R, rstride,
                                   C, cv, K, mean, m2, n);
  }
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
        bn::welford_merge(a0, a1, a2, slot(threadIdx.y + s, i, 0), slot(threadIdx.y + s, i, 1),
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

// One warp per channel: merges the partials, writes save_mean, save_invstd and
// coef[c] = (mean, gamma * invstd, beta, 0).
template <typename A>
__global__ void cbr_finalize_fwd(const A* __restrict__ ws, int splits, int64_t C, double eps,
                                 const void* weight, int wkind, const void* bias, int bkind,
                                 A* __restrict__ save_mean, A* __restrict__ save_invstd,
                                 Coef4<A>* __restrict__ coef) {
  const int lane = threadIdx.x & 31;
  const int64_t c = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (c >= C) return;
  A mean = 0, m2 = 0, n = 0;
  for (int s = lane; s < splits; s += 32) {
    const A* p = ws + (c * splits + s) * 3;
    bn::welford_merge(mean, m2, n, p[0], p[1], p[2]);
  }
  bn::warp_welford(mean, m2, n);
  if (lane != 0) return;
  const A var = n > A(0) ? m2 / n : A(0);
  const A invstd = bn::inv_sqrt(var + static_cast<A>(eps));
  const A w = bn::load_param<A>(weight, wkind, c, A(1));
  const A b = bn::load_param<A>(bias, bkind, c, A(0));
  save_mean[c] = mean;
  save_invstd[c] = invstd;
  Coef4<A> k;
  k.v[0] = mean;
  k.v[1] = w * invstd;
  k.v[2] = b;
  k.v[3] = 0;
  coef[c] = k;
}

// ---------------------------------------------------------------- elementwise passes

template <typename T, typename A>
__device__ __forceinline__ T bn_relu(T xv, const Coef4<A>& k, unsigned& bit) {
  const A y = (static_cast<A>(xv) - k.v[0]) * k.v[1] + k.v[2];
  const T yt = static_cast<T>(y);
  const A yr = static_cast<A>(yt);
  bit = yr > A(0) ? 1u : 0u;
  return yr < A(0) ? T(0) : yt;  // NaN passes through like torch.relu
}

// relu(bn(x) + r) with the roundings of Conv2d -> BatchNorm2d -> (+= residual) -> ReLU in T: the
// BatchNorm output rounded to T, then the sum (computed in A) rounded to T. bit: the output > 0.
template <typename T, typename A>
__device__ __forceinline__ T bn_add_relu(T xv, T rv, const Coef4<A>& k, unsigned& bit) {
  const T yt = static_cast<T>((static_cast<A>(xv) - k.v[0]) * k.v[1] + k.v[2]);
  const T st = static_cast<T>(static_cast<A>(yt) + static_cast<A>(rv));
  const A sr = static_cast<A>(st);
  bit = sr > A(0) ? 1u : 0u;
  return sr < A(0) ? T(0) : st;
}

// Memory-linear pass over groups of 8 elements; one mask byte per group.
// FAST: the channel row (HW in NCHW, C in NHWC) is a multiple of 8 and the pointers are
// 16-byte aligned, so a group is one vector load and (NCHW) one channel.
// RES: res (x's layout) is added after the BatchNorm, before the ReLU (bn_add_relu).
template <typename T, bool FAST, bool RES = false>
__global__ void __launch_bounds__(kThreads)
    cbr_apply(const T* __restrict__ x, T* __restrict__ y, uint8_t* __restrict__ mask,
              const Coef4<typename Acc<T>::type>* __restrict__ coef, int64_t numel, ChannelOf ch,
              const T* __restrict__ res) {
  using A = typename Acc<T>::type;
  const int64_t groups = (numel + kGroup - 1) / kGroup;
  auto value = [&](T xv, const T* rp, int i, const Coef4<A>& k, unsigned& bit) -> T {
    if constexpr (RES) {
      return bn_add_relu<T, A>(xv, rp[i], k, bit);
    } else {
      return bn_relu<T, A>(xv, k, bit);
    }
  };
  for (int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += int64_t(gridDim.x) * blockDim.x) {
    const int64_t base = g * kGroup;
    unsigned byte = 0;
    if (FAST) {
      const Group<T> in = *reinterpret_cast<const Group<T>*>(x + base);
      Group<T> rg;
      if constexpr (RES) rg = *reinterpret_cast<const Group<T>*>(res + base);
      Group<T> out;
      if (ch.nhwc) {
        const int64_t c0 = base % ch.C;
#pragma unroll
        for (int i = 0; i < kGroup; ++i) {
          unsigned bit;
          out.v[i] = value(in.v[i], rg.v, i, coef[c0 + i], bit);
          byte |= bit << i;
        }
      } else {
        const Coef4<A> k = coef[(base / ch.HW) % ch.C];
#pragma unroll
        for (int i = 0; i < kGroup; ++i) {
          unsigned bit;
          out.v[i] = value(in.v[i], rg.v, i, k, bit);
          byte |= bit << i;
        }
      }
      *reinterpret_cast<Group<T>*>(y + base) = out;
    } else {
      const T* rp = nullptr;
      if constexpr (RES) rp = res + base;
      for (int i = 0; i < kGroup; ++i) {
        const int64_t off = base + i;
        if (off >= numel) break;
        unsigned bit;
        y[off] = value(x[off], rp, i, coef[ch(off)], bit);
        byte |= bit << i;
      }
    }
    mask[g] = static_cast<uint8_t>(byte);
  }
}

// Gradient of relu(z) from its bit mask, in memory order: out[i] = mask bit i ? g[i] : 0 (the
// residual's gradient of Conv+BN+Add+ReLU). FAST: g and out 16-byte aligned.
template <typename T, bool FAST>
__global__ void __launch_bounds__(kThreads)
    cbr_mask_grad(const T* __restrict__ g, const uint8_t* __restrict__ mask, T* __restrict__ out,
                  int64_t numel) {
  const int64_t groups = (numel + kGroup - 1) / kGroup;
  for (int64_t q = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; q < groups;
       q += int64_t(gridDim.x) * blockDim.x) {
    const int64_t base = q * kGroup;
    const unsigned bits = mask[q];
    if (FAST && base + kGroup <= numel) {
      const Group<T> in = *reinterpret_cast<const Group<T>*>(g + base);
      Group<T> o;
#pragma unroll
      for (int i = 0; i < kGroup; ++i) o.v[i] = ((bits >> i) & 1u) ? in.v[i] : T(0);
      *reinterpret_cast<Group<T>*>(out + base) = o;
    } else {
      for (int i = 0; i < kGroup && base + i < numel; ++i)
        out[base + i] = ((bits >> i) & 1u) ? g[base + i] : T(0);
    }
  }
}

// ---------------------------------------------------------------- backward reductions

template <int V>
__device__ __forceinline__ unsigned mask_bits(const uint8_t* __restrict__ mask, int64_t off) {
  // V divides 8 and off is a multiple of V: the V bits sit in one byte.
  return (static_cast<unsigned>(mask[off >> 3]) >> (off & 7)) & ((1u << V) - 1u);
}

// x, dy: [N, C, HW]; grid (C, splits); ws [C, splits, 2] = (sum g, sum g * (x - mean)).
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    cbr_reduce_nchw(const T* __restrict__ x, const T* __restrict__ dy,
                    const uint8_t* __restrict__ mask,
                    const typename Acc<T>::type* __restrict__ save_mean,
                    typename Acc<T>::type* __restrict__ ws, int64_t N, int64_t C, int64_t HW) {
  using A = typename Acc<T>::type;
  const int64_t c = blockIdx.x;
  const int splits = gridDim.y;
  const int64_t packs = N * (HW / V);
  const int64_t chunk = (packs + splits - 1) / splits;
  const int64_t begin = blockIdx.y * chunk;
  const int64_t end = begin + chunk < packs ? begin + chunk : packs;
  const int64_t stride = blockDim.x;
  const A mean = save_mean[c];
  A sg = 0, sgx = 0;
  int64_t j = begin + threadIdx.x;
  if (j < end) {
    NchwWalk w(j, stride, c, C, HW, V);
    for (; j < end; j += kUnroll * stride) {
      Pack<T, V> px[kUnroll], pd[kUnroll];
      unsigned bits[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (j + u * stride < end) {
          px[u] = *reinterpret_cast<const Pack<T, V>*>(x + w.off);
          pd[u] = *reinterpret_cast<const Pack<T, V>*>(dy + w.off);
          bits[u] = mask_bits<V>(mask, w.off);
        }
        w.advance();
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (j + u * stride < end) {
#pragma unroll
          for (int i = 0; i < V; ++i) {
            const A g = ((bits[u] >> i) & 1u) ? static_cast<A>(pd[u].v[i]) : A(0);
            sg += g;
            sgx += g * (static_cast<A>(px[u].v[i]) - mean);
          }
        }
      }
    }
  }
  block_sum2(sg, sgx);
  if (threadIdx.x == 0) {
    A* o = ws + (c * splits + blockIdx.y) * 2;
    o[0] = sg;
    o[1] = sgx;
  }
}

// x, dy: [R, C]; block (TX, TY), grid (ceil(C/V/TX), splits); smem TY * TX * V * 2.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    cbr_reduce_nhwc(const T* __restrict__ x, const T* __restrict__ dy,
                    const uint8_t* __restrict__ mask,
                    const typename Acc<T>::type* __restrict__ save_mean,
                    typename Acc<T>::type* __restrict__ ws, int64_t R, int64_t C) {
  using A = typename Acc<T>::type;
  extern __shared__ unsigned char smem_raw[];
  A* sm = reinterpret_cast<A*>(smem_raw);
  const int64_t Cv = C / V;
  const int64_t cv = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool active = cv < Cv;
  const int splits = gridDim.y;
  A sg[V], sgx[V], mean[V];
#pragma unroll
  for (int i = 0; i < V; ++i) {
    sg[i] = sgx[i] = 0;
    mean[i] = active ? save_mean[cv * V + i] : A(0);
  }
  if (active) {
    const int64_t rstride = int64_t(gridDim.y) * blockDim.y;
    for (int64_t r = int64_t(blockIdx.y) * blockDim.y + threadIdx.y; r < R;
         r += kUnroll * rstride) {
      Pack<T, V> px[kUnroll], pd[kUnroll];
      unsigned bits[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (r + u * rstride < R) {
          const int64_t off = (r + u * rstride) * C + cv * V;
          px[u] = *reinterpret_cast<const Pack<T, V>*>(x + off);
          pd[u] = *reinterpret_cast<const Pack<T, V>*>(dy + off);
          bits[u] = mask_bits<V>(mask, off);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (r + u * rstride < R) {
#pragma unroll
          for (int i = 0; i < V; ++i) {
            const A g = ((bits[u] >> i) & 1u) ? static_cast<A>(pd[u].v[i]) : A(0);
            sg[i] += g;
            sgx[i] += g * (static_cast<A>(px[u].v[i]) - mean[i]);
          }
        }
      }
    }
  }
  const int tx = threadIdx.x, TX = blockDim.x;
  auto slot = [&](int ty, int i, int k) -> A& { return sm[((ty * TX + tx) * V + i) * 2 + k]; };
#pragma unroll
  for (int i = 0; i < V; ++i) {
    slot(threadIdx.y, i, 0) = sg[i];
    slot(threadIdx.y, i, 1) = sgx[i];
  }
  __syncthreads();
  for (int s = blockDim.y >> 1; s > 0; s >>= 1) {
    if (threadIdx.y < s) {
#pragma unroll
      for (int i = 0; i < V; ++i) {
        slot(threadIdx.y, i, 0) += slot(threadIdx.y + s, i, 0);
        slot(threadIdx.y, i, 1) += slot(threadIdx.y + s, i, 1);
      }
    }
    __syncthreads();
  }
  if (threadIdx.y == 0 && active) {
#pragma unroll
    for (int i = 0; i < V; ++i) {
      A* o = ws + ((cv * V + i) * splits + blockIdx.y) * 2;
      o[0] = slot(0, i, 0);
      o[1] = slot(0, i, 1);
    }
  }
}

// One warp per channel. grad_weight = sum(g * x_hat), grad_bias = sum(g);
// coef[c] = (mean, k1, k2, k3) for dconv = g * k1 - k2 - (x - mean) * k3.
template <typename A>
__global__ void cbr_finalize_bwd(const A* __restrict__ ws, int splits, int64_t C, int64_t count,
                                 const A* __restrict__ save_mean,
                                 const A* __restrict__ save_invstd, const void* weight, int wkind,
                                 void* grad_weight, void* grad_bias, int gkind,
                                 Coef4<A>* __restrict__ coef) {
  const int lane = threadIdx.x & 31;
  const int64_t c = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (c >= C) return;
  A sg = 0, sgx = 0;
  for (int s = lane; s < splits; s += 32) {
    sg += ws[(c * splits + s) * 2 + 0];
    sgx += ws[(c * splits + s) * 2 + 1];
  }
  sg = bn::warp_sum(sg);
  sgx = bn::warp_sum(sgx);
  if (lane != 0) return;
  const A invstd = save_invstd[c];
  const A w = bn::load_param<A>(weight, wkind, c, A(1));
  const A k1 = w * invstd;
  const A inv_m = A(1) / static_cast<A>(count);
  if (grad_weight != nullptr) bn::store_param<A>(grad_weight, gkind, c, sgx * invstd);
  if (grad_bias != nullptr) bn::store_param<A>(grad_bias, gkind, c, sg);
  Coef4<A> k;
  k.v[0] = save_mean[c];
  k.v[1] = k1;
  k.v[2] = k1 * sg * inv_m;
  k.v[3] = k1 * invstd * invstd * sgx * inv_m;
  coef[c] = k;
}

template <typename T, typename A>
__device__ __forceinline__ T dconv_value(T xv, T dyv, unsigned bit, const Coef4<A>& k) {
  const A g = bit ? static_cast<A>(dyv) : A(0);
  return static_cast<T>(g * k.v[1] - k.v[2] - (static_cast<A>(xv) - k.v[0]) * k.v[3]);
}

template <typename T, bool FAST>
__global__ void __launch_bounds__(kThreads)
    cbr_grad_conv_out(const T* __restrict__ x, const T* __restrict__ dy,
                      const uint8_t* __restrict__ mask, T* __restrict__ dx,
                      const Coef4<typename Acc<T>::type>* __restrict__ coef, int64_t numel,
                      ChannelOf ch) {
  using A = typename Acc<T>::type;
  const int64_t groups = (numel + kGroup - 1) / kGroup;
  for (int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += int64_t(gridDim.x) * blockDim.x) {
    const int64_t base = g * kGroup;
    const unsigned byte = mask[g];
    if (FAST) {
      const Group<T> xin = *reinterpret_cast<const Group<T>*>(x + base);
      const Group<T> din = *reinterpret_cast<const Group<T>*>(dy + base);
      Group<T> out;
      if (ch.nhwc) {
        const int64_t c0 = base % ch.C;
#pragma unroll
        for (int i = 0; i < kGroup; ++i)
          out.v[i] = dconv_value<T, A>(xin.v[i], din.v[i], (byte >> i) & 1u, coef[c0 + i]);
      } else {
        const Coef4<A> k = coef[(base / ch.HW) % ch.C];
#pragma unroll
        for (int i = 0; i < kGroup; ++i)
          out.v[i] = dconv_value<T, A>(xin.v[i], din.v[i], (byte >> i) & 1u, k);
      }
      *reinterpret_cast<Group<T>*>(dx + base) = out;
    } else {
      for (int i = 0; i < kGroup; ++i) {
        const int64_t off = base + i;
        if (off >= numel) break;
        dx[off] = dconv_value<T, A>(x[off], dy[off], (byte >> i) & 1u, coef[ch(off)]);
      }
    }
  }
}

// In-place y = relu(y + bias[c]) (inference epilogue).
template <typename T, bool FAST>
__global__ void __launch_bounds__(kThreads)
    cbr_bias_relu(T* __restrict__ y, const typename Acc<T>::type* __restrict__ bias,
                  int64_t numel, ChannelOf ch) {
  using A = typename Acc<T>::type;
  const int64_t groups = (numel + kGroup - 1) / kGroup;
  for (int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += int64_t(gridDim.x) * blockDim.x) {
    const int64_t base = g * kGroup;
    if (FAST) {
      Group<T> v = *reinterpret_cast<const Group<T>*>(y + base);
      const int64_t c0 = ch.nhwc ? base % ch.C : (base / ch.HW) % ch.C;
#pragma unroll
      for (int i = 0; i < kGroup; ++i) {
        const A b = bias ? bias[ch.nhwc ? c0 + i : c0] : A(0);
        const A r = static_cast<A>(v.v[i]) + b;
        v.v[i] = static_cast<T>(r < A(0) ? A(0) : r);
      }
      *reinterpret_cast<Group<T>*>(y + base) = v;
    } else {
      for (int i = 0; i < kGroup; ++i) {
        const int64_t off = base + i;
        if (off >= numel) break;
        const A r = static_cast<A>(y[off]) + (bias ? bias[ch(off)] : A(0));
        y[off] = static_cast<T>(r < A(0) ? A(0) : r);
      }
    }
  }
}

// ---------------------------------------------------------------- NHWC kernels, v2
//
// The default for NHWC tensors (CUDADOCTOR_OPS_CBR_V1=1 selects the kernels above).
// The tensor is walked in groups of 8 consecutive elements in memory order: group g holds elements
// 8g .. 8g+7 and owns mask byte g; the nfull = numel / 8 full groups go through the main loops,
// a partial last group (numel % 8 != 0) through a short scalar path. The channels of group g are
// (8g + i) % C, i < 8; they repeat every Cg = C / gcd(C, 8) groups. Thread gid < S of a
// grid-stride kernel takes groups gid, gid + S, gid + 2S, ... with S a multiple of Cg, so it keeps
// the same 8 channels (and their coefficients, in registers) for all its groups, while consecutive
// threads take consecutive groups (coalesced 16-byte accesses). Group indices are 32-bit (the
// host takes this path only for numel < 2^33 and C < 2^20); element offsets are 64-bit.
// Reductions: every thread accumulates its 8 channels over its full groups; the block merges its
// kThreads * 8 (thread, element) positions channel by channel in shared memory, in a fixed
// order, into one row of partials per block ([P][C] planes); the finalize kernels merge the P
// rows, 32 channels per block, then fold in the elements of the partial group. No atomics:
// results do not depend on scheduling.

constexpr int kPos = kThreads * kGroup;  // (thread, element) positions of one block

// full group g
template <typename T, bool VEC>
__device__ __forceinline__ void load_full(const T* __restrict__ p, int g, Group<T>& out) {
  const T* q = p + int64_t(g) * kGroup;
  if (VEC) {
    out = *reinterpret_cast<const Group<T>*>(q);
  } else {
#pragma unroll
    for (int i = 0; i < kGroup; ++i) out.v[i] = q[i];
  }
}

template <typename T, bool VEC>
__device__ __forceinline__ void store_full(T* __restrict__ p, int g, const Group<T>& v) {
  T* q = p + int64_t(g) * kGroup;
  if (VEC) {
    *reinterpret_cast<Group<T>*>(q) = v;
  } else {
#pragma unroll
    for (int i = 0; i < kGroup; ++i) q[i] = v.v[i];
  }
}

// channel of element i of group gid (of the groups of thread gid: gid, gid + S, ...; 64-bit, as
// cbr_apply_sums_nhwc_v4's gid goes up to nfull)
__device__ __forceinline__ int group_channel(int gid, int i, int C) {
  return static_cast<int>((int64_t(gid) * kGroup % C + i) % C);
}

template <typename T, typename A>
__device__ __forceinline__ T bn_relu3(T xv, A mean, A a, A beta, unsigned& bit) {
  const A y = (static_cast<A>(xv) - mean) * a + beta;  // the arithmetic of bn_relu
  const T yt = static_cast<T>(y);
  const A yr = static_cast<A>(yt);
  bit = yr > A(0) ? 1u : 0u;
  return yr < A(0) ? T(0) : yt;  // NaN passes through like torch.relu
}

// Per-channel merge of the block's positions: position e (= thread * 8 + element) holds a value
// of channel (base + e) % C with base = (blockIdx.x * kPos) % C. Q = kThreads / C threads per
// channel when C <= kThreads (each merges every Q-th position of its channel, then one thread
// merges the Q results), else one thread per channel. Writes row blockIdx.x of the [P][C]
// planes. Welford version: s_mean / s_m2 per position, s_n per thread.
template <typename A>
__device__ __forceinline__ void block_merge_welford(const A* s_mean, const A* s_m2, const A* s_n,
                                                    A* p_mean, A* p_m2, A* p_n, A* __restrict__ ws,
                                                    int C) {
  const int t = threadIdx.x;
  const int base = static_cast<int>((int64_t(blockIdx.x) * kPos) % C);
  const int Q = C <= kThreads ? kThreads / C : 1;
  const int64_t plane = int64_t(gridDim.x) * C;
  const int64_t row = int64_t(blockIdx.x) * C;
  for (int idx = t; idx < C * Q; idx += kThreads) {
    const int c = idx % C, q = idx / C;
    int e = c - base;
    if (e < 0) e += C;
    A m = 0, m2 = 0, n = 0;
    for (e += q * C; e < kPos; e += Q * C)
      bn::welford_merge(m, m2, n, s_mean[e], s_m2[e], s_n[e / kGroup]);
    if (Q == 1) {
      ws[row + c] = m;
      ws[plane + row + c] = m2;
      ws[2 * plane + row + c] = n;
    } else {
      p_mean[idx] = m;
      p_m2[idx] = m2;
      p_n[idx] = n;
    }
  }
  if (Q > 1) {  // block-uniform
    __syncthreads();
    if (t < C) {
      A m = 0, m2 = 0, n = 0;
      for (int q = 0; q < Q; ++q)
        bn::welford_merge(m, m2, n, p_mean[q * C + t], p_m2[q * C + t], p_n[q * C + t]);
      ws[row + t] = m;
      ws[plane + row + t] = m2;
      ws[2 * plane + row + t] = n;
    }
  }
}

// The same for plain sums (two values per position).
template <typename A>
__device__ __forceinline__ void block_merge_sums(const A* s_a, const A* s_b, A* p_a, A* p_b,
                                                 A* __restrict__ ws, int C) {
  const int t = threadIdx.x;
  const int base = static_cast<int>((int64_t(blockIdx.x) * kPos) % C);
  const int Q = C <= kThreads ? kThreads / C : 1;
  const int64_t plane = int64_t(gridDim.x) * C;
  const int64_t row = int64_t(blockIdx.x) * C;
  for (int idx = t; idx < C * Q; idx += kThreads) {
    const int c = idx % C, q = idx / C;
    int e = c - base;
    if (e < 0) e += C;
    A a = 0, b = 0;
    for (e += q * C; e < kPos; e += Q * C) {
      a += s_a[e];
      b += s_b[e];
    }
    if (Q == 1) {
      ws[row + c] = a;
      ws[plane + row + c] = b;
    } else {
      p_a[idx] = a;
      p_b[idx] = b;
    }
  }
  if (Q > 1) {  // block-uniform
    __syncthreads();
    if (t < C) {
      A a = 0, b = 0;
      for (int q = 0; q < Q; ++q) {
        a += p_a[q * C + t];
        b += p_b[q * C + t];
      }
      ws[row + t] = a;
      ws[plane + row + t] = b;
    }
  }
}

// Statistics of the full groups. Per thread and channel: sums of (x - K) and (x - K)^2 with K the
// thread's first value of that channel (a shift from the data itself keeps the cancellation
// small), turned into (mean, M2, n) and merged (Chan) per block. ws: [3][P][C] = mean, M2, n.
template <typename T, bool VEC>
__global__ void __launch_bounds__(kThreads)
    cbr_stats_nhwc_v2(const T* __restrict__ x, typename Acc<T>::type* __restrict__ ws, int nfull,
                      int S, int C) {
  using A = typename Acc<T>::type;
  __shared__ __align__(16) A s_mean[kPos];
  __shared__ __align__(16) A s_m2[kPos];
  __shared__ A s_n[kThreads];
  __shared__ A p_mean[kThreads], p_m2[kThreads], p_n[kThreads];
  const int t = threadIdx.x;
  const int gid = blockIdx.x * kThreads + t;
  A K[kGroup], s1[kGroup], s2[kGroup];
  A n = 0;
#pragma unroll
  for (int i = 0; i < kGroup; ++i) K[i] = s1[i] = s2[i] = 0;
  if (gid < S && gid < nfull) {
    Group<T> first;
    load_full<T, VEC>(x, gid, first);
#pragma unroll
    for (int i = 0; i < kGroup; ++i) K[i] = static_cast<A>(first.v[i]);
    n = 1;
    auto add = [&](const Group<T>& v) {
#pragma unroll
      for (int i = 0; i < kGroup; ++i) {
        const A d = static_cast<A>(v.v[i]) - K[i];
        s1[i] += d;
        s2[i] += d * d;
      }
    };
    int g = gid + S;
    for (; g + (kUnroll - 1) * S < nfull; g += kUnroll * S) {  // kUnroll groups in flight
      Group<T> in[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) load_full<T, VEC>(x, g + u * S, in[u]);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) add(in[u]);
      n += A(kUnroll);
    }
    for (; g < nfull; g += S) {
      Group<T> in;
      load_full<T, VEC>(x, g, in);
      add(in);
      n += A(1);
    }
  }
#pragma unroll
  for (int i = 0; i < kGroup; ++i) {
    A mean = 0, m2 = 0;
    if (n > A(0)) {
      const A q = s1[i] / n;
      mean = K[i] + q;
      m2 = s2[i] - s1[i] * q;
      if (m2 < A(0)) m2 = 0;
    }
    s_mean[t * kGroup + i] = mean;
    s_m2[t * kGroup + i] = m2;
  }
  s_n[t] = n;
  __syncthreads();
  block_merge_welford(s_mean, s_m2, s_n, p_mean, p_m2, p_n, ws, C);
}

// Block (1024): 32 channels per block, 32 threads per channel walk the P rows of partials (8 rows
// in flight each, 4 in float64), then warp w merges channel w of the block (rows transposed
// through shared memory). Lane 0 adds the elements of the partial group and writes save_mean,
// save_invstd and coef[c] = (mean, gamma * invstd, beta, 0), as cbr_finalize_fwd.
constexpr int kFinThreads = 1024;
template <typename A>
constexpr int fin_batch() {
  return sizeof(A) == 8 ? 4 : 8;  // rows in flight per thread (1024 threads: 64 registers)
}

template <typename T>
__global__ void __launch_bounds__(kFinThreads)
    cbr_finalize_fwd_v2(const typename Acc<T>::type* __restrict__ ws, int P, int C,
                        const T* __restrict__ x, int64_t nfull, int64_t numel, double eps,
                        const void* weight, int wkind, const void* bias, int bkind,
                        typename Acc<T>::type* __restrict__ save_mean,
                        typename Acc<T>::type* __restrict__ save_invstd,
                        Coef4<typename Acc<T>::type>* __restrict__ coef) {
  using A = typename Acc<T>::type;
  constexpr int kFinBatch = fin_batch<A>();
  __shared__ A sm[3][32][33];
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  const int c = blockIdx.x * 32 + tx;
  A m = 0, m2 = 0, n = 0;
  if (c < C) {
    const int64_t plane = int64_t(P) * C;
    for (int p0 = ty; p0 < P; p0 += 32 * kFinBatch) {
      A lm[kFinBatch], lm2[kFinBatch], ln[kFinBatch];
#pragma unroll
      for (int k = 0; k < kFinBatch; ++k) {
        const int p = p0 + 32 * k;
        if (p < P) {
          const int64_t o = int64_t(p) * C + c;
          lm[k] = ws[o];
          lm2[k] = ws[plane + o];
          ln[k] = ws[2 * plane + o];
        } else {
          lm[k] = lm2[k] = ln[k] = A(0);
        }
      }
#pragma unroll
      for (int k = 0; k < kFinBatch; ++k) bn::welford_merge(m, m2, n, lm[k], lm2[k], ln[k]);
    }
  }
  sm[0][ty][tx] = m;
  sm[1][ty][tx] = m2;
  sm[2][ty][tx] = n;
  __syncthreads();
  m = sm[0][tx][ty];
  m2 = sm[1][tx][ty];
  n = sm[2][tx][ty];
  bn::warp_welford(m, m2, n);
  const int cw = blockIdx.x * 32 + ty;
  if (tx != 0 || cw >= C) return;
  for (int64_t e = nfull * kGroup; e < numel; ++e)
    if (e % C == cw) bn::welford_merge(m, m2, n, static_cast<A>(x[e]), A(0), A(1));
  const A var = n > A(0) ? m2 / n : A(0);
  const A invstd = bn::inv_sqrt(var + static_cast<A>(eps));
  const A w = bn::load_param<A>(weight, wkind, cw, A(1));
  const A b = bn::load_param<A>(bias, bkind, cw, A(0));
  save_mean[cw] = m;
  save_invstd[cw] = invstd;
  Coef4<A> k;
  k.v[0] = m;
  k.v[1] = w * invstd;
  k.v[2] = b;
  k.v[3] = 0;
  coef[cw] = k;
}

// apply_groups_nhwc's default pre().
struct NoPre {
  __device__ void operator()() const {}
};

// y = relu((x - mean) * a + beta) over the full groups, and mask byte g of group g. Lanes
// 4j .. 4j+3 of a warp take 4 consecutive groups (the warp's first group is a multiple of 32), so
// lane 4j gathers their bytes with two shuffles and writes one 32-bit mask word (single bytes at
// the end of the full groups, or when the mask is not 4-byte aligned). S is a multiple of 32:
// warps are wholly in or out, and the loop conditions around the shuffles are warp-uniform.
// Thread 0 then does the partial group (numel % 8 elements, tail > 0) with its own coefficients.
// The body of cbr_apply_nhwc_v2 for thread gid < S, the coefficients of channel c from
// coef_of(c) (a Coef4; c an int, or an int64_t for the partial group).
// RES: res (x's layout) added after the BatchNorm, before the ReLU (bn_add_relu's roundings).
// RND > 0 (kApplyRound by default; CUDADOCTOR_OPS_CBR_APPLY_ROUNDS=0 selects RND = 0, the loops
// before it): the lane's groups in rounds of RND (RND / 2 with RES) whose loads are all issued
// before any of them is used, the last round predicated per group rather than one group at a
// time, and the first round's loads issued before the coefficients are computed, so their
// latencies overlap. RND = 0: unpredicated rounds of kUnroll, then the rest one group per lane at
// a time, the coefficients first. CHUNK (with RND > 0): one round only, the block's chunk of
// RND * kThreads groups (gid = chunk start + threadIdx.x, S = kThreads; cbr_apply_sums_nhwc_v4).
// pre(): called by every thread after the first round's loads are issued, before coef_of is
// first called (cbr_apply_sums_nhwc_v5 fills its shared-memory coefficients there; NoPre: nothing).
template <typename T, bool VEC, typename CoefOf, bool RES = false, int RND = kApplyRound,
          bool CHUNK = false, typename Pre = NoPre>
__device__ __forceinline__ void apply_groups_nhwc(const T* __restrict__ x, T* __restrict__ y,
                                                  uint8_t* __restrict__ mask, CoefOf&& coef_of,
                                                  int gid, int nfull, int tail, int S, int C,
                                                  bool mask_words,
                                                  const T* __restrict__ res = nullptr,
                                                  Pre&& pre = Pre{}) {
  using A = typename Acc<T>::type;
  const int lane = threadIdx.x & 31;
  constexpr bool ROUNDS = RND > 0;
  constexpr int kR = !ROUNDS ? 1 : (RES && RND > 1 ? RND / 2 : RND);
  int w0 = gid - lane;  // warp-uniform
  Group<T> rin[kR], rres[kR];
  // the lane's groups of the round at warp offset w (zeros past nfull)
  auto load_round = [&](int w) {
#pragma unroll
    for (int u = 0; u < kR; ++u) {
      const int g = w + u * S + lane;
      if (g < nfull) {
        load_full<T, VEC>(x, g, rin[u]);
        if constexpr (RES) load_full<T, VEC>(res, g, rres[u]);
      } else {
#pragma unroll
        for (int i = 0; i < kGroup; ++i) rin[u].v[i] = rres[u].v[i] = T(0);
      }
    }
  };
  if constexpr (ROUNDS) load_round(w0);
  pre();
  A km[kGroup], ka[kGroup], kb[kGroup];
#pragma unroll
  for (int i = 0; i < kGroup; ++i) {
    const Coef4<A> k = coef_of(group_channel(gid, i, C));
    km[i] = k.v[0];
    ka[i] = k.v[1];
    kb[i] = k.v[2];
  }
  // group g (< nfull when `valid`): output, and the mask byte of the lane; rg: the residual
  // group (RES)
  auto one = [&](const Group<T>& in, const Group<T>& rg, int g, bool valid) -> unsigned {
    unsigned byte = 0;
    Group<T> out;
#pragma unroll
    for (int i = 0; i < kGroup; ++i) {
      unsigned bit;
      if constexpr (RES) {
        Coef4<A> k;
        k.v[0] = km[i];
        k.v[1] = ka[i];
        k.v[2] = kb[i];
        out.v[i] = bn_add_relu<T, A>(in.v[i], rg.v[i], k, bit);
      } else {
        out.v[i] = bn_relu3<T, A>(in.v[i], km[i], ka[i], kb[i], bit);
      }
      byte |= bit << i;
    }
    if (valid) store_full<T, VEC>(y, g, out);
    return valid ? byte : 0u;
  };
  // lane 4j: the 32-bit word of the bytes of lanes 4j .. 4j+3 (all lanes call this)
  auto word_of = [&](unsigned byte) -> unsigned {
    unsigned word = byte | (__shfl_down_sync(0xffffffffu, byte, 1) << 8);
    return word | (__shfl_down_sync(0xffffffffu, word, 2) << 16);
  };
  if constexpr (ROUNDS) {
    while (w0 < nfull) {
#pragma unroll
      for (int u = 0; u < kR; ++u) {
        const int wu = w0 + u * S;  // warp-uniform: the shuffles see whole warps
        if (wu >= nfull) break;
        const int g = wu + lane;
        const bool valid = g < nfull;
        const unsigned word = word_of(one(rin[u], rres[u], g, valid));
        if ((lane & 3) == 0 && valid) {
          if (mask_words && g + 3 < nfull) {
            *reinterpret_cast<uint32_t*>(mask + g) = word;
          } else {
            for (int k = 0; k < 4; ++k)
              if (g + k < nfull) mask[g + k] = static_cast<uint8_t>(word >> (8 * k));
          }
        }
      }
      if (CHUNK) {
        w0 = nfull;
        break;
      }
      w0 += kR * S;
      if (w0 < nfull) load_round(w0);
    }
  }
  // full rounds: every lane has all its kUnroll groups
  for (; !ROUNDS && w0 + (kUnroll - 1) * S + 32 <= nfull; w0 += kUnroll * S) {
    Group<T> in[kUnroll], rg[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      load_full<T, VEC>(x, w0 + u * S + lane, in[u]);
      if constexpr (RES) load_full<T, VEC>(res, w0 + u * S + lane, rg[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int g = w0 + u * S + lane;
      const unsigned word = word_of(one(in[u], rg[u], g, true));
      if ((lane & 3) == 0) {
        if (mask_words) {
          *reinterpret_cast<uint32_t*>(mask + g) = word;
        } else {
#pragma unroll
          for (int k = 0; k < 4; ++k) mask[g + k] = static_cast<uint8_t>(word >> (8 * k));
        }
      }
    }
  }
  // the rest, one group per lane at a time (w0 is warp-uniform; with ROUNDS w0 >= nfull here)
  for (; w0 < nfull; w0 += S) {
    const int g = w0 + lane;
    const bool valid = g < nfull;
    Group<T> in, rg;
    if (valid) {
      load_full<T, VEC>(x, g, in);
      if constexpr (RES) load_full<T, VEC>(res, g, rg);
    } else {
#pragma unroll
      for (int i = 0; i < kGroup; ++i) in.v[i] = rg.v[i] = T(0);
    }
    const unsigned word = word_of(one(in, rg, g, valid));
    if ((lane & 3) == 0 && valid) {
      if (mask_words && g + 3 < nfull) {
        *reinterpret_cast<uint32_t*>(mask + g) = word;
      } else {
        for (int k = 0; k < 4; ++k)
          if (g + k < nfull) mask[g + k] = static_cast<uint8_t>(word >> (8 * k));
      }
    }
  }
  if (tail > 0 && gid == 0) {
    const int64_t e0 = int64_t(nfull) * kGroup;
    unsigned byte = 0;
    for (int i = 0; i < tail; ++i) {
      const Coef4<A> k = coef_of((e0 + i) % C);
      unsigned bit;
      if constexpr (RES) {
        y[e0 + i] = bn_add_relu<T, A>(x[e0 + i], res[e0 + i], k, bit);
      } else {
        y[e0 + i] = bn_relu3<T, A>(x[e0 + i], k.v[0], k.v[1], k.v[2], bit);
      }
      byte |= bit << i;
    }
    mask[nfull] = static_cast<uint8_t>(byte);
  }
}

template <typename T, bool VEC, bool RES = false, bool ROUNDS = true>
__global__ void __launch_bounds__(kThreads)
    cbr_apply_nhwc_v2(const T* __restrict__ x, T* __restrict__ y, uint8_t* __restrict__ mask,
                      const Coef4<typename Acc<T>::type>* __restrict__ coef, int nfull, int tail,
                      int S, int C, bool mask_words, const T* __restrict__ res) {
  const int gid = blockIdx.x * kThreads + threadIdx.x;
  if (gid >= S) return;
  auto coef_of = [&](auto c) { return coef[c]; };
  apply_groups_nhwc<T, VEC, decltype(coef_of)&, RES, ROUNDS ? kApplyRound : 0>(
      x, y, mask, coef_of, gid, nfull, tail, S, C, mask_words, res);
}

// Backward sums of the full groups: sum g and sum g * (x - mean) with g = dy * mask, per
// channel. ws: [2][P][C].
template <typename T, bool VEC>
__global__ void __launch_bounds__(kThreads)
    cbr_reduce_nhwc_v2(const T* __restrict__ x, const T* __restrict__ dy,
                       const uint8_t* __restrict__ mask,
                       const typename Acc<T>::type* __restrict__ save_mean,
                       typename Acc<T>::type* __restrict__ ws, int nfull, int S, int C) {
  using A = typename Acc<T>::type;
  __shared__ __align__(16) A s_a[kPos];
  __shared__ __align__(16) A s_b[kPos];
  __shared__ A p_a[kThreads], p_b[kThreads];
  const int t = threadIdx.x;
  const int gid = blockIdx.x * kThreads + t;
  A sg[kGroup], sgx[kGroup];
#pragma unroll
  for (int i = 0; i < kGroup; ++i) sg[i] = sgx[i] = 0;
  if (gid < S && gid < nfull) {
    A mean[kGroup];
#pragma unroll
    for (int i = 0; i < kGroup; ++i) mean[i] = save_mean[group_channel(gid, i, C)];
    auto add = [&](const Group<T>& vx, const Group<T>& vd, unsigned bits) {
#pragma unroll
      for (int i = 0; i < kGroup; ++i) {
        const A gv = ((bits >> i) & 1u) ? static_cast<A>(vd.v[i]) : A(0);
        sg[i] += gv;
        sgx[i] += gv * (static_cast<A>(vx.v[i]) - mean[i]);
      }
    };
    int g = gid;
    for (; g + (kUnroll - 1) * S < nfull; g += kUnroll * S) {  // kUnroll groups in flight
      Group<T> px[kUnroll], pd[kUnroll];
      unsigned bits[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        load_full<T, VEC>(x, g + u * S, px[u]);
        load_full<T, VEC>(dy, g + u * S, pd[u]);
        bits[u] = mask[g + u * S];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) add(px[u], pd[u], bits[u]);
    }
    for (; g < nfull; g += S) {
      Group<T> px, pd;
      load_full<T, VEC>(x, g, px);
      load_full<T, VEC>(dy, g, pd);
      add(px, pd, mask[g]);
    }
  }
#pragma unroll
  for (int i = 0; i < kGroup; ++i) {
    s_a[t * kGroup + i] = sg[i];
    s_b[t * kGroup + i] = sgx[i];
  }
  __syncthreads();
  block_merge_sums(s_a, s_b, p_a, p_b, ws, C);
}

// As cbr_finalize_fwd_v2 for the backward sums; lane 0 then computes what cbr_finalize_bwd
// does: grad_weight = sum(g * x_hat), grad_bias = sum(g), coef[c] = (mean, k1, k2, k3).
template <typename T>
__global__ void __launch_bounds__(kFinThreads)
    cbr_finalize_bwd_v2(const typename Acc<T>::type* __restrict__ ws, int P, int C,
                        int64_t count, const T* __restrict__ x, const T* __restrict__ dy,
                        const uint8_t* __restrict__ mask, int64_t nfull, int64_t numel,
                        const typename Acc<T>::type* __restrict__ save_mean,
                        const typename Acc<T>::type* __restrict__ save_invstd, const void* weight,
                        int wkind, void* grad_weight, void* grad_bias, int gkind,
                        Coef4<typename Acc<T>::type>* __restrict__ coef) {
  using A = typename Acc<T>::type;
  constexpr int kFinBatch = fin_batch<A>();
  __shared__ A sm[2][32][33];
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  const int c = blockIdx.x * 32 + tx;
  A sg = 0, sgx = 0;
  if (c < C) {
    const int64_t plane = int64_t(P) * C;
    for (int p0 = ty; p0 < P; p0 += 32 * kFinBatch) {
      A la[kFinBatch], lb[kFinBatch];
#pragma unroll
      for (int k = 0; k < kFinBatch; ++k) {
        const int p = p0 + 32 * k;
        if (p < P) {
          const int64_t o = int64_t(p) * C + c;
          la[k] = ws[o];
          lb[k] = ws[plane + o];
        } else {
          la[k] = lb[k] = A(0);
        }
      }
#pragma unroll
      for (int k = 0; k < kFinBatch; ++k) {
        sg += la[k];
        sgx += lb[k];
      }
    }
  }
  sm[0][ty][tx] = sg;
  sm[1][ty][tx] = sgx;
  __syncthreads();
  sg = bn::warp_sum(sm[0][tx][ty]);
  sgx = bn::warp_sum(sm[1][tx][ty]);
  const int cw = blockIdx.x * 32 + ty;
  if (tx != 0 || cw >= C) return;
  const A mean = save_mean[cw];
  for (int64_t e = nfull * kGroup; e < numel; ++e) {
    if (e % C != cw) continue;
    const unsigned bit = (static_cast<unsigned>(mask[nfull]) >> (e - nfull * kGroup)) & 1u;
    const A gv = bit ? static_cast<A>(dy[e]) : A(0);
    sg += gv;
    sgx += gv * (static_cast<A>(x[e]) - mean);
  }
  const A invstd = save_invstd[cw];
  const A w = bn::load_param<A>(weight, wkind, cw, A(1));
  const A k1 = w * invstd;
  const A inv_m = A(1) / static_cast<A>(count);
  if (grad_weight != nullptr) bn::store_param<A>(grad_weight, gkind, cw, sgx * invstd);
  if (grad_bias != nullptr) bn::store_param<A>(grad_bias, gkind, cw, sg);
  Coef4<A> k;
  k.v[0] = mean;
  k.v[1] = k1;
  k.v[2] = k1 * sg * inv_m;
  k.v[3] = k1 * invstd * invstd * sgx * inv_m;
  coef[cw] = k;
}

// dconv = g * k1 - k2 - (x - mean) * k3 over the full groups, coefficients of the thread's 8
// channels in registers; thread 0 then does the partial group.
template <typename T, bool VEC>
__global__ void __launch_bounds__(kThreads)
    cbr_grad_conv_out_nhwc_v2(const T* __restrict__ x, const T* __restrict__ dy,
                              const uint8_t* __restrict__ mask, T* __restrict__ dx,
                              const Coef4<typename Acc<T>::type>* __restrict__ coef, int nfull,
                              int tail, int S, int C) {
  using A = typename Acc<T>::type;
  const int gid = blockIdx.x * kThreads + threadIdx.x;
  if (gid >= S) return;
  Coef4<A> k[kGroup];
#pragma unroll
  for (int i = 0; i < kGroup; ++i) k[i] = coef[group_channel(gid, i, C)];
  auto one = [&](const Group<T>& vx, const Group<T>& vd, unsigned bits, int g) {
    Group<T> out;
#pragma unroll
    for (int i = 0; i < kGroup; ++i)
      out.v[i] = dconv_value<T, A>(vx.v[i], vd.v[i], (bits >> i) & 1u, k[i]);
    store_full<T, VEC>(dx, g, out);
  };
  int g = gid;
  for (; g + (kUnroll - 1) * S < nfull; g += kUnroll * S) {  // kUnroll groups in flight
    Group<T> px[kUnroll], pd[kUnroll];
    unsigned bits[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      load_full<T, VEC>(x, g + u * S, px[u]);
      load_full<T, VEC>(dy, g + u * S, pd[u]);
      bits[u] = mask[g + u * S];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) one(px[u], pd[u], bits[u], g + u * S);
  }
  for (; g < nfull; g += S) {
    Group<T> px, pd;
    load_full<T, VEC>(x, g, px);
    load_full<T, VEC>(dy, g, pd);
    one(px, pd, mask[g], g);
  }
  if (tail > 0 && gid == 0) {
    const int64_t e0 = int64_t(nfull) * kGroup;
    const unsigned byte = mask[nfull];
    for (int i = 0; i < tail; ++i)
      dx[e0 + i] = dconv_value<T, A>(x[e0 + i], dy[e0 + i], (byte >> i) & 1u, coef[(e0 + i) % C]);
  }
}

// ---------------------------------------------------------------- host helpers

unsigned linear_blocks(int64_t numel, int device) {
  const int64_t groups = (numel + kGroup - 1) / kGroup;
  int64_t blocks = (groups + kThreads - 1) / kThreads;
  const int64_t cap = int64_t(bn::sm_count(device)) * 16;
  if (blocks > cap) blocks = cap;
  if (blocks < 1) blocks = 1;
  return static_cast<unsigned>(blocks);
}

bool fast_groups(const Layout& l, std::initializer_list<const void*> ptrs) {
  const int64_t row = l.nhwc ? l.C : l.HW;
  if (row % kGroup != 0) return false;
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

ChannelOf channel_of(const Layout& l) {
  ChannelOf ch;
  ch.C = l.C;
  ch.HW = l.HW;
  ch.nhwc = l.nhwc;
  return ch;
}

int64_t mask_bytes(int64_t numel) { return (numel + kGroup - 1) / kGroup; }

std::array<int64_t, 2> pair_arg(at::IntArrayRef v, const char* op, const char* name) {
  TORCH_CHECK(v.size() == 1 || v.size() == 2, op, ": ", name,
              " must be an int or a pair of ints, got ", v.size(), " values");
  return {v[0], v.size() == 2 ? v[1] : v[0]};
}

// A depthwise convolution the depthwise op handles (groups == C_in == C_out).
bool use_depthwise(const at::Tensor& input, const at::Tensor& weight, int64_t groups) {
  if (input.scalar_type() == at::kDouble) return false;
  const int64_t C = input.size(1);
  if (groups != C || C <= 1 || weight.size(0) != C || weight.size(1) != 1) return false;
  // the schema lives in ops.cpp; the kernels only when depthwise*.cu are part of the build
  static const bool registered = [] {
    auto h = c10::Dispatcher::singleton().findSchema({"cudadoctor_ops::depthwise_conv2d", ""});
    return h.has_value() && h->hasKernelForDispatchKey(c10::DispatchKey::CUDA);
  }();
  return registered;
}

void check_common(const char* op, const at::Tensor& input, const at::Tensor& weight,
                  at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                  int64_t groups) {
  TORCH_CHECK(input.is_cuda(), op, ": input must be a CUDA tensor, got device ", input.device());
  TORCH_CHECK(input.dim() == 4, op, ": input must be 4-D (N, C, H, W), got sizes ",
              input.sizes());
  const auto st = input.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kHalf || st == at::kBFloat16 || st == at::kDouble, op,
              ": input must be float32, float16, bfloat16 or float64, got ", st);
  TORCH_CHECK(weight.device() == input.device(), op, ": conv_weight is on ", weight.device(),
              " but input is on ", input.device(), "; move both to the same CUDA device");
  TORCH_CHECK(weight.scalar_type() == st, op, ": conv_weight has dtype ", weight.scalar_type(),
              " but input has dtype ", st, "; they must match");
  TORCH_CHECK(groups >= 1, op, ": groups must be >= 1, got ", groups);
  TORCH_CHECK(weight.dim() == 4 && weight.size(0) % groups == 0 &&
                  weight.size(1) * groups == input.size(1),
              op, ": conv_weight must have shape [C_out, C_in / groups, kh, kw] with C_in = ",
              input.size(1), " and groups = ", groups, ", got ", weight.sizes());
  const auto s = pair_arg(stride, op, "stride");
  const auto p = pair_arg(padding, op, "padding");
  const auto d = pair_arg(dilation, op, "dilation");
  TORCH_CHECK(s[0] > 0 && s[1] > 0, op, ": stride must be positive, got ", stride);
  TORCH_CHECK(p[0] >= 0 && p[1] >= 0, op, ": padding must be >= 0, got ", padding);
  TORCH_CHECK(d[0] > 0 && d[1] > 0, op, ": dilation must be positive, got ", dilation);
}

// The convolution of the fused op: the depthwise op for depthwise weights, else ATen
// (cuDNN where torch uses it). Autocast is excluded: dtypes are decided by the caller.
at::Tensor conv_forward(const at::Tensor& input, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                        at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKeySet(c10::DispatchKey::AutocastCUDA));
  if (use_depthwise(input, weight, groups)) {
    static auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("cudadoctor_ops::depthwise_conv2d", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                              const std::optional<at::Tensor>&, at::IntArrayRef, at::IntArrayRef,
                              at::IntArrayRef, int64_t)>();
    return op.call(input, weight, bias, stride, padding, dilation, 0);
  }
  const int64_t zero[2] = {0, 0};
  return at::convolution(input, weight, bias, stride, padding, dilation, false,
                         at::IntArrayRef(zero, 2), groups);
}

// CUDADOCTOR_OPS_CBR_BWD_STREAMS=1 runs the convolution's weight gradient on a side stream beside
// the input gradient; by default (or =0) they run one after the other on the current stream, as
// torch runs them (read at every call). Off by default: alone, a bfloat16 channels-last ResNet-50
// convolution's backward took 0.89-1.23x less time on two streams (H200, CUDA-graph replay,
// scripts/conv_bwd_streams_probe.py), but a whole batch-128 ResNet-50 training step took 22.77
// instead of 21.90 ms of GPU time (scripts/gpu_host_probe.py resnet streams).
bool bwd_streams_selected() { return env_switch("CUDADOCTOR_OPS_CBR_BWD_STREAMS") == 1; }

// The two events of the side-stream fork and join, per device and host thread (created once,
// without timing; a record replaces the previous one, so they are reused by every call).
struct StreamEvents {
  cudaEvent_t fork = nullptr;
  cudaEvent_t join = nullptr;
};

StreamEvents& stream_events(int device) {
  thread_local std::vector<StreamEvents> per_device;
  if (per_device.size() <= static_cast<size_t>(device)) per_device.resize(device + 1);
  StreamEvents& ev = per_device[device];
  if (ev.fork == nullptr) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&ev.fork, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&ev.join, cudaEventDisableTiming));
  }
  return ev;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv_backward(
    const at::Tensor& grad, const at::Tensor& input, const at::Tensor& weight,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
    std::array<bool, 3> mask) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKeySet(c10::DispatchKey::AutocastCUDA));
  if (use_depthwise(input, weight, groups)) {
    at::Tensor gi, gw, gb;
    if (mask[0]) {
      static auto op_in =
          c10::Dispatcher::singleton()
              .findSchemaOrThrow("cudadoctor_ops::depthwise_conv2d_backward_input", "")
              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, int64_t)>();
      gi = op_in.call(grad, input, weight, stride, padding, dilation, 0);
    }
    if (mask[1] || mask[2]) {
      static auto op_w =
          c10::Dispatcher::singleton()
              .findSchemaOrThrow("cudadoctor_ops::depthwise_conv2d_backward_weight", "")
              .typed<std::tuple<at::Tensor, at::Tensor>(
                  const at::Tensor&, const at::Tensor&, const at::Tensor&, at::IntArrayRef,
                  at::IntArrayRef, at::IntArrayRef, bool, int64_t)>();
      auto r = op_w.call(grad, input, weight, stride, padding, dilation, mask[2], 0);
      if (mask[1]) gw = std::get<0>(r);
      if (mask[2]) gb = std::get<1>(r);
    }
    return {gi, gw, gb};
  }
  const int64_t zero[2] = {0, 0};
  const int64_t bias_size[1] = {weight.size(0)};
  auto run = [&](std::array<bool, 3> m) {
    return at::convolution_backward(grad, input, weight, at::IntArrayRef(bias_size, 1), stride,
                                    padding, dilation, false, at::IntArrayRef(zero, 2), groups,
                                    m);
  };
  if (!(mask[0] && (mask[1] || mask[2])) || !grad.is_cuda() || !bwd_streams_selected()) {
    return run(mask);
  }
  // The weight (and bias) gradient on a side stream forked from the current one, the input
  // gradient on the current stream, then the current stream waits for the side one.
  const int device = grad.get_device();
  c10::cuda::CUDAStream cur = c10::cuda::getCurrentCUDAStream(device);
  c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, device);
  StreamEvents& ev = stream_events(device);
  C10_CUDA_CHECK(cudaEventRecord(ev.fork, cur.stream()));
  C10_CUDA_CHECK(cudaStreamWaitEvent(side.stream(), ev.fork, 0));
  // the current stream waits for the side stream's work however this function ends (an error
  // of either gradient included), so nothing queued on the side stream outlives its inputs
  auto join = [&] {
    C10_CUDA_CHECK(cudaEventRecord(ev.join, side.stream()));
    C10_CUDA_CHECK(cudaStreamWaitEvent(cur.stream(), ev.join, 0));
  };
  std::tuple<at::Tensor, at::Tensor, at::Tensor> wr, ir;
  try {
    {
      c10::cuda::CUDAStreamGuard on_side(side);
      wr = run({false, mask[1], mask[2]});
    }
    ir = run({true, false, false});
  } catch (...) {
    join();
    throw;
  }
  join();
  // allocated on the side stream, used on the current one from here on: their blocks are not
  // reused before the current stream's work queued so far has run
  for (const at::Tensor* t : {&std::get<1>(wr), &std::get<2>(wr)}) {
    if (t->defined() && t->storage().data_ptr().get() != nullptr)
      c10::cuda::CUDACachingAllocator::recordStream(t->storage().data_ptr(), cur);
  }
  return {std::get<0>(ir), std::get<1>(wr), std::get<2>(wr)};
}

void check_bn_param(const char* op, const std::optional<at::Tensor>& t, const char* name,
                    const at::Tensor& conv_out) {
  if (!t.has_value() || !t->defined()) return;
  const int64_t C = conv_out.size(1);
  TORCH_CHECK(t->device() == conv_out.device(), op, ": ", name, " is on ", t->device(),
              " but input is on ", conv_out.device());
  TORCH_CHECK(t->dim() == 1 && t->size(0) == C, op, ": ", name, " must have shape [", C,
              "] (one value per output channel of the convolution), got ", t->sizes());
  const auto st = conv_out.scalar_type();
  const bool low = st == at::kHalf || st == at::kBFloat16;
  TORCH_CHECK(t->scalar_type() == st || (low && t->scalar_type() == at::kFloat), op, ": ", name,
              " has dtype ", t->scalar_type(), " but input has dtype ", st, "; it must have the "
              "input's dtype", (low ? " or float32" : ""));
}

// Grids of the per-channel reduction kernels: about 8 blocks per SM in all, at least ~2 packs
// per thread. NCHW: grid (C, splits) of kThreads. NHWC: block (TX, TY), TX threads across the
// packs of channels, grid (ceil(Cv / TX), splits).
int nchw_splits(int64_t C, int64_t packs_per_channel, int device) {
  const int64_t target = int64_t(bn::sm_count(device)) * 8;
  int64_t s = (target + C - 1) / C;
  const int64_t by_work = (packs_per_channel + 2 * kThreads - 1) / (2 * kThreads);
  if (s > by_work) s = by_work;
  if (s > bn::kMaxSplits) s = bn::kMaxSplits;
  if (s < 1) s = 1;
  return static_cast<int>(s);
}

struct NhwcGrid {
  dim3 block, grid;
  int splits;
};

NhwcGrid nhwc_grid(int64_t Cv, int64_t R, int device) {
  int tx = 1;
  while (tx < Cv && tx < 32) tx <<= 1;
  const int ty = kThreads / tx;
  const int64_t gx = (Cv + tx - 1) / tx;
  const int64_t target = int64_t(bn::sm_count(device)) * 8;
  int64_t s = (target + gx - 1) / gx;
  const int64_t by_work = (R + 2 * ty - 1) / (2 * ty);
  if (s > by_work) s = by_work;
  if (s > bn::kMaxSplits) s = bn::kMaxSplits;
  if (s < 1) s = 1;
  NhwcGrid g;
  g.block = dim3(tx, ty);
  g.grid = dim3(static_cast<unsigned>(gx), static_cast<unsigned>(s));
  g.splits = static_cast<int>(s);
  return g;
}

// cbr_apply over conv_out l.x: out and the mask from the per-channel coefficients, with the
// residual res (l.x's layout) added before the ReLU when not null.
template <typename T>
void launch_apply_v1(const Layout& l, const at::Tensor& out, const at::Tensor& mask,
                     const Coef4<typename Acc<T>::type>* cp, const T* res) {
  const int device = l.x.get_device();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  const T* x = l.x.data_ptr<T>();
  const int64_t numel = l.x.numel();
  const unsigned blocks = linear_blocks(numel, device);
  uint8_t* mp = mask.data_ptr<uint8_t>();
  T* y = out.data_ptr<T>();
  const ChannelOf ch = channel_of(l);
  const bool fast = res != nullptr ? fast_groups(l, {x, y, res}) : fast_groups(l, {x, y});
  if (res != nullptr) {
    if (fast) {
      cbr_apply<T, true, true><<<blocks, kThreads, 0, stream>>>(x, y, mp, cp, numel, ch, res);
    } else {
      cbr_apply<T, false, true><<<blocks, kThreads, 0, stream>>>(x, y, mp, cp, numel, ch, res);
    }
  } else if (fast) {
    cbr_apply<T, true><<<blocks, kThreads, 0, stream>>>(x, y, mp, cp, numel, ch, nullptr);
  } else {
    cbr_apply<T, false><<<blocks, kThreads, 0, stream>>>(x, y, mp, cp, numel, ch, nullptr);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// res: see launch_apply_v1 (nullptr: none).
template <typename T, int V>
void stats_and_apply(const Layout& l, const at::Tensor& out, const at::Tensor& mask, double eps,
                     const at::Tensor& w, const at::Tensor& b, const at::Tensor& save_mean,
                     const at::Tensor& save_invstd, const T* res) {
  using A = typename Acc<T>::type;
  const int device = l.x.get_device();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  const T* x = l.x.data_ptr<T>();
  const int64_t R = l.N * l.HW;
  int splits;
  at::Tensor ws;
  if (l.nhwc) {
    NhwcGrid g = nhwc_grid(l.C / V, R, device);
    splits = g.splits;
    ws = at::empty({l.C * splits * 3}, save_mean.options());
    const size_t smem = size_t(g.block.x) * g.block.y * V * 3 * sizeof(A);
    cbr_stats_nhwc<T, V><<<g.grid, g.block, smem, stream>>>(x, ws.data_ptr<A>(), R, l.C);
  } else {
    splits = nchw_splits(l.C, l.N * (l.HW / V), device);
    ws = at::empty({l.C * splits * 3}, save_mean.options());
    cbr_stats_nchw<T, V><<<dim3(unsigned(l.C), unsigned(splits)), kThreads, 0, stream>>>(
        x, ws.data_ptr<A>(), l.N, l.C, l.HW);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  at::Tensor coef = at::empty({l.C * 4}, save_mean.options());
  auto* cp = reinterpret_cast<Coef4<A>*>(coef.data_ptr<A>());
  {
    const int warps = 8;
    const unsigned fgrid = static_cast<unsigned>((l.C + warps - 1) / warps);
    cbr_finalize_fwd<A><<<fgrid, warps * 32, 0, stream>>>(
        ws.data_ptr<A>(), splits, l.C, eps, bn::param_ptr(w), bn::param_kind(w),
        bn::param_ptr(b), bn::param_kind(b), save_mean.data_ptr<A>(), save_invstd.data_ptr<A>(),
        cp);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  launch_apply_v1<T>(l, out, mask, cp, res);
}

template <typename T, int V>
void grad_conv_out(const Layout& l, const at::Tensor& dy, const at::Tensor& mask,
                   const at::Tensor& dx, const at::Tensor& save_mean,
                   const at::Tensor& save_invstd, const at::Tensor& w, const at::Tensor& gw,
                   const at::Tensor& gb) {
  using A = typename Acc<T>::type;
  const int device = l.x.get_device();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  const T* x = l.x.data_ptr<T>();
  const T* d = dy.data_ptr<T>();
  const uint8_t* mp = mask.data_ptr<uint8_t>();
  const A* sm = save_mean.data_ptr<A>();
  const int64_t R = l.N * l.HW;
  int splits;
  at::Tensor ws;
  if (l.nhwc) {
    NhwcGrid g = nhwc_grid(l.C / V, R, device);
    splits = g.splits;
    ws = at::empty({l.C * splits * 2}, save_mean.options());
    const size_t smem = size_t(g.block.x) * g.block.y * V * 2 * sizeof(A);
    cbr_reduce_nhwc<T, V><<<g.grid, g.block, smem, stream>>>(x, d, mp, sm, ws.data_ptr<A>(), R,
                                                              l.C);
  } else {
    splits = nchw_splits(l.C, l.N * (l.HW / V), device);
    ws = at::empty({l.C * splits * 2}, save_mean.options());
    cbr_reduce_nchw<T, V><<<dim3(unsigned(l.C), unsigned(splits)), kThreads, 0, stream>>>(
        x, d, mp, sm, ws.data_ptr<A>(), l.N, l.C, l.HW);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  at::Tensor coef = at::empty({l.C * 4}, save_mean.options());
  auto* cp = reinterpret_cast<Coef4<A>*>(coef.data_ptr<A>());
  {
    const int warps = 8;
    const unsigned fgrid = static_cast<unsigned>((l.C + warps - 1) / warps);
    const int gkind = gw.defined() ? bn::param_kind(gw) : bn::param_kind(gb);
    cbr_finalize_bwd<A><<<fgrid, warps * 32, 0, stream>>>(
        ws.data_ptr<A>(), splits, l.C, R, sm, save_invstd.data_ptr<A>(), bn::param_ptr(w),
        bn::param_kind(w), gw.defined() ? gw.data_ptr() : nullptr,
        gb.defined() ? gb.data_ptr() : nullptr, gkind, cp);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (!dx.defined()) return;
  const int64_t numel = l.x.numel();
  const unsigned blocks = linear_blocks(numel, device);
  if (fast_groups(l, {x, d, dx.data_ptr()})) {
    cbr_grad_conv_out<T, true><<<blocks, kThreads, 0, stream>>>(x, d, mp, dx.data_ptr<T>(), cp,
                                                                numel, channel_of(l));
  } else {
    cbr_grad_conv_out<T, false><<<blocks, kThreads, 0, stream>>>(x, d, mp, dx.data_ptr<T>(), cp,
                                                                 numel, channel_of(l));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ---------------------------------------------------------------- v2 host side (NHWC)

// CUDADOCTOR_OPS_CBR_V1 set to anything but "" or "0" selects the v1 NHWC kernels. Read at every
// call (a few hundred ns next to five kernel launches), so one process can time both.
bool cbr_v1_selected() {
  const char* e = std::getenv("CUDADOCTOR_OPS_CBR_V1");
  return e != nullptr && e[0] != '\0' && !(e[0] == '0' && e[1] == '\0');
}

// The training backward's BatchNorm part runs on BatchNorm's backward kernels with the ReLU
// mask (bn::relu_mask_backward_cuda) unless CUDADOCTOR_OPS_CBR_BN_BWD=0 (then the CBR kernels
// below, v2 / v1 as above); read at every call.
bool cbr_bn_bwd_selected() {
  const char* e = std::getenv("CUDADOCTOR_OPS_CBR_BN_BWD");
  return !(e != nullptr && e[0] == '0' && e[1] == '\0');
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The v2 kernels index groups with 32-bit integers.
bool v2_fits(const Layout& l) {
  return l.x.numel() / kGroup < (int64_t(1) << 30) && l.C < (int64_t(1) << 20);
}

// Groups of 8 elements after which the channels of a group repeat in the NHWC layout.
int64_t channel_period(int64_t C) { return C / std::gcd(C, int64_t(kGroup)); }

// Grid of a v2 grid-stride kernel: S threads in the loop, a multiple of `align` (and at least
// `align`), in `blocks` blocks of kThreads (threads past S idle).
struct FlatPlan {
  unsigned blocks;
  int64_t S;
};

FlatPlan flat_plan(int64_t max_blocks, int64_t align) {
  if (max_blocks < 1) max_blocks = 1;
  int64_t S = max_blocks * kThreads / align * align;
  if (S < align) S = align;
  FlatPlan p;
  p.blocks = static_cast<unsigned>((S + kThreads - 1) / kThreads);
  p.S = S;
  return p;
}

// Blocks of the v2 reductions: at most one wave of resident blocks, about 8 full groups per
// thread or more, at least 32 rows per block on average (the [P][C] partials stay small next to
// the data), and past one block per SM the nearest whole multiple of the SM count (equal work
// per SM).
int64_t reduce_blocks(int64_t nfull, int64_t rows, int per_sm, int device) {
  const int64_t sms = bn::sm_count(device);
  const int64_t wave = sms * per_sm;
  int64_t b = wave;
  const int64_t by_work = (nfull + int64_t(kThreads) * 8 - 1) / (int64_t(kThreads) * 8);
  if (b > by_work) b = by_work;
  if (b > rows / 32) b = rows / 32;
  if (b > sms) {
    b = (b + sms / 2) / sms * sms;
    if (b > wave) b = wave;
  }
  if (b < 1) b = 1;
  return b;
}

// Blocks of the v2 elementwise passes: one wave of resident blocks, no block without a group.
int64_t stream_blocks(int64_t ngroups, int per_sm, int device) {
  int64_t b = int64_t(bn::sm_count(device)) * per_sm;
  const int64_t by_work = (ngroups + kThreads - 1) / kThreads;
  if (b > by_work) b = by_work;
  if (b < 1) b = 1;
  return b;
}

// The apply passes in rounds (apply_groups_nhwc's ROUNDS) and conv_bn_relu_apply_sums without
// a cooperative launch (cbr_apply_sums_nhwc_v3) unless CUDADOCTOR_OPS_CBR_APPLY_ROUNDS=0 (read
// once).
bool apply_rounds_enabled() {
  static const bool on = env_switch("CUDADOCTOR_OPS_CBR_APPLY_ROUNDS") != 0;
  return on;
}

// CUDADOCTOR_OPS_CBR_APPLY_V4: 2 or 4 selects cbr_apply_sums_nhwc_v4 with that many groups per
// thread for conv_bn_relu_apply_sums where 2048 % C == 0; else (the default) 0, v3 (read once).
int apply_v4_rounds() {
  static const int r = env_choice("CUDADOCTOR_OPS_CBR_APPLY_V4", {2, 4}, 0);
  return r;
}

// conv_bn_relu_apply_sums runs cbr_apply_sums_nhwc_v5 where 2048 % C == 0 (and neither
// CUDADOCTOR_OPS_CBR_APPLY_V4 nor CUDADOCTOR_OPS_CBR_APPLY_ROUNDS=0 is set);
// CUDADOCTOR_OPS_CBR_APPLY_V5=0 brings back v3 there (read once).
bool apply_v5_enabled() {
  static const bool on = env_switch("CUDADOCTOR_OPS_CBR_APPLY_V5") != 0;
  return on;
}

// The completion counters of cbr_apply_sums_nhwc_v3 / _v4 / _v5: a CounterPool of kApplySlots
// slots of one counter (the block that updates the running statistics sets it back).
constexpr int kApplySlots = 1024;
__device__ unsigned g_apply_counters[kApplySlots];

// A counter of g_apply_counters on `device` (the current device).
unsigned* next_apply_counter(int device) {
  static bn::CounterPool pool(g_apply_counters, kApplySlots, 1);
  return pool.next(device);
}

// The arguments and grid of an apply pass over the channels_last conv_out l.x into out and the
// mask (cbr_apply_nhwc_v2, cbr_apply_sums_nhwc): 8-element groups, at most one wave of resident
// blocks of the kernel (stream_blocks), a grid stride that is a multiple of the channel period
// and of 32 (flat_plan).
template <typename T>
struct ApplyPass {
  int device;
  cudaStream_t stream;
  const T* x;
  T* y;
  uint8_t* mask;
  int C, nfull, tail;
  bool vec;         // x and y 16-byte aligned
  bool mask_words;  // mask 4-byte aligned
  ApplyPass(const Layout& l, const at::Tensor& out, const at::Tensor& m)
      : device(l.x.get_device()),
        stream(c10::cuda::getCurrentCUDAStream(device).stream()),
        x(l.x.data_ptr<T>()),
        y(out.data_ptr<T>()),
        mask(m.data_ptr<uint8_t>()),
        C(static_cast<int>(l.C)),
        nfull(static_cast<int>(l.x.numel() / kGroup)),
        tail(static_cast<int>(l.x.numel() % kGroup)),
        vec(aligned16(x) && aligned16(y)),
        mask_words(reinterpret_cast<uintptr_t>(mask) % 4 == 0) {}
  template <typename Kernel>
  FlatPlan plan(Kernel kernel) const {
    const int64_t align = std::lcm(channel_period(C), int64_t(32));
    return flat_plan(stream_blocks(nfull, bn::blocks_per_sm(kernel, 0), device), align);
  }
};

// cbr_apply_nhwc_v2 over conv_out l.x: out and the mask from the per-channel coefficients; with
// res (l.x's layout, not null) relu(bn + res).
template <typename T>
void launch_apply_v2(const Layout& l, const at::Tensor& out, const at::Tensor& mask,
                     const Coef4<typename Acc<T>::type>* cp, const T* res = nullptr) {
  const ApplyPass<T> p(l, out, mask);
  const bool vec = p.vec && (res == nullptr || aligned16(res));
  auto* apply = apply_rounds_enabled()
                    ? (res != nullptr ? (vec ? &cbr_apply_nhwc_v2<T, true, true>
                                             : &cbr_apply_nhwc_v2<T, false, true>)
                                      : (vec ? &cbr_apply_nhwc_v2<T, true>
                                             : &cbr_apply_nhwc_v2<T, false>))
                    : (res != nullptr ? (vec ? &cbr_apply_nhwc_v2<T, true, true, false>
                                             : &cbr_apply_nhwc_v2<T, false, true, false>)
                                      : (vec ? &cbr_apply_nhwc_v2<T, true, false, false>
                                             : &cbr_apply_nhwc_v2<T, false, false, false>));
  const FlatPlan ap = p.plan(apply);
  apply<<<ap.blocks, kThreads, 0, p.stream>>>(p.x, p.y, p.mask, cp, p.nfull, p.tail,
                                              static_cast<int>(ap.S), p.C, p.mask_words, res);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// res: see launch_apply_v1 (nullptr: none; with one, the apply is cbr_apply's).
template <typename T>
void stats_and_apply_v2(const Layout& l, const at::Tensor& out, const at::Tensor& mask,
                        double eps, const at::Tensor& w, const at::Tensor& b,
                        const at::Tensor& save_mean, const at::Tensor& save_invstd,
                        const T* res) {
  using A = typename Acc<T>::type;
  const int device = l.x.get_device();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  const T* x = l.x.data_ptr<T>();
  const int64_t numel = l.x.numel();
  const int C = static_cast<int>(l.C);
  const int nfull = static_cast<int>(numel / kGroup);
  const int64_t period = channel_period(l.C);
  const bool vec = aligned16(x) && aligned16(out.data_ptr());

  auto* stats = vec ? &cbr_stats_nhwc_v2<T, true> : &cbr_stats_nhwc_v2<T, false>;
  const FlatPlan sp =
      flat_plan(reduce_blocks(nfull, l.N * l.HW, bn::blocks_per_sm(stats, 0), device), period);
  at::Tensor ws = at::empty({3 * int64_t(sp.blocks) * C}, save_mean.options());
  stats<<<sp.blocks, kThreads, 0, stream>>>(x, ws.data_ptr<A>(), nfull, static_cast<int>(sp.S),
                                            C);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  at::Tensor coef = at::empty({int64_t(C) * 4}, save_mean.options());
  auto* cp = reinterpret_cast<Coef4<A>*>(coef.data_ptr<A>());
  cbr_finalize_fwd_v2<T><<<static_cast<unsigned>((C + 31) / 32), kFinThreads, 0, stream>>>(
      ws.data_ptr<A>(), static_cast<int>(sp.blocks), C, x, nfull, numel, eps, bn::param_ptr(w),
      bn::param_kind(w), bn::param_ptr(b), bn::param_kind(b), save_mean.data_ptr<A>(),
      save_invstd.data_ptr<A>(), cp);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  launch_apply_v2<T>(l, out, mask, cp, res);
}

template <typename T>
void grad_conv_out_v2(const Layout& l, const at::Tensor& dy, const at::Tensor& mask,
                      const at::Tensor& dx, const at::Tensor& save_mean,
                      const at::Tensor& save_invstd, const at::Tensor& w, const at::Tensor& gw,
                      const at::Tensor& gb) {
  using A = typename Acc<T>::type;
  const int device = l.x.get_device();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  const T* x = l.x.data_ptr<T>();
  const T* d = dy.data_ptr<T>();
  const uint8_t* mp = mask.data_ptr<uint8_t>();
  const A* sm = save_mean.data_ptr<A>();
  const int64_t numel = l.x.numel();
  const int C = static_cast<int>(l.C);
  const int nfull = static_cast<int>(numel / kGroup), tail = static_cast<int>(numel % kGroup);
  const int64_t period = channel_period(l.C);
  const bool vec = aligned16(x) && aligned16(d) && (!dx.defined() || aligned16(dx.data_ptr()));

  auto* reduce = vec ? &cbr_reduce_nhwc_v2<T, true> : &cbr_reduce_nhwc_v2<T, false>;
  const FlatPlan rp =
      flat_plan(reduce_blocks(nfull, l.N * l.HW, bn::blocks_per_sm(reduce, 0), device), period);
  at::Tensor ws = at::empty({2 * int64_t(rp.blocks) * C}, save_mean.options());
  reduce<<<rp.blocks, kThreads, 0, stream>>>(x, d, mp, sm, ws.data_ptr<A>(), nfull,
                                             static_cast<int>(rp.S), C);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  at::Tensor coef = at::empty({int64_t(C) * 4}, save_mean.options());
  auto* cp = reinterpret_cast<Coef4<A>*>(coef.data_ptr<A>());
  const int gkind = gw.defined() ? bn::param_kind(gw) : bn::param_kind(gb);
  cbr_finalize_bwd_v2<T><<<static_cast<unsigned>((C + 31) / 32), kFinThreads, 0, stream>>>(
      ws.data_ptr<A>(), static_cast<int>(rp.blocks), C, l.N * l.HW, x, d, mp, nfull, numel, sm,
      save_invstd.data_ptr<A>(), bn::param_ptr(w), bn::param_kind(w),
      gw.defined() ? gw.data_ptr() : nullptr, gb.defined() ? gb.data_ptr() : nullptr, gkind, cp);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (!dx.defined()) return;

  auto* grad = vec ? &cbr_grad_conv_out_nhwc_v2<T, true> : &cbr_grad_conv_out_nhwc_v2<T, false>;
  const FlatPlan gp = flat_plan(stream_blocks(nfull, bn::blocks_per_sm(grad, 0), device), period);
  grad<<<gp.blocks, kThreads, 0, stream>>>(x, d, mp, dx.data_ptr<T>(), cp, nfull, tail,
                                           static_cast<int>(gp.S), C);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The momentum of this step in a one-block kernel: `momentum`, or 1 / num_batches_tracked after
// this step's increment when momentum < 0 (BatchNorm's momentum=None); increments
// num_batches_tracked (every thread reads it before thread 0 writes it).
template <typename A>
__device__ __forceinline__ A step_momentum(int64_t* __restrict__ nbt, double momentum) {
  A m = static_cast<A>(momentum);
  if (nbt != nullptr) {
    const int64_t n = nbt[0] + 1;
    if (momentum < 0) m = A(1) / static_cast<A>(n);
    __syncthreads();
    if (threadIdx.x == 0) nbt[0] = n;
  }
  return m;
}

// running = (1 - m) * running + m * batch for channel c.
template <typename A>
__device__ __forceinline__ void update_running(void* rmean, int mkind, void* rvar, int vkind,
                                               int64_t c, A m, A mean, A unbiased) {
  const A old_m = bn::load_param<A>(rmean, mkind, c, A(0));
  const A old_v = bn::load_param<A>(rvar, vkind, c, A(0));
  bn::store_param<A>(rmean, mkind, c, (A(1) - m) * old_m + m * mean);
  bn::store_param<A>(rvar, vkind, c, (A(1) - m) * old_v + m * unbiased);
}

// One block: running statistics of every channel and num_batches_tracked.
template <typename A>
__global__ void cbr_update_stats(void* rmean, int mkind, void* rvar, int vkind,
                                 int64_t* __restrict__ nbt, const A* __restrict__ save_mean,
                                 const A* __restrict__ save_invstd, int64_t C, double momentum,
                                 double eps, int64_t count) {
  const A m = step_momentum<A>(nbt, momentum);
  if (rmean == nullptr || rvar == nullptr || count <= 0) return;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const A inv = save_invstd[c];
    A var = A(1) / (inv * inv) - static_cast<A>(eps);
    if (var < A(0)) var = A(0);
    const A unbiased = var * (static_cast<A>(count) / static_cast<A>(count - 1));
    update_running<A>(rmean, mkind, rvar, vkind, c, m, save_mean[c], unbiased);
  }
}

// One block: the batch statistics from per-channel sums that the convolution produced with its
// output (cuDNN's fused pointwise + reduction epilogue: sums[c] = sum(y - K), sums[C + c] =
// sum((y - K)^2), K = the running mean before this step when `shifted`, else 0), as save_mean,
// save_invstd and the apply coefficients of cbr_finalize_fwd; and the running-statistics update of
// cbr_update_stats (each thread reads its channel's shift before it writes that channel).
template <typename A>
__global__ void cbr_finalize_sums(const float* __restrict__ sums, int64_t C, int64_t count,
                                  double eps, const void* weight, int wkind, const void* bias,
                                  int bkind, void* rmean, int mkind, void* rvar, int vkind,
                                  int64_t* __restrict__ nbt, double momentum, bool shifted,
                                  A* __restrict__ save_mean, A* __restrict__ save_invstd,
                                  Coef4<A>* __restrict__ coef) {
  const A m = step_momentum<A>(nbt, momentum);
  const bool update = rmean != nullptr && rvar != nullptr;
  const A cnt = static_cast<A>(count);
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const A shift = shifted ? bn::load_param<A>(rmean, mkind, c, A(0)) : A(0);
    const A d = static_cast<A>(sums[c]) / cnt;
    const A mean = shift + d;
    A var = static_cast<A>(sums[C + c]) / cnt - d * d;
    if (var < A(0)) var = A(0);
    const A invstd = bn::inv_sqrt(var + static_cast<A>(eps));
    save_mean[c] = mean;
    save_invstd[c] = invstd;
    Coef4<A> k;
    k.v[0] = mean;
    k.v[1] = bn::load_param<A>(weight, wkind, c, A(1)) * invstd;
    k.v[2] = bn::load_param<A>(bias, bkind, c, A(0));
    k.v[3] = 0;
    coef[c] = k;
    if (update) update_running<A>(rmean, mkind, rvar, vkind, c, m, mean, var * (cnt / (cnt - A(1))));
  }
}

// The arguments of cbr_apply_sums_nhwc: cbr_finalize_sums's.
template <typename A>
struct SumsArgs {
  const float* sums;
  int64_t C, count;
  double eps;
  const void* weight;
  int wkind;
  const void* bias;
  int bkind;
  void* rmean;
  int mkind;
  void* rvar;
  int vkind;
  int64_t* nbt;
  double momentum;
  bool shifted;
  A* save_mean;
  A* save_invstd;
};

// Channel c's batch mean and (biased) variance from the sums, as cbr_finalize_sums computes them
// (the shift read from the running mean before this step's update).
template <typename A>
__device__ __forceinline__ void sums_mean_var(const SumsArgs<A>& a, int64_t c, A& mean, A& var) {
  const A cnt = static_cast<A>(a.count);
  const A shift = a.shifted ? bn::load_param<A>(a.rmean, a.mkind, c, A(0)) : A(0);
  const A d = static_cast<A>(a.sums[c]) / cnt;
  mean = shift + d;
  var = static_cast<A>(a.sums[a.C + c]) / cnt - d * d;
  if (var < A(0)) var = A(0);
}

// Channel c's batch mean and inverse standard deviation from the sums.
template <typename A>
__device__ __forceinline__ void sums_mean_invstd(const SumsArgs<A>& a, int64_t c, A& mean,
                                                 A& invstd) {
  A var;
  sums_mean_var<A>(a, c, mean, var);
  invstd = bn::inv_sqrt(var + static_cast<A>(a.eps));
}

// Channel c's apply coefficients from its mean and inverse standard deviation
// (cbr_finalize_sums's arithmetic).
template <typename A>
__device__ __forceinline__ Coef4<A> sums_coef_of(const SumsArgs<A>& a, int64_t c, A mean,
                                                 A invstd) {
  Coef4<A> k;
  k.v[0] = mean;
  k.v[1] = bn::load_param<A>(a.weight, a.wkind, c, A(1)) * invstd;
  k.v[2] = bn::load_param<A>(a.bias, a.bkind, c, A(0));
  k.v[3] = 0;
  return k;
}

// Channel c's apply coefficients from the sums.
template <typename A>
__device__ __forceinline__ Coef4<A> sums_coef(const SumsArgs<A>& a, int64_t c) {
  A mean, invstd;
  sums_mean_invstd<A>(a, c, mean, invstd);
  return sums_coef_of<A>(a, c, mean, invstd);
}

// conv_bn_relu_apply_sums in one launch: cbr_finalize_sums's work folded into
// cbr_apply_nhwc_v2. Every thread computes the coefficients of its own channels from the sums
// (the same arithmetic, so the same bits; a few cached loads per channel against a launch of
// its own); block 0 writes save_mean / save_invstd. With `update` (running statistics or
// num_batches_tracked given) the kernel is a cooperative launch: after a grid barrier, when every
// block has read the running mean (the shift), block 0 updates the running statistics and
// num_batches_tracked as cbr_finalize_sums does.
template <typename T, bool VEC>
__global__ void __launch_bounds__(kThreads)
    cbr_apply_sums_nhwc(const T* __restrict__ x, T* __restrict__ y, uint8_t* __restrict__ mask,
                        SumsArgs<typename Acc<T>::type> a, int nfull, int tail, int S, int C,
                        bool mask_words, bool update) {
  using A = typename Acc<T>::type;
  const int gid = blockIdx.x * kThreads + threadIdx.x;
  const auto coef_of = [&](auto c) { return sums_coef<A>(a, c); };
  if (gid < S) {
    apply_groups_nhwc<T, VEC, decltype(coef_of)&, false, 0>(x, y, mask, coef_of, gid, nfull,
                                                            tail, S, C, mask_words);
  }
  if (blockIdx.x == 0) {
    for (int64_t c = threadIdx.x; c < a.C; c += blockDim.x)
      sums_mean_invstd<A>(a, c, a.save_mean[c], a.save_invstd[c]);
  }
  if (!update) return;  // the same for every block
  cg::this_grid().sync();
  if (blockIdx.x != 0) return;
  const A m = step_momentum<A>(a.nbt, a.momentum);
  if (a.rmean == nullptr || a.rvar == nullptr) return;
  const A cnt = static_cast<A>(a.count);
  for (int64_t c = threadIdx.x; c < a.C; c += blockDim.x) {
    A mean, var;
    sums_mean_var<A>(a, c, mean, var);  // reads channel c's running mean before it is written
    update_running<A>(a.rmean, a.mkind, a.rvar, a.vkind, c, m, mean, var * (cnt / (cnt - A(1))));
  }
}

// The last block's part (every thread of it): the running statistics and num_batches_tracked
// from the sums, then the completion counter back to zero.
template <typename A>
__device__ __forceinline__ void sums_update_last(const SumsArgs<A>& a, unsigned* __restrict__ counter) {
  const A m = step_momentum<A>(a.nbt, a.momentum);
  if (a.rmean != nullptr && a.rvar != nullptr) {
    const A cnt = static_cast<A>(a.count);
    for (int64_t c = threadIdx.x; c < a.C; c += blockDim.x) {
      A mean, var;
      sums_mean_var<A>(a, c, mean, var);  // reads channel c's running mean before it is written
      update_running<A>(a.rmean, a.mkind, a.rvar, a.vkind, c, m, mean,
                        var * (cnt / (cnt - A(1))));
    }
  }
  if (threadIdx.x == 0) *counter = 0u;
}

// The end of cbr_apply_sums_nhwc_v3 / _v4 after the block's groups: block 0 writes save_mean /
// save_invstd; where there is something to update (counter not null) the last block to finish
// updates the running statistics and num_batches_tracked: every block counts itself on `counter`
// after all of its threads have read their channels' running mean (the shift), and the block that
// brings it to gridDim.x, which therefore runs after every read, writes them and sets the counter
// back to zero. No grid-wide wait: the other blocks exit as soon as they are counted.
template <typename A>
__device__ __forceinline__ void sums_finish(const SumsArgs<A>& a, unsigned* __restrict__ counter) {
  __shared__ bool s_last;
  if (blockIdx.x == 0) {
    for (int64_t c = threadIdx.x; c < a.C; c += blockDim.x)
      sums_mean_invstd<A>(a, c, a.save_mean[c], a.save_invstd[c]);
  }
  if (counter == nullptr) return;  // the same for every block
  __syncthreads();                 // this block's reads of the shift are done
  if (threadIdx.x == 0) {
    __threadfence();
    s_last = atomicAdd(counter, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  sums_update_last<A>(a, counter);
}

// cbr_apply_sums_nhwc without the cooperative launch (unless CUDADOCTOR_OPS_CBR_APPLY_ROUNDS=0;
// the default where 2048 % C != 0, v5 elsewhere): one wave of resident blocks, the apply in rounds (apply_groups_nhwc's RND), every
// thread computing the coefficients of its own channels; then sums_finish.
template <typename T, bool VEC>
__global__ void __launch_bounds__(kThreads)
    cbr_apply_sums_nhwc_v3(const T* __restrict__ x, T* __restrict__ y, uint8_t* __restrict__ mask,
                           SumsArgs<typename Acc<T>::type> a, int nfull, int tail, int S, int C,
                           bool mask_words, unsigned* __restrict__ counter) {
  using A = typename Acc<T>::type;
  const int gid = blockIdx.x * kThreads + threadIdx.x;
  const auto coef_of = [&](auto c) { return sums_coef<A>(a, c); };
  if (gid < S) {
    apply_groups_nhwc<T, VEC, decltype(coef_of)&>(x, y, mask, coef_of, gid, nfull, tail, S, C,
                                                  mask_words);
  }
  sums_finish<A>(a, counter);
}

// The same pass as many short blocks instead of one wave (CUDADOCTOR_OPS_CBR_APPLY_V4=R, R = 2
// or 4; where 2048 % C == 0): block b takes the chunk of R * kThreads groups from
// b * R * kThreads, thread t its groups t, t + kThreads, ... of it, which hold the channels
// (8t + i) % C in every chunk; the block computes the C coefficients into shared memory
// (dynamic, C Coef4) once, then its threads issue their R loads and apply; then sums_finish.
template <typename T, bool VEC, int R>
__global__ void __launch_bounds__(kThreads)
    cbr_apply_sums_nhwc_v4(const T* __restrict__ x, T* __restrict__ y, uint8_t* __restrict__ mask,
                           SumsArgs<typename Acc<T>::type> a, int nfull, int tail, int C,
                           bool mask_words, unsigned* __restrict__ counter) {
  using A = typename Acc<T>::type;
  extern __shared__ __align__(16) unsigned char s_raw[];
  Coef4<A>* s_coef = reinterpret_cast<Coef4<A>*>(s_raw);
  for (int c = threadIdx.x; c < C; c += kThreads) s_coef[c] = sums_coef<A>(a, c);
  __syncthreads();
  const auto coef_of = [&](auto c) { return s_coef[c]; };
  const int gid = blockIdx.x * (R * kThreads) + threadIdx.x;
  apply_groups_nhwc<T, VEC, decltype(coef_of)&, false, R, true>(x, y, mask, coef_of, gid, nfull,
                                                                tail, kThreads, C, mask_words);
  sums_finish<A>(a, counter);
}

// cbr_apply_sums_nhwc_v3 with the coefficients computed once per block (the default where
// 2048 % C == 0, so that the grid is S threads exactly; CUDADOCTOR_OPS_CBR_APPLY_V5=0: v3): after issuing its first round's
// loads each block computes the C coefficients into shared memory (dynamic, C Coef4; block 0
// also writes save_mean / save_invstd from the same values) and counts itself on `counter` right
// then, when its reads of the shift are done and it has no stores in flight; the block that
// brings the count to gridDim.x updates the running statistics after its groups. v3 instead
// computes every thread's 8 channels in that thread (about 100 instructions each) and counts
// after its stores, behind a fence that waits for them.
template <typename T, bool VEC>
__global__ void __launch_bounds__(kThreads)
    cbr_apply_sums_nhwc_v5(const T* __restrict__ x, T* __restrict__ y, uint8_t* __restrict__ mask,
                           SumsArgs<typename Acc<T>::type> a, int nfull, int tail, int S, int C,
                           bool mask_words, unsigned* __restrict__ counter) {
  using A = typename Acc<T>::type;
  extern __shared__ __align__(16) unsigned char s_raw5[];
  Coef4<A>* s_coef = reinterpret_cast<Coef4<A>*>(s_raw5);
  __shared__ bool s_last;
  const int gid = blockIdx.x * kThreads + threadIdx.x;  // < S: the grid is S threads
  auto pre = [&]() {
    for (int c = threadIdx.x; c < C; c += kThreads) {
      A mean, invstd;
      sums_mean_invstd<A>(a, c, mean, invstd);
      // (the stores use the loaded shift: its reads are done at the barrier)
      s_coef[c] = sums_coef_of<A>(a, c, mean, invstd);
      if (blockIdx.x == 0) {
        a.save_mean[c] = mean;
        a.save_invstd[c] = invstd;
      }
    }
    __syncthreads();
    if (counter != nullptr && threadIdx.x == 0) {
      __threadfence();
      s_last = atomicAdd(counter, 1u) == gridDim.x - 1;
    }
  };
  const auto coef_of = [&](auto c) { return s_coef[c]; };
  apply_groups_nhwc<T, VEC, decltype(coef_of)&, false, kApplyRound, false, decltype(pre)&>(
      x, y, mask, coef_of, gid, nfull, tail, S, C, mask_words, nullptr, pre);
  if (counter == nullptr) return;  // the same for every block
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  sums_update_last<A>(a, counter);
}

// What conv_bn_relu_update_stats does to the running statistics (undefined tensors: none; the
// running statistics are used only when both are given).
struct StatsUpdate {
  at::Tensor rm, rv, nbt;
  double momentum = 0;
  bool any() const { return rm.defined() || nbt.defined(); }
};

// The checks of conv_bn_relu_update_stats on its arguments for C channels on `device`.
StatsUpdate check_stats_update(const char* op, const std::optional<at::Tensor>& running_mean,
                               const std::optional<at::Tensor>& running_var,
                               const std::optional<at::Tensor>& num_batches_tracked,
                               const at::Device& device, int64_t C, double momentum) {
  const bool stats = running_mean.has_value() && running_mean->defined() &&
                     running_var.has_value() && running_var->defined();
  const bool has_nbt = num_batches_tracked.has_value() && num_batches_tracked->defined();
  for (const auto* t : {&running_mean, &running_var}) {
    if (!stats) break;
    const at::Tensor& r = **t;
    const char* name = t == &running_mean ? "running_mean" : "running_var";
    TORCH_CHECK(r.device() == device, op, ": ", name, " is on ", r.device(),
                " but the batch statistics are on ", device);
    TORCH_CHECK(r.dim() == 1 && r.numel() == C && r.is_contiguous(), op, ": ", name,
                " must be a contiguous tensor of shape [", C, "], got ", r.sizes());
    TORCH_CHECK(bn::param_kind(r) != bn::kAbsent, op, ": ", name,
                " must be floating point, got ", r.scalar_type());
  }
  if (has_nbt) {
    TORCH_CHECK(num_batches_tracked->device() == device &&
                    num_batches_tracked->scalar_type() == at::kLong &&
                    num_batches_tracked->numel() == 1,
                op, ": num_batches_tracked must be a one-element int64 tensor on ", device);
  }
  StatsUpdate u;
  if (stats) {
    u.rm = *running_mean;
    u.rv = *running_var;
  }
  if (has_nbt) u.nbt = *num_batches_tracked;
  u.momentum = momentum;
  return u;
}

// cbr_update_stats on the current stream for batch statistics of `count` values per channel.
void launch_stats_update(const StatsUpdate& u, const at::Tensor& save_mean,
                         const at::Tensor& save_invstd, double eps, int64_t count) {
  if (!u.any()) return;
  const int64_t C = save_mean.numel();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(save_mean.get_device()).stream();
  const bool stats = u.rm.defined();
  int64_t* nbt = u.nbt.defined() ? u.nbt.data_ptr<int64_t>() : nullptr;
  void* rm = stats ? u.rm.data_ptr() : nullptr;
  void* rv = stats ? u.rv.data_ptr() : nullptr;
  const int mk = stats ? bn::param_kind(u.rm) : bn::kAbsent;
  const int vk = stats ? bn::param_kind(u.rv) : bn::kAbsent;
  const at::Tensor sm = save_mean.contiguous(), si = save_invstd.contiguous();
  if (sm.scalar_type() == at::kDouble) {
    cbr_update_stats<double><<<1, 256, 0, stream>>>(rm, mk, rv, vk, nbt, sm.data_ptr<double>(),
                                                    si.data_ptr<double>(), C, u.momentum, eps,
                                                    count);
  } else {
    cbr_update_stats<float><<<1, 256, 0, stream>>>(rm, mk, rv, vk, nbt, sm.data_ptr<float>(),
                                                   si.data_ptr<float>(), C, u.momentum, eps,
                                                   count);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ---------------------------------------------------------------- ops

using TrainOut = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The argument checks of conv_bn_relu_train that need no convolution output.
void check_train_args(const char* op, const at::Tensor& input, const at::Tensor& conv_weight,
                      const std::optional<at::Tensor>& conv_bias, double eps,
                      at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                      int64_t groups) {
  check_common(op, input, conv_weight, stride, padding, dilation, groups);
  if (conv_bias.has_value() && conv_bias->defined()) {
    TORCH_CHECK(conv_bias->dim() == 1 && conv_bias->size(0) == conv_weight.size(0), op,
                ": conv_bias must have shape [", conv_weight.size(0), "], got ",
                conv_bias->sizes());
    TORCH_CHECK(conv_bias->scalar_type() == input.scalar_type() &&
                    conv_bias->device() == input.device(),
                op, ": conv_bias must have the input's dtype and device, got ",
                conv_bias->scalar_type(), " on ", conv_bias->device());
  }
  TORCH_CHECK(eps >= 0, op, ": eps must be >= 0, got ", eps);
}

void apply_sums_into(const Layout& l, const at::Tensor& sums, const at::Tensor& w,
                     const at::Tensor& b, const StatsUpdate& u, double eps, bool shifted,
                     at::Tensor& out, at::Tensor& save_mean, at::Tensor& save_invstd,
                     at::Tensor& mask);

// The Hopper convolution with the batch statistics in its epilogue
// (cudadoctor_ops::conv3x3_wgmma_stats, module cudadoctor_ops._C_sm90a) for the 16-bit
// channels_last training forward: where its kernel is registered (the module is built where the
// arch list holds 9.0 and loaded by the package), the GPU is of compute capability 9.0 and the
// layer is 64 -> 64 channels, 3x3, stride 1, padding 1, dilation 1, groups 1, no convolution
// bias, width <= 89. On by default, CUDADOCTOR_OPS_CBR_WGMMA=0 turns it off (read once): on the
// H200 the convolution with its sums took 26.4 us for (32,64,56,56) float16 against cuDNN's 27.2
// for the convolution alone (L2 flushed), and the block's training forward in a CUDA graph
// 44.8 us against 46.0 on cuDNN's convolution and bn_tile_nhwc.
bool wgmma_enabled() {
  static const bool on = env_switch("CUDADOCTOR_OPS_CBR_WGMMA") != 0;
  return on;
}

const c10::OperatorHandle* wgmma_op_with_kernel() {
  static std::atomic<const c10::OperatorHandle*> found{nullptr};
  static std::optional<c10::OperatorHandle> handle;
  static std::mutex mu;
  if (const auto* h = found.load(std::memory_order_acquire)) return h;
  std::lock_guard<std::mutex> lock(mu);
  if (!handle) handle = c10::Dispatcher::singleton().findOp({"cudadoctor_ops::conv3x3_wgmma_stats", ""});
  if (handle && handle->hasKernelForDispatchKey(c10::DispatchKey::CUDA)) {
    found.store(&*handle, std::memory_order_release);
    return &*handle;
  }
  return nullptr;  // the module may load later: looked up again next time
}

bool wgmma_applies(const at::Tensor& input, const at::Tensor& weight,
                   const std::optional<at::Tensor>& conv_bias, at::IntArrayRef stride,
                   at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups) {
  if (!wgmma_enabled()) return false;
  const auto st = input.scalar_type();
  if (!input.is_cuda() || weight.device() != input.device()) return false;
  if (!(st == at::kHalf || st == at::kBFloat16) || weight.scalar_type() != st) return false;
  if (conv_bias.has_value() && conv_bias->defined()) return false;
  if (input.dim() != 4 || input.size(1) != 64 || weight.dim() != 4 || weight.size(0) != 64 ||
      weight.size(1) != 64 || weight.size(2) != 3 || weight.size(3) != 3 || groups != 1)
    return false;
  const auto ones = [](at::IntArrayRef v) { return v.size() == 2 && v[0] == 1 && v[1] == 1; };
  if (!ones(stride) || !ones(padding) || !ones(dilation)) return false;
  if (input.size(3) < 1 || input.size(3) > 89 || input.numel() == 0) return false;
  if (input.is_contiguous() || !input.is_contiguous(at::MemoryFormat::ChannelsLast)) return false;
  if (reinterpret_cast<uintptr_t>(input.data_ptr()) % 16 != 0) return false;
  if (tf32conv::compute_capability(input.get_device()) != 90) return false;
  return wgmma_op_with_kernel() != nullptr;
}

// The training forward on conv3x3_wgmma_stats + cbr_apply_sums_nhwc (where wgmma_applies):
// the sums are shifted by the running mean before this step where it is float32 and updated in
// this step, as cuDNN's statistics path does.
TrainOut train_wgmma(const char* op, const at::Tensor& input, const at::Tensor& conv_weight,
                     const std::optional<at::Tensor>& bn_weight,
                     const std::optional<at::Tensor>& bn_bias, double eps,
                     const StatsUpdate* upd) {
  const bool shifted = upd != nullptr && upd->rm.defined() && upd->rm.scalar_type() == at::kFloat;
  const auto call = wgmma_op_with_kernel()
                        ->typed<std::tuple<at::Tensor, at::Tensor>(
                            const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>();
  auto [conv_out, sums] =
      call.call(input, conv_weight, shifted ? std::optional<at::Tensor>(upd->rm) : std::nullopt);
  check_bn_param(op, bn_weight, "bn_weight", conv_out);
  check_bn_param(op, bn_bias, "bn_bias", conv_out);
  Layout l = bn::make_layout(conv_out);
  TORCH_INTERNAL_ASSERT(l.x.is_same(conv_out) && l.nhwc, op, ": conv3x3_wgmma_stats output layout");
  const auto acc_opts = input.options().dtype(at::kFloat);
  at::Tensor out = at::empty_like(l.x);
  at::Tensor save_mean = at::empty({l.C}, acc_opts);
  at::Tensor save_invstd = at::empty({l.C}, acc_opts);
  at::Tensor mask = at::empty({mask_bytes(l.x.numel())}, input.options().dtype(at::kByte));
  apply_sums_into(l, sums, bn::contig_param(bn_weight), bn::contig_param(bn_bias),
                  upd != nullptr ? *upd : StatsUpdate{}, eps, shifted, out, save_mean,
                  save_invstd, mask);
  return {out, conv_out, save_mean, save_invstd, mask};
}

// The training forward; upd (may be null): the running-statistics update of the same step (see
// conv_bn_relu_train_update_cuda). Channels-last float16 / bfloat16 (NHWC kernels not forced to
// v1, CUDADOCTOR_OPS_CBR_TILE not 0) and contiguous float32 / float16 / bfloat16
// (CUDADOCTOR_OPS_CBR_TILE not 0): bn::batch_norm_relu_mask_train first (BN, ReLU, mask and the
// update in one launch: bn_tile_nhwc / bn_fused_nchw); where it does not apply the v2 (or v1)
// kernels and then cbr_update_stats.
// residual (may be null): Conv+BN+Add+ReLU, out = relu(bn(conv) + residual), on the statistics
// kernels and the apply pass with the residual (never the one-launch kernels); the mask is that
// of out.
TrainOut train_impl(const char* op, const at::Tensor& input, const at::Tensor& conv_weight,
                    const std::optional<at::Tensor>& conv_bias,
                    const std::optional<at::Tensor>& bn_weight,
                    const std::optional<at::Tensor>& bn_bias, double eps, at::IntArrayRef stride,
                    at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                    const StatsUpdate* upd, const at::Tensor* residual = nullptr) {
  c10::cuda::CUDAGuard guard(input.device());
  // float32 NCHW 3x3 on large images: the direct TF32 kernel (NCHW in and out) where torch lets
  // cuDNN use TF32, in place of cuDNN's TF32 kernel and its two layout transposes
  const bool tf32 = tf32conv::train_prefers(input) && tf32conv::tf32_allowed() &&
                    tf32conv::applies(input, conv_weight, stride, padding, dilation, groups);
  // 16-bit channels_last 3x3, opt-in (CUDADOCTOR_OPS_CBR_HMMA_TRAIN=1): the tensor-core kernel
  const bool hmma = !tf32 && hmmaconv::train_enabled() &&
                    hmmaconv::applies(input, conv_weight, stride, padding, dilation, groups);
  // 16-bit channels_last 64 -> 64 3x3 on an sm_90 GPU: the convolution with the statistics in
  // its epilogue, then one apply pass
  if (!tf32 && !hmma && residual == nullptr && tile_enabled() && !cbr_v1_selected() &&
      wgmma_applies(input, conv_weight, conv_bias, stride, padding, dilation, groups) &&
      input.size(0) * input.size(2) * input.size(3) > 1) {
    return train_wgmma(op, input, conv_weight, bn_weight, bn_bias, eps, upd);
  }
  at::Tensor conv_out =
      tf32   ? tf32conv::conv3x3(input, conv_weight, conv_bias, false)
      : hmma ? hmmaconv::conv3x3(input, conv_weight, conv_bias, false)
             : conv_forward(input, conv_weight, conv_bias, stride, padding, dilation, groups);
  check_bn_param(op, bn_weight, "bn_weight", conv_out);
  check_bn_param(op, bn_bias, "bn_bias", conv_out);
  Layout l = bn::make_layout(conv_out);
  conv_out = l.x;
  at::Tensor res;
  if (residual != nullptr) {
    check_residual(op, *residual, conv_out);
    res = bn::like_layout(*residual, l);
  }
  const auto acc_type = input.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto acc_opts = input.options().dtype(acc_type);
  const int64_t C = l.C;
  at::Tensor out = at::empty_like(l.x);
  at::Tensor save_mean = at::empty({C}, acc_opts);
  at::Tensor save_invstd = at::empty({C}, acc_opts);
  at::Tensor mask = at::empty({mask_bytes(l.x.numel())}, input.options().dtype(at::kByte));
  const int64_t per_channel = l.N * l.HW;
  TORCH_CHECK(per_channel > 1 || l.x.numel() == 0, op,
              ": expected more than 1 value per channel when training, got conv output size ",
              l.x.sizes());
  if (l.x.numel() == 0) {
    save_mean.zero_();
    save_invstd.zero_();
    mask.zero_();
    if (upd != nullptr) launch_stats_update(*upd, save_mean, save_invstd, eps, 0);
    return {out, conv_out, save_mean, save_invstd, mask};
  }
  const at::Tensor w = bn::contig_param(bn_weight), b = bn::contig_param(bn_bias);
  const bool v1 = cbr_v1_selected();
  if (tile_enabled() && !(l.nhwc && v1) && !res.defined()) {
    const at::Tensor none;
    if (bn::batch_norm_relu_mask_train(l.x, out, mask, w, b, eps, save_mean, save_invstd,
                                       upd ? upd->rm : none, upd ? upd->rv : none,
                                       upd ? upd->nbt : none, upd ? upd->momentum : 0.0)) {
      return {out, conv_out, save_mean, save_invstd, mask};
    }
  }
  const bool v2 = l.nhwc && v2_fits(l) && !v1;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, l.x.scalar_type(), "cbr_fwd", [&] {
    const scalar_t* rp = res.defined() ? res.data_ptr<scalar_t>() : nullptr;
    if (v2) {
      stats_and_apply_v2<scalar_t>(l, out, mask, eps, w, b, save_mean, save_invstd, rp);
      return;
    }
    constexpr int VW = 16 / sizeof(scalar_t);
    if (bn::vec_width<scalar_t>(l, {l.x.data_ptr()}) == VW) {
      stats_and_apply<scalar_t, VW>(l, out, mask, eps, w, b, save_mean, save_invstd, rp);
    } else {
      stats_and_apply<scalar_t, 1>(l, out, mask, eps, w, b, save_mean, save_invstd, rp);
    }
  });
  if (upd != nullptr) launch_stats_update(*upd, save_mean, save_invstd, eps, per_channel);
  return {out, conv_out, save_mean, save_invstd, mask};
}

// -> (out, conv_out, save_mean, save_invstd, mask)
TrainOut conv_bn_relu_train_cuda(const at::Tensor& input, const at::Tensor& conv_weight,
                                 const std::optional<at::Tensor>& conv_bias,
                                 const std::optional<at::Tensor>& bn_weight,
                                 const std::optional<at::Tensor>& bn_bias, double eps,
                                 at::IntArrayRef stride, at::IntArrayRef padding,
                                 at::IntArrayRef dilation, int64_t groups) {
  constexpr const char* op = "cudadoctor_ops.conv_bn_relu";
  check_train_args(op, input, conv_weight, conv_bias, eps, stride, padding, dilation, groups);
  return train_impl(op, input, conv_weight, conv_bias, bn_weight, bn_bias, eps, stride, padding,
                    dilation, groups, nullptr);
}

// out = g where the mask (of g's elements, memory order) is set, else 0: relu_mask_grad's kernel
// on tensors of one layout (out: g's sizes, dtype and memory order).
void launch_mask_grad(const at::Tensor& g, const at::Tensor& mask, at::Tensor& out) {
  const int64_t numel = g.numel();
  if (numel == 0) return;
  const int device = g.get_device();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  const unsigned blocks = linear_blocks(numel, device);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "cbr_mask_grad", [&] {
    const scalar_t* gp = g.data_ptr<scalar_t>();
    scalar_t* op_ = out.data_ptr<scalar_t>();
    const uint8_t* mp = mask.data_ptr<uint8_t>();
    if (aligned16(gp) && aligned16(op_)) {
      cbr_mask_grad<scalar_t, true><<<blocks, kThreads, 0, stream>>>(gp, mp, op_, numel);
    } else {
      cbr_mask_grad<scalar_t, false><<<blocks, kThreads, 0, stream>>>(gp, mp, op_, numel);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// conv_bn_relu_backward; with res_grad (not null), *res_grad is also set to the residual's
// gradient of conv_bn_add_relu_train (relu_mask_grad's result), written by the BatchNorm
// backward's apply kernel where it can (bn::relu_mask_backward_cuda), else by relu_mask_grad's
// kernel into the same tensor.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_impl(
    const char* op, const at::Tensor& grad_out, const at::Tensor& input,
    const at::Tensor& conv_weight, const at::Tensor& conv_out,
    const std::optional<at::Tensor>& bn_weight, const at::Tensor& save_mean,
    const at::Tensor& save_invstd, const at::Tensor& mask, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
    std::array<bool, 5> output_mask, at::Tensor* res_grad) {
  check_common(op, input, conv_weight, stride, padding, dilation, groups);
  TORCH_CHECK(grad_out.sizes() == conv_out.sizes() &&
                  grad_out.scalar_type() == conv_out.scalar_type() &&
                  grad_out.device() == conv_out.device(),
              op, ": grad_out must match the forward output (", conv_out.sizes(), ", ",
              conv_out.scalar_type(), "), got ", grad_out.sizes(), ", ", grad_out.scalar_type());
  const auto acc_type = input.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(save_mean.scalar_type() == acc_type && save_invstd.scalar_type() == acc_type &&
                  save_mean.numel() == conv_out.size(1) && save_invstd.numel() == conv_out.size(1),
              op, ": save_mean / save_invstd must be [C] tensors of dtype ", acc_type,
              " as returned by conv_bn_relu_train");
  TORCH_CHECK(mask.scalar_type() == at::kByte && mask.numel() >= mask_bytes(conv_out.numel()) &&
                  mask.is_contiguous() && mask.device() == conv_out.device(),
              op, ": mask must be the uint8 mask returned by conv_bn_relu_train (contiguous, on ",
              conv_out.device(), ")");
  check_bn_param(op, bn_weight, "bn_weight", conv_out);
  c10::cuda::CUDAGuard guard(input.device());
  Layout l = bn::make_layout(conv_out);
  TORCH_CHECK(l.x.is_same(conv_out), op,
              ": conv_out must be contiguous or channels_last as returned by conv_bn_relu_train");
  const at::Tensor dy = bn::like_layout(grad_out, l);
  const int64_t C = l.C;
  const bool need_conv_grad = output_mask[0] || output_mask[1] || output_mask[2];
  at::Tensor w = bn::contig_param(bn_weight);
  const auto pdtype = w.defined() ? w.scalar_type() : acc_type;
  at::Tensor gw = output_mask[3] ? at::empty({C}, save_mean.options().dtype(pdtype)) : at::Tensor();
  at::Tensor gb = output_mask[4] ? at::empty({C}, save_mean.options().dtype(pdtype)) : at::Tensor();
  at::Tensor dconv = need_conv_grad ? at::empty_like(l.x) : at::Tensor();
  at::Tensor dres = res_grad != nullptr ? at::empty_like(l.x) : at::Tensor();
  bool dres_written = false;
  if (l.x.numel() == 0) {
    if (gw.defined()) gw.zero_();
    if (gb.defined()) gb.zero_();
    if (dconv.defined()) dconv.zero_();
    dres_written = true;
  } else if ((need_conv_grad || gw.defined() || gb.defined()) && cbr_bn_bwd_selected() &&
             bn::relu_mask_backward_cuda(l.x, dy, mask, save_mean, save_invstd, w, dconv, gw,
                                         gb, dres, &dres_written)) {
    // BatchNorm's backward kernels (one cooperative launch for small tensors) with the mask
  } else if (need_conv_grad || gw.defined() || gb.defined()) {
    const at::Tensor sm = save_mean.contiguous(), si = save_invstd.contiguous();
    const bool v2 = l.nhwc && v2_fits(l) && !cbr_v1_selected();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, l.x.scalar_type(), "cbr_bwd", [&] {
      if (v2) {
        grad_conv_out_v2<scalar_t>(l, dy, mask, dconv, sm, si, w, gw, gb);
        return;
      }
      constexpr int VW = 16 / sizeof(scalar_t);
      if (bn::vec_width<scalar_t>(l, {l.x.data_ptr(), dy.data_ptr()}) == VW) {
        grad_conv_out<scalar_t, VW>(l, dy, mask, dconv, sm, si, w, gw, gb);
      } else {
        grad_conv_out<scalar_t, 1>(l, dy, mask, dconv, sm, si, w, gw, gb);
      }
    });
  }
  if (res_grad != nullptr) {
    if (!dres_written) launch_mask_grad(dy, mask, dres);
    *res_grad = dres;
  }
  at::Tensor gi, gcw, gcb;
  if (need_conv_grad) {
    auto r = conv_backward(dconv, input, conv_weight, stride, padding, dilation, groups,
                           {output_mask[0], output_mask[1], output_mask[2]});
    // fixed layouts (what the fake kernel promises): input's and weight's own
    gi = std::get<0>(r);
    if (gi.defined()) gi = gi.contiguous(bn::make_layout(input).format);
    gcw = std::get<1>(r);
    if (gcw.defined()) gcw = gcw.contiguous(bn::make_layout(conv_weight).format);
    gcb = std::get<2>(r);
  }
  auto or_empty = [&](const at::Tensor& t) {
    return t.defined() ? t : at::empty({0}, input.options());
  };
  return {or_empty(gi), or_empty(gcw), or_empty(gcb), or_empty(gw), or_empty(gb)};
}

// -> (grad_input, grad_conv_weight, grad_conv_bias, grad_bn_weight, grad_bn_bias); entries whose
// output_mask is false are empty tensors of shape [0].
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
conv_bn_relu_backward_cuda(const at::Tensor& grad_out, const at::Tensor& input,
                           const at::Tensor& conv_weight, const at::Tensor& conv_out,
                           const std::optional<at::Tensor>& bn_weight,
                           const at::Tensor& save_mean, const at::Tensor& save_invstd,
                           const at::Tensor& mask, at::IntArrayRef stride,
                           at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                           std::array<bool, 5> output_mask) {
  return backward_impl("cudadoctor_ops.conv_bn_relu_backward", grad_out, input, conv_weight,
                       conv_out, bn_weight, save_mean, save_invstd, mask, stride, padding,
                       dilation, groups, output_mask, nullptr);
}

void conv_bn_relu_update_stats_cuda(const std::optional<at::Tensor>& running_mean,
                                    const std::optional<at::Tensor>& running_var,
                                    const std::optional<at::Tensor>& num_batches_tracked,
                                    const at::Tensor& save_mean, const at::Tensor& save_invstd,
                                    double momentum, double eps, int64_t count) {
  constexpr const char* op = "cudadoctor_ops.conv_bn_relu_update_stats";
  const int64_t C = save_mean.numel();
  TORCH_CHECK(save_mean.is_cuda() && save_invstd.numel() == C &&
                  save_mean.scalar_type() == save_invstd.scalar_type() &&
                  (save_mean.scalar_type() == at::kFloat || save_mean.scalar_type() == at::kDouble),
              op, ": save_mean / save_invstd must be the float32/float64 [C] CUDA tensors of "
              "conv_bn_relu_train");
  const StatsUpdate u = check_stats_update(op, running_mean, running_var, num_batches_tracked,
                                           save_mean.device(), C, momentum);
  if (!u.any()) return;
  c10::cuda::CUDAGuard guard(save_mean.device());
  launch_stats_update(u, save_mean, save_invstd, eps, count);
}

// conv_bn_relu_apply_sums runs cbr_apply_sums_nhwc (one launch) unless
// CUDADOCTOR_OPS_CBR_SUMS_FUSED=0 (read once): then cbr_finalize_sums and cbr_apply_nhwc_v2.
bool sums_fused_enabled() {
  static const bool on = env_switch("CUDADOCTOR_OPS_CBR_SUMS_FUSED") != 0;
  return on;
}

// The apply from sums over conv_out l.x: cbr_apply_sums_nhwc_v4 where CUDADOCTOR_OPS_CBR_APPLY_V4
// asks for it and 2048 % C == 0; else, unless CUDADOCTOR_OPS_CBR_APPLY_ROUNDS=0,
// cbr_apply_sums_nhwc_v5 where 2048 % C == 0 (CUDADOCTOR_OPS_CBR_APPLY_V5 not 0) and
// cbr_apply_sums_nhwc_v3 elsewhere; else cbr_apply_sums_nhwc, false (nothing launched) where its cooperative launch
// (running statistics or num_batches_tracked to update) cannot be resident at once.
template <typename T>
bool launch_apply_sums(const Layout& l, const at::Tensor& out, const at::Tensor& mask,
                       const SumsArgs<float>& a) {
  using A = typename Acc<T>::type;
  static_assert(std::is_same<A, float>::value, "cbr_apply_sums_nhwc: float32 coefficients");
  ApplyPass<T> p(l, out, mask);  // not const: the cooperative launch takes its fields' addresses
  const int v4 = apply_v4_rounds();
  if (v4 != 0 && 2048 % p.C == 0) {
    auto* k4 = v4 == 2 ? (p.vec ? &cbr_apply_sums_nhwc_v4<T, true, 2> : &cbr_apply_sums_nhwc_v4<T, false, 2>)
                       : (p.vec ? &cbr_apply_sums_nhwc_v4<T, true, 4> : &cbr_apply_sums_nhwc_v4<T, false, 4>);
    const int64_t chunk = int64_t(v4) * kThreads;
    const unsigned blocks = static_cast<unsigned>(std::max<int64_t>(1, (p.nfull + chunk - 1) / chunk));
    const bool upd = a.nbt != nullptr || (a.rmean != nullptr && a.rvar != nullptr);
    unsigned* counter = upd ? next_apply_counter(p.device) : nullptr;
    SumsArgs<A> args = a;
    k4<<<blocks, kThreads, size_t(p.C) * sizeof(Coef4<A>), p.stream>>>(
        p.x, p.y, p.mask, args, p.nfull, p.tail, p.C, p.mask_words, counter);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return true;
  }
  if (apply_rounds_enabled() && apply_v5_enabled() && 2048 % p.C == 0) {
    auto* k5 = p.vec ? &cbr_apply_sums_nhwc_v5<T, true> : &cbr_apply_sums_nhwc_v5<T, false>;
    const FlatPlan ap = p.plan(k5);
    // 2048 % C == 0: the channel period divides kThreads, so S is a whole number of blocks
    TORCH_INTERNAL_ASSERT(ap.S == int64_t(ap.blocks) * kThreads, "cbr_apply_sums_nhwc_v5: grid");
    const bool upd = a.nbt != nullptr || (a.rmean != nullptr && a.rvar != nullptr);
    unsigned* counter = upd ? next_apply_counter(p.device) : nullptr;
    SumsArgs<A> args = a;
    k5<<<ap.blocks, kThreads, size_t(p.C) * sizeof(Coef4<A>), p.stream>>>(
        p.x, p.y, p.mask, args, p.nfull, p.tail, static_cast<int>(ap.S), p.C, p.mask_words, counter);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return true;
  }
  if (apply_rounds_enabled()) {
    auto* k3 = p.vec ? &cbr_apply_sums_nhwc_v3<T, true> : &cbr_apply_sums_nhwc_v3<T, false>;
    const FlatPlan ap = p.plan(k3);
    const bool upd = a.nbt != nullptr || (a.rmean != nullptr && a.rvar != nullptr);
    unsigned* counter = upd ? next_apply_counter(p.device) : nullptr;
    SumsArgs<A> args = a;
    k3<<<ap.blocks, kThreads, 0, p.stream>>>(p.x, p.y, p.mask, args, p.nfull, p.tail,
                                             static_cast<int>(ap.S), p.C, p.mask_words, counter);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return true;
  }
  auto* kernel = p.vec ? &cbr_apply_sums_nhwc<T, true> : &cbr_apply_sums_nhwc<T, false>;
  // at most one wave of resident blocks, as a cooperative launch needs
  const FlatPlan ap = p.plan(kernel);
  int S = static_cast<int>(ap.S);
  bool update = a.nbt != nullptr || (a.rmean != nullptr && a.rvar != nullptr);
  SumsArgs<A> args = a;
  if (!update) {
    kernel<<<ap.blocks, kThreads, 0, p.stream>>>(p.x, p.y, p.mask, args, p.nfull, p.tail, S, p.C,
                                                 p.mask_words, update);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return true;
  }
  if (!bn::cooperative_ok(p.device)) return false;
  void* kargs[] = {&p.x, &p.y, &p.mask, &args, &p.nfull, &p.tail, &S, &p.C, &p.mask_words, &update};
  return bn::launch_cooperative(reinterpret_cast<const void*>(kernel), dim3(ap.blocks),
                                dim3(kThreads), kargs, 0, p.stream);
}

// BatchNorm + ReLU of the training forward from the convolution's sums (see
// conv_bn_relu_apply_sums) into out, save_mean, save_invstd and mask (allocated by the caller);
// the running statistics of u (none where undefined) updated. l: the channels_last conv_out.
void apply_sums_into(const Layout& l, const at::Tensor& sums, const at::Tensor& w,
                     const at::Tensor& b, const StatsUpdate& u, double eps, bool shifted,
                     at::Tensor& out, at::Tensor& save_mean, at::Tensor& save_invstd,
                     at::Tensor& mask) {
  const double momentum = u.momentum;
  const bool stats = u.rm.defined();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(l.x.get_device()).stream();
  if (sums_fused_enabled()) {
    SumsArgs<float> a;
    a.sums = sums.data_ptr<float>();
    a.C = l.C;
    a.count = l.N * l.HW;
    a.eps = eps;
    a.weight = bn::param_ptr(w);
    a.wkind = bn::param_kind(w);
    a.bias = bn::param_ptr(b);
    a.bkind = bn::param_kind(b);
    a.rmean = stats ? u.rm.data_ptr() : nullptr;
    a.mkind = stats ? bn::param_kind(u.rm) : bn::kAbsent;
    a.rvar = stats ? u.rv.data_ptr() : nullptr;
    a.vkind = stats ? bn::param_kind(u.rv) : bn::kAbsent;
    a.nbt = u.nbt.defined() ? u.nbt.data_ptr<int64_t>() : nullptr;
    a.momentum = momentum;
    a.shifted = shifted;
    a.save_mean = save_mean.data_ptr<float>();
    a.save_invstd = save_invstd.data_ptr<float>();
    bool done = false;
    if (l.x.scalar_type() == at::kHalf) {
      done = launch_apply_sums<c10::Half>(l, out, mask, a);
    } else if (l.x.scalar_type() == at::kBFloat16) {
      done = launch_apply_sums<c10::BFloat16>(l, out, mask, a);
    } else {
      done = launch_apply_sums<float>(l, out, mask, a);
    }
    if (done) return;
  }
  at::Tensor coef = at::empty({l.C * 4}, save_mean.options());
  auto* cp = reinterpret_cast<Coef4<float>*>(coef.data_ptr<float>());
  cbr_finalize_sums<float><<<1, 1024, 0, stream>>>(
      sums.data_ptr<float>(), l.C, l.N * l.HW, eps, bn::param_ptr(w), bn::param_kind(w),
      bn::param_ptr(b), bn::param_kind(b), stats ? u.rm.data_ptr() : nullptr,
      stats ? bn::param_kind(u.rm) : bn::kAbsent, stats ? u.rv.data_ptr() : nullptr,
      stats ? bn::param_kind(u.rv) : bn::kAbsent,
      u.nbt.defined() ? u.nbt.data_ptr<int64_t>() : nullptr, momentum, shifted,
      save_mean.data_ptr<float>(), save_invstd.data_ptr<float>(), cp);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (l.x.scalar_type() == at::kHalf) {
    launch_apply_v2<c10::Half>(l, out, mask, cp);
  } else if (l.x.scalar_type() == at::kBFloat16) {
    launch_apply_v2<c10::BFloat16>(l, out, mask, cp);
  } else {
    launch_apply_v2<float>(l, out, mask, cp);
  }
}

// The training forward's BatchNorm + ReLU from statistics the convolution computed (see
// cbr_finalize_sums): one single-block finalize + running-statistics update, then ONE pass of
// cbr_apply_nhwc_v2 over the channels_last conv_out. -> (out, save_mean, save_invstd, mask), the
// same tensors conv_bn_relu_train returns, so conv_bn_relu_backward takes them as they are.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> conv_bn_relu_apply_sums_cuda(
    const at::Tensor& conv_out, const at::Tensor& sums, const std::optional<at::Tensor>& bn_weight,
    const std::optional<at::Tensor>& bn_bias, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var,
    const std::optional<at::Tensor>& num_batches_tracked, double momentum, double eps,
    bool shifted) {
  constexpr const char* op = "cudadoctor_ops.conv_bn_relu_apply_sums";
  TORCH_CHECK(conv_out.is_cuda() && conv_out.dim() >= 3, op,
              ": conv_out must be a CUDA tensor (N, C, H, ...), got ", conv_out.sizes(), " on ",
              conv_out.device());
  const auto st = conv_out.scalar_type();
  TORCH_CHECK(st == at::kHalf || st == at::kBFloat16 || st == at::kFloat, op,
              ": conv_out must be float16, bfloat16 or float32, got ", st);
  TORCH_CHECK(eps >= 0, op, ": eps must be >= 0, got ", eps);
  c10::cuda::CUDAGuard guard(conv_out.device());
  Layout l = bn::make_layout(conv_out);
  TORCH_CHECK(l.x.is_same(conv_out) && l.nhwc && v2_fits(l) && l.C > 0, op,
              ": conv_out must be a channels_last tensor with channels (as the convolution wrote "
              "it), got sizes ", conv_out.sizes(), " strides ", conv_out.strides());
  const int64_t C = l.C;
  const int64_t count = l.N * l.HW;
  TORCH_CHECK(count > 1, op, ": expected more than 1 value per channel when training, got ",
              conv_out.sizes());
  TORCH_CHECK(sums.device() == conv_out.device() && sums.scalar_type() == at::kFloat &&
                  sums.is_contiguous() && sums.numel() == 2 * C,
              op, ": sums must be a contiguous float32 tensor of 2 x ", C, " values on ",
              conv_out.device(), " (per channel sum(y - shift), then sum((y - shift)^2)), got ",
              sums.sizes(), " ", sums.scalar_type(), " on ", sums.device());
  check_bn_param(op, bn_weight, "bn_weight", conv_out);
  check_bn_param(op, bn_bias, "bn_bias", conv_out);
  const StatsUpdate u = check_stats_update(op, running_mean, running_var, num_batches_tracked,
                                           conv_out.device(), C, momentum);
  TORCH_CHECK(!shifted || u.rm.defined(), op,
              ": shifted=True needs running_mean and running_var (the shift is running_mean "
              "before this step's update)");
  const auto acc_opts = conv_out.options().dtype(at::kFloat);
  at::Tensor out = at::empty_like(l.x);
  at::Tensor save_mean = at::empty({C}, acc_opts);
  at::Tensor save_invstd = at::empty({C}, acc_opts);
  at::Tensor mask = at::empty({mask_bytes(l.x.numel())}, conv_out.options().dtype(at::kByte));
  apply_sums_into(l, sums, bn::contig_param(bn_weight), bn::contig_param(bn_bias), u, eps, shifted,
                  out, save_mean, save_invstd, mask);
  return {out, save_mean, save_invstd, mask};
}

std::atomic<bool> g_cudnn_relu_failed{false};

// Inference: relu(conv(input, weight) + bias), one cuDNN launch where it can (impl 0), else the
// convolution and one in-place bias + ReLU epilogue (impl 1, and whenever cuDNN's fused engine
// does not apply). impl 2: the direct TF32 kernel of conv3x3_tf32.cu where it applies and torch
// lets cuDNN's convolutions use TF32 (torch.backends.cudnn.allow_tf32), else impl 0.
at::Tensor conv_bias_relu_cuda(const at::Tensor& input, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                               at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                               int64_t impl) {
  constexpr const char* op = "cudadoctor_ops.conv_bias_relu";
  check_common(op, input, weight, stride, padding, dilation, groups);
  TORCH_CHECK(impl >= 0 && impl <= 3, op,
              ": impl must be 0 (auto), 1 (epilogue kernel), 2 (direct TF32 kernel) or 3 (16-bit "
              "tensor-core kernel), got ", impl);
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0), op,
                ": bias must have shape [", weight.size(0), "], got ", bias->sizes());
    TORCH_CHECK(bias->device() == input.device(), op, ": bias is on ", bias->device(),
                " but input is on ", input.device());
    TORCH_CHECK(bias->scalar_type() == input.scalar_type() ||
                    bias->scalar_type() == at::kFloat,
                op, ": bias must have the input's dtype or float32, got ", bias->scalar_type());
  }
  c10::cuda::CUDAGuard guard(input.device());
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKeySet(c10::DispatchKey::AutocastCUDA));
  const auto st = input.scalar_type();
  if (impl == 2) {
    if (tf32conv::tf32_allowed() &&
        tf32conv::applies(input, weight, stride, padding, dilation, groups))
      return tf32conv::conv3x3(input, weight, bias, true);
    impl = 0;
  }
  if (impl == 3) {
    if (hmmaconv::applies(input, weight, stride, padding, dilation, groups))
      return hmmaconv::conv3x3(input, weight, bias, true);
    impl = 0;
  }
  // cuDNN's fused conv+bias+ReLU engines: plain convolutions with tensor-core friendly channel
  // counts only; everything else (grouped, depthwise, odd channel counts, float64) takes the
  // epilogue path
  const bool cudnn_fusable = st != at::kDouble && groups == 1 && input.size(1) % 8 == 0 &&
                             weight.size(0) % 8 == 0;
  if (impl == 0 && cudnn_fusable && at::globalContext().userEnabledCuDNN() &&
      !g_cudnn_relu_failed.load()) {
    try {
      std::optional<at::Tensor> b;
      if (has_bias) b = bias->scalar_type() == st ? *bias : bias->to(st);
      return at::cudnn_convolution_relu(input, weight, b, stride, padding, dilation, groups);
    } catch (const c10::Error&) {
      // this cuDNN has no fused engine for it: use the epilogue path from now on
      g_cudnn_relu_failed.store(true);
    }
  }
  at::Tensor y = conv_forward(input, weight, std::nullopt, stride, padding, dilation, groups);
  Layout l = bn::make_layout(y);
  y = l.x;
  if (y.numel() == 0) return y;
  const auto acc_type = st == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor bacc = has_bias ? bias->to(acc_type).contiguous() : at::Tensor();
  const int device = y.get_device();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  const unsigned blocks = linear_blocks(y.numel(), device);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, st, "cbr_bias_relu", [&] {
    using acc_t = typename Acc<scalar_t>::type;
    const acc_t* bp = has_bias ? bacc.data_ptr<acc_t>() : nullptr;
    if (fast_groups(l, {y.data_ptr()})) {
      cbr_bias_relu<scalar_t, true><<<blocks, kThreads, 0, stream>>>(
          y.data_ptr<scalar_t>(), bp, y.numel(), channel_of(l));
    } else {
      cbr_bias_relu<scalar_t, false><<<blocks, kThreads, 0, stream>>>(
          y.data_ptr<scalar_t>(), bp, y.numel(), channel_of(l));
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
conv_bn_add_relu_backward_cuda(const at::Tensor& grad_out, const at::Tensor& input,
                               const at::Tensor& conv_weight, const at::Tensor& conv_out,
                               const std::optional<at::Tensor>& bn_weight,
                               const at::Tensor& save_mean, const at::Tensor& save_invstd,
                               const at::Tensor& mask, at::IntArrayRef stride,
                               at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                               std::array<bool, 5> output_mask) {
  at::Tensor res;
  auto [gi, gcw, gcb, gw, gb] =
      backward_impl("cudadoctor_ops.conv_bn_relu_backward", grad_out, input, conv_weight,
                    conv_out, bn_weight, save_mean, save_invstd, mask, stride, padding, dilation,
                    groups, output_mask, &res);
  return {gi, gcw, gcb, gw, gb, res};
}

TrainOut conv_bn_relu_train_update_cuda(const at::Tensor& input, const at::Tensor& conv_weight,
                                        const std::optional<at::Tensor>& conv_bias,
                                        const std::optional<at::Tensor>& bn_weight,
                                        const std::optional<at::Tensor>& bn_bias, double eps,
                                        at::IntArrayRef stride, at::IntArrayRef padding,
                                        at::IntArrayRef dilation, int64_t groups,
                                        const std::optional<at::Tensor>& running_mean,
                                        const std::optional<at::Tensor>& running_var,
                                        const std::optional<at::Tensor>& num_batches_tracked,
                                        double momentum) {
  constexpr const char* op = "cudadoctor_ops.conv_bn_relu";
  check_train_args(op, input, conv_weight, conv_bias, eps, stride, padding, dilation, groups);
  const StatsUpdate u =
      check_stats_update("cudadoctor_ops.conv_bn_relu_update_stats", running_mean, running_var,
                         num_batches_tracked, input.device(), conv_weight.size(0), momentum);
  return train_impl(op, input, conv_weight, conv_bias, bn_weight, bn_bias, eps, stride, padding,
                    dilation, groups, u.any() ? &u : nullptr);
}

// -> (out, conv_out, save_mean, save_invstd, mask) of relu(bn(conv(input)) + residual)
TrainOut conv_bn_add_relu_train_cuda(const at::Tensor& input, const at::Tensor& conv_weight,
                                     const std::optional<at::Tensor>& conv_bias,
                                     const std::optional<at::Tensor>& bn_weight,
                                     const std::optional<at::Tensor>& bn_bias,
                                     const at::Tensor& residual, double eps,
                                     at::IntArrayRef stride, at::IntArrayRef padding,
                                     at::IntArrayRef dilation, int64_t groups) {
  constexpr const char* op = "cudadoctor_ops.conv_bn_add_relu";
  check_train_args(op, input, conv_weight, conv_bias, eps, stride, padding, dilation, groups);
  return train_impl(op, input, conv_weight, conv_bias, bn_weight, bn_bias, eps, stride, padding,
                    dilation, groups, nullptr, &residual);
}

// grad_out where the mask (of conv_out's elements, memory order) is set, else 0; in conv_out's
// layout.
at::Tensor relu_mask_grad_cuda(const at::Tensor& grad_out, const at::Tensor& conv_out,
                               const at::Tensor& mask) {
  constexpr const char* op = "cudadoctor_ops.relu_mask_grad";
  TORCH_CHECK(grad_out.sizes() == conv_out.sizes() &&
                  grad_out.scalar_type() == conv_out.scalar_type() &&
                  grad_out.device() == conv_out.device() && conv_out.is_cuda(),
              op, ": grad_out must match conv_out (", conv_out.sizes(), ", ",
              conv_out.scalar_type(), ", CUDA), got ", grad_out.sizes(), ", ",
              grad_out.scalar_type(), " on ", grad_out.device());
  TORCH_CHECK(mask.scalar_type() == at::kByte && mask.device() == conv_out.device() &&
                  mask.is_contiguous() && mask.numel() >= mask_bytes(conv_out.numel()),
              op, ": mask must be the uint8 mask returned with conv_out");
  c10::cuda::CUDAGuard guard(conv_out.device());
  Layout l = bn::make_layout(conv_out);
  TORCH_CHECK(l.x.is_same(conv_out), op,
              ": conv_out must be contiguous or channels_last as returned by the training op");
  const at::Tensor g = bn::like_layout(grad_out, l);
  at::Tensor out = at::empty_like(l.x);
  launch_mask_grad(g, mask, out);
  return out;
}

}  // namespace cbr
}  // namespace cudadoctor_ops

TORCH_LIBRARY_IMPL(cudadoctor_ops, CUDA, m) {
  m.impl("conv_bn_add_relu_train", &cudadoctor_ops::cbr::conv_bn_add_relu_train_cuda);
  m.impl("relu_mask_grad", &cudadoctor_ops::cbr::relu_mask_grad_cuda);
  m.impl("conv_bn_relu_train", &cudadoctor_ops::cbr::conv_bn_relu_train_cuda);
  m.impl("conv_bn_relu_backward", &cudadoctor_ops::cbr::conv_bn_relu_backward_cuda);
  m.impl("conv_bias_relu", &cudadoctor_ops::cbr::conv_bias_relu_cuda);
  m.impl("conv_bn_relu_update_stats", &cudadoctor_ops::cbr::conv_bn_relu_update_stats_cuda);
  m.impl("conv_bn_relu_apply_sums", &cudadoctor_ops::cbr::conv_bn_relu_apply_sums_cuda);
}
