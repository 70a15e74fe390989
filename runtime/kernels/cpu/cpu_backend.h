// The CPU backend: GEMMs on oneDNN's kernels that give the same bits on any thread count (fp16, and
// bf16 on a CPU without oneDNN's bf16 kernels, computed as a tensor core does), and OpenMP loops over
// the shared per-element functions. Its memory is runtime/core/host_memory.cpp.
#pragma once
#include <vector>

#include "runtime/kernels/backend.h"

namespace amp {

class CpuBackend final : public Backend {
 public:
  void cast(const Tensor& src, Tensor& dst) override;
  void unary(UnaryOp op, const Tensor& x, Tensor& y, double alpha) override;
  void binary(BinaryOp op, const Tensor& a, const Tensor& b, Tensor& out) override;
  void broadcast_to(const Tensor& x, Tensor& out) override;
  void sum_to(const Tensor& x, Tensor& out) override;
  void softmax_lastdim(const Tensor& x, Tensor& y, bool log) override;
  void nll_loss(const Tensor& logp, const Tensor& target, Tensor& loss) override;
  void nll_loss_backward(const Tensor& grad, const Tensor& target, Tensor& grad_logp) override;
  void cross_entropy(const Tensor& logits, const Tensor& target, int64_t classes, Tensor& lse, Tensor& loss) override;
  void cross_entropy_backward(const Tensor& logits, const Tensor& target, const Tensor& lse, const Tensor& grad,
                              int64_t classes, Tensor& gx) override;
  void fill_uniform(Tensor& t, uint64_t seed, uint64_t offset, double lo, double hi) override;
  void fill_normal(Tensor& t, uint64_t seed, uint64_t offset, double mean, double std) override;

  void embedding(const Tensor& weight, const Tensor& idx, Tensor& out) override;
  void embedding_backward(const Tensor& grad, const Tensor& idx, Tensor& grad_weight) override;
  void layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, double eps, Tensor& y, Tensor& mean,
                  Tensor& rstd) override;
  void layer_norm_backward(const Tensor& g, const Tensor& x, const Tensor& w, const Tensor& mean, const Tensor& rstd,
                           Tensor& gx, Tensor& gw, Tensor& gb, bool accumulate) override;
  void permute(const Tensor& x, const std::vector<int64_t>& perm, Tensor& out) override;
  void causal_softmax(const Tensor& x, Tensor& y, double scale) override;
  void softmax_backward(const Tensor& y, const Tensor& g, Tensor& gx, bool log, double scale) override;
  void dropout_mask(Tensor& mask, uint64_t seed, uint64_t offset, double p, const Tensor& base = Tensor(),
                    uint64_t per_base = 0) override;

  void gemm(bool trans_a, bool trans_b, float alpha, const Tensor& a, const Tensor& b, float beta,
            Tensor& c) override;
  void gemm_batched(bool trans_a, bool trans_b, float alpha, const Tensor& a, const Tensor& b, float beta,
                    Tensor& c) override;
  void linear_forward(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y) override;

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
  void clip_by_norm(const std::vector<Tensor>& xs, const Tensor& total_norm, double max_norm) override;
  void clamp(const std::vector<Tensor>& xs, double lo, double hi) override;
};

Backend& cpu_backend();

}  // namespace amp
