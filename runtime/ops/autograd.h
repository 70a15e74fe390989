// Autograd: a dynamic tape of Nodes, and the engine that walks it backwards.
//
// Every op that sees an input requiring grad (while grad mode is on) records one Node whose apply()
// maps the gradient of its single output to gradients of its inputs. Backward formulas are written
// with the same differentiable ops, so with create_graph=true the gradients are themselves
// differentiable (double backward).
#pragma once
#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "runtime/core/tensor.h"

namespace amp {

class Node {
 public:
  Node();
  // Releases next through the graveyard below: a graph a million nodes deep is freed in a loop, not
  // by a million nested destructors (which overflowed the stack: an MLP of 100000 layers crashed).
  virtual ~Node();
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  // Gradients of the inputs (one per entry of next; undefined where an input needs none).
  virtual std::vector<Tensor> apply(const Tensor& grad_output) = 0;
  virtual std::string name() const = 0;
  // Frees saved tensors after a backward without retain_graph.
  virtual void release() {}

  std::vector<std::shared_ptr<Node>> next;  // producer of each input (null: no grad needed)
  const uint64_t sequence_nr;               // creation order; the engine runs later nodes first
};

using BackwardFn = std::function<std::vector<Tensor>(const Tensor& grad_output)>;

// A node whose backward is a closure over the tensors it saved.
class FunctionNode final : public Node {
 public:
  FunctionNode(std::string name, BackwardFn fn) : name_(std::move(name)), fn_(std::move(fn)) {}
  ~FunctionNode() override;  // fn_'s saved tensors (whose grad_fns are nodes) through the graveyard too
  std::vector<Tensor> apply(const Tensor& grad_output) override;
  std::string name() const override { return name_; }
  void release() override { fn_ = nullptr; }

 private:
  std::string name_;
  BackwardFn fn_;
};

// The sink for a leaf: accumulates into .grad and runs the leaf's post-accumulate hooks.
class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(std::shared_ptr<TensorImpl> leaf) : leaf_(std::move(leaf)) {}
  std::vector<Tensor> apply(const Tensor& grad_output) override;
  std::string name() const override { return "AccumulateGrad"; }
  Tensor leaf() const { return Tensor(leaf_); }

 private:
  std::shared_ptr<TensorImpl> leaf_;
};

// Grad mode: thread-local switch for recording.
struct GradMode {
  static bool enabled();
  static void set_enabled(bool e);
};
class NoGradGuard {
 public:
  NoGradGuard() : prev_(GradMode::enabled()) { GradMode::set_enabled(false); }
  ~NoGradGuard() { GradMode::set_enabled(prev_); }
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool prev_;
};

// True inside backward() (gradients go to .grad), false inside grad() and outside autograd.
bool accumulating_backward();
// True inside a backward() or grad() that frees the graph as it ends (no retain_graph): what a node
// saved is read for the last time, so its backward may write over a saved tensor nothing else holds.
bool releasing_graph();
// The memory an op may compute `leaf`'s gradient into: its grad_destination, inside backward() (never
// grad()), without a graph of the gradient, for a leaf without a gradient yet, of `dtype`, and only
// for the first gradient of this backward to ask (a leaf used twice gets its second one elsewhere:
// the first is still on its way to the accumulator). Undefined when none may be used.
Tensor take_grad_destination(const Tensor& leaf, DType dtype);

// Inside a node's backward, outside create_graph: the gradient the engine has already gathered for the
// node's input `input` from its other consumers (a residual stream's, from the add that also reads it),
// when nothing else holds it and it has `like`'s shape and dtype, contiguous. The engine gives it up:
// the op must add its own gradient into it in place and return it as that input's gradient, which the
// engine then takes as the sum (the numbers of the engine's add, when the op adds as add() does).
// Undefined otherwise: the op makes its gradient apart, and the engine adds. At most one caller gets
// a given buffer.
Tensor take_gradient_so_far(size_t input, const Tensor& like);

// The same for a leaf, inside backward() (never grad()), outside create_graph, for a leaf without a
// gradient yet: a gradient of `dtype` and the leaf's shape on its way to the leaf from its other uses,
// taken out of the engine's map where nothing else reads it before the leaf's accumulator (only the
// map holds it, or it is the leaf's destination). At the accumulator; or at autocast's copy of the
// leaf (GPT's tied wte: the copy the classifier reads was made before the embedding, so its backward
// runs after the embedding's) where every consumer of the copy has given it its gradient and the
// accumulator waits for the copy and this op alone; cast to `dtype` here where it is not (fp16's
// classifier gradient, into the leaf's destination where it has one). The op adds its own gradient
// into it in place (as add() would add it to what it was given) and returns the sum as its gradient
// for the leaf: the engine's sum. A cast whose gradient was taken then gets none and does not run.
// Undefined otherwise.
Tensor take_leaf_gradient_so_far(const Tensor& leaf, DType dtype);

// A cast's backward: the gradient cast back to the source's dtype. Its own class so that the op
// making that gradient can see the source's dtype and make it there directly (passed on unchanged).
class CastNode final : public Node {
 public:
  explicit CastNode(DType from) : from_(from) {}
  std::vector<Tensor> apply(const Tensor& grad_output) override;
  std::string name() const override { return "CastBackward"; }
  DType from() const { return from_; }

 private:
  DType from_;
};
// t's CastNode when t is a cast's output with history, else null.
const CastNode* cast_node_of(const Tensor& t);
// The leaf whose accumulator `node` is, or an undefined tensor.
Tensor leaf_of(const std::shared_ptr<Node>& node);

// Records `fn` as the backward of `out` if grad mode is on and any input requires grad.
Tensor record(const char* name, Tensor out, const std::vector<Tensor>& inputs, BackwardFn fn);
// The same with a node of its own class (apply() maps to one gradient per input).
Tensor record_node(std::shared_ptr<Node> node, Tensor out, const std::vector<Tensor>& inputs);
// The node a gradient for `t` flows into (its grad_fn, or its leaf accumulator), or null.
std::shared_ptr<Node> gradient_edge(const Tensor& t);

// Accumulates d(sum of roots·seeds)/d(leaf) into every reachable leaf's .grad.
void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& seeds = {}, bool retain_graph = false,
              bool create_graph = false);
// Returns d(sum of outputs·seeds)/d(inputs) without touching .grad. With create_graph the results
// carry history. allow_unused: an input the outputs do not depend on gets an undefined tensor.
std::vector<Tensor> grad(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                         const std::vector<Tensor>& seeds = {}, bool retain_graph = false, bool create_graph = false,
                         bool allow_unused = false);

}  // namespace amp
