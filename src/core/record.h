// The per-row stats record each rank contributes to the all-gather, and how the gathered
// records merge into the global statistics. Field-major per rank so that a thread per row reads
// coalesced: rank k's field f of row i lives at gathered[(k * fields + f) * rows + i].
#pragma once

#include <cstring>

#include "core/math.h"

namespace xent::core {

struct RecordLayout {
  int fields = 2;      // lse and target logit always
  int sum_field = -1;  // sum of z over the real columns (label smoothing)
  int max_field = -1;  // max z and its global column (accuracy)
  int argmax_field = -1;

  static constexpr int kLse = 0;
  static constexpr int kTarget = 1;
  static constexpr int kMaxFields = 5;  // with the sum and the argmax

  static RecordLayout make(bool smoothing, bool accuracy) {
    RecordLayout r;
    if (smoothing) r.sum_field = r.fields++;
    if (accuracy) {
      r.max_field = r.fields++;
      r.argmax_field = r.fields++;
    }
    return r;
  }
  size_t bytes_per_row() const { return sizeof(float) * static_cast<size_t>(fields); }
};

// The argmax column travels in a float slot bit for bit.
XENT_HD float index_to_slot(int32_t i) {
#if defined(__CUDA_ARCH__)
  return __int_as_float(i);
#else
  float f;
  std::memcpy(&f, &i, sizeof f);
  return f;
#endif
}
XENT_HD int32_t slot_to_index(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_int(f);
#else
  int32_t i;
  std::memcpy(&i, &f, sizeof i);
  return i;
#endif
}

// What one rank knows of one row after its pass over its shard.
struct LocalStats {
  LseAcc lse;                // over this shard's real columns
  float target_z = kNegInf;  // z of the target column if this shard owns it
  float sum_z = 0.0f;
  ArgMax best;
};

// Two shares of one rank's row (parts of its columns) as one.
XENT_HD void merge(LocalStats& a, const LocalStats& b) {
  a.lse.merge(b.lse);
  if (b.target_z > a.target_z) a.target_z = b.target_z;
  a.sum_z += b.sum_z;
  a.best.merge(b.best);
}

XENT_HD void write_record(const LocalStats& st, const RecordLayout& L, float* record, int64_t rows,
                          int64_t row) {
  record[RecordLayout::kLse * rows + row] = st.lse.lse();
  record[RecordLayout::kTarget * rows + row] = st.target_z;
  if (L.sum_field >= 0) record[L.sum_field * rows + row] = st.sum_z;
  if (L.max_field >= 0) {
    record[L.max_field * rows + row] = st.best.value;
    record[L.argmax_field * rows + row] = index_to_slot(static_cast<int32_t>(st.best.index));
  }
}

// The global statistics of one row.
struct RowStats {
  float lse = kNegInf;
  float target_z = kNegInf;
  float sum_z = 0.0f;
  ArgMax best;
};

XENT_HD RowStats merge_records(const float* gathered, int ranks, const RecordLayout& L,
                               int64_t rows, int64_t row) {
  RowStats g;
  // lse = M + log sum_k exp(lse_k - M), M the largest: one rounding of the log whatever the number
  // of records (the fused lm head's lean schedule merges a record per chunk of the vocabulary
  // and rank), where merging them two at a time would round once per record.
  float m = kNegInf;
  for (int k = 0; k < ranks; ++k) {
    const float v =
        gathered[(static_cast<int64_t>(k) * L.fields + RecordLayout::kLse) * rows + row];
    if (v > m || v != v) m = v;  // a NaN record keeps the row NaN
  }
  float sum = 0.0f;
  for (int k = 0; k < ranks; ++k)  // rank order: the same sum on every rank
    sum += rescale(gathered[(static_cast<int64_t>(k) * L.fields + RecordLayout::kLse) * rows + row],
                   m);
  g.lse = m == kNegInf ? kNegInf : m + log_f(sum);
  for (int k = 0; k < ranks; ++k) {
    const float* rec = gathered + static_cast<int64_t>(k) * L.fields * rows;
    const float t = rec[RecordLayout::kTarget * rows + row];
    if (t > g.target_z) g.target_z = t;  // only the owner's is above -inf
    if (L.sum_field >= 0) g.sum_z += rec[L.sum_field * rows + row];
    if (L.max_field >= 0) {
      ArgMax a;
      a.value = rec[L.max_field * rows + row];
      a.index = slot_to_index(rec[L.argmax_field * rows + row]);
      g.best.merge(a);
    }
  }
  return g;
}

}  // namespace xent::core
