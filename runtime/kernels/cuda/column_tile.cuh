// The tile of the column reductions (sum_to's, LayerNorm's parameter gradients, the embedding's
// runs): kColTile adjacent columns, one warp's coalesced row segment, by kRowLanes rows at a time.
#pragma once

namespace amp::cuda {

constexpr int kColTile = 32, kRowLanes = 8;

}  // namespace amp::cuda
