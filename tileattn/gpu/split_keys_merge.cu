// The merge of a split-KV forward (common.cuh, SPLIT_KEYS): a prefill grid of few query
// tiles whose key tiles were cut into n_splits shares, each share's O normalised by its own
// sum with its lse, partials laid out [out head][share][n_q rows]. For each output row, with
// m the largest share lse and w_s = exp(lse_s - m): o = sum_s w_s o_s / sum_s w_s,
// lse = m + log(sum_s w_s). A share of lse -inf (it kept no key, or, in a variable-length
// call whose launcher filled the lse partials with -inf, never wrote the row) adds nothing,
// whatever its o partial holds; no share at all: o = 0, lse = -inf. A NaN share lse is
// passed over by fmaxf and then makes the sum NaN, so NaN reaches o and lse.
//
// The shares are few (a handful, tiles.FORWARD_MAX_SPLITS at most) and the rows many, so a
// thread takes kColumns adjacent columns of one row and loops over the shares: the partials
// are read once, consecutive threads reading adjacent columns.
// (attention_decode.cu's merge serves the opposite case: a few rows, hundreds of splits.)
//
// Compile-time configuration (NVRTC -D options): STORAGE (o's type), VALUE_DIM, PARTIAL (the
// partials' and lse's type: float, or double for float64).
#include "sequences.cuh"
#ifndef PARTIAL
#define PARTIAL float
#endif
typedef PARTIAL partial;

constexpr int kColumns = 4;
constexpr int kPieces = (VALUE_DIM + kColumns - 1) / kColumns;  // a row's threads

extern "C" __global__ void __launch_bounds__(256) split_keys_merge(
    const partial* partial_o, const partial* partial_lse, STORAGE* o, partial* lse, i64 n_rows,
    i64 n_q, int n_splits, int n_q_heads, i64 o_sb, i64 o_sh, i64 o_sn) {
    const i64 index = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x;
    const i64 row = index / kPieces;
    const int first = static_cast<int>(index % kPieces) * kColumns;
    if (row >= n_rows) return;
    // Share s of this row: partial row (head * n_splits + s) * n_q + row % n_q.
    const i64 share0 = row / n_q * n_splits * n_q + row % n_q;
    partial largest = negative_infinity<partial>();
    for (int s = 0; s < n_splits; ++s)
        largest = max_acc(largest, partial_lse[share0 + s * n_q]);
    const partial safe_max = largest == negative_infinity<partial>() ? partial(0) : largest;
    partial total = 0, sum[kColumns] = {};
    for (int s = 0; s < n_splits; ++s) {
        const partial share_lse = partial_lse[share0 + s * n_q];
        if (share_lse == negative_infinity<partial>()) continue;
        const partial weight = exp_acc(share_lse - safe_max);
        const partial* part = partial_o + (share0 + s * n_q) * VALUE_DIM + first;
        total += weight;
#pragma unroll
        for (int c = 0; c < kColumns; ++c)
            if (VALUE_DIM % kColumns == 0 || first + c < VALUE_DIM) sum[c] += weight * part[c];
    }
    const partial factor = total == partial(0) ? partial(0) : partial(1) / total;
    STORAGE* o_row = o + flat_row_offset(row, n_q_heads, n_q, {o_sb, o_sh, o_sn});
#pragma unroll
    for (int c = 0; c < kColumns; ++c)
        if (VALUE_DIM % kColumns == 0 || first + c < VALUE_DIM)
            o_row[first + c] = narrow<STORAGE>(sum[c] * factor);
    if (first == 0)
        lse[row] = total == partial(0) ? negative_infinity<partial>() : safe_max + log_acc(total);
}
