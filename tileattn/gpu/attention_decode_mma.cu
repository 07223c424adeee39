// Split-KV decode forward on tensor cores: float16 / bfloat16, D and Dv up to 256, sm_80+.
//
// The same work as attention_decode.cu (GQA packing: one block per (batch, kv head, key
// range) owns the ROWS = group * Nq query rows that share the kv head; partials merged by
// attention_decode_merge), with the products on mma.sync instead of CUDA cores. At 8 or
// more packed rows the CUDA cores cannot keep up with HBM (2 * ROWS * (D + Dv) flops per
// key), while one m16n8k16 tile serves up to 16 rows at the cost of 8 rows' worth of
// padding. The layout follows from decoding's shape, few rows and many keys:
// * the block's WARPS x ROW_WARPS warps form ROW_WARPS groups of ROW_TILES m16 tiles of
//   packed rows each; within a group the WARPS warps hold the same rows and split each key
//   tile: warp w of a group takes keys [w * WARP_KEYS, (w + 1) * WARP_KEYS) of every stage
//   and keeps its own online softmax and O accumulators. A tile costs one barrier (the
//   stage handover), not three, and no warp waits for another's softmax. Row warps let a
//   block hold more rows than one warp's registers can (O: ROW_TILES x Dv floats a warp)
//   while every row group still reads each K/V stage once;
// * after the last tile the key warps' (max, sum, O) meet in shared memory and are
//   combined by log-sum-exp, once per block;
// * K/V stream through STAGES shared buffers of BLOCK_K = WARPS * WARP_KEYS keys with
//   cp.async (rows swizzled or padded by 16 bytes for conflict-free ldmatrix, zeros past
//   the keys and in the padding columns); the score options, masks and the online softmax are
//   forward_softmax.cuh's, the same code as the prefill mma.sync forward.
// Packed row r is query head kv_head * group + r / Nq, query row r % Nq; the masks and
// ALiBi see the query row, so causal speculative rows (Nq > 1) keep their own keys, and
// ALiBi takes each packed row's own head's slope (held in registers, two a row tile).
// Rows past the packed rows in use are zero and never stored. More packed rows than a
// block holds (16 * ROW_TILES * ROW_WARPS) are cut into row groups, a block each: K/V is
// then read once per row group, still far less than once per query head. Dropout runs on
// the CUDA-core kernel (tileattn/gpu/tiles.py, decode_on_tensor_cores): decoding with
// dropout is no inference case.
//
// Compile-time configuration (NVRTC -D options): IS_BFLOAT16, HEAD_DIM, VALUE_DIM,
// COPY_BYTES (K and V rows), Q_COPY_BYTES (Q rows), ROW_TILES, ROW_WARPS, WARPS, WARP_KEYS,
// STAGES, MIN_BLOCKS, FUSED_MERGE, LIMIT_LEFT, LIMIT_RIGHT, SOFTCAP, ALIBI, VARLEN, PAGED
// (DROPOUT is 0), L2_PREFETCH (mma.cuh: the copies' L2 prefetch size) and PAIRED_PAGE_ROWS
// (TileChunks::paged; off unless defined to 1).
#include "forward_softmax.cuh"

#ifndef PAIRED_PAGE_ROWS
#define PAIRED_PAGE_ROWS 0
#endif

constexpr int kRowTiles = ROW_TILES;  // a warp's m16 tiles of packed rows
constexpr int kRowWarps = ROW_WARPS;  // warp groups holding different rows
constexpr int kRows = 16 * kRowTiles * kRowWarps;  // packed-row capacity
constexpr int kWarps = WARPS;  // key warps: a group's warps, splitting each stage's keys
constexpr int kThreads = 32 * kWarps * kRowWarps;
constexpr int kWarpKeys = WARP_KEYS;
constexpr int kBlockK = kWarps * kWarpKeys;  // keys a stage
constexpr int kHeadWidth = padded_width(HEAD_DIM, 16);
constexpr int kValueWidth = padded_width(VALUE_DIM, 16);
constexpr int kQkPitch = kTilePitch<kHeadWidth>;
constexpr int kVPitch = kTilePitch<kValueWidth>;
// Q fragments stay in registers where they are few; wide rows re-read them from shared
// memory for each product, which leaves the registers to O.
constexpr bool kQInRegisters = kRowTiles * kHeadWidth <= 128;
static_assert(kWarpKeys % 16 == 0, "a warp's keys are whole k16 steps of P V");
static_assert(STAGES >= 2, "one tile in flight while one is used");
static_assert(!DROPOUT, "dropout decodes on CUDA cores (tiles.decode_on_tensor_cores)");

// K and V stages take swizzled rows (mma.cuh's tile_offset: whole 128-byte lines, which
// the copies fill faster) where every copy is a 16-byte chunk (TileChunks); rows that are
// not 16-byte aligned, or head dims that are not whole chunks, take the general copies into
// rows padded by 16 bytes. A stage is as large either way: swizzled, its last kBlockK x 16
// elements hold the rows' addresses in a paged cache (K's and V's, 8 bytes each a row).
constexpr bool kSwizzledStages = COPY_BYTES == 16 && HEAD_DIM % 8 == 0 && VALUE_DIM % 8 == 0;
constexpr int kKRowStride = kSwizzledStages ? kHeadWidth : kQkPitch;  // K rows in a stage
constexpr int kVRowStride = kSwizzledStages ? kValueWidth : kVPitch;
constexpr int kVTileOffset = kBlockK * kKRowStride;  // V's tile in a stage

// Shared memory (launch_decode.py mirrors it): STAGES x (K tile, V tile), then Q. After
// the key loop the stages hold the key warps' partial results: O [kWarps][kRows][kOPitch]
// floats, then max and sum [kWarps][kRows] each.
constexpr int kStageElements = kBlockK * (kQkPitch + kVPitch);
constexpr int kStagesBytes = STAGES * kStageElements * 2;
constexpr int kOPitch = kValueWidth + 4;  // 16 bytes of padding: rows in different banks
constexpr int kCombineBytes = kWarps * kRows * (kOPitch + 2) * 4;
constexpr int kQOffset = (kStagesBytes > kCombineBytes ? kStagesBytes : kCombineBytes);
constexpr int kSharedBytes = kQOffset + kRows * kQkPitch * 2;
static_assert(kQOffset % 16 == 0, "16-byte aligned Q tile");
#ifdef EXPECTED_SHARED_BYTES  // bench/experiments/compile_check_gpu.py: the launcher's mirror
static_assert(kSharedBytes == EXPECTED_SHARED_BYTES, "DecodeMmaTiles.shared_bytes disagrees");
#endif

// K and V tiles by whole 16-byte copies at places fixed per thread: thread t copies chunks
// t + i * kThreads of the tile (row chunk / kChunksPerRow, column chunk % kChunksPerRow),
// in a loop of a fixed count, unrolled. Where the threads divide the rows' chunks evenly
// (kEvenSplit: D 16-256 a power of two, the common head dims) a thread's chunks lie in one
// column and rows kRowStep apart, so a chunk's address is the thread's first one plus i
// fixed steps; other widths (D = 96, 192: 12 and 24 chunks a row) find their row and column
// by a division by a constant. load_rows_async's general loop (any width, chunk size and
// row source) forms each chunk's address anew: 64-bit row products, bounds, and under
// PAGED a block-table read; at decode's two mma a copy those integer instructions were
// most of the kernel's issue slots (NOTES-gpu v33: 62 instructions a copy, 2 of them mma;
// paged 101) and held paged calls to 0.62 of the dense ones on an H200. Unaligned rows
// (COPY_BYTES < 16) and head dims that are not whole chunks take the general loop.
template <int Columns, int Width>
struct TileChunks {
    static constexpr int kChunksPerRow = Width / 8;
    static constexpr int kChunks = kBlockK * kChunksPerRow;
    static constexpr bool kCovered = COPY_BYTES == 16 && Columns % 8 == 0;
    static constexpr bool kEvenSplit =
        kThreads % kChunksPerRow == 0 && kChunks % kThreads == 0;
    static constexpr int kRowStep = kEvenSplit ? kThreads / kChunksPerRow : 1;
    static constexpr int kPerThread = (kChunks + kThreads - 1) / kThreads;

    int first_row;     // this thread's first row of a tile (kEvenSplit)
    int column;        // its chunk's first column (kEvenSplit)
    bool column_kept;  // the chunk lies within Columns (else zeros: the head dim's padding)

    __device__ __forceinline__ static TileChunks of_thread() {
        const int chunk = static_cast<int>(threadIdx.x) % kChunksPerRow;
        return {static_cast<int>(threadIdx.x) / kChunksPerRow, chunk * 8, chunk * 8 < Columns};
    }
    // Chunk i of this thread: false past the tile's chunks (an uneven split's last pass),
    // else its row and column.
    __device__ __forceinline__ static bool place(int i, int* row, int* col) {
        const int chunk = static_cast<int>(threadIdx.x) + i * kThreads;
        *row = chunk / kChunksPerRow;
        *col = chunk % kChunksPerRow * 8;
        return kChunks % kThreads == 0 || chunk < kChunks;
    }
    // Rows [0, rows_kept) of a tile into `tile` (swizzled rows), row r from `row_at(r)`;
    // zeros after them. With an even split a chunk's column depends on its row % 8.
    template <class RowAt>
    __device__ __forceinline__ void copy(bits16* tile, int rows_kept, RowAt row_at) const {
        const u32 target = shared_address(tile);
        if constexpr (kEvenSplit) {
#pragma unroll
            for (int i = 0; i < kPerThread; ++i) {
                const int r = first_row + i * kRowStep;
                copy_chunk_async<16>(target + 2 * tile_offset<Width, true>(r, column),
                                     row_at(r) + column, column_kept && r < rows_kept);
            }
        } else {
#pragma unroll
            for (int i = 0; i < kPerThread; ++i) {
                int r, c;
                if (!place(i, &r, &c)) break;
                copy_chunk_async<16>(target + 2 * tile_offset<Width, true>(r, c),
                                     row_at(r) + c, c < Columns && r < rows_kept);
            }
        }
    }
    // A tile whose row 0 is at `row0`, rows `stride` apart (addressed from the thread's
    // first row: with an even split the steps are then constants times the stride).
    __device__ __forceinline__ void strided(bits16* tile, const bits16* row0, i64 stride,
                                            int rows_kept) const {
        const bits16* first = row0 + first_row * stride;
        copy(tile, rows_kept, [&](int r) { return first + (r - first_row) * stride; });
    }
#if PAGED
    // The same through the rows' addresses, which `PageRows::store` left at `rows`,
    // `stride` pointers apart (after the stage's tiles): a load and the column's add a
    // copy. A thread's rows are kRowStep apart from a first row under
    // kRowStep, so where pages are powers of two of at least 2 x kRowStep rows (16 at
    // D 128), its rows 2m and 2m + 1 share a page: with PAIRED_PAGE_ROWS the second's
    // address is the first's plus kRowStep slots, with no load.
    __device__ __forceinline__ void paged(bits16* tile, const bits16* const* rows, int stride,
                                          int rows_kept, const PagedRows<bits16>& pool) const {
        if constexpr (PAIRED_PAGE_ROWS && kEvenSplit && kPerThread % 2 == 0) {
            if (pool.page_shift >= 0 && pool.page_size % (2 * kRowStep) == 0) {
                const i64 step = kRowStep * pool.slot_stride;
                const bits16* pair_first = nullptr;
                int i = 0;  // the copy's index: copy() asks for the rows in order
                copy(tile, rows_kept, [&](int r) {
                    const bits16* address =
                        i % 2 == 0 ? (pair_first = rows[r * stride]) : pair_first + step;
                    ++i;
                    return address;
                });
                return;
            }
        }
        copy(tile, rows_kept, [&](int r) { return rows[r * stride]; });
    }
#endif
};
using KeyChunks = TileChunks<HEAD_DIM, kHeadWidth>;
using KeyFragments = SwizzledFragments<kHeadWidth>;
using ValueFragments = SwizzledFragments<kValueWidth>;
using ValueChunks = TileChunks<VALUE_DIM, kValueWidth>;
constexpr bool kChunkCopies = KeyChunks::kCovered && ValueChunks::kCovered;
static_assert(kSwizzledStages == kChunkCopies, "the chunk copies fill the swizzled stages");

#if PAGED
// A stage's K and V row addresses (the chunk copies' paged rows), row r's at [r *
// kAddressStride]: after the swizzled tiles, K's and V's side by side.
constexpr int kRowAddressesAt = kBlockK * (kHeadWidth + kValueWidth);
constexpr int kAddressStride = 2;
__device__ __forceinline__ const bits16** key_row_addresses(bits16* stage) {
    return reinterpret_cast<const bits16**>(stage + kRowAddressesAt);
}
__device__ __forceinline__ const bits16** value_row_addresses(bits16* stage) {
    return key_row_addresses(stage) + 1;
}

// The addresses in the pools of one tile's K and V rows (pool + page * page stride + slot *
// slot stride), thread r holding row r's: `fetch` reads the block table a tile before
// `store` writes the addresses into the stage, so the table read's latency hides under a
// tile's products instead of delaying the tile's copies. A thread's copies then read their
// rows' addresses from shared memory; the barrier at the top of each tile orders the store
// before them.
struct PageRows {
    static constexpr int kPerThread = (kBlockK + kThreads - 1) / kThreads;
    i64 ids[kPerThread];

    __device__ __forceinline__ void fetch(const PagedRows<bits16>& rows, i64 tile_index,
                                          i64 row_limit) {
#pragma unroll
        for (int j = 0; j < kPerThread; ++j) {
            const int r = static_cast<int>(threadIdx.x) + j * kThreads;
            const i64 row = tile_index * kBlockK + r;
            // past the sequence the table may name no page: the copies there are zeros
            ids[j] = r < kBlockK && row < row_limit ? rows.table[rows.page_of(row)] : 0;
        }
    }
    __device__ __forceinline__ void store(bits16* stage, const PagedRows<bits16>& k_rows,
                                          const PagedRows<bits16>& v_rows,
                                          i64 tile_index) const {
#pragma unroll
        for (int j = 0; j < kPerThread; ++j) {
            const int r = static_cast<int>(threadIdx.x) + j * kThreads;
            if (r >= kBlockK) continue;
            const i64 row = tile_index * kBlockK + r;
            const i64 page = min(max(ids[j], i64(0)), k_rows.last_page);
            const i64 slot = row - k_rows.page_of(row) * k_rows.page_size;
            key_row_addresses(stage)[r * kAddressStride] =
                k_rows.pool + page * k_rows.page_stride + slot * k_rows.slot_stride;
            value_row_addresses(stage)[r * kAddressStride] =
                v_rows.pool + page * v_rows.page_stride + slot * v_rows.slot_stride;
        }
    }
};
#endif

// FUSED_MERGE: the splits of a (batch, kv head, row group) are combined by the last of
// their blocks to finish, not by a second kernel (attention_decode.cu's merge), which at
// caches of a few hundred MiB cost ~5 us of a ~100 us step (NOTES-gpu v32). The same
// formula: with m the largest split lse, w_s = exp(lse_s - m), o = sum_s w_s o_s / sum_s
// w_s and lse = m + log(sum_s w_s); every split -inf gives o = 0 and lse = -inf, a NaN lse
// reaches o and lse. Sums run in split order, so o is the same whichever block is last.
// `count` (a u32 per group in the workspace, zero between launches) counts the blocks
// done; the last resets it for the next launch. The launcher fuses only while the
// partials of a block's rows are few (tiles.decode_merges_in_kernel), since one block
// reads them all; the weights (n_splits x kRows floats) and the row totals reuse the
// stages.
__device__ __forceinline__ void merge_if_last_split(
    const float* partial_o, const float* partial_lse, bits16* o, float* lse, u32* count,
    int n_splits, i64 all_rows, i64 row0, int block_rows, i64 batch, int kv_head,
    int group_size, int n_q, int first_row, OutputStrides o_strides, float* weights) {
    __threadfence();  // this block's partials reach L2 before its count does
    const bool last = __syncthreads_or(
        threadIdx.x == 0 && static_cast<int>(atomicAdd(count, 1u)) == n_splits - 1);
    if (!last) return;
    if (threadIdx.x == 0) *count = 0;
    __threadfence();  // the other blocks' partials are read after their counts (from L2: __ldcg)
    float* row_total = weights + n_splits * kRows;  // [kRows]
    for (int e = threadIdx.x; e < n_splits * block_rows; e += kThreads) {
        const int split = e / block_rows, r = e % block_rows;
        weights[split * kRows + r] = __ldcg(partial_lse + split * all_rows + row0 + r);
    }
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int r = warp; r < block_rows; r += kThreads / 32) {
        float largest = negative_infinity<float>();
        for (int split = lane; split < n_splits; split += 32)
            largest = fmaxf(largest, weights[split * kRows + r]);
        largest = warp_max(largest);
        const float safe_max = largest == negative_infinity<float>() ? 0.0f : largest;
        float total = 0.0f;
        for (int split = lane; split < n_splits; split += 32) {
            const float weight = expf(weights[split * kRows + r] - safe_max);
            weights[split * kRows + r] = weight;
            total += weight;
        }
        total = warp_sum(total);
        if (lane == 0) {
            row_total[r] = total;
            lse[row0 + r] = total == 0.0f ? negative_infinity<float>() : safe_max + logf(total);
        }
    }
    __syncthreads();
    constexpr int kPairs = (VALUE_DIM + 1) / 2;
    for (int e = threadIdx.x; e < block_rows * kPairs; e += kThreads) {
        const int r = e / kPairs, col = 2 * (e % kPairs);
        const float* partial = partial_o + (row0 + r) * VALUE_DIM + col;
        float low = 0.0f, high = 0.0f;
#pragma unroll 4
        for (int split = 0; split < n_splits; ++split) {
            const float weight = weights[split * kRows + r];
            const float* at = partial + split * all_rows * VALUE_DIM;
            if constexpr (VALUE_DIM % 2 == 0) {
                const float2 pair = __ldcg(reinterpret_cast<const float2*>(at));
                low += weight * pair.x;
                high += weight * pair.y;
            } else {
                low += weight * __ldcg(at);
                if (col + 1 < VALUE_DIM) high += weight * __ldcg(at + 1);
            }
        }
        const float total = row_total[r];
        const float factor = total == 0.0f ? 0.0f : 1.0f / total;
        if (total == 0.0f) low = high = 0.0f;  // every split kept nothing: o = 0, not 0 x NaN
        const i64 o_offset = STRIDED_OUT ? packed_row_offset(batch, kv_head, group_size, n_q,
                                                             first_row + r, o_strides)
                                         : (row0 + r) * VALUE_DIM;
        store_row_pair<VALUE_DIM>(o + o_offset, col, low * factor, high * factor);
    }
}

// MIN_BLOCKS: the blocks an SM holds in the launcher's split count (tiles.decode_residency),
// so ptxas keeps the registers within it.
extern "C" __global__ void __launch_bounds__(kThreads, MIN_BLOCKS) attention_decode_mma(
    const bits16* q, const bits16* k, const bits16* v, bits16* o, float* lse,
    float* partial_o, float* partial_lse, u32* split_counts, const double* alibi_slopes,
    i64 n_q, i64 n_k, int n_q_heads, int group_size,
    int n_splits, i64 q_sb, i64 q_sh, i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn, i64 v_sb,
    i64 v_sh, i64 v_sn, i64 o_sb, i64 o_sh, i64 o_sn, float scale, float softcap,
    i64 band_offset, i64 window_left,
    i64 window_right, u32 /*dropout_key*/, u32 /*dropout_threshold*/, float /*dropout_scale*/,
    u32 /*dropout_row0*/, u32 /*dropout_col0*/, SEQUENCE_PARAMETERS) {
    // 128-byte aligned: the swizzled fragments' XOR addressing (mma.cuh SwizzledFragments)
    extern __shared__ __align__(128) unsigned char shared_bytes[];
    bits16* stages = reinterpret_cast<bits16*>(shared_bytes);
    bits16* q_tile = reinterpret_cast<bits16*>(shared_bytes + kQOffset);  // [kRows][kQkPitch]
    {  // the launcher's shared-memory size must cover this layout
        u32 provided;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(provided));
        if (provided < kSharedBytes) __trap();
    }

    // Blocks in (batch, kv head, row group, split) order.
    const int rows = static_cast<int>(group_size * n_q);  // packed rows of a kv head
    const int row_groups = (rows + kRows - 1) / kRows;
    const int split = static_cast<int>(blockIdx.x % n_splits);
    const int row_group = static_cast<int>(blockIdx.x / n_splits % row_groups);
    const i64 bkv = blockIdx.x / n_splits / row_groups;  // flat (batch, kv head)
    const int n_kv_heads = n_q_heads / group_size;
    const i64 batch = bkv / n_kv_heads;
    const int kv_head = static_cast<int>(bkv % n_kv_heads);
    const int first_row = row_group * kRows;  // this block's packed rows: first_row + [0, kRows)
    const i64 out_row0 = bkv * rows;  // flat (b, h, i) of packed row 0 in o and lse
    const SequenceTables tables = SEQUENCE_TABLES;
    i64 seq_rows = n_q, seq_keys = n_k, seq_band = band_offset;
    if (VARLEN) {  // a padded or paged batch: batch element b is sequence b
        const Sequence sequence = sequence_at(tables.descriptors, batch);
        seq_rows = sequence.rows;
        seq_keys = sequence.keys;
        seq_band = sequence.band + band_offset;
    }
    const Band band{seq_band, window_left, window_right};
    const KeyRows<bits16> k_rows = key_rows(k, batch, kv_head, k_sb, k_sh, k_sn, 0, tables);
    const KeyRows<bits16> v_rows = key_rows(v, batch, kv_head, v_sb, v_sh, v_sn, 0, tables);

    i64 tile_begin, tile_end;
    key_tile_range<LIMIT_LEFT, LIMIT_RIGHT>(band, 0, seq_rows, seq_keys, kBlockK, &tile_begin,
                                            &tile_end);
    if (VARLEN && seq_rows == 0) tile_end = tile_begin;
    const i64 n_tiles = tile_end - tile_begin;
    const i64 my_begin = tile_begin + n_tiles * split / n_splits;
    const i64 my_end = tile_begin + n_tiles * (split + 1) / n_splits;

    const int warp = threadIdx.x / 32 % kWarps, lane = threadIdx.x % 32;  // warp: key warp
    const int warp_row0 = threadIdx.x / 32 / kWarps * 16 * kRowTiles;  // its group's rows
    const int quad_row = lane / 4, quad_col = lane % 4;
    // A row warp whose rows all lie past the packed rows in use (65-112 rows on 8 row warps
    // of one m16 tile) skips the products, which would read every stage from shared memory
    // for rows never stored; it still copies its share of each stage and meets the others
    // at every barrier.
    const bool rows_in_use = first_row + warp_row0 < rows;
    // The query row (for the masks and ALiBi) and the ALiBi slope (its query head's, in
    // logit units) of this thread's two rows of each row tile; rows past the packed rows in
    // use take row 0 and slope 0 (computed, never stored).
    i64 my_rows[kRowTiles][2];
    float my_slopes[kRowTiles][2];
#pragma unroll
    for (int m = 0; m < kRowTiles; ++m)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int packed = first_row + warp_row0 + m * 16 + quad_row + 8 * half;
            const bool in_use = packed < rows;
            my_rows[m][half] = in_use ? packed % n_q : 0;
            const i64 head = static_cast<i64>(kv_head) * group_size + packed / n_q;
            my_slopes[m][half] =
                ALIBI && in_use
                    ? static_cast<float>(alibi_slopes[batch * n_q_heads + head]) * kLogitUnit
                    : 0.0f;
        }

    const auto stage_of = [&](i64 tile_index) {
        return stages + static_cast<int>(tile_index - my_begin) % STAGES * kStageElements;
    };
    // A tile's K and V rows into its stage (PAGED: through the row addresses its stage holds
    // where the chunk copies serve, else through the block table).
    const KeyChunks k_chunks = KeyChunks::of_thread();
    const ValueChunks v_chunks = ValueChunks::of_thread();
#if PAGED
    // Pages of a multiple of the stage's keys (64, 256: what servers use beside 16) hold
    // whole tiles, whose copies then step from row 0's address as the dense ones do.
    const bool pages_hold_tiles = k_rows.page_size % kBlockK == 0;
#endif
    const auto load_tile = [&](i64 tile_index) {
        bits16* stage = stage_of(tile_index);
        bits16* v_stage = stage + kVTileOffset;
        const i64 row = tile_index * kBlockK;
        if constexpr (kChunkCopies) {
            const int rows_kept = static_cast<int>(min(seq_keys - row, i64(kBlockK)));
#if PAGED
            if (pages_hold_tiles) {  // the tile's rows are contiguous slots of one page
                k_chunks.strided(stage, key_row_addresses(stage)[0], k_rows.slot_stride,
                                 rows_kept);
                v_chunks.strided(v_stage, value_row_addresses(stage)[0], v_rows.slot_stride,
                                 rows_kept);
            } else {
                k_chunks.paged(stage, key_row_addresses(stage), kAddressStride, rows_kept,
                               k_rows);
                v_chunks.paged(v_stage, value_row_addresses(stage), kAddressStride,
                               rows_kept, v_rows);
            }
#else
            k_chunks.strided(stage, k_rows.base + row * k_rows.stride, k_rows.stride, rows_kept);
            v_chunks.strided(v_stage, v_rows.base + row * v_rows.stride, v_rows.stride,
                             rows_kept);
#endif
        } else {
            load_rows_async<kBlockK, HEAD_DIM, kHeadWidth, kThreads, kQkPitch, COPY_BYTES>(
                stage, k_rows, row, seq_keys);
            load_rows_async<kBlockK, VALUE_DIM, kValueWidth, kThreads, kVPitch, COPY_BYTES>(
                v_stage, v_rows, row, seq_keys);
        }
    };
#if PAGED
    // The row addresses of the first STAGES tiles are stored before any copy (one wait on the
    // table a block); the loop then stores tile t + STAGES's during tile t, into t's stage,
    // from table entries fetched during tile t - 1.
    PageRows pending_rows;
    if constexpr (kChunkCopies) {
        PageRows first_rows[STAGES];
#pragma unroll
        for (int s = 0; s < STAGES; ++s)
            if (my_begin + s < my_end) first_rows[s].fetch(k_rows, my_begin + s, seq_keys);
#pragma unroll
        for (int s = 0; s < STAGES; ++s)
            if (my_begin + s < my_end)
                first_rows[s].store(stage_of(my_begin + s), k_rows, v_rows, my_begin + s);
        if (my_begin + STAGES < my_end)
            pending_rows.fetch(k_rows, my_begin + STAGES, seq_keys);
        __syncthreads();
    }
#endif

    // Prologue: the packed Q rows (zeros past the rows in use and past D) join the first
    // group of copies, so their latency hides under the first K/V tile's instead of
    // preceding it; then STAGES - 1 tiles in flight (a group is committed even when empty,
    // so the waits below always count the same number of groups).
    load_rows_async<kRows, HEAD_DIM, kHeadWidth, kThreads, kQkPitch, Q_COPY_BYTES>(
        q_tile,
        PackedQueryRows<bits16>{q + batch * q_sb + static_cast<i64>(kv_head) * group_size * q_sh,
                                q_sh, q_sn, static_cast<int>(n_q)},
        first_row, rows);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (my_begin + s < my_end) load_tile(my_begin + s);
        commit_copies();
    }
    wait_copies<STAGES - 2>();
    __syncthreads();  // Q landed (with the first tile)

    u32 q_fragments[kQInRegisters ? kRowTiles : 1][kQInRegisters ? kHeadWidth / 16 : 1][4];
    if (kQInRegisters) {
#pragma unroll
        for (int m = 0; m < kRowTiles; ++m)
#pragma unroll
            for (int kk = 0; kk < kHeadWidth / 16; ++kk)
                load_a_fragment<kHeadWidth>(q_tile, warp_row0 + m * 16, kk * 16,
                                            q_fragments[kQInRegisters ? m : 0]
                                                       [kQInRegisters ? kk : 0]);
    }

    float o_acc[kRowTiles][kValueWidth / 8][4], row_max[kRowTiles][2], row_sum[kRowTiles][2];
    start_online_softmax(o_acc, row_max, row_sum);
    // The block's slope (its first query head's) goes unused: the rows take my_slopes.
    const ForwardScores scores =
        make_forward_scores(scale, softcap, alibi_slopes,
                            batch * n_q_heads + static_cast<i64>(kv_head) * group_size, band,
                            seq_keys);

    // The warp's fragment addresses in stage 0 (swizzled stages; a stage's are these plus
    // its offset).
    const u32 stages_address = shared_address(stages);
    const u32 k_lane0 = stages_address + 2 * (warp * kWarpKeys * kKRowStride) +
                        (kSwizzledStages ? KeyFragments::lane_offset(false) : 0u);
    const u32 v_lane0 = stages_address + 2 * (kVTileOffset + warp * kWarpKeys * kVRowStride) +
                        (kSwizzledStages ? ValueFragments::lane_offset(true) : 0u);
    for (i64 tile = my_begin; tile < my_end; ++tile) {
        const int slot = static_cast<int>(tile - my_begin) % STAGES;
        bits16* k_tile = stages + slot * kStageElements;
        bits16* v_tile = k_tile + kVTileOffset;
        wait_copies<STAGES - 2>();
        __syncthreads();  // this tile landed for all; the stage refilled below was last
                          // read in the previous tile, which every warp has finished
        {
            const i64 next = tile + STAGES - 1;
            if (next < my_end) load_tile(next);
            commit_copies();
        }
#if PAGED
        if constexpr (kChunkCopies) {  // tile + STAGES's addresses into this tile's stage
            if (tile + STAGES < my_end)
                pending_rows.store(stage_of(tile + STAGES), k_rows, v_rows, tile + STAGES);
            if (tile + STAGES + 1 < my_end)
                pending_rows.fetch(k_rows, tile + STAGES + 1, seq_keys);
        }
#endif
        // A warp's keys start at a multiple of 16 rows: its rows' swizzle is the tile's.
        const bits16* k_warp = k_tile + warp * kWarpKeys * kKRowStride;
        const bits16* v_warp = v_tile + warp * kWarpKeys * kVRowStride;
        const u32 stage_bytes = static_cast<u32>(slot) * (kStageElements * 2);
        const u32 k_lane = k_lane0 + stage_bytes, v_lane = v_lane0 + stage_bytes;
        const i64 col_start = tile * kBlockK + warp * kWarpKeys;

        // S = Q K^T over this warp's keys.
        float s[kRowTiles][kWarpKeys / 8][4];
#pragma unroll
        for (int m = 0; m < kRowTiles; ++m)
#pragma unroll
            for (int n = 0; n < kWarpKeys / 8; ++n)
                s[m][n][0] = s[m][n][1] = s[m][n][2] = s[m][n][3] = 0.0f;
        if (rows_in_use) {
#pragma unroll
            for (int kk = 0; kk < kHeadWidth / 16; ++kk) {
                u32 a[kRowTiles][4];
#pragma unroll
                for (int m = 0; m < kRowTiles; ++m) {
                    if (kQInRegisters) {
#pragma unroll
                        for (int e = 0; e < 4; ++e)
                            a[m][e] = q_fragments[kQInRegisters ? m : 0]
                                                 [kQInRegisters ? kk : 0][e];
                    } else {
                        load_a_fragment<kHeadWidth>(q_tile, warp_row0 + m * 16, kk * 16, a[m]);
                    }
                }
#pragma unroll
                for (int nn = 0; nn < kWarpKeys / 16; ++nn) {
                    u32 b[4];
                    if constexpr (kSwizzledStages)
                        KeyFragments::load_b(k_lane, nn * 16, kk * 16, b);
                    else
                        load_b_fragments<kHeadWidth>(k_warp, nn * 16, kk * 16, b);
#pragma unroll
                    for (int m = 0; m < kRowTiles; ++m) {
                        mma_16x8x16(s[m][2 * nn], a[m], b[0], b[1]);
                        mma_16x8x16(s[m][2 * nn + 1], a[m], b[2], b[3]);
                    }
                }
            }
        }

        // Masks: this warp's keys against query rows [0, seq_rows); the non-finite-V step
        // below needs a block-uniform test, so it asks of the whole stage.
        if (rows_in_use) {
            // Two calls, so that the tiles inside (all but a split's last, without a band)
            // carry no mask arithmetic: with one call taking the flag, the compiler
            // evaluated every score's mask and selected (~90 instructions a tile).
            if (key_tile_needs_mask(scores, 0, static_cast<int>(seq_rows), col_start,
                                    kWarpKeys))
                scores_to_logits(s, my_rows, col_start, true,
                                 tile_mask<LIMIT_LEFT, LIMIT_RIGHT>(band, 0, col_start, seq_keys),
                                 scores, my_slopes);
            else
                scores_to_logits(s, my_rows, col_start, false, TileMask{}, scores, my_slopes);
            // O takes the factor e^(old max - new max) only where a row's max moved (a warp-wide
            // test): over a long cache it rarely does after the first tiles, and a factor of
            // 1 changes nothing (Dv / 2 multiplies a thread a tile).
            float rescale[kRowTiles][2];
            softmax_probabilities(s, row_max, row_sum, rescale);
            bool max_moved = false;
#pragma unroll
            for (int m = 0; m < kRowTiles; ++m)
                max_moved = max_moved || rescale[m][0] != 1.0f || rescale[m][1] != 1.0f;
            if (__any_sync(0xffffffffu, max_moved)) rescale_output(o_acc, rescale);
        }

        // A stage the band cuts with a non-finite V: the kept pairs' products on CUDA cores,
        // then zeros in V's place for the tensor cores (kept_products.cuh). Keys past the
        // sequence are zero-filled, never loaded, so only a band limit needs this.
        if (kBandMasksKeys && key_tile_needs_mask(scores, 0, static_cast<int>(seq_rows),
                                                  tile * kBlockK, kBlockK)) {
            if (__syncthreads_or(
                    tile_has_non_finite<kBlockK, kValueWidth, kVRowStride, kThreads>(v_tile))) {
                if (rows_in_use)
                    add_kept_non_finite_values<kWarpKeys / 8>(
                        o_acc,
                        KeptKeysOfRows<kRowTiles>{
                            my_rows, tile_mask<LIMIT_LEFT, LIMIT_RIGHT>(band, 0, col_start,
                                                                        seq_keys)},
                        HeldFromScores<kRowTiles, kWarpKeys / 8>{s},
                        [&](int key, int col) {
                            return element_value(
                                v_warp[tile_offset<kValueWidth, kSwizzledStages>(key, col)]);
                        });
                __syncthreads();
                zero_non_finite<kBlockK, kValueWidth, kVRowStride, kThreads>(v_tile);
                __syncthreads();
            }
        }

        // O += P V: the S accumulators of key fragments 2kk and 2kk+1 are the A fragment.
        if (rows_in_use) {
#pragma unroll
            for (int kk = 0; kk < kWarpKeys / 16; ++kk) {
                u32 a[kRowTiles][4];
#pragma unroll
                for (int m = 0; m < kRowTiles; ++m)
                    pack_a_fragment(s[m][2 * kk], s[m][2 * kk + 1], a[m]);
#pragma unroll
                for (int dn = 0; dn < kValueWidth / 16; ++dn) {
                    u32 b[4];
                    if constexpr (kSwizzledStages)
                        ValueFragments::load_b_transposed(v_lane, kk * 16, dn * 16, b);
                    else
                        load_b_fragments_transposed<kValueWidth>(v_warp, kk * 16, dn * 16, b);
#pragma unroll
                    for (int m = 0; m < kRowTiles; ++m) {
                        mma_16x8x16(o_acc[m][2 * dn], a[m], b[0], b[1]);
                        mma_16x8x16(o_acc[m][2 * dn + 1], a[m], b[2], b[3]);
                    }
                }
            }
        }
    }
    wait_copies<0>();
    __syncthreads();  // every warp is done with the stages, which now take the partials

    // Each warp's (max, sum, unnormalised O) per packed row of its group into shared memory.
    float* combine_o = reinterpret_cast<float*>(shared_bytes);  // [kWarps][kRows][kOPitch]
    float* combine_max = combine_o + kWarps * kRows * kOPitch;  // [kWarps][kRows]
    float* combine_sum = combine_max + kWarps * kRows;
#pragma unroll
    for (int m = 0; m < kRowTiles; ++m)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float total = row_sum[m][half];
            total += __shfl_xor_sync(0xffffffffu, total, 1);
            total += __shfl_xor_sync(0xffffffffu, total, 2);
            const int r = warp_row0 + m * 16 + quad_row + 8 * half;
            float* o_row = combine_o + (warp * kRows + r) * kOPitch;
#pragma unroll
            for (int n = 0; n < kValueWidth / 8; ++n) {
                o_row[n * 8 + 2 * quad_col] = o_acc[m][n][2 * half];
                o_row[n * 8 + 2 * quad_col + 1] = o_acc[m][n][2 * half + 1];
            }
            if (quad_col == 0) {
                combine_max[warp * kRows + r] = row_max[m][half];
                combine_sum[warp * kRows + r] = total;
            }
        }
    __syncthreads();

    // Combined by log-sum-exp over the warps (base-2 logits: exp2 of max differences), a
    // thread per (row, column pair). total == 0: nothing kept here (o = 0, lse = -inf);
    // a NaN total is not 0, so NaN reaches o and lse. Padding rows of a padded batch (query
    // row >= the sequence's rows) keep no key.
    const bool direct = n_splits == 1;
    constexpr int kPairs = (VALUE_DIM + 1) / 2;
    const int block_rows = min(kRows, rows - first_row);
    const i64 all_rows = static_cast<i64>(gridDim.x / n_splits / row_groups) * rows;  // B Hq Nq
    const i64 split_rows = split * all_rows;  // the split's partial rows start here
    for (int e = threadIdx.x; e < block_rows * kPairs; e += kThreads) {
        const int r = e / kPairs, col = 2 * (e % kPairs);
        float largest = negative_infinity<float>();
#pragma unroll
        for (int w = 0; w < kWarps; ++w) largest = fmaxf(largest, combine_max[w * kRows + r]);
        const float safe_max = largest == negative_infinity<float>() ? 0.0f : largest;
        float total = 0.0f, low = 0.0f, high = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
            const float weight = exp2_approx(combine_max[w * kRows + r] - safe_max);
            const float* o_row = combine_o + (w * kRows + r) * kOPitch;
            total += weight * combine_sum[w * kRows + r];
            low += weight * o_row[col];
            high += weight * o_row[col + 1];
        }
        if (VARLEN && (first_row + r) % n_q >= seq_rows) total = 0.0f;
        // A row that keeps no key writes zeros, not 0 x its sums: a padding row's Q may be
        // NaN (nothing past a sequence's rows is read as data, SPEC).
        const float factor = total == 0.0f ? 0.0f : 1.0f / total;
        if (total == 0.0f) low = high = 0.0f;
        const float row_lse = total == 0.0f ? negative_infinity<float>()
                                            : safe_max * kLn2 + logf(total);
        const i64 out_row = out_row0 + first_row + r;
        if (direct) {
            const i64 o_offset = STRIDED_OUT ? packed_row_offset(batch, kv_head, group_size,
                                                                 static_cast<int>(n_q),
                                                                 first_row + r, {o_sb, o_sh, o_sn})
                                             : out_row * VALUE_DIM;
            store_row_pair<VALUE_DIM>(o + o_offset, col, low * factor, high * factor);
            if (col == 0) lse[out_row] = row_lse;
        } else {
            float* partial_row = partial_o + (split_rows + out_row) * VALUE_DIM;
            partial_row[col] = low * factor;
            if (col + 1 < VALUE_DIM) partial_row[col + 1] = high * factor;
            if (col == 0) partial_lse[split_rows + out_row] = row_lse;
        }
    }
    if (FUSED_MERGE && !direct)
        merge_if_last_split(partial_o, partial_lse, o, lse, split_counts + blockIdx.x / n_splits,
                            n_splits, all_rows, out_row0 + first_row, block_rows, batch,
                            kv_head, group_size, static_cast<int>(n_q), first_row,
                            {o_sb, o_sh, o_sn}, reinterpret_cast<float*>(shared_bytes));
}
