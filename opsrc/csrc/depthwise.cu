// Depthwise 2-D convolution (groups == input channels): argument checks,
// direct reference kernels, fast-path selection and the CUDA registrations of
//   cudadoctor_ops::depthwise_conv2d
//   cudadoctor_ops::depthwise_conv2d_backward_input
//   cudadoctor_ops::depthwise_conv2d_backward_weight
//
// The direct kernels (one thread per output element, any kernel size, stride,
// dilation, padding, channel multiplier, dtype incl. float64, NCHW or
// channels_last) are the correctness anchor; impl=1 forces them. impl=0 picks
// the fast kernels of depthwise_fwd.cu / depthwise_wgrad.cu where they apply
// (forward: the second-generation kernels, falling back to the first-generation
// ones); impl=2 ("tiled_v1") is impl=0 with the forward pinned to the
// first-generation kernels, kept so that old and new can be timed side by side;
// impl=3 ("nhwc_v3") runs the channels_last forward on the third-generation
// kernel where it applies (float32 too); impl=4 ("v2") pins the forward to the
// second-generation kernels (the default before nhwc_v3). The backward ops
// treat 2, 3 and 4 like 0.
#include <array>
#include <optional>
#include <tuple>

#include <ATen/AccumulateType.h>
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "depthwise.cuh"

namespace cudadoctor_ops {
namespace depthwise {
namespace {

constexpr int kThreads = 256;

struct Geom {
  int64_t N, C, H, W;  // input; C = input channels
  int64_t Co, Ho, Wo;  // output
  int64_t KH, KW, SH, SW, PH, PW, DH, DW, mult;
};

struct Strides {
  int64_t n, c, h, w;
};

Strides strides_of(const at::Tensor& t) {
  return {t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}

// Decompose a linear index in the memory order of the layout so that
// consecutive threads touch consecutive addresses (W fastest for NCHW, C
// fastest for channels_last).
__device__ __forceinline__ void decompose(int64_t idx, bool cl, int64_t C,
                                          int64_t H, int64_t W, int64_t& n,
                                          int64_t& c, int64_t& h, int64_t& w) {
  if (cl) {
    c = idx % C;
    idx /= C;
    w = idx % W;
    idx /= W;
    h = idx % H;
    n = idx / H;
  } else {
    w = idx % W;
    idx /= W;
    h = idx % H;
    idx /= H;
    c = idx % C;
    n = idx / C;
  }
}

// out[n,oc,oy,ox] = bias[oc] + sum_{kh,kw} in[n,oc/mult,iy,ix] * w[oc,0,kh,kw]
//   in, out: 4-D with arbitrary strides; w [Co,1,KH,KW] contiguous; bias [Co] or null.
template <typename T, typename A>
__global__ void direct_fwd(const T* __restrict__ in, const T* __restrict__ w,
                           const T* __restrict__ bias, T* __restrict__ out,
                           Geom g, Strides is, Strides os, bool cl,
                           int64_t total) {
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       idx < total; idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t n, oc, oy, ox;
    decompose(idx, cl, g.Co, g.Ho, g.Wo, n, oc, oy, ox);
    const int64_t ic = oc / g.mult;
    A acc = bias != nullptr ? static_cast<A>(bias[oc]) : A(0);
    const T* ip = in + n * is.n + ic * is.c;
    const T* wp = w + oc * g.KH * g.KW;
    for (int64_t kh = 0; kh < g.KH; ++kh) {
      const int64_t iy = oy * g.SH - g.PH + kh * g.DH;
      if (iy < 0 || iy >= g.H) continue;
      for (int64_t kw = 0; kw < g.KW; ++kw) {
        const int64_t ix = ox * g.SW - g.PW + kw * g.DW;
        if (ix < 0 || ix >= g.W) continue;
        acc += static_cast<A>(ip[iy * is.h + ix * is.w]) * static_cast<A>(wp[kh * g.KW + kw]);
      }
    }
    out[n * os.n + oc * os.c + oy * os.h + ox * os.w] = static_cast<T>(acc);
  }
}

// gin[n,ic,iy,ix] = sum_{m,kh,kw} gout[n,ic*mult+m,oy,ox] * w[ic*mult+m,0,kh,kw]
// over the (oy,ox) with oy*SH-PH+kh*DH == iy and ox*SW-PW+kw*DW == ix.
template <typename T, typename A>
__global__ void direct_bwd_input(const T* __restrict__ gout,
                                 const T* __restrict__ w, T* __restrict__ gin,
                                 Geom g, Strides gs, Strides is, bool cl,
                                 int64_t total) {
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       idx < total; idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t n, ic, iy, ix;
    decompose(idx, cl, g.C, g.H, g.W, n, ic, iy, ix);
    A acc = A(0);
    for (int64_t m = 0; m < g.mult; ++m) {
      const int64_t oc = ic * g.mult + m;
      const T* gp = gout + n * gs.n + oc * gs.c;
      const T* wp = w + oc * g.KH * g.KW;
      for (int64_t kh = 0; kh < g.KH; ++kh) {
        const int64_t ty = iy + g.PH - kh * g.DH;
        if (ty < 0 || ty % g.SH != 0) continue;
        const int64_t oy = ty / g.SH;
        if (oy >= g.Ho) continue;
        for (int64_t kw = 0; kw < g.KW; ++kw) {
          const int64_t tx = ix + g.PW - kw * g.DW;
          if (tx < 0 || tx % g.SW != 0) continue;
          const int64_t ox = tx / g.SW;
          if (ox >= g.Wo) continue;
          acc += static_cast<A>(gp[oy * gs.h + ox * gs.w]) * static_cast<A>(wp[kh * g.KW + kw]);
        }
      }
    }
    gin[n * is.n + ic * is.c + iy * is.h + ix * is.w] = static_cast<T>(acc);
  }
}

// One block per (oc, tap); tap == KH*KW is the bias sum. The block reduces
// over all (n, oy, ox) with a fixed-order tree, so the result is deterministic.
//   gw [Co,1,KH,KW] contiguous, gb [Co] or null.
template <typename T, typename A>
__global__ void direct_bwd_weight(const T* __restrict__ gout,
                                  const T* __restrict__ in, T* __restrict__ gw,
                                  T* __restrict__ gb, Geom g, Strides gs,
                                  Strides is) {
  const int64_t KK = g.KH * g.KW;
  const int64_t oc = blockIdx.x / (KK + 1);
  const int64_t tap = blockIdx.x % (KK + 1);
  if (tap == KK && gb == nullptr) return;
  const int64_t ic = oc / g.mult;
  const int64_t kh = tap < KK ? tap / g.KW : 0;
  const int64_t kw = tap < KK ? tap % g.KW : 0;
  const int64_t count = g.N * g.Ho * g.Wo;
  A acc = A(0);
  for (int64_t j = threadIdx.x; j < count; j += blockDim.x) {
    const int64_t ox = j % g.Wo;
    const int64_t t = j / g.Wo;
    const int64_t oy = t % g.Ho;
    const int64_t n = t / g.Ho;
    const A go = static_cast<A>(gout[n * gs.n + oc * gs.c + oy * gs.h + ox * gs.w]);
    if (tap == KK) {
      acc += go;
      continue;
    }
    const int64_t iy = oy * g.SH - g.PH + kh * g.DH;
    const int64_t ix = ox * g.SW - g.PW + kw * g.DW;
    if (iy < 0 || iy >= g.H || ix < 0 || ix >= g.W) continue;
    acc += go * static_cast<A>(in[n * is.n + ic * is.c + iy * is.h + ix * is.w]);
  }
  __shared__ A red[kThreads];
  red[threadIdx.x] = acc;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    if (tap < KK)
      gw[oc * KK + tap] = static_cast<T>(red[0]);
    else
      gb[oc] = static_cast<T>(red[0]);
  }
}

unsigned grid_for(int64_t total) {
  int64_t blocks = (total + kThreads - 1) / kThreads;
  const int64_t cap = int64_t(1) << 20;
  if (blocks > cap) blocks = cap;
  if (blocks < 1) blocks = 1;
  return static_cast<unsigned>(blocks);
}

std::array<int64_t, 2> pair_arg(at::IntArrayRef v, const char* name) {
  TORCH_CHECK(v.size() == 1 || v.size() == 2, "depthwise_conv2d: ", name,
              " must be an int or a pair of ints, got ", v.size(), " values");
  return {v[0], v.size() == 2 ? v[1] : v[0]};
}

bool use_channels_last(const at::Tensor& input) {
  return !input.is_contiguous() && input.is_contiguous(at::MemoryFormat::ChannelsLast);
}

// Validates the arguments shared by the three ops and returns the geometry.
Geom check_args(const char* op, const at::Tensor& input, const at::Tensor& weight,
                at::IntArrayRef stride, at::IntArrayRef padding,
                at::IntArrayRef dilation) {
  TORCH_CHECK(input.dim() == 4, op, ": input must be 4-D (N, C, H, W), got ", input.dim(),
              "-D with sizes ", input.sizes());
  TORCH_CHECK(input.is_cuda(), op, ": input must be a CUDA tensor, got device ", input.device());
  TORCH_CHECK(weight.device() == input.device(), op, ": weight is on ", weight.device(),
              " but input is on ", input.device(), "; move both to the same CUDA device");
  TORCH_CHECK(weight.scalar_type() == input.scalar_type(), op, ": weight dtype ",
              weight.scalar_type(), " does not match input dtype ", input.scalar_type());
  const auto st = input.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kHalf || st == at::kBFloat16 || st == at::kDouble, op,
              ": input dtype must be float32, float16, bfloat16 or float64, got ", st);
  const int64_t C = input.size(1);
  TORCH_CHECK(weight.dim() == 4 && weight.size(1) == 1 && weight.size(0) > 0 && C > 0 &&
                  weight.size(0) % C == 0 && weight.size(2) > 0 && weight.size(3) > 0,
              op, ": weight must have shape [C*multiplier, 1, kh, kw] with C = ", C,
              " input channels (groups == C), got weight sizes ", weight.sizes());
  const auto s = pair_arg(stride, "stride");
  const auto p = pair_arg(padding, "padding");
  const auto d = pair_arg(dilation, "dilation");
  TORCH_CHECK(s[0] > 0 && s[1] > 0, op, ": stride must be positive, got ", stride);
  TORCH_CHECK(p[0] >= 0 && p[1] >= 0, op, ": padding must be non-negative, got ", padding);
  TORCH_CHECK(d[0] > 0 && d[1] > 0, op, ": dilation must be positive, got ", dilation);
  Geom g;
  g.N = input.size(0);
  g.C = C;
  g.H = input.size(2);
  g.W = input.size(3);
  g.Co = weight.size(0);
  g.mult = g.Co / C;
  g.KH = weight.size(2);
  g.KW = weight.size(3);
  g.SH = s[0];
  g.SW = s[1];
  g.PH = p[0];
  g.PW = p[1];
  g.DH = d[0];
  g.DW = d[1];
  const int64_t eh = g.DH * (g.KH - 1) + 1;
  const int64_t ew = g.DW * (g.KW - 1) + 1;
  TORCH_CHECK(g.H + 2 * g.PH >= eh && g.W + 2 * g.PW >= ew, op, ": padded input ",
              g.H + 2 * g.PH, "x", g.W + 2 * g.PW, " is smaller than the dilated kernel ", eh,
              "x", ew, " (input ", g.H, "x", g.W, ", padding ", padding, ", kernel ", g.KH, "x",
              g.KW, ", dilation ", dilation, ")");
  g.Ho = (g.H + 2 * g.PH - eh) / g.SH + 1;
  g.Wo = (g.W + 2 * g.PW - ew) / g.SW + 1;
  return g;
}

bool fast_dtype(at::ScalarType st, DType& dt) {
  switch (st) {
    case at::kFloat:
      dt = DType::F32;
      return true;
    case at::kHalf:
      dt = DType::F16;
      return true;
    case at::kBFloat16:
      dt = DType::BF16;
      return true;
    default:
      return false;
  }
}

// The fast kernels cover multiplier 1, square K in {3,5,7}, equal strides in
// {1,2}, dilation 1, symmetric-per-axis padding, sizes within int range.
bool fast_geom(const Geom& g) {
  return g.mult == 1 && g.KH == g.KW && (g.KH == 3 || g.KH == 5 || g.KH == 7) && g.SH == g.SW &&
         (g.SH == 1 || g.SH == 2) && g.DH == 1 && g.DW == 1 && g.H < (1 << 30) &&
         g.W < (1 << 30) && g.C < (1 << 30) && g.N < (1 << 30) &&
         g.N * g.C * g.H * g.W < (int64_t(1) << 40);
}

FastShape fast_shape(const Geom& g) {
  FastShape s;
  s.N = static_cast<int>(g.N);
  s.C = static_cast<int>(g.C);
  s.H = static_cast<int>(g.H);
  s.W = static_cast<int>(g.W);
  s.Ho = static_cast<int>(g.Ho);
  s.Wo = static_cast<int>(g.Wo);
  s.K = static_cast<int>(g.KH);
  s.S = static_cast<int>(g.SH);
  s.PH = static_cast<int>(g.PH);
  s.PW = static_cast<int>(g.PW);
  return s;
}

constexpr int64_t kImplAuto = 0;
constexpr int64_t kImplDirect = 1;
constexpr int64_t kImplTiledV1 = 2;
constexpr int64_t kImplNhwcV3 = 3;
constexpr int64_t kImplV2 = 4;
// impl=5 ("nhwc_v4"): the channels_last forward on the fourth-generation direct
// kernel where it applies (float16/bfloat16), else the second-generation kernels;
// the backward ops treat it like the other forward-only codes.
constexpr int64_t kImplNhwcV4 = 5;

void check_impl(int64_t impl) {
  TORCH_CHECK(impl >= kImplAuto && impl <= kImplNhwcV4,
              "depthwise_conv2d: impl must be 0 (auto), 1 (direct), 2 (tiled_v1), 3 (nhwc_v3), "
              "4 (v2) or 5 (nhwc_v4), got ", impl);
}

at::Tensor forward_cuda(const at::Tensor& input_, const at::Tensor& weight_,
                        const std::optional<at::Tensor>& bias_, at::IntArrayRef stride,
                        at::IntArrayRef padding, at::IntArrayRef dilation, int64_t impl) {
  const char* op = "depthwise_conv2d";
  check_impl(impl);
  const Geom g = check_args(op, input_, weight_, stride, padding, dilation);
  at::Tensor bias;
  if (bias_.has_value() && bias_->defined()) {
    bias = *bias_;
    TORCH_CHECK(bias.device() == input_.device(), op, ": bias is on ", bias.device(),
                " but input is on ", input_.device());
    TORCH_CHECK(bias.scalar_type() == input_.scalar_type(), op, ": bias dtype ",
                bias.scalar_type(), " does not match input dtype ", input_.scalar_type());
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == g.Co, op, ": bias must have shape [", g.Co,
                "], got ", bias.sizes());
    bias = bias.contiguous();
  }
  c10::cuda::CUDAGuard guard(input_.device());
  const bool cl = use_channels_last(input_);
  const auto fmt = cl ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
  const at::Tensor input = input_.contiguous(fmt);
  const at::Tensor weight = weight_.contiguous();
  at::Tensor out = at::empty({g.N, g.Co, g.Ho, g.Wo}, input.options().memory_format(fmt));
  if (out.numel() == 0) return out;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  DType dt;
  if (impl != kImplDirect && fast_dtype(input.scalar_type(), dt) && fast_geom(g)) {
    const FastShape s = fast_shape(g);
    const void* bp = bias.defined() ? bias.data_ptr() : nullptr;
    if (impl == kImplAuto || impl == kImplNhwcV3 || impl == kImplV2 || impl == kImplNhwcV4) {
      const void* ip = input.data_ptr();
      const void* wp = weight.data_ptr();
      void* op_ = out.data_ptr();
      bool ok2 = false;
      if (!cl)
        ok2 = (impl == kImplAuto && launch_fwd_nchw_shfl(dt, ip, wp, bp, op_, s, false, stream)) ||
              launch_fwd_nchw_v2(dt, ip, wp, bp, op_, s, false, stream);
      else if (impl == kImplAuto)
        ok2 = launch_fwd_nhwc_v2(dt, ip, wp, bp, op_, s, false, stream);
      else
        ok2 = (impl == kImplNhwcV3 && launch_fwd_nhwc_v3(dt, ip, wp, bp, op_, s, false, stream)) ||
              (impl == kImplNhwcV4 && launch_fwd_nhwc_v4(dt, ip, wp, bp, op_, s, false, stream)) ||
              launch_fwd_nhwc_v2_kernel(dt, ip, wp, bp, op_, s, false, stream);
      if (ok2) {
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        return out;
      }
    }
    const bool ok = cl ? launch_fwd_nhwc(dt, input.data_ptr(), weight.data_ptr(), bp,
                                         out.data_ptr(), s, false, stream)
                       : launch_fwd_nchw(dt, input.data_ptr(), weight.data_ptr(), bp,
                                         out.data_ptr(), s, false, stream);
    if (ok) {
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return out;
    }
  }
  const int64_t total = out.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "depthwise_conv2d", [&] {
    using A = at::acc_type<scalar_t, true>;
    direct_fwd<scalar_t, A><<<grid_for(total), kThreads, 0, stream>>>(
        input.const_data_ptr<scalar_t>(), weight.const_data_ptr<scalar_t>(),
        bias.defined() ? bias.const_data_ptr<scalar_t>() : nullptr,
        out.mutable_data_ptr<scalar_t>(), g, strides_of(input), strides_of(out), cl, total);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

// grad_output must have the forward's output shape; returns a tensor shaped
// like input (in input's layout).
at::Tensor backward_input_cuda(const at::Tensor& grad_out_, const at::Tensor& input_,
                               const at::Tensor& weight_, at::IntArrayRef stride,
                               at::IntArrayRef padding, at::IntArrayRef dilation, int64_t impl) {
  const char* op = "depthwise_conv2d_backward_input";
  check_impl(impl);
  const Geom g = check_args(op, input_, weight_, stride, padding, dilation);
  TORCH_CHECK(grad_out_.device() == input_.device(), op, ": grad_output is on ",
              grad_out_.device(), " but input is on ", input_.device());
  TORCH_CHECK(grad_out_.scalar_type() == input_.scalar_type(), op, ": grad_output dtype ",
              grad_out_.scalar_type(), " does not match input dtype ", input_.scalar_type());
  TORCH_CHECK(grad_out_.dim() == 4 && grad_out_.size(0) == g.N && grad_out_.size(1) == g.Co &&
                  grad_out_.size(2) == g.Ho && grad_out_.size(3) == g.Wo,
              op, ": grad_output must have sizes [", g.N, ", ", g.Co, ", ", g.Ho, ", ", g.Wo,
              "], got ", grad_out_.sizes());
  c10::cuda::CUDAGuard guard(input_.device());
  const bool cl = use_channels_last(input_);
  const auto fmt = cl ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
  const at::Tensor gout = grad_out_.contiguous(fmt);
  const at::Tensor weight = weight_.contiguous();
  at::Tensor gin = at::empty({g.N, g.C, g.H, g.W}, input_.options().memory_format(fmt));
  if (gin.numel() == 0) return gin;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  DType dt;
  // Stride 1: dX = conv(dY, rot180(w), padding K-1-p), output H x W.
  if (impl != kImplDirect && fast_dtype(gout.scalar_type(), dt) && fast_geom(g) && g.SH == 1) {
    FastShape s;
    s.N = static_cast<int>(g.N);
    s.C = static_cast<int>(g.C);
    s.H = static_cast<int>(g.Ho);
    s.W = static_cast<int>(g.Wo);
    s.Ho = static_cast<int>(g.H);
    s.Wo = static_cast<int>(g.W);
    s.K = static_cast<int>(g.KH);
    s.S = 1;
    s.PH = static_cast<int>(g.KH - 1 - g.PH);
    s.PW = static_cast<int>(g.KW - 1 - g.PW);
    // The forward's kernel choice (the current fast kernels; impl=tiled_v1 the first-generation
    // ones, impl=v2 / nhwc_v3 those generations) on dY with the flipped filter.
    const void* gp = gout.data_ptr();
    const void* wp = weight.data_ptr();
    void* xp = gin.data_ptr();
    bool ok = false;
    if (impl != kImplTiledV1) {
      if (!cl)
        ok = (impl == kImplAuto && launch_fwd_nchw_shfl(dt, gp, wp, nullptr, xp, s, true, stream)) ||
             launch_fwd_nchw_v2(dt, gp, wp, nullptr, xp, s, true, stream);
      else if (impl == kImplAuto)
        ok = launch_fwd_nhwc_v2(dt, gp, wp, nullptr, xp, s, true, stream);
      else
        ok = (impl == kImplNhwcV3 && launch_fwd_nhwc_v3(dt, gp, wp, nullptr, xp, s, true, stream)) ||
             launch_fwd_nhwc_v2_kernel(dt, gp, wp, nullptr, xp, s, true, stream);
    }
    if (!ok)
      ok = cl ? launch_fwd_nhwc(dt, gp, wp, nullptr, xp, s, true, stream)
              : launch_fwd_nchw(dt, gp, wp, nullptr, xp, s, true, stream);
    if (ok) {
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return gin;
    }
  }
  // Stride 2, channels_last: gather kernel over the stride grid. impl=auto runs the
  // second-generation kernel (2 x 2 input pixels x 16 bytes of channels per thread) where it
  // applies, unless CUDADOCTOR_OPS_DW_DGRAD_V1=1; otherwise, and for the other fast impls, the
  // first-generation one.
  if (impl != kImplDirect && cl && fast_dtype(gout.scalar_type(), dt) && fast_geom(g) && g.SH != 1) {
    const FastShape s = fast_shape(g);
    const bool ok =
        (impl == kImplAuto && !dgrad_v1_forced() &&
         launch_bwd_input_nhwc_v2(dt, gout.data_ptr(), weight.data_ptr(), gin.data_ptr(), s,
                                  stream)) ||
        launch_bwd_input_nhwc(dt, gout.data_ptr(), weight.data_ptr(), gin.data_ptr(), s, stream);
    if (ok) {
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return gin;
    }
  }
  const int64_t total = gin.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gout.scalar_type(), "depthwise_conv2d_backward_input", [&] {
    using A = at::acc_type<scalar_t, true>;
    direct_bwd_input<scalar_t, A><<<grid_for(total), kThreads, 0, stream>>>(
        gout.const_data_ptr<scalar_t>(), weight.const_data_ptr<scalar_t>(),
        gin.mutable_data_ptr<scalar_t>(), g, strides_of(gout), strides_of(gin), cl, total);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return gin;
}

// Returns (grad_weight [Co,1,KH,KW], grad_bias [Co] or [0] when bias_grad is false).
std::tuple<at::Tensor, at::Tensor> backward_weight_cuda(
    const at::Tensor& grad_out_, const at::Tensor& input_, const at::Tensor& weight_,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, bool bias_grad,
    int64_t impl) {
  const char* op = "depthwise_conv2d_backward_weight";
  check_impl(impl);
  const Geom g = check_args(op, input_, weight_, stride, padding, dilation);
  TORCH_CHECK(grad_out_.device() == input_.device(), op, ": grad_output is on ",
              grad_out_.device(), " but input is on ", input_.device());
  TORCH_CHECK(grad_out_.scalar_type() == input_.scalar_type(), op, ": grad_output dtype ",
              grad_out_.scalar_type(), " does not match input dtype ", input_.scalar_type());
  TORCH_CHECK(grad_out_.dim() == 4 && grad_out_.size(0) == g.N && grad_out_.size(1) == g.Co &&
                  grad_out_.size(2) == g.Ho && grad_out_.size(3) == g.Wo,
              op, ": grad_output must have sizes [", g.N, ", ", g.Co, ", ", g.Ho, ", ", g.Wo,
              "], got ", grad_out_.sizes());
  c10::cuda::CUDAGuard guard(input_.device());
  const bool cl = use_channels_last(input_);
  const auto fmt = cl ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
  const at::Tensor input = input_.contiguous(fmt);
  const at::Tensor gout = grad_out_.contiguous(fmt);
  at::Tensor gw = at::empty({g.Co, 1, g.KH, g.KW}, input.options().memory_format(
                                                        at::MemoryFormat::Contiguous));
  at::Tensor gb = at::empty({bias_grad ? g.Co : 0}, input.options().memory_format(
                                                          at::MemoryFormat::Contiguous));
  if (g.N * g.Ho * g.Wo == 0) {
    gw.zero_();
    gb.zero_();
    return {gw, gb};
  }
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  DType dt;
  if (impl != kImplDirect && fast_dtype(input.scalar_type(), dt) && fast_geom(g)) {
    const FastShape s = fast_shape(g);
    const int64_t wsn = wgrad_workspace(dt, cl, s);
    if (wsn > 0) {
      at::Tensor ws = at::empty({wsn}, input.options().dtype(at::kFloat).memory_format(
                                           at::MemoryFormat::Contiguous));
      const bool ok = launch_wgrad(dt, cl, gout.data_ptr(), input.data_ptr(), gw.data_ptr(),
                                   bias_grad ? gb.data_ptr() : nullptr,
                                   ws.mutable_data_ptr<float>(), s, stream);
      if (ok) {
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        return {gw, gb};
      }
    }
  }
  const int64_t blocks = g.Co * (g.KH * g.KW + 1);
  TORCH_CHECK(blocks < (int64_t(1) << 31), op, ": too many weight elements (", blocks, ")");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "depthwise_conv2d_backward_weight", [&] {
    using A = at::acc_type<scalar_t, true>;
    direct_bwd_weight<scalar_t, A><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        gout.const_data_ptr<scalar_t>(), input.const_data_ptr<scalar_t>(),
        gw.mutable_data_ptr<scalar_t>(), bias_grad ? gb.mutable_data_ptr<scalar_t>() : nullptr, g,
        strides_of(gout), strides_of(input));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {gw, gb};
}

}  // namespace
}  // namespace depthwise
}  // namespace cudadoctor_ops

TORCH_LIBRARY_IMPL(cudadoctor_ops, CUDA, m) {
  m.impl("depthwise_conv2d", &cudadoctor_ops::depthwise::forward_cuda);
  m.impl("depthwise_conv2d_backward_input", &cudadoctor_ops::depthwise::backward_input_cuda);
  m.impl("depthwise_conv2d_backward_weight", &cudadoctor_ops::depthwise::backward_weight_cuda);
}
