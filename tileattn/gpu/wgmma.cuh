// Hopper (sm_90a) building blocks of the wgmma kernels: shared-memory matrix descriptors
// over 128-byte-swizzled tiles, tile loads that write that swizzle with cp.async, and the
// warpgroup matrix instructions with their fences.
//
// Tiles live in shared memory as column blocks of 64 16-bit elements: a tile of R rows and
// C columns is C / 64 blocks of [R][64], each row 128 bytes, and within every group of 8
// rows (1024 bytes) the 16-byte chunk c of row r sits at chunk c ^ (r % 8). That is the
// hardware's 128-byte swizzle (address bits 4-6 XOR bits 7-9), so every tile base must be
// 1024-byte aligned. It spreads the 8 rows that a tensor-core read takes at one column
// over all 32 banks without the padding the mma.sync kernels use.
#pragma once
#include "mma.cuh"
#include "sequences.cuh"

#if IS_BFLOAT16
#define WGMMA_TYPES ".f32.bf16.bf16"
#else
#define WGMMA_TYPES ".f32.f16.f16"
#endif

// A tile of Width columns (a multiple of 16) is stored in column blocks of
// Swizzled<Width>::kColumns elements, the widest of 64, 32 and 16 that divides Width, with
// the matching hardware swizzle (128, 64 or 32 bytes a row). Within each group of 8 rows the
// 16-byte chunk c of row r sits at chunk c ^ ((r * kRowBytes / 128) % (kRowBytes / 16)):
// address bits 4.. XOR bits 7.., the pattern the tensor cores decode. Every column block
// then covers the whole 8-row period, so a wgmma operand of N = Width columns (MN-major) or
// K = 16-column slices (K-major) is a canonical layout for any Width, and no column of a
// padded head dim is wasted beyond the next multiple of 16.
template <int Width> struct Swizzled {
    static_assert(Width % 16 == 0 && Width <= 512, "tile widths are multiples of 16");
    static constexpr int kColumns = Width % 64 == 0 ? 64 : Width % 32 == 0 ? 32 : 16;
    static constexpr int kRowBytes = kColumns * 2;
    static constexpr int kAtomBytes = 8 * kRowBytes;  // the pattern's period: 8 rows
    static constexpr int kChunks = kColumns / 8;      // 16-byte chunks per row of a block
    // The descriptor's layout type: 1 = 128-byte, 2 = 64-byte, 3 = 32-byte swizzle.
    static constexpr u64 kMode = kRowBytes == 128 ? 1 : kRowBytes == 64 ? 2 : 3;
    // The chunk a row's chunk c lands on.
    static __device__ __forceinline__ int chunk(int c, int row) {
        return c ^ ((row * kRowBytes >> 7) & (kChunks - 1));
    }
    // Byte offset of the k-th 16-column slice of a tile of `rows` rows: its column block,
    // then 32 bytes per slice within the block's rows.
    static __device__ __forceinline__ u32 slice(int kk, int rows) {
        return (kk * 16 / kColumns) * rows * kRowBytes + (kk * 16 % kColumns) * 2;
    }
    // Byte offset of element (r, c) of a tile of `rows` rows: the column block, the row,
    // the swizzled 16-byte chunk, the element in it.
    static __device__ __forceinline__ u32 element(int r, int c, int rows) {
        const int c8 = c / 8;
        return (c8 / kChunks) * rows * kRowBytes + r * kRowBytes + (chunk(c8 % kChunks, r) << 4) +
               (c % 8) * 2;
    }
};

// Bytes of a swizzled tile of Rows x Width 16-bit elements (the 1024-byte alignment of
// every tile keeps each column block on its swizzle period).
template <int Rows, int Width> constexpr int kSwizzledTileBytes = Rows * Width * 2;
constexpr int kTileAlignment = 1024;

// Which rows of a Rows x Width swizzled tile this thread copies, copy by copy. When the
// threads split evenly over a row's chunks, each thread keeps one chunk and walks the rows
// `kRowStep` apart; the step is a multiple of the swizzle's 8-row period, so the chunk's
// swizzled position is the same on every row and a copy costs an address add and a bounds
// compare, with a compile-time trip count (a loop over chunk = threadIdx.x,
// threadIdx.x + Threads, ... compiled to a remainder loop, with spills, in the two-block
// forward: bench/NOTES-gpu.md, v13b). Other widths walk the chunks in that order, with the
// division by the compile-time chunk count unrolled the same way. Either way a thread's
// rows are fixed at compile time up to its index, so a paged source can look their pages
// up before the copies (sequences.cuh, PagedCopyRows).
template <int Rows, int Width, int Threads> struct SwizzledCopies {
    static constexpr int kRowChunks = Width / 8;
    static constexpr bool kFixedChunk =
        Threads % kRowChunks == 0 && (Threads / kRowChunks) % 8 == 0;
    static constexpr int kRowStep = Threads / kRowChunks;  // used when kFixedChunk
    static constexpr int kTotal = Rows * kRowChunks;
    static constexpr int kSteps =
        kFixedChunk ? (Rows + kRowStep - 1) / kRowStep : (kTotal + Threads - 1) / Threads;
    // The tile row of copy `step`, and whether this thread has that copy at all.
    static __device__ __forceinline__ int row(int step) {
        return kFixedChunk ? static_cast<int>(threadIdx.x) / kRowChunks + step * kRowStep
                           : (static_cast<int>(threadIdx.x) + step * Threads) / kRowChunks;
    }
    static __device__ __forceinline__ bool exists(int step) {
        if constexpr (kFixedChunk) return Rows % kRowStep == 0 || row(step) < Rows;
        return kTotal % Threads == 0 || static_cast<int>(threadIdx.x) + step * Threads < kTotal;
    }
};

// Rows [row_start, row_start + Rows) of one head (row stride `row_stride`, contiguous
// columns, Columns of them) into the swizzled Rows x Width tile at shared address `tile` by
// the block's threads 0 .. Threads - 1, in the order of SwizzledCopies; rows at or past
// `row_limit` and the columns past Columns become zeros. ChunkBytes (16, 8, 4 or 2) is
// the widest copy the rows' alignment allows (2 for an odd head dim).
template <int Rows, int Columns, int Width, int Threads, int ChunkBytes = 16, class Source>
__device__ __forceinline__ void load_swizzled_rows_async(u32 tile, const Source& source,
                                                         i64 row_start, i64 row_limit) {
    using S = Swizzled<Width>;
    using Copies = SwizzledCopies<Rows, Width, Threads>;
    constexpr int kRowChunks = Copies::kRowChunks;
    const auto rows = source.for_tile(row_start, Rows);
    if constexpr (Copies::kFixedChunk) {
        const int c = threadIdx.x % kRowChunks, r0 = Copies::row(0);
        const u32 first = tile + (c / S::kChunks) * (Rows * S::kRowBytes) +
                          r0 * S::kRowBytes + (S::chunk(c % S::kChunks, r0) << 4);
#pragma unroll
        for (int step = 0; step < Copies::kSteps; ++step) {
            if (!Copies::exists(step)) break;
            const i64 row = row_start + r0 + step * Copies::kRowStep;
            const bool valid = row < row_limit;
            copy_row_chunk<Columns, Width, ChunkBytes>(
                first + step * Copies::kRowStep * S::kRowBytes,
                copy_source(rows, step, row, valid), rows.fallback(), c * 8, valid);
        }
    } else {
#pragma unroll
        for (int step = 0; step < Copies::kSteps; ++step) {
            if (!Copies::exists(step)) break;
            const int i = threadIdx.x + step * Threads;
            const int r = i / kRowChunks, c = i % kRowChunks;
            const i64 row = row_start + r;
            const bool valid = row < row_limit;
            copy_row_chunk<Columns, Width, ChunkBytes>(
                tile + (c / S::kChunks) * (Rows * S::kRowBytes) + r * S::kRowBytes +
                    (S::chunk(c % S::kChunks, r) << 4),
                copy_source(rows, step, row, valid), rows.fallback(), c * 8, valid);
        }
    }
}

// The same for rows `row_stride` apart from `head`.
template <int Rows, int Columns, int Width, int Threads, int ChunkBytes = 16>
__device__ __forceinline__ void load_swizzled_tile_async(u32 tile, const bits16* head,
                                                         i64 row_stride, i64 row_start,
                                                         i64 row_limit) {
    load_swizzled_rows_async<Rows, Columns, Width, Threads, ChunkBytes>(
        tile, StridedRows<bits16>{head, row_stride}, row_start, row_limit);
}

// A wgmma shared-memory matrix descriptor for a swizzled tile: start address, leading- and
// stride-dimension byte offsets, layout type (PTX ISA, "Matrix Descriptor Format").
//  * K-major operands (Q, K: rows are M or N, the 16-element K slice is contiguous):
//    `stride_bytes` = one swizzle period (8 rows) between 8-row groups; the leading
//    offset is unused. A slice's start is Swizzled::slice bytes in, which the hardware's
//    address-based swizzle resolves.
//  * MN-major operands (V in O = P V: rows are K, N is contiguous): `leading_bytes` steps
//    between column blocks, `stride_bytes` = one period between 8-row groups of K.
template <int Width>
__device__ __forceinline__ u64 swizzled_descriptor(u32 address, u32 leading_bytes) {
    using S = Swizzled<Width>;
    return static_cast<u64>((address & 0x3FFFF) >> 4) |
           (static_cast<u64>((leading_bytes >> 4) & 0x3FFF) << 16) |
           (static_cast<u64>((S::kAtomBytes >> 4) & 0x3FFF) << 32) | (S::kMode << 62);
}

// The two uses: a K-major tile of Width columns (Q, K, dO, V as the B of S and dP), and an
// MN-major one whose column blocks lie `column_block_bytes` apart.
template <int Width> __device__ __forceinline__ u64 k_major_descriptor(u32 address) {
    return swizzled_descriptor<Width>(address, 0);
}
template <int Width>
__device__ __forceinline__ u64 mn_major_descriptor(u32 address, u32 column_block_bytes) {
    return swizzled_descriptor<Width>(address, column_block_bytes);
}

// Orders this thread's earlier register and shared accesses before the warpgroup's next
// wgmma reads its operands (needed whenever accumulators or A fragments were written by
// ordinary instructions since the last wgmma).
__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int Pending> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Pending) : "memory");
}
// Shared memory written through the generic proxy (cp.async, st.shared) and read next by
// wgmma (the async proxy) needs this fence in each writing thread before the barrier.
__device__ __forceinline__ void fence_shared_for_async_proxy() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Bulk reduction by the TMA unit: dst[0 .. bytes / 4) += the floats at shared address src,
// performed in L2 without holding the issuing warp. `bytes` is a multiple of 16 and both
// addresses are 16-byte aligned. The source may be rewritten only after
// bulk_wait_read<0>() in the issuing thread (groups are per thread).
__device__ __forceinline__ void bulk_reduce_add(float* dst, u32 src, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 ::"l"(dst), "r"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() {
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// This thread's bulk groups but the newest `Pending` have read their source.
template <int Pending> __device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(Pending) : "memory");
}
// This thread's bulk groups but the newest `Pending` are complete (written).
template <int Pending> __device__ __forceinline__ void bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(Pending) : "memory");
}
// A barrier for this thread's warpgroup alone (named barrier 1 + warpgroup; 0 is
// __syncthreads').
__device__ __forceinline__ void warpgroup_sync() {
    asm volatile("bar.sync %0, 128;\n" ::"r"(threadIdx.x / 128 + 1) : "memory");
}

// Pins accumulator registers in place around wgmma: without it the compiler may move
// a value between an asynchronous wgmma's issue and its wait.
template <int Frags>
__device__ __forceinline__ void wgmma_pin(float (&d)[Frags][4]) {
#pragma unroll
    for (int j = 0; j < Frags; ++j)
        asm volatile("" : "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])::"memory");
}

// d (64 x N per warpgroup; per warp the m16n8 accumulator layout of mma.sync repeated over
// N / 8 fragments) = A B (+ d when `accumulate`), A and B from shared memory, both K-major.
template <int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 8][4], u64 a, u64 b, int accumulate);
// d = A B (+ d when `accumulate`) with A and B from shared memory, both MN-major (A's rows
// and B's columns contiguous: dQ = dS K with dS stored transposed, keys x queries).
template <int N>
__device__ __forceinline__ void wgmma_ss_transposed(float (&d)[N / 8][4], u64 a, u64 b,
                                                    int accumulate);
// d += A B with A from registers (each warp's 16 rows in the m16n8k16 A layout) and B
// MN-major in shared memory (transposed: V's rows are the K dimension).
template <int N>
__device__ __forceinline__ void wgmma_rs_transposed_b(float (&d)[N / 8][4], const u32 (&a)[4],
                                                      u64 b, int accumulate);

// The instructions for every N a kernel uses (multiples of 16 up to 256). Inline PTX names
// its operands by number, outputs first, so each N needs its register list spelled out;
// the lists below grow by one n8 fragment (four registers) a line, and each instantiation
// names the numbers of the operands that follow its N / 2 accumulators.
#define WGMMA_R4(a, b, c, d) "%" #a ", %" #b ", %" #c ", %" #d
#define WGMMA_REGS_2 WGMMA_R4(0, 1, 2, 3) ", " WGMMA_R4(4, 5, 6, 7)
#define WGMMA_REGS_4 WGMMA_REGS_2 ", " WGMMA_R4(8, 9, 10, 11) ", " WGMMA_R4(12, 13, 14, 15)
#define WGMMA_REGS_6 WGMMA_REGS_4 ", " WGMMA_R4(16, 17, 18, 19) ", " WGMMA_R4(20, 21, 22, 23)
#define WGMMA_REGS_8 WGMMA_REGS_6 ", " WGMMA_R4(24, 25, 26, 27) ", " WGMMA_R4(28, 29, 30, 31)
#define WGMMA_REGS_10 WGMMA_REGS_8 ", " WGMMA_R4(32, 33, 34, 35) ", " WGMMA_R4(36, 37, 38, 39)
#define WGMMA_REGS_12 WGMMA_REGS_10 ", " WGMMA_R4(40, 41, 42, 43) ", " WGMMA_R4(44, 45, 46, 47)
#define WGMMA_REGS_14 WGMMA_REGS_12 ", " WGMMA_R4(48, 49, 50, 51) ", " WGMMA_R4(52, 53, 54, 55)
#define WGMMA_REGS_16 WGMMA_REGS_14 ", " WGMMA_R4(56, 57, 58, 59) ", " WGMMA_R4(60, 61, 62, 63)
#define WGMMA_REGS_18 WGMMA_REGS_16 ", " WGMMA_R4(64, 65, 66, 67) ", " WGMMA_R4(68, 69, 70, 71)
#define WGMMA_REGS_20 WGMMA_REGS_18 ", " WGMMA_R4(72, 73, 74, 75) ", " WGMMA_R4(76, 77, 78, 79)
#define WGMMA_REGS_22 WGMMA_REGS_20 ", " WGMMA_R4(80, 81, 82, 83) ", " WGMMA_R4(84, 85, 86, 87)
#define WGMMA_REGS_24 WGMMA_REGS_22 ", " WGMMA_R4(88, 89, 90, 91) ", " WGMMA_R4(92, 93, 94, 95)
#define WGMMA_REGS_26 WGMMA_REGS_24 ", " WGMMA_R4(96, 97, 98, 99) ", " WGMMA_R4(100, 101, 102, 103)
#define WGMMA_REGS_28 WGMMA_REGS_26 ", " WGMMA_R4(104, 105, 106, 107) ", " WGMMA_R4(108, 109, 110, 111)
#define WGMMA_REGS_30 WGMMA_REGS_28 ", " WGMMA_R4(112, 113, 114, 115) ", " WGMMA_R4(116, 117, 118, 119)
#define WGMMA_REGS_32 WGMMA_REGS_30 ", " WGMMA_R4(120, 121, 122, 123) ", " WGMMA_R4(124, 125, 126, 127)

#define WGMMA_D(f) "+f"(d[f][0]), "+f"(d[f][1]), "+f"(d[f][2]), "+f"(d[f][3])
#define WGMMA_ACC_2 WGMMA_D(0), WGMMA_D(1)
#define WGMMA_ACC_4 WGMMA_ACC_2, WGMMA_D(2), WGMMA_D(3)
#define WGMMA_ACC_6 WGMMA_ACC_4, WGMMA_D(4), WGMMA_D(5)
#define WGMMA_ACC_8 WGMMA_ACC_6, WGMMA_D(6), WGMMA_D(7)
#define WGMMA_ACC_10 WGMMA_ACC_8, WGMMA_D(8), WGMMA_D(9)
#define WGMMA_ACC_12 WGMMA_ACC_10, WGMMA_D(10), WGMMA_D(11)
#define WGMMA_ACC_14 WGMMA_ACC_12, WGMMA_D(12), WGMMA_D(13)
#define WGMMA_ACC_16 WGMMA_ACC_14, WGMMA_D(14), WGMMA_D(15)
#define WGMMA_ACC_18 WGMMA_ACC_16, WGMMA_D(16), WGMMA_D(17)
#define WGMMA_ACC_20 WGMMA_ACC_18, WGMMA_D(18), WGMMA_D(19)
#define WGMMA_ACC_22 WGMMA_ACC_20, WGMMA_D(20), WGMMA_D(21)
#define WGMMA_ACC_24 WGMMA_ACC_22, WGMMA_D(22), WGMMA_D(23)
#define WGMMA_ACC_26 WGMMA_ACC_24, WGMMA_D(24), WGMMA_D(25)
#define WGMMA_ACC_28 WGMMA_ACC_26, WGMMA_D(26), WGMMA_D(27)
#define WGMMA_ACC_30 WGMMA_ACC_28, WGMMA_D(28), WGMMA_D(29)
#define WGMMA_ACC_32 WGMMA_ACC_30, WGMMA_D(30), WGMMA_D(31)

// N, its fragment count F = N / 8, and the numbers of the operands after the 4 F
// accumulators: %4F, %4F+1, ... (the shared-memory forms take two descriptors and the
// flag; the register form four A registers, the descriptor and the flag).
#define WGMMA_SHAPE(N, F, O0, O1, O2, O3, O4, O5)                                          \
    template <>                                                                             \
    __device__ __forceinline__ void wgmma_ss<N>(float (&d)[F][4], u64 a, u64 b,             \
                                                int accumulate) {                           \
        asm volatile("{ .reg .pred p; setp.ne.b32 p, " O2 ", 0;\n"                          \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16" WGMMA_TYPES               \
                     " {" WGMMA_REGS_##F "}, " O0 ", " O1 ", p, 1, 1, 0, 0; }\n"            \
                     : WGMMA_ACC_##F                                                        \
                     : "l"(a), "l"(b), "r"(accumulate));                                    \
    }                                                                                       \
    template <>                                                                             \
    __device__ __forceinline__ void wgmma_ss_transposed<N>(float (&d)[F][4], u64 a, u64 b,  \
                                                           int accumulate) {                \
        asm volatile("{ .reg .pred p; setp.ne.b32 p, " O2 ", 0;\n"                          \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16" WGMMA_TYPES               \
                     " {" WGMMA_REGS_##F "}, " O0 ", " O1 ", p, 1, 1, 1, 1; }\n"            \
                     : WGMMA_ACC_##F                                                        \
                     : "l"(a), "l"(b), "r"(accumulate));                                    \
    }                                                                                       \
    template <>                                                                             \
    __device__ __forceinline__ void wgmma_rs_transposed_b<N>(                               \
        float (&d)[F][4], const u32 (&a)[4], u64 b, int accumulate) {                       \
        asm volatile("{ .reg .pred p; setp.ne.b32 p, " O5 ", 0;\n"                          \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16" WGMMA_TYPES               \
                     " {" WGMMA_REGS_##F "}, {" O0 ", " O1 ", " O2 ", " O3 "}, " O4         \
                     ", p, 1, 1, 1; }\n"                                                    \
                     : WGMMA_ACC_##F                                                        \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate)); \
    }

// Every N, its fragment count and operand numbers, as X(N, F, O0, .., O5) (the tf32
// wrappers of wgmma_tf32.cuh take the same list).
#define WGMMA_FOR_EACH_N(X) \
    X(16, 2, "%8", "%9", "%10", "%11", "%12", "%13") \
    X(32, 4, "%16", "%17", "%18", "%19", "%20", "%21") \
    X(48, 6, "%24", "%25", "%26", "%27", "%28", "%29") \
    X(64, 8, "%32", "%33", "%34", "%35", "%36", "%37") \
    X(80, 10, "%40", "%41", "%42", "%43", "%44", "%45") \
    X(96, 12, "%48", "%49", "%50", "%51", "%52", "%53") \
    X(112, 14, "%56", "%57", "%58", "%59", "%60", "%61") \
    X(128, 16, "%64", "%65", "%66", "%67", "%68", "%69") \
    X(144, 18, "%72", "%73", "%74", "%75", "%76", "%77") \
    X(160, 20, "%80", "%81", "%82", "%83", "%84", "%85") \
    X(176, 22, "%88", "%89", "%90", "%91", "%92", "%93") \
    X(192, 24, "%96", "%97", "%98", "%99", "%100", "%101") \
    X(208, 26, "%104", "%105", "%106", "%107", "%108", "%109") \
    X(224, 28, "%112", "%113", "%114", "%115", "%116", "%117") \
    X(240, 30, "%120", "%121", "%122", "%123", "%124", "%125") \
    X(256, 32, "%128", "%129", "%130", "%131", "%132", "%133")

WGMMA_FOR_EACH_N(WGMMA_SHAPE)
