// The check runner of the op-case library (cases/checks.h), the one `detdit
// verify` and `verify --matrix` use: on the CPU at small dimensions every
// verify-suite case and every parallel problem passes every check, and each
// kind of check fails when its property is broken (an op that is not
// repeatable, a WS1 with one bit flipped, a ULP bound that is not met).
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cases/checks.h"
#include "detdit/parallel.h"
#include "support/test_util.h"

namespace detdit {
namespace testing {
namespace {

using cases::CaseContext;
using cases::CheckRow;
using cases::OpCase;
using cases::Suite;

// Dimensions of the CLI tests' small weights (H = 64), --quick sizes.
CaseContext small_context() {
  CaseContext ctx;
  ctx.hidden = 64;
  ctx.time_embed_hidden = 64;
  ctx.time_embed_dim = 32;
  ctx.freq_dim = 16;
  ctx.quick = true;
  ctx.seed = 3;
  return ctx;
}

int64_t checks_passed(const std::vector<CheckRow>& rows, int64_t* checks) {
  int64_t passed = 0;
  *checks = 0;
  for (const CheckRow& row : rows) {
    if (row.informational) continue;
    ++*checks;
    passed += row.pass ? 1 : 0;
    EXPECT_TRUE(row.pass) << row.check << ": " << row.detail;
  }
  return passed;
}

TEST(Checks, EveryVerifyCasePassesEveryCheckOnTheCpu) {
  int ops = 0;
  for (const std::string& op : cases::case_ops()) {
    const std::vector<OpCase> all = cases::op_cases(op, Suite::kVerify, small_context());
    if (all.empty()) continue;
    SCOPED_TRACE(op);
    std::vector<CheckRow> rows;
    DETDIT_ASSERT_OK(cases::check_op_cases(all, Device::cpu(), &rows));
    int64_t checks = 0;
    EXPECT_EQ(checks_passed(rows, &checks), checks);
    // At least the first run and both repeatabilities, each having compared bytes.
    EXPECT_GE(checks, 2) << "too few checks";
    int64_t compared = 0;
    for (const CheckRow& row : rows) compared += row.bitwise_run;
    EXPECT_GT(compared, 0);
    ++ops;
  }
  EXPECT_GE(ops, 9);
}

// An op whose second run differs in one bit fails forward repeatability with
// the element and both values; the other checks of the case still pass.
TEST(Checks, ARunThatIsNotRepeatableFailsRepeatability) {
  std::vector<OpCase> all = cases::op_cases("gate_residual", Suite::kVerify, small_context());
  ASSERT_FALSE(all.empty());
  OpCase c = all.front();
  auto calls = std::make_shared<int>(0);
  const cases::RunFn forward = c.forward;
  c.forward = [forward, calls](const cases::Instance& t, Stream stream) {
    DETDIT_RETURN_IF_ERROR(forward(t, stream));
    if (++*calls == 2) static_cast<unsigned char*>(t["out"].data)[0] ^= 1;
    return Status::ok_status();
  };
  c.alone = nullptr;  // its one-position runs would be further calls
  std::vector<CheckRow> rows;
  DETDIT_ASSERT_OK(cases::check_op_case(c, Device::cpu(), &rows));
  bool saw = false;
  for (const CheckRow& row : rows) {
    if (row.check != "forward repeatability") {
      EXPECT_TRUE(row.pass) << row.check << ": " << row.detail;
      continue;
    }
    saw = true;
    EXPECT_FALSE(row.pass);
    EXPECT_LT(row.bitwise_passed, row.bitwise_run);
    EXPECT_NE(row.detail.find("out: 1 of"), std::string::npos) << row.detail;
    EXPECT_NE(row.detail.find("first at index 0"), std::string::npos) << row.detail;
  }
  EXPECT_TRUE(saw);
}

TEST(Checks, AnErrorAboveItsBoundFails) {
  CheckRow row = cases::timed_check("accuracy", [](CheckRow* r) {
    r->max_error = 2.5;
    r->bound = 2.0;
    r->error_unit = "ulp";
    return Status::ok_status();
  });
  EXPECT_FALSE(row.pass);
  EXPECT_NE(row.detail.find("exceeds the bound"), std::string::npos) << row.detail;
  row = cases::timed_check("accuracy", [](CheckRow* r) {
    r->max_error = std::nan("");
    r->bound = 2.0;
    return Status::ok_status();
  });
  EXPECT_FALSE(row.pass) << "a NaN error must fail";
  row = cases::timed_check("ran", [](CheckRow*) { return Status::runtime_error("the op refused"); });
  EXPECT_FALSE(row.pass);
  EXPECT_NE(row.detail.find("the op refused"), std::string::npos);
}

TEST(Checks, SpRegionAndTpWorldsPassAtEveryWorldSize) {
  const CaseContext ctx = small_context();
  cases::ParallelSetting setting;
  setting.quick = true;
  const std::vector<cases::SpRegionCase> sp = cases::sp_region_cases(ctx, setting);
  ASSERT_FALSE(sp.empty());
  std::vector<CheckRow> rows;
  DETDIT_ASSERT_OK(cases::check_sp_region(ctx, Device::cpu(), nullptr, sp.front(), &rows));
  int64_t checks = 0;
  EXPECT_EQ(checks_passed(rows, &checks), checks);
  EXPECT_EQ(checks, static_cast<int64_t>(sp.front().worlds.size()));
  // 23 tensors per rank of a world of w ranks.
  for (std::size_t i = 0; i < sp.front().worlds.size(); ++i)
    EXPECT_EQ(rows[i].bitwise_run, 23 * sp.front().worlds[i]) << rows[i].check;
  const std::vector<cases::TpCase> tp = cases::tp_adaln_projection_cases(ctx, setting);
  ASSERT_FALSE(tp.empty());
  rows.clear();
  DETDIT_ASSERT_OK(cases::check_tp_worlds(ctx, Device::cpu(), nullptr, tp.front().shape, tp.front().worlds, false, &rows));
  EXPECT_EQ(checks_passed(rows, &checks), checks);
  EXPECT_EQ(checks, static_cast<int64_t>(tp.front().worlds.size()));
}

// One bit of one variant's WS1 flipped: every world row of that variant
// fails, naming a rank and the output; the other variants pass.
TEST(Checks, ACorruptWs1FailsItsVariantsWorldRows) {
  cases::SpShape shape;
  shape.seq_len = 300;
  shape.hidden = 64;
  std::vector<cases::SpVariantRows> out;
  DETDIT_ASSERT_OK(cases::check_sp_matrix(small_context(), Device::cpu(), shape, {1, 3}, {}, "gate_residual", &out));
  ASSERT_EQ(out.size(), 4u);
  for (const cases::SpVariantRows& v : out) {
    for (const CheckRow& row : v.rows) {
      if (v.variant == "gate_residual") {
        EXPECT_FALSE(row.pass) << row.check;
        EXPECT_NE(row.detail.find("rank 0: gate_residual "), std::string::npos) << row.detail;
      } else {
        EXPECT_TRUE(row.pass) << v.variant << " " << row.check << ": " << row.detail;
      }
    }
  }
}

// The rows of a multi-process run, merged on every rank: counts summed, the
// first failing rank named, a rank with fewer rows failing the rows it lacks.
TEST(Checks, RowsOfEveryRankMergeOnEveryRank) {
  std::vector<std::vector<CheckRow>> merged(3);
  DETDIT_ASSERT_OK(InProcessGroup::run(3, [&](Communicator& comm) {
    std::vector<CheckRow> rows(comm.rank() == 2 ? 1 : 2);
    for (std::size_t i = 0; i < rows.size(); ++i) {
      rows[i].check = "check " + std::to_string(i);
      rows[i].bitwise_run = 2;
      rows[i].bitwise_passed = comm.rank() == 1 && i == 1 ? 1 : 2;
      rows[i].seconds = comm.rank();
      cases::finish_row(&rows[i]);
      if (!rows[i].pass) rows[i].detail = "x differs";
    }
    DETDIT_RETURN_IF_ERROR(cases::merge_rank_rows(comm, &rows));
    merged[static_cast<std::size_t>(comm.rank())] = rows;
    return Status::ok_status();
  }, Device::cpu()));
  for (const std::vector<CheckRow>& rows : merged) {
    ASSERT_EQ(rows.size(), 2u);
    EXPECT_TRUE(rows[0].pass) << rows[0].detail;
    EXPECT_EQ(rows[0].bitwise_run, 6);
    EXPECT_EQ(rows[0].bitwise_passed, 6);
    EXPECT_EQ(rows[0].seconds, 2.0);
    EXPECT_FALSE(rows[1].pass);
    EXPECT_EQ(rows[1].bitwise_run, 4);
    EXPECT_EQ(rows[1].bitwise_passed, 3);
    EXPECT_EQ(rows[1].detail, "rank 1: x differs");
  }
}

}  // namespace
}  // namespace testing
}  // namespace detdit
