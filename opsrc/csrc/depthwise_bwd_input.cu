// Depthwise 2-D convolution, channels_last input gradient at stride 2
// (second generation; the first is bwd_input_nhwc in depthwise_fwd.cu).
//
//   dX[n,iy,ix,c] = sum over (ky,kx) with iy+PH-ky and ix+PW-kx even and the
//                   quotients in range of dY[n,(iy+PH-ky)/2,(ix+PW-kx)/2,c] * w[c,ky,kx]
//
// A thread computes a 2 x 2 block of input pixels for 16 bytes of channels
// (V = 8 for 16-bit types, 4 for float32): rows iy0, iy0+1 and columns ix0,
// ix0+1 with iy0+PH and ix0+PW even. Writing p = (iy0+PH)/2, q = (ix0+PW)/2:
//   row iy0   takes the even kernel rows ky = 2m   at oy = p - m,
//   row iy0+1 takes the odd  kernel rows ky = 2m+1 at oy = p - m,
// and likewise for columns (kx = 2j / 2j+1 at ox = q - j). So the four pixels
// read the same M x M dY vectors (M = (K+1)/2, oy = p-m, ox = q-j), each dY
// vector feeds up to four taps (one per pixel), every (ky,kx) is used once per
// block, and which taps apply is fixed at compile time: no per-tap parity or
// divisibility test, only the range checks of the dY row and column. Blocks
// start at iy0 = -(PH & 1) (and ix0 = -(PW & 1)), so the first block row or
// column may lie half outside the image; such pixels are not stored.
//
// Block = TX channel vectors (threadIdx.x) x TY pixel blocks (threadIdx.y).
// The K*K weights of the block's TX*V channels are staged in shared memory as
// float, [tap][channel]. TX <= 8, so the 16-byte weight reads of one tap by a
// warp touch at most 8 distinct, contiguous 16-byte words (lanes of the same
// channel vector read the same word), about one shared-memory wavefront each.
// Pixel blocks are numbered n-major, then block row, then block column, and
// dealt to (block, ty) with a grid-stride loop; the index is split with
// multiply-shift division (no integer divide in the loop).
#include <cstdlib>
#include <map>
#include <mutex>
#include <tuple>

#include "depthwise.cuh"

namespace cudadoctor_ops {
namespace depthwise {
namespace {

constexpr int kThreads = 256;
constexpr int kTxCap = 8;

// a += g * w for V channels; w: V floats in shared memory, 16-byte aligned.
template <int V>
__device__ __forceinline__ void fma_tap(float (&a)[V], const float (&g)[V], const float* w) {
#pragma unroll
  for (int e = 0; e < V; e += 4) {
    const float4 w4 = *reinterpret_cast<const float4*>(w + e);
    a[e + 0] = fmaf(g[e + 0], w4.x, a[e + 0]);
    a[e + 1] = fmaf(g[e + 1], w4.y, a[e + 1]);
    a[e + 2] = fmaf(g[e + 2], w4.z, a[e + 2]);
    a[e + 3] = fmaf(g[e + 3], w4.w, a[e + 3]);
  }
}

//   go [N][Ho][Wo][C]   w [C][K][K]   gin [N][H][W][C]
// BH x BW pixel blocks per image, `total` = N*BH*BW < 2^31.
template <typename T, int K, int V>
__global__ void __launch_bounds__(kThreads)
    bwd_input_nhwc_s2(const T* __restrict__ go, const T* __restrict__ w, T* __restrict__ gin,
                      int C, int H, int W, int Ho, int Wo, int PH, int PW, int BH, int BW,
                      FastDiv divBW, FastDiv divBH, unsigned total) {
  constexpr int KK = K * K;
  constexpr int M = (K + 1) / 2;
  extern __shared__ float4 sw4[];  // [K*K][TXC] floats
  float* sw = reinterpret_cast<float*>(sw4);
  const int TXC = blockDim.x * V;
  const int c0 = blockIdx.y * TXC;
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  const int nthr = blockDim.x * blockDim.y;
  for (int i = tid; i < TXC * KK; i += nthr) {
    const int cl = i / KK;
    const int t = i - cl * KK;
    const int cc = c0 + cl;
    sw[t * TXC + cl] = cc < C ? to_float(w[static_cast<int64_t>(cc) * KK + t]) : 0.f;
  }
  __syncthreads();

  const int c = c0 + threadIdx.x * V;  // C % V == 0: all V channels valid when c < C
  if (c >= C) return;
  const float* swc = sw + threadIdx.x * V;
  const int ey = PH & 1;
  const int ex = PW & 1;
  const int64_t rowstride = static_cast<int64_t>(W) * C;
  const unsigned stride = gridDim.x * blockDim.y;
  for (unsigned task = blockIdx.x * blockDim.y + threadIdx.y; task < total; task += stride) {
    const unsigned t = fdiv(task, divBW);
    const int bx = static_cast<int>(task - t * static_cast<unsigned>(BW));
    const unsigned n = fdiv(t, divBH);
    const int by = static_cast<int>(t - n * static_cast<unsigned>(BH));
    const int iy0 = 2 * by - ey;
    const int ix0 = 2 * bx - ex;
    const int p = (iy0 + PH) >> 1;
    const int q = (ix0 + PW) >> 1;
    const T* gp = go + static_cast<int64_t>(n) * Ho * Wo * C + c;

    float acc[2][2][V];
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int s = 0; s < 2; ++s)
#pragma unroll
        for (int e = 0; e < V; ++e) acc[r][s][e] = 0.f;

#pragma unroll
    for (int m = 0; m < M; ++m) {
      const int oy = p - m;
      const bool rok = static_cast<unsigned>(oy) < static_cast<unsigned>(Ho);
#pragma unroll
      for (int j = 0; j < M; ++j) {
        const int ox = q - j;
        const bool ok = rok && static_cast<unsigned>(ox) < static_cast<unsigned>(Wo);
        float g[V];
        ldg_vec_or_zero<T, V>(gp + (ok ? (static_cast<int64_t>(oy) * Wo + ox) * C : 0), ok, g);
        // (row parity, column parity) -> tap (2m + r, 2j + s), present when < K.
        fma_tap<V>(acc[0][0], g, swc + ((2 * m) * K + 2 * j) * TXC);
        if (2 * j + 1 < K) fma_tap<V>(acc[0][1], g, swc + ((2 * m) * K + 2 * j + 1) * TXC);
        if (2 * m + 1 < K) {
          fma_tap<V>(acc[1][0], g, swc + ((2 * m + 1) * K + 2 * j) * TXC);
          if (2 * j + 1 < K) fma_tap<V>(acc[1][1], g, swc + ((2 * m + 1) * K + 2 * j + 1) * TXC);
        }
      }
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int iy = iy0 + r;
      if (static_cast<unsigned>(iy) >= static_cast<unsigned>(H)) continue;
      T* orow = gin + (static_cast<int64_t>(n) * H + iy) * rowstride + c;
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        const int ix = ix0 + s;
        if (static_cast<unsigned>(ix) < static_cast<unsigned>(W))
          store_vec<T, V>(orow + static_cast<int64_t>(ix) * C, acc[r][s]);
      }
    }
  }
}

template <typename T, int K>
bool run_s2(const void* go, const void* w, void* gin, const FastShape& s, cudaStream_t stream) {
  constexpr int V = 16 / static_cast<int>(sizeof(T));
  const int CV = s.C / V;
  const int TX = pick_channel_vectors(CV, kTxCap);
  const int TY = kThreads / TX;
  const int gy = (CV + TX - 1) / TX;
  if (gy > 65535) return false;
  const int64_t BH = (static_cast<int64_t>(s.H) + (s.PH & 1) + 1) / 2;
  const int64_t BW = (static_cast<int64_t>(s.W) + (s.PW & 1) + 1) / 2;
  const int64_t total = static_cast<int64_t>(s.N) * BH * BW;
  if (total >= (int64_t(1) << 31)) return false;
  const size_t smem = static_cast<size_t>(K * K) * TX * V * sizeof(float);
  auto kern = bwd_input_nhwc_s2<T, K, V>;
  // About two waves of resident blocks; each loops over its share of pixel blocks.
  const int64_t wave = static_cast<int64_t>(current_sm_count()) *
                       resident_blocks_per_sm(reinterpret_cast<const void*>(kern), TX * TY, smem);
  int64_t gx = (2 * wave + gy - 1) / gy;
  const int64_t need = (total + TY - 1) / TY;
  if (gx > need) gx = need;
  if (gx < 1) gx = 1;
  kern<<<dim3(static_cast<unsigned>(gx), gy), dim3(TX, TY), smem, stream>>>(
      static_cast<const T*>(go), static_cast<const T*>(w), static_cast<T*>(gin), s.C, s.H, s.W,
      s.Ho, s.Wo, s.PH, s.PW, static_cast<int>(BH), static_cast<int>(BW),
      make_fastdiv(static_cast<unsigned>(BW)), make_fastdiv(static_cast<unsigned>(BH)),
      static_cast<unsigned>(total));
  return true;
}

template <typename T>
bool dispatch_k(const void* go, const void* w, void* gin, const FastShape& s,
                cudaStream_t stream) {
  switch (s.K) {
    case 3:
      return run_s2<T, 3>(go, w, gin, s, stream);
    case 5:
      return run_s2<T, 5>(go, w, gin, s, stream);
    case 7:
      return run_s2<T, 7>(go, w, gin, s, stream);
    default:
      return false;
  }
}

}  // namespace

int current_sm_count() {
  static int cached[64] = {0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return 132;
  }
  if (dev >= 0 && dev < 64 && cached[dev] > 0) return cached[dev];
  int v = 0;
  if (cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || v <= 0) {
    (void)cudaGetLastError();
    v = 132;
  }
  if (dev >= 0 && dev < 64) cached[dev] = v;
  return v;
}

int resident_blocks_per_sm(const void* kernel, int threads, size_t smem) {
  static std::mutex mu;
  static std::map<std::tuple<int, const void*, int, size_t>, int> cache;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();
    dev = -1;
  }
  const auto key = std::make_tuple(dev, kernel, threads, smem);
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem) != cudaSuccess) {
    (void)cudaGetLastError();
    n = 1;
  }
  if (n < 1) n = 1;
  cache[key] = n;
  return n;
}

int pick_channel_vectors(int cv, int cap) {
  if (cv <= cap) return cv;
  for (int tx = cap; 2 * tx > cap; --tx)
    if (cv % tx == 0) return tx;
  const int nb = (cv + cap - 1) / cap;
  return (cv + nb - 1) / nb;
}

bool dgrad_v1_forced() {
  static const bool v = [] {
    const char* e = std::getenv("CUDADOCTOR_OPS_DW_DGRAD_V1");
    return e != nullptr && e[0] != '\0' && e[0] != '0';
  }();
  return v;
}

bool launch_bwd_input_nhwc_v2(DType dt, const void* go, const void* w, void* gin,
                              const FastShape& s, cudaStream_t stream) {
  if (s.N <= 0 || s.C <= 0 || s.H <= 0 || s.W <= 0 || s.Ho <= 0 || s.Wo <= 0) return false;
  if (s.S != 2 || !(s.K == 3 || s.K == 5 || s.K == 7) || s.PH < 0 || s.PW < 0) return false;
  // 16 bytes of channels per thread: C a multiple of 8 (16-bit) or 4 (float32),
  // 16-byte aligned grad_output and grad_input.
  const int V = dt == DType::F32 ? 4 : 8;
  if (s.C % V != 0 || (reinterpret_cast<uintptr_t>(go) & 15u) ||
      (reinterpret_cast<uintptr_t>(gin) & 15u))
    return false;
  switch (dt) {
    case DType::F32:
      return dispatch_k<float>(go, w, gin, s, stream);
    case DType::F16:
      return dispatch_k<c10::Half>(go, w, gin, s, stream);
    case DType::BF16:
      return dispatch_k<c10::BFloat16>(go, w, gin, s, stream);
  }
  return false;
}

}  // namespace depthwise
}  // namespace cudadoctor_ops
