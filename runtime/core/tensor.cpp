#include "runtime/core/tensor.h"

#include <sstream>
#include <stdexcept>

#include "runtime/core/device_memory.h"

namespace amp {

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

std::string shape_str(const Shape& s) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << ']';
  return os.str();
}

Storage::Storage(size_t bytes, Device device) : bytes_(bytes), device_(device) {
  data_ = memory_for(device).allocate(bytes);
}

Storage::Storage(void* data, size_t bytes, Device device, std::shared_ptr<void> owner)
    : data_(data), bytes_(bytes), device_(device), owner_(std::move(owner)) {}

Storage::~Storage() {
  if (!owner_) memory_for(device_).deallocate(data_, bytes_);
}

void Tensor::undefined_tensor() {
  throw std::invalid_argument("an undefined tensor (amp::Tensor(), which holds nothing) where a tensor is needed");
}

int64_t Tensor::size(int64_t d) const {
  const int64_t n = dim();
  if (d < 0) d += n;
  if (d < 0 || d >= n) throw std::out_of_range("dimension " + std::to_string(d) + " out of range for a " +
                                               std::to_string(n) + "-d tensor");
  return impl_->shape[static_cast<size_t>(d)];
}

Tensor& Tensor::set_requires_grad(bool r) {
  if (r && !is_floating(dtype())) throw std::invalid_argument("only floating-point tensors can require grad");
  if (!is_leaf()) throw std::logic_error("requires_grad can only be changed on leaf tensors");
  impl_->requires_grad = r;
  return *this;
}

void Tensor::set_grad_destination(const Tensor& dst) {
  if (dst.defined() && (dst.shape() != shape() || dst.dtype() != dtype() || dst.device() != device()))
    throw std::invalid_argument("a gradient destination must have the parameter's shape, dtype and device");
  impl_->grad_destination = dst.impl_ptr();
}


Tensor Tensor::detach() const {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = checked().storage;
  impl->offset = impl_->offset;
  impl->shape = impl_->shape;
  impl->dtype = impl_->dtype;
  return Tensor(impl);
}

Tensor Tensor::view(int64_t first, const Shape& s) const {
  const int64_t n = shape_numel(s);
  if (first < 0 || first + n > numel())
    throw std::out_of_range("view of elements [" + std::to_string(first) + ", " + std::to_string(first + n) +
                            ") of a tensor with " + std::to_string(numel()));
  Tensor out = detach();
  out.impl()->offset += static_cast<size_t>(first) * dtype_size(dtype());
  out.impl()->shape = s;
  return out;
}


Tensor Tensor::to(Device d) const {
  if (d == device()) return *this;
  Tensor out = empty(shape(), dtype(), d);
  if (device().is_cpu()) {
    memory_for(d).copy_from_host(out.data_ptr(), data_ptr(), nbytes());
  } else if (d.is_cpu()) {
    memory_for(device()).copy_to_host(out.data_ptr(), data_ptr(), nbytes());
  } else {
    return to(kCPU).to(d);
  }
  return out;
}

Tensor Tensor::clone() const {
  Tensor out = empty(shape(), dtype(), device());
  memory_for(device()).copy(out.data_ptr(), data_ptr(), nbytes());
  return out;
}


std::vector<double> Tensor::to_vector() const {
  Tensor host = to(kCPU);
  std::vector<double> v(static_cast<size_t>(numel()));
  const size_t n = v.size();
  switch (dtype()) {
    case DType::f32: for (size_t i = 0; i < n; ++i) v[i] = host.data<float>()[i]; break;
    case DType::f64: for (size_t i = 0; i < n; ++i) v[i] = host.data<double>()[i]; break;
    case DType::f16: for (size_t i = 0; i < n; ++i) v[i] = Elem<Half>::load(host.data<Half>()[i]); break;
    case DType::bf16: for (size_t i = 0; i < n; ++i) v[i] = Elem<BFloat16>::load(host.data<BFloat16>()[i]); break;
    case DType::i64: for (size_t i = 0; i < n; ++i) v[i] = static_cast<double>(host.data<int64_t>()[i]); break;
  }
  return v;
}

double Tensor::item() const {
  if (numel() != 1) throw std::invalid_argument("item() needs a tensor with one element, got " + shape_str(shape()));
  return to_vector()[0];
}

Tensor empty(const Shape& shape, DType dtype, Device device) {
  uint64_t count = 1;
  for (int64_t d : shape) {
    if (d < 0) throw std::invalid_argument("negative dimension in shape " + shape_str(shape));
    if (__builtin_mul_overflow(count, static_cast<uint64_t>(d), &count) || count > (uint64_t{1} << 56))
      throw std::invalid_argument("shape " + shape_str(shape) + " is too large");
  }
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::make_shared<Storage>(static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype), device);
  impl->shape = shape;
  impl->dtype = dtype;
  return Tensor(impl);
}

Tensor full(const Shape& shape, double value, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  memory_for(device).fill(t, value);
  return t;
}
Tensor zeros(const Shape& shape, DType dtype, Device device) { return full(shape, 0.0, dtype, device); }
Tensor ones(const Shape& shape, DType dtype, Device device) { return full(shape, 1.0, dtype, device); }
Tensor scalar_tensor(double value, DType dtype, Device device) { return full({}, value, dtype, device); }
Tensor from_external(void* data, const Shape& shape, DType dtype, Device device, std::shared_ptr<void> owner) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::make_shared<Storage>(data, static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype), device,
                                            std::move(owner));
  impl->shape = shape;
  impl->dtype = dtype;
  return Tensor(impl);
}

Tensor zeros_like(const Tensor& t) { return zeros(t.shape(), t.dtype(), t.device()); }
Tensor empty_like(const Tensor& t) { return empty(t.shape(), t.dtype(), t.device()); }


Tensor from_int64(const std::vector<int64_t>& values, const Shape& shape, Device device) {
  if (static_cast<int64_t>(values.size()) != shape_numel(shape))
    throw std::invalid_argument("from_int64: wrong number of values for shape " + shape_str(shape));
  Tensor host = empty(shape, DType::i64, kCPU);
  std::copy(values.begin(), values.end(), host.data<int64_t>());
  return host.to(device);
}

}  // namespace amp
