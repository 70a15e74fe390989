// Jacobian descent under AMP through the C++ API: TorchJD's AMP example line for line (docs/API.md
// shows the same loop), the control-versus-scaled pattern with an injected inf, and UPGrad's
// invariance to the loss scale.
#include <gtest/gtest.h>

#include <cmath>

#include "jd/jac.h"
#include "amp/autocast.h"
#include "amp/grad_scaler.h"
#include "jd/mtl_backward.h"
#include "models/mtl.h"
#include "runtime/ops/autograd.h"
#include "runtime/nn/layers.h"
#include "runtime/ops/ops.h"
#include "runtime/optim/sgd.h"
#include "test_util.h"

namespace amp {
namespace {

struct Example {
  std::unique_ptr<models::TrainingModel> model;
  std::vector<Tensor> inputs, targets1, targets2;
  explicit Example(uint64_t seed) {
    Generator gen(seed);
    model = models::make_mtl_model({2, 10, 5, 3}, gen);
    for (int i = 0; i < 8; ++i) {
      inputs.push_back(randn({16, 10}, gen));
      targets1.push_back(randn({16, 1}, gen));
      targets2.push_back(randn({16, 1}, gen));
    }
  }
};

// TorchJD's example: autocast (CPU, fp16), scale([loss1, loss2]), mtl_backward, jac_to_grad with
// UPGrad, scaler.step, update, zero_grad. poison: the iteration whose Jacobian gets an inf.
void train_example(Example& e, GradScaler* scaler, int poison, bool fp16) {
  std::vector<Tensor> params = e.model->module().parameters();
  optim::SGD optimizer(params, optim::SgdOptions{.lr = 0.1});
  jd::UPGrad aggregator;
  const std::vector<Tensor> shared = e.model->shared_parameters();
  for (size_t i = 0; i < e.inputs.size(); ++i) {
    models::Losses L;
    {
      autocast ac(DeviceType::cpu, DType::f16, fp16);
      L = e.model->losses({e.inputs[i], {e.targets1[i], e.targets2[i]}});
    }
    if (scaler != nullptr) {
      jd::mtl_backward(scaler->scale(L.per_task), L.features);
      if (static_cast<int>(i) == poison) {
        Tensor j = jd::jac(shared[0]);
        fill_(j, INFINITY);  // a non-finite Jacobian: UPGrad's output is NaN, the scaler skips
      }
      jd::jac_to_grad(shared, aggregator);
      scaler->step(optimizer);
      scaler->update();
    } else {
      jd::mtl_backward(L.per_task, L.features);
      jd::jac_to_grad(shared, aggregator);
      if (static_cast<int>(i) != poison) optimizer.step();
    }
    optimizer.zero_grad();
  }
}

TEST(JacobianDescent, ControlVersusScaledWithAnInjectedInf) {
  Example control(3), scaled(3);
  GradScaler scaler(GradScalerOptions{.init_scale = 128.0, .growth_factor = 2.0, .growth_interval = 1});
  train_example(control, nullptr, 2, false);
  train_example(scaled, &scaler, 2, false);
  EXPECT_EQ(scaler.get_scale(), 128.0 * std::pow(2.0, 7) * 0.5) << "7 clean steps grew it, the poisoned one backed off";
  const auto pc = control.model->module().named_parameters(), ps = scaled.model->module().named_parameters();
  // UPGrad is invariant to the power-of-two scale, bitwise (docs/JACOBIAN_DESCENT.md): the two runs
  // agree to rounding of the unscale, here exactly.
  for (size_t k = 0; k < pc.size(); ++k) EXPECT_TRUE(test::all_close(ps[k].second, pc[k].second, 1e-6, 1e-7)) << pc[k].first;
}

TEST(JacobianDescent, TorchJDsAmpExampleRunsInFp16AndSkipsOverflows) {
  Example e(4);
  GradScaler scaler;  // 65536: the example's first steps overflow in fp16 and are skipped
  const auto before = e.model->module().parameters()[0].to_vector();
  train_example(e, &scaler, -1, true);
  EXPECT_LT(scaler.get_scale(), 65536.0) << "an fp16 overflow backed the scale off";
  EXPECT_NE(e.model->module().parameters()[0].to_vector(), before) << "later steps trained";
  for (const Tensor& p : e.model->module().parameters())
    for (double v : p.to_vector()) ASSERT_TRUE(std::isfinite(v));
}

// Under fp16 autocast the features are fp16 (the backward runs through fp16 ops), and the Jacobian
// lands in the parameters' float32, one row per loss; the parameters are named as PyTorch names the
// state dict of modules shared, task1, task2.
TEST(JacobianDescent, Fp16JacobianLandsInFloat32UnderTorchsNames) {
  Example e(5);
  models::Losses L;
  {
    autocast ac(DeviceType::cpu, DType::f16);
    L = e.model->losses({e.inputs[0], {e.targets1[0], e.targets2[0]}});
  }
  EXPECT_EQ(L.features.dtype(), DType::f16);
  GradScaler scaler;
  jd::mtl_backward(scaler.scale(L.per_task), L.features);
  for (const Tensor& p : e.model->shared_parameters()) {
    ASSERT_TRUE(jd::jac(p).defined());
    EXPECT_EQ(jd::jac(p).dtype(), DType::f32);
    Shape want = {2};
    want.insert(want.end(), p.shape().begin(), p.shape().end());
    EXPECT_EQ(jd::jac(p).shape(), want);
  }
  std::vector<std::string> names;
  for (const auto& [name, p] : e.model->module().named_parameters()) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"shared.0.weight", "shared.0.bias", "shared.2.weight", "shared.2.bias",
                                             "task1.weight", "task1.bias", "task2.weight", "task2.bias"}));
}

// docs/API.md's example, as written there: TorchJD's AMP example line for line.
TEST(JacobianDescent, ReadmeExample) {
  amp::Generator data_gen(9);
  std::vector<amp::Tensor> inputs, task1_targets, task2_targets;
  for (int i = 0; i < 16; ++i) {
    inputs.push_back(amp::randn({16, 10}, data_gen));
    task1_targets.push_back(amp::randn({16, 1}, data_gen));
    task2_targets.push_back(amp::randn({16, 1}, data_gen));
  }
  // --- docs/API.md's code
  amp::Generator gen(0);
  auto shared_module = std::make_shared<amp::nn::Sequential>();
  shared_module->push_back(std::make_shared<amp::nn::Linear>(10, 5, gen)).push_back(std::make_shared<amp::nn::ReLU>())
      .push_back(std::make_shared<amp::nn::Linear>(5, 3, gen)).push_back(std::make_shared<amp::nn::ReLU>());
  amp::nn::Linear task1_module(3, 1, gen), task2_module(3, 1, gen);
  std::vector<amp::Tensor> params = shared_module->parameters();
  for (amp::nn::Linear* head : {&task1_module, &task2_module})
    for (const amp::Tensor& p : head->parameters()) params.push_back(p);

  amp::GradScaler scaler;
  amp::optim::SGD optimizer(params, {.lr = 0.1});
  amp::jd::UPGrad aggregator;
  for (size_t i = 0; i < inputs.size(); ++i) {
    amp::Tensor features, loss1, loss2;
    {
      amp::autocast ac(amp::DeviceType::cpu, amp::DType::f16);
      features = (*shared_module)(inputs[i]);
      loss1 = amp::mse_loss(task1_module(features), task1_targets[i]);
      loss2 = amp::mse_loss(task2_module(features), task2_targets[i]);
    }
    const std::vector<amp::Tensor> scaled_losses = scaler.scale(std::vector<amp::Tensor>{loss1, loss2});
    amp::jd::mtl_backward(scaled_losses, features);
    amp::jd::jac_to_grad(shared_module->parameters(), aggregator);
    scaler.step(optimizer);
    scaler.update();
    optimizer.zero_grad();
  }
  // --- end of docs/API.md's code
  EXPECT_LT(scaler.get_scale(), 65536.0) << "the fp16 overflow of the first steps was skipped";
  for (const amp::Tensor& p : params)
    for (double v : p.to_vector()) ASSERT_TRUE(std::isfinite(v));
  EXPECT_EQ(aggregator.last_weights().size(), 2u);
}

}  // namespace
}  // namespace amp
