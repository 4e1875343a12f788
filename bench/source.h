// xent_dist_bench: a value as given (a flag or a config key) and its conversions. Each conversion
// refuses a bad value by throwing Refused with a message that names where it came from and the
// text, so that a flag and a config key are refused in the same words.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace xb {

// Where a value came from ("--vocab" or "configs/x.yaml: vocab_size") and the text given.
struct Source {
  std::string value;
  std::string where;
};

struct Refused {
  std::string message;
};

// "--vocab = '32000'": how messages name a value.
std::string named(const Source& s);
[[noreturn]] void refuse(const Source& s, const std::string& rule);

std::string trim(const std::string& t);
int64_t to_int(const Source& s, int64_t lo, int64_t hi);
// [lo, hi], lo_open / hi_open making that end exclusive.
double to_double(const Source& s, double lo, double hi, bool lo_open = false, bool hi_open = false);
bool to_bool(const Source& s);
// Names and their codes; several names may share a code (aliases). A refusal lists the first name
// of each code.
using Choices = std::vector<std::pair<std::string, int>>;
int to_choice(const Source& s, const Choices& names);
// The first name of `code`.
const char* choice_name(const Choices& names, int code);
std::vector<int64_t> to_int_list(const Source& s);
// The whole config file named by where.value.
std::string read_config_text(const Source& where);

}  // namespace xb
