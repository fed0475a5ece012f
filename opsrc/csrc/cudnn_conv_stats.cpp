// cudnn_conv_stats: the convolution of Conv+BN+ReLU's training forward with BatchNorm's batch
// statistics computed in its epilogue, through cuDNN's graph API from C++ (the header-only C++
// API of nvidia-cudnn-frontend), so that a call costs what a plain ATen convolution costs on the
// host instead of the Python frontend's graph execute (0.21-0.24 ms per call on the H200
// machine, cudadoctor_ops/cudnn_stats.py).
//
// One cuDNN graph per block shape: conv_fprop -> Y (written out, channels_last), D = Y - shift
// (the running mean before this step) or D = Y, and two ADD reductions over N, H, W in float32:
// sums[0] = sum(D), sums[1] = sum(D * D). Graphs are built on first use of a shape (cuDNN
// compiles the kernel at run time, which synchronises) and kept for the process; a shape cuDNN
// has no engine for is remembered with cuDNN's reason and declined from then on.
//
// Built only where setup.py finds the frontend's headers and cuDNN's (CUDADOCTOR_OPS_CUDNN_FE);
// without them the op has no CUDA kernel and cudadoctor_ops/cudnn_stats.py uses the Python
// frontend, if any.
#ifdef CUDADOCTOR_OPS_CUDNN_FE

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/cudnn/Handle.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cudnn_frontend.h>
#include <torch/library.h>

namespace cudadoctor_ops {
namespace cudnn_stats {
namespace {

namespace fe = cudnn_frontend;
using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

struct Plan {
  std::shared_ptr<fe::graph::Graph> graph;
  TensorPtr X, W, Y, SH, S1, S2;
  int64_t workspace = 0;
  bool shifted = false;
};

std::mutex g_mu;
// key -> plan; a null plan: declined (g_why has cuDNN's reason)
std::map<std::vector<int64_t>, std::shared_ptr<Plan>> g_plans;
std::map<std::vector<int64_t>, std::string> g_why;

std::vector<int64_t> channels_last_strides(const std::vector<int64_t>& d) {
  // d = (n, c, h, w)
  return {d[2] * d[3] * d[1], 1, d[3] * d[1], d[1]};
}

// Builds the graph; null with `why` set where a step fails (no engine for the shape, typically).
std::shared_ptr<Plan> build(cudnnHandle_t handle, fe::DataType_t dt, const std::vector<int64_t>& xd,
                            const std::vector<int64_t>& wd, const std::vector<int64_t>& yd,
                            const std::vector<int64_t>& stride, const std::vector<int64_t>& padding,
                            const std::vector<int64_t>& dilation, bool shifted, std::string& why) {
  const int64_t k = wd[0];
  auto p = std::make_shared<Plan>();
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(dt)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  p->X = g->tensor(fe::graph::Tensor_attributes()
                       .set_name("X")
                       .set_dim(xd)
                       .set_stride(channels_last_strides(xd))
                       .set_data_type(dt));
  p->W = g->tensor(fe::graph::Tensor_attributes()
                       .set_name("W")
                       .set_dim(wd)
                       .set_stride(channels_last_strides(wd))
                       .set_data_type(dt));
  p->Y = g->conv_fprop(p->X, p->W,
                       fe::graph::Conv_fprop_attributes()
                           .set_padding(padding)
                           .set_stride(stride)
                           .set_dilation(dilation));
  p->Y->set_output(true).set_data_type(dt).set_dim(yd).set_stride(channels_last_strides(yd));
  TensorPtr d = p->Y;
  if (shifted) {
    p->SH = g->tensor(fe::graph::Tensor_attributes()
                          .set_name("SHIFT")
                          .set_dim({1, k, 1, 1})
                          .set_stride({k, 1, k, k})
                          .set_data_type(fe::DataType_t::FLOAT));
    d = g->pointwise(p->Y, p->SH,
                     fe::graph::Pointwise_attributes().set_mode(fe::PointwiseMode_t::SUB));
  }
  const auto sum = [&](const TensorPtr& t) {
    return g->reduction(t, fe::graph::Reduction_attributes()
                               .set_mode(fe::ReductionMode_t::ADD)
                               .set_compute_data_type(fe::DataType_t::FLOAT));
  };
  p->S1 = sum(d);
  p->S2 = sum(g->pointwise(d, d, fe::graph::Pointwise_attributes().set_mode(fe::PointwiseMode_t::MUL)));
  for (const TensorPtr& s : {p->S1, p->S2})
    s->set_output(true).set_data_type(fe::DataType_t::FLOAT).set_dim({1, k, 1, 1}).set_stride(
        {k, 1, k, k});
  const auto ok = [&](const fe::error_t& e, const char* step) {
    if (!e.is_bad()) return true;
    why = std::string(step) + ": " + e.err_msg;
    return false;
  };
  if (!ok(g->validate(), "validate") || !ok(g->build_operation_graph(handle), "build_operation_graph") ||
      !ok(g->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}),
          "create_execution_plans") ||
      !ok(g->check_support(handle), "check_support") || !ok(g->build_plans(handle), "build_plans"))
    return nullptr;
  int64_t ws = 0;
  if (!ok(g->get_workspace_size(ws), "get_workspace_size")) return nullptr;
  p->graph = g;
  p->workspace = ws > 0 ? ws : 1;
  p->shifted = shifted;
  return p;
}

fe::DataType_t fe_type(at::ScalarType st) {
  return st == at::kHalf ? fe::DataType_t::HALF : fe::DataType_t::BFLOAT16;
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// -> (conv output channels_last, float32 [2, K] sums, status, reason): status 1 when the sums are
// of (y - shift), 0 when of y (no shift given, or cuDNN declined the shifted graph), -1 when the
// op declined the call (`reason` says why): no engine for the shape, or a
// CUDA-graph capture before the shape's graph was built (building synchronises); y and sums are
// then empty tensors.
std::tuple<at::Tensor, at::Tensor, int64_t, std::string> cudnn_conv_stats_cuda(
    const at::Tensor& input, const at::Tensor& weight, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, const std::optional<at::Tensor>& shift) {
  constexpr const char* op = "cudadoctor_ops.cudnn_conv_stats";
  TORCH_CHECK(input.is_cuda() && input.dim() == 4 && weight.dim() == 4, op,
              ": input and weight must be 4-D CUDA tensors, got ", input.sizes(), " on ",
              input.device(), " and ", weight.sizes());
  const auto st = input.scalar_type();
  TORCH_CHECK((st == at::kHalf || st == at::kBFloat16) && weight.scalar_type() == st &&
                  weight.device() == input.device(),
              op, ": input and weight must both be float16 or both bfloat16 on one device, got ",
              st, " and ", weight.scalar_type(), " on ", weight.device());
  TORCH_CHECK(input.is_contiguous(at::MemoryFormat::ChannelsLast) && aligned16(input), op,
              ": input must be channels_last and 16-byte aligned, got strides ", input.strides());
  TORCH_CHECK(stride.size() == 2 && padding.size() == 2 && dilation.size() == 2, op,
              ": stride, padding and dilation must have 2 values each");
  const int64_t n = input.size(0), c = input.size(1), h = input.size(2), w = input.size(3);
  const int64_t k = weight.size(0), kh = weight.size(2), kw = weight.size(3);
  TORCH_CHECK(weight.size(1) == c && c % 8 == 0 && k % 8 == 0, op,
              ": weight must be [K, C, kh, kw] with C and K multiples of 8 (groups 1), got ",
              weight.sizes(), " for C = ", c);
  const bool want_shift = shift.has_value() && shift->defined();
  if (want_shift) {
    TORCH_CHECK(shift->scalar_type() == at::kFloat && shift->is_contiguous() &&
                    shift->numel() == k && shift->device() == input.device(),
                op, ": shift must be a contiguous float32 tensor of ", k, " values on ",
                input.device(), ", got ", shift->sizes(), " ", shift->scalar_type());
  }
  const int64_t ho = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) / stride[0] + 1;
  const int64_t wo = (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) / stride[1] + 1;
  const auto declined = [&](std::string why) {
    return std::make_tuple(at::empty({0}, input.options()),
                           at::empty({0}, input.options().dtype(at::kFloat)), int64_t(-1),
                           std::move(why));
  };
  if (ho <= 0 || wo <= 0 || n * ho * wo <= 1 || n == 0) return declined("empty or 1-value output");
  c10::cuda::CUDAGuard guard(input.device());
  const std::vector<int64_t> key = {input.get_device(), n, c, h, w, k, kh, kw, stride[0], stride[1],
                                    padding[0], padding[1], dilation[0], dilation[1],
                                    static_cast<int64_t>(st), want_shift ? 1 : 0};
  std::shared_ptr<Plan> plan;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_plans.find(key);
    if (it != g_plans.end()) {
      if (!it->second) return declined(g_why[key]);
      plan = it->second;
    } else {
      if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None)
        return declined("CUDA-graph capture before this shape's cuDNN graph was built");
      cudnnHandle_t handle = at::native::getCudnnHandle();
      std::string why;
      const std::vector<int64_t> xd = {n, c, h, w}, wd = {k, c, kh, kw}, yd = {n, k, ho, wo};
      const std::vector<int64_t> sv(stride.begin(), stride.end()), pv(padding.begin(), padding.end()),
          dv(dilation.begin(), dilation.end());
      // the shifted graph first; where cuDNN has no engine for it, the plain sums
      for (const bool with_shift : want_shift ? std::vector<bool>{true, false} : std::vector<bool>{false}) {
        std::string step_why;
        try {
          plan = build(handle, fe_type(st), xd, wd, yd, sv, pv, dv, with_shift, step_why);
        } catch (const std::exception& e) {
          plan = nullptr;
          step_why = std::string("exception: ") + e.what();
        }
        if (plan) break;
        why += (why.empty() ? "" : "; ") + std::string(with_shift ? "shifted: " : "plain: ") + step_why;
      }
      g_plans[key] = plan;
      if (!plan) {
        g_why[key] = why;
        return declined(why);
      }
    }
  }
  const at::Tensor wt = weight.contiguous(at::MemoryFormat::ChannelsLast);
  TORCH_CHECK(aligned16(wt), op, ": weight must be 16-byte aligned");
  at::Tensor y = at::empty({n, ho, wo, k}, input.options()).permute({0, 3, 1, 2});
  at::Tensor sums = at::empty({2, k}, input.options().dtype(at::kFloat));
  at::Tensor ws = at::empty({plan->workspace}, input.options().dtype(at::kByte));
  std::unordered_map<TensorPtr, void*> pack = {
      {plan->X, input.data_ptr()}, {plan->W, wt.data_ptr()}, {plan->Y, y.data_ptr()},
      {plan->S1, sums.data_ptr<float>()}, {plan->S2, sums.data_ptr<float>() + k}};
  if (plan->shifted) pack[plan->SH] = shift->data_ptr();
  cudnnHandle_t handle = at::native::getCudnnHandle();
  TORCH_CHECK(cudnnSetStream(handle, c10::cuda::getCurrentCUDAStream().stream()) ==
                  CUDNN_STATUS_SUCCESS,
              op, ": cudnnSetStream failed");
  const fe::error_t e = plan->graph->execute(handle, pack, ws.data_ptr());
  if (e.is_bad()) {
    // nothing written that the caller reads: the usual path runs instead, now and from now on
    std::lock_guard<std::mutex> lock(g_mu);
    g_plans[key] = nullptr;
    g_why[key] = "execute: " + e.err_msg;
    return declined(g_why[key]);
  }
  return std::make_tuple(y, sums, int64_t(plan->shifted ? 1 : 0), std::string());
}

}  // namespace
}  // namespace cudnn_stats
}  // namespace cudadoctor_ops

TORCH_LIBRARY_IMPL(cudadoctor_ops, CUDA, m) {
  m.impl("cudnn_conv_stats", &cudadoctor_ops::cudnn_stats::cudnn_conv_stats_cuda);
}

#endif  // CUDADOCTOR_OPS_CUDNN_FE
