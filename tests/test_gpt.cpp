// The GPT against PyTorch (tests/data/gpt_pytorch.safetensors, from tests/scripts/make_gpt_fixture.py):
// parameter names and shapes, logits, loss and every gradient in float64 and float32, and AdamW steps
// with nanoGPT's parameter groups; nanoGPT's initialisation; the tied lm_head; and, on a CUDA device
// (real or emulated), the CUDA backend against the CPU on the whole model.
#include <gtest/gtest.h>
#include <cstring>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <filesystem>
#include <set>
#include <string>

#include "amp/autocast.h"
#include "amp/clip_grad.h"
#include "models/gpt.h"
#include "models/gpt_sample.h"
#include "runtime/ops/autograd.h"
#include "runtime/kernels/cuda/cuda_support.h"
#include "runtime/nn/state_dict.h"
#include "runtime/ops/ops.h"
#include "runtime/optim/adam.h"
#include "models/gpt2_vocab.h"
#include "models/gpt_hf.h"
#include "test_util.h"

namespace amp {
namespace {

const char* kFixture = "gpt_pytorch.safetensors";

models::GptConfig fixture_config() {
  models::GptConfig c;
  c.vocab_size = 256;
  c.block_size = 8;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 16;
  return c;
}

// The model with the fixture's weights (its parameter names are the state dict's).
std::unique_ptr<models::GptModel> fixture_model(DType dtype = DType::f32, Device device = kCPU,
                                                models::GptConfig config = fixture_config()) {
  Generator gen(1);
  auto m = models::make_gpt_model(config, gen, device);
  safetensors::NamedTensors weights;
  for (const auto& [name, p] : m->module().named_parameters()) weights.emplace_back(name, test::fixture_tensor(kFixture, name));
  nn::load_state_dict(m->module(), weights, kFixture);
  m->module().to(dtype);
  return m;
}

// AdamW(lr 1e-2, betas (0.9, 0.95)) with nanoGPT's groups, as the fixtures' PyTorch runs: weight
// decay 0.1 on the model's decayed parameters (2 or more dims), none on the others.
std::unique_ptr<optim::AdamW> nanogpt_adamw(models::GptModel& m) {
  optim::AdamWOptions o;
  o.lr = 1e-2;
  o.beta2 = 0.95;
  o.weight_decay = 0.1;
  optim::AdamWOptions no_decay = o;
  no_decay.weight_decay = 0.0;
  std::vector<Tensor> other;
  for (const Tensor& p : m.module().parameters())
    if (p.dim() < 2) other.push_back(p);
  return std::make_unique<optim::AdamW>(std::vector<optim::ParamGroup<optim::AdamWOptions>>{{m.decayed_parameters(), o}, {other, no_decay}});
}

models::Batch fixture_batch(Device device = kCPU) {
  models::Batch b;
  b.x = test::fixture_tensor(kFixture, "tokens").to(device);
  b.targets = {test::fixture_tensor(kFixture, "targets").to(device)};
  return b;
}

TEST(Gpt, NamesAndShapesAreNanoGpts) {
  Generator gen(1);
  auto m = models::make_gpt_model(fixture_config(), gen);
  std::set<std::string> ours;
  for (const auto& [name, p] : m->module().named_parameters()) {
    ours.insert(name);
    EXPECT_EQ(p.shape(), test::fixture_tensor(kFixture, name).shape()) << name;
  }
  // Every parameter of PyTorch's model is ours (the fixture's weights are its named_parameters()).
  for (const auto& [name, t] : test::fixture(kFixture)) {
    const bool result = name.rfind("f64.", 0) == 0 || name.rfind("f32.", 0) == 0 || name.rfind("adamw.", 0) == 0;
    if (name.find('.') != std::string::npos && !result) {
      EXPECT_TRUE(ours.count(name)) << name;
    }
  }
  EXPECT_EQ(ours.size(), 4u + 12u * 2u);
}

TEST(Gpt, LogitsLossAndGradientsMatchPyTorch) {
  for (DType dt : {DType::f64, DType::f32}) {
    const std::string tag = dt == DType::f64 ? "f64." : "f32.";
    // float64: both sides compute the same formulas in double (a few ulps of reordering); float32:
    // two float implementations of a 2-layer model, PyTorch's comparison tolerance for float32.
    const double rtol = dt == DType::f64 ? 1e-10 : 1e-4, atol = dt == DType::f64 ? 1e-12 : 1e-6;
    auto m = fixture_model(dt);
    const models::Batch b = fixture_batch();
    EXPECT_TRUE(test::all_close(m->logits(b.x), test::fixture_tensor(kFixture, tag + "logits"), rtol, atol)) << tag;
    const Tensor loss = m->losses(b).per_task.at(0);
    EXPECT_TRUE(test::all_close(loss, test::fixture_tensor(kFixture, tag + "loss"), rtol, atol)) << tag;
    loss.backward();
    for (const auto& [name, p] : m->module().named_parameters())
      EXPECT_TRUE(test::all_close(p.grad(), test::fixture_tensor(kFixture, tag + "grad." + name), rtol, atol)) << tag << name;
  }
}

// --gelu tanh, GPT-2's own GELU (Hugging Face's gelu_new): the fixture's GPT with the tanh form
// against a float64 reference written out in plain Python (tests/scripts/make_gpt_tanh_fixture.py),
// whose erf form reproduces PyTorch's float64 logits of the same weights to 1e-16. The erf model's
// logits are not the tanh model's (the test would see a GELU left as it was).
TEST(Gpt, TheTanhGeluMatchesItsReference) {
  models::GptConfig c = fixture_config();
  c.gelu_tanh = true;
  auto m = fixture_model(DType::f64, kCPU, c);
  const models::Batch b = fixture_batch();
  const char* ref = "gpt_tanh_reference.safetensors";
  const Tensor logits = m->logits(b.x);
  EXPECT_TRUE(test::all_close(logits, test::fixture_tensor(ref, "tanh.f64.logits"), 1e-10, 1e-12));
  EXPECT_TRUE(test::all_close(m->losses(b).per_task.at(0), test::fixture_tensor(ref, "tanh.f64.loss"), 1e-10, 1e-12));
  EXPECT_FALSE(test::all_close(logits, test::fixture_tensor(kFixture, "f64.logits"), 1e-7, 1e-9)) << "the erf model's";
}

// Hugging Face's GPT-2 layout, written here from its documented names and layouts (models/gpt_hf.h):
// the fixture's PyTorch weights without the "transformer." prefix, the four Conv1D matrices [in, out]
// (transposed here element by element), sorted by name. Loaded, the model computes PyTorch's logits
// (float64, to 1e-10); saved back as "hf", the file is the same bytes. The prefix, a tied lm_head and
// the attention's mask buffers load the same weights; an lm_head that differs from wte is refused.
TEST(Gpt, HuggingFacesLayoutLoadsAndSavesBackByteForByte) {
  const auto conv1d = [](const std::string& n) {
    for (const char* tail : {".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight"})
      if (n.size() > std::strlen(tail) && n.compare(n.size() - std::strlen(tail), std::strlen(tail), tail) == 0) return true;
    return false;
  };
  safetensors::NamedTensors hf;
  Generator gen(1);
  for (const auto& [name, p] : models::make_gpt_model(fixture_config(), gen)->module().named_parameters()) {
    const Tensor t = test::fixture_tensor(kFixture, name);
    const std::string n = name.substr(std::string("transformer.").size());
    if (!conv1d(n)) {
      hf.emplace_back(n, t);
      continue;
    }
    const int64_t out = t.size(0), in = t.size(1);
    const std::vector<double> v = t.to_vector();
    std::vector<double> w(v.size());
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i) w[static_cast<size_t>(i * out + o)] = v[static_cast<size_t>(o * in + i)];
    hf.emplace_back(n, from_vector(w, {in, out}));
  }
  std::sort(hf.begin(), hf.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  EXPECT_TRUE(models::is_hf_gpt2(hf));
  EXPECT_FALSE(models::is_hf_gpt2(test::fixture(kFixture)));

  auto loaded = [&](const safetensors::NamedTensors& file) {
    Generator g(2);
    auto m = models::make_gpt_model(fixture_config(), g);
    const models::GptConfig c = fixture_config();
    nn::load_state_dict(m->module(), models::gpt2_from_hf(file, "hf.safetensors", {c.n_layer, c.n_embd, c.block_size, c.vocab_size}),
                        "hf.safetensors");
    return m;
  };
  auto m = loaded(hf);
  EXPECT_EQ(safetensors::serialize(models::gpt2_to_hf(nn::state_dict(m->module()))), safetensors::serialize(hf));
  m->module().to(DType::f64);
  EXPECT_TRUE(test::all_close(m->logits(fixture_batch().x), test::fixture_tensor(kFixture, "f64.logits"), 1e-10, 1e-12));

  // save_pretrained's GPT2LMHeadModel: the prefix, lm_head tied, and older files' mask buffers.
  safetensors::NamedTensors prefixed;
  for (const auto& [n, t] : hf) prefixed.emplace_back("transformer." + n, t);
  prefixed.emplace_back("lm_head.weight", safetensors::find(hf, "wte.weight", "hf"));
  prefixed.emplace_back("transformer.h.0.attn.bias", ones({1, 1, 8, 8}));
  prefixed.emplace_back("transformer.h.0.attn.masked_bias", full({}, -1e4));
  EXPECT_TRUE(models::is_hf_gpt2(prefixed));
  auto same = loaded(prefixed);
  EXPECT_EQ(safetensors::serialize(nn::state_dict(same->module())),
            safetensors::serialize(nn::state_dict(loaded(hf)->module())));
  prefixed[prefixed.size() - 3].second = zeros({256, 16});
  EXPECT_THROW(loaded(prefixed), std::invalid_argument) << "an lm_head that is not wte";

  // A file unlike GPT-2 of the flags' sizes is refused in its own terms: the tensor as the file names
  // it, its shape and the one Hugging Face's layout has (they were our names and our transposes).
  auto refusal = [&](const safetensors::NamedTensors& file) -> std::string {
    try {
      loaded(file);
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "accepted";
  };
  auto replaced = [&](const std::string& name, const Tensor& t) {
    safetensors::NamedTensors f = hf;
    for (auto& [n, x] : f)
      if (n == name) x = t;
    return f;
  };
  EXPECT_NE(refusal(replaced("h.0.mlp.c_fc.weight", zeros({64, 16}))).find(
                "hf.safetensors: tensor 'h.0.mlp.c_fc.weight' has shape [64, 16], expected [16, 64] (--n-layer 2"),
            std::string::npos)
      << "our Linear's [out, in] where Conv1D's [in, out] belongs";
  EXPECT_NE(refusal(replaced("h.1.attn.c_attn.weight", zeros({16, 30}))).find("has shape [16, 30], expected [16, 48]"),
            std::string::npos);
  safetensors::NamedTensors missing;
  for (const auto& [n, t] : prefixed)
    if (n != "transformer.h.1.ln_2.bias") missing.emplace_back(n, t);
  EXPECT_NE(refusal(missing).find("has no tensor named 'transformer.h.1.ln_2.bias' [16]"), std::string::npos)
      << refusal(missing);
  safetensors::NamedTensors extra = hf;
  extra.emplace_back("h.2.ln_1.weight", ones({16}));
  EXPECT_NE(refusal(extra).find("unexpected tensor 'h.2.ln_1.weight'"), std::string::npos) << refusal(extra);
  // Without the one tensor the layout was told by, the file is still the hub's (its names say so).
  safetensors::NamedTensors no_c_attn;
  for (const auto& [n, t] : hf)
    if (n != "h.0.attn.c_attn.weight") no_c_attn.emplace_back(n, t);
  EXPECT_TRUE(models::is_hf_gpt2(no_c_attn));
  EXPECT_NE(refusal(no_c_attn).find("has no tensor named 'h.0.attn.c_attn.weight' [16, 48]"), std::string::npos)
      << refusal(no_c_attn);
  // A dtype other than the weights' is named as the file names it (the load named ours).
  EXPECT_NE(refusal(replaced("ln_f.bias", cast(ones({16}), DType::f16))).find(
                "tensor 'ln_f.bias' has dtype float16, expected float32"),
            std::string::npos)
      << refusal(replaced("ln_f.bias", cast(ones({16}), DType::f16)));
}

// GPT-2's vocabulary (50257 tokens) trains like PyTorch step by step in float32: 5 AdamW steps with
// nanoGPT's groups and clipping at 1.0 on random token ids (gpt_vocab50257_pytorch.safetensors, from
// tests/scripts/make_gpt2_vocab_fixture.py), from initial weights both sides compute from one formula:
// each step's loss agrees to 1e-5 and its gradient norm (before clipping) to 1e-3: Adam moves an
// element by about lr whatever its gradient's size, so float32 noise in the many tiny gradients of a
// large embedding grows to ~1e-4 of the norm in a few steps (as AdamWWithNanoGptsGroupsMatchesPyTorch).
TEST(Gpt, GptTwosVocabularyTrainsLikePyTorchStepByStep) {
  const std::string f = "gpt_vocab50257_pytorch.safetensors";
  models::GptConfig c = fixture_config();  // 2 layers, 2 heads, 16 wide, block 8
  c.vocab_size = 50257;
  Generator gen(1);
  auto m = models::make_gpt_model(c, gen);
  int q = 0;
  for (auto& [name, p] : m->module().named_parameters()) {
    const bool ln_weight = name.find(".ln_") != std::string::npos && name.compare(name.size() - 6, 6, "weight") == 0;
    std::vector<double> v(static_cast<size_t>(p.numel()));
    for (size_t i = 0; i < v.size(); ++i)
      v[i] = static_cast<float>(0.02 * std::sin(0.37 * static_cast<double>(i) + 1.3 * q) + (ln_weight ? 1.0 : 0.0));
    Tensor dst = p.detach();
    copy_(dst, from_vector(v, p.shape()));
    ++q;
  }
  auto opt = nanogpt_adamw(*m);
  const std::vector<double> tokens = test::fixture_tensor(f, "tokens").to_vector();  // [5, 2, 9]
  const std::vector<double> losses = test::fixture_tensor(f, "losses").to_vector();
  const std::vector<double> norms = test::fixture_tensor(f, "grad_norms").to_vector();
  for (int s = 0; s < 5; ++s) {
    std::vector<int64_t> x, y;
    for (int b = 0; b < 2; ++b)
      for (int t = 0; t < 8; ++t) {
        x.push_back(static_cast<int64_t>(tokens[static_cast<size_t>((s * 2 + b) * 9 + t)]));
        y.push_back(static_cast<int64_t>(tokens[static_cast<size_t>((s * 2 + b) * 9 + t + 1)]));
      }
    models::Batch batch;
    batch.x = from_int64(x, {2, 8});
    batch.targets = {from_int64(y, {2, 8})};
    opt->zero_grad();
    const Tensor loss = m->losses(batch).per_task.at(0);
    loss.backward();
    const double norm = clip_grad_norm_(m->module().parameters(), 1.0).to_vector().at(0);
    opt->step();
    EXPECT_NEAR(loss.to_vector().at(0), losses[static_cast<size_t>(s)], 1e-5 * losses[static_cast<size_t>(s)]) << "step " << s + 1;
    EXPECT_NEAR(norm, norms[static_cast<size_t>(s)], 1e-3 * norms[static_cast<size_t>(s)]) << "step " << s + 1;
  }
}

// GPT-2's vocab.json decodes through the byte map of its byte-level BPE, written out here from its
// definition (the printable bytes as themselves, the other 68 as U+0100 onwards: "Ġ" U+0120 is byte 32,
// a space; "Ċ" U+010A byte 10, a newline); bad files are refused naming the problem.
TEST(Gpt, Gpt2VocabDecodesThroughTheByteMap) {
  const std::string path = (std::filesystem::temp_directory_path() / "amp_test_vocab.json").string();
  const auto write = [&](const std::string& json) { std::ofstream(path, std::ios::binary) << json; };
  // U+00A0 is byte 160 (not printable): mapped to U+0100 + 34 (the bytes 0-32, 127-159 come first).
  write(R"({"Hello": 0, "\u0120world": 1, "!": 2, "\u010a": 3, "<|endoftext|>": 4, "\u0142": 5, "\u00e9": 6})");
  const models::Gpt2Vocab v = models::Gpt2Vocab::load(path, 5);
  EXPECT_EQ(v.decode({0, 1, 2, 3, 4}), "Hello world!\n<|endoftext|>");
  EXPECT_EQ(v.decode({5}), std::string(1, static_cast<char>(160)));
  EXPECT_EQ(v.decode({6}), std::string(1, static_cast<char>(0xe9))) << "printable bytes map to themselves";
  EXPECT_THROW(models::Gpt2Vocab::load(path, 8), std::invalid_argument) << "no token has id 7";
  write(R"({"a": 0, "b": 0})");
  EXPECT_THROW(models::Gpt2Vocab::load(path, 1), std::invalid_argument) << "two tokens, one id";
  write(R"({"\u4e2d": 0})");
  try {
    models::Gpt2Vocab::load(path, 1);
    ADD_FAILURE() << "outside the byte map: accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("outside GPT-2's byte map (U+4E2D)"), std::string::npos) << e.what();
  }
  write("not json");
  EXPECT_THROW(models::Gpt2Vocab::load(path, 1), std::invalid_argument);
  std::filesystem::remove(path);
}

TEST(Gpt, AdamWWithNanoGptsGroupsMatchesPyTorch) {
  auto m = fixture_model();
  const std::vector<Tensor> decay = m->decayed_parameters();
  std::vector<Tensor> other;
  for (const Tensor& p : m->module().parameters())
    if (p.dim() < 2) other.push_back(p);
  EXPECT_EQ(decay.size() + other.size(), m->module().parameters().size());
  auto opt = nanogpt_adamw(*m);
  const models::Batch b = fixture_batch();
  for (int i = 0; i < 3; ++i) {
    opt->zero_grad();
    m->losses(b).per_task.at(0).backward();
    opt->step();
  }
  // Adam moves each element by about lr per step whatever its gradient's size, so a gradient's float32
  // noise (1e-4 relative, as above) moves it by up to ~1e-4 of lr per step: 3 steps of lr 1e-2, 3e-6.
  for (const auto& [name, p] : m->module().named_parameters())
    EXPECT_TRUE(test::all_close(p, test::fixture_tensor(kFixture, "adamw.after3." + name), 1e-4, 1e-5)) << name;
}

TEST(Gpt, InitialisationIsNanoGpts) {
  models::GptConfig c = fixture_config();
  c.n_embd = 64;
  c.n_layer = 3;
  Generator gen(7);
  auto m = models::make_gpt_model(c, gen);
  for (const auto& [name, p] : m->module().named_parameters()) {
    const std::vector<double> v = p.to_vector();
    double s = 0, sq = 0;
    for (double x : v) s += x, sq += x * x;
    const double n = static_cast<double>(v.size()), mean = s / n, sd = std::sqrt(sq / n - mean * mean);
    if (name.find(".ln_") != std::string::npos) {
      for (double x : v) ASSERT_EQ(x, name.find("weight") != std::string::npos ? 1.0 : 0.0) << name;
    } else if (name.size() > 5 && name.substr(name.size() - 5) == ".bias") {
      for (double x : v) ASSERT_EQ(x, 0.0) << name;
    } else {
      const double want = name.find("c_proj.weight") != std::string::npos ? 0.02 / std::sqrt(6.0) : 0.02;
      EXPECT_NEAR(sd, want, 5 * want / std::sqrt(n)) << name;  // sample sd within 5 standard errors (about)
      EXPECT_NEAR(mean, 0.0, 5 * want / std::sqrt(n)) << name;
    }
  }
}

// A vocabulary of 300 is trained padded to 384 rows (a multiple of 128, as llm.c pads 50257 to
// 50304). The padding rows start at zero and are inert: given the largest logits of every row, they
// change neither the loss nor any gradient, get gradient 0, and are never sampled; the state dict
// holds the 300 rows, and loading it zeroes the padding.
TEST(Gpt, ThePaddedVocabularysRowsAreInert) {
  models::GptConfig c = fixture_config();
  c.vocab_size = 300;
  Generator gen(3);
  auto m = models::make_gpt_model(c, gen);
  Tensor wte = m->module().named_parameters().at(0).second;
  ASSERT_EQ(wte.shape(), (Shape{384, 16}));
  const std::vector<double> init = wte.to_vector();
  for (size_t i = 300 * 16; i < init.size(); ++i) ASSERT_EQ(init[i], 0.0) << "padding element " << i;
  EXPECT_EQ(nn::state_dict(m->module()).at(0).second.shape(), (Shape{300, 16}));

  models::Batch batch;
  std::vector<int64_t> x(16), y(16);
  for (size_t i = 0; i < 16; ++i) x[i] = static_cast<int64_t>(i * 37 % 300), y[i] = static_cast<int64_t>(i * 53 % 300);
  batch.x = from_int64(x, {2, 8});
  batch.targets = {from_int64(y, {2, 8})};
  auto loss_and_grads = [&] {
    m->module().zero_grad();
    const Tensor loss = m->losses(batch).per_task.at(0);
    loss.backward();
    std::vector<std::vector<double>> g;
    for (const Tensor& p : m->module().parameters()) g.push_back(p.grad().to_vector());
    return std::make_pair(loss.item(), g);
  };
  const auto [loss0, grads0] = loss_and_grads();
  // Padding rows that would win every row's softmax: +-1000 times token 0's row.
  float* w = wte.data<float>();
  for (int64_t r = 300; r < 384; ++r)
    for (int64_t k = 0; k < 16; ++k) w[r * 16 + k] = (r % 2 ? 1000.0f : -1000.0f) * w[k];
  const auto [loss1, grads1] = loss_and_grads();
  EXPECT_EQ(loss0, loss1);
  ASSERT_EQ(grads0.size(), grads1.size());
  for (size_t i = 0; i < grads0.size(); ++i) EXPECT_TRUE(grads0[i] == grads1[i]) << "gradient " << i;
  for (size_t i = 300 * 16; i < grads1[0].size(); ++i) ASSERT_EQ(grads1[0][i], 0.0) << "padding's gradient " << i;

  NoGradGuard ng;
  const std::vector<double> logits = m->logits(batch.x).to_vector();  // [2, 8, 384]
  const auto last = logits.begin() + 7 * 384;
  EXPECT_GE(std::max_element(last, last + 384) - last, 300) << "the control: the padding holds the largest logit";
  models::SampleOptions greedy;
  greedy.tokens = 10;
  greedy.top_k = 1;
  for (int64_t t : models::sample_tokens(*m, x, greedy)) EXPECT_LT(t, 300);

  // Loading the 300 rows zeroes the padding; 384 rows are refused, naming both shapes.
  safetensors::NamedTensors sd = nn::state_dict(m->module());
  for (auto& [name, t] : sd) t = t.clone();
  nn::load_state_dict(m->module(), sd, "padded.safetensors");
  const std::vector<double> loaded = wte.to_vector();
  for (size_t i = 300 * 16; i < loaded.size(); ++i) ASSERT_EQ(loaded[i], 0.0) << "padding element " << i;
  sd.at(0).second = zeros({384, 16});
  try {
    nn::load_state_dict(m->module(), sd, "padded.safetensors");
    ADD_FAILURE() << "384 rows were accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("[384, 16], expected [300, 16]"), std::string::npos) << e.what();
  }
}

TEST(Gpt, TiedLmHeadLoadsOnlyWhenIdentical) {
  auto m = fixture_model();
  safetensors::NamedTensors sd = nn::state_dict(m->module());
  const Tensor wte = safetensors::find(sd, "transformer.wte.weight", "test");
  sd.emplace_back("lm_head.weight", wte.clone());
  EXPECT_NO_THROW(nn::load_state_dict(m->module(), sd, "tied.safetensors"));
  Tensor other = wte.clone();
  other.data<float>()[5] += 1.0f;
  sd.back().second = other;
  try {
    nn::load_state_dict(m->module(), sd, "untied.safetensors");
    ADD_FAILURE() << "a different lm_head.weight was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("lm_head.weight"), std::string::npos) << e.what();
  }
}

TEST(Gpt, RefusesBadSizesAndSequences) {
  Generator gen(1);
  models::GptConfig c = fixture_config();
  c.n_head = 3;
  EXPECT_THROW(models::make_gpt_model(c, gen), std::invalid_argument);
  auto m = fixture_model();
  EXPECT_THROW(m->logits(zeros({1, 9}, DType::i64)), std::invalid_argument);  // longer than block_size
}

// top_k 1 is greedy decoding: each byte is the argmax of the last position's logits, which the test
// computes itself; a seed gives the same text twice, and another seed other text.
TEST(Gpt, SamplingIsGreedyAtTopKOneAndSeeded) {
  auto m = fixture_model();
  models::SampleOptions greedy;
  greedy.tokens = 12;
  greedy.top_k = 1;
  const std::string text = models::sample(*m, "In the", greedy);
  ASSERT_EQ(text.size(), 12u);
  std::string context = "In the";
  NoGradGuard ng;
  for (char produced : text) {
    std::vector<int64_t> ids;
    for (size_t i = context.size() > 8 ? context.size() - 8 : 0; i < context.size(); ++i)
      ids.push_back(static_cast<unsigned char>(context[i]));
    const int64_t T = static_cast<int64_t>(ids.size());
    const std::vector<double> logits = m->logits(from_int64(ids, {1, T})).to_vector();
    const auto last = logits.begin() + (T - 1) * 256;
    const int64_t argmax = std::max_element(last, last + 256) - last;
    ASSERT_EQ(static_cast<unsigned char>(produced), argmax);
    context.push_back(produced);
  }
  models::SampleOptions o;
  o.tokens = 40;
  o.temperature = 1.5;
  o.seed = 1;
  const std::string a = models::sample(*m, "", o), b = models::sample(*m, "", o);
  o.seed = 2;
  EXPECT_EQ(a, b);
  EXPECT_NE(a, models::sample(*m, "", o));
}

TEST(Gpt, CudaMatchesCpuOnTheWholeModel) {
  std::string reason;
  if (!cuda_usable(&reason)) GTEST_SKIP() << "no usable CUDA device: " << reason;
  cuda_init(0);
  const Device gpu{DeviceType::cuda, 0};
  for (bool fp16 : {false, true}) {
    auto c = fixture_model(), g = fixture_model(DType::f32, gpu);
    Tensor lc, lg;
    {
      autocast ac(DeviceType::cpu, DType::f16, fp16, true, CastLists::cuda);
      lc = c->losses(fixture_batch()).per_task.at(0);
    }
    {
      autocast ac(DeviceType::cuda, DType::f16, fp16);
      lg = g->losses(fixture_batch(gpu)).per_task.at(0);
    }
    lc.backward();
    lg.backward();
    // The same ops in another order of summation (GEMMs, row statistics): float32 noise, or fp16's.
    const double tol = fp16 ? 2e-2 : 1e-4;
    EXPECT_TRUE(test::all_close(lg.to(kCPU), lc, tol, 1e-6)) << "fp16 " << fp16;
    const auto pc = c->module().named_parameters(), pg = g->module().named_parameters();
    for (size_t i = 0; i < pc.size(); ++i)
      EXPECT_TRUE(test::all_close(pg[i].second.grad().to(kCPU), pc[i].second.grad(), tol, fp16 ? 1e-4 : 1e-6))
          << "fp16 " << fp16 << " " << pc[i].first;
  }
}

}  // namespace
}  // namespace amp
