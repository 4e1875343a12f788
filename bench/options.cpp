// xent_dist_bench: flags (CLI11) and YAML presets (yaml-cpp), merged and validated in one place so
// that a flag and a config key are refused with the same words. Flags override the config. The
// options themselves are the rows of option_table.cpp.
#include "options.h"

#include <yaml-cpp/yaml.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>

#include "option_table.h"
#include "source.h"

namespace xb {

namespace {

const Option* config_option(const std::string& key) {
  for (const Option& o : option_table())
    if (o.in_config && key == o.key) return &o;
  return nullptr;
}

std::string config_keys() {
  std::vector<std::string> keys;
  for (const Option& o : option_table())
    if (o.in_config) keys.push_back(o.key);
  std::sort(keys.begin(), keys.end());
  std::string out;
  for (const std::string& k : keys) out += (out.empty() ? "" : ", ") + k;
  return out;
}

void load_config(const std::string& path, std::map<std::string, Source>& src) {
  const Source where{path, "--config"};
  const std::string text = read_config_text(where);
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    refuse(where, std::string("not valid YAML: ") + e.what());
  }
  if (!root.IsMap()) refuse(where, "a preset is a YAML mapping of key: value");
  for (const auto& kv : root) {
    const std::string raw_key = kv.first.as<std::string>();
    std::string key = raw_key;
    for (char& c : key)
      if (c == '-') c = '_';
    const YAML::Node& node = kv.second;
    Source s;
    s.where = path + ": " + raw_key;
    if (node.IsSequence()) {
      for (const auto& item : node)
        s.value += (s.value.empty() ? "" : ",") + (item.IsScalar() ? item.Scalar() : "?");
    } else if (node.IsScalar()) {
      s.value = node.Scalar();
    } else {
      s.value = node.IsNull() ? "" : "{...}";
    }
    if (!config_option(key)) refuse(s, "unknown key; known keys: " + config_keys());
    if (node.IsSequence() && key != "tokens") refuse(s, "must be a single value, not a list");
    if (!node.IsSequence() && !node.IsScalar()) refuse(s, "must be a value");
    src[key] = s;
  }
}

}  // namespace

ParseStatus parse_settings(int argc, char** argv, int ranks, int rank, int cuda_devices,
                           Settings& s, std::string& message) {
  for (int i = 0; i < argc; ++i) s.command += (i ? " " : "") + std::string(argv[i]);
  s.ranks = ranks;

  CLI::App app{
      "xent_dist_bench: times and verifies vocab-parallel cross-entropy (forward + backward) over "
      "all MPI ranks, one vocabulary shard per rank, like nccl-tests. Flags override --config.",
      "xent_dist_bench"};
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.footer(
      "\nExamples:\n"
      "  mpirun -np 8 xent_dist_bench --config configs/llama3-tp8.yaml --check\n"
      "  mpirun -np 2 xent_dist_bench -b 1024 -e 16384 -f 2 --vocab 151936 --dtype bf16 --mode "
      "both\n"
      "  mpirun -np 4 --oversubscribe xent_dist_bench --device cpu --check --tokens 64,256 --vocab "
      "32000\n"
      "  mpirun -np 2 xent_dist_bench --hidden 4096 --vocab 128256 --tokens 8192\n"
      "  mpirun -np 2 xent_dist_bench --hidden 1024 --vocab 32768 --tokens 1024,2048 --check\n"
      "Exit status: 0 all good, 1 a #wrong value or a runtime error, 2 a refused flag or config, "
      "or a sweep that does not fit in memory.");

  // CLI11 writes into these (map nodes do not move); the flags' values become "true"/"false".
  std::map<std::string, std::string> text;
  std::map<std::string, bool> on;
  std::map<std::string, CLI::Option*> cli;
  for (const Option& o : option_table()) {
    if (!*o.names) continue;
    cli[o.key] = o.type ? app.add_option(o.names, text[o.key], o.help)->type_name(o.type)
                        : app.add_flag(o.names, on[o.key], o.help);
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    message = app.help();
    return kParseHelp;
  } catch (const CLI::ParseError& e) {
    message = std::string("xent_dist_bench: ") + e.what() + " (see --help)";
    return kParseError;
  }

  try {
    // Command line first; its long name names it in messages ("--min-tokens" for -b).
    std::map<std::string, Source> src;
    for (const auto& c : cli) {
      if (c.second->count() == 0) continue;
      const bool flag = on.count(c.first) > 0;
      src[c.first] =
          Source{flag ? (on[c.first] ? "true" : "false") : text[c.first], c.second->get_name()};
    }
    // Then the preset, for what the command line left open; a token flag replaces its sweep.
    if (src.count("config")) {
      s.config = src["config"].value;
      std::map<std::string, Source> cfg;
      load_config(s.config, cfg);
      const bool cli_sweep =
          std::any_of(src.begin(), src.end(), [](const auto& x) { return sweep_key(x.first); });
      for (const auto& c : cfg)
        if (!(cli_sweep && sweep_key(c.first)) && !src.count(c.first)) src[c.first] = c.second;
    }
    Resolve r{s, src, rank, cuda_devices};
    for (const Option& o : option_table())
      if (o.apply) o.apply(r, r.find(o.key));
  } catch (const Refused& r) {
    message = "xent_dist_bench: " + r.message;
    return kParseError;
  }
  return kParseOk;
}

void echo_config(const Settings& s, nlohmann::json& config) {
  for (const Option& o : option_table())
    if (o.echo) o.echo(s, config);
}

}  // namespace xb
