#pragma once
#include "mma.cuh"

// Masked entries contribute nothing to a tile's products, not 0 x NaN (SPEC, "Errors"), on
// the tensor cores: the GPU counterpart of tileattn/cpu/kept_products.py.
//
// A masked score is selected to -inf, so its P (and, by select, its dS) is 0, but a tensor-
// core product still multiplies it by the other operand: a NaN or inf in V (or K, Q, dO in
// the backward) at a key or query that a row does not keep would reach that row. Only
// tiles that the mask cuts hold masked entries. There, the kernel scans the streamed or
// owned operand's tile in shared memory (tile_has_non_finite, ORed over the block); only if
// it holds a non-finite element do the kept pairs' products with those elements go to CUDA
// cores with IEEE arithmetic (add_kept_non_finite_values: a kept p = 0 times inf stays
// NaN), after which the elements are zeroed in shared memory (zero_non_finite) and the
// tensor-core product sums every other term, the masked ones as 0 x 0. Tiles the mask
// keeps whole have only kept pairs and are never scanned.
//
// Only a band (causal or a window) masks a key that was loaded: keys and queries past the
// sequence's end are zero-filled in shared memory, never read from memory. So the scans are
// compiled in only where a band limit is (kBandMasksKeys), and kernels without one stay
// exactly as they were, registers included.
constexpr bool kBandMasksKeys = LIMIT_LEFT || LIMIT_RIGHT;

// x, through an instruction the compiler may not merge or move: a cold path's mask is then
// recomputed from it where it is used, not kept live from the hot path's identical
// computation across the tile's peak of registers (ptxas: fewer spill bytes in the wgmma
// backward's dQ kernel with every option).
__device__ __forceinline__ i64 opaque(i64 x) {
    i64 y;
    asm volatile("mov.b64 %0, %1;\n" : "=l"(y) : "l"(x));
    return y;
}

// Whether a 16-bit element (float16 or bfloat16 by IS_BFLOAT16) or a float is inf or NaN:
// its exponent bits are all ones.
__device__ __forceinline__ bool bits_non_finite(bits16 x) {
#if IS_BFLOAT16
    constexpr u32 exponent = 0x7f80u;
#else
    constexpr u32 exponent = 0x7c00u;
#endif
    return (x & exponent) == exponent;
}
__device__ __forceinline__ bool bits_non_finite(float x) {
    return (__float_as_uint(x) & 0x7f800000u) == 0x7f800000u;
}
__device__ __forceinline__ bool bits_non_finite(double x) {
    constexpr unsigned long long exponent = 0x7ff0000000000000ull;
    return (static_cast<unsigned long long>(__double_as_longlong(x)) & exponent) == exponent;
}

__device__ __forceinline__ float element_value(bits16 x) {
#if IS_BFLOAT16
    return widen(bfloat16_storage{x});
#else
    return widen(half_storage{x});
#endif
}
__device__ __forceinline__ float element_value(float x) { return x; }
__device__ __forceinline__ double element_value(double x) { return x; }

// 16 bytes of a tile: two 16-bit exponents per word, one float's, or half a double's.
template <typename T> __device__ __forceinline__ bool chunk_non_finite(uint4 chunk);
template <> __device__ __forceinline__ bool chunk_non_finite<bits16>(uint4 chunk) {
#if IS_BFLOAT16
    constexpr u32 exponents = 0x7f807f80u;
#else
    constexpr u32 exponents = 0x7c007c00u;
#endif
    // (w & e) ^ e has a zero 16-bit half exactly where that half's exponent is all ones.
    const u32 words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
    bool found = false;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u32 missing = (words[i] & exponents) ^ exponents;
        found |= (missing & 0xffffu) == 0u || (missing >> 16) == 0u;
    }
    return found;
}
template <> __device__ __forceinline__ bool chunk_non_finite<float>(uint4 chunk) {
    constexpr u32 exponent = 0x7f800000u;
    return (chunk.x & exponent) == exponent || (chunk.y & exponent) == exponent ||
           (chunk.z & exponent) == exponent || (chunk.w & exponent) == exponent;
}
// Two doubles: their exponents are in the high words (little-endian), y and w.
template <> __device__ __forceinline__ bool chunk_non_finite<double>(uint4 chunk) {
    constexpr u32 exponent = 0x7ff00000u;
    return (chunk.y & exponent) == exponent || (chunk.w & exponent) == exponent;
}

// This thread's share of the scan of columns [0, Width) of tile[Rows][Pitch] (the pitch's
// padding is never written, so it is not read). Width and Pitch are whole 16-byte chunks.
template <int Rows, int Width, int Pitch, int Threads, typename T>
__device__ __forceinline__ bool tile_has_non_finite(const T* tile) {
    constexpr int chunk_elements = 16 / sizeof(T), chunks_per_row = Width / chunk_elements;
    static_assert(Width % chunk_elements == 0 && Pitch % chunk_elements == 0, "16-byte rows");
    bool found = false;
    for (int chunk = threadIdx.x; chunk < Rows * chunks_per_row; chunk += Threads) {
        const int r = chunk / chunks_per_row, c = chunk % chunks_per_row;
        found |= chunk_non_finite<T>(
            *reinterpret_cast<const uint4*>(tile + r * Pitch + c * chunk_elements));
    }
    return found;
}

template <int Rows, int Width, int Pitch, int Threads, typename T>
__device__ __forceinline__ void zero_non_finite(T* tile) {
    for (int element = threadIdx.x; element < Rows * Width; element += Threads) {
        T* x = tile + (element / Width) * Pitch + element % Width;
        if (bits_non_finite(*x)) *x = T(0);
    }
}

// The same scan and zeroing over Bytes of dense 16-bit tiles at a shared address (wgmma's
// swizzled tiles: every byte is an element or zero padding, so no layout is needed).
template <int Bytes, int Threads>
__device__ __forceinline__ bool shared_tile_has_non_finite(u32 tile) {
    static_assert(Bytes % 16 == 0, "16-byte chunks");
    bool found = false;
    for (int offset = threadIdx.x * 16; offset < Bytes; offset += Threads * 16) {
        uint4 chunk;
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(chunk.x), "=r"(chunk.y), "=r"(chunk.z), "=r"(chunk.w)
                     : "r"(tile + offset)
                     : "memory");
        found |= chunk_non_finite<bits16>(chunk);
    }
    return found;
}

// The 16-bit dK/dV kernels' note for attention_generic.cu's attention_backward_dkdv_redo
// (FLAG_NON_FINITE_KEYS): whether this block's owned K or V rows hold inf or NaN, found
// (per thread) in the owned tiles once the block's dk and dv are stored. Queries past n_q
// in a streamed tile are zero rows; against such a key they make 0 x inf = NaN, which a
// select per score would keep out at a measured 6-10 % of the backward, so the flagged
// blocks are computed again on CUDA cores over the real queries only.
__device__ __forceinline__ void flag_non_finite_keys(int* key_flags, bool found,
                                                    i64 block = blockIdx.x) {
    found = __syncthreads_or(found);
    if (threadIdx.x == 0) key_flags[block] = found;
}

__device__ __forceinline__ bits16 load_shared_bits16(u32 address) {
    unsigned short x;
    asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(x) : "r"(address) : "memory");
    return x;
}

template <int Bytes, int Threads>
__device__ __forceinline__ void zero_non_finite_shared_tile(u32 tile) {
    for (int offset = threadIdx.x * 2; offset < Bytes; offset += Threads * 2)
        if (bits_non_finite(load_shared_bits16(tile + offset)))
            asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(tile + offset),
                         "h"(static_cast<unsigned short>(0))
                         : "memory");
}

// The non-finite terms p_rj v[j][col + f] (f = 0, 1) of row half `half` of row tile m over
// the keys j that `kept` keeps, summed (the layout and shuffles of
// add_kept_non_finite_values, below).
template <int KeyFrags, typename Real, class HeldOf, class ValueAt>
__device__ __forceinline__ void sum_kept_non_finite_terms(Real (&sum)[2], const Window& kept,
                                                          HeldOf held_of, ValueAt value_at,
                                                          int m, int half, int col) {
    const int quad_lane0 = (threadIdx.x % 32) & ~3;
    sum[0] = sum[1] = Real(0);
#pragma unroll
    for (int n = 0; n < KeyFrags; ++n) {
        const Real held_even = held_of(m, n, half, 0);
        const Real held_odd = held_of(m, n, half, 1);
#pragma unroll 1
        for (int j = 0; j < 8; ++j) {
            // Key n * 8 + j: the holder's element j % 2 of fragment n.
            const Real weight =
                __shfl_sync(0xffffffffu, (j & 1) ? held_odd : held_even, quad_lane0 | (j / 2));
            if (!kept.keeps(n * 8 + j)) continue;
#pragma unroll
            for (int f = 0; f < 2; ++f) {
                const Real value = value_at(n * 8 + j, col + f);
                if (bits_non_finite(value)) sum[f] += weight * value;
            }
        }
    }
}

// O += p_rj v[j][d] for this thread's rows r and O columns d, over the keys j that row r
// keeps (window_of(m, half): the Window of tile-relative keys kept by row half `half` of
// row tile m) and the d where v[j][d] = value_at(j, d) is not finite (value_at is called
// for kept keys only). The backward uses it with keys and queries in the other roles. P is in the accumulator layout: held_of(m, n,
// half, odd) is this thread's entry of row half `half` of row tile m, key 8 n + 2 quad_col
// + odd (after dropout); key j's entry of a row is held by quad lane (j % 8) / 2, so it
// comes by shuffle. Each such term is inf or NaN, so their sum, added to O once, is what
// adding them one by one gives (IEEE: any NaN or infinities of both signs give NaN, else
// the one signed infinity); that keeps O out of the rolled loops, whose loop-carried
// accumulators cost spills in the hot path (ptxas). Off the hot path (non-finite V on a
// cut tile only), so the loop over a fragment's 8 keys stays rolled; the fragment index
// stays compile-time (a run-time one puts P in local memory).
template <int KeyFrags, typename Real, int RowTiles, int OutFrags, class WindowOf,
          class HeldOf, class ValueAt>
__device__ __forceinline__ void add_kept_non_finite_values(Real (&o_acc)[RowTiles][OutFrags][4],
                                                           WindowOf window_of, HeldOf held_of,
                                                           ValueAt value_at) {
    const int quad_col = threadIdx.x % 4;
#pragma unroll
    for (int m = 0; m < RowTiles; ++m)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const Window kept = window_of(m, half);
#pragma unroll
            for (int dn = 0; dn < OutFrags; ++dn) {
                Real non_finite_sum[2];
                sum_kept_non_finite_terms<KeyFrags>(non_finite_sum, kept, held_of, value_at, m,
                                                    half, dn * 8 + 2 * quad_col);
                o_acc[m][dn][2 * half] += non_finite_sum[0];
                o_acc[m][dn][2 * half + 1] += non_finite_sum[1];
            }
        }
}

// held_of for P in the accumulator layout (floats, or doubles in the float64 forward).
template <int RowTiles, int KeyFrags, typename Real = float>
struct HeldFromScores {
    const Real (&p)[RowTiles][KeyFrags][4];
    __device__ __forceinline__ Real operator()(int m, int n, int half, int odd) const {
        return p[m][n][2 * half + odd];
    }
};

// window_of for a forward's rows against the tile `mask` (its rows relative to mask.row0).
template <int RowTiles>
struct KeptKeysOfRows {
    const i64 (&rows)[RowTiles][2];
    TileMask mask;
    __device__ __forceinline__ Window operator()(int m, int half) const {
        return mask.row_window(static_cast<int>(rows[m][half] - mask.row0), 0);
    }
};

// The mma.sync and 3xTF32 forwards' step on a key tile the mask cuts, V in shared memory
// in rows of Pitch elements: when V holds inf or NaN, the kept pairs' products with it on
// CUDA cores, then zeros in its place for the tensor cores' P V. Every thread of the block
// calls it (the scan's result is block-uniform; the barriers order every warp's reads
// before the zeroing and the zeroing before every warp's P V). `mask_of()` makes the tile's
// mask only when needed, rather than keeping it live across the softmax (registers).
template <int BlockK, int Width, int Pitch, int Threads, typename Real, int RowTiles,
          int OutFrags, typename T, typename MaskOf>
__device__ __forceinline__ void add_and_zero_non_finite_values(
    Real (&o_acc)[RowTiles][OutFrags][4], const i64 (&rows)[RowTiles][2],
    const Real (&p)[RowTiles][BlockK / 8][4], T* v_tile, MaskOf mask_of) {
    if (!__syncthreads_or(tile_has_non_finite<BlockK, Width, Pitch, Threads>(v_tile))) return;
    add_kept_non_finite_values<BlockK / 8>(
        o_acc, KeptKeysOfRows<RowTiles>{rows, mask_of()},
        HeldFromScores<RowTiles, BlockK / 8, Real>{p},
        [&](int key, int col) { return element_value(v_tile[key * Pitch + col]); });
    __syncthreads();
    zero_non_finite<BlockK, Width, Pitch, Threads>(v_tile);
    __syncthreads();
}

// The same for one row tile's accumulators, float[OutFrags][4] or double[OutFrags][4] (the
// backwards' layout). Two overloads, not one on a deduced element type: that would also
// match the row tiles' float[RowTiles][4][4] as an array of float[4].
template <int KeyFrags, int OutFrags, class WindowOf, class HeldOf, class ValueAt>
__device__ __forceinline__ void add_kept_non_finite_values(float (&acc)[OutFrags][4],
                                                           WindowOf window_of, HeldOf held_of,
                                                           ValueAt value_at) {
    add_kept_non_finite_values<KeyFrags>(reinterpret_cast<float (&)[1][OutFrags][4]>(acc),
                                         window_of, held_of, value_at);
}
template <int KeyFrags, int OutFrags, class WindowOf, class HeldOf, class ValueAt>
__device__ __forceinline__ void add_kept_non_finite_values(double (&acc)[OutFrags][4],
                                                           WindowOf window_of, HeldOf held_of,
                                                           ValueAt value_at) {
    add_kept_non_finite_values<KeyFrags>(reinterpret_cast<double (&)[1][OutFrags][4]>(acc),
                                         window_of, held_of, value_at);
}

// held_of for one row tile's weights, Real[KeyFrags][4].
template <int KeyFrags, typename Real = float>
struct HeldFromTile {
    const Real (&p)[KeyFrags][4];
    __device__ __forceinline__ Real operator()(int, int n, int half, int odd) const {
        return p[n][2 * half + odd];
    }
};

// held_of for one row tile's weights already rounded to the input type as register A
// fragments, u32[KeyFrags / 2][4] (pack_a_fragment: fragment n is kk = n / 2's words
// 2 (n % 2) + half, its element `odd` the word's high half). Half the registers of the
// float tile: the wgmma backward's corrections read these, as its float tiles and dQ do
// not fit beside each other (bench/NOTES-gpu.md, v15). They are also what the tensor cores
// multiply, so a kept term is the same product there and here.
template <int KeyFrags>
struct HeldFromPacked {
    const u32 (&a)[KeyFrags / 2][4];
    __device__ __forceinline__ float operator()(int, int n, int half, int odd) const {
        const u32 word = a[n / 2][2 * (n % 2) + half];
        return element_value(static_cast<bits16>(odd ? word >> 16 : word & 0xffffu));
    }
};

// A pair of 16-bit elements (one register of an mma.sync fragment) with its inf and NaN
// halves made +0: the tensor cores then meet 0 where the element was not finite.
__device__ __forceinline__ u32 zero_non_finite_pair(u32 pair) {
#if IS_BFLOAT16
    constexpr u32 exponents = 0x7f807f80u;
#else
    constexpr u32 exponents = 0x7c007c00u;
#endif
    const u32 missing = (pair & exponents) ^ exponents;  // a zero half: all ones there
    return pair & (((missing & 0xffffu) ? 0xffffu : 0u) | ((missing >> 16) ? 0xffff0000u : 0u));
}

// add_kept_non_finite_values for one row tile with the loop over output fragments rolled:
// each pass sums one fragment's terms and adds them to it by an unrolled select over the
// fragments (a run-time index would put the accumulators in local memory). Less code held
// at once, for kernels where the unrolled form spills (the wgmma backward, whose dQ, dK
// and dV tiles leave a few registers beside the packed weights).
template <int KeyFrags, int OutFrags, class WindowOf, class HeldOf, class ValueAt>
__device__ __forceinline__ void add_kept_non_finite_values_rolled(float (&acc)[OutFrags][4],
                                                                  WindowOf window_of,
                                                                  HeldOf held_of,
                                                                  ValueAt value_at) {
    const int quad_col = threadIdx.x % 4;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const Window kept = window_of(0, half);
#pragma unroll 1
        for (int dn = 0; dn < OutFrags; ++dn) {
            float non_finite_sum[2];
            sum_kept_non_finite_terms<KeyFrags>(non_finite_sum, kept, held_of, value_at, 0, half,
                                                dn * 8 + 2 * quad_col);
#pragma unroll
            for (int target = 0; target < OutFrags; ++target)
                if (target == dn) {
                    acc[target][2 * half] += non_finite_sum[0];
                    acc[target][2 * half + 1] += non_finite_sum[1];
                }
        }
    }
}
