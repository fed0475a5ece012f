// Depthwise 2-D convolution, fast forward kernels (multiplier 1, square
// K in {3,5,7}, stride 1 or 2, dilation 1). With flip=true and stride 1 the
// same kernels compute the input gradient: dX = conv(dY, rot180(w), pad K-1-p).
#include <atomic>
#include <cstdlib>
#include <type_traits>

#include "async_copy.cuh"
#include "depthwise.cuh"
#include "env_setting.h"

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

// ---------------------------------------------------------------------------
// Second-generation forward kernels.

constexpr int kSmemLimit = 48 * 1024;  // dynamic shared memory without opt-in

// NCHW forward, v2.
//   in [N*C planes][H][W], w [C][K][K], bias [C] or null, out [N*C planes][Ho][Wo]
// Block = BX x BY threads (BX in {32,16,8}, runtime), output tile of
// TW = BX*RW columns by TH = BY*R rows of one plane. Thread (tx, ty) computes
// columns tx + j*BX (j < RW) of rows ty*R .. ty*R+R-1: consecutive threads
// read consecutive shared-memory words (no bank conflicts at stride 1) and
// store consecutive output columns (coalesced).
//
// Staging: the input rows of the tile, iy0 .. iy0+IH-1, columns from a0 (ix0
// rounded down to a multiple of VE = 16/sizeof(T) elements) in chunks of VE
// elements. With `vec` (W % VE == 0 and a 16-byte aligned base) every chunk is
// either wholly inside the row or wholly outside, so one 16-byte load (or a
// zero) fills it; each thread issues U such loads before it converts and
// stores any of them to shared memory. Without `vec`, element loads.
// Shared memory row pitch SP = chunks * VE floats; column `off` of a row is
// input column ix0.
//
// The divisions of the index arithmetic (block index into tiles and plane, channel of the plane,
// thread index into staging row and chunk) are multiply-high by divisors made on the host
// (V2Div): with one or two waves of blocks (e.g. (1,64,128,128) float32, 512 blocks) the
// instructions before the first load are on the critical path of the whole kernel.
struct V2Div {
  FastDiv tilesX, tilesY, C, nch, sp;  // nch: chunks per staged row, SP / VE
  int dr, dq;                          // (BX * BY) / nch and (BX * BY) % nch
};

// COLV helpers (see fwd_nchw_v2): a thread's input window of one staged tile row, the NV
// 16-byte words at p (16-byte aligned) as 4 * NV floats; and its 4 consecutive outputs of one row
// at o (output column ox of Wo): one 16-byte store where all four are inside the row and o is
// aligned, else one store per column inside the row.
template <int NV>
__device__ __forceinline__ void colv_window(const float* p, float (&v)[4 * NV]) {
#pragma unroll
  for (int m = 0; m < NV; ++m) {
    const float4 q = *reinterpret_cast<const float4*>(p + 4 * m);
    v[4 * m] = q.x;
    v[4 * m + 1] = q.y;
    v[4 * m + 2] = q.z;
    v[4 * m + 3] = q.w;
  }
}

__device__ __forceinline__ void colv_store(float* o, int ox, int Wo, const float (&acc)[4]) {
  if (ox + 3 < Wo && (reinterpret_cast<uintptr_t>(o) & 15u) == 0) {
    *reinterpret_cast<float4*>(o) = make_float4(acc[0], acc[1], acc[2], acc[3]);
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (ox + j < Wo) o[j] = acc[j];
  }
}

// LEAN (with ASYNC, float32 only; CUDADOCTOR_OPS_DW_V2_LEAN=1, launched where the plane has fewer
// than 2^31 elements): fewer instructions before the tile lands. The filter taps load from one
// base at constant offsets and are reversed in registers for `flip` (instead of an address per
// tap per direction), the staging loop walks a 32-bit element offset into the plane and a
// shared-memory pointer by precomputed steps (instead of a 64-bit address rebuilt per chunk), and
// a tile wholly inside the output stores by pointer steps without bounds checks.
// At 0.5 waves ((1,64,128,128), 512 blocks) the kernel is issue-bound: the SASS before the
// barrier is on its critical path.
//
// COLV >= 0 (float32, stride 1, RW = 4, the cp.async staging; default, CUDADOCTOR_OPS_DW_V2_COLV=0
// for without): thread (tx, ty) computes the
// 4 consecutive columns 4 * tx .. 4 * tx + 3 of the tile instead of tx + j * BX. Its input window
// of a tile row, 4 + K - 1 floats starting at tile column 4 * tx + off, is read as
// ceil((off + 4 + K - 1) / 4) 16-byte shared loads (conflict-free: consecutive lanes read
// consecutive 16 bytes) instead of 4 * K scalar loads, and each output row is one 16-byte store
// where aligned. COLV is `off`, fixed by the padding ((-PW) mod 4: the tile starts at a multiple
// of 4 columns), so the window's register indices are compile-time constants. Same sums in the
// same order as the default mapping.

template <typename T, int K, int S, int R, int RW, bool ASYNC = false, bool LEAN = false,
          int COLV = -1>
__global__ void __launch_bounds__(kThreads)
    fwd_nchw_v2(const T* __restrict__ in, const T* __restrict__ w,
                const T* __restrict__ bias, T* __restrict__ out, int H,
                int W, int Ho, int Wo, int PH, int PW, V2Div dv,
                int SP, bool vec, bool flip) {
  constexpr int VE = 16 / static_cast<int>(sizeof(T));
  extern __shared__ float4 smem_v2[];
  float* tile = reinterpret_cast<float*>(smem_v2);
  const int BX = blockDim.x;
  const int BY = blockDim.y;
  const int TW = BX * RW;
  const int TH = BY * R;
  const int IH = (TH - 1) * S + K;
  const int NCH = static_cast<int>(dv.nch.d);

  // blockIdx.x = (plane * tilesY + ty_tile) * tilesX + tx_tile (the grid has < 2^31 blocks)
  const unsigned b = blockIdx.x;
  const unsigned b1 = fdiv(b, dv.tilesX);
  const int tx_tile = static_cast<int>(b - b1 * dv.tilesX.d);
  const unsigned pl = fdiv(b1, dv.tilesY);
  const int ty_tile = static_cast<int>(b1 - pl * dv.tilesY.d);
  const int64_t plane = pl;
  const int c = static_cast<int>(pl - fdiv(pl, dv.C) * dv.C.d);

  const int ox0 = tx_tile * TW;
  const int oy0 = ty_tile * TH;
  const int ix0 = ox0 * S - PW;
  const int iy0 = oy0 * S - PH;
  const int a0 = ix0 >= 0 ? (ix0 / VE) * VE : -(((-ix0) + VE - 1) / VE) * VE;
  const int off = ix0 - a0;  // 0 .. VE-1
  const T* ip = in + plane * static_cast<int64_t>(H) * W;
  const int tid = threadIdx.y * BX + threadIdx.x;
  const int nthr = BX * BY;

  // The filter (and bias) first, for 3x3: their loads are in flight with the tile's instead of a
  // second round trip after it. Larger filters load them after the tile: 25 or 49 more registers
  // live across the staging cost float16 5x5 a resident block per SM (ptxas, sm_90: 97 instead
  // of 76 registers).
  float wr[K * K];
  const T* wp = w + static_cast<int64_t>(c) * K * K;
  float bv = 0.f;
  constexpr bool kLean = ASYNC && LEAN && std::is_same<T, float>::value;
  // the filter taps (and bias); LEAN: taps at constant offsets from wp, reversed in registers
  // for flip
  auto load_filter = [&]() {
    if constexpr (kLean) {
#pragma unroll
      for (int t = 0; t < K * K; ++t) wr[t] = to_float(wp[t]);
      if (flip) {
#pragma unroll
        for (int t = 0; t < K * K / 2; ++t) {
          const float u = wr[t];
          wr[t] = wr[K * K - 1 - t];
          wr[K * K - 1 - t] = u;
        }
      }
    } else {
#pragma unroll
      for (int t = 0; t < K * K; ++t) wr[t] = to_float(wp[flip ? K * K - 1 - t : t]);
    }
    if (bias != nullptr) bv = to_float(bias[c]);
  };
  if constexpr (K <= 3) load_filter();

  // The cp.async staging (ASYNC, aligned float32 rows): chunks i0 .. i1 - 1 of the tile (chunk
  // i = tile row * NCH + chunk of the row) copied to shared memory as they are, zeros where a
  // chunk lies outside the image, then one commit: every chunk of the thread in flight at once,
  // no registers held. (The register path below issues U loads per round but ptxas (sm_90, 32
  // registers) stores each chunk before it issues the next load: one DRAM round trip per chunk.)
  const auto stage_async = [&](int i0, int i1) {
    const int first = i0 + tid;
    int r = static_cast<int>(fdiv(first, dv.nch));
    int q = first - r * NCH;
    for (int i = first; i < i1; i += nthr) {
      const int iy = iy0 + r;
      const int ix = a0 + q * VE;
      const bool ok = iy >= 0 && iy < H && ix >= 0 && ix < W;
      const T* src = ok ? ip + static_cast<int64_t>(iy) * W + ix : ip;
      cp_async16_zfill(reinterpret_cast<uint4*>(tile) + i, src, ok);
      q += dv.dq;
      r += dv.dr;
      if (q >= NCH) {
        q -= NCH;
        ++r;
      }
    }
    cp_async_commit();
  };

  bool staged = false;
  if constexpr (kLean) {
    if (vec) {
      // chunk i = tid + k * nthr is tile row r, chunk q (i = r * NCH + q): input row iy0 + r,
      // columns a0 + q * VE .. + VE - 1, element offset e = iy * W + ix in the plane, kept modulo
      // 2^32 (exact wherever the chunk is inside the image: the launcher's condition is a plane of
      // fewer than 2^32 elements); (r, q, e) advance by (dr, dq, dr * W + dq * VE) per step, one
      // row more when q wraps.
      const int total = IH * NCH;
      int r = static_cast<int>(fdiv(tid, dv.nch));
      int q = tid - r * NCH;
      int iy = iy0 + r;
      int ix = a0 + q * VE;
      uint32_t e = static_cast<uint32_t>(iy) * static_cast<uint32_t>(W) + static_cast<uint32_t>(ix);
      const uint32_t de =
          static_cast<uint32_t>(dv.dr) * static_cast<uint32_t>(W) + static_cast<uint32_t>(dv.dq * VE);
      const int wrap_x = NCH * VE;
      const uint32_t wrap_e = static_cast<uint32_t>(W) - static_cast<uint32_t>(NCH * VE);
      uint4* dst = reinterpret_cast<uint4*>(tile) + tid;
      for (int i = tid; i < total; i += nthr) {
        const bool ok = static_cast<unsigned>(iy) < static_cast<unsigned>(H) &&
                        static_cast<unsigned>(ix) < static_cast<unsigned>(W);
        cp_async16_zfill(dst, ip + (ok ? e : 0u), ok);
        dst += nthr;
        q += dv.dq;
        iy += dv.dr;
        ix += dv.dq * VE;
        e += de;
        if (q >= NCH) {
          q -= NCH;
          ++iy;
          ix -= wrap_x;
          e += wrap_e;
        }
      }
      cp_async_commit();  // waited for below, after the 5x5 / 7x7 filter loads
      staged = true;
    }
  } else if constexpr (ASYNC && std::is_same<T, float>::value) {
    if (vec) {
      stage_async(0, IH * NCH);  // waited for below, after the 5x5 / 7x7 filter loads
      staged = true;
    }
  }
  if (staged) {
    // the copies are in flight (waited for before the barrier below)
  } else if (vec) {
    constexpr int U = 8;
    const int total = IH * NCH;
    // chunk i is tile row r = i / NCH, chunk q = i % NCH, and starts at tile + i * VE (SP =
    // NCH * VE); (r, q) advance by (dr, dq) per nthr chunks, without a division per chunk
    const int dr = dv.dr;
    const int dq = dv.dq;
    int r = static_cast<int>(fdiv(tid, dv.nch));
    int q = tid - r * NCH;
    for (int base = tid; base < total; base += U * nthr) {
      uint4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = base + u * nthr;
        const int iy = iy0 + r;
        const int ix = a0 + q * VE;
        const bool ok = i < total && iy >= 0 && iy < H && ix >= 0 && ix < W;
        v[u] = make_uint4(0u, 0u, 0u, 0u);
        if (ok) v[u] = __ldg(reinterpret_cast<const uint4*>(ip + static_cast<int64_t>(iy) * W + ix));
        q += dq;
        r += dr;
        if (q >= NCH) {
          q -= NCH;
          ++r;
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = base + u * nthr;
        if (i < total) {
          T e[VE];
          memcpy(e, &v[u], 16);
          float f[VE];
#pragma unroll
          for (int k = 0; k < VE; ++k) f[k] = static_cast<float>(e[k]);
          float4* dst = reinterpret_cast<float4*>(tile + static_cast<int64_t>(i) * VE);
#pragma unroll
          for (int k = 0; k < VE / 4; ++k)
            dst[k] = make_float4(f[4 * k], f[4 * k + 1], f[4 * k + 2], f[4 * k + 3]);
        }
      }
    }
  } else {
    constexpr int U = 8;
    const int total = IH * SP;
    for (int base = tid; base < total; base += U * nthr) {
      float v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = base + u * nthr;
        const int r = static_cast<int>(fdiv(i, dv.sp));
        const int iy = iy0 + r;
        const int ix = a0 + (i - r * SP);
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

  if constexpr (K > 3) load_filter();
  if (staged) cp_async_wait_group<0>();  // this thread's copies; the barrier publishes all
  __syncthreads();

  float acc[R][RW];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < RW; ++j) acc[r][j] = bv;

  if constexpr (COLV >= 0) {
    static_assert(S == 1 && RW == 4 && COLV < 4 && std::is_same<T, float>::value,
                  "COLV: float32, stride 1, 4 columns per thread");
    constexpr int NV = (COLV + RW + K - 1 + 3) / 4;  // 16-byte loads per tile row
    // SP % 4 == 0: every thread's window starts 16-byte aligned; the launcher checks that the
    // last thread's NV loads stay inside the row (4 * (BX - 1) + 4 * NV <= SP)
    const float* sq = tile + threadIdx.y * R * SP + 4 * threadIdx.x;
#pragma unroll
    for (int ir = 0; ir < R - 1 + K; ++ir) {
      float v[4 * NV];
      colv_window<NV>(sq + ir * SP, v);
#pragma unroll
      for (int j = 0; j < RW; ++j) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const int kh = ir - r;
          if (kh >= 0 && kh < K) {
#pragma unroll
            for (int kw = 0; kw < K; ++kw)
              acc[r][j] = fmaf(v[COLV + j + kw], wr[kh * K + kw], acc[r][j]);
          }
        }
      }
    }
    T* op = out + plane * static_cast<int64_t>(Ho) * Wo;
    const int oyb = oy0 + threadIdx.y * R;
    const int oxs = ox0 + 4 * threadIdx.x;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int oy = oyb + r;
      if (oy < Ho) colv_store(op + static_cast<int64_t>(oy) * Wo + oxs, oxs, Wo, acc[r]);
    }
    return;
  }

  const float* sp = tile + (threadIdx.y * R * S) * SP + off + threadIdx.x * S;
  const int colstep = BX * S;
#pragma unroll
  for (int ir = 0; ir < (R - 1) * S + K; ++ir) {
#pragma unroll
    for (int j = 0; j < RW; ++j) {
      float row[K];
#pragma unroll
      for (int kw = 0; kw < K; ++kw) row[kw] = sp[ir * SP + j * colstep + kw];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int kh = ir - r * S;
        if (kh >= 0 && kh < K) {
#pragma unroll
          for (int kw = 0; kw < K; ++kw) acc[r][j] = fmaf(row[kw], wr[kh * K + kw], acc[r][j]);
        }
      }
    }
  }

  T* op = out + plane * static_cast<int64_t>(Ho) * Wo;
  const int oyb = oy0 + threadIdx.y * R;
  if constexpr (kLean) {
    // a tile wholly inside the output (block-uniform): stores by pointer steps, no bounds checks
    if (oy0 + TH <= Ho && ox0 + TW <= Wo) {
      T* orow = op + static_cast<int64_t>(oyb) * Wo + ox0 + threadIdx.x;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        T* oc = orow;
#pragma unroll
        for (int j = 0; j < RW; ++j) {
          *oc = from_float<T>(acc[r][j]);
          oc += BX;
        }
        orow += Wo;
      }
      return;
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int oy = oyb + r;
    if (oy < Ho) {
#pragma unroll
      for (int j = 0; j < RW; ++j) {
        const int ox = ox0 + threadIdx.x + j * BX;
        if (ox < Wo) op[static_cast<int64_t>(oy) * Wo + ox] = from_float<T>(acc[r][j]);
      }
    }
  }
}

// NHWC (channels_last) forward, v2.
//   in [N][H][W][C], out [N][Ho][Wo][C], w [C][K][K], bias [C] or null
// Threads: x = a vector of V = 16/sizeof(T) channels (16-byte loads and
// stores), y = a group of RW horizontally adjacent outputs of one output row.
// Per kernel row the thread loads the NCOL = (RW-1)*S+K input vectors the
// group needs (each reused by every output of the group it touches); the
// next row's vectors are loaded before the current row's FMAs, so up to two
// rows of 16-byte loads are in flight per thread. Weights for the block's channels are staged in shared
// memory as [tap][channel] floats.
template <typename T, int K, int S, int RW>
__global__ void __launch_bounds__(kThreads, 2)
    fwd_nhwc_v2(const T* __restrict__ in, const T* __restrict__ w,
                const T* __restrict__ bias, T* __restrict__ out, int C, int H,
                int W, int Ho, int Wo, int PH, int PW, int groupsW,
                int64_t total_groups, bool flip) {
  constexpr int V = 16 / static_cast<int>(sizeof(T));
  constexpr int NCOL = (RW - 1) * S + K;
  extern __shared__ float4 smem_v2[];
  float* sw = reinterpret_cast<float*>(smem_v2);  // [K*K][TXC], then [TXC] bias
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
  const int ixb = ox0 * S - PW;
  const int iyb = oy * S - PH;

  // Loads of kernel row kh (zero outside the image and for kh >= K).
  auto load_row = [&](int kh, uint4 (&dst)[NCOL]) {
    const int iy = iyb + kh;
    const bool rok = kh < K && iy >= 0 && iy < H;
    const T* rp = ip + min(max(iy, 0), H - 1) * rowstride;
#pragma unroll
    for (int j = 0; j < NCOL; ++j) {
      const int ix = ixb + j;
      dst[j] = make_uint4(0u, 0u, 0u, 0u);
      if (rok && ix >= 0 && ix < W)
        dst[j] = __ldg(reinterpret_cast<const uint4*>(rp + static_cast<int64_t>(ix) * C));
    }
  };
  // Software pipeline over kernel rows: row kh+1 is loaded before row kh's
  // FMAs. The loop is deliberately not unrolled, so that the compiler cannot
  // hoist every row's loads (K*NCOL vectors would not fit in registers).
  uint4 cur[NCOL];
  load_row(0, cur);
#pragma unroll 1
  for (int kh = 0; kh < K; ++kh) {
    uint4 nxt[NCOL];
    load_row(kh + 1, nxt);
#pragma unroll
    for (int j = 0; j < NCOL; ++j) {
      T e[V];
      memcpy(e, &cur[j], 16);
      float v[V];
#pragma unroll
      for (int k = 0; k < V; ++k) v[k] = static_cast<float>(e[k]);
#pragma unroll
      for (int r = 0; r < RW; ++r) {
        const int kw = j - r * S;
        if (kw >= 0 && kw < K) {
          const float4* wv = reinterpret_cast<const float4*>(sw + (kh * K + kw) * TXC + cl);
#pragma unroll
          for (int q = 0; q < V / 4; ++q) {
            const float4 w4 = wv[q];
            acc[r][4 * q + 0] = fmaf(v[4 * q + 0], w4.x, acc[r][4 * q + 0]);
            acc[r][4 * q + 1] = fmaf(v[4 * q + 1], w4.y, acc[r][4 * q + 1]);
            acc[r][4 * q + 2] = fmaf(v[4 * q + 2], w4.z, acc[r][4 * q + 2]);
            acc[r][4 * q + 3] = fmaf(v[4 * q + 3], w4.w, acc[r][4 * q + 3]);
          }
        }
      }
    }
#pragma unroll
    for (int j = 0; j < NCOL; ++j) cur[j] = nxt[j];
  }

  T* op = out + (n * Ho + oy) * static_cast<int64_t>(Wo) * C + c;
#pragma unroll
  for (int r = 0; r < RW; ++r) {
    const int ox = ox0 + r;
    if (ox < Wo) store_vec<T, V>(op + static_cast<int64_t>(ox) * C, acc[r]);
  }
}

// fwd_nchw_v2 stages float32 tiles with cp.async (see the kernel); CUDADOCTOR_OPS_DW_V2_ASYNC=0
// keeps the register staging (read once). H200, fp32 NCHW 3x3 and 5x5 forward: 4 to 10% faster
// on the five target shapes at the same tile plan.
bool nchw_v2_async_enabled() {
  static const bool on = env_switch("CUDADOCTOR_OPS_DW_V2_ASYNC") != 0;
  return on;
}

// CUDADOCTOR_OPS_DW_V2_LEAN=1: the LEAN build of the cp.async kernel (see fwd_nchw_v2); default off
// until timed on a GPU (read once).
bool nchw_v2_lean_enabled() {
  static const bool on = env_choice("CUDADOCTOR_OPS_DW_V2_LEAN", {0, 1}, 0) == 1;
  return on;
}

// The cp.async kernel runs with 4 consecutive columns per thread at stride 1 (COLV, see
// fwd_nchw_v2); CUDADOCTOR_OPS_DW_V2_COLV=0 keeps the strided columns (read once). H200, fp32 NCHW
// forward, one run: (8,64,128,128) 24.4 vs 25.6 us, (64,32,112,112) 61.6 vs 63.2, (1,256,128,128)
// 14.6 vs 14.9, (32,12,112,112) 5x5 21.2 vs 21.3; backward unchanged.

bool nchw_v2_colv_enabled() {
  static const bool on = env_choice("CUDADOCTOR_OPS_DW_V2_COLV", {0, 1}, 1) == 1;
  return on;
}

// CUDADOCTOR_OPS_DW_V2_ROWS=2 / 4 / 8: rows per thread of fwd_nchw_v2 wherever that plan fits (4:
// float32 only, built for timing the LEAN kernel's tile height; else
// the choice by grid size, see run_nchw_v2), read once.
int nchw_v2_rows_setting() {
  static const int v = env_choice("CUDADOCTOR_OPS_DW_V2_ROWS", {2, 4, 8}, 0);
  return v;
}

// NCHW float32 forward at stride 1 and "same" padding along W (PW = (K-1)/2, K = 3 or 5), for
// the default forward and stride-1 input gradient (launch_fwd_nchw_shfl, tried before
// fwd_nchw_v2 by depthwise.cu's "auto"; rows per warp: nchw_shfl_setting): no shared memory and
// no barrier.
// One warp computes R output rows x 128 columns of one plane: lane l owns the 4 columns
// x0 = seg*128 + 4l .. x0+3 and loads, for each of the R+K-1 input rows it needs, its own aligned
// float4 of those columns (W % 4 == 0: a vector is wholly inside the row or wholly outside, zeros
// outside). The K-1 columns around the vector come from the neighbouring lanes by shuffles; lane
// 0 and lane 31 load the P = (K-1)/2 columns beyond the warp's 128 themselves. Every load of the
// warp is issued before the first FMA: the kernel's critical path is one round trip to memory.
// Per output: the bias, then the taps by kernel row, then column, as in the reference kernel;
// taps outside the image add 0 * w (the reference skips them).
template <int K, int R>
__global__ void __launch_bounds__(256)
    fwd_nchw_shfl(const float* __restrict__ in, const float* __restrict__ w,
                  const float* __restrict__ bias, float* __restrict__ out, int C, int H, int W,
                  int Ho, int PH, int nseg, int nstrip, int64_t nwarps, bool flip) {
  constexpr int P = (K - 1) / 2;
  constexpr int NR = R + K - 1;  // input rows of the strip
  const int64_t gw = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (gw >= nwarps) return;  // whole warps only
  const int lane = threadIdx.x & 31;
  const int seg = static_cast<int>(gw % nseg);
  const int64_t t = gw / nseg;
  const int strip = static_cast<int>(t % nstrip);
  const int64_t plane = t / nstrip;
  const int c = static_cast<int>(plane % C);
  const int x0 = seg * 128 + lane * 4;
  const int oy0 = strip * R;
  const int iy0 = oy0 - PH;
  const float* ip = in + plane * H * W;
  const bool xin = x0 < W;
  // the columns beyond the warp: left of lane 0, right of lane 31
  const int ex = lane == 0 ? x0 - P : x0 + 4;
  const bool edge = (lane == 0 || lane == 31);

  float4 v[NR];
  float e[NR][P];
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    const int iy = iy0 + r;
    const bool rin = static_cast<unsigned>(iy) < static_cast<unsigned>(H);
    v[r] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (rin && xin) v[r] = __ldg(reinterpret_cast<const float4*>(ip + static_cast<int64_t>(iy) * W + x0));
#pragma unroll
    for (int k = 0; k < P; ++k) {
      e[r][k] = 0.f;
      if (rin && edge && static_cast<unsigned>(ex + k) < static_cast<unsigned>(W))
        e[r][k] = __ldg(ip + static_cast<int64_t>(iy) * W + ex + k);
    }
  }
  float wk[K * K];
  const float* wp = w + static_cast<int64_t>(c) * K * K;
#pragma unroll
  for (int i = 0; i < K * K; ++i) wk[i] = __ldg(wp + (flip ? K * K - 1 - i : i));
  const float b = bias != nullptr ? __ldg(bias + c) : 0.f;

  float acc[R][4];
#pragma unroll
  for (int o = 0; o < R; ++o)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[o][j] = b;

#pragma unroll
  for (int r = 0; r < NR; ++r) {
    // the row's window: input columns x0 - P .. x0 + 3 + P
    float win[4 + 2 * P];
    const float cur[4] = {v[r].x, v[r].y, v[r].z, v[r].w};
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const float fromleft = __shfl_up_sync(0xffffffffu, cur[4 - P + k], 1);
      const float fromright = __shfl_down_sync(0xffffffffu, cur[k], 1);
      win[k] = lane == 0 ? e[r][k] : fromleft;
      win[4 + P + k] = lane == 31 ? e[r][k] : fromright;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) win[P + j] = cur[j];
#pragma unroll
    for (int o = 0; o < R; ++o) {
      const int ky = r - o;
      if (ky < 0 || ky >= K) continue;
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int kx = 0; kx < K; ++kx) acc[o][j] = fmaf(win[j + kx], wk[ky * K + kx], acc[o][j]);
    }
  }
  if (!xin) return;
  float* op = out + plane * Ho * W + x0;
#pragma unroll
  for (int o = 0; o < R; ++o)
    if (oy0 + o < Ho)
      *reinterpret_cast<float4*>(op + static_cast<int64_t>(oy0 + o) * W) =
          make_float4(acc[o][0], acc[o][1], acc[o][2], acc[o][3]);
}

// CUDADOCTOR_OPS_DW_V2_SHFL=2 / 4 / 8: fwd_nchw_shfl with that many rows per warp wherever it
// applies (3x3 and 5x5); =0 never (fwd_nchw_v2 and its own switches); unset: 4 rows for 3x3, 5x5
// on fwd_nchw_v2. H200, float32, `scripts/gpu_variants.py dwsh`, 2026-12-01, us, fwd_nchw_v2 /
// 2 rows / 4 rows, two interleaved children each: 3x3 (1,64,128,128) 7.3, 7.5 / 7.1, 7.0 / 6.9,
// 7.4 (CUDA graph 8.2, 8.1 / 7.6, 7.6 / 7.3, 7.4; cuDNN 14.4-15.5), (8,64,128,128) 24.9, 24.2 /
// 25.4, 25.3 / 22.6, 23.0, (1,256,128,128) 14.6, 15.0 / 16.0, 15.8 / 14.0, 14.7, (64,32,112,112)
// 61.9, 61.1 / 70.4, 70.4 / 55.1, 55.4; 5x5 (32,12,112,112) 20.6, 20.3 / 31.4, 31.1 / 24.9, 25.6.
// Read once.
int nchw_shfl_setting() {
  static const int v = env_choice("CUDADOCTOR_OPS_DW_V2_SHFL", {0, 2, 4, 8}, -1);
  return v;
}

// fwd_nchw_shfl for float32 at stride 1 with W % 4 == 0, PW = (K-1)/2 (so Wo == W), 16-byte
// aligned input and output; false where it does not apply.
template <int K>
bool run_nchw_shfl(const float* in, const float* w, const float* bias, float* out,
                   const FastShape& s, bool flip, int rows, cudaStream_t stream) {
  if (s.S != 1 || s.PW != (K - 1) / 2 || s.W % 4 != 0 || s.Wo != s.W ||
      (reinterpret_cast<uintptr_t>(in) & 15u) || (reinterpret_cast<uintptr_t>(out) & 15u))
    return false;
  const int nseg = (s.W + 127) / 128;
  const int nstrip = (s.Ho + rows - 1) / rows;
  const int64_t nwarps = static_cast<int64_t>(s.N) * s.C * nstrip * nseg;
  const int64_t blocks = (nwarps + 7) / 8;
  if (blocks >= (int64_t(1) << 31)) return false;
  const auto go = [&](auto kernel) {
    kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(in, w, bias, out, s.C, s.H, s.W, s.Ho,
                                                              s.PH, nseg, nstrip, nwarps, flip);
  };
  if (rows == 8) go(fwd_nchw_shfl<K, 8>);
  else if (rows == 4) go(fwd_nchw_shfl<K, 4>);
  else go(fwd_nchw_shfl<K, 2>);
  return true;
}

template <typename T, int K, int S, int R>
void launch_nchw_v2(const void* in, const void* w, const void* bias, void* out,
                    const FastShape& s, bool flip, int BX, int BY, int SP, size_t smem,
                    bool vec, cudaStream_t stream) {
  constexpr int RW = 4;
  constexpr int VE = 16 / static_cast<int>(sizeof(T));
  const int tilesX = (s.Wo + BX * RW - 1) / (BX * RW);
  const int tilesY = (s.Ho + BY * R - 1) / (BY * R);
  const int64_t blocks = static_cast<int64_t>(tilesX) * tilesY * s.N * s.C;
  const int nch = SP / VE;
  V2Div dv;
  dv.tilesX = make_fastdiv(static_cast<unsigned>(tilesX));
  dv.tilesY = make_fastdiv(static_cast<unsigned>(tilesY));
  dv.C = make_fastdiv(static_cast<unsigned>(s.C));
  dv.nch = make_fastdiv(static_cast<unsigned>(nch));
  dv.sp = make_fastdiv(static_cast<unsigned>(SP));
  dv.dr = BX * BY / nch;
  dv.dq = BX * BY - dv.dr * nch;
  if constexpr (std::is_same<T, float>::value && S == 1) {
    // COLV: the window of the last thread's 16-byte loads inside the staged row
    const int off = ((-s.PW) % 4 + 4) % 4;
    const int nv = (off + RW + K - 1 + 3) / 4;
    if (vec && nchw_v2_async_enabled() && nchw_v2_colv_enabled() && 4 * (BX - 1) + 4 * nv <= SP) {
      const auto args = [&](auto kernel) {
        kernel<<<static_cast<unsigned>(blocks), dim3(BX, BY), smem, stream>>>(
            static_cast<const T*>(in), static_cast<const T*>(w), static_cast<const T*>(bias),
            static_cast<T*>(out), s.H, s.W, s.Ho, s.Wo, s.PH, s.PW, dv, SP, vec, flip);
      };
      // the COLV kernel of this window offset
      switch (off) {
        case 0: args(fwd_nchw_v2<T, K, S, R, RW, true, false, 0>); return;
        case 1: args(fwd_nchw_v2<T, K, S, R, RW, true, false, 1>); return;
        case 2: args(fwd_nchw_v2<T, K, S, R, RW, true, false, 2>); return;
        default: args(fwd_nchw_v2<T, K, S, R, RW, true, false, 3>); return;
      }
    }
  }
  if constexpr (std::is_same<T, float>::value) {
    if (vec && nchw_v2_async_enabled() && nchw_v2_lean_enabled() &&
        static_cast<int64_t>(s.H) * s.W < (int64_t(1) << 32)) {
      // 32-bit element offsets into the plane
      fwd_nchw_v2<T, K, S, R, RW, true, true>
          <<<static_cast<unsigned>(blocks), dim3(BX, BY), smem, stream>>>(
              static_cast<const T*>(in), static_cast<const T*>(w), static_cast<const T*>(bias),
              static_cast<T*>(out), s.H, s.W, s.Ho, s.Wo, s.PH, s.PW, dv, SP, vec, flip);
      return;
    }
    if (vec && nchw_v2_async_enabled()) {
      // a kernel of its own: the default one keeps its registers (32 at 3x3, 2 rows)
      fwd_nchw_v2<T, K, S, R, RW, true>
          <<<static_cast<unsigned>(blocks), dim3(BX, BY), smem, stream>>>(
              static_cast<const T*>(in), static_cast<const T*>(w), static_cast<const T*>(bias),
              static_cast<T*>(out), s.H, s.W, s.Ho, s.Wo, s.PH, s.PW, dv, SP, vec, flip);
      return;
    }
  }
  fwd_nchw_v2<T, K, S, R, RW><<<static_cast<unsigned>(blocks), dim3(BX, BY), smem, stream>>>(
      static_cast<const T*>(in), static_cast<const T*>(w), static_cast<const T*>(bias),
      static_cast<T*>(out), s.H, s.W, s.Ho, s.Wo, s.PH, s.PW, dv, SP, vec, flip);
}

// Geometry of one NCHW v2 launch with R rows per thread; false when its
// shared memory would exceed kSmemLimit or its grid the launch limit.
struct NchwV2Plan {
  int BX, BY, SP;
  size_t smem;
  int64_t blocks;
};

bool plan_nchw_v2(const FastShape& s, int R, int VE, NchwV2Plan& p) {
  constexpr int RW = 4;
  p.BX = s.Wo > 64 ? 32 : (s.Wo > 32 ? 16 : 8);
  p.BY = kThreads / p.BX;
  const int need_rows = (s.Ho + R - 1) / R;
  if (need_rows < p.BY) p.BY = need_rows < 1 ? 1 : need_rows;
  const int TH = p.BY * R;
  const int IH = (TH - 1) * s.S + s.K;
  const int IW = (p.BX * RW - 1) * s.S + s.K;
  p.SP = ((IW + VE - 1) / VE + 1) * VE;
  p.smem = static_cast<size_t>(IH) * p.SP * sizeof(float);
  const int64_t tilesX = (s.Wo + p.BX * RW - 1) / (p.BX * RW);
  const int64_t tilesY = (s.Ho + TH - 1) / TH;
  p.blocks = tilesX * tilesY * s.N * s.C;
  return p.smem <= static_cast<size_t>(kSmemLimit) && p.blocks < (int64_t(1) << 31);
}

template <typename T, int K, int S>
bool run_nchw_v2(const void* in, const void* w, const void* bias, void* out,
                 const FastShape& s, bool flip, cudaStream_t stream) {
  constexpr int VE = 16 / static_cast<int>(sizeof(T));
  const bool vec = s.W % VE == 0 && (reinterpret_cast<uintptr_t>(in) & 15u) == 0;
  NchwV2Plan p;
  // Tall tiles (8 rows per thread) cut the halo re-reads and reuse each
  // shared-memory row across more outputs; use them while the grid still has
  // several blocks per SM, else 2 rows per thread (CUDADOCTOR_OPS_DW_V2_ROWS=2 / 8
  // forces one where it fits). With the cp.async staging (float32, aligned rows)
  // two blocks per SM are enough: (1,256,128,128) 3x3 and (32,12,112,112) 5x5,
  // 512 and 768 blocks of 8 rows, ran 12% and 25% faster with them on the H200;
  // (1,64,128,128), 128 blocks, ran faster with 2 rows.
  const int rows = nchw_v2_rows_setting();
  if constexpr (std::is_same<T, float>::value) {
    if (rows == 4 && plan_nchw_v2(s, 4, VE, p)) {
      launch_nchw_v2<T, K, S, 4>(in, w, bias, out, s, flip, p.BX, p.BY, p.SP, p.smem, vec, stream);
      return true;
    }
  }
  const bool use_async = std::is_same<T, float>::value && vec && nchw_v2_async_enabled();
  const int64_t tall_min_blocks = use_async ? 256 : 1024;
  if (rows != 2 && plan_nchw_v2(s, 8, VE, p) && (rows == 8 || p.blocks >= tall_min_blocks)) {
    launch_nchw_v2<T, K, S, 8>(in, w, bias, out, s, flip, p.BX, p.BY, p.SP, p.smem, vec, stream);
    return true;
  }
  if (plan_nchw_v2(s, 2, VE, p)) {
    launch_nchw_v2<T, K, S, 2>(in, w, bias, out, s, flip, p.BX, p.BY, p.SP, p.smem, vec, stream);
    return true;
  }
  return false;
}

template <typename T, int K, int S>
bool run_nhwc_v2(const void* in, const void* w, const void* bias, void* out,
                 const FastShape& s, bool flip, cudaStream_t stream) {
  constexpr int V = 16 / static_cast<int>(sizeof(T));
  constexpr int RW = S == 1 ? 4 : 2;
  const int CV = s.C / V;
  const int groupsW = (s.Wo + RW - 1) / RW;
  // Fewer channels per block on wide images, so that one block spans at
  // least two output rows (their shared input rows then hit in L1); at most
  // 128 channels per block (shared memory of the staged weights).
  int cap = kThreads / (2 * groupsW);
  cap = cap < 2 ? 2 : (cap > 128 / V ? 128 / V : cap);
  const int TX = balanced_tx(CV, cap);
  const int TY = kThreads / TX;
  const int64_t total = static_cast<int64_t>(s.N) * s.Ho * groupsW;
  const int64_t gx = (total + TY - 1) / TY;
  const int gy = (CV + TX - 1) / TX;
  if (gx >= (int64_t(1) << 31) || gy > 65535) return false;
  const size_t smem = static_cast<size_t>(K * K + 1) * TX * V * sizeof(float);
  fwd_nhwc_v2<T, K, S, RW><<<dim3(static_cast<unsigned>(gx), gy), dim3(TX, TY), smem, stream>>>(
      static_cast<const T*>(in), static_cast<const T*>(w), static_cast<const T*>(bias),
      static_cast<T*>(out), s.C, s.H, s.W, s.Ho, s.Wo, s.PH, s.PW, groupsW, total, flip);
  return true;
}

template <typename T>
bool dispatch_ks_v2(bool nhwc, const void* in, const void* w, const void* bias, void* out,
                    const FastShape& s, bool flip, cudaStream_t stream) {
#define CDO_DW_CASE(KK, SS)                                                    \
  if (s.K == KK && s.S == SS) {                                                \
    return nhwc ? run_nhwc_v2<T, KK, SS>(in, w, bias, out, s, flip, stream)    \
                : run_nchw_v2<T, KK, SS>(in, w, bias, out, s, flip, stream);   \
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

bool dispatch_type_v2(DType dt, bool nhwc, const void* in, const void* w, const void* bias,
                      void* out, const FastShape& s, bool flip, cudaStream_t stream) {
  switch (dt) {
    case DType::F32:
      return dispatch_ks_v2<float>(nhwc, in, w, bias, out, s, flip, stream);
    case DType::F16:
      return dispatch_ks_v2<c10::Half>(nhwc, in, w, bias, out, s, flip, stream);
    case DType::BF16:
      return dispatch_ks_v2<c10::BFloat16>(nhwc, in, w, bias, out, s, flip, stream);
  }
  return false;
}

// ---------------------------------------------------------------------------
// Third-generation NHWC forward (channels_last, 16 bytes of channels per
// thread: 8 channels of a 16-bit type, 4 of float32).
//
//   in [N][H][W][C], out [N][Ho][Wo][C], w [C][K][K], bias [C] or null.
//
// One block computes an output tile of TH rows x NG*RW columns x CGb channel
// groups (CGb*V channels) of one image. It stages the input tile it needs,
// IH = (TH-1)*S+K rows by IW = (NG*RW-1)*S+K columns by CGb 16-byte groups,
// in shared memory with cp.async (16-byte copies straight from global memory
// to shared memory, zero-filled outside the image and outside the channel
// range). All copies of a block are issued at once, before any compute, so a
// block keeps its whole tile in flight without spending registers on it; the
// rows come in nb commit groups (bands), and band g is computed as soon as its
// rows have landed while the later bands are still on their way.
//
// Threads: x = channel group (16 bytes), y = (output row within the band,
// column group of RW outputs), column group fastest. Each thread computes one
// output position (RW outputs along W times V channels) per band: for every
// kernel row it reads the NCOL = (RW-1)*S+K input vectors of the position from
// shared memory (each reused by every output of the group it touches), and
// accumulates in float32. Weights (and bias) are staged as float32 in shared
// memory as [tap][V/4][CGb] float4s; with WREG (K == 3) each thread keeps its
// 9*V weights in registers, otherwise it reads the K*V weights of a kernel row
// per row. Consecutive threads (x) read and write consecutive 16-byte groups
// of one pixel.

constexpr int kV3Threads = 256;             // at most, per block
constexpr int kV3SmemBudget = 64 * 1024;    // dynamic shared memory per block
constexpr int kV3MaxBands = 8;              // commit groups per block
constexpr int kV3TileInCols = 40;           // input columns per tile, about
constexpr int64_t kV3MinBlocks = 768;       // keep several waves of blocks

struct V3Args {
  int C, H, W, Ho, Wo, PH, PW;
  int CG;        // channel groups of the tensor (C / V)
  int nCh;       // channel chunks (blocks along C); CGb = blockDim.x groups each
  int nTx, nTy;  // tiles along W and H
  int NG;        // column groups (of RW outputs) per tile
  int THb, nb;   // output rows per band, bands per tile
  int TH;        // output rows per tile (<= THb * nb)
  int IH, IW;    // input tile rows and columns
  bool flip;     // rot180 weights
};

// Waits until at most `pending` (0 .. kV3MaxBands-1) of this thread's commit
// groups are still in flight.
__device__ __forceinline__ void v3_cp_async_wait_dyn(int pending) {
  switch (pending) {
    case 0: cp_async_wait_group<0>(); break;
    case 1: cp_async_wait_group<1>(); break;
    case 2: cp_async_wait_group<2>(); break;
    case 3: cp_async_wait_group<3>(); break;
    case 4: cp_async_wait_group<4>(); break;
    case 5: cp_async_wait_group<5>(); break;
    case 6: cp_async_wait_group<6>(); break;
    default: cp_async_wait_group<7>(); break;
  }
  static_assert(kV3MaxBands == 8, "v3_cp_async_wait_dyn covers 0..7 pending groups");
}

template <typename T, int V>
__device__ __forceinline__ void v3_unpack(const uint4& raw, float (&v)[V]) {
  T e[V];
  memcpy(e, &raw, 16);
#pragma unroll
  for (int k = 0; k < V; ++k) v[k] = static_cast<float>(e[k]);
}

// One kernel row of one position: rp points at the first input vector of the
// row in shared memory (consecutive columns are CGb uint4 apart), wk at the K
// weight vectors of the row.
template <typename T, int K, int S, int RW, int V>
__device__ __forceinline__ void v3_row(const uint4* rp, int CGb, const float (*wk)[V],
                                       float (&acc)[RW][V]) {
  constexpr int NCOL = (RW - 1) * S + K;
#pragma unroll
  for (int j = 0; j < NCOL; ++j) {
    float v[V];
    v3_unpack<T, V>(rp[j * CGb], v);
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

template <typename T, int K, int S, int RW, bool WREG>
__global__ void __launch_bounds__(kV3Threads, 2)
    fwd_nhwc_v3(const T* __restrict__ in, const T* __restrict__ w,
                const T* __restrict__ bias, T* __restrict__ out, const V3Args a) {
  constexpr int V = 16 / static_cast<int>(sizeof(T));
  constexpr int Q = V / 4;  // float4s per channel group
  constexpr int KK = K * K;
  extern __shared__ uint4 smem_v3[];

  const int CGb = blockDim.x;
  const int PT = blockDim.y;
  const int cg = threadIdx.x;
  const int ty = threadIdx.y;
  const int tid = ty * CGb + cg;
  const int nthr = CGb * PT;

  int64_t b = blockIdx.x;
  const int chunk = static_cast<int>(b % a.nCh);
  b /= a.nCh;
  const int txt = static_cast<int>(b % a.nTx);
  b /= a.nTx;
  const int tyt = static_cast<int>(b % a.nTy);
  const int64_t n = b / a.nTy;

  const int cgg = chunk * CGb + cg;  // channel group in the tensor
  const bool cok = cgg < a.CG;
  const int c = cgg * V;
  const int oy0 = tyt * a.TH;
  const int ox0 = txt * a.NG * RW;
  const int iy0 = oy0 * S - a.PH;
  const int ix0 = ox0 * S - a.PW;
  const int IW = a.IW;

  uint4* tile = smem_v3;  // [IH][IW][CGb]
  float* sw = reinterpret_cast<float*>(smem_v3 + static_cast<size_t>(a.IH) * IW * CGb);

  // 1. Input tile, band by band: one commit group per band of output rows.
  {
    const T* in_n = in + n * a.H * static_cast<int64_t>(a.W) * a.C;
    const int dr = PT / IW;  // pixel step PT as (rows, columns)
    const int dc = PT - dr * IW;
    const int r0 = ty / IW;
    const int c0 = ty - r0 * IW;
    int rs = 0;
    for (int g = 0; g < a.nb; ++g) {
      const int re = g == a.nb - 1 ? a.IH : min(a.IH, ((g + 1) * a.THb - 1) * S + K);
      int row = rs + r0;
      int col = c0;
      while (row < re) {
        const int iy = iy0 + row;
        const int ix = ix0 + col;
        const bool ok = cok && static_cast<unsigned>(iy) < static_cast<unsigned>(a.H) &&
                        static_cast<unsigned>(ix) < static_cast<unsigned>(a.W);
        const T* src = ok ? in_n + (static_cast<int64_t>(iy) * a.W + ix) * a.C + c : in;
        cp_async16_zfill(tile + (row * IW + col) * CGb + cg, src, ok);
        col += dc;
        row += dr;
        if (col >= IW) {
          col -= IW;
          ++row;
        }
      }
      cp_async_commit();
      rs = re;
    }
  }

  // 2. Weights and bias of the block's channels as float32, [tap][Q][CGb][4];
  //    tap KK holds the bias. Zero for channels past C.
  {
    const int CB = CGb * V;
    const int cbase = chunk * CB;
    for (int i = tid; i < CB * KK; i += nthr) {
      const int cl = i / KK;
      const int t = i - cl * KK;
      const int cc = cbase + cl;
      float v = 0.f;
      if (cc < a.C) v = to_float(w[static_cast<int64_t>(cc) * KK + (a.flip ? KK - 1 - t : t)]);
      sw[((t * Q + (cl % V) / 4) * CGb + cl / V) * 4 + (cl & 3)] = v;
    }
    for (int i = tid; i < CB; i += nthr) {
      const int cc = cbase + i;
      sw[((KK * Q + (i % V) / 4) * CGb + i / V) * 4 + (i & 3)] =
          (bias != nullptr && cc < a.C) ? to_float(bias[cc]) : 0.f;
    }
  }

  // 3. Bands.
  const float4* swv = reinterpret_cast<const float4*>(sw);
  const int gcol = ty % a.NG;
  const int rl = ty / a.NG;
  float wr[WREG ? KK : 1][V];
  for (int g = 0; g < a.nb; ++g) {
    v3_cp_async_wait_dyn(a.nb - 1 - g);
    __syncthreads();
    if constexpr (WREG) {
      if (g == 0) {
#pragma unroll
        for (int t = 0; t < KK; ++t)
#pragma unroll
          for (int q = 0; q < Q; ++q) {
            const float4 f = swv[(t * Q + q) * CGb + cg];
            wr[t][4 * q + 0] = f.x;
            wr[t][4 * q + 1] = f.y;
            wr[t][4 * q + 2] = f.z;
            wr[t][4 * q + 3] = f.w;
          }
      }
    }
    const int lr = g * a.THb + rl;  // output row within the tile
    const int oy = oy0 + lr;
    if (!cok || lr >= a.TH || oy >= a.Ho) continue;

    float acc[RW][V];
#pragma unroll
    for (int q = 0; q < Q; ++q) {
      const float4 f = swv[(KK * Q + q) * CGb + cg];
#pragma unroll
      for (int r = 0; r < RW; ++r) {
        acc[r][4 * q + 0] = f.x;
        acc[r][4 * q + 1] = f.y;
        acc[r][4 * q + 2] = f.z;
        acc[r][4 * q + 3] = f.w;
      }
    }
    const uint4* tp = tile + (lr * S * IW + gcol * RW * S) * CGb + cg;
    if constexpr (WREG) {
#pragma unroll
      for (int kh = 0; kh < K; ++kh)
        v3_row<T, K, S, RW, V>(tp + kh * IW * CGb, CGb, &wr[kh * K], acc);
    } else {
#pragma unroll 1
      for (int kh = 0; kh < K; ++kh) {
        float wk[K][V];
#pragma unroll
        for (int kw = 0; kw < K; ++kw)
#pragma unroll
          for (int q = 0; q < Q; ++q) {
            const float4 f = swv[((kh * K + kw) * Q + q) * CGb + cg];
            wk[kw][4 * q + 0] = f.x;
            wk[kw][4 * q + 1] = f.y;
            wk[kw][4 * q + 2] = f.z;
            wk[kw][4 * q + 3] = f.w;
          }
        v3_row<T, K, S, RW, V>(tp + kh * IW * CGb, CGb, wk, acc);
      }
    }

    const int oxg = ox0 + gcol * RW;
    T* op = out + ((n * a.Ho + oy) * static_cast<int64_t>(a.Wo) + oxg) * a.C + c;
#pragma unroll
    for (int r = 0; r < RW; ++r)
      if (oxg + r < a.Wo) store_vec<T, V>(op + static_cast<int64_t>(r) * a.C, acc[r]);
  }
}

// Channel chunk of at most `hi` groups (and at least hi/2) with the fewest
// idle groups in the last chunk; ties go to multiples of 8, then of 4 (whole
// 128-byte lines per pixel, conflict-free shared-memory phases), then to the
// larger chunk.
void v3_chunking(int CG, int hi, int& nCh, int& CGb) {
  if (CG <= hi) {
    nCh = 1;
    CGb = CG;
    return;
  }
  int best_key = 1 << 30;
  for (int cgb = hi; cgb >= (hi + 1) / 2; --cgb) {
    const int nch = (CG + cgb - 1) / cgb;
    const int waste = nch * cgb - CG;
    const int align = cgb % 8 == 0 ? 0 : (cgb % 4 == 0 ? 1 : 2);
    const int key = (waste * 4 + align) * 64 + (64 - cgb);
    if (key < best_key) {
      best_key = key;
      nCh = nch;
      CGb = cgb;
    }
  }
}

// Tile geometry of one launch. false when even one output row per tile does
// not fit in kV3SmemBudget or the grid is too large.
bool v3_plan(const FastShape& s, int K, int S, int RW, int V, V3Args& a, dim3& block,
             size_t& smem, int64_t& blocks) {
  set_plane_sizes(a, s);
  a.CG = s.C / V;
  // Columns: tiles of at most about kV3TileInCols input columns.
  int ngmax = ((kV3TileInCols - K) / S + 1) / RW;
  if (ngmax < 1) ngmax = 1;
  const int ngt = (s.Wo + RW - 1) / RW;
  a.nTx = (ngt + ngmax - 1) / ngmax;
  a.NG = (ngt + a.nTx - 1) / a.nTx;
  a.IW = (a.NG * RW - 1) * S + K;
  // Channels.
  int CGb = 0;
  v3_chunking(a.CG, K >= 7 ? 8 : 12, a.nCh, CGb);
  // Rows: bands of THb rows (one position per thread per band), as many bands
  // as the shared-memory budget allows, fewer while the grid is small.
  const size_t wbytes = static_cast<size_t>(K * K + 1) * CGb * V * sizeof(float);
  const size_t rowb = static_cast<size_t>(a.IW) * CGb * 16;
  if (wbytes + static_cast<size_t>(K) * rowb > static_cast<size_t>(kV3SmemBudget)) return false;
  const int ihmax = static_cast<int>((kV3SmemBudget - wbytes) / rowb);
  const int thmax = (ihmax - K) / S + 1;  // >= 1
  int THb = kV3Threads / (CGb * a.NG);
  if (THb < 1) THb = 1;
  if (THb > thmax) THb = thmax;
  int TH;
  if (s.Ho <= THb) {
    TH = s.Ho;
  } else {
    int nbands = thmax / THb;
    if (nbands > kV3MaxBands) nbands = kV3MaxBands;
    if (nbands < 1) nbands = 1;
    TH = nbands * THb < s.Ho ? nbands * THb : s.Ho;
    while (nbands > 1 && static_cast<int64_t>(s.N) * ((s.Ho + TH - 1) / TH) * a.nTx * a.nCh <
                             kV3MinBlocks) {
      --nbands;
      TH = nbands * THb < s.Ho ? nbands * THb : s.Ho;
    }
  }
  a.nTy = (s.Ho + TH - 1) / TH;
  a.TH = (s.Ho + a.nTy - 1) / a.nTy;  // balanced: <= TH
  a.nb = (a.TH + THb - 1) / THb;      // <= kV3MaxBands
  a.THb = (a.TH + a.nb - 1) / a.nb;   // <= THb
  a.IH = (a.TH - 1) * S + K;
  smem = static_cast<size_t>(a.IH) * rowb + wbytes;
  blocks = static_cast<int64_t>(s.N) * a.nTy * a.nTx * a.nCh;
  block = dim3(CGb, a.THb * a.NG);
  return smem <= static_cast<size_t>(kV3SmemBudget) && blocks < (int64_t(1) << 31) &&
         CGb * a.THb * a.NG <= kV3Threads;
}

template <typename T, int K, int S, int RW, bool WREG>
bool run_nhwc_v3(const void* in, const void* w, const void* bias, void* out,
                 const FastShape& s, bool flip, cudaStream_t stream) {
  constexpr int V = 16 / static_cast<int>(sizeof(T));
  V3Args a;
  dim3 block;
  size_t smem = 0;
  int64_t blocks = 0;
  if (!v3_plan(s, K, S, RW, V, a, block, smem, blocks)) return false;
  a.flip = flip;
  auto kern = fwd_nhwc_v3<T, K, S, RW, WREG>;
  if (smem > 48 * 1024) {
    // Opt in to more than 48 KiB of dynamic shared memory, once per device.
    static std::atomic<unsigned long long> opted{0};
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return false;
    const unsigned long long bit = dev < 64 ? (1ull << dev) : 0ull;
    if (bit == 0 || (opted.load(std::memory_order_relaxed) & bit) == 0) {
      if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               kV3SmemBudget) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
      }
      opted.fetch_or(bit, std::memory_order_relaxed);
    }
  }
  kern<<<static_cast<unsigned>(blocks), block, smem, stream>>>(
      static_cast<const T*>(in), static_cast<const T*>(w), static_cast<const T*>(bias),
      static_cast<T*>(out), a);
  return true;
}

template <typename T>
bool dispatch_nhwc_v3(const void* in, const void* w, const void* bias, void* out,
                      const FastShape& s, bool flip, cudaStream_t stream) {
  // (K, S) -> outputs per thread along W (RW); 3x3 keeps all 9 taps in
  // registers (WREG).
#define CDO_DW_V3(KK, SS, RW, WREG)                                                   \
  if (s.K == KK && s.S == SS)                                                         \
    return run_nhwc_v3<T, KK, SS, RW, WREG>(in, w, bias, out, s, flip, stream);
  CDO_DW_V3(3, 1, 4, true)
  CDO_DW_V3(3, 2, 2, true)
  CDO_DW_V3(5, 1, 4, false)
  CDO_DW_V3(5, 2, 4, false)
  CDO_DW_V3(7, 1, 4, false)
  CDO_DW_V3(7, 2, 2, false)
#undef CDO_DW_V3
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

bool launch_fwd_nchw_v2(DType dt, const void* in, const void* w, const void* bias,
                        void* out, const FastShape& s, bool flip,
                        cudaStream_t stream) {
  if (s.Ho <= 0 || s.Wo <= 0 || s.N <= 0 || s.C <= 0 || s.H <= 0 || s.W <= 0) return false;
  return dispatch_type_v2(dt, false, in, w, bias, out, s, flip, stream);
}

// fwd_nchw_shfl where it applies (run_nchw_shfl's conditions) and is chosen (nchw_shfl_setting).
bool launch_fwd_nchw_shfl(DType dt, const void* in, const void* w, const void* bias, void* out,
                          const FastShape& s, bool flip, cudaStream_t stream) {
  if (s.Ho <= 0 || s.Wo <= 0 || s.N <= 0 || s.C <= 0 || s.H <= 0 || s.W <= 0) return false;
  if (dt != DType::F32 || (s.K != 3 && s.K != 5)) return false;
  const int set = nchw_shfl_setting();
  const int rows = set >= 0 ? set : (s.K == 3 ? 4 : 0);
  if (rows <= 0) return false;
  const auto* i = static_cast<const float*>(in);
  const auto* wf = static_cast<const float*>(w);
  const auto* b = static_cast<const float*>(bias);
  auto* o = static_cast<float*>(out);
  return s.K == 3 ? run_nchw_shfl<3>(i, wf, b, o, s, flip, rows, stream)
                  : run_nchw_shfl<5>(i, wf, b, o, s, flip, rows, stream);
}

bool launch_fwd_nhwc_v2_kernel(DType dt, const void* in, const void* w, const void* bias,
                               void* out, const FastShape& s, bool flip,
                               cudaStream_t stream) {
  if (s.Ho <= 0 || s.Wo <= 0 || s.N <= 0 || s.C <= 0 || s.H <= 0 || s.W <= 0) return false;
  // 16 bytes of channels per thread: C a multiple of 4 (float32) or 8 (16-bit),
  // 16-byte aligned tensors.
  const int V = dt == DType::F32 ? 4 : 8;
  if (s.C % V != 0 || (reinterpret_cast<uintptr_t>(in) & 15u) ||
      (reinterpret_cast<uintptr_t>(out) & 15u))
    return false;
  return dispatch_type_v2(dt, true, in, w, bias, out, s, flip, stream);
}

bool launch_fwd_nhwc_v3(DType dt, const void* in, const void* w, const void* bias,
                        void* out, const FastShape& s, bool flip,
                        cudaStream_t stream) {
  if (s.Ho <= 0 || s.Wo <= 0 || s.N <= 0 || s.C <= 0 || s.H <= 0 || s.W <= 0) return false;
  // 16-byte groups of channels: C a multiple of 4 (float32) or 8 (16-bit), 16-byte
  // aligned input and output (cp.async and vector stores).
  const int V = dt == DType::F32 ? 4 : 8;
  if (s.C % V != 0 || (reinterpret_cast<uintptr_t>(in) & 15u) ||
      (reinterpret_cast<uintptr_t>(out) & 15u))
    return false;
  switch (dt) {
    case DType::F32:
      return dispatch_nhwc_v3<float>(in, w, bias, out, s, flip, stream);
    case DType::F16:
      return dispatch_nhwc_v3<c10::Half>(in, w, bias, out, s, flip, stream);
    case DType::BF16:
      return dispatch_nhwc_v3<c10::BFloat16>(in, w, bias, out, s, flip, stream);
  }
  return false;
}

bool launch_fwd_nhwc_v2(DType dt, const void* in, const void* w, const void* bias,
                        void* out, const FastShape& s, bool flip,
                        cudaStream_t stream) {
  // The default channels_last forward. For 16-bit types the fourth-generation
  // direct kernel first, wherever it applies (C % 8 == 0, 16-byte aligned input
  // and output); CUDADOCTOR_OPS_DW_V4=0 skips it. Then, as before it: the
  // third-generation kernel for 16-bit types on the shapes where it beat the
  // second-generation one (H200, batch 64, fp16 and bf16 measured in one run:
  // 1.06-1.25x at stride 1 on 28x28 and larger planes and on 5x5 filters over
  // 14x14 and larger, 1.13x for 5x5 stride 2 on 56x56; 0.80-0.97x for 3x3 at
  // stride 2 and for 3x3 on 14x14 / 7x7 planes), else the second-generation
  // kernel.
  if (dt != DType::F32 && fwd_nhwc_v4_enabled() &&
      launch_fwd_nhwc_v4(dt, in, w, bias, out, s, flip, stream))
    return true;
  const bool v3_pays = s.S == 1 ? (s.H >= 28 || (s.K >= 5 && s.H >= 14)) : (s.K >= 5 && s.H >= 28);
  if (dt != DType::F32 && v3_pays && launch_fwd_nhwc_v3(dt, in, w, bias, out, s, flip, stream))
    return true;
  return launch_fwd_nhwc_v2_kernel(dt, in, w, bias, out, s, flip, stream);
}

}  // namespace depthwise
}  // namespace cudadoctor_ops
