// --model gpt: nanoGPT's GPT-2 (models/gpt.h) on the bytes of a text file or on token shards (llm.c's,
// nanoGPT's uint16: models/data/token_dataset.h), its validation data evaluated by the trainer, and
// text sampled at the end (models/gpt_sample.h).
#include <cstdio>
#include <memory>
#include <string>
#include <vector>
#include <stdexcept>

#include "models/data/text_dataset.h"
#include "models/data/token_dataset.h"
#include "models/gpt.h"
#include "models/gpt2_vocab.h"
#include "models/gpt_hf.h"
#include "models/gpt_sample.h"
#include "models/model_spec.h"
#include "runtime/core/parse_number.h"
#include "runtime/kernels/cuda/cuda_support.h"
#include "runtime/kernels/rng_math.h"

namespace amp::models {

namespace {

// Where the GPT's data comes from: --data-format, --val-data and whether --vocab-size was given.
struct DataFlags {
  std::string format = "auto";  // auto | text | llmc | u16
  std::string validation;       // --val-data: token data only
  bool vocab_given = false;
  std::vector<int64_t> prompt_tokens;  // --prompt-tokens: the sample's prompt on token data
  std::string vocab_file;              // --vocab-file: GPT-2's vocab.json, to print samples as text
  bool prompt_given = false;           // --prompt: text's prompt, refused on token data
};

// "50256,464,3290" -> its ids, each below vocab_size.
std::vector<int64_t> parse_token_list(const std::string& s, int64_t vocab_size) {
  std::vector<int64_t> out;
  if (s.empty()) return out;
  size_t at = 0;
  while (true) {
    const size_t comma = s.find(',', at);
    const std::string item = s.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
    const ParsedInteger id = parse_integer(item);
    const int64_t v = id.error == NumberError::none ? id.value : -1;
    if (v < 0 || v >= vocab_size)
      throw std::invalid_argument("--prompt-tokens must be comma-separated token ids below --vocab-size " +
                                  std::to_string(vocab_size) + ", got '" + item + "' in '" + s + "'");
    out.push_back(v);
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  return out;
}

class GptSpec final : public ModelSpec {
 public:
  GptSpec(const GptConfig& c, const SampleOptions& sample, std::string prompt, DataFlags data)
      : c_(c), sample_(sample), prompt_(std::move(prompt)), data_(std::move(data)) {}
  // Token data or text, from --data-format and (auto) the file itself; the flags checked against it.
  bool token_data(const std::string& data) const {
    const bool tokens = data_.format == "auto" ? is_token_data(data, "--data-format") : data_.format != "text";
    if (tokens && !data_.vocab_given)
      throw std::invalid_argument("--vocab-size: --data " + data + " holds tokens: give their vocabulary's size (50257 "
                                  "for GPT-2's tokenizer)");
    if (!tokens && c_.vocab_size != 256)  // more would be rows no byte reaches, and a sample's id of 256 printed as a byte
      throw std::invalid_argument("--vocab-size: --data " + data + " is text (bytes): the vocabulary is 256, got " +
                                  std::to_string(c_.vocab_size));
    if (!tokens && !data_.validation.empty())
      throw std::invalid_argument("--val-data: --data " + data +
                                  " is text, whose last tenth is the validation split; --val-data is for token shards");
    if (tokens && sample_.tokens > 0 && data_.prompt_tokens.empty())
      throw std::invalid_argument("--prompt-tokens: --sample-tokens on token data samples token ids after a prompt of "
                                  "ids: give one (50256 is GPT-2's <|endoftext|>)");
    if (!tokens && !data_.prompt_tokens.empty())
      throw std::invalid_argument("--prompt-tokens: --data " + data + " is text: its prompt is --prompt");
    if (tokens && data_.prompt_given)
      throw std::invalid_argument("--prompt: --data " + data + " holds tokens: their prompt is --prompt-tokens (ids)");
    if (!tokens && !data_.vocab_file.empty())
      throw std::invalid_argument("--vocab-file: --data " + data + " is text (bytes): there are no token ids to decode");
    if (!data_.vocab_file.empty() && !vocab_)
      vocab_ = std::make_shared<Gpt2Vocab>(Gpt2Vocab::load(data_.vocab_file, c_.vocab_size));
    tokens_ = tokens;
    return tokens;
  }
  void check(const RunShape& run, long double ram) const override {
    if (run.data == "synthetic")
      throw std::invalid_argument("--data: --model gpt trains on a text FILE (bytes) or token shards; "
                                  "launch/scripts/run_example.sh makes a text file from the King James Bible (Debian's "
                                  "bible-kjv)");
    if (ram > 0) check_memory(run, ram);
    (void)token_data(run.data);  // after the sizes: they are refused whatever the data
    if (c_.attention == AttentionKernels::cudnn) {
      const std::string why = cudnn_refusal(run);
      if (!why.empty()) throw std::invalid_argument("--attention cudnn: " + why + " (--attention auto falls back)");
    }
    attention_note_ = attention_note(run);
  }
  // What attention a GPU run computes with, for the run's first line (rank 0 prints it once; the op
  // falls back without a word): cuDNN's, or ours and why not cuDNN's.
  std::string attention_note(const RunShape& run) const {
    if (run.device != DeviceType::cuda || !run.autocast || c_.dropout > 0.0) return "";
    if (c_.attention == AttentionKernels::cudnn) return ", attention by " + cudnn_describe();
    if (c_.attention != AttentionKernels::automatic) return "";
    const std::string why = cudnn_attention_unavailable(run.autocast_dtype, c_.n_embd / c_.n_head);
    return why.empty() ? ", attention by " + cudnn_describe()
                       : ", attention not by cuDNN (" + why + ")";
  }
  // Why cuDNN's attention cannot run this run, or "". The library is asked once the device is a GPU.
  std::string cudnn_refusal(const RunShape& run) const {
    if (c_.dropout > 0.0)
      return "cuDNN's attention runs without dropout, and --dropout is " + std::to_string(c_.dropout);
    if (run.device == DeviceType::cpu) return "cuDNN runs on a GPU, and this run trains on the CPU";
    if (!run.autocast) return "cuDNN's attention runs in bf16 or fp16: add --amp bf16 or --amp fp16";
    if (run.device == DeviceType::cuda) return cudnn_attention_unavailable(run.autocast_dtype, c_.n_embd / c_.n_head);
    return "";
  }
  void check_memory(const RunShape& run, long double ram) const {
    const MemoryEstimate m = memory_estimate(run);
    if (MemoryEstimate::kProcessBytes + m.model > ram)
      throw std::invalid_argument("--n-embd " + std::to_string(c_.n_embd) + ", --n-layer " + std::to_string(c_.n_layer) +
                                  " and --block-size " + std::to_string(c_.block_size) +
                                  " (the position embedding): the model alone needs at least " +
                                  memory_needed(MemoryEstimate::kProcessBytes + m.model, ram));
    if (m.total() > ram)
      throw std::invalid_argument("--batch-size " + std::to_string(run.batch_size) + " at --block-size " +
                                  std::to_string(c_.block_size) + " and --n-head " + std::to_string(c_.n_head) +
                                  ": a micro-batch's activations (its attention weights grow as the block's square), "
                                  "the model and the data need at least " + memory_needed(m.total(), ram) +
                                  "; use more --micro-batches of a smaller --batch-size");
  }
  // Measured on the CPU (tests/test_memory_estimate.cpp): about 20 values of [B, T, C] a layer and
  // the logits [B, T, 256] three times; the attention's [B, H, T, T] weights about 1.25 times a
  // layer (saved for the backward) plus 2.75 in flight (scores, their gradient), more under autocast
  // (16-bit copies beside fp32's softmax); the text held once.
  MemoryEstimate memory_estimate(const RunShape& run) const override {
    const long double C = static_cast<long double>(c_.n_embd), L = static_cast<long double>(c_.n_layer);
    const long double T = static_cast<long double>(c_.block_size), B = static_cast<long double>(run.batch_size);
    const long double H = static_cast<long double>(c_.n_head);
    MemoryEstimate m;
    const long double V = static_cast<long double>(c_.padded_vocab());
    m.model = parameter_bytes(12 * L * C * C + (V + T) * C, run);
    const long double attention = run.autocast ? 2 * L + 4.5L : 1.5L * L + 3;
    m.activations = B * T * (20 * C * L + 3 * V) * 4 + B * H * T * T * 4 * attention;
    m.data = data_file_bytes(run);
    return m;
  }
  std::unique_ptr<TrainingModel> build(Generator& gen, Device device) const override {
    return make_gpt_model(c_, gen, device);
  }
  std::unique_ptr<Dataset> data(const std::string& data, uint64_t, Device device) const override {
    if (!token_data(data)) return load_text_dataset(data, c_.block_size, device);
    TokenDataOptions o;
    o.train = data;
    o.validation = data_.validation;
    o.format = data_.format == "u16" ? TokenFormat::u16 : TokenFormat::llmc;
    o.vocab_size = c_.vocab_size;
    o.block_size = c_.block_size;
    return load_token_dataset(o, device);
  }
  nlohmann::json checkpoint_identity() const override {
    nlohmann::json id = {{"model",
                          {{"model", "gpt"}, {"n_layer", c_.n_layer}, {"n_head", c_.n_head}, {"n_embd", c_.n_embd},
                           {"block_size", c_.block_size}, {"vocab_size", c_.vocab_size}}},
                         {"dropout", c_.dropout}};
    // The tanh GELU is another model: a checkpoint says so (an erf run's identity is as it always was,
    // so that its checkpoints resume).
    if (c_.gelu_tanh) id["model"]["gelu"] = "tanh";
    return id;
  }
  std::string describe(const std::string& data) const override {
    return "gpt " + std::to_string(c_.n_layer) + " layers x " + std::to_string(c_.n_head) + " heads x " +
           std::to_string(c_.n_embd) + " wide, block " + std::to_string(c_.block_size) +
           (c_.gelu_tanh ? ", GELU tanh" : "") + attention_note_ + ", on " + data;
  }
  std::string size_flags() const override { return "are --n-embd, --n-layer, --block-size or --batch-size"; }
  // Hugging Face's GPT-2 layout (models/gpt_hf.h) in, recognised by its Conv1D shapes, and out as "hf".
  safetensors::NamedTensors import_weights(safetensors::NamedTensors tensors, const std::string& source) const override {
    if (!is_hf_gpt2(tensors)) {
      // nanoGPT's state dict where PyTorch had no flash attention (before 2.0) holds each block's
      // causal mask as a buffer, transformer.h.N.attn.bias: no parameter, dropped as Hugging Face's are.
      std::erase_if(tensors, [](const auto& named) {
        return named.first.starts_with("transformer.h.") && named.first.ends_with(".attn.bias");
      });
      return tensors;
    }
    if (!c_.gelu_tanh)
      std::fprintf(stderr, "amp_train: note: %s is in Hugging Face's GPT-2 layout; GPT-2's own weights were trained "
                           "with the tanh GELU: --gelu tanh computes what GPT-2 computes (this run uses erf)\n",
                   source.c_str());
    return gpt2_from_hf(tensors, source, {c_.n_layer, c_.n_embd, c_.block_size, c_.vocab_size});
  }
  std::vector<std::string> weight_formats() const override { return {"hf"}; }
  safetensors::NamedTensors export_weights(safetensors::NamedTensors tensors, const std::string& format) const override {
    return format == "hf" ? gpt2_to_hf(tensors) : tensors;
  }
  double tokens_per_sample() const override { return static_cast<double>(c_.block_size); }
  const char* unit() const override { return "tokens"; }
  bool double_backward() const override { return false; }
  std::string after_training(TrainingModel& model, uint64_t seed, const std::function<bool()>& stop) const override {
    if (sample_.tokens == 0) return {};
    SampleOptions o = sample_;
    o.seed = math::mix64(seed ^ 0x73616d706c65ull);  // the sampler's own stream
    o.stop = stop;
    if (tokens_) {  // token ids, as the data holds them (no tokenizer here to decode them)
      const std::vector<int64_t> ids = sample_tokens(dynamic_cast<GptModel&>(model), data_.prompt_tokens, o);
      std::string list;
      for (int64_t t : ids) list += (list.empty() ? "" : ",") + std::to_string(t);
      if (vocab_) list = vocab_->decode(data_.prompt_tokens) + vocab_->decode(ids);  // the prompt, then the sample
      char head[200];
      std::snprintf(head, sizeof head, "--- %zu tokens sampled (temperature %g, top-k %lld) after the prompt's %zu%s:\n",
                    ids.size(), o.temperature, static_cast<long long>(o.top_k), data_.prompt_tokens.size(),
                    vocab_ ? ", decoded with --vocab-file" : " (token ids)");
      const std::string tail = static_cast<int64_t>(ids.size()) == o.tokens
                                   ? "\n---\n"
                                   : "\n--- interrupted: " + std::to_string(ids.size()) + " of " +
                                         std::to_string(o.tokens) + " tokens sampled\n";
      return head + list + tail;
    }
    const std::string text = sample(dynamic_cast<GptModel&>(model), prompt_, o);
    char head[160];
    std::snprintf(head, sizeof head, "--- %lld bytes sampled (temperature %g, top-k %lld), continuing the prompt:\n",
                  static_cast<long long>(o.tokens), o.temperature, static_cast<long long>(o.top_k));
    // The bytes as drawn (a NUL or an invalid UTF-8 sequence included), then a closing line that says
    // how many there were when a stop cut the sample short.
    const std::string tail = static_cast<int64_t>(text.size()) == o.tokens
                                 ? "\n---\n"
                                 : "\n--- interrupted: " + std::to_string(text.size()) + " of " + std::to_string(o.tokens) +
                                       " bytes sampled\n";
    return head + prompt_ + text + tail;
  }

 private:
  GptConfig c_;
  mutable std::string attention_note_;  // set by check() once the device is known (describe())
  SampleOptions sample_;
  std::string prompt_;
  DataFlags data_;
  mutable bool tokens_ = false;  // the data is tokens (check() and data() find out)
  mutable std::shared_ptr<const Gpt2Vocab> vocab_;  // --vocab-file, read by check()
};

}  // namespace

ModelKind gpt_kind() {
  ModelKind k;
  k.name = "gpt";
  k.summary = "GPT-2 on the bytes of a text file, or on token shards";
  k.data_help = "any text, or token shards (llm.c's .bin, or nanoGPT's uint16 with --data-format u16; a glob in quotes)";
  k.flags = {{"n-layer", "4", "gpt: transformer blocks"},
             {"n-head", "4", "gpt: attention heads"},
             {"n-embd", "128", "gpt: embedding width (a multiple of --n-head)"},
             {"block-size", "64", "gpt: context length in bytes"},
             {"dropout", "0.0", "gpt: dropout probability (embeddings, attention, residuals)"},
             {"data-format", "auto", "gpt: --data's format: auto (llm.c's token shards by their header, else text), text, "
                                     "llmc, or u16 (nanoGPT's headerless uint16 train.bin)"},
             {"val-data", "", "gpt: validation token shards (a file or a quoted glob); text keeps its last tenth"},
             {"vocab-size", "auto", "gpt: the vocabulary: 256 for text (auto); token data needs it (50257: GPT-2's)"},
             {"attention", "auto", "gpt: auto (cuDNN's fused attention where it runs, else our fused kernels, with dropout "
                                   "0), cudnn (refused where it cannot run), fused (ours), or composite"},
             {"gelu", "erf", "gpt: the MLP's GELU: erf (nanoGPT's) or tanh (GPT-2's own, Hugging Face's gelu_new)"},
             {"sample-tokens", "0", "gpt: print N bytes sampled from the model at the end (0: none)"},
             {"temperature", "0.8", "gpt: sampling temperature"},
             {"top-k", "200", "gpt: sample among the K most likely bytes"},
             {"prompt", "\n", "gpt: text the sample continues"},
             {"prompt-tokens", "", "gpt: on token data, the ids the sample continues (comma-separated)"},
             {"vocab-file", "", "gpt: GPT-2's vocab.json, to print a sample of token data as text (decoding only)"}};
  k.configure = [flags = k.flags](const ModelFlagValues& v) -> std::shared_ptr<const ModelSpec> {
    const FlagReader r(flags, v);
    GptConfig c;
    c.n_layer = r.integer("n-layer", 1);
    c.n_head = r.integer("n-head", 1);
    c.n_embd = r.integer("n-embd", 1);
    c.block_size = r.integer("block-size", 1);
    c.dropout = r.number("dropout");
    const std::string attention = r.text("attention");
    if (attention == "auto") c.attention = AttentionKernels::automatic;
    else if (attention == "cudnn") c.attention = AttentionKernels::cudnn;
    else if (attention == "fused") c.attention = AttentionKernels::fused;
    else if (attention == "composite") c.attention = AttentionKernels::composite;
    else throw std::invalid_argument("--attention must be auto, cudnn, fused or composite, got '" + attention + "'");
    const std::string gelu = r.text("gelu");
    if (gelu != "erf" && gelu != "tanh") throw std::invalid_argument("--gelu must be erf or tanh, got '" + gelu + "'");
    c.gelu_tanh = gelu == "tanh";
    DataFlags d;
    d.format = r.text("data-format");
    if (d.format != "auto" && d.format != "text" && d.format != "llmc" && d.format != "u16")
      throw std::invalid_argument("--data-format must be auto, text, llmc or u16, got '" + d.format + "'");
    d.validation = r.text("val-data");
    for (const char* flag : {"val-data", "vocab-file"})  // an unset variable in a script: not "none"
      if (r.given(flag) && r.text(flag).empty())
        throw std::invalid_argument(std::string("--") + flag +
                                    ": an empty path (an unset variable?): give one, or leave the flag out");
    d.vocab_given = r.text("vocab-size") != "auto";
    if (d.vocab_given) {
      c.vocab_size = r.integer("vocab-size", 1);
      if (c.vocab_size > 65536)
        throw std::invalid_argument("--vocab-size must be at most 65536 (tokens are uint16), got " + r.text("vocab-size"));
    }
    if (c.n_embd % c.n_head != 0)
      throw std::invalid_argument("--n-embd must be a positive multiple of --n-head=" + std::to_string(c.n_head) +
                                  ", got " + std::to_string(c.n_embd));
    if (!(c.dropout >= 0.0 && c.dropout < 1.0)) throw std::invalid_argument("--dropout must be in [0, 1), got " + r.text("dropout"));
    SampleOptions s;
    s.tokens = r.integer("sample-tokens", 0);
    s.temperature = r.number("temperature");
    if (!(s.temperature > 0.0)) throw std::invalid_argument("--temperature must be a finite number > 0, got " + r.text("temperature"));
    s.top_k = r.integer("top-k", 1);
    d.prompt_tokens = parse_token_list(r.text("prompt-tokens"), c.vocab_size);
    d.vocab_file = r.text("vocab-file");
    d.prompt_given = r.given("prompt");
    return std::make_shared<GptSpec>(c, s, r.text("prompt"), std::move(d));
  };
  k.inert = [flags = k.flags](const ModelFlagValues& v) {
    const FlagReader r(flags, v);
    std::vector<InertFlag> inert;
    if (r.integer("sample-tokens", 0) == 0)
      for (const char* flag : {"temperature", "top-k", "prompt", "prompt-tokens", "vocab-file"})
        if (r.given(flag)) inert.push_back({flag, "only a sample uses it, and --sample-tokens is 0 (none is drawn)"});
    return inert;
  };
  return k;
}

}  // namespace amp::models
