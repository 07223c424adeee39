// Hopper tensor-core forward (sm_90a) for float16 / bfloat16, any D and Dv up to 256.
//
// The FlashAttention-2 forward of attention_mma_forward.cu moved onto warpgroup matrix
// instructions (the FlashAttention-3 paper's first ingredient):
// * one block per (batch, head, BLOCK_Q query rows); each warpgroup (4 warps, 128
//   threads) owns 64 query rows, the M of wgmma.m64nNk16;
// * S = Q K^T is one chain of HEAD_DIM / 16 wgmma with N = BLOCK_K, both operands read
//   by the tensor cores straight from shared memory through descriptors: no ldmatrix,
//   so the issuing warps' shared-memory bandwidth no longer bounds the loop (it did for
//   mma.sync at 16 rows per warp, bench/NOTES-gpu.md v3);
// * the online softmax runs on the accumulators exactly as in the mma.sync kernel (the
//   per-warp register layout is the same; forward_softmax.cuh), and P, rounded to the
//   input type, is the register A operand of O += P V, with V read MN-major (transposed)
//   from shared memory;
// * tiles are stored with the hardware's swizzle (wgmma.cuh), K/V in STAGES buffers filled
//   by cp.async: one barrier per key tile, after which tile t + STAGES - 1 is issued into
//   the buffer that tile t - 1 has just released;
// * head dims that are not a multiple of 16 are zero-padded to one in shared memory (the
//   caller's arrays are read in place, in copies of COPY_BYTES where rows are not 16-byte
//   aligned): the padding adds nothing to Q K^T, and O's padding columns are not stored;
// * key tiles outside the band are never visited, the per-score mask runs only on tiles
//   that straddle the band edge or the end of the keys;
// * OVERLAP=1 (tiles.WgmmaTiles.overlap; no table row takes it yet) runs
//   FlashAttention-3's intra-warpgroup overlap: tile t's S and tile t - 1's P V are issued
//   together and tile t's softmax runs while P V does, which needs a third stage.
//
// Compile-time configuration (NVRTC -D options): IS_BFLOAT16, HEAD_DIM and VALUE_DIM (D and
// Dv, up to 256), COPY_BYTES (16, 8 or 4), BLOCK_Q (a multiple of 64), BLOCK_K (a multiple
// of 16 up to 256), STAGES (>= 2), BLOCKS_PER_SM (the residency the registers
// are capped for: 2 lets a second block's main loop cover one block's prologue and
// epilogue, which short sequences pay per block), OVERLAP (0/1, above; a tile must not
// spill there: its accumulators are written while other code runs), LIMIT_LEFT,
// LIMIT_RIGHT, SOFTCAP, ALIBI, DROPOUT, VARLEN and PAGED (sequences.cuh: variable-length and
// paged calls). Needs -arch=sm_90a.
#include "wgmma.cuh"
#include "forward_softmax.cuh"

constexpr int kWarpgroups = BLOCK_Q / 64;
constexpr int kThreads = kWarpgroups * 128;
constexpr int kHeadWidth = padded_width(HEAD_DIM, 16);    // Q and K tile columns
constexpr int kValueWidth = padded_width(VALUE_DIM, 16);  // V tile and O columns
using QkSwizzle = Swizzled<kHeadWidth>;
using VSwizzle = Swizzled<kValueWidth>;
constexpr int kKeyFrags = BLOCK_K / 8;       // n8 fragments of S per warp
constexpr int kOutFrags = kValueWidth / 8;   // n8 fragments of O per warp
constexpr int kQTileBytes = kSwizzledTileBytes<BLOCK_Q, kHeadWidth>;
constexpr int kKTileBytes = kSwizzledTileBytes<BLOCK_K, kHeadWidth>;
constexpr int kVTileBytes = kSwizzledTileBytes<BLOCK_K, kValueWidth>;
static_assert(BLOCK_Q % 64 == 0 && STAGES >= 2 && BLOCK_K % 16 == 0 && BLOCK_K <= 256,
              "wgmma tiles");
#ifndef OVERLAP
#define OVERLAP 0
#endif
// Whether a warpgroup skips the key tiles its own rows do not reach: under a band, and not
// under the 128-register cap of 512 threads per multiprocessor (see the kernel); not in the
// overlapped schedule, whose steps each warpgroup runs in the same order.
constexpr bool kWarpgroupSkips = !OVERLAP && kWarpgroups > 1 && kWarpgroups * BLOCKS_PER_SM < 4 &&
                                 (LIMIT_LEFT || LIMIT_RIGHT);
// Key tiles in flight ahead of the one computed: the overlapped schedule reads two tiles at
// once, so it keeps one buffer more than the plain one for them.
constexpr int kAhead = OVERLAP ? STAGES - 2 : STAGES - 1;
static_assert(kAhead >= 1, "the overlapped schedule needs three stages");

// Keys [row, row + BLOCK_K) of K and V into one stage's tiles (zeros past n_k).
template <class KSource, class VSource>
__device__ __forceinline__ void load_key_tiles(u32 k_tile, u32 v_tile, const KSource& k_rows,
                                               const VSource& v_rows, i64 row, i64 n_k) {
    load_swizzled_rows_async<BLOCK_K, HEAD_DIM, kHeadWidth, kThreads, COPY_BYTES>(
        k_tile, k_rows, row, n_k);
    load_swizzled_rows_async<BLOCK_K, VALUE_DIM, kValueWidth, kThreads, COPY_BYTES>(
        v_tile, v_rows, row, n_k);
}

#if PAGED
using KCopies = SwizzledCopies<BLOCK_K, kHeadWidth, kThreads>;
using VCopies = SwizzledCopies<BLOCK_K, kValueWidth, kThreads>;

#ifndef PAGES_HOLD_TILES
#define PAGES_HOLD_TILES 0
#endif

// The K and V rows this thread copies of one key tile, their block-table entries read a
// tile before the copies that use them (sequences.cuh, PagedCopyRows). Where every page
// holds whole key tiles (PAGES_HOLD_TILES: a power of two of at least BLOCK_K rows, such as
// the 64 and 256 servers use; the launcher says so at compile time) a tile is one strided
// run from one entry, copied as a contiguous tile is. Otherwise each copy has its row's
// entry, and page sizes that are powers of two run separate code from the others, chosen
// by one uniform test a tile.
struct KeyTilePages {
    static constexpr bool kPagesHoldTiles = PAGES_HOLD_TILES;
    const KeyRows<bits16> k_rows, v_rows;
    i64 k[KCopies::kSteps];  // with kPagesHoldTiles, the tile's one entry in k[0]
    i64 v[VCopies::kSteps];  // where D and Dv differ in width; else V's rows are K's
    __device__ __forceinline__ bool power_of_two() const { return k_rows.page_shift >= 0; }
    __device__ __forceinline__ void fetch(i64 row, i64 n_k) {
        if constexpr (kPagesHoldTiles) {
            k[0] = row < n_k ? k_rows.table[row >> k_rows.page_shift] : 0;
        } else {
            if (power_of_two()) fetch_as<true>(row, n_k);
            else fetch_as<false>(row, n_k);
        }
    }
    template <bool kPowerOfTwo> __device__ __forceinline__ void fetch_as(i64 row, i64 n_k) {
        k_rows.template fetch_entries<KCopies, kPowerOfTwo>(row, n_k, k);
        if constexpr (kHeadWidth != kValueWidth)  // other rows (one block table for both)
            k_rows.template fetch_entries<VCopies, kPowerOfTwo>(row, n_k, v);
    }
    __device__ __forceinline__ void load(u32 k_tile, u32 v_tile, i64 row, i64 n_k) const {
        if constexpr (kPagesHoldTiles) {
            load_in_page(k_tile, v_tile, row, n_k);
        } else {
            if (power_of_two()) load_as<true>(k_tile, v_tile, row, n_k);
            else load_as<false>(k_tile, v_tile, row, n_k);
        }
    }
    // The tile's rows run from its first row's slot of one page: strided rows, which the
    // copies address as a contiguous tile's (row 0 is the tile's first).
    __device__ __forceinline__ void load_in_page(u32 k_tile, u32 v_tile, i64 row,
                                                 i64 n_k) const {
        const i64 slot = row & (k_rows.page_size - 1);
        const i64 page = k_rows.clamped(k[0]);
        const StridedRows<bits16> k_run{
            k_rows.pool + page * k_rows.page_stride + slot * k_rows.slot_stride,
            k_rows.slot_stride};
        const StridedRows<bits16> v_run{
            v_rows.pool + page * v_rows.page_stride + slot * v_rows.slot_stride,
            v_rows.slot_stride};
        load_key_tiles(k_tile, v_tile, k_run, v_run, 0, n_k - row);
    }
    template <bool kPowerOfTwo>
    __device__ __forceinline__ void load_as(u32 k_tile, u32 v_tile, i64 row, i64 n_k) const {
        PagedCopyRows<bits16, KCopies::kSteps, kPowerOfTwo> k_copies{k_rows, {}};
        PagedCopyRows<bits16, VCopies::kSteps, kPowerOfTwo> v_copies{v_rows, {}};
#pragma unroll
        for (int step = 0; step < KCopies::kSteps; ++step)
            k_copies.page[step] = static_cast<u32>(k_rows.clamped(k[step]));
#pragma unroll
        for (int step = 0; step < VCopies::kSteps; ++step)
            v_copies.page[step] = kHeadWidth == kValueWidth
                                      ? k_copies.page[step]
                                      : static_cast<u32>(k_rows.clamped(v[step]));
        load_key_tiles(k_tile, v_tile, k_copies, v_copies, row, n_k);
    }
};
#endif

extern "C" __global__ void __launch_bounds__(kThreads, BLOCKS_PER_SM) attention_forward_wgmma(
    const bits16* q, const bits16* k, const bits16* v, bits16* o, float* lse,
    const double* alibi_slopes, i64 n_q_total, i64 n_k_total, int n_q_heads, int group_size, i64 q_sb,
    i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn, i64 v_sb, i64 v_sh, i64 v_sn,
    i64 o_sb, i64 o_sh, i64 o_sn,
    float scale, float softcap, i64 band_shift, i64 window_left, i64 window_right,
    u32 dropout_key, u32 dropout_threshold, float dropout_scale, u32 dropout_row0,
    u32 dropout_col0, SEQUENCE_PARAMETERS) {
    // The swizzle pattern repeats every 1024 bytes of address: align the tiles to it (the
    // launch asks for 1024 bytes of slack).
    extern __shared__ __align__(128) unsigned char shared_bytes[];
    const u32 q_tile = (shared_address(shared_bytes) + kTileAlignment - 1) &
                       ~static_cast<u32>(kTileAlignment - 1);
    const u32 k_tiles = q_tile + kQTileBytes;               // [STAGES] swizzled K tiles
    const u32 v_tiles = k_tiles + STAGES * kKTileBytes;     // [STAGES] swizzled V tiles

    const SequenceTables tables = SEQUENCE_TABLES;
    const QueryBlock owned =
        query_block(BLOCK_Q, n_q_total, n_k_total, band_shift, n_q_heads, group_size, tables);
    if (tile_past_rows(owned)) return;
    const i64 bh = owned.bh, n_q = owned.n_q, n_k = owned.n_k;
    const Band band{owned.band_offset, window_left, window_right};
    const bits16* q_head = q + owned.batch * q_sb + owned.head * q_sh + owned.row_base * q_sn;
    const KeyRows<bits16> k_head = key_rows(k, owned.batch, owned.kv_head, k_sb, k_sh, k_sn,
                                            owned.key_base, tables);
    const KeyRows<bits16> v_head = key_rows(v, owned.batch, owned.kv_head, v_sb, v_sh, v_sn,
                                            owned.key_base, tables);
    const i64 row_start = owned.row_start;
    const i64 row_stop = min(row_start + BLOCK_Q, n_q);
    const ForwardScores scores =
        make_forward_scores(scale, softcap, alibi_slopes, bh, band, n_k);

    const int warpgroup = threadIdx.x / 128;
    const int lane = threadIdx.x % 32;
    // This thread's two rows of the warpgroup's 64 (warp w of the group owns 16 w ..).
    i64 my_rows[1][2];
    my_rows[0][0] = row_start + warpgroup * 64 + ((threadIdx.x / 32) % 4) * 16 + lane / 4;
    my_rows[0][1] = my_rows[0][0] + 8;

    i64 tile_begin, tile_end;
    key_tile_range<LIMIT_LEFT, LIMIT_RIGHT>(band, row_start, row_stop, n_k, BLOCK_K,
                                            &tile_begin, &tile_end);
    split_key_tiles(&tile_begin, &tile_end);
    if (tile_begin == tile_end) {  // no row of this tile keeps any key (in this share)
        store_empty_rows<VALUE_DIM, kThreads>(
            output_rows<VALUE_DIM>(o, owned, n_q_total, {o_sb, o_sh, o_sn}),
            sequence_rows<1>(lse, owned, n_q_total), row_start, row_stop);
        return;
    }

    // Prologue: Q with key tile 0 in one copy group, then tiles 1 .. kAhead - 1, one group
    // each (empty groups past the end keep the group count uniform for wait_copies).
    load_swizzled_tile_async<BLOCK_Q, HEAD_DIM, kHeadWidth, kThreads, COPY_BYTES>(
        q_tile, q_head, q_sn, row_start, n_q);
#pragma unroll
    for (int stage = 0; stage < kAhead; ++stage) {
        const i64 key_tile = tile_begin + stage;
        if (key_tile < tile_end) {
#if PAGED
            KeyTilePages pages{k_head, v_head, {}, {}};
            pages.fetch(key_tile * BLOCK_K, n_k);
            pages.load(k_tiles + stage * kKTileBytes, v_tiles + stage * kVTileBytes,
                       key_tile * BLOCK_K, n_k);
#else
            load_key_tiles(k_tiles + stage * kKTileBytes, v_tiles + stage * kVTileBytes,
                           k_head, v_head, key_tile * BLOCK_K, n_k);
#endif
        }
        commit_copies();
    }
#if PAGED
    // The pages of the first tile the loop issues; each issue reads the next tile's.
    KeyTilePages ahead_pages{k_head, v_head, {}, {}};
    ahead_pages.fetch((tile_begin + kAhead) * BLOCK_K, n_k);
#endif

    // Under a band, the steps [wg_first, wg_stop) of the block's key tiles that this
    // warpgroup's own 64 rows reach. The others are fully masked for it (the first
    // warpgroup's share of a causal diagonal's last key tile); it skips their products and
    // softmax and keeps only the barrier and its share of the copies, leaving the tensor
    // cores to the other warpgroups. Not where 512 threads share a multiprocessor (two
    // blocks of 128 rows, or 256-row blocks): under that 128-register cap the step bounds
    // cost spills (ptxas, D = 128 causal: 68 bytes instead of 28) and the N = 1k causal
    // forward lost 3-7 %, where 192 x 128 tiles at N = 2k gained 3-7 % (bench/NOTES-gpu.md,
    // v13). That was before v13b's tile copies freed registers (the bounds now cost 0 -> 12
    // bytes there): worth measuring again.
    int wg_first = 0, wg_stop = static_cast<int>(tile_end - tile_begin);
    if (kWarpgroupSkips) {
        const i64 wg_row_start = row_start + warpgroup * 64;
        if (wg_row_start >= row_stop) {  // all rows past the end (a head's last tile)
            wg_stop = 0;
        } else {
            i64 first, stop;
            band_key_range<LIMIT_LEFT, LIMIT_RIGHT>(band, wg_row_start,
                                                    min(wg_row_start + 64, row_stop), n_k,
                                                    &first, &stop);
            if (LIMIT_LEFT) wg_first = static_cast<int>(first / BLOCK_K - tile_begin);
            if (LIMIT_RIGHT)
                wg_stop = static_cast<int>((stop + BLOCK_K - 1) / BLOCK_K - tile_begin);
        }
    }

    float o_acc[1][kOutFrags][4], row_max[1][2], row_sum[1][2];
    start_online_softmax(o_acc, row_max, row_sum);
    u32 row_states[1][2];
    dropout_row_states(row_states, dropout_key, bh, my_rows, dropout_row0);
    // Q's rows of this warpgroup: 64 rows into every column block.
    const u32 q_rows = q_tile + warpgroup * 64 * QkSwizzle::kRowBytes;

    // The steps of a key tile, which both schedules below run in their own order.
    // Tile t has landed (this thread's copies), is visible to the tensor cores, and every
    // warpgroup is done with the tile whose buffer the next issue refills.
    auto wait_for_tile = [&]() {
        wait_copies<kAhead - 1>();
        fence_shared_for_async_proxy();
        __syncthreads();
    };
    // Tile `key_tile + kAhead` into the buffer its step comes to.
    auto issue_ahead = [&](i64 key_tile, int step) {
        const i64 ahead = key_tile + kAhead;
        const int ahead_stage = (step + kAhead) % STAGES;
        if (ahead < tile_end) {
#if PAGED
            ahead_pages.load(k_tiles + ahead_stage * kKTileBytes,
                             v_tiles + ahead_stage * kVTileBytes, ahead * BLOCK_K, n_k);
            ahead_pages.fetch((ahead + 1) * BLOCK_K, n_k);
#else
            load_key_tiles(k_tiles + ahead_stage * kKTileBytes,
                           v_tiles + ahead_stage * kVTileBytes, k_head, v_head,
                           ahead * BLOCK_K, n_k);
#endif
        }
        commit_copies();
    };
    // A cut tile (key_tile_needs_mask is block-uniform) is scanned for a non-finite V by
    // every warpgroup, skipping ones included, since the barriers count all threads
    // (kept_products.cuh).
    auto has_non_finite_values = [&](i64 key_tile, u32 v_tile) {
        return kBandMasksKeys &&
               key_tile_needs_mask(scores, row_start, BLOCK_Q, key_tile * BLOCK_K, BLOCK_K) &&
               __syncthreads_or(shared_tile_has_non_finite<kVTileBytes, kThreads>(v_tile));
    };
    // The zeroing's barriers, which a warpgroup that skips the tile keeps too.
    auto zero_non_finite_values = [&](u32 v_tile) {
        __syncthreads();
        zero_non_finite_shared_tile<kVTileBytes, kThreads>(v_tile);
        fence_shared_for_async_proxy();
        __syncthreads();
    };
    // S = Q K^T over the 16-column slices of Q and K, issued and committed (not waited for).
    auto issue_scores = [&](float (&s)[1][kKeyFrags][4], u32 k_tile) {
#pragma unroll
        for (int kk = 0; kk < kHeadWidth / 16; ++kk)
            wgmma_ss<BLOCK_K>(s[0],
                              k_major_descriptor<kHeadWidth>(q_rows + QkSwizzle::slice(kk, BLOCK_Q)),
                              k_major_descriptor<kHeadWidth>(k_tile + QkSwizzle::slice(kk, BLOCK_K)),
                              kk > 0);
        wgmma_commit();
    };
    // Scores -> logits (the mask where the tile needs one) -> unnormalised probabilities,
    // the running max and sums updated; `rescale` the factor O still has to take.
    auto probabilities = [&](float (&s)[1][kKeyFrags][4], i64 key_tile,
                             float (&rescale)[1][2]) {
        const i64 col_start = key_tile * BLOCK_K;
        const bool needs_mask = key_tile_needs_mask(scores, row_start, BLOCK_Q, col_start,
                                                    BLOCK_K);
        scores_to_logits(s, my_rows, col_start, needs_mask,
                         tile_mask<LIMIT_LEFT, LIMIT_RIGHT>(band, row_start, col_start, n_k),
                         scores);
        softmax_probabilities(s, row_max, row_sum, rescale);
    };
    // After O took the factor: dropout, and where V holds inf or NaN on a cut tile the kept
    // pairs' products with it on CUDA cores, then zeros in its place, made visible to the
    // tensor cores' (async proxy) reads. The barriers order every warpgroup's reads before
    // the zeroing and the zeroing before every warpgroup's P V (no wgmma reads V between
    // them: each waited for its last).
    auto finish_probabilities = [&](float (&s)[1][kKeyFrags][4], i64 key_tile, u32 v_tile,
                                    bool v_non_finite) {
        const i64 col_start = key_tile * BLOCK_K;
        if (DROPOUT) drop_probabilities(s, row_states, col_start + dropout_col0, dropout_threshold);
        if (v_non_finite) {
            // The mask again rather than kept live across the softmax (registers).
            add_kept_non_finite_values<kKeyFrags>(
                o_acc,
                KeptKeysOfRows<1>{
                    my_rows, tile_mask<LIMIT_LEFT, LIMIT_RIGHT>(band, row_start, col_start, n_k)},
                HeldFromScores<1, kKeyFrags>{s}, [&](int key, int col) {
                    return element_value(
                        load_shared_bits16(v_tile + VSwizzle::element(key, col, BLOCK_K)));
                });
            zero_non_finite_values(v_tile);
        }
    };
    // O += P V, issued and committed: keys 16 kk .. 16 kk + 15 are rows 16 kk .. of the V
    // tile; V's next column block is BLOCK_K rows further.
    auto issue_values = [&](const u32 (&p)[BLOCK_K / 16][4], u32 v_tile) {
#pragma unroll
        for (int kk = 0; kk < BLOCK_K / 16; ++kk)
            wgmma_rs_transposed_b<kValueWidth>(
                o_acc[0], p[kk],
                mn_major_descriptor<kValueWidth>(v_tile + kk * 16 * VSwizzle::kRowBytes,
                                                 BLOCK_K * VSwizzle::kRowBytes),
                1);
        wgmma_commit();
    };
    auto pack_probabilities = [&](const float (&s)[1][kKeyFrags][4], u32 (&p)[BLOCK_K / 16][4]) {
#pragma unroll
        for (int kk = 0; kk < BLOCK_K / 16; ++kk)
            pack_a_fragment(s[0][2 * kk], s[0][2 * kk + 1], p[kk]);
    };

#if OVERLAP
    // One tile's products overlap the next tile's softmax (FlashAttention-3's intra-
    // warpgroup overlap): step t issues S of tile t and P V of tile t - 1 back to back, waits
    // for S alone, turns it into probabilities while P V runs, then waits for P V and
    // rescales O. Tiles t - 1 and t are read at once, so the copies run kAhead = STAGES - 2
    // tiles ahead into the buffer of tile t - 2.
    float s[1][kKeyFrags][4];
    u32 p[BLOCK_K / 16][4];
    {
        wait_for_tile();
        issue_ahead(tile_begin, 0);
        const u32 k_tile = k_tiles, v_tile = v_tiles;
        const bool v_non_finite = has_non_finite_values(tile_begin, v_tile);
        wgmma_fence();
        issue_scores(s, k_tile);
        wgmma_wait<0>();
        wgmma_pin(s[0]);
        float rescale[1][2];
        probabilities(s, tile_begin, rescale);  // O is 0: no factor to take
        finish_probabilities(s, tile_begin, v_tile, v_non_finite);
    }
    for (i64 key_tile = tile_begin + 1; key_tile < tile_end; ++key_tile) {
        const int step = static_cast<int>(key_tile - tile_begin);
        wait_for_tile();
        issue_ahead(key_tile, step);
        const u32 k_tile = k_tiles + (step % STAGES) * kKTileBytes;
        const u32 v_tile = v_tiles + (step % STAGES) * kVTileBytes;
        const u32 previous_v = v_tiles + ((step - 1) % STAGES) * kVTileBytes;
        const bool v_non_finite = has_non_finite_values(key_tile, v_tile);
        pack_probabilities(s, p);
        wgmma_fence();
        issue_scores(s, k_tile);
        issue_values(p, previous_v);
        wgmma_wait<1>();  // S (groups complete in order)
        wgmma_pin(s[0]);
        float rescale[1][2];
        probabilities(s, key_tile, rescale);
        wgmma_wait<0>();  // P V of the previous tile
        wgmma_pin(o_acc[0]);
        rescale_output(o_acc, rescale);
        finish_probabilities(s, key_tile, v_tile, v_non_finite);
    }
    pack_probabilities(s, p);
    wgmma_fence();
    issue_values(p, v_tiles + ((tile_end - 1 - tile_begin) % STAGES) * kVTileBytes);
    wgmma_wait<0>();
    wgmma_pin(o_acc[0]);
#else
    for (i64 key_tile = tile_begin; key_tile < tile_end; ++key_tile) {
        const int step = static_cast<int>(key_tile - tile_begin);
        wait_for_tile();
        issue_ahead(key_tile, step);
        const int stage = step % STAGES;
        const u32 k_tile = k_tiles + stage * kKTileBytes;
        const u32 v_tile = v_tiles + stage * kVTileBytes;
        const bool v_non_finite = has_non_finite_values(key_tile, v_tile);
        if (kWarpgroupSkips && (step < wg_first || step >= wg_stop)) {  // per warpgroup
            if (v_non_finite) zero_non_finite_values(v_tile);
            continue;
        }

        float s[1][kKeyFrags][4];
        wgmma_fence();
        issue_scores(s, k_tile);
        wgmma_wait<0>();
        wgmma_pin(s[0]);
        float rescale[1][2];
        probabilities(s, key_tile, rescale);
        rescale_output(o_acc, rescale);
        finish_probabilities(s, key_tile, v_tile, v_non_finite);

        u32 p[BLOCK_K / 16][4];
        pack_probabilities(s, p);
        wgmma_fence();
        issue_values(p, v_tile);
        wgmma_wait<0>();
        wgmma_pin(o_acc[0]);
    }
#endif

    store_output_rows<VALUE_DIM>(o_acc, row_max, row_sum, my_rows,
                                 output_rows<VALUE_DIM>(o, owned, n_q_total, {o_sb, o_sh, o_sn}),
                                 sequence_rows<1>(lse, owned, n_q_total), n_q, dropout_scale);
}
