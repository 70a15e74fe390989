// GEMMs on oneDNN's kernels whose results do not depend on the thread count.
//
// oneDNN splits a GEMM by the threads it has, and where it splits the sum over k, another thread count
// adds in another order: a CPU run's last bits depended on --threads. Here the work is cut by the
// shape alone: c into tiles of a fixed size, and where the tiles are too few to keep threads busy, k
// into chunks of a fixed length whose partial products are added in chunk order. Each piece is one
// single-threaded oneDNN GEMM run on the thread that takes it (inside our OpenMP loop), so it computes
// the same bits whichever thread runs it and however many there are.
#pragma once
#include <cstdint>

namespace amp::cpu {

// How a batch of products is cut into pieces: bg products of the batch to a piece (small ones), c
// in tiles of tm x tn elements (the last ones smaller), k in ks chunks of kc (the last one shorter;
// ks = 1: k in one piece). A function of the shape only.
struct GemmPlan {
  int64_t tm, tn, kc, ks, bg;
};
GemmPlan gemm_plan(bool trans_a, bool trans_b, int64_t batch, int64_t m, int64_t n, int64_t k);

// The element types taken: a and b f32 or bf16 (one type), c f32 or theirs, bias theirs.
enum class GemmType { f32, bf16 };

// Whether this CPU has oneDNN's bf16 kernels (AVX-512): without them, widen bf16 to f32 first.
bool has_bf16_gemm();

// fp32 pieces run through oneDNN's sgemm; bf16 ones through matmul primitives. A test turns this on
// to run fp32 through the primitives, the path a CPU without bf16 kernels would not check otherwise.
void use_primitives_for_f32(bool on);

// c[i] = alpha op(a[i]) op(b[i]) + beta c[i] (+ bias) for i < batch, summed in fp32 and rounded once
// into c: row-major and dense (op(a[i]) is [m, k], stored [k, m] when trans_a, a[i] at a + i m k;
// likewise b and c). beta = 0 reads nothing of c (a NaN there does not propagate), as BLAS. bias
// (n values, or null) is added to every row's sum: a linear layer's, one product, alpha = 1, beta = 0
// (oneDNN's primitives would scale it by alpha). fp32 inputs give fp32.
void tiled_gemm(GemmType in, GemmType out, bool trans_a, bool trans_b, int64_t batch, int64_t m, int64_t n, int64_t k,
                float alpha, const void* a, const void* b, float beta, void* c, const void* bias = nullptr);

}  // namespace amp::cpu
