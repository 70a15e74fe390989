// The ops a transformer needs beyond the MLP's: embedding, layer norm, batched matmul, permute and
// select (the views of attention's heads), and dropout. Their backward formulas call the backend
// directly (they are not differentiable twice).
#include <numeric>
#include <stdexcept>
#include <string>

#include "runtime/autocast_policy.h"
#include "runtime/autograd.h"
#include "runtime/backend.h"
#include "runtime/ops.h"

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
  return record("EmbeddingBackward", out, {weight}, [indices, wshape](const Tensor& g) {
    Tensor gw = zeros(wshape, g.dtype(), g.device());
    backend_for(g.device()).embedding_backward(g, indices, gw);
    return std::vector<Tensor>{gw};
  });
}

Tensor layer_norm(const Tensor& x_in, const Tensor& w_in, const Tensor& b_in, double eps) {
  Tensor x = x_in, w = w_in, b = b_in;
  autocast_inputs(OpKind::layer_norm, {&x, &w, &b});
  if (x.dim() < 1 || w.dim() != 1 || b.dim() != 1 || w.shape()[0] != x.size(-1) || b.shape()[0] != x.size(-1))
    throw std::invalid_argument("layer_norm: input " + shape_str(x.shape()) + " does not match weight " +
                                shape_str(w.shape()) + " and bias " + shape_str(b.shape()) +
                                " (normalized over the last dim)");
  // Outside an fp32 region the affine parameters take the input's dtype (PyTorch keeps them wider).
  if (w.dtype() != x.dtype()) w = w.to(x.dtype());
  if (b.dtype() != x.dtype()) b = b.to(x.dtype());
  const int64_t rows = x.size(-1) == 0 ? 0 : x.numel() / x.size(-1);
  Tensor y = empty_like(x);
  Tensor mean = empty({rows}, stat_dtype(x.dtype()), x.device());
  Tensor rstd = empty({rows}, stat_dtype(x.dtype()), x.device());
  backend_for(x.device()).layer_norm(x, w, b, eps, y, mean, rstd);
  return record("LayerNormBackward", y, {x, w, b}, [x, w, mean, rstd](const Tensor& g) {
    Tensor gx = empty_like(x), gw = empty_like(w), gb = empty_like(w);
    backend_for(g.device()).layer_norm_backward(g, x, w, mean, rstd, gx, gw, gb);
    return std::vector<Tensor>{gx, gw, gb};
  });
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

Tensor dropout(const Tensor& x, double p, uint64_t seed, uint64_t offset) {
  if (!(p >= 0.0 && p < 1.0)) throw std::invalid_argument("dropout: probability must be in [0, 1), got " + std::to_string(p));
  if (p == 0.0) return x;
  Tensor mask = empty(x.shape(), x.dtype(), x.device());
  backend_for(x.device()).dropout_mask(mask, seed, offset, p);
  return mul(x, mask);  // the backward is g * mask
}

}  // namespace amp
