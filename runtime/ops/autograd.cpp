#include "runtime/ops/autograd.h"

#include <algorithm>
#include <queue>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "runtime/kernels/backend.h"
#include "runtime/ops/autocast_policy.h"
#include "runtime/ops/ops.h"

namespace amp {

namespace {
std::atomic<uint64_t> g_next_sequence_nr{0};
thread_local bool t_grad_enabled = true;
thread_local bool t_accumulating = false;
thread_local bool t_releasing = false;
std::atomic<uint64_t> g_backward_count{0};
thread_local uint64_t t_backward_id = 0;  // this thread's current backward(), 0 outside

// Restores the previous value on every exit, exceptions included.
class ScopedFlag {
 public:
  ScopedFlag(bool* flag, bool value) : flag_(flag), prev_(*flag) { *flag = value; }
  ~ScopedFlag() { *flag_ = prev_; }
  ScopedFlag(const ScopedFlag&) = delete;
  ScopedFlag& operator=(const ScopedFlag&) = delete;

 private:
  bool* flag_;
  bool prev_;
};

// The node the engine is applying on this thread, and the gradients it has gathered so far.
struct Applying {
  const Node* node = nullptr;
  std::unordered_map<Node*, Tensor>* buffers = nullptr;
  const std::unordered_map<Node*, int>* dependencies = nullptr;  // the edges each node still waits for
};
thread_local Applying t_applying;
}  // namespace

bool accumulating_backward() { return t_accumulating; }
bool releasing_graph() { return t_releasing; }

namespace {
// Only this handle holds the tensor and its memory (no view, no other reference): what is written
// into it in place no one else reads.
bool held_here_only(const Tensor& t) { return t.impl_ptr().use_count() == 1 && t.impl()->storage.use_count() == 1; }
}  // namespace

Tensor take_gradient_so_far(size_t input, const Tensor& like) {
  const Applying& a = t_applying;
  if (a.node == nullptr || t_grad_enabled || input >= a.node->next.size() || !a.node->next[input]) return Tensor();
  const auto it = a.buffers->find(a.node->next[input].get());
  if (it == a.buffers->end() || !it->second.defined()) return Tensor();
  const Tensor& buf = it->second;
  // Only the map holds it (no view, no other consumer's reference): an in-place sum changes nothing
  // anyone else reads.
  if (!held_here_only(buf) || buf.dtype() != like.dtype() || buf.shape() != like.shape() || buf.device() != like.device() ||
      buf.requires_grad())
    return Tensor();
  // Out of the map: what the op returns for this input is then the whole gradient so far, and the
  // engine, finding no buffer, takes it as it is (anything else given to that node is still added).
  Tensor taken = std::move(it->second);
  a.buffers->erase(it);
  return taken;
}

Tensor take_leaf_gradient_so_far(const Tensor& leaf, DType dtype) {
  const Applying& a = t_applying;
  if (a.node == nullptr || !t_accumulating || t_grad_enabled || !leaf.defined() || !leaf.is_leaf() ||
      leaf.grad().defined())
    return Tensor();
  const std::shared_ptr<Node> acc = leaf.impl()->grad_accumulator.lock();
  if (!acc) return Tensor();
  const Tensor destination = leaf.grad_destination();
  // Nothing else reads it before the accumulator: only the map holds it, or it is the leaf's
  // destination (a slice of the reducer's bucket, read once the leaf's gradient is complete). The
  // same buffer is then taken with buckets and without, and a run's bits do not depend on the ranks.
  auto in_place = [&](const Tensor& buf) {
    return held_here_only(buf) || (destination.defined() && buf.data_ptr() == destination.data_ptr());
  };
  auto usable = [&](const Tensor& buf, bool at_cast) {
    return buf.defined() && (buf.dtype() == dtype || (at_cast && is_floating(buf.dtype()))) &&
           buf.shape() == leaf.shape() && buf.device() == leaf.device() && !buf.requires_grad() &&
           (buf.dtype() != dtype || in_place(buf));
  };
  auto waits = [&](Node* n) {
    const auto it = a.dependencies->find(n);
    return it == a.dependencies->end() ? 0 : it->second;
  };
  // The accumulator's own: what reached the leaf already, to which the engine would add this op's
  // gradient next. Else a cast's, only where the engine's sum is the same: every consumer of the cast
  // has given it its gradient, and the accumulator waits for the cast and this op alone (which adds
  // its gradient to the cast's, as the engine would add them).
  auto chosen = a.buffers->find(acc.get());
  if (chosen != a.buffers->end()) {
    if (!usable(chosen->second, false)) return Tensor();
  } else {
    if (waits(acc.get()) != 2) return Tensor();
    for (auto it = a.buffers->begin(); it != a.buffers->end(); ++it) {
      const auto* cast = dynamic_cast<const CastNode*>(it->first);
      if (cast == nullptr || cast->from() != dtype || cast->next.size() != 1 || cast->next[0] != acc ||
          waits(it->first) != 0 || !usable(it->second, true))
        continue;
      chosen = it;  // at most one: the accumulator waits for this op and one other
      break;
    }
  }
  if (chosen == a.buffers->end()) return Tensor();
  Tensor taken = std::move(chosen->second);
  a.buffers->erase(chosen);
  if (taken.dtype() != dtype) {  // fp16's classifier gradient: the cast's backward, made here
    Tensor wide = take_grad_destination(leaf, dtype);
    if (!wide.defined()) wide = empty(taken.shape(), dtype, taken.device());
    backend_for(taken.device()).cast(taken, wide);
    return wide;
  }
  return taken;
}

Tensor take_grad_destination(const Tensor& leaf, DType dtype) {
  if (!t_accumulating || t_grad_enabled || !leaf.defined() || !leaf.is_leaf() || leaf.grad().defined())
    return Tensor();
  TensorImpl* impl = leaf.impl();
  const Tensor dst = leaf.grad_destination();
  if (!dst.defined() || dst.dtype() != dtype || impl->grad_destination_taken_by == t_backward_id) return Tensor();
  impl->grad_destination_taken_by = t_backward_id;
  return dst;
}

std::vector<Tensor> CastNode::apply(const Tensor& grad_output) {
  // The backward of autocast's copy of a parameter: the gradient cast straight into the parameter's
  // destination (the reducer's bucket), not cast and then copied there.
  Tensor dst = next.empty() ? Tensor() : take_grad_destination(leaf_of(next[0]), from_);
  if (!dst.defined()) return {cast(grad_output, from_)};
  backend_for(dst.device()).cast(grad_output, dst);
  return {dst};
}

const CastNode* cast_node_of(const Tensor& t) {
  return t.defined() ? dynamic_cast<const CastNode*>(t.grad_fn().get()) : nullptr;
}

Tensor leaf_of(const std::shared_ptr<Node>& node) {
  const auto* acc = dynamic_cast<const AccumulateGrad*>(node.get());
  return acc != nullptr ? acc->leaf() : Tensor();
}

Node::Node() : sequence_nr(g_next_sequence_nr.fetch_add(1)) {}

namespace {
// What a dying node owned that may own further nodes (its producers; a closure's saved tensors,
// whose grad_fns are nodes), freed by the outermost destruction in a loop: a node that dies inside
// it only hands its own over, so the stack stays a few frames deep whatever the graph's depth.
struct Graveyard {
  std::vector<std::shared_ptr<Node>> nodes;
  std::vector<BackwardFn> closures;
};
// The outermost destruction's graveyard, on its stack (a pointer: nothing thread_local to destroy
// at a thread's or the process's exit, when nodes may still die).
thread_local Graveyard* t_graveyard = nullptr;

void add(Graveyard& g, std::vector<std::shared_ptr<Node>>* nodes, BackwardFn* closure) {
  if (nodes)
    for (std::shared_ptr<Node>& n : *nodes)
      if (n) g.nodes.push_back(std::move(n));  // (a bad_alloc here ends the process: a destructor)
  if (closure && *closure) {  // swapped out: a moved-from std::function is not promised to be empty
    g.closures.emplace_back();
    g.closures.back().swap(*closure);
  }
}

void bury(std::vector<std::shared_ptr<Node>>* nodes, BackwardFn* closure) noexcept {
  if (t_graveyard) return add(*t_graveyard, nodes, closure);
  Graveyard g;
  t_graveyard = &g;  // before add: what dies while adding is buried too
  add(g, nodes, closure);
  while (!g.nodes.empty() || !g.closures.empty()) {
    if (!g.closures.empty()) {
      BackwardFn dying = std::move(g.closures.back());
      g.closures.pop_back();
      dying = nullptr;  // may bury more: appended to g, freed by this loop
    } else {
      std::shared_ptr<Node> dying = std::move(g.nodes.back());
      g.nodes.pop_back();
      dying.reset();
    }
  }
  t_graveyard = nullptr;
}
}  // namespace

Node::~Node() { bury(&next, nullptr); }

FunctionNode::~FunctionNode() { bury(nullptr, &fn_); }

bool GradMode::enabled() { return t_grad_enabled; }
void GradMode::set_enabled(bool e) { t_grad_enabled = e; }

std::vector<Tensor> FunctionNode::apply(const Tensor& grad_output) {
  if (!fn_)
    throw std::runtime_error("Trying to backward through the graph a second time (or directly access saved tensors "
                             "after they have already been freed) in " + name_ +
                             ". Specify retain_graph=true on the first backward.");
  return fn_(grad_output);
}

std::vector<Tensor> AccumulateGrad::apply(const Tensor& g) {
  Tensor leaf(leaf_);
  Tensor existing = leaf.grad();
  if (!existing.defined()) {
    // Steal the incoming buffer when nothing else can see it; otherwise copy so later += is private.
    // Computed in place into the leaf's destination: that view is the gradient, no copy.
    const bool in_destination = leaf_->grad_destination && g.data_ptr() == Tensor(leaf_->grad_destination).data_ptr();
    const bool private_buffer = in_destination || held_here_only(g);
    Tensor stored = GradMode::enabled() ? g : (private_buffer ? g.detach() : g.detach().clone());
    if (stored.dtype() != leaf.dtype()) {
      stored = cast(stored, leaf.dtype());
    }
    leaf.set_grad(stored);
  } else if (GradMode::enabled()) {
    leaf.set_grad(add(existing, g));  // create_graph: keep the history of the sum
  } else {
    add_(existing, g);  // fp32 .grad += g, across micro-batches and losses
  }
  for (const GradHook& hook : leaf_->post_accumulate_hooks) hook(leaf);
  return {};
}

std::shared_ptr<Node> gradient_edge(const Tensor& t) {
  if (!t.defined() || !t.requires_grad()) return nullptr;
  if (t.grad_fn()) return t.grad_fn();
  TensorImpl* impl = t.impl();
  std::shared_ptr<Node> acc = impl->grad_accumulator.lock();
  if (!acc) {
    acc = std::make_shared<AccumulateGrad>(t.impl_ptr());
    impl->grad_accumulator = acc;
  }
  return acc;
}

namespace {
bool any_requires_grad(const std::vector<Tensor>& inputs) {
  if (!GradMode::enabled()) return false;
  bool any = false;
  for (const Tensor& t : inputs) any = any || (t.defined() && t.requires_grad());
  return any;
}
}  // namespace

Tensor record(const char* name, Tensor out, const std::vector<Tensor>& inputs, BackwardFn fn) {
  if (!any_requires_grad(inputs)) return out;
  return record_node(std::make_shared<FunctionNode>(name, std::move(fn)), std::move(out), inputs);
}

Tensor record_node(std::shared_ptr<Node> node, Tensor out, const std::vector<Tensor>& inputs) {
  if (!any_requires_grad(inputs)) return out;
  node->next.reserve(inputs.size());
  for (const Tensor& t : inputs) node->next.push_back(gradient_edge(t));
  out.impl()->grad_fn = std::move(node);
  out.impl()->requires_grad = true;
  return out;
}

namespace {

struct Engine {
  // Inputs of grad(): gradients arriving at these nodes are captured, not accumulated.
  std::unordered_map<Node*, size_t> capture_index;
  std::vector<Tensor> captured;
  bool accumulate = true;

  void run(const std::vector<Tensor>& roots, const std::vector<Tensor>& seeds, bool retain_graph) {
    ScopedFlag releasing(&t_releasing, !retain_graph);
    std::vector<std::shared_ptr<Node>> root_nodes;
    std::unordered_map<Node*, Tensor> buffers;
    for (size_t i = 0; i < roots.size(); ++i) {
      const Tensor& r = roots[i];
      if (!r.requires_grad())
        throw std::runtime_error("element " + std::to_string(i) +
                                 " of tensors does not require grad and does not have a grad_fn");
      Tensor seed;
      if (i < seeds.size() && seeds[i].defined()) {
        seed = seeds[i];
        if (seed.shape() != r.shape())
          throw std::invalid_argument("backward: gradient shape " + shape_str(seed.shape()) +
                                      " does not match output shape " + shape_str(r.shape()));
      } else {
        if (r.numel() != 1) throw std::runtime_error("grad can be implicitly created only for scalar outputs");
        seed = ones(r.shape(), r.dtype(), r.device());
      }
      std::shared_ptr<Node> n = gradient_edge(r);
      Tensor& buf = buffers[n.get()];
      buf = buf.defined() ? add(buf, seed) : seed;
      root_nodes.push_back(n);
    }

    // Count, for each reachable node, how many edges feed its gradient.
    std::unordered_map<Node*, int> dependencies;
    std::unordered_set<Node*> seen;
    std::vector<Node*> stack;
    for (auto& n : root_nodes)
      if (seen.insert(n.get()).second) stack.push_back(n.get());
    std::vector<Node*> visited;
    while (!stack.empty()) {
      Node* n = stack.back();
      stack.pop_back();
      visited.push_back(n);
      for (auto& next : n->next) {
        if (!next) continue;
        dependencies[next.get()] += 1;
        if (seen.insert(next.get()).second) stack.push_back(next.get());
      }
    }

    auto later_first = [](Node* a, Node* b) { return a->sequence_nr < b->sequence_nr; };
    std::priority_queue<Node*, std::vector<Node*>, decltype(later_first)> ready(later_first);
    std::unordered_set<Node*> queued;
    for (auto& n : root_nodes)
      if (dependencies[n.get()] == 0 && queued.insert(n.get()).second) ready.push(n.get());

    while (!ready.empty()) {
      Node* n = ready.top();
      ready.pop();
      Tensor g = std::move(buffers[n]);
      buffers.erase(n);
      auto cap = capture_index.find(n);
      if (cap != capture_index.end()) captured[cap->second] = g;
      std::vector<Tensor> grads;
      if (dynamic_cast<AccumulateGrad*>(n) != nullptr) {
        if (accumulate && g.defined()) n->apply(g);
      } else if (g.defined()) {
        struct Restore {  // on every exit; a backward inside a hook nests
          Applying outer;
          ~Restore() { t_applying = outer; }
        } restore{t_applying};
        t_applying = {n, &buffers, &dependencies};
        grads = n->apply(g);
        // Its saved tensors are spent: freed now, as PyTorch frees them, not when the whole backward
        // is done. The activations then go as the gradients come, and the backward's peak is not
        // every activation and every gradient at once.
        if (!retain_graph) n->release();
      }
      for (size_t i = 0; i < n->next.size(); ++i) {
        Node* next = n->next[i].get();
        if (!next) continue;
        if (i < grads.size() && grads[i].defined()) {
          // (A buffer the op took, take_gradient_so_far, is out of the map: what it returned is the sum.)
          Tensor& buf = buffers[next];
          buf = buf.defined() ? add(buf, grads[i]) : grads[i];
        }
        if (--dependencies[next] == 0) ready.push(next);
      }
    }
    if (!retain_graph)
      for (Node* n : visited) n->release();  // those that took no gradient, and the sinks
  }
};

}  // namespace

void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& seeds, bool retain_graph,
              bool create_graph) {
  AutocastSuspend no_autocast;
  ScopedFlag grad_mode(&t_grad_enabled, create_graph);
  ScopedFlag accumulating(&t_accumulating, true);
  const uint64_t outer_id = t_backward_id;  // a hook may run a backward of its own
  t_backward_id = g_backward_count.fetch_add(1) + 1;
  struct Restore {
    uint64_t id;
    ~Restore() { t_backward_id = id; }
  } restore{outer_id};
  Engine e;
  e.run(roots, seeds, retain_graph || create_graph);
}

std::vector<Tensor> grad(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                         const std::vector<Tensor>& seeds, bool retain_graph, bool create_graph, bool allow_unused) {
  AutocastSuspend no_autocast;
  Engine e;
  e.accumulate = false;
  e.captured.resize(inputs.size());
  std::vector<std::shared_ptr<Node>> keep;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].requires_grad())
      throw std::runtime_error("grad: input " + std::to_string(i) + " does not require grad");
    keep.push_back(gradient_edge(inputs[i]));
    e.capture_index[keep.back().get()] = i;
  }
  {
    ScopedFlag grad_mode(&t_grad_enabled, create_graph);
    ScopedFlag accumulating(&t_accumulating, false);
    e.run(outputs, seeds, retain_graph || create_graph);
  }
  for (size_t i = 0; i < inputs.size(); ++i)
    if (!e.captured[i].defined() && !allow_unused)
      throw std::runtime_error("grad: input " + std::to_string(i) +
                               " is not used in the graph (pass allow_unused=true to get an undefined gradient)");
  return e.captured;
}

}  // namespace amp
