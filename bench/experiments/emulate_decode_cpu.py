"""Run attention_decode.cu on the CPU, no GPU: the kernel's own source under a C++ emulation
of the CUDA built-ins it uses, checked against the float64 golden model.

    python3 bench/experiments/emulate_decode_cpu.py [--quick] [--launcher]

Needs g++ 12+ (C++20 std::barrier, _Float16). Each block runs as THREADS std::threads that
meet at __syncthreads (a std::barrier) and exchange warp shuffles through a per-warp buffer
between two warp barriers; blocks run one after another. cp.async copies land at once in a
first pass and only when their wait_group retires them in a second (the earliest and the
latest a GPU may land them), so this checks indexing, masks, the split ranges, the merge,
the barriers' placement and the pipeline's waits, though not memory ordering beyond them
(compute-sanitizer on the GPU does). PTX `asm` in the shared headers is replaced by its
meaning (cvt to and from half, cvta.to.shared, cp.async groups, the dynamic
shared-memory size); what no decode path uses (mma.sync, ldmatrix) compiles to nothing.
Every case runs twice: o contiguous, and o written into a (B, Nq, Hq, Dv) buffer as a
"bshd" call's is (STRIDED_OUT, and the merge's strides).
`--launcher` also runs the Python launch path (`launch_forward.forward`: dispatch, launch
cache, `launch_decode`, workspace, merge) on a stand-in for CuPy whose kernels are this
emulation called with the launcher's own argument tuples (float32 inputs: 16-bit ones take
the tensor-core decode, attention_decode_mma.cu, which is not emulated).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import hashlib
import itertools
import os
import re
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import tileattn  # noqa: E402
from tileattn import reference  # noqa: E402
from tileattn.dropout import dropout_key, dropout_threshold  # noqa: E402
from tileattn.gpu._compile import source  # noqa: E402
from tileattn.gpu.tiles import DecodeShape, Problem, decode_fits, decode_tiles  # noqa: E402
from tileattn.options import UNLIMITED  # noqa: E402
from tileattn.testing import assert_attention_close, bfloat16  # noqa: E402
from tileattn.validation import validate  # noqa: E402

PRELUDE = r"""
#include <algorithm>
#include <barrier>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ static
#define asm(...)

struct uint3_ { unsigned x = 0, y = 0, z = 0; };
thread_local uint3_ threadIdx;
uint3_ blockIdx, gridDim, blockDim;
unsigned char* g_shared = nullptr;
unsigned g_dynamic_shared = 0;
std::barrier<>* g_block_barrier = nullptr;
std::vector<std::unique_ptr<std::barrier<>>> g_warp_barriers;
double g_exchange[1024];
// cp.async at once, or (DEFERRED_COPIES) only when a wait_group retires its group: the
// latest a GPU may land it, so a tile read before its wait reads stale bytes (0xff: NaN).
struct PendingCopy { unsigned destination; const void* source; bool valid; int bytes; };
thread_local std::vector<PendingCopy> t_open_group;
thread_local std::vector<std::vector<PendingCopy>> t_groups;
inline void land(const PendingCopy& copy) {
    if (copy.valid) std::memcpy(g_shared + copy.destination, copy.source, copy.bytes);
    else std::memset(g_shared + copy.destination, 0, copy.bytes);
}
inline void commit_copies_emulated() {
    t_groups.push_back(std::move(t_open_group));
    t_open_group.clear();
}
inline void wait_copies_emulated(int pending) {
    while (static_cast<int>(t_groups.size()) > pending) {
        for (const PendingCopy& copy : t_groups.front()) land(copy);
        t_groups.erase(t_groups.begin());
    }
}

inline void __syncthreads() { g_block_barrier->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) {
    g_warp_barriers[threadIdx.x / 32]->arrive_and_wait();
}
// A warp shuffle: every lane publishes x, then reads lane `source`'s.
template <typename X> X shuffle_from(X x, unsigned source) {
    static_assert(sizeof(X) <= sizeof(double));
    const unsigned warp0 = threadIdx.x - threadIdx.x % 32;
    std::memcpy(&g_exchange[threadIdx.x], &x, sizeof(X));
    __syncwarp();
    X value;
    std::memcpy(&value, &g_exchange[warp0 + source % 32], sizeof(X));
    __syncwarp();
    return value;
}
template <typename X> X __shfl_xor_sync(unsigned, X x, int lane_mask) {
    return shuffle_from(x, (threadIdx.x % 32) ^ lane_mask);
}
template <typename X> X __shfl_sync(unsigned, X x, int source_lane) {
    return shuffle_from(x, source_lane);
}
inline unsigned __float_as_uint(float x) { return std::bit_cast<unsigned>(x); }
inline float __uint_as_float(unsigned x) { return std::bit_cast<float>(x); }
inline long long __double_as_longlong(double x) { return std::bit_cast<long long>(x); }
inline double __longlong_as_double(long long x) { return std::bit_cast<double>(x); }
inline void __trap() { std::fprintf(stderr, "__trap\n"); std::abort(); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
using std::exp; using std::log; using std::tanh; using std::fmax;
template <typename A, typename B> inline auto min(A a, B b) {
    using C = std::common_type_t<A, B>; return std::min<C>(a, b);
}
template <typename A, typename B> inline auto max(A a, B b) {
    using C = std::common_type_t<A, B>; return std::max<C>(a, b);
}
"""

# (pattern, replacement) on the spliced source: the PTX that the decode path needs, by meaning.
PATCHES = [
    (r'asm\("cvt\.f32\.f16 %0, %1;" : "=f"\(result\) : "h"\(x\.bits\)\);',
     "result = (float)std::bit_cast<_Float16>(x.bits);"),
    (r'asm\("cvt\.rn\.f16\.f32 %0, %1;" : "=h"\(result\.bits\) : "f"\(x\)\);',
     "result.bits = std::bit_cast<unsigned short>((_Float16)x);"),
    (r'asm\("\{ \.reg \.u64 a; cvta\.to\.shared\.u64 a, %1; cvt\.u32\.u64 %0, a; \}"\s*'
     r': "=r"\(address\)\s*: "l"\(pointer\)\);',
     "address = (u32)((const unsigned char*)pointer - g_shared);"),
    (r'asm\("mov\.u32 %0, %%dynamic_smem_size;" : "=r"\(provided\)\);',
     "provided = g_dynamic_shared;"),
    (r"extern __shared__ __align__\(16\) unsigned char shared_bytes\[\];",
     "unsigned char* shared_bytes = g_shared;"),
    (r'__device__ __forceinline__ void commit_copies\(\) \{ asm volatile\("cp\.async\.commit_group;\\n" ::\); \}',
     "inline void commit_copies() { commit_copies_emulated(); }"),
    (r"asm volatile\(\"cp\.async\.wait_group %0;\\n\" ::\"n\"\(Pending\)\);",
     "wait_copies_emulated(Pending);"),
    (r"asm volatile\(", "asm("),
]
# cp.async: the copy (or the zeros) at once, defined where the PTX version was (copy_row_chunk
# names it as a template right after).
COPY_PATTERN = r"template <int ChunkBytes>\s*__device__ __forceinline__ void copy_chunk_async\("


COPY = r"""
template <int ChunkBytes>
inline void copy_chunk_async(u32 destination, const void* source, bool valid) {
    const PendingCopy copy{destination, source, valid, ChunkBytes};
    if (DEFERRED_COPIES && ChunkBytes != 2) t_open_group.push_back(copy);  // 2 bytes: synchronous
    else land(copy);
}
"""

RUN_BLOCKS = r"""
template <typename Kernel>
void run_blocks(Kernel kernel, unsigned blocks, unsigned threads, unsigned shared,
                unsigned blocks_y = 1) {
    std::vector<unsigned char> memory(shared + 64, 0xff);  // stale bytes: NaN patterns
    g_shared = memory.data();
    g_dynamic_shared = shared;
    gridDim.x = blocks;
    gridDim.y = blocks_y;
    blockDim.x = threads;
    for (unsigned block = 0; block < blocks * blocks_y; ++block) {
        blockIdx.x = block % blocks;
        blockIdx.y = block / blocks;
        std::barrier<> barrier(threads);
        g_block_barrier = &barrier;
        g_warp_barriers.clear();
        for (unsigned w = 0; w < threads / 32; ++w)
            g_warp_barriers.emplace_back(std::make_unique<std::barrier<>>(32));
        std::vector<std::thread> pool;
        for (unsigned t = 0; t < threads; ++t)
            pool.emplace_back([&, t] { threadIdx.x = t; kernel(); });
        for (auto& thread : pool) thread.join();
    }
}
"""

RUNNER = RUN_BLOCKS + r"""
// The kernels' own parameter lists, for the launcher mode (`--launcher`): the Python launch
// path's argument tuples go through these unchanged.
extern "C" void launch_attention_decode(
    unsigned grid, unsigned grid_y, unsigned threads, unsigned shared, const T* q, const T* k,
    const T* v, T* o, Acc* lse, Acc* partial_o, Acc* partial_lse, const double* alibi_slopes,
    i64 n_q, i64 n_k, int n_q_heads, int group_size, int n_splits, i64 q_sb, i64 q_sh,
    i64 q_sn, i64 k_sb, i64 k_sh, i64 k_sn, i64 v_sb, i64 v_sh, i64 v_sn, i64 o_sb, i64 o_sh,
    i64 o_sn, Acc scale, Acc softcap, i64 band_offset, i64 window_left, i64 window_right,
    u32 dropout_key, u32 dropout_threshold, Acc dropout_scale, u32 dropout_row0,
    u32 dropout_col0, const i64* descriptors, const i64* tiles, const i64* block_table,
    i64 table_stride, i64 page_size, i64 n_pages) {
    if (threads != THREADS) { std::fprintf(stderr, "block %u != THREADS\n", threads); std::abort(); }
    run_blocks([&] {
        attention_decode(q, k, v, o, lse, partial_o, partial_lse, alibi_slopes, n_q, n_k,
                         n_q_heads, group_size, n_splits, q_sb, q_sh, q_sn, k_sb, k_sh, k_sn,
                         v_sb, v_sh, v_sn, o_sb, o_sh, o_sn, scale, softcap, band_offset,
                         window_left, window_right, dropout_key, dropout_threshold,
                         dropout_scale, dropout_row0, dropout_col0, descriptors, tiles,
                         block_table, table_stride, page_size, n_pages);
    }, grid, threads, shared, grid_y);
}

extern "C" void launch_attention_decode_merge(unsigned grid, unsigned grid_y, unsigned threads,
                                              unsigned shared, const Acc* partial_o,
                                              const Acc* partial_lse, T* o, Acc* lse,
                                              i64 n_rows, int n_splits, int n_q_heads, i64 n_q,
                                              i64 o_sb, i64 o_sh, i64 o_sn) {
    if (threads != kMergeThreads) {
        std::fprintf(stderr, "merge block %u\n", threads);
        std::abort();
    }
    run_blocks([&] { attention_decode_merge(partial_o, partial_lse, o, lse, n_rows, n_splits,
                                            n_q_heads, n_q, o_sb, o_sh, o_sn); },
               grid, threads, shared, grid_y);
}

extern "C" void launch_attention_decode_merge_rows(unsigned grid, unsigned grid_y,
                                                   unsigned threads, unsigned shared,
                                                   const Acc* partial_o, const Acc* partial_lse,
                                                   T* o, Acc* lse, i64 n_rows, int n_splits,
                                                   int n_q_heads, i64 n_q, i64 o_sb, i64 o_sh,
                                                   i64 o_sn) {
    if (threads != 32 * kMergeRowsPerBlock) {
        std::fprintf(stderr, "row merge block %u\n", threads);
        std::abort();
    }
    run_blocks([&] { attention_decode_merge_rows(partial_o, partial_lse, o, lse, n_rows,
                                                 n_splits, n_q_heads, n_q, o_sb, o_sh, o_sn); },
               grid, threads, shared, grid_y);
}

extern "C" void run(const T* q, const T* k, const T* v, T* o, Acc* lse, Acc* partial_o,
                    Acc* partial_lse, const double* slopes, i64 n_q, i64 n_k, int n_q_heads,
                    int group, int splits, const i64* strides, const double* reals,
                    const i64* band, const unsigned* bits, int blocks, int shared,
                    i64 n_rows) {
    run_blocks([&] {
        attention_decode(q, k, v, o, lse, partial_o, partial_lse, slopes, n_q, n_k, n_q_heads,
                         group, splits, strides[0], strides[1], strides[2], strides[3],
                         strides[4], strides[5], strides[6], strides[7], strides[8],
                         strides[9], strides[10], strides[11], (Acc)reals[0], (Acc)reals[1],
                         band[0], band[1], band[2], bits[0], bits[1], (Acc)reals[2], bits[2],
                         bits[3], nullptr, nullptr, nullptr, 0, 0, 0);
    }, blocks, THREADS, shared);
    if (splits > 1 && (splits <= 32 || n_rows >= 8 * splits))  // as launch_decode chooses
        run_blocks([&] { attention_decode_merge_rows(partial_o, partial_lse, o, lse, n_rows,
                                                     splits, n_q_heads, n_q, strides[9],
                                                     strides[10], strides[11]); },
                   (n_rows + kMergeRowsPerBlock - 1) / kMergeRowsPerBlock,
                   32 * kMergeRowsPerBlock, 0);
    else if (splits > 1)
        run_blocks([&] { attention_decode_merge(partial_o, partial_lse, o, lse, n_rows, splits,
                                                n_q_heads, n_q, strides[9], strides[10],
                                                strides[11]); },
                   n_rows, kMergeThreads, 0, (VALUE_DIM + 31) / 32);
}
"""

STORAGE = {"float16": "half_storage", "bfloat16": "bfloat16_storage", "float32": "float",
           "float64": "double"}
_LIBRARIES: dict[tuple, ctypes.CDLL] = {}


def library(defines: dict) -> ctypes.CDLL:
    key = tuple(sorted(defines.items()))
    if key in _LIBRARIES:
        return _LIBRARIES[key]
    text = source("attention_decode.cu")
    for pattern, replacement in PATCHES:
        text, count = re.subn(pattern, replacement, text)
        assert count, f"patch found nothing: {pattern}"
    text, count = re.subn(COPY_PATTERN, lambda _: COPY + "\ntemplate <int ChunkBytes>\n"
                          "inline void copy_chunk_async_ptx(", text)
    assert count == 1, "copy_chunk_async not found"
    text = text.replace('#include "', '// #include "')
    _LIBRARIES[key] = build(PRELUDE + text + RUNNER, key, "decode")
    return _LIBRARIES[key]


def build(code: str, defines: tuple, prefix: str) -> ctypes.CDLL:
    """`code` compiled by g++ with these ``(name, value)`` defines into a shared library,
    kept in the temporary directory by the hash of both (later runs load it)."""
    digest = hashlib.sha256(repr((code, defines)).encode()).hexdigest()[:16]
    directory = os.path.join(tempfile.gettempdir(), "tileattn-emulate")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{prefix}-{digest}.so")
    if not os.path.exists(path):
        source_path = path[:-3] + ".cpp"
        with open(source_path, "w") as handle:
            handle.write(code)
        command = ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w",
                   "-o", path, source_path] + [f"-D{k}={v}" for k, v in defines]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(result.stderr[-6000:])
    return ctypes.CDLL(path)


def _pointer(array):
    return ctypes.c_void_p(array.ctypes.data)


def _copy_bytes(*arrays) -> int:
    """The widest copy all rows allow (operands.row_alignment, on host arrays)."""
    best = 16
    for array in arrays:
        for value in (array.ctypes.data, *array.strides[:3], array.shape[3] * array.itemsize):
            while best > 1 and value % best:
                best //= 2
    return best


DEFERRED = {"value": 0}  # DEFERRED_COPIES of the libraries built from here on (main's loop)


def resolved(q, k, v, **kwargs):
    """The AttentionOptions the API would pass a backend for these keyword options."""
    return validate(q, k, v, **{**dict(causal=False, window=None, scale=None, softcap=None,
                                       alibi_slopes=None, dropout_p=0.0, seed=None,
                                       block_q=None, block_k=None, deterministic=True),
                                **kwargs}).options


def score_operands(options, n_q: int, n_k: int) -> tuple:
    """The option switches (compile-time defines) and the run-time score operands the
    launchers pass (operands.score_arguments): the band (offset, left, right), the reals
    (scale, softcap, 1 / (1 - dropout_p)) and the bits (dropout key and threshold, global
    row and key of position 0)."""
    switches = dict(LIMIT_LEFT=int(options.window_left != UNLIMITED),
                    LIMIT_RIGHT=int(options.window_right != UNLIMITED),
                    SOFTCAP=int(options.softcap > 0), ALIBI=int(options.alibi_slopes is not None),
                    DROPOUT=int(options.dropout_p > 0))
    offset = options.band_offset(n_q, n_k)
    reach = n_q + n_k + abs(offset)
    side = lambda x: 0 if x == UNLIMITED else min(x, reach)  # noqa: E731
    band = np.array([offset, side(options.window_left), side(options.window_right)], np.int64)
    dropping = options.dropout_p > 0
    reals = np.array([options.scale, options.softcap if options.softcap > 0 else 1.0,
                      1.0 / (1.0 - options.dropout_p)])
    bits = np.array([dropout_key(options.seed) if dropping else 0,
                     dropout_threshold(options.dropout_p) if dropping else 0,
                     options.row_offset & 0xFFFFFFFF, options.col_offset & 0xFFFFFFFF],
                    np.uint32)
    return switches, band, reals, bits


def emulate(q, k, v, splits: int | None = None, options=None, sequence_first_o=False,
            rows: int | None = None, **kwargs):
    """o and lse of attention_decode.cu for host arrays (any strides, last axis contiguous),
    for the keyword options or an AttentionOptions; `sequence_first_o`: o written into a
    (B, Nq, Hq, Dv) buffer (STRIDED_OUT), as a "bshd" call's; `rows`: a block's packed-row
    capacity (fewer than group x Nq: row groups)."""
    options = options if options is not None else resolved(q, k, v, **kwargs)
    batch, n_q_heads, n_q, head_dim = q.shape
    n_kv_heads, n_k, value_dim = k.shape[1], k.shape[2], v.shape[3]
    group = n_q_heads // n_kv_heads
    dtype = q.dtype.name
    problem = Problem(90, 227 * 1024, dtype, head_dim, value_dim, n_k)
    shape = DecodeShape(n_q, group, batch * n_kv_heads, batch * n_q_heads, n_k, 132)
    tiles = decode_tiles(problem, shape, splits=splits)
    if rows is not None:
        tiles = dataclasses.replace(tiles, rows=rows)
    assert decode_fits(problem, tiles)
    accum = np.float64 if dtype == "float64" else np.float32
    switches, band, reals, bits = score_operands(options, n_q, n_k)
    defines = dict(STORAGE=STORAGE[dtype], ACCUM="double" if accum == np.float64 else "float",
                   HEAD_DIM=head_dim, VALUE_DIM=value_dim, COPY_BYTES=_copy_bytes(k, v),
                   ROWS=tiles.rows, BLOCK_K=tiles.block_k, STAGES=tiles.stages,
                   THREADS=tiles.threads, DEFERRED_COPIES=DEFERRED["value"],
                   STRIDED_OUT=int(sequence_first_o), **switches)
    run = library(defines).run
    n_rows = batch * n_q_heads * n_q
    o = (np.full((batch, n_q, n_q_heads, value_dim), np.nan, dtype=q.dtype).swapaxes(1, 2)
         if sequence_first_o else np.full((batch, n_q_heads, n_q, value_dim), np.nan, q.dtype))
    lse = np.full((batch, n_q_heads, n_q), np.nan, dtype=accum)
    partial_o = np.full(tiles.splits * n_rows * value_dim, np.nan, dtype=accum)
    partial_lse = np.full(tiles.splits * n_rows, np.nan, dtype=accum)
    slopes = (np.zeros(1) if options.alibi_slopes is None
              else np.ascontiguousarray(options.alibi_slopes, dtype=np.float64))
    strides = np.array([s // a.itemsize for a in (q, k, v, o) for s in a.strides[:3]],
                       np.int64)
    shared = tiles.shared_bytes(q.itemsize, np.dtype(accum).itemsize, head_dim, value_dim)
    run.restype = None
    run(_pointer(q), _pointer(k), _pointer(v), _pointer(o), _pointer(lse),
        _pointer(partial_o), _pointer(partial_lse), _pointer(slopes), ctypes.c_int64(n_q),
        ctypes.c_int64(n_k), ctypes.c_int(n_q_heads), ctypes.c_int(group),
        ctypes.c_int(tiles.splits), _pointer(strides), _pointer(reals), _pointer(band),
        _pointer(bits),
        ctypes.c_int(batch * n_kv_heads * tiles.row_groups(group * n_q) * tiles.splits),
        ctypes.c_int(shared),
        ctypes.c_int64(n_rows))
    return o, lse, tiles


CASES = [
    # (dtype, (B, Hq, Hkv, Nq, Nk, D, Dv), options, splits)
    ("float16", (2, 4, 4, 1, 333, 64, 64), {}, 1),
    ("float16", (2, 4, 4, 1, 333, 64, 64), {"causal": True}, 3),
    ("float16", (1, 8, 2, 3, 333, 64, 64), {"causal": True}, 40),  # more splits than tiles
    # the merge: splits past its early loads (128) and past the lse it keeps (512)
    ("float16", (1, 2, 1, 1, 4200, 32, 32), {}, 140),
    ("float16", (1, 2, 1, 1, 700, 32, 32), {}, 600),
    ("float16", (1, 8, 1, 2, 300, 64, 64), {"window": (37, 5)}, 2),
    ("float16", (1, 8, 2, 4, 517, 64, 64),
     {"softcap": 5.0, "alibi_slopes": np.linspace(0.1, 0.4, 8), "window": (64, 64),
      "dropout_p": 0.1, "seed": 7}, 5),
    ("float16", (1, 4, 2, 16, 300, 64, 64), {"causal": True}, 3),
    ("float16", (1, 4, 2, 8, 5, 32, 32), {"causal": True}, 3),
    ("float16", (2, 4, 2, 2, 290, 33, 33), {"causal": True}, 4),
    ("float16", (2, 4, 2, 2, 290, 24, 200), {"causal": True}, 4),
    ("float16", (1, 4, 2, 2, 290, 1, 1), {}, 2),
    ("bfloat16", (1, 8, 2, 3, 450, 64, 64), {"dropout_p": 0.3, "seed": 5, "causal": True}, 4),
    ("float32", (1, 8, 2, 3, 450, 80, 24), {"causal": True, "window": (100, None),
                                            "softcap": 2.0}, 4),
    ("float64", (1, 4, 1, 2, 270, 256, 256), {"window": (100, 3)}, 3),
    ("float16", (1, 8, 1, 4, 300, 128, 128), {"causal": True}, 2),  # 32 rows, 256 threads
    ("float16", (1, 6, 2, 5, 300, 64, 64), {"causal": True, "alibi_slopes":
                                           np.linspace(0.1, 0.6, 6)}, 3),  # group of 3
    # the row merge past 32 splits (rows >= 8 x splits) and past a block's 8 rows
    ("float16", (2, 16, 4, 9, 1500, 64, 40), {"causal": True}, 33),
]

# The merges (launch_decode picks as `run` does): attention_decode_merge over many splits of
# few rows (past its early loads and its kept lse), attention_decode_merge_rows over few
# splits (weights in lanes; rows not a multiple of its 8 a block, Dv not of 32) and over 33
# splits of >= 8 rows each (weights re-formed per split). (dtype, shape, options, splits)
MERGE_CASES = [
    ("float16", (1, 2, 1, 1, 4200, 32, 32), {}, 140),
    ("float16", (1, 6, 2, 5, 300, 64, 40), {"causal": True}, 3),
    ("float16", (2, 16, 4, 9, 1500, 64, 40), {"causal": True}, 33),
    ("float32", (1, 8, 2, 3, 450, 80, 24), {"window": (100, None)}, 4),
]

# More packed rows than a block holds: row groups of `rows` (the last partial), with and
# without splits. (dtype, (B, Hq, Hkv, Nq, Nk, D, Dv), options, splits, rows)
ROW_GROUP_CASES = [
    ("float32", (2, 20, 2, 1, 300, 64, 64), {}, 1, 4),  # 10 rows: groups of 4, 4, 2
    ("float32", (1, 12, 1, 3, 333, 40, 24), {"causal": True, "softcap": 3.0,
                                             "alibi_slopes": np.linspace(0.1, 0.5, 12)}, 3, 16),
    ("float64", (2, 6, 2, 5, 270, 32, 32), {"window": (60, 2), "dropout_p": 0.2, "seed": 4},
     2, 4),
]


def strided_case(layout: str, rng):
    """GQA fp16 inputs as views: rows 2 bytes past alignment (2-byte copies), keys in
    reverse order in memory (negative strides), or heads and rows transposed."""
    shapes = ((2, 8, 3, 64), (2, 2, 310, 64), (2, 2, 310, 64))
    arrays = [rng.standard_normal(s).astype(np.float16) for s in shapes]
    if layout == "unaligned":
        views = []
        for a in arrays:
            buffer = np.zeros(a.shape[:3] + (a.shape[3] + 1,), dtype=a.dtype)
            buffer[..., 1:] = a
            views.append(buffer[..., 1:])
        return views
    if layout == "reversed_keys":
        return [arrays[0]] + [np.ascontiguousarray(a[:, :, ::-1])[:, :, ::-1] for a in arrays[1:]]
    return [np.ascontiguousarray(a.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3) for a in arrays]


def non_finite_case():
    """NaN/Inf at keys some rows mask (band-edge tiles): they must reach only rows keeping them."""
    rng = np.random.default_rng(10)
    q, k, v = (rng.standard_normal(s).astype(np.float32)
               for s in ((1, 4, 4, 64), (1, 2, 300, 64), (1, 2, 300, 64)))
    v[:, :, 299, 3] = np.nan
    k[:, :, 298, 5] = np.inf
    v[:, :, 297, 0] = np.inf
    return q, k, v


# --------------------------------------------------------------------------- launcher mode
# tileattn/gpu/launch_forward.forward (dispatch, launch cache, launch_decode, workspace, merge)
# on a stand-in for CuPy: NumPy arrays with `.data.ptr` and `.device`, and a `_compile.kernel`
# whose kernels are the emulation, called with the launcher's own argument tuples.


def _install_cupy_standin():
    import types

    class _Pointer:
        def __init__(self, ptr):
            self.ptr = ptr

    class _Device:
        id = 0
        compute_capability = "90"

        def __init__(self, *_):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *_):
            return False

    class ndarray(np.ndarray):  # noqa: N801 (CuPy's name)
        @property
        def data(self):
            return _Pointer(self.ctypes.data)

        @property
        def device(self):
            return _Device()

    def empty(shape, dtype=float):
        return np.empty(shape, dtype=dtype).view(ndarray)

    def asarray(array):
        return np.asarray(array).view(ndarray)

    stream = types.SimpleNamespace(ptr=0)
    runtime = types.SimpleNamespace(
        getDeviceProperties=lambda _: {"multiProcessorCount": 132,
                                       "sharedMemPerBlockOptin": 227 * 1024, "name": b"cpu"})
    cuda = types.ModuleType("cupy.cuda")
    cuda.Device, cuda.runtime, cuda.get_current_stream = _Device, runtime, lambda: stream
    cuda.driver = types.ModuleType("cupy.cuda.driver")  # packed launches: never built here
    cuda.driver.CUDADriverError = RuntimeError
    standin = types.ModuleType("cupy")
    standin.ndarray, standin.empty, standin.asarray, standin.cuda = ndarray, empty, asarray, cuda
    standin.uint16, standin.uint32 = np.uint16, np.uint32
    standin.float32, standin.int32, standin.int64 = np.float32, np.int32, np.int64
    standin.zeros = lambda shape, dtype=float: np.zeros(shape, dtype=dtype).view(ndarray)
    lib = types.ModuleType("cupy.lib")
    lib.stride_tricks = types.ModuleType("cupy.lib.stride_tricks")
    lib.stride_tricks.as_strided = lambda array, shape, strides: np.lib.stride_tricks.as_strided(
        array, shape, strides, subok=True)
    standin.lib = lib
    sys.modules.update({"cupy": standin, "cupy.cuda": cuda, "cupy.cuda.driver": cuda.driver,
                        "cupy.lib": lib, "cupy.lib.stride_tricks": lib.stride_tricks})
    return standin


class _EmulatedKernel:
    """A RawKernel stand-in: ``kernel(grid, block, args, shared_mem=...)`` runs the emulation
    with exactly these arguments, converted by their NumPy types."""

    max_dynamic_shared_size_bytes = 48 * 1024

    def __init__(self, entry: str, defines: tuple):
        self.function = getattr(library({**dict(defines),
                                         "DEFERRED_COPIES": DEFERRED["value"]}),
                                f"launch_{entry}")
        self.function.restype = None

    def __call__(self, grid, block, args, shared_mem=0):
        self.function(*launch_arguments(grid, block, args, shared_mem))


def launch_arguments(grid, block, args, shared_mem) -> list:
    """A CuPy-style launch as the ctypes arguments of an emulated ``launch_<entry>``: the
    grid's x and y, the block's threads, the shared bytes, then each argument (an array as
    its address, a scalar by its NumPy type)."""
    converted = [ctypes.c_uint(grid[0]), ctypes.c_uint(grid[1] if len(grid) > 1 else 1),
                 ctypes.c_uint(block[0]), ctypes.c_uint(shared_mem)]
    for arg in args:
        if isinstance(arg, np.ndarray):
            converted.append(ctypes.c_void_p(arg.ctypes.data if arg.size else None))
        else:
            converted.append({np.dtype(np.int64): ctypes.c_int64,
                              np.dtype(np.int32): ctypes.c_int32,
                              np.dtype(np.uint32): ctypes.c_uint32,
                              np.dtype(np.float32): ctypes.c_float,
                              np.dtype(np.float64): ctypes.c_double}[arg.dtype](arg))
    return converted


def launcher_mode() -> int:
    """The launch path end to end on decode shapes the dispatch picks, twice each (the second
    call takes the cached launches), against the golden model; float32, whose decode runs on
    CUDA cores (16-bit inputs take attention_decode_mma.cu, which this does not emulate),
    o contiguous and o a view of a (B, N, H, Dv) buffer (a "bshd" call's)."""
    standin = _install_cupy_standin()
    from tileattn.gpu import _compile, launch_forward, operands

    operands._PLANS.clear()  # launches cached by the other copy mode's run

    def kernel(source_name, entry, defines, shared_bytes=0, arch=None):
        assert source_name == "attention_decode.cu", source_name
        return _EmulatedKernel(entry, defines)

    _compile.kernel = kernel
    rng = np.random.default_rng(3)
    failures = 0
    for (batch, hq, hkv, nq, nk, d, dv), options in [
            ((1, 8, 1, 1, 4096, 128, 128), {}),  # MQA, 128 splits and the merge
            ((2, 32, 8, 2, 1000, 64, 64), {"causal": True}),  # GQA, 8 rows, a few splits
            ((1, 4, 4, 3, 700, 80, 48), {"window": (400, 0), "softcap": 3.0,
                                         "alibi_slopes": np.linspace(0.1, 0.4, 4)}),
            ((4, 8, 2, 1, 600, 96, 96), {"dropout_p": 0.2, "seed": 3}),
            ((1, 71, 1, 1, 2000, 64, 64), {}),  # 71 rows: two row groups of 64
            ((1, 72, 1, 1, 300, 576, 512), {"causal": True})]:  # wide rows: 2 groups
        q, k, v = (rng.standard_normal(s).astype(np.float32)
                   for s in ((batch, hq, nq, d), (batch, hkv, nk, d), (batch, hkv, nk, dv)))
        resolved = validate(q, k, v, **{**dict(causal=False, window=None, scale=None,
                                               softcap=None, alibi_slopes=None, dropout_p=0.0,
                                               seed=None, block_q=None, block_k=None,
                                               deterministic=True), **options}).options
        device = [standin.asarray(a) for a in (q, k, v)]
        choice = launch_forward.choose(*device, resolved)
        golden_o, golden_lse = tileattn.forward(*(a.astype(np.float64) for a in (q, k, v)),
                                                backend="reference", return_lse=True, **options)
        for call, sequence_first in itertools.product(("first", "cached"), (False, True)):
            out = (standin.empty((batch, nq, hq, dv), np.float32).swapaxes(1, 2)
                   if sequence_first else None)
            o, lse = launch_forward.forward(*device, resolved, out=out)
            label = (f"launcher {call} q{q.shape} k{k.shape} {sorted(options)} {choice}"
                     f"{' o (B, N, H, Dv)' if sequence_first else ''}")
            try:
                assert choice.family == "decode"
                assert_attention_close(np.asarray(o), golden_o, q.dtype, name="o")
                assert_attention_close(np.asarray(lse), golden_lse, q.dtype, name="lse")
                print(f"ok {label}")
            except AssertionError as error:
                print(f"FAILED {label}: {error}")
                failures += 1
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the first few cases only")
    parser.add_argument("--launcher", action="store_true",
                        help="also run tileattn/gpu/launch_forward.forward on a CuPy stand-in")
    parser.add_argument("--merges", action="store_true",
                        help="only the cases of MERGE_CASES (both merge kernels), copies landing "
                             "at their wait")
    args = parser.parse_args()
    failures = 0
    if args.merges:
        DEFERRED["value"] = 1
        rng = np.random.default_rng(0)
        for dtype, (batch, hq, hkv, nq, nk, d, dv), options, splits in MERGE_CASES:
            q, k, v = (rng.standard_normal(s).astype(dtype)
                       for s in ((batch, hq, nq, d), (batch, hkv, nk, d), (batch, hkv, nk, dv)))
            failures += check(q, k, v, options, splits)
        q, k, v = non_finite_case()
        failures += check(q, k, v, {"causal": True}, 4)
        print("all passed" if not failures else f"{failures} failed")
        return int(failures > 0)
    for deferred in (0, 1):
        DEFERRED["value"] = deferred
        print(f"-- cp.async copies land {'at their wait' if deferred else 'at once'}")
        rng = np.random.default_rng(0)
        for dtype, (batch, hq, hkv, nq, nk, d, dv), options, splits in \
                itertools.islice(CASES, 4 if args.quick else None):
            dtype = bfloat16() if dtype == "bfloat16" else np.dtype(dtype)
            q = rng.standard_normal((batch, hq, nq, d)).astype(dtype)
            k = rng.standard_normal((batch, hkv, nk, d)).astype(dtype)
            v = rng.standard_normal((batch, hkv, nk, dv)).astype(dtype)
            failures += check(q, k, v, options, splits)
        for dtype, (batch, hq, hkv, nq, nk, d, dv), options, splits, rows in \
                ROW_GROUP_CASES[:1 if args.quick else None]:
            q, k, v = (rng.standard_normal(s).astype(dtype)
                       for s in ((batch, hq, nq, d), (batch, hkv, nk, d), (batch, hkv, nk, dv)))
            failures += check(q, k, v, options, splits, rows)
        for layout in ("unaligned", "reversed_keys", "bshd"):  # rows read in place, any strides
            q, k, v = strided_case(layout, rng)
            failures += check(q, k, v, {"causal": True}, 3)
        q, k, v = non_finite_case()
        for options in ({"causal": True}, {"causal": True, "window": (3, None)}):
            failures += check(q, k, v, options, 4)
            failures += check(q, k, v, options, 4, rows=4)  # 8 rows in two row groups
        failures += placed_case(rng)
        if args.launcher:
            failures += launcher_mode()
    print("all passed" if not failures else f"{failures} failed")
    return int(failures > 0)


def placed_case(rng) -> int:
    """A block of a longer sequence (AttentionOptions.row_offset/col_offset/alignment, as
    tileattn.distributed places it): band, ALiBi and dropout at global positions."""
    q, k, v = (rng.standard_normal(s).astype(np.float16)
               for s in ((1, 4, 3, 64), (1, 2, 400, 64), (1, 2, 400, 64)))
    options = dataclasses.replace(
        resolved(q, k, v, causal=True, window=(200, None), dropout_p=0.2, seed=9,
                 alibi_slopes=np.linspace(0.1, 0.4, 4)),
        row_offset=100, col_offset=37, alignment=300)
    o, lse, tiles = emulate(q, k, v, 3, options=options)
    golden_o, golden_lse = reference.forward(*(a.astype(np.float64) for a in (q, k, v)),
                                             options)
    try:
        assert_attention_close(o, golden_o, q.dtype, name="o")
        assert_attention_close(lse, golden_lse, q.dtype, name="lse")
    except AssertionError as error:
        print(f"FAILED placed block: {error}")
        return 1
    print(f"ok placed block (row_offset 100, col_offset 37, alignment 300) {tiles}")
    return 0


def check(q, k, v, options, splits, rows=None) -> int:
    """The emulation against the golden model, o written contiguous (B, H, N, Dv) and, as a
    "bshd" call's is, into a (B, N, H, Dv) buffer (STRIDED_OUT); `rows` as emulate's."""
    golden_o, golden_lse = tileattn.forward(*(a.astype(np.float64) for a in (q, k, v)),
                                            backend="reference", return_lse=True, **options)
    failures = 0
    for sequence_first_o in (False, True):
        o, lse, tiles = emulate(q, k, v, splits, sequence_first_o=sequence_first_o, rows=rows,
                                **options)
        label = (f"{q.dtype.name} q{q.shape} k{k.shape} v{v.shape} {sorted(options)} {tiles}"
                 f"{' o (B, N, H, Dv)' if sequence_first_o else ''}")
        try:
            assert_attention_close(o, golden_o, q.dtype, name="o")
            assert_attention_close(lse, golden_lse, q.dtype, name="lse")
        except AssertionError as error:
            print(f"FAILED {label}: {error}")
            failures += 1
            continue
        print(f"ok {label}")
    return failures


if __name__ == "__main__":
    sys.exit(main())
