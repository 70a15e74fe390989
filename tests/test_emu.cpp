// The emulated GPU itself (preset cuda-emu): that it runs kernels as a GPU would, and that it
// catches what a GPU would punish. Kernels written here, launched through AMP_LAUNCH like the
// project's own.
//
// Each fault test checks the message, then clears the sticky fault (a real device would need a new
// process) so that the next test starts clean.
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "emu.h"
#include "runtime/kernels/cuda/async_copy.cuh"
#include "runtime/kernels/cuda/block_reduce.cuh"
#include "runtime/kernels/cuda/device_elem.cuh"
#include "runtime/kernels/cuda/launch.cuh"
#include "runtime/kernels/cuda/mma.cuh"

namespace amp {
namespace {

// --- kernels

__global__ void half_the_block_at_a_barrier(int* out) {
  if (threadIdx.x < 16) __syncthreads();
  out[threadIdx.x] = 1;
}

__global__ void two_barrier_sites(int* out) {
  if (threadIdx.x % 2 == 0) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1;
}

__global__ void shuffle_after_half_the_warp_left(float* out) {
  if (threadIdx.x >= 16) return;
  out[threadIdx.x] = __shfl_down_sync(0xffffffffu, static_cast<float>(threadIdx.x), 1);
}

__global__ void full_mask_in_a_partial_warp(float* out) {
  out[threadIdx.x] = __shfl_down_sync(0xffffffffu, 1.0f, 1);
}

__global__ void shuffle_down_and_xor(int* down, int* xr, int* idx) {
  const int v = static_cast<int>(threadIdx.x) * 10;
  down[threadIdx.x] = __shfl_down_sync(0xffffffffu, v, 3);
  xr[threadIdx.x] = __shfl_xor_sync(0xffffffffu, v, 5);
  idx[threadIdx.x] = __shfl_sync(0xffffffffu, v, 7 + 32 * (static_cast<int>(threadIdx.x) % 3));  // lane 7, any multiple of 32 off
}

template <class T>
__global__ void block_sum(const T* x, int64_t n, T* out) {
  T acc = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += x[i];
  acc = cuda::block_reduce(acc, cuda::SumOp{});
  if (threadIdx.x == 0) out[blockIdx.x] = acc;
}

__global__ void read_shared_before_writing(float* out) {
  AMP_SHARED(float[64], tile);
  out[threadIdx.x] = tile[threadIdx.x];  // never written in this block
  __syncthreads();
  tile[threadIdx.x] = 1.0f;
}

template <bool Barrier>
__global__ void broadcast_from_thread_zero(float* out) {
  AMP_SHARED(float, v);
  if (threadIdx.x == 0) v = 7.0f;
  if (Barrier) __syncthreads();
  out[threadIdx.x] = v;
}

__global__ void count_visits(int* hits, int64_t n) {
  AMP_GRID_STRIDE(i, n) hits[i] += 1;
}

__global__ void set_to(float* p, float v) { p[0] = v; }
__global__ void copy_first(const float* src, float* dst) { dst[0] = src[0]; }
__global__ void throwing_kernel(int* p) {
  if (threadIdx.x == 5) throw std::runtime_error("thread 5 gave up");
  p[0] = 1;
}

// One mma.m16n8k16 from whole matrices (a: 16 x 16 row-major, b: 16 x 8 k by n, bf16 bits), each lane
// filling its fragments by the PTX ISA's formulas for element i (groupID = lane / 4, tig = lane % 4):
// A's a_i at row groupID (+ 8 for i = 2, 3, 6, 7), col 2 tig + (i & 1) (+ 8 for i >= 4); B's b_i at
// row 2 tig + (i & 1) (+ 8 for i >= 2), col groupID; C's c_i at row groupID (+ 8 for i >= 2), col
// 2 tig + (i & 1). d is 16 x 8, initialised to c.
__global__ void mma_whole(const uint16_t* a, const uint16_t* b, const float* c, float* d) {
  const int lane = static_cast<int>(threadIdx.x), group = lane / 4, tig = lane % 4;
  uint16_t ae[8], be[4];
  for (int i = 0; i < 8; ++i) {
    const int row = group + ((i % 4) >= 2 ? 8 : 0), col = 2 * tig + (i & 1) + (i >= 4 ? 8 : 0);
    ae[i] = a[row * 16 + col];
  }
  for (int i = 0; i < 4; ++i) be[i] = b[(2 * tig + (i & 1) + (i >= 2 ? 8 : 0)) * 8 + group];
  uint32_t af[4], bf[2];
  for (int r = 0; r < 4; ++r) af[r] = uint32_t{ae[2 * r]} | uint32_t{ae[2 * r + 1]} << 16;  // low half: the lower index
  for (int r = 0; r < 2; ++r) bf[r] = uint32_t{be[2 * r]} | uint32_t{be[2 * r + 1]} << 16;
  float acc[4];
  for (int i = 0; i < 4; ++i) acc[i] = c[(group + (i >= 2 ? 8 : 0)) * 8 + 2 * tig + (i & 1)];
  cuda::mma_16816<BFloat16>(acc, af, bf[0], bf[1]);
  for (int i = 0; i < 4; ++i) d[(group + (i >= 2 ? 8 : 0)) * 8 + 2 * tig + (i & 1)] = acc[i];
}

// ldmatrix.x4 over a 32-row x 8-word shared tile whose word (r, w) is 100 r + w: lane l names row l
// (offset `misalign` bytes), and receives r[0..3].
__global__ void ldmatrix_rows(uint32_t* out, int misalign) {
  struct alignas(16) Tile {
    uint32_t w[32][8];
  };
  AMP_SHARED(Tile, tile);
  const int lane = static_cast<int>(threadIdx.x);
  for (int w = 0; w < 8; ++w) tile.w[lane][w] = static_cast<uint32_t>(100 * lane + w);
  __syncthreads();
  uint32_t r[4];
  const auto* row = reinterpret_cast<const uint32_t*>(reinterpret_cast<const char*>(&tile.w[lane][4]) + misalign);
  cuda::ldmatrix_x4(r, row);
  for (int i = 0; i < 4; ++i) out[lane * 4 + i] = r[i];
}

// ldmatrix.x4.trans over a 32-row x 8-word shared tile whose 16-bit element (r, e) is 16 r + e: lane
// l names row l from word 4 (elements 8 .. 15), and receives r[0..3].
__global__ void ldmatrix_trans_rows(uint32_t* out) {
  struct alignas(16) Tile {
    uint32_t w[32][8];
  };
  AMP_SHARED(Tile, tile);
  const int lane = static_cast<int>(threadIdx.x);
  for (int w = 0; w < 8; ++w)
    tile.w[lane][w] = static_cast<uint32_t>(16 * lane + 2 * w) | static_cast<uint32_t>(16 * lane + 2 * w + 1) << 16;
  __syncthreads();
  uint32_t r[4];
  cuda::ldmatrix_x4_trans(r, &tile.w[lane][4]);
  for (int i = 0; i < 4; ++i) out[lane * 4 + i] = r[i];
}

// Thread l copies src's words 4 l .. 4 l + 3 into row l of a shared tile by cp.async (thread 0 reads
// nothing: zeros), and src's words 128 + 4 l .. into row l of a second tile in a second group. It
// records its first row's word 0 before any wait (before), both rows' after cp.async.wait_group 1
// (mid: the first group landed, the second not yet), then, after wait_group 0 and a barrier, the
// rows of thread (l + 1) % 32 (after: 8 words). With `forget`, thread 3 never waits: a fault.
__global__ void cp_async_rows(const uint32_t* src, uint32_t* before, uint32_t* mid, uint32_t* after, int forget) {
  struct alignas(16) Tile {
    uint32_t w[2][32][4];
  };
  AMP_SHARED(Tile, tile);
  const int l = static_cast<int>(threadIdx.x);
  cuda::cp_async_16(tile.w[0][l], l == 0 ? src : src + 4 * l, l != 0);
  cuda::cp_async_commit();
  cuda::cp_async_16(tile.w[1][l], src + 128 + 4 * l, true);
  cuda::cp_async_commit();
  before[l] = tile.w[0][l][0];
  if (forget != 0 && l == 3) return;
  cuda::cp_async_wait<1>();
  mid[2 * l] = tile.w[0][l][1];
  mid[2 * l + 1] = tile.w[1][l][1];
  cuda::cp_async_wait<0>();
  __syncthreads();
  for (int i = 0; i < 4; ++i) {
    after[8 * l + i] = tile.w[0][(l + 1) % 32][i];
    after[8 * l + 4 + i] = tile.w[1][(l + 1) % 32][i];
  }
}

// Two warps fill a shared buffer, meet at a barrier, read the other warp's half, then refill their own
// half without a barrier between: a race (on a GPU the other warp may not have read it yet).
__global__ void refill_without_barrier(int* out) {
  AMP_SHARED(int[64], buf);
  const int i = static_cast<int>(threadIdx.x);
  buf[i] = 1;
  __syncthreads();
  out[i] = buf[63 - i];
  buf[i] = 2;
}

// Eight bf16 elements from p as four words (the attention's 16-byte tile load).
__global__ void load_quad_at(const BFloat16* p, uint32_t* out) {
  uint32_t w[4];
  cuda::load_quad(p, w);
  for (int i = 0; i < 4; ++i) out[i] = w[i];
}

// --- helpers

class Emu : public ::testing::Test {
 protected:
  void SetUp() override {
    emu::clear_fault_for_testing();
    (void)cudaGetLastError();
  }
  void TearDown() override {
    emu::set_cp_async_landing_for_testing(emu::CpAsyncLanding::random);
    emu::pause_for_testing(false);
    emu::drain_for_testing();
    emu::clear_fault_for_testing();
    (void)cudaGetLastError();
  }
  template <class T>
  T* device(size_t n) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, n * sizeof(T)), cudaSuccess);
    allocations_.push_back(p);
    return static_cast<T*>(p);
  }
  template <class T>
  std::vector<T> host(const T* d, size_t n) {
    std::vector<T> v(n);
    EXPECT_EQ(cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }
  ~Emu() override {
    for (void* p : allocations_) (void)cudaFree(p);
  }
  std::vector<void*> allocations_;
};

// The fault the last kernel raised, after a synchronisation that must report it.
std::string fault_after_sync() {
  EXPECT_EQ(cudaDeviceSynchronize(), cudaErrorLaunchFailure);
  return emu::last_fault();
}

// --- devices: CUDA_VISIBLE_DEVICES as the driver reads it (issue 42), and each GPU's UUID

TEST(EmuDevices, CudaVisibleDevicesSelectsAndOrdersTheNodesGpus) {
  const char* saved_count = std::getenv("AMP_EMU_DEVICES");
  const char* saved_visible = std::getenv("CUDA_VISIBLE_DEVICES");
  const std::string keep_count = saved_count ? saved_count : "", keep_visible = saved_visible ? saved_visible : "";
  setenv("AMP_EMU_DEVICES", "4", 1);
  auto count = [](const char* visible) {
    if (visible) setenv("CUDA_VISIBLE_DEVICES", visible, 1);
    else unsetenv("CUDA_VISIBLE_DEVICES");
    int n = -1;
    EXPECT_EQ(cudaGetDeviceCount(&n), cudaSuccess);
    return n;
  };
  auto uuid = [](int device) {
    cudaDeviceProp prop{};
    EXPECT_EQ(cudaGetDeviceProperties(&prop, device), cudaSuccess);
    return std::string(prop.uuid.bytes, sizeof prop.uuid.bytes);
  };
  EXPECT_EQ(count(nullptr), 4);
  const std::string gpu2 = uuid(2), gpu0 = uuid(0);
  EXPECT_NE(gpu2, gpu0);
  EXPECT_EQ(count("2"), 1);
  EXPECT_EQ(uuid(0), gpu2) << "device 0 of CUDA_VISIBLE_DEVICES=2 is the node's GPU 2";
  EXPECT_EQ(count("3,0"), 2);
  EXPECT_EQ(uuid(1), gpu0);
  EXPECT_EQ(count("1,7,2"), 1) << "the list ends at the first entry that names no GPU";
  EXPECT_EQ(count("1,1"), 1) << "a GPU listed twice ends the list";
  EXPECT_EQ(count(""), 0);
  EXPECT_EQ(count("GPU-e41a7ed0-0000-4e3a-8c6d-000000000003"), 1);
  EXPECT_EQ(uuid(0), uuid(0));
  EXPECT_EQ(count("GPU-e41a7ed0"), 1) << "a prefix of a UUID names it";
  EXPECT_EQ(count("GPU-ffff"), 0);
  cudaDeviceProp prop{};
  count("0");
  EXPECT_EQ(cudaGetDeviceProperties(&prop, 1), cudaErrorInvalidDevice);
  (void)cudaGetLastError();
  setenv("AMP_EMU_DEVICES", keep_count.c_str(), 1);
  if (!saved_count) unsetenv("AMP_EMU_DEVICES");
  if (saved_visible) setenv("CUDA_VISIBLE_DEVICES", keep_visible.c_str(), 1);
  else unsetenv("CUDA_VISIBLE_DEVICES");
}

// --- the execution model

TEST_F(Emu, BlockReduceSumsEveryThreadsValueForAnyBlockSize) {
  for (int threads : {32, 96, 256, 1024}) {
    const int64_t n = 5000;
    std::vector<double> x(n);
    double want = 0;
    for (int64_t i = 0; i < n; ++i) want += (x[static_cast<size_t>(i)] = static_cast<double>(i % 17) - 3.0);
    double* dx = device<double>(n);
    double* dout = device<double>(1);
    ASSERT_EQ(cudaMemcpy(dx, x.data(), n * sizeof(double), cudaMemcpyHostToDevice), cudaSuccess);
    AMP_LAUNCH(1, threads, 0, nullptr, block_sum<double>)(dx, n, dout);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    EXPECT_EQ(host(dout, 1)[0], want) << threads << " threads";
  }
}

TEST_F(Emu, ShufflesFollowCudaSemantics) {
  int* down = device<int>(64);
  int* xr = device<int>(64);
  int* idx = device<int>(64);
  AMP_LAUNCH(1, 64, 0, nullptr, shuffle_down_and_xor)(down, xr, idx);
  const std::vector<int> d = host(down, 64), x = host(xr, 64), ix = host(idx, 64);
  for (int t = 0; t < 64; ++t) {
    const int lane = t % 32, warp = t / 32 * 32;
    // Past the end of the warp, a lane keeps its own value.
    EXPECT_EQ(d[static_cast<size_t>(t)], (lane + 3 < 32 ? warp + lane + 3 : t) * 10) << t;
    EXPECT_EQ(x[static_cast<size_t>(t)], (warp + (lane ^ 5)) * 10) << t;
    EXPECT_EQ(ix[static_cast<size_t>(t)], (warp + 7) * 10) << t;  // the source lane modulo the warp
  }
}

TEST_F(Emu, GridStrideLoopsIterateOverASmallDevice) {
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  const int64_t n = 100003;
  const unsigned grid = cuda::grid_for(n, sms);
  ASSERT_LT(static_cast<int64_t>(grid) * cuda::kBlock, n) << "the grid covers n in one pass: loops never iterate";
  int* hits = device<int>(n);
  ASSERT_EQ(cudaMemset(hits, 0, n * sizeof(int)), cudaSuccess);
  AMP_LAUNCH(grid, cuda::kBlock, 0, nullptr, count_visits)(hits, n);
  const std::vector<int> h = host(hits, static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(h[static_cast<size_t>(i)], 1) << i;
}

TEST_F(Emu, SharedMemoryIsPoisonedForEveryBlock) {
  float* out = device<float>(64 * 3);
  AMP_LAUNCH(3, 64, 0, nullptr, read_shared_before_writing)(out);
  for (float v : host(out, 64 * 3)) EXPECT_TRUE(std::isnan(v));  // even after an earlier block wrote 1s
}

TEST_F(Emu, NewDeviceMemoryIsNaN) {
  float* p = device<float>(10);
  for (float v : host(p, 10)) EXPECT_TRUE(std::isnan(v));
}

// --- what a GPU would punish

// Threads run in a random order: a value that thread 0 writes to shared memory is not there for the
// others without a barrier (some of them read the poison), and always is with one.
TEST_F(Emu, AMissingBarrierAfterThreadZeroWritesIsVisible) {
  float* out = device<float>(256);
  AMP_LAUNCH(1, 256, 0, nullptr, broadcast_from_thread_zero<false>)(out);
  int poisoned = 0;
  for (float v : host(out, 256)) poisoned += std::isnan(v);
  EXPECT_GT(poisoned, 0) << "every thread saw thread 0's write without a barrier";
  AMP_LAUNCH(1, 256, 0, nullptr, broadcast_from_thread_zero<true>)(out);
  for (float v : host(out, 256)) EXPECT_EQ(v, 7.0f);
}

TEST_F(Emu, ABarrierThatHalfTheBlockSkipsIsAFault) {
  int* out = device<int>(32);
  AMP_LAUNCH(1, 32, 0, nullptr, half_the_block_at_a_barrier)(out);
  const std::string f = fault_after_sync();
  EXPECT_NE(f.find("__syncthreads reached by 16 of 32 threads"), std::string::npos) << f;
  EXPECT_NE(f.find("half_the_block_at_a_barrier"), std::string::npos) << f;
}

TEST_F(Emu, BarriersAtDifferentCallSitesAreAFault) {
  int* out = device<int>(32);
  AMP_LAUNCH(1, 32, 0, nullptr, two_barrier_sites)(out);
  const std::string f = fault_after_sync();
  EXPECT_NE(f.find("different __syncthreads"), std::string::npos) << f;
}

// The tensor-core product against the product written out here: small integers, exact in bf16 and in
// every fp32 partial sum, so any misplaced element shows.
TEST_F(Emu, MmaTakesItsFragmentsAsThePtxIsaLaysThemOut) {
  std::vector<uint16_t> a(16 * 16), b(16 * 8);
  std::vector<float> c(16 * 8);
  auto bf16 = [](int v) { return static_cast<uint16_t>(f32_bits(static_cast<float>(v)) >> 16); };
  for (int i = 0; i < 16; ++i)
    for (int k = 0; k < 16; ++k) a[static_cast<size_t>(i * 16 + k)] = bf16((i * 7 + k * 3) % 11 - 5);
  for (int k = 0; k < 16; ++k)
    for (int j = 0; j < 8; ++j) b[static_cast<size_t>(k * 8 + j)] = bf16((k * 5 + j * 13) % 9 - 4);
  for (int i = 0; i < 16 * 8; ++i) c[static_cast<size_t>(i)] = static_cast<float>(i % 7);
  uint16_t* da = device<uint16_t>(a.size());
  uint16_t* db = device<uint16_t>(b.size());
  float* dc = device<float>(c.size());
  float* dd = device<float>(c.size());
  ASSERT_EQ(cudaMemcpy(da, a.data(), a.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(db, b.data(), b.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dc, c.data(), c.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  AMP_LAUNCH(1, 32, 0, nullptr, mma_whole)(da, db, dc, dd);
  const std::vector<float> d = host(dd, c.size());
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 8; ++j) {
      double want = c[static_cast<size_t>(i * 8 + j)];
      for (int k = 0; k < 16; ++k) want += ((i * 7 + k * 3) % 11 - 5) * ((k * 5 + j * 13) % 9 - 4);
      EXPECT_EQ(d[static_cast<size_t>(i * 8 + j)], want) << "row " << i << " col " << j;
    }
}

TEST_F(Emu, LdmatrixGivesLaneLWordLMod4OfRowLDiv4OfEachMatrix) {
  uint32_t* out = device<uint32_t>(128);
  AMP_LAUNCH(1, 32, 0, nullptr, ldmatrix_rows)(out, 0);
  const std::vector<uint32_t> r = host(out, 128);
  for (int l = 0; l < 32; ++l)
    for (int i = 0; i < 4; ++i)  // matrix i's rows are those lanes 8i .. 8i + 7 named: rows 8i .., words 4 ..
      EXPECT_EQ(r[static_cast<size_t>(l * 4 + i)], static_cast<uint32_t>(100 * (8 * i + l / 4) + 4 + l % 4))
          << "lane " << l << " matrix " << i;
  AMP_LAUNCH(1, 32, 0, nullptr, ldmatrix_rows)(out, 4);  // rows off their 16-byte boundary
  const std::string f = fault_after_sync();
  EXPECT_NE(f.find("not 16-byte aligned"), std::string::npos) << f;
}

// ldmatrix.trans as the PTX ISA gives it: lane l receives, of matrix i (the rows lanes 8i .. 8i + 7
// named), elements (2 (l % 4), l / 4) and (2 (l % 4) + 1, l / 4), the first in the low half.
TEST_F(Emu, LdmatrixTransGivesEachMatrixTransposed) {
  uint32_t* out = device<uint32_t>(128);
  AMP_LAUNCH(1, 32, 0, nullptr, ldmatrix_trans_rows)(out);
  const std::vector<uint32_t> r = host(out, 128);
  for (int l = 0; l < 32; ++l)
    for (int i = 0; i < 4; ++i) {
      const int g = l / 4, t = l % 4;
      auto element = [&](int row) { return static_cast<uint32_t>(16 * (8 * i + row) + 8 + g); };
      EXPECT_EQ(r[static_cast<size_t>(l * 4 + i)], element(2 * t) | element(2 * t + 1) << 16) << "lane " << l << " matrix " << i;
    }
}

// cp.async lands a group's copies at one end of its flight or the other: at its wait, and not before
// (a read that comes too early sees what the shared memory held: the poison), or at its commit (a read
// before the wait sees the copy); either way it zero-fills a copy that reads nothing, and a thread that
// never waits for its copies is a fault.
TEST_F(Emu, CpAsyncLandsAtItsCommitOrAtItsWaitAndNotLater) {
  std::vector<uint32_t> words(256);
  for (size_t i = 0; i < words.size(); ++i) words[i] = static_cast<uint32_t>(1000 + i);
  uint32_t* src = device<uint32_t>(256);
  uint32_t *before = device<uint32_t>(32), *mid = device<uint32_t>(64), *after = device<uint32_t>(256);
  ASSERT_EQ(cudaMemcpy(src, words.data(), 256 * sizeof(uint32_t), cudaMemcpyHostToDevice), cudaSuccess);
  emu::set_cp_async_landing_for_testing(emu::CpAsyncLanding::at_commit);
  AMP_LAUNCH(1, 32, 0, nullptr, cp_async_rows)(src, before, mid, after, 0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint32_t> early = host(before, 32), early_mid = host(mid, 64);
  for (int l = 0; l < 32; ++l) {
    EXPECT_EQ(early[static_cast<size_t>(l)], l == 0 ? 0u : words[static_cast<size_t>(4 * l)]) << "thread " << l;
    EXPECT_EQ(early_mid[static_cast<size_t>(2 * l + 1)], words[static_cast<size_t>(128 + 4 * l + 1)]) << "thread " << l;
  }
  emu::set_cp_async_landing_for_testing(emu::CpAsyncLanding::at_wait);
  AMP_LAUNCH(1, 32, 0, nullptr, cp_async_rows)(src, before, mid, after, 0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint32_t> b = host(before, 32), m = host(mid, 64), a = host(after, 256);
  for (int l = 0; l < 32; ++l) {
    EXPECT_EQ(b[static_cast<size_t>(l)], 0xffffffffu) << "thread " << l << " read its row before the wait";
    EXPECT_EQ(m[static_cast<size_t>(2 * l)], l == 0 ? 0u : words[static_cast<size_t>(4 * l + 1)]) << "thread " << l;
    EXPECT_EQ(m[static_cast<size_t>(2 * l + 1)], 0xffffffffu) << "thread " << l << ": the second group landed early";
    const int n = (l + 1) % 32;
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(a[static_cast<size_t>(8 * l + i)], n == 0 ? 0u : words[static_cast<size_t>(4 * n + i)]);
      EXPECT_EQ(a[static_cast<size_t>(8 * l + 4 + i)], words[static_cast<size_t>(128 + 4 * n + i)]);
    }
  }
  AMP_LAUNCH(1, 32, 0, nullptr, cp_async_rows)(src, before, mid, after, 1);
  const std::string f = fault_after_sync();
  EXPECT_NE(f.find("cp.async copies it never waited for"), std::string::npos) << f;
}

// One warp lags behind the others after each barrier: the race above reads the refilled value in
// exactly that warp, every time (run in turn, some threads would read it and some not, by chance).
TEST_F(Emu, ALaggingWarpReadsWhatTheOthersRefilledWithoutABarrier) {
  int* out = device<int>(64);
  for (int run = 0; run < 8; ++run) {
    AMP_LAUNCH(1, 64, 0, nullptr, refill_without_barrier)(out);
    const std::vector<int> r = host(out, 64);
    int refilled[2] = {0, 0};
    for (int i = 0; i < 64; ++i) refilled[i / 32] += r[static_cast<size_t>(i)] == 2;
    EXPECT_TRUE((refilled[0] == 32 && refilled[1] == 0) || (refilled[0] == 0 && refilled[1] == 32))
        << "run " << run << ": warp 0 read " << refilled[0] << " refilled values, warp 1 " << refilled[1];
  }
}

// The 16-byte load the GPU would fault on off its boundary: the emulated GPU faults too, naming it.
TEST_F(Emu, AMisalignedSixteenByteLoadIsAFault) {
  BFloat16* p = device<BFloat16>(16);
  uint32_t* out = device<uint32_t>(4);
  ASSERT_EQ(cudaMemset(p, 0, 32), cudaSuccess);
  AMP_LAUNCH(1, 1, 0, nullptr, load_quad_at)(p, out);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(host(out, 4), std::vector<uint32_t>(4, 0u));
  AMP_LAUNCH(1, 1, 0, nullptr, load_quad_at)(p + 1, out);
  const std::string f = fault_after_sync();
  EXPECT_NE(f.find("load_quad: the address is not 16-byte aligned"), std::string::npos) << f;
}

// cuBLASLt as the CUDA backend's linear layer calls it (bias epilogue), and what it refuses: the
// heuristic offers no algorithm for a bias type other than D's or an epilogue the emulator lacks; an
// algorithm chosen for 16-byte aligned operands refuses a 4-byte aligned one (a GPU may fault or read
// the wrong elements), as it refuses a bias less aligned than the one it was chosen with; a bias
// outside device memory is refused.
TEST_F(Emu, CublasLtRunsTheBiasEpilogueAndRefusesWhatItWouldNotRun) {
  cublasLtHandle_t lt = nullptr;
  ASSERT_EQ(cublasLtCreate(&lt), CUBLAS_STATUS_SUCCESS);
  const int m = 8, n = 4, k = 16;
  float* a = device<float>(m * k + 4);
  float* b = device<float>(k * n + 4);
  float* d = device<float>(m * n + 4);
  float* bias = device<float>(m);
  std::vector<float> ha(m * k + 4), hb(k * n + 4), hbias(m);
  for (size_t i = 0; i < ha.size(); ++i) ha[i] = static_cast<float>(i % 5) - 2.0f;
  for (size_t i = 0; i < hb.size(); ++i) hb[i] = static_cast<float>(i % 3) - 1.0f;
  for (int i = 0; i < m; ++i) hbias[i] = 100.0f * static_cast<float>(i);
  ASSERT_EQ(cudaMemcpy(a, ha.data(), ha.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(b, hb.data(), hb.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(bias, hbias.data(), hbias.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ASSERT_EQ(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), CUBLAS_STATUS_SUCCESS);
  uint32_t epilogue = CUBLASLT_EPILOGUE_BIAS;
  const void* bias_ptr = bias;
  ASSERT_EQ(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)),
            CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_ptr, sizeof(bias_ptr)),
            CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasLtMatrixLayoutCreate(&la, CUDA_R_32F, m, k, m), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasLtMatrixLayoutCreate(&lb, CUDA_R_32F, k, n, k), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasLtMatrixLayoutCreate(&ld, CUDA_R_32F, m, n, m), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasLtMatmulPreferenceCreate(&pref), CUBLAS_STATUS_SUCCESS);
  const uint32_t sixteen = 16;
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
    ASSERT_EQ(cublasLtMatmulPreferenceSetAttribute(pref, attr, &sixteen, sizeof(sixteen)), CUBLAS_STATUS_SUCCESS);
  cublasLtMatmulHeuristicResult_t r{};
  int found = 0;
  ASSERT_EQ(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, ld, ld, pref, 1, &r, &found), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(found, 1);
  const float alpha = 1.0f, beta = 0.0f;
  ASSERT_EQ(cublasLtMatmul(lt, op, &alpha, a, la, b, lb, &beta, d, ld, d, ld, &r.algo, nullptr, 0, nullptr),
            CUBLAS_STATUS_SUCCESS);
  const std::vector<float> got = host(d, m * n);
  for (int j = 0; j < n; ++j)
    for (int i = 0; i < m; ++i) {
      float want = 0;
      for (int p = 0; p < k; ++p) want += ha[i + p * m] * hb[p + j * k];
      EXPECT_EQ(got[i + j * m], want + hbias[i]) << i << "," << j;
    }
  // A one float (4 bytes) into its allocation: less aligned than the algorithm was chosen for.
  EXPECT_EQ(cublasLtMatmul(lt, op, &alpha, a + 1, la, b, lb, &beta, d, ld, d, ld, &r.algo, nullptr, 0, nullptr),
            CUBLAS_STATUS_NOT_SUPPORTED);
  // A bias one float into its allocation (4-byte aligned): refused by an algorithm chosen for a
  // 256-byte aligned one (cuBLASLt's heuristic reads the bias pointer).
  float* bias_big = device<float>(m + 1);
  const void* shifted = bias_big + 1;
  ASSERT_EQ(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &shifted, sizeof(shifted)),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasLtMatmul(lt, op, &alpha, a, la, b, lb, &beta, d, ld, d, ld, &r.algo, nullptr, 0, nullptr),
            CUBLAS_STATUS_NOT_SUPPORTED);
  alignas(256) float on_host[m] = {};
  const void* host_bias = on_host;
  ASSERT_EQ(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &host_bias, sizeof(host_bias)),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasLtMatmul(lt, op, &alpha, a, la, b, lb, &beta, d, ld, d, ld, &r.algo, nullptr, 0, nullptr),
            CUBLAS_STATUS_INVALID_VALUE);
  const int32_t half_bias = CUDA_R_16BF;
  ASSERT_EQ(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &half_bias, sizeof(half_bias)),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, ld, ld, pref, 1, &r, &found), CUBLAS_STATUS_NOT_SUPPORTED);
  EXPECT_EQ(found, 0);
  epilogue = 2;  // CUBLASLT_EPILOGUE_RELU: not emulated
  ASSERT_EQ(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, ld, ld, pref, 1, &r, &found), CUBLAS_STATUS_NOT_SUPPORTED);
  EXPECT_EQ(cublasLtMatmulPreferenceDestroy(pref), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasLtMatrixLayoutDestroy(la), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasLtMatrixLayoutDestroy(lb), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasLtMatrixLayoutDestroy(ld), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasLtMatmulDescDestroy(op), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasLtDestroy(lt), CUBLAS_STATUS_SUCCESS);
}

// cuBLASLt's GELU epilogues as the CUDA backend's MLP calls them: GELU_AUX_BIAS writes the fp32 sum
// plus bias to aux and D = gelu(that), the tanh form; DGELU reads aux and D = sum * gelu'(aux).
// Against the tanh GELU and its slope written out here in double (the sums, in float in one order,
// are exact here: small integers). An aux leading dimension that is not a multiple of 8 is refused,
// as is an aux less aligned than the algorithm was chosen for.
TEST_F(Emu, CublasLtRunsTheGeluEpilogues) {
  cublasLtHandle_t lt = nullptr;
  ASSERT_EQ(cublasLtCreate(&lt), CUBLAS_STATUS_SUCCESS);
  const int m = 16, n = 5, k = 7;
  float* a = device<float>(m * k);
  float* b = device<float>(k * n);
  float* d = device<float>(m * n);
  float* aux = device<float>(m * n + 4);
  float* bias = device<float>(m);
  std::vector<float> ha(m * k), hb(k * n), hbias(m);
  for (size_t i = 0; i < ha.size(); ++i) ha[i] = static_cast<float>(i % 5) - 2.0f;
  for (size_t i = 0; i < hb.size(); ++i) hb[i] = static_cast<float>(i % 3) - 1.0f;
  for (int i = 0; i < m; ++i) hbias[i] = 0.25f * static_cast<float>(i - 8);
  ASSERT_EQ(cudaMemcpy(a, ha.data(), ha.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(b, hb.data(), hb.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(bias, hbias.data(), hbias.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  const auto gelu = [](double x) { return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x))); };
  const auto slope = [&](double x) { return (gelu(x + 1e-6) - gelu(x - 1e-6)) / 2e-6; };  // another route to it
  const auto sum = [&](int i, int j) {
    double s = 0;
    for (int p = 0; p < k; ++p) s += ha[i + p * m] * hb[p + j * k];
    return s;
  };
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ASSERT_EQ(cublasLtMatrixLayoutCreate(&la, CUDA_R_32F, m, k, m), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasLtMatrixLayoutCreate(&lb, CUDA_R_32F, k, n, k), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasLtMatrixLayoutCreate(&ld, CUDA_R_32F, m, n, m), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasLtMatmulPreferenceCreate(&pref), CUBLAS_STATUS_SUCCESS);
  const float alpha = 1.0f, beta = 0.0f;
  for (const uint32_t epilogue : {uint32_t{CUBLASLT_EPILOGUE_GELU_AUX_BIAS}, uint32_t{CUBLASLT_EPILOGUE_DGELU}}) {
    const bool forward = epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    cublasLtMatmulDesc_t op = nullptr;
    ASSERT_EQ(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), CUBLAS_STATUS_SUCCESS);
    const void* bias_ptr = bias;
    void* aux_ptr = aux;
    int64_t aux_ld = 12;  // not a multiple of 8
    ASSERT_EQ(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)),
              CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_ptr, sizeof(bias_ptr)),
              CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux_ptr, sizeof(aux_ptr)),
              CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld)),
              CUBLAS_STATUS_SUCCESS);
    cublasLtMatmulHeuristicResult_t r{};
    int found = 0;
    EXPECT_EQ(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, ld, ld, pref, 1, &r, &found), CUBLAS_STATUS_INVALID_VALUE);
    aux_ld = m;
    ASSERT_EQ(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld)),
              CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, ld, ld, pref, 1, &r, &found), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(found, 1);
    if (!forward) {  // aux: the GELU's inputs, as a forward would have left them
      std::vector<float> pre(m * n);
      for (size_t i = 0; i < pre.size(); ++i) pre[i] = 0.37f * static_cast<float>(static_cast<int>(i % 23) - 11);
      ASSERT_EQ(cudaMemcpy(aux, pre.data(), pre.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    }
    const std::vector<float> aux_before = host(aux, m * n);
    ASSERT_EQ(cublasLtMatmul(lt, op, &alpha, a, la, b, lb, &beta, d, ld, d, ld, &r.algo, nullptr, 0, nullptr),
              CUBLAS_STATUS_SUCCESS);
    const std::vector<float> got = host(d, m * n), got_aux = host(aux, m * n);
    for (int j = 0; j < n; ++j)
      for (int i = 0; i < m; ++i) {
        const int at = i + j * m;
        if (forward) {
          const double pre = sum(i, j) + hbias[i];
          EXPECT_EQ(got_aux[at], static_cast<float>(pre)) << i << "," << j;
          EXPECT_NEAR(got[at], gelu(pre), 1e-6 * (1.0 + std::fabs(pre))) << i << "," << j;
        } else {
          EXPECT_EQ(got_aux[at], aux_before[at]) << "aux is read, not written";
          EXPECT_NEAR(got[at], sum(i, j) * slope(aux_before[at]), 1e-5 * (1.0 + std::fabs(sum(i, j)))) << i << "," << j;
        }
      }
    // An aux one float into its allocation: less aligned than the algorithm was chosen for.
    void* shifted = aux + 1;
    ASSERT_EQ(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &shifted, sizeof(shifted)),
              CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cublasLtMatmul(lt, op, &alpha, a, la, b, lb, &beta, d, ld, d, ld, &r.algo, nullptr, 0, nullptr),
              CUBLAS_STATUS_NOT_SUPPORTED);
    EXPECT_EQ(cublasLtMatmulDescDestroy(op), CUBLAS_STATUS_SUCCESS);
  }
  EXPECT_EQ(cublasLtMatmulPreferenceDestroy(pref), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasLtMatrixLayoutDestroy(la), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasLtMatrixLayoutDestroy(lb), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasLtMatrixLayoutDestroy(ld), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasLtDestroy(lt), CUBLAS_STATUS_SUCCESS);
}

TEST_F(Emu, AShuffleWaitingForLanesThatLeftIsAFault) {
  float* out = device<float>(32);
  AMP_LAUNCH(1, 32, 0, nullptr, shuffle_after_half_the_warp_left)(out);
  const std::string f = fault_after_sync();
  EXPECT_NE(f.find("waits for lane 16, which has finished"), std::string::npos) << f;
}

TEST_F(Emu, AFullMaskInAPartialWarpIsAFault) {
  float* out = device<float>(16);
  AMP_LAUNCH(1, 16, 0, nullptr, full_mask_in_a_partial_warp)(out);
  const std::string f = fault_after_sync();
  EXPECT_NE(f.find("mask names lanes past the block's last thread"), std::string::npos) << f;
}

TEST_F(Emu, AHostPointerHandedToAKernelIsAFault) {
  float on_host = 0;
  AMP_LAUNCH(1, 1, 0, nullptr, set_to)(&on_host, 1.0f);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaErrorIllegalAddress);
  EXPECT_NE(emu::last_fault().find("neither device nor pinned memory"), std::string::npos) << emu::last_fault();
  EXPECT_EQ(on_host, 0.0f);
}

TEST_F(Emu, AnExceptionInAKernelIsAFaultAndFaultsAreSticky) {
  int* p = device<int>(1);
  AMP_LAUNCH(1, 32, 0, nullptr, throwing_kernel)(p);
  EXPECT_NE(fault_after_sync().find("thread 5 gave up"), std::string::npos);
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure);  // sticky: not cleared by reading it
  EXPECT_EQ(cudaMemsetAsync(p, 0, 4, nullptr), cudaErrorLaunchFailure);
}

TEST_F(Emu, BadLaunchConfigurationsFailAtTheCallSite) {
  int* out = device<int>(32);
  AMP_LAUNCH(1, 2048, 0, nullptr, half_the_block_at_a_barrier)(out);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  AMP_LAUNCH(0, 32, 0, nullptr, half_the_block_at_a_barrier)(out);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // reading the slot clears it
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// --- asynchrony

TEST_F(Emu, NothingRunsWhenEnqueuedAndNotReadyLandsInTheLastErrorSlot) {
  float* d = device<float>(1);
  float* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, sizeof(float)), cudaSuccess);
  pinned[0] = -1.0f;
  cudaStream_t s;
  cudaEvent_t e;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), cudaSuccess);
  emu::pause_for_testing(true);
  AMP_LAUNCH(1, 1, 0, s, set_to)(d, 42.0f);
  ASSERT_EQ(cudaMemcpyAsync(pinned, d, sizeof(float), cudaMemcpyDeviceToHost, s), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(e, s), cudaSuccess);
  // The copy has not happened, and the old contents are gone: a host that reads before the event
  // sees NaN, not a stale value that looks right.
  EXPECT_TRUE(std::isnan(pinned[0])) << pinned[0];
  EXPECT_EQ(cudaEventQuery(e), cudaErrorNotReady);
  EXPECT_EQ(cudaGetLastError(), cudaErrorNotReady);  // as on a real device: clear it, or the next check throws
  emu::pause_for_testing(false);
  ASSERT_EQ(cudaEventSynchronize(e), cudaSuccess);
  EXPECT_EQ(pinned[0], 42.0f);
  EXPECT_EQ(cudaEventQuery(e), cudaSuccess);
  (void)cudaEventDestroy(e);
  (void)cudaStreamDestroy(s);
  (void)cudaFreeHost(pinned);
}

// Two streams: a producer and a consumer. Without an event between them the consumer sometimes
// runs first; with one it never does.
TEST_F(Emu, AMissingEventBetweenStreamsChangesTheResult) {
  float* x = device<float>(1);
  float* y = device<float>(1);
  cudaStream_t a, b;
  cudaEvent_t e;
  ASSERT_EQ(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), cudaSuccess);
  for (bool with_event : {false, true}) {
    int stale = 0;
    for (int trial = 0; trial < 40; ++trial) {
      AMP_LAUNCH(1, 1, 0, a, set_to)(x, 0.0f);
      AMP_LAUNCH(1, 1, 0, a, set_to)(y, 0.0f);
      ASSERT_EQ(cudaStreamSynchronize(a), cudaSuccess);
      emu::pause_for_testing(true);  // both streams' heads become ready together
      AMP_LAUNCH(1, 1, 0, a, set_to)(x, static_cast<float>(trial + 1));
      ASSERT_EQ(cudaEventRecord(e, a), cudaSuccess);
      if (with_event) {
        ASSERT_EQ(cudaStreamWaitEvent(b, e, 0), cudaSuccess);
      }
      AMP_LAUNCH(1, 1, 0, b, copy_first)(x, y);
      emu::pause_for_testing(false);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      stale += host(y, 1)[0] != static_cast<float>(trial + 1);
    }
    if (with_event) EXPECT_EQ(stale, 0);
    else EXPECT_GT(stale, 0) << "the consumer never overtook the producer: stream order is not adversarial";
  }
  (void)cudaEventDestroy(e);
  (void)cudaStreamDestroy(a);
  (void)cudaStreamDestroy(b);
}

TEST_F(Emu, CountersSeeLaunchesHostSyncsAndDeviceToHostCopies) {
  float* d = device<float>(1);
  float* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, sizeof(float)), cudaSuccess);
  const emu::Counters before = emu::counters();
  AMP_LAUNCH(1, 1, 0, nullptr, set_to)(d, 1.0f);
  AMP_LAUNCH(1, 1, 0, nullptr, set_to)(d, 2.0f);
  ASSERT_EQ(cudaMemcpyAsync(pinned, d, sizeof(float), cudaMemcpyDeviceToHost, nullptr), cudaSuccess);  // no wait
  const emu::Counters mid = emu::counters();
  EXPECT_EQ(mid.launches - before.launches, 2);
  EXPECT_EQ(mid.host_syncs - before.host_syncs, 0);
  EXPECT_EQ(mid.d2h_copies - before.d2h_copies, 1);
  float pageable = 0;
  ASSERT_EQ(cudaMemcpyAsync(&pageable, d, sizeof(float), cudaMemcpyDeviceToHost, nullptr), cudaSuccess);
  EXPECT_EQ(pageable, 2.0f);  // into pageable memory the copy makes the host wait
  const emu::Counters after = emu::counters();
  EXPECT_EQ(after.host_syncs - mid.host_syncs, 1);
  EXPECT_EQ(after.d2h_copies - mid.d2h_copies, 1);
  (void)cudaFreeHost(pinned);
}

}  // namespace
}  // namespace amp
