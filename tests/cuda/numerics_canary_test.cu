// The numerics canary: host and device agree bitwise on the primitives the
// contract is built from (docs/numerics.md 2-4): a*b+c written without
// contraction, explicit fma, division, sqrt, the bf16/fp16 conversions of
// random bit patterns (NaNs, subnormals, infinities, ties included) and the
// portable exp/sin/cos/rsqrt over >= 1e6 inputs each; and the device's
// bf16/fp16 conversions (cvt.rn on sm_80+) equal the integer definition on all
// 2^32 FP32 inputs. A build that contracts, flushes subnormals or approximates
// division/sqrt fails here.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "common/scalar_math.h"
#include "support/test_util.h"

namespace detdit {
namespace testing {
namespace {

enum Probe : int {
  kMulAdd = 0,   // a*b + c as two separately rounded operations
  kFma,          // fma(a, b, c)
  kDivide,       // a / b
  kSqrt,         // sqrtf(a) (FP32, correctly rounded)
  kSqrt64,       // FP64 sqrt then one rounding (the core of portable_rsqrt)
  kToBf16,       // float_to_bf16(bits)
  kToF16,        // float_to_f16(bits)
  kFromF16,      // f16_to_float(low 16 bits)
  kExp,          // portable_exp
  kSin,          // portable_sin
  kCos,          // portable_cos
  kRsqrt,        // portable_rsqrt
  kProbeCount
};

DETDIT_HD uint32_t evaluate(int probe, float a, float b, float c) {
  switch (probe) {
    case kMulAdd: return num::float_bits(num::add32(num::mul32(a, b), c));
    case kFma: return num::float_bits(num::fma32(a, b, c));
    case kDivide: return num::float_bits(num::div32(a, b));
    case kSqrt: return num::float_bits(sqrtf(a));
    case kSqrt64: return num::float_bits(num::to_f32(num::sqrt64(static_cast<double>(a))));
    case kToBf16: return num::float_to_bf16(a);
    case kToF16: return num::float_to_f16(a);
    case kFromF16: return num::float_bits(num::f16_to_float(static_cast<uint16_t>(num::float_bits(a) & 0xFFFFu)));
    case kExp: return num::float_bits(num::portable_exp(a));
    case kSin: return num::float_bits(num::portable_sin(a));
    case kCos: return num::float_bits(num::portable_cos(a));
    default: return num::float_bits(num::portable_rsqrt(a));
  }
}

// Spelled out as plain `a * b + c` too: with --fmad=false nvcc must not fuse it.
__global__ void plain_mul_add_kernel(const float* a, const float* b, const float* c, uint32_t* out, int64_t count) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) out[i] = num::float_bits(a[i] * b[i] + c[i]);
}

__global__ void evaluate_kernel(int probe, const float* a, const float* b, const float* c, uint32_t* out,
                                int64_t count) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) out[i] = evaluate(probe, a[i], b[i], c[i]);
}

constexpr int64_t kCount = 1 << 20;

// Inputs of each probe: random bit patterns (all classes), plus ranges where
// the function is defined and interesting, plus edge values.
void make_inputs(int probe, std::vector<float>* a, std::vector<float>* b, std::vector<float>* c) {
  std::mt19937_64 rng(1234 + probe);
  std::uniform_int_distribution<uint32_t> bits;
  a->resize(kCount), b->resize(kCount), c->resize(kCount);
  auto uniform = [&](float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng); };
  for (int64_t i = 0; i < kCount; ++i) {
    (*a)[i] = num::bits_float(bits(rng));
    (*b)[i] = num::bits_float(bits(rng));
    (*c)[i] = num::bits_float(bits(rng));
    const int64_t kind = i % 4;
    switch (probe) {
      case kMulAdd:
      case kFma:
        if (kind != 0) (*a)[i] = uniform(-10, 10), (*b)[i] = uniform(-10, 10), (*c)[i] = uniform(-100, 100);
        break;
      case kToBf16:  // ties: the 16 dropped bits exactly 0x8000
        if (kind == 1) (*a)[i] = num::bits_float((bits(rng) & 0xFFFF0000u) | 0x8000u);
        break;
      case kToF16:  // ties of the normal and subnormal fp16 range
        if (kind == 1) (*a)[i] = num::bits_float((bits(rng) & 0xFFFFE000u) | 0x1000u);
        if (kind == 2) (*a)[i] = uniform(-7e-5f, 7e-5f);
        break;
      case kExp: (*a)[i] = kind == 0 ? uniform(-104, 89) : uniform(-2, 2); break;
      case kSin:
      case kCos: (*a)[i] = kind == 0 ? uniform(-1000, 1000) : uniform(-2, 2); break;
      case kRsqrt: (*a)[i] = kind == 0 ? uniform(1e-6f, 1e6f) : num::bits_float(bits(rng) & 0x7FFFFFFFu); break;
      default: break;
    }
  }
  const float edges[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 1e-45f, -1e-45f, 1.17549435e-38f, 3.4e38f, 1.0f,
                         -1.0f, 88.7f, -103.9f, 65504.0f, 65520.0f, 1e6f, -1e6f};
  for (std::size_t e = 0; e < sizeof(edges) / sizeof(edges[0]); ++e) (*a)[e] = edges[e];
}

std::vector<uint32_t> run_on_device(const std::vector<float>& a, const std::vector<float>& b,
                                    const std::vector<float>& c, int probe, bool plain) {
  float *da, *db, *dc;
  uint32_t* dout;
  std::vector<uint32_t> out(kCount);
  const std::size_t bytes = kCount * sizeof(float);
  EXPECT_EQ(cudaMalloc(&da, bytes), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&db, bytes), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&dc, bytes), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&dout, bytes), cudaSuccess);
  cudaMemcpy(da, a.data(), bytes, cudaMemcpyHostToDevice);
  cudaMemcpy(db, b.data(), bytes, cudaMemcpyHostToDevice);
  cudaMemcpy(dc, c.data(), bytes, cudaMemcpyHostToDevice);
  const unsigned blocks = static_cast<unsigned>((kCount + 255) / 256);
  if (plain)
    plain_mul_add_kernel<<<blocks, 256>>>(da, db, dc, dout, kCount);
  else
    evaluate_kernel<<<blocks, 256>>>(probe, da, db, dc, dout, kCount);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(out.data(), dout, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(da), cudaFree(db), cudaFree(dc), cudaFree(dout);
  return out;
}

// FP32 results: bitwise equal, except that a NaN result only has to be a NaN
// on both sides. The NaN *encoding* of FP32 arithmetic is the hardware's
// (x86 returns the quieted input NaN or 0xFFC00000, CUDA the canonical
// 0x7FFFFFFF), which docs/numerics.md section 3 leaves out of the contract;
// every stored bf16/fp16 NaN is canonicalised to 0x7FFF in software.
::testing::AssertionResult fp32_results_agree(const std::vector<uint32_t>& host, const std::vector<uint32_t>& device) {
  std::vector<uint32_t> device_nan_as_host(device);
  int64_t nan_pattern_only = 0;
  for (std::size_t i = 0; i < host.size(); ++i) {
    const bool both_nan = num::is_nan32(num::bits_float(host[i])) && num::is_nan32(num::bits_float(device[i]));
    if (both_nan && host[i] != device[i]) device_nan_as_host[i] = host[i], ++nan_pattern_only;
  }
  ::testing::AssertionResult r =
      bitwise_equal_bytes(host.data(), device_nan_as_host.data(), host.size(), DType::kF32);
  return r << " (" << nan_pattern_only << " NaN results differ only in their NaN encoding)";
}

const char* probe_name(int probe) {
  const char* names[] = {"a*b+c", "fma", "divide", "sqrtf", "sqrt64", "float_to_bf16", "float_to_f16", "f16_to_float",
                         "portable_exp", "portable_sin", "portable_cos", "portable_rsqrt"};
  return names[probe];
}

TEST(NumericsCanaryCuda, HostAndDeviceAgreeBitwiseOnEveryPrimitive) {
  DETDIT_SKIP_WITHOUT_CUDA();
  for (int probe = 0; probe < kProbeCount; ++probe) {
    SCOPED_TRACE(probe_name(probe));
    std::vector<float> a, b, c;
    make_inputs(probe, &a, &b, &c);
    const std::vector<uint32_t> device = run_on_device(a, b, c, probe, false);
    std::vector<uint32_t> host(kCount);
    for (int64_t i = 0; i < kCount; ++i) host[i] = evaluate(probe, a[i], b[i], c[i]);
    // 16-bit results (the conversions to bf16/fp16) are compared as integers, bit for bit.
    if (probe == kToBf16 || probe == kToF16)
      EXPECT_TRUE(bitwise_equal_bytes(host.data(), device.data(), kCount, DType::kI32)) << kCount << " inputs";
    else
      EXPECT_TRUE(fp32_results_agree(host, device)) << kCount << " inputs";
  }
}

// Every FP32 input (all 2^32 bit patterns): the device's conversions (the cvt
// instructions on sm_80+) against the integer definition, run on the device.
struct ConversionMismatches {
  unsigned long long count;
  unsigned long long first;  // smallest input bit pattern that differs (~0 when none)
};

DETDIT_HD uint16_t convert(bool to_bf16, float v, bool integer_form) {
  if (integer_form) return to_bf16 ? num::float_to_bf16_integer(v) : num::float_to_f16_integer(v);
  return to_bf16 ? num::float_to_bf16(v) : num::float_to_f16(v);
}

__global__ void exhaustive_conversion_kernel(bool to_bf16, ConversionMismatches* result) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (1ull << 32); i += stride) {
    const float v = num::bits_float(static_cast<uint32_t>(i));
    if (convert(to_bf16, v, false) != convert(to_bf16, v, true)) {
      atomicAdd(&result->count, 1ull);
      atomicMin(&result->first, static_cast<unsigned long long>(i));
    }
  }
}

__global__ void convert_one_kernel(bool to_bf16, uint32_t bits, uint16_t* out) {
  out[0] = convert(to_bf16, num::bits_float(bits), false);
  out[1] = convert(to_bf16, num::bits_float(bits), true);
}

TEST(NumericsCanaryCuda, DeviceConversionsEqualTheIntegerDefinitionOnEveryInput) {
  DETDIT_SKIP_WITHOUT_CUDA();
  for (bool to_bf16 : {true, false}) {
    SCOPED_TRACE(to_bf16 ? "float_to_bf16" : "float_to_f16");
    ConversionMismatches host = {0, ~0ull}, *device;
    uint16_t pair[2], *device_pair;
    ASSERT_EQ(cudaMalloc(&device, sizeof(host)), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&device_pair, sizeof(pair)), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(device, &host, sizeof(host), cudaMemcpyHostToDevice), cudaSuccess);
    exhaustive_conversion_kernel<<<2048, 256>>>(to_bf16, device);
    ASSERT_EQ(cudaMemcpy(&host, device, sizeof(host), cudaMemcpyDeviceToHost), cudaSuccess);
    if (host.count != 0) {
      convert_one_kernel<<<1, 1>>>(to_bf16, static_cast<uint32_t>(host.first), device_pair);
      ASSERT_EQ(cudaMemcpy(pair, device_pair, sizeof(pair), cudaMemcpyDeviceToHost), cudaSuccess);
      ADD_FAILURE() << host.count << " of 2^32 inputs differ; first input 0x" << std::hex << host.first
                    << ": device 0x" << pair[0] << ", integer form 0x" << pair[1];
    }
    cudaFree(device), cudaFree(device_pair);
  }
}

TEST(NumericsCanaryCuda, PlainMultiplyAddIsNotContracted) {
  DETDIT_SKIP_WITHOUT_CUDA();
  std::vector<float> a, b, c;
  make_inputs(kMulAdd, &a, &b, &c);
  const std::vector<uint32_t> device = run_on_device(a, b, c, kMulAdd, true);
  std::vector<uint32_t> host(kCount), fused(kCount);
  for (int64_t i = 0; i < kCount; ++i) {
    host[i] = num::float_bits(a[i] * b[i] + c[i]);  // host build: -ffp-contract=off
    fused[i] = num::float_bits(std::fmaf(a[i], b[i], c[i]));
  }
  EXPECT_TRUE(fp32_results_agree(host, device));
  // Non-vacuity: contraction would be visible on these inputs.
  int64_t differ = 0;
  for (int64_t i = 0; i < kCount; ++i) differ += host[i] != fused[i];
  EXPECT_GT(differ, 1000);
}

}  // namespace
}  // namespace testing
}  // namespace detdit
