// The fast schedule's loop, over any backend's steps (fast.cpp).
#pragma once

#include "linear/check.h"
#include "linear/steps.h"

namespace xent::linear {

void run_fast(FastSteps& s, const Call& call, const Plan& plan, Pass pass);

}  // namespace xent::linear
