// cases/index_case.h: the packed sequences and their plans.
#include "cases/index_case.h"

#include <sstream>

#include "cases/tensor.h"

namespace detdit {
namespace cases {

const char* packing_name(Packing packing) { return packing == Packing::kBlock ? "block" : "interleaved"; }

std::string IndexCase::name() const {
  std::ostringstream os;
  os << packing_name(packing) << "_S" << seq_len << "_T" << num_timesteps << "_B" << batch;
  return os.str();
}

IndexCase make_index_case(Packing packing, int64_t seq_len, int64_t num_timesteps, int64_t batch) {
  IndexCase c;
  c.packing = packing;
  c.seq_len = seq_len;
  c.num_timesteps = num_timesteps;
  c.batch = batch;
  c.timestep_indices.resize(seq_len);
  c.tags.resize(seq_len);
  if (packing == Packing::kInterleaved) {
    for (int64_t s = 0; s < seq_len; ++s) {
      c.timestep_indices[s] = s % num_timesteps;
      c.tags[s] = kInterleavedTags[s % 10];
    }
    return c;
  }
  for (int64_t t = 0; t < num_timesteps; ++t) {
    const int64_t begin = t * seq_len / num_timesteps, end = (t + 1) * seq_len / num_timesteps;
    const int64_t length = end - begin;
    const int64_t text = length * 5 / 100, audio = length * 15 / 100;
    for (int64_t s = begin; s < end; ++s) {
      c.timestep_indices[s] = t;
      c.tags[s] = s - begin < text ? 1 : (end - s <= audio ? 2 : 0);
    }
  }
  return c;
}

IndexCase single_position_case(const IndexCase& c, int64_t p) {
  IndexCase alone = c;
  alone.seq_len = 1;
  alone.batch = 1;
  alone.timestep_indices = {c.timestep_indices[p % c.seq_len]};
  alone.tags = {c.tags[p % c.seq_len]};
  return alone;
}

std::vector<int64_t> unreferenced_rows(const IndexCase& c) {
  std::vector<bool> used(c.num_rows(), false);
  for (int64_t s = 0; s < c.seq_len; ++s) used[c.row(s)] = true;
  std::vector<int64_t> rows;
  for (int64_t r = 0; r < c.num_rows(); ++r)
    if (!used[r]) rows.push_back(r);
  return rows;
}

std::vector<IndexCase> standard_cases(int64_t max_positions) {
  std::vector<IndexCase> cases;
  for (Packing packing : {Packing::kBlock, Packing::kInterleaved})
    for (int64_t seq_len : {1, 3, 257, 4097})
      for (int64_t batch : {1, 2, 3})
        for (int64_t num_timesteps : {1, 3, 4})
          if (seq_len * batch <= max_positions) cases.push_back(make_index_case(packing, seq_len, num_timesteps, batch));
  return cases;
}

std::vector<int64_t> adaln_rows_of_positions(const IndexCase& c) {
  std::vector<int64_t> rows(c.positions());
  for (int64_t p = 0; p < c.positions(); ++p) rows[p] = c.row(p % c.seq_len);
  return rows;
}

std::vector<int64_t> timestep_rows_of_positions(const IndexCase& c) {
  std::vector<int64_t> rows(c.positions());
  for (int64_t p = 0; p < c.positions(); ++p) rows[p] = c.timestep_indices[p % c.seq_len];
  return rows;
}

namespace {

// An int64 (S,) tensor of `values` on `device`.
Status index_tensor(const std::vector<int64_t>& values, const Device& device, DeviceTensor* tensor, Stream stream) {
  HostTensor host(DType::kI64, {static_cast<int64_t>(values.size())});
  for (std::size_t s = 0; s < values.size(); ++s) host.ptr<int64_t>()[s] = values[s];
  return DeviceTensor::from_host(host, device, tensor, stream);
}

}  // namespace

Status adaln_plan(const IndexCase& c, const Device& device, IndexPlan* plan, Stream stream) {
  DeviceTensor ti, tags;
  DETDIT_RETURN_IF_ERROR(index_tensor(c.timestep_indices, device, &ti, stream));
  DETDIT_RETURN_IF_ERROR(index_tensor(c.tags, device, &tags, stream));
  return IndexPlan::from_timesteps_and_tags(ti.view(), tags.view(), c.num_timesteps, c.batch, plan, stream);
}

Status timestep_plan(const IndexCase& c, const Device& device, IndexPlan* plan, Stream stream) {
  return row_plan(c.timestep_indices, c.num_timesteps, c.batch, device, plan, stream);
}

Status row_plan(const std::vector<int64_t>& rows, int64_t num_rows, int64_t batch, const Device& device,
                IndexPlan* plan, Stream stream) {
  DeviceTensor index;
  DETDIT_RETURN_IF_ERROR(index_tensor(rows, device, &index, stream));
  return IndexPlan::from_row_index(index.view(), num_rows, batch, plan, stream);
}

}  // namespace cases
}  // namespace detdit
