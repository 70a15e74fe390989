// Backend: the kernels a device must provide (its memory, copies and read-backs are the other half:
// runtime/core/device_memory.h). The CPU backend is runtime/kernels/cpu/, the CUDA one
// runtime/kernels/cuda/. Ops and autograd call only these, so semantics are identical on both devices.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/kernels/optim_math.h"
#include "runtime/core/device_memory.h"
#include "runtime/core/tensor.h"

namespace amp {

// Element-wise unary functions y = f(x, alpha); alpha is unused by most.
enum class UnaryOp : uint8_t { neg, exp, log, sqrt, relu, gelu, gelu_tanh, pow_scalar, mul_scalar, div_scalar, add_scalar, copy };
// Element-wise binary functions with broadcasting. The *_backward ones take (grad, x).
enum class BinaryOp : uint8_t { add, sub, mul, div, relu_backward, gelu_backward, gelu_tanh_backward };

// The hyperparameters of the scale-update kernel (update_scale below): GradScaler's rule and the
// peers' extensions, whose math is amp_math.h's. A plain struct the kernel takes by value; the
// scaler itself (amp/grad_scaler.h) lives two layers up.
struct ScaleUpdateHyper {
  double growth_factor, backoff_factor;  // doubles, as PyTorch passes them: (float)((double)scale * factor)
  int growth_interval, hysteresis;
  float min_scale, max_scale;
};

// Clipping by a total norm, folded into an optimizer's step: every gradient times
// math::clip_coefficient(total_norm, max_norm) as the step reads it (total_norm: 1-element f32 on the
// parameters' device, read when the step runs). An undefined total_norm: no clipping.
// Which fused attention computes a causal attention: the backend's own kernels, or cuDNN's.
enum class FusedAttention : uint8_t { own, cudnn };

struct NormClip {
  Tensor total_norm;
  double max_norm = 0.0;
};

class Backend {
 public:
  virtual ~Backend() = default;

  // --- element-wise and reductions
  virtual void cast(const Tensor& src, Tensor& dst) = 0;  // any float dtype to any float dtype
  virtual void unary(UnaryOp op, const Tensor& x, Tensor& y, double alpha) = 0;
  virtual void binary(BinaryOp op, const Tensor& a, const Tensor& b, Tensor& out) = 0;  // broadcasts a, b to out
  // out = a + b of one shape where b's float dtype differs from a's and out's (a residual stream plus a
  // 16-bit branch under autocast): b read as its cast to out's dtype, the numbers of cast then add.
  // This default makes the two passes; a backend may make one.
  virtual void add_cast(const Tensor& a, const Tensor& b, Tensor& out);
  virtual void broadcast_to(const Tensor& x, Tensor& out) = 0;
  // out's shape is x's with some dims of size 1 (after left-padding out's shape with ones).
  virtual void sum_to(const Tensor& x, Tensor& out) = 0;
  virtual void softmax_lastdim(const Tensor& x, Tensor& y, bool log) = 0;
  // loss = -mean_i logp[i, target[i]]; grad_logp[i, t_i] = -grad / N, zero elsewhere.
  virtual void nll_loss(const Tensor& logp, const Tensor& target, Tensor& loss) = 0;
  virtual void nll_loss_backward(const Tensor& grad, const Tensor& target, Tensor& grad_logp) = 0;
  // The classifier's loss in one pass over its logits [N, V], read in their own dtype (16-bit under
  // autocast: no copy in fp32): the softmax cross-entropy over the first `classes` columns (a padded
  // vocabulary's columns past it are in neither the softmax nor the loss). lse[r] = log sum_{c <
  // classes} e^x[r, c] (each row's sum in fp64), loss = mean_r (lse[r] - x[r, t_r]) (in fp64); lse [N]
  // and loss [] fp32 (fp64 for fp64 logits). A target outside [0, classes) throws on the CPU and
  // makes the loss NaN on CUDA, as nll_loss.
  virtual void cross_entropy(const Tensor& logits, const Tensor& target, int64_t classes, Tensor& lse,
                             Tensor& loss) = 0;
  // Its gradient, the other pass: gx[r, c] = (grad / N) (e^(x[r, c] - lse[r]) - [c == t_r]) for c <
  // classes, 0 past it (math::cross_entropy_grad), in the logits' dtype; grad is the loss's []. gx may
  // be logits (written over them).
  virtual void cross_entropy_backward(const Tensor& logits, const Tensor& target, const Tensor& lse,
                                      const Tensor& grad, int64_t classes, Tensor& gx) = 0;
  // Fills with U[lo, hi) or N(mean, std) from a counter-based stream: element i uses counter offset + i.
  virtual void fill_uniform(Tensor& t, uint64_t seed, uint64_t offset, double lo, double hi) = 0;
  virtual void fill_normal(Tensor& t, uint64_t seed, uint64_t offset, double mean, double std) = 0;

  // --- transformer primitives (one file per family in runtime/kernels/cpu/ and runtime/kernels/cuda/)
  // out[n, :] = weight[idx[n], :]: weight [V, C], idx int64 [N], out [N, C]. An index outside
  // [0, V) throws on the CPU; on CUDA (which cannot throw without a host sync) its row becomes NaN.
  virtual void embedding(const Tensor& weight, const Tensor& idx, Tensor& out) = 0;
  // grad_weight[idx[n], :] += grad[n, :] for n in order (deterministic); out-of-range rows are skipped.
  // (CUDA sums each row's indices first, rounds the sum into the dtype and adds it once: into zeros the
  // same thing.)
  virtual void embedding_backward(const Tensor& grad, const Tensor& idx, Tensor& grad_weight) = 0;
  // grad_weight += what embedding_backward writes into zeros, with add()'s numbers: where grad_weight
  // already holds a gradient (a tied classifier's: autograd's take_leaf_gradient_so_far). This default
  // makes that zeroed gradient and adds it; the CUDA backend adds each named row's sum into its row
  // once (no [V, C] temporary, no pass over the rows no index names): the same bits, save that a row
  // no index names keeps a -0 where the add would write +0.
  virtual void embedding_backward_add(const Tensor& grad, const Tensor& idx, Tensor& grad_weight);
  // Over the last dim C of x [rows, C]: y = (x - mean) * rstd * w + b, with mean and rstd (f32
  // [rows]) saved for the backward; statistics in double. w, b: [C], x's dtype.
  virtual void layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, double eps, Tensor& y, Tensor& mean,
                          Tensor& rstd) = 0;
  // gx = d/dx, gw = sum over rows of g * xhat, gb = sum over rows of g (each row and column summed
  // in double, in a fixed order). accumulate: gx += d/dx instead (d/dx rounded to x's dtype, then
  // added as add() adds: the numbers of add(gx, d/dx); a residual stream's gradient in the same pass).
  virtual void layer_norm_backward(const Tensor& g, const Tensor& x, const Tensor& w, const Tensor& mean,
                                   const Tensor& rstd, Tensor& gx, Tensor& gw, Tensor& gb, bool accumulate) = 0;
  // layer_norm with y in another float dtype than x (autocast's cast to the next op's dtype folded
  // in: the numbers of layer_norm, then cast), and layer_norm_backward with g in another dtype than x
  // (read as its cast to x's dtype: the numbers of cast, then layer_norm_backward); gx_low, when
  // defined (gx's shape, another float dtype), also gets gx's final values cast to its dtype (the
  // numbers of cast(gx) after the pass: a residual stream's gradient as the branch beside it takes
  // it). These defaults make the passes apart; a backend may make one.
  virtual void layer_norm_cast(const Tensor& x, const Tensor& w, const Tensor& b, double eps, Tensor& y, Tensor& mean,
                               Tensor& rstd);
  virtual void layer_norm_backward_cast(const Tensor& g, const Tensor& x, const Tensor& w, const Tensor& mean,
                                        const Tensor& rstd, Tensor& gx, Tensor& gw, Tensor& gb, bool accumulate,
                                        const Tensor& gx_low);
  // A residual add and the LayerNorm after it: sum = a + b (b of a's dtype or narrower, read as its
  // promotion: add_cast's numbers), then layer_norm_cast of sum into y. The default makes the passes
  // apart; a backend may make one (reading a and b, writing sum and y).
  virtual void add_layer_norm_cast(const Tensor& a, const Tensor& b, const Tensor& w, const Tensor& bias, double eps,
                                   Tensor& sum, Tensor& y, Tensor& mean, Tensor& rstd);
  // out = x with its dims permuted: out.shape[d] = x.shape[perm[d]] (at most 8 dims).
  virtual void permute(const Tensor& x, const std::vector<int64_t>& perm, Tensor& out) = 0;
  // Attention's softmax over [.., T, T] score rows: row r is query i = r mod T, and
  // y[j] = exp(scale x[j] - m) / sum over k <= i of exp(scale x[k] - m) for j <= i, 0 for j > i.
  virtual void causal_softmax(const Tensor& x, Tensor& y, double scale) = 0;
  // The gradient of a softmax along the last dim from its output y: gx = scale y (g - sum(g y)); of
  // a log-softmax (log): gx = g - exp(y) sum(g). Row sums in double.
  virtual void softmax_backward(const Tensor& y, const Tensor& g, Tensor& gx, bool log, double scale) = 0;
  // Attention's softmax with autocast's casts folded in: y = causal_softmax(x cast to y's dtype,
  // scale) and, where `low` is defined, low = y cast to low's dtype (the next bmm's input). The
  // numbers are those of cast, causal_softmax, cast; this default makes those passes, a backend may
  // make one.
  virtual void causal_softmax_cast(const Tensor& x, Tensor& y, const Tensor& low, double scale);
  // softmax_backward (not log) with g cast to y's dtype first and gx the result cast to gx's dtype:
  // the numbers of cast, softmax_backward, cast; the same default.
  virtual void softmax_backward_cast(const Tensor& y, const Tensor& g, Tensor& gx, double scale);
  // Causal self-attention without the [T, T] scores in memory (FlashAttention's order: scores, their
  // softmax and the product with v, a tile of keys at a time, all in fp32). qkv [B, T, 3C] holds q, k,
  // v side by side, H heads of D = C / H each; y [B, T, C] in qkv's dtype; lse [B, H, T] f32, each
  // row's log-sum-exp of its scaled scores (what the backward recomputes the softmax from). Optional:
  // a backend that has it says so for the dtype and head size; the op falls back to its composite.
  // `which`: the backend's own kernels (has_fused_attention), or cuDNN's fused attention where the
  // library runs (cudnn_attention_unavailable() is ""); the backward must be the forward's own.
  virtual bool has_fused_attention(DType, int64_t /*head_dim*/) const { return false; }
  virtual std::string cudnn_attention_unavailable(DType, int64_t /*head_dim*/) const {
    return "cuDNN's attention runs on a CUDA device";
  }
  virtual void attention_forward(const Tensor& qkv, int64_t n_head, double scale, Tensor& y, Tensor& lse,
                                 FusedAttention which = FusedAttention::own);
  // d(qkv) [B, T, 3C] in qkv's dtype from gy [B, T, C] (y's dtype), recomputing the scores.
  virtual void attention_backward(const Tensor& qkv, const Tensor& y, const Tensor& lse, const Tensor& gy,
                                  int64_t n_head, double scale, Tensor& dqkv, FusedAttention which = FusedAttention::own);
  // mask[i] = 1 / (1 - p) where uniform01(seed, c + i) >= p, else 0 (math::dropout_mask), with
  // c = offset + base[0] * per_base: base, when defined, an int64 [1] tensor on mask's device that the
  // kernel reads (a CUDA graph's replay takes the value written before it, not the captured one).
  virtual void dropout_mask(Tensor& mask, uint64_t seed, uint64_t offset, double p, const Tensor& base = Tensor(),
                            uint64_t per_base = 0) = 0;

  // --- GEMM: c = alpha * op(a) @ op(b) + beta * c, 2-D row-major. a and b share a dtype; products
  // accumulate in fp32 (fp64 for f64); c may be a's dtype or fp32.
  virtual void gemm(bool trans_a, bool trans_b, float alpha, const Tensor& a, const Tensor& b, float beta,
                    Tensor& c) = 0;
  // The same for each i of a batch: c[i] = alpha * op(a[i]) @ op(b[i]) + beta * c[i], 3-D [B, ., .]
  // contiguous operands (one cuBLAS launch on CUDA; one oneDNN primitive on the CPU).
  virtual void gemm_batched(bool trans_a, bool trans_b, float alpha, const Tensor& a, const Tensor& b, float beta,
                            Tensor& c) = 0;
  // Optional (has a default): a linear layer's forward, y = x @ w^T + bias (bias [n] added to every
  // row, before y's one rounding). The default broadcasts the bias into y and accumulates the product
  // onto it (beta = 1); a backend with a GEMM epilogue overrides it.
  virtual void linear_forward(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y);
  // Optional: a linear layer and the tanh GELU after it (the MLP's first half): pre = x @ w^T + bias
  // and y = gelu_tanh(pre), both in x's dtype, pre kept for the backward. The default is
  // linear_forward into pre, then the GELU's pass over pre. A backend with cuBLASLt's GELU epilogue
  // (the tanh form) computes both in the GEMM, y from the fp32 sum rather than from rounded pre:
  // |y - gelu_tanh(pre)| <= ulp(y) + 1.13 ulp(pre) + 2^-11 |pre| (the last for a fast tanh, which
  // a GPU's epilogue may use; test_cuda's bound).
  virtual void linear_gelu_tanh_forward(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& pre, Tensor& y);
  // Optional: the input gradient of a linear layer whose input was gelu_tanh(pre), taken back
  // through the GELU: dpre = (g @ w) * gelu_tanh'(pre), g [r, o], w [o, h], pre and dpre [r, h], one
  // dtype. The default is the GEMM into a temporary, then the GELU's backward pass; cuBLASLt's DGELU
  // epilogue applies the slope to the fp32 product, not to its rounding: |dpre - p gelu_tanh'(pre)|
  // <= 1.13 (the fp32 sums' bound) + 2^-10 |p| (a fast tanh) + ulp(dpre), p = g @ w (test_cuda's bound).
  virtual void linear_input_grad_gelu_tanh(const Tensor& g, const Tensor& w, const Tensor& pre, Tensor& dpre);
  // Optional: whether linear_param_grads computes a linear layer's weight and bias gradients in one
  // pass over g (dtype g_dtype) into gradients of dtype out. The default: no (the caller takes the
  // weight gradient's GEMM, then sum_to for the bias).
  virtual bool fuses_linear_param_grads(DType g_dtype, DType out) const;
  // Where fuses_linear_param_grads says so: dw = g^T x ([o, in]) and db = g summed over its rows
  // ([o]), g [r, o], x [r, in], dw and db of one dtype. On CUDA, cuBLASLt's BGRADB epilogue reduces
  // the bias gradient inside the weight gradient's GEMM, in fp32 (one rounding to db's dtype); where
  // cuBLASLt has no algorithm, the GEMM and sum_to. The default is the latter (sum_to's sums rounded to
  // g's dtype, then cast to db's).
  virtual void linear_param_grads(const Tensor& g, const Tensor& x, Tensor& dw, Tensor& db);

  // --- fused multi-tensor AMP and optimizer kernels. found_inf and scale are 1-element f32 device tensors.
  // grads *= (float)(1.0 / (double)scale); found_inf = 1 if any unscaled grad is inf or NaN (never
  // reset here; amp_math.h unscaled_is_nonfinite). per_tensor (optional: f32 [grads.size()] on the
  // device) says which: per_tensor[i] = 1 where grads[i] has one (never reset here either), for a
  // caller to read after a skipped step.
  virtual void unscale_and_check(const std::vector<Tensor>& grads, const Tensor& scale, Tensor& found_inf,
                                 const Tensor& per_tensor = Tensor()) = 0;
  // scale: float32 (0-dim or 1 element); tracker: int64 [growth_tracker, hysteresis_left], both on
  // the device; see amp_math.h update_scale.
  virtual void update_scale(Tensor& scale, Tensor& tracker, const Tensor& found_inf, const ScaleUpdateHyper& h) = 0;
  // found_inf = 1 if any element of xs, times (float)(1.0 / (double)scale), is inf or NaN (never
  // reset here): what unscale_and_check would find, per_tensor too. Read-only. An undefined scale means 1.
  virtual void check_finite(const std::vector<Tensor>& xs, const Tensor& scale, Tensor& found_inf,
                            const Tensor& per_tensor = Tensor()) = 0;
  // check_finite's per_tensor where found_inf is already this pass's verdict on xs, found by a pass that
  // read them anyway (chunk_sums_of_squares' found_inf, the gradient norm's): where it is 0, xs are not
  // read and per_tensor is left as it is; where it is set, per_tensor gets check_finite's flags.
  // found_inf is only read (on a GPU, by the kernel: no host read).
  virtual void nonfinite_flags_if_found(const std::vector<Tensor>& xs, const Tensor& scale, const Tensor& found_inf,
                                        const Tensor& per_tensor) = 0;
  // Optimizer steps; a defined found_inf that is nonzero makes them leave everything untouched.
  // step_count is a 1-element f32 tensor, incremented only when the step is taken. A defined
  // grad_scale (1-element f32) means the gradients are still scaled: each is multiplied by
  // inverse_scale(grad_scale) and written back unscaled in the same pass (PyTorch's fused path).
  // copies: empty, or one per parameter, all float16 or all bfloat16, each as many elements as its
  // parameter: each is written with its parameter's new value, rounded as cast() rounds, in the same
  // pass (Optimizer::keep_low_precision_copies); a skipped step writes none. A defined lr (1-element
  // f64 on the parameters' device) replaces h.lr, read when the step runs: a replayed CUDA graph takes
  // its value then, where h.lr would stay the value captured. A defined clip.total_norm folds
  // clip_by_norm into the pass: each gradient, unscaled, is multiplied by the clipping factor as it is
  // read (math::read_gradient), and written back so where h.keep_unscaled_grads, as with grad_scale.
  virtual void sgd_step(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                        const std::vector<Tensor>& momentum_bufs, Tensor& step_count, const SgdHyper& h,
                        const Tensor& found_inf, const Tensor& grad_scale, const std::vector<Tensor>& copies,
                        const Tensor& lr = Tensor(), const NormClip& clip = NormClip()) = 0;
  virtual void adam_step(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                         const std::vector<Tensor>& exp_avgs, const std::vector<Tensor>& exp_avg_sqs,
                         const std::vector<Tensor>& max_exp_avg_sqs, Tensor& step_count, const AdamHyper& h,
                         const Tensor& found_inf, const Tensor& grad_scale, const std::vector<Tensor>& copies,
                         const Tensor& lr = Tensor(), const NormClip& clip = NormClip()) = 0;
  // out (1-element f32) += sum over tensors of sum |x|^p (p = 2: squares; p = 0: nonzero count);
  // p = inf: out = max(out, max |x|); p = -inf: out = min(out, min |x|). A NaN element wins a max or min.
  virtual void norm_accumulate(const std::vector<Tensor>& xs, double p, Tensor& out) = 0;
  // The same for each tensor alone, in one pass over all of them: out (f32, one element per tensor)
  // gets at i what norm_accumulate({xs[i]}, p, out[i]) would (torch._foreach_norm's accumulations).
  virtual void norm_accumulate_each(const std::vector<Tensor>& xs, double p, Tensor& out) = 0;
  // The same with p = 2 over the chunks of a 1-D x: out[k] (f32) += the sum of squares of x[k chunk,
  // min((k + 1) chunk, n)) for each of its ceil(n / chunk) chunks (comm/chunked_norm.h's unit): what
  // norm_accumulate_each over the chunks' views gives, in one launch however many chunks there are.
  // scale (a 1-element f32 on x's device, or undefined: 1): x still carries a loss scale, and the
  // squares are those of x as unscale_and_check would leave it (each element times inverse_scale,
  // stored in x's dtype): the sums are bit for bit those of the unscaled x, and x is not written.
  // found_inf (a 1-element f32 on x's device, or undefined): set to 1 where an unscaled element is inf
  // or NaN, as check_finite would (never reset here), in the same read of x: with it, the norm's pass
  // is also the loss scaler's check (GradScaler::check_inf_ with a fused pass).
  virtual void chunk_sums_of_squares(const Tensor& x, int64_t chunk, Tensor& out, const Tensor& scale,
                                     const Tensor& found_inf = Tensor()) = 0;
  // The same over a float32 vector of n elements that is not stored: pieces[i] (float32, on out's
  // device) at [offsets[i], offsets[i] + pieces[i].numel()), the offsets ascending and the pieces
  // apart within [0, n), zeros elsewhere. out gets what chunk_sums_of_squares adds for that vector,
  // bit for bit, and the pieces are only read (the chunked norm of gradients that are not in buckets:
  // one rank, one micro-batch; comm/chunked_norm.h). This default writes the vector, a temporary of n
  // elements; the CUDA backend reads each element where it lies.
  virtual void chunk_sums_of_squares_gathered(const std::vector<Tensor>& pieces, const std::vector<int64_t>& offsets,
                                              int64_t n, int64_t chunk, Tensor& out, const Tensor& scale,
                                              const Tensor& found_inf = Tensor());
  // xs *= math::clip_coefficient(total_norm, max_norm), with total_norm a 1-element device tensor.
  virtual void clip_by_norm(const std::vector<Tensor>& xs, const Tensor& total_norm, double max_norm) = 0;
  virtual void clamp(const std::vector<Tensor>& xs, double lo, double hi) = 0;
};

// The backend that owns a device. Throws a clear error for a device that is not built or not present.
// The dtype of an optimizer step's low-precision copies (sgd_step, adam_step), DType::f32 when there
// are none; throws std::invalid_argument unless they are one per parameter, of one dtype, each with
// its parameter's element count and device.
DType low_precision_copies_dtype(const std::vector<Tensor>& params, const std::vector<Tensor>& copies);
// A kernel's device-side scalar (an optimizer step's lr, dropout's counter base): throws
// std::invalid_argument naming `what` unless t is one element of dtype on device.
void require_device_scalar(const Tensor& t, DType dtype, Device device, const char* what);
Backend& backend_for(Device d);
void register_backend(DeviceType t, Backend* b);  // called by a backend's static registrar
bool backend_available(DeviceType t);

}  // namespace amp
