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
  const DeviceInfo device = device_info();
  const bool clusters = device.pdl;  // compute capability 9.0 and newer
  const int64_t most = clusters ? kLargestRowPacks : kLargestBlockRowPacks;
  // Capped rows (a softcap) of 2-byte logits: the single pass is bound by the SM's arithmetic
  // (two exponentials per element in each phase), the two-pass path by memory. 8192 rows, bf16,
  // softcap 30, single pass against two passes: on H100 the single pass wins at 7 of 9 widths
  // from 8200 to 256000 columns (64128: 0.903 against 1.096 ms; it loses at 151936, 2.639
  // against 2.573, and 200000, 3.950 against 3.490); on H200, whose memory is 47 % faster for
  // the same SMs, the single pass takes the same time (64128: 0.884 ms) and wins in the
  // smallest shape only (16032: 0.235 against 0.253; 32064: 0.483 against 0.447; 128000: 1.848
  // against 1.692; 256000: 3.968 against 3.381).
  constexpr int64_t kSmallestRowPacks = std::tuple_element_t<0, Shapes>::kRowPacks;
  if (p.softcap > 0.0f && dtype_size(dtype) == 2 && device.fast_memory &&
      row_packs(p, dtype) > kSmallestRowPacks)
    return false;
  return block_row && p.real_cols <= most * n;
}

namespace single_pass_detail {
void check_single_pass(const core::Problem& p, LogitsView in, LogitsView out, bool mixed) {
  check_shape(p, in);
  if (out.data != in.data) check_shape(p, out, "grad");
  const bool pair =
      out.dtype == in.dtype || (mixed && in.dtype == DType::f32 && dtype_size(out.dtype) == 2);
  if (!pair)
    fail(std::string("single pass: grad.dtype = ") + to_string(out.dtype) +
         " with logits.dtype = " + to_string(in.dtype) + ": the gradient takes the logits' dtype" +
         (mixed ? ", or 16 bits from f32 logits" : ""));
  // api.cpp asked single_pass_fits; a row past the largest shape would be left half written.
  if (row_packs(p, in.dtype) > kLargestRowPacks)
    fail("the single-pass kernel cannot hold rows of " + std::to_string(p.real_cols) +
         " real columns");
}
}  // namespace single_pass_detail

void single_pass(const core::Problem& p, LogitsView in, LogitsView out, TargetsView targets,
                 float* record, int64_t* error, const float* scalars, cudaStream_t stream) {
  if (p.rows == 0) return;
  check_single_pass(p, in, out, /*mixed=*/true);
  launch_single_pass<false>(p, in, out, targets, SinglePassPointers{record, error, scalars},
                            PeerExchange{}, 1.0f, stream);
}

}  // namespace xent::cuda
