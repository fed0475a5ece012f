// Depthwise 2-D convolution, fast weight (and bias) gradient.
//
//   dW[c][kh][kw] = sum_{n,oy,ox} dY[n,c,oy,ox] * X[n,c,oy*S-p+kh,ox*S-p+kw]
//   dB[c]         = sum_{n,oy,ox} dY[n,c,oy,ox]
//
// Two deterministic stages: stage 1 splits each channel's reduction over many
// blocks, each writing K*K+1 float partial sums into a workspace laid out as
// [C][P][K*K+1]; stage 2 sums the P partials of each (channel, tap) in a fixed
// order. No atomics, so results are bit-reproducible run to run.
#include "depthwise.cuh"

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

}  // namespace

int64_t wgrad_workspace(DType dt, bool channels_last, const FastShape& s) {
  if (!supported(s)) return 0;
  const int64_t taps = static_cast<int64_t>(s.K) * s.K + 1;
  if (!channels_last) {
    return static_cast<int64_t>(s.C) * plan_nchw(s).P * taps;
  }
  const int V = vec_for(dt, s.K);
  if (s.C % V != 0) return 0;
  return static_cast<int64_t>(s.C) * plan_nhwc(s, V).gx * taps;
}

bool launch_wgrad(DType dt, bool channels_last, const void* go, const void* in,
                  void* gw, void* gb, float* ws, const FastShape& s,
                  cudaStream_t stream) {
  if (wgrad_workspace(dt, channels_last, s) == 0) return false;
  if (channels_last) {
    const int V = vec_for(dt, s.K);
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
