// Depthwise 2-D convolution, channels_last forward, fourth generation: a
// direct kernel without input staging (multiplier 1, square K in {3,5,7},
// stride 1 or 2, dilation 1, float16 / bfloat16). With flip=true and stride 1
// it computes the input gradient like the other forward kernels:
// dX = conv(dY, rot180(w), padding K-1-p).
//
//   in [N][H][W][C], out [N][Ho][Wo][C], w [C][K][K], bias [C] or null.
//
// Thread: V = 8 channels (one 16-byte vector) x RW consecutive output columns
// of one output row. For each kernel row it loads the NCOL = (RW-1)*S+K input
// vectors of that row straight from global memory (16-byte read-only loads,
// zero outside the image), converts them to float32 and accumulates into its
// RW x V float32 outputs.
//
// Block: CB channel vectors x GX column groups x GY output rows of one image
// (a 2-D patch of GX*RW x GY outputs for CB*8 channels). The thread index runs
// over channel vectors first, then column groups, then rows, so the lanes of a
// warp read consecutive 16-byte vectors of a pixel (coalesced), and the
// threads of a block that share input pixels (neighbouring columns and rows
// of the same channels) hit the same L1 lines: the block's input footprint,
// ((GY-1)*S+K) x ((GX*RW-1)*S+K) pixels x CB vectors, is loaded from L2 about
// once and every further use is an L1 hit. No input goes through shared
// memory.
//
// HOIST (chosen per launch: v4_auto_hoist): each thread loads its first kernel row inside the
// image before the weight staging and its barrier, so that the two latencies overlap.
//
// Weights: the block's CB*8 channels x K*K taps, staged once as float32 in
// shared memory as [channel vector][tap][8] (each vector's taps padded by 4
// floats so that 8 consecutive channel vectors read 8 disjoint bank quads);
// a thread reads the 8 weights of one tap as two float4 at a constant offset
// from its own base. Bias as [channel] floats after them.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>

#include "depthwise.cuh"
#include "env_setting.h"

namespace cudadoctor_ops {
namespace depthwise {
namespace {

constexpr int kV4Vec = 8;  // channels per thread (16 bytes of a 16-bit type)

struct V4Args {
  int C, H, W, Ho, Wo, PH, PW;
  int CB;        // channel vectors per block (<= kV4MaxCB in v4_plan; v4_plan_wave: up to 256)
  int nCh;       // channel chunks (blocks along C)
  int GX, GY;    // column groups (of RW outputs) and output rows per block
  int nTx, nTy;  // tiles along W and H
  bool wvec;     // weights 16-byte aligned: staged with 16-byte loads
  bool flip;     // rot180 weights
};

constexpr int kV4MaxCB = 16;

// Floats per channel vector in the staged weights: K*K taps of 8 floats, plus
// 4 of padding (16-byte aligned rows; 8 consecutive vectors start in 8
// different bank quads because K*K is odd).
__host__ __device__ constexpr int v4_wstride_host(int K) { return K * K * kV4Vec + 4; }
template <int K>
__host__ __device__ constexpr int v4_wstride() {
  return v4_wstride_host(K);
}

template <typename T>
__device__ __forceinline__ void v4_unpack(const uint4& raw, float (&v)[kV4Vec]) {
  T e[kV4Vec];
  memcpy(e, &raw, 16);
#pragma unroll
  for (int k = 0; k < kV4Vec; ++k) v[k] = static_cast<float>(e[k]);
}

template <typename T, int K, int S, int RW, int NT, int MINB, bool HOIST>
__global__ void __launch_bounds__(NT, MINB)
    fwd_nhwc_v4(const T* __restrict__ in, const T* __restrict__ w,
                const T* __restrict__ bias, T* __restrict__ out, const V4Args a) {
  constexpr int V = kV4Vec;
  constexpr int KK = K * K;
  constexpr int NCOL = (RW - 1) * S + K;
  constexpr int WS = v4_wstride<K>();
  static_assert(NCOL <= 32, "column mask is 32 bits");
  extern __shared__ float4 smem_v4[];
  float* sw = reinterpret_cast<float*>(smem_v4);  // [CB][WS]
  float* sb = sw + a.CB * WS;                     // [CB * V]

  unsigned b = blockIdx.x;
  const int chunk = static_cast<int>(b % static_cast<unsigned>(a.nCh));
  b /= static_cast<unsigned>(a.nCh);
  const int txt = static_cast<int>(b % static_cast<unsigned>(a.nTx));
  b /= static_cast<unsigned>(a.nTx);
  const int tyt = static_cast<int>(b % static_cast<unsigned>(a.nTy));
  const int n = static_cast<int>(b / static_cast<unsigned>(a.nTy));

  const int tid = threadIdx.x;
  const int nthr = blockDim.x;
  const int c0 = chunk * a.CB * V;       // first channel of the block
  const int nvalid = min(a.CB * V, a.C - c0);  // channels of the block inside C (multiple of 8)

  // HOIST: the first kernel row inside the image is loaded before the weight staging and its
  // barrier, so that its latency overlaps the weights' (the row loop below skips its load). The
  // thread's position is worked out here for the hoisted kernels only and again after the barrier
  // for all: computed once before the staging, it changed the non-hoisted kernels' register
  // allocation (ptxas spilled 4-8 bytes at 5x5 stride 1).
  uint4 raw[NCOL];
  int iyh = -1;  // the hoisted row
  if constexpr (HOIST) {
    const int cv = tid % a.CB;
    const int pos = tid / a.CB;
    const int c = c0 + cv * V;
    const int gy = pos / a.GX;
    const int oy = tyt * a.GY + gy;
    const int ox0 = (txt * a.GX + (pos - gy * a.GX)) * RW;
    const int iy0 = oy * S - a.PH;
    const int row = max(iy0, 0);
    if (pos < a.GX * a.GY && c < a.C && oy < a.Ho && ox0 < a.Wo && row < min(iy0 + K, a.H)) {
      iyh = row;
      const int ixb = ox0 * S - a.PW;
      const uint4* rp = reinterpret_cast<const uint4*>(
          in + static_cast<int64_t>(n) * a.H * a.W * a.C + ((row * a.W + ixb) * a.C + c));
#pragma unroll
      for (int j = 0; j < NCOL; ++j) {
        raw[j] = make_uint4(0u, 0u, 0u, 0u);
        if (static_cast<unsigned>(ixb + j) < static_cast<unsigned>(a.W)) raw[j] = __ldg(rp);
        rp += a.C / V;
      }
    }
  }

  // 1. Weights and bias of the block's channels (only those below C: the
  //    threads of channels past C return before reading any).
  {
    const T* wc = w + static_cast<int64_t>(c0) * KK;  // the chunk's weights are contiguous
    if (a.wvec) {
      const int nv = nvalid * KK / V;  // nvalid % 8 == 0
      for (int i = tid; i < nv; i += nthr) {
        const uint4 wv = __ldg(reinterpret_cast<const uint4*>(wc) + i);
        float f[V];
        v4_unpack<T>(wv, f);
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const int el = i * V + k;
          const int cl = el / KK;
          const int t = el - cl * KK;
          sw[(cl / V) * WS + (a.flip ? KK - 1 - t : t) * V + (cl % V)] = f[k];
        }
      }
    } else {
      const int ne = nvalid * KK;
      for (int el = tid; el < ne; el += nthr) {
        const int cl = el / KK;
        const int t = el - cl * KK;
        sw[(cl / V) * WS + (a.flip ? KK - 1 - t : t) * V + (cl % V)] = to_float(wc[el]);
      }
    }
    for (int i = tid; i < nvalid; i += nthr)
      sb[i] = bias != nullptr ? to_float(bias[c0 + i]) : 0.f;
  }
  __syncthreads();

  // 2. This thread's channel vector and output position.
  const int cv = tid % a.CB;
  const int pos = tid / a.CB;
  if (pos >= a.GX * a.GY) return;
  const int c = c0 + cv * V;
  if (c >= a.C) return;
  const int gy = pos / a.GX;
  const int gx = pos - gy * a.GX;
  const int oy = tyt * a.GY + gy;
  const int ox0 = (txt * a.GX + gx) * RW;
  if (oy >= a.Ho || ox0 >= a.Wo) return;

  const float* wl = sw + cv * WS;
  float acc[RW][V];
  {
    const float4 b0 = *reinterpret_cast<const float4*>(sb + cv * V);
    const float4 b1 = *reinterpret_cast<const float4*>(sb + cv * V + 4);
#pragma unroll
    for (int r = 0; r < RW; ++r) {
      acc[r][0] = b0.x;
      acc[r][1] = b0.y;
      acc[r][2] = b0.z;
      acc[r][3] = b0.w;
      acc[r][4] = b1.x;
      acc[r][5] = b1.y;
      acc[r][6] = b1.z;
      acc[r][7] = b1.w;
    }
  }

  const int iy0 = oy * S - a.PH;
  const int ixb = ox0 * S - a.PW;
  // Columns of the NCOL input vectors inside the image.
  unsigned colok = 0;
#pragma unroll
  for (int j = 0; j < NCOL; ++j)
    colok |= (static_cast<unsigned>(ixb + j) < static_cast<unsigned>(a.W) ? 1u : 0u) << j;
  // 64-bit image base, 32-bit offsets inside the image (the launcher checks
  // that the padded image fits, so every offset formed here is in int range;
  // rows outside the image are skipped before their offset is used).
  const int rowstride = a.W * a.C;
  const int cstep = a.C / V;  // one pixel, in 16-byte vectors
  const T* in_n = in + static_cast<int64_t>(n) * a.H * rowstride;
  int roff = iy0 * rowstride + ixb * a.C + c;
  const float* wrow = wl;

#pragma unroll 1
  for (int iy = iy0; iy < iy0 + K; ++iy, roff += rowstride, wrow += K * V) {
    if (static_cast<unsigned>(iy) >= static_cast<unsigned>(a.H)) continue;
    if (!HOIST || iy != iyh) {
      const uint4* rp = reinterpret_cast<const uint4*>(in_n + roff);
#pragma unroll
      for (int j = 0; j < NCOL; ++j) {
        raw[j] = make_uint4(0u, 0u, 0u, 0u);
        if ((colok >> j) & 1u) raw[j] = __ldg(rp);
        rp += cstep;
      }
    }
#pragma unroll
    for (int j = 0; j < NCOL; ++j) {
      float v[V];
      v4_unpack<T>(raw[j], v);
#pragma unroll
      for (int r = 0; r < RW; ++r) {
        const int kx = j - r * S;
        if (kx >= 0 && kx < K) {
          const float4* wq = reinterpret_cast<const float4*>(wrow + kx * V);
          const float4 w0 = wq[0];
          const float4 w1 = wq[1];
          acc[r][0] = fmaf(v[0], w0.x, acc[r][0]);
          acc[r][1] = fmaf(v[1], w0.y, acc[r][1]);
          acc[r][2] = fmaf(v[2], w0.z, acc[r][2]);
          acc[r][3] = fmaf(v[3], w0.w, acc[r][3]);
          acc[r][4] = fmaf(v[4], w1.x, acc[r][4]);
          acc[r][5] = fmaf(v[5], w1.y, acc[r][5]);
          acc[r][6] = fmaf(v[6], w1.z, acc[r][6]);
          acc[r][7] = fmaf(v[7], w1.w, acc[r][7]);
        }
      }
    }
  }

  T* op = out + static_cast<int64_t>(n) * a.Ho * a.Wo * a.C + ((oy * a.Wo + ox0) * a.C + c);
#pragma unroll
  for (int r = 0; r < RW; ++r)
    if (ox0 + r < a.Wo) store_vec<T, V>(op + r * a.C, acc[r]);
}

// ---------------------------------------------------------------------------
// Host side.
//
// Configurations, forced at run time by CUDADOCTOR_OPS_DW_V4_CFG=0..5 (read once). Unset
// (or anything else): 5 for 3x3 at stride 1 with output rows of 7 where configuration 1's grid
// takes more than one wave of resident blocks; 4 for 3x3 and 5x5 at stride 1 with output rows of 14, 21 or 28; else 3
// for 3x3 with an output row of at least 14 and for 5x5 at stride 2; else 1 (the H200, batch-64
// MobileNetV2 / EfficientNet-B0 layers in float16 / bfloat16, one run: 3 was 1.02-1.10x faster
// than 1 on those, 1 up to 1.12x faster than 3 on 7x7 planes, 3x3 stride 2 to 7x7 and 5x5
// stride 1; 1 beat 0 and 2 on 36 of 38 in an earlier run; 4 against the choice before it,
// `scripts/gpu_variants.py dw dwb4`, 2026-11-30: 5x5 stride 1 forward (64,240,28,28) 43.5 -> 41.8
// us float16 (cuDNN 41.5), (64,480,14,14) 27.5 -> 24.9, (64,672,14,14) 36.2 -> 32.3, 3x3
// (64,192,28,28) 22.9 -> 22.0, the 3x3 14x14 layers -3% to +3%; the backward, whose stride-1
// input gradient is this kernel, (64,672,14,14) 5x5 81.1 -> 75.5 us, (64,192,28,28) 3x3 59.5 ->
// 56.3 (cuDNN 55.7); slower on 7x7 planes (5x5 (64,1152,7,7) 19.1 -> 21.0) and 56x56 / 112x112
// (where 3's groups of 8 tile the rows), hence the row-width test):
//   0:           128-thread blocks, at most 64 registers (8 blocks, 50%
//                occupancy per SM); RW = 2 outputs per thread along W for 3x3
//                and 5x5 at stride 1, RW = 1 for 7x7 and at stride 2.
//   1 (default): 128-thread blocks with wider groups: RW = 4 for 3x3 and 5x5
//                at stride 1, RW = 2 otherwise (fewer input loads and
//                conversions per output). These need 78-96 registers, so this
//                configuration is bounded at 96 (5 blocks, 31% occupancy)
//                instead of 64: it tests fewer instructions per output
//                against occupancy.
//   2:           256-thread blocks (a patch twice as large per block: more
//                L1 reuse, fewer weight stagings, coarser grid), at most 64
//                registers; RW as in 0.
//   3:           128-thread blocks with the widest groups: RW = 8 for 3x3 and 4 for 5x5 / 7x7
//                at stride 1, 4 (3x3, 5x5) or 2 (7x7) at stride 2, bounded at 170
//                registers (3 blocks): fewer loads per output again, lower occupancy.
//   4:           as 3 with RW = 7 at stride 1 (groups that tile rows of 7k pixels without a
//                ragged last group); at stride 2 as 1.
//   5:           3x3 at stride 1 (else the configuration chosen by shape): RW = 7, blocks of up
//                to 256 threads at <= 128 registers (ptxas spills 8 bytes), the block shape from
//                v4_plan_wave (the fewest waves; e.g. (64,1152,7,7): 256 blocks of 36 channel
//                vectors x 7 rows, 2 per SM, where 1 runs about 1.5 waves and 4 (3 blocks per SM)
//                1.45). H200, `scripts/gpu_variants.py dw7`, 2026-12-02, forward, us, two
//                interleaved children each, 5 / 1 (torch's in the same children): (64,960,7,7)
//                fp16 11.4, 11.9 / 12.4, 12.2 (12.3-12.9), bf16 11.4, 11.4 / 12.4, 12.4 (12.1-12.8);
//                (64,1152,7,7) fp16 11.9, 11.9 / 12.9, 12.9 (12.8-13.5), bf16 12.3, 11.6 / 13.9,
//                13.9 (15.3-16.1); (128,960,7,7) fp16 17.5, 18.2 / 18.6, 18.4. Slower where 1's
//                grid is one wave, hence the wave test: (64,384,7,7) fp16 9.6, 9.0 / 8.8, 8.5, bf16
//                8.8, 9.6 / 7.9, 7.9; (32,1152,7,7) fp16 10.0, 9.4 / 9.0, 9.4. The backward (dX +
//                dW; dX is the smaller part) within noise either way. Blocks of 18 or 9 vectors
//                (CUDADOCTOR_OPS_DW_V4_WAVE_CB) were no faster: (64,1152,7,7) fp16 12.4 / 13.3.
// All use the same block-shape planner (v4_plan). Timed on the H200 and removed: 1 bounded at 80
// registers (6 blocks per SM; nvcc 13.0 spills 32-40 bytes at 5x5 stride 1) took (64,240,28,28)
// 5x5 fp16 from 43.6 to 49.8 us and was within noise or slower on the other 37 layers; 1 with
// each kernel row's weights held in registers (116 registers, 4 blocks) was slower on 36 of 38.

template <int K, int S>
struct V4Rw {
  static constexpr int narrow = (S == 1 && K <= 5) ? 2 : 1;
  static constexpr int wide = (S == 1 && K <= 5) ? 4 : 2;
  static constexpr int widest = S == 1 ? (K == 3 ? 8 : 4) : (K <= 5 ? 4 : 2);
  // configuration 4 (stride 1): groups of 7 columns, which tile the 112 / 56 / 28 / 14 / 7-pixel
  // rows of MobileNet / EfficientNet layers without a ragged last group (3 blocks per SM: at 4,
  // ptxas spilled 8-24 bytes at 3x3)
  static constexpr int seven = S == 1 ? 7 : wide;
};

// The forced configuration, or -1 (choose by shape: v4_auto_cfg).
int v4_cfg() {
  static const int cfg = env_choice("CUDADOCTOR_OPS_DW_V4_CFG", {0, 1, 2, 3, 4, 5}, -1);
  return cfg;
}

// Whether a thread issues its first kernel row's loads before the weight staging and its barrier
// (HOIST), so that their latency overlaps the weights'. CUDADOCTOR_OPS_DW_V4_HOIST=0 / 1 forces it
// (read once); by default on at stride 2 (K <= 5) and for 3x3 at stride 1 with output rows of 56
// pixels or more. H200, `scripts/gpu_variants.py dwh dwbh`, 2026-12-01, float16 / bfloat16, batch-64
// MobileNetV2 / EfficientNet-B0 layers, us, without / with, two interleaved children each: 3x3
// stride 2 (64,96,112,112) 67.0, 67.4 / 59.7, 59.2 (cuDNN 78.8), (64,144,56,56) 34.2, 33.9 / 30.8,
// 31.4; 3x3 stride 1 (64,144,56,56) 56.9, 56.8 / 52.7, 52.5 (cuDNN 59.8), (64,32,112,112) 45.2,
// 45.3 / 44.1, 43.3; 5x5 stride 2 (64,144,56,56) 49.1, 48.9 / 47.1, 47.0. Slower where the rows
// are short or the kernel 5x5 at stride 1: 3x3 (64,576,14,14) bf16 19.1, 19.7 / 20.6, 20.5, 5x5
// (64,240,28,28) bf16 42.6, 42.4 / 44.9, 44.7, and (64,1152,7,7) 20.0, 19.2 / 20.7, 20.6 (there
// ptxas spills 88-100 bytes at 96 registers with the hoisted row live across the staging loop);
// 3x3 on 7x7 and 28x28 planes within noise either way. The backward's stride-1 input gradient
// (this kernel on the flipped filter) moved by the same rule: (64,144,56,56) 130.8, 128.4 /
// 125.8, 127.0 us, the others within noise.
int v4_hoist_setting() {
  static const int v = env_choice("CUDADOCTOR_OPS_DW_V4_HOIST", {0, 1}, -1);
  return v;
}

bool v4_auto_hoist(int K, int S, int Wo) { return K <= 5 && (S == 2 || (K == 3 && Wo >= 56)); }

int v4_auto_cfg(int K, int S, int Wo) {
  if (S == 1 && K == 3 && Wo == 7) return 5;
  if (S == 1 && K <= 5 && Wo % 7 == 0 && Wo >= 14 && Wo <= 28) return 4;
  if (K == 3 && Wo >= 14) return 3;
  if (K == 5 && S == 2) return 3;
  return 1;
}

int ceil_div(int a, int b) { return (a + b - 1) / b; }

int gcd_int(int a, int b) {
  while (b != 0) {
    const int t = a % b;
    a = b;
    b = t;
  }
  return a;
}

// The block shape (CB channel vectors x GX column groups x GY rows, nCh x nTx x nTy blocks per
// image), into a.
void v4_set_tiles(V4Args& a, int CB, int nCh, int gx, int gy, int nTx, int nTy) {
  a.CB = CB;
  a.nCh = nCh;
  a.GX = gx;
  a.GY = gy;
  a.nTx = nTx;
  a.nTy = nTy;
}

// Block shape of one launch: CB channel vectors per block, GX column groups x
// GY rows. Searches the balanced shapes (tiles along an axis of equal size,
// or one smaller) that fit in NT threads and takes the one with the smallest
// modelled time of the launch, in SM cycles:
//   per warp and kernel row: max(issue, L1) + min/4, where
//     issue = the thread's instructions (loads, address arithmetic, 8
//             conversions per input vector, 8 FMAs per tap and output, two
//             weight reads per tap) / 4 schedulers;
//     L1    = 128-byte lines per 16-byte warp load x NCOL loads + shared-memory
//             wavefronts of the 2K weight reads (one per 8 distinct channel
//             vectors in the warp). Lines per load: each run of lanes on one
//             pixel is a CB*16-byte segment; with the segments' start aligned
//             to A = gcd(128, 2C, 16*CB) bytes a segment spans on average
//             1 + (L - A)/128 lines, so a warp spans 4 + segs*(1 - A/128);
//   per block: + weight staging (CB*K*K vectors, 8 shared stores each) +
//              a fixed cost, + the block's input footprint (clipped to the
//              image) fetched from L2 at about 28 bytes per SM cycle;
//   summed over the blocks of one image.
// Idle lanes (ragged tiles, channel chunks past C, partly filled warps) are
// paid for as whole warps, so the model trades the footprint and load
// efficiency of large patches against the waste of ragged ones.
bool v4_plan(const FastShape& s, int K, int S, int RW, int NT, V4Args& a, int& threads,
             int64_t& blocks, size_t& smem) {
  const int CV = s.C / kV4Vec;
  const int KK = K * K;
  const int NCOL = (RW - 1) * S + K;
  const int groupsW = ceil_div(s.Wo, RW);
  const double issue = (NCOL * (1 + 3 + kV4Vec) + RW * K * kV4Vec + 2 * K + 8) / 4.0;
  const int cb_lo = CV <= 16 ? CV : 4;
  const int cb_hi = CV <= 16 ? CV : 16;
  double best = -1.0;
  for (int cb = cb_lo; cb <= cb_hi; ++cb) {
    const int nCh = ceil_div(CV, cb);
    const int CB = ceil_div(CV, nCh);  // balanced chunks
    if (CB != cb) continue;            // visited as its balanced value
    const int P = NT / CB;             // positions per block, at most
    if (P < 1) continue;
    const int A = gcd_int(gcd_int(128, 2 * s.C), 16 * CB);
    const double segs = (32.0 + CB - gcd_int(32, CB)) / CB;
    const double lines = 4.0 + segs * (1.0 - A / 128.0);
    const double lds = CB <= 8 ? 1.0 : 2.0;
    const double l1 = NCOL * lines + 2.0 * K * lds;
    const double warp_row = std::max(l1, issue) + 0.25 * std::min(l1, issue);
    const double stage = CB * KK * 9.0 / 32.0 + 50.0;
    for (int gx = 1; gx <= groupsW && gx <= P; ++gx) {
      const int nTx = ceil_div(groupsW, gx);
      if (ceil_div(groupsW, nTx) != gx) continue;
      const int gymax = P / gx < s.Ho ? P / gx : s.Ho;
      const int nTy = ceil_div(s.Ho, gymax);
      const int gy = ceil_div(s.Ho, nTy);
      const int warps = ceil_div(CB * gx * gy, 32);
      const int rows_in = std::min((gy - 1) * S + K, s.H);
      const int cols_in = std::min((gx * RW - 1) * S + K, s.W);
      const double miss = rows_in * cols_in * CB * 16.0 / 28.0;
      const double cost = (warps * K * warp_row + stage + miss) * nCh * nTx * nTy;
      if (best < 0 || cost < best) {
        best = cost;
        v4_set_tiles(a, CB, nCh, gx, gy, nTx, nTy);
        threads = warps * 32;
      }
    }
  }
  if (best < 0 || a.CB > kV4MaxCB) return false;
  set_plane_sizes(a, s);
  blocks = static_cast<int64_t>(s.N) * a.nTy * a.nTx * a.nCh;
  smem = (static_cast<size_t>(a.CB) * v4_wstride_host(K) + static_cast<size_t>(a.CB) * kV4Vec) *
         sizeof(float);
  return blocks < (int64_t(1) << 31) && threads <= NT && smem <= 48 * 1024;
}

// Block shape of configuration 5 (see V4Rw::seven and run_nhwc_v4_wave): the shape whose grid
// takes the fewest waves of resident blocks. Among the balanced shapes (channel chunks, column
// groups and row tiles of equal size, or one smaller) of at most NT lanes, with at least
// min(C/8, 4) channel vectors per block so that a warp's loads stay coalesced, the key is, in
// order: waves = ceil(blocks / (resident blocks per SM x SMs)); the warps of the most loaded SM
// (ceil(blocks / SMs) x warps per block); the input vectors the blocks fetch (their footprints,
// clipped to the image); the most channel vectors per block. Resident blocks come from the occupancy calculator for `kernel` at each
// block size and its shared memory. Small layers are what this is for: a 7x7-plane layer of
// 64 x 1152 channels is 2016 full warps of 7-output rows, about 15 per SM, so one wave needs 4
// blocks of 4 warps (or 2 of 8) per SM; v4_plan's model, which does not count waves, took 576
// blocks of 4 warps at 3 per SM (1.45 waves) in configuration 4.
// CUDADOCTOR_OPS_DW_V4_WAVE_CB=n: only shapes of n channel vectors per block where one is
// balanced (n = ceil(C/8 / ceil(C/8 / n))), else the planner's choice (read once).
int v4_wave_cb() {
  static const int v = env_positive_int("CUDADOCTOR_OPS_DW_V4_WAVE_CB", 256);
  return v;
}

bool v4_plan_wave(const FastShape& s, int K, int S, int RW, int NT, const void* kernel, V4Args& a,
                  int& threads, int64_t& blocks, size_t& smem, int only_cb = 0) {
  const int CV = s.C / kV4Vec;
  const int groupsW = ceil_div(s.Wo, RW);
  const int64_t sms = current_sm_count();
  const int cb_lo = std::min(CV, 4);
  const int cb_hi = std::min(CV, NT);
  bool found = false;
  int64_t bw = 0, bl = 0, bf = 0;  // best waves, load, footprint
  for (int cb = cb_lo; cb <= cb_hi; ++cb) {
    const int nCh = ceil_div(CV, cb);
    const int CB = ceil_div(CV, nCh);
    if (CB != cb) continue;  // visited as its balanced value
    if (only_cb > 0 && CB != only_cb) continue;
    const size_t sm = (static_cast<size_t>(CB) * v4_wstride_host(K) +
                       static_cast<size_t>(CB) * kV4Vec) * sizeof(float);
    if (sm > 48 * 1024) break;  // grows with cb
    const int P = NT / CB;
    for (int gx = 1; gx <= groupsW && gx <= P; ++gx) {
      const int nTx = ceil_div(groupsW, gx);
      if (ceil_div(groupsW, nTx) != gx) continue;
      for (int gy = 1; gy <= s.Ho && gx * gy <= P; ++gy) {
        const int nTy = ceil_div(s.Ho, gy);
        if (ceil_div(s.Ho, nTy) != gy) continue;
        const int thr = ceil_div(CB * gx * gy, 32) * 32;
        const int occ = resident_blocks_per_sm(kernel, thr, sm);
        if (occ < 1) continue;
        const int64_t nb = static_cast<int64_t>(s.N) * nCh * nTx * nTy;
        const int64_t waves = (nb + occ * sms - 1) / (occ * sms);
        const int64_t load = (nb + sms - 1) / sms * (thr / 32);
        const int64_t rows_in = std::min((gy - 1) * S + K, s.H);
        const int64_t cols_in = std::min((gx * RW - 1) * S + K, s.W);
        const int64_t foot = nb * rows_in * cols_in * CB;
        // ties: the larger CB (fewer, longer segments per warp load), which comes later
        const bool better =
            !found || waves < bw ||
            (waves == bw && (load < bl || (load == bl && foot <= bf)));
        if (better) {
          found = true;
          bw = waves;
          bl = load;
          bf = foot;
          v4_set_tiles(a, CB, nCh, gx, gy, nTx, nTy);
          threads = thr;
          blocks = nb;
          smem = sm;
        }
      }
    }
  }
  if (!found) return only_cb > 0 && v4_plan_wave(s, K, S, RW, NT, kernel, a, threads, blocks, smem);
  set_plane_sizes(a, s);
  return blocks < (int64_t(1) << 31);
}

// v4_plan_wave runs the occupancy calculator for each candidate shape: its plans are kept per
// device and shape (at most kV4WaveCache of them; past that, planned on every call).
struct V4WavePlan {
  V4Args a;
  int threads;
  int64_t blocks;
  size_t smem;
};
constexpr size_t kV4WaveCache = 4096;

bool v4_plan_wave_cached(const FastShape& s, int K, int S, int RW, int NT, const void* kernel,
                         V4Args& a, int& threads, int64_t& blocks, size_t& smem) {
  static std::mutex mu;
  static std::map<std::tuple<int, const void*, int64_t, int, int, int, int, int, int, int>,
                  V4WavePlan>
      cache;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();
    dev = -1;
  }
  const auto key = std::make_tuple(dev, kernel, static_cast<int64_t>(s.N), s.C, s.H, s.W, s.Ho,
                                   s.Wo, s.PH, s.PW);
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) {
      a = it->second.a;
      threads = it->second.threads;
      blocks = it->second.blocks;
      smem = it->second.smem;
      return true;
    }
  }
  if (!v4_plan_wave(s, K, S, RW, NT, kernel, a, threads, blocks, smem, v4_wave_cb())) return false;
  std::lock_guard<std::mutex> lock(mu);
  if (cache.size() < kV4WaveCache) cache.emplace(key, V4WavePlan{a, threads, blocks, smem});
  return true;
}

// The kernel forms input offsets (iy*W + ix)*C + c and output offsets
// (oy*Wo + ox)*C + c in 32-bit arithmetic, for rows and columns up to a kernel
// extent outside the image: the padded planes must stay below 2^31 elements.
bool v4_offsets_fit(const FastShape& s) {
  const int64_t ph = s.PH < 0 ? -static_cast<int64_t>(s.PH) : s.PH;
  const int64_t pw = s.PW < 0 ? -static_cast<int64_t>(s.PW) : s.PW;
  const int64_t lim = (int64_t(1) << 31) - 1;
  const int64_t hin = s.H + 2 * ph + 2 * s.K;
  const int64_t win = s.W + 2 * pw + 4 * s.K;
  const int64_t hout = s.Ho + 2 * int64_t(s.K);
  const int64_t wout = s.Wo + 4 * int64_t(s.K);
  return hin * win * s.C < lim && hout * wout * s.C < lim;
}

template <typename T, int K, int S, int RW, int NT, int MINB>
bool run_nhwc_v4(const void* in, const void* w, const void* bias, void* out,
                 const FastShape& s, bool flip, cudaStream_t stream) {
  V4Args a;
  int threads = 0;
  int64_t blocks = 0;
  size_t smem = 0;
  if (!v4_plan(s, K, S, RW, NT, a, threads, blocks, smem)) return false;
  a.flip = flip;
  a.wvec = (reinterpret_cast<uintptr_t>(w) & 15u) == 0;
  const int hs = v4_hoist_setting();
  const bool hoist = hs >= 0 ? hs == 1 : v4_auto_hoist(K, S, s.Wo);
  auto kernel = hoist ? fwd_nhwc_v4<T, K, S, RW, NT, MINB, true>
                      : fwd_nhwc_v4<T, K, S, RW, NT, MINB, false>;
  kernel<<<static_cast<unsigned>(blocks), threads, smem, stream>>>(
      static_cast<const T*>(in), static_cast<const T*>(w), static_cast<const T*>(bias),
      static_cast<T*>(out), a);
  return true;
}

// Configuration 5: the wave planner above, groups of RW columns, blocks of up to NT threads at
// MINB blocks per SM (the register cap: 65536 / (NT * MINB)).
template <typename T, int K, int S, int RW, int NT, int MINB>
bool run_nhwc_v4_wave(const void* in, const void* w, const void* bias, void* out,
                      const FastShape& s, bool flip, cudaStream_t stream) {
  const int hs = v4_hoist_setting();
  const bool hoist = hs >= 0 ? hs == 1 : v4_auto_hoist(K, S, s.Wo);
  auto kernel = hoist ? fwd_nhwc_v4<T, K, S, RW, NT, MINB, true>
                      : fwd_nhwc_v4<T, K, S, RW, NT, MINB, false>;
  V4Args a;
  int threads = 0;
  int64_t blocks = 0;
  size_t smem = 0;
  if (!v4_plan_wave_cached(s, K, S, RW, NT, reinterpret_cast<const void*>(kernel), a, threads,
                           blocks, smem))
    return false;
  a.flip = flip;
  a.wvec = (reinterpret_cast<uintptr_t>(w) & 15u) == 0;
  kernel<<<static_cast<unsigned>(blocks), threads, smem, stream>>>(
      static_cast<const T*>(in), static_cast<const T*>(w), static_cast<const T*>(bias),
      static_cast<T*>(out), a);
  return true;
}

// Whether v4_plan's grid for configuration (RW, NT, MINB) fits one wave of resident blocks.
template <typename T, int K, int S, int RW, int NT, int MINB>
bool v4_one_wave(const FastShape& s) {
  V4Args a;
  int threads = 0;
  int64_t blocks = 0;
  size_t smem = 0;
  if (!v4_plan(s, K, S, RW, NT, a, threads, blocks, smem)) return false;
  const int hs = v4_hoist_setting();
  const bool hoist = hs >= 0 ? hs == 1 : v4_auto_hoist(K, S, s.Wo);
  const void* kernel = hoist ? reinterpret_cast<const void*>(fwd_nhwc_v4<T, K, S, RW, NT, MINB, true>)
                             : reinterpret_cast<const void*>(fwd_nhwc_v4<T, K, S, RW, NT, MINB, false>);
  const int occ = resident_blocks_per_sm(kernel, threads, smem);
  return occ > 0 && blocks <= static_cast<int64_t>(occ) * current_sm_count();
}

template <typename T, int K, int S>
bool run_nhwc_v4_cfg(const void* in, const void* w, const void* bias, void* out,
                     const FastShape& s, bool flip, cudaStream_t stream) {
  constexpr int RWA = V4Rw<K, S>::narrow;
  constexpr int RWB = V4Rw<K, S>::wide;
  constexpr int RWC = V4Rw<K, S>::widest;
  int cfg = v4_cfg();
  const bool forced = cfg >= 0;
  if (!forced || (cfg == 5 && !(K == 3 && S == 1))) cfg = v4_auto_cfg(K, S, s.Wo);
  // by shape, configuration 5 only where configuration 1's grid takes more than one wave
  if (!forced && cfg == 5 && v4_one_wave<T, K, S, RWB, 128, 5>(s)) cfg = 1;
  switch (cfg) {
    case 0:
      return run_nhwc_v4<T, K, S, RWA, 128, 8>(in, w, bias, out, s, flip, stream);
    case 2:
      return run_nhwc_v4<T, K, S, RWA, 256, 4>(in, w, bias, out, s, flip, stream);
    case 3:
      return run_nhwc_v4<T, K, S, RWC, 128, 3>(in, w, bias, out, s, flip, stream);
    case 5:
      if constexpr (K == 3 && S == 1) {
        return run_nhwc_v4_wave<T, K, S, V4Rw<K, S>::seven, 256, 2>(in, w, bias, out, s, flip,
                                                                   stream);
      }
      [[fallthrough]];
    case 4:
      if constexpr (S == 1) {
        return run_nhwc_v4<T, K, S, V4Rw<K, S>::seven, 128, 3>(in, w, bias, out, s, flip,
                                                               stream);
      }
      [[fallthrough]];
    default:
      return run_nhwc_v4<T, K, S, RWB, 128, 5>(in, w, bias, out, s, flip, stream);
  }
}

template <typename T>
bool dispatch_nhwc_v4(const void* in, const void* w, const void* bias, void* out,
                      const FastShape& s, bool flip, cudaStream_t stream) {
#define CDO_DW_V4(KK, SS) \
  if (s.K == KK && s.S == SS) return run_nhwc_v4_cfg<T, KK, SS>(in, w, bias, out, s, flip, stream);
  CDO_DW_V4(3, 1)
  CDO_DW_V4(3, 2)
  CDO_DW_V4(5, 1)
  CDO_DW_V4(5, 2)
  CDO_DW_V4(7, 1)
  CDO_DW_V4(7, 2)
#undef CDO_DW_V4
  return false;
}

}  // namespace

bool fwd_nhwc_v4_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("CUDADOCTOR_OPS_DW_V4");
    return e == nullptr || std::strcmp(e, "0") != 0;
  }();
  return on;
}

bool launch_fwd_nhwc_v4(DType dt, const void* in, const void* w, const void* bias, void* out,
                        const FastShape& s, bool flip, cudaStream_t stream) {
  if (s.Ho <= 0 || s.Wo <= 0 || s.N <= 0 || s.C <= 0 || s.H <= 0 || s.W <= 0) return false;
  // 8 channels of a 16-bit type per 16-byte vector: C a multiple of 8, input and
  // output 16-byte aligned.
  if (s.C % kV4Vec != 0 || (reinterpret_cast<uintptr_t>(in) & 15u) ||
      (reinterpret_cast<uintptr_t>(out) & 15u))
    return false;
  if (!v4_offsets_fit(s)) return false;
  switch (dt) {
    case DType::F16:
      return dispatch_nhwc_v4<c10::Half>(in, w, bias, out, s, flip, stream);
    case DType::BF16:
      return dispatch_nhwc_v4<c10::BFloat16>(in, w, bias, out, s, flip, stream);
    default:
      return false;
  }
}

}  // namespace depthwise
}  // namespace cudadoctor_ops
