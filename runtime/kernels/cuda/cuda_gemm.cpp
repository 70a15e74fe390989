// CUDA backend: GEMM on cuBLAS (cublasGemmEx, and cublasGemmStridedBatchedEx for batches; cuBLASLt
// for a linear layer's GEMM with its bias, or its bias and the tanh GELU, in the epilogue, and for
// the GELU's backward in the epilogue of the next layer's input gradient). fp16/bf16 inputs use tensor cores with fp32
// accumulation and an fp16/bf16 or fp32 output, as the CPU backend emulates; fp32 is strict fp32
// (no TF32); fp64 is fp64. The workspace is set once on the handle (cuda_context.cpp).
#include <climits>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>

#include "runtime/kernels/cuda/cuda_backend.h"
#include "runtime/kernels/gemm_check.h"
#include "runtime/kernels/cuda/cuda_check.h"
#include "runtime/kernels/cuda/cuda_context.h"
#include "runtime/kernels/cuda/gemm_layout.h"

namespace amp::cuda {

namespace {

cudaDataType_t cuda_dtype(DType t) {
  switch (t) {
    case DType::f32: return CUDA_R_32F;
    case DType::f64: return CUDA_R_64F;
    case DType::f16: return CUDA_R_16F;
    case DType::bf16: return CUDA_R_16BF;
    default: throw std::invalid_argument(std::string("gemm: unsupported dtype ") + dtype_name(t));
  }
}

int as_int(int64_t v, const char* what) {
  if (v > INT_MAX) throw std::invalid_argument(std::string("gemm: ") + what + " = " + std::to_string(v) +
                                               " exceeds cuBLAS's 32-bit limit");
  return static_cast<int>(v);
}

}  // namespace

namespace {

// c[i] = alpha op(a[i]) op(b[i]) + beta c[i] for i < batch, a[i] `stride_a` elements apart (and so on):
// row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T, so b goes first.
void launch_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const Tensor& a, const Tensor& b,
                 float beta, Tensor& c, int64_t batch) {
  const ColumnMajorGemm g = column_major_gemm(ta, tb, m, n, k);
  const cublasOperation_t op_first = g.trans_first ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_second = g.trans_second ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int gm = as_int(g.m, "n"), gn = as_int(g.n, "m"), gk = as_int(g.k, "k");
  const int ld1 = as_int(g.ld_first, "ldb"), ld2 = as_int(g.ld_second, "lda"), ldc = as_int(g.ldc, "ldc");
  const cublasHandle_t handle = context().cublas();
  const cudaDataType_t in_type = cuda_dtype(a.dtype()), out_type = cuda_dtype(c.dtype());
  const bool f64 = a.dtype() == DType::f64;
  // fp32 accumulation for every narrower input: the tensor-core path for fp16/bf16.
  const double alpha64 = alpha, beta64 = beta;
  const void* pa = f64 ? static_cast<const void*>(&alpha64) : &alpha;
  const void* pb = f64 ? static_cast<const void*>(&beta64) : &beta;
  const cublasComputeType_t compute = f64                                              ? CUBLAS_COMPUTE_64F
                                      : a.dtype() == DType::f32 && context().allow_tf32() ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                                                          : CUBLAS_COMPUTE_32F;
  if (batch == 1) {
    AMP_CUBLAS_CHECK(cublasGemmEx(handle, op_first, op_second, gm, gn, gk, pa, b.data_ptr(), in_type, ld1,
                                  a.data_ptr(), in_type, ld2, pb, c.data_ptr(), out_type, ldc, compute,
                                  CUBLAS_GEMM_DEFAULT));
    return;
  }
  AMP_CUBLAS_CHECK(cublasGemmStridedBatchedEx(handle, op_first, op_second, gm, gn, gk, pa, b.data_ptr(), in_type, ld1,
                                              k * n, a.data_ptr(), in_type, ld2, m * k, pb, c.data_ptr(), out_type, ldc,
                                              m * n, as_int(batch, "batch"), compute, CUBLAS_GEMM_DEFAULT));
}

}  // namespace

namespace {

// The largest power of two, up to 256, that divides the address: the alignment cuBLASLt may assume.
uint32_t alignment_of(const void* p) {
  uint32_t a = 256;
  while (a > 1 && reinterpret_cast<uintptr_t>(p) % a != 0) a /= 2;
  return a;
}

template <class T, cublasStatus_t (*Destroy)(T)>
struct LtObject {  // a cuBLASLt descriptor, destroyed with its owner
  T p = nullptr;
  LtObject() = default;
  LtObject(const LtObject&) = delete;
  LtObject& operator=(const LtObject&) = delete;
  ~LtObject() {
    if (p != nullptr) (void)Destroy(p);
  }
};

// The cuBLASLt matmuls we run, each column-major D (m x n) = op(A) B, alpha 1, beta 0:
//   bias:  a linear layer's forward, op(A) = w^T, B = x, + bias per row of D;
//   gelu:  the same, D = gelu(sum + bias) with the sum + bias kept in aux (CUBLASLT_EPILOGUE_GELU_AUX_BIAS);
//   dgelu: a linear layer's input gradient, A = w, B = g, D = product * gelu'(aux) (CUBLASLT_EPILOGUE_DGELU);
//   bgradb: a linear layer's weight gradient, A = x, op(B) = g^T (g as stored, transposed), D = dw^T, and
//           g summed over the product's k (its rows) into the bias pointer (CUBLASLT_EPILOGUE_BGRADB).
// cuBLASLt's GELU is the tanh form. aux has D's layout (leading dimension m).
enum class LtEpilogue : uint8_t { bias, gelu, dgelu, bgradb };

// One matmul's shape, dtype, epilogue and alignments: its descriptors and cuBLASLt's heuristic answer
// (none when it has no algorithm), made once per process; a call sets only its pointers.
struct LtKey {
  int64_t m, n, k;
  cudaDataType_t type, d_type;  // A and B's, D's (and the bias gradient's)
  cublasComputeType_t compute;
  LtEpilogue epilogue;
  uint32_t align_a, align_b, align_d, align_bias, align_aux;  // the heuristic reads the epilogue's pointers too
  bool operator<(const LtKey& o) const {
    return std::tie(m, n, k, type, d_type, compute, epilogue, align_a, align_b, align_d, align_bias, align_aux) <
           std::tie(o.m, o.n, o.k, o.type, o.d_type, o.compute, o.epilogue, o.align_a, o.align_b, o.align_d,
                    o.align_bias, o.align_aux);
  }
};
struct LtPlan {
  LtObject<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy> op;
  LtObject<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy> a, b, d;
  std::optional<cublasLtMatmulAlgo_t> algo;
};

bool has_bias(LtEpilogue e) { return e != LtEpilogue::dgelu; }
bool has_aux(LtEpilogue e) { return e == LtEpilogue::gelu || e == LtEpilogue::dgelu; }

void set_pointers(LtPlan& plan, const LtKey& key, const void* bias, const void* aux) {
  if (has_bias(key.epilogue))
    AMP_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op.p, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  if (has_aux(key.epilogue))
    AMP_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op.p, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux)));
}

std::unique_ptr<LtPlan> make_lt_plan(const LtKey& key, const void* bias, const void* aux) {
  auto plan = std::make_unique<LtPlan>();
  AMP_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->op.p, key.compute, CUDA_R_32F));
  const bool dgelu = key.epilogue == LtEpilogue::dgelu, bgradb = key.epilogue == LtEpilogue::bgradb;
  const int32_t trans_a = dgelu || bgradb ? CUBLAS_OP_N : CUBLAS_OP_T, trans_b = bgradb ? CUBLAS_OP_T : CUBLAS_OP_N;
  const uint32_t epilogue = key.epilogue == LtEpilogue::bias   ? CUBLASLT_EPILOGUE_BIAS
                            : key.epilogue == LtEpilogue::gelu ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS
                            : dgelu                            ? CUBLASLT_EPILOGUE_DGELU
                                                               : CUBLASLT_EPILOGUE_BGRADB;
  AMP_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op.p, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a)));
  AMP_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op.p, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b)));
  AMP_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op.p, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
  if (has_aux(key.epilogue)) {
    const int64_t aux_ld = key.m;
    AMP_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op.p, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld)));
  }
  set_pointers(*plan, key, bias, aux);
  if (dgelu || bgradb) AMP_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->a.p, key.type, key.m, key.k, key.m));
  else AMP_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->a.p, key.type, key.k, key.m, key.k));
  if (bgradb) AMP_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->b.p, key.type, key.n, key.k, key.n));
  else AMP_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->b.p, key.type, key.k, key.n, key.k));
  AMP_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->d.p, key.d_type, key.m, key.n, key.m));
  LtObject<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy> pref;
  AMP_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref.p));
  const uint64_t workspace = Context::kCublasWorkspaceBytes;
  // Split-K partial sums in fp32 only (never in D's fp16/bf16): one rounding, as the cuBLAS handle's
  // CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION.
  const uint32_t reductions = CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  AMP_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                        sizeof(workspace)));
  AMP_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reductions,
                                                        sizeof(reductions)));
  const uint32_t align[4] = {key.align_a, key.align_b, key.align_d, key.align_d};  // C is D
  for (int i = 0; i < 4; ++i)
    AMP_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref.p, static_cast<cublasLtMatmulPreferenceAttributes_t>(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES + i),
        &align[i], sizeof(align[i])));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(context().cublas_lt(), plan->op.p, plan->a.p, plan->b.p,
                                                           plan->d.p, plan->d.p, pref.p, 1, &result, &found);
  if (st == CUBLAS_STATUS_SUCCESS && found > 0) plan->algo = result.algo;
  // No algorithm: the caller's composite. The GELU epilogues' combinations (a dtype, TF32, an aux
  // layout) may also be refused as invalid by a cuBLASLt that lacks them: the composite too.
  else if (st != CUBLAS_STATUS_NOT_SUPPORTED && st != CUBLAS_STATUS_SUCCESS &&
           (key.epilogue == LtEpilogue::bias || key.epilogue == LtEpilogue::bgradb))
    AMP_CUBLAS_CHECK(st);
  return plan;
}

// D = op(A) B with key's epilogue, enqueued; false (nothing enqueued) where cuBLASLt has no algorithm.
bool lt_matmul(const LtKey& key, const void* a, const void* b, void* d, const void* bias, const void* aux) {
  static std::mutex mutex;  // guards the plans and each plan's pointers until its matmul is enqueued
  static std::map<LtKey, std::unique_ptr<LtPlan>> plans;
  std::lock_guard<std::mutex> lock(mutex);
  std::unique_ptr<LtPlan>& plan = plans[key];
  if (!plan) plan = make_lt_plan(key, bias, aux);
  if (!plan->algo) return false;
  set_pointers(*plan, key, bias, aux);
  const float alpha = 1.0f, beta = 0.0f;
  AMP_CUBLAS_CHECK(cublasLtMatmul(context().cublas_lt(), plan->op.p, &alpha, a, plan->a.p, b, plan->b.p, &beta, d,
                                  plan->d.p, d, plan->d.p, &*plan->algo, context().workspace(),
                                  Context::kCublasWorkspaceBytes, context().stream()));
  return true;
}

// Whether cuBLASLt takes a matmul of these sizes and dtype: fp16, bf16 or fp32, D in the inputs'
// dtype, sizes within its 32-bit limits, no empty dimension.
bool lt_takes(DType dt, DType out, int64_t m, int64_t n, int64_t k) {
  return (dt == DType::f16 || dt == DType::bf16 || dt == DType::f32) && out == dt && m > 0 && n > 0 && k > 0 &&
         m <= INT_MAX && n <= INT_MAX && k <= INT_MAX;
}

cublasComputeType_t lt_compute(DType dt) {
  return dt == DType::f32 && context().allow_tf32() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
}

bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

void check_bias(const Tensor& bias, const Tensor& w, int64_t o, const char* op) {
  if (bias.dim() != 1 || bias.numel() != o || bias.dtype() != w.dtype())
    throw std::invalid_argument(std::string(op) + ": bias " + shape_str(bias.shape()) + " " + dtype_name(bias.dtype()) +
                                " does not match the weight's " + std::to_string(o) + " " + dtype_name(w.dtype()) +
                                " rows");
}

}  // namespace

void CudaBackend::linear_forward(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y) {
  require_cuda(x, "linear: x");
  require_cuda(w, "linear: w");
  require_cuda(bias, "linear: bias");
  require_cuda(y, "linear: y");
  const auto [r, o, in] = check_gemm(false, true, x, w, y);
  check_bias(bias, w, o, "linear");
  // cuBLASLt where it takes the bias (16-byte aligned); otherwise Backend's broadcast and GEMM.
  const DType dt = x.dtype();
  if (!lt_takes(dt, y.dtype(), o, r, in) || !aligned16(bias)) return Backend::linear_forward(x, w, bias, y);
  const LtKey key{o, r, in, cuda_dtype(dt), cuda_dtype(dt), lt_compute(dt), LtEpilogue::bias, alignment_of(w.data_ptr()),
                  alignment_of(x.data_ptr()), alignment_of(y.data_ptr()), alignment_of(bias.data_ptr()), 1};
  if (!lt_matmul(key, w.data_ptr(), x.data_ptr(), y.data_ptr(), bias.data_ptr(), nullptr))
    Backend::linear_forward(x, w, bias, y);
}

void CudaBackend::linear_gelu_tanh_forward(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& pre, Tensor& y) {
  require_cuda(x, "linear_gelu_tanh: x");
  require_cuda(w, "linear_gelu_tanh: w");
  require_cuda(bias, "linear_gelu_tanh: bias");
  require_cuda(pre, "linear_gelu_tanh: pre");
  require_cuda(y, "linear_gelu_tanh: y");
  const auto [r, o, in] = check_gemm(false, true, x, w, y);
  check_bias(bias, w, o, "linear_gelu_tanh");
  if (pre.shape() != y.shape() || pre.dtype() != y.dtype())
    throw std::invalid_argument("linear_gelu_tanh: pre " + shape_str(pre.shape()) + " " + dtype_name(pre.dtype()) +
                                " is not y's " + shape_str(y.shape()) + " " + dtype_name(y.dtype()));
  // The epilogue's aux (pre) has D's leading dimension o: a multiple of 8, 16-byte aligned.
  const DType dt = x.dtype();
  if (!lt_takes(dt, y.dtype(), o, r, in) || !aligned16(bias) || !aligned16(pre) || o % 8 != 0)
    return Backend::linear_gelu_tanh_forward(x, w, bias, pre, y);
  const LtKey key{o, r, in, cuda_dtype(dt), cuda_dtype(dt), lt_compute(dt), LtEpilogue::gelu, alignment_of(w.data_ptr()),
                  alignment_of(x.data_ptr()), alignment_of(y.data_ptr()), alignment_of(bias.data_ptr()),
                  alignment_of(pre.data_ptr())};
  if (!lt_matmul(key, w.data_ptr(), x.data_ptr(), y.data_ptr(), bias.data_ptr(), pre.data_ptr()))
    Backend::linear_gelu_tanh_forward(x, w, bias, pre, y);
}

void CudaBackend::linear_input_grad_gelu_tanh(const Tensor& g, const Tensor& w, const Tensor& pre, Tensor& dpre) {
  require_cuda(g, "linear_input_grad_gelu_tanh: g");
  require_cuda(w, "linear_input_grad_gelu_tanh: w");
  require_cuda(pre, "linear_input_grad_gelu_tanh: pre");
  require_cuda(dpre, "linear_input_grad_gelu_tanh: dpre");
  const auto [r, h, o] = check_gemm(false, false, g, w, dpre);
  if (pre.shape() != dpre.shape() || pre.dtype() != dpre.dtype())
    throw std::invalid_argument("linear_input_grad_gelu_tanh: pre " + shape_str(pre.shape()) + " " +
                                dtype_name(pre.dtype()) + " is not dpre's " + shape_str(dpre.shape()) + " " +
                                dtype_name(dpre.dtype()));
  const DType dt = g.dtype();
  if (!lt_takes(dt, dpre.dtype(), h, r, o) || !aligned16(pre) || h % 8 != 0)
    return Backend::linear_input_grad_gelu_tanh(g, w, pre, dpre);
  // Column-major dpre^T (h x r) = w^T (h x o, w as stored) g^T (o x r, g as stored).
  const LtKey key{h, r, o, cuda_dtype(dt), cuda_dtype(dt), lt_compute(dt), LtEpilogue::dgelu, alignment_of(w.data_ptr()),
                  alignment_of(g.data_ptr()), alignment_of(dpre.data_ptr()), 1, alignment_of(pre.data_ptr())};
  if (!lt_matmul(key, w.data_ptr(), g.data_ptr(), dpre.data_ptr(), nullptr, pre.data_ptr()))
    Backend::linear_input_grad_gelu_tanh(g, w, pre, dpre);
}

bool CudaBackend::fuses_linear_param_grads(DType g_dtype, DType out) const {
  return (g_dtype == DType::f16 || g_dtype == DType::bf16) && (out == g_dtype || out == DType::f32);
}

void CudaBackend::linear_param_grads(const Tensor& g, const Tensor& x, Tensor& dw, Tensor& db) {
  require_cuda(g, "linear_param_grads: g");
  require_cuda(x, "linear_param_grads: x");
  require_cuda(dw, "linear_param_grads: dw");
  require_cuda(db, "linear_param_grads: db");
  const auto [o, in, r] = check_gemm(true, false, g, x, dw);
  if (db.dim() != 1 || db.numel() != o || db.dtype() != dw.dtype())
    throw std::invalid_argument("linear_param_grads: db " + shape_str(db.shape()) + " " + dtype_name(db.dtype()) +
                                " does not match dw's " + std::to_string(o) + " " + dtype_name(dw.dtype()) + " rows");
  if (!fuses_linear_param_grads(g.dtype(), dw.dtype()) || r > INT_MAX || o > INT_MAX || in > INT_MAX || r == 0 ||
      o == 0 || in == 0 || !aligned16(db))
    return Backend::linear_param_grads(g, x, dw, db);
  // Column-major dw^T (in x o) = x^T (in x r, x as stored) op(g) (g as stored is o x r: op = transpose),
  // the bias gradient reduced over r, the product's k.
  const DType dt = g.dtype();
  const LtKey key{in, o, r, cuda_dtype(dt), cuda_dtype(dw.dtype()), lt_compute(dt), LtEpilogue::bgradb,
                  alignment_of(x.data_ptr()), alignment_of(g.data_ptr()), alignment_of(dw.data_ptr()),
                  alignment_of(db.data_ptr()), 1};
  if (!lt_matmul(key, x.data_ptr(), g.data_ptr(), dw.data_ptr(), db.data_ptr(), nullptr))
    Backend::linear_param_grads(g, x, dw, db);
}

void CudaBackend::gemm(bool ta, bool tb, float alpha, const Tensor& a, const Tensor& b, float beta, Tensor& c) {
  require_cuda(a, "gemm: a");
  require_cuda(b, "gemm: b");
  require_cuda(c, "gemm: c");
  const auto [m, n, k] = check_gemm(ta, tb, a, b, c);
  if (gemm_is_trivial(*this, m, n, k, beta, c)) return;
  launch_gemm(ta, tb, m, n, k, alpha, a, b, beta, c, 1);
}

void CudaBackend::gemm_batched(bool ta, bool tb, float alpha, const Tensor& a, const Tensor& b, float beta, Tensor& c) {
  require_cuda(a, "gemm_batched: a");
  require_cuda(b, "gemm_batched: b");
  require_cuda(c, "gemm_batched: c");
  const auto [m, n, k] = check_gemm_batched(ta, tb, a, b, c);
  if (a.shape()[0] == 0 || gemm_is_trivial(*this, m, n, k, beta, c)) return;
  launch_gemm(ta, tb, m, n, k, alpha, a, b, beta, c, a.shape()[0]);
}

}  // namespace amp::cuda
