// The one order in which a step's contributions are summed, whatever the number of ranks: the
// binary tree that a binary counter of partial sums builds over the global micro-batch index
// m = 0 .. M-1 (M = ranks x micro-batches). Leaf m is pushed; two partial sums of the same height
// merge (left + right) as soon as both exist; at the end the partial sums left (the binary digits
// of M, largest first) are folded left to right.
//
// Why this is rank-invariant: when each rank's K micro-batches are a power of two, rank r's leaves
// [rK, (r+1)K) form one complete subtree whose partial sum is what the rank contributes, and the
// tree over the R ranks' contributions (the same counter over R leaves) is the upper part of the
// tree over the M leaves. One rank with M micro-batches, M ranks with one each, and every split in
// between add the same numbers in the same order. float addition is commutative (a + b == b + a
// bit for bit), so only the grouping matters, not which operand a buffer holds.
#pragma once
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace amp::comm {

// The tree over values of any kind (device tensors, host numbers): add(into, other) sets
// into = into + other. A merge writes into the right operand, and the fold into the last partial
// sum, so the value pushed last holds the total: a caller that pushes its communication buffer last
// gets the sum there with no copy.
template <class T, class Add>
class SumTree {
 public:
  explicit SumTree(Add add) : add_(std::move(add)) {}

  void push(T leaf) {
    int height = 0;
    while (!nodes_.empty() && nodes_.back().height == height) {
      add_(leaf, nodes_.back().value);  // left + right, in the right operand's storage
      released_.push_back(std::move(nodes_.back().value));
      nodes_.pop_back();
      ++height;
    }
    nodes_.push_back({height, std::move(leaf)});
  }

  // The sum of every leaf pushed since the last fold (left to right over what is left); the tree is
  // empty after. At least one leaf must have been pushed.
  T fold() {
    for (size_t i = 1; i < nodes_.size(); ++i) {
      add_(nodes_[i].value, nodes_[i - 1].value);
      released_.push_back(std::move(nodes_[i - 1].value));
    }
    T total = std::move(nodes_.back().value);
    nodes_.clear();
    return total;
  }

  bool empty() const { return nodes_.empty(); }
  // Values merged into others since the last call: their storage may be reused.
  std::vector<T> take_released() { return std::exchange(released_, {}); }

 private:
  struct Node {
    int height;
    T value;
  };
  Add add_;
  std::vector<Node> nodes_;
  std::vector<T> released_;
};

template <class T, class Add>
SumTree<T, Add> make_sum_tree(Add add) {
  return SumTree<T, Add>(std::move(add));
}

// The same tree over n numbers get(0) .. get(n-1), without allocation (per element of a reduction
// over ranks; n at most 2^63).
template <class T, class Get>
inline T tree_sum(int64_t n, Get get) {
  if (n <= 0) return T{};
  T sum[64];
  int height[64];
  sum[0] = get(0);
  height[0] = 0;
  int top = 1;
  for (int64_t i = 1; i < n; ++i) {
    T v = get(i);
    int h = 0;
    while (top > 0 && height[top - 1] == h) {
      v = sum[top - 1] + v;
      --top;
      ++h;
    }
    sum[top] = v;
    height[top++] = h;
  }
  T acc = sum[0];
  for (int i = 1; i < top; ++i) acc = acc + sum[i];
  return acc;
}

// Whether the tree over ranks x micro-batches is the tree over their product: K a power of two (each
// rank's micro-batches a whole subtree), or one rank.
inline bool split_is_subtrees(int64_t ranks, int64_t micro_batches) {
  return ranks == 1 || (micro_batches > 0 && (micro_batches & (micro_batches - 1)) == 0);
}

}  // namespace amp::comm
