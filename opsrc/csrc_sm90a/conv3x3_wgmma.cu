// cudadoctor_ops._C_sm90a: the CUDA kernel of cudadoctor_ops::conv3x3_wgmma_stats (schema in
// csrc/ops.cpp), conv3x3_wgmma.cuh's Hopper tensor-core convolution with BatchNorm's sums in its
// epilogue. This module is compiled for sm_90a only (wgmma exists on no other target), so it is
// a separate extension that setup.py builds where the arch list holds 9.0; without it the op has
// no CUDA kernel and Conv+BN+ReLU's training forward keeps the ATen convolution.
#include <Python.h>

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <array>
#include <atomic>
#include <mutex>
#include <tuple>

#include "conv3x3_wgmma.cuh"

extern "C" {
// Makes the shared object importable as `cudadoctor_ops._C_sm90a`; the kernel registers at load.
PyObject* PyInit__C_sm90a(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C_sm90a",
      "cudadoctor_ops sm_90a kernels (registered in torch.ops.cudadoctor_ops)", -1, nullptr};
  return PyModule_Create(&module_def);
}
}

namespace cudadoctor_ops {
namespace wgmma_conv {
namespace {

// Completion counters of the launches' last-block reduction, one per launch in flight: a launch
// takes the next slot (round robin) and its last block puts the slot back to zero, so launches
// on different streams, or CUDA graphs holding launches, do not share a counter unless more than
// kSlots of them are in flight at once.
constexpr int kSlots = 1024;
__device__ unsigned g_counters[kSlots];

std::atomic<unsigned> g_next_slot{0};

struct DeviceState {
  std::once_flag once;
  unsigned* counters = nullptr;
  int sms = 0;
  bool ok = false;
};

DeviceState& device_state(int device) {
  static std::array<DeviceState, 64> states;
  TORCH_CHECK(device >= 0 && device < 64, "cudadoctor_ops.conv3x3_wgmma_stats: device index ",
              device, " out of range");
  DeviceState& s = states[device];
  std::call_once(s.once, [&] {
    const cudaDeviceProp* p = at::cuda::getDeviceProperties(device);
    s.sms = p->multiProcessorCount;
    s.ok = p->major == 9 && p->minor == 0;
    if (!s.ok) return;
    C10_CUDA_CHECK(cudaGetSymbolAddress(reinterpret_cast<void**>(&s.counters), g_counters));
    const int smem = make_geometry(1, 1, kMaxWidth).smem_bytes;  // the most any shape takes
    C10_CUDA_CHECK(cudaFuncSetAttribute(&conv3x3_wgmma_stats<__half>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    C10_CUDA_CHECK(cudaFuncSetAttribute(&conv3x3_wgmma_stats<__nv_bfloat16>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  });
  return s;
}

// -> (y channels_last, float32 [2, 64] sums of (y - shift) and (y - shift)^2 per channel)
std::tuple<at::Tensor, at::Tensor> conv3x3_wgmma_stats_cuda(const at::Tensor& input,
                                                            const at::Tensor& weight,
                                                            const std::optional<at::Tensor>& shift) {
  constexpr const char* op = "cudadoctor_ops.conv3x3_wgmma_stats";
  TORCH_CHECK(input.is_cuda() && input.dim() == 4, op,
              ": input must be a 4-D CUDA tensor (N, 64, H, W), got ", input.sizes(), " on ",
              input.device());
  const auto st = input.scalar_type();
  TORCH_CHECK(st == at::kHalf || st == at::kBFloat16, op,
              ": input must be float16 or bfloat16, got ", st);
  TORCH_CHECK(input.size(1) == kCi, op, ": input must have ", kCi, " channels, got ",
              input.size(1));
  TORCH_CHECK(weight.device() == input.device() && weight.scalar_type() == st &&
                  weight.dim() == 4 && weight.size(0) == kCo && weight.size(1) == kCi &&
                  weight.size(2) == 3 && weight.size(3) == 3,
              op, ": weight must be a [64, 64, 3, 3] tensor of the input's dtype and device, got ",
              weight.sizes(), " ", weight.scalar_type(), " on ", weight.device());
  const int64_t N = input.size(0), H = input.size(2), W = input.size(3);
  TORCH_CHECK(W >= 1 && W <= kMaxWidth && H >= 1 && N >= 1, op,
              ": input width must be 1 .. ", kMaxWidth, " and every size at least 1, got ",
              input.sizes());
  TORCH_CHECK(N * H <= (int64_t(1) << 30), op, ": input too large (N * H = ", N * H, ")");
  const float* shp = nullptr;
  at::Tensor sh;
  if (shift.has_value() && shift->defined()) {
    TORCH_CHECK(shift->device() == input.device() && shift->scalar_type() == at::kFloat &&
                    shift->numel() == kCo,
                op, ": shift must be a float32 tensor of ", kCo, " values on ", input.device(),
                ", got ", shift->sizes(), " ", shift->scalar_type(), " on ", shift->device());
    sh = shift->contiguous();
    shp = sh.data_ptr<float>();
  }
  c10::cuda::CUDAGuard guard(input.device());
  DeviceState& ds = device_state(input.get_device());
  TORCH_CHECK(ds.ok, op, ": needs a GPU of compute capability 9.0 (its kernel is sm_90a code), ",
              "this one is ", at::cuda::getDeviceProperties(input.get_device())->major, ".",
              at::cuda::getDeviceProperties(input.get_device())->minor);
  const auto aligned = [](const at::Tensor& t) {
    return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  };
  at::Tensor x = input.contiguous(at::MemoryFormat::ChannelsLast);
  if (!aligned(x)) x = x.clone(at::MemoryFormat::ChannelsLast);
  // [co][r][s][ci]: a view of a channels_last weight, a copy of any other
  at::Tensor w = weight.permute({0, 2, 3, 1}).contiguous();
  if (!aligned(w)) w = w.clone();
  at::Tensor y = at::empty(input.sizes(), input.options().memory_format(at::MemoryFormat::ChannelsLast));
  at::Tensor sums = at::empty({2, kCo}, input.options().dtype(at::kFloat));
  const Geometry g = make_geometry(static_cast<int>(N), static_cast<int>(H), static_cast<int>(W));
  const int grid = std::min(ds.sms, (g.tiles + 1) / 2);
  // per block: its two warpgroups' sums and sums of squares, combined in the block first
  at::Tensor partials = at::empty({int64_t(grid) * 2 * kCo}, input.options().dtype(at::kFloat));
  TensorMaps maps;
  if (const char* err = make_tensor_maps(&maps, x.data_ptr(), w.data_ptr(), y.data_ptr(), g,
                                         st == at::kBFloat16)) {
    TORCH_CHECK(false, op, ": ", err, " (input ", input.sizes(), ")");
  }
  unsigned* counter = ds.counters + (g_next_slot.fetch_add(1u, std::memory_order_relaxed) % kSlots);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(input.get_device()).stream();
  if (st == at::kHalf) {
    conv3x3_wgmma_stats<__half><<<grid, kThreads, g.smem_bytes, stream>>>(
        maps, shp, partials.data_ptr<float>(), sums.data_ptr<float>(), counter, g);
  } else {
    conv3x3_wgmma_stats<__nv_bfloat16><<<grid, kThreads, g.smem_bytes, stream>>>(
        maps, shp, partials.data_ptr<float>(), sums.data_ptr<float>(), counter, g);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {y, sums};
}

}  // namespace
}  // namespace wgmma_conv
}  // namespace cudadoctor_ops

TORCH_LIBRARY_IMPL(cudadoctor_ops, CUDA, m) {
  m.impl("conv3x3_wgmma_stats", &cudadoctor_ops::wgmma_conv::conv3x3_wgmma_stats_cuda);
}
