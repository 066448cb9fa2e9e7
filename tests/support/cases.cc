// tests/support/cases.h.
#include "support/cases.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "detdit/adaln.h"

namespace detdit {
namespace testing {
namespace {
IndexPlan must_plan(const Status& s, const IndexPlan& plan) {
  EXPECT_TRUE(s.ok()) << s.to_string();
  return plan;
}
}  // namespace

IndexPlan adaln_plan(const IndexCase& c) {
  IndexPlan plan;
  return must_plan(cases::adaln_plan(c, Device::cpu(), &plan), plan);
}

IndexPlan timestep_plan(const IndexCase& c) {
  IndexPlan plan;
  return must_plan(cases::timestep_plan(c, Device::cpu(), &plan), plan);
}

IndexPlan plan_from_rows(const std::vector<int64_t>& rows, int64_t num_rows, int64_t batch) {
  IndexPlan plan;
  return must_plan(row_plan(rows, num_rows, batch, Device::cpu(), &plan), plan);
}

::testing::AssertionResult within_tolerance(const HostTensor& got, const std::vector<double>& ref, double atol,
                                            double rtol) {
  int64_t bad = 0, worst = -1;
  double worst_excess = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double err = std::fabs(got.get(i) - ref[i]), bound = atol + rtol * std::fabs(ref[i]);
    if (!(err <= bound)) {
      ++bad;
      if (worst < 0 || err - bound > worst_excess) {
        worst = i;
        worst_excess = err - bound;
      }
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << got.numel() << " elements outside atol " << atol
                                       << " / rtol " << rtol << "; worst at " << worst << ": got " << got.get(worst)
                                       << ", reference " << ref[worst];
}

::testing::AssertionResult still_canary(const std::vector<HostTensor*>& outputs) {
  for (std::size_t i = 0; i < outputs.size(); ++i)
    if (!all_bytes_are(*outputs[i], kCanary))
      return ::testing::AssertionFailure() << "output " << i << " of " << outputs.size() << " was written";
  return ::testing::AssertionSuccess();
}

CpuCase::CpuCase(OpCase c, const std::map<std::string, HostTensor>* inputs) : case_(std::move(c)) {
  const Status s = instantiate(case_, Device::cpu(), nullptr, &instance_, inputs);
  EXPECT_TRUE(s.ok()) << case_.full_name() << ": " << s.to_string();
  if (s.ok()) {
    EXPECT_TRUE(download(case_, instance_, &host_).ok());
  }
}

Status CpuCase::run(Phase phase) {
  DETDIT_RETURN_IF_ERROR(cases::run(case_, phase, instance_));
  return download(case_, instance_, &host_);
}

Status CpuCase::run() {
  DETDIT_RETURN_IF_ERROR(run(Phase::kForward));
  return case_.has(Phase::kBackward) ? run(Phase::kBackward) : Status();
}

const HostTensor& CpuCase::operator[](const std::string& name) const {
  const auto it = host_.find(name);
  if (it == host_.end()) {
    std::fprintf(stderr, "detdit tests: %s has no tensor %s\n", case_.full_name().c_str(), name.c_str());
    std::abort();
  }
  return it->second;
}

HostTensor CpuCase::current(const std::string& name) const {
  HostTensor t;
  const Status s = instance_.tensor(name).to_host(&t);
  EXPECT_TRUE(s.ok()) << s.to_string();
  return t;
}

std::vector<HostTensor*> CpuCase::outputs() {
  const Status s = download_outputs(case_, instance_, &outputs_);
  EXPECT_TRUE(s.ok()) << s.to_string();
  std::vector<HostTensor*> all;
  for (auto& [name, t] : outputs_) all.push_back(&t);
  return all;
}

::testing::AssertionResult repeats_bitwise(const OpCase& c, std::map<std::string, HostTensor>* first) {
  CpuCase a(c), b(c);
  for (CpuCase* k : {&a, &b}) {
    const Status s = k->run();
    if (!s.ok()) return ::testing::AssertionFailure() << c.full_name() << ": " << s.to_string();
  }
  for (const TensorSpec& spec : c.tensors) {
    if (!spec.output) continue;
    const Mismatch m = compare(a[spec.name], b[spec.name]);
    if (!m.equal()) return ::testing::AssertionFailure() << spec.name << ": " << m.describe();
    if (all_bytes_are(a[spec.name], kCanary)) return ::testing::AssertionFailure() << spec.name << " was not written";
  }
  if (first) *first = a.tensors();
  return ::testing::AssertionSuccess();
}

namespace {
// Each named pair holds the same bytes.
::testing::AssertionResult all_equal(const std::vector<std::pair<const char*, std::pair<const HostTensor*, const HostTensor*>>>& pairs) {
  for (const auto& [name, tensors] : pairs) {
    const Mismatch m = compare(*tensors.first, *tensors.second);
    if (!m.equal()) return ::testing::AssertionFailure() << name << ": " << m.describe();
  }
  return ::testing::AssertionSuccess();
}
}  // namespace

::testing::AssertionResult projection_forward_matches(const CpuCase& k) {
  const HostTensor &table = k["table"], &act = k["act"];
  HostTensor want_table(table.dtype(), table.shape()), want_act(act.dtype(), act.shape());
  const Status s = adaln_projection_forward(
      {{k["temb"].view(), k["weight"].view(), k["bias"].view()}, want_table.view(), want_act.view()});
  if (!s.ok()) return ::testing::AssertionFailure() << s.to_string();
  return all_equal({{"table", {&want_table, &table}}, {"act", {&want_act, &act}}});
}

::testing::AssertionResult projection_backward_matches(const CpuCase& k, const HostTensor& d_table) {
  const HostTensor &d_temb = k["d_temb"], &d_weight = k["d_weight"], &d_bias = k["d_bias"];
  HostTensor want_temb(d_temb.dtype(), d_temb.shape()), want_weight(d_weight.dtype(), d_weight.shape());
  HostTensor want_bias(d_bias.dtype(), d_bias.shape());
  const Status s = adaln_projection_backward({{k["temb"].view(), k["weight"].view(), k["bias"].view()}, k["act"].view(),
                                              d_table.view(), want_temb.view(), want_weight.view(), want_bias.view()});
  if (!s.ok()) return ::testing::AssertionFailure() << s.to_string();
  return all_equal({{"d_temb", {&want_temb, &d_temb}}, {"d_weight", {&want_weight, &d_weight}}, {"d_bias", {&want_bias, &d_bias}}});
}

::testing::AssertionResult positions_alone_match(const OpCase& c, const std::vector<int64_t>& positions) {
  std::vector<OutputReport> reports;
  const Status s = compare_positions_alone(c, Device::cpu(), positions, &reports);
  if (!s.ok()) return ::testing::AssertionFailure() << s.to_string();
  if (reports.empty()) return ::testing::AssertionFailure() << c.full_name() << ": no per-position output compared";
  for (const OutputReport& r : reports)
    if (!r.mismatch.equal()) return ::testing::AssertionFailure() << r.output << ": " << r.mismatch.describe();
  return ::testing::AssertionSuccess();
}

int64_t case_elements(const OpCase& c) {
  int64_t total = 0;
  for (const TensorSpec& t : c.tensors) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    total += n;
  }
  return total;
}

}  // namespace testing
}  // namespace detdit
