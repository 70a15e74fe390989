#include "runtime/kernels/backend.h"

#include <array>
#include <stdexcept>
#include <string>

#include "runtime/core/device_memory.h"
#include "runtime/kernels/cpu/cpu_backend.h"
#include "runtime/kernels/norm_check.h"

namespace amp {

namespace {
std::array<Backend*, 2>& registry() {
  static std::array<Backend*, 2> r{};
  return r;
}
}  // namespace

void Backend::linear_forward(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y) {
  broadcast_to(bias, y);
  gemm(false, true, 1.0f, x, w, 1.0f, y);
}

void Backend::linear_gelu_tanh_forward(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& pre, Tensor& y) {
  linear_forward(x, w, bias, pre);
  unary(UnaryOp::gelu_tanh, pre, y, 0.0);
}

bool Backend::fuses_linear_param_grads(DType, DType) const { return false; }

void Backend::linear_param_grads(const Tensor& g, const Tensor& x, Tensor& dw, Tensor& db) {
  gemm(true, false, 1.0f, g, x, 0.0f, dw);
  if (db.dtype() == g.dtype()) return sum_to(g, db);
  Tensor sums = empty(db.shape(), g.dtype(), db.device());  // sum_to writes its input's dtype
  sum_to(g, sums);
  cast(sums, db);
}

void Backend::linear_input_grad_gelu_tanh(const Tensor& g, const Tensor& w, const Tensor& pre, Tensor& dpre) {
  Tensor product = empty(pre.shape(), pre.dtype(), pre.device());
  gemm(false, false, 1.0f, g, w, 0.0f, product);
  binary(BinaryOp::gelu_tanh_backward, product, pre, dpre);
}

void Backend::embedding_backward_add(const Tensor& grad, const Tensor& idx, Tensor& grad_weight) {
  Tensor rows = empty(grad_weight.shape(), grad_weight.dtype(), grad_weight.device());
  memory_for(rows.device()).fill(rows, 0.0);
  embedding_backward(grad, idx, rows);
  binary(BinaryOp::add, grad_weight, rows, grad_weight);
}

void Backend::chunk_sums_of_squares_gathered(const std::vector<Tensor>& pieces, const std::vector<int64_t>& offsets,
                                             int64_t n, int64_t chunk, Tensor& out, const Tensor& scale,
                                             const Tensor& found_inf) {
  check_gathered_pieces(pieces, offsets, n, out);
  Tensor flat = empty({n}, DType::f32, out.device());
  DeviceMemory& m = memory_for(out.device());
  m.fill(flat, 0.0);
  for (size_t i = 0; i < pieces.size(); ++i)
    m.copy(static_cast<float*>(flat.data_ptr()) + offsets[i], pieces[i].data_ptr(), pieces[i].nbytes());
  chunk_sums_of_squares(flat, chunk, out, scale, found_inf);
}

void Backend::attention_forward(const Tensor&, int64_t, double, Tensor&, Tensor&, FusedAttention) {
  throw std::logic_error("attention_forward: this backend has no fused attention (has_fused_attention)");
}

void Backend::attention_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t, double, Tensor&,
                                 FusedAttention) {
  throw std::logic_error("attention_backward: this backend has no fused attention (has_fused_attention)");
}

void Backend::causal_softmax_cast(const Tensor& x, Tensor& y, const Tensor& low, double scale) {
  Tensor xs = x;
  if (x.dtype() != y.dtype()) {
    xs = empty(x.shape(), y.dtype(), x.device());
    cast(x, xs);
  }
  causal_softmax(xs, y, scale);
  if (low.defined()) {
    Tensor out = low;
    cast(y, out);
  }
}

void Backend::softmax_backward_cast(const Tensor& y, const Tensor& g, Tensor& gx, double scale) {
  Tensor gs = g;
  if (g.dtype() != y.dtype()) {
    gs = empty(g.shape(), y.dtype(), g.device());
    cast(g, gs);
  }
  if (gx.dtype() == y.dtype()) {
    softmax_backward(y, gs, gx, false, scale);
    return;
  }
  Tensor wide = empty(gx.shape(), y.dtype(), gx.device());
  softmax_backward(y, gs, wide, false, scale);
  cast(wide, gx);
}

void Backend::add_cast(const Tensor& a, const Tensor& b, Tensor& out) {
  Tensor wide = empty(b.shape(), out.dtype(), b.device());
  cast(b, wide);
  binary(BinaryOp::add, a, wide, out);
}

void Backend::layer_norm_cast(const Tensor& x, const Tensor& w, const Tensor& b, double eps, Tensor& y, Tensor& mean,
                              Tensor& rstd) {
  if (y.dtype() == x.dtype()) {
    layer_norm(x, w, b, eps, y, mean, rstd);
    return;
  }
  Tensor wide = empty(y.shape(), x.dtype(), y.device());
  layer_norm(x, w, b, eps, wide, mean, rstd);
  cast(wide, y);
}

void Backend::layer_norm_backward_cast(const Tensor& g, const Tensor& x, const Tensor& w, const Tensor& mean,
                                       const Tensor& rstd, Tensor& gx, Tensor& gw, Tensor& gb, bool accumulate,
                                       const Tensor& gx_low) {
  Tensor gs = g;
  if (g.dtype() != x.dtype()) {
    gs = empty(g.shape(), x.dtype(), g.device());
    cast(g, gs);
  }
  layer_norm_backward(gs, x, w, mean, rstd, gx, gw, gb, accumulate);
  if (gx_low.defined()) {
    Tensor low = gx_low;
    cast(gx, low);
  }
}

void Backend::add_layer_norm_cast(const Tensor& a, const Tensor& b, const Tensor& w, const Tensor& bias, double eps,
                                  Tensor& sum, Tensor& y, Tensor& mean, Tensor& rstd) {
  if (b.dtype() == a.dtype()) binary(BinaryOp::add, a, b, sum);
  else add_cast(a, b, sum);
  layer_norm_cast(sum, w, bias, eps, y, mean, rstd);
}

void register_backend(DeviceType t, Backend* b) { registry()[static_cast<size_t>(t)] = b; }

bool backend_available(DeviceType t) { return t == DeviceType::cpu || registry()[static_cast<size_t>(t)] != nullptr; }

DType low_precision_copies_dtype(const std::vector<Tensor>& params, const std::vector<Tensor>& copies) {
  if (copies.empty()) return DType::f32;
  if (copies.size() != params.size())
    throw std::invalid_argument("optimizer step: " + std::to_string(copies.size()) + " low-precision copies for " +
                                std::to_string(params.size()) + " parameters");
  const DType dt = copies[0].dtype();
  if (dt != DType::f16 && dt != DType::bf16)
    throw std::invalid_argument(std::string("optimizer step: low-precision copies must be float16 or bfloat16, got ") +
                                dtype_name(dt));
  for (size_t t = 0; t < copies.size(); ++t)
    if (copies[t].dtype() != dt || copies[t].numel() != params[t].numel() || copies[t].device() != params[t].device())
      throw std::invalid_argument("optimizer step: low-precision copy " + std::to_string(t) + " (" +
                                  dtype_name(copies[t].dtype()) + " " + shape_str(copies[t].shape()) + " on " +
                                  copies[t].device().str() + ") does not match its parameter (" +
                                  shape_str(params[t].shape()) + " on " + params[t].device().str() +
                                  ") or the first copy's dtype " + dtype_name(dt));
  return dt;
}

void require_device_scalar(const Tensor& t, DType dtype, Device device, const char* what) {
  if (!t.defined() || t.dtype() != dtype || t.numel() != 1 || t.device() != device)
    throw std::invalid_argument(std::string(what) + ": expected one " + dtype_name(dtype) + " on " + device.str() +
                                ", got " + (t.defined() ? shape_str(t.shape()) + " " + dtype_name(t.dtype()) + " on " +
                                                              t.device().str()
                                                        : std::string("an undefined tensor")));
}

Backend& backend_for(Device d) {
  if (d.is_cpu()) return cpu_backend();
  Backend* b = registry()[static_cast<size_t>(d.type)];
  if (b == nullptr)
    throw std::runtime_error("no backend for device " + d.str() +
                             (d.is_cuda() ? ": this build has no CUDA backend (configure with AMP_WITH_CUDA=ON)" : ""));
  return *b;
}

}  // namespace amp
