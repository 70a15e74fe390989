#include "models/gpt_hf.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>

#include "runtime/ops/ops.h"

namespace amp::models {

namespace {

const std::string kPrefix = "transformer.";

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

std::string without_prefix(const std::string& name) {
  return name.rfind(kPrefix, 0) == 0 ? name.substr(kPrefix.size()) : name;
}

// The Conv1D weights (stored [in, out]), by their names without the prefix.
bool is_conv1d_weight(const std::string& name) {
  return name.rfind("h.", 0) == 0 && (ends_with(name, ".attn.c_attn.weight") || ends_with(name, ".attn.c_proj.weight") ||
                                      ends_with(name, ".mlp.c_fc.weight") || ends_with(name, ".mlp.c_proj.weight"));
}

// Every tensor of Hugging Face's GPT-2 of these dims, by its name without the prefix, in its layout
// (lm_head.weight, optional, is wte's).
std::map<std::string, Shape> hf_shapes(const Gpt2Dims& d) {
  const int64_t C = d.n_embd;
  std::map<std::string, Shape> s = {{"wte.weight", {d.vocab, C}}, {"wpe.weight", {d.block_size, C}},
                                    {"ln_f.weight", {C}},         {"ln_f.bias", {C}}};
  for (int64_t i = 0; i < d.n_layer; ++i) {
    const std::string h = "h." + std::to_string(i) + ".";
    for (const char* ln : {"ln_1.", "ln_2."}) {
      s[h + ln + "weight"] = {C};
      s[h + ln + "bias"] = {C};
    }
    s[h + "attn.c_attn.weight"] = {C, 3 * C};
    s[h + "attn.c_attn.bias"] = {3 * C};
    s[h + "attn.c_proj.weight"] = {C, C};
    s[h + "attn.c_proj.bias"] = {C};
    s[h + "mlp.c_fc.weight"] = {C, 4 * C};
    s[h + "mlp.c_fc.bias"] = {4 * C};
    s[h + "mlp.c_proj.weight"] = {4 * C, C};
    s[h + "mlp.c_proj.bias"] = {C};
  }
  return s;
}

}  // namespace

bool is_hf_gpt2(const safetensors::NamedTensors& tensors) {
  // Any of GPT-2's names without the prefix is the hub's (ours always carry it), whatever the other
  // tensors: a missing or misshapen one is then named by the load in the file's terms, not taken for
  // our layout. With the prefix, a block's c_attn.weight tells: [C, 3C] is Conv1D's, [3C, C] ours.
  for (const auto& [name, t] : tensors) {
    const std::string n = without_prefix(name);
    if (name == n && (n == "wte.weight" || n == "wpe.weight" || n.rfind("ln_f.", 0) == 0 || n.rfind("h.", 0) == 0))
      return true;
  }
  for (const auto& [name, t] : tensors)
    if (ends_with(name, ".attn.c_attn.weight") && is_conv1d_weight(without_prefix(name)))
      return t.dim() == 2 && t.size(1) == 3 * t.size(0);
  return false;
}

safetensors::NamedTensors gpt2_from_hf(const safetensors::NamedTensors& theirs, const std::string& source,
                                       const Gpt2Dims& dims) {
  const std::map<std::string, Shape> shapes = hf_shapes(dims);
  const std::string flags = " (--n-layer " + std::to_string(dims.n_layer) + ", --n-embd " + std::to_string(dims.n_embd) +
                            ", --block-size " + std::to_string(dims.block_size) + ", vocabulary " +
                            std::to_string(dims.vocab) + "; Hugging Face's layout: Conv1D weights are [in, out])";
  bool prefixed = false;  // the file's own naming, for a missing tensor's name
  for (const auto& [name, t] : theirs) {
    const std::string n = without_prefix(name);
    prefixed = prefixed || name != n;
    if (n.rfind("h.", 0) == 0 && (ends_with(n, ".attn.bias") || ends_with(n, ".attn.masked_bias"))) {
      const std::string block = n.substr(2, n.find('.', 2) - 2);
      if (shapes.count("h." + block + ".ln_1.weight")) continue;  // a buffer of a block we have
    }
    const auto it = shapes.find(n == "lm_head.weight" ? "wte.weight" : n);
    if (it == shapes.end())
      throw std::invalid_argument(source + ": unexpected tensor '" + name + "': GPT-2 of these sizes has none" + flags);
    if (t.shape() != it->second)
      throw std::invalid_argument(source + ": tensor '" + name + "' has shape " + shape_str(t.shape()) + ", expected " +
                                  shape_str(it->second) + flags);
    if (t.dtype() != DType::f32)  // here, where the file's name is known (the load would name ours)
      throw std::invalid_argument(source + ": tensor '" + name + "' has dtype " + dtype_name(t.dtype()) +
                                  ", expected float32 (the model's weights)");
  }
  for (const auto& [n, shape] : shapes) {
    bool there = false;
    for (const auto& [name, t] : theirs) there = there || without_prefix(name) == n;
    if (!there)
      throw std::invalid_argument(source + ": has no tensor named '" + (prefixed ? kPrefix : "") + n + "' " +
                                  shape_str(shape) + flags);
  }
  safetensors::NamedTensors ours;
  std::map<std::string, std::string> seen;  // a parameter's name without the prefix -> the file's name for it
  for (const auto& [name, t] : theirs) {
    const std::string n = without_prefix(name);
    // With and without the prefix, one file could give a parameter twice, and the first would win.
    if (const auto [it, fresh] = seen.emplace(n, name); !fresh)
      throw std::invalid_argument(source + ": holds both '" + it->second + "' and '" + name +
                                  "': one parameter given twice");
    if (n.rfind("h.", 0) == 0 && (ends_with(n, ".attn.bias") || ends_with(n, ".attn.masked_bias"))) continue;
    if (n == "lm_head.weight" || name == "lm_head.weight") {
      ours.emplace_back("lm_head.weight", t);  // checked against wte by load_state_dict (tied)
      continue;
    }
    if (is_conv1d_weight(n)) {
      if (t.dim() != 2)
        throw std::invalid_argument(source + ": tensor '" + name + "' has shape " + shape_str(t.shape()) +
                                    ": a Conv1D weight is 2-dimensional [in, out]");
      ours.emplace_back(kPrefix + n, transpose(t, 0, 1));
    } else {
      ours.emplace_back(kPrefix + n, t);
    }
  }
  return ours;
}

safetensors::NamedTensors gpt2_to_hf(const safetensors::NamedTensors& ours) {
  safetensors::NamedTensors theirs;
  for (const auto& [name, t] : ours) {
    if (name == "lm_head.weight") continue;
    const std::string n = without_prefix(name);
    theirs.emplace_back(n, is_conv1d_weight(n) ? transpose(t, 0, 1) : t);
  }
  std::sort(theirs.begin(), theirs.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  return theirs;
}

}  // namespace amp::models
