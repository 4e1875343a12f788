// xent_dist_bench's options as a table (option_table.cpp), which options.cpp turns into flags,
// preset keys, checks and the JSON's echo. Internal to the benchmark.
#pragma once

#include <map>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "options.h"
#include "source.h"

namespace xb {

// What a row's apply sees: the settings so far and every value given, by key.
struct Resolve {
  Settings& s;
  const std::map<std::string, Source>& given;
  int rank;
  int cuda_devices;
  bool gpu() const { return s.device == "cuda"; }
  const Source* find(const char* key) const {
    const auto it = given.find(key);
    return it == given.end() ? nullptr : &it->second;
  }
};

struct Option {
  const char* key;    // config key, and the name a row looks others up by
  const char* names;  // CLI11's names; "" for a key only a preset sets
  const char* type;   // the value's placeholder in --help; nullptr for an on/off flag
  const char* help;
  bool in_config;  // a preset may set it
  // Stores the value given (nullptr: none), or the default; refuses a bad one.
  void (*apply)(Resolve& r, const Source* given);
  void (*echo)(const Settings& s, nlohmann::json& config);  // nullptr: not in the JSON
};

// Whether a key is one of the sweep's (tokens, -b/-e/-f): a sweep given on the command line
// replaces the preset's whole sweep.
bool sweep_key(const std::string& key);

// Every option, in the order of --help and of resolution.
const std::vector<Option>& option_table();

}  // namespace xb
