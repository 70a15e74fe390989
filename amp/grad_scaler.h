// GradScaler: dynamic loss scaling with PyTorch's semantics (torch.cuda.amp.GradScaler), plus the
// peers' extensions (hysteresis, min/max scale, error at the minimum) and, for a library user who
// gives it a communicator, a found_inf that every rank agrees on. A training loop that reduces its own
// figures (launch/training) gives it none: it sums found_inf_tensor() with them, then calls step().
//
// As in PyTorch, the scale (0-dim float32) and the growth tracker (an integer) are created by the
// first scale() call, on the device of the first output it scales; each optimizer's found_inf lives
// on its gradients' device. The step path never reads them on the host: the optimizer's fused step
// reads found_inf itself.
#pragma once
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "runtime/optim/optimizer.h"
#include "runtime/core/tensor.h"

namespace amp {

struct GradScalerOptions {
  // Doubles, as PyTorch keeps its Python floats: the scale is stored in float32 and each update
  // computes (float)((double)scale * factor).
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
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
};

class GradScaler {
 public:
  // comm: when given, found_inf is summed over its ranks before any step or update (every rank then
  // sees a non-zero total if any rank overflowed; PyTorch sums found_inf over devices the same way).
  // Without one, the scaler runs no collective: a caller with several ranks sums found_inf_tensor()
  // over them itself, between unscale_ (or check_inf_) and step.
  explicit GradScaler(GradScalerOptions options = {}, comm::Communicator* comm = nullptr);
  // Not copyable: a copy would share the scale and the growth tracker (device tensors) but not the
  // per-optimizer state, and one's update() would change the other's scale. Movable.
  GradScaler(const GradScaler&) = delete;
  GradScaler& operator=(const GradScaler&) = delete;
  GradScaler(GradScaler&&) = default;
  GradScaler& operator=(GradScaler&&) = default;

  // outputs * scale, by ordinary type promotion (a float16 [N] output stays float16; a 0-dim loss
  // becomes float32). The first call creates the scaler's state on the output's device.
  Tensor scale(const Tensor& outputs);
  // Nested lists keep their structure, as PyTorch's scale() of an iterable does.
  template <class T>
  std::vector<T> scale(const std::vector<T>& outputs) {
    std::vector<T> out;
    out.reserve(outputs.size());
    for (const T& o : outputs) out.push_back(scale(o));
    return out;
  }
  // Multiplies opt's gradients by 1/scale (fp64 reciprocal) and records found_inf, in one fused pass
  // per dtype. float16 gradients are refused, as PyTorch's unscale_ refuses them.
  void unscale_(optim::Optimizer& opt);
  // PyTorch's _unscale_grads_: opt's gradients times 1/scale, grouped by dtype, found_inf set when any
  // is not finite; allow_fp16 lets float16 gradients through (callers that keep fp16 gradients on
  // purpose). Touches none of the scaler's state.
  static void unscale_grads_(optim::Optimizer& opt, const Tensor& scale, Tensor& found_inf, bool allow_fp16);
  // PyTorch's _check_inf_per_device (ours: one device per optimizer): records opt's found_inf by a
  // read-only check of the scaled gradients, which step() then unscales in the optimizer's own pass.
  // Returns found_inf_tensor(opt). Before step(), instead of unscale_.
  Tensor check_inf_(optim::Optimizer& opt);
  // The same check made by the caller's own pass over opt's gradients, one that reads them anyway
  // (the trainer's gradient norm, comm/chunked_norm.h): fused(scale, found_inf) must read every one
  // of opt.grads() (still scaled by `scale`, on their device) and set found_inf to 1 where one is not
  // finite unscaled, as Backend::check_finite would. The per-tensor flags (set_per_tensor_flags) are
  // then written only where found_inf is set (Backend::nonfinite_flags_if_found): a step that finds
  // nothing reads each gradient once for the check and the norm together.
  Tensor check_inf_(optim::Optimizer& opt, const std::function<void(const Tensor& scale, const Tensor& found_inf)>& fused);
  // The optimizer's step, which skips itself when found_inf is set. Without an explicit unscale_
  // it checks the scaled gradients read-only and the fused step unscales them in its own pass
  // (writing them back unscaled, as PyTorch's fused optimizers do). A defined clip.total_norm (the
  // unscaled gradients' norm) clips them in that pass too (Optimizer::step).
  void step(optim::Optimizer& opt, const NormClip& clip = NormClip());
  // _amp_update_scale_ from this iteration's found_inf; resets every optimizer's state.
  // Every one of unscale_, step and update throws before the first scale(), as PyTorch's does.
  void update();
  void update(double new_scale);
  // A 1-element float32 tensor on the scaler's device, that requires no gradient (PyTorch's rule).
  void update(const Tensor& new_scale);

  // The scale (init_scale before the first scale(); 1 when disabled); reads the device value.
  double get_scale() const;
  double get_growth_factor() const { return options_.growth_factor; }
  void set_growth_factor(double v);
  double get_backoff_factor() const { return options_.backoff_factor; }
  void set_backoff_factor(double v);
  int get_growth_interval() const { return options_.growth_interval; }
  void set_growth_interval(int v);
  int get_growth_tracker() const;
  bool is_enabled() const { return options_.enabled; }
  const GradScalerOptions& options() const { return options_; }
  // The found_inf of opt's last unscale_ (after the cross-rank agreement once step/update ran).
  bool found_inf(const optim::Optimizer& opt) const;
  // PyTorch's _found_inf_per_device (one device): the 1-element float32 found_inf that unscale_ or
  // check_inf_ recorded for opt, on its gradients' device, which step() and update() read. A caller
  // that runs its own collectives sums it over the ranks in place before step(). Undefined when
  // none was recorded this iteration.
  Tensor found_inf_tensor(const optim::Optimizer& opt) const;
  // Ours: the scale that opt's gradients still carry, on their device, between check_inf_ and
  // step() (which unscales them in its own pass); undefined when they are unscaled or not scaled
  // (after unscale_, before a check, or disabled). For a caller that reads them meanwhile: the
  // trainer's gradient norm, computed on the unscaled values without a pass that writes them.
  Tensor pending_scale(const optim::Optimizer& opt) const;
  // Ours: with per-tensor flags on, unscale_ and check_inf_ also say which gradients were not finite,
  // in the same fused pass (Backend::unscale_and_check's per_tensor): a float32 [opt.grads().size()]
  // on the gradients' device, 1 where that gradient held inf or NaN, for a caller to read back only
  // after a skipped step (on a GPU the gradients themselves are gone by then). Undefined when off, or
  // before a check this iteration, or where unscale_'s gradients have several dtypes.
  void set_per_tensor_flags(bool on) { per_tensor_flags_ = on; }
  Tensor nonfinite_per_tensor(const optim::Optimizer& opt) const;

  // Device-side values for logging without a host sync: a copy of the current scale (on `device`
  // before the first scale()), and the found_inf total that the last update() acted on (undefined
  // before the first update).
  Tensor scale_snapshot(Device device) const;
  Tensor last_found_inf() const { return last_found_inf_; }

  // Keys: scale, growth_factor, backoff_factor, growth_interval, _growth_tracker (PyTorch's), and
  // _hysteresis_left when hysteresis > 1 (ours).
  std::map<std::string, double> state_dict() const;
  void load_state_dict(const std::map<std::string, double>& state);

 private:
  enum class Stage { ready, checked, unscaled, stepped };  // checked: check_inf_ ran
  struct PerOptimizer {
    Stage stage = Stage::ready;
    Tensor found_inf;  // 1-element f32 on the device; undefined until unscale_ saw a gradient
    Tensor per_tensor;  // set_per_tensor_flags: [gradients] f32 on the device
    bool agreed = false;  // all-reduced over ranks
  };
  void validate() const;
  void require_state(const char* funcname) const;  // PyTorch's "Attempted step but _scale is None"
  void lazy_init(Device device);
  // opt's gradients, none of them fp16 (PyTorch's error otherwise), with a fresh found_inf for st.
  std::vector<Tensor> checked_grads(optim::Optimizer& opt, PerOptimizer* st) const;
  void agree_on_found_inf();  // with a communicator: one small collective for every optimizer still pending

  GradScalerOptions options_;
  comm::Communicator* comm_;
  Tensor scale_;    // 0-dim float32, undefined until the first scale()
  Tensor tracker_;  // int64 [growth_tracker, hysteresis_left], beside scale_
  int64_t init_growth_tracker_ = 0;  // what load_state_dict set before the state exists
  int64_t init_hysteresis_left_ = -1;  // likewise (-1: options_.hysteresis)
  int64_t hysteresis_left() const { return init_hysteresis_left_ < 0 ? options_.hysteresis : init_hysteresis_left_; }
  std::map<const optim::Optimizer*, PerOptimizer> per_optimizer_;
  Tensor last_found_inf_;
  bool per_tensor_flags_ = false;
};

}  // namespace amp
