// BatchNorm backward (training and eval, optional fused ReLU).
//
// bn_bwd_reduce_* : per channel slice, sums of g, g * c and c where c = x - save_mean and
//                   g = grad_out masked by the ReLU (recomputed from x) -> ws [C, splits, 3].
// bn_bwd_finalize : per channel: grad_weight, grad_bias and coef [C, 5] = (mean, A, B, D, E).
// bn_bwd_apply_*  : grad_input = A * g + B * c + D, with the ReLU mask y = c * A + E > 0.
// Summing c as well makes the result exact even though save_mean was rounded: the centred sum
// is sum(g * c) - mean(c) * sum(g).
// bn_bwd_fused_*  : the same three steps in ONE cooperative launch (grid barriers between them)
//                   for tensors small enough that x and grad_out stay in L2 in between.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cooperative_groups.h>
#include <type_traits>

#include "async_copy.cuh"
#include "batch_norm_common.cuh"

namespace cg = cooperative_groups;

namespace cudadoctor_ops {
namespace bn {
namespace {

// Per-channel values the reduce and apply passes need before the reduction: mean, A = w*invstd,
// E = bias - reserve * A (the ReLU threshold offset).
template <typename A>
struct ChannelPre {
  A mean, a, e;
};

template <typename A>
__device__ __forceinline__ ChannelPre<A> channel_pre(int64_t c, const A* save_mean,
                                                     const A* save_invstd, const A* reserve,
                                                     const void* weight, int wkind,
                                                     const void* bias, int bkind) {
  ChannelPre<A> p;
  p.mean = save_mean[c];
  p.a = load_param<A>(weight, wkind, c, A(1)) * save_invstd[c];
  p.e = load_param<A>(bias, bkind, c, A(0)) - reserve[c] * p.a;
  return p;
}

// Packs in flight per thread: each step loads two packs (x and grad), so 8-wide packs use 2.
template <int V>
struct BwdUnroll {
  static constexpr int value = V >= 8 ? 2 : kUnroll;
};

template <typename A>
__device__ __forceinline__ A masked(A g, A c, A a, A e, bool relu) {
  return (relu && !(c * a + e > A(0))) ? A(0) : g;
}

// ReLU gradient from a bit mask instead (Conv+BN+ReLU: bit k of mask byte j is 1 when element
// 8j + k, in memory order, was > 0 after the forward's ReLU input). The V bits of the pack at
// element offset `off` (a multiple of V, V a divisor of 8) are the low bits of mask_bits(off).
template <int V>
__device__ __forceinline__ unsigned mask_bits(const uint8_t* mask, int64_t off) {
  static_assert(8 % V == 0, "packs within one mask byte");
  return static_cast<unsigned>(mask[off >> 3]) >> static_cast<unsigned>(off & 7);
}

// g for element i of a pack: from the mask bits (M: the kernels' template parameter, true only
// for relu_mask_backward_cuda, so BatchNorm's own kernels compile as without a mask), else masked().
// NR ("no ReLU"): the launch knows that relu is false, so g passes unchanged and the kernel needs
// no registers for a and e.
template <bool M, typename A, bool NR = false>
__device__ __forceinline__ A gate(A g, A c, A a, A e, bool relu, const uint8_t* mask,
                                  unsigned bits, int i) {
  if constexpr (NR) return g;
  if constexpr (M) return ((bits >> i) & 1u) ? g : A(0);
  return masked(g, c, a, e, relu);
}

// Blocks per SM the channels-last reduce and apply kernels are compiled for (the register cap
// of __launch_bounds__): 2 in general (they hold V channels' worth of coefficients and sums per
// thread: 80-112 registers for 16-byte packs), 3 for float16 without ReLU (NR), where a and e
// drop out and ptxas (sm_90) fits both kernels in 80 registers without spills (78 and 80; for
// bfloat16 the apply spilled, so it stays at 2): 24 warps per SM instead of 16, so more loads in
// flight. CUDADOCTOR_OPS_BN_BWD_NR=0 runs the general kernels instead (read once).
template <typename T, bool NR>
struct BwdNhwcMinBlocks {
  static constexpr int value = (NR && std::is_same<T, c10::Half>::value) ? 3 : 2;
};

// x, dy: [N, C, HW]. The block reduces slice `split` of `splits` of channel c into ws:
// [C, splits, 3] = (sum g, sum g*c, sum c). kLoop: the caller loops over items with the same
// shared memory, so the item ends with a block barrier (a one-item kernel leaves it out).
template <typename T, int V, bool kLoop, bool M = false>
__device__ __forceinline__ void bwd_reduce_nchw_item(
    const T* __restrict__ x, const T* __restrict__ dy, typename Acc<T>::type* __restrict__ ws,
    int64_t N, int64_t C, int64_t HW, int64_t c, int64_t split, int splits,
    const typename Acc<T>::type* save_mean, const typename Acc<T>::type* save_invstd,
    const typename Acc<T>::type* reserve, const void* weight, int wkind, const void* bias,
    int bkind, bool relu, const uint8_t* mask) {
  using A = typename Acc<T>::type;
  constexpr int U = BwdUnroll<V>::value;
  const int64_t packs = N * (HW / V);
  const int64_t chunk = (packs + splits - 1) / splits;
  const int64_t begin = split * chunk;
  const int64_t end = begin + chunk < packs ? begin + chunk : packs;
  const int64_t stride = blockDim.x;
  const ChannelPre<A> pre =
      channel_pre<A>(c, save_mean, save_invstd, reserve, weight, wkind, bias, bkind);
  A sg = 0, sgc = 0, sc = 0;
  int64_t j = begin + threadIdx.x;
  if (j < end) {
    NchwWalk w(j, stride, c, C, HW, V);
    for (; j < end; j += U * stride) {
      Pack<T, V> px[U], pg[U];
      unsigned bits[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        bits[u] = 0;
        if (j + u * stride < end) {
          px[u] = *reinterpret_cast<const Pack<T, V>*>(x + w.off);
          pg[u] = *reinterpret_cast<const Pack<T, V>*>(dy + w.off);
          if constexpr (M) bits[u] = mask_bits<V>(mask, w.off);
        }
        w.advance();
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (j + u * stride < end) {
#pragma unroll
          for (int i = 0; i < V; ++i) {
            const A cx = static_cast<A>(px[u].v[i]) - pre.mean;
            const A g =
                gate<M>(static_cast<A>(pg[u].v[i]), cx, pre.a, pre.e, relu, mask, bits[u], i);
            sg += g;
            sgc += g * cx;
            sc += cx;
          }
        }
      }
    }
  }
  sg = warp_sum(sg);
  sgc = warp_sum(sgc);
  sc = warp_sum(sc);
  __shared__ A sm[3][kThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    sm[0][warp] = sg;
    sm[1][warp] = sgc;
    sm[2][warp] = sc;
  }
  __syncthreads();
  if (warp == 0) {
    const int nw = blockDim.x >> 5;
    sg = warp_sum(lane < nw ? sm[0][lane] : A(0));
    sgc = warp_sum(lane < nw ? sm[1][lane] : A(0));
    sc = warp_sum(lane < nw ? sm[2][lane] : A(0));
    if (lane == 0) {
      A* o = ws + (c * splits + split) * 3;
      o[0] = sg;
      o[1] = sgc;
      o[2] = sc;
    }
  }
  if (kLoop) __syncthreads();  // sm is rewritten by the next item
}

// grid (C, splits), block kThreads: one item per block.
template <typename T, int V, bool M = false>
__global__ void __launch_bounds__(kThreads, 2)
    bn_bwd_reduce_nchw(const T* __restrict__ x, const T* __restrict__ dy,
                       typename Acc<T>::type* __restrict__ ws, int64_t N, int64_t C, int64_t HW,
                       const typename Acc<T>::type* save_mean,
                       const typename Acc<T>::type* save_invstd,
                       const typename Acc<T>::type* reserve, const void* weight, int wkind,
                       const void* bias, int bkind, bool relu, const uint8_t* mask) {
  bwd_reduce_nchw_item<T, V, false, M>(x, dy, ws, N, C, HW, blockIdx.x, blockIdx.y, gridDim.y,
                                    save_mean, save_invstd, reserve, weight, wkind, bias, bkind,
                                    relu, mask);
}

// x, dy: [R, C]; block (TX, TY), grid (ceil(C/V/TX), splits). The block reduces its channels
// over the rows blockIdx.y * TY + threadIdx.y + k * splits * TY into ws [C, splits, 3].
// sm: TY * TX * V * 3 accumulators (dynamic shared memory).
template <typename T, int V, bool M = false, bool NR = false>
__device__ __forceinline__ void bwd_reduce_nhwc_block(
    const T* __restrict__ x, const T* __restrict__ dy, typename Acc<T>::type* __restrict__ ws,
    int64_t R, int64_t C, const typename Acc<T>::type* save_mean,
    const typename Acc<T>::type* save_invstd, const typename Acc<T>::type* reserve,
    const void* weight, int wkind, const void* bias, int bkind, bool relu, const uint8_t* mask,
    typename Acc<T>::type* sm) {
  using A = typename Acc<T>::type;
  constexpr int U = BwdUnroll<V>::value;
  const int64_t Cv = C / V;
  const int64_t cv = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool active = cv < Cv;
  const int splits = gridDim.y;
  A mean[V], a[V], e[V], sg[V], sgc[V], sc[V];
#pragma unroll
  for (int i = 0; i < V; ++i) {
    sg[i] = 0;
    sgc[i] = 0;
    sc[i] = 0;
    mean[i] = 0;
    a[i] = 0;
    e[i] = 0;
  }
  if (active) {
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const ChannelPre<A> pre = channel_pre<A>(cv * V + i, save_mean, save_invstd, reserve,
                                               weight, wkind, bias, bkind);
      mean[i] = pre.mean;
      a[i] = pre.a;
      e[i] = pre.e;
    }
    const int64_t rstride = int64_t(gridDim.y) * blockDim.y;
    for (int64_t r = int64_t(blockIdx.y) * blockDim.y + threadIdx.y; r < R;
         r += U * rstride) {
      Pack<T, V> px[U], pg[U];
      unsigned bits[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        bits[u] = 0;
        if (r + u * rstride < R) {
          const int64_t off = (r + u * rstride) * C + cv * V;
          px[u] = *reinterpret_cast<const Pack<T, V>*>(x + off);
          pg[u] = *reinterpret_cast<const Pack<T, V>*>(dy + off);
          if constexpr (M) bits[u] = mask_bits<V>(mask, off);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (r + u * rstride < R) {
#pragma unroll
          for (int i = 0; i < V; ++i) {
            const A cx = static_cast<A>(px[u].v[i]) - mean[i];
            const A g =
                gate<M, A, NR>(static_cast<A>(pg[u].v[i]), cx, a[i], e[i], relu, mask, bits[u], i);
            sg[i] += g;
            sgc[i] += g * cx;
            sc[i] += cx;
          }
        }
      }
    }
  }
  const int tx = threadIdx.x, TX = blockDim.x;
  auto slot = [&](int ty, int i, int k) -> A& { return sm[((ty * TX + tx) * V + i) * 3 + k]; };
#pragma unroll
  for (int i = 0; i < V; ++i) {
    slot(threadIdx.y, i, 0) = sg[i];
    slot(threadIdx.y, i, 1) = sgc[i];
    slot(threadIdx.y, i, 2) = sc[i];
  }
  __syncthreads();
  for (int s = blockDim.y >> 1; s > 0; s >>= 1) {
    if (threadIdx.y < s) {
#pragma unroll
      for (int i = 0; i < V; ++i)
#pragma unroll
        for (int k = 0; k < 3; ++k) slot(threadIdx.y, i, k) += slot(threadIdx.y + s, i, k);
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

// dynamic smem TY*TX*V*3 sums.
template <typename T, int V, bool M = false, bool NR = false>
__global__ void __launch_bounds__(kThreads, BwdNhwcMinBlocks<T, NR>::value)
    bn_bwd_reduce_nhwc(const T* __restrict__ x, const T* __restrict__ dy,
                       typename Acc<T>::type* __restrict__ ws, int64_t R, int64_t C,
                       const typename Acc<T>::type* save_mean,
                       const typename Acc<T>::type* save_invstd,
                       const typename Acc<T>::type* reserve, const void* weight, int wkind,
                       const void* bias, int bkind, bool relu, const uint8_t* mask) {
  extern __shared__ unsigned char smem_raw[];
  bwd_reduce_nhwc_block<T, V, M, NR>(x, dy, ws, R, C, save_mean, save_invstd, reserve, weight,
                                     wkind, bias, bkind, relu, mask,
                                     reinterpret_cast<typename Acc<T>::type*>(smem_raw));
}

// What it takes to finish a channel of the backward: the partial sums ws [C, splits, 3] (null
// with splits == 0 when no reduction was needed: eval without parameter grads), the saved
// statistics, the affine parameters and where the parameter grads go (null: not wanted).
template <typename A>
struct BwdArgs {
  const A* ws;
  int splits;
  int64_t count;  // values per channel
  bool training;
  const A* save_mean;
  const A* save_invstd;
  const A* reserve;
  const void* weight;
  int wkind;
  const void* bias;
  int bkind;
  void* grad_weight;
  int gwkind;
  void* grad_bias;
  int gbkind;
  const uint8_t* mask;  // ReLU gradient from these bits instead of `relu` (null: none)
};

// Lane 0 of the calling warp gets channel c's (sum g, sum g*c, sum c); `lane` is the caller's
// lane (from the linear thread index in 2-D blocks).
template <typename A>
__device__ __forceinline__ void warp_sum_partials(const BwdArgs<A>& f, int64_t c, int lane, A& sg,
                                                  A& sgc, A& sc) {
  sg = 0;
  sgc = 0;
  sc = 0;
  for (int s = lane; s < f.splits; s += 32) {
    const A* p = f.ws + (c * f.splits + s) * 3;
    sg += p[0];
    sgc += p[1];
    sc += p[2];
  }
  sg = warp_sum(sg);
  sgc = warp_sum(sgc);
  sc = warp_sum(sc);
}

// coef = (mean, A, B, D, E) of channel c: grad_input = A * g + B * (x - mean) + D, ReLU mask
// (x - mean) * A + E > 0. Stores the parameter grads when `store`.
template <typename A>
__device__ __forceinline__ void finish_bwd_channel(const BwdArgs<A>& f, int64_t c, A sg, A sgc,
                                                   A sc, bool store, A* coef) {
  const ChannelPre<A> pre = channel_pre<A>(c, f.save_mean, f.save_invstd, f.reserve, f.weight,
                                           f.wkind, f.bias, f.bkind);
  const A invstd = f.save_invstd[c];
  const A M = static_cast<A>(f.count);
  A mc = 0, S = sgc;
  if (f.training) {
    mc = sc / M;
    S = sgc - mc * sg;  // sum of g * (x - true mean)
  }
  if (store && f.grad_weight != nullptr) store_param<A>(f.grad_weight, f.gwkind, c, S * invstd);
  if (store && f.grad_bias != nullptr) store_param<A>(f.grad_bias, f.gbkind, c, sg);
  A B = 0, D = 0;
  if (f.training) {
    B = -pre.a * invstd * invstd * S / M;
    D = -pre.a * sg / M - B * mc;
  }
  coef[0] = pre.mean;
  coef[1] = pre.a;
  coef[2] = B;
  coef[3] = D;
  coef[4] = pre.e;
}

// One warp per channel: parameter grads and coef [C, 5] (channels-last, or no grad_input).
template <typename A>
__global__ void bn_bwd_finalize(BwdArgs<A> f, int64_t C, A* __restrict__ coef) {
  const int64_t c = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (c >= C) return;
  A sg, sgc, sc;
  warp_sum_partials(f, c, int(threadIdx.x & 31), sg, sgc, sc);
  if ((threadIdx.x & 31) != 0) return;
  finish_bwd_channel(f, c, sg, sgc, sc, true, coef + c * 5);
}

// As bn_bwd_finalize with one block of kFinThreads per channel (grid C; see kFinThreads).
template <typename A>
__global__ void __launch_bounds__(kFinThreads)
    bn_bwd_finalize_blk(BwdArgs<A> f, A* __restrict__ coef) {
  constexpr int W = kFinThreads / 32;
  __shared__ A sh[3][W];
  const int64_t c = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  A sg = 0, sgc = 0, sc = 0;
  const auto add = [&](A g, A gc, A cc) {
    sg += g;
    sgc += gc;
    sc += cc;
  };
  for_partials<kFinBatch, true>(f.ws + c * f.splits * 3, f.splits, int(threadIdx.x), kFinThreads,
                                add);
  sg = warp_sum(sg);
  sgc = warp_sum(sgc);
  sc = warp_sum(sc);
  if (lane == 0) {
    sh[0][warp] = sg;
    sh[1][warp] = sgc;
    sh[2][warp] = sc;
  }
  __syncthreads();
  if (warp != 0) return;
  sg = warp_sum(lane < W ? sh[0][lane] : A(0));
  sgc = warp_sum(lane < W ? sh[1][lane] : A(0));
  sc = warp_sum(lane < W ? sh[2][lane] : A(0));
  if (lane == 0) finish_bwd_channel(f, c, sg, sgc, sc, true, coef + c * 5);
}

// x, dy, dx: [N, C, HW]. The block applies slice `split` of `splits` of channel c. Warp 0
// finishes the channel first from the f.splits partials; split 0 stores the parameter grads.
// need_x: false only for eval without ReLU. kLoop: as bwd_reduce_nchw_item (the barrier costs
// the one-item kernel registers).
template <typename T, int V, bool kLoop, bool M = false>
__device__ __forceinline__ void bwd_apply_nchw_item(const T* __restrict__ x,
                                                    const T* __restrict__ dy,
                                                    T* __restrict__ dx,
                                                    const BwdArgs<typename Acc<T>::type>& f,
                                                    int64_t N, int64_t C, int64_t HW, int64_t c,
                                                    int64_t split, int splits, bool relu,
                                                    bool need_x) {
  using A = typename Acc<T>::type;
  constexpr int U = BwdUnroll<V>::value;
  __shared__ A sh[5];
  if (threadIdx.x < 32) {
    A sg, sgc, sc;
    warp_sum_partials(f, c, int(threadIdx.x), sg, sgc, sc);
    if (threadIdx.x == 0) finish_bwd_channel(f, c, sg, sgc, sc, split == 0, sh);
  }
  __syncthreads();
  const A mean = sh[0], a = sh[1], B = sh[2], D = sh[3], e = sh[4];
  const int64_t packs = N * (HW / V);
  const int64_t chunk = (packs + splits - 1) / splits;
  const int64_t begin = split * chunk;
  const int64_t end = begin + chunk < packs ? begin + chunk : packs;
  const int64_t stride = blockDim.x;
  // backwards through the slice: the reduce pass read its end last
  int64_t j = end - 1 - threadIdx.x;
  if (j >= begin) {
    NchwWalk w(j, stride, c, C, HW, V);
    for (; j >= begin; j -= U * stride) {
      Pack<T, V> px[U], pg[U];
      int64_t off[U];
      unsigned bits[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        off[u] = w.off;
        bits[u] = 0;
        if (j - u * stride >= begin) {
          if (need_x) px[u] = *reinterpret_cast<const Pack<T, V>*>(x + w.off);
          pg[u] = *reinterpret_cast<const Pack<T, V>*>(dy + w.off);
          if constexpr (M) bits[u] = mask_bits<V>(f.mask, w.off);
        }
        w.retreat();
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (j - u * stride >= begin) {
          Pack<T, V> o;
#pragma unroll
          for (int i = 0; i < V; ++i) {
            const A cx = need_x ? static_cast<A>(px[u].v[i]) - mean : A(0);
            const A g = gate<M>(static_cast<A>(pg[u].v[i]), cx, a, e, relu, f.mask, bits[u], i);
            o.v[i] = static_cast<T>(a * g + B * cx + D);
          }
          *reinterpret_cast<Pack<T, V>*>(dx + off[u]) = o;
        }
      }
    }
  }
  if (kLoop) __syncthreads();  // sh is rewritten by the next item
}

// grid (C, splits of the apply), block kThreads; the last channels first (still in L2).
template <typename T, int V, bool M = false>
__global__ void __launch_bounds__(kThreads, 2)
    bn_bwd_apply_nchw(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ dx,
                      BwdArgs<typename Acc<T>::type> f, int64_t N, int64_t C, int64_t HW,
                      bool relu, bool need_x) {
  bwd_apply_nchw_item<T, V, false, M>(x, dy, dx, f, N, C, HW, int64_t(gridDim.x) - 1 - blockIdx.x,
                                   blockIdx.y, gridDim.y, relu, need_x);
}

// The channels-last apply passes: coef [C, 5] = (mean, A, B, D, E) of the thread's V channels
// cv*V.. (see finish_bwd_channel), and grad_input of one pack from x, grad_out and the mask bits.
template <typename A, int V>
__device__ __forceinline__ void load_bwd_coef(const A* coef, int64_t cv, A (&mean)[V], A (&a)[V],
                                              A (&B)[V], A (&D)[V], A (&e)[V]) {
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const A* q = coef + (cv * V + i) * 5;
    mean[i] = q[0];
    a[i] = q[1];
    B[i] = q[2];
    D[i] = q[3];
    e[i] = q[4];
  }
}

template <bool M, typename T, int V, typename A, bool NR = false>
__device__ __forceinline__ Pack<T, V> bwd_dx_pack(const Pack<T, V>& px, const Pack<T, V>& pg,
                                                  unsigned bits, const A (&mean)[V],
                                                  const A (&a)[V], const A (&B)[V],
                                                  const A (&D)[V], const A (&e)[V], bool relu,
                                                  bool need_x, const uint8_t* mask) {
  Pack<T, V> o;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const A cx = need_x ? static_cast<A>(px.v[i]) - mean[i] : A(0);
    const A g = gate<M, A, NR>(static_cast<A>(pg.v[i]), cx, a[i], e[i], relu, mask, bits, i);
    o.v[i] = static_cast<T>(a[i] * g + B[i] * cx + D[i]);
  }
  return o;
}

// x, dy, dx: [R, C]; block/grid like bn_bwd_reduce_nhwc. With the mask (M) and dres not null it
// also writes dres = dy where the mask bit is set, else 0 (the gradient that reaches the residual
// of Conv+BN+Add+ReLU), from the dy and mask it loads anyway.
template <typename T, int V, bool M = false, bool NR = false>
__global__ void __launch_bounds__(kThreads, BwdNhwcMinBlocks<T, NR>::value)
    bn_bwd_apply_nhwc(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ dx,
                      const typename Acc<T>::type* __restrict__ coef, int64_t R, int64_t C,
                      bool relu, bool need_x, const uint8_t* mask, T* __restrict__ dres) {
  using A = typename Acc<T>::type;
  constexpr int U = BwdUnroll<V>::value;
  const int64_t Cv = C / V;
  const int64_t cv = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (cv >= Cv) return;
  A mean[V], a[V], B[V], D[V], e[V];
  load_bwd_coef<A, V>(coef, cv, mean, a, B, D, e);
  const int64_t rstride = int64_t(gridDim.y) * blockDim.y;
  for (int64_t r = int64_t(blockIdx.y) * blockDim.y + threadIdx.y; r < R; r += U * rstride) {
    Pack<T, V> px[U], pg[U];
    unsigned bits[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      bits[u] = 0;
      if (r + u * rstride < R) {
        const int64_t off = (R - 1 - r - u * rstride) * C + cv * V;  // last rows first
        if (need_x) px[u] = *reinterpret_cast<const Pack<T, V>*>(x + off);
        pg[u] = *reinterpret_cast<const Pack<T, V>*>(dy + off);
        if constexpr (M) bits[u] = mask_bits<V>(mask, off);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (r + u * rstride < R) {
        const int64_t off = (R - 1 - r - u * rstride) * C + cv * V;
        *reinterpret_cast<Pack<T, V>*>(dx + off) =
            bwd_dx_pack<M, T, V, A, NR>(px[u], pg[u], bits[u], mean, a, B, D, e, relu, need_x,
                                        mask);
        if constexpr (M) {
          if (dres != nullptr) {
            Pack<T, V> o;
#pragma unroll
            for (int i = 0; i < V; ++i) o.v[i] = ((bits[u] >> i) & 1u) ? pg[u].v[i] : T(0);
            *reinterpret_cast<Pack<T, V>*>(dres + off) = o;
          }
        }
      }
    }
  }
}

// Blocks per SM the one-launch kernels are compiled for (the register cap of __launch_bounds__):
// the most at which ptxas (sm_90) keeps them free of spills. More resident blocks make a larger
// cooperative grid, so more loads in flight.
template <typename T, int V>
struct FusedNchwMinBlocks {
  static constexpr int value = sizeof(T) == 8 ? 2 : (V == 1 ? 4 : 3);
};
template <typename T, int V>
struct FusedNhwcMinBlocks {
  static constexpr int value = (sizeof(T) < 8 && V == 1) ? 4 : 2;
};

// Contiguous (NCHW) backward of a small tensor in ONE cooperative launch (every block resident):
// the items (channel, slice) are dealt to the blocks round-robin; reduce partials of every item
// -> grid barrier -> each block finishes and applies its items in reverse order (most recently
// read first, still in L2). f.ws == ws with f.splits slices per channel. Saves the apply launch
// and its gap.
template <typename T, int V, bool M = false>
__global__ void __launch_bounds__(kThreads, FusedNchwMinBlocks<T, V>::value)
    bn_bwd_fused_nchw(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ dx,
                      BwdArgs<typename Acc<T>::type> f, typename Acc<T>::type* ws, int64_t N,
                      int64_t C, int64_t HW, bool relu, bool need_x) {
  cg::grid_group grid = cg::this_grid();
  const int splits = f.splits;
  const int64_t items = C * splits;
  const int64_t G = gridDim.x;
  for (int64_t it = blockIdx.x; it < items; it += G)
    bwd_reduce_nchw_item<T, V, true, M>(x, dy, ws, N, C, HW, it / splits, it % splits, splits,
                                     f.save_mean, f.save_invstd, f.reserve, f.weight, f.wkind,
                                     f.bias, f.bkind, relu, f.mask);
  grid.sync();
  if (int64_t(blockIdx.x) >= items) return;
  const int64_t last = blockIdx.x + ((items - 1 - blockIdx.x) / G) * G;
  for (int64_t it = last; it >= 0; it -= G)
    bwd_apply_nchw_item<T, V, true, M>(x, dy, dx, f, N, C, HW, it / splits, it % splits, splits,
                                    relu, need_x);
}

// Channels-last backward of a small tensor in ONE cooperative launch (every block resident):
// reduce partials as bn_bwd_reduce_nhwc -> grid barrier -> every warp of the grid finishes
// channels (parameter grads, coef [C, 5]) -> grid barrier -> each block applies grad_input to
// the rows it reduced, last rows first (still in L2). Same grid, block and shared memory as
// bn_bwd_reduce_nhwc; f.ws == ws with f.splits == gridDim.y. Saves the finalize and apply
// launches and their gaps.
template <typename T, int V, bool M = false>
__global__ void __launch_bounds__(kThreads, FusedNhwcMinBlocks<T, V>::value)
    bn_bwd_fused_nhwc(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ dx,
                      BwdArgs<typename Acc<T>::type> f, typename Acc<T>::type* ws,
                      typename Acc<T>::type* coef, int64_t R, int64_t C, bool relu,
                      bool need_x) {
  using A = typename Acc<T>::type;
  constexpr int U = BwdUnroll<V>::value;
  extern __shared__ unsigned char smem_raw[];
  cg::grid_group grid = cg::this_grid();
  bwd_reduce_nhwc_block<T, V, M>(x, dy, ws, R, C, f.save_mean, f.save_invstd, f.reserve, f.weight,
                              f.wkind, f.bias, f.bkind, relu, f.mask,
                              reinterpret_cast<A*>(smem_raw));
  grid.sync();
  {
    // channel finishing: one warp per channel over the whole grid
    const GridWarps gw = grid_warps();
    const int lane = gw.lane;
    for (int64_t c = gw.first; c < C; c += gw.stride) {
      A sg, sgc, sc;
      warp_sum_partials(f, c, lane, sg, sgc, sc);
      if (lane == 0) finish_bwd_channel(f, c, sg, sgc, sc, true, coef + c * 5);
    }
  }
  grid.sync();
  const int64_t Cv = C / V;
  const int64_t cv = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (cv >= Cv) return;
  A mean[V], a[V], B[V], D[V], e[V];
  load_bwd_coef<A, V>(coef, cv, mean, a, B, D, e);
  // the rows this thread reduced, last ones first (most recently read)
  const int64_t rstride = int64_t(gridDim.y) * blockDim.y;
  const int64_t r0 = int64_t(blockIdx.y) * blockDim.y + threadIdx.y;
  if (r0 >= R) return;
  const int64_t last = r0 + ((R - 1 - r0) / rstride) * rstride;
  for (int64_t r = last; r >= r0; r -= U * rstride) {
    Pack<T, V> px[U], pg[U];
    unsigned bits[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      bits[u] = 0;
      if (r - u * rstride >= r0) {
        const int64_t off = (r - u * rstride) * C + cv * V;
        if (need_x) px[u] = *reinterpret_cast<const Pack<T, V>*>(x + off);
        pg[u] = *reinterpret_cast<const Pack<T, V>*>(dy + off);
        if constexpr (M) bits[u] = mask_bits<V>(f.mask, off);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (r - u * rstride >= r0) {
        *reinterpret_cast<Pack<T, V>*>(dx + (r - u * rstride) * C + cv * V) =
            bwd_dx_pack<M, T, V>(px[u], pg[u], bits[u], mean, a, B, D, e, relu, need_x, f.mask);
      }
    }
  }
}

// ---- bn_bwd_tile_nhwc: the channel-tiled, register-resident channels-last backward ----
//
// One cooperative launch with ONE grid barrier, laid out as bn_tile_nhwc (the forward): channels
// in tiles of CT, TX = CT / V packs of V = 8 channels (16-bit types), block (TX, TY = 256 / TX),
// grid (tiles, splits); thread (tx, ty) of block (tile, s) owns pack cv = tile * TX + tx in rows
// r_k = s * TY + ty + k * splits * TY, k < BwdTileMaxR (the launcher keeps every row some
// thread's).
//   Phase 1: the thread loads all its packs of x and grad_out (and mask bytes) at once, keeps them
//   in registers (grad_out with the mask applied, M) and sums g, g * c, c (c = x - save_mean) per
//   channel; the block adds its rows (shuffles inside each warp, then the warps' sums through
//   shared memory in a fixed order) into one partial per channel, ws [tiles][splits][3][CT].
//   Grid barrier.
//   Phase 2: EVERY block adds the `splits` partials of its own tile in one fixed order (so the
//   blocks of a tile compute the same coefficients bit for bit) and finishes its channels with
//   finish_bwd_channel; only the blocks with s == 0 store grad_weight / grad_bias.
//   Phase 3: grad_input = A * g + B * c + D from the packs still in registers.
// Against bn_bwd_fused_nhwc: one grid barrier instead of two, no warp-per-channel finishing
// phase over the whole grid, x and grad_out read from memory once. Variants: SR > 0 keeps SR more
// rows per thread in shared memory (the stash); ST > 0 (the streamed variant, with the stash)
// also takes rows beyond registers and stash, reading them in phase 1 and again in phase 3.
// For the gradient of a ReLU only the mask (M) is taken: the ReLU test recomputed from x
// (BatchNorm's activation="relu") stays on the other kernels.
constexpr int kBwdTileThreads = 256;
// Rows (a pack of x and one of grad_out each) a thread holds in registers: 8 (ptxas, sm_90:
// 127-128 registers; float16 spills nothing), 6 for bfloat16 with the mask (124 bytes spilled at
// 8, 40 at 6), 5 for bfloat16 with the mask in the stash variant (4 bytes spilled; bfloat16
// without the mask spills 16 bytes there).
// The streamed variant (ST > 0, tensors whose rows no resident grid holds on chip): 4 rows in
// registers, kBwdStreamStashRows in shared memory, the rest read in phase 1 and again in phase 3,
// ST rows per batch (see bn_bwd_tile_nhwc).
constexpr int kBwdStreamRegRows = 4;
template <typename T, bool M, int SR = 0, int ST = 0>
struct BwdTileMaxR {
  static constexpr int value =
      ST > 0 ? kBwdStreamRegRows
             : ((M && std::is_same<T, c10::BFloat16>::value) ? (SR > 0 ? 5 : 6) : 8);
};
constexpr int kBwdTileMB = 8;     // partials a thread loads at once in phase 2
constexpr int kBwdTileMaxSplits = 256;

// For every channel j < CT: adds the P sums red[k][j][0 .. P-1] (k: sum g, sum g * c, sum c), P
// consecutive lanes per channel (P divides 32) and a shuffle tree in a fixed order; emit(j, s0,
// s1, s2) runs on the first lane of the channel's lanes. Every thread of the block calls it
// (CT * P is a multiple of 32: the loop is warp-uniform). The sums' counterpart of
// tile_merge_slots (bn_tile_nhwc's Welford merges).
template <typename A, int CT, int P, int THREADS, int P1, typename F>
__device__ __forceinline__ void tile_sum_slots(const A (&red)[3][CT][P1], int tid, F&& emit) {
  static_assert(32 % P == 0 && (CT * P) % 32 == 0 && P < P1, "slots of tile_sum_slots");
  for (int q = tid; q < CT * P; q += THREADS) {
    const int j = q / P, w = q % P;
    A s0 = red[0][j][w], s1 = red[1][j][w], s2 = red[2][j][w];
#pragma unroll
    for (int o = P / 2; o > 0; o >>= 1) {
      s0 += __shfl_down_sync(0xffffffffu, s0, o);
      s1 += __shfl_down_sync(0xffffffffu, s1, o);
      s2 += __shfl_down_sync(0xffffffffu, s2, o);
    }
    if (w == 0) emit(j, s0, s1, s2);
  }
}

// grad_out's pack with the mask bits applied on its raw 32-bit words (+0.0 where a bit is clear).
template <typename T, int V>
__device__ __forceinline__ void mask_pack(Pack<T, V>& pg, unsigned bits) {
  static_assert(sizeof(T) == 2 && V % 2 == 0, "16-bit packs");
  uint32_t w[V / 2];
  memcpy(w, &pg, sizeof(w));
#pragma unroll
  for (int k = 0; k < V / 2; ++k) {
    const uint32_t lo = 0u - ((bits >> (2 * k)) & 1u);
    const uint32_t hi = 0u - ((bits >> (2 * k + 1)) & 1u);
    w[k] &= (lo & 0xffffu) | (hi << 16);
  }
  memcpy(&pg, w, sizeof(w));
}

// Adds one row's pack (x, masked grad_out) into the per-channel sums g, g * c, c (c = x - mean).
template <typename A, typename T, int V>
__device__ __forceinline__ void sum_bwd_pack(const Pack<T, V>& px, const Pack<T, V>& pg,
                                             const A (&mean)[V], A (&sg)[V], A (&sgc)[V],
                                             A (&sc)[V]) {
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const A cx = static_cast<A>(px.v[i]) - mean[i];
    const A g = static_cast<A>(pg.v[i]);
    sg[i] += g;
    sgc[i] += g * cx;
    sc[i] += cx;
  }
}

// grad_input's pack a * g + B * c + D.
template <typename A, typename T, int V>
__device__ __forceinline__ Pack<T, V> dx_pack(const Pack<T, V>& px, const Pack<T, V>& pg,
                                              const A (&mean)[V], const A (&a)[V],
                                              const A (&B)[V], const A (&D)[V]) {
  Pack<T, V> o;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const A cx = static_cast<A>(px.v[i]) - mean[i];
    o.v[i] = static_cast<T>(a[i] * static_cast<A>(pg.v[i]) + B[i] * cx + D[i]);
  }
  return o;
}

// The streamed rows' packs of bn_bwd_tile_nhwc (ST > 0), all loads issued before any is used: x
// and grad_out of rows r + u * step (u < ST) below `bound` (DOWN false, phase 1) or of rows
// r - u * step at or above it (DOWN true, phase 3), and their mask bits (M). Rows outside are
// left unset.
template <typename T, int V, bool M, int ST, bool DOWN>
__device__ __forceinline__ void load_stream_rows(const T* __restrict__ x, const T* __restrict__ dy,
                                                 const uint8_t* mask, int64_t r, int64_t step,
                                                 int64_t bound, int64_t C, int64_t cv,
                                                 Pack<T, V> (&qx)[ST], Pack<T, V> (&qg)[ST],
                                                 unsigned (&qb)[ST]) {
#pragma unroll
  for (int u = 0; u < ST; ++u) {
    const int64_t rr = DOWN ? r - u * step : r + u * step;
    qb[u] = 0;
    if (DOWN ? rr >= bound : rr < bound) {
      const int64_t off = rr * C + cv * V;
      qx[u] = *reinterpret_cast<const Pack<T, V>*>(x + off);
      qg[u] = *reinterpret_cast<const Pack<T, V>*>(dy + off);
      if constexpr (M) qb[u] = mask_bits<V>(mask, off);
    }
  }
}

// Group partials of bn_bwd_tile_nhwc (wgs != nullptr): the splits of a tile in groups of
// kBwdGroupSplits, and the last block of a group to finish phase 1 (a completion counter per group)
// adds the group's partials, in split order, into one group partial before the grid barrier; phase
// 2 then adds ceil(splits / kBwdGroupSplits) group partials instead of `splits` partials. At 256
// splits every block read 256 * 3 * CT partials (192 KB at CT = 64, 48 MB from L2 over the grid)
// through L2 after the barrier; with groups, 16 * 3 * CT. The counters: a CounterPool of
// kBwdGroupSlots slots of kBwdGroupCounters (the last block of a group sets its counter back).
constexpr int kBwdGroupSplits = 16;
constexpr int kBwdGroupBatch = 8;  // the group's partials a thread loads at once
constexpr int kBwdGroupSlots = 256;
constexpr int kBwdGroupCounters = 256;  // per launch: tiles * groups at most
__device__ unsigned g_bwd_group_counters[kBwdGroupSlots * kBwdGroupCounters];

// The group counters of one launch on `device` (the current device).
unsigned* next_bwd_group_counters(int device) {
  static CounterPool pool(g_bwd_group_counters, kBwdGroupSlots, kBwdGroupCounters);
  return pool.next(device);
}

// Phase 1's end in bn_bwd_tile_nhwc with group partials: the block's partial (stored by some of
// its threads) is counted on its group's counter; the block that completes the group adds the
// group's partials of wt [splits][3][CT] in split order into wg [groups][3][CT] and sets the
// counter back to zero. Every thread of the block calls it.
template <typename A, int CT, int THREADS>
__device__ __forceinline__ void bwd_group_partial(const A* wt, A* wg, unsigned* counter, int split,
                                                  int splits, int tid) {
  static_assert(3 * CT <= THREADS, "one thread per partial value");
  __shared__ bool s_last;
  const int grp = split / kBwdGroupSplits;
  const int first = grp * kBwdGroupSplits;
  const int n = min(kBwdGroupSplits, splits - first);
  __threadfence();  // this thread's partial stores, before the block is counted
  __syncthreads();
  if (tid == 0) s_last = atomicAdd(counter, 1u) == unsigned(n - 1);
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  if (tid < 3 * CT) {
    // kBwdGroupBatch partials in flight at a time: the rows held for phase 3 keep the registers
    // near the kernel's bound
    A sum = __ldcg(wt + int64_t(first) * 3 * CT + tid);
#pragma unroll
    for (int k0 = 1; k0 < kBwdGroupSplits; k0 += kBwdGroupBatch) {
      A v[kBwdGroupBatch];
#pragma unroll
      for (int k = 0; k < kBwdGroupBatch; ++k)
        v[k] = k0 + k < n ? __ldcg(wt + int64_t(first + k0 + k) * 3 * CT + tid) : A(0);
#pragma unroll
      for (int k = 0; k < kBwdGroupBatch; ++k)
        if (k0 + k < n) sum += v[k];
    }
    wg[int64_t(grp) * 3 * CT + tid] = sum;
  }
  if (tid == 0) *counter = 0u;  // every block of the group has been counted
}

// SR > 0 (the stash): rows k = MAXR .. MAXR + SR - 1 of a thread live in dynamic shared memory,
// x's pack at slot 2k and grad_out's at 2k + 1 of stash [2 * SR][THREADS] (the launcher passes
// only the rows in use), copied there by cp.async before the register rows are loaded; phase 1
// masks grad_out there in place (each thread touches only its own slots: no block barrier), phase
// 3 reads both back. Their mask bytes are loaded with the register rows, 4 to a register.
template <typename T, int CT, bool M, int SR = 0, int ST = 0>
__global__ void __launch_bounds__(kBwdTileThreads, 2)
    bn_bwd_tile_nhwc(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ dx,
                     BwdArgs<typename Acc<T>::type> f, typename Acc<T>::type* ws, int64_t R,
                     int64_t C, typename Acc<T>::type* wgs, unsigned* group_counters) {
  using A = typename Acc<T>::type;
  constexpr int THREADS = kBwdTileThreads;
  constexpr int MAXR = BwdTileMaxR<T, M, SR, ST>::value;
  constexpr int V = 16 / int(sizeof(T));
  constexpr int TX = CT / V;
  constexpr int W = THREADS / 32;  // warps: phase 1's partials per channel
  constexpr int G = THREADS / CT;  // thread groups of phase 2, one partial per channel each
  constexpr int P1 = (W > G ? W : G) + 1;
  static_assert(CT % V == 0 && 32 % TX == 0 && THREADS % CT == 0, "bn_bwd_tile_nhwc shape");
  __shared__ A red[3][CT][P1];
  __shared__ A coef[3][CT];  // A, B, D per channel (the mean stays in registers)
  cg::grid_group grid = cg::this_grid();
  const auto [tx, tid, lane, warp, tile, split, splits, cv, rstride, r0, active] =
      TileIndex<CT, V, THREADS>(C);
  A* wt = ws + int64_t(tile) * splits * 3 * CT;  // this tile's partials [splits][3][CT]
  Pack<T, V> px[MAXR], pg[MAXR];
  A mean[V];
  extern __shared__ __align__(16) unsigned char bwd_stash_raw[];
  Pack<T, V>* const stash = reinterpret_cast<Pack<T, V>*>(bwd_stash_raw) + tid;
  auto srow = [&](int k) { return r0 + int64_t(MAXR + k) * rstride; };
  // ST: the streamed rows rs0, rs0 + rstride, ... < R (after the register and stash rows)
  const int64_t rs0 = r0 + int64_t(MAXR + SR) * rstride;

  // ---- phase 1 ----
  {
    A sg[V], sgc[V], sc[V];
#pragma unroll
    for (int i = 0; i < V; ++i) {
      mean[i] = active ? f.save_mean[cv * V + i] : A(0);
      sg[i] = 0;
      sgc[i] = 0;
      sc[i] = 0;
    }
    if (active) {
      if constexpr (SR > 0) {
#pragma unroll
        for (int k = 0; k < SR; ++k) {
          if (srow(k) < R) {
            const int64_t off = srow(k) * C + cv * V;
            cp_async16(stash + 2 * k * THREADS, x + off);
            cp_async16(stash + (2 * k + 1) * THREADS, dy + off);
          }
        }
      }
      unsigned bits[MAXR];
#pragma unroll
      for (int u = 0; u < MAXR; ++u) {
        const int64_t r = r0 + u * rstride;
        bits[u] = 0;
        if (r < R) {
          const int64_t off = r * C + cv * V;
          px[u] = *reinterpret_cast<const Pack<T, V>*>(x + off);
          pg[u] = *reinterpret_cast<const Pack<T, V>*>(dy + off);
          if constexpr (M) bits[u] = mask_bits<V>(f.mask, off);
        }
      }
      constexpr int SB = SR > 0 ? (SR + 3) / 4 : 1;
      uint32_t sbits[SB];
      if constexpr (M && SR > 0) {
#pragma unroll
        for (int q = 0; q < SB; ++q) sbits[q] = 0;
#pragma unroll
        for (int k = 0; k < SR; ++k)
          if (srow(k) < R)
            sbits[k / 4] |= (mask_bits<V>(f.mask, srow(k) * C + cv * V) & 0xffu) << (8 * (k % 4));
      }
#pragma unroll
      for (int u = 0; u < MAXR; ++u) {
        if (r0 + u * rstride < R) {
          if constexpr (M) mask_pack<T, V>(pg[u], bits[u]);
          sum_bwd_pack<A, T, V>(px[u], pg[u], mean, sg, sgc, sc);
        }
      }
      if constexpr (ST > 0) {
        // streamed rows, ST at a time: summed and dropped (phase 3 reads them again)
        for (int64_t r = rs0; r < R; r += int64_t(ST) * rstride) {
          Pack<T, V> qx[ST], qg[ST];
          unsigned qb[ST];
          load_stream_rows<T, V, M, ST, false>(x, dy, f.mask, r, rstride, R, C, cv, qx, qg, qb);
#pragma unroll
          for (int u = 0; u < ST; ++u) {
            if (r + u * rstride < R) {
              if constexpr (M) mask_pack<T, V>(qg[u], qb[u]);
              sum_bwd_pack<A, T, V>(qx[u], qg[u], mean, sg, sgc, sc);
            }
          }
        }
      }
      if constexpr (SR > 0) {
        cp_async_wait_all();  // this thread's own copies: no block barrier needed
#pragma unroll
        for (int k = 0; k < SR; ++k) {
          if (srow(k) < R) {
            const Pack<T, V> sx = stash[2 * k * THREADS];
            Pack<T, V> sgp = stash[(2 * k + 1) * THREADS];
            if constexpr (M) {
              mask_pack<T, V>(sgp, sbits[k / 4] >> (8 * (k % 4)));
              stash[(2 * k + 1) * THREADS] = sgp;
            }
            sum_bwd_pack<A, T, V>(sx, sgp, mean, sg, sgc, sc);
          }
        }
      }
    }
    // the rows of the warp (lanes tx, tx + TX, ...) into lane tx
#pragma unroll
    for (int o = 16; o >= TX; o >>= 1) {
#pragma unroll
      for (int i = 0; i < V; ++i) {
        sg[i] += __shfl_down_sync(0xffffffffu, sg[i], o);
        sgc[i] += __shfl_down_sync(0xffffffffu, sgc[i], o);
        sc[i] += __shfl_down_sync(0xffffffffu, sc[i], o);
      }
    }
    if (lane < TX) {  // lane == tx here (TX divides 32)
#pragma unroll
      for (int i = 0; i < V; ++i) {
        red[0][lane * V + i][warp] = sg[i];
        red[1][lane * V + i][warp] = sgc[i];
        red[2][lane * V + i][warp] = sc[i];
      }
    }
    __syncthreads();
    // the W warps' sums of each channel into the block's partial
    tile_sum_slots<A, CT, W, THREADS, P1>(red, tid, [&](int j, A s0, A s1, A s2) {
      store_tile_partial<CT>(wt, split, j, s0, s1, s2);
    });
  }
  // group partials (wgs [tiles][groups][3][CT], one counter per tile and group)
  const int groups = (splits + kBwdGroupSplits - 1) / kBwdGroupSplits;
  A* const wg = wgs != nullptr ? wgs + int64_t(tile) * groups * 3 * CT : nullptr;
  if (wgs != nullptr)  // the same for every block
    bwd_group_partial<A, CT, THREADS>(wt, wg, group_counters + tile * groups + split / kBwdGroupSplits,
                                      split, splits, tid);
  grid.sync();

  // ---- phase 2: every block adds its tile's partials and finishes its channels ----
  {
    const int j = tid % CT, g = tid / CT;
    A s0 = 0, s1 = 0, s2 = 0;
    for_tile_partials<kBwdTileMB, CT>(wgs != nullptr ? wg : wt, j, wgs != nullptr ? groups : splits,
                                      g, G, [&](A p0, A p1, A p2) {
      s0 += p0;
      s1 += p1;
      s2 += p2;
    });
    red[0][j][g] = s0;
    red[1][j][g] = s1;
    red[2][j][g] = s2;
  }
  __syncthreads();
  tile_sum_slots<A, CT, G, THREADS, P1>(red, tid, [&](int j, A s0, A s1, A s2) {
    const int64_t c = int64_t(tile) * CT + j;
    A co[5] = {0, 0, 0, 0, 0};
    if (c < C) finish_bwd_channel(f, c, s0, s1, s2, split == 0, co);
    coef[0][j] = co[1];
    coef[1][j] = co[2];
    coef[2][j] = co[3];
  });
  __syncthreads();

  // ---- phase 3: grad_input from the packs held since phase 1 ----
  if (!active) return;
  A a[V], B[V], D[V];
  load_tile_coef<A, CT, V>(coef, tx, a, B, D);
  T* dxc = dx + cv * V;
  if constexpr (ST > 0) {
    // the streamed rows again, last ones first (the most recently read, likeliest still in L2)
    if (rs0 < R) {
      const int64_t last = rs0 + ((R - 1 - rs0) / rstride) * rstride;
      for (int64_t r = last; r >= rs0; r -= int64_t(ST) * rstride) {
        Pack<T, V> qx[ST], qg[ST];
        unsigned qb[ST];
        load_stream_rows<T, V, M, ST, true>(x, dy, f.mask, r, rstride, rs0, C, cv, qx, qg, qb);
#pragma unroll
        for (int u = 0; u < ST; ++u) {
          const int64_t rr = r - u * rstride;
          if (rr >= rs0) {
            if constexpr (M) mask_pack<T, V>(qg[u], qb[u]);
            *reinterpret_cast<Pack<T, V>*>(dxc + rr * C) =
                dx_pack<A, T, V>(qx[u], qg[u], mean, a, B, D);
          }
        }
      }
    }
  }
#pragma unroll
  for (int u = 0; u < MAXR; ++u) {
    const int64_t r = r0 + u * rstride;
    if (r < R) {
      persist_opaque(px[u]);
      persist_opaque(pg[u]);
      *reinterpret_cast<Pack<T, V>*>(dxc + r * C) = dx_pack<A, T, V>(px[u], pg[u], mean, a, B, D);
    }
  }
  if constexpr (SR > 0) {
#pragma unroll 4
    for (int k = 0; k < SR; ++k) {
      if (srow(k) < R)
        *reinterpret_cast<Pack<T, V>*>(dxc + srow(k) * C) =
            dx_pack<A, T, V>(stash[2 * k * THREADS], stash[(2 * k + 1) * THREADS], mean, a, B, D);
    }
  }
}

// Whether a backward with a reduction and grad_input runs as one cooperative kernel: up to
// kFusedBwdMaxBytes of contiguous input, kFusedBwdMaxBytesNhwc of channels-last input (x and
// grad_out both stay in L2 between the phases), and only when the whole grid is resident.
// CUDADOCTOR_OPS_BN_FUSED_BWD = 0 / 1 forces it off / on (on: at any size that can be
// resident); read once. The channels-last limit: on the H200, float16 at 25.7 MB ((64,1024,14,14),
// (64,256,28,28), (64,64,56,56)) replayed from CUDA graphs took 51.1 / 51.5 / 46.3 us in one
// launch against 54.3 / 54.5 / 49.9 us as reduce -> finalize -> apply; at 51 MB the two were even.
constexpr int64_t kFusedBwdMaxBytes = int64_t(16) << 20;
constexpr int64_t kFusedBwdMaxBytesNhwc = int64_t(32) << 20;

inline int bwd_nr_setting() {
  static const int v = env_switch("CUDADOCTOR_OPS_BN_BWD_NR");
  return v;
}

inline int fused_bwd_setting() {
  static const int v = env_switch("CUDADOCTOR_OPS_BN_FUSED_BWD");
  return v;
}

// Tries the one-launch backward (reduction and grad_input wanted); false when it does not apply
// (the caller then runs the multi-kernel path). f: everything but the partials (f.ws, f.splits),
// which this sets.
template <typename T, int V, bool M = false>
bool launch_fused_backward(const Layout& l, const T* x, const T* g, T* dx,
                           BwdArgs<typename Acc<T>::type> f, const at::TensorOptions& acc_opts,
                           bool relu, bool need_x, int device, cudaStream_t stream) {
  using A = typename Acc<T>::type;
  const int setting = fused_bwd_setting();
  if (setting == 0) return false;
  const int64_t bytes = l.N * l.C * l.HW * int64_t(sizeof(T));
  if (setting < 0 && bytes > (l.nhwc ? kFusedBwdMaxBytesNhwc : kFusedBwdMaxBytes)) return false;
  if (!cooperative_ok(device)) return false;
  const T* xa = x;
  const T* ga = g;
  T* dxa = dx;
  int64_t C = l.C;
  if (l.nhwc) {
    const size_t smem = size_t(kThreads) * V * 3 * sizeof(A);
    const int per_sm = blocks_per_sm(bn_bwd_fused_nhwc<T, V, M>, smem);
    // as bn_bwd_reduce_nhwc's plan: x and grad_out are read, twice the bytes per row
    const int ty = static_cast<int>(nhwc_block(l.C / V).y);
    const NhwcGrid gr = nhwc_grid(l.C / V, l.N * l.HW, device, per_sm,
                                  nhwc_reduce_rows(2 * int(sizeof(T)), ty));
    const int64_t resident = int64_t(sm_count(device)) * per_sm;
    if (int64_t(gr.grid.x) * gr.grid.y > resident) return false;
    // partials [C, splits, 3] and coefficients [C, 5] in one allocation
    at::Tensor ws = at::empty({l.C * (int64_t(gr.splits) * 3 + 5)}, acc_opts);
    A* wsp = ws.data_ptr<A>();
    A* cp = wsp + l.C * int64_t(gr.splits) * 3;
    f.ws = wsp;
    f.splits = gr.splits;
    int64_t R = l.N * l.HW;
    void* args[] = {&xa, &ga, &dxa, &f, &wsp, &cp, &R, &C, &relu, &need_x};
    return launch_cooperative(reinterpret_cast<const void*>(bn_bwd_fused_nhwc<T, V, M>),
                                  gr.grid, gr.block, args, smem, stream);
  }
  const int per_sm = blocks_per_sm(bn_bwd_fused_nchw<T, V, M>, 0);
  const int64_t resident = int64_t(sm_count(device)) * per_sm;
  const int splits = nchw_splits(l.C, l.N * (l.HW / V), device, per_sm);
  const int64_t items = l.C * splits;
  const int64_t blocks = items < resident ? items : resident;
  at::Tensor ws = at::empty({l.C * splits * 3}, acc_opts);
  A* wsp = ws.data_ptr<A>();
  f.ws = wsp;
  f.splits = splits;
  int64_t N = l.N, HW = l.HW;
  void* args[] = {&xa, &ga, &dxa, &f, &wsp, &N, &C, &HW, &relu, &need_x};
  return launch_cooperative(reinterpret_cast<const void*>(bn_bwd_fused_nchw<T, V, M>),
                                dim3(static_cast<unsigned>(blocks)), dim3(kThreads), args, 0,
                                stream);
}

// bn_bwd_tile_nhwc where it applies: CUDADOCTOR_OPS_BN_BWD_TILE=0 turns it off (read once).
inline int bwd_tile_setting() {
  static const int v = env_switch("CUDADOCTOR_OPS_BN_BWD_TILE");
  return v;
}

// Splits of bn_bwd_tile_nhwc for R rows and `tiles` tiles (0: no resident grid holds every row
// in registers). As tile_grid's policy for the forward: the fewest blocks per SM b (splits = b *
// SMs / tiles) at which every thread holds at most maxr rows; the whole launch is latency-bound,
// so its time follows the most loaded SM.
inline int bwd_tile_splits(int64_t R, int64_t tiles, int ty, int sms, int per_sm, int maxr) {
  const int64_t most = (R + ty - 1) / ty;  // more splits would leave blocks without rows
  for (int b = 1; b <= per_sm; ++b) {
    int64_t s = int64_t(b) * sms / tiles;
    if (s > most) s = most;
    if (s > kBwdTileMaxSplits) s = kBwdTileMaxSplits;
    if (s < 1) continue;
    if ((R + s * ty - 1) / (s * ty) <= maxr) return static_cast<int>(s);
  }
  return 0;
}

// The stash variant (bn_bwd_tile_nhwc<SR = kBwdTileStashRows>) where no register-only grid
// holds every row: up to kBwdTileStashRows more rows per thread (x and grad_out, 2 * 8 * 256 * 16
// = 64 KB per block of 256, two blocks per SM), about 8.6M elements on an H200 instead of 4.3M:
// (64,128,28,28), (64,512,14,14) and (32,64,56,56) in 16 bits. On the H200 (float16 BatchNorm
// backward replayed from CUDA graphs, us, stash / without, cuDNN): (64,128,28,28) 23.7-24.4 /
// 31.1-31.2, 29.6; (64,512,14,14) 22.5-22.7 / 35.0, 26.8; (32,64,56,56) 24.0-24.5 / 29.3-29.6,
// 24.0. Conv+BN+ReLU's masked backward of the float16 (32,64,56,56)->64 block gained nothing
// (21.5 us in the kernel against 21.7 for bn_bwd_fused_nhwc; 139.5 against 139.2 us forward +
// backward). At 256 splits every block adds 256 * 64 partials in phase 2; merging each channel
// once in one block behind a second grid barrier measured no faster (24.0 / 24.5 us on
// (32,64,56,56), 24.4 / 23.7 on (64,128,28,28)) and is not kept. CUDADOCTOR_OPS_BN_BWD_TILE_STASH=0
// turns the variant off; CUDADOCTOR_OPS_BN_BWD_TILE_CT=32 / 64 fixes the tile width (unset: 64
// where C % 64 == 0, else 32; tiles of 32 were slower on every shape above, e.g. 32.8 us on
// (32,64,56,56)). Both read once.
constexpr int kBwdTileStashRows = 8;

inline size_t bwd_stash_bytes(int rows) { return size_t(2) * rows * kBwdTileThreads * 16; }

inline int bwd_tile_stash_setting() {
  static const int v = env_switch("CUDADOCTOR_OPS_BN_BWD_TILE_STASH");
  return v;
}

// The streamed variant of bn_bwd_tile_nhwc (ST = kBwdStreamBatch > 0) where neither the
// registers nor the stash hold every row: 4 rows per thread in registers, kBwdStreamStashRows
// (96 KB per block of 256) in shared memory, the others read in phase 1 (summed and dropped) and
// again in phase 3, last ones first. Against reduce -> finalize -> apply it reads the rows kept on
// chip once instead of twice, and the streamed rows read last in phase 1 are the first read again
// in phase 3 (L2). By default it runs after the other two variants for BatchNorm's own backward
// (not Conv+BN+ReLU's masked one, M), up to kBwdStreamMaxBytes of input;
// CUDADOCTOR_OPS_BN_BWD_STREAM=0 turns it off, 1 makes it the variant wherever bn_bwd_tile_nhwc
// applies, at any size (read once). CUDADOCTOR_OPS_BN_BWD_STREAM_SPLITS=S caps its splits at S
// (read once; tests use it to stream rows of small tensors). H200, CUDA-graph replays, float16,
// us, streamed / without it (gpu_variants.py bnst): (64,256,28,28) 36.1 / 51.5, (64,128,56,56)
// 70.7 / 77.4, (256,64,56,56) 135.9 / 136.0 (cuDNN 54.4, 72.8, 133.5).
constexpr int kBwdStreamStashRows = 12;
constexpr int kBwdStreamBatch = 2;
constexpr int64_t kBwdStreamMaxBytes = int64_t(128) << 20;

inline int bwd_stream_setting() {
  static const int v = env_switch("CUDADOCTOR_OPS_BN_BWD_STREAM");
  return v;
}

inline int bwd_stream_splits_setting() {
  static const int v =
      env_positive_int("CUDADOCTOR_OPS_BN_BWD_STREAM_SPLITS", kBwdTileMaxSplits);
  return v;
}

// CUDADOCTOR_OPS_BN_BWD_GROUPS: bn_bwd_tile_nhwc's group partials (bwd_group_partial); 0 turns
// them off, 1 takes them at any split count above 1 (tests use it on small tensors); unset, above
// kBwdGroupMinSplits splits (read once). On the H200 (CUDA-graph replays, us, with / without;
// gpu_variants.py bnp and cbra): float16 BatchNorm backward (32,64,56,56) at 256 splits 23.7 /
// 25.2, (64,64,56,56) 38.1 / 39.6, (64,128,28,28) at 132 splits 23.8 / 24.0, but (64,512,14,14)
// at 33 splits 23.7 / 22.7; Conv+BN+ReLU fwd+bwd, float16 (32,64,56,56)->64 134.8 and 134.4 /
// 136.1 and 135.9, bfloat16 (64,512,7,7)->512 (33 splits) 125.8 and 126.3 / 124.9 and 124.7.
constexpr int kBwdGroupMinSplits = 64;
inline int bwd_groups_setting() {
  static const int v = env_switch("CUDADOCTOR_OPS_BN_BWD_GROUPS");
  return v;
}

inline int bwd_tile_ct() {
  static const int v = env_choice("CUDADOCTOR_OPS_BN_BWD_TILE_CT", {32, 64}, 0);
  return v;
}

template <typename T, int CT, bool M>
bool launch_tile_backward_ct(const Layout& l, const T* x, const T* g, T* dx,
                             BwdArgs<typename Acc<T>::type> f, const at::TensorOptions& acc_opts,
                             bool allow_stream, int device, cudaStream_t stream) {
  using A = typename Acc<T>::type;
  constexpr int V = 16 / int(sizeof(T));
  constexpr int TX = CT / V;
  constexpr int TY = kBwdTileThreads / TX;
  constexpr int SR = kBwdTileStashRows;
  int64_t R = l.N * l.HW;
  int64_t C = l.C;
  const int64_t tiles = (C + CT - 1) / CT;
  if (tiles > 65535) return false;
  const int sms = sm_count(device);
  const void* kernel = reinterpret_cast<const void*>(bn_bwd_tile_nhwc<T, CT, M>);
  size_t smem = 0;
  const int stream_mode = bwd_stream_setting();
  // CUDADOCTOR_OPS_BN_BWD_STREAM=1: the streamed variant wherever the tile kernel applies
  int splits = stream_mode == 1 ? 0
                           : bwd_tile_splits(R, tiles, TY, sms,
                                             blocks_per_sm(kernel, 0, kBwdTileThreads),
                                             BwdTileMaxR<T, M>::value);
  if (splits < 1 && stream_mode != 1 && bwd_tile_stash_setting() != 0) {
    constexpr int maxr = BwdTileMaxR<T, M, SR>::value;
    kernel = reinterpret_cast<const void*>(bn_bwd_tile_nhwc<T, CT, M, SR>);
    allow_dynamic_smem(kernel, device, bwd_stash_bytes(SR));
    const int per_sm = blocks_per_sm(kernel, bwd_stash_bytes(SR), kBwdTileThreads);
    splits = bwd_tile_splits(R, tiles, TY, sms, per_sm, maxr + SR);
    if (splits >= 1) {
      const int64_t rows = (R + int64_t(splits) * TY - 1) / (int64_t(splits) * TY);
      smem = bwd_stash_bytes(rows > maxr ? static_cast<int>(rows - maxr) : 1);
    }
  }
  if (splits < 1) {
    // the streamed variant: every resident block, the rows beyond the chip read twice
    const int64_t bytes = R * C * int64_t(sizeof(T));
    if (!allow_stream || stream_mode == 0 ||
        (stream_mode < 0 && (M || bytes > kBwdStreamMaxBytes)))
      return false;
    constexpr int SS = kBwdStreamStashRows;
    kernel = reinterpret_cast<const void*>(bn_bwd_tile_nhwc<T, CT, M, SS, kBwdStreamBatch>);
    smem = bwd_stash_bytes(SS);
    allow_dynamic_smem(kernel, device, smem);
    const int per_sm = blocks_per_sm(kernel, smem, kBwdTileThreads);
    int64_t s = int64_t(per_sm) * sms / tiles;
    const int64_t most = (R + TY - 1) / TY;
    if (s > most) s = most;
    if (s > kBwdTileMaxSplits) s = kBwdTileMaxSplits;
    const int cap = bwd_stream_splits_setting();
    if (cap > 0 && s > cap) s = cap;
    if (s < 1) return false;
    splits = static_cast<int>(s);
  }
  // group partials (see bwd_group_partial): by default past kBwdGroupMinSplits splits
  const int64_t groups = (splits + kBwdGroupSplits - 1) / kBwdGroupSplits;
  const int gmode = bwd_groups_setting();
  const bool use_groups = gmode != 0 && tiles * groups <= kBwdGroupCounters &&
                          (gmode == 1 ? splits > 1 : splits > kBwdGroupMinSplits);
  const int64_t partials = tiles * splits * 3 * CT;
  at::Tensor ws = at::empty({partials + (use_groups ? tiles * groups * 3 * CT : 0)}, acc_opts);
  A* wsp = ws.data_ptr<A>();
  A* wgp = use_groups ? wsp + partials : nullptr;
  unsigned* counters = use_groups ? next_bwd_group_counters(device) : nullptr;
  void* args[] = {&x, &g, &dx, &f, &wsp, &R, &C, &wgp, &counters};
  return launch_cooperative(kernel, dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(splits)),
                            dim3(TX, TY), args, smem, stream);
}

// Tries bn_bwd_tile_nhwc (channels-last 16-bit input in 16-byte packs, a reduction and
// grad_input wanted, no ReLU or the ReLU gradient from a mask); false when it does not apply.
// Tiles of 64 channels where C is a multiple of 64, else of 32. allow_stream: whether the streamed
// variant may run (not for a residual tail's backward, whose three-launch path writes the
// residual's gradient from its apply kernel).
template <typename T, int V, bool M>
bool launch_tile_backward(const Layout& l, const T* x, const T* g, T* dx,
                          BwdArgs<typename Acc<T>::type> f, const at::TensorOptions& acc_opts,
                          bool relu, bool allow_stream, int device, cudaStream_t stream) {
  if constexpr (sizeof(T) != 2 || V != 8) {
    return false;
  } else {
    if (!l.nhwc || (relu && !M) || bwd_tile_setting() == 0 || !cooperative_ok(device))
      return false;
    const int ct = bwd_tile_ct();
    if (ct == 64 || (ct == 0 && l.C % 64 == 0))
      return launch_tile_backward_ct<T, 64, M>(l, x, g, dx, f, acc_opts, allow_stream, device,
                                               stream);
    return launch_tile_backward_ct<T, 32, M>(l, x, g, dx, f, acc_opts, allow_stream, device,
                                             stream);
  }
}

// NCHW backward with a reduction and grad_input that reads x and grad_out once ("single
// read"): one block per channel holds the channel's N*HW values of both in shared memory. The
// sums (g, g*c, c) are taken while loading (the per-channel mean / A / E come from the saved
// statistics), thread 0 finishes the channel (parameter grads, coef), then grad_input is written
// from shared memory: 3x the tensor's bytes instead of 5x, one launch, no workspace. For channels
// whose x plus grad_out fit kBwdSingleReadMaxBytes and at least one channel per SM.
// M: the ReLU gradient from Conv+BN+ReLU's bit mask (see mask_bits); shared memory then holds
// grad_out with the mask applied.
constexpr int kBwdSingleReadThreads = 512;
constexpr int64_t kBwdSingleReadMaxBytes = int64_t(112) << 10;

template <typename T, int V, bool M = false>
__global__ void __launch_bounds__(kBwdSingleReadThreads, 2)
    bn_bwd_singleread_nchw(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ dx,
                           BwdArgs<typename Acc<T>::type> f, int64_t N, int64_t C, int64_t HW,
                           bool relu, const uint8_t* __restrict__ mask = nullptr) {
  using A = typename Acc<T>::type;
  extern __shared__ __align__(16) unsigned char bsr_smem[];
  const int64_t packs = N * (HW / V);
  T* sx = reinterpret_cast<T*>(bsr_smem);  // [N * HW] of channel c, then grad_out's
  T* sg_ = sx + packs * V;
  __shared__ A red[kBwdSingleReadThreads / 32];
  __shared__ A coef[5];
  const int64_t c = blockIdx.x;
  const int64_t stride = blockDim.x;
  const ChannelPre<A> pre = channel_pre<A>(c, f.save_mean, f.save_invstd, f.reserve, f.weight,
                                           f.wkind, f.bias, f.bkind);
  constexpr int U = V > 1 ? 2 : kUnroll;  // packs of x and grad_out in flight per thread
  A sg = 0, sgc = 0, sc = 0;
  int64_t j = threadIdx.x;
  if (j < packs) {
    NchwWalk w(j, stride, c, C, HW, V);
    for (; j < packs; j += U * stride) {
      Pack<T, V> px[U], pg[U];
      unsigned bits[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        bits[u] = 0;
        if (j + u * stride < packs) {
          px[u] = *reinterpret_cast<const Pack<T, V>*>(x + w.off);
          pg[u] = *reinterpret_cast<const Pack<T, V>*>(dy + w.off);
          if constexpr (M) bits[u] = mask_bits<V>(mask, w.off);
        }
        w.advance();
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (j + u * stride < packs) {
#pragma unroll
          for (int i = 0; i < V; ++i) {
            const A cx = static_cast<A>(px[u].v[i]) - pre.mean;
            const A g = gate<M>(static_cast<A>(pg[u].v[i]), cx, pre.a, pre.e, relu, mask,
                                bits[u], i);
            if constexpr (M) pg[u].v[i] = static_cast<T>(g);  // dy or 0: exact
            sg += g;
            sgc += g * cx;
            sc += cx;
          }
          *reinterpret_cast<Pack<T, V>*>(sx + (j + u * stride) * V) = px[u];
          *reinterpret_cast<Pack<T, V>*>(sg_ + (j + u * stride) * V) = pg[u];
        }
      }
    }
  }
  sg = block_sum(sg, red);
  sgc = block_sum(sgc, red);
  sc = block_sum(sc, red);
  if (threadIdx.x == 0) finish_bwd_channel(f, c, sg, sgc, sc, true, coef);
  __syncthreads();
  const A mean = coef[0], a = coef[1], B = coef[2], D = coef[3], e = coef[4];
  j = threadIdx.x;
  if (j < packs) {
    NchwWalk w(j, stride, c, C, HW, V);
    for (; j < packs; j += stride) {
      const Pack<T, V> px = *reinterpret_cast<const Pack<T, V>*>(sx + j * V);
      const Pack<T, V> pg = *reinterpret_cast<const Pack<T, V>*>(sg_ + j * V);
      Pack<T, V> o;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const A cx = static_cast<A>(px.v[i]) - mean;
        const A g = M ? static_cast<A>(pg.v[i]) : masked(static_cast<A>(pg.v[i]), cx, a, e, relu);
        o.v[i] = static_cast<T>(a * g + B * cx + D);
      }
      *reinterpret_cast<Pack<T, V>*>(dx + w.off) = o;
      w.advance();
    }
  }
}

// Tries the single-read contiguous backward; false when it does not apply. M: with the mask.
template <typename T, int V, bool M = false>
bool launch_bwd_singleread_nchw(const Layout& l, const T* x, const T* g, T* dx,
                                const BwdArgs<typename Acc<T>::type>& f, bool relu, int device,
                                cudaStream_t stream, const uint8_t* mask = nullptr) {
  const int setting = singleread_setting();
  if (setting == 0 || l.nhwc) return false;
  const int64_t bytes = 2 * l.N * l.HW * int64_t(sizeof(T));
  if (bytes > kBwdSingleReadMaxBytes || bytes == 0) return false;
  if (setting < 0 && l.C < sm_count(device)) return false;
  if (l.C > int64_t(INT32_MAX)) return false;
  allow_dynamic_smem(reinterpret_cast<const void*>(bn_bwd_singleread_nchw<T, V, M>), device,
                     kBwdSingleReadMaxBytes);
  const int threads = singleread_threads(l.N * l.HW);
  bn_bwd_singleread_nchw<T, V, M><<<static_cast<unsigned>(l.C), threads, size_t(bytes), stream>>>(
      x, g, dx, f, l.N, l.C, l.HW, relu, mask);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

// Launches: with a reduction and grad_input, bn_bwd_singleread_nchw for contiguous inputs with
// small channels, or bn_bwd_fused_* alone for small tensors (see launch_fused_backward); else NCHW: reduce (if needed) -> apply (which finishes its channel
// itself), and without grad_input reduce -> finalize; NHWC: reduce (if needed) -> finalize ->
// apply (if grad_input is wanted). With the mask, dres (not null) asks the channels-last apply
// to write the residual's gradient too (see bn_bwd_apply_nhwc); returns whether it was written
// (only by that kernel: the other paths leave it to the caller).
template <typename T, int V, bool M = false>
bool launch_backward(const Layout& l, const at::Tensor& dy, const at::Tensor& dx,
                     const at::Tensor& w, const at::Tensor& b, const at::Tensor& save_mean,
                     const at::Tensor& save_invstd, const at::Tensor& reserve, bool training,
                     bool relu, bool need_reduce, const at::Tensor& gw, const at::Tensor& gb,
                     const uint8_t* mask = nullptr, T* dres = nullptr) {
  using A = typename Acc<T>::type;
  const int device = l.x.get_device();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  const T* x = l.x.data_ptr<T>();
  const T* g = dy.data_ptr<T>();
  const auto acc_opts = save_mean.options();
  const A* sm = save_mean.data_ptr<A>();
  const A* si = save_invstd.data_ptr<A>();
  const A* rs = reserve.data_ptr<A>();
  const int64_t R = l.N * l.HW;
  BwdArgs<A> f;
  f.ws = nullptr;  // the partials, set once reduced
  f.splits = 0;
  f.count = R;
  f.training = training;
  f.save_mean = sm;
  f.save_invstd = si;
  f.reserve = rs;
  f.weight = param_ptr(w);
  f.wkind = param_kind(w);
  f.bias = param_ptr(b);
  f.bkind = param_kind(b);
  f.grad_weight = gw.defined() ? gw.data_ptr() : nullptr;
  f.gwkind = param_kind(gw);
  f.grad_bias = gb.defined() ? gb.data_ptr() : nullptr;
  f.gbkind = param_kind(gb);
  f.mask = mask;
  const bool need_x = training || relu || mask != nullptr;
  if (need_reduce && dx.defined() && (M || mask == nullptr) &&
      launch_bwd_singleread_nchw<T, V, M>(l, x, g, dx.data_ptr<T>(), f, relu, device, stream,
                                          mask)) {
    return false;
  }
  if (need_reduce && dx.defined() &&
      launch_tile_backward<T, V, M>(l, x, g, dx.data_ptr<T>(), f, acc_opts, relu,
                                    /*allow_stream=*/dres == nullptr, device, stream)) {
    return false;
  }
  if (need_reduce && dx.defined() &&
      launch_fused_backward<T, V, M>(l, x, g, dx.data_ptr<T>(), f, acc_opts, relu, need_x, device,
                                  stream)) {
    return false;
  }
  int splits = 0;
  at::Tensor ws;
  // channels-last without ReLU: the kernels that leave the ReLU test out (see BwdNhwcMinBlocks;
  // their template argument is !M so that the masked instantiation adds no kernel)
  const bool nr = !M && !relu && bwd_nr_setting() != 0;
  if (need_reduce) {
    // reads x and grad_out: twice the bytes per row against the same partials
    const Plan p =
        l.nhwc ? (nr ? plan_launch(bn_bwd_reduce_nhwc<T, V, M, !M>, true, l.N, l.C, l.HW, V,
                                   V * 3 * sizeof(A), device, 2 * sizeof(T))
                     : plan_launch(bn_bwd_reduce_nhwc<T, V, M>, true, l.N, l.C, l.HW, V,
                                   V * 3 * sizeof(A), device, 2 * sizeof(T)))
               : plan_launch(bn_bwd_reduce_nchw<T, V, M>, false, l.N, l.C, l.HW, V, 0, device);
    splits = p.splits;
    ws = at::empty({l.C * splits * 3}, acc_opts);
    if (l.nhwc && nr) {
      bn_bwd_reduce_nhwc<T, V, M, !M><<<p.grid, p.block, p.smem, stream>>>(
          x, g, ws.data_ptr<A>(), R, l.C, sm, si, rs, param_ptr(w), param_kind(w), param_ptr(b),
          param_kind(b), relu, mask);
    } else if (l.nhwc) {
      bn_bwd_reduce_nhwc<T, V, M><<<p.grid, p.block, p.smem, stream>>>(
          x, g, ws.data_ptr<A>(), R, l.C, sm, si, rs, param_ptr(w), param_kind(w), param_ptr(b),
          param_kind(b), relu, mask);
    } else {
      bn_bwd_reduce_nchw<T, V, M><<<p.grid, p.block, 0, stream>>>(
          x, g, ws.data_ptr<A>(), l.N, l.C, l.HW, sm, si, rs, param_ptr(w), param_kind(w),
          param_ptr(b), param_kind(b), relu, mask);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  f.ws = need_reduce ? ws.data_ptr<A>() : nullptr;
  f.splits = need_reduce ? splits : 0;
  if (!l.nhwc && dx.defined()) {
    // the apply blocks finish their channel themselves
    Plan p = plan_launch(bn_bwd_apply_nchw<T, V, M>, false, l.N, l.C, l.HW, V, 0, device);
    if (need_reduce) p.grid.y = static_cast<unsigned>(splits);  // same slices, reversed
    bn_bwd_apply_nchw<T, V, M><<<p.grid, p.block, 0, stream>>>(x, g, dx.data_ptr<T>(), f, l.N, l.C,
                                                            l.HW, relu, need_x);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return false;
  }
  at::Tensor coef = at::empty({l.C, 5}, acc_opts);
  if (need_reduce && fin_block_setting() != 0) {
    bn_bwd_finalize_blk<A><<<static_cast<unsigned>(l.C), kFinThreads, 0, stream>>>(
        f, coef.data_ptr<A>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  } else {
    const int warps = 8;
    const unsigned fgrid = static_cast<unsigned>((l.C + warps - 1) / warps);
    bn_bwd_finalize<A><<<fgrid, warps * 32, 0, stream>>>(f, l.C, coef.data_ptr<A>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (dx.defined() && nr) {
    const Plan p =
        plan_launch(bn_bwd_apply_nhwc<T, V, M, !M>, true, l.N, l.C, l.HW, V, 0, device);
    bn_bwd_apply_nhwc<T, V, M, !M><<<p.grid, p.block, 0, stream>>>(
        x, g, dx.data_ptr<T>(), coef.data_ptr<A>(), R, l.C, relu, need_x, mask, nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  } else if (dx.defined()) {
    const Plan p = plan_launch(bn_bwd_apply_nhwc<T, V, M>, true, l.N, l.C, l.HW, V, 0, device);
    bn_bwd_apply_nhwc<T, V, M><<<p.grid, p.block, 0, stream>>>(
        x, g, dx.data_ptr<T>(), coef.data_ptr<A>(), R, l.C, relu, need_x, mask, dres);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return dres != nullptr;
  }
  return false;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& input,
    const c10::optional<at::Tensor>& weight_opt, const c10::optional<at::Tensor>& bias_opt,
    const at::Tensor& save_mean, const at::Tensor& save_invstd, const at::Tensor& reserve,
    bool training, c10::string_view activation, std::array<bool, 3> output_mask) {
  check_input(input, "input");
  check_input(grad_out, "grad_out");
  const bool relu = parse_relu(activation);
  const int64_t C = input.size(1);
  TORCH_CHECK(grad_out.sizes() == input.sizes(),
              "cudadoctor_ops.batch_norm_backward: grad_out has shape ", grad_out.sizes(),
              " but input has shape ", input.sizes());
  TORCH_CHECK(grad_out.scalar_type() == input.scalar_type(),
              "cudadoctor_ops.batch_norm_backward: grad_out has dtype ", grad_out.scalar_type(),
              " but input has dtype ", input.scalar_type());
  TORCH_CHECK(grad_out.device() == input.device(),
              "cudadoctor_ops.batch_norm_backward: grad_out is on ", grad_out.device(),
              " but input is on ", input.device());
  check_param(weight_opt, "weight", input, C);
  check_param(bias_opt, "bias", input, C);
  const auto acc_type = input.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  for (const at::Tensor* t : {&save_mean, &save_invstd, &reserve}) {
    TORCH_CHECK(t->device() == input.device() && t->scalar_type() == acc_type &&
                    t->dim() == 1 && t->size(0) == C,
                "cudadoctor_ops.batch_norm_backward: save_mean, save_invstd and reserve must be "
                "the [", C, "] ", acc_type, " tensors returned by batch_norm on ",
                input.device());
  }
  c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor w = contig_param(weight_opt), b = contig_param(bias_opt);
  Layout l = make_layout(input);
  at::Tensor dy = like_layout(grad_out, l);
  at::Tensor dx, gw, gb;
  if (output_mask[0]) dx = at::empty_like(l.x);
  const auto param_opts = w.defined() ? w.options() : input.options().dtype(acc_type);
  const auto bias_opts = b.defined() ? b.options() : input.options().dtype(acc_type);
  if (output_mask[1]) gw = at::empty({C}, param_opts);
  if (output_mask[2]) gb = at::empty({C}, bias_opts);
  if (input.numel() == 0) {
    if (gw.defined()) gw.zero_();
    if (gb.defined()) gb.zero_();
  } else if (output_mask[0] || output_mask[1] || output_mask[2]) {
    const at::Tensor sm = save_mean.contiguous(), si = save_invstd.contiguous(),
                     rs = reserve.contiguous();
    const bool need_reduce = training ? (output_mask[0] || output_mask[1] || output_mask[2])
                                      : (output_mask[1] || output_mask[2]);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "bn_bwd",
                                    [&] {
      constexpr int VW = 16 / sizeof(scalar_t);
      const void* dxp = dx.defined() ? dx.data_ptr() : nullptr;
      if (vec_width<scalar_t>(l, {l.x.data_ptr(), dy.data_ptr(), dxp}) == VW) {
        launch_backward<scalar_t, VW>(l, dy, dx, w, b, sm, si, rs, training, relu, need_reduce,
                                      gw, gb);
      } else {
        launch_backward<scalar_t, 1>(l, dy, dx, w, b, sm, si, rs, training, relu, need_reduce,
                                     gw, gb);
      }
    });
  }
  if (!dx.defined()) dx = at::empty({0}, input.options());
  if (!gw.defined()) gw = at::empty({0}, param_opts);
  if (!gb.defined()) gb = at::empty({0}, bias_opts);
  return {dx, gw, gb};
}

}  // namespace

bool relu_mask_backward_cuda(const at::Tensor& x, const at::Tensor& grad_out,
                             const at::Tensor& mask, const at::Tensor& save_mean,
                             const at::Tensor& save_invstd, const at::Tensor& weight,
                             const at::Tensor& dx, const at::Tensor& grad_weight,
                             const at::Tensor& grad_bias, const at::Tensor& dres,
                             bool* dres_written) {
  if (dres_written != nullptr) *dres_written = false;
  const auto st = x.scalar_type();
  if (st != at::kFloat && st != at::kHalf && st != at::kBFloat16) return false;
  if (x.numel() == 0 || x.dim() < 2 || !x.is_cuda()) return false;
  Layout l = make_layout(x);
  if (!l.x.is_same(x)) return false;  // not contiguous / channels_last as returned
  const at::Tensor dy = like_layout(grad_out, l);
  if (dx.defined() && !dx.is_contiguous(l.format)) return false;
  if (mask.scalar_type() != at::kByte || !mask.is_contiguous() ||
      mask.numel() * 8 < x.numel())
    return false;
  const at::Tensor sm = save_mean.contiguous(), si = save_invstd.contiguous();
  const bool need_reduce = dx.defined() || grad_weight.defined() || grad_bias.defined();
  if (!need_reduce) return true;
  c10::cuda::CUDAGuard guard(x.device());
  const uint8_t* mp = mask.data_ptr<uint8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, st, "bn_relu_mask_bwd", [&] {
    if constexpr (sizeof(scalar_t) <= 4) {  // float64 is refused above
      constexpr int VW = 16 / sizeof(scalar_t);
      const void* dxp = dx.defined() ? dx.data_ptr() : nullptr;
      // the reserve pointer is read but unused with a mask
      // the residual's gradient: dres in x's layout (and, for the packs, 16-byte aligned)
      scalar_t* rp = nullptr;
      if (dres.defined() && dres.is_contiguous(l.format) && dres.sizes() == x.sizes() &&
          dres.scalar_type() == st)
        rp = dres.data_ptr<scalar_t>();
      bool w = false;
      if (vec_width<scalar_t>(l, {l.x.data_ptr(), dy.data_ptr(), dxp}) == VW) {
        if (reinterpret_cast<uintptr_t>(rp) % 16 != 0) rp = nullptr;
        w = launch_backward<scalar_t, VW, true>(l, dy, dx, weight, at::Tensor(), sm, si, sm,
                                                true, false, true, grad_weight, grad_bias, mp,
                                                rp);
      } else {
        w = launch_backward<scalar_t, 1, true>(l, dy, dx, weight, at::Tensor(), sm, si, sm, true,
                                               false, true, grad_weight, grad_bias, mp, rp);
      }
      if (dres_written != nullptr) *dres_written = w;
    }
  });
  return true;
}

}  // namespace bn
}  // namespace cudadoctor_ops

TORCH_LIBRARY_IMPL(cudadoctor_ops, CUDA, m) {
  m.impl("batch_norm_backward", &cudadoctor_ops::bn::batch_norm_backward_cuda);
}
