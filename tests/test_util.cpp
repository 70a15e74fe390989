#include <gtest/gtest.h>

#include "test_util.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <iterator>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "models/mlp.h"
#include "runtime/ops/autograd.h"
#include "runtime/kernels/backend.h"
#include "runtime/nn/state_dict.h"
#include "runtime/ops/ops.h"
#include "runtime/ops/random.h"

namespace amp::test {

int64_t count_representable(const Tensor& t, int mantissa_bits) {
  int64_t n = 0;
  for (double v : t.to_vector()) {
    const float f = static_cast<float>(v);
    uint32_t bits = 0;
    std::memcpy(&bits, &f, sizeof bits);
    n += (bits & ((1u << (23 - mantissa_bits)) - 1)) == 0;
  }
  return n;
}

// AMP_TEST_DATA_DIR in the environment: the fixtures where they travelled (the GPU bundle's tests/data).
std::string data_path(const std::string& file) {
  const char* dir = std::getenv("AMP_TEST_DATA_DIR");
  return std::string(dir && *dir ? dir : AMP_TEST_DATA_DIR) + "/" + file;
}

const safetensors::NamedTensors& fixture(const std::string& file) {
  // The cache's tensors are freed through the CPU backend at exit: the backend (a function-local
  // static) must be constructed first, so that it is destroyed after the cache.
  static Backend& cpu = backend_for(kCPU);
  (void)cpu;
  static std::map<std::string, safetensors::NamedTensors> cache;
  auto it = cache.find(file);
  if (it == cache.end()) it = cache.emplace(file, safetensors::load(data_path(file))).first;
  return it->second;
}

Tensor fixture_tensor(const std::string& file, const std::string& name) {
  return safetensors::find(fixture(file), name, file);
}

std::shared_ptr<nn::Sequential> fixture_mlp() {
  const std::string f = "mlp_pytorch.safetensors";
  Generator gen(0);
  auto mlp = models::make_mlp({16, 16, 16, 3}, gen);
  safetensors::NamedTensors init;
  for (auto& [name, p] : mlp->named_parameters()) init.emplace_back(name, fixture_tensor(f, name));
  nn::load_state_dict(*mlp, init, f);
  return mlp;
}

double closeness(const Tensor& a, const Tensor& b, double rtol, double atol) {
  const auto va = a.to_vector(), vb = b.to_vector();
  if (va.size() != vb.size()) return INFINITY;
  double worst = 0.0;
  for (size_t i = 0; i < va.size(); ++i) {
    if (!std::isfinite(va[i]) || !std::isfinite(vb[i])) {
      if (!(va[i] == vb[i] || (std::isnan(va[i]) && std::isnan(vb[i])))) return INFINITY;
      continue;
    }
    worst = std::max(worst, std::fabs(va[i] - vb[i]) / (atol + rtol * std::fabs(vb[i])));
  }
  return worst;
}

::testing::AssertionResult all_close(const Tensor& a, const Tensor& b, double rtol, double atol) {
  if (a.numel() != b.numel())
    return ::testing::AssertionFailure() << "shapes differ: " << shape_str(a.shape()) << " vs " << shape_str(b.shape());
  const double c = closeness(a, b, rtol, atol);
  if (c <= 1.0) return ::testing::AssertionSuccess();
  const auto va = a.to_vector(), vb = b.to_vector();
  size_t worst_i = 0;
  double worst = -1;
  for (size_t i = 0; i < va.size(); ++i) {
    const double e = std::fabs(va[i] - vb[i]) / (atol + rtol * std::fabs(vb[i]));
    if (!(e <= worst)) { worst = e; worst_i = i; }
  }
  return ::testing::AssertionFailure() << "not close (rtol " << rtol << ", atol " << atol << "): worst at element "
                                       << worst_i << ": " << va[worst_i] << " vs " << vb[worst_i];
}

::testing::AssertionResult bitwise_equal(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) return ::testing::AssertionFailure() << "dtype or shape differ";
  const Tensor ha = a.to(kCPU), hb = b.to(kCPU);
  if (ha.nbytes() != 0 && std::memcmp(ha.data_ptr(), hb.data_ptr(), ha.nbytes()) != 0) return ::testing::AssertionFailure() << "bits differ";
  return ::testing::AssertionSuccess();
}

namespace {

double weighted_sum(const Tensor& out, const Tensor& w) {
  NoGradGuard ng;
  return sum(mul(out, w)).item();
}

// d(scalar(x))/dx by central differences, perturbing each element of each input in place.
std::vector<std::vector<double>> numeric_grad(const std::function<double()>& scalar, std::vector<Tensor>& inputs,
                                              double eps) {
  std::vector<std::vector<double>> out;
  for (Tensor& x : inputs) {
    std::vector<double> g(static_cast<size_t>(x.numel()));
    double* d = x.data<double>();
    for (size_t j = 0; j < g.size(); ++j) {
      const double orig = d[j];
      d[j] = orig + eps;
      const double plus = scalar();
      d[j] = orig - eps;
      const double minus = scalar();
      d[j] = orig;
      g[j] = (plus - minus) / (2 * eps);
    }
    out.push_back(g);
  }
  return out;
}

::testing::AssertionResult compare(const char* what, const std::vector<Tensor>& analytic,
                                   const std::vector<std::vector<double>>& numeric, double tol) {
  for (size_t i = 0; i < numeric.size(); ++i) {
    const std::vector<double> a = analytic[i].defined() ? analytic[i].to_vector()
                                                        : std::vector<double>(numeric[i].size(), 0.0);
    for (size_t j = 0; j < a.size(); ++j) {
      if (!(std::fabs(a[j] - numeric[i][j]) <= tol * (1.0 + std::fabs(numeric[i][j]))))
        return ::testing::AssertionFailure() << what << ": input " << i << " element " << j << ": analytic " << a[j]
                                             << " vs numeric " << numeric[i][j];
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace

::testing::AssertionResult gradcheck(const Fn& f, std::vector<Tensor> inputs, bool second_order, double eps,
                                     double tol) {
  for (Tensor& x : inputs) {
    if (x.dtype() != DType::f64) return ::testing::AssertionFailure() << "gradcheck needs float64 inputs";
    x.set_requires_grad(true);
  }
  Generator gen(1234);
  Tensor out0;
  {
    NoGradGuard ng;
    out0 = f(inputs);
  }
  const Tensor w = rand_uniform(out0.shape(), 0.5, 1.5, gen, DType::f64);
  const std::vector<Tensor> analytic = grad({sum(mul(f(inputs), w))}, inputs, {}, false, false, true);
  auto first = numeric_grad([&] { return weighted_sum(f(inputs), w); }, inputs, eps);
  auto r = compare("first derivative", analytic, first, tol);
  if (!r || !second_order) return r;

  std::vector<Tensor> vs;
  for (const Tensor& x : inputs) vs.push_back(rand_uniform(x.shape(), -1.0, 1.0, gen, DType::f64));
  auto h = [&](bool create_graph) {
    const std::vector<Tensor> g = grad({sum(mul(f(inputs), w))}, inputs, {}, create_graph, create_graph, true);
    Tensor total = scalar_tensor(0.0, DType::f64);
    for (size_t i = 0; i < g.size(); ++i)
      if (g[i].defined()) total = add(total, sum(mul(g[i], vs[i])));
    return total;
  };
  const Tensor hv = h(true);
  // No graph means the gradient does not depend on the inputs: the second derivative is zero.
  const std::vector<Tensor> analytic2 =
      hv.requires_grad() ? grad({hv}, inputs, {}, false, false, true) : std::vector<Tensor>(inputs.size());
  auto second = numeric_grad([&] { return h(false).item(); }, inputs, eps);
  return compare("second derivative", analytic2, second, tol * 10);
}

std::string generated_text_file(const std::string& name, size_t bytes) {
  static const char* const words[] = {"the", "and", "of", "to", "in", "that", "he", "shall", "unto", "for", "i", "his",
                                      "a", "lord", "they", "be", "is", "him", "not", "them", "it", "with", "all", "thou"};
  std::string text;
  uint64_t state = 42;
  while (text.size() < bytes) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    text += words[(state >> 33) % (sizeof words / sizeof *words)];
    text += (state >> 60) == 0 ? ".\n" : " ";
  }
  text.resize(bytes);
  // Written aside and renamed into place: suites running at once (CTest -j) may ask for the same
  // file, and none may read it half-written.
  const std::string path = (std::filesystem::temp_directory_path() / ("amp_test_" + name + ".txt")).string();
  const std::string tmp = path + "." + std::to_string(::getpid()) + ".tmp";
  std::ofstream(tmp, std::ios::binary) << text;
  std::filesystem::rename(tmp, path);
  return path;
}

void write_llmc_shard(const std::string& path, const std::vector<uint16_t>& tokens) {
  std::string bytes(1024 + 2 * tokens.size(), '\0');
  const auto put32 = [&](size_t at, uint32_t v) {
    for (int b = 0; b < 4; ++b) bytes[at + static_cast<size_t>(b)] = static_cast<char>((v >> (8 * b)) & 0xff);
  };
  put32(0, 20240520u);
  put32(4, 1u);
  put32(8, static_cast<uint32_t>(tokens.size()));
  for (size_t i = 0; i < tokens.size(); ++i) {
    bytes[1024 + 2 * i] = static_cast<char>(tokens[i] & 0xff);
    bytes[1024 + 2 * i + 1] = static_cast<char>(tokens[i] >> 8);
  }
  const std::string tmp = path + "." + std::to_string(::getpid()) + ".tmp";
  std::ofstream(tmp, std::ios::binary) << bytes;
  std::filesystem::rename(tmp, path);
}

std::string generated_token_shards(const std::string& name, int shards, int64_t tokens_each) {
  std::ifstream in(generated_text_file(name + "_tokens", static_cast<size_t>(shards * tokens_each)), std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("amp_test_" + name + "_tokens");
  std::filesystem::create_directories(dir);
  for (int s = 0; s < shards; ++s) {
    std::vector<uint16_t> tokens(static_cast<size_t>(tokens_each));
    for (int64_t i = 0; i < tokens_each; ++i) {
      const int64_t g = s * tokens_each + i;
      tokens[static_cast<size_t>(i)] =
          g % 7 == 6 ? 256 : static_cast<uint16_t>(static_cast<unsigned char>(text[static_cast<size_t>(g)]));
    }
    char file[32];
    std::snprintf(file, sizeof file, "train_%03d.bin", s);
    write_llmc_shard((dir / file).string(), tokens);
  }
  return (dir / "train_*.bin").string();
}

}  // namespace amp::test
