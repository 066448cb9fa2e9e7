// The detdit CLI's command-line declarations, parsed by CLI11: long options
// with a value ("--out DIR" or "--out=DIR"; the value may not be empty), flags
// ("--quick"), positionals, and a --help text generated from the
// declarations. Every option may be given once. Parsing errors are usage
// errors (exit code 2) with a message naming the option. CLI11 stays out of
// this header (it is large; only args.cc includes it).
#pragma once

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace detdit {
namespace cli {

class Args {
 public:
  // usage: "detdit weights synth --out DIR [options]"; summary: one paragraph.
  Args(std::string usage, std::string summary);
  ~Args();
  Args(const Args&) = delete;
  Args& operator=(const Args&) = delete;

  // Declarations (before parse). `value_name` empty means a flag;
  // `default_text` is what the help says happens when the option is not given.
  void option(const std::string& name, const std::string& value_name, const std::string& help,
              const std::string& default_text = "");
  void flag(const std::string& name, const std::string& help) { option(name, "", help); }
  void positional(const std::string& name, const std::string& help, bool required = true);

  // Parses argv[first..argc). Returns false on a usage error (message in
  // error()) and when --help was given (help_requested()).
  bool parse(int argc, char** argv, int first);
  bool help_requested() const { return help_; }
  const std::string& error() const { return error_; }
  std::string help_text() const;

  bool has(const std::string& name) const;  // option given, or positional present
  std::string get(const std::string& name, const std::string& fallback = "") const;
  // The items of a comma-separated value (empty when not given); false (with
  // error()) for an empty item ("a,,b", "a,") or one given twice.
  bool get_set(const std::string& name, std::set<std::string>* items);
  // Integer values; false (with error()) when the text is not decimal digits
  // (get_int: after an optional '-') of a value in [lo, hi] (get_uint64: < 2^64).
  bool get_int(const std::string& name, int64_t fallback, int64_t lo, int64_t hi, int64_t* value);
  bool get_uint64(const std::string& name, uint64_t fallback, uint64_t* value);
  // A comma-separated list of integers in [lo, hi] (`fallback` when not given),
  // each item decimal digits, in the order given. False (with error():
  // "<name> must list <what>s in [lo, hi], got '<item>'") for any other item,
  // an empty one included, for no item at all and for an item given twice.
  bool get_int_list(const std::string& name, const std::string& fallback, int64_t lo, int64_t hi,
                    const std::string& what, std::vector<int64_t>* values);
  // A finite decimal number > 0 (e.g. "360", "2.5").
  bool get_positive(const std::string& name, double fallback, double* value);

 private:
  struct Parser;  // the CLI11 app and the values it parsed into
  std::unique_ptr<Parser> parser_;
  std::string error_;
  bool help_ = false;
};

// The standard handling around parse(): prints help to stdout (returns 0) or
// the error and the usage line to stderr (returns 2); -1 means "go on".
int parse_or_exit_code(Args* args, int argc, char** argv, int first);

}  // namespace cli
}  // namespace detdit
