// Host-side switches of the CUDA backend, for benchmarks and experiments (not part of the
// public API). Plain C++: can be included from .cpp files.
#pragma once

namespace xent::cuda {

// Programmatic dependent launch on devices of compute capability 9.0 and newer: each kernel of
// xent may be scheduled while the previous kernel in the stream drains. On by default; the
// environment variable XENT_CUDA_PDL=0 turns it off at start-up, this call at any time.
void set_programmatic_launch(bool on);
bool programmatic_launch();

}  // namespace xent::cuda
