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

#if IS_BFLOAT16
#define WGMMA_TYPES ".f32.bf16.bf16"
#else
#define WGMMA_TYPES ".f32.f16.f16"
#endif

constexpr int kSwizzleRowBytes = 128;   // one row of a column block
constexpr int kSwizzleColumns = 64;     // 16-bit elements per column block
constexpr int kSwizzleAtomBytes = 1024;  // 8 rows: the period of the swizzle pattern

// Bytes of a swizzled tile of Rows x Cols 16-bit elements.
template <int Rows, int Cols> constexpr int kSwizzledTileBytes = Rows * Cols * 2;

// Rows [row_start, row_start + Rows) of one head (row stride `row_stride`, contiguous
// columns) into the swizzled tile at shared address `tile` by the block's threads 0 ..
// Threads - 1; rows at or past `row_limit` become zeros (0 * NaN would otherwise reach the
// products). Each thread keeps one 16-byte column chunk and walks the rows `kRowStep`
// apart. The step is a multiple of the swizzle's 8-row period, so the chunk's swizzled
// position is the same on every row and a copy costs an address add and a bounds compare;
// the trip count is a compile-time constant, so the loop unrolls without a remainder loop
// (a loop over chunk = threadIdx.x, threadIdx.x + Threads, ... compiled to both, with
// spills, in the two-block forward: bench/NOTES-gpu.md, v13b).
template <int Rows, int Cols, int Threads>
__device__ __forceinline__ void load_swizzled_tile_async(u32 tile, const bits16* head,
                                                         i64 row_stride, i64 row_start,
                                                         i64 row_limit) {
    static_assert(Cols % kSwizzleColumns == 0, "column blocks of 64");
    constexpr int chunks_per_row = Cols / 8;
    constexpr int kRowStep = Threads / chunks_per_row;
    static_assert(Threads % chunks_per_row == 0 && kRowStep % 8 == 0,
                  "whole swizzle periods per step");
    const int c = threadIdx.x % chunks_per_row, r0 = threadIdx.x / chunks_per_row;
    const u32 first = tile + (c / 8) * (Rows * kSwizzleRowBytes) + r0 * kSwizzleRowBytes +
                      (((c % 8) ^ (r0 % 8)) << 4);
    const bits16* column = head + c * 8;
#pragma unroll
    for (int step = 0; step < (Rows + kRowStep - 1) / kRowStep; ++step) {
        const int r = r0 + step * kRowStep;
        if (Rows % kRowStep != 0 && r >= Rows) break;
        const i64 row = row_start + r;
        const bool valid = row < row_limit;
        copy_16_async(first + step * kRowStep * kSwizzleRowBytes,
                      valid ? column + row * row_stride : head, valid);
    }
}

// A wgmma shared-memory matrix descriptor with the 128-byte swizzle: start address,
// leading- and stride-dimension byte offsets (PTX ISA, "Matrix Descriptor Format").
//  * K-major operands (Q, K: rows are M or N, the 16-element K slice is contiguous):
//    `stride_bytes` = 1024 steps between 8-row groups; the leading offset is unused.
//    The k-th 16-column slice of a column block starts 32 * k bytes further on, which the
//    hardware's address-based swizzle resolves.
//  * MN-major operands (V in O = P V: rows are K, N is contiguous): `leading_bytes` steps
//    between 64-column blocks, `stride_bytes` = 1024 between 8-row groups of K.
__device__ __forceinline__ u64 swizzled_descriptor(u32 address, u32 leading_bytes,
                                                   u32 stride_bytes) {
    return static_cast<u64>((address & 0x3FFFF) >> 4) |
           (static_cast<u64>((leading_bytes >> 4) & 0x3FFF) << 16) |
           (static_cast<u64>((stride_bytes >> 4) & 0x3FFF) << 32) |
           (static_cast<u64>(1) << 62);  // layout type 1: 128-byte swizzle
}

// The two uses: a K-major tile (Q, K, dO, V as the B of S and dP), and an MN-major tile whose
// 64-column blocks lie `column_block_bytes` apart (0 where the operand is one block wide).
__device__ __forceinline__ u64 k_major_descriptor(u32 address) {
    return swizzled_descriptor(address, 0, kSwizzleAtomBytes);
}
__device__ __forceinline__ u64 mn_major_descriptor(u32 address, u32 column_block_bytes) {
    return swizzled_descriptor(address, column_block_bytes, kSwizzleAtomBytes);
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

template <> __device__ __forceinline__ void wgmma_ss<64>(float (&d)[8][4], u64 a, u64 b,
                                                      int accumulate) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16" WGMMA_TYPES " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "%32, %33, p, 1, 1, 0, 0; }\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
          "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
          "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "l"(a), "l"(b), "r"(accumulate));
}

template <> __device__ __forceinline__ void wgmma_rs_transposed_b<64>(float (&d)[8][4],
                                                                    const u32 (&a)[4], u64 b,
                                                                    int accumulate) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16" WGMMA_TYPES " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, 1; }\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
          "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
          "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}

template <> __device__ __forceinline__ void wgmma_ss<128>(float (&d)[16][4], u64 a, u64 b,
                                                      int accumulate) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16" WGMMA_TYPES " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1, 0, 0; }\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
          "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
          "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),
          "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),
          "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),
          "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]),
          "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
          "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]),
          "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
          "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
          "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "l"(a), "l"(b), "r"(accumulate));
}

template <> __device__ __forceinline__ void wgmma_rs_transposed_b<128>(float (&d)[16][4],
                                                                    const u32 (&a)[4], u64 b,
                                                                    int accumulate) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16" WGMMA_TYPES " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, p, 1, 1, 1; }\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
          "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
          "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),
          "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),
          "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),
          "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]),
          "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
          "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]),
          "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
          "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
          "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}

template <> __device__ __forceinline__ void wgmma_ss_transposed<64>(float (&d)[8][4], u64 a,
                                                                 u64 b, int accumulate) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16" WGMMA_TYPES " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "%32, %33, p, 1, 1, 1, 1; }\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
          "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
          "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "l"(a), "l"(b), "r"(accumulate));
}
