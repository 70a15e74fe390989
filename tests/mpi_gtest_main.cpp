// gtest main for every suite: initialises MPI (a singleton when not under mpirun), silences the
// printer on ranks other than 0, and returns the worst result over all ranks, so a failure on any
// rank fails the test under mpirun.
#include <gtest/gtest.h>
#include <mpi.h>

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  ::testing::InitGoogleTest(&argc, argv);
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  int local = RUN_ALL_TESTS();
  // A rank that failed says so even though its printer is silenced.
  if (local != 0 && rank != 0) std::fprintf(stderr, "rank %d: tests failed\n", rank);
  int worst = 0;
  MPI_Allreduce(&local, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}
