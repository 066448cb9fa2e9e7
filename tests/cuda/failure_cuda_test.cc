// Failure behaviour with CUDA tensors: the validation errors of the CPU hold for CUDA tensors with the same kind and
// message (device names aside), no output is written, a CPU plan with CUDA tensors and tensors on two CUDA devices
// are clear ValueErrors (Device::cuda(1) views: no second GPU needed, nothing is dereferenced before validation
// fails).
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "cuda/cuda_test_util.h"
#include "detdit/gate_residual.h"
#include "detdit/linear.h"
#include "detdit/rmsnorm.h"

namespace detdit {
namespace testing {
namespace {

std::string on_cpu(std::string message) {
  for (std::size_t at; (at = message.find("cuda:0")) != std::string::npos;) message.replace(at, 6, "cpu");
  return message;
}

TensorView on_device(TensorView v, Device device) {
  v.device = device;
  return v;
}

// Every rmsnorm misuse fails the same way on both devices and writes nothing.
TEST(FailureCuda, RmsnormValidationMatchesTheCpu) {
  DETDIT_SKIP_WITHOUT_CUDA();
  const IndexCase c = make_index_case(Packing::kBlock, 257, 3, 1);
  PlanPair plans = adaln_plan_pair(c);
  Pair x = random_pair(DType::kBF16, {257, 64}, 1), w = random_pair(DType::kBF16, {64}, 2);
  Pair w32 = random_pair(DType::kF32, {64}, 3), shift = random_pair(DType::kBF16, {9, 64}, 4);
  Pair short_shift = random_pair(DType::kBF16, {8, 64}, 5), x12 = random_pair(DType::kBF16, {257, 66}, 6);
  Pair out = output_pair(DType::kBF16, {257, 64}), rstd = output_pair(DType::kF32, {257});
  struct Misuse {
    const char* what;
    std::function<void(RmsnormParams&, bool)> apply;
  };
  const std::vector<Misuse> misuses = {
      {"weight dtype", [&](RmsnormParams& p, bool g) { p.in.weight = g ? w32.d() : w32.h(); }},
      {"H % 4", [&](RmsnormParams& p, bool g) { p.in.x = g ? x12.d() : x12.h(); }},
      {"misaligned x", [&](RmsnormParams& p, bool) {
         p.in.x = TensorView::contiguous(static_cast<char*>(p.in.x.data) + 2, DType::kBF16, {257, 64}, p.in.x.device);
       }},
      {"shift rows", [&](RmsnormParams& p, bool g) { p.in.shift = g ? short_shift.d() : short_shift.h(); }},
      {"scale without shift", [&](RmsnormParams& p, bool) { p.in.shift = TensorView{}; }},
      {"eps", [&](RmsnormParams& p, bool) { p.in.eps = -1.0f; }},
      {"absent out", [&](RmsnormParams& p, bool) { p.out = TensorView{}; }},
  };
  for (const Misuse& m : misuses) {
    SCOPED_TRACE(m.what);
    RmsnormParams cpu, gpu;
    cpu.in.x = x.h(), gpu.in.x = x.d();
    cpu.in.weight = w.h(), gpu.in.weight = w.d();
    cpu.in.shift = cpu.in.scale = shift.h(), gpu.in.shift = gpu.in.scale = shift.d();
    cpu.in.plan = plans.host, gpu.in.plan = plans.dev;
    cpu.out = out.h(), gpu.out = out.d();
    cpu.rstd = rstd.h(), gpu.rstd = rstd.d();
    m.apply(cpu, false);
    m.apply(gpu, true);
    const Status sc = rmsnorm_forward(cpu), sg = rmsnorm_forward(gpu);
    ASSERT_FALSE(sc.ok());
    ASSERT_FALSE(sg.ok());
    EXPECT_EQ(sc.kind(), sg.kind());
    EXPECT_EQ(sc.message(), on_cpu(sg.message()));
    EXPECT_TRUE(all_bytes_are(out.result(), kCanary)) << "the GPU output was written: " << sg.to_string();
    EXPECT_TRUE(all_bytes_are(rstd.result(), kCanary));
  }
}

TEST(FailureCuda, LinearValidationMatchesTheCpu) {
  DETDIT_SKIP_WITHOUT_CUDA();
  Pair x = random_pair(DType::kBF16, {3, 24}, 1), w = random_pair(DType::kBF16, {64, 24}, 2);
  Pair w32 = random_pair(DType::kF32, {64, 24}, 3), w_k = random_pair(DType::kBF16, {64, 16}, 4);
  Pair out = output_pair(DType::kBF16, {3, 64});
  const std::pair<const Pair*, const char*> weights[] = {{&w32, "dtype"}, {&w_k, "K"}};
  for (const auto& bad : weights) {
    SCOPED_TRACE(bad.second);
    const Status sc = linear_forward(LinearParams{x.h(), bad.first->h(), TensorView{}, out.h(), TensorView{}});
    const Status sg = linear_forward(LinearParams{x.d(), bad.first->d(), TensorView{}, out.d(), TensorView{}});
    ASSERT_FALSE(sc.ok());
    ASSERT_FALSE(sg.ok());
    EXPECT_EQ(sc.kind(), sg.kind());
    EXPECT_EQ(sc.message(), on_cpu(sg.message()));
    EXPECT_TRUE(all_bytes_are(out.result(), kCanary));
  }
}

TEST(FailureCuda, MixedDevicesAreValueErrors) {
  DETDIT_SKIP_WITHOUT_CUDA();
  const IndexCase c = make_index_case(Packing::kInterleaved, 256, 2, 1);
  PlanPair plans = adaln_plan_pair(c);
  Pair x = random_pair(DType::kBF16, {256, 64}, 1), y = random_pair(DType::kBF16, {256, 64}, 2);
  Pair gate = random_pair(DType::kBF16, {6, 64}, 3), out = output_pair(DType::kBF16, {256, 64});
  // A CPU plan with CUDA tensors.
  Status s = gate_residual_forward(GateResidualParams{{x.d(), y.d(), gate.d(), plans.host}, out.d()});
  EXPECT_EQ(s.kind(), ErrorKind::kValue) << s.to_string();
  EXPECT_NE(s.message().find("cpu"), std::string::npos) << s.to_string();
  // A CUDA plan with CPU tensors.
  GateResidualParams on_host;
  on_host.in = {x.h(), y.h(), gate.h(), plans.dev};
  on_host.out = out.h();
  s = gate_residual_forward(on_host);
  EXPECT_EQ(s.kind(), ErrorKind::kValue) << s.to_string();
  // One tensor on another GPU (a cuda:1 view; never dereferenced).
  s = gate_residual_forward(
      GateResidualParams{{x.d(), on_device(y.d(), Device::cuda(1)), gate.d(), plans.dev}, out.d()});
  EXPECT_EQ(s.kind(), ErrorKind::kValue) << s.to_string();
  EXPECT_NE(s.message().find("cuda:1"), std::string::npos) << s.to_string();
  // CPU and CUDA tensors in one call.
  s = gate_residual_forward(GateResidualParams{{x.d(), y.h(), gate.d(), plans.dev}, out.d()});
  EXPECT_EQ(s.kind(), ErrorKind::kValue) << s.to_string();
  EXPECT_TRUE(all_bytes_are(out.result(), kCanary));
  EXPECT_TRUE(all_bytes_are(out.host, kCanary));
  // The torch profile is CUDA only.
  Pair w = random_pair(DType::kBF16, {64}, 4), normed = output_pair(DType::kBF16, {256, 64});
  RmsnormParams p;
  p.in.x = x.h(), p.in.weight = w.h(), p.out = normed.h(), p.in.numerics = Numerics::kTorch;
  s = rmsnorm_forward(p);
  EXPECT_EQ(s.kind(), ErrorKind::kValue) << s.to_string();
  p.in.x = x.d(), p.in.weight = w.d(), p.out = normed.d();
  DETDIT_EXPECT_OK(rmsnorm_forward(p));
}

}  // namespace
}  // namespace testing
}  // namespace detdit
