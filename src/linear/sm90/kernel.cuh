// One CUTLASS 3 kernel composition for the epilogue GEMMs (CUTLASS's own layering: a collective
// mainloop, an epilogue, a kernel schedule): bf16 operands read by TMA, fp32 accumulators, a
// persistent warp-specialized cooperative kernel of 128 x 256 tiles on clusters of two, and an
// epilogue of xent's own (`Visit`) handed each consumer thread's accumulators in registers with
// their coordinates. Nothing here calls the CUDA driver directly: TMA descriptors come through
// the runtime's driver entry points (CUTLASS's wrapper), so the library loads without libcuda.
#pragma once

#include <cutlass/cutlass.h>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/version.h>

#include <cute/tensor.hpp>
#include <cutlass/cluster_launch.hpp>
#include <cutlass/epilogue/collective/detail.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/kernel_hardware_info.hpp>

#include "cuda/launch.cuh"
#include "error.h"
#include "linear/sm90/epilogue_gemm.h"

namespace xent::linear::sm90 {

using TileShape = cute::Shape<cute::_128, cute::_256, cute::_64>;
using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;

// A wgmma accumulator fragment ((2, 2, V), M, N) of one thread seen as (rows, columns): ((2, M),
// (2, V, N)). The four threads of a quad hold the same rows, each a quarter of their columns.
template <class Layout>
CUTE_HOST_DEVICE auto rows_cols(Layout l) {
  using namespace cute;
  static_assert(rank(Layout{}) == 3 && rank<0>(Layout{}) == 3);
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)),
                     make_layout(get<0, 0>(l), get<0, 2>(l), get<2>(l)));
}

// An epilogue in CUTLASS's DefaultEpilogue's shape, no source C: Visit::tile gets the accumulators
// and their coordinates in the problem as (rows, columns) views, and Visit::SharedStorage (its
// own, carved out of the main loop's stages).
template <class Visit>
struct RegisterEpilogue {
  using EpilogueSchedule = cutlass::epilogue::NoSmemWarpSpecialized;
  using DispatchPolicy = EpilogueSchedule;
  using ElementC = void;
  using ElementD = float;
  using StrideC = cute::Stride<int64_t, cute::_1, int64_t>;
  using StrideD = StrideC;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  using SharedStorage = typename Visit::SharedStorage;
  using TensorStorage = SharedStorage;
  using Arguments = typename Visit::Params;
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args,
                                                  void*) {
    return args;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*,
                                              cudaStream_t, cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const&) {
    return true;
  }

  CUTLASS_HOST_DEVICE RegisterEpilogue(Params const& p, SharedStorage const& = SharedStorage())
      : params(p) {}
  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
            class FrgLayout, class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem, BlockShapeMNK blk_shape,
                                 BlockCoordMNKL blk_coord,
                                 cute::Tensor<FrgEngine, FrgLayout> const& accumulators,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char* smem) {
    using namespace cute;
    const int m = get<0>(problem), n = get<1>(problem);
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    (void)k_coord, (void)l_coord;
    Tensor coords = local_tile(make_identity_tensor(make_shape(m, n)), take<0, 2>(blk_shape),
                               make_coord(m_coord, n_coord));  // (BLK_M, BLK_N) -> (row, col)
    Tensor thread_coords = tiled_mma.get_thread_slice(thread_idx).partition_C(coords);
    static_assert(is_static<FrgLayout>::value);
    CUTE_STATIC_ASSERT_V(size(thread_coords) == size(accumulators));
    Tensor acc = make_tensor(accumulators.data(), rows_cols(accumulators.layout()));
    Tensor crd = make_tensor(thread_coords.data(), rows_cols(thread_coords.layout()));
    Visit::tile(params, acc, crd, m, n, thread_idx, reinterpret_cast<SharedStorage&>(*smem));
  }

  Params params;
};

// CUTLASS's adapter of operator-style epilogues to its warp-specialized kernels, whose tail (once a
// consumer thread's last tile is done) calls Visit::finish: asynchronous copies out of shared
// memory must have read it before the block exits.
template <class Visit>
struct AdaptedEpilogue : cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<
                             RegisterEpilogue<Visit>> {
  using Base =
      cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<RegisterEpilogue<Visit>>;
  using Base::Base;

  CUTLASS_DEVICE auto store_tail(typename Base::LoadPipeline load_pipeline,
                                 typename Base::LoadPipelineState load_state,
                                 typename Base::StorePipeline store_pipeline,
                                 typename Base::StorePipelineState store_state) {
    Visit::finish();
    return Base::store_tail(load_pipeline, load_state, store_pipeline, store_state);
  }
};

template <class Visit>
struct EpilogueKernel {
  using Epilogue = AdaptedEpilogue<Visit>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cutlass::bfloat16_t,
      cutlass::layout::RowMajor, 8, cutlass::bfloat16_t, cutlass::layout::ColumnMajor, 8, float,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;

  // Launches the GEMM of `g` with `epi` on `stream`: no workspace, no host synchronisation.
  static void run(const Operands& g, const typename Visit::Params& epi, cudaStream_t stream,
                  const char* what) {
    using namespace cute;
    if (g.m == 0 || g.n == 0) return;
    typename Kernel::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {static_cast<int>(g.m), static_cast<int>(g.n), static_cast<int>(g.k), 1},
        {static_cast<const cutlass::bfloat16_t*>(g.a), typename Mainloop::StrideA{g.lda, _1{}, 0},
         static_cast<const cutlass::bfloat16_t*>(g.b), typename Mainloop::StrideB{g.ldb, _1{}, 0}},
        epi};
    int device = 0;
    check_cuda(cudaGetDevice(&device), "cudaGetDevice");
    args.hw_info = cutlass::KernelHardwareInfo{device, cuda::detail::device_info().sms};
    if (Kernel::get_workspace_size(args) != 0 || !Kernel::can_implement(args))
      fail(std::string(what) + ": CUTLASS cannot run this GEMM (" + std::to_string(g.m) + " x " +
           std::to_string(g.n) + " x " + std::to_string(g.k) + ")");
    const typename Kernel::Params params = Kernel::to_underlying_arguments(args, nullptr);
    const void* kernel = reinterpret_cast<const void*>(&cutlass::device_kernel<Kernel>);
    constexpr int smem = Kernel::SharedStorageSize;
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
               what);
    const cutlass::ClusterLaunchParams launch{
        Kernel::get_grid_shape(params), Kernel::get_block_shape(),
        dim3(size<0>(ClusterShape{}), size<1>(ClusterShape{}), size<2>(ClusterShape{})), smem,
        stream};
    if (cutlass::launch_kernel_on_cluster(launch, kernel, params) != cutlass::Status::kSuccess)
      check_cuda(cudaGetLastError(), what);
    check_cuda(cudaGetLastError(), what);
  }
};

}  // namespace xent::linear::sm90
