// Depthwise 2-D convolution, fast weight (and bias) gradient.
//
//   dW[c][kh][kw] = sum_{n,oy,ox} dY[n,c,oy,ox] * X[n,c,oy*S-p+kh,ox*S-p+kw]
//   dB[c]         = sum_{n,oy,ox} dY[n,c,oy,ox]
//
// Two deterministic stages: stage 1 splits each channel's reduction over many
// blocks, each writing K*K+1 float partial sums into a workspace; stage 2 sums
// the P partials of each (channel, tap) in a fixed order. No atomics, so
// results are bit-reproducible run to run.
//
// Two generations for channels_last:
//   v1 (wgrad_nhwc + wgrad_finish): 1-2 channels per thread, every tap;
//       workspace [C][P][K*K+1].
//   v2 (wgrad_nhwc_v2 + wgrad_finish_v2, the default): 16- or 8-byte channel
//       vectors per thread, one kernel row per thread; workspace
//       [P][K*K+1][C]. CUDADOCTOR_OPS_DW_WGRAD_V1=1 (read once) selects v1.
// NCHW always runs wgrad_nchw.
#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <utility>

#include "async_copy.cuh"
#include "depthwise.cuh"
#include "env_setting.h"

namespace cudadoctor_ops {
namespace depthwise {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Stage 1, NCHW.
//   go [N*C planes][Ho][Wo], in [N*C planes][H][W] (contiguous)
//   ws [C][P = N*chunks][K*K+1]
// Block b covers plane (n, c) rows [chunk*rows, (chunk+1)*rows) of the output.
// Thread (tx, ty) walks output columns tx, tx+BX, ... and, within the block's
// rows, a contiguous run of rows assigned to ty. Down that run it keeps the
// K x K input window in registers and slides it by S rows per output row, so
// each output costs one dY load and K (S=1) input loads.
template <typename T, int K, int S>
__global__ void __launch_bounds__(kThreads)
    wgrad_nchw(const T* __restrict__ go, const T* __restrict__ in,
               float* __restrict__ ws, int C, int H, int W, int Ho, int Wo,
               int PH, int PW, int rows, int chunks) {
  constexpr int KK = K * K;
  float acc[KK + 1];
#pragma unroll
  for (int t = 0; t <= KK; ++t) acc[t] = 0.f;

  const int64_t b = blockIdx.x;
  const int chunk = static_cast<int>(b % chunks);
  const int64_t plane = b / chunks;
  const int c = static_cast<int>(plane % C);
  const int64_t n = plane / C;

  const int oyA = chunk * rows;
  const int oyB = min(Ho, oyA + rows);
  const int span = oyB - oyA;
  const int per = (span + blockDim.y - 1) / blockDim.y;
  const int r0 = oyA + threadIdx.y * per;
  const int r1 = min(oyB, r0 + per);

  const T* gp = go + plane * static_cast<int64_t>(Ho) * Wo;
  const T* ip = in + plane * static_cast<int64_t>(H) * W;

  if (r0 < r1) {
    for (int ox = threadIdx.x; ox < Wo; ox += blockDim.x) {
      const int ixb = ox * S - PW;
      bool colok[K];
#pragma unroll
      for (int kw = 0; kw < K; ++kw) colok[kw] = (ixb + kw >= 0) && (ixb + kw < W);

      float win[K][K];
#pragma unroll
      for (int kh = 0; kh < K; ++kh) {
        const int iy = r0 * S - PH + kh;
        const bool rok = iy >= 0 && iy < H;
        const T* rp = ip + static_cast<int64_t>(iy) * W + ixb;
#pragma unroll
        for (int kw = 0; kw < K; ++kw) win[kh][kw] = (rok && colok[kw]) ? to_float(rp[kw]) : 0.f;
      }
      for (int oy = r0; oy < r1; ++oy) {
        const float g = to_float(gp[static_cast<int64_t>(oy) * Wo + ox]);
#pragma unroll
        for (int kh = 0; kh < K; ++kh)
#pragma unroll
          for (int kw = 0; kw < K; ++kw) acc[kh * K + kw] = fmaf(g, win[kh][kw], acc[kh * K + kw]);
        acc[KK] += g;
        if (oy + 1 < r1) {
          // Slide the window down by S input rows.
#pragma unroll
          for (int kh = 0; kh < K; ++kh) {
            if (kh + S < K) {
#pragma unroll
              for (int kw = 0; kw < K; ++kw) win[kh][kw] = win[kh + S < K ? kh + S : kh][kw];
            } else {
              const int iy = (oy + 1) * S - PH + kh;
              const bool rok = iy >= 0 && iy < H;
              const T* rp = ip + static_cast<int64_t>(iy) * W + ixb;
#pragma unroll
              for (int kw = 0; kw < K; ++kw)
                win[kh][kw] = (rok && colok[kw]) ? to_float(rp[kw]) : 0.f;
            }
          }
        }
      }
    }
  }

  // Block reduction: warp shuffles, then a fixed-order sum over warps.
  __shared__ float red[kThreads / 32][KK + 1];
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int nwarps = (blockDim.x * blockDim.y + 31) >> 5;
#pragma unroll
  for (int t = 0; t <= KK; ++t) {
    const float v = warp_sum(acc[t]);
    if (lane == 0) red[warp][t] = v;
  }
  __syncthreads();
  if (tid <= KK) {
    float s = 0.f;
    for (int wi = 0; wi < nwarps; ++wi) s += red[wi][tid];
    const int P = static_cast<int>(gridDim.x / C);  // N * chunks
    const int64_t p = n * chunks + chunk;
    ws[(static_cast<int64_t>(c) * P + p) * (KK + 1) + tid] = s;
  }
}

// Stage 1, NHWC.
//   go [N][Ho][Wo][C], in [N][H][W][C]
//   ws [C][P = gridDim.x][K*K+1]
// Threads: x = a vector of V channels, y = a stream of row segments
// (n, oy, [x0, x0+L)). Along a segment the thread walks steps of U outputs,
// loading the U dY vectors and the K x ((U-1)*S+K) input vectors of a step
// together (many loads in flight), so each output costs one dY load and about
// K*((U-1)*S+K)/U input loads, mostly L1 hits. Segments are dealt to (block, ty) round-robin; the
// block then sums its TY partials per (tap, channel) through shared memory.
template <typename T, int K, int S, int V, int U>
__global__ void __launch_bounds__(kThreads)
    wgrad_nhwc(const T* __restrict__ go, const T* __restrict__ in,
               float* __restrict__ ws, int C, int H, int W, int Ho, int Wo,
               int PH, int PW, int L, int segsW, int64_t total_segs) {
  constexpr int KK = K * K;
  float acc[KK + 1][V];
#pragma unroll
  for (int t = 0; t <= KK; ++t)
#pragma unroll
    for (int e = 0; e < V; ++e) acc[t][e] = 0.f;

  const int TXC = blockDim.x * V;
  const int cl = threadIdx.x * V;
  const int c = blockIdx.y * TXC + cl;
  const bool cok = c < C;
  const int64_t rowstride = static_cast<int64_t>(W) * C;
  const int64_t orowstride = static_cast<int64_t>(Wo) * C;

  if (cok) {
    for (int64_t seg = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
         seg < total_segs; seg += static_cast<int64_t>(gridDim.x) * blockDim.y) {
      const int sx = static_cast<int>(seg % segsW);
      const int64_t t2 = seg / segsW;
      const int oy = static_cast<int>(t2 % Ho);
      const int64_t n = t2 / Ho;
      const int x0 = sx * L;
      const int x1 = min(Wo, x0 + L);
      const T* ip = in + n * H * rowstride + c;
      const T* gp = go + (n * Ho + oy) * orowstride + c;

      bool rowok[K];
      const T* rps[K];
#pragma unroll
      for (int kh = 0; kh < K; ++kh) {
        const int iy = oy * S - PH + kh;
        rowok[kh] = iy >= 0 && iy < H;
        rps[kh] = ip + static_cast<int64_t>(min(max(iy, 0), H - 1)) * rowstride;
      }
      // Steps of U outputs: the U dY vectors and the K x NC input vectors
      // they touch are independent loads, issued together, then accumulated.
      constexpr int NC = (U - 1) * S + K;
      for (int ox0 = x0; ox0 < x1; ox0 += U) {
        float g[U][V];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const bool ok = ox0 + u < x1;
          load_vec<T, V>(gp + static_cast<int64_t>(ok ? ox0 + u : x1 - 1) * C, g[u]);
#pragma unroll
          for (int e = 0; e < V; ++e) g[u][e] = ok ? g[u][e] : 0.f;
        }
        const int ixb = ox0 * S - PW;
#pragma unroll
        for (int kh = 0; kh < K; ++kh) {
          float xin[NC][V];
#pragma unroll
          for (int j = 0; j < NC; ++j) {
            const int ix = ixb + j;
            const bool ok = rowok[kh] && ix >= 0 && ix < W;
            load_vec<T, V>(rps[kh] + static_cast<int64_t>(min(max(ix, 0), W - 1)) * C, xin[j]);
#pragma unroll
            for (int e = 0; e < V; ++e) xin[j][e] = ok ? xin[j][e] : 0.f;
          }
#pragma unroll
          for (int u = 0; u < U; ++u)
#pragma unroll
            for (int kw = 0; kw < K; ++kw)
#pragma unroll
              for (int e = 0; e < V; ++e)
                acc[kh * K + kw][e] = fmaf(g[u][e], xin[u * S + kw][e], acc[kh * K + kw][e]);
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int e = 0; e < V; ++e) acc[KK][e] += g[u][e];
      }
    }
  }

  // Block reduction over ty, G taps per round through shared memory.
  extern __shared__ float red[];  // [TY][G][TXC]
  const int TY = blockDim.y;
  const int G = 8192 / (TY * TXC) > 0 ? 8192 / (TY * TXC) : 1;
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  const int nthr = blockDim.x * blockDim.y;
  const int P = gridDim.x;
#pragma unroll
  for (int t = 0; t <= KK; ++t) {
    const int slot = t % G;
#pragma unroll
    for (int e = 0; e < V; ++e) red[(threadIdx.y * G + slot) * TXC + cl + e] = acc[t][e];
    if (slot == G - 1 || t == KK) {
      __syncthreads();
      const int t0 = t - slot;
      const int items = (slot + 1) * TXC;
      for (int i = tid; i < items; i += nthr) {
        const int sl = i / TXC;
        const int ch = i - sl * TXC;
        float s = 0.f;
        for (int y = 0; y < TY; ++y) s += red[(y * G + sl) * TXC + ch];
        const int cc = blockIdx.y * TXC + ch;
        if (cc < C) ws[(static_cast<int64_t>(cc) * P + blockIdx.x) * (KK + 1) + t0 + sl] = s;
      }
      __syncthreads();
    }
  }
}

// Stage 2: one warp per (channel, tap); lanes stride over the P partials, then
// a fixed shuffle tree. gw [C][K*K] in T, gb [C] in T (or null).
template <typename T>
__global__ void wgrad_finish(const float* __restrict__ ws, T* __restrict__ gw,
                             T* __restrict__ gb, int C, int P, int KK) {
  const int64_t gwarp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (gwarp >= static_cast<int64_t>(C) * (KK + 1)) return;
  const int c = static_cast<int>(gwarp / (KK + 1));
  const int t = static_cast<int>(gwarp % (KK + 1));
  if (t == KK && gb == nullptr) return;
  const float* p = ws + static_cast<int64_t>(c) * P * (KK + 1) + t;
  float s = 0.f;
  for (int i = lane; i < P; i += 32) s += p[static_cast<int64_t>(i) * (KK + 1)];
  s = warp_sum(s);
  if (lane == 0) {
    if (t < KK)
      gw[static_cast<int64_t>(c) * KK + t] = from_float<T>(s);
    else
      gb[c] = from_float<T>(s);
  }
}

int pick_bx(int wo) { return wo > 96 ? 128 : (wo > 48 ? 64 : 32); }

// Launch plans, shared by the workspace query and the launch.
struct PlanNCHW {
  int BX, BY, rows, chunks;
  int64_t P;
};

PlanNCHW plan_nchw(const FastShape& s) {
  PlanNCHW p;
  p.BX = pick_bx(s.Wo);
  p.BY = kThreads / p.BX;
  const int64_t planes = static_cast<int64_t>(s.N) * s.C;
  // Aim for >= 1024 blocks, but give each thread at least 8 rows to slide over.
  int64_t want = (1024 + planes - 1) / planes;
  int64_t maxc = s.Ho / (p.BY * 8);
  if (maxc < 1) maxc = 1;
  if (want > maxc) want = maxc;
  if (want < 1) want = 1;
  p.rows = static_cast<int>((s.Ho + want - 1) / want);
  p.chunks = (s.Ho + p.rows - 1) / p.rows;
  p.P = static_cast<int64_t>(s.N) * p.chunks;
  return p;
}

template <typename T>
constexpr int nhwc_vec(int K) {
  return (sizeof(T) == 2 && K == 3) ? 2 : 1;
}

struct PlanNHWC {
  int V, TX, TY, L, segsW, gy;
  int64_t segs, gx;
};

PlanNHWC plan_nhwc(const FastShape& s, int V) {
  PlanNHWC p;
  p.V = V;
  const int CV = s.C / V;
  const int nb = (CV + 31) / 32;  // even split over channel blocks
  p.TX = (CV + nb - 1) / nb;
  p.TY = kThreads / p.TX;
  if (p.TY > 64) p.TY = 64;
  p.L = s.Wo < 16 ? s.Wo : 16;
  p.segsW = (s.Wo + p.L - 1) / p.L;
  p.segs = static_cast<int64_t>(s.N) * s.Ho * p.segsW;
  p.gy = (CV + p.TX - 1) / p.TX;
  // About 2048 blocks in all, each thread with several segments.
  int64_t gx = (2048 + p.gy - 1) / p.gy;
  const int64_t maxgx = (p.segs + p.TY * 4 - 1) / (p.TY * 4);
  if (gx > maxgx) gx = maxgx;
  if (gx < 1) gx = 1;
  p.gx = gx;
  return p;
}

template <typename T, int K, int S>
void run_wgrad(bool nhwc, const void* go, const void* in, void* gw, void* gb,
               float* ws, const FastShape& s, cudaStream_t stream) {
  int64_t P;
  if (!nhwc) {
    const PlanNCHW p = plan_nchw(s);
    const int64_t blocks = static_cast<int64_t>(s.N) * s.C * p.chunks;
    wgrad_nchw<T, K, S><<<static_cast<unsigned>(blocks), dim3(p.BX, p.BY), 0, stream>>>(
        static_cast<const T*>(go), static_cast<const T*>(in), ws, s.C, s.H, s.W,
        s.Ho, s.Wo, s.PH, s.PW, p.rows, p.chunks);
    P = p.P;
  } else {
    constexpr int V = nhwc_vec<T>(K);
    const PlanNHWC p = plan_nhwc(s, V);
    const size_t smem = 8192 * sizeof(float);
    wgrad_nhwc<T, K, S, V, 4><<<dim3(static_cast<unsigned>(p.gx), p.gy), dim3(p.TX, p.TY), smem, stream>>>(
        static_cast<const T*>(go), static_cast<const T*>(in), ws, s.C, s.H, s.W,
        s.Ho, s.Wo, s.PH, s.PW, p.L, p.segsW, p.segs);
    P = p.gx;
  }
  const int KK = K * K;
  const int64_t threads = static_cast<int64_t>(s.C) * (KK + 1) * 32;
  wgrad_finish<T><<<static_cast<unsigned>((threads + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      ws, static_cast<T*>(gw), static_cast<T*>(gb), s.C, static_cast<int>(P), KK);
}

bool supported(const FastShape& s) {
  if (s.N <= 0 || s.C <= 0 || s.Ho <= 0 || s.Wo <= 0) return false;
  if (!(s.K == 3 || s.K == 5 || s.K == 7)) return false;
  if (!(s.S == 1 || s.S == 2)) return false;
  return true;
}

int vec_for(DType dt, int K) {
  return (dt != DType::F32 && K == 3) ? 2 : 1;
}

template <typename T>
bool dispatch_ks(bool nhwc, const void* go, const void* in, void* gw, void* gb,
                 float* ws, const FastShape& s, cudaStream_t stream) {
#define CDO_DW_CASE(KK, SS)                                        \
  if (s.K == KK && s.S == SS) {                                    \
    run_wgrad<T, KK, SS>(nhwc, go, in, gw, gb, ws, s, stream);     \
    return true;                                                   \
  }
  CDO_DW_CASE(3, 1)
  CDO_DW_CASE(3, 2)
  CDO_DW_CASE(5, 1)
  CDO_DW_CASE(5, 2)
  CDO_DW_CASE(7, 1)
  CDO_DW_CASE(7, 2)
#undef CDO_DW_CASE
  return false;
}

// ---------------------------------------------------------------------------
// Channels_last, second generation.
//
//   go [N][Ho][Wo][C], in [N][H][W][C]; ws [P = gridDim.x][K*K+1][C] floats.
//
// Thread = (channel vector cv of V channels, kernel row kh, tile row sy), block
// = TX x K x SY threads (threadIdx.x/y/z). A thread owns the K taps of kernel
// row kh for its V channels (K*V float accumulators, plus V for the bias when
// kh == 0): splitting the taps by kernel row keeps 3x3 at 8 channels (16-byte
// vectors of 16-bit types) and 5x5 / 7x7 at 4 channels within about 64-90
// registers, where all K*K taps of 8 channels would need 80-400 accumulators.
//
// Work unit = (n, a tile of SY output rows, a segment [x0, x1) of columns).
// Thread sy takes output row oy = tile*SY + sy and walks its segment left to
// right. It needs input row iy = oy*S - PH + kh only, and keeps the K input
// vectors of the current window (columns ox*S - PW .. +K-1) in registers as
// float: each step loads S new input vectors and one dY vector, so every input
// and dY element is loaded and converted once per thread. The window is a
// ring indexed by (relative column) % K; the column loop is unrolled by K
// steps, after which the ring has turned a whole number of times (K*S is a
// multiple of K), so every ring index is a compile-time constant (no moves).
// The K threads of one (cv, sy) read the same dY vector (L1 hits) and the SY
// rows of a tile share input rows (S=1: each input row of a tile is read by up
// to K threads close in time), so DRAM/L2 traffic stays near one read of
// each tensor.
//
// The grid is at most one wave of resident blocks (gridDim.x = P per channel
// group, gridDim.y channel groups); block b takes units [b*U/P, (b+1)*U/P).
// This keeps the partial count P small (the workspace is read once more by
// the finish kernel); rows are cut into column segments where that evens out
// the units per block (see make_plan).
// The block then sums its SY partials per (tap, channel) in shared memory in
// a fixed order and writes them, channel-contiguous, to ws[blockIdx.x].
namespace v2 {

constexpr int kBlock = 256;   // most threads per block of wgrad_nhwc_v2
constexpr int kTxCap = 8;     // channel vectors per block (128 bytes of channels for V=8 fp16)

// Input vector at column ix of the thread's input row (zero outside the image).
template <typename T, int V>
__device__ __forceinline__ void load_col(const T* xr, int C, int W, bool rowok, int ix,
                                         float (&dst)[V]) {
  const bool ok = rowok && static_cast<unsigned>(ix) < static_cast<unsigned>(W);
  ldg_vec_or_zero<T, V>(xr + static_cast<int64_t>(ok ? ix : 0) * C, ok, dst);
}

template <typename T, int V>
using RawT = typename RawVec<sizeof(T) * V>::type;

// The raw vector at column ix of the thread's input row (zeros outside the image).
template <typename T, int V>
__device__ __forceinline__ RawT<T, V> raw_col(const T* xr, int C, int W, bool rowok, int ix) {
  RawT<T, V> r{};
  if (rowok && static_cast<unsigned>(ix) < static_cast<unsigned>(W))
    r = __ldg(reinterpret_cast<const RawT<T, V>*>(xr + static_cast<int64_t>(ix) * C));
  return r;
}

template <typename T, int V>
__device__ __forceinline__ void raw_to_float(const RawT<T, V>& r, float (&out)[V]) {
  T tmp[V];
  memcpy(tmp, &r, sizeof(r));
#pragma unroll
  for (int i = 0; i < V; ++i) out[i] = to_float(tmp[i]);
}

// The loads of one group of output columns ox0 .. ox0+n-1, n <= K (n < K only for the last group
// of a segment): for each step u < n the S input vectors not yet in the window (relative columns
// u*S+K-S .. u*S+K-1) and the dY vector, raw, all issued before any is used; steps u >= n load
// nothing (zeros).
template <typename T, int K, int S, int V>
struct GroupLoads {
  RawT<T, V> in[K * S];
  RawT<T, V> g[K];

  __device__ __forceinline__ void issue(const T* xr, const T* gr, int C, int W, int ox0, int n,
                                        int PW, bool rowok) {
    const int base = ox0 * S - PW;
#pragma unroll
    for (int t = 0; t < K * S; ++t)
      in[t] = raw_col<T, V>(xr, C, W, rowok && t / S < n, base + K - S + t);
#pragma unroll
    for (int u = 0; u < K; ++u) {
      g[u] = RawT<T, V>{};
      if (u < n)
        g[u] = __ldg(reinterpret_cast<const RawT<T, V>*>(gr + static_cast<int64_t>(ox0 + u) * C));
    }
  }
};

// The K taps (and the bias) of output column u of a group, its dY vector g and the window in the
// ring (see row_step).
template <int K, int S, int V>
__device__ __forceinline__ void step_taps(int u, const float (&g)[V], bool bias,
                                          const float (&win)[K][V], float (&acc)[K][V],
                                          float (&bacc)[V]) {
#pragma unroll
  for (int kw = 0; kw < K; ++kw)
#pragma unroll
    for (int e = 0; e < V; ++e) acc[kw][e] = fmaf(g[e], win[(u * S + kw) % K][e], acc[kw][e]);
  if (bias) {
#pragma unroll
    for (int e = 0; e < V; ++e) bacc[e] += g[e];
  }
}

// Steps u < n of a group from its loads (see row_step for the ring).
template <typename T, int K, int S, int V>
__device__ __forceinline__ void group_steps(const GroupLoads<T, K, S, V>& ld, int n, bool bias,
                                            float (&win)[K][V], float (&acc)[K][V],
                                            float (&bacc)[V]) {
#pragma unroll
  for (int u = 0; u < K; ++u) {
    if (u >= n) break;
#pragma unroll
    for (int s = 0; s < S; ++s) raw_to_float<T, V>(ld.in[u * S + s], win[(u * S + K - S + s) % K]);
    float g[V];
    raw_to_float<T, V>(ld.g[u], g);
    step_taps<K, S, V>(u, g, bias, win, acc, bacc);
  }
}

// Output column ox0 + u of a group of K columns starting at ox0, whose window
// starts at input column base = ox0*S - PW (relative column 0). Relative
// column j lives in ring slot j % K; step u reads relative columns
// u*S .. u*S+K-1 and loads the S of them not loaded by step u-1.
template <typename T, int K, int S, int V>
__device__ __forceinline__ void row_step(int u, const T* xr, const T* gr, int C, int W, int base,
                                         int ox0, bool rowok, bool bias, float (&win)[K][V],
                                         float (&acc)[K][V], float (&bacc)[V]) {
#pragma unroll
  for (int s = 0; s < S; ++s) {
    const int j = u * S + K - S + s;
    load_col<T, V>(xr, C, W, rowok, base + j, win[j % K]);
  }
  float g[V];
  load_vec<T, V>(gr + static_cast<int64_t>(ox0 + u) * C, g);
  step_taps<K, S, V>(u, g, bias, win, acc, bacc);
}

// PF: how the loads of the column loop are issued. 0: per step (one input and one dY vector,
// then their FMAs); 1: per group of K steps, all K*S + K vectors first (GroupLoads), the
// segment's last, shorter group included; 2: as 1, and the next group's loads issued before this
// group's FMAs (one segment's groups form one pipeline).
template <typename T, int K, int S, int V, int PF>
__global__ void __launch_bounds__(kBlock)
    wgrad_nhwc_v2(const T* __restrict__ go, const T* __restrict__ in, float* __restrict__ ws,
                  int C, int H, int W, int Ho, int Wo, int PH, int PW, int L, int segsW,
                  int tilesY, int64_t units) {
  constexpr int KK = K * K;
  const int TX = blockDim.x;
  const int SY = blockDim.z;
  const int TXC = TX * V;
  const int cv = threadIdx.x;
  const int kh = threadIdx.y;
  const int sy = threadIdx.z;
  const int c = blockIdx.y * TXC + cv * V;  // C % V == 0: all V channels valid when c < C
  const bool bias = kh == 0;

  float acc[K][V];
  float bacc[V];
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int e = 0; e < V; ++e) acc[k][e] = 0.f;
#pragma unroll
  for (int e = 0; e < V; ++e) bacc[e] = 0.f;

  if (c < C) {
    const int64_t u0 = static_cast<int64_t>(blockIdx.x) * units / gridDim.x;
    const int64_t u1 = static_cast<int64_t>(blockIdx.x + 1) * units / gridDim.x;
    const int64_t rowstride = static_cast<int64_t>(W) * C;
    for (int64_t u = u0; u < u1; ++u) {
      const int sx = static_cast<int>(u % segsW);
      const int64_t t = u / segsW;
      const int oy = static_cast<int>(t % tilesY) * SY + sy;
      const int64_t n = t / tilesY;
      if (oy >= Ho) continue;
      const int iy = oy * S - PH + kh;
      const bool rowok = static_cast<unsigned>(iy) < static_cast<unsigned>(H);
      // A row outside the image adds nothing to the taps; the kh == 0 thread
      // still walks it for the bias (loads off, zeros).
      if (!rowok && !bias) continue;
      const int x0 = sx * L;
      const int x1 = min(Wo, x0 + L);
      const T* xr = in + (n * H + (rowok ? iy : 0)) * rowstride + c;
      const T* gr = go + (n * Ho + oy) * static_cast<int64_t>(Wo) * C + c;

      float win[K][V];
      const int base0 = x0 * S - PW;
#pragma unroll
      for (int j = 0; j < K - S; ++j) load_col<T, V>(xr, C, W, rowok, base0 + j, win[j]);
      int ox0 = x0;
      if constexpr (PF == 0) {
        for (; ox0 + K <= x1; ox0 += K) {
          const int base = ox0 * S - PW;
#pragma unroll
          for (int s = 0; s < K; ++s)
            row_step<T, K, S, V>(s, xr, gr, C, W, base, ox0, rowok, bias, win, acc, bacc);
        }
      } else if constexpr (PF == 1) {
        for (; ox0 < x1; ox0 += K) {
          const int n = min(K, x1 - ox0);
          GroupLoads<T, K, S, V> ld;
          ld.issue(xr, gr, C, W, ox0, n, PW, rowok);
          group_steps<T, K, S, V>(ld, n, bias, win, acc, bacc);
        }
        continue;  // the segment is done (no tail below)
      } else {
        GroupLoads<T, K, S, V> cur;
        int n = min(K, x1 - ox0);  // x1 > x0: every segment has a column
        cur.issue(xr, gr, C, W, ox0, n, PW, rowok);
        for (;;) {
          const int nn = min(K, x1 - ox0 - K);  // the next group's columns (<= 0: none)
          GroupLoads<T, K, S, V> nxt;
          if (nn > 0) nxt.issue(xr, gr, C, W, ox0 + K, nn, PW, rowok);
          group_steps<T, K, S, V>(cur, n, bias, win, acc, bacc);
          if (nn <= 0) break;
          ox0 += K;
          n = nn;
          cur = nxt;
        }
        continue;
      }
      const int base = ox0 * S - PW;
#pragma unroll
      for (int s = 0; s < K - 1; ++s)
        if (ox0 + s < x1)
          row_step<T, K, S, V>(s, xr, gr, C, W, base, ox0, rowok, bias, win, acc, bacc);
    }
  }

  // Block reduction over sy: red[SY][K*K+1][TXC], summed in sy order.
  extern __shared__ float red[];
  float* r = red + static_cast<size_t>(sy) * (KK + 1) * TXC + cv * V;
#pragma unroll
  for (int kw = 0; kw < K; ++kw)
#pragma unroll
    for (int e = 0; e < V; ++e) r[(kh * K + kw) * TXC + e] = acc[kw][e];
  if (bias) {
#pragma unroll
    for (int e = 0; e < V; ++e) r[KK * TXC + e] = bacc[e];
  }
  __syncthreads();
  const int tid = (sy * K + kh) * TX + cv;
  const int nthr = TX * K * SY;
  const int items = (KK + 1) * TXC;
  float* wsb = ws + static_cast<int64_t>(blockIdx.x) * (KK + 1) * C;
  for (int i = tid; i < items; i += nthr) {
    const int tap = i / TXC;
    const int ch = i - tap * TXC;
    float sum = 0.f;
    for (int y = 0; y < SY; ++y) sum += red[(y * (KK + 1) + tap) * TXC + ch];
    const int cc = blockIdx.y * TXC + ch;
    if (cc < C) wsb[static_cast<int64_t>(tap) * C + cc] = sum;
  }
}

// Stage 2: ws [P][J = (K*K+1)*C] -> gw [C][K*K], gb [C] (or null).
// Block = 32 columns x RY rows; thread (x, y) sums partials y, y+RY, ... of
// column j in order, then thread y == 0 sums the RY row sums in order.
template <typename T>
__global__ void __launch_bounds__(1024)
    wgrad_finish_v2(const float* __restrict__ ws, T* __restrict__ gw, T* __restrict__ gb, int C,
                    int P, int KK) {
  __shared__ float part[32][33];
  const int64_t J = static_cast<int64_t>(KK + 1) * C;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  const int RY = blockDim.y;
  float s = 0.f;
  if (j < J) {
    for (int p = threadIdx.y; p < P; p += RY) s += ws[static_cast<int64_t>(p) * J + j];
  }
  part[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || j >= J) return;
  float t = 0.f;
  for (int y = 0; y < RY; ++y) t += part[y][threadIdx.x];
  const int tap = static_cast<int>(j / C);
  const int c = static_cast<int>(j - static_cast<int64_t>(tap) * C);
  if (tap < KK)
    gw[static_cast<int64_t>(c) * KK + tap] = from_float<T>(t);
  else if (gb != nullptr)
    gb[c] = from_float<T>(t);
}

// Stage 2 over P partials of [(KK + 1) * C]: blocks of 32 columns x RY partial rows.
template <typename T>
void launch_finish_v2(const float* ws, void* gw, void* gb, int C, int P, int KK,
                      cudaStream_t stream) {
  const int64_t J = static_cast<int64_t>(KK + 1) * C;
  int RY = 1;
  while (RY < 32 && 2 * RY <= (P + 1) / 2) RY *= 2;
  wgrad_finish_v2<T><<<static_cast<unsigned>((J + 31) / 32), dim3(32, RY), 0, stream>>>(
      ws, static_cast<T*>(gw), static_cast<T*>(gb), C, P, KK);
}

// As few blocks as give the same work units per block as `most` blocks do.
inline int fewest_blocks(int64_t units, int64_t most) {
  const int64_t per_block = (units + most - 1) / most;
  return static_cast<int>((units + per_block - 1) / per_block);
}

// Vector width (elements): 16 bytes for 16-bit 3x3 (8 channels) and for
// float32 (4 channels); 8 bytes (4 channels) for 16-bit 5x5 and 7x7.
int vec_v2(DType dt, int K) { return (dt != DType::F32 && K == 3) ? 8 : 4; }

struct Plan {
  int TX, SY, L, segsW, tilesY, gx, gy, threads;
  int64_t units;
  size_t smem;
};

bool make_plan(const FastShape& s, int V, const void* kernel, Plan& p) {
  const int K = s.K;
  const int KK = K * K;
  const int CV = s.C / V;
  p.TX = pick_channel_vectors(CV, kTxCap);
  p.gy = (CV + p.TX - 1) / p.TX;
  if (p.gy > 65535) return false;
  int symax = kBlock / (p.TX * K);
  if (symax < 1) symax = 1;
  if (symax > 64) symax = 64;
  p.tilesY = (s.Ho + symax - 1) / symax;
  p.SY = (s.Ho + p.tilesY - 1) / p.tilesY;
  p.threads = p.TX * K * p.SY;
  p.smem = static_cast<size_t>(p.SY) * (KK + 1) * p.TX * V * sizeof(float);
  const int64_t wave =
      static_cast<int64_t>(current_sm_count()) * resident_blocks_per_sm(kernel, p.threads, p.smem);
  int64_t gxw = (wave + p.gy - 1) / p.gy;
  if (gxw < 1) gxw = 1;
  // Column segments: the split of each row into segsW segments of L columns
  // (L >= 2K) that minimises a block's steps, ceil(units / gxw) * (L + K - S)
  // (a segment costs K - S extra input loads); whole rows on ties.
  const int64_t rows = static_cast<int64_t>(s.N) * p.tilesY;
  p.segsW = 1;
  p.L = s.Wo;
  int64_t best = -1;
  for (int want = 1; want <= s.Wo; want *= 2) {
    const int L = (s.Wo + want - 1) / want;
    if (want > 1 && L < 2 * K) break;
    const int segs = (s.Wo + L - 1) / L;
    const int64_t per_block = (rows * segs + gxw - 1) / gxw;
    const int64_t cost = per_block * (L + K - s.S);
    if (best < 0 || cost < best) {
      best = cost;
      p.L = L;
      p.segsW = segs;
    }
  }
  p.units = rows * p.segsW;
  // As few blocks as give the same units per block (fewer partials).
  p.gx = fewest_blocks(p.units, gxw);
  return p.gx >= 1;
}

// CUDADOCTOR_OPS_DW_WGRAD_PF=0|1|2 (read once): the loads of wgrad_nhwc_v2's column loop (see
// its PF); unset: default_pf.
int pf_setting() {
  static const int v = [] {
    const char* e = std::getenv("CUDADOCTOR_OPS_DW_WGRAD_PF");
    if (e == nullptr || e[0] < '0' || e[0] > '2' || e[1] != '\0') return -1;
    return e[0] - '0';
  }();
  return v;
}

// The default: the next group's loads in flight (2) at stride 1 on short rows (output width <= 14,
// or <= 28 for 3x3), where a thread's segment is a few groups and the pipeline's start is most
// of its latency; per group (1) elsewhere (stride 2, wide rows: fewer registers, more warps). On
// the H200 (one run, weight gradient alone, batch 64, channels_last, float16, us for PF 1 / 2):
// 5x5 stride 1 (64,1152,7,7) 52.0 / 39.2, (64,480,14,14) 79.8 / 78.6, (64,240,28,28) 81.7 /
// 86.6; 3x3 stride 1 (64,960,7,7) 23.2 / 22.1, (64,192,28,28) 39.9 / 38.9, (64,144,56,56) 77.1 /
// 78.6; stride 2 (64,96,112,112) 3x3 72.8 / 101.9, (64,144,56,56) 5x5 65.7 / 74.2. Per step (0)
// was slower everywhere: 5x5 stride 1 (64,240,28,28) 150 us. float32 7x7 stays at 1: two groups
// of its 16-byte vectors need 200-250 registers.
int default_pf(DType dt, const FastShape& s) {
  if (dt == DType::F32 && s.K == 7) return 1;
  if (s.S == 1 && (s.Wo <= 14 || (s.K == 3 && s.Wo <= 28))) return 2;
  return 1;
}

int pf_for(DType dt, const FastShape& s) {
  const int v = pf_setting();
  return v >= 0 ? v : default_pf(dt, s);
}

template <typename T, int K, int S>
const void* kernel_ptr(int pf) {
  constexpr int V = (sizeof(T) == 2 && K == 3) ? 8 : 4;
  if (pf == 0) return reinterpret_cast<const void*>(&wgrad_nhwc_v2<T, K, S, V, 0>);
  if (pf == 1) return reinterpret_cast<const void*>(&wgrad_nhwc_v2<T, K, S, V, 1>);
  return reinterpret_cast<const void*>(&wgrad_nhwc_v2<T, K, S, V, 2>);
}

const void* kernel_for(DType dt, const FastShape& s) {
  const int K = s.K, S = s.S;
  const int pf = pf_for(dt, s);
#define CDO_DW_V2K(T)                                    \
  if (K == 3 && S == 1) return kernel_ptr<T, 3, 1>(pf);  \
  if (K == 3 && S == 2) return kernel_ptr<T, 3, 2>(pf);  \
  if (K == 5 && S == 1) return kernel_ptr<T, 5, 1>(pf);  \
  if (K == 5 && S == 2) return kernel_ptr<T, 5, 2>(pf);  \
  if (K == 7 && S == 1) return kernel_ptr<T, 7, 1>(pf);  \
  if (K == 7 && S == 2) return kernel_ptr<T, 7, 2>(pf);  \
  return nullptr;
  switch (dt) {
    case DType::F32: {
      CDO_DW_V2K(float)
    }
    case DType::F16: {
      CDO_DW_V2K(c10::Half)
    }
    case DType::BF16: {
      CDO_DW_V2K(c10::BFloat16)
    }
  }
#undef CDO_DW_V2K
  return nullptr;
}

// Shape-level applicability and plan (pointer alignment is checked at launch).
bool plan_for(DType dt, const FastShape& s, Plan& p) {
  if (s.N <= 0 || s.C <= 0 || s.H <= 0 || s.W <= 0 || s.Ho <= 0 || s.Wo <= 0) return false;
  if (!(s.K == 3 || s.K == 5 || s.K == 7) || !(s.S == 1 || s.S == 2)) return false;
  const int V = vec_v2(dt, s.K);
  if (s.C % V != 0) return false;
  // Finish grid: ceil((K*K+1)*C / 32) blocks.
  if ((static_cast<int64_t>(s.K) * s.K + 1) * s.C / 32 >= (int64_t(1) << 31) - 1) return false;
  const void* kern = kernel_for(dt, s);
  return kern != nullptr && make_plan(s, V, kern, p);
}

int64_t workspace(const FastShape& s, const Plan& p) {
  return static_cast<int64_t>(p.gx) * (static_cast<int64_t>(s.K) * s.K + 1) * s.C;
}

template <typename T, int K, int S>
void run(DType dt, const void* go, const void* in, void* gw, void* gb, float* ws,
         const FastShape& s, const Plan& p, cudaStream_t stream) {
  constexpr int V = (sizeof(T) == 2 && K == 3) ? 8 : 4;
  const dim3 grid(static_cast<unsigned>(p.gx), p.gy), block(p.TX, K, p.SY);
  const T* g = static_cast<const T*>(go);
  const T* x = static_cast<const T*>(in);
  switch (pf_for(dt, s)) {
    case 0:
      wgrad_nhwc_v2<T, K, S, V, 0><<<grid, block, p.smem, stream>>>(
          g, x, ws, s.C, s.H, s.W, s.Ho, s.Wo, s.PH, s.PW, p.L, p.segsW, p.tilesY, p.units);
      break;
    case 1:
      wgrad_nhwc_v2<T, K, S, V, 1><<<grid, block, p.smem, stream>>>(
          g, x, ws, s.C, s.H, s.W, s.Ho, s.Wo, s.PH, s.PW, p.L, p.segsW, p.tilesY, p.units);
      break;
    default:
      wgrad_nhwc_v2<T, K, S, V, 2><<<grid, block, p.smem, stream>>>(
          g, x, ws, s.C, s.H, s.W, s.Ho, s.Wo, s.PH, s.PW, p.L, p.segsW, p.tilesY, p.units);
      break;
  }
  launch_finish_v2<T>(ws, gw, gb, s.C, p.gx, K * K, stream);
}

template <typename T>
bool dispatch(DType dt, const void* go, const void* in, void* gw, void* gb, float* ws,
              const FastShape& s, const Plan& p, cudaStream_t stream) {
#define CDO_DW_V2(KK, SS)                                   \
  if (s.K == KK && s.S == SS) {                             \
    run<T, KK, SS>(dt, go, in, gw, gb, ws, s, p, stream);   \
    return true;                                            \
  }
  CDO_DW_V2(3, 1)
  CDO_DW_V2(3, 2)
  CDO_DW_V2(5, 1)
  CDO_DW_V2(5, 2)
  CDO_DW_V2(7, 1)
  CDO_DW_V2(7, 2)
#undef CDO_DW_V2
  return false;
}

}  // namespace v2

// ---------------------------------------------------------------------------
// Channels_last, shared-memory staged (v3), 16-bit types, stride 1.
// On by default for output planes up to 32x32 pixels; CUDADOCTOR_OPS_DW_WGRAD_SMEM=0|1 (see mode()).
//
// Block = a group of 32 channels (64 bytes per pixel) and a run of work units, a unit being a
// band of TH output rows of one image (the whole image where both planes fit the shared-memory
// budget, e.g. 14x14 and 7x7; bands at 28x28). Per unit the block copies the band's TH + K - 1
// input rows, zero-padded by PW on both sides (rows above or below the image zeroed), and its TH
// dY rows into shared memory (cp.async, 16-byte pieces; the side halo is zeroed once). Row
// pitches of both planes are odd numbers of pixels, so neighbouring rows in one warp fall into the
// other 16 banks. Two thread layouts (template flag AK):
//   - 5x5 / 7x7 (and 3x3 with CUDADOCTOR_OPS_DW_WGRAD_V3_AK=0): threads (16 channel pairs) x K
//     kernel rows x SY row slices; thread (cp, kh, sy) walks the band's output rows sy, sy + SY, ..
//     keeping the K input pairs of its kernel row's window as float2 in a ring (one new input pair
//     and one dY pair per step) and adds K taps x 2 channels. 48 KB of bands.
//   - AK, 3x3 by default (5x5 with _V3_AK=2): threads (16 channel pairs) x 15 slices; a thread
//     owns all K x K taps of its pair and walks work items (output row, column segment;
//     ak_segments), per step one dY pair and K input pairs (one ring per kernel row) for 2 K^2
//     FMAs (18 at 3x3), so each dY pair is loaded and
//     converted once instead of once per kernel row. 96 KB of bands (opt-in): 28x28 in 2 bands of
//     14 rows instead of 3 of 10.
// Where a band is a whole image, a unit can be several images (with_images: 7x7 planes take 4-5),
// so that a block copies all its data at once instead of in rounds of one DRAM round trip each.
// The block then sums its slices per (tap, channel) in a fixed order and writes
// ws [blockIdx.x][K*K+1][C] as v2 does; wgrad_finish_v2 sums the blocks. Where v2 (reading global
// memory, one kernel row of 4 channels per thread) is latency-bound on 14x14 planes: 5x5 float16
// (64,672,14,14) 105 us against cuDNN's 61 us.
// H200, scripts/gpu_variants.py dwv3, 2026-12-01, batch 64, weight gradient alone / dX + dW, us,
// AK (96 KB) against one kernel row per thread (48 KB), cuDNN last: float16 3x3 (64,192,28,28)
// 31.1 / 50.5 against 39.2 / 57.5 (cuDNN 34.7 / 55.9), (64,576,14,14) 27.1 / 43.9 against 31.7 /
// 50.0, (64,960,7,7) 20.1 / 29.9 against 22.1 / 33.8 (cuDNN 17.8 / 40.5). Tried there and left
// opt-in, slower on these layers: two band buffers (DB, the next unit's copies in flight during
// this one's FMAs; in 48 KB its bands are half as tall: (64,240,28,28) 5x5 72.7 against 64.3 us,
// in 96 KB 35.8 against 31.1 at (64,192,28,28)), at most 1 or 2 units per block (UPB; 7x7 3x3
// 25.7 / 21.9 against 20.1 us).
namespace v3 {

constexpr int kCB = 32;       // channels per block
constexpr int kPairs = kCB / 2;
constexpr int kWords = kCB / 2;  // 32-bit words per pixel (two 16-bit channels each)

template <typename T>
__device__ __forceinline__ float2 pair(uint32_t w) {
  T t[2];
  memcpy(t, &w, sizeof(w));
  return make_float2(to_float(t[0]), to_float(t[1]));
}

struct Geo {
  int Wp, pitchI, pitchG;  // padded input row width and the two row pitches (pixels)
  int TH, bands;           // output rows per unit, units per image
  size_t smem;             // bytes: the band's input and dY rows, at least the reduction
};

__host__ __device__ inline int odd_up(int v) { return v | 1; }

inline size_t band_bytes(int TH, int K, int pitchI, int pitchG) {
  return (static_cast<size_t>(TH + K - 1) * pitchI + static_cast<size_t>(TH) * pitchG) * kWords * 4;
}

// The band height: all Ho rows where `buffers` bands fit `smem` bytes, else as even bands as the
// largest fitting height allows; TH = 0 when not even one row fits. SY: the reduction's slices.
inline Geo geometry(const FastShape& s, int K, int SY, int buffers, size_t smem) {
  Geo g;
  g.Wp = s.W + 2 * s.PW;
  g.pitchI = odd_up(g.Wp);
  g.pitchG = odd_up(s.Wo);
  const size_t budget = smem / static_cast<size_t>(buffers);
  int most = s.Ho;
  while (most > 0 && band_bytes(most, K, g.pitchI, g.pitchG) > budget) --most;
  g.TH = 0;
  g.bands = 0;
  g.smem = 0;
  if (most < 1) return g;
  g.bands = (s.Ho + most - 1) / most;
  g.TH = (s.Ho + g.bands - 1) / g.bands;
  const size_t planes = band_bytes(g.TH, K, g.pitchI, g.pitchG) * static_cast<size_t>(buffers);
  const size_t red = static_cast<size_t>(SY) * (K * K + 1) * kCB * sizeof(float);
  g.smem = planes > red ? planes : red;
  return g;
}

// Threads of a block: kPairs channel pairs x K kernel rows x slices(K) row slices, or with AK
// (all kernel rows per thread, 3x3 only) kPairs x 1 x K * slices(K): the same count either way.
constexpr int slices(int K) { return K == 3 ? 5 : K == 5 ? 3 : 2; }
constexpr int block_threads(int K) { return kPairs * K * slices(K); }

// Unit u: band oy0 .. oy0 + rows - 1 of images n0 .. n0 + nimg - 1 (several images only where a
// band is the whole image).
struct UnitPos {
  int64_t n0;
  int nimg, oy0, rows;
};

__device__ __forceinline__ UnitPos unit_pos(int64_t u, int bands, int imgs, int N, int TH, int Ho) {
  UnitPos q;
  const int64_t grp = u / bands;
  q.oy0 = static_cast<int>(u - grp * bands) * TH;
  q.rows = min(TH, Ho - q.oy0);
  q.n0 = grp * imgs;
  q.nimg = static_cast<int>(min(static_cast<int64_t>(imgs), static_cast<int64_t>(N) - q.n0));
  return q;
}

// Copies one band of image n (its input rows, zeros outside the image, and its dY rows) into one
// band buffer: cp.async 16-byte pieces, plain zero stores where there is nothing to copy.
template <typename T>
__device__ __forceinline__ void stage_band(const T* __restrict__ go, const T* __restrict__ in,
                                           uint32_t* sIn, uint32_t* sG, int64_t n, int oy0,
                                           int rows, int tid, int nthr, int c0, int C, int H,
                                           int W, int Ho, int Wo, int PH, int PW, int pitchI,
                                           int pitchG, int K) {
  constexpr int kPieces = kCB * int(sizeof(T)) / 16;  // 16-byte pieces per pixel
  const int rin = rows + K - 1;
  const T* xin = in + n * H * W * C + c0;
  for (int i = tid; i < rin * W * kPieces; i += nthr) {
    const int pix = i / kPieces, q = i - pix * kPieces;
    const int r = pix / W, x = pix - r * W;
    const int iy = oy0 + r - PH;
    uint32_t* dst = sIn + (static_cast<size_t>(r) * pitchI + (x + PW)) * kWords + q * 4;
    if (iy >= 0 && iy < H && c0 + q * 8 < C)
      cp_async16(dst, xin + (static_cast<int64_t>(iy) * W + x) * C + q * 8);
    else
      *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
  }
  const T* gin = go + (n * Ho + oy0) * Wo * C + c0;
  for (int i = tid; i < rows * Wo * kPieces; i += nthr) {
    const int pix = i / kPieces, q = i - pix * kPieces;
    const int r = pix / Wo, x = pix - r * Wo;
    uint32_t* dst = sG + (static_cast<size_t>(r) * pitchG + x) * kWords + q * 4;
    if (c0 + q * 8 < C)
      cp_async16(dst, gin + static_cast<int64_t>(pix) * C + q * 8);
    else
      *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// DB: two band buffers; the copies of unit u + 1 are in flight while unit u is computed (one
// commit group per unit). Without it, each unit is copied, waited for and computed in turn.
// AK (K == 3, or 5 with _V3_AK=2): a thread (cp, 0, sy) owns all K x K taps of its channel pair
// and walks the unit's work items sy, sy + SY, .. (image, column segment, output row): per step one
// dY pair and K input
// pairs (one per kernel row, each window a ring), K*K*2 FMAs; without AK a thread (cp, kh, sy)
// owns one kernel row (K taps) and walks whole output rows (nseg == 1), and the K threads of an
// output row each load and convert its dY pair.
template <typename T, int K, bool DB, bool AK>
__global__ void __launch_bounds__(block_threads(K))
    wgrad_nhwc_v3(const T* __restrict__ go, const T* __restrict__ in, float* __restrict__ ws,
                  int N, int C, int H, int W, int Ho, int Wo, int PH, int PW, int Wp, int pitchI,
                  int pitchG, int TH, int bands, int imgs, int nseg, int L, int64_t units) {
  static_assert(!AK || K == 3 || K == 5, "all kernel rows per thread: 3x3 and 5x5 only");
  constexpr int KK = K * K;
  constexpr int KR = AK ? K : 1;  // kernel rows per thread
  extern __shared__ __align__(16) uint32_t v3_smem[];
  const int SY = blockDim.z;
  const int cp = threadIdx.x, sy = threadIdx.z;
  const int kh0 = AK ? 0 : threadIdx.y;  // the thread's first kernel row
  const int tid = (sy * blockDim.y + threadIdx.y) * kPairs + cp;
  const int nthr = kPairs * blockDim.y * SY;
  const int c0 = blockIdx.y * kCB;
  const int RI = TH + K - 1;  // input rows of a band
  const size_t inWords = static_cast<size_t>(RI) * pitchI * kWords;
  const size_t bandWords = inWords + static_cast<size_t>(TH) * pitchG * kWords;
  const size_t slotWords = bandWords * imgs;  // a unit's bands (DB: two slots)
  const bool bias = AK || kh0 == 0;
  const int64_t u0 = static_cast<int64_t>(blockIdx.x) * units / gridDim.x;
  const int64_t u1 = static_cast<int64_t>(blockIdx.x + 1) * units / gridDim.x;

  // the side halo (and the pitch padding) is zero for good: the copies write columns
  // PW .. PW + W - 1 only
  for (int b = 0; b < (DB ? 2 : 1) * imgs; ++b) {
    uint32_t* sIn = v3_smem + b * bandWords;
    for (int i = tid; i < RI * pitchI; i += nthr) {
      const int px = i % pitchI;
      if (px < PW || px >= PW + W) {
#pragma unroll
        for (int w = 0; w < kWords; ++w) sIn[static_cast<size_t>(i) * kWords + w] = 0u;
      }
    }
  }

  float2 acc[KR][K];
  float2 bacc = make_float2(0.f, 0.f);
#pragma unroll
  for (int r = 0; r < KR; ++r)
#pragma unroll
    for (int k = 0; k < K; ++k) acc[r][k] = make_float2(0.f, 0.f);

  // copies unit u's bands into slot `slot`
  auto stage = [&](int64_t u, int slot) {
    const UnitPos q = unit_pos(u, bands, imgs, N, TH, Ho);
    for (int i = 0; i < q.nimg; ++i) {
      uint32_t* bIn = v3_smem + slot * slotWords + i * bandWords;
      stage_band<T>(go, in, bIn, bIn + inWords, q.n0 + i, q.oy0, q.rows, tid, nthr, c0, C, H, W,
                    Ho, Wo, PH, PW, pitchI, pitchG, K);
    }
  };
  if (DB && u0 < u1) {
    stage(u0, 0);
    cp_async_commit();
  }
  for (int64_t u = u0; u < u1; ++u) {
    const int slot = DB ? static_cast<int>((u - u0) & 1) : 0;
    if constexpr (DB) {
      if (u + 1 < u1) {
        stage(u + 1, slot ^ 1);
        cp_async_commit();
        cp_async_wait_group<1>();
      } else {
        cp_async_wait_all();
      }
    } else {
      stage(u, 0);
      cp_async_wait_all();
    }
    __syncthreads();
    const UnitPos q = unit_pos(u, bands, imgs, N, TH, Ho);
    const int rows = q.rows;

    // ---- taps of kernel rows kh0 .. kh0 + KR - 1 for channel pair cp over the unit's work items
    // (image, column segment of L, output row) sy, sy + SY, .. (nseg segments per row; rows
    // fastest, so the two slices of a warp read rows an odd pitch apart: the other 16 banks) ----
    const int rstep = pitchI * kWords;
    const int per_img = rows * nseg;
    const int items = q.nimg * per_img;
    for (int it = sy; it < items; it += SY) {
      const int img = it / per_img;
      const int seg = (it - img * per_img) / rows;
      const int oy = it - img * per_img - seg * rows;
      const int x0 = seg * L;
      const uint32_t* sIn = v3_smem + slot * slotWords + img * bandWords;
      const uint32_t* sG = sIn + inWords;
      const int len = min(L, Wo - x0);
      const uint32_t* ir = sIn + (static_cast<size_t>(oy + kh0) * pitchI + x0) * kWords + cp;
      const uint32_t* gr = sG + (static_cast<size_t>(oy) * pitchG + x0) * kWords + cp;
      float2 win[KR][K];
#pragma unroll
      for (int r = 0; r < KR; ++r)
#pragma unroll
        for (int j = 0; j < K - 1; ++j) win[r][j] = pair<T>(ir[r * rstep + j * kWords]);
      for (int ox0 = 0; ox0 < len; ox0 += K) {
#pragma unroll
        for (int u2 = 0; u2 < K; ++u2) {
          if (ox0 + u2 < len) {
#pragma unroll
            for (int r = 0; r < KR; ++r)
              win[r][(u2 + K - 1) % K] = pair<T>(ir[r * rstep + (ox0 + u2 + K - 1) * kWords]);
            const float2 g = pair<T>(gr[(ox0 + u2) * kWords]);
#pragma unroll
            for (int r = 0; r < KR; ++r)
#pragma unroll
              for (int kw = 0; kw < K; ++kw) {
                acc[r][kw].x = fmaf(g.x, win[r][(u2 + kw) % K].x, acc[r][kw].x);
                acc[r][kw].y = fmaf(g.y, win[r][(u2 + kw) % K].y, acc[r][kw].y);
              }
            if (bias) {
              bacc.x += g.x;
              bacc.y += g.y;
            }
          }
        }
      }
    }
    __syncthreads();  // this buffer is rewritten for a later unit
  }

  // ---- sum the SY slices per (tap, channel) in sy order; ws[blockIdx.x][tap][c] ----
  float* red = reinterpret_cast<float*>(v3_smem);  // [SY][KK + 1][kCB]
  {
    float* r = red + static_cast<size_t>(sy) * (KK + 1) * kCB + 2 * cp;
#pragma unroll
    for (int kr = 0; kr < KR; ++kr)
#pragma unroll
      for (int kw = 0; kw < K; ++kw) {
        r[((kh0 + kr) * K + kw) * kCB] = acc[kr][kw].x;
        r[((kh0 + kr) * K + kw) * kCB + 1] = acc[kr][kw].y;
      }
    if (bias) {
      r[KK * kCB] = bacc.x;
      r[KK * kCB + 1] = bacc.y;
    }
  }
  __syncthreads();
  float* wsb = ws + static_cast<int64_t>(blockIdx.x) * (KK + 1) * C;
  for (int i = tid; i < (KK + 1) * kCB; i += nthr) {
    const int tap = i / kCB, ch = i - tap * kCB;
    float sum = 0.f;
    for (int y = 0; y < SY; ++y) sum += red[(static_cast<size_t>(y) * (KK + 1) + tap) * kCB + ch];
    if (c0 + ch < C) wsb[static_cast<int64_t>(tap) * C + c0 + ch] = sum;
  }
}

// CUDADOCTOR_OPS_DW_WGRAD_SMEM (read once): 0 never, 1 wherever it applies, unset: output planes of
// at most kAutoPlane pixels (H200, 16-bit: 7x7 to 28x28 gain, 1.05-2.2x over v2; 56x56 and
// 112x112 3x3 lose 17-22%, their bands of 5 rows re-read too much halo).
constexpr int64_t kAutoPlane = 32 * 32;

int mode() {
  static const int v = [] {
    const char* e = std::getenv("CUDADOCTOR_OPS_DW_WGRAD_SMEM");
    if (e == nullptr || e[0] == '\0') return 2;
    return e[0] == '1' ? 1 : 0;
  }();
  return v;
}

// Switches (read once). CUDADOCTOR_OPS_DW_WGRAD_V3_AK=0: one kernel row per thread (no AK);
// =1: all kernel rows per thread (AK) for 3x3 only; =2: AK for 3x3 and every 5x5 launch; unset:
// AK for 3x3, and for 5x5 where its grid fits one wave of resident blocks (see plan_for).
// CUDADOCTOR_OPS_DW_WGRAD_V3_DB=1: two band buffers (DB; default one).
// CUDADOCTOR_OPS_DW_WGRAD_V3_KB=48|64|96|128|192: shared memory for the band buffers (default 96
// with AK, else 48; above 48 the kernel opts in). CUDADOCTOR_OPS_DW_WGRAD_V3_UPB=1..64: at most
// that many units per block (default: as few blocks as one wave of resident blocks needs).
int db_setting() {
  static const int v = env_choice("CUDADOCTOR_OPS_DW_WGRAD_V3_DB", {0, 1}, 0);
  return v;
}
int ak_setting() {
  static const int v = env_choice("CUDADOCTOR_OPS_DW_WGRAD_V3_AK", {0, 1, 2}, -1);
  return v;
}
// 0 when unset (the default by kernel)
size_t smem_setting() {
  static const size_t v =
      static_cast<size_t>(env_choice("CUDADOCTOR_OPS_DW_WGRAD_V3_KB", {48, 64, 96, 128, 192}, 0)) *
      1024;
  return v;
}
int upb_setting() {
  static const int v = env_positive_int("CUDADOCTOR_OPS_DW_WGRAD_V3_UPB", 64);
  return v;
}
// CUDADOCTOR_OPS_DW_WGRAD_V3_IMGS=1..16: images per unit where one band holds a whole image (at
// most what the budget holds); unset: the choice of with_images.
int imgs_setting() {
  static const int v = env_positive_int("CUDADOCTOR_OPS_DW_WGRAD_V3_IMGS", 16);
  return v;
}

// Lets `kern` take more than 48 KB of dynamic shared memory on the current device (the attribute
// is set once per kernel and device, to the device's opt-in limit); false where the device cannot
// give `bytes`.
bool allow_smem(const void* kern, size_t bytes) {
  if (bytes <= 48 * 1024) return true;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int> limit;  // 0: the attribute could not be set
  std::lock_guard<std::mutex> lock(mu);
  auto it = limit.find({kern, dev});
  if (it == limit.end()) {
    int optin = 0;
    if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) !=
            cudaSuccess ||
        cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, optin) !=
            cudaSuccess) {
      (void)cudaGetLastError();
      optin = 0;
    }
    it = limit.emplace(std::make_pair(kern, dev), optin).first;
  }
  return bytes <= static_cast<size_t>(it->second);
}

// AK's column segments per output row: the fewest steps of the slowest slice, a step being one
// output column (plus the K - 1 columns that fill a segment's window), over segments of at least
// K columns.
int ak_segments(int TH, int Wo, int K, int SY) {
  int best = 1, best_cost = -1;
  const int most = Wo / K > 1 ? Wo / K : 1;
  for (int ns = 1; ns <= most; ++ns) {
    const int L = (Wo + ns - 1) / ns;
    const int cost = ((TH * ns + SY - 1) / SY) * (L + K - 1);
    if (best_cost < 0 || cost < best_cost) {
      best_cost = cost;
      best = ns;
    }
  }
  return best;
}

template <typename T, int K, bool DB, bool AK>
const void* kernel_ptr() {
  return reinterpret_cast<const void*>(&wgrad_nhwc_v3<T, K, DB, AK>);
}

template <typename T, int K>
const void* kernel_variant(bool db, bool ak) {
  if constexpr (K == 3 || K == 5) {
    if (ak) return db ? kernel_ptr<T, K, true, true>() : kernel_ptr<T, K, false, true>();
  }
  return db ? kernel_ptr<T, K, true, false>() : kernel_ptr<T, K, false, false>();
}

const void* kernel_for(DType dt, int K, bool db, bool ak) {
#define CDO_DW_V3K(T)                                  \
  if (K == 3) return kernel_variant<T, 3>(db, ak);     \
  if (K == 5) return kernel_variant<T, 5>(db, ak);     \
  if (K == 7) return kernel_variant<T, 7>(db, false);  \
  return nullptr;
  switch (dt) {
    case DType::F16: {
      CDO_DW_V3K(c10::Half)
    }
    case DType::BF16: {
      CDO_DW_V3K(c10::BFloat16)
    }
    default:
      return nullptr;
  }
#undef CDO_DW_V3K
}

struct Plan {
  Geo geo;
  int imgs = 1;  // images per unit (bands == 1 only)
  bool db = false, ak = false;
  int SY = 0, gx = 0, gy = 0;  // SY: slices (blockDim.z)
  int nseg = 1, L = 0;         // column segments per output row, of L columns
  int64_t units = 0;
  const void* kernel = nullptr;
};

// Several images per unit where a band is the whole image (p.geo.bands == 1): by default the
// fewest that put every unit of the launch into one wave of resident blocks, one unit each (so a
// block copies all it needs at once instead of in rounds, each a DRAM round trip), in at most 48
// KB; CUDADOCTOR_OPS_DW_WGRAD_V3_IMGS forces a count (at most what the budget holds). Updates
// p.imgs, p.geo.smem, p.units and `wave` (the residency falls as the blocks' shared memory grows).
// H200, scripts/gpu_variants.py dwv3, 2026-12-01, batch 64, weight gradient alone, us, default
// (4 images) against one: 3x3 (64,960,7,7) float16 20.9 against 22.8, (64,1152,7,7) 23.7 against
// 26.3; 5x5 (64,1152,7,7) 32.7 against 35.3. On 14x14 3x3 planes (30.8 KB a band) 2-3 images in
// 96 KB were slower, (64,480,14,14) float16 33.5 against 25.3, hence the 48 KB.
bool with_images(const FastShape& s, Plan& p, size_t budget, int64_t& wave) {
  const size_t per = band_bytes(p.geo.TH, s.K, p.geo.pitchI, p.geo.pitchG);
  const size_t red = static_cast<size_t>(p.SY) * (s.K * s.K + 1) * kCB * sizeof(float);
  int most =
      static_cast<int>(std::min<size_t>({budget / per, static_cast<size_t>(s.N), size_t(16)}));
  if (most < 1) most = 1;
  const int forced = imgs_setting();
  if (forced == 0 && per * most > 48 * 1024) most = std::max(1, static_cast<int>(48 * 1024 / per));
  const int threads = block_threads(s.K);
  for (int imgs = 1; imgs <= most; ++imgs) {
    if (forced > 0 && imgs != std::min(forced, most)) continue;
    const size_t smem = std::max(per * imgs, red);
    if (!allow_smem(p.kernel, smem)) return false;
    const int64_t w = static_cast<int64_t>(current_sm_count()) *
                      resident_blocks_per_sm(p.kernel, threads, smem);
    const int64_t units = (s.N + imgs - 1) / imgs;
    if (w < 1) break;
    p.imgs = imgs;
    p.geo.smem = smem;
    p.units = units;
    wave = w;
    if (forced > 0 || units * p.gy <= w) break;
  }
  return wave >= 1;
}

// The plan of one kernel variant (ak: all kernel rows per thread): at least one band row within
// the budget, and the grid: at most one wave of resident blocks, as few blocks as give the same
// units (bands) per block. `wave`: the resident blocks of one wave for the plan's shared memory.
bool plan_with(DType dt, const FastShape& s, bool ak, Plan& p, int64_t& wave) {
  p.ak = ak;
  p.SY = p.ak ? s.K * slices(s.K) : slices(s.K);
  p.db = db_setting() == 1;
  const size_t budget = smem_setting() > 0 ? smem_setting() : (p.ak ? 96 : 48) * size_t(1024);
  p.geo = geometry(s, s.K, p.SY, p.db ? 2 : 1, budget);
  if (p.geo.TH < 1 && p.db) {  // not even one row per buffer: one buffer
    p.db = false;
    p.geo = geometry(s, s.K, p.SY, 1, budget);
  }
  if (p.geo.TH < 1) return false;
  // AK's slices take (row, column segment) items; one kernel row per thread: whole rows
  p.nseg = p.ak ? ak_segments(p.geo.TH, s.Wo, s.K, p.SY) : 1;
  p.L = (s.Wo + p.nseg - 1) / p.nseg;
  p.gy = (s.C + kCB - 1) / kCB;
  if (p.gy > 65535) return false;
  p.kernel = kernel_for(dt, s.K, p.db, p.ak);
  if (p.kernel == nullptr || !allow_smem(p.kernel, p.geo.smem)) return false;
  wave = static_cast<int64_t>(current_sm_count()) *
         resident_blocks_per_sm(p.kernel, block_threads(s.K), p.geo.smem);
  p.units = static_cast<int64_t>(s.N) * p.geo.bands;
  if (p.geo.bands == 1 && !p.db && !with_images(s, p, budget, wave)) return false;
  int64_t gxw = (wave + p.gy - 1) / p.gy;
  if (gxw < 1) gxw = 1;
  if (gxw > p.units) gxw = p.units;
  if (upb_setting() > 0) gxw = (p.units + upb_setting() - 1) / upb_setting();
  if (gxw > (int64_t(1) << 30)) return false;
  p.gx = v2::fewest_blocks(p.units, gxw);
  return p.gx >= 1;
}

// Applicability (16-bit, stride 1, K 3/5/7, C % 8 == 0, switch on) and the variant: AK for 3x3
// unless _V3_AK=0; for 5x5 with _V3_AK=2, or by default where the AK plan's blocks fit one wave.
// AK's 5x5 threads take 128 registers (sm_90 build), so two 240-thread blocks per SM: where its
// grid spills into a second, ragged wave, one kernel row per thread (more blocks per SM) is
// faster. H200, scripts/gpu_variants.py dwv5, 2026-12-02, batch 64, float16 / bfloat16, weight
// gradient alone, us, one kernel row per thread against AK: (64,240,28,28) 66.7 / 69.2 against
// 56.1 / 57.9 (AK 256 blocks in a wave of 264), (64,480,14,14) 40.0 / 41.2 against 35.6 / 36.8
// (240 blocks); (64,672,14,14) 53.4 / 54.9 against 59.6 / 61.7 (273), (64,1152,7,7) 32.9 / 33.5
// against 38.4 / 39.6 (288).
bool plan_for(DType dt, const FastShape& s, Plan& p) {
  const int m = mode();
  if (m == 0 || dt == DType::F32 || s.S != 1 || s.C % 8 != 0) return false;
  if (m == 2 && static_cast<int64_t>(s.Ho) * s.Wo > kAutoPlane) return false;
  if (!(s.K == 3 || s.K == 5 || s.K == 7)) return false;
  if (s.N <= 0 || s.H <= 0 || s.W <= 0 || s.Ho <= 0 || s.Wo <= 0) return false;
  if (s.Ho != s.H + 2 * s.PH - s.K + 1 || s.Wo != s.W + 2 * s.PW - s.K + 1) return false;
  const int a = ak_setting();
  int64_t wave = 0;
  if (s.K == 5 && a < 0) {
    Plan q;
    if (plan_with(dt, s, true, q, wave) && static_cast<int64_t>(q.gx) * q.gy <= wave) {
      p = q;
      return true;
    }
    return plan_with(dt, s, false, p, wave);
  }
  return plan_with(dt, s, (s.K == 3 && a != 0) || (s.K == 5 && a == 2), p, wave);
}

int64_t workspace(const FastShape& s, const Plan& p) {
  return static_cast<int64_t>(p.gx) * (static_cast<int64_t>(s.K) * s.K + 1) * s.C;
}

template <typename T, int K, bool DB, bool AK>
void launch_stage1(const void* go, const void* in, float* ws, const FastShape& s, const Plan& p,
                   cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.gx), static_cast<unsigned>(p.gy));
  const dim3 block(kPairs, AK ? 1 : K, p.SY);
  wgrad_nhwc_v3<T, K, DB, AK><<<grid, block, p.geo.smem, stream>>>(
      static_cast<const T*>(go), static_cast<const T*>(in), ws, s.N, s.C, s.H, s.W, s.Ho, s.Wo,
      s.PH, s.PW, p.geo.Wp, p.geo.pitchI, p.geo.pitchG, p.geo.TH, p.geo.bands, p.imgs, p.nseg, p.L,
      p.units);
}

template <typename T, int K>
void run(const void* go, const void* in, void* gw, void* gb, float* ws, const FastShape& s,
         const Plan& p, cudaStream_t stream) {
  bool done = false;
  if constexpr (K == 3 || K == 5) {
    if (p.ak) {
      (p.db ? launch_stage1<T, K, true, true> : launch_stage1<T, K, false, true>)(go, in, ws, s, p,
                                                                                  stream);
      done = true;
    }
  }
  if (!done)
    (p.db ? launch_stage1<T, K, true, false> : launch_stage1<T, K, false, false>)(go, in, ws, s, p,
                                                                                  stream);
  v2::launch_finish_v2<T>(ws, gw, gb, s.C, p.gx, K * K, stream);
}

bool dispatch(DType dt, const void* go, const void* in, void* gw, void* gb, float* ws,
              const FastShape& s, const Plan& p, cudaStream_t stream) {
#define CDO_DW_V3(T)                                                   \
  if (s.K == 3) { run<T, 3>(go, in, gw, gb, ws, s, p, stream); return true; } \
  if (s.K == 5) { run<T, 5>(go, in, gw, gb, ws, s, p, stream); return true; } \
  if (s.K == 7) { run<T, 7>(go, in, gw, gb, ws, s, p, stream); return true; } \
  return false;
  switch (dt) {
    case DType::F16: {
      CDO_DW_V3(c10::Half)
    }
    case DType::BF16: {
      CDO_DW_V3(c10::BFloat16)
    }
    default:
      return false;
  }
#undef CDO_DW_V3
}

}  // namespace v3

// CUDADOCTOR_OPS_DW_WGRAD_V1=1 (read once): the channels_last weight gradient
// runs the first-generation kernels.
bool wgrad_v1_forced() {
  static const bool v = [] {
    const char* e = std::getenv("CUDADOCTOR_OPS_DW_WGRAD_V1");
    return e != nullptr && e[0] != '\0' && e[0] != '0';
  }();
  return v;
}

}  // namespace

// Channels_last: the larger of the v2 and v1 needs where both apply by shape,
// so the launch may still fall back to v1 when a pointer is not aligned for v2.
int64_t wgrad_workspace(DType dt, bool channels_last, const FastShape& s) {
  if (!supported(s)) return 0;
  const int64_t taps = static_cast<int64_t>(s.K) * s.K + 1;
  if (!channels_last) {
    return static_cast<int64_t>(s.C) * plan_nchw(s).P * taps;
  }
  int64_t need = 0;
  v2::Plan p;
  if (!wgrad_v1_forced() && v2::plan_for(dt, s, p)) need = v2::workspace(s, p);
  v3::Plan p3;
  if (!wgrad_v1_forced() && v3::plan_for(dt, s, p3) && v3::workspace(s, p3) > need)
    need = v3::workspace(s, p3);
  const int V = vec_for(dt, s.K);
  if (s.C % V == 0) {
    const int64_t v1 = static_cast<int64_t>(s.C) * plan_nhwc(s, V).gx * taps;
    if (v1 > need) need = v1;
  }
  return need;
}

bool launch_wgrad(DType dt, bool channels_last, const void* go, const void* in,
                  void* gw, void* gb, float* ws, const FastShape& s,
                  cudaStream_t stream) {
  if (wgrad_workspace(dt, channels_last, s) == 0) return false;
  if (channels_last && !wgrad_v1_forced()) {
    v3::Plan p3;
    if (v3::plan_for(dt, s, p3) && !(reinterpret_cast<uintptr_t>(go) & 15u) &&
        !(reinterpret_cast<uintptr_t>(in) & 15u))
      return v3::dispatch(dt, go, in, gw, gb, ws, s, p3, stream);
    v2::Plan p;
    const uintptr_t mask = static_cast<uintptr_t>(v2::vec_v2(dt, s.K) * (dt == DType::F32 ? 4 : 2) - 1);
    if (v2::plan_for(dt, s, p) && !(reinterpret_cast<uintptr_t>(go) & mask) &&
        !(reinterpret_cast<uintptr_t>(in) & mask)) {
      switch (dt) {
        case DType::F32:
          return v2::dispatch<float>(dt, go, in, gw, gb, ws, s, p, stream);
        case DType::F16:
          return v2::dispatch<c10::Half>(dt, go, in, gw, gb, ws, s, p, stream);
        case DType::BF16:
          return v2::dispatch<c10::BFloat16>(dt, go, in, gw, gb, ws, s, p, stream);
      }
    }
  }
  if (channels_last) {
    const int V = vec_for(dt, s.K);
    if (s.C % V != 0) return false;
    const uintptr_t mask = static_cast<uintptr_t>(V * (dt == DType::F32 ? 4 : 2) - 1);
    if ((reinterpret_cast<uintptr_t>(go) & mask) || (reinterpret_cast<uintptr_t>(in) & mask))
      return false;
  }
  switch (dt) {
    case DType::F32:
      return dispatch_ks<float>(channels_last, go, in, gw, gb, ws, s, stream);
    case DType::F16:
      return dispatch_ks<c10::Half>(channels_last, go, in, gw, gb, ws, s, stream);
    case DType::BF16:
      return dispatch_ks<c10::BFloat16>(channels_last, go, in, gw, gb, ws, s, stream);
  }
  return false;
}

}  // namespace depthwise
}  // namespace cudadoctor_ops
