// One warp-wide tensor-core product, mma.sync.aligned.m16n8k16 with fp32 accumulators, for bf16 or
// fp16 inputs (sm_80 and newer), and the 32-bit words its fragments are made of. The fragments are laid
// out as the PTX ISA gives them (groupID g = lane / 4, t = lane % 4):
//   A, 16 x 16 (row-major), 4 words: rows g, g + 8, g, g + 8; cols 2t, 2t + 1 (+ 8 for words 2 and 3)
//   B, 16 x 8 (k x n), 2 words: col g; rows 2t, 2t + 1 (+ 8 for word 1)
//   C, D, 16 x 8, 4 floats: rows g, g, g + 8, g + 8; cols 2t, 2t + 1, 2t, 2t + 1
// A word holds two adjacent elements, the lower-indexed one in its low 16 bits. The emulated GPU
// computes the same product from every lane's fragments (tests/gpu_emulator/kernel.cpp), and faults
// on the misaligned addresses the GPU would fault on.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <type_traits>

#include "runtime/kernels/cuda/device_elem.cuh"

namespace amp::cuda {

// d += a b (b: words b0, b1), T is BFloat16 or Half.
template <class T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  static_assert(std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>, "mma_16816: bf16 or fp16 inputs");
#if defined(AMP_CUDA_EMU)
  const uint32_t b[2] = {b0, b1};
  ::amp::emu::mma_m16n8k16(std::is_same_v<T, BFloat16>, d, a, b, std::source_location::current());
#elif defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, BFloat16>)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Four 8 x 8 matrices of 16-bit elements from shared memory, each row 16 bytes (4 words) at a 16-byte
// boundary: lanes 8i .. 8i + 7 give the rows of matrix i; lane l receives, in r[i], word l % 4 of row
// l / 4 of matrix i (a B fragment's word, or an A fragment's).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const uint32_t* row) {
#if defined(AMP_CUDA_EMU)
  ::amp::emu::ldmatrix_x4(r, row, std::source_location::current());
#elif defined(__CUDA_ARCH__)
  const auto addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
#endif
}

// The same four matrices, each transposed: lane l receives, in r[i], elements (2 (l % 4), l / 4) and
// (2 (l % 4) + 1, l / 4) of matrix i, the first in the low half: a B fragment's word from a tile whose
// rows are B's k (row-major B), where ldmatrix_x4 wants B's columns as rows.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const uint32_t* row) {
#if defined(AMP_CUDA_EMU)
  ::amp::emu::ldmatrix_x4_trans(r, row, std::source_location::current());
#elif defined(__CUDA_ARCH__)
  const auto addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
#endif
}

// Eight elements p[0 .. 8) as four words; p must be 16-byte aligned.
template <class T>
__device__ __forceinline__ void load_quad(const T* p, uint32_t (&w)[4]) {
  static_assert(sizeof(T) == 2, "load_quad: 16-bit elements");
#if defined(AMP_CUDA_EMU)
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) throw std::logic_error("load_quad: the address is not 16-byte aligned");
  for (int i = 0; i < 4; ++i) w[i] = uint32_t{p[2 * i].bits} | uint32_t{p[2 * i + 1].bits} << 16;
#else
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  w[0] = v.x;
  w[1] = v.y;
  w[2] = v.z;
  w[3] = v.w;
#endif
}

// Four words w[0 .. 4) (16-byte aligned) as the eight elements p[0 .. 8); p must be 16-byte aligned.
template <class T>
__device__ __forceinline__ void store_quad(T* p, const uint32_t* w) {
  static_assert(sizeof(T) == 2, "store_quad: 16-bit elements");
#if defined(AMP_CUDA_EMU)
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0 || reinterpret_cast<uintptr_t>(w) % 16 != 0)
    throw std::logic_error("store_quad: an address is not 16-byte aligned");
  for (int i = 0; i < 4; ++i) {
    p[2 * i] = T{static_cast<uint16_t>(w[i] & 0xffffu)};
    p[2 * i + 1] = T{static_cast<uint16_t>(w[i] >> 16)};
  }
#else
  *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(w);
#endif
}

// p[0] and p[1] as one word; p must be 4-byte aligned.
template <class T>
__device__ __forceinline__ uint32_t load_pair(const T* p) {
  static_assert(sizeof(T) == 2, "load_pair: 16-bit elements");
#if defined(AMP_CUDA_EMU)
  if (reinterpret_cast<uintptr_t>(p) % 4 != 0) throw std::logic_error("load_pair: the address is not 4-byte aligned");
  return uint32_t{p[0].bits} | uint32_t{p[1].bits} << 16;
#else
  return *reinterpret_cast<const uint32_t*>(p);
#endif
}

// lo and hi rounded to T (to nearest, even), as one word: one cvt on the GPU.
template <class T>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
#if defined(__CUDA_ARCH__) && !defined(AMP_CUDA_EMU)
  uint32_t w;
  if constexpr (std::is_same_v<T, BFloat16>)
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
  else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
  return w;
#else
  return uint32_t{DevElem<T>::store(lo).bits} | uint32_t{DevElem<T>::store(hi).bits} << 16;
#endif
}

// The two elements of a word, as floats.
template <class T>
__device__ __forceinline__ float pair_lo(uint32_t w) {
  return DevElem<T>::load(T{static_cast<uint16_t>(w & 0xffffu)});
}
template <class T>
__device__ __forceinline__ float pair_hi(uint32_t w) {
  return DevElem<T>::load(T{static_cast<uint16_t>(w >> 16)});
}

}  // namespace amp::cuda
