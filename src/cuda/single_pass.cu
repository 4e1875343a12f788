// The single-pass path's entry points (the kernel: cuda/single_pass.cuh): which rows it takes,
// and the launch on one rank.
#include "cuda/single_pass.cuh"

namespace xent::cuda {

using namespace single_pass_detail;

bool single_pass_fits(const core::Problem& p, DType dtype) {
  if (p.cols - p.real_cols > kMostPadding) return false;
  const int64_t n = static_cast<int64_t>(16 / dtype_size(dtype));  // elements per pack
  // Rows that a warp takes on the two-pass path stay there (a block per row would idle).
  const bool block_row = row_packs(p, dtype) > RowPolicy::kWarpRowPacks;
  const bool clusters = device_info().pdl;  // compute capability 9.0 and newer
  const int64_t most = clusters ? kLargestRowPacks : kLargestBlockRowPacks;
  return block_row && p.real_cols <= most * n;
}

namespace single_pass_detail {
void check_single_pass(const core::Problem& p, LogitsView in, LogitsView out) {
  check_shape(p, in);
  if (out.data != in.data) check_shape(p, out, "grad");
  // api.cpp asked single_pass_fits; a row past the largest shape would be left half written.
  if (row_packs(p, in.dtype) > kLargestRowPacks)
    fail("the single-pass kernel cannot hold rows of " + std::to_string(p.real_cols) +
         " real columns");
}
}  // namespace single_pass_detail

void single_pass(const core::Problem& p, LogitsView in, LogitsView out, TargetsView targets,
                 float* record, int64_t* error, const float* scalars, cudaStream_t stream) {
  if (p.rows == 0) return;
  check_single_pass(p, in, out);
  launch_single_pass<false>(p, in, out, targets, SinglePassPointers{record, error, scalars},
                            PeerExchange{}, 1.0f, stream);
}

}  // namespace xent::cuda
