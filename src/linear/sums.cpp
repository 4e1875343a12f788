// d_hidden's sum over the ranks on the CUDA backend, from each rank's fp32 partial, rounded once
// (cuda.h: device::sum_over_ranks), for both schedules.
#include <cuda_runtime.h>

#include "error.h"
#include "linear/cuda.h"

namespace xent::linear::device {

void sum_over_ranks(Communicator& comm, bool sequence_parallel, float* partial, int64_t rows,
                    const MatrixView& dst, int64_t r0, cudaStream_t stream) {
  const int ranks = comm.size(), rank = comm.rank();
  const int64_t H = dst.cols;
  const size_t es = dtype_size(dst.dtype);
  if (sequence_parallel) {  // this rank's rows: the sum of every rank's partial of them
    comm.reduce_scatter_sum(partial, partial + rank * rows * H, static_cast<size_t>(rows * H),
                            stream);
    store_sum(partial + rank * rows * H, 1, 0, H, dst, r0, rows, stream);
    return;
  }
  if (es == sizeof(float) || rows % ranks != 0) {
    comm.all_reduce_sum(partial, partial, static_cast<size_t>(rows * H), stream);
    store_sum(partial, 1, 0, H, dst, r0, rows, stream);
    return;
  }
  // Reduce-scatter, round, all-gather: rank k sums and rounds rows [k b, (k + 1) b), and the
  // 16-bit rows travel. The all-gather lands in the partial's bytes (free after the
  // reduce-scatter but for this rank's block, which is stored first), then one copy into dst.
  const int64_t b = rows / ranks;
  float* mine = partial + rank * b * H;
  comm.reduce_scatter_sum(partial, mine, static_cast<size_t>(b * H), stream);
  store_sum(mine, 1, 0, H, dst, r0 + rank * b, b, stream);
  char* out = static_cast<char*>(dst.data);
  const size_t row_bytes = static_cast<size_t>(H) * es, ld_bytes = dst.row_stride * es;
  const char* own = out + (r0 + rank * b) * ld_bytes;
  if (dst.row_stride != H) {  // the all-gather's send must be contiguous: stage it
    char* staged = reinterpret_cast<char*>(partial) + rows * row_bytes;  // past the recv
    check_cuda(cudaMemcpy2DAsync(staged, row_bytes, own, ld_bytes, row_bytes, b,
                                 cudaMemcpyDeviceToDevice, stream),
               "cudaMemcpy2DAsync (d_hidden's rows)");
    own = staged;
  }
  comm.all_gather(own, partial, static_cast<size_t>(b) * row_bytes, stream);
  check_cuda(cudaMemcpy2DAsync(out + r0 * ld_bytes, ld_bytes, partial, row_bytes, row_bytes, rows,
                               cudaMemcpyDeviceToDevice, stream),
             "cudaMemcpy2DAsync (d_hidden's sum)");
}

}  // namespace xent::linear::device
