// xent_dist_bench's options (options.cpp makes them flags and preset keys).
//
// Each option is one row of kOptions: its flag, its --help line, whether a preset may set it, how
// its value is checked and stored (its default included), and how the JSON echoes it. Rows are
// resolved in table order, which is also the order of --help; a row may read rows before it (the
// device picks the defaults), so with several bad values the first row's is the one refused.
#include "option_table.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "gen.h"

namespace xb {

const Choices kDTypes = {{"f32", kF32},   {"fp32", kF32},      {"float32", kF32},
                         {"bf16", kBF16}, {"bfloat16", kBF16}, {"f16", kF16},
                         {"fp16", kF16},  {"float16", kF16},   {"half", kF16}};
const Choices kReductions = {{"mean", kMean}, {"sum", kSum}, {"none", kNone}};

const char* dtype_name(int dtype) {
  return choice_name(kDTypes, dtype);
}
const char* reduction_name(int reduction) {
  return choice_name(kReductions, reduction);
}

using nlohmann::json;

bool sweep_key(const std::string& key) {
  return key == "tokens" || key == "min_tokens" || key == "max_tokens" || key == "step_factor";
}

namespace {

// The sweep: a token list, or -b/-e/-f around defaults that depend on the device.
void apply_sweep(Resolve& r, const Source* list) {
  Settings& s = r.s;
  const Source *b_ = r.find("min_tokens"), *e_ = r.find("max_tokens"), *f_ = r.find("step_factor");
  if (list && (b_ || e_ || f_)) refuse(*list, "give either a token list or -b/-e/-f, not both");
  if (list) {
    s.tokens = to_int_list(*list);
    s.tokens_from = named(*list);
    return;
  }
  int64_t b = r.gpu() ? 1024 : 128, e = r.gpu() ? 16384 : 512, f = 2;
  if (b_) b = to_int(*b_, 1, INT32_MAX);
  if (e_) e = to_int(*e_, 1, INT32_MAX);
  if (f_) f = to_int(*f_, 2, 1 << 20);
  if (!e_ && e < b) e = b;
  if (!b_ && b > e) b = e;
  if (e < b) refuse(*e_, "is below --min-tokens " + std::to_string(b));
  for (int64_t n = b; n <= e; n *= f) s.tokens.push_back(n);
  // What set the largest size: -e, else -b where it raised the default -e, else the default.
  s.tokens_from = e_             ? named(*e_)
                  : b_ && e == b ? named(*b_)
                                 : "--max-tokens = '" + std::to_string(e) + "' (the default)";
}

}  // namespace

const std::vector<Option>& option_table() {
  static const std::vector<Option> kOptions = {
      {"config", "--config", "FILE", "YAML preset (configs/*.yaml); flags given here override it",
       false, nullptr, [](const Settings& s, json& c) { c["file"] = s.config; }},
      {"device", "--device", "cpu|cuda", "backend (default: cuda when a GPU is visible, else cpu)",
       false,
       [](Resolve& r, const Source* v) {
         r.s.device = r.cuda_devices > 0 ? "cuda" : "cpu";
         if (!v) return;
         r.s.device = to_choice(*v, {{"cpu", 0}, {"cuda", 1}}) ? "cuda" : "cpu";
         if (r.gpu() && r.cuda_devices == 0)
           refuse(*v, "no CUDA device is visible here (use --device cpu)");
       },
       nullptr},
      {"model", "", nullptr, "", true,
       [](Resolve& r, const Source* v) { r.s.model = v ? trim(v->value) : "custom"; },
       [](const Settings& s, json& c) { c["model"] = s.model; }},
      {"description", "", nullptr, "", true, nullptr, nullptr},
      {"tp", "", nullptr, "", true,
       [](Resolve& r, const Source* v) {
         const int64_t tp = v ? to_int(*v, 1, 1 << 20) : r.s.ranks;
         if (tp != r.s.ranks)
           refuse(*v, "this run has " + std::to_string(r.s.ranks) +
                          " rank(s); launch one rank per tensor-parallel rank (mpirun -np " +
                          std::to_string(tp) + ")");
       },
       [](const Settings& s, json& c) { c["tp"] = s.ranks; }},
      // -b/-e/-f are resolved with --tokens, which decides between the two.
      {"min_tokens", "-b,--min-tokens", "N",
       "smallest token count of the sweep (cuda 1024, cpu 128)", true, nullptr, nullptr},
      {"max_tokens", "-e,--max-tokens", "N",
       "largest token count of the sweep (cuda 16384, cpu 512)", true, nullptr, nullptr},
      {"step_factor", "-f,--step-factor", "F", "multiply the token count by F between sizes (2)",
       true, nullptr, nullptr},
      {"tokens", "--tokens", "N,N,...", "explicit token counts, instead of -b/-e/-f", true,
       apply_sweep, [](const Settings& s, json& c) { c["tokens"] = s.tokens; }},
      {"vocab_size", "--vocab", "V", "global vocabulary size (cuda 128256, cpu 32000)", true,
       [](Resolve& r, const Source* v) {
         r.s.vocab = v ? to_int(*v, 1, INT32_MAX) : (r.gpu() ? 128256 : 32000);
         r.s.vocab_from =
             v ? named(*v) : "--vocab = '" + std::to_string(r.s.vocab) + "' (the default)";
       },
       [](const Settings& s, json& c) { c["vocab_size"] = s.vocab; }},
      {"pad_to", "--pad-to", "M", "pad the global vocabulary to a multiple of M (1: no padding)",
       true,
       [](Resolve& r, const Source* v) {
         Settings& s = r.s;
         s.pad_to = v ? to_int(*v, 1, 1 << 24) : 1;
         s.padded = (s.vocab + s.pad_to - 1) / s.pad_to * s.pad_to;
         if (s.padded >= s.ranks) return;
         const Source* vocab = r.find("vocab_size");
         refuse(vocab ? *vocab : Source{std::to_string(s.vocab), "--vocab"},
                "the (padded) vocabulary must give every one of the " + std::to_string(s.ranks) +
                    " ranks a column");
       },
       [](const Settings& s, json& c) {
         c["pad_to"] = s.pad_to;
         c["padded_vocab"] = s.padded;
       }},
      {"dtype", "--dtype", "f32|bf16|f16", "logits dtype (bf16)", true,
       [](Resolve& r, const Source* v) { r.s.dtype = v ? to_choice(*v, kDTypes) : kBF16; },
       [](const Settings& s, json& c) { c["dtype"] = dtype_name(s.dtype); }},
      {"reduction", "--reduction", "mean|sum|none", "loss reduction (mean)", true,
       [](Resolve& r, const Source* v) { r.s.reduction = v ? to_choice(*v, kReductions) : kMean; },
       [](const Settings& s, json& c) { c["reduction"] = reduction_name(s.reduction); }},
      {"mode", "--mode", "fused|deferred|both", "gradient mode(s) to time (both)", true,
       [](Resolve& r, const Source* v) {
         const int mode = v ? to_choice(*v, {{"fused", 0}, {"deferred", 1}, {"both", 2}}) : 2;
         if (mode == 0 || mode == 2) r.s.modes.push_back("fused");
         if (mode == 1 || mode == 2) r.s.modes.push_back("deferred");
       },
       [](const Settings& s, json& c) { c["modes"] = s.modes; }},
      {"label_smoothing", "--label-smoothing", "E", "label smoothing in [0, 1) (0)", true,
       [](Resolve& r, const Source* v) {
         if (v) r.s.label_smoothing = to_double(*v, 0.0, 1.0, false, true);
       },
       [](const Settings& s, json& c) { c["label_smoothing"] = s.label_smoothing; }},
      {"z_loss", "--z-loss", "W", "z-loss weight >= 0 (0)", true,
       [](Resolve& r, const Source* v) {
         if (v) r.s.z_loss = to_double(*v, 0.0, 1e6);
       },
       [](const Settings& s, json& c) { c["z_loss"] = s.z_loss; }},
      {"softcap", "--softcap", "C", "final-logit softcap > 0, 0 for none (0)", true,
       [](Resolve& r, const Source* v) {
         if (v) r.s.softcap = to_double(*v, 0.0, 1e6);
       },
       [](const Settings& s, json& c) { c["softcap"] = s.softcap; }},
      {"ignore_fraction", "--ignore-fraction", "P",
       "share of rows whose target is ignore_index, in [0, 1) (0)", true,
       [](Resolve& r, const Source* v) {
         if (v) r.s.ignore_fraction = to_double(*v, 0.0, 1.0, false, true);
       },
       [](const Settings& s, json& c) { c["ignore_fraction"] = s.ignore_fraction; }},
      {"grad_output", "--grad-output", "G", "value of grad_output passed to backward (1)", true,
       [](Resolve& r, const Source* v) {
         if (v) r.s.grad_output = to_double(*v, -1e6, 1e6);
       },
       [](const Settings& s, json& c) { c["grad_output"] = s.grad_output; }},
      {"grad_scale", "--grad-scale", "S",
       "Options::grad_scale of the fused mode: forward's gradient is for grad_output = S, and "
       "backward rescales only where grad_output differs (set S = G to skip that pass) (1)",
       true,
       [](Resolve& r, const Source* v) {
         if (v) r.s.grad_scale = to_double(*v, 0.0, 1e6, true);
       },
       [](const Settings& s, json& c) { c["grad_scale"] = s.grad_scale; }},
      {"logit_range", "--logit-range", "R",
       "logits k*R/256, integers k in [-256, 128): per row a window of width R at its own offset; "
       "R "
       "a power of two in [1, 1024] (8)",
       true,
       [](Resolve& r, const Source* v) {
         if (!v) return;
         r.s.logit_range = to_double(*v, 1.0, 1024.0);
         int e2 = 0;
         if (std::frexp(r.s.logit_range, &e2) != 0.5)
           refuse(*v, "must be a power of two (1, 2, 4, ..., 1024)");
       },
       [](const Settings& s, json& c) { c["logit_range"] = s.logit_range; }},
      {"iters", "-n,--iters", "N", "timed iterations (cuda 20, cpu 5)", true,
       [](Resolve& r, const Source* v) {
         r.s.iters = v ? static_cast<int>(to_int(*v, 1, 1 << 20)) : (r.gpu() ? 20 : 5);
       },
       [](const Settings& s, json& c) { c["iters"] = s.iters; }},
      {"warmup", "-w,--warmup", "N", "warm-up iterations (cuda 5, cpu 1)", true,
       [](Resolve& r, const Source* v) {
         r.s.warmup = v ? static_cast<int>(to_int(*v, 0, 1 << 20)) : (r.gpu() ? 5 : 1);
       },
       [](const Settings& s, json& c) { c["warmup"] = s.warmup; }},
      {"seed", "--seed", "S", "seed of the generated logits and targets (1)", true,
       [](Resolve& r, const Source* v) {
         if (v) r.s.seed = static_cast<uint64_t>(to_int(*v, 0, INT64_MAX));
       },
       [](const Settings& s, json& c) { c["seed"] = s.seed; }},
      {"check", "-c,--check", nullptr,
       "verify loss, lse and gradient against an fp64 reference (#wrong)", true,
       [](Resolve& r, const Source* v) {
         if (v) r.s.check = to_bool(*v);
       },
       [](const Settings& s, json& c) { c["check"] = s.check; }},
      {"graph", "--graph", nullptr, "time forward and backward replayed from CUDA graphs", true,
       [](Resolve& r, const Source* v) {
         if (v) r.s.graph = to_bool(*v);
         if (r.s.graph && !r.gpu()) refuse(*v, "CUDA graphs need --device cuda");
       },
       [](const Settings& s, json& c) { c["graph"] = s.graph; }},
      {"idle", "--idle", nullptr,
       "time each step alone from an idle device, the ranks starting together (median): launch "
       "latency counts, as when a training step reaches its loss with the GPU waiting",
       true,
       [](Resolve& r, const Source* v) {
         if (v) r.s.idle = to_bool(*v);
       },
       [](const Settings& s, json& c) { c["idle"] = s.idle; }},
      {"two_pass", "--two-pass", nullptr,
       "take the two-pass path even where the single-pass one applies (Options::single_pass = "
       "false): one rank, fused, rows that fit on chip",
       true,
       [](Resolve& r, const Source* v) {
         if (v) r.s.two_pass = to_bool(*v);
       },
       [](const Settings& s, json& c) { c["two_pass"] = s.two_pass; }},
      {"device_exchange", "--device-exchange", nullptr,
       "exchange the records device-side through peer memory (NCCL symmetric memory, else CUDA "
       "IPC between the ranks of one host) rather than an all-gather (Options::device_exchange, "
       "opt-in; the path column says which path ran)",
       true,
       [](Resolve& r, const Source* v) {
         if (v) r.s.device_exchange = to_bool(*v);
         if (r.s.device_exchange && !r.gpu()) refuse(*v, "the device exchange needs --device cuda");
       },
       [](const Settings& s, json& c) { c["device_exchange"] = s.device_exchange; }},
      {"hidden", "--hidden", "H",
       "time and verify the fused lm head (xent::linear_forward / linear_backward) of hidden width "
       "H in [1, 16384] on this rank's shard of the weight instead of the logits' cross-entropy, "
       "against the three GEMMs alone (gemm3; on GPUs at TP > 1 with an all-reduce of d_hidden's "
       "16-bit bytes, as an unfused step sums it) and the floor of an exact step (gemm3 plus 8 "
       "bytes "
       "a logit at the copy bandwidth); fused mode's gradients are for grad_output = "
       "--grad-scale, deferred's for --grad-output; --logit-range scales the weight; "
       "not with --graph, --two-pass or --device-exchange; 0: the logits (0)",
       true,
       [](Resolve& r, const Source* v) {
         if (v) r.s.hidden = to_int(*v, 0, 16384);
         if (r.s.hidden == 0) return;
         for (const char* key : {"graph", "two_pass", "device_exchange"}) {
           const Source* f = r.find(key);
           if (f && to_bool(*f)) refuse(*f, "not supported with --hidden (the fused lm head)");
         }
         const Source* go = r.find("grad_output");
         if (go && r.s.modes == std::vector<std::string>{"fused"})
           refuse(*go,
                  "not used with --hidden in fused mode (linear_backward is not called; the "
                  "gradients are for grad_output = --grad-scale): give --grad-scale, or --mode "
                  "deferred");
       },
       [](const Settings& s, json& c) { c["hidden"] = s.hidden; }},
      {"scratch_mib", "--scratch-mib", "MIB",
       "--hidden: the bound on the fused lm head's scratch (LinearOptions::max_scratch_bytes) in "
       "MiB; 0: the default (an eighth of the bf16 logits, or what the lean schedule needs); the "
       "extra column is the most the call held at once",
       true,
       [](Resolve& r, const Source* v) {
         if (v) r.s.scratch_mib = to_int(*v, 0, int64_t(1) << 30);
       },
       [](const Settings& s, json& c) { c["scratch_mib"] = s.scratch_mib; }},
      {"schedule", "--schedule", "S",
       "--hidden: the fused lm head's schedule, auto (the plan's choice), fast or lean "
       "(LinearOptions::schedule); the path column says which ran",
       true,
       [](Resolve& r, const Source* v) {
         if (!v) return;
         if (v->value != "auto" && v->value != "fast" && v->value != "lean")
           refuse(*v, "must be auto, fast or lean");
         r.s.schedule = v->value;
       },
       [](const Settings& s, json& c) { c["schedule"] = s.schedule; }},
      {"gemm", "--gemm", "E",
       "--hidden: the engine of the fused lm head's logits GEMMs, auto (the plan's choice), "
       "cublaslt or epilogue (xent's sm_90a GEMMs; LinearOptions::gemm); the path column says "
       "which "
       "ran",
       true,
       [](Resolve& r, const Source* v) {
         if (!v) return;
         if (v->value != "auto" && v->value != "cublaslt" && v->value != "epilogue")
           refuse(*v, "must be auto, cublaslt or epilogue");
         r.s.gemm = v->value;
       },
       [](const Settings& s, json& c) { c["gemm"] = s.gemm; }},
      {"interleave", "--interleave", nullptr,
       "--hidden: time gemm3 once before each step (alternating, means of each) instead of all of "
       "its calls before the steps, so that both run in the same power and thermal state (a "
       "power-capped GPU runs whatever it times first faster)",
       true,
       [](Resolve& r, const Source* v) {
         if (v) r.s.interleave = to_bool(*v);
         if (!r.s.interleave) return;
         if (r.s.hidden == 0) refuse(*v, "only with --hidden (gemm3 is the fused lm head's)");
         if (r.s.idle) refuse(*v, "not with --idle (each step there starts from an idle device)");
       },
       [](const Settings& s, json& c) { c["interleave"] = s.interleave; }},
      {"chunk_rows", "--chunk-rows", "N",
       "--hidden: LinearOptions::chunk_rows (fast: rows per chunk; lean: rows per block of fp32 "
       "logits); 0: the plan's",
       true,
       [](Resolve& r, const Source* v) {
         if (v) r.s.chunk_rows = to_int(*v, 0, int64_t(1) << 30);
       },
       [](const Settings& s, json& c) { c["chunk_rows"] = s.chunk_rows; }},
      {"chunk_cols", "--chunk-cols", "N",
       "--hidden: LinearOptions::chunk_cols (lean: columns per chunk of the vocabulary); 0: the "
       "plan's",
       true,
       [](Resolve& r, const Source* v) {
         if (v) r.s.chunk_cols = to_int(*v, 0, int64_t(1) << 30);
       },
       [](const Settings& s, json& c) { c["chunk_cols"] = s.chunk_cols; }},
      {"json", "--json", "FILE", "also write the results and the environment as JSON (rank 0)",
       false,
       [](Resolve& r, const Source* v) {
         if (!v) return;
         r.s.json = v->value;
         if (r.s.json.empty()) refuse(*v, "needs a file name");
         if (r.rank != 0) return;
         // Rank 0 writes it: find out now rather than after the run.
         std::error_code ec;
         const std::filesystem::path parent = std::filesystem::path(r.s.json).parent_path();
         if (!parent.empty()) std::filesystem::create_directories(parent, ec);
         std::ofstream probe(r.s.json, std::ios::app);
         if (!probe) refuse(*v, "cannot write this file");
       },
       nullptr},
  };
  return kOptions;
}

}  // namespace xb
