#include "comm/coalesced.h"

#include <stdexcept>

#include "runtime/kernels/backend.h"

namespace amp::comm {

void all_reduce_scalars(Communicator& c, const std::vector<Tensor>& scalars, ReduceOp op) {
  if (scalars.empty()) return;
  const Device device = scalars[0].device();
  for (const Tensor& t : scalars)
    if (t.dtype() != DType::f32 || t.numel() != 1 || t.device() != device)
      throw std::invalid_argument("all_reduce_scalars: expected one-element float32 tensors on " + device.str());
  if (c.size() <= 1) return;  // sum, avg and max of one value are that value
  // Packed by device copies: nothing here waits for the device.
  Tensor packed = empty({static_cast<int64_t>(scalars.size())}, DType::f32, device);
  DeviceMemory& b = memory_for(device);
  float* slot = static_cast<float*>(packed.data_ptr());
  for (size_t i = 0; i < scalars.size(); ++i) b.copy(slot + i, scalars[i].data_ptr(), sizeof(float));
  // A sum adds in the tree's order (ordered_sum.h): the figures riding it are rank-invariant.
  if (op == ReduceOp::sum) c.ordered_sum(packed);
  else c.all_reduce(packed, op);
  for (size_t i = 0; i < scalars.size(); ++i) b.copy(scalars[i].data_ptr(), slot + i, sizeof(float));
}

}  // namespace amp::comm
