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
// Data moves by TMA (tensor maps from make_tensor_maps), all of it in the 128-byte swizzle whose
// rows are one pixel's (or one output channel's) 64 values:
//   weights  [tap 9][co 64][64 ci]        73728 bytes, nine loads once per block
//   window   [pixel][64 ci] per buffer, two buffers per warpgroup; one load per tile whose box
//            starts at column -1, row h0 - 1, so the padding is the TMA's zero fill
//   y        staged [pixel][64 co] in the window just used, one store per tile whose box is the
//            tile's rows on the padded width: the padding columns and rows past H fall outside
//            the tensor and are not written
// A block is two warpgroups; each takes the tiles worker, worker + workers, ... (persistent,
// one block per SM); its first thread loads the next tile's window while the warpgroup
// multiplies the current one, and stores a tile once the warpgroup has staged it.
//
// Statistics: sums of (v - shift[co]) and (v - shift[co])^2 over the valid pixels, v the value
// stored in y (rounded to T), shift null for 0. Each block writes its partial [2][64] (its two
// warpgroups added in order); the last block to finish (a counter it resets) adds the partials in
// block order in float64 and writes sums [2][64] (float32), so the result does not depend on the
// order blocks finish.
#pragma once

#include <cuda.h>  // CUtensorMap and its enums (the encoder comes through the runtime)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace cudadoctor_ops {
namespace wgmma_conv {

constexpr int kCo = 64;                           // output channels (wgmma M)
constexpr int kCi = 64;                           // input channels
constexpr int kN = 120;                           // pixels per tile (wgmma N)
constexpr int kThreads = 256;                     // two warpgroups
constexpr int kRow = 128;                         // bytes of one pixel's (or channel's) 64 values
constexpr int kTapBytes = kCo * kRow;             // one tap's weights
constexpr int kWBytes = 9 * kTapBytes;            // weights in shared memory
constexpr int kSmemLimit = 232448 - 256;          // an H200 block's 227 KB, less the static part
// the widest image whose four windows and the weights fit that (W = 89: 230400 bytes)
constexpr int kMaxWidth = 89;
constexpr int kAccRegs = kN / 2;                  // float accumulators per thread

struct Geometry {
  int N, H, W;
  int Wp;            // W + 2
  int R;             // output rows per tile
  int tiles_per_img;
  int tiles;
  int box_bytes;     // bytes one window load brings: (R + 2) rows of Wp pixels
  int buf_bytes;     // one window buffer: the pixels a tile's B operands reach, to 1024 bytes
  int smem_bytes;    // dynamic shared memory of a block (with 1024 bytes to align it)
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
  g.box_bytes = (g.R + 2) * g.Wp * kRow;
  // B operands reach pixel m + 2 * Wp + 2 for m < kN; pixels past the box hold stale data and
  // feed only the dropped outputs
  g.buf_bytes = ((kN + 2 * g.Wp + 2) * kRow + 1023) / 1024 * 1024;
  g.smem_bytes = 1024 + kWBytes + 4 * g.buf_bytes;
  if (g.smem_bytes > kSmemLimit) g.R = 0;
  return g;
}

// The kernel's TMA descriptors: x and y as [N][H][W][64] boxes of (R + 2) and R rows of Wp
// pixels, w ([co][3][3][ci]) as one tap's [co][ci]; all with the 128-byte swizzle.
struct TensorMaps {
  CUtensorMap x, w, y;
};

// Encodes the maps of (x, w, y) for g; returns null, or what failed.
inline const char* make_tensor_maps(TensorMaps* m, const void* x, const void* w, void* y,
                                    const Geometry& g, bool bf16) {
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                              const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                              const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                              CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
#if CUDART_VERSION >= 12050
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                           cudaEnableDefault, &q);
#else
    const cudaError_t e = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &q);
#endif
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<Encode>(fn);
  }();
  if (encode == nullptr) return "the driver has no cuTensorMapEncodeTiled";
  const CUtensorMapDataType dt = bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const cuuint32_t ones[4] = {1, 1, 1, 1};
  const cuuint64_t dims[4] = {kCi, cuuint64_t(g.W), cuuint64_t(g.H), cuuint64_t(g.N)};
  const cuuint64_t strides[3] = {kRow, cuuint64_t(g.W) * kRow, cuuint64_t(g.H) * g.W * kRow};
  const cuuint32_t xbox[4] = {kCi, cuuint32_t(g.Wp), cuuint32_t(g.R + 2), 1};
  const cuuint32_t ybox[4] = {kCo, cuuint32_t(g.Wp), cuuint32_t(g.R), 1};
  if (encode(&m->x, dt, 4, const_cast<void*>(x), dims, strides, xbox, ones,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
    return "cuTensorMapEncodeTiled failed for the input";
  if (encode(&m->y, dt, 4, y, dims, strides, ybox, ones, CU_TENSOR_MAP_INTERLEAVE_NONE,
             CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
    return "cuTensorMapEncodeTiled failed for the output";
  const cuuint64_t wdims[3] = {kCi, 9, kCo};
  const cuuint64_t wstrides[2] = {kRow, 9 * kRow};
  const cuuint32_t wbox[3] = {kCi, 1, kCo};
  if (encode(&m->w, dt, 3, const_cast<void*>(w), wdims, wstrides, wbox, ones,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
    return "cuTensorMapEncodeTiled failed for the weight";
  return nullptr;
}

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CUDADOCTOR_WGMMA_DEVICE 1
#endif

namespace dev {

// generic-proxy writes of shared memory visible to the async proxy (TMA, wgmma)
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

#ifdef CUDADOCTOR_WGMMA_DEVICE
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  }
}
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                            int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, "
      "%4, %5}], [%2];\n" ::"r"(dst),
      "l"(map), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                            int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, "
      "%4, %5, %6}], [%2];\n" ::"r"(dst),
      "l"(map), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, uint32_t src, int c0, int c1,
                                             int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
          map),
      "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// the bulk stores of this thread have read their shared memory / are complete
__device__ __forceinline__ void tma_store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
__device__ __forceinline__ void tma_store_wait() {
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

// wgmma shared-memory descriptor, K-major with the 128-byte swizzle: start address (16-byte
// units), 8-row groups 1024 bytes apart; the leading offset is unused in this layout
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}

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

// x: [N][H][W][64] (channels_last), w: [64 co][3][3][64 ci], y: [N][H][W][64], through maps
// (make_tensor_maps). shift: float [64] or null. partials: float [gridDim.x][2][64] (written
// whole). sums: float [2][64]. counter: zero before the launch, zero again after it.
template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
    conv3x3_wgmma_stats(const __grid_constant__ TensorMaps maps, const float* __restrict__ shift,
                        float* __restrict__ partials, float* __restrict__ sums,
                        unsigned* __restrict__ counter, Geometry g) {
#ifdef CUDADOCTOR_WGMMA_DEVICE
  using namespace dev;
  extern __shared__ unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t s_bar[5];  // [wg][buffer] windows, then the weights
  __shared__ float s_part[2][2][kCo];         // [wg][sum, sum of squares][co]
  __shared__ int s_last;
  const int tid = threadIdx.x, wg = tid >> 7, t = tid & 127, warp = t >> 5, lane = tid & 31;
  // the swizzle is on address bits 4..9: every buffer starts on 1024 bytes
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  const uint32_t s_w = smem_addr(smem);
  const uint32_t s_x = s_w + kWBytes + wg * 2 * g.buf_bytes;  // this warpgroup's two windows
  unsigned char* x_gen = smem + kWBytes + wg * 2 * g.buf_bytes;
  const uint32_t bar_x = smem_addr(&s_bar[wg * 2]), bar_w = smem_addr(&s_bar[4]);
  const int workers = gridDim.x * 2;
  const int worker = blockIdx.x * 2 + wg;

  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < 5; ++i) mbar_init(smem_addr(&s_bar[i]), 1);
    mbar_init_fence();
  }
  __syncthreads();
  // the input window of a tile to buffer b: rows h0 - 1 .. h0 + R, columns -1 .. W, the TMA's
  // zeros outside the image
  const auto load_tile = [&](int tile, int b) {
    const int n = tile / g.tiles_per_img, h0 = (tile % g.tiles_per_img) * g.R;
    mbar_expect_tx(bar_x + 8 * b, g.box_bytes);
    tma_load_4d(s_x + b * g.buf_bytes, &maps.x, bar_x + 8 * b, 0, -1, h0 - 1, n);
  };
  if (tid == 0) {
    mbar_expect_tx(bar_w, kWBytes);
    for (int tap = 0; tap < 9; ++tap) tma_load_3d(s_w + tap * kTapBytes, &maps.w, bar_w, 0, tap, 0);
  }
  if (t == 0) {
    if (worker < g.tiles) load_tile(worker, 0);
    if (worker + workers < g.tiles) load_tile(worker + workers, 1);
  }

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

  int k = 0;
  for (int tile = worker; tile < g.tiles; tile += workers, ++k) {
    const int b = k & 1;
    if (k > 0 && t == 0) {
      // the other buffer's window is free once the store of tile k - 1 has read it
      tma_store_wait_read();
      if (tile + workers < g.tiles) load_tile(tile + workers, b ^ 1);
    }
    if (k == 0) mbar_wait(bar_w, 0);
    mbar_wait(bar_x + 8 * b, (k >> 1) & 1);
    const uint32_t xb = s_x + b * g.buf_bytes;
    acc_fence(d);
    wg_fence();
#pragma unroll
    for (int tap = 0; tap < 9; ++tap) {
      const int off = (tap / 3) * g.Wp + (tap % 3);
#pragma unroll
      for (int kk = 0; kk < kCi / 16; ++kk) {
        const uint64_t da = smem_desc(s_w + tap * kTapBytes + kk * 32);
        const uint64_t db = smem_desc(xb + off * kRow + kk * 32);
        mma<T>(d, da, db, (tap | kk) != 0);
      }
    }
    wg_commit();
    wg_wait0();
    acc_fence(d);
    bar_sync(1 + wg, 128);  // every warp's MMAs are done with the window

    // epilogue: round, sums, stage [pixel][64] in the swizzle of the store's map
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
        *reinterpret_cast<T*>(st + m * kRow + ((((co >> 3) ^ (m & 7)) << 4) | ((co & 7) * 2))) = v;
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
    fence_proxy_async();
    bar_sync(1 + wg, 128);
    if (t == 0) tma_store_4d(&maps.y, xb, 0, 0, h0, n);
  }
  if (t == 0) tma_store_wait();

  // this warpgroup's partial: the 4 lanes of a channel pair, then the block's [2][64]
#pragma unroll
  for (int o = 1; o <= 2; o <<= 1) {
    s1a += __shfl_xor_sync(0xffffffffu, s1a, o);
    s2a += __shfl_xor_sync(0xffffffffu, s2a, o);
    s1b += __shfl_xor_sync(0xffffffffu, s1b, o);
    s2b += __shfl_xor_sync(0xffffffffu, s2b, o);
  }
  if ((lane & 3) == 0) {
    s_part[wg][0][co0] = s1a;
    s_part[wg][0][co0 + 8] = s1b;
    s_part[wg][1][co0] = s2a;
    s_part[wg][1][co0 + 8] = s2b;
  }
  __syncthreads();
  if (tid < 2 * kCo) {
    const int v = tid;
    partials[int64_t(blockIdx.x) * 2 * kCo + v] = s_part[0][v >> 6][v & 63] + s_part[1][v >> 6][v & 63];
    __threadfence();
  }
  __syncthreads();
  if (tid == 0) s_last = atomicAdd(counter, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  // the last block: value v = tid % 128 over half of the blocks each, in block order (8
  // interleaved accumulators, added in order)
  {
    double* s_red = reinterpret_cast<double*>(smem);  // the weights are no longer read
    const int v = tid & 127, half = tid >> 7;
    const int nb = gridDim.x;
    const int b0 = half ? nb / 2 : 0, b1 = half ? nb : nb / 2;
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int bk = b0; bk < b1; bk += 8) {
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (bk + j < b1) acc[j] += __ldcg(partials + int64_t(bk + j) * 2 * kCo + v);
    }
    s_red[half * 128 + v] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    __syncthreads();
    if (half == 0) sums[v] = static_cast<float>(s_red[v] + s_red[128 + v]);
    if (tid == 0) *counter = 0u;
  }
#endif
}

}  // namespace wgmma_conv
}  // namespace cudadoctor_ops
