// Depthwise 2-D convolution: shared declarations between the op file
// (depthwise.cu) and the fast-path kernel files (depthwise_fwd.cu,
// depthwise_wgrad.cu).
//
// The fast kernels take raw pointers and a small shape struct so that their
// translation units need no ATen headers at all; the launchers return false
// when a case is outside what the fast kernels handle, and the caller then
// runs the direct (reference) kernels.
#pragma once

#include <cstdint>
#include <cstring>
#include <cuda_runtime.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace cudadoctor_ops {
namespace depthwise {

enum class DType { F32, F16, BF16 };

// q = n / d for n, d < 2^31 by multiply-high and shift (Granlund-Montgomery,
// as in ATen's IntDivider): shift = ceil(log2 d), m = floor(2^32 (2^shift - d) / d) + 1,
// q = (umulhi(n, m) + n) >> shift (the sum fits in 32 bits since n < 2^31). Made on the
// host, passed to kernels by value: three instructions instead of a division's twenty-odd.
struct FastDiv {
  unsigned d, m;
  int shift;
};

inline FastDiv make_fastdiv(unsigned d) {
  FastDiv f;
  f.d = d;
  f.shift = 0;
  while ((1ull << f.shift) < d) ++f.shift;
  f.m = static_cast<unsigned>(((1ull << 32) * ((1ull << f.shift) - d)) / d + 1);
  return f;
}

__device__ __forceinline__ unsigned fdiv(unsigned n, const FastDiv& f) {
  return (__umulhi(n, f.m) + n) >> f.shift;
}

// Shape of one depthwise convolution with channel multiplier 1, square
// kernel K, equal stride S on both axes and dilation 1 (the fast-path case).
// Padding may be negative: the input-gradient path runs the forward kernel
// with padding K-1-p, which is negative when p > K-1.
struct FastShape {
  int N, C, H, W;   // input
  int Ho, Wo;       // output
  int K, S;         // kernel size, stride
  int PH, PW;       // padding (top/left)
};

// The plane sizes of s into a kernel's argument struct (fields C, H, W, Ho, Wo, PH, PW).
template <typename Args>
inline void set_plane_sizes(Args& a, const FastShape& s) {
  a.C = s.C;
  a.H = s.H;
  a.W = s.W;
  a.Ho = s.Ho;
  a.Wo = s.Wo;
  a.PH = s.PH;
  a.PW = s.PW;
}

// Forward (or, with flip=true and stride 1, input gradient) for contiguous
// NCHW tensors: `in` [N,C,H,W], `w` [C,1,K,K], `bias` [C] or null,
// `out` [N,C,Ho,Wo].
bool launch_fwd_nchw(DType dt, const void* in, const void* w, const void* bias,
                     void* out, const FastShape& s, bool flip,
                     cudaStream_t stream);

// Same for channels_last tensors: `in` [N,H,W,C] in memory, `out` [N,Ho,Wo,C].
bool launch_fwd_nhwc(DType dt, const void* in, const void* w, const void* bias,
                     void* out, const FastShape& s, bool flip,
                     cudaStream_t stream);

// Second-generation forward kernels (the default forward path). Same contract
// as launch_fwd_nchw / launch_fwd_nhwc; they return false where they do not
// apply (the caller then tries the first-generation kernels above).
//   NCHW: 16-byte aligned chunk loads of the input tile rows into shared
//         memory (many in flight per thread), 4 outputs per thread along W
//         times R rows.
//   NHWC: the default channels_last forward: launch_fwd_nhwc_v3 for float16 and
//         bfloat16 where it applies, else launch_fwd_nhwc_v2_kernel.
bool launch_fwd_nchw_v2(DType dt, const void* in, const void* w, const void* bias,
                        void* out, const FastShape& s, bool flip,
                        cudaStream_t stream);
bool launch_fwd_nhwc_v2(DType dt, const void* in, const void* w, const void* bias,
                        void* out, const FastShape& s, bool flip,
                        cudaStream_t stream);

// Float32 NCHW at stride 1, 3x3 / 5x5 with padding (K-1)/2 along W, W % 4 == 0, 16-byte
// aligned input and output: one warp per 128 columns x 4 output rows (by default 3x3 only;
// CUDADOCTOR_OPS_DW_V2_SHFL, depthwise_fwd.cu), loads straight from global memory and the columns
// around each lane's 16 bytes from its neighbours by shuffles. The default (auto) forward and
// stride-1 input gradient try it before launch_fwd_nchw_v2; false where it does not apply.
bool launch_fwd_nchw_shfl(DType dt, const void* in, const void* w, const void* bias,
                          void* out, const FastShape& s, bool flip,
                          cudaStream_t stream);

// The second-generation channels_last kernel alone: 16 bytes of channels per
// thread (8 for 16-bit types, 4 for float32) times several output pixels along
// W, loaded straight from global memory; needs C a multiple of that and
// 16-byte aligned input and output.
bool launch_fwd_nhwc_v2_kernel(DType dt, const void* in, const void* w, const void* bias,
                               void* out, const FastShape& s, bool flip,
                               cudaStream_t stream);

// Third-generation channels_last kernel (all three fast dtypes): each block
// stages its input tile (rows x columns x a chunk of channels) in shared
// memory with cp.async, band by band, and computes 16 bytes of channels times
// several output pixels along W per thread from there. Same requirements as
// launch_fwd_nhwc_v2_kernel; also false where one output row of a tile does
// not fit in the shared-memory budget.
bool launch_fwd_nhwc_v3(DType dt, const void* in, const void* w, const void* bias,
                        void* out, const FastShape& s, bool flip,
                        cudaStream_t stream);

// Fourth-generation channels_last kernel (depthwise_fwd_v4.cu), float16 and
// bfloat16 only: a direct kernel without input staging. Each thread computes 8
// channels (one 16-byte vector) x RW consecutive outputs of one output row,
// loading the input vectors of every kernel row straight from global memory;
// a block covers a small patch of outputs x a chunk of channels so that its
// threads share the input lines in L1. Weights staged in shared memory as
// float32. Same contract as launch_fwd_nhwc_v3; false (nothing launched) for
// float32, C % 8 != 0, input or output not 16-byte aligned, K/S outside the
// fast set, a padded plane (H, W plus a kernel extent each side, times C) of
// 2^31 or more elements (32-bit offsets inside an image), or a grid over the
// launch limit. Block shape and outputs per thread come from
// CUDADOCTOR_OPS_DW_V4_CFG=0..4 (read once; see the file).
bool launch_fwd_nhwc_v4(DType dt, const void* in, const void* w, const void* bias,
                        void* out, const FastShape& s, bool flip,
                        cudaStream_t stream);

// false when CUDADOCTOR_OPS_DW_V4=0 (read once): launch_fwd_nhwc_v2 then does
// not try the fourth-generation kernel first.
bool fwd_nhwc_v4_enabled();

// Input gradient for channels_last tensors, any stride in the fast set (the
// shape is the forward's: H,W input, Ho,Wo output, PH,PW the forward padding).
//   go [N,Ho,Wo,C] in memory, w [C,1,K,K], gin [N,H,W,C] in memory.
bool launch_bwd_input_nhwc(DType dt, const void* go, const void* w, void* gin,
                           const FastShape& s, cudaStream_t stream);

// Second-generation input gradient for channels_last at stride 2
// (depthwise_bwd_input.cu): 16 bytes of channels (8 for 16-bit types, 4 for
// float32) times a 2 x 2 block of input pixels per thread, both row and both
// column parities, so the taps of each pixel are fixed at compile time. Same
// contract as launch_bwd_input_nhwc; false where it does not apply (stride not
// 2, K not 3/5/7, C not a multiple of the vector, grad_output or grad_input
// not 16-byte aligned, more than 2^31 pixel blocks).
bool launch_bwd_input_nhwc_v2(DType dt, const void* go, const void* w, void* gin,
                              const FastShape& s, cudaStream_t stream);

// CUDADOCTOR_OPS_DW_DGRAD_V1 set to 1 (read once): the stride-2 channels_last
// input gradient keeps the first-generation kernel (launch_bwd_input_nhwc).
bool dgrad_v1_forced();

// Launch-planning helpers of the channels_last backward kernels
// (depthwise_bwd_input.cu): SMs of the current device (cached); resident
// blocks per SM of `kernel` at this block size and dynamic shared memory
// (cached per device, kernel, threads, smem, so that a workspace query and the
// launch that follows plan alike); channel vectors per block: cv itself when
// it is <= cap, else a divisor of cv in (cap/2, cap], else an even split over
// ceil(cv/cap) blocks.
int current_sm_count();
int resident_blocks_per_sm(const void* kernel, int threads, size_t smem);
int pick_channel_vectors(int cv, int cap);

// Weight (and optionally bias) gradient. Number of float32 workspace
// elements the launcher needs; 0 means the fast path does not apply.
int64_t wgrad_workspace(DType dt, bool channels_last, const FastShape& s);

// `go` grad output, `in` input (same layout), `gw` [C,1,K,K] contiguous,
// `gb` [C] or null, `ws` at least wgrad_workspace() floats.
bool launch_wgrad(DType dt, bool channels_last, const void* go, const void* in,
                  void* gw, void* gb, float* ws, const FastShape& s,
                  cudaStream_t stream);

// ---------------------------------------------------------------------------
// Device helpers shared by the kernel files.

template <typename T>
__device__ __forceinline__ float to_float(T v) {
  return static_cast<float>(v);
}

template <typename T>
__device__ __forceinline__ T from_float(float v) {
  return static_cast<T>(v);
}

template <int BYTES>
struct RawVec;
template <>
struct RawVec<16> { using type = uint4; };
template <>
struct RawVec<8> { using type = uint2; };
template <>
struct RawVec<4> { using type = unsigned int; };
template <>
struct RawVec<2> { using type = unsigned short; };

// V elements (V*sizeof(T) bytes, aligned) through the read-only path as
// float; zeros without a memory access when !ok.
template <typename T, int V>
__device__ __forceinline__ void ldg_vec_or_zero(const T* p, bool ok, float (&out)[V]) {
  using R = typename RawVec<sizeof(T) * V>::type;
  R r{};
  if (ok) r = __ldg(reinterpret_cast<const R*>(p));
  T tmp[V];
  memcpy(tmp, &r, sizeof(R));
#pragma unroll
  for (int i = 0; i < V; ++i) out[i] = to_float(tmp[i]);
}

// Load V consecutive elements (aligned to V*sizeof(T)) as one vector access.
template <typename T, int V>
__device__ __forceinline__ void load_vec(const T* p, float (&out)[V]) {
  using R = typename RawVec<sizeof(T) * V>::type;
  R r = __ldg(reinterpret_cast<const R*>(p));
  T tmp[V];
  memcpy(tmp, &r, sizeof(R));
#pragma unroll
  for (int i = 0; i < V; ++i) out[i] = static_cast<float>(tmp[i]);
}

// One element through the read-only path, as float.
template <typename T>
__device__ __forceinline__ float ldg_float(const T* p) {
  float v[1];
  load_vec<T, 1>(p, v);
  return v[0];
}

template <typename T, int V>
__device__ __forceinline__ void store_vec(T* p, const float (&in)[V]) {
  using R = typename RawVec<sizeof(T) * V>::type;
  T tmp[V];
#pragma unroll
  for (int i = 0; i < V; ++i) tmp[i] = static_cast<T>(in[i]);
  R r;
  memcpy(&r, tmp, sizeof(R));
  *reinterpret_cast<R*>(p) = r;
}

}  // namespace depthwise
}  // namespace cudadoctor_ops
