// 3x3 convolution (stride 1, padding 1, dilation 1, groups 1) of channels_last float16 /
// bfloat16 tensors on tensor cores, with float32 sums, the bias and the ReLU in its epilogue:
// Conv+BN+ReLU's inference variant "hmma" (conv_bias_relu impl 3) and, with
// CUDADOCTOR_OPS_CBR_HMMA_TRAIN=1, the convolution of its 16-bit channels_last training forward
// (ReLU off). Both opt-in (see conv3x3_hmma.h).
//
// Implicit GEMM: D[p][co] = sum over k = (ci, tap) of in[n][oy + kh - 1][ox + kw - 1][ci] *
// w[co][ci][kh][kw], on mma.sync.m16n8k16 (16-bit in, float32 accumulate), sm_80 and newer.
//   Block: a tile of kTH = 8 x kTW = 16 output pixels of one image x kBN = 64 output channels
//   (grid.y); 4 warps as 2 x 2, each 4 output rows (one 16 x 8 tile row per output row) x 32
//   channels: 4 x 4 tiles of 16 x 8, 64 float32 accumulators.
//   K loop: chunks of kBK = 32 input channels, the 9 taps of a chunk as 9 steps. Per chunk the
//   block stages the input tile its pixels touch, (kTH + 2) x (kTW + 2) pixels x 32 channels,
//   zero filled outside the image (the padding), once; per step the tap's 64 x 32 filter values
//   from the packed weights [tap][co][ci]. Every tap's A operand is the same input tile read at
//   a shift (ldmatrix takes one row address per lane), so each input value crosses from L2 about
//   (10 * 18) / (8 * 16) = 1.4 times per chunk instead of 9 times (one copy per tap), the traffic
//   that bounds implicit GEMMs that copy the shifted input for each tap. All copies are cp.async
//   (no registers): two input-tile buffers, three filter buffers, steps k + 1 and k + 2 in flight
//   while step k is computed. Rows of 32 values are kept 40 apart (80 bytes) so that the 8 rows
//   an ldmatrix reads (8 neighbouring pixels) fall in 8 different bank quads.
//   Fragments: ldmatrix.x4 (A: 16 pixels of one output row x 16 channels; B: two 8 x 16 tiles of
//   output channels x input channels, the column-major B that mma .col reads).
//   Epilogue: + bias, ReLU, each thread's two adjacent channels of a pixel as one 4-byte store.
// Sums run in a fixed order (deterministic).
// Measured on the H200 (opsrc/README.md, Measured, 2026-12-02): correct, but 1.6-4x slower than
// cuDNN's warpgroup-MMA kernels on every layer timed (47.8 against 30.3 us on the float16
// (32,64,56,56)->64 layer), hence opt-in everywhere.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <optional>

#include "async_copy.cuh"
#include "conv3x3_hmma.h"
#include "conv3x3_tf32.h"
#include "env_setting.h"

namespace cudadoctor_ops {
namespace hmmaconv {
namespace {

constexpr int kTH = 8;        // output rows per tile
constexpr int kTW = 16;       // output columns per tile
constexpr int kIH = kTH + 2;  // input rows of a tile
constexpr int kIW = kTW + 2;  // input columns of a tile
constexpr int kBN = 64;       // output channels per block
constexpr int kBK = 32;       // input channels per chunk
constexpr int kRow = 40;      // 16-bit values between staged rows (32 used, 80 bytes)
constexpr int kWStages = 3;   // filter buffers (one tap each)
constexpr int kIStages = 2;   // input-tile buffers (one chunk each)
constexpr int kThreads = 128;
constexpr int kTileElems = kIH * kIW * kRow;  // 7200 values, 14.1 KB
constexpr int kWElems = kBN * kRow;           // 2560 values, 5 KB

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
#else
  __trap();
#endif
}

template <bool BF16>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (BF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#else
  __trap();
#endif
}

template <bool BF16>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (BF16) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

struct Args {
  int H, W, Cin, Cout;
  int tilesX, tilesY;  // tiles along W and H
  int steps;           // 9 * Cin / kBK
  int relu;
};

// in [N][H][W][Cin], wp [9][Cout][Cin], bias float [Cout] or null, out [N][H][W][Cout]; 16-bit
// values as uint16_t. At most 128 registers: 4 blocks (43 KB of shared memory each) per SM.
template <bool BF16>
__global__ void __launch_bounds__(kThreads, 4)
    conv3x3_hmma_nhwc(const uint16_t* __restrict__ in, const uint16_t* __restrict__ wp,
                      const float* __restrict__ bias, uint16_t* __restrict__ out, const Args a) {
  __shared__ __align__(16) uint16_t tiles[kIStages * kTileElems];
  __shared__ __align__(16) uint16_t filt[kWStages * kWElems];
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wm = warp & 1;   // output rows 4 * wm .. 4 * wm + 3 of the tile
  const int wn = warp >> 1;  // channels 32 * wn .. 32 * wn + 31 of the block
  unsigned b = blockIdx.x;
  const int tx = static_cast<int>(b % static_cast<unsigned>(a.tilesX));
  b /= static_cast<unsigned>(a.tilesX);
  const int ty = static_cast<int>(b % static_cast<unsigned>(a.tilesY));
  const int64_t n = b / static_cast<unsigned>(a.tilesY);
  const int oy0 = ty * kTH, ox0 = tx * kTW;
  const int co0 = blockIdx.y * kBN;
  const uint16_t* img = in + n * a.H * a.W * a.Cin;

  // the input tile of chunk c: (kIH x kIW) pixels from (oy0 - 1, ox0 - 1), 4 16-byte pieces each
  auto stage_tile = [&](int slot, int c) {
    uint16_t* dst = tiles + slot * kTileElems;
    for (int q = tid; q < kIH * kIW * 4; q += kThreads) {
      const int pix = q >> 2, piece = q & 3;
      const int r = pix / kIW, col = pix - r * kIW;
      const int iy = oy0 - 1 + r, ix = ox0 - 1 + col;
      const bool ok = iy >= 0 && iy < a.H && ix >= 0 && ix < a.W;
      // a valid address for the zero-filling copies: the tensor's first element
      const uint16_t* src =
          ok ? img + (static_cast<int64_t>(iy) * a.W + ix) * a.Cin + c * kBK + piece * 8 : in;
      cp_async16_zfill(dst + pix * kRow + piece * 8, src, ok);
    }
  };
  // the filter of step s (chunk s / 9, tap s % 9): 64 rows (output channels) x 4 pieces
  auto stage_filter = [&](int s) {
    const int c = s / 9, tap = s - c * 9;
    uint16_t* dst = filt + (s % kWStages) * kWElems;
#pragma unroll
    for (int i = 0; i < (kBN * 4) / kThreads; ++i) {
      const int q = tid + i * kThreads;
      const int row = q >> 2, piece = q & 3;
      cp_async16(dst + row * kRow + piece * 8,
                 wp + (static_cast<int64_t>(tap) * a.Cout + co0 + row) * a.Cin + c * kBK + piece * 8);
    }
  };
  // the copies of step s, one cp.async group: its filter, and the chunk's input tile at its first tap
  auto stage = [&](int s) {
    if (s < a.steps) {
      if (s % 9 == 0) stage_tile((s / 9) % kIStages, s / 9);
      stage_filter(s);
    }
    cp_async_commit();
  };

  float acc[4][4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int k = 0; k < 4; ++k) acc[i][j][k] = 0.f;

  stage(0);
  stage(1);
  for (int s = 0; s < a.steps; ++s) {
    cp_async_wait_group<1>();  // step s's copies (and its chunk's tile, copied at step 9 * (s / 9)) landed
    // visible to all; every warp done with step s - 1, whose filter buffer step s + 2 reuses (the
    // tile buffer step s + 2 may fill held chunk (s + 2) / 9 - 2, last read at a step < s - 1)
    __syncthreads();
    stage(s + 2);

    const int c = s / 9, tap = s - c * 9;
    const int kh = tap / 3, kw = tap - kh * 3;
    const uint16_t* T = tiles + (c % kIStages) * kTileElems;
    const uint16_t* Bs = filt + (s % kWStages) * kWElems;
#pragma unroll
    for (int ks = 0; ks < kBK / 16; ++ks) {
      uint32_t af[4][4];
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        // tile row mt of the warp = output row 4 * wm + mt, its 16 pixels; lanes 16-31 the upper
        // 8 channels of the 16
        const int pix = (wm * 4 + mt + kh) * kIW + (lane & 15) + kw;
        ldmatrix_x4(af[mt], T + pix * kRow + ks * 16 + (lane >> 4) * 8);
      }
      uint32_t bf[2][4];
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        const int r = wn * 32 + np * 16 + (lane & 7) + ((lane >> 4) << 3);
        ldmatrix_x4(bf[np], Bs + r * kRow + ks * 16 + ((lane >> 3) & 1) * 8);
      }
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
          mma16816<BF16>(acc[mt][nt], af[mt], bf[nt >> 1][(nt & 1) * 2],
                         bf[nt >> 1][(nt & 1) * 2 + 1]);
    }
  }
  cp_async_wait_group<0>();

  // Epilogue: accumulator c0 / c1 are tile row g (pixel g of the output row), channels 2t / 2t + 1
  // of the 16 x 8 tile; c2 / c3 the same channels of pixel g + 8.
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    const int co = co0 + wn * 32 + nt * 8 + 2 * t;
    const float b0 = bias != nullptr ? bias[co] : 0.f;
    const float b1 = bias != nullptr ? bias[co + 1] : 0.f;
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
      const int oy = oy0 + wm * 4 + mt;
      if (oy >= a.H) continue;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int ox = ox0 + g + h * 8;
        if (ox >= a.W) continue;
        float v0 = acc[mt][nt][2 * h] + b0;
        float v1 = acc[mt][nt][2 * h + 1] + b1;
        if (a.relu) {
          v0 = fmaxf(v0, 0.f);
          v1 = fmaxf(v1, 0.f);
        }
        const int64_t o = ((n * a.H + oy) * a.W + ox) * a.Cout + co;
        *reinterpret_cast<uint32_t*>(out + o) = pack2<BF16>(v0, v1);
      }
    }
  }
}

}  // namespace

bool applies(const at::Tensor& input, const at::Tensor& weight, at::IntArrayRef stride,
             at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups) {
  const auto st = input.scalar_type();
  if (!input.is_cuda() || (st != at::kHalf && st != at::kBFloat16) || weight.scalar_type() != st)
    return false;
  if (input.dim() != 4 || weight.dim() != 4 || groups != 1) return false;
  if (stride.size() != 2 || padding.size() != 2 || dilation.size() != 2) return false;
  for (int i = 0; i < 2; ++i)
    if (stride[i] != 1 || padding[i] != 1 || dilation[i] != 1) return false;
  if (weight.size(2) != 3 || weight.size(3) != 3 || weight.size(1) != input.size(1)) return false;
  if (weight.device() != input.device()) return false;
  // channels_last proper: a tensor that is also plain contiguous (C == 1, or H == W == 1) keeps
  // NCHW in the other kernels
  if (input.is_contiguous() || !input.is_contiguous(at::MemoryFormat::ChannelsLast)) return false;
  if (reinterpret_cast<uintptr_t>(input.data_ptr()) % 16 != 0) return false;
  const int64_t N = input.size(0), Cin = input.size(1), H = input.size(2), W = input.size(3);
  const int64_t Cout = weight.size(0);
  if (N < 1 || H < 1 || W < 1 || Cin % kBK != 0 || Cout % kBN != 0 || Cout / kBN > 65535)
    return false;
  const int64_t tiles = ((H + kTH - 1) / kTH) * ((W + kTW - 1) / kTW);
  if (N * tiles > (int64_t(1) << 31) - 1 || H * W * Cin > (int64_t(1) << 31) || Cin * 9 > (1 << 30))
    return false;
  return tf32conv::compute_capability(input.get_device()) >= 80;
}

bool train_enabled() {
  static const bool on = env_switch("CUDADOCTOR_OPS_CBR_HMMA_TRAIN") == 1;
  return on;
}

at::Tensor conv3x3(const at::Tensor& input, const at::Tensor& weight,
                   const std::optional<at::Tensor>& bias, bool relu) {
  c10::cuda::CUDAGuard guard(input.device());
  const int device = input.get_device();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  const int64_t N = input.size(0), Cin = input.size(1), H = input.size(2), W = input.size(3);
  const int64_t Cout = weight.size(0);
  at::Tensor out = at::empty({N, Cout, H, W},
                             input.options().memory_format(at::MemoryFormat::ChannelsLast));
  if (out.numel() == 0) return out;
  // [Cout][Cin][3][3] -> [3][3][Cout][Cin]: per tap, each output channel's input channels in a row
  const at::Tensor wpk = weight.permute({2, 3, 0, 1}).contiguous();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->to(at::kFloat).contiguous();
  Args a;
  a.H = static_cast<int>(H);
  a.W = static_cast<int>(W);
  a.Cin = static_cast<int>(Cin);
  a.Cout = static_cast<int>(Cout);
  a.tilesX = static_cast<int>((W + kTW - 1) / kTW);
  a.tilesY = static_cast<int>((H + kTH - 1) / kTH);
  a.steps = static_cast<int>(9 * Cin / kBK);
  a.relu = relu ? 1 : 0;
  const dim3 grid(static_cast<unsigned>(N * a.tilesX * a.tilesY), static_cast<unsigned>(Cout / kBN));
  const auto* ip = static_cast<const uint16_t*>(input.data_ptr());
  const auto* wq = static_cast<const uint16_t*>(wpk.data_ptr());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  auto* op = static_cast<uint16_t*>(out.data_ptr());
  if (input.scalar_type() == at::kBFloat16)
    conv3x3_hmma_nhwc<true><<<grid, kThreads, 0, stream>>>(ip, wq, bp, op, a);
  else
    conv3x3_hmma_nhwc<false><<<grid, kThreads, 0, stream>>>(ip, wq, bp, op, a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace hmmaconv
}  // namespace cudadoctor_ops
