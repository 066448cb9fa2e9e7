#include "args.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace detdit {
namespace cli {

Args::Args(std::string usage, std::string summary) : usage_(std::move(usage)), summary_(std::move(summary)) {}

void Args::option(const std::string& name, const std::string& value_name, const std::string& help,
                  const std::string& default_text) {
  Spec s;
  s.name = name;
  s.value_name = value_name;
  s.help = help;
  s.default_text = default_text;
  specs_.push_back(s);
}

void Args::positional(const std::string& name, const std::string& help, bool required) {
  Spec s;
  s.name = name;
  s.help = help;
  s.positional = true;
  s.required = required;
  specs_.push_back(s);
}

Args::Spec* Args::find(const std::string& name) {
  for (Spec& s : specs_) {
    if (s.name == name) return &s;
  }
  return nullptr;
}

const Args::Spec* Args::find(const std::string& name) const {
  for (const Spec& s : specs_) {
    if (s.name == name) return &s;
  }
  return nullptr;
}

bool Args::parse(int argc, char** argv, int first) {
  for (int i = first; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      help_ = true;
      return false;
    }
    if (arg.size() > 2 && arg.compare(0, 2, "--") == 0) {
      std::string name = arg, value;
      bool inline_value = false;
      std::size_t eq = arg.find('=');
      if (eq != std::string::npos) {
        name = arg.substr(0, eq);
        value = arg.substr(eq + 1);
        inline_value = true;
      }
      Spec* s = find(name);
      if (s == nullptr || s->positional) {
        error_ = "unknown option " + name;
        return false;
      }
      if (s->given) {
        error_ = "option " + name + " given twice";
        return false;
      }
      if (s->value_name.empty()) {
        if (inline_value) {
          error_ = "option " + name + " takes no value";
          return false;
        }
      } else {
        if (!inline_value) {
          if (i + 1 >= argc) {
            error_ = "option " + name + " needs a value " + s->value_name;
            return false;
          }
          value = argv[++i];
        }
        // An empty value is a mistake (an unset shell variable), never "the
        // default": --weights "" used to run on the synthetic default.
        if (value.empty()) {
          error_ = "option " + name + " needs a non-empty value " + s->value_name + ", got ''";
          return false;
        }
      }
      s->given = true;
      s->value = value;
      continue;
    }
    Spec* next = nullptr;
    for (Spec& s : specs_) {
      if (s.positional && !s.given) {
        next = &s;
        break;
      }
    }
    if (next == nullptr) {
      error_ = "unexpected argument '" + arg + "'";
      return false;
    }
    next->given = true;
    next->value = arg;
  }
  for (const Spec& s : specs_) {
    if (s.positional && s.required && !s.given) {
      error_ = "missing argument " + s.name;
      return false;
    }
  }
  return true;
}

std::string Args::help_text() const {
  std::string text = "usage: " + usage_ + "\n\n" + summary_ + "\n";
  bool any_positional = false;
  for (const Spec& s : specs_) any_positional = any_positional || s.positional;
  if (any_positional) {
    text += "\narguments:\n";
    for (const Spec& s : specs_) {
      if (s.positional) text += "  " + s.name + std::string(s.name.size() < 22 ? 22 - s.name.size() : 1, ' ') + s.help + "\n";
    }
  }
  text += "\noptions:\n";
  for (const Spec& s : specs_) {
    if (s.positional) continue;
    std::string head = s.name + (s.value_name.empty() ? "" : " " + s.value_name);
    text += "  " + head + std::string(head.size() < 22 ? 22 - head.size() : 1, ' ') + s.help;
    if (!s.default_text.empty()) text += " (default: " + s.default_text + ")";
    text += "\n";
  }
  text += "  --help                this text\n";
  return text;
}

bool Args::has(const std::string& name) const {
  const Spec* s = find(name);
  return s != nullptr && s->given;
}

std::string Args::get(const std::string& name, const std::string& fallback) const {
  const Spec* s = find(name);
  return s != nullptr && s->given ? s->value : fallback;
}

std::set<std::string> Args::get_set(const std::string& name) const {
  std::set<std::string> items;
  std::stringstream in(get(name));
  std::string item;
  while (std::getline(in, item, ',')) {
    if (!item.empty()) items.insert(item);
  }
  return items;
}

namespace {

// Only decimal digits, after an optional '-' where `sign_allowed`: strtoll
// and strtoull also skip leading blanks and take a sign, so " -1" read as an
// unsigned number was 2^64 - 1.
bool is_decimal(const std::string& text, bool sign_allowed) {
  const std::size_t first = sign_allowed && !text.empty() && text[0] == '-' ? 1 : 0;
  if (text.size() == first) return false;
  for (std::size_t i = first; i < text.size(); ++i)
    if (text[i] < '0' || text[i] > '9') return false;
  return true;
}

}  // namespace

bool Args::get_int(const std::string& name, int64_t fallback, int64_t lo, int64_t hi, int64_t* value) {
  if (!has(name)) {
    *value = fallback;
    return true;
  }
  const std::string text = get(name);
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(text.c_str(), &end, 10);
  if (!is_decimal(text, true) || *end != '\0' || errno != 0 || v < lo || v > hi) {
    error_ = name + " must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got '" +
             text + "'";
    return false;
  }
  *value = v;
  return true;
}

bool Args::get_uint64(const std::string& name, uint64_t fallback, uint64_t* value) {
  if (!has(name)) {
    *value = fallback;
    return true;
  }
  const std::string text = get(name);
  char* end = nullptr;
  errno = 0;
  unsigned long long v = std::strtoull(text.c_str(), &end, 10);
  if (!is_decimal(text, false) || *end != '\0' || errno != 0) {
    error_ = name + " must be a non-negative integer, got '" + text + "'";
    return false;
  }
  *value = v;
  return true;
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
