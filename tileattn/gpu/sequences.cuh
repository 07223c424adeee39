// Variable-length batches and paged K/V (SPEC "Variable-length batches and paged K/V"):
// which query tile a block owns, which rows and keys form its sequence, and where a key row
// lies in memory. Every kernel family reads its problem through these, so a dense call and
// a variable-length one differ only in the compile-time switches below.
//
// VARLEN (0/1): the grid walks a tile table of (sequence, first row) pairs, built on the
// host longest first (tileattn/gpu/varlen.py), times the query heads: tiles past a
// sequence's end are never launched, and each block reads its sequence's descriptor (the
// columns of tileattn.options.DESCRIPTOR_COLUMNS): its batch element, first row and row
// count, first key and key count, band offset (bottom-right per sequence) and index (its
// dropout heads and ALiBi row are index * Hq + h).
// PAGED (0/1): keys are read through a block table: logical key j of batch element b is
// slot j % page_size of page table[b][j / page_size] of the K and V pools, whose "batch"
// stride is the page stride. Page ids are clamped into the pool, so a bad table (the
// caller's opt-out of the contents check) gives wrong numbers, never a fault.
#pragma once
#include "common.cuh"

#ifndef VARLEN
#define VARLEN 0
#endif
#ifndef STRIDED_OUT
#define STRIDED_OUT 0
#endif
#ifndef PAGED
#define PAGED 0
#endif

// The tables of a variable-length call, passed to every kernel (null and 0 when dense).
struct SequenceTables {
    const i64* descriptors;  // [S][7]: batch, row base, rows, key base, keys, band, index
    const i64* tiles;        // [entries][2]: sequence, first row (or first key) of a tile
    const i64* block_table;  // [B][table_stride] page ids (PAGED)
    i64 table_stride;
    i64 page_size;
    i64 n_pages;
};

struct Sequence {
    i64 batch;
    i64 row_base;
    i64 rows;
    i64 key_base;
    i64 keys;
    i64 band;
    i64 index;
};

__device__ __forceinline__ Sequence sequence_at(const i64* descriptors, i64 s) {
    const i64* d = descriptors + s * 7;
    return {d[0], d[1], d[2], d[3], d[4], d[5], d[6]};
}

// The query tile a block owns and the sequence it lies in, in the sequence's own indices.
struct QueryBlock {
    i64 bh;          // dropout hash and ALiBi head: index * Hq + head (dense: batch * Hq + head)
    i64 out_head;    // flat (batch, head) of the o, lse (and dq) arrays
    i64 batch;
    int head;
    int kv_head;
    i64 row_start;   // the tile's first row, within the sequence
    i64 n_q;         // the sequence's rows
    i64 n_k;         // the sequence's keys
    i64 row_base;    // the sequence's first row in the arrays' row axis
    i64 key_base;    // the sequence's first key (0 when paged: keys are logical)
    i64 band_offset;
};

// Dense calls keep `query_tile_of_block`'s order; a variable-length call takes entry
// blockIdx.x / Hq of the tile table (longest first, so every head's long tiles start
// before any short one), `band_shift` then being the global-position shift of the band
// (row_offset - col_offset) that each sequence's bottom-right offset is added to.
__device__ __forceinline__ QueryBlock query_block(int block_rows, i64 n_q, i64 n_k,
                                                  i64 band_offset, int n_q_heads,
                                                  int group_size, const SequenceTables& tables) {
    QueryBlock block;
#if VARLEN
    const i64 entry = blockIdx.x / n_q_heads;
    block.head = static_cast<int>(blockIdx.x % n_q_heads);
    const Sequence sequence = sequence_at(tables.descriptors, tables.tiles[2 * entry]);
    block.row_start = tables.tiles[2 * entry + 1];
    block.batch = sequence.batch;
    block.bh = sequence.index * n_q_heads + block.head;
    block.out_head = sequence.batch * n_q_heads + block.head;
    block.n_q = sequence.rows;
    block.n_k = sequence.keys;
    block.row_base = sequence.row_base;
    block.key_base = sequence.key_base;
    block.band_offset = sequence.band + band_offset;
#else
    const QueryTile owned = query_tile_of_block(n_q, block_rows, n_q_heads, group_size);
    block.head = owned.head;
    block.row_start = owned.tile * block_rows;
    block.batch = owned.batch;
    block.bh = block.out_head = owned.bh;
    block.n_q = n_q;
    block.n_k = n_k;
    block.row_base = block.key_base = 0;
    block.band_offset = band_offset;
#endif
    block.kv_head = block.head / group_size;
    return block;
}

// Row 0 of a query block's sequence, in its head, of an output of `Width` columns a row:
// in `out` itself, or under SPLIT_KEYS in this share's float32 partials (common.cuh).
// Kernels call it where they store, so the key loop keeps no output pointer live.
template <int Width, typename T>
__device__ __forceinline__ typename SplitOutput<SPLIT_KEYS, T>::type* sequence_rows(
    T* out, const QueryBlock& block, i64 n_q_total) {
    using Out = typename SplitOutput<SPLIT_KEYS, T>::type;
    return reinterpret_cast<Out*>(out) +
           (split_head_row0(block.out_head, n_q_total) + block.row_base) * Width;
}

// Where a query block's output rows lie. STRIDED_OUT (0/1): o has other batch, head and row
// strides than a contiguous (B, H, N, Dv) array (a "bshd" result, written in the caller's
// order, rows H x Dv apart); a contiguous o keeps the shorter address arithmetic of
// compile-time widths, whose registers the tightest tiles need (ptxas: 8-24 bytes of
// spills at 128 registers otherwise). Under SPLIT_KEYS the share's float32 partials are
// contiguous rows of `Width` (common.cuh).
template <typename Out> struct OutputRows {
    Out* row0;   // row 0 of the block's sequence, in its head
    int stride;  // elements from a row to the next (H x Dv at most: 32 bits, which keep the
                 // epilogue's address arithmetic within the registers it had)
};

struct OutputStrides {
    i64 batch, head, row;
};

template <int Width, typename T>
__device__ __forceinline__ OutputRows<typename SplitOutput<SPLIT_KEYS, T>::type> output_rows(
    T* out, const QueryBlock& block, i64 n_q_total, OutputStrides strides) {
    if constexpr (SPLIT_KEYS || !STRIDED_OUT) {
        return {sequence_rows<Width>(out, block, n_q_total), Width};
    } else {
        return {out + block.batch * strides.batch + block.head * strides.head +
                    block.row_base * strides.row,
                static_cast<int>(strides.row)};
    }
}

// Row `row` of o in the flat (batch, head, query row) order of lse: its first element.
__device__ __forceinline__ i64 flat_row_offset(i64 row, int n_q_heads, i64 n_q,
                                               OutputStrides strides) {
    const i64 query = row % n_q, batch_head = row / n_q;
    return batch_head / n_q_heads * strides.batch + batch_head % n_q_heads * strides.head +
           query * strides.row;
}

// Packed decode row `packed` of (batch, kv head) in o: query head kv_head * group + packed /
// n_q, query row packed % n_q. Packed rows are few (group x Nq <= 128): 32-bit division.
__device__ __forceinline__ i64 packed_row_offset(i64 batch, int kv_head, int group_size,
                                                 int n_q, int packed, OutputStrides strides) {
    return batch * strides.batch + (kv_head * group_size + packed / n_q) * strides.head +
           (packed % n_q) * strides.row;
}

// A dense tile table (tileattn/gpu/varlen.py: Sequences.dense_grid, a forward whose
// lengths stay on the device) lists every tile of the padded row axis: a tile at or past
// its sequence's rows has nothing to do. Host-built tables never list one.
__device__ __forceinline__ bool tile_past_rows(const QueryBlock& block) {
    return VARLEN && block.row_start >= block.n_q;
}

// The key tile a block owns (the dK/dV kernels) and the sequence it lies in.
struct KeyBlock {
    i64 index;       // the sequence's index: its query head h's dropout and ALiBi head is
                     // index * Hq + h (dense: the batch element)
    i64 batch;
    int kv_head;
    i64 out_head;    // flat (batch, kv head) of the dk and dv arrays
    i64 key_start;   // the tile's first key, within the sequence
    i64 n_q;
    i64 n_k;
    i64 row_base;
    i64 key_base;
    i64 band_offset;
};

// Dense calls keep `key_tile_of_block`'s order (`kTileMajor` as there); a variable-length
// call takes entry blockIdx.x / Hkv of the key-tile table.
template <bool kTileMajor = kBandedGrid>
__device__ __forceinline__ KeyBlock key_block(int block_keys, i64 n_q, i64 n_k,
                                              i64 band_offset, int n_kv_heads,
                                              const SequenceTables& tables,
                                              i64 block_index = blockIdx.x) {
    KeyBlock block;
#if VARLEN
    const i64 entry = block_index / n_kv_heads;
    block.kv_head = static_cast<int>(block_index % n_kv_heads);
    const Sequence sequence = sequence_at(tables.descriptors, tables.tiles[2 * entry]);
    block.key_start = tables.tiles[2 * entry + 1];
    block.index = sequence.index;
    block.batch = sequence.batch;
    block.n_q = sequence.rows;
    block.n_k = sequence.keys;
    block.row_base = sequence.row_base;
    block.key_base = sequence.key_base;
    block.band_offset = sequence.band + band_offset;
#else
    const KeyTile owned = key_tile_of_block<kTileMajor>(n_k, block_keys, n_kv_heads,
                                                        block_index);
    block.kv_head = owned.kv_head;
    block.key_start = owned.tile * block_keys;
    block.index = block.batch = owned.batch;
    block.n_q = n_q;
    block.n_k = n_k;
    block.row_base = block.key_base = 0;
    block.band_offset = band_offset;
#endif
    block.out_head = block.batch * n_kv_heads + block.kv_head;
    return block;
}

// Where a key block's dK (or dV) rows lie, as `output_rows` for query blocks: row 0 of its
// sequence in its kv head, contiguous (B, Hkv, Nk, Width) rows or, under STRIDED_OUT, the
// array's own strides (a "bshd" gradient written in the caller's order). The dK/dV
// kernels' partial heads of cut GQA groups (GROUP_SPLITS) are contiguous: the launcher
// never compiles STRIDED_OUT with them.
template <int Width, typename T>
__device__ __forceinline__ OutputRows<T> key_output_rows(T* out, const KeyBlock& block,
                                                         i64 n_k_total, OutputStrides strides) {
    if constexpr (!STRIDED_OUT) {
        return {out + (block.out_head * n_k_total + block.key_base) * Width, Width};
    } else {
        return {out + block.batch * strides.batch + block.kv_head * strides.head +
                    block.key_base * strides.row,
                static_cast<int>(strides.row)};
    }
}

// ------------------------------------------------------------------ where a row lies

// Rows at a fixed stride from a base (a dense head). A tile loader asks `for_tile` first:
// the row sources below answer with what serves that tile's rows fastest.
template <typename T> struct StridedRows {
    const T* base;
    i64 stride;
    // `valid` is false for rows past the end, which are zero-filled, never read: any
    // address will do, and a strided one costs nothing to form.
    __device__ __forceinline__ const T* at(i64 row, bool) const { return base + row * stride; }
    __device__ __forceinline__ const T* fallback() const { return base; }
    __device__ __forceinline__ StridedRows for_tile(i64, int) const { return *this; }
};

// The packed query rows of one (batch, kv head) in the decode kernels: packed row r is
// query head kv_head * group + r / Nq (head 0 of the group at `base`), query row r % Nq.
template <typename T> struct PackedQueryRows {
    const T* base;
    i64 head_stride;
    i64 row_stride;
    int n_q;
    __device__ __forceinline__ const T* at(i64 packed, bool) const {
        const int r = static_cast<int>(packed);
        return base + (r / n_q) * head_stride + (r % n_q) * row_stride;
    }
    __device__ __forceinline__ const T* fallback() const { return base; }
    __device__ __forceinline__ PackedQueryRows for_tile(i64, int) const { return *this; }
};

template <typename T> struct PagedTile;

// Logical key rows of one (batch element, kv head) through its block-table row.
template <typename T> struct PagedRows {
    const T* pool;       // the pool at this kv head (page 0, slot 0)
    const i64* table;    // this batch element's row of the block table
    i64 page_size;
    i64 page_stride;
    i64 slot_stride;
    i64 last_page;
    int page_shift;      // log2(page_size) for a power of two (what servers use), else -1

    __device__ __forceinline__ i64 page_of(i64 row) const {
        return page_shift >= 0 ? row >> page_shift : row / page_size;
    }
    // The index of `row`'s page in the table row, for a page size known to be a power of
    // two or not.
    template <bool kPowerOfTwo> __device__ __forceinline__ i64 page_index(i64 row) const {
        return kPowerOfTwo ? row >> page_shift : row / page_size;
    }
    __device__ __forceinline__ i64 clamped(i64 page) const {
        return min(max(page, i64(0)), last_page);
    }
    __device__ __forceinline__ const T* at(i64 row, bool valid) const {
        if (!valid) return pool;  // past the sequence: the table may not name a page there
        const i64 index = page_of(row);
        const i64 page = min(max(table[index], i64(0)), last_page);
        return pool + page * page_stride + (row - index * page_size) * slot_stride;
    }
    __device__ __forceinline__ const T* fallback() const { return pool; }
    __device__ __forceinline__ PagedTile<T> for_tile(i64 row_start, int rows) const;
    // The block-table entries of the rows this thread copies (Copies: wgmma.cuh's
    // SwizzledCopies) of the tile at `row_start`, as read: clamped where they are used, so
    // that nothing waits here for the read. 0 for rows at or past `row_limit`, whose copies
    // read nothing.
    template <class Copies, bool kPowerOfTwo>
    __device__ __forceinline__ void fetch_entries(i64 row_start, i64 row_limit,
                                                  i64 (&entries)[Copies::kSteps]) const {
#pragma unroll
        for (int step = 0; step < Copies::kSteps; ++step) {
            const i64 row = row_start + Copies::row(step);
            entries[step] = Copies::exists(step) && row < row_limit
                                ? table[page_index<kPowerOfTwo>(row)]
                                : i64(0);
        }
    }
};

// The rows of one tile: when they lie in one page (a page of at least the tile's height,
// which is every tile of an aligned grid then), a strided run from one table lookup per
// tile; otherwise a lookup per row. The test is the same for every thread of the block.
template <typename T> struct PagedTile {
    const T* base;  // row row0's address when the tile lies in one page, else null
    i64 row0;
    PagedRows<T> pages;
    __device__ __forceinline__ const T* at(i64 row, bool valid) const {
        if (base != nullptr) return base + (row - row0) * pages.slot_stride;
        return pages.at(row, valid);
    }
    __device__ __forceinline__ const T* fallback() const { return pages.pool; }
};

template <typename T>
__device__ __forceinline__ PagedTile<T> PagedRows<T>::for_tile(i64 row_start, int rows) const {
    const bool one_page = page_of(row_start) == page_of(row_start + rows - 1);
    return {one_page ? at(row_start, true) : nullptr, row_start, *this};
}

// The rows one thread copies of a paged tile, with their pages known beforehand (the
// block-table entries read by PagedRows::fetch_entries a tile ahead in the wgmma forward,
// clamped once for K and V): a copy's address is then two 32 x 64-bit products and adds,
// with no branch (a row past the end gets page 0's address, which its zero-filling copy
// does not read). A lookup per row put a dependent table read, its clamp and branches
// between a tile's barrier and its copies, on the Hopper forward's critical path
// (bench/NOTES-gpu.md, v28 and v34).
template <typename T, int Steps, bool kPowerOfTwo> struct PagedCopyRows {
    PagedRows<T> pages;
    u32 page[Steps];  // clamped into the pool
    __device__ __forceinline__ const T* at_copy(int step, i64 row) const {
        const i64 slot = kPowerOfTwo ? static_cast<i64>(static_cast<u32>(row) &
                                                        static_cast<u32>(pages.page_size - 1))
                                     : row % pages.page_size;
        return pages.pool + static_cast<i64>(page[step]) * pages.page_stride +
               slot * pages.slot_stride;
    }
    __device__ __forceinline__ const T* fallback() const { return pages.pool; }
    __device__ __forceinline__ PagedCopyRows for_tile(i64, int) const { return *this; }
};

// The address of a tile loader's copy `step` (row `row`): from the row alone, except where
// the source holds each copy's page already.
template <class Rows>
__device__ __forceinline__ auto copy_source(const Rows& rows, int, i64 row, bool valid) {
    return rows.at(row, valid);
}
template <typename T, int Steps, bool kPowerOfTwo>
__device__ __forceinline__ const T* copy_source(const PagedCopyRows<T, Steps, kPowerOfTwo>& rows,
                                                int step, i64 row, bool) {
    return rows.at_copy(step, row);
}

#if PAGED
template <typename T> using KeyRows = PagedRows<T>;
#else
template <typename T> using KeyRows = StridedRows<T>;
#endif

// K (or V) rows of a block's (batch element, kv head): `array` with its batch (page), head
// and row strides; dense and packed calls start at the sequence's first key.
template <typename T>
__device__ __forceinline__ KeyRows<T> key_rows(const T* array, i64 batch, int kv_head,
                                               i64 batch_stride, i64 head_stride,
                                               i64 row_stride, i64 key_base,
                                               const SequenceTables& tables) {
#if PAGED
    const bool power_of_two = (tables.page_size & (tables.page_size - 1)) == 0;
    return {array + kv_head * head_stride, tables.block_table + batch * tables.table_stride,
            tables.page_size, batch_stride, row_stride, tables.n_pages - 1,
            power_of_two ? __ffsll(tables.page_size) - 1 : -1};
#else
    return {array + batch * batch_stride + kv_head * head_stride + key_base * row_stride,
            row_stride};
#endif
}

// The kernels' trailing parameters that carry the tables (tileattn/gpu/varlen.py passes
// them, null and 0 for a dense call), and the tables they make.
#define SEQUENCE_PARAMETERS                                                                  \
    const i64 *sequence_descriptors, const i64 *sequence_tiles, const i64 *block_table,      \
        i64 table_stride, i64 page_size, i64 n_pages
#define SEQUENCE_TABLES                                                                      \
    SequenceTables {                                                                         \
        sequence_descriptors, sequence_tiles, block_table, table_stride, page_size, n_pages \
    }
