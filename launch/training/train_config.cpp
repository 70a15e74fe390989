// The trainer's configuration mapped to the runtime's objects: the scaler's options and the
// learning-rate schedule.
#include "launch/training/train_config.h"

#include <memory>
#include <vector>

namespace amp::launch {

std::unique_ptr<optim::LRScheduler> make_scheduler(const TrainConfig& c, optim::Optimizer& opt) {
  if (c.lr_schedule == LrSchedule::constant) return nullptr;
  // Cosine: LinearLR from lr / (W + 1) to lr over W steps, then CosineAnnealingLR down to min_lr at
  // the decay step, then min_lr (a LambdaLR), chained by SequentialLR as a PyTorch user writes it.
  const int64_t warmup = c.warmup_steps;
  const int64_t decay = c.decay_steps > 0 ? c.decay_steps : c.steps;
  std::vector<std::unique_ptr<optim::LRScheduler>> parts;
  std::vector<int64_t> milestones;
  if (warmup > 0) {
    parts.push_back(std::make_unique<optim::LinearLR>(opt, 1.0 / static_cast<double>(warmup + 1), 1.0, warmup));
    milestones.push_back(warmup);
  }
  parts.push_back(std::make_unique<optim::CosineAnnealingLR>(opt, decay - warmup, c.min_lr));
  if (decay < c.steps) {
    const double floor = c.lr > 0.0 ? c.min_lr / c.lr : 0.0;
    parts.push_back(std::make_unique<optim::LambdaLR>(opt, [floor](int64_t) { return floor; }));
    milestones.push_back(decay);
  }
  if (parts.size() == 1) return std::move(parts[0]);
  return std::make_unique<optim::SequentialLR>(opt, std::move(parts), std::move(milestones));
}

GradScalerOptions scaler_options(const TrainConfig& c) {
  GradScalerOptions o;
  o.init_scale = c.init_scale;
  o.growth_factor = c.growth_factor;
  o.backoff_factor = c.backoff_factor;
  o.growth_interval = c.growth_interval;
  o.hysteresis = c.hysteresis;
  o.min_scale = c.min_scale;
  o.max_scale = c.max_scale;
  switch (c.loss_scale.kind) {
    case LossScale::Kind::auto_: o.enabled = c.amp == AmpMode::fp16; break;  // bf16 needs no scaling
    case LossScale::Kind::dynamic: o.enabled = true; break;
    case LossScale::Kind::off: o.enabled = false; break;
    case LossScale::Kind::constant:
      o.enabled = true;
      o.dynamic = false;
      o.init_scale = c.loss_scale.value;
      break;
  }
  return o;
}

models::RunShape run_shape(const TrainConfig& c) {
  models::RunShape r;
  r.data = c.data;
  r.batch_size = c.batch_size;
  r.optimizer_slots = c.optimizer == OptimizerKind::adamw ? 2 : c.momentum > 0.0 ? 1 : 0;
  r.autocast = c.amp != AmpMode::off;
  r.autocast_dtype = c.amp == AmpMode::fp16 ? DType::f16 : c.amp == AmpMode::bf16 ? DType::bf16 : DType::f32;
  if (c.device != DeviceKind::auto_) r.device = c.device == DeviceKind::cuda ? DeviceType::cuda : DeviceType::cpu;
  return r;
}

}  // namespace amp::launch
