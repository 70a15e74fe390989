// float32 -> bfloat16 with non-temporal (streaming) stores, for results that nothing reads before
// they would have left the cache anyway (the optimizer's low-precision copies, read by the next
// forward): the stores skip the read of each line that an ordinary store makes first. AVX-512BW
// only, checked at run time; stream_to_bf16 returns false, having written nothing, where it does not
// apply (another CPU, a destination not 64-byte aligned, a length not a multiple of 32), and the
// caller's ordinary loop runs instead. The same numbers as Elem<BFloat16>::store. stream_fence()
// after the last streaming store of a thread's range.
#pragma once
#include <cstdint>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__CUDACC__)
#include <immintrin.h>
#define AMP_STREAM_CASTS 1
#endif

#include "runtime/core/dtype.h"

namespace amp::cpu {

#ifdef AMP_STREAM_CASTS
inline bool stream_stores_available() {
  static const bool yes = __builtin_cpu_supports("avx512bw");
  return yes;
}

// GCC 12's AVX-512 intrinsics trip its own -Wmaybe-uninitialized (the headers' undefined masks).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// 16 floats rounded to bf16 as f32_to_bf16_bits does: nearest even, NaN kept quiet.
__attribute__((target("avx512f,avx512bw"))) inline __m256i bf16_round16(const float* p) {
  const __m512i x = _mm512_castps_si512(_mm512_loadu_ps(p));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(x, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  const __m512i hi = _mm512_srli_epi32(x, 16);
  const __m512i up = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(hi, _mm512_set1_epi32(1)));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(x, up), 16);
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, r, _mm512_or_si512(hi, _mm512_set1_epi32(0x40))));
}

__attribute__((target("avx512f,avx512bw"))) inline void stream_to_bf16_avx512(const float* p, BFloat16* d, long n) {
  for (long i = 0; i < n; i += 32) {
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(bf16_round16(p + i)), bf16_round16(p + i + 16), 1);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i), v);
  }
}

#pragma GCC diagnostic pop
#endif

inline bool stream_to_bf16(const float* p, BFloat16* d, long n) {
#ifdef AMP_STREAM_CASTS
  if (stream_stores_available() && reinterpret_cast<uintptr_t>(d) % 64 == 0 && n % 32 == 0) {
    stream_to_bf16_avx512(p, d, n);
    return true;
  }
#endif
  (void)p, (void)d, (void)n;
  return false;
}

inline void stream_fence() {
#ifdef AMP_STREAM_CASTS
  _mm_sfence();
#endif
}

}  // namespace amp::cpu
