// adaln_table_add (docs/numerics.md 5.13, 6.12) on the CPU reference against
// the formulas written out here element by element (FP32 adds, one rounding):
// the forward in every promotion (Wan's fp32 table + bf16 projection, LTX's
// bf16 + bf16, the final layers' (T, 1, H) broadcast), d_proj, d_table by the
// canonical reduction (chunks of 256 rows, then the chunk fold), a row's
// output and d_proj unchanged by the other rows, validation. Also the families'
// chunk orders and the general adaln_table_chunk, and adaln_projection with a
// family's chunk count and a bf16 temb.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "support/cases.h"
#include "support/test_util.h"
#include "detdit/adaln.h"
#include "detdit/plan.h"

namespace detdit {
namespace testing {
namespace {

struct TableAdd {
  int64_t rows, k, hidden;
  bool broadcast;
  HostTensor table, proj, out, grad, d_table, d_proj;
  TableAdd(int64_t t, int64_t kk, int64_t h, DType table_dtype, DType proj_dtype, bool bcast, uint64_t seed)
      : rows(t), k(kk), hidden(h), broadcast(bcast), table(table_dtype, {kk, h}),
        proj(proj_dtype, {t, bcast ? 1 : kk, h}),
        out(table_dtype == proj_dtype ? table_dtype : DType::kF32, {t, kk, h}),
        grad(out.dtype(), {t, kk, h}), d_table(table_dtype, {kk, h}), d_proj(proj_dtype, {t, bcast ? 1 : kk, h}) {
    fill_normal(&table, seed, 0.0, 0.5);
    fill_normal(&proj, seed + 1, 0.0, 1.0);
    fill_normal(&grad, seed + 2, 0.0, 1.0);
  }
  Status forward() { return adaln_table_add_forward({table.view(), proj.view(), out.view()}); }
  Status backward() { return adaln_table_add_backward({grad.view(), d_table.view(), d_proj.view()}); }
  int64_t proj_index(int64_t t, int64_t c, int64_t h) const { return broadcast ? t * hidden + h : (t * k + c) * hidden + h; }
};

HostTensor expected_out(const TableAdd& a) {
  HostTensor e(a.out.dtype(), a.out.shape());
  for (int64_t t = 0; t < a.rows; ++t)
    for (int64_t c = 0; c < a.k; ++c)
      for (int64_t h = 0; h < a.hidden; ++h) {
        const float v = static_cast<float>(a.table.get(c * a.hidden + h)) + static_cast<float>(a.proj.get(a.proj_index(t, c, h)));
        e.set((t * a.k + c) * a.hidden + h, v);
      }
  return e;
}

HostTensor expected_d_proj(const TableAdd& a) {
  HostTensor e(a.d_proj.dtype(), a.d_proj.shape());
  for (int64_t t = 0; t < a.rows; ++t)
    for (int64_t h = 0; h < a.hidden; ++h) {
      if (!a.broadcast) {
        for (int64_t c = 0; c < a.k; ++c) e.set((t * a.k + c) * a.hidden + h, a.grad.get((t * a.k + c) * a.hidden + h));
        continue;
      }
      float acc = 0.0f;
      for (int64_t c = 0; c < a.k; ++c) acc += static_cast<float>(a.grad.get((t * a.k + c) * a.hidden + h));
      e.set(t * a.hidden + h, acc);
    }
  return e;
}

// numerics 6.5 without an index: per 256 rows an ascending FP32 chain from
// +0.0, then the ascending chain over the chunks' partials, one rounding.
HostTensor expected_d_table(const TableAdd& a) {
  HostTensor e(a.d_table.dtype(), a.d_table.shape());
  for (int64_t j = 0; j < a.k * a.hidden; ++j) {
    float fold = 0.0f;
    for (int64_t begin = 0; begin < a.rows; begin += kReductionChunk) {
      float partial = 0.0f;
      for (int64_t t = begin; t < std::min(a.rows, begin + kReductionChunk); ++t)
        partial += static_cast<float>(a.grad.get(t * a.k * a.hidden + j));
      fold += partial;
    }
    e.set(j, fold);
  }
  return e;
}

struct Setting {
  const char* name;
  DType table, proj;
  int64_t rows, k, hidden;
  bool broadcast;
};

const std::vector<Setting> kSettings = {
    {"wan block: fp32 table + bf16 proj", DType::kF32, DType::kBF16, 5, 6, 16, false},
    {"ltx block: bf16 + bf16", DType::kBF16, DType::kBF16, 4, 6, 8, false},
    {"wan final: fp32 table + fp32 temb (T, 1, H)", DType::kF32, DType::kF32, 3, 2, 24, true},
    {"ltx final: bf16 + bf16 (T, 1, H)", DType::kBF16, DType::kBF16, 6, 2, 8, true},
    {"fp16 table + bf16 proj -> fp32", DType::kF16, DType::kBF16, 2, 3, 8, false},
    {"per token past two chunks", DType::kF32, DType::kBF16, 700, 6, 4, false},
};

TEST(AdalnTableAdd, ForwardAndGradientsAreTheWrittenFormulas) {
  uint64_t seed = 10;
  for (const Setting& s : kSettings) {
    SCOPED_TRACE(s.name);
    TableAdd a(s.rows, s.k, s.hidden, s.table, s.proj, s.broadcast, seed += 10);
    DETDIT_ASSERT_OK(a.forward());
    EXPECT_TRUE(bitwise_equal(expected_out(a), a.out));
    DETDIT_ASSERT_OK(a.backward());
    EXPECT_TRUE(bitwise_equal(expected_d_proj(a), a.d_proj));
    EXPECT_TRUE(bitwise_equal(expected_d_table(a), a.d_table));
  }
}

TEST(AdalnTableAdd, FP32TableGradientIsTheUnroundedFold) {
  TableAdd a(300, 2, 8, DType::kBF16, DType::kBF16, false, 5);
  HostTensor d_table32(DType::kF32, {2, 8});
  DETDIT_ASSERT_OK(adaln_table_add_backward({a.grad.view(), d_table32.view(), TensorView()}));
  HostTensor rounded = expected_d_table(a);  // the same fold, rounded to bf16
  for (int64_t j = 0; j < 16; ++j) {
    HostTensor one(DType::kBF16, {1});
    one.set(0, d_table32.get(j));
    EXPECT_EQ(one.get(0), rounded.get(j)) << j;
  }
}

// A row's output and d_proj are the same with or without the other rows
// (batch invariance of the elementwise parts).
TEST(AdalnTableAdd, RowAloneEqualsRowInTheBatch) {
  TableAdd all(9, 6, 8, DType::kF32, DType::kBF16, false, 40);
  DETDIT_ASSERT_OK(all.forward());
  DETDIT_ASSERT_OK(all.backward());
  const int64_t width = 6 * 8;
  for (int64_t t : {0, 4, 8}) {
    TableAdd one(1, 6, 8, DType::kF32, DType::kBF16, false, 40);
    one.table = all.table;
    std::memcpy(one.proj.data(), all.proj.ptr<uint16_t>() + t * width, width * 2);
    std::memcpy(one.grad.data(), all.grad.ptr<float>() + t * width, width * 4);
    DETDIT_ASSERT_OK(one.forward());
    DETDIT_ASSERT_OK(one.backward());
    EXPECT_EQ(0, std::memcmp(one.out.data(), all.out.ptr<float>() + t * width, width * 4)) << t;
    EXPECT_EQ(0, std::memcmp(one.d_proj.data(), all.d_proj.ptr<uint16_t>() + t * width, width * 2)) << t;
  }
}

TEST(AdalnTableAdd, RejectsBadArgumentsAndWritesNothing) {
  TableAdd a(3, 6, 8, DType::kF32, DType::kBF16, false, 60);
  HostTensor out_bf16(DType::kBF16, {3, 6, 8}), table_wrong(DType::kF32, {5, 8}), proj_wrong(DType::kBF16, {3, 2, 8});
  struct Case {
    std::string name;
    ErrorKind kind;
    std::string part;
    std::function<void(AdalnTableAddParams*)> edit;
  };
  const std::vector<Case> cases = {
      {"out not promoted", ErrorKind::kType, "out must have the promoted dtype", [&](auto* p) { p->out = out_bf16.view(); }},
      {"table K", ErrorKind::kValue, "table must be (K, H)", [&](auto* p) { p->table = table_wrong.view(); }},
      {"proj K neither K nor 1", ErrorKind::kValue, "proj must be (T, K, H)", [&](auto* p) { p->proj = proj_wrong.view(); }},
      {"proj 2-D", ErrorKind::kValue, "proj must be a 3-D", [&](auto* p) { p->proj = a.proj.view_as({3, 48}); }},
      {"table missing", ErrorKind::kValue, "table is required", [&](auto* p) { p->table = TensorView(); }},
      {"out aliases proj", ErrorKind::kValue, "must not overlap", [&](auto* p) {
         p->out = TensorView::contiguous(a.proj.data(), DType::kF32, {3, 6, 8});
       }},
  };
  for (const Case& bad : cases) {
    SCOPED_TRACE(bad.name);
    a.out.fill_bytes(kCanary);
    out_bf16.fill_bytes(kCanary);
    AdalnTableAddParams p{a.table.view(), a.proj.view(), a.out.view()};
    bad.edit(&p);
    const Status s = adaln_table_add_forward(p);
    EXPECT_EQ(s.kind(), bad.kind) << s.to_string();
    EXPECT_NE(s.message().find(bad.part), std::string::npos) << s.to_string();
    EXPECT_TRUE(still_canary({&a.out, &out_bf16}));
  }
  HostTensor d_table_wrong(DType::kF32, {6, 4});
  a.d_table.fill_bytes(kCanary);
  a.d_proj.fill_bytes(kCanary);
  Status s = adaln_table_add_backward({a.grad.view(), d_table_wrong.view(), a.d_proj.view()});
  EXPECT_EQ(s.kind(), ErrorKind::kValue) << s.to_string();
  EXPECT_TRUE(still_canary({&a.d_proj}));
  s = adaln_table_add_backward({a.grad.view(), a.d_table.view(), proj_wrong.view()});
  EXPECT_EQ(s.kind(), ErrorKind::kValue) << s.to_string();
  EXPECT_TRUE(still_canary({&a.d_table}));
}

// ---- the chunk orders and adaln_table_chunk with a family's chunk count ----

TEST(AdalnChunkOrder, EveryFamilyOrderByName) {
  const AdalnChunkOrder* order = nullptr;
  const std::vector<std::pair<std::string, std::vector<std::string>>> expected = {
      {"ada_layer_norm_continuous", {"scale", "shift"}},
      {"ada_layer_norm", {"shift", "scale"}},
      {"ada_layer_norm_zero_single", {"shift", "scale", "gate"}},
      {"cogvideox_layer_norm_zero", {"shift", "scale", "gate", "enc_shift", "enc_scale", "enc_gate"}},
      {"wan_block", {"shift", "scale", "gate", "c_shift", "c_scale", "c_gate"}},
      {"scale_shift_table_final", {"shift", "scale"}},
  };
  for (const auto& [name, chunks] : expected) {
    SCOPED_TRACE(name);
    DETDIT_ASSERT_OK(adaln_chunk_order(name, &order));
    ASSERT_EQ(order->count, static_cast<int>(chunks.size()));
    for (int c = 0; c < order->count; ++c) EXPECT_EQ(chunks[c], order->chunks[c]);
  }
  DETDIT_ASSERT_OK(adaln_chunk_order("sd35_ada_layer_norm_zero_x", &order));
  int chunk = -1;
  DETDIT_ASSERT_OK(adaln_chunk_index(*order, "gate_msa2", &chunk));
  EXPECT_EQ(chunk, 8);
  EXPECT_EQ(adaln_chunk_index(*order, "gate", &chunk).kind(), ErrorKind::kIndex);
  const Status s = adaln_chunk_order("flux", &order);
  EXPECT_EQ(s.kind(), ErrorKind::kValue);
  EXPECT_NE(s.message().find("known: h3, ada_layer_norm_zero"), std::string::npos) << s.to_string();
}

TEST(AdalnChunkOrder, ChunkViewOfAFamilyTable) {
  // (T = 4, 3 * H) AdaLayerNormZeroSingle table: chunk c is (4, H) at column c*H.
  const int64_t hidden = 5;
  HostTensor table(DType::kF32, {4, 3 * hidden});
  for (int64_t i = 0; i < table.numel(); ++i) table.set(i, static_cast<double>(i));
  for (int c = 0; c < 3; ++c) {
    TensorView v;
    DETDIT_ASSERT_OK(adaln_table_chunk(table.view(), hidden, 3, c, &v));
    EXPECT_EQ(v.shape[0], 4);
    EXPECT_EQ(v.shape[1], hidden);
    EXPECT_EQ(v.strides[0], 3 * hidden);
    for (int64_t t = 0; t < 4; ++t)
      for (int64_t h = 0; h < hidden; ++h) EXPECT_EQ(v.ptr<float>()[t * v.strides[0] + h], table.get(t * 3 * hidden + c * hidden + h));
  }
  // H3's (T, 18H) table with 6 chunks is the H3 overload's (3T, H) view.
  HostTensor h3(DType::kBF16, {2, 18 * 4});
  for (int c = 0; c < 6; ++c) {
    TensorView general, h3_view;
    DETDIT_ASSERT_OK(adaln_table_chunk(h3.view(), 4, 6, c, &general));
    DETDIT_ASSERT_OK(adaln_table_chunk(h3.view(), 4, c, &h3_view));
    EXPECT_EQ(general.data, h3_view.data);
    EXPECT_EQ(general.shape[0], h3_view.shape[0]);
    EXPECT_EQ(general.strides[0], h3_view.strides[0]);
  }
  TensorView v;
  EXPECT_EQ(adaln_table_chunk(table.view(), hidden, 3, 3, &v).kind(), ErrorKind::kIndex);
  EXPECT_EQ(adaln_table_chunk(table.view(), 4, 3, 0, &v).kind(), ErrorKind::kValue);
}

// ---- adaln_projection with a family's chunk count ----

TEST(AdalnProjectionFamilies, Bf16TembIsTheWidenedFp32Temb) {
  // act = R_W(silu_P(temb)) with the bf16 temb widened exactly: the same bits
  // as the same values given as fp32, forward and every gradient.
  const int64_t t = 3, d = 16, n = 3 * 8;
  HostTensor temb16(DType::kBF16, {t, d}), temb32(DType::kF32, {t, d}), weight(DType::kBF16, {n, d}), bias(DType::kBF16, {n});
  fill_normal(&temb16, 1, 0.0, 2.0);
  for (int64_t i = 0; i < temb16.numel(); ++i) temb32.set(i, temb16.get(i));
  fill_normal(&weight, 2, 0.0, 0.05);
  fill_normal(&bias, 3, 0.0, 0.5);
  HostTensor grad(DType::kF32, {t, n});
  fill_normal(&grad, 4, 0.0, 1.0);
  HostTensor table[2] = {{DType::kBF16, {t, n}}, {DType::kBF16, {t, n}}}, act[2] = {{DType::kBF16, {t, d}}, {DType::kBF16, {t, d}}};
  HostTensor d_temb[2] = {{DType::kF32, {t, d}}, {DType::kF32, {t, d}}}, d_w[2] = {{DType::kBF16, {n, d}}, {DType::kBF16, {n, d}}};
  HostTensor d_b[2] = {{DType::kBF16, {n}}, {DType::kBF16, {n}}};
  for (int i = 0; i < 2; ++i) {
    const AdalnProjectionInputs in{i ? temb32.view() : temb16.view(), weight.view(), bias.view(), Numerics::kPortable, 3};
    DETDIT_ASSERT_OK(adaln_projection_forward({in, table[i].view(), act[i].view()}));
    DETDIT_ASSERT_OK(adaln_projection_backward({in, act[i].view(), grad.view(), d_temb[i].view(), d_w[i].view(), d_b[i].view()}));
  }
  EXPECT_TRUE(bitwise_equal(table[1], table[0]));
  EXPECT_TRUE(bitwise_equal(act[1], act[0]));
  EXPECT_TRUE(bitwise_equal(d_temb[1], d_temb[0]));
  EXPECT_TRUE(bitwise_equal(d_w[1], d_w[0]));
  EXPECT_TRUE(bitwise_equal(d_b[1], d_b[0]));
}

TEST(AdalnProjectionFamilies, ChunkCountIsValidated) {
  HostTensor temb(DType::kBF16, {2, 8}), temb16(DType::kF16, {2, 8}), weight(DType::kBF16, {20, 8}), bias(DType::kBF16, {20}),
      table(DType::kBF16, {2, 20}), weight32(DType::kF32, {20, 8}), bias32(DType::kF32, {20}), table32(DType::kF32, {2, 20});
  auto run = [&](const TensorView& te, const TensorView& w, const TensorView& b, const TensorView& out, int chunks) {
    return adaln_projection_forward({{te, w, b, Numerics::kPortable, chunks}, out, TensorView()});
  };
  DETDIT_EXPECT_OK(run(temb.view(), weight.view(), bias.view(), table.view(), 2));  // AdaLayerNormContinuous, H = 10
  Status s = run(temb.view(), weight.view(), bias.view(), table.view(), 6);
  EXPECT_EQ(s.kind(), ErrorKind::kValue);
  EXPECT_NE(s.message().find("not a positive multiple of 6"), std::string::npos) << s.to_string();
  s = run(temb.view(), weight32.view(), bias32.view(), table32.view(), 2);  // bf16 temb, fp32 weight
  EXPECT_EQ(s.kind(), ErrorKind::kType);
  EXPECT_NE(s.message().find("temb must be float32 or weight's dtype (float32)"), std::string::npos) << s.to_string();
  s = run(temb16.view(), weight.view(), bias.view(), table.view(), 2);
  EXPECT_EQ(s.kind(), ErrorKind::kType);
  s = run(temb.view(), weight.view(), bias.view(), table.view(), -1);
  EXPECT_EQ(s.kind(), ErrorKind::kValue);
  // H3's rule (chunks 0) still refuses a bf16 temb.
  s = run(temb.view(), weight.view(), bias.view(), table.view(), 0);
  EXPECT_EQ(s.kind(), ErrorKind::kType);
}

}  // namespace
}  // namespace testing
}  // namespace detdit
