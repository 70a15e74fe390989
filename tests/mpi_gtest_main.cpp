// gtest main for every suite: under mpirun it initialises MPI, silences the printer on ranks other
// than 0, and returns the worst result over all ranks, so a failure on any rank fails the test.
// Started without mpirun, it is a plain single-process gtest main (no MPI at all).
#include <gtest/gtest.h>
#include <mpi.h>

#include "comm/mpi_session.h"

int main(int argc, char** argv) {
  amp::comm::MpiSession mpi(&argc, &argv);
  const int rank = mpi.rank();
  ::testing::InitGoogleTest(&argc, argv);
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  int local = RUN_ALL_TESTS();
  // A rank that failed says so even though its printer is silenced.
  if (local != 0 && rank != 0) std::fprintf(stderr, "rank %d: tests failed\n", rank);
  int worst = local;
  if (mpi.active()) MPI_Allreduce(&local, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return worst;
}
