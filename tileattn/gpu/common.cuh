// Device code shared by every tileattn kernel: storage types and their conversions, the
// dropout hash, the attention band (causal / sliding-window mask) and a few reductions.
//
// No CUDA headers are included: NVRTC then needs no include path, and the same source
// compiles under every CUDA version CuPy ships for. 16-bit storage types are plain bit
// containers converted with PTX `cvt` (half) or bit shifts (bfloat16).
#pragma once

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

// ------------------------------------------------------------------ storage types

struct half_storage {
    unsigned short bits;
};
struct bfloat16_storage {
    unsigned short bits;
};

__device__ __forceinline__ float widen(half_storage x) {
    float result;
    asm("cvt.f32.f16 %0, %1;" : "=f"(result) : "h"(x.bits));
    return result;
}
__device__ __forceinline__ float widen(bfloat16_storage x) {
    return __uint_as_float(static_cast<u32>(x.bits) << 16);  // bfloat16 is float32's top half
}
__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ double widen(double x) { return x; }

template <typename T> __device__ __forceinline__ T narrow(float x);
template <typename T> __device__ __forceinline__ T narrow(double x);

template <> __device__ __forceinline__ half_storage narrow<half_storage>(float x) {
    half_storage result;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(result.bits) : "f"(x));
    return result;
}
template <> __device__ __forceinline__ bfloat16_storage narrow<bfloat16_storage>(float x) {
    // Round to nearest even by hand (cvt.rn.bf16.f32 needs sm_80; this runs everywhere).
    u32 bits = __float_as_uint(x);
    bfloat16_storage result;
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        result.bits = static_cast<unsigned short>((bits >> 16) | 0x0040u);  // quiet NaN
    } else {
        bits += 0x7fffu + ((bits >> 16) & 1u);
        result.bits = static_cast<unsigned short>(bits >> 16);
    }
    return result;
}
template <> __device__ __forceinline__ float narrow<float>(float x) { return x; }
template <> __device__ __forceinline__ double narrow<double>(double x) { return x; }

template <typename Acc> __device__ __forceinline__ Acc negative_infinity();
template <> __device__ __forceinline__ float negative_infinity<float>() {
    return __uint_as_float(0xff800000u);
}
template <> __device__ __forceinline__ double negative_infinity<double>() {
    return __longlong_as_double(static_cast<i64>(0xfff0000000000000ull));
}

// Accurate exp/log/tanh per accumulation type (the CUDA-core kernels must meet the float32
// and float64 tolerances, so no approximate intrinsics there).
__device__ __forceinline__ float exp_acc(float x) { return expf(x); }
__device__ __forceinline__ double exp_acc(double x) { return exp(x); }
__device__ __forceinline__ float log_acc(float x) { return logf(x); }
__device__ __forceinline__ double log_acc(double x) { return log(x); }
__device__ __forceinline__ float tanh_acc(float x) { return tanhf(x); }
__device__ __forceinline__ double tanh_acc(double x) { return tanh(x); }
__device__ __forceinline__ float abs_acc(float x) { return fabsf(x); }
__device__ __forceinline__ double abs_acc(double x) { return fabs(x); }
__device__ __forceinline__ float max_acc(float x, float y) { return fmaxf(x, y); }
__device__ __forceinline__ double max_acc(double x, double y) { return fmax(x, y); }

// ------------------------------------------------------------------ dropout hash
// Bit-identical to tileattn/dropout.py (its docstring is the specification): MurmurHash3's
// fmix32 on wrapping uint32 arithmetic.

__device__ __forceinline__ u32 fmix32(u32 x) {
    x ^= x >> 16;
    x *= 0x85EBCA6Bu;
    x ^= x >> 13;
    x *= 0xC2B2AE35u;
    x ^= x >> 16;
    return x;
}

// Once per query row: `key` is derived from the seed on the host (dropout_key), `bh` is
// b * Hq + h of the query head, `row` the global query row (the kernels add the host's
// dropout_row0 to their own row index: a call may be a block of a longer sequence). Rows
// i and i ^ 8 share a base (bit 0 clear); a row's state is the base with bit 0 saying
// whether it is the pair's upper row.
__device__ __forceinline__ u32 dropout_row_state(u32 key, u32 bh, u32 row) {
    const u32 base = fmix32(fmix32(key ^ bh) + (row & ~8u)) & ~1u;
    return base | ((row >> 3) & 1u);
}

// 32 random bits for a row pair at key `col`: 16 each, the low half the lower row's. One mix
// serves the rows i and i + 8 that a thread of a tensor-core fragment holds.
__device__ __forceinline__ u32 dropout_pair_bits(u32 row_state, u32 col) {
    const u32 base = row_state & ~1u;
    return fmix32((base ^ col) * 0x9E3779B9u + base);
}

// `threshold` is floor(dropout_p * 2^16): an entry survives when its 16 bits reach it. The
// upper row's bits are the high half, compared without shifting them down.
__device__ __forceinline__ bool dropout_lower_keeps(u32 bits, u32 threshold) {
    return (bits & 0xFFFFu) >= threshold;
}
__device__ __forceinline__ bool dropout_upper_keeps(u32 bits, u32 threshold) {
    return bits >= (threshold << 16);
}

__device__ __forceinline__ bool dropout_keeps(u32 row_state, u32 col, u32 threshold) {
    const u32 bits = dropout_pair_bits(row_state, col);
    return (row_state & 1u) ? dropout_upper_keeps(bits, threshold)
                            : dropout_lower_keeps(bits, threshold);
}

// Whether `lower` and `upper` are the states of one row pair, lower row first: then one
// dropout_pair_bits serves both (true of a fragment's rows r and r + 8 whenever the call's
// row offset is a multiple of 16).
__device__ __forceinline__ bool dropout_row_pair(u32 lower, u32 upper) {
    return (lower & 1u) == 0u && upper == (lower | 1u);
}

// Whether key `col` survives for a thread's rows r and r + 8 (states `lower` and `upper`);
// RowPairs: they are one row pair (dropout_row_pair), so one hash serves both.
template <bool RowPairs>
__device__ __forceinline__ void dropout_keeps_rows(u32 lower, u32 upper, u32 col, u32 threshold,
                                                   bool& lower_keeps, bool& upper_keeps) {
    if (RowPairs) {
        const u32 bits = dropout_pair_bits(lower, col);
        lower_keeps = dropout_lower_keeps(bits, threshold);
        upper_keeps = dropout_upper_keeps(bits, threshold);
    } else {
        lower_keeps = dropout_keeps(lower, col, threshold);
        upper_keeps = dropout_keeps(upper, col, threshold);
    }
}

// ------------------------------------------------------------------ the attention band
// Query row i keeps key j when  i + offset - left <= j <= i + offset + right, with
// offset = Nk - Nq (bottom-right alignment). LIMIT_LEFT / LIMIT_RIGHT are compile-time:
// an unlimited side costs nothing. The host clamps left/right to Nq + Nk, which keeps the
// meaning and keeps every sum below in 64-bit range.

struct Band {
    i64 offset;
    i64 left;
    i64 right;
};

template <bool LimitLeft, bool LimitRight>
__device__ __forceinline__ bool band_keeps(const Band& band, i64 row, i64 col) {
    const i64 diagonal = col - (row + band.offset);
    bool kept = true;
    if (LimitLeft) kept = kept && diagonal >= -band.left;
    if (LimitRight) kept = kept && diagonal <= band.right;
    return kept;
}

// An inclusive range [low, high] of tile-relative indices.
struct Window {
    int low;
    int high;
    __device__ __forceinline__ bool keeps(int x) const { return x >= low && x <= high; }
};

// The band and the end of the keys over one tile, in 32-bit coordinates relative to the
// tile's first row `row0` and first key `col0`: the score at (row0 + r, col0 + c) is kept
// when c < key_limit and diagonal_low <= c - r <= diagonal_high. The 64-bit bounds are
// clamped to +-2^30, which changes no answer (tiles are far smaller than that). A thread
// turns the mask into a Window per row it holds (or per column, transposed), so the test
// per score is two 32-bit compares against a compile-time index.
struct TileMask {
    i64 row0;
    int key_limit;
    int diagonal_low;
    int diagonal_high;

    // Row r's kept columns, as c - column_offset.
    __device__ __forceinline__ Window row_window(int r, int column_offset) const {
        return {diagonal_low + r - column_offset,
                min(diagonal_high + r, key_limit - 1) - column_offset};
    }
    // Column c's kept rows, as r - row_offset (none when c is past the keys).
    __device__ __forceinline__ Window column_window(int c, int row_offset) const {
        if (c >= key_limit) return {1, 0};
        return {c - diagonal_high - row_offset, c - diagonal_low - row_offset};
    }
};

__device__ __forceinline__ int clamp_to_int(i64 x) {
    return static_cast<int>(max(min(x, static_cast<i64>(1) << 30), -(static_cast<i64>(1) << 30)));
}

template <bool LimitLeft, bool LimitRight>
__device__ __forceinline__ TileMask tile_mask(const Band& band, i64 row0, i64 col0, i64 n_k) {
    // diagonal = col - (row + offset) = (c - r) + (col0 - row0 - offset)
    const i64 base = col0 - row0 - band.offset;
    TileMask mask;
    mask.row0 = row0;
    mask.key_limit = clamp_to_int(n_k - col0);
    mask.diagonal_low = LimitLeft ? clamp_to_int(-band.left - base) : -(1 << 30);
    mask.diagonal_high = LimitRight ? clamp_to_int(band.right - base) : (1 << 30);
    return mask;
}

// Keys [*first, *stop) that some row of [row_start, row_stop) keeps, clipped to [0, n_k).
// The band is monotone in both indices, so the first row bounds the left edge and the
// last row the right edge; every key tile outside this range is fully masked
// (tile_is_masked in tileattn/options.py).
template <bool LimitLeft, bool LimitRight>
__device__ __forceinline__ void band_key_range(const Band& band, i64 row_start, i64 row_stop,
                                               i64 n_k, i64* first, i64* stop) {
    i64 lo = 0, hi = n_k;
    if (LimitLeft) lo = max(lo, row_start + band.offset - band.left);
    if (LimitRight) hi = min(hi, row_stop - 1 + band.offset + band.right + 1);
    *first = lo;
    *stop = max(lo, hi);
}

// Rows [*first, *stop) that keep some key of [col_start, col_stop), clipped to [0, n_q).
template <bool LimitLeft, bool LimitRight>
__device__ __forceinline__ void band_row_range(const Band& band, i64 col_start, i64 col_stop,
                                               i64 n_q, i64* first, i64* stop) {
    i64 lo = 0, hi = n_q;
    if (LimitRight) lo = max(lo, col_start - band.offset - band.right);
    if (LimitLeft) hi = min(hi, col_stop - 1 - band.offset + band.left + 1);
    *first = lo;
    *stop = max(lo, hi);
}

// The tiles of `block` keys [*begin, *end) that some row of [row_start, row_stop) keeps
// (the tensor-core kernels' key loop; tiles outside it are fully masked).
template <bool LimitLeft, bool LimitRight>
__device__ __forceinline__ void key_tile_range(const Band& band, i64 row_start, i64 row_stop,
                                               i64 n_k, int block, i64* begin, i64* end) {
    i64 first, stop;
    band_key_range<LimitLeft, LimitRight>(band, row_start, row_stop, n_k, &first, &stop);
    *begin = first / block;
    *end = stop > first ? (stop + block - 1) / block : *begin;
}

// The tiles of `block` queries [*begin, *end) that keep some key of [col_start, col_stop).
template <bool LimitLeft, bool LimitRight>
__device__ __forceinline__ void query_tile_range(const Band& band, i64 col_start, i64 col_stop,
                                                 i64 n_q, int block, i64* begin, i64* end) {
    i64 first, stop;
    band_row_range<LimitLeft, LimitRight>(band, col_start, col_stop, n_q, &first, &stop);
    *begin = first / block;
    *end = stop > first ? (stop + block - 1) / block : *begin;
}

// ------------------------------------------------------------------ which tile a block owns
// Under a band (causal or a window: LIMIT_LEFT or LIMIT_RIGHT) the tiles of a head differ
// in length and each kernel orders them longest first; there grids are tile-major (every
// head's first tile before any head's second), so the grid's tail is the shortest tile of
// every head rather than all tiles of the last heads (causal backward +5-10 %, v11 in
// bench/NOTES-gpu.md). Without a band the tiles are equal and grids stay head-major
// (tiles fastest): the blocks running at once then share a few heads' K/V in L2, which
// tile-major order lost at N = 1k (forward D=128 262 -> 246 TFLOP/s).
#if defined(LIMIT_LEFT) && defined(LIMIT_RIGHT)
constexpr bool kBandedGrid = LIMIT_LEFT || LIMIT_RIGHT;
#else
constexpr bool kBandedGrid = false;
#endif

// This block's flat head and tile in a grid of `n_tiles` tiles per head: tile-major (every
// head's first tile, then every head's second, ...) or head-major (tiles fastest).
struct GridCell {
    i64 head;
    i64 tile;
};

template <bool kTileMajor>
__device__ __forceinline__ GridCell grid_cell(i64 n_tiles, i64 block = blockIdx.x) {
    const i64 n_heads = gridDim.x / n_tiles;
    return {kTileMajor ? block % n_heads : block / n_tiles,
            kTileMajor ? block / n_heads : block % n_tiles};
}

struct QueryTile {
    i64 bh;  // flat (batch, query head): the dropout hash's head index
    i64 batch;
    int head;
    int kv_head;  // GQA/MQA: query head h reads kv head h / group_size
    i64 tile;
};

// Query-tile kernels run later tiles first: under a causal band they see the most keys.
__device__ __forceinline__ QueryTile query_tile_of_block(i64 n_q, int block_q, int n_q_heads,
                                                         int group_size) {
    const i64 n_tiles = (n_q + block_q - 1) / block_q;
    const GridCell cell = grid_cell<kBandedGrid>(n_tiles);
    QueryTile owned;
    owned.bh = cell.head;
    owned.tile = n_tiles - 1 - cell.tile;
    owned.batch = owned.bh / n_q_heads;
    owned.head = static_cast<int>(owned.bh % n_q_heads);
    owned.kv_head = owned.head / group_size;
    return owned;
}

struct KeyTile {
    i64 batch_kv_head;  // flat (batch, kv head): the row of dK/dV's (B * Hkv, Nk, D) layout
    i64 batch;
    int kv_head;
    i64 tile;
};

// Key-tile kernels (dK/dV) own one kv head's key tile and loop over its query heads; the
// first key tiles see the most queries under a causal band, so they run first.
// The ordered single pass (attention_mma_backward.cu) asks for `kTileMajor` without a
// band too, and passes the index it took from its ticket as `block`.
template <bool kTileMajor = kBandedGrid>
__device__ __forceinline__ KeyTile key_tile_of_block(i64 n_k, int block_k, int n_kv_heads,
                                                    i64 block = blockIdx.x) {
    const GridCell cell = grid_cell<kTileMajor>((n_k + block_k - 1) / block_k, block);
    KeyTile owned;
    owned.batch_kv_head = cell.head;
    owned.tile = cell.tile;
    owned.batch = owned.batch_kv_head / n_kv_heads;
    owned.kv_head = static_cast<int>(owned.batch_kv_head % n_kv_heads);
    return owned;
}

// ------------------------------------------------------------------ warp reductions
// fmax, not a comparison: a NaN score must not win the maximum, it must reach the row sum
// through exp(NaN) so that the row (and only that row) comes out NaN, as in the golden model.

template <typename Acc> __device__ __forceinline__ Acc warp_max(Acc x) {
    for (int mask = 16; mask > 0; mask >>= 1) x = fmax(x, __shfl_xor_sync(0xffffffffu, x, mask));
    return x;
}

template <typename Acc> __device__ __forceinline__ Acc warp_sum(Acc x) {
    for (int mask = 16; mask > 0; mask >>= 1) x += __shfl_xor_sync(0xffffffffu, x, mask);
    return x;
}

// ------------------------------------------------------------------ split-KV grids

// SPLIT_KEYS (tiles.py: `forward_key_splits`, `dq_key_splits`): a query-tile grid of few
// blocks against many keys runs gridDim.y shares of each tile's key tiles, grid row
// blockIdx.y taking an even share, and writes float32 partials in place of its output
// rows, laid out [out head][share][rows] (x the row's width): the forwards' (o, lse), each
// share's O normalised by its own sum and merged by log-sum-exp (split_keys_merge.cu), and
// dQ's parts, added in a fixed order (group_sum.cu). A share may keep no key: its rows store
// zeros (and lse = -inf).
#ifndef SPLIT_KEYS
#define SPLIT_KEYS 0
#endif

// The type of a split kernel's output rows: float32 partials under SPLIT_KEYS (float64's
// forward: doubles), else T.
template <bool kSplit, typename T> struct SplitOutput { using type = T; };
template <typename T> struct SplitOutput<true, T> { using type = float; };
template <> struct SplitOutput<true, double> { using type = double; };

// This block's share of the key tiles [*begin, *end).
__device__ __forceinline__ void split_key_tiles(i64* begin, i64* end) {
    if (!SPLIT_KEYS) return;
    const i64 first = *begin, count = *end - *begin;
    *begin = first + count * blockIdx.y / gridDim.y;
    *end = first + count * (blockIdx.y + 1) / gridDim.y;
}

// Row 0 of output head `out_head` (of `n_q` rows each) in the output, or under SPLIT_KEYS
// in this block's share of the partials.
__device__ __forceinline__ i64 split_head_row0(i64 out_head, i64 n_q) {
    return SPLIT_KEYS ? (out_head * gridDim.y + blockIdx.y) * n_q : out_head * n_q;
}
