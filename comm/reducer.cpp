#include "comm/reducer.h"

#include <stdexcept>

#include "runtime/kernels/backend.h"
#include "runtime/ops/ops.h"

namespace amp::comm {

struct Slot {
  Tensor param;
  size_t bucket;
  size_t offset;  // elements into the bucket buffer
  bool ready = false;
};

struct Bucket {
  Tensor buffer;  // flat f32
  size_t pending = 0;
  size_t members = 0;
  std::unique_ptr<Work> work;
};

struct GradientReducer::State {
  Communicator* comm;
  ReducerOptions options;
  std::vector<Slot> slots;
  std::vector<Bucket> buckets;
  size_t next_launch = 0;
  bool sync = false;
  bool in_backward = false;
  size_t launched_in_backward = 0;
  bool passthrough = false;  // one rank: nothing to average, so no copies at all

  void launch_ready() {
    while (next_launch < buckets.size() && buckets[next_launch].pending == 0) {
      Bucket& b = buckets[next_launch++];
      b.work = comm->all_reduce_async(b.buffer, ReduceOp::avg);
      if (in_backward) ++launched_in_backward;
    }
    for (size_t i = 0; i < next_launch; ++i) buckets[i].work->test();  // lets MPI progress
  }

  void mark_ready(size_t slot_index) {
    Slot& s = slots[slot_index];
    Bucket& b = buckets[s.bucket];
    if (s.ready) {
      if (b.work) throw std::logic_error("a gradient changed after its bucket was all-reduced (two backwards in one synced step?)");
    } else {
      s.ready = true;
      --b.pending;
    }
    const Tensor g = s.param.grad();
    float* dst = static_cast<float*>(b.buffer.data_ptr()) + s.offset;
    if (g.data_ptr() != dst) memory_for(g.device()).copy(dst, g.data_ptr(), g.nbytes());  // else: already a view
    if (options.overlap) launch_ready();
  }
};

GradientReducer::GradientReducer(std::vector<Tensor> params, Communicator& comm, ReducerOptions options)
    : state_(std::make_shared<State>()) {
  State& st = *state_;
  st.comm = &comm;
  st.options = options;
  st.passthrough = comm.size() == 1;
  // Reverse parameter order: the last layer's gradients are ready first.
  size_t cap = options.first_bucket_bytes;
  for (auto it = params.rbegin(); it != params.rend(); ++it) {
    if (it->dtype() != DType::f32) throw std::invalid_argument("GradientReducer: parameters must be float32");
    const size_t bytes = it->nbytes();
    if (st.buckets.empty() || (st.buckets.back().members > 0 && (st.buckets.back().pending * 4 + bytes > cap))) {
      if (!st.buckets.empty()) cap = options.bucket_bytes;
      st.buckets.emplace_back();
    }
    Bucket& b = st.buckets.back();
    st.slots.push_back(Slot{*it, st.buckets.size() - 1, b.pending, false});
    b.pending += static_cast<size_t>(it->numel());  // counts elements while sizing
    ++b.members;
  }
  for (Bucket& b : st.buckets) {
    if (!st.passthrough) b.buffer = comm.make_buffer(static_cast<int64_t>(b.pending), DType::f32, params[0].device());
    b.pending = b.members;
  }
  // Backward writes each parameter's first gradient straight into its bucket slice.
  if (!st.passthrough)
    for (Slot& s : st.slots)
      s.param.set_grad_destination(st.buckets[s.bucket].buffer.view(static_cast<int64_t>(s.offset), s.param.shape()));
  std::weak_ptr<State> weak = state_;
  for (size_t i = 0; i < st.slots.size(); ++i) {
    st.slots[i].param.register_post_accumulate_grad_hook([weak, i](const Tensor&) {
      if (auto s = weak.lock(); s && s->sync && !s->passthrough) s->mark_ready(i);
    });
  }
}

GradientReducer::~GradientReducer() {
  for (Slot& s : state_->slots) s.param.set_grad_destination(Tensor());  // the buckets go with us
}

void GradientReducer::prepare_for_backward(bool sync) {
  State& st = *state_;
  st.sync = sync;
  st.in_backward = true;
  if (!sync) return;
  st.next_launch = 0;
  st.launched_in_backward = 0;
  for (Bucket& b : st.buckets) {
    b.pending = b.members;
    b.work.reset();
  }
  for (Slot& s : st.slots) s.ready = false;
}

void GradientReducer::finish() {
  State& st = *state_;
  st.in_backward = false;
  if (!st.sync) return;
  if (st.passthrough) {
    st.sync = false;
    return;
  }
  // Parameters that got no gradient contribute zeros (and receive the average of the others').
  for (Slot& s : st.slots) {
    if (s.ready) continue;
    Bucket& b = st.buckets[s.bucket];
    Tensor slice = b.buffer.view(static_cast<int64_t>(s.offset), s.param.shape());
    fill_(slice, 0.0);
    s.ready = true;
    --b.pending;
  }
  st.launch_ready();
  for (Bucket& b : st.buckets) b.work->wait();
  // The averaged gradients stay in the buckets: each .grad becomes a view of its slice (no copy).
  for (Slot& s : st.slots)
    s.param.set_grad(st.buckets[s.bucket].buffer.view(static_cast<int64_t>(s.offset), s.param.shape()));
  st.sync = false;
}

size_t GradientReducer::num_buckets() const { return state_->buckets.size(); }
size_t GradientReducer::launched_during_backward() const { return state_->launched_in_backward; }

}  // namespace amp::comm
