// xent_dist_bench: the table and the JSON file, from the settings, the environment and the rows.
#include <cinttypes>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "harness.h"

#ifndef XENT_BENCH_VERSION
#define XENT_BENCH_VERSION "unknown"
#endif

namespace xb {
namespace {

double gbps(const Result& r) {
  return r.bytes / (r.total_ms * 1e-3) / 1e9;
}
// The 3-pass roofline: the row's bytes at the copy bandwidth measured at start-up.
double roofline_ms(const Result& r, const Env& env) {
  return r.bytes / env.copy_bw * 1e3;
}
double roofline_pct(const Result& r, const Env& env) {
  return 100.0 * roofline_ms(r, env) / r.total_ms;
}
// The 2-pass floor: the logits read once and the gradient written once (two thirds of the
// roofline), what a path that holds each row on chip can reach.
double floor_ms(const Result& r, const Env& env) {
  return roofline_ms(r, env) * 2.0 / 3.0;
}
double floor_pct(const Result& r, const Env& env) {
  return 100.0 * floor_ms(r, env) / r.total_ms;
}

// --hidden: the lm head's time over the three GEMMs alone (0 where they were not timed).
double x_gemm3(const Result& r) {
  return r.gemm3_ms > 0 ? r.total_ms / r.gemm3_ms : 0.0;
}
// --hidden: the floor of an exact step (docs/linear.md, "The floor of an exact step"): gemm3
// plus 8 bytes a logit at the copy bandwidth. Each logit must be in fp32 when its gradient is
// made: 16-bit inputs write it in 4 bytes (gemm3: 2), read it (4) and write its gradient (2);
// f32 inputs read it (4) and write its gradient (4).
double exact_floor_ms(const Result& r, const Env& env) {
  return r.gemm3_ms + 8.0 * double(r.tokens) * double(r.width) / env.copy_bw * 1e3;
}
double x_floor(const Result& r, const Env& env) {
  return r.gemm3_ms > 0 ? r.total_ms / exact_floor_ms(r, env) : 0.0;
}

nlohmann::json to_json(const Settings& s, const Env& env, const std::vector<Result>& results,
                       int64_t wrong) {
  using nlohmann::json;
  json j;
  j["tool"] = "xent_dist_bench";
  j["version"] = XENT_BENCH_VERSION;
  j["command"] = s.command;
  j["env"] = {{"hostname", env.hostname},
              {"started", env.started},
              {"ranks", env.ranks},
              {"backend", s.device},
              {"ranks_detail", env.rank_lines},
              {"mpi", env.mpi},
              {"cuda_runtime", env.cuda_runtime},
              {"cuda_driver", env.cuda_driver},
              {"nccl", env.nccl},
              {"copy_bandwidth_gbps", env.copy_bw / 1e9},
              {"copy_bandwidth_method", env.copy_how}};
  j["config"] = json::object();
  echo_config(s, j["config"]);
  json rows = json::array();
  for (const Result& r : results) {
    json row = {{"tokens", r.tokens},     {"vocab_per_rank", r.width},
                {"mode", r.mode},         {"dtype", dtype_name(s.dtype)},
                {"fwd_ms", r.fwd_ms},     {"bwd_ms", r.bwd_ms},
                {"total_ms", r.total_ms}, {"extra_mib", r.extra_bytes / (1 << 20)}};
    row["wrong"] = s.check ? json(r.wrong) : json(nullptr);
    if (s.hidden > 0) {
      row["hidden"] = s.hidden;
      row["gemm3_ms"] = r.gemm3_ms > 0 ? json(r.gemm3_ms) : json(nullptr);
      row["x_gemm3"] = r.gemm3_ms > 0 ? json(x_gemm3(r)) : json(nullptr);
      row["exact_floor_ms"] = r.gemm3_ms > 0 ? json(exact_floor_ms(r, env)) : json(nullptr);
      row["x_floor"] = r.gemm3_ms > 0 ? json(x_floor(r, env)) : json(nullptr);
      row["path"] = r.path;  // the plan's schedule and GEMM engine
    } else {
      row.update({{"path", r.path},
                  {"allgather_ms", r.gather_ms},
                  {"gbps", gbps(r)},
                  {"roofline_ms", roofline_ms(r, env)},
                  {"roofline_pct", roofline_pct(r, env)},
                  {"floor_ms", floor_ms(r, env)},
                  {"floor_pct", floor_pct(r, env)}});
    }
    rows.push_back(row);
  }
  j["results"] = rows;
  j["wrong_total"] = s.check ? json(wrong) : json(nullptr);
  return j;
}

}  // namespace

void print_header(const Settings& s, const Env& env, int64_t width) {
  std::printf("# xent_dist_bench %s: %s, forward + backward\n", XENT_BENCH_VERSION,
              s.hidden > 0 ? "the fused lm head (xent::linear_forward / linear_backward)"
                           : "vocab-parallel cross-entropy");
  std::printf("# command: %s\n", s.command.c_str());
  std::printf("# %d rank(s), one vocabulary shard each; backend %s\n", env.ranks, s.device.c_str());
  std::printf("# model %s%s%s: vocab %" PRId64 " padded to %" PRId64 " (pad-to %" PRId64
              "), %" PRId64 " columns per rank, dtype %s\n",
              s.model.c_str(), s.config.empty() ? "" : " from ", s.config.c_str(), s.vocab,
              s.padded, s.pad_to, width, dtype_name(s.dtype));
  std::printf(
      "# reduction %s, label smoothing %g, z-loss %g, softcap %g, ignore fraction %g, grad_output "
      "%g, "
      "%s%g, %g), seed %" PRIu64 "\n",
      reduction_name(s.reduction), s.label_smoothing, s.z_loss, s.softcap, s.ignore_fraction,
      s.grad_output,
      s.hidden > 0 ? "hidden in [-1, 1), weight in [-1, 1) x 2^round(log2(R / sqrt(H))) (R, H = "
                   : "logits in [-",
      s.logit_range, s.hidden > 0 ? static_cast<double>(s.hidden) : s.logit_range / 2, s.seed);
  std::printf("# timing: %d iteration(s) after %d warm-up, %s%s; check: %s\n", s.iters, s.warmup,
              s.device == "cuda" ? "CUDA events on one stream" : "MPI_Wtime",
              s.graph  ? ", replayed from CUDA graphs"
              : s.idle ? ", each step from an idle device, ranks starting together (median)"
                       : "",
              s.check ? "on (fp64 reference)" : "off (#wrong N/A; -c to verify)");
  std::printf("# MPI: %s\n", env.mpi.c_str());
  std::printf("# CUDA runtime %s, driver %s; NCCL %s\n", env.cuda_runtime.c_str(),
              env.cuda_driver.c_str(), env.nccl.c_str());
  for (const std::string& l : env.rank_lines) std::printf("%s\n", l.c_str());
  std::printf("# copy bandwidth %.1f GB/s (%s, slowest rank)\n", env.copy_bw / 1e9,
              env.copy_how.c_str());
  if (s.hidden > 0) {
    std::printf("# hidden %" PRId64 ": hidden [tokens, %" PRId64
                "] and this rank's weight shard [vocab/rank, "
                "%" PRId64
                "] in %s; gradients for grad_output = grad_scale %g (fused), %g (deferred)\n",
                s.hidden, s.hidden, s.hidden, dtype_name(s.dtype), s.grad_scale, s.grad_output);
    std::printf(
        "# gemm3: logits = hidden W^T, d_hidden = G W, d_weight = G^T hidden alone (%s)%s, %s; "
        "x gemm3: total / gemm3\n",
        s.device == "cuda" ? "cublasGemmEx, fp32 compute" : "cblas_sgemm on fp32 copies",
        s.device == "cuda" && env.ranks > 1
            ? ", then d_hidden summed over the ranks (an all-reduce of its bytes)"
            : "",
        s.interleave ? "timed once before each step (--interleave)" : "timed before the steps");
    std::printf(
        "# x floor: total / (gemm3 + 8 bytes a logit at the copy bandwidth), the floor of an exact "
        "step: fp32 logits written, read once, their gradient written\n");
    std::printf(
        "# path: the plan's schedule (fast, lean) and the engine of its logits GEMMs (cublaslt, "
        "or epilogue: xent's sm_90a GEMM with the gradient in its epilogue)\n");
    std::printf("#\n");
    std::printf("# %8s %11s %7s %9s %9s %9s %9s %9s %8s %8s %9s %7s %14s\n", "", "", "", "",
                "forward", "backward", "total", "gemm3", "", "", "extra", "", "");
    std::printf("# %8s %11s %7s %9s %9s %9s %9s %9s %8s %8s %9s %7s %14s\n", "tokens", "vocab/rank",
                "hidden", "mode", "ms", "ms", "ms", "ms", "x gemm3", "x floor", "MiB", "#wrong",
                "path");
    std::fflush(stdout);
    return;
  }
  std::printf(
      "# %%roof: the 3-pass roofline (the logits read twice and the gradient written once at that\n"
      "# bandwidth) over the time; %%floor: the 2-pass floor (read once, written once) over the "
      "time\n");
  std::printf(
      "# path: single-pass (each row read once) or two-pass, and \", device exchange\" where the "
      "records went through peer memory (xent::forward_path)\n");
  std::printf("#\n");
  std::printf("# %8s %11s %9s %9s %9s %9s %11s %9s %6s %6s %9s %7s %11s\n", "", "", "", "forward",
              "backward", "total", "all-gather", "", "", "", "extra", "", "");
  std::printf("# %8s %11s %9s %9s %9s %9s %11s %9s %6s %6s %9s %7s %11s\n", "tokens", "vocab/rank",
              "mode", "ms", "ms", "ms", "ms", "GB/s", "%roof", "%floor", "MiB", "#wrong", "path");
  std::fflush(stdout);
}

void print_row(const Settings& s, const Env& env, const Result& r) {
  char wrong[32];
  if (s.check)
    std::snprintf(wrong, sizeof wrong, "%" PRId64, r.wrong);
  else
    std::snprintf(wrong, sizeof wrong, "N/A");
  if (s.hidden > 0) {
    char gemm3[32] = "n/a", x[32] = "n/a", xf[32] = "n/a";
    if (r.gemm3_ms > 0) {
      std::snprintf(gemm3, sizeof gemm3, "%.3f", r.gemm3_ms);
      std::snprintf(x, sizeof x, "%.2f", x_gemm3(r));
      std::snprintf(xf, sizeof xf, "%.2f", x_floor(r, env));
    }
    std::printf("%10" PRId64 " %11" PRId64 " %7" PRId64
                " %9s %9.3f %9.3f %9.3f %9s %8s %8s %9.2f %7s %14s\n",
                r.tokens, r.width, s.hidden, r.mode.c_str(), r.fwd_ms, r.bwd_ms, r.total_ms, gemm3,
                x, xf, r.extra_bytes / (1 << 20), wrong, r.path.c_str());
    std::fflush(stdout);
    return;
  }
  std::printf(
      "%10" PRId64 " %11" PRId64 " %9s %9.3f %9.3f %9.3f %11.3f %9.1f %6.1f %6.1f %9.2f %7s %11s\n",
      r.tokens, r.width, r.mode.c_str(), r.fwd_ms, r.bwd_ms, r.total_ms, r.gather_ms, gbps(r),
      roofline_pct(r, env), floor_pct(r, env), r.extra_bytes / (1 << 20), wrong, r.path.c_str());
  std::fflush(stdout);
}

int print_summary(const Settings& s, const Env& env, const std::vector<Result>& results,
                  int64_t wrong) {
  std::string means;
  for (const std::string& mode : s.modes) {
    double sum = 0.0;
    int count = 0;
    for (const Result& r : results) {
      if (r.mode != mode || (s.hidden > 0 && r.gemm3_ms <= 0)) continue;
      sum += s.hidden > 0 ? x_gemm3(r) : roofline_pct(r, env);
      ++count;
    }
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.1f (%s)", count ? sum / count : 0.0, mode.c_str());
    means += (means.empty() ? "" : ", ") + std::string(buf);
  }
  std::printf(s.hidden > 0 ? "# mean x gemm3: %s\n" : "# mean %% of the 3-pass roofline: %s\n",
              means.c_str());
  if (s.check)
    std::printf("# #wrong in all: %" PRId64 " (%s)\n", wrong, wrong ? "FAILED" : "OK");
  else
    std::printf("# #wrong: not checked (-c to verify)\n");
  int status = 0;
  if (!s.json.empty()) {
    std::ofstream f(s.json, std::ios::trunc);
    f << to_json(s, env, results, wrong).dump(2) << "\n";
    if (!f) {
      std::fprintf(stderr, "xent_dist_bench: --json = '%s': could not write the file\n",
                   s.json.c_str());
      status = 1;
    } else {
      std::printf("# results written to %s\n", s.json.c_str());
    }
  }
  std::fflush(stdout);
  return status;
}

}  // namespace xb
