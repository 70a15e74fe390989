// A multi-task micro-batch's backward as one flat float32 buffer: the shared parameters' Jacobian J
// [tasks, N] (row-major), then every task parameter's gradient, in order. Packs add element-wise, so
// a caller sums the micro-batches' packs (a tree) and the ranks' (a collective) as it sums gradients,
// then unpacks the sum: the heads' gradients, and J aggregated into the shared parameters' gradients.
#pragma once
#include <cstdint>
#include <vector>

#include "jd/aggregator.h"
#include "runtime/core/tensor.h"

namespace amp::jd {

struct Packed {
  Tensor flat;       // [rows * N + the task parameters' elements], float32
  int64_t rows = 0;  // J's rows
};

// After mtl_backward: packs J (the shared parameters' jacs, concatenated) and the task parameters'
// gradients (zeros for one without), then clears both, ready for the next micro-batch.
Packed pack(const std::vector<Tensor>& shared, const std::vector<std::vector<Tensor>>& tasks);

// From a sum of packs: sets each task parameter's gradient, aggregates the summed J into the shared
// parameters' gradients (jac_to_grad with aggregator), and returns the aggregator's weights.
std::vector<double> unpack_and_aggregate(const Packed& sum, const std::vector<Tensor>& shared,
                                         const std::vector<std::vector<Tensor>>& tasks, Aggregator& aggregator);

}  // namespace amp::jd
