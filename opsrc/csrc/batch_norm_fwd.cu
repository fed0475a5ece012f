// BatchNorm forward (training and eval) and the running-statistics update.
//
// Training: bn_stats_* (Welford partials per channel slice, values shifted by K = the channel's
// first value so that large means keep their precision) -> bn_finalize_fwd (per channel merge,
// save_mean / save_invstd / reserve, apply coefficients) -> bn_apply_* (y = (x - K) * a + b,
// optional ReLU). Eval: bn_finalize_fwd from the running statistics -> bn_apply_*.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "batch_norm_common.cuh"

namespace cudadoctor_ops {
namespace bn {
namespace {

// Accumulates one pack of V values (already shifted by K) into a thread's Welford state.
template <typename A, typename T, int V>
__device__ __forceinline__ void welford_pack(const Pack<T, V>& p, A K, A& mean, A& m2, A& n) {
  if (V == 1) {
    const A v = static_cast<A>(p.v[0]) - K;
    n += A(1);
    const A d = v - mean;
    mean += fast_div(d, n);
    m2 += d * (v - mean);
  } else {
    A vals[V];
    A s = 0;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      vals[i] = static_cast<A>(p.v[i]) - K;
      s += vals[i];
    }
    const A lm = s * (A(1) / A(V));
    A lm2 = 0;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const A d = vals[i] - lm;
      lm2 += d * d;
    }
    welford_merge(mean, m2, n, lm, lm2, A(V));
  }
}

// x: [N, C, HW] contiguous, packs of V along HW. grid (C, splits), block kThreads.
// ws: [C, splits, 3] = (mean of x - K, M2, count) of this block's slice.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    bn_stats_nchw(const T* __restrict__ x, typename Acc<T>::type* __restrict__ ws, int64_t N,
                  int64_t C, int64_t HW) {
  using A = typename Acc<T>::type;
  const int64_t c = blockIdx.x;
  const int splits = gridDim.y;
  const int64_t packs = N * (HW / V);
  const int64_t chunk = (packs + splits - 1) / splits;
  const int64_t begin = blockIdx.y * chunk;
  const int64_t end = begin + chunk < packs ? begin + chunk : packs;
  const int64_t stride = blockDim.x;
  const A K = static_cast<A>(x[c * HW]);
  A mean = 0, m2 = 0, n = 0;
  int64_t j = begin + threadIdx.x;
  if (j < end) {
    NchwWalk w(j, stride, c, C, HW, V);
    for (; j < end; j += kUnroll * stride) {
      Pack<T, V> p[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (j + u * stride < end) p[u] = *reinterpret_cast<const Pack<T, V>*>(x + w.off);
        w.advance();
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (j + u * stride < end) welford_pack<A, T, V>(p[u], K, mean, m2, n);
    }
  }
  // block merge
  warp_welford(mean, m2, n);
  __shared__ A sm[3][kThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    sm[0][warp] = mean;
    sm[1][warp] = m2;
    sm[2][warp] = n;
  }
  __syncthreads();
  if (warp == 0) {
    const int nw = blockDim.x >> 5;
    mean = lane < nw ? sm[0][lane] : A(0);
    m2 = lane < nw ? sm[1][lane] : A(0);
    n = lane < nw ? sm[2][lane] : A(0);
    warp_welford(mean, m2, n);
    if (lane == 0) {
      A* o = ws + (c * splits + blockIdx.y) * 3;
      o[0] = mean;
      o[1] = m2;
      o[2] = n;
    }
  }
}

// x: [R, C] rows, C contiguous, packs of V channels. block (TX, TY), grid (ceil(C/V/TX), splits).
// ws: [C, splits, 3] as above. Dynamic shared memory: TY * TX * V * 3 accumulators.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    bn_stats_nhwc(const T* __restrict__ x, typename Acc<T>::type* __restrict__ ws, int64_t R,
                  int64_t C) {
  using A = typename Acc<T>::type;
  extern __shared__ unsigned char smem_raw[];
  A* sm = reinterpret_cast<A*>(smem_raw);
  const int64_t Cv = C / V;
  const int64_t cv = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool active = cv < Cv;
  const int splits = gridDim.y;
  A K[V], mean[V], m2[V];
  A n = 0;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    K[i] = 0;
    mean[i] = 0;
    m2[i] = 0;
  }
  if (active) {
    const Pack<T, V> k = *reinterpret_cast<const Pack<T, V>*>(x + cv * V);
#pragma unroll
    for (int i = 0; i < V; ++i) K[i] = static_cast<A>(k.v[i]);
    const int64_t rstride = int64_t(gridDim.y) * blockDim.y;
    for (int64_t r = int64_t(blockIdx.y) * blockDim.y + threadIdx.y; r < R;
         r += kUnroll * rstride) {
      Pack<T, V> p[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (r + u * rstride < R)
          p[u] = *reinterpret_cast<const Pack<T, V>*>(x + (r + u * rstride) * C + cv * V);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (r + u * rstride < R) {
          n += A(1);
          const A f = fast_div(A(1), n);
#pragma unroll
          for (int i = 0; i < V; ++i) {
            const A v = static_cast<A>(p[u].v[i]) - K[i];
            const A d = v - mean[i];
            mean[i] += d * f;
            m2[i] += d * (v - mean[i]);
          }
        }
      }
    }
  }
  // tree merge over threadIdx.y
  const int tx = threadIdx.x, TX = blockDim.x;
  auto slot = [&](int ty, int i, int k) -> A& { return sm[((ty * TX + tx) * V + i) * 3 + k]; };
#pragma unroll
  for (int i = 0; i < V; ++i) {
    slot(threadIdx.y, i, 0) = mean[i];
    slot(threadIdx.y, i, 1) = m2[i];
    slot(threadIdx.y, i, 2) = n;
  }
  __syncthreads();
  for (int s = blockDim.y >> 1; s > 0; s >>= 1) {
    if (threadIdx.y < s) {
#pragma unroll
      for (int i = 0; i < V; ++i) {
        A a0 = slot(threadIdx.y, i, 0), a1 = slot(threadIdx.y, i, 1), a2 = slot(threadIdx.y, i, 2);
        welford_merge(a0, a1, a2, slot(threadIdx.y + s, i, 0), slot(threadIdx.y + s, i, 1),
                      slot(threadIdx.y + s, i, 2));
        slot(threadIdx.y, i, 0) = a0;
        slot(threadIdx.y, i, 1) = a1;
        slot(threadIdx.y, i, 2) = a2;
      }
    }
    __syncthreads();
  }
  if (threadIdx.y == 0 && active) {
#pragma unroll
    for (int i = 0; i < V; ++i) {
      A* o = ws + ((cv * V + i) * splits + blockIdx.y) * 3;
      o[0] = slot(0, i, 0);
      o[1] = slot(0, i, 1);
      o[2] = slot(0, i, 2);
    }
  }
}

// One warp per channel. Writes save_mean, save_invstd, reserve (the part of the mean that
// save_mean's rounding lost) and coef [C, 3] = (K, a, b) for y = (x - K) * a + b.
// training: merges ws [C, splits, 3]; K = x[c * k_stride]. Eval: K = running_mean.
template <typename T>
__global__ void bn_finalize_fwd(const T* __restrict__ x, int64_t k_stride,
                                const typename Acc<T>::type* __restrict__ ws, int splits,
                                int64_t C, double eps, bool training, const void* rmean,
                                const void* rvar, int rkind, const void* weight, int wkind,
                                const void* bias, int bkind, typename Acc<T>::type* save_mean,
                                typename Acc<T>::type* save_invstd,
                                typename Acc<T>::type* reserve, typename Acc<T>::type* coef) {
  using A = typename Acc<T>::type;
  const int lane = threadIdx.x & 31;
  const int64_t c = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (c >= C) return;
  A K, ms, invstd;
  if (training) {
    A mean = 0, m2 = 0, n = 0;
    for (int s = lane; s < splits; s += 32) {
      const A* p = ws + (c * splits + s) * 3;
      welford_merge(mean, m2, n, p[0], p[1], p[2]);
    }
    warp_welford(mean, m2, n);
    if (lane != 0) return;
    K = static_cast<A>(x[c * k_stride]);
    ms = mean;
    const A var = n > A(0) ? m2 / n : A(0);
    invstd = inv_sqrt(var + static_cast<A>(eps));
  } else {
    if (lane != 0) return;
    K = load_param<A>(rmean, rkind, c, A(0));
    ms = 0;
    invstd = inv_sqrt(load_param<A>(rvar, rkind, c, A(1)) + static_cast<A>(eps));
  }
  const A full = K + ms;
  const A w = load_param<A>(weight, wkind, c, A(1));
  const A b = load_param<A>(bias, bkind, c, A(0));
  const A a = w * invstd;
  save_mean[c] = full;
  save_invstd[c] = invstd;
  reserve[c] = (K - full) + ms;
  coef[c * 3 + 0] = K;
  coef[c * 3 + 1] = a;
  coef[c * 3 + 2] = b - ms * a;
}

template <typename A>
__device__ __forceinline__ A act(A y, bool relu) {
  return (relu && y < A(0)) ? A(0) : y;  // NaN passes through like torch.relu
}

// x, y: [N, C, HW]; grid (C, splits) like bn_stats_nchw.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    bn_apply_nchw(const T* __restrict__ x, T* __restrict__ y,
                  const typename Acc<T>::type* __restrict__ coef, int64_t N, int64_t C,
                  int64_t HW, bool relu) {
  using A = typename Acc<T>::type;
  const int64_t c = blockIdx.x;
  const int splits = gridDim.y;
  const int64_t packs = N * (HW / V);
  const int64_t chunk = (packs + splits - 1) / splits;
  const int64_t begin = blockIdx.y * chunk;
  const int64_t end = begin + chunk < packs ? begin + chunk : packs;
  const int64_t stride = blockDim.x;
  const A K = coef[c * 3 + 0], a = coef[c * 3 + 1], b = coef[c * 3 + 2];
  int64_t j = begin + threadIdx.x;
  if (j >= end) return;
  NchwWalk w(j, stride, c, C, HW, V);
  for (; j < end; j += kUnroll * stride) {
    Pack<T, V> p[kUnroll];
    int64_t off[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      off[u] = w.off;
      if (j + u * stride < end) p[u] = *reinterpret_cast<const Pack<T, V>*>(x + w.off);
      w.advance();
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (j + u * stride < end) {
        Pack<T, V> o;
#pragma unroll
        for (int i = 0; i < V; ++i)
          o.v[i] = static_cast<T>(act((static_cast<A>(p[u].v[i]) - K) * a + b, relu));
        *reinterpret_cast<Pack<T, V>*>(y + off[u]) = o;
      }
    }
  }
}

// x, y: [R, C]; block/grid like bn_stats_nhwc.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    bn_apply_nhwc(const T* __restrict__ x, T* __restrict__ y,
                  const typename Acc<T>::type* __restrict__ coef, int64_t R, int64_t C,
                  bool relu) {
  using A = typename Acc<T>::type;
  const int64_t Cv = C / V;
  const int64_t cv = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (cv >= Cv) return;
  A K[V], a[V], b[V];
#pragma unroll
  for (int i = 0; i < V; ++i) {
    K[i] = coef[(cv * V + i) * 3 + 0];
    a[i] = coef[(cv * V + i) * 3 + 1];
    b[i] = coef[(cv * V + i) * 3 + 2];
  }
  const int64_t rstride = int64_t(gridDim.y) * blockDim.y;
  for (int64_t r = int64_t(blockIdx.y) * blockDim.y + threadIdx.y; r < R; r += kUnroll * rstride) {
    Pack<T, V> p[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (r + u * rstride < R)
        p[u] = *reinterpret_cast<const Pack<T, V>*>(x + (r + u * rstride) * C + cv * V);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (r + u * rstride < R) {
        Pack<T, V> o;
#pragma unroll
        for (int i = 0; i < V; ++i)
          o.v[i] = static_cast<T>(act((static_cast<A>(p[u].v[i]) - K[i]) * a[i] + b[i], relu));
        *reinterpret_cast<Pack<T, V>*>(y + (r + u * rstride) * C + cv * V) = o;
      }
    }
  }
}

template <typename T, int V>
void launch_forward(const Layout& l, const at::Tensor& out, bool training, double eps,
                    bool relu, const at::Tensor& rm, const at::Tensor& rv, const at::Tensor& w,
                    const at::Tensor& b, const at::Tensor& save_mean,
                    const at::Tensor& save_invstd, const at::Tensor& reserve) {
  using A = typename Acc<T>::type;
  const int device = l.x.get_device();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  const T* x = l.x.data_ptr<T>();
  T* y = out.data_ptr<T>();
  const auto acc_opts = save_mean.options();
  at::Tensor coef = at::empty({l.C, 3}, acc_opts);
  at::Tensor ws;
  int splits = 0;
  dim3 grid, block;
  size_t smem = 0;
  const int64_t R = l.N * l.HW;
  if (l.nhwc) {
    NhwcGrid g = nhwc_grid(l.C / V, R, device);
    grid = g.grid;
    block = g.block;
    splits = g.splits;
    smem = size_t(block.x) * block.y * V * 3 * sizeof(A);
  } else {
    splits = nchw_splits(l.C, l.N * (l.HW / V), device);
    grid = dim3(static_cast<unsigned>(l.C), static_cast<unsigned>(splits));
    block = dim3(kThreads);
  }
  if (training) {
    ws = at::empty({l.C * splits * 3}, acc_opts);
    if (l.nhwc) {
      bn_stats_nhwc<T, V><<<grid, block, smem, stream>>>(x, ws.data_ptr<A>(), R, l.C);
    } else {
      bn_stats_nchw<T, V><<<grid, block, 0, stream>>>(x, ws.data_ptr<A>(), l.N, l.C, l.HW);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  {
    const int warps = 8;
    const unsigned fgrid = static_cast<unsigned>((l.C + warps - 1) / warps);
    bn_finalize_fwd<T><<<fgrid, warps * 32, 0, stream>>>(
        x, l.nhwc ? 1 : l.HW, training ? ws.data_ptr<A>() : nullptr, splits, l.C, eps, training,
        param_ptr(rm), param_ptr(rv), param_kind(rm), param_ptr(w), param_kind(w), param_ptr(b),
        param_kind(b), save_mean.data_ptr<A>(), save_invstd.data_ptr<A>(), reserve.data_ptr<A>(),
        coef.data_ptr<A>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (l.nhwc) {
    bn_apply_nhwc<T, V><<<grid, block, 0, stream>>>(x, y, coef.data_ptr<A>(), R, l.C, relu);
  } else {
    bn_apply_nchw<T, V><<<grid, block, 0, stream>>>(x, y, coef.data_ptr<A>(), l.N, l.C, l.HW,
                                                    relu);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> batch_norm_cuda(
    const at::Tensor& input, const c10::optional<at::Tensor>& weight_opt,
    const c10::optional<at::Tensor>& bias_opt, const c10::optional<at::Tensor>& rm_opt,
    const c10::optional<at::Tensor>& rv_opt, bool training, double eps,
    c10::string_view activation) {
  check_input(input, "input");
  const bool relu = parse_relu(activation);
  const int64_t C = input.size(1);
  check_param(weight_opt, "weight", input, C);
  check_param(bias_opt, "bias", input, C);
  check_param(rm_opt, "running_mean", input, C);
  check_param(rv_opt, "running_var", input, C);
  const bool has_rm = rm_opt.has_value() && rm_opt->defined();
  const bool has_rv = rv_opt.has_value() && rv_opt->defined();
  TORCH_CHECK(training || (has_rm && has_rv),
              "cudadoctor_ops.batch_norm: running_mean and running_var must be given when "
              "training=False (they are the statistics used in eval mode)");
  TORCH_CHECK(eps >= 0, "cudadoctor_ops.batch_norm: eps must be >= 0, got ", eps);
  c10::cuda::CUDAGuard guard(input.device());

  const auto acc_type = input.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto acc_opts = input.options().dtype(acc_type);
  Layout l = make_layout(input);
  at::Tensor out = at::empty_like(l.x);
  at::Tensor save_mean = at::empty({C}, acc_opts);
  at::Tensor save_invstd = at::empty({C}, acc_opts);
  at::Tensor reserve = at::empty({C}, acc_opts);
  if (input.numel() == 0) {
    save_mean.zero_();
    save_invstd.zero_();
    reserve.zero_();
    return {out, save_mean, save_invstd, reserve};
  }
  const at::Tensor w = contig_param(weight_opt), b = contig_param(bias_opt);
  const at::Tensor rm = training ? at::Tensor() : contig_param(rm_opt);
  const at::Tensor rv = training ? at::Tensor() : contig_param(rv_opt);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "bn_fwd", [&] {
    constexpr int VW = 16 / sizeof(scalar_t);
    if (vec_width<scalar_t>(l, {l.x.data_ptr(), out.data_ptr()}) == VW) {
      launch_forward<scalar_t, VW>(l, out, training, eps, relu, rm, rv, w, b, save_mean,
                                   save_invstd, reserve);
    } else {
      launch_forward<scalar_t, 1>(l, out, training, eps, relu, rm, rv, w, b, save_mean,
                                  save_invstd, reserve);
    }
  });
  return {out, save_mean, save_invstd, reserve};
}

// running = (1 - momentum) * running + momentum * batch; unbiased batch var from save_invstd.
template <typename A>
__global__ void bn_update_stats(void* rmean, int mkind, void* rvar, int vkind,
                                const A* __restrict__ save_mean,
                                const A* __restrict__ save_invstd, int64_t C, double momentum,
                                double eps, int64_t count) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const A m = static_cast<A>(momentum);
  const A inv = save_invstd[c];
  A var = A(1) / (inv * inv) - static_cast<A>(eps);
  if (var < A(0)) var = A(0);
  // count == 1 divides by zero (inf/nan) like torch; the Python layer refuses that case first.
  const A unbiased = var * (static_cast<A>(count) / static_cast<A>(count - 1));
  const A old_m = load_param<A>(rmean, mkind, c, A(0));
  const A old_v = load_param<A>(rvar, vkind, c, A(0));
  store_param<A>(rmean, mkind, c, (A(1) - m) * old_m + m * save_mean[c]);
  store_param<A>(rvar, vkind, c, (A(1) - m) * old_v + m * unbiased);
}

void batch_norm_update_stats_cuda(const at::Tensor& running_mean, const at::Tensor& running_var,
                                  const at::Tensor& save_mean, const at::Tensor& save_invstd,
                                  double momentum, double eps, int64_t count) {
  const int64_t C = save_mean.numel();
  TORCH_CHECK(running_mean.is_cuda() && running_var.is_cuda(),
              "cudadoctor_ops.batch_norm_update_stats: running_mean and running_var must be CUDA "
              "tensors, got ", running_mean.device(), " and ", running_var.device());
  TORCH_CHECK(running_mean.device() == save_mean.device() &&
                  running_var.device() == save_mean.device(),
              "cudadoctor_ops.batch_norm_update_stats: running_mean/running_var must be on ",
              save_mean.device());
  TORCH_CHECK(running_mean.dim() == 1 && running_mean.numel() == C,
              "cudadoctor_ops.batch_norm_update_stats: running_mean must have shape [", C,
              "], got ", running_mean.sizes());
  TORCH_CHECK(running_var.dim() == 1 && running_var.numel() == C,
              "cudadoctor_ops.batch_norm_update_stats: running_var must have shape [", C,
              "], got ", running_var.sizes());
  TORCH_CHECK(running_mean.is_contiguous() && running_var.is_contiguous(),
              "cudadoctor_ops.batch_norm_update_stats: running_mean and running_var must be "
              "contiguous (they are updated in place)");
  TORCH_CHECK(save_mean.scalar_type() == save_invstd.scalar_type() &&
                  (save_mean.scalar_type() == at::kFloat ||
                   save_mean.scalar_type() == at::kDouble),
              "cudadoctor_ops.batch_norm_update_stats: save_mean/save_invstd must be float32 or "
              "float64 (as returned by batch_norm)");
  TORCH_CHECK(param_kind(running_mean) != kAbsent && param_kind(running_var) != kAbsent,
              "cudadoctor_ops.batch_norm_update_stats: running stats must be floating point, got ",
              running_mean.scalar_type(), " and ", running_var.scalar_type());
  if (C == 0 || count <= 0) return;
  c10::cuda::CUDAGuard guard(save_mean.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(save_mean.get_device()).stream();
  const at::Tensor sm = save_mean.contiguous(), si = save_invstd.contiguous();
  const unsigned grid = static_cast<unsigned>((C + 255) / 256);
  if (sm.scalar_type() == at::kDouble) {
    bn_update_stats<double><<<grid, 256, 0, stream>>>(
        running_mean.data_ptr(), param_kind(running_mean), running_var.data_ptr(),
        param_kind(running_var), sm.data_ptr<double>(), si.data_ptr<double>(), C, momentum, eps,
        count);
  } else {
    bn_update_stats<float><<<grid, 256, 0, stream>>>(
        running_mean.data_ptr(), param_kind(running_mean), running_var.data_ptr(),
        param_kind(running_var), sm.data_ptr<float>(), si.data_ptr<float>(), C, momentum, eps,
        count);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace bn
}  // namespace cudadoctor_ops

TORCH_LIBRARY_IMPL(cudadoctor_ops, CUDA, m) {
  m.impl("batch_norm", &cudadoctor_ops::bn::batch_norm_cuda);
  m.impl("batch_norm_update_stats", &cudadoctor_ops::bn::batch_norm_update_stats_cuda);
}
