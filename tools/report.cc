// detdit report: draws a verify report (JSON), or any report of the same
// shape (scripts/torch_compare.py writes one: a "title" and a "time_label"
// replace the verify wording), as an SVG figure written by detdit itself,
// three panels top to bottom:
//   1. byte-equality matrix: one row per case (more lines when its cells do
//      not fit), one cell per check labelled with its whole name, green when
//      every bitwise comparison matched (label "b passed/run"), blue when the
//      check is accuracy-only and passed, red when it failed, grey when informational,
//      outlined white when skipped (verify --matrix: a cell not run, never a pass);
//   2. time per case (bars, seconds);
//   3. per case, each check's error vs FP64 divided by its bound on one log
//      axis (the bound is 1; exact zeros and ratios below 1e-6 at the left
//      edge), the error in its own unit and the bound written beside it.
// A footer records the verdict, device (and the CUDA runtime and driver for a
// run on a CUDA device), compiler, commit, dirty flag and host. Everything
// fits the figure's width: labels are sized from the text, and cut with
// "..." only where a whole name cannot fit.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "args.h"
#include "cli.h"
#include "io/files.h"

namespace detdit {
namespace cli {
namespace {

using Json = nlohmann::json;

constexpr const char* kGreen = "#1baf7a";
constexpr const char* kBlue = "#2a78d6";
constexpr const char* kRed = "#d62728";
constexpr const char* kOrange = "#eb6834";
constexpr const char* kGrey = "#8c8c8c";  // informational rows (a measurement, not a check)
constexpr double kWidth = 1100;
constexpr double kLabelWidth = 380;  // case labels left of every panel
constexpr double kMargin = 20;       // left and right of everything
// Panel 3's axis: error / bound, from 1e-6 (exact zeros and anything smaller
// drawn there) to 10.
constexpr int kLogMin = -6, kLogMax = 1;

std::string escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

// Text widths without a font engine: DejaVu Sans (the first font named)
// averages under 0.62 em per character over names like these (digits 0.64,
// lowercase 0.59), so a box of text_width() holds its text.
double text_width(const std::string& text, double font_size) { return 0.62 * font_size * text.size(); }

// `text` cut with "..." to fit `width` pixels at `font_size`; whole when it fits.
std::string fit(const std::string& text, double width, double font_size) {
  const std::size_t chars = static_cast<std::size_t>(width / (0.62 * font_size) + 1e-9);  // 0.62 * n fits n
  return text.size() <= chars ? text : text.substr(0, chars > 3 ? chars - 3 : 0) + "...";
}

std::string fmt(const char* format, double v) {
  char text[64];
  std::snprintf(text, sizeof text, format, v);
  return text;
}

class Svg {
 public:
  void text(double x, double y, const std::string& s, int size = 12, const char* anchor = "start",
            const char* weight = "normal", const char* fill = "#222") {
    out_ << "<text x=\"" << x << "\" y=\"" << y << "\" font-size=\"" << size << "\" text-anchor=\"" << anchor
         << "\" font-weight=\"" << weight << "\" fill=\"" << fill << "\">" << escape(s) << "</text>\n";
  }
  void rect(double x, double y, double w, double h, const char* fill, const char* stroke = "none") {
    out_ << "<rect x=\"" << x << "\" y=\"" << y << "\" width=\"" << w << "\" height=\"" << h << "\" fill=\"" << fill
         << "\" stroke=\"" << stroke << "\"/>\n";
  }
  void line(double x1, double y1, double x2, double y2, const char* stroke, double width = 1, bool dashed = false) {
    out_ << "<line x1=\"" << x1 << "\" y1=\"" << y1 << "\" x2=\"" << x2 << "\" y2=\"" << y2 << "\" stroke=\""
         << stroke << "\" stroke-width=\"" << width << "\"" << (dashed ? " stroke-dasharray=\"4,3\"" : "") << "/>\n";
  }
  void circle(double x, double y, double r, const char* fill) {
    out_ << "<circle cx=\"" << x << "\" cy=\"" << y << "\" r=\"" << r << "\" fill=\"" << fill << "\"/>\n";
  }
  std::string body() const { return out_.str(); }

 private:
  std::ostringstream out_;
};

std::string case_name(const Json& c) { return c["op"].get<std::string>() + " / " + c["case"].get<std::string>(); }

double number(const Json& v, double fallback = NAN) { return v.is_number() ? v.get<double>() : fallback; }

// What the figure needs of a report; the messages are about the report (the
// caller names it), never about the figure's path.
Status check_drawable(const Json& report) {
  if (!report.is_object()) return Status::value_error("the report is not a JSON object");
  const Json kind = report.value("kind", Json());
  if (!kind.is_string() || (kind != "detdit_verify_report" && kind != "detdit_torch_compare")) {
    const std::string got = kind.is_null() ? "no \"kind\"" : "kind " + kind.dump();
    const std::string hint = kind == "detdit_bench_report" ? ": a detdit bench report, which has no checks to draw" : "";
    return Status::value_error("expected a detdit verify report (kind \"detdit_verify_report\", written by "
                               "detdit verify --out) or a torch comparison (\"detdit_torch_compare\"), got " +
                               got + hint);
  }
  if (!report.contains("cases") || !report["cases"].is_array()) {
    return Status::value_error("the report has no \"cases\" list");
  }
  const Json& cases = report["cases"];
  for (const Json& c : cases) {
    if (!c.is_object() || !c.contains("checks") || !c["checks"].is_array() || !c.value("op", Json()).is_string() ||
        !c.value("case", Json()).is_string()) {
      return Status::value_error("a case of the report lacks op, case or a checks list");
    }
  }
  return Status::ok_status();
}

}  // namespace

Status write_report_svg(const Json& report, const std::string& path) {
  Status drawable = check_drawable(report);
  if (!drawable.ok()) return Status::value_error("the report to draw as " + path + ": " + drawable.message());
  const Json& cases = report["cases"];
  const double row_height = 24, top = 60;
  Svg svg;
  double y = top;

  // Panel 1: byte-equality matrix. Each cell is as wide as its label (the
  // check's name whole, after "b passed/run"); a case whose cells do not fit
  // one line continues on the next.
  svg.text(kMargin, y, "Checks: byte equality (b passed/run) and accuracy", 15, "start", "bold");
  y += 12;
  const double cell_font = 9, cell_pad = 8, matrix_right = kWidth - kMargin;
  for (const Json& c : cases) {
    svg.text(kLabelWidth - 8, y + 16, fit(case_name(c), kLabelWidth - 8 - kMargin, 11), 11, "end");
    double x = kLabelWidth;
    for (const Json& row : c["checks"]) {
      const bool pass = row.value("pass", false);
      const int64_t run = row.value("bitwise_run", int64_t(0)), ok = row.value("bitwise_passed", int64_t(0));
      const bool info = row.value("informational", false), skipped = row.value("skipped", false);
      std::string label = row.value("check", std::string("?"));
      if (run > 0) label = "b" + std::to_string(ok) + "/" + std::to_string(run) + " " + label;
      const double width = std::min(text_width(label, cell_font) + cell_pad, matrix_right - kLabelWidth);
      if (x > kLabelWidth && x + width > matrix_right) {
        x = kLabelWidth;
        y += row_height;
      }
      if (skipped) {
        svg.rect(x + 1, y + 2, width - 2, row_height - 4, "#fff", kGrey);
      } else {
        svg.rect(x + 1, y + 2, width - 2, row_height - 4, !pass ? kRed : info ? kGrey : run > 0 ? kGreen : kBlue);
      }
      svg.text(x + cell_pad / 2, y + 16, fit(label, width - cell_pad, cell_font), cell_font, "start", "normal",
               skipped ? kGrey : "#fff");
      x += width;
    }
    y += row_height;
  }
  y += 10;
  const struct {
    double x;
    const char *fill, *stroke, *what;
  } legend[] = {{0, kGreen, "none", "bitwise equal"},  {120, kBlue, "none", "accuracy within bound"},
                {300, kRed, "none", "failed"},         {380, kGrey, "none", "informational"},
                {490, "#fff", kGrey, "skipped (not run)"}};
  for (const auto& l : legend) {
    svg.rect(kLabelWidth + l.x, y, 12, 12, l.fill, l.stroke);
    svg.text(kLabelWidth + l.x + 16, y + 10, l.what, 11);
  }
  y += 40;

  // Panel 2: time per case.
  double max_seconds = 1e-3;
  for (const Json& c : cases) max_seconds = std::max(max_seconds, number(c.value("seconds", Json()), 0));
  const double bar_span = kWidth - kLabelWidth - 90;
  svg.text(kMargin, y, "Time per case (" + report.value("time_label", std::string("seconds, wall clock")) + ")", 15, "start",
           "bold");
  y += 12;
  for (const Json& c : cases) {
    const double seconds = number(c.value("seconds", Json()), 0);
    svg.text(kLabelWidth - 8, y + 15, fit(case_name(c), kLabelWidth - 8 - kMargin, 11), 11, "end");
    svg.rect(kLabelWidth, y + 4, std::max(1.0, bar_span * seconds / max_seconds), row_height - 8, kBlue);
    svg.text(kLabelWidth + bar_span * seconds / max_seconds + 6, y + 15, fmt("%.3g s", seconds), 10);
    y += row_height;
  }
  y += 40;

  // Panel 3: each measured error as a fraction of its check's bound, on one
  // log axis: the checks measure in different units (absolute, relative,
  // units of a bf16 rounding, fractions of outputs), so only error / bound
  // is comparable; the bound is the line at 1. The error in its own unit is
  // written right of the axis. A line per case, then one per check.
  svg.text(kMargin, y, "Max error vs FP64 / the check's bound (log axis; a check passes left of 1)", 15, "start",
           "bold");
  y += 24;
  const double axis_left = kLabelWidth, axis_right = kWidth - 340, value_left = axis_right + 14;
  auto x_of = [&](double ratio) {
    const double lg = std::log10(std::max(ratio, std::pow(10.0, kLogMin)));
    const double t = (std::min(lg, double(kLogMax)) - kLogMin) / (kLogMax - kLogMin);
    return axis_left + t * (axis_right - axis_left);
  };
  for (int e = kLogMin; e <= kLogMax; ++e) {
    svg.text(x_of(std::pow(10.0, e)), y, e == kLogMin ? "<= 1e-6" : e == 0 ? "1 (bound)" : "1e" + std::to_string(e),
             10, "middle");
  }
  svg.text(value_left, y, "error (unit) / bound", 10);
  y += 6;
  const double error_top = y;
  int error_rows = 0;
  for (const Json& c : cases) {
    bool case_shown = false;
    for (const Json& row : c["checks"]) {
      const double err = number(row.value("max_error_vs_fp64", Json()));
      if (std::isnan(err)) continue;
      if (!case_shown) {
        svg.text(kMargin, y + 15, fit(case_name(c), axis_left - 8 - kMargin, 10), 10, "start", "bold");
        y += row_height * 0.8;
        case_shown = true;
      }
      ++error_rows;
      const double bound = number(row.value("bound", Json()));
      const bool pass = row.value("pass", false);
      const std::string unit = row.value("error_unit", std::string(""));
      svg.text(axis_left - 8, y + 15, fit(row.value("check", std::string("?")), axis_left - 20 - kMargin, 10), 10,
               "end");
      svg.line(axis_left, y + row_height / 2, axis_right, y + row_height / 2, "#eee");
      std::string value = err == 0 ? "exact (0)" : fmt("%.2e", err) + (unit.empty() ? "" : " " + unit);
      if (!std::isnan(bound) && bound > 0) {
        svg.circle(x_of(err / bound), y + row_height / 2, 5, pass ? kGreen : kRed);
        value += " / " + fmt("%.2e", bound);
      } else {
        value += " (no bound)";
      }
      svg.text(value_left, y + 15, fit(value, kWidth - kMargin - value_left, 10), 10);
      y += row_height;
    }
  }
  if (error_rows == 0) {
    svg.text(axis_left, y + 15, "(no check in this report measures an error against FP64)", 11);
    y += row_height;
  }
  for (int e = kLogMin; e <= kLogMax; ++e) {
    svg.line(x_of(std::pow(10.0, e)), error_top, x_of(std::pow(10.0, e)), y, e == 0 ? kOrange : "#ccc", e == 0 ? 2 : 1,
             e != 0);
  }
  y += 30;

  // Footer.
  const Json env = report.value("environment", Json::object());
  const Json git = report.value("git", Json::object());
  const std::string title = report.value("title", std::string("detdit verify report"));
  // The CUDA versions only for a run on a CUDA device: a CPU run of a CUDA
  // build used neither.
  const std::string device = env.value("device", std::string("?"));
  const bool on_cuda = device.rfind("cuda", 0) == 0;
  std::string footer = title + ": " + report.value("verdict", std::string("?")) + ", " +
                       std::to_string(report.value("checks_passed", 0)) + "/" +
                       std::to_string(report.value("checks_total", 0)) + " checks | device " + device;
  if (on_cuda) {
    footer += " | CUDA runtime " + env.value("cuda_runtime", std::string("?")) + ", driver " +
              env.value("cuda_driver", std::string("?"));
  }
  footer += " | " + env.value("compiler", std::string("?")) + " | commit " +
            git.value("commit", std::string("?")).substr(0, 12) + (git.value("dirty", false) ? " (dirty)" : "");
  if (env.contains("host")) footer += " | host " + env.value("host", std::string("?"));
  svg.text(kMargin, y, fit(footer, kWidth - 2 * kMargin, 11), 11, "start", "normal", "#555");
  y += 20;

  // Through a temporary and a rename: a figure is complete or absent, and a
  // path that is not a regular file (a FIFO would block) is refused.
  std::ostringstream out;
  out << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << kWidth << "\" height=\"" << y << "\" viewBox=\"0 0 "
      << kWidth << " " << y << "\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"#fff\"/>\n"
      << "<text x=\"20\" y=\"30\" font-size=\"18\" font-weight=\"bold\">" << escape(title) << "</text>\n"
      << svg.body() << "</svg>\n";
  return io::write_file_atomically(path, out.str());
}

int run_report(int argc, char** argv) {
  Args args("detdit report REPORT.json --out FIGURE.svg",
            "Draws a detdit verify report as an SVG: the byte-equality matrix over the checks, the time\n"
            "per case, and the error vs FP64 on a log axis. Exit 2 when the report cannot be read.");
  args.positional("REPORT.json", "a report written by detdit verify --out");
  args.option("--out", "FIGURE.svg", "where to write the figure", "REPORT.svg next to the report");
  int code = parse_or_exit_code(&args, argc, argv, 1);
  if (code >= 0) return code;
  const std::string in_path = args.get("REPORT.json");
  std::string out_path = args.get("--out");
  if (out_path.empty()) {
    const std::size_t dot = in_path.rfind('.');
    out_path = (dot == std::string::npos ? in_path : in_path.substr(0, dot)) + ".svg";
  }
  std::string text, error;
  Status status = io::read_regular_file(in_path, &text);
  Json report;
  try {
    if (!status.ok()) {
      error = status.to_string();
    } else if (report = Json::parse(text); !(status = check_drawable(report)).ok()) {
      error = in_path + ": " + status.to_string();
    } else if (!(status = write_report_svg(report, out_path)).ok()) {
      error = status.to_string();
    }
  } catch (const Json::exception& e) {  // parse_error: no JSON; else a value of an unexpected type
    error = report.is_null() ? in_path + ": not valid JSON: " + e.what()
                             : Status::value_error(in_path + ": unexpected report structure: " + e.what()).to_string();
  }
  if (!error.empty()) return fail(error);
  std::printf("wrote %s\n", out_path.c_str());
  return 0;
}

}  // namespace cli
}  // namespace detdit
