// Small helpers of the host code (csrc/*_host.cpp): autograd Functions and composite ops.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace cudadoctor_ops {

// An optional tensor argument that was given (present and defined).
inline bool has(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// An int list argument as a vector (what an autograd context's saved_data keeps).
inline std::vector<int64_t> vec(at::IntArrayRef v) { return std::vector<int64_t>(v.begin(), v.end()); }

// A plain CUDA tensor of an eager call: no tensor subclass, functionalization, vmap or dispatch
// mode is involved (those must see the ops themselves, e.g. under torch.compile or opcheck).
inline bool plain_cuda(const at::Tensor& t) {
  if (!t.is_cuda()) return false;
  constexpr c10::DispatchKeySet kWrapped({c10::DispatchKey::Python,
                                          c10::DispatchKey::PythonTLSSnapshot,
                                          c10::DispatchKey::Functionalize,
                                          c10::DispatchKey::FuncTorchBatched,
                                          c10::DispatchKey::FuncTorchGradWrapper,
                                          c10::DispatchKey::Conjugate, c10::DispatchKey::Negative});
  return !t.key_set().has_any(kWrapped);
}

// Conv+BN+Add+ReLU's residual: the convolution output's sizes, dtype and device.
inline void check_residual(const char* op, const at::Tensor& residual, const at::Tensor& conv_out) {
  TORCH_CHECK(residual.sizes() == conv_out.sizes() &&
                  residual.scalar_type() == conv_out.scalar_type() &&
                  residual.device() == conv_out.device(),
              op, ": residual must have the convolution output's sizes ", conv_out.sizes(),
              ", dtype ", conv_out.scalar_type(), " and device ", conv_out.device(), ", got ",
              residual.sizes(), " ", residual.scalar_type(), " on ", residual.device());
}

}  // namespace cudadoctor_ops
