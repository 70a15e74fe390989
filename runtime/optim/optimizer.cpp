#include "runtime/optim/optimizer.h"

#include <cstring>
#include <set>
#include <stdexcept>

#include "runtime/core/number_format.h"
#include "runtime/kernels/backend.h"
#include "runtime/ops/ops.h"

namespace amp::optim {

Optimizer::Optimizer(const std::vector<std::vector<Tensor>>& groups, const std::vector<double>& lrs)
    : group_lr_(lrs), initial_lr_(lrs.size()) {
  if (groups.empty()) throw std::invalid_argument("optimizer got an empty parameter list");
  std::set<const TensorImpl*> seen;
  for (size_t g = 0; g < groups.size(); ++g) {
    if (groups[g].empty()) throw std::invalid_argument("optimizer got an empty parameter list (group " + std::to_string(g) + ")");
    for (const Tensor& p : groups[g]) {
      if (!p.is_leaf() || !p.requires_grad())
        throw std::invalid_argument("optimizer can only optimize leaf tensors that require grad");
      if (!seen.insert(p.impl()).second)
        throw std::invalid_argument(groups.size() == 1 ? "a parameter appears twice in the parameter list"
                                                       : "some parameters appear more than once in the parameter groups");
      if (p.device() != groups[0][0].device())
        throw std::invalid_argument("optimizer parameters must all be on one device, got " + groups[0][0].device().str() +
                                    " and " + p.device().str());
      params_.push_back(p);
      group_of_.push_back(g);
      cohort_of_.push_back(g);  // one cohort per group to begin with
    }
    cohort_steps_.push_back(zeros({1}, DType::f32, groups[0][0].device()));
    lr_device_.push_back(full({1}, lrs.at(g), DType::f64, groups[0][0].device()));
    lr_written_.push_back(lrs.at(g));
  }
}

void Optimizer::write_lr() {
  for (size_t g = 0; g < group_lr_.size(); ++g) {
    // Bitwise: an lr of the same value written again costs nothing; any other change is written.
    if (std::memcmp(&group_lr_[g], &lr_written_[g], sizeof(double)) == 0) continue;
    fill_(lr_device_[g], group_lr_[g]);
    lr_written_[g] = group_lr_[g];
  }
}

void Optimizer::step(const Tensor& found_inf, const Tensor& grad_scale, const NormClip& clip) {
  // Read as one float32 where the parameters are (any other dtype or size was read as one, wrongly).
  const Device device = params_[0].device();
  if (found_inf.defined()) require_device_scalar(found_inf, DType::f32, device, "optimizer step: found_inf");
  if (grad_scale.defined()) require_device_scalar(grad_scale, DType::f32, device, "optimizer step: grad_scale");
  write_lr();
  std::map<size_t, std::vector<size_t>> present;  // cohort -> its parameters that have a gradient
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor g = params_[i].grad();
    if (!g.defined()) continue;
    if (g.shape() != params_[i].shape())
      throw std::logic_error("gradient shape " + shape_str(g.shape()) + " differs from parameter " +
                             shape_str(params_[i].shape()));
    // Every parameter that steps and its gradient checked before any of them steps: the fused steps
    // update float32 master weights (autocast makes the low-precision copies), and a tensor of
    // another dtype was refused by the kernel after the ones before it had stepped (their step count
    // not moved). Other dtypes are fine elsewhere (a scaler's unscale_ over float64 gradients).
    if (params_[i].dtype() != DType::f32)
      throw std::invalid_argument(std::string("optimizer step: parameter ") + std::to_string(i) + " is " +
                                  dtype_name(params_[i].dtype()) +
                                  "; the step updates float32 parameters (autocast makes the low-precision copies)");
    if (g.dtype() != DType::f32 || g.device() != device)
      throw std::invalid_argument("optimizer step: the gradient of parameter " + std::to_string(i) + " is " +
                                  dtype_name(g.dtype()) + " on " + g.device().str() + "; the step takes float32 on " +
                                  device.str() + ", as its parameter");
    present[cohort_of_[i]].push_back(i);
  }
  for (auto& [cohort, index] : present) {
    size_t members = 0;
    for (size_t c : cohort_of_) members += c == cohort;
    size_t target = cohort;
    if (index.size() != members) {
      // Only some members step: they continue from the same count in a cohort of their own.
      target = cohort_steps_.size();
      cohort_steps_.push_back(cohort_steps_[cohort].clone());
      for (size_t i : index) cohort_of_[i] = target;
    }
    step_group(group_of_[index[0]], index, cohort_steps_[target], found_inf, grad_scale, clip);
  }
}

void Optimizer::zero_grad(bool set_to_none) {
  for (Tensor& p : params_) {
    if (set_to_none) {
      p.set_grad(Tensor());
    } else if (p.grad().defined()) {
      Tensor g = p.grad();
      fill_(g, 0.0);
    }
  }
}

void Optimizer::keep_low_precision_copies(DType dtype) {
  if (dtype != DType::f32 && dtype != DType::f16 && dtype != DType::bf16)
    throw std::invalid_argument(std::string("keep_low_precision_copies: dtype must be float16 or bfloat16 (float32: "
                                            "none), got ") + dtype_name(dtype));
  copies_.clear();
  if (dtype == DType::f32) return;
  for (const Tensor& p : params_) copies_.push_back(cast(p.detach(), dtype));  // detached: no graph
}

std::vector<Tensor> Optimizer::grads() const {
  std::vector<Tensor> out;
  for (const Tensor& p : params_)
    if (p.grad().defined()) out.push_back(p.grad());
  return out;
}

std::vector<Tensor> Optimizer::param_group_params(size_t group) const {
  std::vector<Tensor> out;
  for (size_t i = 0; i < params_.size(); ++i)
    if (group_of_[i] == group) out.push_back(params_[i]);
  return out;
}

void Optimizer::set_lr(double lr) {
  for (double& l : group_lr_) l = lr;
}

int64_t Optimizer::step_count(size_t param) const {
  return static_cast<int64_t>(cohort_steps_.at(cohort_of_.at(param)).item());
}

std::vector<Tensor> Optimizer::select(const std::vector<Tensor>& all, const std::vector<size_t>& index) const {
  std::vector<Tensor> out;
  for (size_t i : index) out.push_back(all.at(i));
  return out;
}

std::vector<Tensor>& Optimizer::add_state(const std::string& name, const std::vector<bool>& in_group) {
  std::vector<Tensor>& v = state_[name];
  for (size_t i = 0; i < params_.size(); ++i)
    v.push_back(in_group.empty() || in_group.at(group_of_[i]) ? zeros_like(params_[i]) : Tensor());
  return v;
}

size_t Optimizer::state_bytes() const {
  size_t n = 0;
  for (const auto& [name, tensors] : state_)
    for (const Tensor& t : tensors)
      if (t.defined()) n += t.nbytes();
  return n;
}

OptimizerStateDict Optimizer::state_dict() const {
  OptimizerStateDict sd;
  std::map<size_t, double> count;  // cohort -> steps taken (one host read per cohort)
  for (size_t c = 0; c < cohort_steps_.size(); ++c) count[c] = cohort_steps_[c].item();
  for (size_t i = 0; i < params_.size(); ++i) {
    const size_t c = cohort_of_[i];
    if (count[c] == 0.0) continue;  // never stepped: no state yet, as in PyTorch
    std::map<std::string, Tensor>& st = sd.state[static_cast<int64_t>(i)];
    if (step_in_state()) st["step"] = cohort_steps_[c].reshape({}).clone();
    for (const auto& [name, tensors] : state_)
      if (tensors[i].defined()) st[name] = tensors[i];
  }
  for (size_t g = 0; g < num_param_groups(); ++g) {
    nlohmann::json h = group_hyper(g);
    if (initial_lr_[g]) h["initial_lr"] = *initial_lr_[g];
    h["params"] = nlohmann::json::array();
    for (size_t i = 0; i < params_.size(); ++i)
      if (group_of_[i] == g) h["params"].push_back(i);
    sd.param_groups.push_back(h);
  }
  return sd;
}

void Optimizer::require_group_keys(const char* optimizer, size_t group, const nlohmann::json& h,
                                   std::initializer_list<const char*> keys) {
  for (const char* k : keys) {
    if (h.contains(k)) continue;
    std::string theirs;
    for (const auto& [key, value] : h.items())
      if (key != "params") theirs += (theirs.empty() ? "'" : ", '") + key + "'";
    throw std::invalid_argument(std::string(optimizer) + " state_dict, parameter group " + std::to_string(group) +
                                ": no '" + k + "' (its keys: " + (theirs.empty() ? "none" : theirs) +
                                "): another optimizer's state dict?");
  }
}

void Optimizer::load_state_dict(const OptimizerStateDict& sd) {
  if (!sd.param_groups.is_array() || sd.param_groups.size() != num_param_groups())
    throw std::invalid_argument("loaded state dict has a different number of parameter groups");
  // Saved ids map to this optimizer's parameters in order, group by group (PyTorch's rule).
  std::map<int64_t, size_t> index_of;
  size_t next = 0;
  for (size_t g = 0; g < num_param_groups(); ++g) {
    const nlohmann::json& h = sd.param_groups[g];
    if (!h.is_object() || !h.contains("params") || !h["params"].is_array())
      throw std::invalid_argument("loaded state dict: parameter group " + std::to_string(g) + " has no 'params' list");
    if (h["params"].size() != param_group_params(g).size())
      throw std::invalid_argument("loaded state dict contains a parameter group that doesn't match the size of optimizer's group");
    for (const auto& id : h["params"]) {
      if (!id.is_number_integer()) throw std::invalid_argument("loaded state dict: a parameter id is not an integer");
      // A duplicated id gave its state to the later parameter and zeros to the earlier one.
      if (!index_of.emplace(id.get<int64_t>(), next++).second)
        throw std::invalid_argument("loaded state dict: parameter id " + std::to_string(id.get<int64_t>()) + " is listed twice");
    }
  }
  std::vector<const std::map<std::string, Tensor>*> saved(params_.size(), nullptr);
  for (const auto& [id, st] : sd.state) {
    auto it = index_of.find(id);
    if (it == index_of.end()) throw std::invalid_argument("loaded state dict has state for unknown parameter " + std::to_string(id));
    saved[it->second] = &st;
  }
  auto expect = [](const std::map<std::string, Tensor>& st, const std::string& name, const Shape& shape, size_t i) {
    auto it = st.find(name);
    if (it == st.end() || !it->second.defined())
      throw std::invalid_argument("optimizer state of parameter " + std::to_string(i) + " is missing '" + name + "'");
    if (it->second.numel() != shape_numel(shape))
      throw std::invalid_argument("optimizer state '" + name + "' of parameter " + std::to_string(i) + " has shape " +
                                  shape_str(it->second.shape()) + ", expected " + shape_str(shape));
    return it->second;
  };
  for (size_t i = 0; i < params_.size(); ++i) {
    if (saved[i] == nullptr) continue;
    if (step_in_state()) {
      // A count of steps: a negative one gave a NaN bias correction and NaN parameters at the next step.
      const double n = expect(*saved[i], "step", {}, i).item();
      if (!(n >= 0.0 && n <= 1e15))
        throw std::invalid_argument("optimizer state 'step' of parameter " + std::to_string(i) + " is " + float_repr(n) +
                                    ": a count of steps taken, from 0 to 1e15");
    }
    for (const auto& [name, tensors] : state_)
      if (tensors[i].defined()) expect(*saved[i], name, tensors[i].shape(), i);
  }
  for (size_t g = 0; g < num_param_groups(); ++g) {
    const nlohmann::json& h = sd.param_groups[g];
    if (h.contains("initial_lr") && !h["initial_lr"].is_number())
      throw std::invalid_argument("loaded state dict: parameter group " + std::to_string(g) + "'s 'initial_lr' is not a number");
  }
  // The groups' hyperparameters all or none: each group's are checked as they are taken, and a group
  // refused after others were taken puts those back (a failed load leaves the optimizer as it was).
  std::vector<nlohmann::json> before;
  for (size_t g = 0; g < num_param_groups(); ++g) before.push_back(group_hyper(g));
  for (size_t g = 0; g < num_param_groups(); ++g) {
    try {
      load_group_hyper(g, sd.param_groups[g]);
    } catch (...) {
      for (size_t k = 0; k < g; ++k) load_group_hyper(k, before[k]);
      throw;
    }
  }
  for (size_t g = 0; g < num_param_groups(); ++g) {
    const nlohmann::json& h = sd.param_groups[g];
    initial_lr_[g] = h.contains("initial_lr") ? std::optional<double>(h["initial_lr"].get<double>()) : std::nullopt;
  }
  std::vector<double> steps(params_.size(), 0.0);
  for (auto& [name, tensors] : state_)
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (!tensors[i].defined()) continue;
      Tensor dst = tensors[i];
      if (saved[i] != nullptr) copy_(dst, saved[i]->at(name).reshape(dst.shape()).to(dst.dtype()).to(dst.device()));
      else fill_(dst, 0.0);
    }
  for (size_t i = 0; i < params_.size(); ++i)
    if (saved[i] != nullptr) steps[i] = step_in_state() ? saved[i]->at("step").item() : 1.0;
  // Parameters of a group with equal step counts share a cohort again (loading is not a hot path).
  std::map<std::pair<size_t, double>, size_t> cohort_of_key;
  cohort_steps_.clear();
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto key = std::make_pair(group_of_[i], steps[i]);
    auto it = cohort_of_key.find(key);
    if (it == cohort_of_key.end()) {
      it = cohort_of_key.emplace(key, cohort_steps_.size()).first;
      cohort_steps_.push_back(full({1}, steps[i], DType::f32, params_[0].device()));
    }
    cohort_of_[i] = it->second;
  }
}

}  // namespace amp::optim
