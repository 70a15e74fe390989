// Learning-rate schedulers, as torch.optim.lr_scheduler (2.x): each sets every parameter group's lr
// by PyTorch's own recursive ("chainable") formula, so that the numbers are PyTorch's to the last
// bit, and uses the closed form where PyTorch does (SequentialLR restarting a scheduler at a
// milestone). Construction takes the first step (epoch 0) as PyTorch's does; call step() after
// each optimizer step.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "runtime/optim/optimizer.h"

namespace amp::optim {

class SequentialLR;

class LRScheduler {
 public:
  virtual ~LRScheduler() = default;
  LRScheduler(const LRScheduler&) = delete;
  LRScheduler& operator=(const LRScheduler&) = delete;

  virtual void step();
  const std::vector<double>& get_last_lr() const { return last_lr_; }
  int64_t last_epoch() const { return last_epoch_; }
  const std::vector<double>& base_lrs() const { return base_lrs_; }

  // PyTorch's state_dict() under its keys: "last_epoch", "_step_count", "base_lrs", "_last_lr" and
  // the scheduler's own ("step_size", "gamma", "T_max", ...; SequentialLR's schedulers in
  // "_schedulers"; a LambdaLR's lambdas are not saved, "lr_lambdas" holds nulls, as PyTorch's for
  // functions). To resume as PyTorch does: build the optimizer and the scheduler, then load the
  // optimizer's state (its groups' lrs) and this. load_state_dict checks everything first, naming the
  // key, and takes all of it or nothing; it sets no lr (the optimizer's state holds them).
  nlohmann::json state_dict() const;
  void load_state_dict(const nlohmann::json& state);

 protected:
  explicit LRScheduler(Optimizer& opt);
  // Records each group's initial_lr (the first scheduler on an optimizer sets it) as base_lrs: once,
  // after the derived constructor's checks (as PyTorch's check before their base's __init__), so that
  // a scheduler refused leaves the optimizer as it was.
  void take_base_lrs();
  // The lrs of the epoch last_epoch_, from the groups' current lrs (PyTorch's get_lr).
  virtual std::vector<double> get_lr() const = 0;
  // The closed form at last_epoch_ (PyTorch's _get_closed_form_lr; get_lr where there is none).
  virtual std::vector<double> closed_form_lr() const { return get_lr(); }
  // Epoch 0 (base_lrs taken first): derived constructors end with this, as PyTorch's base
  // constructor ends with step().
  void initial_step();
  void apply(const std::vector<double>& lrs);
  // The scheduler's own entries of its state dict; load_own checks them (throws std::invalid_argument
  // naming the key) and, when take, takes them.
  virtual nlohmann::json own_state() const { return nlohmann::json::object(); }
  virtual void load_own(const nlohmann::json& state, bool take) { (void)state, (void)take; }
  double group_lr(size_t g) const { return opt_.lr(g); }
  size_t groups() const { return opt_.num_param_groups(); }

  Optimizer& opt_;
  std::vector<double> base_lrs_;
  int64_t last_epoch_ = -1;
  int64_t step_count_ = 0;

 private:
  friend class SequentialLR;
  void step_to(int64_t epoch);  // step(epoch): the closed form at epoch
  void load(const nlohmann::json& state, bool take);  // load_state_dict's two passes
  void set_last_lr(std::vector<double> lrs) { last_lr_ = std::move(lrs); }
  std::vector<double> last_lr_;
};

// lr = base_lr * lambda(epoch); one lambda for every group, or one per group.
class LambdaLR : public LRScheduler {
 public:
  using Lambda = std::function<double(int64_t)>;
  LambdaLR(Optimizer& opt, Lambda lr_lambda);
  LambdaLR(Optimizer& opt, std::vector<Lambda> lr_lambdas);

 protected:
  std::vector<double> get_lr() const override;
  nlohmann::json own_state() const override;
  void load_own(const nlohmann::json& state, bool take) override;

 private:
  std::vector<Lambda> lambdas_;
};

// Multiplies the lr by gamma every step_size epochs.
class StepLR : public LRScheduler {
 public:
  StepLR(Optimizer& opt, int64_t step_size, double gamma = 0.1);

 protected:
  std::vector<double> get_lr() const override;
  std::vector<double> closed_form_lr() const override;
  nlohmann::json own_state() const override;
  void load_own(const nlohmann::json& state, bool take) override;

 private:
  int64_t step_size_;
  double gamma_;
};

// The factor moves linearly from start_factor to end_factor over total_iters epochs.
class LinearLR : public LRScheduler {
 public:
  LinearLR(Optimizer& opt, double start_factor = 1.0 / 3.0, double end_factor = 1.0, int64_t total_iters = 5);

 protected:
  std::vector<double> get_lr() const override;
  std::vector<double> closed_form_lr() const override;
  nlohmann::json own_state() const override;
  void load_own(const nlohmann::json& state, bool take) override;

 private:
  double start_, end_;
  int64_t total_iters_;
};

// Half a cosine from base_lr down to eta_min over t_max epochs (and back up after, as PyTorch's).
class CosineAnnealingLR : public LRScheduler {
 public:
  CosineAnnealingLR(Optimizer& opt, int64_t t_max, double eta_min = 0.0);

 protected:
  std::vector<double> get_lr() const override;
  std::vector<double> closed_form_lr() const override;
  nlohmann::json own_state() const override;
  void load_own(const nlohmann::json& state, bool take) override;

 private:
  int64_t t_max_;
  double eta_min_;
};

// Runs schedulers[i] from milestones[i-1] on (restarted at its epoch 0 there): warmup then cosine.
class SequentialLR : public LRScheduler {
 public:
  // schedulers: all on opt, constructed in order just before; milestones: one fewer, increasing.
  SequentialLR(Optimizer& opt, std::vector<std::unique_ptr<LRScheduler>> schedulers, std::vector<int64_t> milestones);
  void step() override;

 protected:
  std::vector<double> get_lr() const override { return get_last_lr(); }
  nlohmann::json own_state() const override;
  void load_own(const nlohmann::json& state, bool take) override;

 private:
  std::vector<std::unique_ptr<LRScheduler>> schedulers_;
  std::vector<int64_t> milestones_;
};

}  // namespace amp::optim
