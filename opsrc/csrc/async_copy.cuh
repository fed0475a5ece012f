// Copies global -> shared memory that do not pass through registers (cp.async, sm_80+; 16 bytes,
// 4 bytes), shared by the kernels that stage data in shared memory ahead of its use. On older
// architectures the copy goes through registers and the wait is a no-op.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace cudadoctor_ops {

// dst: shared memory, src: global memory, both 16-byte aligned.
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
#else
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
#endif
}

// Same with zero fill: 16 zero bytes at dst when !valid (src-size 0 reads nothing; src must still
// be a valid address). Issued copies join a group with cp_async_commit.
__device__ __forceinline__ void cp_async16_zfill(void* dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
#else
  *reinterpret_cast<uint4*>(dst) =
      valid ? __ldg(static_cast<const uint4*>(src)) : make_uint4(0u, 0u, 0u, 0u);
#endif
}

// 4-byte copy with zero fill (cp.async.ca: the smallest size cp.async copies), for rows that do
// not start on a 16-byte boundary.
__device__ __forceinline__ void cp_async4_zfill(void* dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src),
               "r"(valid ? 4 : 0)
               : "memory");
#else
  *static_cast<float*>(dst) = valid ? *static_cast<const float*>(src) : 0.f;
#endif
}

// Closes the group of the copies this thread issued since the last commit.
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// Waits for every copy this thread issued (other threads' copies need a block barrier after).
__device__ __forceinline__ void cp_async_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

}  // namespace cudadoctor_ops
