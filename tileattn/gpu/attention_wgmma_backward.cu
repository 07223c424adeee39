// Hopper tensor-core backward (sm_90a) for float16 / bfloat16, any D and Dv up to 256.
//
// The two kernels of attention_mma_backward.cu (deterministic: no atomics, dQ and dK/dV
// each summed inside one block) moved onto warpgroup matrix instructions. Each warpgroup
// (4 warps) owns 64 rows, the M of wgmma.m64nNk16; the element-wise work per score is the
// mma.sync kernels' own (backward_scores.cuh), as wgmma's per-warp accumulator slice has
// the mma.sync layout.
//
// * attention_backward_dq_wgmma: one block per (batch, head, OWNED_ROWS query rows),
//   streaming STREAMED_ROWS-key tiles of K and V: S = Q K^T and dP = dO V^T (both operands
//   from shared memory), then dQ += dS K with dS from registers and K MN-major
//   (transposed) from shared memory. D = rowsum(dO * o) comes from
//   attention_backward_delta.cu, launched before both kernels.
// * attention_backward_dkdv_wgmma: one block per (batch, kv head, OWNED_ROWS keys),
//   streaming STREAMED_ROWS-query tiles of Q, dO, lse and D for every query head of its
//   GQA group. S^T = K Q^T and dP^T = V dO^T (operands from shared memory) make P^T and
//   dS^T accumulators with keys as rows: the register A operands of dV += P^T dO and
//   dK += dS^T Q, whose B operands (dO, Q) are read MN-major from shared memory.
//
// SINGLE_PASS (measured, not the default): no dQ kernel; the dK/dV kernel also adds each
// query tile's dQ share, dS K over its keys, into a float32 buffer (FlashAttention-2's
// single pass): 5 tile products instead of 7, dq's last bits then depend on the order of
// the additions. dS^T goes to a swizzled shared tile (keys x queries), read MN-major as
// the A operand of dQ = dS K, with K's owned tile MN-major as B; each warpgroup's share
// (kSplitKeys below) goes to the buffer as bulk reductions (cp.reduce.async.bulk) from a
// staging block in shared memory. attention_backward_dq_unblock scales and rounds the
// buffer.
//
// DKDV_PART splits the dK/dV kernel where D + Dv leave too few registers for both
// accumulators beside the score tiles (D = Dv = 128 is the widest pair that fits): 1 runs
// only dV += P^T dO (S^T, no dP^T), 2 only dK += dS^T Q; 0 both. The split costs the
// second kernel's recomputed S^T, one tile product in eight.
//
// Head dims that are not a multiple of 16 are zero-padded in shared memory, as in the
// forward (attention_wgmma_forward.cu).
//
// Tiles use the swizzles of wgmma.cuh; streamed tiles cycle through STAGES buffers
// filled by cp.async with one barrier per tile (tile t + STAGES - 1 is issued into the
// buffer tile t - 1 released). Tiles outside the band are skipped, the per-score mask runs
// only on tiles that straddle its edge or the end of the keys.
//
// GROUP_SPLITS (dK/dV kernel, default 1) cuts each GQA group's query heads into that many
// blocks where B * Hkv key tiles leave SMs idle: the kernel then sees Hkv * GROUP_SPLITS
// heads of group / GROUP_SPLITS, reads K and V of head kv_head / GROUP_SPLITS, and writes
// its partial dK and dV to a buffer that group_sum.cu adds up.
//
// Compile-time configuration (NVRTC -D options): IS_BFLOAT16, HEAD_DIM, VALUE_DIM,
// COPY_BYTES, OWNED_ROWS (a multiple of 64), STREAMED_ROWS (a multiple of 16 up to 256),
// STAGES (>= 2), SINGLE_PASS and DKDV_PART (dK/dV kernel), LIMIT_LEFT, LIMIT_RIGHT, SOFTCAP,
// ALIBI, DROPOUT, VARLEN (sequences.cuh; not with SINGLE_PASS), FLAG_NON_FINITE_KEYS
// (dK/dV kernel, default 0: see flag_non_finite_keys), STRIDED_OUT (sequences.cuh: the
// gradients at the strides the kernels' last arguments give; not with SINGLE_PASS,
// SPLIT_KEYS or GROUP_SPLITS, whose outputs are contiguous parts). Needs -arch=sm_90a.
#include "wgmma.cuh"
#include "backward_scores.cuh"
#include "kept_products.cuh"
#ifndef FLAG_NON_FINITE_KEYS
#define FLAG_NON_FINITE_KEYS 0
#endif
#ifndef GROUP_SPLITS
#define GROUP_SPLITS 1
#endif

constexpr int kWarpgroups = OWNED_ROWS / 64;
constexpr int kThreads = kWarpgroups * 128;
constexpr int kHeadWidth = padded_width(HEAD_DIM, 16);    // Q, K and dQ, dK columns
constexpr int kValueWidth = padded_width(VALUE_DIM, 16);  // V, dO and dV columns
using QkSwizzle = Swizzled<kHeadWidth>;
using VSwizzle = Swizzled<kValueWidth>;
// Owned and streamed tiles of Q / K (head width) and of dO / V (value width).
constexpr int kOwnedHeadBytes = kSwizzledTileBytes<OWNED_ROWS, kHeadWidth>;
constexpr int kOwnedValueBytes = kSwizzledTileBytes<OWNED_ROWS, kValueWidth>;
constexpr int kStreamedHeadBytes = kSwizzledTileBytes<STREAMED_ROWS, kHeadWidth>;
constexpr int kStreamedValueBytes = kSwizzledTileBytes<STREAMED_ROWS, kValueWidth>;
constexpr int kScoreFrags = STREAMED_ROWS / 8;  // n8 fragments of a score tile per warp
static_assert(OWNED_ROWS % 64 == 0 && STAGES >= 2 && STREAMED_ROWS % 16 == 0 &&
                  STREAMED_ROWS <= 256, "wgmma tiles");
constexpr bool kComputesDv = DKDV_PART != 2;
constexpr bool kComputesDk = DKDV_PART != 1;
// The single pass's dQ blocks are 64 columns of the 128-byte swizzle.
static_assert(!SINGLE_PASS || (HEAD_DIM == VALUE_DIM && HEAD_DIM % 64 == 0 && DKDV_PART == 0),
              "the single pass serves D = Dv, multiples of 64");
constexpr int kSwizzleColumns = 64;
constexpr int kSwizzleRowBytes = 128;
constexpr int kColumnBlocks = kHeadWidth / kSwizzleColumns;  // 64-column blocks of a row
// The single pass's share of dQ = dS K per warpgroup and query tile (one wgmma M of
// queries): with as many 64-column blocks as warpgroups (D = 128 over 128 keys) warpgroup w
// takes block w over all owned keys; with one block (D = 64) each takes its own 64 keys (and
// the buffer gets one addition per 64 keys). Every warpgroup issues the same wgmma chain
// every tile: a wgmma under a branch that differs between warpgroups is serialised by
// ptxas (C7520), and with it v7b's single pass spilled 300-800 bytes.
constexpr bool kSplitKeys = kColumnBlocks == 1;
constexpr int kDqKeys = kSplitKeys ? 64 : OWNED_ROWS;  // the dQ product's K
static_assert(!SINGLE_PASS || (STREAMED_ROWS == 64 && (kSplitKeys || kColumnBlocks == kWarpgroups)),
              "single-pass dQ split");

// ------------------------------------------------------------------ products

// Issues out = A B^T for this warpgroup's 64 rows of an owned tile (a_rows: the tile's
// address advanced to those rows) against a streamed tile b (STREAMED_ROWS rows), both
// Width columns wide (K-major): S (Q K^T over the head width) or dP (dO V^T over the value
// width), or their transposes. Not committed.
template <int Width>
__device__ __forceinline__ void issue_score_product(u32 a_rows, u32 b,
                                                    float (&out)[kScoreFrags][4]) {
    using S = Swizzled<Width>;
#pragma unroll
    for (int kk = 0; kk < Width / 16; ++kk)
        wgmma_ss<STREAMED_ROWS>(out, k_major_descriptor<Width>(a_rows + S::slice(kk, OWNED_ROWS)),
                                k_major_descriptor<Width>(b + S::slice(kk, STREAMED_ROWS)), kk > 0);
}

// first = A1 B1^T over the head width and second = A2 B2^T over the value width, in one
// batch: S and dP, or their transposes.
__device__ __forceinline__ void score_products(u32 a1_rows, u32 b1, u32 a2_rows, u32 b2,
                                               float (&first)[kScoreFrags][4],
                                               float (&second)[kScoreFrags][4]) {
    wgmma_fence();
    issue_score_product<kHeadWidth>(a1_rows, b1, first);
    issue_score_product<kValueWidth>(a2_rows, b2, second);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_pin(first);
    wgmma_pin(second);
}

// first = A1 B1^T alone (the dV-only part needs no dP^T).
__device__ __forceinline__ void score_product(u32 a1_rows, u32 b1,
                                              float (&first)[kScoreFrags][4]) {
    wgmma_fence();
    issue_score_product<kHeadWidth>(a1_rows, b1, first);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_pin(first);
}

// x (a score tile's accumulators) rounded to the input type as register A fragments.
__device__ __forceinline__ void pack_fragments(const float (&x)[kScoreFrags][4],
                                               u32 (&a)[STREAMED_ROWS / 16][4]) {
#pragma unroll
    for (int kk = 0; kk < STREAMED_ROWS / 16; ++kk)
        pack_a_fragment(x[2 * kk], x[2 * kk + 1], a[kk]);
}

// Issues out += X B for X = packed fragments (64 x STREAMED_ROWS per warpgroup) and B = the
// streamed tile `b` (STREAMED_ROWS x Width, rows are the inner dimension), read MN-major:
// rows 16 kk .. per step, the next column block STREAMED_ROWS rows further. Not committed:
// the caller commits and waits, keeping `a` intact until then.
template <int Width>
__device__ __forceinline__ void issue_accumulate(float (&out)[Width / 8][4],
                                                 const u32 (&a)[STREAMED_ROWS / 16][4], u32 b) {
    using S = Swizzled<Width>;
#pragma unroll
    for (int kk = 0; kk < STREAMED_ROWS / 16; ++kk)
        wgmma_rs_transposed_b<Width>(
            out, a[kk],
            mn_major_descriptor<Width>(b + kk * 16 * S::kRowBytes, STREAMED_ROWS * S::kRowBytes),
            1);
}

// This warp's 16 rows of accumulators (the warpgroup's rows 16 w ..), times `factor`, into
// the output rows `out` (Dim columns written a row) from row `row0`; rows at or past
// `row_limit` and the padding columns are not written.
template <int Dim, int Frags, typename Out>
__device__ __forceinline__ void store_rows(const float (&acc)[Frags][4], float factor,
                                           OutputRows<Out> out, i64 row0, i64 row_limit) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const i64 row = row0 + lane / 4 + half * 8;
        if (row >= row_limit) continue;
#pragma unroll
        for (int n = 0; n < Frags; ++n)
            if (n * 8 < Dim)
                store_row_pair<Dim>(out.row0 + row * out.stride, n * 8 + 2 * (lane % 4),
                                    acc[n][2 * half] * factor, acc[n][2 * half + 1] * factor);
    }
}

template <int Frags> __device__ __forceinline__ void clear(float (&acc)[Frags][4]) {
#pragma unroll
    for (int n = 0; n < Frags; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
}

// Streams tiles [tile_begin, tile_end) through STAGES buffers: `load(stage, tile)` issues a
// tile's cp.async copies, `body(stage, tile)` uses the tile and must have waited for its
// own wgmma before returning. One barrier per tile: after it, tile t has landed for every
// thread and every thread is done with tile t - 1, whose buffer takes tile t + STAGES - 1.
// The last barrier frees every buffer for whatever the caller streams next.
template <class Load, class Body>
__device__ __forceinline__ void stream_tiles(i64 tile_begin, i64 tile_end, Load load,
                                             Body body) {
#pragma unroll
    for (int stage = 0; stage < STAGES - 1; ++stage) {
        if (tile_begin + stage < tile_end) load(stage, tile_begin + stage);
        commit_copies();
    }
    for (i64 tile = tile_begin; tile < tile_end; ++tile) {
        const int step = static_cast<int>(tile - tile_begin);
        wait_copies<STAGES - 2>();
        fence_shared_for_async_proxy();
        __syncthreads();
        if (tile + STAGES - 1 < tile_end) load((step + STAGES - 1) % STAGES, tile + STAGES - 1);
        commit_copies();
        body(step % STAGES, tile);
    }
    __syncthreads();
}

// ------------------------------------------------------------------ dQ

extern "C" __global__ void __launch_bounds__(kThreads, 1) attention_backward_dq_wgmma(
    const bits16* q, const bits16* k, const bits16* v, const bits16* d_out, const float* lse,
    const float* delta, bits16* dq, const double* alibi_slopes, i64 n_q_total, i64 n_k_total,
    int n_q_heads, int group_size, i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn,
    i64 v_sb, i64 v_sh, i64 v_sn, i64 do_sb, i64 do_sh, i64 do_sn, SCORE_OPTION_PARAMS,
    SEQUENCE_PARAMETERS, i64 dq_sb, i64 dq_sh, i64 dq_sn) {
    extern __shared__ __align__(128) unsigned char shared_bytes[];
    const u32 q_tile = (shared_address(shared_bytes) + kTileAlignment - 1) &
                       ~static_cast<u32>(kTileAlignment - 1);
    const u32 do_tile = q_tile + kOwnedHeadBytes;
    const u32 k_tiles = do_tile + kOwnedValueBytes;             // [STAGES] swizzled K tiles
    const u32 v_tiles = k_tiles + STAGES * kStreamedHeadBytes;  // [STAGES] swizzled V tiles

    const SequenceTables tables = SEQUENCE_TABLES;
    const QueryBlock owned = query_block(OWNED_ROWS, n_q_total, n_k_total, band_offset,
                                         n_q_heads, group_size, tables);
    const i64 bh = owned.bh, n_q = owned.n_q, n_k = owned.n_k;
    const Band band{owned.band_offset, window_left, window_right};
    const bits16* k_head = k + owned.batch * k_sb + owned.kv_head * k_sh + owned.key_base * k_sn;
    const bits16* v_head = v + owned.batch * v_sb + owned.kv_head * v_sh + owned.key_base * v_sn;
    // The sequence's row 0 of this head in dq, lse and D.
    const i64 head_row0 = owned.out_head * n_q_total + owned.row_base;
    static_assert(!(SPLIT_KEYS && VARLEN), "dQ's shares run dense grids only");
    const i64 row_start = owned.row_start;
    const i64 row_stop = min(row_start + OWNED_ROWS, n_q);
    const Scores scores = make_scores(scale, softcap, alibi_slopes, bh, band, dropout_key,
                                      dropout_threshold, dropout_scale,
                                      dropout_row0, dropout_col0);

    i64 tile_begin, tile_end;
    key_tile_range<LIMIT_LEFT, LIMIT_RIGHT>(band, row_start, row_stop, n_k, STREAMED_ROWS,
                                            &tile_begin, &tile_end);
    split_key_tiles(&tile_begin, &tile_end);
    if (tile_begin == tile_end) {  // no row of this tile keeps any key (in this share): dq = 0
        const auto dq_rows = output_rows<HEAD_DIM>(dq, owned, n_q_total, {dq_sb, dq_sh, dq_sn});
        for (i64 element = threadIdx.x; element < (row_stop - row_start) * HEAD_DIM;
             element += kThreads)
            dq_rows.row0[(row_start + element / HEAD_DIM) * dq_rows.stride + element % HEAD_DIM] =
                0;
        return;
    }

    const int warpgroup = threadIdx.x / 128, lane = threadIdx.x % 32;
    const i64 warp_row0 = row_start + warpgroup * 64 + ((threadIdx.x / 32) % 4) * 16;
    const i64 my_rows[2] = {warp_row0 + lane / 4, warp_row0 + lane / 4 + 8};
    float row_lse[2], row_delta[2];
    u32 row_states[2];
    load_query_row_terms(scores, lse + head_row0, delta + head_row0, 0, n_q, my_rows, row_lse,
                         row_delta, row_states);

    const auto load_keys = [&](int stage, i64 key_tile) {
        load_swizzled_tile_async<STREAMED_ROWS, HEAD_DIM, kHeadWidth, kThreads, COPY_BYTES>(
            k_tiles + stage * kStreamedHeadBytes, k_head, k_sn, key_tile * STREAMED_ROWS, n_k);
        load_swizzled_tile_async<STREAMED_ROWS, VALUE_DIM, kValueWidth, kThreads, COPY_BYTES>(
            v_tiles + stage * kStreamedValueBytes, v_head, v_sn, key_tile * STREAMED_ROWS, n_k);
    };
    const auto tile_is_masked = [&](i64 key_tile) {
        const i64 col_start = key_tile * STREAMED_ROWS;
        return col_start + STREAMED_ROWS > n_k ||
               tile_straddles_band(band, row_start, OWNED_ROWS, col_start, STREAMED_ROWS);
    };
    const auto key_tile_mask = [&](i64 key_tile) {
        return tile_mask<LIMIT_LEFT, LIMIT_RIGHT>(band, row_start, key_tile * STREAMED_ROWS, n_k);
    };

    load_swizzled_tile_async<OWNED_ROWS, HEAD_DIM, kHeadWidth, kThreads, COPY_BYTES>(
        q_tile, q + owned.batch * q_sb + owned.head * q_sh + owned.row_base * q_sn, q_sn,
        row_start, n_q);
    load_swizzled_tile_async<OWNED_ROWS, VALUE_DIM, kValueWidth, kThreads, COPY_BYTES>(
        do_tile, d_out + owned.batch * do_sb + owned.head * do_sh + owned.row_base * do_sn,
        do_sn, row_start, n_q);
    commit_copies();
    // This warpgroup's 64 rows of the owned tiles.
    const u32 q_rows = q_tile + warpgroup * 64 * QkSwizzle::kRowBytes;
    const u32 do_rows = do_tile + warpgroup * 64 * VSwizzle::kRowBytes;

    // dQ += dS K, dS = P * (dP * dropout - D) * softcap'.
    float dq_acc[kHeadWidth / 8][4];
    clear(dq_acc);
    stream_tiles(tile_begin, tile_end, load_keys, [&](int stage, i64 key_tile) {
        const u32 k_tile = k_tiles + stage * kStreamedHeadBytes;
        float s[kScoreFrags][4], dp[kScoreFrags][4];
        score_products(q_rows, k_tile, do_rows, v_tiles + stage * kStreamedValueBytes, s, dp);
        scores_to_ds(scores, s, dp, row_lse, my_rows, row_states, row_delta,
                     key_tile * STREAMED_ROWS, tile_is_masked(key_tile),
                     key_tile_mask(key_tile));
        u32 ds[STREAMED_ROWS / 16][4];
        pack_fragments(s, ds);
        // A cut tile (block-uniform) with inf/NaN in K: the kept pairs' dS K terms with it
        // on CUDA cores, then zeros for the tensor cores (kept_products.cuh). Here, after
        // the packing, so that only dQ and the 16-bit dS are live (dS as floats beside dQ
        // spilled, v15), and the mask again rather than kept live. The scan's barrier also
        // orders every warpgroup's S = Q K^T (each waited for its own) before the zeroing.
        if (kBandMasksKeys && tile_is_masked(key_tile) &&
            __syncthreads_or(shared_tile_has_non_finite<kStreamedHeadBytes, kThreads>(k_tile))) {
            const TileMask mask = key_tile_mask(opaque(key_tile));
            add_kept_non_finite_values_rolled<kScoreFrags>(
                dq_acc,
                [&](int, int half) {
                    return mask.row_window(static_cast<int>(my_rows[half] - mask.row0), 0);
                },
                HeldFromPacked<kScoreFrags>{ds}, [&](int key, int col) {
                    return element_value(
                        load_shared_bits16(k_tile + QkSwizzle::element(key, col, STREAMED_ROWS)));
                });
            __syncthreads();
            zero_non_finite_shared_tile<kStreamedHeadBytes, kThreads>(k_tile);
            fence_shared_for_async_proxy();
            __syncthreads();
        }
        wgmma_fence();
        issue_accumulate<kHeadWidth>(dq_acc, ds, k_tile);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_pin(dq_acc);
    });
    store_rows<HEAD_DIM>(dq_acc, scale,
                         output_rows<HEAD_DIM>(dq, owned, n_q_total, {dq_sb, dq_sh, dq_sn}),
                         warp_row0, n_q);
}

// ------------------------------------------------------------------ the single pass's dQ

// This warp's 16 key rows of dS^T (accumulators, keys x 64 queries), rounded to the input
// type, into the swizzled tile ds_tile[key][query] (one column block).
__device__ __forceinline__ void store_transposed_ds(const float (&dst)[kScoreFrags][4],
                                                    unsigned char* ds_tile, int key0) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int n = 0; n < kScoreFrags; ++n)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int key = key0 + lane / 4 + 8 * half, byte = (n * 8 + 2 * (lane % 4)) * 2;
            *reinterpret_cast<u32*>(ds_tile + key * kSwizzleRowBytes +
                                    (((byte >> 4) ^ (key % 8)) << 4) + (byte & 15)) =
                pack_pair(dst[n][2 * half], dst[n][2 * half + 1]);
        }
}

// Issues dq_part = dS K for the 64 queries of the tile, over kDqKeys keys from `ds_rows`
// (dS^T's tile at the first of those keys, read MN-major) and `k_rows` (K's owned tile at the
// same key, in the column block of dq_part, MN-major).
__device__ __forceinline__ void issue_dq_product(float (&dq_part)[kSwizzleColumns / 8][4],
                                                 u32 ds_rows, u32 k_rows) {
#pragma unroll
    for (int kk = 0; kk < kDqKeys / 16; ++kk)
        wgmma_ss_transposed<kSwizzleColumns>(
            dq_part, mn_major_descriptor<kSwizzleColumns>(ds_rows + kk * 16 * kSwizzleRowBytes, 0),
            mn_major_descriptor<kSwizzleColumns>(k_rows + kk * 16 * kSwizzleRowBytes, 0), kk > 0);
}

// dQ shares leave through shared memory: the warpgroup stages its 64 x 64 float block and
// one thread hands it to the TMA unit as one bulk reduction into dq_sum, so the float
// additions run in L2 without holding the warps (red.global from registers did:
// bench/NOTES-gpu.md, v10). dq_sum is blocked to match: (batch x head, query tile of 64,
// column block), 64 x 64 floats each, contiguous; attention_backward_dq_unblock reads it.
constexpr int kStagedBytes = 64 * kSwizzleColumns * 4;  // per warpgroup

// This warp's 16 rows of dq_part into the warpgroup's staging block (rows of 256 bytes).
__device__ __forceinline__ void stage_dq_part(const float (&dq_part)[kSwizzleColumns / 8][4],
                                              unsigned char* staged) {
    const int lane = threadIdx.x % 32;
    const int row0 = ((threadIdx.x / 32) % 4) * 16 + lane / 4;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        float2* row = reinterpret_cast<float2*>(staged) + (row0 + 8 * half) * kSwizzleColumns / 2;
#pragma unroll
        for (int n = 0; n < kSwizzleColumns / 8; ++n)
            row[n * 4 + lane % 4] = make_float2(dq_part[n][2 * half], dq_part[n][2 * half + 1]);
    }
}

// The first 64 x 64 block of dq_sum's blocked layout for (bh, query tile), column block 0.
__device__ __forceinline__ float* dq_sum_block(float* dq_sum, i64 bh, i64 query_tile, i64 n_q) {
    const i64 n_tiles = (n_q + 63) / 64;
    return dq_sum + (bh * n_tiles + query_tile) * kColumnBlocks * 64 * kSwizzleColumns;
}

// dq = scale * dq_sum (blocked), rounded to the input type: the single pass's last step.
extern "C" __global__ void attention_backward_dq_unblock(const float* dq_sum, bits16* dq,
                                                         i64 n_q, i64 count, float scale) {
    for (i64 pair = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; pair < count / 2;
         pair += static_cast<i64>(gridDim.x) * blockDim.x) {
        const i64 i = 2 * pair, bh = i / (n_q * HEAD_DIM), row = (i / HEAD_DIM) % n_q;
        const int column = static_cast<int>(i % HEAD_DIM);
        const float* block = dq_sum_block(const_cast<float*>(dq_sum), bh, row / 64, n_q) +
                             (column / kSwizzleColumns) * 64 * kSwizzleColumns;
        const float* at = block + (row % 64) * kSwizzleColumns + column % kSwizzleColumns;
        reinterpret_cast<u32*>(dq)[pair] = pack_pair(scale * at[0], scale * at[1]);
    }
}

// ------------------------------------------------------------------ dK, dV

// The dK/dV kernel's step on a query tile the band cuts: for each of the streamed dO and Q
// tiles that holds inf or NaN, the kept (key, query) pairs' products with those elements
// on CUDA cores (weights: P^T and dS^T as packed for the tensor cores), then zeros in their
// place, made visible to the tensor cores (async proxy). Every thread calls it.
__device__ __forceinline__ void add_and_zero_non_finite_queries(
    const u32 (&pt)[STREAMED_ROWS / 16][4], const u32 (&dst)[STREAMED_ROWS / 16][4],
    float (&dv_acc)[kValueWidth / 8][4], float (&dk_acc)[kHeadWidth / 8][4], u32 q_stage,
    u32 do_stage, const TileMask& mask, const i64 (&my_keys)[2], i64 col_start) {
    const auto kept_queries = [&](int, int half) {
        return mask.column_window(static_cast<int>(my_keys[half] - col_start), 0);
    };
    if (kComputesDv &&
        __syncthreads_or(shared_tile_has_non_finite<kStreamedValueBytes, kThreads>(do_stage))) {
        add_kept_non_finite_values_rolled<kScoreFrags>(
            dv_acc, kept_queries, HeldFromPacked<kScoreFrags>{pt}, [&](int query, int col) {
                return element_value(
                    load_shared_bits16(do_stage + VSwizzle::element(query, col, STREAMED_ROWS)));
            });
        __syncthreads();
        zero_non_finite_shared_tile<kStreamedValueBytes, kThreads>(do_stage);
        fence_shared_for_async_proxy();
        __syncthreads();
    }
    if (kComputesDk &&
        __syncthreads_or(shared_tile_has_non_finite<kStreamedHeadBytes, kThreads>(q_stage))) {
        add_kept_non_finite_values_rolled<kScoreFrags>(
            dk_acc, kept_queries, HeldFromPacked<kScoreFrags>{dst}, [&](int query, int col) {
                return element_value(
                    load_shared_bits16(q_stage + QkSwizzle::element(query, col, STREAMED_ROWS)));
            });
        __syncthreads();
        zero_non_finite_shared_tile<kStreamedHeadBytes, kThreads>(q_stage);
        fence_shared_for_async_proxy();
        __syncthreads();
    }
}

extern "C" __global__ void __launch_bounds__(kThreads, 1) attention_backward_dkdv_wgmma(
    const bits16* q, const bits16* k, const bits16* v, const bits16* d_out, const float* lse,
    const float* delta, bits16* dk, bits16* dv, float* dq_sum, int* key_flags,
    const double* alibi_slopes, i64 n_q_total, i64 n_k_total,
    int n_q_heads, int group_size, i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh,
    i64 k_sn, i64 v_sb, i64 v_sh, i64 v_sn, i64 do_sb, i64 do_sh, i64 do_sn,
    SCORE_OPTION_PARAMS, SEQUENCE_PARAMETERS, i64 dk_sb, i64 dk_sh, i64 dk_sn, i64 dv_sb,
    i64 dv_sh, i64 dv_sn) {
    static_assert(!(STRIDED_OUT && (SINGLE_PASS || GROUP_SPLITS > 1)),
                  "cut groups and the single pass write contiguous gradients");
    extern __shared__ __align__(128) unsigned char shared_bytes[];
    const u32 k_tile = (shared_address(shared_bytes) + kTileAlignment - 1) &
                       ~static_cast<u32>(kTileAlignment - 1);
    const u32 v_tile = k_tile + kOwnedHeadBytes;
    // [STAGES] swizzled Q tiles; the dV-only part holds no V tile.
    const u32 q_tiles = v_tile + (kComputesDk ? kOwnedValueBytes : 0);
    const u32 do_tiles = q_tiles + STAGES * kStreamedHeadBytes;  // [STAGES] swizzled dO tiles
    const u32 stats = do_tiles + STAGES * kStreamedValueBytes;
    // lse and D of each streamed query tile, [STAGES][STREAMED_ROWS] floats each.
    float* lse_tiles = reinterpret_cast<float*>(shared_bytes + (stats - shared_address(shared_bytes)));
    float* delta_tiles = lse_tiles + STAGES * STREAMED_ROWS;
    // SINGLE_PASS: dS^T of the current query tile, [OWNED_ROWS][64] swizzled, after the
    // lse and D stages, aligned to the swizzle's period.
    const u32 ds_tile = (stats + 8 * STAGES * STREAMED_ROWS + kTileAlignment - 1) &
                        ~static_cast<u32>(kTileAlignment - 1);
    unsigned char* ds_bytes = shared_bytes + (ds_tile - shared_address(shared_bytes));
    // SINGLE_PASS: each warpgroup's dQ staging block, after dS^T.
    const u32 staged =
        ds_tile + OWNED_ROWS * kSwizzleRowBytes + (threadIdx.x / 128) * kStagedBytes;
    unsigned char* staged_bytes = shared_bytes + (staged - shared_address(shared_bytes));

    const SequenceTables tables = SEQUENCE_TABLES;
    const int n_kv_heads = n_q_heads / group_size;
    const KeyBlock owned =
        key_block(OWNED_ROWS, n_q_total, n_k_total, band_offset, n_kv_heads, tables);
    const i64 n_q = owned.n_q, n_k = owned.n_k;
    const Band band{owned.band_offset, window_left, window_right};
    const i64 col_start = owned.key_start;
    const i64 col_stop = min(col_start + OWNED_ROWS, n_k);
    const int warpgroup = threadIdx.x / 128, lane = threadIdx.x % 32;
    const i64 warp_key0 = col_start + warpgroup * 64 + ((threadIdx.x / 32) % 4) * 16;
    const i64 my_keys[2] = {warp_key0 + lane / 4, warp_key0 + lane / 4 + 8};
    const auto dk_head = key_output_rows<HEAD_DIM>(dk, owned, n_k_total, {dk_sb, dk_sh, dk_sn});
    const auto dv_head = key_output_rows<VALUE_DIM>(dv, owned, n_k_total, {dv_sb, dv_sh, dv_sn});

    // The part's accumulators (the other part's are never touched: no registers).
    float dk_acc[kHeadWidth / 8][4], dv_acc[kValueWidth / 8][4];
    if (kComputesDk) clear(dk_acc);
    if (kComputesDv) clear(dv_acc);
    i64 tile_begin, tile_end;
    query_tile_range<LIMIT_LEFT, LIMIT_RIGHT>(band, col_start, col_stop, n_q, STREAMED_ROWS,
                                              &tile_begin, &tile_end);
    if (tile_begin == tile_end) {  // no query keeps these keys: dk = dv = 0
        if (kComputesDk) store_rows<HEAD_DIM>(dk_acc, 0.0f, dk_head, warp_key0, n_k);
        if (kComputesDv) store_rows<VALUE_DIM>(dv_acc, 0.0f, dv_head, warp_key0, n_k);
        if (FLAG_NON_FINITE_KEYS && kComputesDk && threadIdx.x == 0) key_flags[blockIdx.x] = 0;
        return;
    }

    const int kv_head = owned.kv_head / GROUP_SPLITS;  // of k and v
    load_swizzled_tile_async<OWNED_ROWS, HEAD_DIM, kHeadWidth, kThreads, COPY_BYTES>(
        k_tile, k + owned.batch * k_sb + kv_head * k_sh + owned.key_base * k_sn, k_sn,
        col_start, n_k);
    if (kComputesDk)
        load_swizzled_tile_async<OWNED_ROWS, VALUE_DIM, kValueWidth, kThreads, COPY_BYTES>(
            v_tile, v + owned.batch * v_sb + kv_head * v_sh + owned.key_base * v_sn, v_sn,
            col_start, n_k);
    commit_copies();
    // This warpgroup's 64 keys of the owned tiles.
    const u32 k_rows = k_tile + warpgroup * 64 * QkSwizzle::kRowBytes;
    const u32 v_rows = v_tile + warpgroup * 64 * VSwizzle::kRowBytes;

    for (int member = 0; member < group_size; ++member) {
        const int head = owned.kv_head * group_size + member;
        const i64 bh = owned.index * n_q_heads + head;  // dropout and ALiBi
        const i64 array_head = owned.batch * n_q_heads + head;  // q, dO, lse, D
        const Scores scores = make_scores(scale, softcap, alibi_slopes, bh, band, dropout_key,
                                          dropout_threshold, dropout_scale,
                                      dropout_row0, dropout_col0);
        const bits16* q_head = q + owned.batch * q_sb + head * q_sh + owned.row_base * q_sn;
        const bits16* do_head =
            d_out + owned.batch * do_sb + head * do_sh + owned.row_base * do_sn;
        const i64 head_row0 = array_head * n_q_total + owned.row_base;  // in lse and D
        const auto load_queries = [&](int stage, i64 query_tile) {
            const i64 start = query_tile * STREAMED_ROWS;
            load_swizzled_tile_async<STREAMED_ROWS, HEAD_DIM, kHeadWidth, kThreads, COPY_BYTES>(
                q_tiles + stage * kStreamedHeadBytes, q_head, q_sn, start, n_q);
            load_swizzled_tile_async<STREAMED_ROWS, VALUE_DIM, kValueWidth, kThreads, COPY_BYTES>(
                do_tiles + stage * kStreamedValueBytes, do_head, do_sn, start, n_q);
            for (int i = threadIdx.x; i < 2 * STREAMED_ROWS; i += kThreads) {
                const int r = i % STREAMED_ROWS;
                const bool valid = start + r < n_q;
                const float* source = (i < STREAMED_ROWS ? lse : delta) + head_row0 +
                                      (valid ? start + r : 0);
                float* destination = (i < STREAMED_ROWS ? lse_tiles : delta_tiles) +
                                     stage * STREAMED_ROWS + r;
                copy_4_async(shared_address(destination), source, valid);
            }
        };
        stream_tiles(tile_begin, tile_end, load_queries, [&](int stage, i64 query_tile) {
            const u32 q_stage = q_tiles + stage * kStreamedHeadBytes;
            const u32 do_stage = do_tiles + stage * kStreamedValueBytes;
            const i64 query_start = query_tile * STREAMED_ROWS;
            // Keys past n_k are not written: they need no mask.
            const bool masked =
                tile_straddles_band(band, query_start, STREAMED_ROWS, col_start, OWNED_ROWS);
            // A cut tile (block-uniform) whose dO or Q holds inf or NaN: scanned here, before
            // the score products, where few registers are live (scanned after the packing,
            // ptxas spilled 140 bytes in the every-option D = 64 kernel's score loop; here 84).
            const bool non_finite =
                kBandMasksKeys && masked &&
                __syncthreads_or(
                    (kComputesDk &&
                     shared_tile_has_non_finite<kStreamedHeadBytes, kThreads>(q_stage)) ||
                    (kComputesDv &&
                     shared_tile_has_non_finite<kStreamedValueBytes, kThreads>(do_stage)));
            // S^T and dP^T: rows are this warpgroup's keys, columns the tile's queries.
            float st[kScoreFrags][4], dpt[kScoreFrags][4];
            if (kComputesDk)
                score_products(k_rows, q_stage, v_rows, do_stage, st, dpt);
            else
                score_product(k_rows, q_stage, st);
            transposed_probabilities<kScoreFrags, SINGLE_PASS, false>(
                scores, st, dpt, lse_tiles + stage * STREAMED_ROWS,
                delta_tiles + stage * STREAMED_ROWS, query_start, my_keys, col_start, n_q, n_k,
                masked, tile_mask<LIMIT_LEFT, LIMIT_RIGHT>(band, query_start, col_start, n_k));
            u32 pt[STREAMED_ROWS / 16][4], dst[STREAMED_ROWS / 16][4];
            if (kComputesDv) pack_fragments(st, pt);
            if (kComputesDk) pack_fragments(dpt, dst);
            // There: the kept pairs' P^T dO and dS^T Q terms with those elements on CUDA cores
            // from the packed fragments, then zeros for the tensor cores, as in the dQ kernel;
            // keys are the rows here, queries the inner index. Each operand's scan there again
            // (its barrier orders every warpgroup's score products before the zeroing).
            if (non_finite)
                add_and_zero_non_finite_queries(pt, dst, dv_acc, dk_acc, q_stage, do_stage,
                                                tile_mask<LIMIT_LEFT, LIMIT_RIGHT>(
                                                    band, opaque(query_start), col_start, n_k),
                                                my_keys, col_start);
            // SINGLE_PASS: dS^T to shared memory for this warpgroup's share of dQ.
            if (SINGLE_PASS) {
                store_transposed_ds(dpt, ds_bytes, warp_key0 - col_start);
                fence_shared_for_async_proxy();
                bulk_wait_read<0>();  // the last tile's staged dQ rows are read: reusable
                // Its own keys' rows of dS^T, or every warpgroup's.
                if (kSplitKeys) warpgroup_sync(); else __syncthreads();
            }
            const int dq_block = kSplitKeys ? 0 : warpgroup;
            const int dq_key0 = kSplitKeys ? warpgroup * 64 : 0;
            float dq_part[kSwizzleColumns / 8][4];
            wgmma_fence();
            if (kComputesDv) issue_accumulate<kValueWidth>(dv_acc, pt, do_stage);
            if (kComputesDk) issue_accumulate<kHeadWidth>(dk_acc, dst, q_stage);
            if (SINGLE_PASS)
                issue_dq_product(dq_part, ds_tile + dq_key0 * kSwizzleRowBytes,
                                 k_tile + (dq_block * OWNED_ROWS + dq_key0) * kSwizzleRowBytes);
            wgmma_commit();
            wgmma_wait<0>();
            if (kComputesDv) wgmma_pin(dv_acc);
            if (kComputesDk) wgmma_pin(dk_acc);
            if (SINGLE_PASS) {
                wgmma_pin(dq_part);
                stage_dq_part(dq_part, staged_bytes);
                fence_shared_for_async_proxy();
                warpgroup_sync();
                if (threadIdx.x % 128 == 0) {
                    bulk_reduce_add(dq_sum_block(dq_sum, array_head, query_tile, n_q) +
                                        dq_block * 64 * kSwizzleColumns,
                                    staged, kStagedBytes);
                    bulk_commit();
                }
            }
        });
    }
    if (SINGLE_PASS) bulk_wait<0>();  // the staging blocks outlive their reductions
    if (kComputesDk) store_rows<HEAD_DIM>(dk_acc, scale, dk_head, warp_key0, n_k);
    if (kComputesDv) store_rows<VALUE_DIM>(dv_acc, 1.0f, dv_head, warp_key0, n_k);
    // The owned tiles are still in shared memory (zeros past n_k and past the head dims).
    if (FLAG_NON_FINITE_KEYS && kComputesDk)
        flag_non_finite_keys(key_flags,
                             shared_tile_has_non_finite<kOwnedHeadBytes, kThreads>(k_tile) ||
                                 shared_tile_has_non_finite<kOwnedValueBytes, kThreads>(v_tile));
}
