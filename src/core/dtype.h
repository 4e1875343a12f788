// Element access for the logits' dtypes, the same on host and device: loads widen to fp32,
// stores round once from fp32 (round to nearest even).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "core/math.h"
#include "xent/xent.h"

namespace xent::core {

template <DType D>
struct Elem;
template <>
struct Elem<DType::f32> {
  using type = float;
  static XENT_HD float load(type v) { return v; }
  static XENT_HD type store(float v) { return v; }
};
template <>
struct Elem<DType::bf16> {
  using type = __nv_bfloat16;
  static XENT_HD float load(type v) { return __bfloat162float(v); }
  static XENT_HD type store(float v) { return __float2bfloat16_rn(v); }
};
template <>
struct Elem<DType::f16> {
  using type = __half;
  static XENT_HD float load(type v) { return __half2float(v); }
  static XENT_HD type store(float v) { return __float2half_rn(v); }
};

// Bytes of one target of this index type.
XENT_HD size_t target_size(IndexType type) {
  return type == IndexType::i32 ? 4 : 8;
}

XENT_HD int64_t load_target(const void* targets, IndexType type, int64_t row) {
  return type == IndexType::i32 ? static_cast<int64_t>(static_cast<const int32_t*>(targets)[row])
                                : static_cast<const int64_t*>(targets)[row];
}

// Calls f(Elem<D>{}) for the runtime dtype: one switch, every backend.
template <typename F>
decltype(auto) dispatch_dtype(DType d, F&& f) {
  switch (d) {
    case DType::bf16: return f(Elem<DType::bf16>{});
    case DType::f16: return f(Elem<DType::f16>{});
    default: return f(Elem<DType::f32>{});
  }
}

}  // namespace xent::core
