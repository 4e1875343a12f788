// xent_dist_bench: data generation and the independent fp64 reference, on the host
// (reference_host.cpp) and on the GPU (reference.cu). See gen.h for the math.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "gen.h"

namespace xb {

// ---- host --------------------------------------------------------------------------------------
// Writes this rank's shard [rows x width] (row stride = width) in p.dtype.
void host_fill_logits(const Problem& p, void* data);
std::vector<int64_t> host_targets(const Problem& p);
// fp64 per-row statistics over the regenerated global row.
std::vector<RefRow> host_ref_rows(const Problem& p);
// Counts the gradient elements of this rank's shard out of tolerance; the first one to *first.
int64_t host_check_grad(const Problem& p, const void* grad, const std::vector<RefRow>& rows,
                        double inv_valid, Mismatch* first);

// ---- CUDA (all stream-ordered unless said) -----------------------------------------------------
void cuda_fill_logits(const Problem& p, void* dev, cudaStream_t stream);
// rows: device array [p.rows].
void cuda_ref_rows(const Problem& p, RefRow* rows, cudaStream_t stream);
// Synchronises `stream`; returns the count of wrong elements, the first one to *first.
int64_t cuda_check_grad(const Problem& p, const void* grad, const RefRow* rows, double inv_valid,
                        Mismatch* first, cudaStream_t stream);

// ---- shared host logic -------------------------------------------------------------------------
// Loss (scalar or per row) and lse against the reference rows; host arrays. The first mismatch to
// *first (if it has none yet).
int64_t check_outputs(const Problem& p, const std::vector<RefRow>& rows, const float* loss,
                      const float* lse, Mismatch* first);
// 1 / the number of non-ignored rows (0 when there are none).
double inv_valid_rows(const std::vector<RefRow>& rows);

}  // namespace xb
