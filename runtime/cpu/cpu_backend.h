// The CPU backend: OpenBLAS for fp32/fp64 GEMM, oneDNN for bf16 GEMM, fp16 GEMM emulated like a
// tensor core, and OpenMP loops over the shared per-element functions.
#pragma once
#include <atomic>
#include <map>
#include <mutex>
#include <vector>

#include "runtime/backend.h"

namespace amp {

class CpuBackend final : public Backend {
 public:
  void* allocate(size_t bytes) override;
  void deallocate(void* p, size_t bytes) override;
  size_t peak_bytes() const override { return peak_.load(); }
  size_t current_bytes() const override { return current_.load(); }
  void reset_peak_bytes() override { peak_.store(current_.load()); }
  void copy_from_host(void* dst, const void* src, size_t bytes) override;
  void copy_to_host(void* dst, const void* src, size_t bytes) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void synchronize() override {}
  std::unique_ptr<Readback> start_readback(const std::vector<Tensor>& scalars) override;

  void fill(Tensor& t, double value) override;
  void cast(const Tensor& src, Tensor& dst) override;
  void unary(UnaryOp op, const Tensor& x, Tensor& y, double alpha) override;
  void binary(BinaryOp op, const Tensor& a, const Tensor& b, Tensor& out) override;
  void broadcast_to(const Tensor& x, Tensor& out) override;
  void sum_to(const Tensor& x, Tensor& out) override;
  void softmax_lastdim(const Tensor& x, Tensor& y, bool log) override;
  void nll_loss(const Tensor& logp, const Tensor& target, Tensor& loss) override;
  void nll_loss_backward(const Tensor& grad, const Tensor& target, Tensor& grad_logp) override;
  void fill_uniform(Tensor& t, uint64_t seed, uint64_t offset, double lo, double hi) override;
  void fill_normal(Tensor& t, uint64_t seed, uint64_t offset, double mean, double std) override;

  void embedding(const Tensor& weight, const Tensor& idx, Tensor& out) override;
  void embedding_backward(const Tensor& grad, const Tensor& idx, Tensor& grad_weight) override;
  void layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, double eps, Tensor& y, Tensor& mean,
                  Tensor& rstd) override;
  void layer_norm_backward(const Tensor& g, const Tensor& x, const Tensor& w, const Tensor& mean, const Tensor& rstd,
                           Tensor& gx, Tensor& gw, Tensor& gb) override;
  void permute(const Tensor& x, const std::vector<int64_t>& perm, Tensor& out) override;
  void causal_softmax(const Tensor& x, Tensor& y, double scale) override;
  void softmax_backward(const Tensor& y, const Tensor& g, Tensor& gx, bool log, double scale) override;
  void dropout_mask(Tensor& mask, uint64_t seed, uint64_t offset, double p) override;

  void gemm(bool trans_a, bool trans_b, float alpha, const Tensor& a, const Tensor& b, float beta,
            Tensor& c) override;
  void gemm_batched(bool trans_a, bool trans_b, float alpha, const Tensor& a, const Tensor& b, float beta,
                    Tensor& c) override;
  void linear_forward(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y) override;

  void unscale_and_check(const std::vector<Tensor>& grads, const Tensor& scale, Tensor& found_inf) override;
  void check_finite(const std::vector<Tensor>& xs, const Tensor& scale, Tensor& found_inf) override;
  void update_scale(Tensor& scale, Tensor& tracker, const Tensor& found_inf, const ScaleUpdateHyper& h) override;
  void sgd_step(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                const std::vector<Tensor>& momentum_bufs, Tensor& step_count, const SgdHyper& h,
                const Tensor& found_inf, const Tensor& grad_scale, const std::vector<Tensor>& copies) override;
  void adam_step(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                 const std::vector<Tensor>& exp_avgs, const std::vector<Tensor>& exp_avg_sqs,
                 const std::vector<Tensor>& max_exp_avg_sqs, Tensor& step_count, const AdamHyper& h,
                 const Tensor& found_inf, const Tensor& grad_scale, const std::vector<Tensor>& copies) override;
  void norm_accumulate(const std::vector<Tensor>& xs, double p, Tensor& out) override;
  void clip_by_norm(const std::vector<Tensor>& xs, const Tensor& total_norm, double max_norm) override;
  void clamp(const std::vector<Tensor>& xs, double lo, double hi) override;

 private:
  // A caching allocator: freed blocks are kept by size and handed out again, so the tensors of
  // each training step reuse memory that is already mapped (no page faults, no zeroing by the OS).
  // current/peak count bytes held by tensors, not the cache.
  std::mutex mutex_;
  std::map<size_t, std::vector<void*>> free_blocks_;
  size_t cached_bytes_ = 0;
  std::atomic<size_t> current_{0};
  std::atomic<size_t> peak_{0};

 public:
  void empty_cache();  // returns every cached block to the system
  ~CpuBackend() override;
};

Backend& cpu_backend();

}  // namespace amp
