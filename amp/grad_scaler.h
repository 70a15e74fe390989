// GradScaler: dynamic loss scaling with PyTorch's semantics (torch.cuda.amp.GradScaler), plus the
// peers' extensions (hysteresis, min/max scale, error at the minimum) and, with a communicator, a
// found_inf that every rank agrees on.
//
// The scale, the growth tracker and each optimizer's found_inf live on the parameters' device. The
// step path never reads them on the host: the optimizer's fused step reads found_inf itself.
#pragma once
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "runtime/optim/optimizer.h"
#include "runtime/tensor.h"

namespace amp {

struct GradScalerOptions {
  float init_scale = 65536.0f;
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
  int growth_interval = 2000;
  bool enabled = true;
  // false: a constant scale (Megatron's ConstantGradScaler): overflows still skip the step, but
  // update() never changes the scale.
  bool dynamic = true;
  // Extensions (DeepSpeed, Megatron); the defaults keep PyTorch's behaviour.
  int hysteresis = 1;  // consecutive overflows tolerated before a backoff (1 = back off at once)
  float min_scale = 0.0f;
  float max_scale = std::numeric_limits<float>::infinity();
  bool error_at_min_scale = false;  // throw when the scale overflows while already at min_scale
  Device device = kCPU;
};

class GradScaler {
 public:
  // comm: when given, found_inf is summed over its ranks before any step or update (every rank then
  // sees a non-zero total if any rank overflowed; PyTorch sums found_inf over devices the same way).
  explicit GradScaler(GradScalerOptions options = {}, comm::Communicator* comm = nullptr);

  Tensor scale(const Tensor& loss) const;
  std::vector<Tensor> scale(const std::vector<Tensor>& losses) const;
  // Multiplies opt's gradients by 1/scale (fp64 reciprocal) and records found_inf, in one fused pass.
  void unscale_(optim::Optimizer& opt);
  // The optimizer's step, which skips itself when found_inf is set. Without an explicit unscale_
  // it checks the scaled gradients read-only and the fused step unscales them in its own pass
  // (writing them back unscaled, as PyTorch's fused optimizers do).
  void step(optim::Optimizer& opt);
  // _amp_update_scale_ from this iteration's found_inf; resets every optimizer's state.
  void update();
  void update(float new_scale);

  float get_scale() const;  // 1 when disabled; reads the device value
  float get_growth_factor() const { return options_.growth_factor; }
  void set_growth_factor(float v);
  float get_backoff_factor() const { return options_.backoff_factor; }
  void set_backoff_factor(float v);
  int get_growth_interval() const { return options_.growth_interval; }
  void set_growth_interval(int v);
  int get_growth_tracker() const;
  bool is_enabled() const { return options_.enabled; }
  const GradScalerOptions& options() const { return options_; }
  // The found_inf of opt's last unscale_ (after the cross-rank agreement once step/update ran).
  bool found_inf(const optim::Optimizer& opt) const;
  // Sums t (1-element float32, on the scaler's device) over the ranks in the same collective as this
  // iteration's found_inf agreement: one small collective a step where there would be two. Returns
  // false when this scaler runs no collective (disabled, no communicator, or one rank): the caller
  // reduces t itself. Call it before step() or update().
  bool sum_with_found_inf(const Tensor& t);

  // Device-side values for logging without a host sync: a copy of the current scale, and the
  // found_inf total that the last update() acted on (undefined before the first update).
  Tensor scale_snapshot() const;
  Tensor last_found_inf() const { return last_found_inf_; }

  // Keys: scale, growth_factor, backoff_factor, growth_interval, _growth_tracker (PyTorch's).
  std::map<std::string, double> state_dict() const;
  void load_state_dict(const std::map<std::string, double>& state);

 private:
  enum class Stage { ready, unscaled, stepped };
  struct PerOptimizer {
    Stage stage = Stage::ready;
    Tensor found_inf;  // 1-element f32 on the device; undefined until unscale_ saw a gradient
    bool agreed = false;  // all-reduced over ranks
  };
  void validate() const;
  // opt's gradients, none of them fp16 (PyTorch's error otherwise), with a fresh found_inf for st.
  static std::vector<Tensor> checked_grads(optim::Optimizer& opt, PerOptimizer* st);
  Tensor scale_view() const;  // 0-d view of state_[0]
  void agree_on_found_inf();  // one small collective for every optimizer still pending

  GradScalerOptions options_;
  comm::Communicator* comm_;
  Tensor state_;  // [scale, growth_tracker, hysteresis_left], f32 on the device
  std::map<const optim::Optimizer*, PerOptimizer> per_optimizer_;
  std::vector<Tensor> riders_;  // summed with the next agreement (sum_with_found_inf)
  Tensor last_found_inf_;
};

}  // namespace amp
