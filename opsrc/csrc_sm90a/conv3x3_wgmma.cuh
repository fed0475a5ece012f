// conv3x3_wgmma: a Hopper (sm_90a) tensor-core 3x3 convolution, stride 1, padding 1, 64 -> 64
// channels, float16 / bfloat16 channels_last, with BatchNorm's per-channel sums of the result in
// its epilogue. Torch-free (the harness scripts/wgmma_conv_dev.cu includes it as it is).
//
// The GEMM is transposed: D[co][pixel] = W[co][k] * X[pixel][k], k = (tap, ci), so the 64 output
// channels are wgmma's M = 64 and a tile of pixels is its N = 120. A tile is R = 120 / (W + 2)
// whole output rows of one image on the zero-padded width W + 2: in that padded space the input
// pixel of tap (r, s) for output pixel m of the tile is input pixel m + r * (W + 2) + s of the
// tile's (R + 2)-row input window, so every tap's B operand is the same shared-memory window at
// another start address; the two padding columns of each row are computed and dropped.
//
// Shared memory (no swizzle, wgmma's 8 x 16-byte core matrices):
//   weights  [tap 9][chunk 8][co 64][8 ci]          73728 bytes, loaded once per block
//   window   [chunk 8][pixel pitch][8 ci] per buffer, two buffers per warpgroup
// A block is two warpgroups; each takes the tiles worker, worker + workers, ... (persistent,
// one block per SM), loads the next tile's window by cp.async while it multiplies the current
// one, and runs its epilogue (round to T, per-channel sums, staging through the window it has
// just used, 16-byte stores of y) while the other warpgroup multiplies.
//
// Statistics: sums of (v - shift[co]) and (v - shift[co])^2 over the valid pixels, v the value
// stored in y (rounded to T), shift null for 0. Each warpgroup writes its partial [2][64]; the
// last block to finish (a counter it resets) adds the partials in worker order in float64 and
// writes sums [2][64] (float32), so the result does not depend on the order blocks finish.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace cudadoctor_ops {
namespace wgmma_conv {

constexpr int kCo = 64;                           // output channels (wgmma M)
constexpr int kCi = 64;                           // input channels
constexpr int kChunks = kCi / 8;                  // 16-byte chunks of a pixel's input channels
constexpr int kN = 120;                           // pixels per tile (wgmma N)
constexpr int kThreads = 256;                     // two warpgroups
constexpr int kWBytes = 9 * kChunks * kCo * 16;   // weights in shared memory
// the widest image whose four windows and the weights fit an H200 block's 227 KB of shared
// memory (W = 89: 229888 bytes)
constexpr int kMaxWidth = 89;
constexpr int kAccRegs = kN / 2;                  // float accumulators per thread

struct Geometry {
  int N, H, W;
  int Wp;            // W + 2
  int R;             // output rows per tile
  int tiles_per_img;
  int tiles;
  int pitch;         // bytes between chunks of a window
  int buf_bytes;     // one window buffer
  int smem_bytes;    // dynamic shared memory of a block
};

// The geometry of (N, H, W); R = 0 where W is too wide for one tile.
inline Geometry make_geometry(int N, int H, int W) {
  Geometry g{};
  g.N = N;
  g.H = H;
  g.W = W;
  g.Wp = W + 2;
  g.R = W >= 1 && W <= kMaxWidth ? kN / g.Wp : 0;
  if (g.R < 1) return g;
  g.tiles_per_img = (H + g.R - 1) / g.R;
  g.tiles = N * g.tiles_per_img;
  // pixels a tile's B operands reach: m + 2 * Wp + 2 for m < kN; a multiple of 8, plus one
  // pixel of pitch so that the 8 chunks of a pixel fall in different banks
  const int npix = (kN + 2 * g.Wp + 2 + 7) / 8 * 8;
  g.pitch = (npix + 1) * 16;
  g.buf_bytes = kChunks * g.pitch;
  g.smem_bytes = kWBytes + 4 * g.buf_bytes;
  return g;
}

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CUDADOCTOR_WGMMA_DEVICE 1
#endif

namespace dev {

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// generic-proxy writes of shared memory (cp.async included) visible to wgmma's async proxy
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// wgmma shared-memory descriptor, no swizzle: start address, leading (K direction) and stride
// (M / N direction, between groups of 8 rows) byte offsets, all in 16-byte units.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t((lbo >> 4) & 0x3FFF) << 16) |
         (uint64_t((sbo >> 4) & 0x3FFF) << 32);
}

#ifdef CUDADOCTOR_WGMMA_DEVICE
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wg_wait0() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
// keeps the compiler from moving accumulator accesses across the asynchronous MMAs
__device__ __forceinline__ void acc_fence(float (&d)[kAccRegs]) {
#pragma unroll
  for (int i = 0; i < kAccRegs; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// D (+)= A * B, m64n120k16, A and B K-major in shared memory; scale_d = 0: D = A * B
template <typename T>
__device__ __forceinline__ void mma(float (&d)[kAccRegs], uint64_t da, uint64_t db, int scale_d);

template <>
__device__ __forceinline__ void mma<__half>(float (&d)[kAccRegs], uint64_t da, uint64_t db,
                                            int scale_d) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %62, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n120k16.f32.f16.f16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
      "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
      "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59"
      "}, %60, %61, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
        "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
        "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
        "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
        "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
        "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),
        "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59])
      : "l"(da), "l"(db), "r"(scale_d));
}

template <>
__device__ __forceinline__ void mma<__nv_bfloat16>(float (&d)[kAccRegs], uint64_t da, uint64_t db,
                                                   int scale_d) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %62, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n120k16.f32.bf16.bf16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
      "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
      "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59"
      "}, %60, %61, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
        "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
        "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
        "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
        "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
        "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),
        "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59])
      : "l"(da), "l"(db), "r"(scale_d));
}
#endif

template <typename T>
__device__ __forceinline__ T to_t(float v);
template <>
__device__ __forceinline__ __half to_t<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 to_t<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

}  // namespace dev

// x: [N][H][W][64] (channels_last), w: [64 co][3][3][64 ci], y: [N][H][W][64]; 16-byte aligned.
// shift: float [64] or null. partials: float [2 * gridDim.x][2][64] (written whole). sums:
// float [2][64]. counter: zero before the launch, zero again after it.
template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
    conv3x3_wgmma_stats(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                        const float* __restrict__ shift, float* __restrict__ partials,
                        float* __restrict__ sums, unsigned* __restrict__ counter, Geometry g) {
#ifdef CUDADOCTOR_WGMMA_DEVICE
  using namespace dev;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ double s_red[2][128];
  __shared__ int s_last;
  const int tid = threadIdx.x, wg = tid >> 7, t = tid & 127, warp = t >> 5, lane = tid & 31;
  const uint32_t s_w = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t s_x = s_w + kWBytes + wg * 2 * g.buf_bytes;  // this warpgroup's two windows
  unsigned char* x_gen = smem + kWBytes + wg * 2 * g.buf_bytes;
  const int workers = gridDim.x * 2;
  const int worker = blockIdx.x * 2 + wg;

  // weights: chunk (co, tap, c) of w to [tap][c][co]
  for (int i = tid; i < kCo * 9 * kChunks; i += kThreads) {
    const int c = i % kChunks, ct = i / kChunks, tap = ct % 9, co = ct / 9;
    cp_async16(s_w + ((tap * kChunks + c) * kCo + co) * 16, w + int64_t(i) * 8, 16);
  }
  // the input window of a tile to buffer b: rows h0 - 1 .. h0 + R, columns -1 .. W, zeros
  // outside the image
  const auto load_tile = [&](int tile, int b) {
    const int n = tile / g.tiles_per_img, h0 = (tile % g.tiles_per_img) * g.R;
    const uint32_t dst = s_x + b * g.buf_bytes;
    const int items = (g.R + 2) * g.Wp * kChunks;
    for (int i = t; i < items; i += 128) {
      const int c = i % kChunks, pix = i / kChunks;
      const int hh = pix / g.Wp, ww = pix - hh * g.Wp;
      const int h = h0 - 1 + hh, wc = ww - 1;
      const bool ok = h >= 0 && h < g.H && wc >= 0 && wc < g.W;
      const T* src = ok ? x + ((int64_t(n) * g.H + h) * g.W + wc) * kCi + c * 8 : x;
      cp_async16(dst + c * g.pitch + pix * 16, src, ok ? 16 : 0);
    }
  };

  const int co0 = warp * 16 + (lane >> 2);  // this thread's channels: co0 and co0 + 8
  const float sh0 = shift != nullptr ? shift[co0] : 0.f;
  const float sh1 = shift != nullptr ? shift[co0 + 8] : 0.f;
  // slot (jj, e) of the accumulators is pixel m = 8 jj + 2 (lane % 4) + (e % 2); which of them
  // are real output columns (m % Wp < W)
  uint32_t colok = 0;  // bit jj * 2 + (e % 2)
#pragma unroll
  for (int jj = 0; jj < kN / 8; ++jj)
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const int m = 8 * jj + 2 * (lane & 3) + b;
      if (m % g.Wp < g.W) colok |= 1u << (jj * 2 + b);
    }
  float s1a = 0.f, s2a = 0.f, s1b = 0.f, s2b = 0.f;
  float d[kAccRegs];
#pragma unroll
  for (int i = 0; i < kAccRegs; ++i) d[i] = 0.f;

  // K direction: the next chunk; M / N direction: the next 8 rows (128 bytes on)
  const uint32_t lbo_w = kCo * 16, sbo_w = 128;
  const uint32_t lbo_x = g.pitch, sbo_x = 128;

  const bool has0 = worker < g.tiles;
  if (has0) load_tile(worker, 0);
  cp_async_commit();  // weights + tile 0
  if (has0 && worker + workers < g.tiles) load_tile(worker + workers, 1);
  cp_async_commit();  // tile 1
  cp_async_wait<1>();
  fence_proxy_async();
  __syncthreads();  // the weights, loaded by both warpgroups

  int k = 0;
  for (int tile = worker; tile < g.tiles; tile += workers, ++k) {
    const int b = k & 1;
    if (k > 0) {
      const int next = tile + workers;
      if (next < g.tiles) load_tile(next, b ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
      fence_proxy_async();
      bar_sync(1 + wg, 128);
    }
    const uint32_t xb = s_x + b * g.buf_bytes;
    acc_fence(d);
    wg_fence();
#pragma unroll
    for (int tap = 0; tap < 9; ++tap) {
      const int off = (tap / 3) * g.Wp + (tap % 3);
#pragma unroll
      for (int kk = 0; kk < kChunks / 2; ++kk) {
        const uint64_t da = smem_desc(s_w + (tap * kChunks + 2 * kk) * kCo * 16, lbo_w, sbo_w);
        const uint64_t db = smem_desc(xb + 2 * kk * g.pitch + off * 16, lbo_x, sbo_x);
        mma<T>(d, da, db, (tap | kk) != 0);
      }
    }
    wg_commit();
    wg_wait0();
    acc_fence(d);
    bar_sync(1 + wg, 128);  // every warp's MMAs are done with the window

    // epilogue: round, sums, stage [pixel][64] (16-byte units swizzled by pixel % 8)
    const int n = tile / g.tiles_per_img, h0 = (tile % g.tiles_per_img) * g.R;
    const int rows = g.H - h0 < g.R ? g.H - h0 : g.R;
    const int lim = rows * g.Wp;
    unsigned char* st = x_gen + b * g.buf_bytes;
#pragma unroll
    for (int jj = 0; jj < kN / 8; ++jj) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int co = co0 + 8 * (e >> 1);
        const int m = 8 * jj + 2 * (lane & 3) + (e & 1);
        const T v = to_t<T>(d[jj * 4 + e]);
        *reinterpret_cast<T*>(st + m * 128 + ((((co >> 3) ^ (m & 7)) << 4) | ((co & 7) * 2))) = v;
        if (m < lim && ((colok >> (jj * 2 + (e & 1))) & 1u)) {
          const float f = to_f(v) - ((e >> 1) ? sh1 : sh0);
          if (e >> 1) {
            s1b += f;
            s2b += f * f;
          } else {
            s1a += f;
            s2a += f * f;
          }
        }
      }
    }
    bar_sync(1 + wg, 128);
    for (int i = t; i < kN * 8; i += 128) {
      const int m = i >> 3, u = i & 7;
      const int ii = m / g.Wp, j = m - ii * g.Wp;
      if (ii < rows && j < g.W) {
        const uint4 v = *reinterpret_cast<const uint4*>(st + m * 128 + ((u ^ (m & 7)) << 4));
        *reinterpret_cast<uint4*>(y + ((int64_t(n) * g.H + h0 + ii) * g.W + j) * kCo + u * 8) = v;
      }
    }
    bar_sync(1 + wg, 128);  // the window is free for the load of tile k + 2
  }
  cp_async_wait<0>();

  // this warpgroup's partial: the 4 lanes of a channel pair, then [2][64]
#pragma unroll
  for (int o = 1; o <= 2; o <<= 1) {
    s1a += __shfl_xor_sync(0xffffffffu, s1a, o);
    s2a += __shfl_xor_sync(0xffffffffu, s2a, o);
    s1b += __shfl_xor_sync(0xffffffffu, s1b, o);
    s2b += __shfl_xor_sync(0xffffffffu, s2b, o);
  }
  if ((lane & 3) == 0) {
    float* p = partials + int64_t(worker) * 2 * kCo;
    p[co0] = s1a;
    p[co0 + 8] = s1b;
    p[kCo + co0] = s2a;
    p[kCo + co0 + 8] = s2b;
  }
  __threadfence();
  __syncthreads();
  if (tid == 0) s_last = atomicAdd(counter, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  // the last block: value v = tid % 128 over half of the workers each, in worker order
  {
    const int v = tid & 127, half = tid >> 7;
    const int w0 = half ? workers / 2 : 0, w1 = half ? workers : workers / 2;
    double acc = 0;
#pragma unroll 8
    for (int wk = w0; wk < w1; ++wk) acc += __ldcg(partials + int64_t(wk) * 2 * kCo + v);
    s_red[half][v] = acc;
    __syncthreads();
    if (half == 0) {
      sums[v] = static_cast<float>(s_red[0][v] + s_red[1][v]);
    }
    if (tid == 0) *counter = 0u;
  }
#endif
}

}  // namespace wgmma_conv
}  // namespace cudadoctor_ops
