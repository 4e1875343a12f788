// Host-side switches of the CUDA backend, for benchmarks and experiments (not part of the
// public API). Plain C++: can be included from .cpp files.
#pragma once

namespace xent::cuda {

// Programmatic dependent launch on devices of compute capability 9.0 and newer: each kernel of
// xent may be scheduled while the previous kernel in the stream drains. On by default; the
// environment variable XENT_CUDA_PDL=0 turns it off at start-up, this call at any time.
void set_programmatic_launch(bool on);
bool programmatic_launch();

// The stats kernel for long rows without options: 0 one row per block, the row's target handled
// by lane 0; 1 to 3 the same with no load waited on before the row's loads go out: 1 with 8
// blocks per SM (one pack per LSE chunk), 2 with 4 (the batch per chunk), 3 with 6 (two packs
// per chunk). The environment variable XENT_CUDA_STATS sets it at start-up.
void set_stats_variant(int v);

}  // namespace xent::cuda
