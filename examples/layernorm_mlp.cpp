// A model of its own, trained with the runtime's C++ API as a PyTorch user writes the loop: a
// two-layer MLP with a LayerNorm, on a regression data set it makes, under fp16 autocast with a
// GradScaler, AdamW with two parameter groups (no weight decay on biases and the norm), warmup then
// cosine, data-parallel over MPI ranks (mpirun -np 2). It prints the loss and exits 1 unless the
// loss fell below a tenth of where it started.
#include <cmath>
#include <cstdio>
#include <memory>
#include <vector>

#include "amp/autocast.h"
#include "amp/clip_grad.h"
#include "amp/grad_scaler.h"
#include "comm/local_communicator.h"
#include "comm/mpi_communicator.h"
#include "comm/mpi_session.h"
#include "comm/reducer.h"
#include "runtime/nn/layers.h"
#include "runtime/ops/ops.h"
#include "runtime/optim/adam.h"
#include "runtime/optim/lr_scheduler.h"
#include "runtime/ops/random.h"

using namespace amp;

// Linear(in, hidden) -> LayerNorm -> ReLU -> Linear(hidden, out).
class LayerNormMlp final : public nn::Module {
 public:
  LayerNormMlp(int64_t in, int64_t hidden, int64_t out, Generator& gen)
      : fc1_(std::make_shared<nn::Linear>(in, hidden, gen)),
        norm_(std::make_shared<nn::LayerNorm>(hidden)),
        fc2_(std::make_shared<nn::Linear>(hidden, out, gen)) {
    register_module("fc1", fc1_);
    register_module("norm", norm_);
    register_module("fc2", fc2_);
  }
  Tensor forward(const Tensor& x) override { return (*fc2_)(relu((*norm_)((*fc1_)(x)))); }
  std::vector<Tensor> matrices() const { return {fc1_->weight, fc2_->weight}; }
  std::vector<Tensor> vectors() const { return {fc1_->bias, norm_->weight, norm_->bias, fc2_->bias}; }

 private:
  std::shared_ptr<nn::Linear> fc1_;
  std::shared_ptr<nn::LayerNorm> norm_;
  std::shared_ptr<nn::Linear> fc2_;
};

int main(int argc, char** argv) {
  comm::MpiSession mpi(&argc, &argv);
  std::unique_ptr<comm::Communicator> world;
  if (mpi.size() > 1) world = std::make_unique<comm::MpiCommunicator>(MPI_COMM_WORLD);
  else world = std::make_unique<comm::LocalCommunicator>();
  constexpr int64_t kIn = 16, kHidden = 64, kOut = 4, kBatch = 32, kSteps = 300;

  // The data: y = relu(x A) for a fixed random A; every rank draws its own samples.
  Generator data_gen(1000 + static_cast<uint64_t>(mpi.rank()));
  Generator teacher_gen(7);
  const Tensor teacher = randn({kIn, kOut}, teacher_gen);

  Generator init(42);  // the same initial weights on every rank
  LayerNormMlp model(kIn, kHidden, kOut, init);
  optim::AdamWOptions decay, no_decay;
  decay.lr = no_decay.lr = 3e-3;
  no_decay.weight_decay = 0.0;
  optim::AdamW opt({{model.matrices(), decay}, {model.vectors(), no_decay}});
  std::vector<std::unique_ptr<optim::LRScheduler>> parts;
  parts.push_back(std::make_unique<optim::LinearLR>(opt, 0.1, 1.0, 20));
  parts.push_back(std::make_unique<optim::CosineAnnealingLR>(opt, kSteps - 20, 3e-4));
  optim::SequentialLR sched(opt, std::move(parts), {20});
  GradScaler scaler(GradScalerOptions{}, world.get());  // found_inf agreed by every rank
  comm::GradientReducer reducer(model.parameters(), *world);  // averages the gradients over ranks

  double first = 0.0, last = 0.0;
  for (int64_t step = 1; step <= kSteps; ++step) {
    const Tensor x = randn({kBatch, kIn}, data_gen);
    const Tensor y = relu(matmul(x, teacher));
    opt.zero_grad();
    reducer.prepare_for_backward(true);
    Tensor loss;
    {
      autocast ac(DeviceType::cpu, DType::f16);
      loss = mse_loss(model(x), y);
    }
    scaler.scale(loss).backward();
    reducer.finish();
    scaler.unscale_(opt);
    clip_grad_norm_(model.parameters(), 1.0);
    scaler.step(opt);
    scaler.update();
    sched.step();
    Tensor avg = loss.detach().reshape({1}).to(DType::f32);
    world->all_reduce(avg, comm::ReduceOp::avg);
    last = avg.item();
    if (step == 1) first = last;
    if (mpi.rank() == 0 && (step == 1 || step % 50 == 0))
      std::printf("step %lld  loss %.5f  lr %.2e  scale %g\n", static_cast<long long>(step), last, opt.lr(),
                  scaler.get_scale());
  }
  const bool learned = std::isfinite(last) && last < first / 10.0;
  if (mpi.rank() == 0) std::printf("%s: loss %.5f -> %.5f on %d rank(s)\n", learned ? "learned" : "FAILED", first, last, mpi.size());
  return learned ? 0 : 1;
}
