#include "comm/reducer.h"

#include <stdexcept>
#include <vector>

#include "comm/sum_tree.h"
#include "runtime/kernels/backend.h"
#include "runtime/ops/ops.h"

namespace amp::comm {

struct Slot {
  Tensor param;
  size_t bucket;
  size_t offset;  // elements into the bucket buffer, a multiple of kSlotAlign
  bool ready = false;
};

// Each slot starts on a 16-byte boundary (4 floats): a gradient is a view of its slot, and vectorised
// kernels and cuBLASLt want their operands aligned. The padding between slots is zero and stays zero
// (every buffer starts zeroed and only slots are written), so it changes no sum.
constexpr size_t kSlotAlign = 4;

using AddInPlace = void (*)(Tensor&, const Tensor&);
void add_in_place(Tensor& into, const Tensor& other) { add_(into, other); }

// How many spare buffers a bucket's tree takes for M micro-batches: the reducer's own sequence
// (direct_gradients, end_micro_batch, reuse) played on ids. They are made up front, zeroed, so that
// every step launches the same work (the first too: a CUDA graph's premise).
size_t spares_needed(int64_t micro_batches) {
  std::vector<int> free_ids;
  int made = 0;
  auto tree = make_sum_tree<int>([](int&, const int&) {});
  for (int64_t m = 0; m + 1 < micro_batches; ++m) {  // the last micro-batch writes into the bucket
    int leaf = made;
    if (free_ids.empty()) ++made;
    else leaf = free_ids.back(), free_ids.pop_back();
    tree.push(leaf);
    for (int r : tree.take_released()) free_ids.push_back(r);
  }
  return static_cast<size_t>(made);
}

struct Bucket {
  Tensor buffer;  // flat f32: the last micro-batch's gradients land here, then the step's sum
  int64_t used = 0;  // elements up to the end of the last slot, rounded up to kSlotAlign
  size_t pending = 0;
  size_t members = 0;
  std::unique_ptr<Work> work;
  // Several micro-batches: their gradients summed in the tree's order (sum_tree.h). Each
  // micro-batch but the last writes into a spare buffer (`leaf`), which joins the tree after its
  // backward; the last writes into `buffer`, which the fold leaves holding the total.
  SumTree<Tensor, AddInPlace> tree{add_in_place};
  std::vector<Tensor> spares;
  Tensor leaf;
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
  bool passthrough = false;  // one rank, one micro-batch: nothing to sum, so no copies at all
  BucketLayout plan;         // plan_buckets' layout for this communicator's ranks
  int64_t micro_batch = 0;   // of this step, counting the one in backward

  void launch_ready() {
    while (next_launch < buckets.size() && buckets[next_launch].pending == 0) {
      Bucket& b = buckets[next_launch++];
      if (!b.tree.empty()) {
        b.tree.push(b.buffer);
        b.tree.fold();  // into b.buffer, the leaf pushed last
        reuse(b);
      }
      b.work = !options.ordered_sum ? comm->all_reduce_async(b.buffer, ReduceOp::avg)
               : options.shard      ? comm->ordered_reduce_scatter_async(b.buffer)
                                    : comm->ordered_sum_async(b.buffer);
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

  void reuse(Bucket& b) {
    for (Tensor& t : b.tree.take_released())
      if (t.data_ptr() != b.buffer.data_ptr()) b.spares.push_back(t);
  }

  // Where the next micro-batch's gradients go: the last one's into the bucket, the others' into a
  // spare. Every .grad starts undefined, so that backward writes into its slice (or the hooks and
  // end_micro_batch copy there).
  void direct_gradients(bool last) {
    for (Bucket& b : buckets) {
      if (last) {
        b.leaf = b.buffer;
      } else if (!b.spares.empty()) {
        b.leaf = b.spares.back();
        b.spares.pop_back();
      } else {
        // More unsynced backwards than options.micro_batches - 1 (a caller of its own): one more spare.
        b.leaf = zeros({b.buffer.numel()}, DType::f32, b.buffer.device());
      }
    }
    for (Slot& s : slots) {
      s.param.set_grad(Tensor());
      s.param.set_grad_destination(buckets[s.bucket].leaf.view(static_cast<int64_t>(s.offset), s.param.shape()));
    }
  }

  // After the backward of a micro-batch that is not the step's last: its gradients (zero where a
  // parameter got none) join each bucket's tree.
  void end_micro_batch() {
    for (Slot& s : slots) {
      Bucket& b = buckets[s.bucket];
      Tensor dst = b.leaf.view(static_cast<int64_t>(s.offset), s.param.shape());
      const Tensor g = s.param.grad();
      if (!g.defined()) fill_(dst, 0.0);
      else if (g.data_ptr() != dst.data_ptr()) copy_(dst, g);
    }
    for (Bucket& b : buckets) {
      b.tree.push(b.leaf);
      reuse(b);
      b.leaf = Tensor();
    }
  }
};

BucketLayout plan_buckets(const std::vector<Tensor>& params, const ReducerOptions& options, int ranks) {
  if (options.shard_align == 0 || options.shard_align % kSlotAlign != 0)
    throw std::invalid_argument("GradientReducer: shard_align must be a positive multiple of 4");
  BucketLayout l;
  std::vector<size_t> members;
  // Reverse parameter order: the last layer's gradients are ready first.
  size_t cap = options.first_bucket_bytes;
  for (size_t k = params.size(); k-- > 0;) {
    const Tensor& p = params[k];
    if (p.dtype() != DType::f32) throw std::invalid_argument("GradientReducer: parameters must be float32");
    if (l.used.empty() || (members.back() > 0 && static_cast<size_t>(l.used.back()) * 4 + p.nbytes() > cap)) {
      if (!l.used.empty()) cap = options.bucket_bytes;
      l.used.push_back(0);
      members.push_back(0);
    }
    int64_t& end = l.used.back();
    end = (end + kSlotAlign - 1) / kSlotAlign * kSlotAlign;
    l.slots.push_back({k, l.used.size() - 1, end, p.numel()});
    end += p.numel();
    ++members.back();
  }
  // A bucket's length is a multiple of ranks x shard_align: it splits into equal, aligned shards, so
  // that its ordered sum moves a ring all-reduce's bytes (ordered_sum.h). The tail is zero padding.
  const int64_t unit = static_cast<int64_t>(options.shard_align) * ranks;
  for (int64_t& used : l.used) {
    used = (used + kSlotAlign - 1) / kSlotAlign * kSlotAlign;
    l.numel.push_back((used + unit - 1) / unit * unit);
  }
  return l;
}

GradientReducer::GradientReducer(std::vector<Tensor> params, Communicator& comm, ReducerOptions options)
    : state_(std::make_shared<State>()) {
  State& st = *state_;
  st.comm = &comm;
  st.options = options;
  if (options.shard && !options.ordered_sum) throw std::invalid_argument("GradientReducer: shard needs ordered_sum");
  st.passthrough = options.passthrough && comm.size() == 1 && options.micro_batches == 1;
  st.plan = plan_buckets(params, options, comm.size());
  const BucketLayout& plan = st.plan;
  st.buckets.resize(plan.numel.size());
  for (const SlotLayout& s : plan.slots) {  // in slot order: reverse parameter order
    st.slots.push_back(Slot{params[s.param], s.bucket, static_cast<size_t>(s.offset), false});
    ++st.buckets[s.bucket].members;
  }
  for (size_t i = 0; i < st.buckets.size(); ++i) {
    Bucket& b = st.buckets[i];
    b.used = plan.used[i];
    if (!st.passthrough) {
      b.buffer = comm.make_buffer(plan.numel[i], DType::f32, params[0].device());
      fill_(b.buffer, 0.0);  // the padding (whatever make_buffer gives)
      for (size_t k = spares_needed(options.micro_batches); k > 0; --k)
        b.spares.push_back(zeros({b.buffer.numel()}, DType::f32, b.buffer.device()));
    }
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
  if (!st.passthrough) {
    if (st.micro_batch > 0) st.end_micro_batch();  // the previous one (not synced) is done
    st.direct_gradients(sync);
    ++st.micro_batch;
  }
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
  st.micro_batch = 0;
}

size_t GradientReducer::num_buckets() const { return state_->buckets.size(); }

BucketLayout GradientReducer::layout() const {
  const State& st = *state_;
  BucketLayout l;
  if (st.passthrough) return l;
  for (const Bucket& b : st.buckets) {
    l.numel.push_back(b.buffer.numel());
    l.used.push_back(b.used);
  }
  // Slots were made in reverse parameter order: slot i is parameter n - 1 - i.
  const size_t n = st.slots.size();
  for (size_t i = 0; i < n; ++i) {
    const Slot& s = st.slots[i];
    l.slots.push_back({n - 1 - i, s.bucket, static_cast<int64_t>(s.offset), s.param.numel()});
  }
  return l;
}

const BucketLayout& GradientReducer::plan() const { return state_->plan; }
bool GradientReducer::passthrough() const { return state_->passthrough; }

std::vector<Tensor> GradientReducer::buffers() const {
  std::vector<Tensor> out;
  for (const Bucket& b : state_->buckets) out.push_back(b.buffer);
  return out;
}

size_t GradientReducer::launched_during_backward() const { return state_->launched_in_backward; }

}  // namespace amp::comm
