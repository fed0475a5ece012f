// Depthwise 2-D convolution, fast forward kernels (multiplier 1, square
// K in {3,5,7}, stride 1 or 2, dilation 1). With flip=true and stride 1 the
// same kernels compute the input gradient: dX = conv(dY, rot180(w), pad K-1-p).
#include "depthwise.cuh"

namespace cudadoctor_ops {
namespace depthwise {
namespace {

constexpr int kThreads = 256;

// NCHW tiled kernel.
//   in   [N*C planes][H][W]       (contiguous)
//   w    [C][K][K]                (contiguous)
//   bias [C] or null
//   out  [N*C planes][Ho][Wo]     (contiguous)
// One block computes an output tile of TW = blockDim.x columns by
// TH = blockDim.y * R rows of one plane. The input tile plus halo,
// ((TH-1)*S+K) x ((TW-1)*S+K), is staged in shared memory as float (zero
// outside the image); each thread then computes R vertically adjacent outputs
// of one column, reusing each shared-memory row it reads across the R rows
// (register blocking). Consecutive threads own consecutive columns, so shared
// reads are conflict-free at stride 1 and global stores coalesce.
template <typename T, int K, int S, int R>
__global__ void __launch_bounds__(kThreads)
    fwd_nchw_tiled(const T* __restrict__ in, const T* __restrict__ w,
                   const T* __restrict__ bias, T* __restrict__ out, int C,
                   int H, int W, int Ho, int Wo, int PH, int PW, int tilesX,
                   int tilesY, bool flip) {
  extern __shared__ float tile[];
  const int BX = blockDim.x;
  const int BY = blockDim.y;
  const int TW = BX;
  const int TH = BY * R;
  const int IW = (TW - 1) * S + K;
  const int IH = (TH - 1) * S + K;

  int64_t b = blockIdx.x;
  const int tx_tile = static_cast<int>(b % tilesX);
  b /= tilesX;
  const int ty_tile = static_cast<int>(b % tilesY);
  const int64_t plane = b / tilesY;
  const int c = static_cast<int>(plane % C);

  const int ox0 = tx_tile * TW;
  const int oy0 = ty_tile * TH;
  const int ix0 = ox0 * S - PW;
  const int iy0 = oy0 * S - PH;
  const T* ip = in + plane * static_cast<int64_t>(H) * W;

  // Stage the tile: U independent loads in flight per thread before the
  // shared-memory stores (a load-store loop would wait on each load in turn).
  {
    constexpr int U = 8;
    const int nthr = BX * BY;
    const int total = IH * IW;
    for (int base = threadIdx.y * BX + threadIdx.x; base < total; base += U * nthr) {
      float v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = base + u * nthr;
        const int r = i / IW;
        const int iy = iy0 + r;
        const int ix = ix0 + (i - r * IW);
        // Unconditional load from a clamped address, then a select: no
        // branch, so all U loads issue back to back.
        const bool ok = i < total && iy >= 0 && iy < H && ix >= 0 && ix < W;
        const int iyc = min(max(iy, 0), H - 1);
        const int ixc = min(max(ix, 0), W - 1);
        const float x = ldg_float(ip + static_cast<int64_t>(iyc) * W + ixc);
        v[u] = ok ? x : 0.f;
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = base + u * nthr;
        if (i < total) tile[i] = v[u];
      }
    }
  }

  float wr[K * K];
  const T* wp = w + static_cast<int64_t>(c) * K * K;
#pragma unroll
  for (int t = 0; t < K * K; ++t) wr[t] = to_float(wp[flip ? K * K - 1 - t : t]);
  const float bv = bias != nullptr ? to_float(bias[c]) : 0.f;
  __syncthreads();

  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = bv;

  const float* sp = tile + (threadIdx.y * R * S) * IW + threadIdx.x * S;
#pragma unroll
  for (int ir = 0; ir < (R - 1) * S + K; ++ir) {
    float row[K];
#pragma unroll
    for (int kw = 0; kw < K; ++kw) row[kw] = sp[ir * IW + kw];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int kh = ir - r * S;
      if (kh >= 0 && kh < K) {
#pragma unroll
        for (int kw = 0; kw < K; ++kw) acc[r] = fmaf(row[kw], wr[kh * K + kw], acc[r]);
      }
    }
  }

  const int ox = ox0 + threadIdx.x;
  if (ox < Wo) {
    T* op = out + plane * static_cast<int64_t>(Ho) * Wo + ox;
    const int oyb = oy0 + threadIdx.y * R;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int oy = oyb + r;
      if (oy < Ho) op[static_cast<int64_t>(oy) * Wo] = from_float<T>(acc[r]);
    }
  }
}

// NHWC (channels_last) kernel.
//   in   [N][H][W][C]   out [N][Ho][Wo][C]   w [C][K][K]   bias [C] or null
// Threads: x = a vector of V = 4 channels (vector loads/stores), y = a group of
// RW horizontally adjacent outputs of one output row. Each input vector loaded
// for a row is reused by every output of the group it touches (register
// blocking along W). The block's K*K weights for its TX*V channels are staged
// transposed in shared memory ([tap][channel]) so a thread reads its V
// weights of one tap as contiguous floats.
template <typename T, int K, int S, int V, int RW>
__global__ void __launch_bounds__(kThreads, 3)
    fwd_nhwc(const T* __restrict__ in, const T* __restrict__ w,
             const T* __restrict__ bias, T* __restrict__ out, int C, int H,
             int W, int Ho, int Wo, int PH, int PW, int groupsW,
             int64_t total_groups, bool flip) {
  extern __shared__ float sw[];  // [K*K][TXC] weights, then [TXC] bias
  const int TXC = blockDim.x * V;
  const int c0 = blockIdx.y * TXC;
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  const int nthr = blockDim.x * blockDim.y;
  for (int i = tid; i < TXC * K * K; i += nthr) {
    const int cl = i / (K * K);
    const int t = i - cl * (K * K);
    const int cc = c0 + cl;
    float v = 0.f;
    if (cc < C) v = to_float(w[static_cast<int64_t>(cc) * K * K + (flip ? K * K - 1 - t : t)]);
    sw[t * TXC + cl] = v;
  }
  float* sb = sw + K * K * TXC;
  for (int i = tid; i < TXC; i += nthr) {
    const int cc = c0 + i;
    sb[i] = (bias != nullptr && cc < C) ? to_float(bias[cc]) : 0.f;
  }
  __syncthreads();

  const int cl = threadIdx.x * V;
  const int c = c0 + cl;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (c >= C || g >= total_groups) return;
  const int gx = static_cast<int>(g % groupsW);
  const int64_t t2 = g / groupsW;
  const int oy = static_cast<int>(t2 % Ho);
  const int64_t n = t2 / Ho;
  const int ox0 = gx * RW;

  float acc[RW][V];
#pragma unroll
  for (int r = 0; r < RW; ++r)
#pragma unroll
    for (int e = 0; e < V; ++e) acc[r][e] = sb[cl + e];

  const int64_t rowstride = static_cast<int64_t>(W) * C;
  const T* ip = in + n * H * rowstride + c;
  constexpr int NCOL = (RW - 1) * S + K;
  const int ixb = ox0 * S - PW;

#pragma unroll
  for (int kh = 0; kh < K; ++kh) {
    const int iy = oy * S - PH + kh;
    // Out-of-range rows predicate the loads instead of branching, so the
    // compiler can issue the loads of several rows ahead of their FMAs.
    const bool rok = iy >= 0 && iy < H;
    float wk[K][V];
#pragma unroll
    for (int kw = 0; kw < K; ++kw)
#pragma unroll
      for (int e = 0; e < V; ++e) wk[kw][e] = sw[(kh * K + kw) * TXC + cl + e];
    const T* rp = ip + min(max(iy, 0), H - 1) * rowstride;
#pragma unroll
    for (int j = 0; j < NCOL; ++j) {
      const int ix = ixb + j;
      // Clamped address + select (no branch): the loads of all rows can be
      // issued ahead of their FMAs.
      const bool ok = rok && ix >= 0 && ix < W;
      float v[V];
      load_vec<T, V>(rp + static_cast<int64_t>(min(max(ix, 0), W - 1)) * C, v);
#pragma unroll
      for (int e = 0; e < V; ++e) v[e] = ok ? v[e] : 0.f;
#pragma unroll
      for (int r = 0; r < RW; ++r) {
        const int kw = j - r * S;
        if (kw >= 0 && kw < K) {
#pragma unroll
          for (int e = 0; e < V; ++e) acc[r][e] = fmaf(v[e], wk[kw][e], acc[r][e]);
        }
      }
    }
  }

  T* op = out + (n * Ho + oy) * static_cast<int64_t>(Wo) * C + c;
#pragma unroll
  for (int r = 0; r < RW; ++r) {
    const int ox = ox0 + r;
    if (ox < Wo) store_vec<T, V>(op + static_cast<int64_t>(ox) * C, acc[r]);
  }
}

// NHWC input gradient for any stride (used for stride 2; stride 1 runs the
// forward kernel on rot180(w)).
//   gout [N][Ho][Wo][C]   w [C][K][K]   gin [N][H][W][C]
// One thread = one input pixel x V channels. It gathers the taps whose output
// position lands on the stride grid: (iy + PH - kh) % S == 0, likewise for W.
// All taps are unrolled with predicated loads, so the few valid loads of a
// pixel are in flight together. Weights staged as [tap][channel] floats.
template <typename T, int K, int S, int V>
__global__ void __launch_bounds__(kThreads)
    bwd_input_nhwc(const T* __restrict__ go, const T* __restrict__ w,
                   T* __restrict__ gin, int C, int H, int W, int Ho, int Wo,
                   int PH, int PW, int64_t total_pix) {
  extern __shared__ float sw[];  // [K*K][TXC]
  const int TXC = blockDim.x * V;
  const int c0 = blockIdx.y * TXC;
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  const int nthr = blockDim.x * blockDim.y;
  for (int i = tid; i < TXC * K * K; i += nthr) {
    const int cl = i / (K * K);
    const int t = i - cl * (K * K);
    const int cc = c0 + cl;
    sw[t * TXC + cl] = cc < C ? to_float(w[static_cast<int64_t>(cc) * K * K + t]) : 0.f;
  }
  __syncthreads();

  const int cl = threadIdx.x * V;
  const int c = c0 + cl;
  const int64_t pix = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (c >= C || pix >= total_pix) return;
  const int ix = static_cast<int>(pix % W);
  const int64_t t2 = pix / W;
  const int iy = static_cast<int>(t2 % H);
  const int64_t n = t2 / H;

  float acc[V];
#pragma unroll
  for (int e = 0; e < V; ++e) acc[e] = 0.f;
  const T* gp = go + n * Ho * static_cast<int64_t>(Wo) * C + c;
#pragma unroll
  for (int kh = 0; kh < K; ++kh) {
    const int ty = iy + PH - kh;
    const bool hok = ty >= 0 && (ty % S) == 0 && ty / S < Ho;
    const int oy = hok ? ty / S : 0;
#pragma unroll
    for (int kw = 0; kw < K; ++kw) {
      const int tx = ix + PW - kw;
      const bool ok = hok && tx >= 0 && (tx % S) == 0 && tx / S < Wo;
      if (ok) {
        float v[V];
        load_vec<T, V>(gp + (static_cast<int64_t>(oy) * Wo + tx / S) * C, v);
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] = fmaf(v[e], sw[(kh * K + kw) * TXC + cl + e], acc[e]);
      }
    }
  }
  store_vec<T, V>(gin + pix * C + c, acc);
}

// Channel vectors per block: at most `cap`, split evenly over the channel
// blocks so the last block is not mostly idle (e.g. 36 -> 2 x 18, not 32 + 4).
int balanced_tx(int cv, int cap) {
  const int nb = (cv + cap - 1) / cap;
  return (cv + nb - 1) / nb;
}

int pick_bx(int wo) { return wo > 96 ? 128 : (wo > 48 ? 64 : 32); }

template <typename T, int K, int S, int R>
void run_nchw(const void* in, const void* w, const void* bias, void* out,
              const FastShape& s, bool flip, cudaStream_t stream) {
  const int BX = pick_bx(s.Wo);
  int BY = kThreads / BX;
  const int need_rows = (s.Ho + R - 1) / R;
  if (need_rows < BY) BY = need_rows < 1 ? 1 : need_rows;
  const int TH = BY * R;
  const int tilesX = (s.Wo + BX - 1) / BX;
  const int tilesY = (s.Ho + TH - 1) / TH;
  const int64_t blocks = static_cast<int64_t>(tilesX) * tilesY * s.N * s.C;
  const int IW = (BX - 1) * S + K;
  const int IH = (TH - 1) * S + K;
  const size_t smem = static_cast<size_t>(IW) * IH * sizeof(float);
  fwd_nchw_tiled<T, K, S, R><<<static_cast<unsigned>(blocks), dim3(BX, BY), smem, stream>>>(
      static_cast<const T*>(in), static_cast<const T*>(w),
      static_cast<const T*>(bias), static_cast<T*>(out), s.C, s.H, s.W, s.Ho,
      s.Wo, s.PH, s.PW, tilesX, tilesY, flip);
}

template <typename T, int K, int S>
void dispatch_r(const void* in, const void* w, const void* bias, void* out,
                const FastShape& s, bool flip, cudaStream_t stream) {
  if (S == 1) {
    // Taller tiles (R=8) halve the halo re-reads; use them only when the grid
    // still has a couple of blocks per SM slot.
    const int64_t tiles8 = static_cast<int64_t>((s.Wo + pick_bx(s.Wo) - 1) / pick_bx(s.Wo)) *
                           ((s.Ho + 15) / 16) * s.N * s.C;
    if (tiles8 >= 2048) {
      run_nchw<T, K, S, 8>(in, w, bias, out, s, flip, stream);
      return;
    }
  }
  run_nchw<T, K, S, 4>(in, w, bias, out, s, flip, stream);
}

template <typename T, int K, int S>
void run_nhwc(const void* in, const void* w, const void* bias, void* out,
              const FastShape& s, bool flip, cudaStream_t stream) {
  constexpr int V = 4;
  constexpr int RW = 4;
  const int CV = s.C / V;
  const int groupsW = (s.Wo + RW - 1) / RW;
  // Fewer channels per block on wide images, so that one block spans at
  // least two output rows: the input rows they share then hit in L1 instead
  // of being fetched again from L2 by another SM.
  int cap = kThreads / (2 * groupsW);
  cap = cap < 4 ? 4 : (cap > 128 / V ? 128 / V : cap);
  const int TX = balanced_tx(CV, cap);
  const int TY = kThreads / TX;
  const int64_t total = static_cast<int64_t>(s.N) * s.Ho * groupsW;
  const int64_t gx = (total + TY - 1) / TY;
  const int gy = (CV + TX - 1) / TX;
  const size_t smem = static_cast<size_t>(K * K + 1) * TX * V * sizeof(float);
  fwd_nhwc<T, K, S, V, RW><<<dim3(static_cast<unsigned>(gx), gy), dim3(TX, TY), smem, stream>>>(
      static_cast<const T*>(in), static_cast<const T*>(w),
      static_cast<const T*>(bias), static_cast<T*>(out), s.C, s.H, s.W, s.Ho,
      s.Wo, s.PH, s.PW, groupsW, total, flip);
}

template <typename T>
bool dispatch_ks(bool nhwc, const void* in, const void* w, const void* bias,
                 void* out, const FastShape& s, bool flip, cudaStream_t stream) {
#define CDO_DW_CASE(KK, SS)                                              \
  if (s.K == KK && s.S == SS) {                                          \
    if (nhwc)                                                            \
      run_nhwc<T, KK, SS>(in, w, bias, out, s, flip, stream);            \
    else                                                                 \
      dispatch_r<T, KK, SS>(in, w, bias, out, s, flip, stream);          \
    return true;                                                         \
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

bool dispatch_type(DType dt, bool nhwc, const void* in, const void* w,
                   const void* bias, void* out, const FastShape& s, bool flip,
                   cudaStream_t stream) {
  switch (dt) {
    case DType::F32:
      return dispatch_ks<float>(nhwc, in, w, bias, out, s, flip, stream);
    case DType::F16:
      return dispatch_ks<c10::Half>(nhwc, in, w, bias, out, s, flip, stream);
    case DType::BF16:
      return dispatch_ks<c10::BFloat16>(nhwc, in, w, bias, out, s, flip, stream);
  }
  return false;
}

template <typename T, int K, int S>
void run_bwd_input_nhwc(const void* go, const void* w, void* gin, const FastShape& s,
                        cudaStream_t stream) {
  constexpr int V = 4;
  const int CV = s.C / V;
  const int TX = balanced_tx(CV, 128 / V);
  const int TY = kThreads / TX;
  const int64_t total = static_cast<int64_t>(s.N) * s.H * s.W;
  const int64_t gx = (total + TY - 1) / TY;
  const int gy = (CV + TX - 1) / TX;
  const size_t smem = static_cast<size_t>(K * K) * TX * V * sizeof(float);
  bwd_input_nhwc<T, K, S, V><<<dim3(static_cast<unsigned>(gx), gy), dim3(TX, TY), smem, stream>>>(
      static_cast<const T*>(go), static_cast<const T*>(w), static_cast<T*>(gin), s.C, s.H, s.W,
      s.Ho, s.Wo, s.PH, s.PW, total);
}

template <typename T>
bool dispatch_bwd_input(const void* go, const void* w, void* gin, const FastShape& s,
                        cudaStream_t stream) {
#define CDO_DW_CASE(KK, SS)                                     \
  if (s.K == KK && s.S == SS) {                                 \
    run_bwd_input_nhwc<T, KK, SS>(go, w, gin, s, stream);       \
    return true;                                                \
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

bool launch_fwd_nchw(DType dt, const void* in, const void* w, const void* bias,
                     void* out, const FastShape& s, bool flip,
                     cudaStream_t stream) {
  if (s.Ho <= 0 || s.Wo <= 0 || s.N <= 0 || s.C <= 0) return false;
  return dispatch_type(dt, false, in, w, bias, out, s, flip, stream);
}

bool launch_fwd_nhwc(DType dt, const void* in, const void* w, const void* bias,
                     void* out, const FastShape& s, bool flip,
                     cudaStream_t stream) {
  if (s.Ho <= 0 || s.Wo <= 0 || s.N <= 0 || s.C <= 0) return false;
  // 4 channels per thread: 16-byte accesses for float32, 8-byte for 16-bit types.
  const uintptr_t mask = dt == DType::F32 ? 15u : 7u;
  if (s.C % 4 != 0 || (reinterpret_cast<uintptr_t>(in) & mask) ||
      (reinterpret_cast<uintptr_t>(out) & mask))
    return false;
  return dispatch_type(dt, true, in, w, bias, out, s, flip, stream);
}

bool launch_bwd_input_nhwc(DType dt, const void* go, const void* w, void* gin,
                           const FastShape& s, cudaStream_t stream) {
  if (s.Ho <= 0 || s.Wo <= 0 || s.N <= 0 || s.C <= 0 || s.H <= 0 || s.W <= 0) return false;
  const uintptr_t mask = dt == DType::F32 ? 15u : 7u;
  if (s.C % 4 != 0 || (reinterpret_cast<uintptr_t>(go) & mask) ||
      (reinterpret_cast<uintptr_t>(gin) & mask))
    return false;
  switch (dt) {
    case DType::F32:
      return dispatch_bwd_input<float>(go, w, gin, s, stream);
    case DType::F16:
      return dispatch_bwd_input<c10::Half>(go, w, gin, s, stream);
    case DType::BF16:
      return dispatch_bwd_input<c10::BFloat16>(go, w, gin, s, stream);
  }
  return false;
}

}  // namespace depthwise
}  // namespace cudadoctor_ops
