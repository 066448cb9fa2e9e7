// Args on CLI11 (Debian libcli11-dev, header-only). CLI11 splits the command
// line ("--out DIR", "--out=DIR", positionals, unknown options, --help); the
// rules of detdit's command lines are added here: values are kept as text
// and read by get_int/get_uint64 (decimal digits only, CLI11's number
// conversion takes " 5" and "+5"), an empty value is refused, and no option
// may be given twice (CLI11 would keep the last).
#include "args.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <vector>

namespace detdit {
namespace cli {

namespace {

// The help layout of every detdit command: the usage line first, then the
// summary, the arguments and the options, each option with its value name
// and nothing CLI11 would add (TEXT, REQUIRED, "=default": the defaults are
// stated in words in the option's help, since several depend on other options).
class HelpFormatter : public CLI::Formatter {
 public:
  explicit HelpFormatter(std::string usage) : usage_(std::move(usage)) {
    column_width(24);
    label("Positionals", "arguments");
  }
  std::string make_help(const CLI::App* app, std::string, CLI::AppFormatMode mode) const override {
    return "usage: " + usage_ + "\n\n" + app->get_description() + "\n" + make_positionals(app) +
           make_groups(app, mode);
  }
  std::string make_option_opts(const CLI::Option* opt) const override {
    return opt->get_positional() || opt->get_type_name().empty() ? "" : " " + opt->get_type_name();
  }

 private:
  std::string usage_;
};

// Only decimal digits, after an optional '-' where `sign_allowed`: strtoll
// and strtoull also skip leading blanks and take a sign, so " -1" read as an
// unsigned number was 2^64 - 1.
bool is_decimal(const std::string& text, bool sign_allowed) {
  const std::size_t first = sign_allowed && !text.empty() && text[0] == '-' ? 1 : 0;
  return text.size() > first && text.find_first_not_of("0123456789", first) == std::string::npos;
}

// `text` as an integer in [lo, hi] (decimal digits, a '-' first where `sign_allowed`).
bool read_integer(const std::string& text, bool sign_allowed, int64_t lo, int64_t hi, int64_t* value) {
  if (!is_decimal(text, sign_allowed)) return false;
  errno = 0;
  const long long v = std::strtoll(text.c_str(), nullptr, 10);
  *value = v;
  return errno == 0 && v >= lo && v <= hi;
}

// The items of a comma-separated text, empty ones included ("a," -> {a, ""}).
std::vector<std::string> items_of(const std::string& text) {
  std::vector<std::string> items(1);
  for (char c : text) {
    if (c == ',') {
      items.emplace_back();
    } else {
      items.back().push_back(c);
    }
  }
  return items;
}

}  // namespace

struct Args::Parser {
  CLI::App app;
  // Node-based, so the references CLI11 writes through stay valid.
  std::map<std::string, std::string> values;
  std::map<std::string, CLI::Option*> options;  // declared name -> option
  std::vector<std::string> order;               // declaration order, for the twice-given check
  std::set<std::string> flags;                  // the options that take no value
};

Args::Args(std::string usage, std::string summary) : parser_(new Parser) {
  CLI::App& app = parser_->app;
  app.description(std::move(summary));
  app.formatter(std::make_shared<HelpFormatter>(std::move(usage)));
  app.option_defaults()->group("options");
  app.set_help_flag("-h,--help", "this text");
}

Args::~Args() = default;

void Args::option(const std::string& name, const std::string& value_name, const std::string& help,
                  const std::string& default_text) {
  const std::string text = default_text.empty() ? help : help + " (default: " + default_text + ")";
  CLI::Option* opt = nullptr;
  if (value_name.empty()) {
    opt = parser_->app.add_flag(name, text);
    // "--quick=false" would be read as the flag's value; a flag takes none.
    opt->disable_flag_override();
    parser_->flags.insert(name);
  } else {
    // Twice is refused after parsing (parse()), with its own message.
    opt = parser_->app.add_option(name, parser_->values[name], text)
              ->type_name(value_name)
              ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    // An empty value is a mistake (an unset shell variable), never "the
    // default": --weights "" used to run on the synthetic default.
    opt->check(CLI::Validator(
        [value_name](std::string& value) {
          return value.empty() ? "needs a non-empty value " + value_name + ", got ''" : std::string();
        },
        ""));
  }
  parser_->options[name] = opt;
  parser_->order.push_back(name);
}

void Args::positional(const std::string& name, const std::string& help, bool required) {
  CLI::Option* opt = parser_->app.add_option(name, parser_->values[name], help)->required(required);
  parser_->options[name] = opt;
}

bool Args::parse(int argc, char** argv, int first) {
  // "--name=value" is checked here, for messages that say what is wrong:
  // CLI11 reads "--quick=1" as a flag override and "--out=" as a missing value.
  for (int i = first; i < argc && std::string(argv[i]) != "--"; ++i) {
    const std::string arg = argv[i];
    const std::size_t eq = arg.find('=');
    if (arg.compare(0, 2, "--") != 0 || eq == std::string::npos) continue;
    auto it = parser_->options.find(arg.substr(0, eq));
    if (it == parser_->options.end() || it->second->get_positional()) continue;
    if (parser_->flags.count(it->first)) {
      error_ = "option " + it->first + " takes no value";
      return false;
    }
    if (eq + 1 == arg.size()) {
      error_ = it->first + ": needs a non-empty value " + it->second->get_type_name() + ", got ''";
      return false;
    }
  }
  std::vector<std::string> arguments;  // CLI11 takes them last first
  for (int i = argc - 1; i >= first; --i) arguments.push_back(argv[i]);
  try {
    parser_->app.parse(arguments);
  } catch (const CLI::CallForHelp&) {
    help_ = true;
    return false;
  } catch (const CLI::ParseError& e) {
    error_ = e.what();
    return false;
  }
  for (const std::string& name : parser_->order) {
    if (parser_->options.at(name)->count() > 1) {
      error_ = "option " + name + " given twice";
      return false;
    }
  }
  return true;
}

std::string Args::help_text() const { return parser_->app.help(); }

bool Args::has(const std::string& name) const {
  auto it = parser_->options.find(name);
  return it != parser_->options.end() && it->second->count() > 0;
}

std::string Args::get(const std::string& name, const std::string& fallback) const {
  return has(name) ? parser_->values.at(name) : fallback;
}

bool Args::get_set(const std::string& name, std::set<std::string>* items) {
  items->clear();
  if (!has(name)) return true;
  for (const std::string& item : items_of(get(name))) {
    if (item.empty()) {
      error_ = name + " has an empty item in '" + get(name) + "'";
      return false;
    }
    if (!items->insert(item).second) {
      error_ = name + " lists '" + item + "' twice";
      return false;
    }
  }
  return true;
}

bool Args::get_int(const std::string& name, int64_t fallback, int64_t lo, int64_t hi, int64_t* value) {
  *value = fallback;
  if (!has(name) || read_integer(get(name), true, lo, hi, value)) return true;
  error_ = name + " must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got '" + get(name) +
           "'";
  return false;
}

bool Args::get_int_list(const std::string& name, const std::string& fallback, int64_t lo, int64_t hi,
                        const std::string& what, std::vector<int64_t>* values) {
  values->clear();
  for (const std::string& item : items_of(get(name, fallback))) {
    int64_t v = 0;
    if (!read_integer(item, false, lo, hi, &v)) {
      error_ = name + " must list " + what + "s in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got '" +
               item + "'";
      return false;
    }
    if (std::find(values->begin(), values->end(), v) != values->end()) {
      error_ = name + " lists " + what + " " + item + " twice";
      return false;
    }
    values->push_back(v);
  }
  if (values->empty()) {
    error_ = name + " needs at least one " + what;
    return false;
  }
  return true;
}

bool Args::get_positive(const std::string& name, double fallback, double* value) {
  *value = fallback;
  if (!has(name)) return true;
  const std::string text = get(name);
  char* end = nullptr;
  errno = 0;
  *value = std::strtod(text.c_str(), &end);
  if (*end == '\0' && errno == 0 && std::isfinite(*value) && *value > 0) return true;
  error_ = name + " must be a number > 0, got '" + text + "'";
  return false;
}

bool Args::get_uint64(const std::string& name, uint64_t fallback, uint64_t* value) {
  *value = fallback;
  if (!has(name)) return true;
  errno = 0;
  *value = is_decimal(get(name), false) ? std::strtoull(get(name).c_str(), nullptr, 10) : 0;
  if (is_decimal(get(name), false) && errno == 0) return true;
  error_ = name + " must be a non-negative integer, got '" + get(name) + "'";
  return false;
}

int parse_or_exit_code(Args* args, int argc, char** argv, int first) {
  if (args->parse(argc, argv, first)) return -1;
  if (args->help_requested()) {
    std::fputs(args->help_text().c_str(), stdout);
    return 0;
  }
  std::fprintf(stderr, "detdit: %s\n%s", args->error().c_str(), args->help_text().c_str());
  return 2;
}

}  // namespace cli
}  // namespace detdit
