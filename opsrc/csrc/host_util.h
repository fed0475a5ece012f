// Small helpers of the host code (csrc/*_host.cpp): autograd Functions and composite ops.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace cudadoctor_ops {

// An optional tensor argument that was given (present and defined).
inline bool has(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// An int list argument as a vector (what an autograd context's saved_data keeps).
inline std::vector<int64_t> vec(at::IntArrayRef v) { return std::vector<int64_t>(v.begin(), v.end()); }

}  // namespace cudadoctor_ops
