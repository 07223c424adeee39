"""Run the mma.sync forward (attention_mma_forward.cu), backward (attention_mma_backward.cu:
the dQ and dK/dV kernels), the tensor-core decode (attention_decode_mma.cu, o direct or its
splits merged in the kernel; dense, padded and paged K/V; ALiBi among the options), the
3xTF32 forwards (attention_tf32_forward.cu, with IS_FLOAT64 the float64 forward, and
attention_tf32_wgmma_forward.cu) and the 16-bit Hopper forward and backward
(attention_wgmma_forward.cu, attention_wgmma_backward.cu's two kernels) on the CPU, no GPU:
the kernels' own source under emulate_decode_cpu.py's C++ emulation of the CUDA built-ins,
with the warp-wide PTX they add (ldmatrix, mma.sync m16n8k16, m16n8k8.tf32 and .f64,
wgmma's 16-bit and TF32 forms read through their shared-memory descriptors, cp.async of 4
to 16 bytes) computed by meaning, checked against the float64 golden model. The backward's
single pass runs in arrival order, in turns (ORDERED) and into a slot per key block
(DQ_PARTS); the non-finite-key redo is not run.

    python3 bench/experiments/emulate_mma_cpu.py [--quick | --decode | --backward |
                                                  --single-pass [--quick] | --launcher |
                                                  --f64-shares | --fold-decode | --tf32 |
                                                  --f64 | --wgmma]

`--launcher` runs only the GQA decodes that fold (wide ones on the mma.sync forward, many
packed rows at D <= 256 on the wgmma forward) and float64's forward with key shares, through
the Python launch path (`launch_forward.forward` on a CuPy stand-in) with those forwards
and split_keys_merge.cu emulated, called with the launcher's own arguments; `--f64-shares`
only the last, `--fold-decode` only the folds at D <= 256.

Needs g++ 12+. Each block runs as its threads (std::threads meeting at barriers); a warp's
ldmatrix and mma.sync exchange the lanes' addresses and fragments through a per-thread
buffer between two warp barriers, then every lane computes its own result words from the
PTX ISA's fragment layouts (A row-major 16 x 16 in four registers, B column-major 16 x 8 in
two, C 16 x 8 in four floats; ldmatrix lane l addresses row l % 8 of matrix l / 8). The
products are summed in float32 in k order, not in the tensor cores' order, so results agree
with the GPU's to rounding, not bit for bit. Every case runs with o contiguous and with o
written into a (B, Nq, Hq, Dv) buffer (STRIDED_OUT), as a "bshd" call's is; the backward's
dq, dk and dv likewise.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import itertools
import os
import re
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from emulate_decode_cpu import (COPY, COPY_PATTERN, PATCHES, PRELUDE,  # noqa: E402
                                RUN_BLOCKS, STORAGE, _install_cupy_standin, build,
                                launch_arguments, resolved, score_operands)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import tileattn  # noqa: E402
from tileattn.gpu._compile import source  # noqa: E402
from tileattn.gpu.tiles import (  # noqa: E402
    DecodeMmaTiles, F64Tiles, MmaBackwardTiles, MmaTiles, Tf32Tiles, Tf32WgmmaTiles,
    WgmmaBackwardTiles, WgmmaTiles, Widths)
from tileattn.testing import assert_attention_close, bfloat16  # noqa: E402

WARP_PTX = r"""
struct uint4 { unsigned x, y, z, w; };
inline int __any_sync(unsigned, int predicate) {
    const unsigned warp0 = threadIdx.x - threadIdx.x % 32;
    g_exchange[threadIdx.x] = predicate;
    __syncwarp();
    int any = 0;
    for (unsigned lane = 0; lane < 32; ++lane) any |= g_exchange[warp0 + lane] != 0;
    __syncwarp();
    return any;
}
int g_block_or = 0;  // blocks run one at a time
inline int __syncthreads_or(int predicate) {
    __syncthreads();  // every thread has read the previous call's result
    if (threadIdx.x == 0) __atomic_store_n(&g_block_or, 0, __ATOMIC_SEQ_CST);
    __syncthreads();
    if (predicate) __atomic_store_n(&g_block_or, 1, __ATOMIC_SEQ_CST);
    __syncthreads();
    return __atomic_load_n(&g_block_or, __ATOMIC_SEQ_CST);
}
inline int atomicAdd(int* x, int y) { return __atomic_fetch_add(x, y, __ATOMIC_SEQ_CST); }
inline u32 atomicAdd(u32* x, u32 y) { return __atomic_fetch_add(x, y, __ATOMIC_SEQ_CST); }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
struct float2 { float x, y; };
inline float2 make_float2(float x, float y) { return {x, y}; }
template <typename T> inline T __ldcg(const T* p) { return *p; }
inline float atomicAdd(float* x, float y) {
    return std::atomic_ref<float>(*x).fetch_add(y);
}
u32 g_words[1024][8];  // a thread's published registers for its warp's ldmatrix / mma
inline u32 shared_word(u32 address) { u32 x; std::memcpy(&x, g_shared + address, 4); return x; }
inline unsigned short shared_half(u32 address) {
    unsigned short x; std::memcpy(&x, g_shared + address, 2); return x;
}
inline void ldmatrix_x4_emulated(u32 address, u32* fragment, bool transposed) {
    const unsigned lane = threadIdx.x % 32, warp0 = threadIdx.x - lane;
    g_words[threadIdx.x][0] = address;
    __syncwarp();
    for (int j = 0; j < 4; ++j) {
        if (!transposed) {
            fragment[j] = shared_word(g_words[warp0 + j * 8 + lane / 4][0] + (lane % 4) * 4);
        } else {
            const u32 r0 = g_words[warp0 + j * 8 + 2 * (lane % 4)][0];
            const u32 r1 = g_words[warp0 + j * 8 + 2 * (lane % 4) + 1][0];
            fragment[j] = shared_half(r0 + (lane / 4) * 2) |
                          (static_cast<u32>(shared_half(r1 + (lane / 4) * 2)) << 16);
        }
    }
    __syncwarp();
}
inline float half_of(u32 word, int upper) {
    const unsigned short bits = static_cast<unsigned short>(upper ? word >> 16 : word);
    if (IS_BFLOAT16) return std::bit_cast<float>(static_cast<u32>(bits) << 16);
    return static_cast<float>(std::bit_cast<_Float16>(bits));
}
// c += A (16 x 8, row) B (8 x 8, col) in TF32: lane l = 4 g + t holds A rows g, g + 8 at
// columns t, t + 4, B column g at rows t, t + 4; C as in m16n8k16. Operands are float bits
// (TF32 reads their top 19).
inline float tf32_of(u32 bits) { return std::bit_cast<float>(bits & 0xffffe000u); }
inline void mma_tf32_emulated(float* c, const u32* a, u32 b0, u32 b1) {
    const unsigned lane = threadIdx.x % 32, warp0 = threadIdx.x - lane;
    for (int i = 0; i < 4; ++i) g_words[threadIdx.x][i] = a[i];
    g_words[threadIdx.x][4] = b0;
    g_words[threadIdx.x][5] = b1;
    __syncwarp();
    const int g = lane / 4, t = lane % 4;
    float result[4];
    for (int i = 0; i < 4; ++i) {
        const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i % 2);
        float sum = c[i];
        for (int kk = 0; kk < 8; ++kk) {
            const u32* a_lane = g_words[warp0 + (row % 8) * 4 + kk % 4];
            const u32* b_lane = g_words[warp0 + col * 4 + kk % 4];
            sum += tf32_of(a_lane[(row >= 8 ? 1 : 0) + (kk >= 4 ? 2 : 0)]) *
                   tf32_of(b_lane[4 + (kk >= 4 ? 1 : 0)]);
        }
        result[i] = sum;
    }
    __syncwarp();
    for (int i = 0; i < 4; ++i) c[i] = result[i];
}
// c += A (16 x 8, row) B (8 x 8, col) in doubles (m16n8k8.f64: the TF32 layout), each
// element's products summed in k order with fused multiply-adds.
double g_doubles[1024][6];  // a thread's published A and B doubles
inline void mma_f64_emulated(double (&c)[4], const double (&a)[4], double b0, double b1) {
    const unsigned lane = threadIdx.x % 32, warp0 = threadIdx.x - lane;
    for (int i = 0; i < 4; ++i) g_doubles[threadIdx.x][i] = a[i];
    g_doubles[threadIdx.x][4] = b0;
    g_doubles[threadIdx.x][5] = b1;
    __syncwarp();
    const int g = lane / 4, t = lane % 4;
    double result[4];
    for (int i = 0; i < 4; ++i) {
        const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i % 2);
        double sum = c[i];
        for (int kk = 0; kk < 8; ++kk) {
            const double* a_lane = g_doubles[warp0 + (row % 8) * 4 + kk % 4];
            const double* b_lane = g_doubles[warp0 + col * 4 + kk % 4];
            sum = std::fma(a_lane[(row >= 8 ? 1 : 0) + (kk >= 4 ? 2 : 0)],
                           b_lane[4 + (kk >= 4 ? 1 : 0)], sum);
        }
        result[i] = sum;
    }
    __syncwarp();
    for (int i = 0; i < 4; ++i) c[i] = result[i];
}
struct alignas(16) float4 { float x, y, z, w; };
// wgmma on TF32 (wgmma_tf32.cuh), computed at issue (fence, commit and wait are then
// nothing): a K-major operand's element (row, k) from its shared-memory descriptor (start
// address, stride between 8-row groups, swizzle mode: rows of 128, 64 or 32 bytes whose
// 16-byte chunks are XORed with the address bits above 128 bytes, as the hardware's
// swizzle is address-based).
inline float wgmma_operand(u64 descriptor, int row, int k) {
    const u32 start = static_cast<u32>(descriptor & 0x3FFF) << 4;
    const u32 stride = static_cast<u32>((descriptor >> 32) & 0x3FFF) << 4;
    const int mode = static_cast<int>(descriptor >> 62);
    const u32 row_bytes = mode == 1 ? 128 : mode == 2 ? 64 : 32;
    const u32 logical = start + (row / 8) * stride + (row % 8) * row_bytes + k * 4;
    const u32 physical = logical ^ (((logical >> 7) & (row_bytes / 16 - 1)) << 4);
    return tf32_of(shared_word(physical));
}
// d (64 x N per warpgroup, each warp's 16 rows in the m16n8 accumulator layout) = A B
// (+ d when `accumulate`) over K = Depth; A(row, k) from a(row, k), B(k, n) from b(k, n).
template <int Depth, int Frags, class AOf, class BOf>
inline void wgmma_emulated(float (&d)[Frags][4], AOf a, BOf b, int accumulate) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int row0 = ((threadIdx.x % 128) / 32) * 16 + g;
    for (int j = 0; j < Frags; ++j)
        for (int e = 0; e < 4; ++e) {
            const int row = row0 + (e >= 2 ? 8 : 0), col = 8 * j + 2 * t + (e % 2);
            float sum = accumulate ? d[j][e] : 0.0f;
            for (int k = 0; k < Depth; ++k) sum += a(row, k) * b(k, col);
            d[j][e] = sum;
        }
}
// The tf32 product over K = 8, B from its K-major descriptor.
template <int Frags, class AOf>
inline void wgmma_tf32_emulated(float (&d)[Frags][4], AOf a, u64 b, int accumulate) {
    wgmma_emulated<8>(d, a, [&](int k, int n) { return wgmma_operand(b, n, k); }, accumulate);
}
template <int Frags>
inline void wgmma_ss_tf32_emulated(float (&d)[Frags][4], u64 a, u64 b, int accumulate) {
    wgmma_tf32_emulated(d, [&](int row, int k) { return wgmma_operand(a, row, k); }, b,
                        accumulate);
}
// A wgmma's A operand from registers: each lane of the warp publishes its four words, and
// `product(words_of)` runs with words_of(r, column) the words of the lane holding row r
// (of the warp's 16) in that column group of four lanes.
template <class Product>
inline void with_register_a(const u32 (&a)[4], Product product) {
    const unsigned lane = threadIdx.x % 32, warp0 = threadIdx.x - lane;
    for (int i = 0; i < 4; ++i) g_words[threadIdx.x][i] = a[i];
    __syncwarp();
    const int warp_row0 = ((threadIdx.x % 128) / 32) * 16;
    product([&](int row, int column) -> const u32* {
        return g_words[warp0 + ((row - warp_row0) % 8) * 4 + column];
    }, warp_row0);
    __syncwarp();
}
// A from registers: lane 4 g + t holds rows g, g + 8 at k = t, t + 4 (the warp's 16 rows).
template <int Frags>
inline void wgmma_rs_tf32_emulated(float (&d)[Frags][4], const u32 (&a)[4], u64 b,
                                   int accumulate) {
    with_register_a(a, [&](auto words_of, int warp_row0) {
        wgmma_tf32_emulated(d, [&](int row, int k) {
            const int r = row - warp_row0;
            return tf32_of(words_of(row, k % 4)[(r >= 8 ? 1 : 0) + (k >= 4 ? 2 : 0)]);
        }, b, accumulate);
    });
}
// wgmma on 16-bit operands (wgmma.cuh), computed at issue like the TF32 ones: element
// (row, k) of a K-major operand (a 16-element K slice contiguous in each row), and element
// (k, n) of an MN-major one (rows are k; column blocks of row_bytes / 2 elements lie the
// descriptor's leading offset apart, 8-row groups of k one stride apart).
inline float shared_half(u32 logical, u32 row_bytes) {
    const u32 physical = logical ^ (((logical >> 7) & (row_bytes / 16 - 1)) << 4);
    return half_of(shared_word(physical & ~3u), (physical & 2u) != 0);
}
inline u32 descriptor_row_bytes(u64 descriptor) {
    const int mode = static_cast<int>(descriptor >> 62);
    return mode == 1 ? 128 : mode == 2 ? 64 : 32;
}
inline float wgmma_operand16(u64 descriptor, int row, int k) {
    const u32 start = static_cast<u32>(descriptor & 0x3FFF) << 4;
    const u32 stride = static_cast<u32>((descriptor >> 32) & 0x3FFF) << 4;
    const u32 row_bytes = descriptor_row_bytes(descriptor);
    return shared_half(start + (row / 8) * stride + (row % 8) * row_bytes + k * 2, row_bytes);
}
inline float wgmma_operand16_mn(u64 descriptor, int k, int n) {
    const u32 start = static_cast<u32>(descriptor & 0x3FFF) << 4;
    const u32 leading = static_cast<u32>((descriptor >> 16) & 0x3FFF) << 4;
    const u32 stride = static_cast<u32>((descriptor >> 32) & 0x3FFF) << 4;
    const u32 row_bytes = descriptor_row_bytes(descriptor);
    const u32 columns = row_bytes / 2;
    return shared_half(start + (n / columns) * leading + (k / 8) * stride + (k % 8) * row_bytes +
                           (n % columns) * 2, row_bytes);
}
// The 16-bit wgmma runs asynchronously here as on the GPU: an issue queues its product
// (`wgmma_deferred`), a commit closes the thread's group, and wgmma_wait<N> computes every
// group but the newest N, reading the operands (shared memory, A registers) and writing the
// accumulators only then. A kernel that touches an accumulator, or overwrites an operand,
// between an issue and its wait therefore computes something else than the golden model.
#include <functional>
thread_local std::vector<std::function<void()>> g_wgmma_open;
thread_local std::vector<std::vector<std::function<void()>>> g_wgmma_groups;
inline void wgmma_deferred(std::function<void()> product) {
    g_wgmma_open.push_back(std::move(product));
}
inline void wgmma_commit_emulated() {
    g_wgmma_groups.push_back(std::move(g_wgmma_open));
    g_wgmma_open.clear();
}
inline void wgmma_wait_emulated(int pending) {
    while (static_cast<int>(g_wgmma_groups.size()) > pending) {
        for (auto& product : g_wgmma_groups.front()) product();
        g_wgmma_groups.erase(g_wgmma_groups.begin());
    }
}
// A from registers: lane 4 g + t holds rows g, g + 8 at k = 2t, 2t + 1 and 2t + 8, 2t + 9
// (the warp's 16 rows, mma.sync's m16n8k16 A layout).
template <class BOf, int Frags>
inline void wgmma16_rs_emulated(float (&d)[Frags][4], const u32 (&a)[4], BOf b,
                                int accumulate) {
    with_register_a(a, [&](auto words_of, int warp_row0) {
        wgmma_emulated<16>(d, [&](int row, int k) {
            const int r = row - warp_row0;
            return half_of(words_of(row, (k % 8) / 2)[(r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)],
                           k % 2);
        }, b, accumulate);
    });
}
// c += A (16 x 16, row) B (16 x 8, col); lane l = 4 g + t holds A rows g, g + 8 at columns
// 2t, 2t + 1 (+ 8), B columns g at rows 2t, 2t + 1 (+ 8), C rows g, g + 8 at columns 2t, 2t + 1.
inline void mma_emulated(float* c, const u32* a, u32 b0, u32 b1) {
    const unsigned lane = threadIdx.x % 32, warp0 = threadIdx.x - lane;
    for (int i = 0; i < 4; ++i) g_words[threadIdx.x][i] = a[i];
    g_words[threadIdx.x][4] = b0;
    g_words[threadIdx.x][5] = b1;
    __syncwarp();
    const int g = lane / 4, t = lane % 4;
    float result[4];
    for (int i = 0; i < 4; ++i) {
        const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i % 2);
        float sum = c[i];
        for (int kk = 0; kk < 16; ++kk) {
            const u32* a_lane = g_words[warp0 + (row % 8) * 4 + (kk % 8) / 2];
            const float a_value = half_of(a_lane[(row >= 8 ? 1 : 0) + (kk >= 8 ? 2 : 0)], kk % 2);
            const u32* b_lane = g_words[warp0 + col * 4 + (kk % 8) / 2];
            const float b_value = half_of(b_lane[4 + (kk >= 8 ? 1 : 0)], kk % 2);
            sum += a_value * b_value;
        }
        result[i] = sum;
    }
    __syncwarp();
    for (int i = 0; i < 4; ++i) c[i] = result[i];
}
"""

# Whole helper functions of the shared headers replaced by their meaning: (the start of the
# definition, the new body). The definition's braces are matched to find its end.
FUNCTIONS = [
    ("__device__ __forceinline__ void wgmma_commit() {", "{ wgmma_commit_emulated(); }"),
    ("template <int Pending> __device__ __forceinline__ void wgmma_wait() {",
     "{ wgmma_wait_emulated(Pending); }"),
    ("__device__ __forceinline__ void wait_for_turn(const int* turn, int rank) {",
     "{ if (threadIdx.x == 0)\n"
     "      while (__atomic_load_n(turn, __ATOMIC_ACQUIRE) != rank) std::this_thread::yield();\n"
     "  __syncthreads(); }"),
    ("__device__ __forceinline__ void copy_16_async(u32 destination, const void* source, "
     "bool valid) {",
     "{ const PendingCopy copy{destination, source, valid, 16};\n"
     "  if (DEFERRED_COPIES) t_open_group.push_back(copy); else land(copy); }"),
    ("__device__ __forceinline__ void copy_4_async(u32 destination, const void* source, "
     "bool valid) {",
     "{ const PendingCopy copy{destination, source, valid, 4};\n"
     "  if (DEFERRED_COPIES) t_open_group.push_back(copy); else land(copy); }"),
    ("__device__ __forceinline__ void load_matrix_x4(u32 address, u32* fragment) {",
     "{ ldmatrix_x4_emulated(address, fragment, false); }"),
    ("__device__ __forceinline__ void load_matrix_x4_transposed(u32 address, u32* fragment) {",
     "{ ldmatrix_x4_emulated(address, fragment, true); }"),
    ("__device__ __forceinline__ void mma_16x8x16(float* c, const u32* a, u32 b0, u32 b1) {",
     "{ mma_emulated(c, a, b0, b1); }"),
    ("__device__ __forceinline__ u32 pack_pair(float low, float high) {",
     "{ using Half = std::conditional_t<IS_BFLOAT16, bfloat16_storage, half_storage>;\n"
     "  return static_cast<u32>(narrow<Half>(low).bits) |\n"
     "         (static_cast<u32>(narrow<Half>(high).bits) << 16); }"),
    ("__device__ __forceinline__ void store_pair(float* out, float low, float high) {",
     "{ out[0] = low; out[1] = high; }"),
    ("__device__ __forceinline__ float exp2_approx(float x) {", "{ return std::exp2(x); }"),
    ("__device__ __forceinline__ i64 opaque(i64 x) {", "{ return x; }"),
    ("__device__ __forceinline__ void mma_16x8x8_tf32(float* c, const u32 (&a)[4], u32 b0, "
     "u32 b1) {", "{ mma_tf32_emulated(c, a, b0, b1); }"),
    ("__device__ __forceinline__ void load_shared_pair(const float* pointer, float& low, "
     "float& high) {", "{ low = pointer[0]; high = pointer[1]; }"),
    ("__device__ __forceinline__ void mma_16x8x8_f64(double (&c)[4], const double (&a)[4], "
     "double b0,\n                                               double b1) {",
     "{ mma_f64_emulated(c, a, b0, b1); }"),
    ("__device__ __forceinline__ void load_shared_pair(const double* pointer, double& low,\n"
     "                                                 double& high) {",
     "{ low = pointer[0]; high = pointer[1]; }"),
    ("__device__ __forceinline__ void store_pair(double* out, double low, double high) {",
     "{ out[0] = low; out[1] = high; }"),
    ("__device__ __forceinline__ bits16 load_shared_bits16(u32 address) {",
     "{ return shared_half(address); }"),
    ("__device__ __forceinline__ float load_shared_float(u32 address) {",
     "{ return std::bit_cast<float>(shared_word(address)); }"),
    ("__device__ __forceinline__ void store_shared_float4(u32 address, float a, float b, "
     "float c,\n                                                    float d) {",
     "{ const float x[4] = {a, b, c, d}; std::memcpy(g_shared + address, x, 16); }"),
]
MORE_PATCHES = [
    (r"extern __shared__ __align__\(128\) unsigned char shared_bytes\[\];",
     "unsigned char* shared_bytes = g_shared;"),
    # wgmma_tf32.cuh's instructions by meaning (their specialisations are dropped).
    (r"template <int N>\s*__device__ __forceinline__ void wgmma_ss_tf32\(float \(&d\)\[N / 8\]"
     r"\[4\], u64 a, u64 b, int accumulate\);",
     "template <int N> inline void wgmma_ss_tf32(float (&d)[N / 8][4], u64 a, u64 b, "
     "int accumulate) { wgmma_ss_tf32_emulated(d, a, b, accumulate); }"),
    (r"template <int N>\s*__device__ __forceinline__ void wgmma_rs_tf32\(float \(&d\)\[N / 8\]"
     r"\[4\], const u32 \(&a\)\[4\], u64 b,\s*int accumulate\);",
     "template <int N> inline void wgmma_rs_tf32(float (&d)[N / 8][4], const u32 (&a)[4], "
     "u64 b, int accumulate) { wgmma_rs_tf32_emulated(d, a, b, accumulate); }"),
    (r"WGMMA_FOR_EACH_N\(WGMMA_TF32_SHAPE\)", ""),
    # wgmma.cuh's 16-bit instructions by meaning (their specialisations are dropped).
    (r"template <int N>\s*__device__ __forceinline__ void wgmma_ss\(float \(&d\)\[N / 8\]\[4\], "
     r"u64 a, u64 b, int accumulate\);",
     "template <int N> inline void wgmma_ss(float (&d)[N / 8][4], u64 a, u64 b, int accumulate) "
     "{ wgmma_deferred([&d, a, b, accumulate] { wgmma_emulated<16>(d, [&](int row, int k) { "
     "return wgmma_operand16(a, row, k); }, [&](int k, int n) { return wgmma_operand16(b, n, k); "
     "}, accumulate); }); }"),
    (r"template <int N>\s*__device__ __forceinline__ void wgmma_ss_transposed\(float \(&d\)"
     r"\[N / 8\]\[4\], u64 a, u64 b,\s*int accumulate\);",
     "template <int N> inline void wgmma_ss_transposed(float (&d)[N / 8][4], u64 a, u64 b, "
     "int accumulate) { wgmma_deferred([&d, a, b, accumulate] { wgmma_emulated<16>(d, "
     "[&](int row, int k) { return wgmma_operand16_mn(a, k, row); }, [&](int k, int n) { "
     "return wgmma_operand16_mn(b, k, n); }, accumulate); }); }"),
    (r"template <int N>\s*__device__ __forceinline__ void wgmma_rs_transposed_b\(float \(&d\)"
     r"\[N / 8\]\[4\], const u32 \(&a\)\[4\],\s*u64 b, int accumulate\);",
     "template <int N> inline void wgmma_rs_transposed_b(float (&d)[N / 8][4], "
     "const u32 (&a)[4], u64 b, int accumulate) { wgmma_deferred([&d, &a, b, accumulate] { "
     "wgmma16_rs_emulated(d, a, [&](int k, int n) { return wgmma_operand16_mn(b, k, n); }, "
     "accumulate); }); }"),
    (r"WGMMA_FOR_EACH_N\(WGMMA_SHAPE\)", ""),
    (r"extern __shared__ __align__\(\d+\) (bits16|element) shared_tiles\[\];",
     r"\1* shared_tiles = reinterpret_cast<\1*>(g_shared);"),
    (r"extern __shared__ __align__\(\d+\) float shared_floats\[\];",
     "float* shared_floats = reinterpret_cast<float*>(g_shared);"),
    (r"extern __shared__ __align__\(\d+\) real shared_reals\[\];",
     "real* shared_reals = reinterpret_cast<real*>(g_shared);"),
    (r'asm volatile\("ld\.shared\.v4\.u32 \{%0, %1, %2, %3\}, \[%4\];\\n"\s*'
     r': "=r"\(chunk\.x\), "=r"\(chunk\.y\), "=r"\(chunk\.z\), "=r"\(chunk\.w\)\s*'
     r': "r"\(tile \+ offset\)\s*: "memory"\);',
     "std::memcpy(&chunk, g_shared + tile + offset, 16);"),
    (r'asm volatile\("st\.shared\.u16 \[%0\], %1;\\n" ::"r"\(tile \+ offset\),\s*'
     r'"h"\(static_cast<unsigned short>\(0\)\)\s*: "memory"\);',
     "std::memset(g_shared + tile + offset, 0, 2);"),
]

RUNNER = RUN_BLOCKS + r"""
extern "C" void run(const bits16* q, const bits16* k, const bits16* v, bits16* o, float* lse,
                    const double* slopes, i64 n_q, i64 n_k, int n_q_heads, int group,
                    const i64* strides, const float* reals, const i64* band,
                    const unsigned* bits, int blocks, int shared) {
    run_blocks([&] {
        attention_forward_mma(q, k, v, o, lse, slopes, n_q, n_k, n_q_heads, group, strides[0],
                              strides[1], strides[2], strides[3], strides[4], strides[5],
                              strides[6], strides[7], strides[8], strides[9], strides[10],
                              strides[11], reals[0], reals[1], band[0], band[1], band[2],
                              bits[0], bits[1], reals[2], bits[2], bits[3], nullptr, nullptr,
                              nullptr, 0, 0, 0);
    }, blocks, kThreads, shared);
}
"""

# The kernels' own parameter lists, for the launcher mode (`--launcher`): the Python launch
# path's argument tuples go through these unchanged (grid x by grid y blocks).
FORWARD_LAUNCHER = RUN_BLOCKS + r"""
extern "C" void launch_attention_forward_mma(
    unsigned grid, unsigned grid_y, unsigned threads, unsigned shared, const bits16* q,
    const bits16* k, const bits16* v, bits16* o, float* lse, const double* alibi_slopes,
    i64 n_q_total, i64 n_k_total, int n_q_heads, int group_size, i64 q_sb, i64 q_sh, i64 q_sn,
    i64 k_sb, i64 k_sh, i64 k_sn, i64 v_sb, i64 v_sh, i64 v_sn, i64 o_sb, i64 o_sh, i64 o_sn,
    float scale, float softcap, i64 band_shift, i64 window_left, i64 window_right,
    u32 dropout_key, u32 dropout_threshold, float dropout_scale, u32 dropout_row0,
    u32 dropout_col0, const i64* descriptors, const i64* tiles, const i64* block_table,
    i64 table_stride, i64 page_size, i64 n_pages) {
    if (threads != kThreads) { std::fprintf(stderr, "block %u != kThreads\n", threads); std::abort(); }
    run_blocks([&] {
        attention_forward_mma(q, k, v, o, lse, alibi_slopes, n_q_total, n_k_total, n_q_heads,
                              group_size, q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn,
                              o_sb, o_sh, o_sn, scale, softcap, band_shift, window_left,
                              window_right, dropout_key, dropout_threshold, dropout_scale,
                              dropout_row0, dropout_col0, descriptors, tiles, block_table,
                              table_stride, page_size, n_pages);
    }, grid, threads, shared, grid_y);
}
"""
# float64's forward (attention_tf32_forward.cu with IS_FLOAT64) takes the same parameters in
# doubles.
F64_FORWARD_LAUNCHER = (
    FORWARD_LAUNCHER.replace("attention_forward_mma", "attention_forward_f64")
    .replace("const bits16*", "const double*").replace("bits16* o", "double* o")
    .replace("float* lse", "double* lse").replace("float scale, float softcap",
                                                   "double scale, double softcap")
    .replace("float dropout_scale", "double dropout_scale"))
MERGE_LAUNCHER = RUN_BLOCKS + r"""
extern "C" void launch_split_keys_merge(unsigned grid, unsigned grid_y, unsigned threads,
                                        unsigned shared, const partial* partial_o,
                                        const partial* partial_lse, STORAGE* o, partial* lse,
                                        i64 n_rows, i64 n_q, int n_splits, int n_q_heads,
                                        i64 o_sb, i64 o_sh, i64 o_sn) {
    run_blocks([&] { split_keys_merge(partial_o, partial_lse, o, lse, n_rows, n_q, n_splits,
                                      n_q_heads, o_sb, o_sh, o_sn); },
               grid, threads, shared, grid_y);
}
"""

BACKWARD_RUNNER = RUN_BLOCKS + r"""
// strides: q, k, v, do, then dq, dk, dv (3 each: batch, head, row).
extern "C" void run_dq(const element* q, const element* k, const element* v,
                       const element* d_out, const accum* lse, const accum* delta, element* dq,
                       const double* slopes, i64 n_q, i64 n_k, int n_q_heads, int group,
                       const i64* s, const accum* reals, const i64* band, const unsigned* bits,
                       int blocks, int threads, int shared) {
    run_blocks([&] {
        attention_backward_dq_mma(q, k, v, d_out, lse, delta, dq, slopes, n_q, n_k, n_q_heads,
                                  group, s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8],
                                  s[9], s[10], s[11], reals[0], reals[1], band[0], band[1],
                                  band[2], bits[0], bits[1], reals[2], bits[2], bits[3],
                                  nullptr, nullptr, nullptr, 0, 0, 0, s[12], s[13], s[14]);
    }, blocks, threads, shared);
}

// dq_sum: the single pass's float32 sums of dQ (SINGLE_PASS; unused otherwise).
extern "C" void run_dkdv(const element* q, const element* k, const element* v,
                         const element* d_out, const accum* lse, const accum* delta,
                         element* dk, element* dv, float* dq_sum, const double* slopes,
                         i64 n_q, i64 n_k, int n_q_heads, int group, const i64* s,
                         const accum* reals, const i64* band, const unsigned* bits, int blocks,
                         int threads, int shared) {
    // ORDERED: the ticket, then the turns (zeroed, as the launcher's).
    std::vector<int> turns(1 << 16, 0);
    int flags[4096] = {};
    run_blocks([&] {
        attention_backward_dkdv_mma(q, k, v, d_out, lse, delta, dk, dv, dq_sum, turns.data(), flags,
                                    slopes, n_q, n_k, n_q_heads, group, s[0], s[1], s[2], s[3],
                                    s[4], s[5], s[6], s[7], s[8], s[9], s[10], s[11],
                                    reals[0], reals[1], band[0], band[1], band[2], bits[0],
                                    bits[1], reals[2], bits[2], bits[3], nullptr, nullptr,
                                    nullptr, 0, 0, 0, s[15], s[16], s[17], s[18], s[19],
                                    s[20]);
    }, blocks, threads, shared);
}

// The single pass's dq, contiguous or at strides (a "bshd" gradient), from `parts` slots a
// head (DQ_PARTS) or one: one block of a warp walks it all.
extern "C" void run_dq_convert(const float* dq_sum, dq_element* dq, i64 count, float scale,
                               int parts, i64 head_elements) {
    run_blocks([&] {
        attention_backward_dq_convert(dq_sum, dq, count, scale, parts, head_elements);
    }, 1, 32, 0);
}

extern "C" void run_dq_convert_strided(const float* dq_sum, dq_element* dq, i64 count,
                                       float scale, int parts, i64 head_elements, int n_heads,
                                       i64 n_q, int head_dim, const i64* s) {
    run_blocks([&] {
        attention_backward_dq_convert_strided(dq_sum, dq, count, scale, parts, head_elements,
                                              n_heads, n_q, head_dim, s[12], s[13], s[14]);
    }, 1, 32, 0);
}
"""
DECODE_RUNNER = RUN_BLOCKS + r"""
// strides: q, k, v, o (3 each). The merge of the splits is attention_decode.cu's, run by
// emulate_decode_cpu.py; here the splits are 1 (o direct) or the partials are compared.
// tables: a padded or paged batch's descriptors and block table (null and 0 for a dense
// call, the table null for a padded one).
extern "C" void run_decode(const bits16* q, const bits16* k, const bits16* v, bits16* o,
                           float* lse, float* partial_o, float* partial_lse, u32* split_counts,
                           const double* slopes, i64 n_q, i64 n_k, int n_q_heads, int group,
                           int splits,
                           const i64* s, const float* reals, const i64* band,
                           const i64* descriptors, const i64* block_table, i64 table_stride,
                           i64 page_size, i64 n_pages, int blocks, int shared) {
    run_blocks([&] {
        attention_decode_mma(q, k, v, o, lse, partial_o, partial_lse, split_counts, slopes,
                             n_q, n_k, n_q_heads, group, splits, s[0], s[1], s[2], s[3], s[4], s[5],
                             s[6], s[7], s[8], s[9], s[10], s[11], reals[0], reals[1],
                             band[0], band[1], band[2], 0u, 0u, 1.0f, 0u, 0u, descriptors,
                             nullptr, block_table, table_stride, page_size, n_pages);
    }, blocks, kThreads, shared);
}
"""

_LIBRARIES: dict = {}


def _replace_function(text: str, start: str, body: str) -> str:
    """`text` with the definition that begins with `start` given `body` (unchanged where the
    source does not include that header: the 16-bit kernels have no tf32.cuh)."""
    at = text.find(start)
    if at < 0:
        return text
    open_brace = at + len(start) - 1
    depth, end = 0, open_brace
    for end in range(open_brace, len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            break
    return text[:open_brace] + body + text[end + 1:]


def _slopes(options) -> np.ndarray:
    """ALiBi slopes as the kernels read them (one unread slope where there are none)."""
    return (np.zeros(1) if options.alibi_slopes is None
            else np.ascontiguousarray(options.alibi_slopes, dtype=np.float64))


def _nan_buffer(shape: tuple, dtype, sequence_first: bool) -> np.ndarray:
    """A NaN-filled (B, H, N, D) array, stored (B, N, H, D) with `sequence_first` (a
    "bshd" call's layout): whatever a kernel leaves unwritten shows."""
    if not sequence_first:
        return np.full(shape, np.nan, dtype)
    batch, heads, rows, width = shape
    return np.full((batch, rows, heads, width), np.nan, dtype).swapaxes(1, 2)


def _row_deltas(do, o, lse, accum) -> tuple:
    """D = rowsum(do * o) and lse as a backward's launcher hands them to its kernels:
    contiguous, in the accumulation dtype."""
    return ((do.astype(accum) * o.astype(accum)).sum(-1).astype(accum),
            np.ascontiguousarray(lse, accum))


def _forward_outputs(q, value_dim: int, sequence_first_o: bool, dtype, lse_dtype) -> tuple:
    """NaN-filled o (in `_nan_buffer`'s layout) and contiguous lse for a forward of `q`."""
    batch, n_q_heads, n_q = q.shape[:3]
    return (_nan_buffer((batch, n_q_heads, n_q, value_dim), dtype, sequence_first_o),
            np.full((batch, n_q_heads, n_q), np.nan, lse_dtype))


def _run_forward(lib, q, k, v, options, operands: tuple, block_q: int, shared: int,
                 sequence_first_o: bool) -> tuple:
    """o and lse of a forward built with RUNNER's entry (`lib`) on host arrays: outputs as
    `_forward_outputs` makes them (o in q's dtype, lse and the score reals in float64 for
    float64, else float32), `operands` the band, reals and bits of `score_operands`, one
    block per query tile of each head, `shared` bytes of shared memory."""
    batch, n_q_heads, n_q = q.shape[:3]
    n_kv_heads, n_k, value_dim = k.shape[1], k.shape[2], v.shape[3]
    band, reals, bits = operands
    accum = np.float64 if q.dtype == np.float64 else np.float32
    o, lse = _forward_outputs(q, value_dim, sequence_first_o, q.dtype, accum)
    slopes = _slopes(options)
    strides = np.array([s // a.itemsize for a in (q, k, v, o) for s in a.strides[:3]], np.int64)
    pointer = lambda a: ctypes.c_void_p(a.ctypes.data)  # noqa: E731
    lib.run.restype = None
    lib.run(*(pointer(a) for a in (q, k, v, o, lse, slopes)), ctypes.c_int64(n_q),
            ctypes.c_int64(n_k), ctypes.c_int(n_q_heads), ctypes.c_int(n_q_heads // n_kv_heads),
            pointer(strides), pointer(reals.astype(accum)), pointer(band), pointer(bits),
            ctypes.c_int(batch * n_q_heads * -(-n_q // block_q)), ctypes.c_int(shared))
    return o, lse


def library(defines: dict, source_name: str = "attention_mma_forward.cu",
            runner: str = RUNNER) -> ctypes.CDLL:
    key = tuple(sorted(defines.items())) + (source_name,)
    if key in _LIBRARIES:
        return _LIBRARIES[key]
    text = source(source_name)
    for start, body in FUNCTIONS:
        text = _replace_function(text, start, body)
    for pattern, replacement in PATCHES + MORE_PATCHES:
        text = re.sub(pattern, replacement, text)
    text, count = re.subn(COPY_PATTERN, lambda _: COPY + "\ntemplate <int ChunkBytes>\n"
                          "inline void copy_chunk_async_ptx(", text)
    assert count == 1 or source_name == "split_keys_merge.cu", "copy_chunk_async not found"
    text = text.replace('#include "', '// #include "')
    # The emulated PTX uses common.cuh's types: it goes in before the first struct there.
    code = PRELUDE + text.replace("struct half_storage", WARP_PTX + "\nstruct half_storage",
                                  1) + runner
    _LIBRARIES[key] = build(code, key[:-1], "mma")
    return _LIBRARIES[key]


def emulate(q, k, v, tiles: MmaTiles, sequence_first_o: bool, **kwargs):
    """o and lse of attention_forward_mma for host 16-bit arrays (rows contiguous)."""
    options = resolved(q, k, v, **kwargs)
    n_q, head_dim = q.shape[2:]
    n_k, value_dim = k.shape[2], v.shape[3]
    switches, band, reals, bits = score_operands(options, n_q, n_k)
    is_bfloat16 = q.dtype.name == "bfloat16"
    defines = dict(STORAGE=STORAGE[q.dtype.name], ACCUM="float", HEAD_DIM=head_dim,
                   VALUE_DIM=value_dim, COPY_BYTES=16 if head_dim % 8 == 0 else 2,
                   BLOCK_Q=tiles.block_q, BLOCK_K=tiles.block_k, WARP_ROWS=tiles.warp_rows,
                   Q_IN_REGISTERS=int(tiles.q_in_registers), IS_BFLOAT16=int(is_bfloat16),
                   DEFERRED_COPIES=1, STRIDED_OUT=int(sequence_first_o), **switches)
    return _run_forward(library(defines), q, k, v, options, (band, reals, bits), tiles.block_q,
                        tiles.shared_bytes(Widths.padded(head_dim, value_dim, 16)),
                        sequence_first_o)


def emulate_backward(do, q, k, v, o, lse, tiles: MmaBackwardTiles, sequence_first: bool,
                     single_pass: bool = False, ordered: bool = False, dq_parts: bool = False,
                     **kwargs):
    """dq, dk, dv of attention_backward_dq_mma and attention_backward_dkdv_mma (the
    two-kernel path: dK and dV in one kernel, by warp pairs where `tiles.paired` says so
    (dQ's too), or in two launches where `tiles.split`) for host arrays; D = rowsum(do * o)
    and lse as the launcher passes them (float32, contiguous). With `sequence_first` the
    gradients are written into (B, N, H, D) buffers (STRIDED_OUT), as a "bshd" call's are.
    `single_pass`: the dK/dV kernel alone adds dQ into float32 sums (SINGLE_PASS, in
    arrival order, or in turns with `ordered`: ORDERED, its blocks' tickets taken in the
    emulation's sequential order), or with `dq_parts` (DQ_PARTS) into a slot per key block,
    which attention_backward_dq_convert[_strided] turns into dq."""
    options = resolved(q, k, v, **kwargs)
    batch, n_q_heads, n_q, head_dim = q.shape
    n_kv_heads, n_k, value_dim = k.shape[1], k.shape[2], v.shape[3]
    switches, band, reals, bits = score_operands(options, n_q, n_k)
    is_float32 = q.dtype == np.float32  # 3xTF32 on the same kernels (IS_FLOAT32)
    is_float64 = q.dtype == np.float64  # FP64 tensor cores (IS_FLOAT64)
    accum = np.float64 if is_float64 else np.float32
    reals = reals.astype(accum)
    delta, lse = _row_deltas(do, o, lse, accum)
    slopes = _slopes(options)
    dq, dk, dv = (_nan_buffer(a.shape, q.dtype, sequence_first) for a in (q, k, v))
    strides = np.array([s // a.itemsize for a in (q, k, v, do, dq, dk, dv)
                        for s in a.strides[:3]], np.int64)
    widths = Widths.padded(head_dim, value_dim, 8 if is_float32 or is_float64 else 16)
    pointer = lambda a: ctypes.c_void_p(a.ctypes.data)  # noqa: E731
    common = dict(STORAGE=STORAGE[q.dtype.name], ACCUM="double" if is_float64 else "float",
                  HEAD_DIM=head_dim, VALUE_DIM=value_dim,
                  COPY_BYTES=16 if head_dim * q.itemsize % 16 == 0 else q.itemsize,
                  IS_BFLOAT16=int(q.dtype.name == "bfloat16"), IS_FLOAT32=int(is_float32),
                  IS_FLOAT64=int(is_float64),
                  ORDERED=int(single_pass and ordered), SINGLE_PASS=int(single_pass),
                  DQ_PARTS=int(single_pass and dq_parts),
                  DEFERRED_COPIES=1,
                  STRIDED_OUT=int(sequence_first), **switches)
    launches = ([] if single_pass else [("dq", 0)]) + [
        ("dkdv", part) for part in ((1, 2) if tiles.split else (0,))]
    slots = -(-n_k // tiles.dkdv[0]) if single_pass and dq_parts else 1
    dq_sum = np.zeros(dq.size * slots if single_pass else 1, np.float32)
    for entry, part in launches:
        owned, streamed = getattr(tiles, entry)
        # float32 zeroes the probabilities of a last query tile's rows past Nq (QUERY_TAIL),
        # as the launcher compiles it.
        tail = int(entry == "dkdv" and (is_float32 or is_float64) and n_q % streamed != 0)
        lib = library(dict(common, OWNED_ROWS=owned, STREAMED_ROWS=streamed, QUERY_TAIL=tail,
                           DKDV_PART=part,
                           PAIRED_WARPS=int(entry in tiles.paired)),
                      "attention_mma_backward.cu", BACKWARD_RUNNER)
        shared = tiles.shared_bytes(entry, widths, q.itemsize, single_pass, part)
        heads, rows = (n_q_heads, n_q) if entry == "dq" else (n_kv_heads, n_k)
        blocks = batch * heads * -(-rows // owned)
        outputs = (dq,) if entry == "dq" else (dk, dv, dq_sum)
        function = getattr(lib, f"run_{entry}")
        function.restype = None
        function(*(pointer(a) for a in (q, k, v, do, lse, delta) + outputs), pointer(slopes),
                 ctypes.c_int64(n_q), ctypes.c_int64(n_k), ctypes.c_int(n_q_heads),
                 ctypes.c_int(n_q_heads // n_kv_heads), pointer(strides), pointer(reals),
                 pointer(band), pointer(bits), ctypes.c_int(blocks),
                 ctypes.c_int(tiles.threads(entry)), ctypes.c_int(shared))
    converted = (ctypes.c_void_p(dq.__array_interface__["data"][0]), ctypes.c_int64(dq.size),
                 ctypes.c_float(options.scale), ctypes.c_int(slots),
                 ctypes.c_int64(n_q * head_dim))
    if single_pass and sequence_first:  # attention_backward_dq_convert_strided itself
        function = lib.run_dq_convert_strided
        function.restype = None
        function(pointer(dq_sum), *converted, ctypes.c_int(n_q_heads), ctypes.c_int64(n_q),
                 ctypes.c_int(head_dim), pointer(strides))
    elif single_pass:  # attention_backward_dq_convert itself (summing the slots)
        function = lib.run_dq_convert
        function.restype = None
        function(pointer(dq_sum), *converted)
    return dq, dk, dv


WGMMA_BACKWARD_RUNNER = RUN_BLOCKS + r"""
// strides: q, k, v, do, then dq, dk, dv (3 each: batch, head, row).
extern "C" void run_dq(const bits16* q, const bits16* k, const bits16* v, const bits16* d_out,
                       const float* lse, const float* delta, bits16* dq, const double* slopes,
                       i64 n_q, i64 n_k, int n_q_heads, int group, const i64* s,
                       const float* reals, const i64* band, const unsigned* bits, int blocks,
                       int threads, int shared) {
    run_blocks([&] {
        attention_backward_dq_wgmma(q, k, v, d_out, lse, delta, dq, slopes, n_q, n_k, n_q_heads,
                                    group, s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8],
                                    s[9], s[10], s[11], reals[0], reals[1], band[0], band[1],
                                    band[2], bits[0], bits[1], reals[2], bits[2], bits[3],
                                    nullptr, nullptr, nullptr, 0, 0, 0, s[12], s[13], s[14]);
    }, blocks, threads, shared);
}

extern "C" void run_dkdv(const bits16* q, const bits16* k, const bits16* v,
                         const bits16* d_out, const float* lse, const float* delta, bits16* dk,
                         bits16* dv, const double* slopes, i64 n_q, i64 n_k, int n_q_heads,
                         int group, const i64* s, const float* reals, const i64* band,
                         const unsigned* bits, int blocks, int threads, int shared) {
    int flags[4096] = {};
    run_blocks([&] {
        attention_backward_dkdv_wgmma(q, k, v, d_out, lse, delta, dk, dv, nullptr, flags, slopes,
                                      n_q, n_k, n_q_heads, group, s[0], s[1], s[2], s[3], s[4],
                                      s[5], s[6], s[7], s[8], s[9], s[10], s[11], reals[0],
                                      reals[1], band[0], band[1], band[2], bits[0], bits[1],
                                      reals[2], bits[2], bits[3], nullptr, nullptr, nullptr, 0,
                                      0, 0, s[15], s[16], s[17], s[18], s[19], s[20]);
    }, blocks, threads, shared);
}
"""


def emulate_wgmma_backward(do, q, k, v, o, lse, tiles: WgmmaBackwardTiles,
                           sequence_first: bool, **kwargs):
    """dq, dk, dv of attention_backward_dq_wgmma and attention_backward_dkdv_wgmma (the
    16-bit Hopper backward's two kernels; dK and dV in two launches where `tiles.split`)
    for host arrays; D = rowsum(do * o) and lse as the launcher passes them (float32,
    contiguous). With `sequence_first` the gradients go into (B, N, H, D) buffers
    (STRIDED_OUT), as a "bshd" call's do."""
    options = resolved(q, k, v, **kwargs)
    batch, n_q_heads, n_q, head_dim = q.shape
    n_kv_heads, n_k, value_dim = k.shape[1], k.shape[2], v.shape[3]
    switches, band, reals, bits = score_operands(options, n_q, n_k)
    reals = reals.astype(np.float32)
    delta, lse = _row_deltas(do, o, lse, np.float32)
    slopes = _slopes(options)
    dq, dk, dv = (_nan_buffer(a.shape, q.dtype, sequence_first) for a in (q, k, v))
    strides = np.array([s // a.itemsize for a in (q, k, v, do, dq, dk, dv)
                        for s in a.strides[:3]], np.int64)
    widths = Widths.padded(head_dim, value_dim, 16)
    pointer = lambda a: ctypes.c_void_p(a.ctypes.data)  # noqa: E731
    common = dict(STORAGE=STORAGE[q.dtype.name], ACCUM="float", HEAD_DIM=head_dim,
                  VALUE_DIM=value_dim, COPY_BYTES=16 if head_dim % 8 == 0 else 2,
                  IS_BFLOAT16=int(q.dtype.name == "bfloat16"), SINGLE_PASS=0,
                  STAGES=tiles.stages, DEFERRED_COPIES=1, STRIDED_OUT=int(sequence_first),
                  **switches)
    for entry, part in [("dq", 0)] + [("dkdv", part) for part in ((1, 2) if tiles.split
                                                                  else (0,))]:
        owned, streamed = getattr(tiles, entry)
        lib = library(dict(common, OWNED_ROWS=owned, STREAMED_ROWS=streamed, DKDV_PART=part),
                      "attention_wgmma_backward.cu", WGMMA_BACKWARD_RUNNER)
        heads, rows = (n_q_heads, n_q) if entry == "dq" else (n_kv_heads, n_k)
        function = getattr(lib, f"run_{entry}")
        function.restype = None
        function(*(pointer(a) for a in (q, k, v, do, lse, delta)),
                 *(pointer(a) for a in ((dq,) if entry == "dq" else (dk, dv))), pointer(slopes),
                 ctypes.c_int64(n_q), ctypes.c_int64(n_k), ctypes.c_int(n_q_heads),
                 ctypes.c_int(n_q_heads // n_kv_heads), pointer(strides), pointer(reals),
                 pointer(band), pointer(bits),
                 ctypes.c_int(batch * heads * -(-rows // owned)),
                 ctypes.c_int(owned // 64 * 128),
                 ctypes.c_int(tiles.shared_bytes(entry, widths, False, part)))
    return dq, dk, dv


def emulate_decode(q, k, v, tiles, sequence_first_o: bool, paged=None, padded=None,
                   paired_page_rows=False, **kwargs):
    """o and lse of attention_decode_mma.cu for host 16-bit arrays (one split: o written
    directly; more: merged by each group's last block), o in a (B, Nq, Hq, Dv) buffer with
    `sequence_first_o`; the split counters must end at zero. With `paged` (a
    `PagedKeys`), K and V are its pools, read through its block table (PAGED); with
    `padded` (``seqlens_q`` and ``seqlens_k``), batch element b is a sequence of those
    lengths (VARLEN)."""
    varlen = (paged.keywords() if paged is not None
              else None if padded is None
              else {"cu_seqlens_q": None, "cu_seqlens_k": None, "block_table": None, **padded})
    options = resolved(q, k, v, **kwargs, **({"varlen": varlen} if varlen is not None else {}))
    batch, n_q_heads, n_q, head_dim = q.shape
    n_kv_heads, n_k, value_dim = k.shape[1], k.shape[2], v.shape[3]
    if varlen is None:
        switches, band, reals, _ = score_operands(options, n_q, n_k)
    else:  # as operands.score_arguments: the kernel adds each sequence's own band offset
        switches, band, reals, _ = score_operands(options, n_q,
                                                  options.varlen.key_capacity(n_k))
        band[0] = options.row_offset - options.col_offset
    reals = reals[:2].astype(np.float32)
    defines = dict(STORAGE=STORAGE[q.dtype.name], ACCUM="float", HEAD_DIM=head_dim,
                   VALUE_DIM=value_dim, COPY_BYTES=16 if head_dim % 8 == 0 else 2,
                   Q_COPY_BYTES=16 if head_dim % 8 == 0 else 2,
                   IS_BFLOAT16=int(q.dtype.name == "bfloat16"), ROW_TILES=tiles.row_tiles,
                   ROW_WARPS=tiles.row_warps, WARPS=tiles.warps, WARP_KEYS=tiles.warp_keys,
                   STAGES=tiles.stages, MIN_BLOCKS=1, DEFERRED_COPIES=1,
                   STRIDED_OUT=int(sequence_first_o), **switches)
    defines["FUSED_MERGE"] = int(tiles.splits > 1)  # the last block of a group merges
    tables = (None, None, 0, 0, 0)
    if paged is not None:
        defines.update(VARLEN=1, PAGED=1, PAIRED_PAGE_ROWS=int(paired_page_rows))
        layout = options.varlen  # as varlen.Sequences builds the launch's tables
        table = np.ascontiguousarray(layout.block_table, dtype=np.int64)
        tables = (layout.descriptors(batch, n_q, n_k), table, table.shape[1],
                  layout.page_size, layout.num_pages)
    elif padded is not None:
        defines.update(VARLEN=1, PAGED=0)
        tables = (options.varlen.descriptors(batch, n_q, n_k), None, 0, 0, 0)
    # The launcher's operand: the (B, Hq) slopes, or a stand-in where ALiBi is off.
    slopes = _slopes(options)
    lib = library(defines, "attention_decode_mma.cu", DECODE_RUNNER)
    o, lse = _forward_outputs(q, value_dim, sequence_first_o, q.dtype, np.float32)
    n_rows = batch * n_q_heads * n_q
    partial_o = np.full(tiles.splits * n_rows * value_dim + 1, np.nan, np.float32)
    partial_lse = np.full(tiles.splits * n_rows + 1, np.nan, np.float32)
    groups = batch * n_kv_heads * tiles.row_groups(n_q * n_q_heads // n_kv_heads)
    counters = np.zeros(groups, np.uint32)
    strides = np.array([s // a.itemsize for a in (q, k, v, o) for s in a.strides[:3]], np.int64)
    pointer = lambda a: ctypes.c_void_p(a.ctypes.data)  # noqa: E731
    lib.run_decode.restype = None
    descriptors, table, table_stride, page_size, n_pages = tables
    lib.run_decode(*(pointer(a) for a in (q, k, v, o, lse, partial_o, partial_lse, counters,
                                           slopes)),
                   ctypes.c_int64(n_q), ctypes.c_int64(n_k), ctypes.c_int(n_q_heads),
                   ctypes.c_int(n_q_heads // n_kv_heads), ctypes.c_int(tiles.splits),
                   pointer(strides), pointer(reals), pointer(band),
                   *(ctypes.c_void_p(None) if a is None else pointer(a)
                     for a in (descriptors, table)),
                   ctypes.c_int64(table_stride), ctypes.c_int64(page_size),
                   ctypes.c_int64(n_pages), ctypes.c_int(groups * tiles.splits),
                   ctypes.c_int(tiles.shared_bytes(head_dim, value_dim)))
    assert not counters.any(), f"split counters left at {counters}"
    return o, lse


def _matches(o, lse, golden_o, golden_lse, dtype, label: str) -> bool:
    """Whether o and lse are within the dtype's tolerance of the golden model; prints the
    case as ok or FAILED with the first difference."""
    try:
        assert_attention_close(o, golden_o, dtype, name="o")
        assert_attention_close(lse, golden_lse, dtype, name="lse")
    except AssertionError as error:
        print(f"FAILED {label}: {error}")
        return False
    print(f"ok {label}", flush=True)
    return True


class PagedKeys:
    """Dense keys and values (B, Hkv, N, D) laid out in a NaN-filled pool of shuffled pages
    (heads-major, or page-major seen through a transposed view) with a block table whose
    unused entries are -1, for `emulate_decode(paged=...)`."""

    def __init__(self, k, v, lengths, page_size: int, page_major: bool, rng):
        batch, n_kv_heads = k.shape[:2]
        pages_of = [-(-int(n) // page_size) for n in lengths]
        order = rng.permutation(sum(pages_of) + 2)
        self.table = np.full((batch, max(pages_of) + 1), -1, np.int32)
        self.lengths = np.asarray(lengths)
        self.pools = []
        for dense in (k, v):
            shape = ((len(order), page_size, n_kv_heads, dense.shape[3]) if page_major
                     else (len(order), n_kv_heads, page_size, dense.shape[3]))
            stored = np.full(shape, np.nan, dense.dtype)
            pool = stored.transpose(0, 2, 1, 3) if page_major else stored
            first = 0
            for b, length in enumerate(lengths):
                self.table[b, :pages_of[b]] = order[first:first + pages_of[b]]
                first += pages_of[b]
                j = np.arange(length)
                pool[self.table[b, j // page_size], :, j % page_size] = np.swapaxes(
                    dense[b, :, :length], 0, 1)
            self.pools.append(pool)

    def keywords(self) -> dict:
        """`validate`'s varlen keywords for this cache."""
        return {"seqlens_q": None, "seqlens_k": self.lengths, "cu_seqlens_q": None,
                "cu_seqlens_k": None, "block_table": self.table}


# (dtype, (B, Hq, Hkv, Nq, Nk, D, Dv), lengths, page size, page-major, options,
# DecodeMmaTiles): row offsets stored in the stages one tile ahead (pages shorter than a
# stage, as long, longer), with 3 stages, splits merged in the kernel, a second row warp,
# and widths whose chunks the threads do not divide evenly (D 96, Dv 72 -> 80).
PAGED_DECODE_CASES = [
    ("float16", (2, 8, 2, 1, 704, 64, 64), (700, 333), 16, False, {},
     DecodeMmaTiles(1, 4, 16, 2, 3)),
    ("float16", (2, 8, 2, 2, 448, 64, 64), (448, 190), 1, True, {"causal": True},
     DecodeMmaTiles(1, 4, 16, 3, 2)),
    ("bfloat16", (1, 16, 2, 2, 512, 64, 32), (500,), 64, True, {"causal": True},
     DecodeMmaTiles(1, 2, 32, 2, 2, 2)),
    ("float16", (2, 4, 1, 1, 768, 32, 32), (768, 257), 256, False, {"window": (300, 0)},
     DecodeMmaTiles(1, 4, 16, 4, 1)),
    ("float16", (2, 8, 2, 1, 400, 96, 72), (400, 170), 16, False, {},
     DecodeMmaTiles(1, 4, 16, 2, 3)),
    # ALiBi at each sequence's own bottom-right offset (190 keys for 2 causal rows).
    ("float16", (2, 8, 2, 2, 448, 64, 64), (448, 190), 16, False,
     {"causal": True, "alibi_slopes": np.linspace(0.02, 0.3, 16).reshape(2, 8)},
     DecodeMmaTiles(1, 4, 16, 2, 2)),
    # 142 packed rows (71 heads over one K/V head, Nq 2) in two row groups of eight row
    # warps, pages of 16.
    ("float16", (2, 71, 1, 2, 320, 64, 64), (320, 150), 16, False, {"causal": True},
     DecodeMmaTiles(1, 1, 64, 2, 2, 8)),
    # A thread's row pairs in one page (pages of 2 x its row step): D 128 over pages of 16,
    # D 64 over pages of 32, D 256 over pages of 8 beside Dv 128 (whose row step is 8:
    # each V row's address loaded); last pages partly filled.
    ("float16", (2, 8, 2, 1, 640, 128, 128), (640, 333), 16, True, {},
     DecodeMmaTiles(1, 4, 16, 2, 3)),
    ("bfloat16", (1, 8, 2, 2, 512, 64, 64), (500,), 32, False, {"causal": True},
     DecodeMmaTiles(1, 4, 16, 3, 2)),
    ("float16", (2, 4, 1, 1, 320, 256, 128), (300, 77), 8, True, {},
     DecodeMmaTiles(1, 4, 16, 2, 2)),
]


def check_paged_decodes(rng) -> int:
    """The paged cases against the golden model on the dense keys: the failures' count."""
    failures = 0
    for name, (batch, hq, hkv, nq, nk, d, dv), lengths, page, page_major, options, tiles in \
            PAGED_DECODE_CASES:
        dtype = bfloat16() if name == "bfloat16" else np.dtype(name)
        q, k, v = (rng.standard_normal(s).astype(np.float32).astype(dtype)
                   for s in ((batch, hq, nq, d), (batch, hkv, nk, d), (batch, hkv, nk, dv)))
        paged = PagedKeys(k, v, lengths, page, page_major, rng)
        golden_o, golden_lse = tileattn.forward(*(a.astype(np.float64) for a in (q, k, v)),
                                                backend="reference", return_lse=True,
                                                seqlens_k=np.asarray(lengths), **options)
        for sequence_first_o, paired in ((False, False), (True, False), (False, True)):
            o, lse = emulate_decode(q, *paged.pools, tiles, sequence_first_o, paged=paged,
                                    paired_page_rows=paired, **options)
            failures += not _matches(
                o, lse, golden_o, golden_lse, dtype,
                f"paged decode {name} q{q.shape} keys {lengths} pages of {page} "
                f"{'page' if page_major else 'heads'}-major {sorted(options)} {tiles}"
                f"{' o (B, N, H, Dv)' if sequence_first_o else ''}"
                f"{' paired page rows' if paired else ''}")
    return failures


# (dtype, (B, Hq, Hkv, Nq, Nk, D, Dv), seqlens_q, seqlens_k, options, DecodeMmaTiles): a
# padded batch (VARLEN), Q rows and keys past each sequence NaN; ALiBi and the causal band
# at each sequence's own bottom-right offset.
PADDED_DECODE_CASES = [
    ("bfloat16", (2, 8, 2, 3, 500, 64, 64), (3, 1), (500, 210),
     {"causal": True, "alibi_slopes": np.linspace(0.01, 0.4, 16).reshape(2, 8)},
     DecodeMmaTiles(1, 4, 16, 2, 3)),
    ("float16", (3, 4, 1, 1, 300, 64, 64), (1, 1, 0), (300, 17, 256),
     {"alibi_slopes": np.linspace(0.05, 0.5, 4)}, DecodeMmaTiles(1, 4, 16, 2, 1)),
    # 120 packed rows on four row warps of two m16 tiles; the second sequence's third query
    # row is padding.
    ("bfloat16", (2, 40, 1, 3, 300, 64, 64), (3, 2), (300, 120), {"causal": True},
     DecodeMmaTiles(2, 1, 64, 2, 2, 4)),
]


def check_padded_decodes(rng) -> int:
    """The padded cases against the golden model: the failures' count."""
    failures = 0
    for name, (batch, hq, hkv, nq, nk, d, dv), seqlens_q, seqlens_k, options, tiles in \
            PADDED_DECODE_CASES:
        dtype = bfloat16() if name == "bfloat16" else np.dtype(name)
        q, k, v = (rng.standard_normal(s).astype(np.float32).astype(dtype)
                   for s in ((batch, hq, nq, d), (batch, hkv, nk, d), (batch, hkv, nk, dv)))
        for b in range(batch):
            q[b, :, seqlens_q[b]:] = np.nan
            k[b, :, seqlens_k[b]:] = v[b, :, seqlens_k[b]:] = np.nan
        lengths = {"seqlens_q": np.asarray(seqlens_q), "seqlens_k": np.asarray(seqlens_k)}
        golden_o, golden_lse = tileattn.forward(*(a.astype(np.float64) for a in (q, k, v)),
                                                backend="reference", return_lse=True,
                                                **lengths, **options)
        for sequence_first_o in (False, True):
            o, lse = emulate_decode(q, k, v, tiles, sequence_first_o, padded=lengths,
                                    **options)
            failures += not _matches(
                o, lse, golden_o, golden_lse, dtype,
                f"padded decode {name} q{q.shape} rows {seqlens_q} keys {seqlens_k} "
                f"{sorted(options)} {tiles}{' o (B, N, H, Dv)' if sequence_first_o else ''}")
    return failures


DECODE_CASES = [
    # (dtype, (B, Hq, Hkv, Nq, Nk, D, Dv), options, DecodeMmaTiles)
    ("float16", (2, 8, 2, 1, 300, 64, 64), {}, DecodeMmaTiles(1, 4, 16, 2, 1)),
    ("bfloat16", (1, 8, 1, 3, 333, 128, 128), {"causal": True, "softcap": 4.0},
     DecodeMmaTiles(1, 4, 16, 2, 1)),
    ("float16", (1, 16, 2, 4, 200, 72, 40), {"causal": True}, DecodeMmaTiles(1, 2, 32, 2, 1, 2)),
    # splits merged by the last block of each group (FUSED_MERGE); 7 splits of 5 key tiles
    # leave some empty (o = 0, lse = -inf partials), a window leaves rows of some splits
    # keyless
    ("float16", (2, 8, 2, 1, 700, 64, 64), {}, DecodeMmaTiles(1, 4, 16, 2, 3)),
    ("bfloat16", (1, 16, 2, 4, 300, 72, 40), {"causal": True, "window": (40, 0)},
     DecodeMmaTiles(1, 2, 32, 2, 7, 2)),
    # 32 packed rows in two row groups of 16 (a block and a split counter each), 3 splits
    ("float16", (2, 16, 2, 4, 500, 64, 64), {"causal": True}, DecodeMmaTiles(1, 4, 16, 2, 3)),
    # ALiBi, a slope per packed row (its query head's; per batch element where given so):
    # Nq 1 with four heads a block; causal Nq 4 in two row groups and 3 splits; 48 rows in
    # two row warps of two m16 tiles each (the second tile's slopes); a window.
    ("float16", (2, 8, 2, 1, 300, 64, 64),
     {"alibi_slopes": np.linspace(0.02, 0.5, 16).reshape(2, 8)}, DecodeMmaTiles(1, 4, 16, 2, 1)),
    ("bfloat16", (1, 16, 2, 4, 333, 128, 128),
     {"causal": True, "alibi_slopes": np.linspace(0.02, 0.5, 16)}, DecodeMmaTiles(1, 4, 16, 2, 3)),
    ("float16", (1, 12, 1, 4, 200, 64, 64),
     {"causal": True, "softcap": 3.0, "alibi_slopes": np.linspace(0.05, 0.6, 12)},
     DecodeMmaTiles(2, 2, 32, 2, 2, 2)),
    ("float16", (2, 8, 2, 3, 400, 64, 64),
     {"window": (100, 0), "alibi_slopes": np.linspace(0.3, 0.01, 16).reshape(2, 8)},
     DecodeMmaTiles(1, 4, 16, 3, 1)),
    # 65-128 packed rows on eight row warps of one m16 tile (speculative rows of a GQA
    # group): 68 rows leave three row warps without rows in use, 100 rows one; those skip
    # the products and still copy their share of each stage.
    ("float16", (1, 16, 4, 17, 300, 64, 64), {"causal": True}, DecodeMmaTiles(1, 1, 64, 2, 2, 8)),
    ("bfloat16", (1, 8, 2, 25, 400, 64, 48),
     {"causal": True, "window": (120, 0), "alibi_slopes": np.linspace(0.05, 0.4, 8)},
     DecodeMmaTiles(1, 1, 64, 2, 1, 8)),
    # 142 rows (71 query heads over one K/V head, Nq 2) in two row groups of 128: the second
    # block's 14 rows leave seven of its row warps without rows in use.
    ("float16", (1, 71, 1, 2, 300, 64, 64), {"causal": True}, DecodeMmaTiles(1, 1, 64, 2, 2, 8)),
    # 71 rows on four row warps of two m16 tiles (D <= 64): the last warp without rows,
    # the third with its second tile's rows past the last.
    ("bfloat16", (2, 71, 1, 1, 500, 64, 64), {"softcap": 5.0}, DecodeMmaTiles(2, 1, 64, 2, 3, 4)),
]


BACKWARD_CASES = [
    # (dtype, (B, Hq, Hkv, Nq, Nk, D, Dv), options, MmaBackwardTiles[, NaN places]): NaN
    # places, {"q" | "do": [(b, h, row, column), ...]}, are rows that a causal band keeps
    # for some keys of a cut tile and masks for others.
    ("float16", (1, 2, 1, 64, 96, 64, 64), {}, MmaBackwardTiles((64, 64), (64, 32))),
    ("bfloat16", (1, 4, 2, 48, 80, 64, 32), {"causal": True, "softcap": 5.0},
     MmaBackwardTiles((64, 32), (64, 32))),
    # Query tiles that keep no key (causal, Nq > Nk: dq = 0 without a key loop) and key
    # tiles that no query keeps (a left window: dk = dv = 0 without a query loop).
    ("float16", (1, 2, 1, 150, 40, 64, 64), {"causal": True},
     MmaBackwardTiles((64, 32), (64, 32))),
    ("float16", (1, 2, 2, 20, 300, 64, 64), {"causal": True, "window": (30, 0)},
     MmaBackwardTiles((64, 32), (64, 32))),
    ("float32", (1, 4, 2, 45, 70, 32, 24), {"causal": True}, MmaBackwardTiles((64, 32),
                                                                             (64, 32))),
    # dK and dV by warp pairs (PAIRED_WARPS) and in two launches (DKDV_PART 1 and 2).
    ("float32", (1, 4, 2, 45, 150, 40, 40), {"causal": True, "softcap": 4.0},
     MmaBackwardTiles((64, 16), (64, 16), paired=("dq", "dkdv"))),
    ("float32", (2, 2, 1, 70, 90, 24, 24), {"window": (20, 10), "dropout_p": 0.2,
                                            "seed": 3},
     MmaBackwardTiles((32, 32), (32, 32), paired=("dq", "dkdv"))),
    ("bfloat16", (1, 2, 1, 70, 90, 48, 48), {"causal": True, "softcap": 3.0},
     MmaBackwardTiles((32, 32), (32, 32), paired=("dq", "dkdv"))),
    ("float32", (1, 2, 1, 40, 60, 200, 196), {"causal": True},
     MmaBackwardTiles((32, 16), (32, 16), paired=("dq",))),
    ("float32", (1, 2, 2, 33, 50, 40, 24), {"causal": True},
     MmaBackwardTiles((32, 16), (32, 16), split=True)),
    # NaN in Q and dO on cut tiles: the scans and kept terms of both kernels, on pairs
    # (whose two warps add different terms) and on one warp a slab (dK and dV together).
    ("float32", (1, 2, 1, 70, 90, 40, 40), {"causal": True},
     MmaBackwardTiles((32, 16), (32, 16), paired=("dq", "dkdv")),
     {"q": [(0, 0, 37, 5)], "do": [(0, 1, 20, 3)]}),
    ("float16", (1, 2, 1, 70, 90, 48, 48), {"causal": True},
     MmaBackwardTiles((32, 32), (32, 32)), {"q": [(0, 1, 37, 5)], "do": [(0, 0, 50, 7)]}),
    # Pairs at D != Dv: one accumulator tile of the wider width for either half.
    ("float32", (1, 2, 1, 60, 80, 40, 24), {"causal": True},
     MmaBackwardTiles((32, 16), (32, 16), paired=("dq", "dkdv")),
     {"q": [(0, 1, 30, 2)], "do": [(0, 0, 41, 20)]}),
    ("bfloat16", (1, 2, 1, 50, 70, 32, 64), {"causal": True, "softcap": 3.0},
     MmaBackwardTiles((32, 32), (32, 32), paired=("dq", "dkdv"))),
    # float32's rows over <= 128 keys: 64 owned rows, 16 streamed at D 65-128.
    ("float32", (1, 2, 1, 100, 120, 128, 128), {"causal": True},
     MmaBackwardTiles((64, 16), (64, 16))),
]

# The single pass (SINGLE_PASS: dQ added by the dK/dV kernel), as BACKWARD_CASES; NaN places
# may also be in K ("k": its owned tile's non-finite elements enter dQ's products as 0 on
# cut tiles, their kept terms on CUDA cores).
SINGLE_PASS_CASES = [
    ("float16", (1, 2, 1, 64, 96, 64, 64), {"causal": True},
     MmaBackwardTiles((64, 64), (64, 32)), {"k": [(0, 0, 50, 3)]}),
    # GQA, D != Dv; two row slabs x two column ranges.
    ("float32", (1, 4, 2, 45, 70, 32, 24), {"causal": True}, MmaBackwardTiles((64, 32),
                                                                             (64, 32))),
    # Pairs: 8 warps over one row slab, 8-column ranges of which the last three lie past
    # D 40 (skipped); NaN in K and Q on cut tiles.
    ("float32", (1, 4, 2, 45, 150, 40, 40), {"causal": True, "softcap": 4.0},
     MmaBackwardTiles((64, 16), (64, 16), paired=("dkdv",)),
     {"k": [(0, 1, 120, 5)], "q": [(0, 2, 30, 1)]}),
    # Two 24-column ranges over D 40: the second reads past the K rows' end.
    ("float32", (1, 2, 1, 70, 90, 40, 40), {"causal": True},
     MmaBackwardTiles((32, 16), (32, 16)), {"k": [(0, 0, 40, 7)], "do": [(0, 1, 20, 3)]}),
    ("float32", (2, 2, 1, 70, 90, 24, 24), {"window": (20, 10), "dropout_p": 0.2, "seed": 3,
                                            "alibi_slopes": np.array([0.3, 0.1])},
     MmaBackwardTiles((32, 32), (32, 32))),
    # No band (every key block visits every query tile: turns in block order) and a window
    # limited on the left only (turns counted from each tile's first key block).
    ("float32", (1, 2, 2, 100, 130, 32, 32), {}, MmaBackwardTiles((32, 16), (32, 16))),
    ("float32", (1, 2, 1, 100, 130, 16, 16), {"window": (40, None)},
     MmaBackwardTiles((32, 16), (32, 16))),
]


TF32_RUNNER = RUN_BLOCKS + r"""
extern "C" void run(const float* q, const float* k, const float* v, float* o, float* lse,
                    const double* slopes, i64 n_q, i64 n_k, int n_q_heads, int group,
                    const i64* strides, const float* reals, const i64* band,
                    const unsigned* bits, int blocks, int shared) {
    run_blocks([&] {
        attention_forward_tf32(q, k, v, o, lse, slopes, n_q, n_k, n_q_heads, group, strides[0],
                               strides[1], strides[2], strides[3], strides[4], strides[5],
                               strides[6], strides[7], strides[8], strides[9], strides[10],
                               strides[11], reals[0], reals[1], band[0], band[1], band[2],
                               bits[0], bits[1], reals[2], bits[2], bits[3], nullptr, nullptr,
                               nullptr, 0, 0, 0);
    }, blocks, kThreads, shared);
}
"""


# The Hopper float32 forward takes the same arguments; the float64 one (IS_FLOAT64) the
# same in doubles.
TF32_WGMMA_RUNNER = TF32_RUNNER.replace("attention_forward_tf32(", "attention_forward_tf32_wgmma(")
F64_RUNNER = (TF32_RUNNER.replace("attention_forward_tf32(", "attention_forward_f64(")
              .replace("float*", "double*"))


def emulate_tf32(q, k, v, tiles: Tf32Tiles | Tf32WgmmaTiles, sequence_first_o: bool, **kwargs):
    """o and lse of attention_forward_tf32 (3xTF32, float32), or of
    attention_forward_tf32_wgmma for `Tf32WgmmaTiles`, for host float32 arrays."""
    options = resolved(q, k, v, **kwargs)
    n_q, head_dim = q.shape[2:]
    n_k, value_dim = k.shape[2], v.shape[3]
    switches, band, reals, bits = score_operands(options, n_q, n_k)
    defines = dict(STORAGE="float", ACCUM="float", HEAD_DIM=head_dim, VALUE_DIM=value_dim,
                   COPY_BYTES=16 if head_dim % 4 == 0 else 4, BLOCK_Q=tiles.block_q,
                   BLOCK_K=tiles.block_k, IS_BFLOAT16=0,
                   DEFERRED_COPIES=1, STRIDED_OUT=int(sequence_first_o), **switches)
    if isinstance(tiles, Tf32WgmmaTiles):
        lib = library(defines, "attention_tf32_wgmma_forward.cu", TF32_WGMMA_RUNNER)
    else:
        lib = library(dict(defines, WARP_ROWS=tiles.warp_rows), "attention_tf32_forward.cu",
                      TF32_RUNNER)
    return _run_forward(lib, q, k, v, options, (band, reals, bits), tiles.block_q,
                        tiles.shared_bytes(Widths.padded(head_dim, value_dim, 8)),
                        sequence_first_o)


# The Hopper 16-bit forward takes the mma.sync forward's arguments.
WGMMA_RUNNER = RUNNER.replace("attention_forward_mma(", "attention_forward_wgmma(")


def emulate_wgmma(q, k, v, tiles: WgmmaTiles, sequence_first_o: bool,
                  copies_at_issue: bool = False, **kwargs):
    """o and lse of attention_forward_wgmma (float16 / bfloat16 on wgmma) for host arrays;
    cp.async copies land when their wait retires them, or with `copies_at_issue` at once
    (the latest and the earliest a GPU may land them: a tile read before its wait, or a
    buffer refilled while a deferred wgmma still has to read it, then gives NaN)."""
    options = resolved(q, k, v, **kwargs)
    n_q, head_dim = q.shape[2:]
    n_k, value_dim = k.shape[2], v.shape[3]
    switches, band, reals, bits = score_operands(options, n_q, n_k)
    defines = dict(STORAGE=STORAGE[q.dtype.name], ACCUM="float", HEAD_DIM=head_dim,
                   VALUE_DIM=value_dim, COPY_BYTES=16 if head_dim % 8 == 0 else 2,
                   BLOCK_Q=tiles.block_q, BLOCK_K=tiles.block_k, STAGES=tiles.stages,
                   BLOCKS_PER_SM=tiles.blocks_per_sm, OVERLAP=int(tiles.overlap),
                   IS_BFLOAT16=int(q.dtype.name == "bfloat16"),
                   DEFERRED_COPIES=int(not copies_at_issue),
                   STRIDED_OUT=int(sequence_first_o), **switches)
    lib = library(defines, "attention_wgmma_forward.cu", WGMMA_RUNNER)
    return _run_forward(lib, q, k, v, options, (band, reals, bits), tiles.block_q,
                        tiles.shared_bytes(Widths.padded(head_dim, value_dim, 16)),
                        sequence_first_o)


def emulate_f64(q, k, v, tiles: F64Tiles, sequence_first_o: bool, **kwargs):
    """o and lse of attention_forward_f64 (attention_tf32_forward.cu with IS_FLOAT64: m16n8k8
    products in doubles) for host float64 arrays."""
    options = resolved(q, k, v, **kwargs)
    n_q, head_dim = q.shape[2:]
    n_k, value_dim = k.shape[2], v.shape[3]
    switches, band, reals, bits = score_operands(options, n_q, n_k)
    defines = dict(STORAGE="double", ACCUM="double", HEAD_DIM=head_dim, VALUE_DIM=value_dim,
                   COPY_BYTES=16 if head_dim % 2 == 0 else 8, BLOCK_Q=tiles.block_q,
                   BLOCK_K=tiles.block_k, IS_BFLOAT16=0, IS_FLOAT64=1,
                   WARP_ROWS=tiles.warp_rows, DEFERRED_COPIES=1,
                   STRIDED_OUT=int(sequence_first_o), **switches)
    lib = library(defines, "attention_tf32_forward.cu", F64_RUNNER)
    return _run_forward(lib, q, k, v, options, (band, reals, bits), tiles.block_q,
                        tiles.shared_bytes(Widths.padded(head_dim, value_dim, 8)),
                        sequence_first_o)


# float64's forward on FP64 tensor cores: its table's rows (smaller ones too, for more
# tiles per problem), head dims padded to 8 and to 16 in the pitch, Dv != D, every option,
# a window, keys past a tile, GQA, and non-finite values at keys the band hides.
F64_CASES = [
    ("float64", (1, 2, 1, 70, 90, 64, 64), {"causal": True}, F64Tiles(64, 32)),
    ("float64", (2, 2, 2, 40, 70, 24, 40), {"window": (20, 3), "softcap": 3.0},
     F64Tiles(32, 16)),
    ("float64", (1, 4, 2, 150, 100, 128, 128),
     {"causal": True, "softcap": 3.0, "dropout_p": 0.2, "seed": 5,
      "alibi_slopes": np.linspace(0.1, 0.4, 4)}, F64Tiles(128, 16)),
    ("float64", (1, 2, 1, 70, 130, 72, 8), {}, F64Tiles(128, 32)),
    ("float64", (1, 2, 2, 150, 200, 64, 64), {"causal": True, "window": (90, None)},
     F64Tiles(128, 64)),
    ("float64", (1, 2, 2, 33, 50, 3, 5), {"causal": True}, F64Tiles(32, 16)),
]

# float64's backward on FP64 tensor cores: its table's rows (dK and dV apart at D 65-128),
# every option, GQA, a query tail, keys past a tile, Dv != D, NaN at places a band hides.
F64_BACKWARD_CASES = [
    ("float64", (1, 4, 2, 45, 70, 32, 24), {"causal": True}, MmaBackwardTiles((64, 32),
                                                                             (64, 32))),
    ("float64", (2, 2, 1, 70, 90, 64, 64), {"window": (20, 10), "dropout_p": 0.2, "seed": 3,
                                            "softcap": 4.0,
                                            "alibi_slopes": np.array([0.3, 0.1])},
     MmaBackwardTiles((64, 32), (64, 32))),
    ("float64", (1, 2, 1, 100, 120, 128, 128), {"causal": True},
     MmaBackwardTiles((64, 16), (64, 16), split=True)),
    ("float64", (1, 2, 2, 33, 50, 72, 40), {"causal": True, "softcap": 3.0},
     MmaBackwardTiles((64, 16), (64, 16), split=True)),
    ("float64", (1, 2, 1, 70, 90, 40, 40), {"causal": True},
     MmaBackwardTiles((64, 32), (64, 32)), {"q": [(0, 1, 37, 5)], "do": [(0, 0, 50, 7)]}),
]

TF32_CASES = [
    ("float32", (1, 2, 1, 70, 90, 64, 64), {"causal": True}, Tf32Tiles(64, 32, 16)),
    ("float32", (2, 2, 2, 40, 70, 32, 24), {"window": (20, 3), "softcap": 3.0},
     Tf32Tiles(64, 32, 16)),
    # The Hopper float32 forward on wgmma: its table's rows, a head dim padded to 8 (a 32-byte
    # swizzle), Dv wider than D, every score option, keys past a tile and a band.
    ("float32", (1, 2, 1, 70, 150, 64, 64), {"causal": True}, Tf32WgmmaTiles(128, 64)),
    ("float32", (1, 4, 2, 150, 100, 128, 128),
     {"causal": True, "softcap": 3.0, "dropout_p": 0.2, "seed": 5,
      "alibi_slopes": np.linspace(0.1, 0.4, 4)}, Tf32WgmmaTiles(128, 32)),
    ("float32", (2, 2, 2, 40, 70, 40, 72), {"window": (20, 3)}, Tf32WgmmaTiles(128, 32)),
    ("float32", (1, 2, 1, 70, 90, 160, 96), {}, Tf32WgmmaTiles(64, 32)),
    # The rows over <= 128 keys: one warpgroup of 64 rows; mma.sync warps of 32 rows.
    ("float32", (2, 4, 2, 64, 64, 64, 64), {"causal": True, "softcap": 3.0},
     Tf32WgmmaTiles(64, 32)),
    ("float32", (1, 2, 1, 100, 100, 40, 40), {"window": (30, 5)}, Tf32Tiles(64, 32, 32)),
]


# The Hopper 16-bit forward (attention_wgmma_forward.cu): one to three warpgroups, a third
# stage, 32-, 64- and 128-byte swizzles (D 48 and Dv 40, D 80 and 32), every score option,
# keys past a tile and a band, a causal diagonal that the first warpgroup's rows end before.
WGMMA_CASES = [
    ("float16", (1, 2, 1, 70, 150, 64, 64), {"causal": True}, WgmmaTiles(128, 64, 2)),
    ("bfloat16", (1, 4, 2, 150, 100, 128, 128),
     {"causal": True, "softcap": 3.0, "dropout_p": 0.2, "seed": 5,
      "alibi_slopes": np.linspace(0.1, 0.4, 4)}, WgmmaTiles(64, 64, 3)),
    ("float16", (2, 2, 2, 40, 70, 48, 40), {"window": (20, 3)}, WgmmaTiles(64, 32, 2)),
    ("float16", (1, 2, 1, 70, 90, 80, 80), {}, WgmmaTiles(192, 64, 2)),
    ("float16", (1, 2, 2, 130, 130, 32, 32), {"causal": True}, WgmmaTiles(128, 128, 2, 2)),
    # The overlapped schedule (OVERLAP): one tile, many, a band, every option, two
    # warpgroups; copies landing at issue catch a buffer refilled under a pending P V.
    ("float16", (1, 2, 1, 64, 40, 64, 64), {}, WgmmaTiles(64, 64, 3, overlap=True)),
    ("float16", (1, 2, 1, 64, 300, 64, 64), {}, WgmmaTiles(64, 64, 3, overlap=True)),
    ("bfloat16", (1, 4, 2, 150, 300, 128, 128),
     {"causal": True, "softcap": 3.0, "dropout_p": 0.2, "seed": 5,
      "alibi_slopes": np.linspace(0.1, 0.4, 4)}, WgmmaTiles(64, 64, 3, overlap=True)),
    ("float16", (2, 2, 2, 100, 170, 48, 40), {"window": (20, 3)},
     WgmmaTiles(128, 32, 4, overlap=True)),
    ("float16", (1, 8, 1, 8, 500, 256, 256), {}, WgmmaTiles(64, 32, 4, 2, overlap=True)),
]


# Its backward's two kernels: GQA, a band, every score option, dK and dV in two launches,
# three stages, a head dim padded to 16 and Dv != D, rows and keys past a tile.
WGMMA_BACKWARD_CASES = [
    ("float16", (1, 4, 2, 70, 150, 64, 64), {"causal": True},
     WgmmaBackwardTiles((128, 64), (128, 64), 2)),
    ("bfloat16", (1, 2, 1, 100, 90, 128, 128),
     {"causal": True, "softcap": 3.0, "dropout_p": 0.2, "seed": 5,
      "alibi_slopes": np.array([0.1, 0.3])}, WgmmaBackwardTiles((64, 64), (64, 64), 3,
                                                                 split=True)),
    ("float16", (2, 2, 2, 40, 70, 40, 72), {"window": (20, 3)},
     WgmmaBackwardTiles((64, 32), (64, 32), 2)),
]


CASES = [
    # (dtype, (B, Hq, Hkv, Nq, Nk, D, Dv), options, MmaTiles)
    ("float16", (1, 2, 1, 70, 90, 64, 64), {}, MmaTiles(64, 32, 16, True)),
    ("float16", (1, 2, 2, 50, 130, 64, 64), {"causal": True}, MmaTiles(64, 64, 32, True)),
    ("bfloat16", (2, 2, 1, 33, 70, 32, 48), {"window": (20, 3), "softcap": 4.0},
     MmaTiles(64, 32, 16, False)),
    ("float16", (1, 4, 2, 40, 60, 72, 40), {"causal": True, "dropout_p": 0.2, "seed": 3,
                                           "alibi_slopes": np.linspace(0.1, 0.4, 4)},
     MmaTiles(64, 32, 16, True)),
    # A folded wide decode's launch (launch_forward._fold_group): 16 rows of a 64-row tile
    # (three warps idle), D 576, a 256-column value slice, the wide row's tiles.
    ("bfloat16", (2, 1, 1, 16, 100, 576, 256), {}, MmaTiles(64, 32, 16, False)),
]


def check_forwards(emulate_forward, cases, rng, kind: str) -> int:
    """`emulate_forward` on each case, o contiguous and in (B, N, H, Dv), against the golden
    model: the failures' count."""
    failures = 0
    for name, (batch, hq, hkv, nq, nk, d, dv), options, tiles in cases:
        dtype = bfloat16() if name == "bfloat16" else np.dtype(name)
        q, k, v = (rng.standard_normal(s).astype(np.float32).astype(dtype)
                   for s in ((batch, hq, nq, d), (batch, hkv, nk, d), (batch, hkv, nk, dv)))
        golden_o, golden_lse = tileattn.forward(*(a.astype(np.float64) for a in (q, k, v)),
                                                backend="reference", return_lse=True,
                                                **options)
        for sequence_first_o in (False, True):
            o, lse = emulate_forward(q, k, v, tiles, sequence_first_o, **options)
            failures += not _matches(
                o, lse, golden_o, golden_lse, dtype,
                f"{kind}{name} q{q.shape} k{k.shape} v{v.shape} {sorted(options)} "
                f"{tiles}{' o (B, N, H, Dv)' if sequence_first_o else ''}")
    return failures


def check_backwards(cases, rng, emulate_two_kernels=None) -> int:
    """`emulate_backward` on each ``(case, single_pass)`` against the golden model, the
    gradients contiguous and in (B, N, H, D); the single pass also in turns and in parts:
    the failures' count. `emulate_two_kernels`, where given, runs the cases (no single
    pass) in its place: the Hopper backward's (`emulate_wgmma_backward`)."""
    failures = 0
    for (name, (batch, hq, hkv, nq, nk, d, dv), options, tiles, *poison), single_pass in cases:
        dtype = bfloat16() if name == "bfloat16" else np.dtype(name)
        q, k, v, do = (rng.standard_normal(s).astype(np.float32).astype(dtype)
                       for s in ((batch, hq, nq, d), (batch, hkv, nk, d), (batch, hkv, nk, dv),
                                 (batch, hq, nq, dv)))
        for array_name, places in (poison[0] if poison else {}).items():
            for place in places:
                {"q": q, "k": k, "do": do}[array_name][place] = np.nan
        wide = [a.astype(np.float64) for a in (q, k, v, do)]
        o, lse = tileattn.forward(*wide[:3], backend="reference", return_lse=True, **options)
        golden = tileattn.backward(wide[3], *wide[:3], o, lse, backend="reference", **options)
        # The single pass runs in arrival order, in turns (ORDERED) and into a slot per key
        # block (DQ_PARTS), the last two also into (B, N, H, D) gradients.
        for sequence_first, ordered, dq_parts in (
                ((False, False, False), (False, True, False), (True, True, False),
                 (False, False, True), (True, False, True))
                if single_pass else ((False, False, False), (True, False, False))):
            if emulate_two_kernels is not None:
                grads = emulate_two_kernels(do, q, k, v, o.astype(dtype), lse, tiles,
                                            sequence_first, **options)
            else:
                grads = emulate_backward(do, q, k, v, o.astype(dtype), lse, tiles,
                                         sequence_first, single_pass, ordered, dq_parts,
                                         **options)
            mode = " in turns" if ordered else " in parts" if dq_parts else ""
            label = (f"backward{' single pass' if single_pass else ''}{mode} {name} q{q.shape} "
                     f"k{k.shape} v{v.shape} {sorted(options)} "
                     f"{tiles}{' gradients (B, N, H, D)' if sequence_first else ''}")
            try:
                for grad_name, ours, want in zip(("dq", "dk", "dv"), grads, golden):
                    assert_attention_close(ours, want, dtype, name=grad_name)
            except AssertionError as error:
                print(f"FAILED {label}: {error}")
                failures += 1
                continue
            print(f"ok {label}", flush=True)
    return failures


class _EmulatedKernel:
    """A RawKernel stand-in for the launcher mode: ``kernel(grid, block, args, shared_mem=...)``
    runs the emulation of `entry` compiled with the launcher's defines, on exactly its
    arguments (arrays as their addresses, scalars by their NumPy types)."""

    def __init__(self, source_name: str, entry: str, defines: tuple):
        given = dict(defines)
        if source_name in ("attention_mma_forward.cu", "attention_wgmma_forward.cu"):
            given.update(STORAGE=STORAGE["bfloat16" if given.get("IS_BFLOAT16") else "float16"],
                         ACCUM="float", DEFERRED_COPIES=1)
            runner = (FORWARD_LAUNCHER if source_name == "attention_mma_forward.cu"
                      else FORWARD_LAUNCHER.replace("attention_forward_mma",
                                                    "attention_forward_wgmma"))
        elif source_name == "attention_tf32_forward.cu":  # float64's, IS_FLOAT64
            given.update(STORAGE="double", ACCUM="double", DEFERRED_COPIES=1, IS_BFLOAT16=0)
            runner = F64_FORWARD_LAUNCHER
        else:
            given.update(ACCUM="float", DEFERRED_COPIES=1,
                         IS_BFLOAT16=int(given["STORAGE"] == STORAGE["bfloat16"]))
            runner = MERGE_LAUNCHER
        self.function = getattr(library(given, source_name, runner), f"launch_{entry}")
        self.function.restype = None

    def __call__(self, grid, block, args, shared_mem=0):
        self.function(*launch_arguments(grid, block, args, shared_mem))


# Wide decodes that fold (launch_forward._forward_folded_rows): (B, Hq, Hkv, Nq, Nk, D, Dv),
# options. Key shares (SPLIT_KEYS and split_keys_merge.cu) from 1024 keys.
FOLD_CASES = [
    ((2, 16, 1, 1, 1100, 576, 512), {"causal": True}),
    ((1, 8, 2, 1, 300, 320, 320), {"window": (50, 0), "softcap": 20.0}),
    ((1, 64, 1, 2, 200, 576, 512), {"causal": True}),
    ((1, 64, 1, 3, 1100, 288, 264), {"window": (600, 1)}),
]


# GQA decodes of many packed rows at the tensor-core head dims that fold onto the wgmma
# prefill (tiles.FOLD_DECODE_ENABLED, forced on here): one causal query row, one under a
# window (NaN and inf in the keys left of it, which its fold cuts off), and several unmasked
# ones folded at once; (B, Hq, Hkv, Nq, Nk, D, Dv), options.
FOLD_DECODE_CASES = [
    ((2, 64, 1, 1, 300, 64, 64), {"causal": True}),
    ((1, 64, 1, 1, 300, 128, 128), {"window": (100, 0)}),
    ((1, 16, 2, 8, 200, 128, 128), {"softcap": 20.0}),
    ((1, 8, 1, 8, 150, 48, 40), {}),
]


# float64's forward over few query tiles (launch_forward.forward: the f64 family with key
# shares into double partials, merged by split_keys_merge.cu in double): (B, Hq, Hkv, Nq,
# Nk, D, Dv), options.
F64_SHARE_CASES = [
    ((1, 2, 2, 100, 1600, 64, 64), {"causal": True}),
    ((1, 2, 1, 70, 1100, 128, 96), {"causal": True, "softcap": 8.0,
                                     "alibi_slopes": np.array([0.02, 0.05])}),
]


def launcher_mode(fold_cases=(), f64_shares: bool = True) -> int:
    """`fold_cases`' folds through the Python launch path (`launch_forward.forward`:
    dispatch, the fold's views, value slices, key shares and their merge, the launch cache)
    on a CuPy stand-in whose kernels are this emulation of attention_mma_forward.cu,
    attention_wgmma_forward.cu and split_keys_merge.cu, called with the launcher's own
    argument tuples; the fold threshold forced to 0 (small grids) and the folds at D <= 256
    on (tiles.FOLD_DECODE_ENABLED), "bhsd" and "bshd", first and cached calls, against the
    golden model; then, with `f64_shares`, float64's key shares. Several causal query rows
    put a NaN key and an infinite value at the last key, which only the last row keeps and
    no other row may see."""
    standin = _install_cupy_standin()
    from tileattn.gpu import _compile, launch_forward, operands, tiles
    from tileattn.validation import validate

    operands._PLANS.clear()
    tiles.FOLD_MIN_WAVE = 0.0

    built = []  # the defines of each wgmma forward built, for the overlap checks below

    def kernel(source_name, entry, defines, shared_bytes=0, arch=None):
        assert source_name in ("attention_mma_forward.cu", "attention_wgmma_forward.cu",
                               "attention_tf32_forward.cu", "split_keys_merge.cu"), source_name
        if source_name == "attention_wgmma_forward.cu":
            built.append(dict(defines))
        return _EmulatedKernel(source_name, entry, defines)

    _compile.kernel = kernel
    rng = np.random.default_rng(5)
    failures = 0
    defaults = dict(causal=False, window=None, scale=None, softcap=None, alibi_slopes=None,
                    dropout_p=0.0, seed=None, block_q=None, block_k=None, deterministic=True)
    tiles.FOLD_DECODE_ENABLED = True
    for (batch, hq, hkv, nq, nk, d, dv), options in fold_cases:
        q, k, v = (rng.standard_normal(s).astype(np.float32).astype(np.float16)
                   for s in ((batch, hq, nq, d), (batch, hkv, nk, d), (batch, hkv, nk, dv)))
        poisoned = nq > 1 and (options.get("causal", False)
                               or options.get("window", (None, None))[1] == 0)
        if poisoned:
            k[:, :, -1] = np.nan
            v[:, :, -1] = np.inf
        left = options.get("window", (None, None))[0]
        if nq == 1 and left is not None and left < nk - 1:  # keys the row does not keep
            k[:, :, : nk - 1 - left] = np.nan
            v[:, :, : nk - 1 - left] = np.inf
        golden_o, golden_lse = tileattn.forward(*(a.astype(np.float64) for a in (q, k, v)),
                                                backend="reference", return_lse=True,
                                                **options)
        kept = slice(0, nq - 1 if poisoned else nq)
        for layout, call in itertools.product(("bhsd", "bshd", "narrow"), ("first", "cached")):
            arrays = [standin.asarray(a) for a in (q, k, v)]
            out = None
            if layout == "narrow":
                # Rows 8 bytes wider than the head dim (views of wider buffers): copies of
                # 8 bytes, under which overlapped tiles would spill and must not be built.
                arrays = [standin.asarray(np.pad(a, ((0, 0),) * 3 + ((0, 4),)))[..., :-4]
                          for a in (q, k, v)]
            if layout == "bshd":
                arrays = [standin.asarray(np.ascontiguousarray(a.swapaxes(1, 2))).swapaxes(1, 2)
                          for a in (q, k, v)]
                out = standin.empty((batch, nq, hq, dv), np.float16).swapaxes(1, 2)
            resolved = validate(*arrays, **{**defaults, **options}).options
            label = f"launcher {call} {layout} q{q.shape} k{k.shape} v{v.shape} {options}"
            if layout == "bshd" and nq > 1 and max(d, dv) <= tiles.MAX_TENSOR_CORE_DIM:
                # Several rows fold only where each head's rows follow one another: a
                # "bshd" call declines the fold (and decodes, not emulated here).
                declined = launch_forward._fold_every_row(*arrays, out, standin.empty(
                    (batch, hq, nq), np.float32), resolved) is None
                print(f"{'ok' if declined else 'FAILED'} {label}: declines the fold",
                      flush=True)
                failures += not declined
                continue
            try:
                built.clear()
                o, lse = launch_forward.forward(*arrays, resolved, out=out)
                assert_attention_close(np.asarray(o)[:, :, kept], golden_o[:, :, kept],
                                       np.float16, name="o")
                assert_attention_close(np.asarray(lse)[:, :, kept], golden_lse[:, :, kept],
                                       np.float16, name="lse")
                overlapped = [defines.get("OVERLAP", 0) for defines in built]
                if layout == "narrow":
                    assert not any(overlapped), "overlapped tiles built for narrow copies"
                elif (layout, call) == ("bhsd", "first") and (d, dv) == (128, 128) \
                        and hq // hkv * nq <= 64:
                    assert overlapped and all(overlapped), "the overlapped fold tiles not used"
                print(f"ok {label}", flush=True)
            except AssertionError as error:
                print(f"FAILED {label}: {error}")
                failures += 1
    for (batch, hq, hkv, nq, nk, d, dv), options in F64_SHARE_CASES if f64_shares else ():
        q, k, v = (rng.standard_normal(s) for s in ((batch, hq, nq, d), (batch, hkv, nk, d),
                                                    (batch, hkv, nk, dv)))
        golden_o, golden_lse = tileattn.forward(q, k, v, backend="reference", return_lse=True,
                                                **options)
        for layout in ("bhsd", "bshd"):
            arrays = [standin.asarray(a) for a in (q, k, v)]
            out = None
            if layout == "bshd":
                out = standin.empty((batch, nq, hq, dv), np.float64).swapaxes(1, 2)
            resolved = validate(*arrays, **{**defaults, **options}).options
            label = (f"launcher key shares {layout} float64 q{q.shape} k{k.shape} v{v.shape} "
                     f"{options}")
            try:
                choice = launch_forward.choose(*arrays, resolved)
                assert choice.family == "f64" and choice.key_splits > 1, choice
                o, lse = launch_forward.forward(*arrays, resolved, out=out)
                assert_attention_close(np.asarray(o), golden_o, np.float64, name="o")
                assert_attention_close(np.asarray(lse), golden_lse, np.float64, name="lse")
                print(f"ok {label} ({choice.key_splits} shares)", flush=True)
            except AssertionError as error:
                print(f"FAILED {label}: {error}")
                failures += 1
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="the first two cases only (with --single-pass: a banded float16 "
                             "GQA case and an unbanded float32 one, no forwards)")
    parser.add_argument("--decode", action="store_true", help="the decode cases only")
    parser.add_argument("--paged-decode", action="store_true",
                        help="the paged decode cases only (each with paired page rows on "
                             "and off)")
    parser.add_argument("--tf32", action="store_true",
                        help="the 3xTF32 forwards only (mma.sync and wgmma)")
    parser.add_argument("--wgmma", action="store_true",
                        help="the 16-bit Hopper forward and backward (wgmma) only")
    parser.add_argument("--f64", action="store_true",
                        help="the float64 forward on FP64 tensor cores only")
    parser.add_argument("--f64-shares", action="store_true",
                        help="the launcher mode's float64 key shares only")
    parser.add_argument("--backward", action="store_true", help="the backward cases only")
    parser.add_argument("--single-pass", action="store_true",
                        help="the single pass's backward cases only")
    parser.add_argument("--fold-decode", action="store_true",
                        help="the launcher mode's folded GQA decodes at D <= 256 only (on "
                             "the wgmma forward)")
    parser.add_argument("--launcher", action="store_true",
                        help="only the wide decode's fold through tileattn/gpu/launch_forward "
                             "on a CuPy stand-in")
    args = parser.parse_args()
    if args.launcher or args.f64_shares or args.fold_decode:
        failures = launcher_mode(
            FOLD_CASES + FOLD_DECODE_CASES if args.launcher
            else FOLD_DECODE_CASES if args.fold_decode else (),
            f64_shares=not args.fold_decode)
        print("all passed" if not failures else f"{failures} failed")
        return failures
    rng = np.random.default_rng(0)
    if args.paged_decode:
        failures = check_paged_decodes(rng)
        print("all passed" if not failures else f"{failures} failed")
        return int(failures > 0)
    if args.f64:
        failures = check_forwards(emulate_f64, F64_CASES, rng, "f64 ")
        failures += check_backwards([(case, False) for case in F64_BACKWARD_CASES], rng)
        print("all passed" if not failures else f"{failures} failed")
        return int(failures > 0)
    if args.wgmma:
        failures = check_forwards(emulate_wgmma, WGMMA_CASES, rng, "wgmma ")
        failures += check_forwards(functools.partial(emulate_wgmma, copies_at_issue=True),
                                   WGMMA_CASES, rng, "wgmma copies at issue ")
        failures += check_backwards([(case, False) for case in WGMMA_BACKWARD_CASES], rng,
                                    emulate_wgmma_backward)
        print("all passed" if not failures else f"{failures} failed")
        return int(failures > 0)
    if args.tf32:
        failures = check_forwards(emulate_tf32, TF32_CASES, rng, "3xTF32 ")
        print("all passed" if not failures else f"{failures} failed")
        return int(failures > 0)
    failures = 0
    others = 0 if args.decode else None
    forwards = 0 if args.backward or args.single_pass else None
    quick = args.quick and not args.single_pass  # the forwards' quick cases
    failures += check_forwards(
        emulate, itertools.islice(CASES, 2 if quick else 0 if args.decode else forwards),
        rng, "")
    failures += check_forwards(
        emulate_tf32,
        itertools.islice(TF32_CASES, 1 if quick else 0 if args.decode else forwards),
        rng, "3xTF32 ")
    failures += check_forwards(emulate_decode,
                               itertools.islice(DECODE_CASES, 1 if quick else forwards),
                               rng, "decode ")
    if not (args.quick or args.backward or args.single_pass):
        failures += check_paged_decodes(rng)
        failures += check_padded_decodes(rng)
    backward_cases = [(case, False) for case in BACKWARD_CASES] + [
        (case, True) for case in SINGLE_PASS_CASES]
    if args.single_pass:
        backward_cases = backward_cases[len(BACKWARD_CASES):]
        if args.quick:
            backward_cases = [backward_cases[0], backward_cases[-2]]
    failures += check_backwards(itertools.islice(backward_cases, 1 if quick else others), rng)
    print("all passed" if not failures else f"{failures} failed")
    return int(failures > 0)


if __name__ == "__main__":
    sys.exit(main())
