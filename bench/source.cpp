#include "source.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <sstream>

namespace xb {

std::string named(const Source& s) {
  return s.where + " = '" + s.value + "'";
}

void refuse(const Source& s, const std::string& rule) {
  throw Refused{named(s) + ": " + rule};
}

std::string trim(const std::string& t) {
  const size_t a = t.find_first_not_of(" \t\r\n");
  if (a == std::string::npos) return "";
  const size_t b = t.find_last_not_of(" \t\r\n");
  return t.substr(a, b - a + 1);
}

namespace {

int64_t parse_int(const Source& s, const std::string& text, int64_t lo, int64_t hi) {
  const std::string t = trim(text);
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(t.c_str(), &end, 10);
  if (t.empty() || *end != '\0' || errno == ERANGE) refuse(s, "not an integer");
  if (v < lo) refuse(s, "must be at least " + std::to_string(lo));
  if (v > hi) refuse(s, "must be at most " + std::to_string(hi));
  return v;
}

std::string fmt(double v) {
  std::ostringstream o;
  o << v;
  return o.str();
}

}  // namespace

int64_t to_int(const Source& s, int64_t lo, int64_t hi) {
  return parse_int(s, s.value, lo, hi);
}

double to_double(const Source& s, double lo, double hi, bool lo_open, bool hi_open) {
  const std::string t = trim(s.value);
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(t.c_str(), &end);
  if (t.empty() || *end != '\0' || errno == ERANGE || !std::isfinite(v))
    refuse(s, "not a finite number");
  if (lo_open ? !(v > lo) : !(v >= lo))
    refuse(s, std::string("must be ") + (lo_open ? "above " : "at least ") + fmt(lo));
  if (hi_open ? !(v < hi) : !(v <= hi))
    refuse(s, std::string("must be ") + (hi_open ? "below " : "at most ") + fmt(hi));
  return v;
}

bool to_bool(const Source& s) {
  std::string t = trim(s.value);
  for (char& c : t) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (t == "1" || t == "true" || t == "yes" || t == "on") return true;
  if (t == "0" || t == "false" || t == "no" || t == "off") return false;
  refuse(s, "not a boolean (true or false)");
}

const char* choice_name(const Choices& names, int code) {
  for (const auto& n : names)
    if (n.second == code) return n.first.c_str();
  return "?";
}

int to_choice(const Source& s, const Choices& names) {
  const std::string t = trim(s.value);
  for (const auto& n : names)
    if (n.first == t) return n.second;
  std::string shown;
  std::vector<int> codes;
  for (const auto& n : names) {
    if (std::find(codes.begin(), codes.end(), n.second) != codes.end()) continue;
    codes.push_back(n.second);
    shown += (shown.empty() ? "" : ", ") + n.first;
  }
  refuse(s, "must be one of " + shown);
}

std::vector<int64_t> to_int_list(const Source& s) {
  std::vector<int64_t> out;
  std::stringstream in(s.value);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(parse_int(s, item, 1, INT32_MAX));
  if (out.empty()) refuse(s, "needs at least one token count");
  return out;
}

// Read here rather than by YAML::LoadFile: its stream throws std::ios_failure on a read error (a
// directory, an unreadable file), which would abort the rank.
std::string read_config_text(const Source& where) {
  std::error_code ec;
  if (std::filesystem::is_directory(where.value, ec))
    refuse(where, "is a directory, not a YAML file");
  std::FILE* f = std::fopen(where.value.c_str(), "rb");
  const int open_err = errno;
  if (!f) refuse(where, std::string("cannot open the file (") + std::strerror(open_err) + ")");
  std::string text;
  char buf[4096];
  size_t got = 0;
  while ((got = std::fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, got);
  const int err = std::ferror(f) ? errno : 0;
  std::fclose(f);
  if (err) refuse(where, std::string("cannot read the file (") + std::strerror(err) + ")");
  return text;
}

}  // namespace xb
