// Differentiable tensor ops. Each records its backward (autograd.h) and declares its autocast
// policy (autocast_policy.h). Binary ops broadcast as NumPy does.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "runtime/core/tensor.h"

namespace amp {

// --- element-wise
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor add(const Tensor& a, double s);
Tensor sub(const Tensor& a, double s);
Tensor mul(const Tensor& a, double s);
Tensor div(const Tensor& a, double s);
Tensor neg(const Tensor& x);
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor sqrt(const Tensor& x);
Tensor pow(const Tensor& x, double exponent);
Tensor relu(const Tensor& x);
Tensor gelu(const Tensor& x, bool tanh_approximation = false);
// Autograd-aware dtype conversion (round to nearest even); the gradient is cast back.
Tensor cast(const Tensor& x, DType dtype);
// cast(x, values.dtype()) whose result is already in `values` (the same numbers, computed elsewhere:
// an optimizer's low-precision copy of its parameters). Shares values' storage; the backward is cast's.
Tensor cast_precomputed(const Tensor& x, const Tensor& values);

// Gradient helpers, differentiable in grad: relu's and gelu's backward.
Tensor relu_backward(const Tensor& grad, const Tensor& x);
Tensor gelu_backward(const Tensor& grad, const Tensor& x, bool tanh_approximation);

// --- shapes and reductions
Tensor expand(const Tensor& x, const Shape& shape);  // broadcast (materialised)
Tensor sum_to(const Tensor& x, const Shape& shape);  // reverse of expand
Tensor sum(const Tensor& x);                          // all elements, 0-d result
Tensor sum(const Tensor& x, int64_t dim, bool keepdim = false);
Tensor mean(const Tensor& x);
Tensor mean(const Tensor& x, int64_t dim, bool keepdim = false);

// --- linear algebra (2-D)
Tensor matmul(const Tensor& a, const Tensor& b);
// op(a) @ op(b) with transposes applied inside the GEMM.
Tensor mm(const Tensor& a, const Tensor& b, bool trans_a, bool trans_b);
// x @ w^T + b, w is [out, in] as in PyTorch. b may be undefined.
Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b);
// (Its bf16 weight gradients under autocast: set_fp32_weight_grads, runtime/ops/autocast_policy.h.)
// The transformer's MLP with GPT-2's GELU: linear(gelu(linear(x, w1, b1), tanh), w2, b2) as one
// node, the GELU inside the GEMMs where the backend has the epilogues (cuBLASLt's GELU_AUX_BIAS
// forward, DGELU backward; Backend::linear_gelu_tanh_forward). The same numbers as the three ops on
// the CPU; on a GPU within the bounds those backend calls state. No double backward.
Tensor mlp_gelu_tanh(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2, const Tensor& b2);
// The inner product of two 1-D tensors of one length (a 0-d result). On CUDA's autocast promote list.
Tensor dot(const Tensor& a, const Tensor& b);

// --- softmax and losses (along the last dimension; dim must be -1 or dim()-1)
Tensor softmax(const Tensor& x, int64_t dim = -1);
Tensor log_softmax(const Tensor& x, int64_t dim = -1);
// Attention's masked softmax of scores x [..., T, T] (query i attends to keys 0..i):
// softmax(scale x + causal mask) in one pass; autocast as softmax. First-order backward only.
Tensor causal_softmax(const Tensor& x, double scale = 1.0);
Tensor mse_loss(const Tensor& input, const Tensor& target);  // mean reduction
Tensor nll_loss(const Tensor& logp, const Tensor& target);   // target: int64 class indices, mean
Tensor cross_entropy(const Tensor& logits, const Tensor& target);  // no ignore_index: -100 is out of range
// A classifier's cross-entropy fused (Backend::cross_entropy): the logits [N, V] are read in their own
// dtype (16-bit under autocast: no fp32 copy, no log-softmax in memory) and the backward writes their
// gradient in that dtype in one pass. Only the first `classes` columns (-1: all V) are classes: a
// padded vocabulary's columns past them are in neither the softmax nor the loss, and get gradient 0.
// The loss is fp32 (fp64 for fp64 logits); cross_entropy's numbers up to rounding. First-order
// backward only.
Tensor fused_cross_entropy(const Tensor& logits, const Tensor& target, int64_t classes = -1);

// --- transformer ops (ops_transformer.cpp)
// Rows of weight [V, C] picked by int64 indices of any shape: [*indices.shape, C]. The backward
// scatter-adds into a [V, C] gradient.
Tensor embedding(const Tensor& weight, const Tensor& indices);
// LayerNorm over the last dim, weight and bias [C] (autocast: fp32 on CUDA's list).
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps = 1e-5);
// layer_norm whose output goes straight into a linear layer of weight `linear_weight`: written in the
// dtype autocast casts the linear's input to (bf16 or fp16 under autocast; otherwise layer_norm's own)
// in the same pass, and its backward reads the gradient in that dtype. The numbers of layer_norm, then
// autocast's cast (forward), and of the cast's backward, then layer_norm's (backward), bit for bit.
Tensor layer_norm_into_linear(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                              const Tensor& linear_weight);
// A residual add and the LayerNorm after it: {h, layer_norm_into_linear(h, ...)} for h = add(x, branch),
// the two in one pass where the backend has one (x wider than or as wide as branch, one shape, and
// LayerNorm reading h as it is). The numbers and the graph of the two ops, bit for bit.
std::pair<Tensor, Tensor> add_layer_norm_into_linear(const Tensor& x, const Tensor& branch, const Tensor& weight,
                                                     const Tensor& bias, double eps, const Tensor& linear_weight);
// A copy with dims permuted: out.shape[i] = x.shape[dims[i]].
Tensor permute(const Tensor& x, const std::vector<int64_t>& dims);
Tensor transpose(const Tensor& x, int64_t dim0, int64_t dim1);
// x[index] along dim 0 (a view of x's storage).
Tensor select(const Tensor& x, int64_t index);
// Batched op(a) @ op(b): [B, m, k] @ [B, k, n] -> [B, m, n] (autocast: lower precision).
Tensor bmm(const Tensor& a, const Tensor& b, bool trans_a = false, bool trans_b = false);
// Where a random draw starts (dropout's masks): element i takes counter offset + i of seed's
// stream, so the same counters drop the same elements anywhere. With base (an int64 [1] tensor on the
// device), the counters start at offset + base[0] * per_base, read by the kernel: a step captured in
// a CUDA graph draws from the base written before each replay.
struct RandomCounters {
  uint64_t seed = 0;
  uint64_t offset = 0;
  Tensor base;
  uint64_t per_base = 0;
};

// Zeroes each element with probability p and scales the rest by 1 / (1 - p), element i's draw
// taken from counters (above).
Tensor dropout(const Tensor& x, double p, const RandomCounters& counters);
inline Tensor dropout(const Tensor& x, double p, uint64_t seed, uint64_t offset) {
  return dropout(x, p, RandomCounters{seed, offset, Tensor(), 0});
}

// Which kernels compute a causal attention (with dropout: always the composite's primitives):
//   automatic  cuDNN's fused attention where it runs (a CUDA device, the library found, bf16/fp16,
//              a head size it takes), else the backend's own fused kernels, else the composite's;
//              where cuDNN's cannot run on a CUDA device it says why, once, on stderr; where it
//              fails at run time (a graph it would not build, a workspace that did not fit: its
//              deterministic backward keeps dS, B H T^2 2 bytes), a backward included, that shape
//              takes the backend's own kernels from then on, said once
//   cudnn      cuDNN's, or std::invalid_argument saying why it cannot run (dropout among the reasons)
//   fused      the backend's own fused kernels where it has them, else the composite's
//   composite  the primitives (permute, bmm, causal softmax, dropout, bmm)
// A forward without autograd (qkv needs no gradient, or no_grad: evaluation, sampling) takes the
// backend's own fused kernels under automatic and cudnn alike: cuDNN's builds graphs per shape.
enum class AttentionKernels : uint8_t { automatic, cudnn, fused, composite };

struct AttentionOptions {
  double dropout_p = 0.0;  // on the attention weights, in [0, 1)
  RandomCounters dropout;  // the weights' mask, drawn as dropout() draws it
  AttentionKernels kernels = AttentionKernels::automatic;
};
// GPT's causal self-attention of qkv [B, T, 3C] (q, k and v side by side, as c_attn makes them)
// with n_head heads, fused: the heads of causal_softmax(q k^T, 1/sqrt(C/n_head)), dropped out as
// dropout(., p, counters) would, times v, merged back to [B, T, C]. The same primitives, dtypes
// (autocast: the products in lower precision, the softmax in float32) and numbers as composing those
// ops, but the backward writes d(qkv) in one pass. First-order backward only. Without dropout, where
// options.kernels allows it, fused kernels instead (AttentionKernels): the scores in fp32, never
// stored (the numbers of exact attention, rounded once).
Tensor causal_attention(const Tensor& qkv, int64_t n_head, const AttentionOptions& options = {});

inline Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
inline Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
inline Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
inline Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
inline Tensor operator*(const Tensor& a, double s) { return mul(a, s); }
inline Tensor operator*(double s, const Tensor& a) { return mul(a, s); }
inline Tensor operator/(const Tensor& a, double s) { return div(a, s); }
inline Tensor operator+(const Tensor& a, double s) { return add(a, s); }
inline Tensor operator-(const Tensor& a, double s) { return sub(a, s); }
inline Tensor operator-(const Tensor& x) { return neg(x); }

// --- in-place, no autograd (optimizers, gradient accumulation)
void add_(Tensor& dst, const Tensor& src);  // dst += src (same shape)
void copy_(Tensor& dst, const Tensor& src); // same shape; casts between dtypes
void fill_(Tensor& t, double value);
void mul_(Tensor& t, double s);

}  // namespace amp
