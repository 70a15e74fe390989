// Helpers shared by the test suites: fixtures, comparisons and the fp64 gradcheck.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "runtime/nn/layers.h"
#include "runtime/core/safetensors.h"
#include "runtime/core/tensor.h"

namespace amp::test {

std::string data_path(const std::string& file);  // tests/data/<file>
const safetensors::NamedTensors& fixture(const std::string& file);  // loaded once
Tensor fixture_tensor(const std::string& file, const std::string& name);
// The MLP of mlp_pytorch.safetensors (16-16-16, 3 layers) with PyTorch's initial weights.
std::shared_ptr<nn::Sequential> fixture_mlp();

// A text file of `bytes` bytes of English-like words (seeded, the same every time) under the
// system's temporary directory, named after `name`; its path.
std::string generated_text_file(const std::string& name, size_t bytes);

// llm.c's token shard, written from its documented layout: 256 little-endian int32 (magic 20240520,
// version 1, the token count, zeros), then the tokens as little-endian uint16.
void write_llmc_shard(const std::string& path, const std::vector<uint16_t>& tokens);
// `shards` llm.c shards of `tokens_each` tokens under the temporary directory: the bytes of
// generated_text_file's words (so a model can learn them) as token ids, plus 256 every seventh token
// (so ids above a byte's occur); the shards' glob pattern ("/tmp/amp_test_NAME_tokens/train_*.bin").
std::string generated_token_shards(const std::string& name, int shards, int64_t tokens_each);

// max |a - b| / (atol + rtol |b|) over elements; <= 1 means close. Non-finite mismatches give inf.
double closeness(const Tensor& a, const Tensor& b, double rtol, double atol);
::testing::AssertionResult all_close(const Tensor& a, const Tensor& b, double rtol = 1e-5, double atol = 1e-6);
::testing::AssertionResult bitwise_equal(const Tensor& a, const Tensor& b);
// How many of t's values (converted to fp32) have at most `mantissa_bits` significand bits: 7 for a
// bf16 value, 10 for an fp16 normal one.
int64_t count_representable(const Tensor& t, int mantissa_bits);

// Checks autograd's gradient of sum(f(inputs) * w) (w a fixed random weight) against central
// finite differences, in fp64. With second_order, also checks the gradient of sum(grad * v) with
// respect to the inputs (double backward).
using Fn = std::function<Tensor(const std::vector<Tensor>&)>;
::testing::AssertionResult gradcheck(const Fn& f, std::vector<Tensor> inputs, bool second_order = false,
                                     double eps = 1e-6, double tol = 1e-5);

}  // namespace amp::test
