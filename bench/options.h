// xent_dist_bench: flags and YAML presets. Every rank parses the same argv (and reads the same
// config file) before any collective; a bad value is refused with a message naming the flag or
// config key and the value.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

namespace xb {

struct Settings {
  std::string device;           // "cpu" or "cuda"
  std::string config;           // --config path ("" for none)
  std::string model;            // label from the config (or "custom")
  std::vector<int64_t> tokens;  // the sweep
  int64_t vocab = 0;            // real vocabulary size
  // Where the sweep and the vocabulary came from, as refusals name them after parsing (the memory
  // check): e.g. "--tokens = '4096,8192'", "configs/x.yaml: vocab_size = '128256'".
  std::string tokens_from, vocab_from;
  int64_t pad_to = 1;
  int64_t padded = 0;              // vocab rounded up to a multiple of pad_to
  int dtype = 1;                   // xb::DTypeCode
  int reduction = 1;               // xb::ReductionCode
  std::vector<std::string> modes;  // "fused", "deferred"
  double label_smoothing = 0.0;
  double z_loss = 0.0;
  double softcap = 0.0;
  double ignore_fraction = 0.0;
  double grad_output = 1.0;
  double grad_scale = 1.0;  // Options::grad_scale, fused mode only
  double logit_range = 8.0;
  int iters = 20;
  int warmup = 5;
  bool check = false;
  bool graph = false;
  bool two_pass = false;         // Options::single_pass = false
  bool device_exchange = false;  // Options::device_exchange
  bool idle = false;   // each step from an idle GPU after a barrier, median (else back to back)
  int64_t hidden = 0;  // > 0: the fused lm head with this hidden width (linear_op.h), else logits
  int64_t scratch_mib = 0;        // --hidden: LinearOptions::max_scratch_bytes in MiB (0: default)
  std::string schedule = "auto";  // --hidden: LinearOptions::schedule (auto, fast, lean)
  std::string gemm = "auto";      // --hidden: LinearOptions::gemm (auto, cublaslt, epilogue)
  bool interleave = false;        // --hidden: gemm3 timed before each step (else before them all)
  int64_t chunk_rows = 0;         // --hidden: LinearOptions::chunk_rows (0: the plan's)
  int64_t chunk_cols = 0;         // --hidden: LinearOptions::chunk_cols (0: the plan's)
  uint64_t seed = 1;
  std::string json;
  std::string command;  // argv, joined
  int ranks = 1;        // MPI ranks: the tensor-parallel size
};

enum ParseStatus { kParseOk = 0, kParseHelp = 1, kParseError = 2 };

const char* dtype_name(int dtype);
const char* reduction_name(int reduction);

// cuda_devices: what cudaGetDeviceCount said (0 when none or no driver); picks the default device.
// On kParseHelp `message` is the help text; on kParseError the reason.
ParseStatus parse_settings(int argc, char** argv, int ranks, int rank, int cuda_devices,
                           Settings& s, std::string& message);

// The settings as the JSON's "config" echoes them, from the same table as the flags.
void echo_config(const Settings& s, nlohmann::json& config);

}  // namespace xb
