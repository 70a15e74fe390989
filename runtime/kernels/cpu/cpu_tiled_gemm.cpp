#include "runtime/kernels/cpu/cpu_tiled_gemm.h"

#include <omp.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <dnnl.h>
#include <dnnl.hpp>
#include <exception>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "runtime/core/dtype.h"

namespace amp::cpu {

namespace {
// The plan's constants. A tile of 256 rows or columns runs oneDNN's single-threaded kernels at their
// speed (packing a and b costs 1/128 of the products); 8 pieces keep 8 threads busy; a piece of fewer
// than 2^18 multiply-adds (about 5 us on one core) is not cut further, nor a tile under 32; a chunk
// of k shorter than 256 would make the partial sums' extra pass cost more than it saves. Small
// products of a batch go several to a piece, up to 2^20 multiply-adds.
constexpr int64_t kTile = 256;
constexpr int64_t kMinTile = 32;
constexpr int64_t kMinPieces = 8;
constexpr int64_t kMinPieceWork = int64_t{1} << 18;
constexpr int64_t kBatchPieceWork = int64_t{1} << 20;
constexpr int64_t kMinChunk = 256;
constexpr int64_t kChunkAlign = 64;
constexpr int64_t kMaxPartials = int64_t{1} << 24;  // floats of partial sums (64 MiB) at most

bool f32_through_primitives = false;  // use_primitives_for_f32

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

using dt = dnnl::memory::data_type;
dt dnnl_type(GemmType t) { return t == GemmType::f32 ? dt::f32 : dt::bf16; }
int64_t bytes_of(GemmType t) { return t == GemmType::f32 ? 4 : 2; }

float load(GemmType t, const void* p, int64_t i) {
  return t == GemmType::f32 ? static_cast<const float*>(p)[i] : Elem<BFloat16>::load(static_cast<const BFloat16*>(p)[i]);
}
void store(GemmType t, void* p, int64_t i, float v) {
  if (t == GemmType::f32) static_cast<float*>(p)[i] = v;
  else static_cast<BFloat16*>(p)[i] = Elem<BFloat16>::store(v);
}

// The calling thread's OpenMP thread count set to 1 for a scope: oneDNN chooses its split by that
// count when it creates a primitive, and when it runs one outside a parallel region.
class OneThread {
 public:
  OneThread() : was_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~OneThread() { omp_set_num_threads(was_); }
  OneThread(const OneThread&) = delete;
  OneThread& operator=(const OneThread&) = delete;

 private:
  int was_;
};

// One piece's primitive: g products of m x n x k, tiles of operands whose matrices are M x N x K.
struct PieceKey {
  dt in, out, bias;
  bool ta, tb;
  int64_t g, m, n, k, M, N, K;
  float alpha, beta;
  bool operator<(const PieceKey& o) const {
    return std::tie(in, out, bias, ta, tb, g, m, n, k, M, N, K, alpha, beta) <
           std::tie(o.in, o.out, o.bias, o.ta, o.tb, o.g, o.m, o.n, o.k, o.M, o.N, o.K, o.alpha, o.beta);
  }
};
struct Piece {
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul prim;
};

// Primitives are costly to create: one per piece's shape, created for one thread and cached for the
// life of the process. Their scratchpads are the caller's (each thread its own), so that several
// threads may run one primitive at once.
class Primitives {
 public:
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  std::mutex mutex;             // held for a whole product (the cache, the partial sums)
  std::vector<float> partials;  // [ks][batch][M][N] where k is cut

  const Piece& get(const PieceKey& key) {
    if (auto it = cache_.find(key); it != cache_.end()) return it->second;
    const OneThread one;
    // [rows, cols] inside a row-major matrix (its rows row_stride apart; transposed: its columns),
    // g of them matrix_stride apart.
    auto desc = [g = key.g](int64_t rows, int64_t cols, int64_t row_stride, int64_t col_stride, int64_t matrix_stride,
                            dt type) {
      if (g == 1) return dnnl::memory::desc({rows, cols}, type, dnnl::memory::dims{row_stride, col_stride});
      return dnnl::memory::desc({g, rows, cols}, type, dnnl::memory::dims{matrix_stride, row_stride, col_stride});
    };
    const int64_t lda = key.ta ? key.M : key.K, ldb = key.tb ? key.K : key.N;
    const auto a = key.ta ? desc(key.m, key.k, 1, lda, key.M * key.K, key.in)
                          : desc(key.m, key.k, lda, 1, key.M * key.K, key.in);
    const auto b = key.tb ? desc(key.k, key.n, 1, ldb, key.K * key.N, key.in)
                          : desc(key.k, key.n, ldb, 1, key.K * key.N, key.in);
    const auto c = desc(key.m, key.n, key.N, 1, key.M * key.N, key.out);
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    if (key.alpha != 1.0f) attr.set_output_scales(0, {key.alpha});
    if (key.beta != 0.0f) {
      dnnl::post_ops ops;
      ops.append_sum(key.beta);
      attr.set_post_ops(ops);
    }
    const dnnl::matmul::desc d =
        key.bias == dt::undef ? dnnl::matmul::desc(a, b, c)
                              : dnnl::matmul::desc(a, b, desc(1, key.n, key.n, 1, key.n, key.bias), c);
    const dnnl::matmul::primitive_desc pd(d, attr, engine);
    return cache_.emplace(key, Piece{pd, dnnl::matmul(pd)}).first->second;
  }

  bool has_bf16() {
    std::lock_guard<std::mutex> lock(mutex);
    if (bf16_ < 0) {
      try {
        get({dt::bf16, dt::bf16, dt::undef, false, false, 1, 16, 16, 16, 16, 16, 16, 1.0f, 0.0f});
        bf16_ = 1;
      } catch (const dnnl::error&) {
        bf16_ = 0;  // oneDNN's bf16 kernels need AVX-512 (avx512_core)
      }
    }
    return bf16_ == 1;
  }

 private:
  std::map<PieceKey, Piece> cache_;
  int bf16_ = -1;
};

Primitives& primitives() {
  static Primitives p;
  return p;
}

// c's rows (rows x n) from ks partial sums [ks][rows][n]: added in chunk order, then stored as one
// sum would be: alpha sum + beta c + bias, rounded once into T.
template <class T>
void add_partials(const float* part, int64_t ks, int64_t rows, int64_t n, float alpha, float beta, T* c,
                  const float* bias) {
  const int64_t stride = rows * n;
#pragma omp parallel if (stride * ks > 1 << 15)
  {
    std::vector<float> sum(static_cast<size_t>(n));
    float* acc = sum.data();
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const float* pr = part + r * n;
      for (int64_t j = 0; j < n; ++j) acc[j] = pr[j];
      for (int64_t s = 1; s < ks; ++s)
        for (int64_t j = 0; j < n; ++j) acc[j] += pr[s * stride + j];
      T* cr = c + r * n;
      for (int64_t j = 0; j < n; ++j) acc[j] *= alpha;
      if (beta != 0.0f)
        for (int64_t j = 0; j < n; ++j) acc[j] += beta * Elem<T>::load(cr[j]);
      if (bias)
        for (int64_t j = 0; j < n; ++j) acc[j] += bias[j];
      for (int64_t j = 0; j < n; ++j) cr[j] = Elem<T>::store(acc[j]);
    }
  }
}

// An fp32 piece through oneDNN's sgemm, which runs on its calling thread inside a parallel region (a
// primitive costs more a call: 1.3x on 4 tiles of 256 x 512 x 128): g products of tm x tn x kc,
// the next one batch_c, batch_a and batch_b elements further; then the bias, as oneDNN's epilogue
// adds it to the fp32 sums.
void sgemm_piece(bool ta, bool tb, int64_t g, int64_t tm, int64_t tn, int64_t kc, int64_t batch_c, int64_t batch_a,
                 int64_t batch_b, float alpha, const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
                 float* c, int64_t ldc, const float* bias) {
  for (int64_t e = 0; e < g; ++e) {
    float* ce = c + e * batch_c;
    const dnnl_status_t status = dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', tm, tn, kc, alpha, a + e * batch_a, lda,
                                            b + e * batch_b, ldb, beta, ce, ldc);
    if (status != dnnl_success) throw std::runtime_error("oneDNN's sgemm failed (status " + std::to_string(status) + ")");
    if (bias)
      for (int64_t i = 0; i < tm; ++i)
        for (int64_t j = 0; j < tn; ++j) ce[i * ldc + j] += bias[j];
  }
}

// Runs a piece on the calling thread, its memory objects made once a thread (they only point).
void run(const Piece& piece, const void* a, const void* b, void* c, const void* bias) {
  const dnnl::engine& engine = primitives().engine;
  thread_local dnnl::stream stream(engine);
  thread_local std::vector<std::byte> scratchpad;
  thread_local std::map<const Piece*, std::unordered_map<int, dnnl::memory>> bound;
  const dnnl::memory::desc pad = piece.pd.scratchpad_desc();
  if (scratchpad.size() < pad.get_size()) scratchpad.resize(pad.get_size());
  auto [it, fresh] = bound.try_emplace(&piece);
  std::unordered_map<int, dnnl::memory>& args = it->second;
  if (fresh) {
    args = {{DNNL_ARG_SRC, {piece.pd.src_desc(), engine, DNNL_MEMORY_NONE}},
            {DNNL_ARG_WEIGHTS, {piece.pd.weights_desc(), engine, DNNL_MEMORY_NONE}},
            {DNNL_ARG_DST, {piece.pd.dst_desc(), engine, DNNL_MEMORY_NONE}},
            {DNNL_ARG_SCRATCHPAD, {pad, engine, DNNL_MEMORY_NONE}}};
    if (piece.pd.bias_desc().get_size() > 0) args.insert({DNNL_ARG_BIAS, {piece.pd.bias_desc(), engine, DNNL_MEMORY_NONE}});
  }
  args[DNNL_ARG_SRC].set_data_handle(const_cast<void*>(a));
  args[DNNL_ARG_WEIGHTS].set_data_handle(const_cast<void*>(b));
  args[DNNL_ARG_DST].set_data_handle(c);
  args[DNNL_ARG_SCRATCHPAD].set_data_handle(scratchpad.data());
  if (bias) args[DNNL_ARG_BIAS].set_data_handle(const_cast<void*>(bias));
  piece.prim.execute(stream, args);
  stream.wait();
}
}  // namespace

GemmPlan gemm_plan(bool trans_a, bool trans_b, int64_t batch, int64_t m, int64_t n, int64_t k) {
  // Tiles cut c first where the operands' rows stay whole: into rows where a is not transposed, into
  // columns where b is. oneDNN packs a block of some columns of a large row-major matrix at a
  // fraction of its speed (256 of a transposed a's 1024 columns: 2.3x slower).
  GemmPlan p{trans_a ? m : std::min(m, kTile), trans_b ? std::min(n, kTile) : n, k, 1, 1};
  if (batch <= 0 || m <= 0 || n <= 0) return p;
  const int64_t kk = std::max<int64_t>(k, 1);
  auto pieces = [&] { return ceil_div(batch, p.bg) * ceil_div(m, p.tm) * ceil_div(n, p.tn) * p.ks; };
  auto work = [&] { return p.tm * p.tn * (p.ks > 1 ? p.kc : kk); };
  if (pieces() == batch && batch > 1)
    p.bg = std::max<int64_t>(1, std::min(kBatchPieceWork / work(), batch / kMinPieces));
  // Halves the tile along m or n (the larger of those allowed) while pieces are too few and big.
  auto halve = [&](bool along_m, bool along_n) {
    while (pieces() < kMinPieces && work() / 2 >= kMinPieceWork) {
      const bool m_ok = along_m && p.tm > kMinTile, n_ok = along_n && p.tn > kMinTile;
      if (!m_ok && !n_ok) return;
      int64_t& t = m_ok && (!n_ok || p.tm >= p.tn) ? p.tm : p.tn;
      t = std::max(kMinTile, ceil_div(ceil_div(t, 2), 8) * 8);
    }
  };
  halve(!trans_a, trans_b);
  // Then k in chunks, each chunk's products summed apart and the sums added in chunk order.
  if (pieces() < kMinPieces && k >= 2 * kMinChunk) {
    int64_t ks = std::min(ceil_div(kMinPieces, pieces()), k / kMinChunk);
    ks = std::min(ks, std::max<int64_t>(1, kMaxPartials / (batch * m * n)));
    if (ks >= 2) {
      p.kc = ceil_div(ceil_div(k, ks), kChunkAlign) * kChunkAlign;
      p.ks = ceil_div(k, p.kc);
    }
  }
  // Then across the operands' rows (small products, whose operands sit in the caches).
  halve(true, true);
  return p;
}

void use_primitives_for_f32(bool on) { f32_through_primitives = on; }

bool has_bf16_gemm() { return primitives().has_bf16(); }

void tiled_gemm(GemmType in, GemmType out, bool trans_a, bool trans_b, int64_t batch, int64_t m, int64_t n, int64_t k,
                float alpha, const void* a, const void* b, float beta, void* c, const void* bias) {
  if (bias && (beta != 0.0f || alpha != 1.0f || batch != 1))
    throw std::invalid_argument("tiled_gemm: a bias needs alpha = 1, beta = 0 and one product");
  if (in == GemmType::f32 && out != GemmType::f32) throw std::invalid_argument("tiled_gemm: fp32 inputs give fp32");
  if (batch <= 0 || m <= 0 || n <= 0) return;
  const int64_t mn = m * n;
  if (k <= 0) {  // no products: c = beta c + bias (oneDNN is never handed a zero dimension)
    for (int64_t e = 0; e < batch * mn; ++e)
      store(out, c, e, (beta == 0.0f ? 0.0f : beta * load(out, c, e)) + (bias ? load(in, bias, e % n) : 0.0f));
    return;
  }
  Primitives& prims = primitives();
  std::lock_guard<std::mutex> lock(prims.mutex);
  const GemmPlan p = gemm_plan(trans_a, trans_b, batch, m, n, k);
  const int64_t groups = ceil_div(batch, p.bg), mt = ceil_div(m, p.tm), nt = ceil_div(n, p.tn);
  const int64_t pieces = groups * mt * nt * p.ks, lda = trans_a ? m : k, ldb = trans_b ? k : n;
  // Where k is cut, each chunk's products go to its own fp32 partial sums, and alpha, beta and the
  // bias are applied when they are added.
  const bool split = p.ks > 1;
  if (split && prims.partials.size() < static_cast<size_t>(p.ks * batch * mn))
    prims.partials.resize(static_cast<size_t>(p.ks * batch * mn));
  const GemmType piece_out = split ? GemmType::f32 : out;
  // The pieces' primitives, by whether the piece is the last of its batch, in m, in n, in k (the
  // short ones).
  std::array<const Piece*, 16> table{};
  const bool primitive_pieces = in != GemmType::f32 || f32_through_primitives;
  for (int last = 0; primitive_pieces && last < 16; ++last) {
    const int64_t g = (last & 8) ? batch - (groups - 1) * p.bg : p.bg;
    const int64_t tm = (last & 4) ? m - (mt - 1) * p.tm : p.tm, tn = (last & 2) ? n - (nt - 1) * p.tn : p.tn;
    const int64_t kc = (last & 1) ? k - (p.ks - 1) * p.kc : p.kc;
    table[static_cast<size_t>(last)] =
        &prims.get({dnnl_type(in), dnnl_type(piece_out), bias && !split ? dnnl_type(in) : dt::undef, trans_a, trans_b, g,
                    tm, tn, kc, m, n, k, split ? 1.0f : alpha, split ? 0.0f : beta});
  }
  const int64_t ein = bytes_of(in), eout = bytes_of(piece_out);
  auto piece = [&](int64_t q) {
    const int64_t s = q % p.ks, t = q / p.ks, gi = t / (mt * nt), ti = t % (mt * nt) / nt, tj = t % nt;
    const int64_t b0 = gi * p.bg, i0 = ti * p.tm, j0 = tj * p.tn, p0 = s * p.kc;
    const auto* ap = static_cast<const char*>(a) + (b0 * m * k + (trans_a ? p0 * lda + i0 : i0 * lda + p0)) * ein;
    const auto* bp = static_cast<const char*>(b) + (b0 * k * n + (trans_b ? j0 * ldb + p0 : p0 * ldb + j0)) * ein;
    void* cp = split ? static_cast<void*>(prims.partials.data() + (s * batch + b0) * mn + i0 * n + j0)
                     : static_cast<void*>(static_cast<char*>(c) + (b0 * mn + i0 * n + j0) * eout);
    const int last = (gi == groups - 1) * 8 + (ti == mt - 1) * 4 + (tj == nt - 1) * 2 + (s == p.ks - 1);
    const int64_t g = std::min(p.bg, batch - b0), tm = std::min(p.tm, m - i0), tn = std::min(p.tn, n - j0);
    const int64_t kc = std::min(p.kc, k - p0);
    const void* piece_bias = bias && !split ? static_cast<const char*>(bias) + j0 * ein : nullptr;
    if (in == GemmType::f32 && !f32_through_primitives)
      return sgemm_piece(trans_a, trans_b, g, tm, tn, kc, mn, m * k, k * n, split ? 1.0f : alpha,
                         static_cast<const float*>(static_cast<const void*>(ap)), lda,
                         static_cast<const float*>(static_cast<const void*>(bp)), ldb, split ? 0.0f : beta,
                         static_cast<float*>(cp), n, static_cast<const float*>(piece_bias));
    run(*table[static_cast<size_t>(last)], ap, bp, cp, piece_bias);
  };
  if (pieces == 1) {
    const OneThread one;
    piece(0);
  } else {
    std::exception_ptr error;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t q = 0; q < pieces; ++q) {
      try {
        // A team of one thread (OMP_DYNAMIC may give one) is no parallel region to oneDNN, which
        // would spread the piece over the threads again.
        const OneThread one;
        piece(q);
      } catch (...) {
#pragma omp critical(amp_tiled_gemm)
        if (!error) error = std::current_exception();
      }
    }
    if (error) std::rethrow_exception(error);
  }
  if (!split) return;
  std::vector<float> wide_bias(bias ? static_cast<size_t>(n) : 0);
  for (int64_t j = 0; bias && j < n; ++j) wide_bias[static_cast<size_t>(j)] = load(in, bias, j);
  if (out == GemmType::f32)
    add_partials(prims.partials.data(), p.ks, batch * m, n, alpha, beta, static_cast<float*>(c), bias ? wide_bias.data() : nullptr);
  else
    add_partials(prims.partials.data(), p.ks, batch * m, n, alpha, beta, static_cast<BFloat16*>(c), bias ? wide_bias.data() : nullptr);
}

}  // namespace amp::cpu
