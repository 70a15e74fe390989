// Tensor: a shared handle to contiguous storage with a shape, a dtype, a device and autograd state.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "runtime/core/device.h"
#include "runtime/core/dtype.h"

namespace amp {

using Shape = std::vector<int64_t>;
int64_t shape_numel(const Shape& s);
std::string shape_str(const Shape& s);

class Node;
class Tensor;

// Bytes owned by a backend's allocator. Freed through that allocator when the last handle goes.
class Storage {
 public:
  Storage(size_t bytes, Device device);
  // Memory owned elsewhere (a communication buffer, for example); owner keeps it alive.
  Storage(void* data, size_t bytes, Device device, std::shared_ptr<void> owner);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  Device device_;
  std::shared_ptr<void> owner_;  // set for external memory, which the backend must not free
};

using GradHook = std::function<void(const Tensor& leaf)>;

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  size_t offset = 0;  // bytes into storage where this tensor's elements start
  Shape shape;
  DType dtype = DType::f32;
  bool requires_grad = false;
  std::shared_ptr<TensorImpl> grad;     // .grad of a leaf
  std::shared_ptr<Node> grad_fn;        // the op that produced this tensor (null for leaves)
  std::weak_ptr<Node> grad_accumulator; // shared by every use of this leaf in a graph
  std::vector<GradHook> post_accumulate_hooks;
  // Where a leaf's first gradient of a backward may be computed in place (a slice of a gradient
  // bucket), so that it need not be copied there afterwards. Only used when .grad is undefined.
  // Autograd's state like grad and grad_fn above (the engine reads it; the reducer in comm/ sets it
  // through set_grad_destination), so it stays beside them rather than in a side table: the engine
  // consults it for every leaf of every backward, as PyTorch keeps its AutogradMeta on the tensor.
  std::shared_ptr<TensorImpl> grad_destination;
  uint64_t grad_destination_taken_by = 0;  // the backward() that took it (autograd.cpp)
};

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  // Every accessor below throws std::invalid_argument on an undefined tensor (Tensor()), as
  // libtorch's do: an op or optimizer handed one says so, where it would dereference null.
  bool defined() const { return impl_ != nullptr; }
  const Shape& shape() const { return checked().shape; }
  int64_t dim() const { return static_cast<int64_t>(checked().shape.size()); }
  int64_t size(int64_t d) const;  // negative d counts from the end
  int64_t numel() const { return shape_numel(checked().shape); }
  DType dtype() const { return checked().dtype; }
  Device device() const { return checked().storage->device(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype()); }

  void* data_ptr() const { return static_cast<char*>(checked().storage->data()) + impl_->offset; }
  template <class T>
  T* data() const { return static_cast<T*>(data_ptr()); }

  // --- autograd
  bool requires_grad() const { return checked().requires_grad; }
  Tensor& set_requires_grad(bool r);
  bool is_leaf() const { return checked().grad_fn == nullptr; }
  const std::shared_ptr<Node>& grad_fn() const { return checked().grad_fn; }
  Tensor grad() const { return Tensor(checked().grad); }
  void set_grad(const Tensor& g) { checked().grad = g.impl_; }
  // Runs when this leaf's gradient is final for the current backward (after accumulation).
  void register_post_accumulate_grad_hook(GradHook hook) { checked().post_accumulate_hooks.push_back(std::move(hook)); }
  // Same shape and dtype as this leaf; ops that can write its gradient straight there do.
  void set_grad_destination(const Tensor& dst);
  Tensor grad_destination() const { return Tensor(checked().grad_destination); }
  // Defined with the ops (runtime/ops/tensor_ops.cpp, target amp_ops), as are to(DType), reshape and
  // from_vector below: they record autograd history or run a kernel.
  void backward(const Tensor& gradient = Tensor(), bool retain_graph = false, bool create_graph = false) const;
  Tensor detach() const;  // shares storage, no autograd history
  // numel(shape) elements starting at element `first`, sharing storage; no autograd history.
  Tensor view(int64_t first, const Shape& shape) const;

  // --- conveniences (all differentiable unless said otherwise)
  Tensor to(DType t) const;          // autograd-aware cast
  Tensor to(Device d) const;         // copy to another device (no autograd)
  Tensor clone() const;              // a copy with no history
  Tensor reshape(const Shape& s) const;
  double item() const;               // the single element, as double
  std::vector<double> to_vector() const;  // every element, as double, on the host

  TensorImpl* impl() const { return impl_.get(); }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }
  bool same(const Tensor& o) const { return impl_ == o.impl_; }

 private:
  [[noreturn]] static void undefined_tensor();
  TensorImpl& checked() const {
    if (impl_ == nullptr) undefined_tensor();
    return *impl_;
  }
  std::shared_ptr<TensorImpl> impl_;
};

// --- factories
Tensor empty(const Shape& shape, DType dtype = DType::f32, Device device = kCPU);
Tensor zeros(const Shape& shape, DType dtype = DType::f32, Device device = kCPU);
Tensor ones(const Shape& shape, DType dtype = DType::f32, Device device = kCPU);
Tensor full(const Shape& shape, double value, DType dtype = DType::f32, Device device = kCPU);
Tensor scalar_tensor(double value, DType dtype = DType::f32, Device device = kCPU);
// Values are converted (rounded to nearest even) into dtype.
Tensor from_vector(const std::vector<double>& values, const Shape& shape, DType dtype = DType::f32,
                   Device device = kCPU);
Tensor from_int64(const std::vector<int64_t>& values, const Shape& shape, Device device = kCPU);
Tensor zeros_like(const Tensor& t);
// A tensor over memory owned elsewhere; owner is kept alive as long as any view of it.
Tensor from_external(void* data, const Shape& shape, DType dtype, Device device, std::shared_ptr<void> owner);
Tensor empty_like(const Tensor& t);

}  // namespace amp
