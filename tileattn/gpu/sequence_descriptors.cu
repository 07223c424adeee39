// The tables of a padded or paged forward whose lengths stay on the device (an unchecked
// call: tileattn/gpu/varlen.py, DeviceTables), built where the lengths are, so that the
// host neither copies them nor waits for the device, into buffers that a repeated call
// reuses (its cached launches read them there).
//
// Descriptors: the columns of tileattn.options.DESCRIPTOR_COLUMNS (sequences.cuh:
// Sequence), clamped as VarlenLayout.descriptors clamps them on the host: batch element b
// is sequence b, with min(max(seqlens_q[b], 0), n_q) rows (n_q without seqlens_q) and
// min(max(seqlens_k[b], 0), n_keys) keys. Block table (paged): the caller's rows copied
// as the int64 page ids the kernels read (the kernels clamp them into the pool).
//
// Compile-time configuration (NVRTC -D options): Q_LENGTH, K_LENGTH, TABLE: the element
// types of seqlens_q, seqlens_k and the block table (int or i64; int with a null pointer
// where one is absent).
#include "common.cuh"

__device__ __forceinline__ i64 clamped(i64 value, i64 limit) {
    return min(max(value, i64(0)), limit);
}

// One thread per table entry (and at least one per batch element).
extern "C" __global__ void padded_tables(const Q_LENGTH* seqlens_q, const K_LENGTH* seqlens_k,
                                         const TABLE* table_in, i64 batch, i64 n_q, i64 n_keys,
                                         i64 table_row_stride, i64 table_pages,
                                         i64* descriptors, i64* table) {
    const i64 t = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (table_in != nullptr && t < batch * table_pages) {
        const i64 b = t / table_pages, page = t % table_pages;
        table[t] = table_in[b * table_row_stride + page];
    }
    if (t >= batch) return;
    const i64 rows = seqlens_q != nullptr ? clamped(seqlens_q[t], n_q) : n_q;
    const i64 keys = seqlens_k != nullptr ? clamped(seqlens_k[t], n_keys) : n_keys;
    i64* d = descriptors + t * 7;
    d[0] = t;            // batch
    d[1] = 0;            // row base
    d[2] = rows;
    d[3] = 0;            // key base
    d[4] = keys;
    d[5] = keys - rows;  // band: bottom-right alignment per sequence
    d[6] = t;            // index
}
