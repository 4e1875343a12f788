// The layout checks that forward() also uses (src/layout.cpp).
#pragma once

#include "core/problem.h"
#include "xent/xent.h"

namespace xent {

// Gathers every rank's header and checks them all alike on every rank (throws on each): layout,
// rows, options, dtype and targets; `tiling`: the shards must tile [0, total width) in order.
void exchange_and_check(const Group& group, const core::LayoutHeader& mine, bool tiling);

// A small collective on host values, whatever the backend: every rank's `bytes` at `mine` into
// `all`, rank order. For CUDA groups it stages through device memory and synchronises.
void gather_on_host(const Group& group, const void* mine, void* all, size_t bytes);

}  // namespace xent
