// The single pass's dQ (attention_mma_backward.cu, SINGLE_PASS): the dK/dV kernel, after
// dV and dK for a query tile, keeps that tile's dS in shared memory and its warps add the
// tile's share of dQ, dS K over the block's keys, into float32 sums (red.global.add), in
// arrival order or, with ORDERED, in a fixed order of turns per (head, query tile); or,
// with DQ_PARTS, store it into the key block's own slot of float32 parts, which
// attention_backward_dq_convert sums in the order of the key blocks (deterministic, no
// turns: for few query rows, where the parts are few bytes beside K and V).
//
// Not a standalone header: attention_mma_backward.cu includes it after its products
// (Accumulators, accumulate_split_columns, kWarps, kHeadWidth, kQkPitch, kDqStep, element),
// only when SINGLE_PASS is set; its dQ split needs head dims of 16 or more (8 in float32).
#pragma once

// dQ share of one query tile: warps split it into (STREAMED_ROWS / 16) row slabs x
// kDqShareParts column ranges of whole tensor-core steps; where the steps do not divide
// the head width evenly, the last ranges reach past it (see add_query_tile_dq).
constexpr int kDqShareSlabs = STREAMED_ROWS / 16;
constexpr int kDqShareParts = kWarps / kDqShareSlabs > 0 ? kWarps / kDqShareSlabs : 1;
constexpr int kDqShareColumns =
    (kHeadWidth + kDqShareParts * kDqStep - 1) / (kDqShareParts * kDqStep) * kDqStep;
static_assert(kWarps % kDqShareSlabs == 0, "single-pass dQ split");

#if IS_FLOAT32
// ds_tile: dS of the current query tile, [STREAMED_ROWS][kDsPitch] floats, queries as rows:
// the dQ share's A operand, loaded as the score products load theirs. The pitch is 8 more
// than the keys, as the other float32 tiles' (tf32.cuh's 64-bit loads conflict-free).
constexpr int kDsPitch = OWNED_ROWS + 8;
typedef float ds_element;

// This warp's 16 key rows of dS^T (accumulators, keys x STREAMED_ROWS queries) into
// ds_tile[query][key].
__device__ __forceinline__ void store_scores_by_query(const Accumulators<STREAMED_ROWS>& dst,
                                                      float* ds_tile, int row0) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int n = 0; n < STREAMED_ROWS / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = row0 + lane / 4 + 8 * (e / 2), query = n * 8 + 2 * (lane % 4) + e % 2;
            ds_tile[query * kDsPitch + key] = dst.tile[n][e];
        }
}

// The value of dS at (query, key) in ds_tile.
__device__ __forceinline__ float stored_score(const float* ds_tile, int query, int key) {
    return ds_tile[query * kDsPitch + key];
}

// This warp's dQ share, [16 rows][kDqShareColumns] accumulators from column0: dS (ds_tile,
// queries as rows) times the owned K tile over its keys; with ZeroNonFiniteK the K
// elements that are inf or NaN enter the tensor cores as 0 (kept_products.cuh).
template <bool ZeroNonFiniteK>
__device__ __forceinline__ void dq_share_product_of(const float* ds_tile, const float* k_tile,
                                                    int slab, int column0,
                                                    Accumulators<kDqShareColumns>& acc) {
    accumulate_split_columns<kDqShareColumns, kHeadWidth, OWNED_ROWS / 8>(
        [&](int step, u32(&big)[4], u32(&small)[4]) {
            load_split_a_fragment<kDsPitch>(ds_tile, slab * 16, step * 8, big, small);
        },
        [](float element) {
            return ZeroNonFiniteK && bits_non_finite(element) ? 0.0f : element;
        },
        k_tile, column0, acc);
}

// The test on each K element in the products' loop costs as much as the split of it, and
// a non-finite K is rare: two instantiations, chosen once a tile.
__device__ __forceinline__ void dq_share_product(const float* ds_tile, const float* k_tile,
                                                 int slab, int column0, bool zero_non_finite_k,
                                                 Accumulators<kDqShareColumns>& acc) {
    if (zero_non_finite_k)
        dq_share_product_of<true>(ds_tile, k_tile, slab, column0, acc);
    else
        dq_share_product_of<false>(ds_tile, k_tile, slab, column0, acc);
}
#else
// ds_tile: dS^T of the current query tile, [OWNED_ROWS][kDsPitch], keys as rows (read back
// through the transposing ldmatrix).
constexpr int kDsPitch = kTilePitch<STREAMED_ROWS>;  // 16-byte pad
typedef bits16 ds_element;

// This warp's 16 key rows of dS^T (accumulators, keys x STREAMED_ROWS queries), rounded to
// the input type, into ds_tile[key][query].
__device__ __forceinline__ void store_scores_by_key(const Accumulators<STREAMED_ROWS>& dst,
                                                    bits16* ds_tile, int row0) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int n = 0; n < STREAMED_ROWS / 8; ++n)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = row0 + lane / 4 + 8 * half, col = n * 8 + 2 * (lane % 4);
            *reinterpret_cast<u32*>(ds_tile + row * kDsPitch + col) =
                pack_pair(dst.tile[n][2 * half], dst.tile[n][2 * half + 1]);
        }
}

__device__ __forceinline__ float stored_score(const bits16* ds_tile, int query, int key) {
    return element_value(ds_tile[key * kDsPitch + query]);
}

// As the float32 dq_share_product; A = dS from ds_tile (stored keys x queries, hence the
// transposing ldmatrix), B = the K tile, non-finite K halves made 0 in registers. One body
// with a run-time flag, not two instantiations: ptxas spilled 4-32 bytes more with two
// (bench/NOTES-gpu.md, v17).
__device__ __forceinline__ void dq_share_product(const bits16* ds_tile, const bits16* k_tile,
                                                 int slab, int column0, bool zero_non_finite_k,
                                                 Accumulators<kDqShareColumns>& acc) {
#pragma unroll
    for (int kk = 0; kk < OWNED_ROWS / 16; ++kk) {
        u32 a[4];
        load_a_fragment_transposed<STREAMED_ROWS>(ds_tile, slab * 16, kk * 16, a);
#pragma unroll
        for (int dn = 0; dn < kDqShareColumns / 16; ++dn) {
            u32 b[4];
            load_b_fragments_transposed<kHeadWidth>(k_tile, kk * 16, column0 + dn * 16, b);
            if (zero_non_finite_k)
#pragma unroll
                for (int i = 0; i < 4; ++i) b[i] = zero_non_finite_pair(b[i]);
            mma_16x8x16(acc.tile[2 * dn], a, b[0], b[1]);
            mma_16x8x16(acc.tile[2 * dn + 1], a, b[2], b[3]);
        }
    }
}
#endif

// This warp's dS rows of the query tile (its dK half's dS^T accumulators) into ds_tile.
__device__ __forceinline__ void store_scores(const Accumulators<STREAMED_ROWS>& dst,
                                             ds_element* ds_tile, int row0) {
#if IS_FLOAT32
    store_scores_by_query(dst, ds_tile, row0);
#else
    store_scores_by_key(dst, ds_tile, row0);
#endif
}

// dq_head[query_start + r][c] += sum over this block's keys of dS[r][key] K[key][c], each
// warp one 16-row slab x kDqShareColumns columns (dq_share_product). Rows past n_q and
// columns past HEAD_DIM (a multiple of the step here) are not added: a range that reaches
// past the head width reads the next K row's elements there (or the V tile's, after the
// last), whose products land in those columns only; a range wholly past it is skipped.
// k_non_finite (block-uniform: a tile the band cuts, whose owned K holds inf or NaN): the
// K elements that are not finite enter the products as 0, so a masked dS = 0 meets 0, not
// 0 x NaN, and the kept pairs' terms with them are added on CUDA cores from ds_tile and the
// K tile (kept_products.cuh; `mask`'s rows are the tile's queries, its columns the owned
// keys). The owned K tile itself stays as it is: every later query tile's S^T reads it.
// This warp's part of a query tile's dQ share: a 16-row slab and the column range from
// column0; a range wholly past the head width holds nothing.
struct DqShareWarp {
    int slab, column0;
    __device__ __forceinline__ bool holds() const { return column0 < HEAD_DIM; }
};

__device__ __forceinline__ DqShareWarp dq_share_warp() {
    const int warp = threadIdx.x / 32;
    return {warp % kDqShareSlabs, (warp / kDqShareSlabs) * kDqShareColumns};
}

// The warp's share of dS K (its part must hold columns), the kept non-finite terms included.
__device__ __forceinline__ void query_tile_dq_share(const ds_element* ds_tile,
                                                    const element* k_tile, DqShareWarp part,
                                                    bool k_non_finite, const TileMask& mask,
                                                    Accumulators<kDqShareColumns>& acc) {
    const int lane = threadIdx.x % 32;
    acc.clear();
    dq_share_product(ds_tile, k_tile, part.slab, part.column0, kBandMasksKeys && k_non_finite,
                     acc);
    if (kBandMasksKeys && k_non_finite) {
        const int row0 = part.slab * 16 + lane / 4, quad_col = lane % 4;
        add_kept_non_finite_values<OWNED_ROWS / 8>(
            acc.tile, [&](int, int half) { return mask.row_window(row0 + 8 * half, 0); },
            [&](int, int n, int half, int odd) {
                return stored_score(ds_tile, row0 + 8 * half, n * 8 + 2 * quad_col + odd);
            },
            [&](int key, int col) {
                return element_value(k_tile[key * kQkPitch + part.column0 + col]);
            });
    }
}

// dq_head's rows of the tile += the warp's share (DQ_PARTS: = it, in the block's own slot),
// rows past n_q and columns past HEAD_DIM left out.
__device__ __forceinline__ void add_dq_share(const Accumulators<kDqShareColumns>& acc,
                                             DqShareWarp part, float* dq_head, i64 query_start,
                                             i64 n_q) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const i64 query = query_start + part.slab * 16 + lane / 4 + 8 * half;
        if (query >= n_q) continue;
        float* row = dq_head + query * HEAD_DIM + part.column0 + 2 * (lane % 4);
#pragma unroll
        for (int n = 0; n < kDqShareColumns / 8; ++n)
            if (part.column0 + n * 8 < HEAD_DIM) {
                if (DQ_PARTS) {
                    row[n * 8] = acc.tile[n][2 * half];
                    row[n * 8 + 1] = acc.tile[n][2 * half + 1];
                } else {
                    add_pair(row + n * 8, acc.tile[n][2 * half], acc.tile[n][2 * half + 1]);
                }
            }
    }
}

__device__ __forceinline__ void add_query_tile_dq(const ds_element* ds_tile,
                                                  const element* k_tile, float* dq_head,
                                                  i64 query_start, i64 n_q, bool k_non_finite,
                                                  const TileMask& mask) {
    const DqShareWarp part = dq_share_warp();
    if (!part.holds()) return;
    Accumulators<kDqShareColumns> acc;
    query_tile_dq_share(ds_tile, k_tile, part, k_non_finite, mask, acc);
    add_dq_share(acc, part, dq_head, query_start, n_q);
}

// ORDERED: the key blocks that visit a query tile add their shares to it in ascending
// order of their index, here the turn (rank) of key block `block` (within its head) on
// query tile `tile`. Blocks take their grid index from a ticket as they start
// (ordered_block_index), so a block only ever waits on blocks that run already or have
// finished, whatever order the hardware dispatches them in: no deadlock. Every block walks
// its query tiles in the same direction (ascending without a band; descending under one,
// from its last tile, which under a causal band all of a head's blocks share), so blocks
// that start together reach a tile together and each trails the one before it by a turn
// (its additions and a fence), not by whole tiles.
__device__ __forceinline__ int dq_turn_rank(const Band& band, i64 tile, i64 block, i64 n_q,
                                            i64 n_k) {
    if (!LIMIT_LEFT && !LIMIT_RIGHT) return static_cast<int>(block);
    i64 key_first, key_stop;
    band_key_range<LIMIT_LEFT, LIMIT_RIGHT>(band, tile * STREAMED_ROWS,
                                            min((tile + 1) * STREAMED_ROWS, n_q), n_k,
                                            &key_first, &key_stop);
    return static_cast<int>(block - key_first / OWNED_ROWS);
}

// ORDERED: this block's grid index, from a counter the launcher zeroes (`ticket`), in the
// order in which the blocks start.
__device__ __forceinline__ i64 ordered_block_index(int* ticket) {
    __shared__ int index;
    if (threadIdx.x == 0) index = atomicAdd(ticket, 1);
    __syncthreads();
    return index;
}

__device__ __forceinline__ void wait_for_turn(const int* turn, int rank) {
    if (threadIdx.x == 0) {
        int current;
        while (true) {
            asm volatile("ld.acquire.gpu.global.b32 %0, [%1];"
                         : "=r"(current)
                         : "l"(turn)
                         : "memory");
            if (current == rank) break;
            __nanosleep(64);
        }
    }
    __syncthreads();
}

// After this block's additions: every warp's are ordered before the counter moves on by
// the barrier and thread 0's fence (the other warps go on meanwhile).
__device__ __forceinline__ void pass_turn(int* turn) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(turn, 1);
    }
}

// ORDERED: add_query_tile_dq in this block's turn; the share is multiplied out before the
// wait, so a turn holds only the additions.
__device__ __forceinline__ void add_query_tile_dq_in_turn(const ds_element* ds_tile,
                                                          const element* k_tile, float* dq_head,
                                                          i64 query_start, i64 n_q,
                                                          bool k_non_finite,
                                                          const TileMask& mask, int* turn,
                                                          int rank) {
    const DqShareWarp part = dq_share_warp();
    Accumulators<kDqShareColumns> acc;
    if (part.holds()) query_tile_dq_share(ds_tile, k_tile, part, k_non_finite, mask, acc);
    wait_for_turn(turn, rank);
    if (part.holds()) add_dq_share(acc, part, dq_head, query_start, n_q);
    pass_turn(turn);
}
