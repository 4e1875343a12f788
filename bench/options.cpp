// xent_dist_bench: flags (CLI11) and YAML presets (yaml-cpp), merged and validated in one place so
// that a flag and a config key are refused with the same words. Flags override the config.
#include "options.h"

#include <yaml-cpp/yaml.h>

#include <CLI/CLI.hpp>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "gen.h"

namespace xb {
namespace {

// Where a value came from ("--vocab" or "configs/x.yaml: vocab_size") and the text given.
struct Source {
  std::string value;
  std::string where;
  bool set = false;
};

struct Refused {
  std::string message;
};

// "--vocab = '32000'": how messages name a value.
std::string named(const Source& s) {
  return s.where + " = '" + s.value + "'";
}

[[noreturn]] void refuse(const Source& s, const std::string& rule) {
  throw Refused{named(s) + ": " + rule};
}

std::string trim(const std::string& t) {
  const size_t a = t.find_first_not_of(" \t\r\n");
  if (a == std::string::npos) return "";
  const size_t b = t.find_last_not_of(" \t\r\n");
  return t.substr(a, b - a + 1);
}

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
int64_t to_int(const Source& s, int64_t lo, int64_t hi) {
  return parse_int(s, s.value, lo, hi);
}

std::string fmt(double v) {
  std::ostringstream o;
  o << v;
  return o.str();
}

// [lo, hi] with lo_open / hi_open making that end exclusive.
double to_double(const Source& s, double lo, double hi, bool lo_open = false,
                 bool hi_open = false) {
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

int to_choice(const Source& s, const std::vector<std::pair<std::string, int>>& names,
              const std::string& shown) {
  const std::string t = trim(s.value);
  for (const auto& n : names)
    if (n.first == t) return n.second;
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

// The keys a config may set, with the flag that sets the same thing.
const std::map<std::string, std::string>& known_keys() {
  static const std::map<std::string, std::string> keys = {{"model", ""},
                                                          {"description", ""},
                                                          {"tp", ""},
                                                          {"vocab_size", "--vocab"},
                                                          {"pad_to", "--pad-to"},
                                                          {"tokens", "--tokens"},
                                                          {"min_tokens", "--min-tokens"},
                                                          {"max_tokens", "--max-tokens"},
                                                          {"step_factor", "--step-factor"},
                                                          {"dtype", "--dtype"},
                                                          {"label_smoothing", "--label-smoothing"},
                                                          {"z_loss", "--z-loss"},
                                                          {"softcap", "--softcap"},
                                                          {"ignore_fraction", "--ignore-fraction"},
                                                          {"reduction", "--reduction"},
                                                          {"mode", "--mode"},
                                                          {"iters", "--iters"},
                                                          {"warmup", "--warmup"},
                                                          {"check", "--check"},
                                                          {"graph", "--graph"},
                                                          {"idle", "--idle"},
                                                          {"seed", "--seed"},
                                                          {"grad_output", "--grad-output"},
                                                          {"logit_range", "--logit-range"}};
  return keys;
}

std::string known_list() {
  std::string out;
  for (const auto& k : known_keys()) out += (out.empty() ? "" : ", ") + k.first;
  return out;
}

// The whole file as text. Read here, not by YAML::LoadFile: its stream throws std::ios_failure
// on a read error (a directory, an unreadable file), which would abort the rank.
std::string read_config(const Source& where) {
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

void load_config(const std::string& path, std::map<std::string, Source>& src) {
  Source where{path, "--config", true};
  const std::string text = read_config(where);
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
    s.set = true;
    if (!known_keys().count(key)) refuse(s, "unknown key; known keys: " + known_list());
    if (node.IsSequence() && key != "tokens") refuse(s, "must be a single value, not a list");
    if (!node.IsSequence() && !node.IsScalar()) refuse(s, "must be a value");
    src[key] = s;
  }
}

}  // namespace

ParseStatus parse_settings(int argc, char** argv, int ranks, int rank, int cuda_devices,
                           Settings& s, std::string& message) {
  for (int i = 0; i < argc; ++i) s.command += (i ? " " : "") + std::string(argv[i]);

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
      "Exit status: 0 all good, 1 a #wrong value or a runtime error, 2 a refused flag or config, "
      "or a sweep that does not fit in memory.");

  std::map<std::string, std::string> v;  // key -> text given on the command line
  std::map<std::string, CLI::Option*> opt;
  auto add = [&](const std::string& key, const std::string& names, const std::string& type,
                 const std::string& help) {
    opt[key] = app.add_option(names, v[key], help)->type_name(type);
  };
  add("config", "--config", "FILE", "YAML preset (configs/*.yaml); flags given here override it");
  add("device", "--device", "cpu|cuda", "backend (default: cuda when a GPU is visible, else cpu)");
  add("min_tokens", "-b,--min-tokens", "N",
      "smallest token count of the sweep (cuda 1024, cpu 128)");
  add("max_tokens", "-e,--max-tokens", "N",
      "largest token count of the sweep (cuda 16384, cpu 512)");
  add("step_factor", "-f,--step-factor", "F", "multiply the token count by F between sizes (2)");
  add("tokens", "--tokens", "N,N,...", "explicit token counts, instead of -b/-e/-f");
  add("vocab_size", "--vocab", "V", "global vocabulary size (cuda 128256, cpu 32000)");
  add("pad_to", "--pad-to", "M", "pad the global vocabulary to a multiple of M (1: no padding)");
  add("dtype", "--dtype", "f32|bf16|f16", "logits dtype (bf16)");
  add("label_smoothing", "--label-smoothing", "E", "label smoothing in [0, 1) (0)");
  add("z_loss", "--z-loss", "W", "z-loss weight >= 0 (0)");
  add("softcap", "--softcap", "C", "final-logit softcap > 0, 0 for none (0)");
  add("ignore_fraction", "--ignore-fraction", "P",
      "share of rows whose target is ignore_index, in [0, 1) (0)");
  add("reduction", "--reduction", "mean|sum|none", "loss reduction (mean)");
  add("mode", "--mode", "fused|deferred|both", "gradient mode(s) to time (both)");
  add("iters", "-n,--iters", "N", "timed iterations (cuda 20, cpu 5)");
  add("warmup", "-w,--warmup", "N", "warm-up iterations (cuda 5, cpu 1)");
  add("seed", "--seed", "S", "seed of the generated logits and targets (1)");
  add("grad_output", "--grad-output", "G", "value of grad_output passed to backward (1)");
  add("logit_range", "--logit-range", "R",
      "logits k*R/256, integers k in [-256, 128): per row a window of width R at its own offset; R "
      "a power of two in [1, 1024] (8)");
  add("json", "--json", "FILE", "also write the results and the environment as JSON (rank 0)");
  bool check = false, graph = false, idle = false;
  opt["check"] = app.add_flag("-c,--check", check,
                              "verify loss, lse and gradient against an fp64 reference (#wrong)");
  opt["graph"] =
      app.add_flag("--graph", graph, "time forward and backward replayed from CUDA graphs");
  opt["idle"] = app.add_flag(
      "--idle", idle,
      "time each step alone from an idle device, the ranks starting together (median): launch "
      "latency counts, as when a training step reaches its loss with the GPU waiting");

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
    // Command line first; its long name names it in messages.
    std::map<std::string, Source> src;
    for (const auto& o : opt) {
      if (o.second->count() == 0) continue;
      Source x;
      x.where = o.second->get_name();  // the long name, e.g. "--min-tokens" for -b
      x.value = o.first == "check"   ? (check ? "true" : "false")
                : o.first == "graph" ? (graph ? "true" : "false")
                : o.first == "idle"  ? (idle ? "true" : "false")
                                     : v[o.first];
      x.set = true;
      src[o.first] = x;
    }
    // Then the preset, for what the command line left open.
    if (src.count("config")) {
      s.config = src["config"].value;
      std::map<std::string, Source> cfg;
      load_config(s.config, cfg);
      const bool cli_sweep = src.count("tokens") || src.count("min_tokens") ||
                             src.count("max_tokens") || src.count("step_factor");
      for (const auto& c : cfg) {
        const bool sweep_key = c.first == "tokens" || c.first == "min_tokens" ||
                               c.first == "max_tokens" || c.first == "step_factor";
        if (sweep_key && cli_sweep) continue;
        if (!src.count(c.first)) src[c.first] = c.second;
      }
    }
    auto has = [&](const char* k) { return src.count(k) > 0; };
    auto get = [&](const char* k) -> const Source& { return src.at(k); };

    // Device first: it picks the defaults.
    s.device = cuda_devices > 0 ? "cuda" : "cpu";
    if (has("device")) {
      s.device = to_choice(get("device"), {{"cpu", 0}, {"cuda", 1}}, "cpu, cuda") ? "cuda" : "cpu";
      if (s.device == "cuda" && cuda_devices == 0)
        refuse(get("device"), "no CUDA device is visible here (use --device cpu)");
    }
    const bool gpu = s.device == "cuda";

    s.model = has("model") ? trim(get("model").value) : "custom";
    if (has("tp")) {
      const Source& tp = get("tp");
      const int64_t t = to_int(tp, 1, 1 << 20);
      if (t != ranks)
        refuse(tp, "this run has " + std::to_string(ranks) +
                       " rank(s); launch one rank per tensor-parallel rank (mpirun -np " +
                       std::to_string(t) + ")");
    }

    // The sweep.
    if (has("tokens") && (has("min_tokens") || has("max_tokens") || has("step_factor")))
      refuse(get("tokens"), "give either a token list or -b/-e/-f, not both");
    if (has("tokens")) {
      s.tokens = to_int_list(get("tokens"));
      s.tokens_from = named(get("tokens"));
    } else {
      int64_t b = gpu ? 1024 : 128, e = gpu ? 16384 : 512, f = 2;
      if (has("min_tokens")) b = to_int(get("min_tokens"), 1, INT32_MAX);
      if (has("max_tokens")) e = to_int(get("max_tokens"), 1, INT32_MAX);
      if (has("step_factor")) f = to_int(get("step_factor"), 2, 1 << 20);
      if (!has("max_tokens") && e < b) e = b;
      if (!has("min_tokens") && b > e) b = e;
      if (e < b) refuse(get("max_tokens"), "is below --min-tokens " + std::to_string(b));
      for (int64_t n = b; n <= e; n *= f) s.tokens.push_back(n);
      // What set the largest size: -e, else -b where it raised the default -e, else the default.
      s.tokens_from = has("max_tokens") ? named(get("max_tokens"))
                      : has("min_tokens") && e == b
                          ? named(get("min_tokens"))
                          : "--max-tokens = '" + std::to_string(e) + "' (the default)";
    }

    s.vocab = has("vocab_size") ? to_int(get("vocab_size"), 1, INT32_MAX) : (gpu ? 128256 : 32000);
    s.vocab_from = has("vocab_size") ? named(get("vocab_size"))
                                     : "--vocab = '" + std::to_string(s.vocab) + "' (the default)";
    s.pad_to = has("pad_to") ? to_int(get("pad_to"), 1, 1 << 24) : 1;
    s.padded = (s.vocab + s.pad_to - 1) / s.pad_to * s.pad_to;
    if (s.padded < ranks) {
      const Source& w =
          has("vocab_size") ? get("vocab_size") : Source{std::to_string(s.vocab), "--vocab", true};
      refuse(w, "the (padded) vocabulary must give every one of the " + std::to_string(ranks) +
                    " ranks a column");
    }

    const std::vector<std::pair<std::string, int>> dtypes = {
        {"f32", kF32}, {"fp32", kF32}, {"float32", kF32}, {"bf16", kBF16}, {"bfloat16", kBF16},
        {"f16", kF16}, {"fp16", kF16}, {"float16", kF16}, {"half", kF16}};
    s.dtype = has("dtype") ? to_choice(get("dtype"), dtypes, "f32, bf16, f16") : kBF16;
    s.reduction = has("reduction") ? to_choice(get("reduction"),
                                               {{"mean", kMean}, {"sum", kSum}, {"none", kNone}},
                                               "mean, sum, none")
                                   : kMean;
    int mode = 2;
    if (has("mode"))
      mode = to_choice(get("mode"), {{"fused", 0}, {"deferred", 1}, {"both", 2}},
                       "fused, deferred, both");
    if (mode == 0 || mode == 2) s.modes.push_back("fused");
    if (mode == 1 || mode == 2) s.modes.push_back("deferred");

    if (has("label_smoothing"))
      s.label_smoothing = to_double(get("label_smoothing"), 0.0, 1.0, false, true);
    if (has("z_loss")) s.z_loss = to_double(get("z_loss"), 0.0, 1e6);
    if (has("softcap")) s.softcap = to_double(get("softcap"), 0.0, 1e6);
    if (has("ignore_fraction"))
      s.ignore_fraction = to_double(get("ignore_fraction"), 0.0, 1.0, false, true);
    if (has("grad_output")) s.grad_output = to_double(get("grad_output"), -1e6, 1e6);
    if (has("logit_range")) {
      s.logit_range = to_double(get("logit_range"), 1.0, 1024.0);
      int e2 = 0;
      if (std::frexp(s.logit_range, &e2) != 0.5)
        refuse(get("logit_range"), "must be a power of two (1, 2, 4, ..., 1024)");
    }
    s.iters = has("iters") ? static_cast<int>(to_int(get("iters"), 1, 1 << 20)) : (gpu ? 20 : 5);
    s.warmup = has("warmup") ? static_cast<int>(to_int(get("warmup"), 0, 1 << 20)) : (gpu ? 5 : 1);
    if (has("seed")) s.seed = static_cast<uint64_t>(to_int(get("seed"), 0, INT64_MAX));
    if (has("check")) s.check = to_bool(get("check"));
    if (has("graph")) s.graph = to_bool(get("graph"));
    if (s.graph && !gpu) refuse(get("graph"), "CUDA graphs need --device cuda");
    if (has("idle")) s.idle = to_bool(get("idle"));

    if (has("json")) {
      s.json = get("json").value;
      if (s.json.empty()) refuse(get("json"), "needs a file name");
      if (rank == 0) {  // rank 0 writes it: find out now rather than after the run
        std::error_code ec;
        const std::filesystem::path parent = std::filesystem::path(s.json).parent_path();
        if (!parent.empty()) std::filesystem::create_directories(parent, ec);
        std::ofstream probe(s.json, std::ios::app);
        if (!probe) refuse(get("json"), "cannot write this file");
      }
    }
  } catch (const Refused& r) {
    message = "xent_dist_bench: " + r.message;
    return kParseError;
  }
  return kParseOk;
}

}  // namespace xb
