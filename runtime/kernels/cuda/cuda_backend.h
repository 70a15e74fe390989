// The CUDA backend: cuBLAS GEMMs, element-wise and reduction kernels over the shared per-element
// math, and multi-tensor AMP/optimizer kernels. Everything runs on the context's compute stream;
// only copy_to_host and synchronize wait for the device.
//
// Files, one per op family, forward and backward together: cuda_backend.cpp (memory, copies,
// read-backs), cuda_elementwise.cu (fill, casts, unary and binary maps, broadcast_to), cuda_reduce.cu
// (sum_to), cuda_softmax.cu, cuda_loss.cu, cuda_random.cu (with dropout's mask), cuda_embedding.cu,
// cuda_layer_norm.cu, cuda_permute.cu, cuda_gemm.cpp, cuda_fused.cu (unscale, scale update,
// optimizers), cuda_grad_norm.cu (gradient norms, clipping, the finite check).
#pragma once
#include "runtime/kernels/backend.h"

namespace amp::cuda {

// Both halves of a device: its memory (runtime/core/device_memory.h) and its kernels.
class CudaBackend final : public Backend, public DeviceMemory {
 public:
  void* allocate(size_t bytes) override;
  void deallocate(void* p, size_t bytes) override;
  size_t peak_bytes() const override;
  size_t current_bytes() const override;
  void reset_peak_bytes() override;
  size_t device_peak_bytes() override;
  void copy_from_host(void* dst, const void* src, size_t bytes) override;
  void copy_to_host(void* dst, const void* src, size_t bytes) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void synchronize() override;
  std::unique_ptr<Readback> start_readback(const std::vector<Tensor>& scalars) override;

  void fill(Tensor& t, double value) override;
  void cast(const Tensor& src, Tensor& dst) override;
  void unary(UnaryOp op, const Tensor& x, Tensor& y, double alpha) override;
  void binary(BinaryOp op, const Tensor& a, const Tensor& b, Tensor& out) override;
  void add_cast(const Tensor& a, const Tensor& b, Tensor& out) override;
  void broadcast_to(const Tensor& x, Tensor& out) override;
  void sum_to(const Tensor& x, Tensor& out) override;
  void softmax_lastdim(const Tensor& x, Tensor& y, bool log) override;
  // A target outside [0, classes) cannot throw from the device without a host sync: it makes the
  // loss NaN instead, which the scaler and the logs then report.
  void nll_loss(const Tensor& logp, const Tensor& target, Tensor& loss) override;
  void nll_loss_backward(const Tensor& grad, const Tensor& target, Tensor& grad_logp) override;
  void cross_entropy(const Tensor& logits, const Tensor& target, int64_t classes, Tensor& lse, Tensor& loss) override;
  void cross_entropy_backward(const Tensor& logits, const Tensor& target, const Tensor& lse, const Tensor& grad,
                              int64_t classes, Tensor& gx) override;
  void fill_uniform(Tensor& t, uint64_t seed, uint64_t offset, double lo, double hi) override;
  void fill_normal(Tensor& t, uint64_t seed, uint64_t offset, double mean, double std) override;

  void embedding(const Tensor& weight, const Tensor& idx, Tensor& out) override;
  void embedding_backward(const Tensor& grad, const Tensor& idx, Tensor& grad_weight) override;
  void embedding_backward_add(const Tensor& grad, const Tensor& idx, Tensor& grad_weight) override;
  void layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, double eps, Tensor& y, Tensor& mean,
                  Tensor& rstd) override;
  void layer_norm_backward(const Tensor& g, const Tensor& x, const Tensor& w, const Tensor& mean, const Tensor& rstd,
                           Tensor& gx, Tensor& gw, Tensor& gb, bool accumulate) override;
  void layer_norm_cast(const Tensor& x, const Tensor& w, const Tensor& b, double eps, Tensor& y, Tensor& mean,
                       Tensor& rstd) override;
  void layer_norm_backward_cast(const Tensor& g, const Tensor& x, const Tensor& w, const Tensor& mean,
                                const Tensor& rstd, Tensor& gx, Tensor& gw, Tensor& gb, bool accumulate,
                                const Tensor& gx_low) override;
  void add_layer_norm_cast(const Tensor& a, const Tensor& b, const Tensor& w, const Tensor& bias, double eps,
                           Tensor& sum, Tensor& y, Tensor& mean, Tensor& rstd) override;
  void permute(const Tensor& x, const std::vector<int64_t>& perm, Tensor& out) override;
  void causal_softmax(const Tensor& x, Tensor& y, double scale) override;
  void causal_softmax_cast(const Tensor& x, Tensor& y, const Tensor& low, double scale) override;
  void softmax_backward(const Tensor& y, const Tensor& g, Tensor& gx, bool log, double scale) override;
  void softmax_backward_cast(const Tensor& y, const Tensor& g, Tensor& gx, double scale) override;
  bool has_fused_attention(DType dtype, int64_t head_dim) const override;
  std::string cudnn_attention_unavailable(DType dtype, int64_t head_dim) const override;
  void attention_forward(const Tensor& qkv, int64_t n_head, double scale, Tensor& y, Tensor& lse,
                         FusedAttention which = FusedAttention::own) override;
  void attention_backward(const Tensor& qkv, const Tensor& y, const Tensor& lse, const Tensor& gy, int64_t n_head,
                          double scale, Tensor& dqkv, FusedAttention which = FusedAttention::own) override;
  void dropout_mask(Tensor& mask, uint64_t seed, uint64_t offset, double p, const Tensor& base = Tensor(),
                    uint64_t per_base = 0) override;

  // y = x w^T + bias in one cuBLASLt matmul with the bias epilogue (fp16, bf16, fp32): no broadcast
  // of the bias into y first. Falls back to Backend's (broadcast, then a GEMM with beta = 1) where
  // cuBLASLt offers no algorithm (fp64; a bias not 16-byte aligned).
  void linear_forward(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y) override;
  void linear_gelu_tanh_forward(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& pre, Tensor& y) override;
  void linear_input_grad_gelu_tanh(const Tensor& g, const Tensor& w, const Tensor& pre, Tensor& dpre) override;
  // fp16 or bf16 g, gradients in g's dtype or fp32 (autocast's fp32 weight gradients): one cuBLASLt
  // matmul with the BGRADB epilogue where cuBLASLt has an algorithm for it.
  bool fuses_linear_param_grads(DType g_dtype, DType out) const override;
  void linear_param_grads(const Tensor& g, const Tensor& x, Tensor& dw, Tensor& db) override;
  void gemm(bool trans_a, bool trans_b, float alpha, const Tensor& a, const Tensor& b, float beta,
            Tensor& c) override;
  void gemm_batched(bool trans_a, bool trans_b, float alpha, const Tensor& a, const Tensor& b, float beta,
                    Tensor& c) override;

  void unscale_and_check(const std::vector<Tensor>& grads, const Tensor& scale, Tensor& found_inf,
                         const Tensor& per_tensor = Tensor()) override;
  void check_finite(const std::vector<Tensor>& xs, const Tensor& scale, Tensor& found_inf,
                    const Tensor& per_tensor = Tensor()) override;
  void nonfinite_flags_if_found(const std::vector<Tensor>& xs, const Tensor& scale, const Tensor& found_inf,
                                const Tensor& per_tensor) override;
  void update_scale(Tensor& scale, Tensor& tracker, const Tensor& found_inf, const ScaleUpdateHyper& h) override;
  void sgd_step(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                const std::vector<Tensor>& momentum_bufs, Tensor& step_count, const SgdHyper& h,
                const Tensor& found_inf, const Tensor& grad_scale, const std::vector<Tensor>& copies,
                const Tensor& lr = Tensor(), const NormClip& clip = NormClip()) override;
  void adam_step(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                 const std::vector<Tensor>& exp_avgs, const std::vector<Tensor>& exp_avg_sqs,
                 const std::vector<Tensor>& max_exp_avg_sqs, Tensor& step_count, const AdamHyper& h,
                 const Tensor& found_inf, const Tensor& grad_scale, const std::vector<Tensor>& copies,
                 const Tensor& lr = Tensor(), const NormClip& clip = NormClip()) override;
  void norm_accumulate(const std::vector<Tensor>& xs, double p, Tensor& out) override;
  void norm_accumulate_each(const std::vector<Tensor>& xs, double p, Tensor& out) override;
  void chunk_sums_of_squares(const Tensor& x, int64_t chunk, Tensor& out, const Tensor& scale,
                             const Tensor& found_inf = Tensor()) override;
  void chunk_sums_of_squares_gathered(const std::vector<Tensor>& pieces, const std::vector<int64_t>& offsets, int64_t n,
                                      int64_t chunk, Tensor& out, const Tensor& scale,
                                      const Tensor& found_inf = Tensor()) override;
  void clip_by_norm(const std::vector<Tensor>& xs, const Tensor& total_norm, double max_norm) override;
  void clamp(const std::vector<Tensor>& xs, double lo, double hi) override;
};

// The process's CUDA backend (registered for DeviceType::cuda by cuda_init).
CudaBackend& cuda_backend();

// Throws std::invalid_argument unless t lives on a CUDA device; what names the operand.
void require_cuda(const Tensor& t, const char* what);

// Per-tensor non-finite flags (unscale_and_check, check_finite with per_tensor): the per-block flags
// of a multi-tensor op planned in kChunkSize chunks over xs (block_flag_count of them, xs in
// dtype_group_order), folded into per_tensor[i] = max(per_tensor[i], tensor i's blocks' flags).
int64_t block_flag_count(const std::vector<Tensor>& xs);
void fold_block_flags(const std::vector<Tensor>& xs, const double* block_flags, float* per_tensor);

// When our attention's backward keeps its tiles of dS (cuda_attention.cu): where the batches whose
// tiles fit in limit_bytes (128 MiB) launch at least min_blocks blocks (1024), whatever the number of
// batches; it then takes batches in groups under the limit. Else its dq pass computes them again.
// Returns the previous policy (tests).
struct AttentionDsPolicy {
  int64_t limit_bytes, min_blocks;
};
AttentionDsPolicy set_attention_ds_policy(AttentionDsPolicy policy);

}  // namespace amp::cuda
