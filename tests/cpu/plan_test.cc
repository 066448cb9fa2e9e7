// IndexPlan: validation of every index entry (first bad position and value,
// IndexError, nothing clamped), argument errors, and the chunk tables checked
// against their definition (plan.h) recomputed directly from the index.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <map>
#include <vector>

#include "common/cases.h"
#include "common/test_util.h"
#include "detdit/plan.h"

namespace detdit {
namespace {

using testing::IndexCase;
using testing::Packing;

TensorView index_view(std::vector<int64_t>& v) {
  return TensorView::contiguous(v.data(), DType::kI64, {static_cast<int64_t>(v.size())});
}

// The tables a plan must hold, from the definition: chunk c's segments are its
// distinct rows ascending, each with its positions ascending; a row's segments
// in ascending chunk order.
void expect_tables_match_definition(const IndexPlan& plan, const std::vector<int64_t>& row_of_seq, int64_t batch) {
  const int64_t seq_len = static_cast<int64_t>(row_of_seq.size());
  const int64_t positions = seq_len * batch;
  ASSERT_EQ(plan.seq_len(), seq_len);
  ASSERT_EQ(plan.batch(), batch);
  ASSERT_EQ(plan.positions(), positions);
  ASSERT_EQ(plan.num_chunks(), (positions + 255) / 256);
  const PlanTables& t = plan.host_tables();
  for (int64_t s = 0; s < seq_len; ++s) ASSERT_EQ(t.row_of_seq[s], row_of_seq[s]) << s;
  int64_t segment = 0;
  std::map<int64_t, std::vector<int64_t>> segments_of_row;
  for (int64_t c = 0; c < plan.num_chunks(); ++c) {
    std::map<int64_t, std::vector<int64_t>> members;  // row -> positions, ascending
    for (int64_t p = c * 256; p < std::min(positions, (c + 1) * 256); ++p) members[row_of_seq[p % seq_len]].push_back(p);
    ASSERT_EQ(t.chunk_segment_begin[c], segment) << "chunk " << c;
    for (const auto& [row, ps] : members) {
      ASSERT_EQ(t.segment_row[segment], row) << "segment " << segment;
      ASSERT_EQ(t.segment_pos_begin[segment + 1] - t.segment_pos_begin[segment], static_cast<int32_t>(ps.size()));
      for (std::size_t i = 0; i < ps.size(); ++i)
        ASSERT_EQ(t.segment_positions[t.segment_pos_begin[segment] + i], ps[i]) << "segment " << segment;
      segments_of_row[row].push_back(segment);
      ++segment;
    }
  }
  ASSERT_EQ(t.chunk_segment_begin[plan.num_chunks()], segment);
  ASSERT_EQ(plan.num_segments(), segment);
  for (int64_t r = 0; r < plan.num_rows(); ++r) {
    const std::vector<int64_t>& expected = segments_of_row[r];
    ASSERT_EQ(t.row_segment_begin[r + 1] - t.row_segment_begin[r], static_cast<int32_t>(expected.size())) << r;
    for (std::size_t i = 0; i < expected.size(); ++i) ASSERT_EQ(t.row_segments[t.row_segment_begin[r] + i], expected[i]);
  }
}

TEST(IndexPlan, TablesMatchTheirDefinitionForEveryPacking) {
  for (const IndexCase& c : testing::standard_cases(3 * 4097)) {
    SCOPED_TRACE(c.name());
    std::vector<int64_t> rows(c.seq_len);
    for (int64_t s = 0; s < c.seq_len; ++s) rows[s] = c.row(s);
    IndexPlan plan = testing::adaln_plan(c);
    ASSERT_TRUE(plan.valid());
    EXPECT_EQ(plan.num_rows(), 3 * c.num_timesteps);
    expect_tables_match_definition(plan, rows, c.batch);
    // The row-index constructor gives the same tables.
    expect_tables_match_definition(testing::plan_from_rows(rows, 3 * c.num_timesteps, c.batch), rows, c.batch);
  }
}

TEST(IndexPlan, Int32IndexGivesTheSamePlan) {
  std::vector<int32_t> rows32 = {2, 0, 2, 1, 1, 0, 2};
  std::vector<int64_t> rows64(rows32.begin(), rows32.end());
  IndexPlan plan;
  DETDIT_ASSERT_OK(IndexPlan::from_row_index(TensorView::contiguous(rows32.data(), DType::kI32, {7}), 4, 40, &plan));
  expect_tables_match_definition(plan, rows64, 40);
  EXPECT_EQ(plan.device(), Device::cpu());
}

TEST(IndexPlan, BadRowIndexNamesTheFirstBadPositionAndValue) {
  for (int64_t bad : {int64_t{-1}, int64_t{5}, int64_t{6}, int64_t{1} << 40}) {
    std::vector<int64_t> rows = {0, 1, 4, bad, 2, -7};
    IndexPlan plan;
    Status s = IndexPlan::from_row_index(index_view(rows), 5, 1, &plan);
    ASSERT_EQ(s.kind(), ErrorKind::kIndex) << s.to_string();
    EXPECT_NE(s.message().find("row_index[3] = " + std::to_string(bad)), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("[0, 5)"), std::string::npos) << s.message();
    EXPECT_FALSE(plan.valid());
  }
}

TEST(IndexPlan, BadTimestepOrTagNamesTheFirstBadPosition) {
  struct Bad {
    int64_t position, ti, tag;
    const char* expected;
  };
  // (2^64 + 2) / 3 as an int64 would wrap ti*3 + tag to row 2 if multiplied first.
  const int64_t wraps = static_cast<int64_t>((~uint64_t{0}) / 3 + 1);
  const Bad cases[] = {
      {2, -1, 0, "timestep_indices[2] = -1"},
      {4, 3, 0, "timestep_indices[4] = 3"},
      {1, 0, 3, "token_tags[1] = 3"},
      {3, 1, -1, "token_tags[3] = -1"},
      {0, wraps, 2, "timestep_indices[0] = 6148914691236517206"},
  };
  for (const Bad& b : cases) {
    std::vector<int64_t> ti = {0, 1, 2, 0, 1, 2}, tags = {0, 1, 2, 2, 1, 0};
    ti[b.position] = b.ti;
    tags[b.position] = b.tag;
    ti[5] = -5;  // a later bad entry is not the one reported
    IndexPlan plan;
    Status s = IndexPlan::from_timesteps_and_tags(index_view(ti), index_view(tags), 3, 2, &plan);
    ASSERT_EQ(s.kind(), ErrorKind::kIndex) << s.to_string();
    EXPECT_NE(s.message().find(b.expected), std::string::npos) << s.message();
    EXPECT_FALSE(plan.valid());
  }
}

TEST(IndexPlan, ArgumentErrorsAreClear) {
  std::vector<int64_t> rows = {0, 1, 2};
  std::vector<int32_t> rows32 = {0, 1, 2};
  std::vector<float> floats = {0, 1, 2};
  IndexPlan plan;
  auto expect = [&](Status s, ErrorKind kind, const char* text) {
    EXPECT_EQ(s.kind(), kind) << s.to_string();
    EXPECT_NE(s.message().find(text), std::string::npos) << s.message();
    EXPECT_FALSE(plan.valid());
  };
  expect(IndexPlan::from_row_index(index_view(rows), 3, 0, &plan), ErrorKind::kValue, "batch must be >= 1, got 0");
  expect(IndexPlan::from_row_index(index_view(rows), 0, 1, &plan), ErrorKind::kValue, "num_rows must be >= 1");
  expect(IndexPlan::from_row_index(TensorView::contiguous(floats.data(), DType::kF32, {3}), 3, 1, &plan),
         ErrorKind::kType, "row_index must be int64 or int32, got float32");
  expect(IndexPlan::from_row_index(TensorView::contiguous(rows.data(), DType::kI64, {0}), 3, 1, &plan),
         ErrorKind::kValue, "S >= 1");
  expect(IndexPlan::from_row_index(TensorView::contiguous(rows.data(), DType::kI64, {1, 3}), 3, 1, &plan),
         ErrorKind::kValue, "row_index must be a 1-D");
  expect(IndexPlan::from_row_index(TensorView::strided(rows.data(), DType::kI64, {2}, {2}), 3, 1, &plan),
         ErrorKind::kValue, "contiguous");
  expect(IndexPlan::from_row_index(TensorView(), 3, 1, &plan), ErrorKind::kValue, "row_index is required");
  expect(IndexPlan::from_row_index(index_view(rows), 3, int64_t{1} << 31, &plan), ErrorKind::kValue,
         "batch * seq_len must be < 2^31");
  expect(IndexPlan::from_timesteps_and_tags(index_view(rows), TensorView::contiguous(rows32.data(), DType::kI32, {3}),
                                            3, 1, &plan),
         ErrorKind::kType, "must share an integer dtype");
  expect(IndexPlan::from_timesteps_and_tags(index_view(rows), TensorView::contiguous(rows.data(), DType::kI64, {2}), 3,
                                            1, &plan),
         ErrorKind::kValue, "must have the same length");
  expect(IndexPlan::from_timesteps_and_tags(index_view(rows), index_view(rows), 0, 1, &plan), ErrorKind::kValue,
         "num_timesteps must be >= 1");
  TensorView on_gpu = index_view(rows);
  on_gpu.device = Device::cuda(0);
  expect(IndexPlan::from_timesteps_and_tags(index_view(rows), on_gpu, 3, 1, &plan), ErrorKind::kValue,
         "token_tags is on cuda:0, timestep_indices is on cpu");
}

TEST(IndexPlan, CopiesShareTheTablesAndAreImmutable) {
  IndexCase c = testing::make_index_case(Packing::kInterleaved, 300, 3, 2);
  IndexPlan a = testing::adaln_plan(c);
  IndexPlan b = a;
  EXPECT_EQ(a.host_tables().segment_positions, b.host_tables().segment_positions);
  EXPECT_EQ(a.num_segments(), b.num_segments());
}

TEST(IndexPlan, EmptyPlanHasNullTables) {
  IndexPlan plan;
  EXPECT_FALSE(plan.valid());
  EXPECT_EQ(plan.positions(), 0);
  EXPECT_EQ(plan.host_tables().row_of_seq, nullptr);
  EXPECT_EQ(plan.device_tables().segment_positions, nullptr);
}

// Building is O(B*S): report the time at the DESIGN's S = 131072 (target < 100 us on
// the GPU host; this machine's figure is printed, not asserted: shared CPUs vary).
TEST(IndexPlan, BuildTimeAtLongSequences) {
  IndexCase c = testing::make_index_case(Packing::kInterleaved, 131072, 4, 2);
  const auto start = std::chrono::steady_clock::now();
  IndexPlan plan = testing::adaln_plan(c);
  const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(plan.valid());
  EXPECT_EQ(plan.num_chunks(), 1024);
  std::printf("plan build, S = 131072, B = 2, T = 4, interleaved: %.0f us\n", us);
}

TEST(IndexPlan, PackingsHaveTheStatedShape) {
  // block: 3 runs of 100; each run: 5 text, 15 audio at the end, 80 video.
  IndexCase block = testing::make_index_case(Packing::kBlock, 300, 3, 1);
  int count[3][3] = {};
  for (int64_t s = 0; s < 300; ++s) ++count[block.timestep_indices[s]][block.tags[s]];
  for (int t = 0; t < 3; ++t) {
    EXPECT_EQ(count[t][0], 80);
    EXPECT_EQ(count[t][1], 5);
    EXPECT_EQ(count[t][2], 15);
  }
  EXPECT_EQ(block.tags[100], 1);
  EXPECT_EQ(block.tags[199], 2);
  IndexCase inter = testing::make_index_case(Packing::kInterleaved, 30, 4, 1);
  for (int64_t s = 0; s < 30; ++s) EXPECT_EQ(inter.timestep_indices[s], s % 4);
}

}  // namespace
}  // namespace detdit
