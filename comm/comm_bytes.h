// The bytes a rank sends in a collective, from the sizes alone, as the bandwidth-optimal algorithms
// send them (a ring's, which NCCL and MPI run for large messages). B is the bytes of this rank's
// buffer, R the number of ranks. A communicator adds them to Communicator::bytes_sent(), whatever
// its transport does underneath (one node's shared memory moves nothing over a wire), so that the
// figure compares algorithms, not transports.
#pragma once
#include <cstdint>

namespace amp::comm::sent_bytes {

// Reduce-scatter then all-gather: 2 (R - 1) chunks of B / R.
inline uint64_t all_reduce(uint64_t B, int R) { return R <= 1 ? 0 : 2 * uint64_t(R - 1) * B / uint64_t(R); }
// This rank's B goes to each of the R - 1 others (a ring forwards as many bytes).
inline uint64_t all_gather(uint64_t B, int R) { return R <= 1 ? 0 : uint64_t(R - 1) * B; }
// B is the whole send buffer, R parts of B / R: all but this rank's own part leave.
inline uint64_t all_to_all(uint64_t B, int R) { return R <= 1 ? 0 : uint64_t(R - 1) * B / uint64_t(R); }
// The data leaves the root once.
inline uint64_t broadcast(uint64_t B, int R, bool root) { return R <= 1 || !root ? 0 : B; }

}  // namespace amp::comm::sent_bytes
