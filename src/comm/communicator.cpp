// The base Communicator's optional collectives: a communicator without them says so
// (has_sums() false) and is never asked; these throw should a caller ask anyway.
#include "error.h"
#include "xent/xent.h"

namespace xent {

void Communicator::all_reduce_sum(const float*, float*, size_t, cudaStream_t) {
  fail("Communicator::all_reduce_sum: this communicator has no sums (has_sums() is false)");
}

void Communicator::reduce_scatter_sum(const float*, float*, size_t, cudaStream_t) {
  fail("Communicator::reduce_scatter_sum: this communicator has no sums (has_sums() is false)");
}

}  // namespace xent
