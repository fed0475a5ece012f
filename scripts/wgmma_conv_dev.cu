// Standalone check of opsrc/csrc_sm90a/conv3x3_wgmma.cuh on an sm_90 GPU, without torch:
// outputs against a direct float32 convolution, sums against float64 sums of the outputs, and
// kernel times (L2 flushed before each launch).
//
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -I opsrc/csrc_sm90a \
//        scripts/wgmma_conv_dev.cu -o /tmp/wgmma_conv_dev && /tmp/wgmma_conv_dev
//
// Exit status 0 when every shape matches, 1 otherwise. With an argument ("small"): only the shapes
// of at most 2000 pixels and no timing, for runs under compute-sanitizer.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <type_traits>
#include <vector>

#include "conv3x3_wgmma.cuh"

using namespace cudadoctor_ops::wgmma_conv;

#define CK(x)                                                                        \
  do {                                                                               \
    cudaError_t e_ = (x);                                                            \
    if (e_ != cudaSuccess) {                                                         \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(2);                                                                  \
    }                                                                                \
  } while (0)

template <typename T>
__global__ void ref_conv(const T* x, const T* w, float* y, int N, int H, int W) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t total = int64_t(N) * H * W * 64;
  if (i >= total) return;
  const int co = i % 64;
  const int64_t p = i / 64;
  const int wc = p % W, h = (p / W) % H, n = p / (int64_t(W) * H);
  float acc = 0.f;
  for (int r = 0; r < 3; ++r)
    for (int s = 0; s < 3; ++s) {
      const int hh = h + r - 1, ww = wc + s - 1;
      if (hh < 0 || hh >= H || ww < 0 || ww >= W) continue;
      const T* xp = x + ((int64_t(n) * H + hh) * W + ww) * 64;
      const T* wp = w + (co * 9 + r * 3 + s) * 64;
      for (int ci = 0; ci < 64; ++ci) acc += dev::to_f(xp[ci]) * dev::to_f(wp[ci]);
    }
  y[i] = acc;
}

__device__ unsigned g_counter;

float host_f(__half v) { return __half2float(v); }
float host_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T>
T host_t(float v);
template <>
__half host_t<__half>(float v) { return __float2half_rn(v); }
template <>
__nv_bfloat16 host_t<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

struct Dev {
  int sms;
  unsigned* counter;
  char* flush;
};

template <typename T>
float launch(const Dev& dv, const Geometry& g, const T* x, const T* w, T* y, const float* shift,
             float* partials, float* sums, bool time_it) {
  const int grid = std::min(dv.sms, (g.tiles + 1) / 2);
  CK(cudaFuncSetAttribute(conv3x3_wgmma_stats<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          g.smem_bytes));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  TensorMaps maps;
  if (const char* err = make_tensor_maps(&maps, x, w, y, g, sizeof(T) == 2 && !std::is_same<T, __half>::value)) {
    std::printf("tensor maps: %s\n", err);
    std::exit(2);
  }
  if (time_it) CK(cudaMemsetAsync(dv.flush, 0, 256 << 20));
  CK(cudaEventRecord(a));
  conv3x3_wgmma_stats<T><<<grid, kThreads, g.smem_bytes>>>(maps, shift, partials, sums,
                                                           dv.counter, g);
  CK(cudaGetLastError());
  CK(cudaEventRecord(b));
  CK(cudaEventSynchronize(b));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, a, b));
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  return ms * 1000.f;
}

template <typename T>
bool run_shape(const Dev& dv, int N, int H, int W, bool timing, const char* dt) {
  const Geometry g = make_geometry(N, H, W);
  const int64_t nx = int64_t(N) * H * W * 64, nw = 64 * 9 * 64;
  std::vector<T> hx(nx), hw(nw);
  std::vector<float> hshift(64);
  uint32_t s = 12345u + N * 7 + H * 13 + W;
  auto rnd = [&] {
    s = s * 1664525u + 1013904223u;
    return (s >> 8) * (1.0f / 16777216.0f) * 2.f - 1.f;
  };
  for (auto& v : hx) v = host_t<T>(rnd() + 0.3f);
  for (auto& v : hw) v = host_t<T>(rnd() * 0.06f);
  for (auto& v : hshift) v = rnd() * 0.5f;
  T *x, *w, *y;
  float *ref, *partials, *sums, *shift;
  const int grid = std::min(dv.sms, (g.tiles + 1) / 2);
  CK(cudaMalloc(&x, nx * sizeof(T)));
  CK(cudaMalloc(&w, nw * sizeof(T)));
  CK(cudaMalloc(&y, nx * sizeof(T)));
  CK(cudaMalloc(&ref, nx * sizeof(float)));
  CK(cudaMalloc(&partials, grid * 128 * sizeof(float)));
  CK(cudaMalloc(&sums, 128 * sizeof(float)));
  CK(cudaMalloc(&shift, 64 * sizeof(float)));
  CK(cudaMemcpy(x, hx.data(), nx * sizeof(T), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(w, hw.data(), nw * sizeof(T), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(shift, hshift.data(), 64 * sizeof(float), cudaMemcpyHostToDevice));
  ref_conv<T><<<(nx + 255) / 256, 256>>>(x, w, ref, N, H, W);
  CK(cudaGetLastError());
  std::vector<float> href(nx);
  std::vector<T> hy(nx);
  std::vector<float> hs(128);
  CK(cudaMemcpy(href.data(), ref, nx * sizeof(float), cudaMemcpyDeviceToHost));
  bool ok_any = false;
  {
    CK(cudaMemset(y, 0xff, nx * sizeof(T)));
    launch<T>(dv, g, x, w, y, shift, partials, sums, false);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(hy.data(), y, nx * sizeof(T), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hs.data(), sums, 128 * sizeof(float), cudaMemcpyDeviceToHost));
    double worst = 0;
    int64_t bad = 0, first_bad = -1;
    std::vector<double> s1(64, 0), s2(64, 0), a1(64, 0);
    for (int64_t i = 0; i < nx; ++i) {
      const float v = host_f(hy[i]), r = href[i];
      const double err = std::fabs(double(v) - r) / (1e-2 + std::fabs(r));
      if (!(err <= 8e-3)) {
        if (first_bad < 0) first_bad = i;
        ++bad;
      }
      if (err > worst || std::isnan(v)) worst = std::isnan(v) ? 1e30 : err;
      const int co = i % 64;
      const double dd = double(v) - hshift[co];
      s1[co] += dd;
      a1[co] += std::fabs(dd);
      s2[co] += dd * dd;
    }
    double sworst = 0;
    for (int co = 0; co < 64; ++co) {
      sworst = std::max(sworst, std::fabs(hs[co] - s1[co]) / (1e-3 + a1[co]));
      sworst = std::max(sworst, std::fabs(hs[64 + co] - s2[co]) / (1e-3 + s2[co]));
    }
    const bool ok = bad == 0 && sworst < 1e-5;
    std::printf("%s N=%d H=%d W=%d R=%d tiles=%d grid=%d smem=%d: %s (bad %lld of %lld, first %lld, worst rel %.3g; sums rel %.3g of sum |v - shift|)\n",
                dt, N, H, W, g.R, g.tiles, grid, g.smem_bytes, ok ? "OK" : "MISMATCH",
                (long long)bad, (long long)nx, (long long)first_bad, worst, sworst);
    if (!ok && first_bad >= 0) {
      const int64_t i = first_bad;
      std::printf("  first bad: co %lld pix %lld got %g want %g\n", (long long)(i % 64),
                  (long long)(i / 64), host_f(hy[i]), href[i]);
    }
    ok_any = ok;
  }
  if (ok_any && timing) {
    std::vector<float> ts;
    for (int it = 0; it < 30; ++it)
      ts.push_back(launch<T>(dv, g, x, w, y, shift, partials, sums, true));
    std::sort(ts.begin(), ts.end());
    std::vector<float> tw;
    for (int it = 0; it < 30; ++it)
      tw.push_back(launch<T>(dv, g, x, w, y, shift, partials, sums, false));
    std::sort(tw.begin(), tw.end());
    std::printf("  time %s N=%d H=%d W=%d: median %.1f us (L2 flushed; min %.1f), %.1f us warm\n",
                dt, N, H, W, ts[ts.size() / 2], ts[0], tw[tw.size() / 2]);
  }
  // the counter must be back to zero
  unsigned c = 1;
  CK(cudaMemcpy(&c, dv.counter, sizeof(unsigned), cudaMemcpyDeviceToHost));
  if (c != 0) {
    std::printf("  counter left at %u\n", c);
    ok_any = false;
  }
  CK(cudaFree(x));
  CK(cudaFree(w));
  CK(cudaFree(y));
  CK(cudaFree(ref));
  CK(cudaFree(partials));
  CK(cudaFree(sums));
  CK(cudaFree(shift));
  return ok_any;
}

int main(int argc, char**) {
  const bool small = argc > 1;
  Dev dv{};
  CK(cudaDeviceGetAttribute(&dv.sms, cudaDevAttrMultiProcessorCount, 0));
  CK(cudaGetSymbolAddress(reinterpret_cast<void**>(&dv.counter), g_counter));
  CK(cudaMemset(dv.counter, 0, sizeof(unsigned)));
  CK(cudaMalloc(&dv.flush, 256 << 20));
  bool all = true;
  struct S {
    int n, h, w;
    bool t;
  };
  const S shapes[] = {{32, 56, 56, true}, {64, 56, 56, true}, {1, 5, 7, false},
                      {3, 28, 28, false}, {2, 13, 89, false}, {5, 14, 14, false},
                      {4, 7, 7, false},   {1, 57, 55, false},  {2, 1, 1, false}};
  for (const S& sh : shapes) {
    if (small && sh.n * sh.h * sh.w > 2000) continue;
    all &= run_shape<__half>(dv, sh.n, sh.h, sh.w, sh.t && !small, "fp16");
    all &= run_shape<__nv_bfloat16>(dv, sh.n, sh.h, sh.w, sh.t && !small && sh.n == 32, "bf16");
  }
  std::printf("%s\n", all ? "ALL OK" : "SOME MISMATCH");
  return all ? 0 : 1;
}
