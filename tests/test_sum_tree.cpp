// comm/sum_tree.h: the one order of a step's sums. The tensor tree (the reducer, the losses, the
// TCP sum) and the per-element tree (the shared-memory sum over ranks) group the same leaves the same
// way, and a tree over R ranks' subtrees of K leaves each (K a power of two) is the tree over R·K
// leaves: what makes every split of a step into ranks x micro-batches add the same numbers in the
// same order. Checked on leaves whose float sums depend on the grouping.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "comm/sum_tree.h"

namespace amp {
namespace {

// The grouping as text: "((0+1)+2)".
struct Expr {
  std::string s;
};
void add_expr(Expr& into, const Expr& left) { into.s = "(" + left.s + "+" + into.s + ")"; }

std::string tree_of(int64_t n) {
  auto t = comm::make_sum_tree<Expr>(add_expr);
  for (int64_t i = 0; i < n; ++i) t.push({std::to_string(i)});
  return t.fold().s;
}

// Leaves whose float sum changes with the grouping (large and small magnitudes mixed).
float leaf(int64_t i) { return (i % 3 == 0 ? 1e8f : 1.0f) * (i % 2 ? -1.0f : 1.0f) + static_cast<float>(i) * 0.37f; }

float tensor_like_sum(int64_t first, int64_t n) {
  auto t = comm::make_sum_tree<float>([](float& into, const float& other) { into = into + other; });
  for (int64_t i = first; i < first + n; ++i) t.push(leaf(i));
  return t.fold();
}

TEST(SumTree, IsTheBinaryCounterTree) {
  EXPECT_EQ(tree_of(1), "0");
  EXPECT_EQ(tree_of(2), "(0+1)");
  EXPECT_EQ(tree_of(3), "((0+1)+2)");
  EXPECT_EQ(tree_of(4), "((0+1)+(2+3))");
  EXPECT_EQ(tree_of(6), "(((0+1)+(2+3))+(4+5))");
  EXPECT_EQ(tree_of(7), "((((0+1)+(2+3))+(4+5))+6)");
}

TEST(SumTree, PerElementTreeIsTheTensorTree) {
  for (int64_t n = 1; n <= 40; ++n) {
    const float a = comm::tree_sum<float>(n, [](int64_t i) { return leaf(i); });
    const float b = tensor_like_sum(0, n);
    EXPECT_TRUE(a == b || (std::isnan(a) && std::isnan(b))) << n << ": " << a << " vs " << b;
  }
}

TEST(SumTree, RanksOfPowerOfTwoSubtreesAreTheWholeTree) {
  bool grouping_matters = false;
  for (int64_t K : {1, 2, 4, 8})
    for (int64_t R = 1; R <= 9; ++R) {
      // Each rank's K leaves in its own tree, then the per-element tree over the R partial sums.
      std::vector<float> partial;
      for (int64_t r = 0; r < R; ++r) partial.push_back(tensor_like_sum(r * K, K));
      const float split = comm::tree_sum<float>(R, [&](int64_t r) { return partial[static_cast<size_t>(r)]; });
      const float whole = tensor_like_sum(0, R * K);
      EXPECT_EQ(split, whole) << R << " ranks x " << K;
      EXPECT_TRUE(comm::split_is_subtrees(R, K));
      float in_order = 0.0f;
      for (int64_t i = 0; i < R * K; ++i) in_order += leaf(i);
      grouping_matters = grouping_matters || in_order != whole;
    }
  EXPECT_TRUE(grouping_matters) << "the leaves do not tell groupings apart: the test would prove nothing";
  EXPECT_FALSE(comm::split_is_subtrees(2, 3));
  EXPECT_TRUE(comm::split_is_subtrees(1, 3));
}

}  // namespace
}  // namespace amp
