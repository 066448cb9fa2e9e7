// The conditioning chain (include/detdit/chain.h) on CUDA tensors equals the CPU chain on the same inputs, bitwise,
// for every output and gradient: small H (bf16 and fp32, both packings, two blocks) and the H3 hidden size with one
// block (bf16, H3's time-embedding sizes); run on a non-default stream, repeated, and captured into a CUDA graph with
// check_range = false (capture fails if the chain synchronises the host). Also the internal elementwise helpers
// (src/common/elementwise.h) on CUDA equal the CPU at every alignment (16-byte vectors, scalar tail, unaligned), in
// place, and mixed devices fail closed before anything is written.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/backends.h"
#include "cuda/cuda_test_util.h"
#include "detdit/chain.h"

namespace detdit {
namespace testing {
namespace {

struct ChainShape {
  DType dtype;
  int64_t hidden, blocks, frequencies, mlp_hidden, embed;
};

// Every input and output of one chain call, on both devices.
struct ChainPairs {
  ChainShape shape;
  IndexCase c;
  PlanPair adaln_plans, timestep_plans;
  Pair timesteps, w1, b1, w2, b2, norm_out, out_w, out_b, x, sub_out, sub_grad, grad_out;
  std::vector<Pair> adaln_w, adaln_b, norm1, norm2;
  // outputs: out, dx, d_timesteps, MLP grads, final-layer grads, then per block
  std::vector<Pair> outputs;
  std::vector<ChainBlockWeights> block_weights[2];  // [0] host, [1] device
  std::vector<ChainBlockGrads> block_grads[2];

  ChainPairs(const ChainShape& s, const IndexCase& index, uint64_t seed) : shape(s), c(index) {
    const int64_t T = c.num_timesteps, M = c.positions(), H = s.hidden, D = s.embed, L = s.blocks;
    adaln_plans = adaln_plan_pair(c);
    timestep_plans = timestep_plan_pair(c);
    HostTensor t(DType::kF32, {T});
    for (int64_t i = 0; i < T; ++i) t.set(i, (i + 1.0) / (T + 1.0));
    timesteps = input_pair(t);
    w1 = random_pair(DType::kF32, {s.mlp_hidden, s.frequencies}, seed, 0.0, 0.1);
    b1 = random_pair(DType::kF32, {s.mlp_hidden}, seed + 1, 0.0, 0.1);
    w2 = random_pair(DType::kF32, {D, s.mlp_hidden}, seed + 2, 0.0, 0.05);
    b2 = random_pair(DType::kF32, {D}, seed + 3, 0.0, 0.1);
    norm_out = random_pair(s.dtype, {H}, seed + 4, 1.0, 0.1);
    out_w = random_pair(s.dtype, {2 * H, D}, seed + 5, 0.0, 0.05);
    out_b = random_pair(s.dtype, {2 * H}, seed + 6, 0.0, 0.1);
    x = random_pair(s.dtype, {M, H}, seed + 7);
    grad_out = random_pair(s.dtype, {M, H}, seed + 8);
    HostTensor so(s.dtype, {2 * L, M, H}), sg(s.dtype, {2 * L, M, H});
    Status st = chain_stand_ins(seed + 9, so.view(), sg.view());
    EXPECT_TRUE(st.ok()) << st.to_string();
    sub_out = input_pair(so);
    sub_grad = input_pair(sg);
    for (int64_t l = 0; l < L; ++l) {
      adaln_w.push_back(random_pair(s.dtype, {18 * H, D}, seed + 20 + l, 0.0, 0.05));
      adaln_b.push_back(random_pair(s.dtype, {18 * H}, seed + 30 + l, 0.0, 0.1));
      norm1.push_back(random_pair(s.dtype, {H}, seed + 40 + l, 1.0, 0.1));
      norm2.push_back(random_pair(s.dtype, {H}, seed + 50 + l, 1.0, 0.1));
    }
    for (const auto& [dtype, dims] : std::vector<std::pair<DType, std::vector<int64_t>>>{
             {s.dtype, {M, H}}, {s.dtype, {M, H}}, {DType::kF32, {T}}, {DType::kF32, {s.mlp_hidden, s.frequencies}},
             {DType::kF32, {s.mlp_hidden}}, {DType::kF32, {D, s.mlp_hidden}}, {DType::kF32, {D}},
             {DType::kF32, {H}}, {s.dtype, {2 * H, D}}, {s.dtype, {2 * H}}})
      outputs.push_back(output_pair(dtype, dims));
    for (int64_t l = 0; l < L; ++l) {
      outputs.push_back(output_pair(s.dtype, {18 * H, D}));
      outputs.push_back(output_pair(s.dtype, {18 * H}));
      outputs.push_back(output_pair(DType::kF32, {H}));  // d_norm1 in fp32,
      outputs.push_back(output_pair(s.dtype, {H}));      // d_norm2 in x's dtype
    }
    for (int side = 0; side < 2; ++side) {
      auto v = [side](const Pair& p) { return side ? p.d() : p.h(); };
      for (int64_t l = 0; l < L; ++l) {
        block_weights[side].push_back({v(adaln_w[l]), v(adaln_b[l]), v(norm1[l]), v(norm2[l])});
        block_grads[side].push_back({v(outputs[10 + 4 * l]), v(outputs[11 + 4 * l]), v(outputs[12 + 4 * l]),
                                     v(outputs[13 + 4 * l])});
      }
    }
  }

  ChainParams params(bool device) const {
    auto v = [device](const Pair& p) { return device ? p.d() : p.h(); };
    const int side = device ? 1 : 0;
    ChainParams p;
    p.weights = {v(w1), v(b1), v(w2), v(b2), block_weights[side].data(), shape.blocks, v(norm_out), v(out_w), v(out_b)};
    p.timesteps = v(timesteps);
    p.adaln_plan = device ? adaln_plans.dev : adaln_plans.host;
    p.timestep_plan = device ? timestep_plans.dev : timestep_plans.host;
    p.x = v(x);
    p.sublayer_out = v(sub_out);
    p.sublayer_grad = v(sub_grad);
    p.grad_out = v(grad_out);
    p.out = v(outputs[0]);
    p.grads = {v(outputs[2]), v(outputs[3]), v(outputs[4]), v(outputs[5]), v(outputs[6]), block_grads[side].data(),
               v(outputs[7]), v(outputs[8]), v(outputs[9]), v(outputs[1])};
    return p;
  }

  // The canary on every device output; synchronises, so a launch on a
  // non-blocking stream cannot overtake the fills.
  void poison_device() {
    for (Pair& o : outputs) fill_device(&o.dev, kCanary);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
};

std::string name_of(const ChainShape& s, const IndexCase& c) {
  return std::string(dtype_name(s.dtype)) + " H=" + std::to_string(s.hidden) + " L=" + std::to_string(s.blocks) + " " +
         c.name();
}

// CPU chain, then the GPU chain on `stream`: every output equal.
void check_chain(const ChainShape& s, const IndexCase& c, uint64_t seed) {
  SCOPED_TRACE(name_of(s, c));
  ChainPairs k(s, c, seed);
  DETDIT_ASSERT_OK(chain_forward_backward(k.params(false)));
  k.poison_device();
  cudaStream_t stream;
  DETDIT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  DETDIT_ASSERT_OK(chain_forward_backward(k.params(true), stream));
  DETDIT_CUDA_CHECK(cudaStreamSynchronize(stream));
  DETDIT_CUDA_CHECK(cudaStreamDestroy(stream));
  for (std::size_t i = 0; i < k.outputs.size(); ++i) {
    SCOPED_TRACE("output " + std::to_string(i));
    EXPECT_GPU_EQ_CPU(k.outputs[i]);
  }
}

TEST(ChainCuda, EveryOutputAndGradientEqualsTheCpuSmallHidden) {
  DETDIT_SKIP_WITHOUT_CUDA();
  uint64_t seed = 500;
  for (DType dtype : {DType::kBF16, DType::kF32})
    for (Packing packing : {Packing::kBlock, Packing::kInterleaved})
      check_chain({dtype, 24, 2, 32, 64, 48}, make_index_case(packing, 257, 3, 2), seed += 100);
  // H = 12 (no 16-byte row multiple for bf16), a single timestep, no blocks at all
  check_chain({DType::kBF16, 12, 1, 16, 32, 24}, make_index_case(Packing::kBlock, 33, 1, 3), seed += 100);
  check_chain({DType::kBF16, 12, 0, 16, 32, 24}, make_index_case(Packing::kInterleaved, 40, 2, 1), seed += 100);
}

// H3: hidden 5376, frequency dim 256, time-embed hidden 5376, time-embed dim 2688, one block.
TEST(ChainCuda, EveryOutputAndGradientEqualsTheCpuH3HiddenOneBlock) {
  DETDIT_SKIP_WITHOUT_CUDA();
  check_chain({DType::kBF16, 5376, 1, 256, 5376, 2688}, make_index_case(Packing::kInterleaved, 300, 2, 2), 1234);
}

// Repeated GPU runs and a CUDA-graph replay of the chain (check_range = false:
// no host synchronisation, else capture fails) give the eager bytes.
TEST(ChainCuda, RepeatsAndReplaysFromACudaGraph) {
  DETDIT_SKIP_WITHOUT_CUDA();
  const ChainShape s{DType::kBF16, 24, 2, 32, 64, 48};
  ChainPairs k(s, make_index_case(Packing::kBlock, 257, 3, 2), 77);
  k.poison_device();
  cudaStream_t stream;
  DETDIT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  DETDIT_ASSERT_OK(chain_forward_backward(k.params(true), stream));
  DETDIT_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<HostTensor> eager;
  for (const Pair& o : k.outputs) {
    eager.push_back(o.result());
    EXPECT_FALSE(all_bytes_are(eager.back(), kCanary)) << "output " << eager.size() - 1 << " was never written";
  }
  k.poison_device();
  DETDIT_ASSERT_OK(chain_forward_backward(k.params(true), stream));
  DETDIT_CUDA_CHECK(cudaStreamSynchronize(stream));
  for (std::size_t i = 0; i < eager.size(); ++i) EXPECT_BITWISE_EQ(eager[i], k.outputs[i].result()) << "repeat, output " << i;

  ChainParams captured_params = k.params(true);
  captured_params.check_range = false;
  k.poison_device();
  cudaGraph_t graph;
  DETDIT_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const Status captured = chain_forward_backward(captured_params, stream);
  DETDIT_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  DETDIT_ASSERT_OK(captured);
  cudaGraphExec_t exec;
  DETDIT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 2; ++replay) {
    k.poison_device();
    DETDIT_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    DETDIT_CUDA_CHECK(cudaStreamSynchronize(stream));
    for (std::size_t i = 0; i < eager.size(); ++i)
      EXPECT_BITWISE_EQ(eager[i], k.outputs[i].result()) << "graph replay " << replay << ", output " << i;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// Needs no GPU: validation never touches the data.
TEST(ChainCuda, MixedDevicesFailClosed) {
  IndexCase c = make_index_case(Packing::kBlock, 16, 2, 1);
  HostTensor x(DType::kBF16, {16, 12}), out(DType::kBF16, {16, 12});
  out.fill_bytes(kCanary);
  ChainParams p;
  p.x = x.view();
  p.out = out.view();
  p.timesteps = x.view();
  p.timesteps.device = Device::cuda(0);  // never dereferenced
  p.adaln_plan = adaln_plan(c);
  p.timestep_plan = timestep_plan(c);
  Status st = chain_forward_backward(p);
  EXPECT_EQ(st.kind(), ErrorKind::kValue) << st.to_string();
  EXPECT_NE(st.message().find("got x on cpu and timesteps on cuda:0"), std::string::npos) << st.to_string();
  EXPECT_TRUE(all_bytes_are(out, kCanary));
}

// ---- the elementwise helpers ------------------------------------------------

// A contiguous (count,) view `offset` elements into a tensor's memory.
TensorView slice(const TensorView& t, int64_t offset, int64_t count) {
  return TensorView::contiguous(static_cast<char*>(t.data) + offset * dtype_size(t.dtype), t.dtype, {count}, t.device);
}

TEST(ElementwiseCuda, AddEqualsTheCpuAtEveryAlignmentAndInPlace) {
  DETDIT_SKIP_WITHOUT_CUDA();
  constexpr int64_t kCount = 100003;
  uint64_t seed = 40;
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16})
    for (int64_t offset : {0, 1, 3}) {  // 0: 16-byte vectors + scalar tail; 1, 3: unaligned, all scalar
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " offset " + std::to_string(offset));
      Pair a = random_pair(dtype, {kCount + offset}, seed++, 0.0, 100.0);
      Pair b = random_pair(dtype, {kCount + offset}, seed++, 0.0, 1.0);
      Pair out = output_pair(dtype, {kCount + offset});
      DETDIT_ASSERT_OK(cpu::add(slice(a.h(), offset, kCount), slice(b.h(), offset, kCount), slice(out.h(), offset, kCount), nullptr));
      DETDIT_ASSERT_OK(cuda::add(slice(a.d(), offset, kCount), slice(b.d(), offset, kCount), slice(out.d(), offset, kCount), nullptr));
      EXPECT_GPU_EQ_CPU(out);
      // in place: a += b on the device equals the CPU's out
      DETDIT_ASSERT_OK(cuda::add(slice(a.d(), offset, kCount), slice(b.d(), offset, kCount), slice(a.d(), offset, kCount), nullptr));
      HostTensor in_place = a.result();
      EXPECT_TRUE(bitwise_equal_bytes(static_cast<char*>(out.host.data()) + offset * dtype_size(dtype),
                                      static_cast<char*>(in_place.data()) + offset * dtype_size(dtype), kCount, dtype));
    }
}

TEST(ElementwiseCuda, CopyTensorAndFillZero) {
  DETDIT_SKIP_WITHOUT_CUDA();
  Pair src = random_pair(DType::kBF16, {1001}, 3);
  Pair dst = output_pair(DType::kBF16, {1001});
  DETDIT_ASSERT_OK(cuda::copy_tensor(src.d(), dst.d(), nullptr));
  EXPECT_BITWISE_EQ(src.host, dst.result());
  DETDIT_ASSERT_OK(cuda::fill_zero(dst.d(), nullptr));
  EXPECT_TRUE(all_bytes_are(dst.result(), 0));
}

}  // namespace
}  // namespace testing
}  // namespace detdit
