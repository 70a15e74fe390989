// The ops a transformer needs beyond the MLP's: embedding, layer norm, batched matmul, permute,
// transpose and select (the views of attention's heads), GPT's fused causal attention, and dropout.
// embedding's, layer_norm's and the attention's backward call the backend directly (they are not
// differentiable twice); the others are built from differentiable ops.
#include <cmath>
#include <memory>
#include <cstdio>
#include <mutex>
#include <numeric>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>

#include "runtime/core/device_memory.h"
#include "runtime/ops/autocast_policy.h"
#include "runtime/ops/autograd.h"
#include "runtime/kernels/backend.h"
#include "runtime/ops/ops.h"

namespace amp {

namespace {
bool needs(const Tensor& t) { return t.defined() && t.requires_grad(); }
DType stat_dtype(DType t) { return t == DType::f64 ? DType::f64 : DType::f32; }
}  // namespace

Tensor embedding(const Tensor& weight, const Tensor& indices) {
  if (weight.dim() != 2) throw std::invalid_argument("embedding: weight must be [num_embeddings, dim], got " + shape_str(weight.shape()));
  if (indices.dtype() != DType::i64) throw std::invalid_argument("embedding: indices must be int64, got " + std::string(dtype_name(indices.dtype())));
  if (indices.device() != weight.device())
    throw std::invalid_argument("embedding: indices on " + indices.device().str() + ", weight on " + weight.device().str());
  Shape out_shape = indices.shape();
  out_shape.push_back(weight.shape()[1]);
  Tensor out = empty(out_shape, weight.dtype(), weight.device());
  backend_for(weight.device()).embedding(weight, indices, out);
  const Shape wshape = weight.shape();
  const Tensor table = weight.is_leaf() ? weight : Tensor();  // a parameter, alive anyway
  return record("EmbeddingBackward", out, {weight}, [indices, wshape, table](const Tensor& g) {
    // A table whose gradient another use made first (GPT's classifier, tied to wte): the rows added
    // into that gradient, not a zeroed [V, C] table that the engine then adds to it.
    Tensor gw = take_leaf_gradient_so_far(table, g.dtype());
    if (gw.defined()) {
      backend_for(g.device()).embedding_backward_add(g, indices, gw);
      return std::vector<Tensor>{gw};
    }
    gw = zeros(wshape, g.dtype(), g.device());
    backend_for(g.device()).embedding_backward(g, indices, gw);
    return std::vector<Tensor>{gw};
  });
}

namespace {
// x's gradient cast for the branch that was added to make x (add_layer_norm_into_linear): the
// LayerNorm's backward writes it beside the sum it computes, and the add's backward takes it where
// the gradient it is given is that very sum (nothing added after it), instead of casting again.
struct BranchGradient {
  DType dtype;
  Tensor of;    // the gradient it is a cast of (held, so that no other tensor takes its place)
  Tensor cast;  // cast(of, dtype)
};

// LayerNorm's node: y's backward to x (its own dtype), w and b; with branch, x's gradient cast too.
Tensor record_layer_norm(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& mean,
                         const Tensor& rstd, std::shared_ptr<BranchGradient> branch = nullptr) {
  return record("LayerNormBackward", y, {x, w, b}, [x, w, b, mean, rstd, branch](const Tensor& g) {
    // A residual stream's x: the add that reads it too has given its gradient; this one is added in.
    Tensor gx = take_gradient_so_far(0, x);
    const bool accumulate = gx.defined();
    if (!accumulate) gx = empty_like(x);
    // The parameters' gradients straight into their destinations (the reducer's buckets) where they have them.
    Tensor gw = take_grad_destination(w, w.dtype()), gb = take_grad_destination(b, b.dtype());
    if (!gw.defined()) gw = empty_like(w);
    if (!gb.defined()) gb = empty_like(w);
    Tensor low;  // not under create_graph: the add's cast of its gradient is then differentiable
    if (branch && branch->dtype != x.dtype() && !GradMode::enabled()) low = empty(x.shape(), branch->dtype, x.device());
    backend_for(g.device()).layer_norm_backward_cast(g, x, w, mean, rstd, gx, gw, gb, accumulate, low);
    if (low.defined()) *branch = BranchGradient{branch->dtype, gx, low};
    return std::vector<Tensor>{gx, gw, gb};
  });
}

// layer_norm with its output in x's dtype after autocast, or (next_linear_weight) in the dtype
// autocast gives the linear layer it feeds: the cast folded into the pass, and into the backward's.
Tensor layer_norm_to(const Tensor& x_in, const Tensor& w_in, const Tensor& b_in, double eps,
                     const Tensor* next_linear_weight) {
  Tensor x = x_in, w = w_in, b = b_in;
  autocast_inputs(OpKind::layer_norm, {&x, &w, &b});
  if (x.dim() < 1 || w.dim() != 1 || b.dim() != 1 || w.shape()[0] != x.size(-1) || b.shape()[0] != x.size(-1))
    throw std::invalid_argument("layer_norm: input " + shape_str(x.shape()) + " does not match weight " +
                                shape_str(w.shape()) + " and bias " + shape_str(b.shape()) +
                                " (normalized over the last dim)");
  // Outside an fp32 region the affine parameters take the input's dtype (PyTorch keeps them wider).
  if (w.dtype() != x.dtype()) w = w.to(x.dtype());
  if (b.dtype() != x.dtype()) b = b.to(x.dtype());
  const DType out = next_linear_weight == nullptr
                        ? x.dtype()
                        : autocast_dtype(OpKind::linear, x.dtype(), x.device().type, {next_linear_weight->dtype()});
  const int64_t rows = x.size(-1) == 0 ? 0 : x.numel() / x.size(-1);
  Tensor y = empty(x.shape(), out, x.device());
  Tensor mean = empty({rows}, stat_dtype(x.dtype()), x.device());
  Tensor rstd = empty({rows}, stat_dtype(x.dtype()), x.device());
  backend_for(x.device()).layer_norm_cast(x, w, b, eps, y, mean, rstd);
  return record_layer_norm(y, x, w, b, mean, rstd);
}

}  // namespace

Tensor layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, double eps) {
  return layer_norm_to(x, w, b, eps, nullptr);
}

Tensor layer_norm_into_linear(const Tensor& x, const Tensor& w, const Tensor& b, double eps, const Tensor& linear_weight) {
  return layer_norm_to(x, w, b, eps, &linear_weight);
}

std::pair<Tensor, Tensor> add_layer_norm_into_linear(const Tensor& x, const Tensor& branch, const Tensor& w,
                                                     const Tensor& b, double eps, const Tensor& linear_weight) {
  const DeviceType t = x.device().type;
  const bool one_pass =
      x.dim() > 0 && x.shape() == branch.shape() && is_floating(x.dtype()) && is_floating(branch.dtype()) &&
      x.device() == branch.device() && x.device() == w.device() && x.device() == b.device() &&
      result_type(x.dtype(), false, branch.dtype(), false) == x.dtype() && w.dtype() == x.dtype() &&
      b.dtype() == x.dtype() && autocast_dtype(OpKind::layer_norm, x.dtype(), t, {x.dtype()}) == x.dtype() &&
      w.dim() == 1 && b.dim() == 1 && w.shape()[0] == x.size(-1) && b.shape()[0] == x.size(-1);
  if (!one_pass) {
    const Tensor h = add(x, branch);
    return {h, layer_norm_into_linear(h, w, b, eps, linear_weight)};
  }
  const DType out = autocast_dtype(OpKind::linear, x.dtype(), t, {linear_weight.dtype()});
  const int64_t rows = x.size(-1) == 0 ? 0 : x.numel() / x.size(-1);
  Tensor h = empty(x.shape(), x.dtype(), x.device()), y = empty(x.shape(), out, x.device());
  Tensor mean = empty({rows}, stat_dtype(x.dtype()), x.device());
  Tensor rstd = empty({rows}, stat_dtype(x.dtype()), x.device());
  backend_for(x.device()).add_layer_norm_cast(x, branch, w, b, eps, h, y, mean, rstd);
  // add()'s backward (its one-shape case): the gradient, and its cast to the branch's dtype, which
  // the LayerNorm's backward has written where it computed the gradient (BranchGradient).
  // (None where the branch takes no gradient.)
  const DType db = branch.dtype();
  auto cast = needs(branch) ? std::make_shared<BranchGradient>(BranchGradient{db, Tensor(), Tensor()}) : nullptr;
  h = record("AddBackward", h, {x, branch}, [db, cast](const Tensor& g) {
    if (!cast) return std::vector<Tensor>{g, Tensor()};
    Tensor low = cast->of.defined() && cast->of.impl() == g.impl() ? cast->cast : g.to(db);
    *cast = BranchGradient{db, Tensor(), Tensor()};
    return std::vector<Tensor>{g, low};
  });
  return {h, record_layer_norm(y, h, w, b, mean, rstd, cast)};
}

Tensor permute(const Tensor& x, const std::vector<int64_t>& dims) {
  const int64_t n = x.dim();
  std::vector<int64_t> perm(dims.size());
  std::vector<bool> seen(static_cast<size_t>(n), false);
  bool ok = static_cast<int64_t>(dims.size()) == n;
  for (size_t i = 0; ok && i < dims.size(); ++i) {
    perm[i] = dims[i] < 0 ? dims[i] + n : dims[i];
    ok = perm[i] >= 0 && perm[i] < n && !seen[static_cast<size_t>(perm[i])];
    if (ok) seen[static_cast<size_t>(perm[i])] = true;
  }
  if (!ok) throw std::invalid_argument("permute: dims are not a permutation of the " + std::to_string(n) + " dims of " + shape_str(x.shape()));
  Shape out_shape(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) out_shape[i] = x.shape()[static_cast<size_t>(perm[i])];
  Tensor out = empty(out_shape, x.dtype(), x.device());
  backend_for(x.device()).permute(x, perm, out);
  std::vector<int64_t> inverse(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) inverse[static_cast<size_t>(perm[i])] = static_cast<int64_t>(i);
  return record("PermuteBackward", out, {x}, [inverse](const Tensor& g) { return std::vector<Tensor>{permute(g, inverse)}; });
}

Tensor transpose(const Tensor& x, int64_t d0, int64_t d1) {
  std::vector<int64_t> dims(static_cast<size_t>(x.dim()));
  std::iota(dims.begin(), dims.end(), 0);
  if (d0 < 0) d0 += x.dim();
  if (d1 < 0) d1 += x.dim();
  if (d0 < 0 || d1 < 0 || d0 >= x.dim() || d1 >= x.dim())
    throw std::invalid_argument("transpose: dims out of range for " + shape_str(x.shape()));
  std::swap(dims[static_cast<size_t>(d0)], dims[static_cast<size_t>(d1)]);
  return permute(x, dims);
}

Tensor select(const Tensor& x, int64_t index) {
  if (x.dim() < 1 || index < 0 || index >= x.shape()[0])
    throw std::invalid_argument("select: index " + std::to_string(index) + " is out of range for " + shape_str(x.shape()));
  const Shape inner(x.shape().begin() + 1, x.shape().end());
  const int64_t n = shape_numel(inner);
  Tensor out = x.view(index * n, inner);
  const Shape full_shape = x.shape();
  return record("SelectBackward", out, {x}, [full_shape, index, n, inner](const Tensor& g) {
    Tensor gx = zeros(full_shape, g.dtype(), g.device());
    Tensor slot = gx.view(index * n, inner);
    copy_(slot, g);
    return std::vector<Tensor>{gx};
  });
}

Tensor bmm(const Tensor& a_in, const Tensor& b_in, bool ta, bool tb) {
  Tensor a = a_in, b = b_in;
  autocast_inputs(OpKind::bmm, {&a, &b});
  if (a.dim() != 3 || b.dim() != 3 || a.shape()[0] != b.shape()[0])
    throw std::invalid_argument("bmm: expected [B, m, k] and [B, k, n], got " + shape_str(a.shape()) + " and " + shape_str(b.shape()));
  if (a.dtype() != b.dtype())
    throw std::invalid_argument(std::string("bmm: expected both operands to have the same dtype, but got ") +
                                dtype_name(a.dtype()) + " and " + dtype_name(b.dtype()));
  const int64_t B = a.shape()[0];
  const int64_t m = ta ? a.shape()[2] : a.shape()[1], k = ta ? a.shape()[1] : a.shape()[2];
  const int64_t kb = tb ? b.shape()[2] : b.shape()[1], n = tb ? b.shape()[1] : b.shape()[2];
  if (k != kb)
    throw std::invalid_argument("bmm: shapes cannot be multiplied (" + shape_str(a.shape()) + " and " + shape_str(b.shape()) + ")");
  Tensor c = empty({B, m, n}, a.dtype(), a.device());
  backend_for(a.device()).gemm_batched(ta, tb, 1.0f, a, b, 0.0f, c);
  // As mm's: dA = g B^T and dB = A^T g, transposed back where a or b was.
  return record("BmmBackward", c, {a, b}, [a, b, ta, tb](const Tensor& g) {
    Tensor ga, gb;
    if (needs(a)) ga = ta ? bmm(b, g, tb, true) : bmm(g, b, false, !tb);
    if (needs(b)) gb = tb ? bmm(g, a, true, ta) : bmm(a, g, !ta, false);
    return std::vector<Tensor>{ga, gb};
  });
}

namespace {

// What runs where automatic cannot use cuDNN's attention: the backend's own fused kernels, or
// (nullopt) the composite. With `say`, once per reason, on stderr: a graph the library would not
// build for a shape. (A library that is missing is for the caller to say: the GPT's run says it in
// its first line.)
std::optional<FusedAttention> fall_back_from_cudnn(Backend& be, DType dtype, int64_t head_dim, const std::string& why,
                                                   bool say) {
  static std::mutex mutex;
  static std::set<std::string> said;
  const bool own = be.has_fused_attention(dtype, head_dim);
  if (say) {
    std::lock_guard<std::mutex> lock(mutex);
    if (said.insert(why).second)
      std::fprintf(stderr, "notice: attention: not cuDNN's fused attention (%s): %s instead\n", why.c_str(),
                   own ? "our own fused kernels" : "the composite (bmm, softmax, bmm)");
  }
  if (own) return FusedAttention::own;
  return std::nullopt;
}

// The shapes (dtype, B, T, H, D) whose cuDNN attention failed at run time under automatic: its
// graphs, or a workspace the device had no room for (the deterministic backward keeps dS, which
// grows as T^2, and is asked for at the step's peak, where the forward's trial run had room). They
// keep to our kernels, so that a step does not fail again at every layer. A process-wide choice,
// as the library's plans are.
using AttentionShape = std::tuple<DType, int64_t, int64_t, int64_t, int64_t>;
std::mutex refused_mutex;
std::set<AttentionShape> refused_shapes;

bool cudnn_refused(const AttentionShape& s) {
  std::lock_guard<std::mutex> lock(refused_mutex);
  return refused_shapes.count(s) != 0;
}
void refuse_cudnn(const AttentionShape& s) {
  std::lock_guard<std::mutex> lock(refused_mutex);
  refused_shapes.insert(s);
}

// The fused kernels options.kernels asks for (AttentionKernels), or nullopt for the composite.
std::optional<FusedAttention> fused_attention_for(Backend& be, AttentionKernels kernels, const Tensor& qkv, int64_t D,
                                                  double dropout_p, const AttentionShape& shape) {
  if (kernels == AttentionKernels::composite) return std::nullopt;
  // Without autograd (evaluation, sampling) cuDNN's is not asked: it builds graphs per shape, and a
  // sampler grows its sequence a token at a time (from one, which its backward does not take).
  const bool training = GradMode::enabled() && qkv.requires_grad();
  if (!training) kernels = AttentionKernels::fused;
  if (kernels == AttentionKernels::cudnn) {
    if (dropout_p > 0.0)
      throw std::invalid_argument("causal_attention: cuDNN's attention was asked for, but it runs without dropout (p = " +
                                  std::to_string(dropout_p) + ")");
    const std::string why = be.cudnn_attention_unavailable(qkv.dtype(), D);
    if (!why.empty()) throw std::invalid_argument("causal_attention: cuDNN's attention cannot run here: " + why);
    return FusedAttention::cudnn;
  }
  if (dropout_p > 0.0) return std::nullopt;
  // fp32 and fp64 are not cuDNN's to run: nothing to say there.
  if (kernels == AttentionKernels::automatic && qkv.device().is_cuda() && is_reduced_float(qkv.dtype())) {
    const std::string why = be.cudnn_attention_unavailable(qkv.dtype(), D);
    if (why.empty() && !cudnn_refused(shape)) return FusedAttention::cudnn;
    return fall_back_from_cudnn(be, qkv.dtype(), D, why, false);
  }
  if (be.has_fused_attention(qkv.dtype(), D)) return FusedAttention::own;
  return std::nullopt;
}

}  // namespace

Tensor causal_attention(const Tensor& qkv_in, int64_t n_head, const AttentionOptions& options) {
  const double dropout_p = options.dropout_p;
  Tensor qkv = qkv_in;
  autocast_inputs(OpKind::bmm, {&qkv});  // the products' dtype, as the first bmm would cast
  if (qkv.dim() != 3 || n_head < 1 || qkv.size(2) % (3 * n_head) != 0)
    throw std::invalid_argument("causal_attention: expected qkv [B, T, 3C] with C a multiple of " +
                                std::to_string(n_head) + " heads, got " + shape_str(qkv.shape()));
  if (!(dropout_p >= 0.0 && dropout_p < 1.0))
    throw std::invalid_argument("causal_attention: dropout must be in [0, 1), got " + std::to_string(dropout_p));
  const int64_t B = qkv.size(0), T = qkv.size(1), C = qkv.size(2) / 3, H = n_head, D = C / H, BH = B * H;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  Backend& be = backend_for(qkv.device());
  const AttentionShape shape{qkv.dtype(), B, T, H, D};
  const bool automatic = options.kernels == AttentionKernels::automatic;
  std::optional<FusedAttention> which = fused_attention_for(be, options.kernels, qkv, D, dropout_p, shape);
  if (which) {
    // Without dropout, where fused kernels run: the scores stay on chip (attention_forward).
    Tensor out = empty({B, T, C}, qkv.dtype(), qkv.device()), lse = empty({B, H, T}, DType::f32, qkv.device());
    try {
      be.attention_forward(qkv, H, scale, out, lse, *which);
    } catch (const std::runtime_error& e) {  // cuDNN would not build this shape's graphs, or had no room
      if (*which != FusedAttention::cudnn || !automatic) throw;
      refuse_cudnn(shape);
      which = fall_back_from_cudnn(be, qkv.dtype(), D, e.what(), true);
      if (!which) return causal_attention(qkv, n_head, {.dropout_p = 0.0, .dropout = {}, .kernels = AttentionKernels::composite});
      be.attention_forward(qkv, H, scale, out, lse, *which);
    }
    const Tensor saved = out.view(0, out.shape());  // y's values, without y's own grad_fn (no cycle)
    return record("CausalAttentionBackward", out, {qkv},
                  [qkv, saved, lse, H, D, scale, which = *which, automatic, shape](const Tensor& g_in) {
                    if (GradMode::enabled()) throw std::logic_error("causal_attention: double backward is not supported");
                    const Tensor g = g_in.dtype() == qkv.dtype() ? g_in : g_in.to(qkv.dtype());
                    Tensor dqkv = empty(qkv.shape(), qkv.dtype(), qkv.device());
                    Backend& bg = backend_for(g.device());
                    try {
                      bg.attention_backward(qkv, saved, lse, g, H, scale, dqkv, which);
                    } catch (const DeviceOutOfMemory& e) {
                      // cuDNN's backward found no room where its forward ran (its workspace, asked
                      // for at the step's peak): ours take its y and lse (the same log-sum-exp), and
                      // the shape keeps to ours. Any other failure stops the run, as it should.
                      if (which != FusedAttention::cudnn || !automatic || !bg.has_fused_attention(qkv.dtype(), D)) throw;
                      refuse_cudnn(shape);
                      bg.attention_backward(qkv, saved, lse, g, H, scale, dqkv,
                                            *fall_back_from_cudnn(bg, qkv.dtype(), D, e.what(), true));
                    }
                    return std::vector<Tensor>{dqkv};
                  });
  }
  // The same primitives, dtypes and order as the composite (permute, select, bmm, causal_softmax,
  // dropout, bmm, permute), without its autograd graph: the backward below writes d(qkv) in one
  // buffer instead of three zero-padded ones that autograd then adds.
  Tensor heads, att, kept, mask, y;
  {
    NoGradGuard no_graph;
    heads = empty({3, B, H, T, D}, qkv.dtype(), qkv.device());  // q, k, v: BH runs of [T, D] each
    be.permute(qkv.reshape({B, T, 3, H, D}), {2, 0, 3, 1, 4}, heads);
    const Tensor q = heads.view(0, {BH, T, D}), k = heads.view(BH * T * D, {BH, T, D});
    Tensor v = heads.view(2 * BH * T * D, {BH, T, D});
    Tensor scores = empty({BH, T, T}, qkv.dtype(), qkv.device());
    be.gemm_batched(false, true, 1.0f, q, k, 0.0f, scores);
    // Autocast's casts of the scores (to the softmax's dtype) and, without dropout, of its output
    // (to the bmm's) happen inside the softmax's pass: the dtypes are autocast's answers (no pass
    // over the [BH, T, T] scores).
    const DeviceType dt = scores.device().type;
    att = empty(scores.shape(), autocast_dtype(OpKind::softmax, scores.dtype(), dt), scores.device());
    Tensor low;  // att in the bmm's dtype, when that differs and nothing comes between
    if (dropout_p == 0.0) {
      const DType bmm_in = autocast_dtype(OpKind::bmm, att.dtype(), dt, {v.dtype()});
      if (bmm_in != att.dtype()) low = empty(att.shape(), bmm_in, att.device());
    }
    be.causal_softmax_cast(scores, att, low, scale);
    kept = low.defined() ? low : att;  // att stays the softmax's output (its backward needs it), kept what dropout keeps
    if (dropout_p > 0.0) {
      mask = empty_like(att);
      const RandomCounters& c = options.dropout;
      be.dropout_mask(mask, c.seed, c.offset, dropout_p, c.base, c.per_base);
      kept = empty_like(att);
      be.binary(BinaryOp::mul, att, mask, kept);
      autocast_inputs(OpKind::bmm, {&kept, &v});
    }
    Tensor yh = empty({BH, T, D}, v.dtype(), v.device());
    be.gemm_batched(false, false, 1.0f, kept, v, 0.0f, yh);
    y = empty({B, T, H, D}, yh.dtype(), yh.device());
    be.permute(yh.reshape({B, H, T, D}), {0, 2, 1, 3}, y);
  }
  y = y.reshape({B, T, C});
  return record("CausalAttentionBackward", y, {qkv}, [heads, att, kept, mask, scale, B, T, C, H, D, BH](const Tensor& g) {
    if (GradMode::enabled()) throw std::logic_error("causal_attention: double backward is not supported");
    Backend& gb = backend_for(g.device());
    const Tensor q = heads.view(0, {BH, T, D}), k = heads.view(BH * T * D, {BH, T, D});
    const Tensor v = heads.view(2 * BH * T * D, {BH, T, D});
    Tensor gy = empty({B, H, T, D}, g.dtype(), g.device());
    gb.permute(g.reshape({B, T, H, D}), {0, 2, 1, 3}, gy);
    gy = gy.reshape({BH, T, D});
    Tensor grads = empty({3, BH, T, D}, heads.dtype(), heads.device());  // dq, dk, dv
    Tensor dv = grads.view(2 * BH * T * D, {BH, T, D});
    gb.gemm_batched(true, false, 1.0f, kept, gy, 0.0f, dv);  // kept^T gy (kept in the bmm's dtype)
    Tensor d_kept = empty({BH, T, T}, gy.dtype(), gy.device());
    gb.gemm_batched(false, true, 1.0f, gy, v, 0.0f, d_kept);  // gy v^T
    Tensor d_att = d_kept;
    if (mask.defined()) {
      if (d_att.dtype() != att.dtype()) d_att = d_att.to(att.dtype());
      Tensor masked = empty_like(d_att);
      gb.binary(BinaryOp::mul, d_att, mask, masked);
      d_att = masked;
    }
    // The casts to att's dtype and back to the heads' happen inside the softmax's backward pass.
    Tensor d_scores = empty(att.shape(), heads.dtype(), heads.device());
    gb.softmax_backward_cast(att, d_att, d_scores, scale);
    Tensor dq = grads.view(0, {BH, T, D}), dk = grads.view(BH * T * D, {BH, T, D});
    gb.gemm_batched(false, false, 1.0f, d_scores, k, 0.0f, dq);  // d_scores k
    gb.gemm_batched(true, false, 1.0f, d_scores, q, 0.0f, dk);   // d_scores^T q
    Tensor dqkv = empty({B, T, 3, H, D}, grads.dtype(), grads.device());
    gb.permute(grads.reshape({3, B, H, T, D}), {1, 3, 0, 2, 4}, dqkv);
    return std::vector<Tensor>{dqkv.reshape({B, T, 3 * C})};
  });
}

Tensor dropout(const Tensor& x, double p, const RandomCounters& c) {
  if (!(p >= 0.0 && p < 1.0)) throw std::invalid_argument("dropout: probability must be in [0, 1), got " + std::to_string(p));
  if (p == 0.0) return x;
  Tensor mask = empty(x.shape(), x.dtype(), x.device());
  backend_for(x.device()).dropout_mask(mask, c.seed, c.offset, p, c.base, c.per_base);
  return mul(x, mask);  // the backward is g * mask
}

}  // namespace amp
