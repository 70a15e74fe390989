#include "models/model_spec.h"

#include "runtime/core/parse_number.h"

#include <cmath>
#include <deque>
#include <filesystem>
#include <sstream>
#include <stdexcept>

namespace amp::models {

namespace {
std::deque<ModelKind>& kinds() {
  // The built-in kinds: one line each. A deque: a registration keeps references to the others valid.
  static std::deque<ModelKind> all = {mlp_kind(), mtl_kind(), gpt_kind()};
  return all;
}
}  // namespace

const std::deque<ModelKind>& model_kinds() { return kinds(); }

void register_model(ModelKind kind) {
  for (const ModelKind& k : kinds())
    if (k.name == kind.name) throw std::invalid_argument("register_model: a model named '" + kind.name + "' exists");
  kinds().push_back(std::move(kind));
}

const ModelKind& model_kind(const std::string& name) {
  std::string names;
  for (const ModelKind& k : kinds()) {
    if (k.name == name) return k;
    names += (names.empty() ? "" : ", ") + k.name;
  }
  throw std::invalid_argument("--model must be one of " + names + ", got " + name);
}

std::shared_ptr<const ModelSpec> configure_model(const std::string& name, const ModelFlagValues& values) {
  const ModelKind& kind = model_kind(name);
  for (const auto& [flag, value] : values) {
    bool known = false;
    for (const ModelFlag& f : kind.flags) known = known || f.name == flag;
    if (!known) throw std::invalid_argument("--" + flag + ": --model " + name + " has no such flag");
  }
  std::shared_ptr<const ModelSpec> spec = kind.configure(values);  // each value checked first
  for (const InertFlag& f : inert_model_flags(name, values)) throw std::invalid_argument("--" + f.flag + ": " + f.why);
  return spec;
}

std::vector<InertFlag> inert_model_flags(const std::string& name, const ModelFlagValues& values) {
  const ModelKind& kind = model_kind(name);
  return kind.inert ? kind.inert(values) : std::vector<InertFlag>{};
}

std::string FlagReader::text(const std::string& name) const {
  const auto it = values_.find(name);
  if (it != values_.end()) return it->second;
  for (const ModelFlag& f : flags_)
    if (f.name == name) return f.default_value;
  throw std::logic_error("FlagReader: no flag --" + name);
}

int64_t FlagReader::integer(const std::string& name, int64_t min) const {
  const std::string s = text(name);
  const ParsedInteger v = parse_integer(s);
  if (v.error == NumberError::out_of_range)
    throw std::invalid_argument("--" + name + " " + s + " is out of range (a whole number must fit in 64 bits: at most 9223372036854775807)");
  if (v.error != NumberError::none) throw std::invalid_argument("--" + name + " must be a whole number, got '" + s + "'");
  if (v.value < min) throw std::invalid_argument("--" + name + " must be >= " + std::to_string(min) + ", got " + s);
  return v.value;
}

double FlagReader::number(const std::string& name) const {
  const std::string s = text(name);
  const ParsedReal v = parse_real(s);
  if (v.error != NumberError::none) throw std::invalid_argument("--" + name + " must be a finite number, got '" + s + "'");
  return v.value;
}

long double parameter_bytes(long double parameters, const RunShape& run) {
  return parameters * (4.0L * (3 + run.optimizer_slots) + (run.autocast ? 2.0L : 0.0L));
}

long double data_file_bytes(const RunShape& run) {
  std::error_code ec;
  if (run.data == "synthetic" || !std::filesystem::is_regular_file(run.data, ec)) return 0;
  const auto size = std::filesystem::file_size(run.data, ec);
  return ec ? 0 : static_cast<long double>(size);
}

std::string memory_needed(long double bytes, long double physical_memory) {
  const long double gib = 1024.0L * 1024.0L * 1024.0L;
  std::ostringstream os;
  os.precision(3);
  os << bytes / gib << " GiB, and this machine has " << physical_memory / gib << " GiB (for each of its ranks)";
  return os.str();
}

}  // namespace amp::models
