// The model registry (models/model_spec.h): a model defined here, outside models/, registers itself
// and trains through amp_train's own path (the CLI's parser, its checks and the trainer) with no
// edit anywhere else; its flags are listed, parsed, checked and refused for other models like the
// built-in ones'. The oracle: a one-weight regression whose least-squares solution is known.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "comm/local_communicator.h"
#include "launch/cli.h"
#include "launch/training/trainer.h"
#include "models/model_spec.h"
#include "runtime/core/parse_number.h"
#include "runtime/nn/layers.h"
#include "runtime/ops/ops.h"

namespace amp {
namespace {

// y = slope * x, x = 1, 2, ... 8 repeating: a Linear(1, 1) without bias learns w -> slope.
class Line final : public models::Dataset {
 public:
  explicit Line(double slope) : slope_(slope) {}
  models::Batch rows(int64_t first, int64_t count) override {
    std::vector<double> x, y;
    for (int64_t j = first; j < first + count; ++j) {
      x.push_back(static_cast<double>(j % 8 + 1));
      y.push_back(slope_ * x.back());
    }
    models::Batch b;
    b.x = from_vector(x, {count, 1});
    b.targets = {from_vector(y, {count, 1})};
    b.first = first;
    return b;
  }
  std::string describe() const override { return "a line"; }

 private:
  double slope_;
};

class LineModel final : public models::TrainingModel {
 public:
  explicit LineModel(Generator& gen) : linear_(1, 1, gen, false) {}
  nn::Module& module() override { return linear_; }
  models::Losses losses(const models::Batch& b) override { return {{mse_loss(linear_(b.x), b.targets[0])}, Tensor()}; }

 private:
  nn::Linear linear_;
};

class LineSpec final : public models::ModelSpec {
 public:
  explicit LineSpec(double slope) : slope_(slope) {}
  void check(const models::RunShape& run, long double) const override {
    if (run.data != "synthetic") throw std::invalid_argument("--data: --model line makes its own data");
  }
  std::unique_ptr<models::TrainingModel> build(Generator& gen, Device) const override {
    return std::make_unique<LineModel>(gen);
  }
  std::unique_ptr<models::Dataset> data(const std::string&, uint64_t, Device) const override {
    return std::make_unique<Line>(slope_);
  }
  nlohmann::json checkpoint_identity() const override { return {{"model", {{"model", "line"}}}, {"dropout", 0.0}}; }
  std::string describe(const std::string&) const override { return "line"; }
  std::string size_flags() const override { return "nothing"; }

 private:
  double slope_;
};

void register_line() {
  static bool done = false;
  if (done) return;
  done = true;
  models::ModelKind k;
  k.name = "line";
  k.summary = "a test's one-weight regression";
  k.flags = {{"slope", "2.0", "line: the slope to learn"}};
  k.configure = [flags = k.flags](const models::ModelFlagValues& v) -> std::shared_ptr<const models::ModelSpec> {
    return std::make_shared<LineSpec>(models::FlagReader(flags, v).number("slope"));
  };
  models::register_model(k);
}

launch::CliResult parse(std::vector<std::string> args) {
  args.insert(args.begin(), "amp_train");
  std::vector<const char*> argv;
  for (const std::string& a : args) argv.push_back(a.c_str());
  return launch::parse_cli(static_cast<int>(argv.size()), argv.data(), 1);
}

// Numbers as typed in a flag or a list (runtime/core/parse_number.h, behind the model flags, the
// aggregators' arguments, --loss-scale, --inject-nonfinite and --prompt-tokens): what std::stod and
// std::stoll also took (a space, hexadecimal, inf, nan, trailing text) is refused.
TEST(ParseNumber, TakesWhatPeopleTypeAndNothingElse) {
  const std::pair<const char*, int64_t> integers[] = {{"3", 3}, {"-2", -2}, {"+7", 7}, {"007", 7}, {"0", 0},
                                                      {"9223372036854775807", INT64_MAX}, {"-9223372036854775808", INT64_MIN}};
  for (const auto& [text, value] : integers) {
    const ParsedInteger p = parse_integer(text);
    EXPECT_EQ(p.error, NumberError::none) << text;
    EXPECT_EQ(p.value, value) << text;
  }
  for (const char* text : {"", " 3", "3 ", "0x10", "1e3", "3.0", "+", "-", "1,2", "inf", "++1", "+-1", "3x", "٣"})
    EXPECT_EQ(parse_integer(text).error, NumberError::malformed) << "'" << text << "'";
  EXPECT_EQ(parse_integer("9223372036854775808").error, NumberError::out_of_range);
  EXPECT_EQ(parse_integer("-9223372036854775809").error, NumberError::out_of_range);
  const std::pair<const char*, double> reals[] = {{"0.5", 0.5}, {".5", 0.5}, {"2.", 2.0},    {"1e-3", 1e-3},
                                                  {"6.5E+4", 65000.0}, {"+1.5", 1.5}, {"-3", -3.0}, {"1e-310", 1e-310}};
  for (const auto& [text, value] : reals) {
    const ParsedReal p = parse_real(text);
    EXPECT_EQ(p.error, NumberError::none) << text;
    EXPECT_EQ(p.value, value) << text;
  }
  EXPECT_TRUE(std::signbit(parse_real("-0").value));
  for (const char* text : {"", " 1", "1 ", "0x1p-3", "0x10", "inf", "-inf", "nan", "1e", "e3", ".", "1.2.3", "--1", "1e+", "1,5"})
    EXPECT_EQ(parse_real(text).error, NumberError::malformed) << "'" << text << "'";
  for (const char* text : {"1e400", "-1e400", "1e-400"}) EXPECT_EQ(parse_real(text).error, NumberError::out_of_range) << text;
}

TEST(ModelRegistry, AModelDefinedOutsideModelsTrainsThroughAmpTrainsPath) {
  register_line();
  const launch::CliResult cli = parse({"--model", "line", "--slope", "-1.5", "--steps", "200", "--lr", "0.01",
                                       "--batch-size", "8", "--log-every", "0"});
  ASSERT_TRUE(cli.config) << cli.message;
  EXPECT_EQ(cli.config->model_flags.at("slope"), "-1.5");
  comm::LocalCommunicator comm;
  launch::Trainer trainer(*cli.config, comm, kCPU);
  const launch::TrainResult r = trainer.run();
  ASSERT_EQ(r.records.size(), 200u);
  const std::vector<double> w = trainer.model().parameters().at(0).to_vector();
  ASSERT_EQ(w.size(), 1u);
  EXPECT_NEAR(w[0], -1.5, 1e-4) << "the least-squares slope";
  EXPECT_LT(r.records.back().loss, 1e-6);
}

TEST(ModelRegistry, ItsFlagsAreListedCheckedAndRefusedForOtherModels) {
  register_line();
  const launch::CliResult help = parse({"--help"});
  EXPECT_NE(help.message.find("--slope arg (=2.0)"), std::string::npos) << help.message;
  std::string words;  // the help's text without its line breaks
  for (char ch : help.message)
    if (!std::isspace(static_cast<unsigned char>(ch)) || (!words.empty() && words.back() != ' ')) words += std::isspace(static_cast<unsigned char>(ch)) ? ' ' : ch;
  EXPECT_NE(words.find("line (a test's one-weight regression)"), std::string::npos) << help.message;
  const launch::CliResult bad = parse({"--model", "line", "--slope", "steep"});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.message.find("--slope must be a finite number, got 'steep'"), std::string::npos) << bad.message;
  const launch::CliResult other = parse({"--model", "mlp", "--slope", "3"});
  EXPECT_EQ(other.exit_code, 2);
  EXPECT_NE(other.message.find("--slope: only --model line uses it"), std::string::npos) << other.message;
  const launch::CliResult data = parse({"--model", "line", "--data", "x.safetensors"});
  EXPECT_EQ(data.exit_code, 2);
  EXPECT_NE(data.message.find("makes its own data"), std::string::npos) << data.message;
  const launch::CliResult unknown = parse({"--model", "cube"});
  EXPECT_EQ(unknown.exit_code, 2);
  EXPECT_NE(unknown.message.find("--model must be one of mlp, mtl, gpt, line"), std::string::npos) << unknown.message;
  EXPECT_THROW(models::register_model(models::model_kind("line")), std::invalid_argument);
}

}  // namespace
}  // namespace amp
