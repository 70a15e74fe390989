// One training step: autocast forward, scaled backward over micro-batches (or the multi-task
// backward), the reduction, unscale, clipping, the optimizer's step and the scale update, and its
// figures on their way to the host.
#include <chrono>
#include <cstdio>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "amp/clip_grad.h"
#include "amp/overflow.h"
#include "comm/chunked_norm.h"
#include "comm/coalesced.h"
#include "comm/sum_tree.h"
#include "jd/mtl_backward.h"
#include "jd/packed_jacobians.h"
#include "launch/training/interrupt.h"
#include "launch/training/trainer.h"
#include "runtime/kernels/cuda/cuda_support.h"
#include "runtime/kernels/backend.h"
#include "runtime/ops/autograd.h"
#include "runtime/ops/ops.h"

namespace amp::launch {

namespace {
// "task2", "task1, task3": J's rows are the tasks in order, named as the model names their heads.
std::string task_rows_str(const std::vector<int64_t>& rows) {
  std::string out;
  for (const int64_t k : rows) out += (out.empty() ? "task" : ", task") + std::to_string(k + 1);
  return out;
}

std::vector<int64_t> nonfinite_rows(const Tensor& flags) {  // a read of the device: after a skipped step only
  std::vector<int64_t> rows;
  const std::vector<double> v = flags.to_vector();
  for (size_t k = 0; k < v.size(); ++k)
    if (v[k] != 0.0) rows.push_back(static_cast<int64_t>(k));
  return rows;
}
}  // namespace

// The figures' order in the one read-back lives here only.
std::vector<Tensor> Trainer::StepFigures::packed() const {
  std::vector<Tensor> v = {loss, scale, found_inf, stop};
  if (grad_norm.defined()) v.push_back(grad_norm);
  v.insert(v.end(), task_losses.begin(), task_losses.end());
  return v;
}

void Trainer::StepFigures::unpack(const std::vector<double>& v, bool has_grad_norm, StepRecord* r) {
  size_t i = 0;
  r->loss = v.at(i++);
  r->scale = v.at(i++);
  r->skipped = v.at(i++) != 0.0;
  r->stop_requested = v.at(i++) != 0.0;
  r->grad_norm = has_grad_norm ? v.at(i++) : std::numeric_limits<double>::quiet_NaN();
  // A skipped step's gradients were not finite on some rank, not necessarily this one (--zero 0: rank
  // 0's norm is of its own copy): its norm is none, whatever rank 0 read.
  if (r->skipped) r->grad_norm = std::numeric_limits<double>::quiet_NaN();
  r->task_losses.assign(v.begin() + static_cast<long>(i), v.end());
}

void Trainer::multi_task_backward(const models::Losses& L) {
  jd::MtlBackwardOptions o;
  o.shared_params = model_->shared_parameters();
  o.tasks_params = model_->task_parameters();
  jd::mtl_backward(scaler_->scale(L.per_task), L.features, o);
  // This micro-batch's trunk Jacobian and heads' gradients, packed flat (jd/packed_jacobians.h), join
  // the tree of the step's micro-batches (comm/sum_tree.h); aggregate_jacobians() sums them over
  // ranks in the same order.
  jd::Packed leaf = jd::pack(o.shared_params, o.tasks_params);
  if (!step_.jacobian_tree)
    step_.jacobian_tree = std::make_unique<JacobianTree>([](Tensor& into, const Tensor& other) { add_(into, other); });
  step_.jacobian_tree->push(leaf.flat);
  step_.jacobian_tree->take_released();
  step_.jacobian_rows = leaf.rows;
}

std::vector<double> Trainer::aggregate_jacobians() {
  jd::Packed sum{step_.jacobian_tree->fold(), step_.jacobian_rows};
  comm_.ordered_sum(sum.flat);  // every rank's, in the tree's order
  // J's rows that hold an inf or NaN (an fp16 overflow of one task's backward). A robust aggregator
  // (trimmedmean) trims such a row away and returns a finite step, which the scaler's check of the
  // aggregated gradient never sees: the step is skipped for them, whatever the aggregator (step()).
  // One read-only pass over J, on the device: the flags are read back only after a skipped step.
  int64_t N = 0;
  for (const Tensor& p : model_->shared_parameters()) N += p.numel();
  std::vector<Tensor> rows;
  for (int64_t k = 0; k < sum.rows; ++k) rows.push_back(sum.flat.view(k * N, {N}));
  step_.jacobian_found = zeros({1}, DType::f32, device_);
  step_.jacobian_row_flags = zeros({sum.rows}, DType::f32, device_);
  backend_for(device_).check_finite(rows, Tensor(), step_.jacobian_found, step_.jacobian_row_flags);
  return jd::unpack_and_aggregate(sum, model_->shared_parameters(), model_->task_parameters(), *aggregator_);
}

void Trainer::provide_casts() const {
  if (!opt_->low_precision_copies().empty()) autocast_provide_casts(opt_->params(), opt_->low_precision_copies());
}

int64_t Trainer::first_sample(int64_t step) const {
  return (step - 1) * samples_per_step() + comm_.rank() * cfg_.micro_batches * cfg_.batch_size;
}

void Trainer::stage_inputs(int64_t step) {
  const int64_t B = cfg_.batch_size, K = cfg_.micro_batches;
  const int64_t first = first_sample(step);
  step_.batches.resize(static_cast<size_t>(K));
  for (int64_t m = 0; m < K; ++m) {
    models::Batch b = data_->rows(first + m * B, B);
    models::Batch& kept = step_.batches[static_cast<size_t>(m)];
    if (step_.use_graphs && kept.x.defined()) {  // the graph reads these very tensors: written, not replaced
      copy_(kept.x, b.x);
      for (size_t t = 0; t < b.targets.size(); ++t) copy_(kept.targets[t], b.targets[t]);
      kept.first = b.first;
    } else {
      kept = std::move(b);
    }
    if (step_.use_graphs && model_->reads_sample_index()) {  // dropout's counters, read by the replay's kernels
      if (!kept.first_index.defined()) kept.first_index = empty({1}, DType::i64, device_);
      fill_(kept.first_index, static_cast<double>(kept.first));
    }
  }
  // The stop flag (a rank got a stop signal) is summed over the ranks with the step's other figures:
  // every rank learns it from the same reduced figures, so every rank stops after the same step.
  if (!step_.stop_flag.defined()) step_.stop_flag = empty({1}, DType::f32, device_);
  fill_(step_.stop_flag, interrupt_signal() != 0 ? 1.0 : 0.0);
  if (!cfg_.inject_nonfinite.empty()) {
    if (!step_.inject_flag.defined()) step_.inject_flag = empty({1}, DType::f32, device_);
    bool here = false;
    for (const Injection& inj : cfg_.inject_nonfinite) here = here || (inj.step == step && inj.rank == comm_.rank());
    fill_(step_.inject_flag, here ? std::numeric_limits<double>::infinity() : 0.0);
  }
  opt_->write_lr();  // this step's learning rate, where the scheduler changed it
}

Trainer::StepFigures Trainer::device_step() {
  const int64_t K = cfg_.micro_batches;
  const std::vector<Tensor> params = model().parameters();
  const Tensor scale_used = scaler_->scale_snapshot(device_);

  opt_->zero_grad();
  // Each task's loss over the micro-batches, summed in the tree's order (comm/sum_tree.h) like the
  // gradients, so that the logged figures are rank-invariant too.
  std::vector<comm::SumTree<Tensor, void (*)(Tensor&, const Tensor&)>> task_trees;
  for (int64_t m = 0; m < K; ++m) {
    if (!multi_task()) reducer_->prepare_for_backward(/*sync=*/m == K - 1);
    const models::Batch& batch = step_.batches[static_cast<size_t>(m)];
    models::Losses L;
    {
      autocast ac = autocast_region();
      provide_casts();
      L = model_->losses(batch);
      // The mean over the step's samples: B / E, the same factor in every split (no division by
      // the ranks after the sum), so that a micro-batch's gradient does not depend on the split.
      if (const int64_t share = K * comm_.size(); share > 1)
        for (Tensor& l : L.per_task) l = div(l, static_cast<double>(share));
    }
    {
      NoGradGuard ng;
      for (size_t t = task_trees.size(); t < L.per_task.size(); ++t)
        task_trees.emplace_back([](Tensor& into, const Tensor& other) { add_(into, other); });
      for (size_t t = 0; t < L.per_task.size(); ++t)
        task_trees[t].push(L.per_task[t].detach().reshape({1}).to(DType::f32));
    }
    if (multi_task()) {
      // Every head gets its own loss's gradient; the trunk a Jacobian, aggregated after the last one.
      multi_task_backward(L);
      continue;
    }
    Tensor loss = L.per_task.at(0);
    if (cfg_.grad_penalty > 0.0) {
      // loss + lambda * ||grad loss||_2, the gradient taken through the scaled loss (PyTorch's recipe).
      std::vector<Tensor> g = grad({scaler_->scale(loss)}, params, {}, true, true);
      const Tensor scale = scaler_->scale_snapshot(device_);  // divided on the device: no host read
      Tensor sq = zeros({}, DType::f32, device_);
      for (const Tensor& t : g) sq = add(sq, sum(pow(div(t, scale), 2.0)));
      autocast ac = autocast_region();
      loss = add(loss, mul(sqrt(sq), cfg_.grad_penalty));
    }
    scaler_->scale(loss).backward();
  }
  if (multi_task()) {
    step_.jd_weights = aggregate_jacobians();  // gradients are now averaged over ranks (still scaled)
  } else {
    reducer_->finish();  // gradients are now summed over ranks (still scaled); under ZeRO-1 this rank's shard
    if (zero_) zero_->assign_grads();
  }
  std::vector<Tensor> task_sums;  // this rank's, then (after the collective) the step's
  for (auto& tree : task_trees) task_sums.push_back(tree.fold());

  // --inject-nonfinite: + inf on its steps and ranks, + 0 on the others, into the first gradient
  // element that this rank's optimizer reads (under ZeRO-1, of its shard; a rank with no element at
  // all has it added to its found_inf below).
  Tensor injected;
  if (step_.inject_flag.defined()) {
    for (const Tensor& p : opt_->params())
      if (p.numel() > 0 && p.grad().defined()) {
        injected = p.grad().view(0, {1});
        break;
      }
    if (injected.defined()) add_(injected, step_.inject_flag);
  }

  // found_inf: a read-only check, and the optimizer's pass unscales each gradient as it reads it
  // (GradScaler::step after check_inf_); the norm over the buckets' chunks reads them unscaled too
  // (chunked_sum_of_squares' grad_scale), and where it is computed it is the check: one read of
  // every gradient for both. The clamp (--clip-grad-value) and the multi-task model's norm read the
  // gradients themselves: unscale_ first then (a read and a write of every gradient).
  // The chunked norm (clipping, --log-grad-norm: a read of every gradient that PyTorch's loop does not
  // pay for, asked only) over fixed chunks of the buckets, or of where the buckets would hold the
  // gradients (one rank, one micro-batch: none), so that its bits depend neither on the ranks nor on
  // ZeRO-1 (comm/chunked_norm.h). Under ZeRO-1 it is a collective: every rank computes it here,
  // before the figures' collective, whether its scaler's check took it or not.
  Tensor squares;  // the chunked norm's sum of squares
  auto chunked_squares = [&](const Tensor& grad_scale, const Tensor& found_inf) {
    if (reducer_->passthrough()) return comm::chunked_sum_of_squares_unbucketed(reducer_->plan(), params, grad_scale, found_inf);
    return comm::chunked_sum_of_squares(reducer_->layout(), reducer_->buffers(), comm_, zero_ != nullptr, grad_scale, found_inf);
  };
  const bool chunked_norm = needs_grad_norm() && reducer_;
  if (cfg_.clip_grad_value > 0.0 || (needs_grad_norm() && !reducer_)) scaler_->unscale_(*opt_);
  else if (chunked_norm)
    scaler_->check_inf_(*opt_, [&](const Tensor& scale, const Tensor& found_inf) { squares = chunked_squares(scale, found_inf); });
  else scaler_->check_inf_(*opt_);
  if (chunked_norm && !squares.defined()) squares = chunked_squares(scaler_->pending_scale(*opt_), Tensor());
  step_.flags = scaler_->nonfinite_per_tensor(*opt_);  // on a GPU: which gradients, for a skipped step's message
  // The names, made once: the gradients checked are the same every step (in the same order), save
  // where some parameter got none, which changes their count.
  if (step_.flags.defined() && (!step_.flag_names || static_cast<int64_t>(step_.flag_names->size()) != step_.flags.numel()))
    step_.flag_names = gradient_names();
  // The step's one small collective: found_inf, the stop flag (a rank got a stop signal) and the
  // losses, summed over the ranks in the tree's order, so that every rank takes the same decision
  // (step or skip, stop or go on) from the same figures. The scaler's step then reads the agreed
  // found_inf.
  std::vector<Tensor> figures;
  if (Tensor found = scaler_->found_inf_tensor(*opt_); found.defined()) {
    if (step_.inject_flag.defined() && !injected.defined()) add_(found, step_.inject_flag);
    if (multi_task()) add_(found, step_.jacobian_found);  // 1 where J is not finite (the same J on every rank)
    figures.push_back(found);
  } else if (multi_task() && step_.jacobian_found.item() != 0.0) {  // no scaler: nothing can skip the step
    throw JobError("step " + std::to_string(step_.number) + ": the shared parameters' Jacobian is not finite (" +
                   task_rows_str(nonfinite_rows(step_.jacobian_row_flags)) + ") and no loss scaler skips steps "
                   "(--loss-scale off): stopping before the weights are corrupted");
  }
  figures.push_back(step_.stop_flag);
  figures.insert(figures.end(), task_sums.begin(), task_sums.end());
  comm::all_reduce_scalars(comm_, figures, comm::ReduceOp::sum);

  if (zero_ && device_.is_cpu()) {
    // On the CPU the figures are final at once: the names of this rank's pieces that were not
    // finite, before the parameters' gathering reuses the buckets (finish() prints them).
    step_.nonfinite.clear();
    if (scaler_->is_enabled() && scaler_->found_inf_tensor(*opt_).item() != 0.0)
      step_.nonfinite = nonfinite_gradients(zero_->named_pieces(model().named_parameters()));
  }
  // The norm: the chunked one's square root; the multi-task model's, over its parameters, as PyTorch's.
  Tensor grad_norm;
  NormClip clip;  // clipping by the norm in the optimizer's pass, unless the clamp reads the clipped gradients
  if (needs_grad_norm()) {
    grad_norm = chunked_norm ? sqrt(squares) : get_total_norm(opt_->grads(), 2.0, false);
    if (cfg_.clip_grad_norm > 0.0 && cfg_.clip_grad_value > 0.0) clip_grads_with_norm_(opt_->params(), cfg_.clip_grad_norm, grad_norm);
    else if (cfg_.clip_grad_norm > 0.0) clip = {grad_norm.to(DType::f32).to(device_), cfg_.clip_grad_norm};
  }  // else: not computed, null in the metrics
  if (cfg_.clip_grad_value > 0.0) clip_grad_value_(opt_->params(), cfg_.clip_grad_value);
  scaler_->step(*opt_, clip);
  scaler_->update();
  if (zero_) {
    if (listeners_.before_gather) listeners_.before_gather(step_.number);
    zero_->gather_parameters();  // each rank's updated pieces, to every rank
  }

  // The losses are means already (B / E each): summed over ranks, they are the step's mean.
  Tensor loss_sum = task_sums.at(0);
  for (size_t t = 1; t < task_sums.size(); ++t) loss_sum = add(loss_sum, task_sums[t]);
  if (!multi_task()) task_sums.clear();  // one loss: it is `loss` (a multi-task model of one task records it)
  const Tensor found = scaler_->is_enabled() ? scaler_->last_found_inf() : zeros({1}, DType::f32, device_);
  return StepFigures{loss_sum, scale_used, found, step_.stop_flag, grad_norm, task_sums};
}

std::shared_ptr<const std::vector<std::string>> Trainer::gradient_names() {
  std::map<const TensorImpl*, std::string> name_of;
  for (const auto& [name, p] : model().named_parameters()) name_of[p.impl()] = name;
  if (zero_)
    for (const auto& [name, p] : zero_->named_pieces(model().named_parameters())) name_of[p.impl()] = name;
  auto names = std::make_shared<std::vector<std::string>>();
  for (const Tensor& p : opt_->params())  // in the order of opt_->grads(), which the scaler checked
    if (p.grad().defined()) names->push_back(name_of.count(p.impl()) ? name_of[p.impl()] : "(unnamed)");
  return names;
}

Trainer::PendingStep Trainer::train_step(int64_t step) {
  const bool profiled = step == cfg_.profile_step && device_.is_cuda();
  if (profiled) cuda_profiler_start();
  const auto t0 = std::chrono::steady_clock::now();
  step_.number = step;
  if (listeners_.before_step) listeners_.before_step(step);
  if (listeners_.observer) listeners_.observer->step_begin(step);
  if (step_.use_graphs && !step_.graph && step > position_.start_step + kGraphWarmupSteps) {
    // Captured, not run: the replay below runs it. Its outputs live in the graph's own memory pool,
    // which takes the blocks the eager steps left in the allocator's cache; so the capture comes
    // before this step's inputs are staged, whose temporaries are then allocated afresh once, here,
    // and not in the first replayed step. The lr first: the optimizer's step must not capture a write.
    opt_->write_lr();
    step_.graph_figures = std::make_unique<StepFigures>();
    const uint64_t before = comm_.bytes_sent();
    step_.graph = capture_device_graph([&] { *step_.graph_figures = device_step(); });
    step_.graph_comm_bytes = comm_.bytes_sent() - before;
    if (comm_.rank() == 0) {
      std::printf("amp_train: step %lld captured in a CUDA graph; replayed from here on\n", static_cast<long long>(step));
      std::fflush(stdout);
    }
  }
  stage_inputs(step);
  StepFigures figures;
  const uint64_t sent_before = comm_.bytes_sent();
  if (step_.graph) {
    step_.graph->replay();
    comm_.watch_graph_launch("step " + std::to_string(step) + " (a CUDA graph's replay)");
    figures = *step_.graph_figures;
  } else {
    figures = device_step();
  }
  if (!step_.use_graphs) step_.batches.clear();  // their memory is the next step's
  // This step's per-gradient flags, aside from the next step's (which the same tensor receives under
  // a CUDA graph): a device copy, read back only if the step turns out skipped.
  Tensor flags;
  if (step_.flags.defined()) {
    Tensor& aside = step_.flag_copies[step % 2];
    if (!aside.defined() || aside.numel() != step_.flags.numel()) aside = empty(step_.flags.shape(), DType::f32, device_);
    copy_(aside, step_.flags);
    flags = aside;
  }

  // The figures travel to the host in the background: nothing here waits for the device.
  PendingStep p{step, t0, memory_for(device_).start_readback(figures.packed()), {}, opt_->lr(), step_.jd_weights,
                figures.grad_norm.defined(),
                step_.graph ? step_.graph_comm_bytes : comm_.bytes_sent() - sent_before, flags, step_.flag_names,
                multi_task() ? step_.jacobian_row_flags : Tensor()};  // a fresh tensor each step: no copy needed
  if (scheduler_) scheduler_->step();  // after the optimizer's step, skipped or not, as PyTorch's loop does
  if (listeners_.observer) p.counted = listeners_.observer->step_end(step);
  if (profiled) cuda_profiler_stop();  // waits for the step's work (this step's figures then read at once)
  return p;
}

StepRecord Trainer::finish(PendingStep& p, std::chrono::steady_clock::time_point next_start) {
  StepRecord r;
  r.step = p.step;
  const std::vector<double> values = p.figures->values();
  // Figures that a failed collective produced are not the peers': its failure is raised instead
  // (a rank alone, not a JobError every rank would agree on).
  comm_.raise_if_failed();
  StepFigures::unpack(values, p.grad_norm, &r);
  r.weights = p.weights;
  r.lr = p.lr;
  r.comm_bytes = static_cast<int64_t>(p.comm_bytes);
  // From this step's start to the next one's: the step's share of the wall time, whether or not
  // the device ran ahead of the host.
  r.step_ms = std::chrono::duration<double, std::milli>(next_start - p.start).count();
  if (p.counted) {
    r.device_launches = p.counted->launches;
    r.device_host_syncs = p.counted->host_syncs;
    r.device_d2h_copies = p.counted->d2h_copies;
    r.device_graph_launches = p.counted->graph_launches;
    r.device_graph_ops = p.counted->graph_ops;
    r.device_allocations = p.counted->allocations;
  }
  if (r.skipped && p.jacobian_row_flags.defined() && comm_.rank() == 0)
    if (const std::vector<int64_t> rows = nonfinite_rows(p.jacobian_row_flags); !rows.empty())
      std::fprintf(stderr, "amp_train: step %lld skipped: inf or NaN in the shared parameters' Jacobian, in the rows of %s\n",
                   static_cast<long long>(r.step), task_rows_str(rows).c_str());
  if (r.skipped && device_.is_cpu()) {
    // On the CPU a step's figures are final at once, so its gradients are still there to inspect
    // (under ZeRO-1, its pieces' were, before the parameters were gathered).
    std::string names;
    for (const std::string& n : zero_ ? step_.nonfinite : nonfinite_gradients(model().named_parameters()))
      names += (names.empty() ? "" : ", ") + n;
    if (!names.empty())
      std::fprintf(stderr, "amp_train: rank %d: step %lld skipped: non-finite gradients in %s\n", comm_.rank(),
                   static_cast<long long>(r.step), names.c_str());
  } else if (r.skipped && p.nonfinite_flags.defined() && p.flag_names) {
    // On a GPU the step's gradients are gone (the next step ran): the scaler's check flagged them.
    // One read of the flags, after a skipped step only.
    const std::vector<double> flags = p.nonfinite_flags.to_vector();
    std::string names;
    for (size_t i = 0; i < flags.size() && i < p.flag_names->size(); ++i)
      if (flags[i] != 0.0) names += (names.empty() ? "" : ", ") + (*p.flag_names)[i];
    if (!names.empty())
      std::fprintf(stderr, "amp_train: rank %d: step %lld skipped: non-finite gradients in %s\n", comm_.rank(),
                   static_cast<long long>(r.step), names.c_str());
  }
  return r;
}

}  // namespace amp::launch
