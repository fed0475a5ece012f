// Direct 3x3 convolution (stride 1, padding 1, dilation 1, groups 1) of contiguous (NCHW) float32
// tensors on TF32 tensor cores, with the bias and the ReLU in its epilogue: Conv+BN+ReLU's
// inference variant "tf32" (conv_bias_relu impl 2), where torch would run cuDNN's TF32 kernel;
// and, with the ReLU off, the convolution of Conv+BN+ReLU's float32 NCHW training forward on
// images of kTrainMinPixels or more (conv_bn_relu.cu, train_impl).
//
// cuDNN's TF32 kernels want NHWC: for NCHW float32 it transposes the input to NHWC and the output
// back around its kernel (on the H200 about 25 us of its 85 us for (32,64,56,56)->64), and the
// bias + ReLU of the folded BatchNorm ride on that. This kernel reads NCHW and writes NCHW itself.
//
// Implicit GEMM: D[pixel][co] = sum over k = (ci, kh, kw) of in[ci][oy + kh - 1][ox + kw - 1] *
// w[co][ci][kh][kw], on mma.sync.m16n8k8 (tf32 in, float32 accumulate), sm_80 and newer.
//   Block: 256 consecutive output pixels of one image (row-major p = oy * W + ox) x 64 output
//   channels (grid.y); 4 warps along the pixels, each 64 pixels x WN channels (4 x WN / 8 tiles
//   of 16 x 8 per warp).
//   K loop: chunks of 8 input channels. Per chunk the block stages in shared memory, by cp.async
//   (no registers):
//     - the input rows its pixels touch (their rows and one above and below), one plane per
//       channel as in memory, with a zero column each side; each thread rounds the values it
//       copied to TF32 (cvt.rna) once they land (ROUND);
//     - the chunk's filter taps as [tap][co][8 channels], rounded and laid out so by
//       pack_weights.
//     then runs 9 taps x 4 x WN / 8 mma per warp. Chunk c + 1 is in flight while chunk c is
//     computed (two buffers).
//   A thread's a0 / a2 are channels t / t + 4 of pixel g (a1 / a3: pixel g + 8): four 4-byte
//   loads, conflict-free (planes 8 or 24 floats apart mod 32); its b0 / b1 one 8-byte load.
//   Epilogue: + bias, ReLU, stores of 8 consecutive pixels of one channel per 8 lanes.
// Sums run in a fixed order (deterministic). Numerics: TF32 products (both operands rounded to
// nearest, 10-bit mantissas), float32 sums, as cuDNN's TF32 convolutions: on the H200 its error
// against float64 matched cuDNN's to 3 digits on every block of scripts/gpu_tf32_probe.py.
//
// H200 (scripts/gpu_tf32_probe.py, CUDA-graph replay, us; eager Conv2d -> BatchNorm2d -> ReLU /
// cuDNN's fused conv + bias + ReLU on the folded weights / this kernel, per configuration
// CUDADOCTOR_OPS_CBR_TF32_CFG = 0 (default) / 1 / 2 / 3, see tf32_config):
//   (32,64,56,56)->64     113 / 85 / 72.8, 79.2, 66.8, 72.8
//   (64,64,56,56)->64     207 / 175 / 126, 133, 123, 121
//   (64,128,28,28)->128   120 / 109 / 123, 138, 112, 126
//   (64,256,14,14)->256    88 / 81 / 144, 159, 126, 141
//   (64,512,7,7)->512     104 / 85 / 419, 471, 408, 443
// Small images leave most of a 256-pixel tile empty (7x7: 49 of 256); the module's eval tuner
// times this kernel against cuDNN's per shape and keeps the faster. Not rounding the input
// (configurations 2, 3) is 8-13% faster at 1.6x cuDNN's error (4.7e-4 against 2.9e-4 of the
// largest output).
#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "async_copy.cuh"
#include "batch_norm_common.cuh"
#include "conv3x3_tf32.h"
#include "env_setting.h"

namespace cudadoctor_ops {
namespace tf32conv {
namespace {

constexpr int kKC = 8;           // input channels per chunk
constexpr int kBN = 64;          // output channels per block
constexpr int kWStage = 9 * kBN * kKC;  // floats of one chunk's filter in shared memory

__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
#else
  r = __float_as_uint(x);
#endif
  return r;
}

__device__ __forceinline__ void mma_tf32(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  __trap();
#endif
}

// w [Cout][Cin][3][3] -> wp [Cin / 8][9][Cout][8], each value rounded to TF32; within the 8,
// position 2t holds channel t and 2t + 1 channel t + 4, so that a thread's b0 / b1 (k = t and
// k = t + 4) are adjacent.
__global__ void pack_weights(const float* __restrict__ w, float* __restrict__ wp, int Cin,
                             int Cout) {
  const int64_t total = int64_t(Cout) * Cin * 9;
  for (int64_t o = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; o < total;
       o += int64_t(gridDim.x) * blockDim.x) {
    const int pos = static_cast<int>(o % kKC);
    const int ci8 = (pos & 1) ? (pos >> 1) + 4 : (pos >> 1);
    int64_t q = o / kKC;
    const int co = static_cast<int>(q % Cout);
    q /= Cout;
    const int tap = static_cast<int>(q % 9);
    const int cc = static_cast<int>(q / 9);
    const float v = w[(int64_t(co) * Cin + cc * kKC + ci8) * 9 + tap];
    wp[o] = __uint_as_float(to_tf32(v));
  }
}

// Launch geometry, computed on the host.
//   Shared memory of one stage: the input, 8 channel planes of NR rows x RS floats (row: 3 unused,
//   a zero column, the W values from a 16-byte boundary, a zero column, unused up to a multiple
//   of 4), planes CS floats apart (CS = 8 or 24 mod 32: the 4 channels a warp's lanes read at
//   once fall in different banks); then the filter, kWStage floats.
//   Staging items: item q of a chunk is (ch, r, v): plane ch, staged row r, vector v (VEC floats)
//   of the row, q = (ch * NR + r) * nv + v; a thread's items are tid, tid + THREADS, ..., walked
//   by the steps (dv, dr, dc) of THREADS items.
struct Shape {
  int Cin, Cout, H, W;
  int tiles;     // tiles of BM pixels per image
  int NR;        // input rows staged per chunk
  int RS;        // staged row stride (floats)
  int CS;        // staged plane stride (floats)
  int nv;        // vectors per row: W / VEC
  int dv, dr, dc;
  int relu;      // 1: ReLU in the epilogue (inference), 0: the plain convolution (+ bias)
};

__host__ __device__ inline int in_stage_floats(const Shape& s) { return kKC * s.CS; }

// The direct kernel. WM x (64 / WN) warps; warp (wm, wn) computes pixels wm * 64 .. + 63 of the
// tile x output channels wn * WN .. + WN - 1 of the block's 64. VEC: floats per input copy (4
// where W % 4 == 0, else 1). ROUND: the staged input rounded to TF32 (cvt.rna) by the thread that
// copied it, before the barrier; without it the tensor cores use its leading 19 bits.
template <int WM, int WN, int VEC, bool ROUND>
__global__ void __launch_bounds__(32 * WM * (64 / WN), 2)
    conv3x3_tf32_nchw(const float* __restrict__ in, const float* __restrict__ wp,
                      const float* __restrict__ bias, float* __restrict__ out, Shape s) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr int THREADS = 32 * WM * (64 / WN);
  constexpr int BM = 64 * WM;
  constexpr int NT = WN / 8;  // n-tiles of 8 output channels per warp
  extern __shared__ __align__(16) float smem[];
  const int IS = in_stage_floats(s);
  const int stage_floats = IS + kWStage;

  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int wm = warp % WM, wn = warp / WM;
  const int g = lane >> 2, t = lane & 3;
  const int n = blockIdx.x / s.tiles;
  const int tile = blockIdx.x - n * s.tiles;
  const int co0 = blockIdx.y * kBN;
  const int HW = s.H * s.W;
  const int p0 = tile * BM;
  const int oy_first = p0 / s.W;
  const int iy0 = oy_first - 1;  // input row of staged row 0
  const int nchunks = s.Cin / kKC;

  // the zero columns (3 and W + 4 of each staged row) of both stages; copies never write them
  for (int i = tid; i < 2 * kKC * s.NR * 2; i += THREADS) {
    const int side = i & 1;
    const int rr = i >> 1;  // stage * 8 * NR + ch * NR + r
    const int st = rr / (kKC * s.NR);
    const int pr = rr - st * (kKC * s.NR);
    const int ch = pr / s.NR, r = pr - ch * s.NR;
    smem[st * stage_floats + ch * s.CS + r * s.RS + (side ? s.W + 4 : 3)] = 0.f;
  }

  // this thread's pixels: rows g and g + 8 of m-tile i of its warp, as offsets into a staged
  // plane at tap (0, 0) (kernel row 0, column 0: staged row oy - oy_first, column ox + 3);
  // pixels past the image's end read pixel p0 (their sums are dropped)
  int poff[4][2];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      int p = p0 + wm * 64 + i * 16 + g + 8 * h;
      if (p >= HW) p = p0;
      const int oy = p / s.W;
      const int ox = p - oy * s.W;
      poff[i][h] = (oy - oy_first) * s.RS + ox + 3 + t * s.CS;
    }
  }

  const float* const img = in + int64_t(n) * s.Cin * HW;
  const int items = kKC * s.NR * s.nv;
  // this thread's first item
  int v_first, r_first, c_first;
  {
    const int rv = tid / s.nv;
    v_first = tid - rv * s.nv;
    c_first = rv / s.NR;
    r_first = rv - c_first * s.NR;
  }
  // walks this thread's items: f(q, ch, r, v)
  auto for_items = [&](auto&& f) {
    int v = v_first, r = r_first, ch = c_first;
    for (int q = tid; q < items; q += THREADS) {
      f(ch, r, v);
      v += s.dv;
      r += s.dr;
      ch += s.dc;
      if (v >= s.nv) {
        v -= s.nv;
        ++r;
      }
      if (r >= s.NR) {
        r -= s.NR;
        ++ch;
      }
    }
  };
  // chunk c's input and filter into stage st (cp.async, one commit group)
  auto stage = [&](int c, int st) {
    float* const xs = smem + st * stage_floats;
    float* const ws = xs + IS;
    for_items([&](int ch, int r, int v) {
      const int iy = iy0 + r;
      const bool ok = iy >= 0 && iy < s.H;
      const float* src = img + (int64_t(c * kKC + ch) * s.H + (ok ? iy : 0)) * s.W + v * VEC;
      float* dst = xs + ch * s.CS + r * s.RS + 4 + v * VEC;
      if constexpr (VEC == 4) {
        cp_async16_zfill(dst, src, ok);
      } else {
        cp_async4_zfill(dst, src, ok);
      }
    });
    const float* wsrc = wp + int64_t(c) * 9 * s.Cout * kKC;
    for (int i = tid; i < kWStage / 4; i += THREADS) {
      const int tap = i >> 7;  // kBN * kKC / 4 = 128 copies per tap
      const int rem = i & 127;
      cp_async16(ws + i * 4, wsrc + (int64_t(tap) * s.Cout + co0) * kKC + rem * 4);
    }
    cp_async_commit();
  };
  // after this thread's copies of stage st landed: round them to TF32 in place
  auto round_stage = [&](int st) {
    if constexpr (ROUND) {
      float* const xs = smem + st * stage_floats;
      for_items([&](int ch, int r, int v) {
        float* d = xs + ch * s.CS + r * s.RS + 4 + v * VEC;
        if constexpr (VEC == 4) {
          float4 x = *reinterpret_cast<float4*>(d);
          x.x = __uint_as_float(to_tf32(x.x));
          x.y = __uint_as_float(to_tf32(x.y));
          x.z = __uint_as_float(to_tf32(x.z));
          x.w = __uint_as_float(to_tf32(x.w));
          *reinterpret_cast<float4*>(d) = x;
        } else {
          *d = __uint_as_float(to_tf32(*d));
        }
      });
    }
  };

  float acc[4][NT][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

  stage(0, 0);
  cp_async_wait_group<0>();
  round_stage(0);
  __syncthreads();

  for (int c = 0; c < nchunks; ++c) {
    const int st = c & 1;
    const bool next = c + 1 < nchunks;
    if (next) stage(c + 1, st ^ 1);
    const float* xs = smem + st * stage_floats;
    const float* ws = xs + IS + (wn * WN + g) * kKC + 2 * t;
#pragma unroll
    for (int tap = 0; tap < 9; ++tap) {
      const int kh = tap / 3, kw = tap % 3;
      const float* xt = xs + kh * s.RS + kw;
      uint32_t b[NT][2];
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const float2 v = *reinterpret_cast<const float2*>(ws + (tap * kBN + j * 8) * kKC);
        b[j][0] = __float_as_uint(v.x);
        b[j][1] = __float_as_uint(v.y);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t a0 = __float_as_uint(xt[poff[i][0]]);
        const uint32_t a1 = __float_as_uint(xt[poff[i][1]]);
        const uint32_t a2 = __float_as_uint(xt[poff[i][0] + 4 * s.CS]);
        const uint32_t a3 = __float_as_uint(xt[poff[i][1] + 4 * s.CS]);
#pragma unroll
        for (int j = 0; j < NT; ++j) mma_tf32(acc[i][j], a0, a1, a2, a3, b[j][0], b[j][1]);
      }
    }
    if (next) {
      cp_async_wait_group<0>();
      round_stage(st ^ 1);
    }
    __syncthreads();
  }

  // epilogue: + bias, ReLU (s.relu); acc[i][j] = (pixel g, co 2t), (g, 2t + 1), (g + 8, 2t),
  // (g + 8, 2t + 1)
  const bool relu = s.relu != 0;
  float* const obase = out + (int64_t(n) * s.Cout + co0 + wn * WN) * HW;
  const float* const bb = bias != nullptr ? bias + co0 + wn * WN : nullptr;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int co = j * 8 + 2 * t;
    const float b0 = bb != nullptr ? bb[co] : 0.f;
    const float b1 = bb != nullptr ? bb[co + 1] : 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int p = p0 + wm * 64 + i * 16 + g + 8 * h;
        if (p < HW) {
          const float v0 = acc[i][j][2 * h] + b0, v1 = acc[i][j][2 * h + 1] + b1;
          obase[int64_t(co) * HW + p] = relu ? fmaxf(v0, 0.f) : v0;
          obase[int64_t(co + 1) * HW + p] = relu ? fmaxf(v1, 0.f) : v1;
        }
      }
    }
  }
#else
  __trap();
#endif
}

int device_cc(int device) {
  static std::mutex mu;
  static int cached[64] = {0};
  std::lock_guard<std::mutex> lock(mu);
  if (device >= 0 && device < 64 && cached[device] > 0) return cached[device];
  int major = 0, minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  const int v = major * 10 + minor;
  if (device >= 0 && device < 64) cached[device] = v;
  return v;
}

constexpr int kBM = 256;  // output pixels per block (WM = 4 warps along the pixels)
constexpr size_t kMaxSmem = size_t(110) << 10;  // two blocks per SM on sm_90 (227 KB)

// The shared memory a block of this kernel may take on `device`: kMaxSmem, or less where the
// device allows less (sm_86 / sm_89: 99 KB).
size_t smem_limit(int device) {
  static std::mutex mu;
  static size_t cached[64] = {0};
  std::lock_guard<std::mutex> lock(mu);
  if (device >= 0 && device < 64 && cached[device] > 0) return cached[device];
  int optin = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const size_t v = std::min(kMaxSmem, static_cast<size_t>(optin));
  if (device >= 0 && device < 64) cached[device] = v;
  return v;
}

// The kernel configuration: CUDADOCTOR_OPS_CBR_TF32_CFG (read once) =
//   0: warps of 64 pixels x 64 channels (4 warps, 128 accumulators per thread, ptxas sm_90: 240 /
//      254 registers), input rounded
//   1: warps of 64 pixels x 32 channels (8 warps, 64 accumulators, 128 registers), input rounded
//   2: as 0, input not rounded (the tensor cores take its leading 19 bits)
//   3: as 1, input not rounded
// Timings in the file's header comment.
inline int tf32_config() {
  static const int v = env_choice("CUDADOCTOR_OPS_CBR_TF32_CFG", {0, 1, 2, 3}, 0);
  return v;
}

// The geometry for an input of H x W (Cin, Cout, tiles and the item steps filled in by the
// launcher).
Shape make_shape(int H, int W) {
  Shape s{};
  s.H = H;
  s.W = W;
  int span = (kBM - 1 + W - 1) / W + 1;  // rows a tile touches, at worst (it starts at a row's end)
  if (span > H) span = H;
  s.NR = span + 2;  // and the rows above and below
  s.RS = (W + 8 + 3) / 4 * 4;
  int cs = (s.NR * s.RS + 7) / 8 * 8;
  if ((cs / 8) % 2 == 0) cs += 8;  // 8 or 24 mod 32
  s.CS = cs;
  s.nv = W % 4 == 0 ? W / 4 : W;
  return s;
}

size_t smem_bytes(const Shape& s) {
  return size_t(2) * (in_stage_floats(s) + kWStage) * sizeof(float);
}

template <int WM, int WN, int VEC, bool ROUND>
void launch(const Shape& s, dim3 grid, const float* in, const float* wp, const float* bias,
            float* out, int device, cudaStream_t stream) {
  const auto kernel = conv3x3_tf32_nchw<WM, WN, VEC, ROUND>;
  const size_t smem = smem_bytes(s);
  // the most any shape applies() takes, not this one's: the attribute is set once per kernel
  bn::allow_dynamic_smem(reinterpret_cast<const void*>(kernel), device, smem_limit(device));
  kernel<<<grid, 32 * WM * (64 / WN), smem, stream>>>(in, wp, bias, out, s);
}

template <int WN, bool ROUND>
void launch_vec(const Shape& s, dim3 grid, const float* in, const float* wp, const float* bias,
                float* out, int device, cudaStream_t stream) {
  if (s.W % 4 == 0) {
    launch<4, WN, 4, ROUND>(s, grid, in, wp, bias, out, device, stream);
  } else {
    launch<4, WN, 1, ROUND>(s, grid, in, wp, bias, out, device, stream);
  }
}

// The argument of Context::allowTF32CuDNN across torch releases: none (older), a std::string
// operator name, or std::optional<Float32Op> (newer; its no-argument call refuses to answer when
// convolutions and RNNs have different settings).
template <typename F>
struct Tf32Arg {
  using type = void;
};
template <typename C, typename R, typename A>
struct Tf32Arg<R (C::*)(A) const> {
  using type = std::decay_t<A>;
};

template <typename Ctx>
bool conv_tf32(const Ctx& ctx) {
  using A = typename Tf32Arg<decltype(&Ctx::allowTF32CuDNN)>::type;
  if constexpr (std::is_void_v<A>) {
    return ctx.allowTF32CuDNN();
  } else if constexpr (std::is_same_v<A, std::string>) {
    return ctx.allowTF32CuDNN("conv");
  } else {
    return ctx.allowTF32CuDNN(A::value_type::CONV);
  }
}

}  // namespace

int compute_capability(int device) { return device_cc(device); }

bool tf32_allowed() {
  // with cuDNN off (torch.backends.cudnn.enabled = False) torch convolves in float32 without it
  const auto& ctx = at::globalContext();
  return ctx.userEnabledCuDNN() && conv_tf32(ctx);
}

bool applies(const at::Tensor& input, const at::Tensor& weight, at::IntArrayRef stride,
             at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups) {
  if (!input.is_cuda() || input.scalar_type() != at::kFloat || weight.scalar_type() != at::kFloat)
    return false;
  if (input.dim() != 4 || weight.dim() != 4 || !input.is_contiguous() || groups != 1) return false;
  if (weight.size(2) != 3 || weight.size(3) != 3 || weight.size(1) != input.size(1)) return false;
  if (weight.device() != input.device()) return false;
  for (int i = 0; i < 2; ++i)
    if (stride[i] != 1 || padding[i] != 1 || dilation[i] != 1) return false;
  const int64_t Cin = input.size(1), Cout = weight.size(0), H = input.size(2), W = input.size(3);
  if (Cin % kKC != 0 || Cout % kBN != 0 || H < 1 || W < 1 || input.size(0) < 1) return false;
  // rows of 4k floats are copied 16 bytes at a time: the data must start on a 16-byte boundary
  // (a view at an odd storage offset does not)
  if (W % 4 == 0 && reinterpret_cast<uintptr_t>(input.data_ptr()) % 16 != 0) return false;
  if (H * W > (int64_t(1) << 30) || Cin * 9 * Cout > (int64_t(1) << 30) || Cout / kBN > 65535)
    return false;
  if (input.size(0) * ((H * W + kBM - 1) / kBM) > (int64_t(1) << 31) - 1) return false;
  if (device_cc(input.get_device()) < 80) return false;
  return smem_bytes(make_shape(static_cast<int>(H), static_cast<int>(W))) <=
         smem_limit(input.get_device());
}

bool train_prefers(const at::Tensor& input) {
  static const bool on = env_switch("CUDADOCTOR_OPS_CBR_TF32_TRAIN") != 0;
  return on && input.dim() == 4 && input.size(2) * input.size(3) >= kTrainMinPixels;
}

at::Tensor conv3x3(const at::Tensor& input, const at::Tensor& weight,
                   const std::optional<at::Tensor>& bias, bool relu) {
  c10::cuda::CUDAGuard guard(input.device());
  const int device = input.get_device();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  const at::Tensor w = weight.contiguous();
  Shape s = make_shape(static_cast<int>(input.size(2)), static_cast<int>(input.size(3)));
  s.Cin = static_cast<int>(input.size(1));
  s.Cout = static_cast<int>(w.size(0));
  s.tiles = (s.H * s.W + kBM - 1) / kBM;
  const int cfg = tf32_config();
  const int threads = (cfg == 1 || cfg == 3) ? 256 : 128;
  s.dv = threads % s.nv;
  s.dr = (threads / s.nv) % s.NR;
  s.dc = threads / (s.nv * s.NR);
  s.relu = relu ? 1 : 0;
  const int64_t N = input.size(0);
  at::Tensor out = at::empty({N, s.Cout, s.H, s.W}, input.options());
  at::Tensor wpk = at::empty({w.numel()}, w.options());
  {
    const int64_t total = w.numel();
    const int blocks = static_cast<int>(std::min<int64_t>((total + 255) / 256, 1024));
    pack_weights<<<blocks, 256, 0, stream>>>(w.data_ptr<float>(), wpk.data_ptr<float>(), s.Cin,
                                             s.Cout);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  at::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->to(at::kFloat).contiguous();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const dim3 grid(static_cast<unsigned>(N * s.tiles), static_cast<unsigned>(s.Cout / kBN));
  const float* ip = input.data_ptr<float>();
  const float* wq = wpk.data_ptr<float>();
  float* op = out.data_ptr<float>();
  switch (cfg) {
    case 1:
      launch_vec<32, true>(s, grid, ip, wq, bp, op, device, stream);
      break;
    case 2:
      launch_vec<64, false>(s, grid, ip, wq, bp, op, device, stream);
      break;
    case 3:
      launch_vec<32, false>(s, grid, ip, wq, bp, op, device, stream);
      break;
    default:
      launch_vec<64, true>(s, grid, ip, wq, bp, op, device, stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace tf32conv
}  // namespace cudadoctor_ops
