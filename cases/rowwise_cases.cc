// The cases of the row-wise ops: rmsnorm (plain and modulated), gate_residual,
// the fused region gate_residual_rmsnorm and adaln_row_gather, on packed
// sequences (cases/index_case.h).
//
// Suites: kTest sweeps awkward legal shapes (H not a multiple of the widest
// vector, S around a chunk, every dtype, strided and unaligned table views,
// table gradients in the table dtype) and a few H3 shapes; kBench the H3 shape
// (bf16, H from the weights, B = 2, T = 3) at S = 4097, 32768 and 131072 with
// both packings; kVerify the weights' H at verify's sizes (S = 4097, B = 2;
// --quick: S = 257, B = 1) with block 0's norm1 weight (adaln_row_gather: B = 1,
// against a direct byte gather).
// Every input is a pure function of the case's seeds; the tables are the
// (3T, 6H) AdaLN rows and each op reads its chunk as a strided (3T, H) view,
// as the model does.
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "cases/case_builders.h"
#include "cases/forms_cases.h"
#include "cases/op_case.h"
#include "cases/oracle.h"
#include "common/backends.h"
#include "detdit/adaln.h"
#include "detdit/gate_residual.h"
#include "detdit/gate_residual_rmsnorm.h"
#include "detdit/rmsnorm.h"

namespace detdit {
namespace cases {
namespace {

constexpr double kBf16Roundoff = 0x1p-8;  // u: one bf16 rounding errs by at most u relative

// How a suite makes its values: counter-uniform (tests, bench: fast, and any
// slice regenerates alone) or the synthetic-weights stream (verify).
struct Values {
  bool stream = false;
  uint64_t seed = 0;
  Fill operator()(uint64_t offset, double mean, double std) const {
    const bool from_stream = stream;
    const uint64_t s = seed + offset;
    return [from_stream, s, mean, std](HostTensor* t) {
      if (from_stream)
        fill_stream_normal(t, s, "verify", mean, std);
      else
        fill_counter_uniform(t, s, mean, std);
    };
  }
};

// Chunk c of the (R, 6H) AdaLN rows: a (R, H) view with row stride 6H.
TensorView chunk_of(const TensorView& rows, int64_t hidden, int chunk) {
  TensorView view;
  const Status s = adaln_table_chunk(rows, hidden, chunk, &view);
  return s.ok() ? view : TensorView();  // a case's own shapes are valid; an absent view fails the op loudly
}

std::string shape_name(DType dtype, int64_t hidden, const IndexCase& index) {
  return std::string(dtype_name(dtype)) + " H=" + std::to_string(hidden) + " " + index.name();
}

// ---- rmsnorm ---------------------------------------------------------------

OpCase rmsnorm_case(const NormShape& s, const Values& v) {
  OpCase c;
  c.op = "rmsnorm";
  c.name = std::string(s.modulated ? "modulated " : "plain ") + shape_name(s.dtype, s.hidden, s.index) +
           (s.offset_table ? " offset table" : "") +
           (s.table_grad_dtype != DType::kF32 ? std::string(" table grads ") + dtype_name(s.table_grad_dtype) : "");
  const int64_t P = s.index.positions(), H = s.hidden, R = s.index.num_rows();
  c.positions = P;
  if (s.modulated) c.plans.push_back({"plan", s.index, PlanSpec::Rows::kAdaln});
  c.input("x", Phase::kForward, s.dtype, {P, H}, v(1, 0.0, 3.0), 0);
  c.input("weight", Phase::kForward, s.dtype, {H}, s.weight ? s.weight : v(2, 1.0, 0.5));
  if (s.modulated) {
    if (s.offset_table) {
      c.input("shift_storage", Phase::kForward, s.dtype, {R, H + 1}, v(3, 0.0, 0.5));
      c.input("scale_storage", Phase::kForward, s.dtype, {R, H + 1}, v(4, 0.0, 0.5));
    } else {
      c.input("table", Phase::kForward, s.dtype, {R, 6 * H}, v(3, 0.0, 0.5));
    }
  }
  c.output("out", Phase::kForward, s.dtype, {P, H}, 0);
  c.output("rstd", Phase::kForward, DType::kF32, {P}, 0);
  c.input("grad", Phase::kBackward, s.dtype, {P, H}, v(5, 0.0, 1.0), 0);
  c.output("dx", Phase::kBackward, s.dtype, {P, H}, 0);
  c.output("d_weight", Phase::kBackward, DType::kF32, {H});
  if (s.modulated) {
    c.output("d_shift", Phase::kBackward, s.table_grad_dtype, {R, H});
    c.output("d_scale", Phase::kBackward, s.table_grad_dtype, {R, H});
  }
  const bool modulated = s.modulated, offset = s.offset_table;
  c.takes_profile = true;  // rsqrt
  c.arguments["eps"] = argument_text(RmsnormInputs{}.eps);
  auto inputs = [modulated, offset, H](const Instance& t) {
    RmsnormInputs in;
    in.x = t["x"];
    in.weight = t["weight"];
    in.numerics = t.numerics;
    if (modulated) {
      in.plan = t.plan("plan");
      in.shift = offset ? t["shift_storage"].narrow(1, 1, H) : chunk_of(t["table"], H, 0);
      in.scale = offset ? t["scale_storage"].narrow(1, 1, H) : chunk_of(t["table"], H, 1);
    }
    return in;
  };
  c.forward = [inputs](const Instance& t, Stream stream) {
    return rmsnorm_forward({inputs(t), t["out"], t["rstd"]}, stream);
  };
  c.backward = [inputs, modulated](const Instance& t, Stream stream) {
    const TensorView none;
    return rmsnorm_backward({inputs(t), t["rstd"], t["grad"], t["dx"], t["d_weight"],
                             modulated ? t["d_shift"] : none, modulated ? t["d_scale"] : none},
                            stream);
  };
  const double table_rows = s.modulated ? 2.0 * R * H * dtype_size(s.dtype) : 0.0;
  const double table_grads = s.modulated ? 2.0 * R * H * dtype_size(s.table_grad_dtype) : 0.0;
  c.set_bytes(Phase::kForward, {"x", "weight", "out", "rstd"}, table_rows, "shift/scale rows");
  c.set_bytes(Phase::kBackward, {"x", "grad", "rstd", "weight", "dx", "d_weight"}, table_rows / 2 + table_grads,
              "scale rows + d_shift + d_scale");
  c.alone = [s, v](int64_t p) {
    NormShape alone = s;
    alone.index = single_position_case(s.index, p);
    return rmsnorm_case(alone, v);
  };
  return c;
}

// |got - exact| / (|product| + |exact|): the error in units of the magnitudes
// the roundings act on (0/0 counts as 0, x/0 as infinite).
double scaled_error(double got, double exact, double product) {
  const double err = std::fabs(got - exact), scale = std::fabs(product) + std::fabs(exact);
  if (err == 0) return 0;
  return scale == 0 ? INFINITY : err / scale;
}

// verify's oracle of the modulated bf16 forward: out = x rstd w (1 + scale) +
// shift in FP64 against the bf16 output.
AccuracyCheck rmsnorm_forward_accuracy(const IndexCase& index, int64_t hidden) {
  AccuracyCheck a;
  a.name = "accuracy vs fp64";
  // Roundings to bf16 of n, 1 + scale and the product each err by u|product|
  // (first order), the sum by u|out|; FP32 statistics add ~1e-6 relative.
  a.bound = 3.1;
  a.unit = "u=2^-8 of |n(1+s)|+|out|";
  a.error = [index, hidden](const std::map<std::string, HostTensor>& t) {
    const HostTensor &x = t.at("x"), &w = t.at("weight"), &table = t.at("table"), &out = t.at("out");
    const int64_t H = hidden, M = index.positions();
    double worst = 0;
    for (int64_t m = 0; m < M; ++m) {
      double ss = 0;
      for (int64_t h = 0; h < H; ++h) ss += x.get(m * H + h) * x.get(m * H + h);
      const double rstd = 1.0 / std::sqrt(ss / static_cast<double>(H) + 1e-5);
      const int64_t r = index.row(m % index.seq_len);
      for (int64_t h = 0; h < H; ++h) {
        const double shift = table.get(r * 6 * H + h), scale = table.get(r * 6 * H + H + h);
        const double product = x.get(m * H + h) * rstd * w.get(h) * (1.0 + scale);
        worst = std::max(worst, scaled_error(out.get(m * H + h), product + shift, product));
      }
    }
    return worst / kBf16Roundoff;
  };
  return a;
}

// ---- gate_residual -------------------------------------------------------------

OpCase gate_residual_case(const GateShape& s, const Values& v) {
  OpCase c;
  c.op = "gate_residual";
  c.name = shape_name(s.dtype, s.hidden, s.index) + (s.strided_gate ? " gate chunk" : " contiguous gate") +
           (s.gate_grad_dtype != DType::kF32 ? std::string(" d_gate ") + dtype_name(s.gate_grad_dtype) : "");
  const int64_t P = s.index.positions(), H = s.hidden, R = s.index.num_rows();
  c.positions = P;
  c.plans.push_back({"plan", s.index, PlanSpec::Rows::kAdaln});
  c.input("residual", Phase::kForward, s.dtype, {P, H}, v(11, 0.0, 1.0), 0);
  c.input("y", Phase::kForward, s.dtype, {P, H}, v(12, 0.0, 3.0), 0);  // the reference's stand-in: 3 randn
  c.input("table", Phase::kForward, s.dtype, {R, (s.strided_gate ? 6 : 1) * H}, v(13, 0.0, 0.5));
  c.output("out", Phase::kForward, s.dtype, {P, H}, 0);
  c.input("grad", Phase::kBackward, s.dtype, {P, H}, v(14, 0.0, 1.0), 0);
  c.output("d_residual", Phase::kBackward, s.dtype, {P, H}, 0);
  c.output("d_y", Phase::kBackward, s.dtype, {P, H}, 0);
  c.output("d_gate", Phase::kBackward, s.gate_grad_dtype, {R, H});
  const bool strided = s.strided_gate;
  const int64_t hidden = H;
  auto inputs = [strided, hidden](const Instance& t) {
    return GateResidualInputs{t["residual"], t["y"], strided ? chunk_of(t["table"], hidden, 2) : t["table"],
                              t.plan("plan")};
  };
  c.forward = [inputs](const Instance& t, Stream stream) {
    return gate_residual_forward({inputs(t), t["out"]}, stream);
  };
  c.backward = [inputs](const Instance& t, Stream stream) {
    return gate_residual_backward({inputs(t), t["grad"], t["d_residual"], t["d_y"], t["d_gate"]}, stream);
  };
  const double gate_rows = static_cast<double>(R * H) * dtype_size(s.dtype);
  c.set_bytes(Phase::kForward, {"residual", "y", "out"}, gate_rows, "gate rows");
  c.set_bytes(Phase::kBackward, {"grad", "y", "d_residual", "d_y", "d_gate"}, gate_rows, "gate rows");
  c.alone = [s, v](int64_t p) {
    GateShape alone = s;
    alone.index = single_position_case(s.index, p);
    return gate_residual_case(alone, v);
  };
  return c;
}

AccuracyCheck gate_residual_forward_accuracy(const IndexCase& index, int64_t hidden) {
  AccuracyCheck a;
  a.name = "accuracy vs fp64";
  // The product's rounding errs by u|g y|, the sum's by u|out| (first order).
  a.bound = 1.01;
  a.unit = "u=2^-8 of |g y|+|out|";
  a.error = [index, hidden](const std::map<std::string, HostTensor>& t) {
    const HostTensor &residual = t.at("residual"), &y = t.at("y"), &table = t.at("table"), &out = t.at("out");
    const int64_t H = hidden, M = index.positions();
    double worst = 0;
    for (int64_t m = 0; m < M; ++m) {
      const int64_t r = index.row(m % index.seq_len);
      for (int64_t h = 0; h < H; ++h) {
        const double product = table.get(r * 6 * H + 2 * H + h) * y.get(m * H + h);
        worst = std::max(worst, scaled_error(out.get(m * H + h), residual.get(m * H + h) + product, product));
      }
    }
    return worst / kBf16Roundoff;
  };
  return a;
}

// ---- gate_residual_rmsnorm (the fused region) -------------------------------------

struct RegionShape {
  DType dtype = DType::kBF16;
  int64_t hidden = 0;
  IndexCase index{};
  bool modulated = true;
  bool d_h = true;  // a gradient reaching h from elsewhere
  DType table_grad_dtype = DType::kF32;
  // gate, shift and scale as (R, H) views at column 1 of (R, H + 1) tensors:
  // rows that are not vector-aligned (the kernels' scalar path).
  bool offset_table = false;
};

// The region's gate, shift and scale (R, H) views; get(name) gives a tensor of the case.
struct RegionTables {
  TensorView gate, shift, scale;
};

template <typename Get>
RegionTables region_tables(Get&& get, bool modulated, bool offset, int64_t hidden) {
  auto table = [&](const char* storage, int chunk) {
    return offset ? get(storage).narrow(1, 1, hidden) : chunk_of(get("table"), hidden, chunk);
  };
  RegionTables r;
  r.gate = table("gate_storage", 2);
  if (modulated) {
    r.shift = table("shift_storage", 3);
    r.scale = table("scale_storage", 4);
  }
  return r;
}

// h = residual + gate_msa * y, out = rmsnorm(h) * (1 + scale_mlp) + shift_mlp:
// the gate and the modulation are chunks 2, 3 and 4 of one (R, 6H) table, as
// in the H3 block (the gate of one half, the norm of the next).
OpCase gate_residual_rmsnorm_case(const RegionShape& s, const Values& v) {
  OpCase c;
  c.op = "gate_residual_rmsnorm";
  c.name = std::string(s.modulated ? "modulated " : "plain ") + shape_name(s.dtype, s.hidden, s.index) +
           (s.d_h ? " d_h" : "") + (s.offset_table ? " offset table" : "") +
           (s.table_grad_dtype != DType::kF32 ? std::string(" table grads ") + dtype_name(s.table_grad_dtype) : "");
  const int64_t P = s.index.positions(), H = s.hidden, R = s.index.num_rows();
  c.positions = P;
  c.plans.push_back({"plan", s.index, PlanSpec::Rows::kAdaln});
  c.input("residual", Phase::kForward, s.dtype, {P, H}, v(31, 0.0, 1.0), 0);
  c.input("y", Phase::kForward, s.dtype, {P, H}, v(32, 0.0, 3.0), 0);
  if (s.offset_table) {
    c.input("gate_storage", Phase::kForward, s.dtype, {R, H + 1}, v(33, 0.0, 0.5));
    if (s.modulated) {
      c.input("shift_storage", Phase::kForward, s.dtype, {R, H + 1}, v(37, 0.0, 0.5));
      c.input("scale_storage", Phase::kForward, s.dtype, {R, H + 1}, v(38, 0.0, 0.5));
    }
  } else {
    c.input("table", Phase::kForward, s.dtype, {R, 6 * H}, v(33, 0.0, 0.5));
  }
  c.input("weight", Phase::kForward, s.dtype, {H}, v(34, 1.0, 0.5));
  c.output("h", Phase::kForward, s.dtype, {P, H}, 0);
  c.output("out", Phase::kForward, s.dtype, {P, H}, 0);
  c.output("rstd", Phase::kForward, DType::kF32, {P}, 0);
  c.input("d_out", Phase::kBackward, s.dtype, {P, H}, v(35, 0.0, 1.0), 0);
  if (s.d_h) c.input("d_h", Phase::kBackward, s.dtype, {P, H}, v(36, 0.0, 1.0), 0);
  c.output("d_residual", Phase::kBackward, s.dtype, {P, H}, 0);
  c.output("d_y", Phase::kBackward, s.dtype, {P, H}, 0);
  c.output("d_gate", Phase::kBackward, s.table_grad_dtype, {R, H});
  c.output("d_weight", Phase::kBackward, DType::kF32, {H});
  if (s.modulated) {
    c.output("d_shift", Phase::kBackward, s.table_grad_dtype, {R, H});
    c.output("d_scale", Phase::kBackward, s.table_grad_dtype, {R, H});
  }
  const bool modulated = s.modulated, d_h = s.d_h, offset = s.offset_table;
  c.takes_profile = true;  // the norm's rsqrt
  c.arguments["eps"] = argument_text(GateResidualRmsnormInputs{}.eps);
  auto inputs = [modulated, offset, H](const Instance& t) {
    const RegionTables r = region_tables([&t](const char* name) { return t[name]; }, modulated, offset, H);
    GateResidualRmsnormInputs in{t["residual"], t["y"], r.gate, t["weight"], r.shift, r.scale, t.plan("plan")};
    in.numerics = t.numerics;
    return in;
  };
  c.forward = [inputs](const Instance& t, Stream stream) {
    return gate_residual_rmsnorm_forward({inputs(t), t["h"], t["out"], t["rstd"]}, stream);
  };
  c.backward = [inputs, modulated, d_h](const Instance& t, Stream stream) {
    const TensorView none;
    return gate_residual_rmsnorm_backward({inputs(t), t["h"], t["rstd"], t["d_out"], d_h ? t["d_h"] : none,
                                           t["d_residual"], t["d_y"], t["d_gate"], t["d_weight"],
                                           modulated ? t["d_shift"] : none, modulated ? t["d_scale"] : none},
                                          stream);
  };
  const double table_row = static_cast<double>(R * H) * dtype_size(s.dtype);
  const double grad_row = static_cast<double>(R * H) * dtype_size(s.table_grad_dtype);
  const int tables = s.modulated ? 2 : 0;
  c.set_bytes(Phase::kForward, {"residual", "y", "h", "out", "rstd", "weight"}, (1 + tables) * table_row,
              "gate/shift/scale rows");
  std::vector<std::string> backward = {"d_out", "h", "y", "rstd", "weight", "d_residual", "d_y", "d_gate", "d_weight"};
  if (s.d_h) backward.push_back("d_h");
  c.set_bytes(Phase::kBackward, backward, (1 + tables / 2) * table_row + tables * grad_row,
              "gate/scale rows + d_shift + d_scale");
  c.alone = [s, v](int64_t p) {
    RegionShape alone = s;
    alone.index = single_position_case(s.index, p);
    return gate_residual_rmsnorm_case(alone, v);
  };
  // The separate ops as autograd composes them (numerics 6.10): gate_residual
  // forward, rmsnorm forward; rmsnorm backward of d_out, dx + d_h rounded once
  // to the dtype, gate_residual backward of that sum.
  const IndexCase index = s.index;
  c.equivalent.name = "= gate_residual then rmsnorm";
  c.equivalent.compute = [index, modulated, d_h, offset, H](const std::map<std::string, HostTensor>& got,
                                                             std::map<std::string, HostTensor>* expected) {
    IndexPlan plan;
    DETDIT_RETURN_IF_ERROR(adaln_plan(index, Device::cpu(), &plan));
    const RegionTables r =
        region_tables([&got](const char* name) { return got.at(name).view(); }, modulated, offset, H);
    const TensorView gate = r.gate, shift = r.shift, scale = r.scale;
    const HostTensor& h_got = got.at("h");
    const DType dtype = h_got.dtype(), grad_dtype = got.at("d_gate").dtype();
    const std::vector<int64_t> rows = h_got.shape(), table_grad = got.at("d_gate").shape();
    std::map<std::string, HostTensor>& e = *expected;
    e["h"] = HostTensor(dtype, rows);
    e["out"] = HostTensor(dtype, rows);
    e["rstd"] = HostTensor(DType::kF32, {rows[0]});
    e["d_residual"] = HostTensor(dtype, rows);  // g, the gradient reaching h
    e["d_y"] = HostTensor(dtype, rows);
    e["d_gate"] = HostTensor(grad_dtype, table_grad);
    e["d_weight"] = HostTensor(DType::kF32, {H});
    if (modulated) {
      e["d_shift"] = HostTensor(grad_dtype, table_grad);
      e["d_scale"] = HostTensor(grad_dtype, table_grad);
    }
    const GateResidualInputs gate_in{got.at("residual").view(), got.at("y").view(), gate, plan};
    DETDIT_RETURN_IF_ERROR(gate_residual_forward({gate_in, e["h"].view()}));
    const RmsnormInputs norm_in{e["h"].view(), got.at("weight").view(), shift, scale, plan};
    DETDIT_RETURN_IF_ERROR(rmsnorm_forward({norm_in, e["out"].view(), e["rstd"].view()}));
    const TensorView g = e["d_residual"].view();
    DETDIT_RETURN_IF_ERROR(rmsnorm_backward({norm_in, e["rstd"].view(), got.at("d_out").view(), g,
                                             e["d_weight"].view(), modulated ? e["d_shift"].view() : TensorView(),
                                             modulated ? e["d_scale"].view() : TensorView()}));
    if (d_h) DETDIT_RETURN_IF_ERROR(cpu::add(g, got.at("d_h").view(), g, nullptr));
    return gate_residual_backward({gate_in, g, TensorView(), e["d_y"].view(), e["d_gate"].view()});
  };
  return c;
}

// ---- adaln_row_gather ------------------------------------------------------------

OpCase adaln_row_gather_case(const GatherShape& s, const Values& v) {
  OpCase c;
  c.op = "adaln_row_gather";
  c.name = shape_name(s.dtype, s.hidden, s.index) + (s.strided_rows ? " strided rows" : "") +
           (s.rows_grad_dtype != DType::kF32 ? std::string(" d_rows ") + dtype_name(s.rows_grad_dtype) : "");
  const int64_t S = s.index.seq_len, P = s.index.positions(), H = s.hidden, R = s.index.num_rows();
  const int64_t width = 6 * H, stride = s.strided_rows ? width + 3 : width;
  c.plans.push_back({"plan", s.index, PlanSpec::Rows::kAdaln});
  c.input("rows_storage", Phase::kForward, s.dtype, {R, stride}, s.rows ? s.rows : v(21, 0.0, 1.0));
  c.output("out", Phase::kForward, s.dtype, {6, S, H});
  c.input("grad", Phase::kBackward, s.dtype, {6, P, H}, v(22, 0.0, 1.0));
  c.output("d_rows", Phase::kBackward, s.rows_grad_dtype, {R, width});
  auto rows = [R, width, stride](const Instance& t) {
    const TensorView storage = t["rows_storage"];
    return TensorView::strided(storage.data, storage.dtype, {R, width}, {stride, 1}, storage.device);
  };
  c.forward = [rows](const Instance& t, Stream stream) {
    return adaln_row_gather_forward({rows(t), t.plan("plan"), t["out"]}, stream);
  };
  c.backward = [](const Instance& t, Stream stream) {
    return adaln_row_gather_backward({t["grad"], t.plan("plan"), t["d_rows"]}, stream);
  };
  c.set_bytes(Phase::kForward, {"out"}, static_cast<double>(R * width) * dtype_size(s.dtype), "rows");
  c.set_bytes(Phase::kBackward, {"grad", "d_rows"});
  // The forward is a byte copy: out[c, s] = the bytes of chunk c of row(s),
  // copied here row by row from the rows' host copy. (The backward sums; its
  // FP64 oracle is row_gather_grad_exact.)
  const IndexCase index = s.index;
  c.equivalent.name = "byte copy = direct gather";
  c.equivalent.forward_only = true;
  c.equivalent.compute = [index, H, stride](const std::map<std::string, HostTensor>& got,
                                            std::map<std::string, HostTensor>* expected) {
    const HostTensor& rows = got.at("rows_storage");
    const std::size_t element = dtype_size(rows.dtype()), row_bytes = static_cast<std::size_t>(H) * element;
    HostTensor out(rows.dtype(), {6, index.seq_len, H});
    for (int64_t chunk = 0; chunk < 6; ++chunk)
      for (int64_t p = 0; p < index.seq_len; ++p)
        std::memcpy(static_cast<char*>(out.data()) + (chunk * index.seq_len + p) * row_bytes,
                    static_cast<const char*>(rows.data()) + (index.row(p) * stride + chunk * H) * element, row_bytes);
    (*expected)["out"] = std::move(out);
    return Status::ok_status();
  };
  return c;
}

// ---- the suites ----------------------------------------------------------------

constexpr int64_t kH3Hidden = 5376;

// The benchmark's indexes of every row-wise op: T = 3, B = 2, both packings at
// S = 4097 (33 chunks, fewer than the GPU's multiprocessors), 32768 and 131072
// (small: 4097 alone).
std::vector<IndexCase> bench_indexes(const CaseContext& ctx) {
  std::vector<IndexCase> indexes;
  for (int64_t seq_len : ctx.small ? std::vector<int64_t>{4097} : std::vector<int64_t>{4097, 32768, 131072})
    for (Packing packing : {Packing::kBlock, Packing::kInterleaved}) indexes.push_back(make_index_case(packing, seq_len, 3, 2));
  return indexes;
}

// verify's index of the norms and the gate: block packing, T = 3, S = 4097 and
// B = 2 (--quick: S = 257, B = 1).
IndexCase verify_index(const CaseContext& ctx) {
  return make_index_case(Packing::kBlock, ctx.quick ? 257 : 4097, 3, ctx.quick ? 1 : 2);
}

std::vector<OpCase> rmsnorm_cases(Suite suite, const CaseContext& ctx) {
  std::vector<OpCase> cases;
  if (suite == Suite::kTest) {
    const Values v{false, 100};
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16})
      for (int64_t hidden : {12, 20, 68, 256})
        for (int64_t seq_len : {1, 255, 256, 257})
          for (Packing packing : {Packing::kBlock, Packing::kInterleaved}) {
            const IndexCase index = make_index_case(packing, seq_len, 3, seq_len == 257 ? 2 : 1);
            cases.push_back(rmsnorm_case({dtype, hidden, index, true}, v));
            if (packing == Packing::kBlock) cases.push_back(rmsnorm_case({dtype, hidden, index, false}, v));
          }
    cases.push_back(rmsnorm_case({DType::kBF16, 68, make_index_case(Packing::kInterleaved, 257, 4, 2), true,
                                  DType::kBF16},
                                 v));
    // up to 12 segments in a chunk (interleaved, T = 4), unaligned table rows, fp16 table grads
    cases.push_back(rmsnorm_case({DType::kBF16, 68, make_index_case(Packing::kInterleaved, 700, 4, 2), true}, v));
    cases.push_back(rmsnorm_case({DType::kF32, 20, make_index_case(Packing::kBlock, 1000, 2, 1), true}, v));
    cases.push_back(rmsnorm_case({DType::kF16, 1028, make_index_case(Packing::kInterleaved, 513, 2, 1), true,
                                  DType::kF16},
                                 v));
    cases.push_back(rmsnorm_case({DType::kBF16, 68, make_index_case(Packing::kInterleaved, 300, 2, 2), true,
                                  DType::kF32, true},
                                 v));
    cases.push_back(rmsnorm_case({DType::kBF16, kH3Hidden, make_index_case(Packing::kBlock, 4097, 4, 2), true}, v));
    cases.push_back(
        rmsnorm_case({DType::kBF16, kH3Hidden, make_index_case(Packing::kInterleaved, 4097, 3, 1), true}, v));
    cases.push_back(rmsnorm_case({DType::kF32, kH3Hidden, make_index_case(Packing::kBlock, 257, 8, 2), false}, v));
    cases.push_back(rmsnorm_case({DType::kBF16, kH3Hidden, make_index_case(Packing::kBlock, 32768, 1, 1), true}, v));
    return cases;
  }
  if (suite == Suite::kBench) {
    const Values v{false, ctx.seed + 300};
    for (const IndexCase& index : bench_indexes(ctx)) cases.push_back(rmsnorm_case({DType::kBF16, ctx.hidden, index, true}, v));
    return cases;
  }
  // kVerify: block 0's norm1 weight, modulated, bf16.
  const Values v{true, ctx.seed + 30};
  NormShape s{DType::kBF16, ctx.hidden, verify_index(ctx), true};
  s.weight = weight_or(ctx, "transformer_blocks.0.norm1.weight", v(2, 1.0, 0.5));
  OpCase c = rmsnorm_case(s, v);
  c.name = "indexed, norm1 of block 0";
  c.accuracy.push_back(rmsnorm_forward_accuracy(s.index, ctx.hidden));
  cases.push_back(std::move(c));
  return cases;
}

std::vector<OpCase> gate_residual_cases(Suite suite, const CaseContext& ctx) {
  std::vector<OpCase> cases;
  if (suite == Suite::kTest) {
    const Values v{false, 200};
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16})
      for (int64_t hidden : {12, 20, 68, 7})
        for (int64_t seq_len : {1, 255, 256, 257})
          for (Packing packing : {Packing::kBlock, Packing::kInterleaved})
            cases.push_back(gate_residual_case(
                {dtype, hidden, make_index_case(packing, seq_len, 3, seq_len == 257 ? 2 : 1), seq_len == 255}, v));
    cases.push_back(gate_residual_case(
        {DType::kBF16, 20, make_index_case(Packing::kInterleaved, 257, 3, 2), false, DType::kBF16}, v));
    cases.push_back(gate_residual_case({DType::kBF16, kH3Hidden, make_index_case(Packing::kBlock, 4097, 4, 2), true}, v));
    cases.push_back(
        gate_residual_case({DType::kBF16, kH3Hidden, make_index_case(Packing::kInterleaved, 4097, 8, 1), false}, v));
    cases.push_back(
        gate_residual_case({DType::kBF16, kH3Hidden, make_index_case(Packing::kInterleaved, 32768, 3, 2), false}, v));
    return cases;
  }
  if (suite == Suite::kBench) {
    const Values v{false, ctx.seed + 400};
    for (const IndexCase& index : bench_indexes(ctx)) cases.push_back(gate_residual_case({DType::kBF16, ctx.hidden, index}, v));
    return cases;
  }
  const Values v{true, ctx.seed + 40};
  const GateShape s{DType::kBF16, ctx.hidden, verify_index(ctx), true};
  OpCase c = gate_residual_case(s, v);
  c.name = "indexed gate_msa, 3 randn sublayer";
  c.accuracy.push_back(gate_residual_forward_accuracy(s.index, ctx.hidden));
  cases.push_back(std::move(c));
  return cases;
}

std::vector<OpCase> adaln_row_gather_cases(Suite suite, const CaseContext& ctx) {
  std::vector<OpCase> cases;
  if (suite == Suite::kTest) {
    const Values v{false, 300};
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16})
      for (int64_t hidden : {12, 20, 68, 7})
        for (int64_t seq_len : {1, 255, 256, 257})
          for (Packing packing : {Packing::kBlock, Packing::kInterleaved})
            cases.push_back(adaln_row_gather_case({dtype, hidden,
                                                   make_index_case(packing, seq_len, 3, seq_len == 257 ? 2 : 1),
                                                   hidden == 7, seq_len == 256 ? dtype : DType::kF32},
                                                  v));
    cases.push_back(
        adaln_row_gather_case({DType::kBF16, kH3Hidden, make_index_case(Packing::kBlock, 4097, 4, 2)}, v));
    cases.push_back(adaln_row_gather_case(
        {DType::kBF16, kH3Hidden, make_index_case(Packing::kInterleaved, 32768, 8, 1), false, DType::kBF16}, v));
    return cases;
  }
  if (suite == Suite::kBench) {
    const Values v{false, ctx.seed + 500};
    for (const IndexCase& index : bench_indexes(ctx))
      cases.push_back(adaln_row_gather_case({DType::kBF16, ctx.hidden, index}, v));
    return cases;
  }
  // kVerify: the weights' H, block packing, S = 4097 (--quick: 257), T = 3,
  // B = 1, rows N(0, 0.5) (verify's stream), against the direct gather.
  const Values v{true, ctx.seed};
  GatherShape s{DType::kBF16, ctx.hidden, make_index_case(Packing::kBlock, ctx.quick ? 257 : 4097, 3, 1)};
  s.rows = v(21, 0.0, 0.5);
  OpCase c = adaln_row_gather_case(s, v);
  c.name = "six chunks";
  cases.push_back(std::move(c));
  return cases;
}

std::vector<OpCase> gate_residual_rmsnorm_cases(Suite suite, const CaseContext& ctx) {
  std::vector<OpCase> cases;
  if (suite == Suite::kTest) {
    const Values v{false, 600};
    bool d_h = true;
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16})
      for (int64_t hidden : {12, 68, 256})
        for (int64_t seq_len : {1, 255, 257})
          for (Packing packing : {Packing::kBlock, Packing::kInterleaved}) {
            const IndexCase index = make_index_case(packing, seq_len, 3, seq_len == 257 ? 2 : 1);
            cases.push_back(gate_residual_rmsnorm_case({dtype, hidden, index, true, d_h}, v));
            if (packing == Packing::kBlock) cases.push_back(gate_residual_rmsnorm_case({dtype, hidden, index, false, !d_h}, v));
            d_h = !d_h;
          }
    cases.push_back(gate_residual_rmsnorm_case(
        {DType::kBF16, 68, make_index_case(Packing::kInterleaved, 700, 4, 2), true, true, DType::kBF16}, v));
    cases.push_back(gate_residual_rmsnorm_case(
        {DType::kBF16, kH3Hidden, make_index_case(Packing::kBlock, 4097, 3, 2), true, true}, v));
    cases.push_back(gate_residual_rmsnorm_case(
        {DType::kBF16, kH3Hidden, make_index_case(Packing::kInterleaved, 4097, 3, 1), true, false}, v));
    // Rows past the CUDA forward's first batch of 8 vectors per thread (H > 4096), and rows that
    // are not vector-aligned (its scalar path), with several vectors per thread.
    cases.push_back(gate_residual_rmsnorm_case(
        {DType::kF32, 4100, make_index_case(Packing::kBlock, 257, 3, 1), true, false}, v));
    cases.push_back(gate_residual_rmsnorm_case(
        {DType::kF32, 4100, make_index_case(Packing::kInterleaved, 257, 3, 2), true, true, DType::kF32, true}, v));
    cases.push_back(gate_residual_rmsnorm_case(
        {DType::kF16, 1028, make_index_case(Packing::kInterleaved, 513, 2, 1), true, true, DType::kF16, true}, v));
    cases.push_back(gate_residual_rmsnorm_case(
        {DType::kBF16, 1028, make_index_case(Packing::kBlock, 255, 3, 1), false, true, DType::kF32, true}, v));
    return cases;
  }
  if (suite == Suite::kBench) {
    const Values v{false, ctx.seed + 700};
    for (const IndexCase& index : bench_indexes(ctx))
      cases.push_back(gate_residual_rmsnorm_case({DType::kBF16, ctx.hidden, index, true, true}, v));
    return cases;
  }
  const Values v{true, ctx.seed + 70};
  OpCase c = gate_residual_rmsnorm_case({DType::kBF16, ctx.hidden, verify_index(ctx), true, true}, v);
  c.name = "gate_msa then norm2, d_h";
  cases.push_back(std::move(c));
  return cases;
}

// The indexed cases above, then the other modulation forms' (cases/forms_cases.cc).
std::vector<OpCase> append(std::vector<OpCase> cases, std::vector<OpCase> more) {
  for (OpCase& c : more) cases.push_back(std::move(c));
  return cases;
}
std::vector<OpCase> rmsnorm_and_form_cases(Suite suite, const CaseContext& ctx) {
  return append(rmsnorm_cases(suite, ctx), rmsnorm_form_cases(suite, ctx));
}
std::vector<OpCase> gate_residual_and_form_cases(Suite suite, const CaseContext& ctx) {
  return append(gate_residual_cases(suite, ctx), gate_residual_form_cases(suite, ctx));
}
std::vector<OpCase> gate_residual_rmsnorm_and_form_cases(Suite suite, const CaseContext& ctx) {
  return append(gate_residual_rmsnorm_cases(suite, ctx), gate_residual_rmsnorm_form_cases(suite, ctx));
}

DETDIT_OP_CASES("rmsnorm", rmsnorm_and_form_cases);
DETDIT_OP_CASES("gate_residual", gate_residual_and_form_cases);
DETDIT_OP_CASES("gate_residual_rmsnorm", gate_residual_rmsnorm_and_form_cases);
DETDIT_OP_CASES("adaln_row_gather", adaln_row_gather_cases);

}  // namespace

OpCase rmsnorm_case(const NormShape& s, uint64_t seed) { return rmsnorm_case(s, Values{false, seed}); }
OpCase gate_residual_case(const GateShape& s, uint64_t seed) { return gate_residual_case(s, Values{false, seed}); }
OpCase adaln_row_gather_case(const GatherShape& s, uint64_t seed) {
  return adaln_row_gather_case(s, Values{false, seed});
}

}  // namespace cases
}  // namespace detdit
