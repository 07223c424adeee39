"""Run attention_decode.cu on the CPU, no GPU: the kernel's own source under a C++ emulation
of the CUDA built-ins it uses, checked against the float64 golden model.

    python3 bench/experiments/emulate_decode_cpu.py [--quick]

Needs g++ 12+ (C++20 std::barrier, _Float16). Each block runs as THREADS std::threads that
meet at __syncthreads (a std::barrier) and exchange warp shuffles through a per-warp buffer
between two warp barriers; blocks run one after another; cp.async copies land at once (so
this checks indexing, masks, the split ranges, the merge and the barriers' placement, not
the copy pipeline's waits; compute-sanitizer on the GPU does that). PTX `asm` in the shared
headers is replaced by its meaning (cvt to and from half, cvta.to.shared, the dynamic
shared-memory size); what no decode path uses (mma.sync, ldmatrix) compiles to nothing.
"""

from __future__ import annotations

import argparse
import ctypes
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

inline void __syncthreads() { g_block_barrier->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) {
    g_warp_barriers[threadIdx.x / 32]->arrive_and_wait();
}
template <typename X> X __shfl_xor_sync(unsigned, X x, int lane_mask) {
    static_assert(sizeof(X) <= sizeof(double));
    const unsigned lane = threadIdx.x % 32, warp0 = threadIdx.x - lane;
    std::memcpy(&g_exchange[threadIdx.x], &x, sizeof(X));
    __syncwarp();
    X partner;
    std::memcpy(&partner, &g_exchange[warp0 + (lane ^ lane_mask)], sizeof(X));
    __syncwarp();
    return partner;
}
inline unsigned __float_as_uint(float x) { return std::bit_cast<unsigned>(x); }
inline float __uint_as_float(unsigned x) { return std::bit_cast<float>(x); }
inline long long __double_as_longlong(double x) { return std::bit_cast<long long>(x); }
inline double __longlong_as_double(long long x) { return std::bit_cast<double>(x); }
inline void __trap() { std::fprintf(stderr, "__trap\n"); std::abort(); }
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
    (r"asm volatile\(", "asm("),
]
# cp.async: the copy (or the zeros) at once, defined where the PTX version was (copy_row_chunk
# names it as a template right after).
COPY_PATTERN = r"template <int ChunkBytes>\s*__device__ __forceinline__ void copy_chunk_async\("


COPY = r"""
template <int ChunkBytes>
inline void copy_chunk_async(u32 destination, const void* source, bool valid) {
    if (valid) std::memcpy(g_shared + destination, source, ChunkBytes);
    else std::memset(g_shared + destination, 0, ChunkBytes);
}
"""

RUNNER = r"""
template <typename Kernel>
void run_blocks(Kernel kernel, unsigned blocks, unsigned threads, unsigned shared) {
    std::vector<unsigned char> memory(shared + 64, 0xff);  // stale bytes: NaN patterns
    g_shared = memory.data();
    g_dynamic_shared = shared;
    gridDim.x = blocks;
    blockDim.x = threads;
    for (unsigned block = 0; block < blocks; ++block) {
        blockIdx.x = block;
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

extern "C" void run(const T* q, const T* k, const T* v, T* o, Acc* lse, Acc* partial_o,
                    Acc* partial_lse, const double* slopes, i64 n_q, i64 n_k, int n_q_heads,
                    int group, int splits, const i64* strides, const double* reals,
                    const i64* band, const unsigned* bits, int blocks, int shared,
                    i64 n_rows) {
    run_blocks([&] {
        attention_decode(q, k, v, o, lse, partial_o, partial_lse, slopes, n_q, n_k, n_q_heads,
                         group, splits, strides[0], strides[1], strides[2], strides[3],
                         strides[4], strides[5], strides[6], strides[7], strides[8],
                         (Acc)reals[0], (Acc)reals[1], band[0], band[1], band[2], bits[0],
                         bits[1], (Acc)reals[2], bits[2], bits[3]);
    }, blocks, THREADS, shared);
    if (splits > 1)
        run_blocks([&] { attention_decode_merge(partial_o, partial_lse, o, lse, n_rows, splits); },
                   n_rows, 128, splits * sizeof(Acc));
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
    code = PRELUDE + text + RUNNER
    digest = hashlib.sha256(repr((code, key)).encode()).hexdigest()[:16]
    directory = os.path.join(tempfile.gettempdir(), "tileattn-emulate")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"decode-{digest}.so")
    if not os.path.exists(path):
        source_path = path[:-3] + ".cpp"
        with open(source_path, "w") as handle:
            handle.write(code)
        command = ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w",
                   "-o", path, source_path] + [f"-D{k}={v}" for k, v in key]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(result.stderr[-6000:])
    _LIBRARIES[key] = ctypes.CDLL(path)
    return _LIBRARIES[key]


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


def emulate(q, k, v, splits: int | None = None, **kwargs):
    """o and lse of attention_decode.cu for host arrays (any strides, last axis contiguous)."""
    options = validate(q, k, v, **{**dict(causal=False, window=None, scale=None, softcap=None,
                                          alibi_slopes=None, dropout_p=0.0, seed=None,
                                          block_q=None, block_k=None, deterministic=True),
                                   **kwargs}).options
    batch, n_q_heads, n_q, head_dim = q.shape
    n_kv_heads, n_k, value_dim = k.shape[1], k.shape[2], v.shape[3]
    group = n_q_heads // n_kv_heads
    dtype = q.dtype.name
    problem = Problem(90, 227 * 1024, dtype, head_dim, value_dim, n_k)
    shape = DecodeShape(n_q, group, batch * n_kv_heads, batch * n_q_heads, n_k, 132)
    tiles = decode_tiles(problem, shape, splits=splits)
    assert decode_fits(problem, tiles)
    accum = np.float64 if dtype == "float64" else np.float32
    switches = dict(LIMIT_LEFT=int(options.window_left != UNLIMITED),
                    LIMIT_RIGHT=int(options.window_right != UNLIMITED),
                    SOFTCAP=int(options.softcap > 0), ALIBI=int(options.alibi_slopes is not None),
                    DROPOUT=int(options.dropout_p > 0))
    defines = dict(STORAGE=STORAGE[dtype], ACCUM="double" if accum == np.float64 else "float",
                   HEAD_DIM=head_dim, VALUE_DIM=value_dim, COPY_BYTES=_copy_bytes(k, v),
                   ROWS=tiles.rows, BLOCK_K=tiles.block_k, STAGES=tiles.stages,
                   THREADS=tiles.threads, **switches)
    run = library(defines).run
    n_rows = batch * n_q_heads * n_q
    o = np.full((batch, n_q_heads, n_q, value_dim), np.nan, dtype=q.dtype)
    lse = np.full((batch, n_q_heads, n_q), np.nan, dtype=accum)
    partial_o = np.full(tiles.splits * n_rows * value_dim, np.nan, dtype=accum)
    partial_lse = np.full(tiles.splits * n_rows, np.nan, dtype=accum)
    slopes = (np.zeros(1) if options.alibi_slopes is None
              else np.ascontiguousarray(options.alibi_slopes, dtype=np.float64))
    strides = np.array([s // a.itemsize for a in (q, k, v) for s in a.strides[:3]], np.int64)
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
    shared = tiles.shared_bytes(q.itemsize, np.dtype(accum).itemsize, head_dim, value_dim)
    run.restype = None
    run(_pointer(q), _pointer(k), _pointer(v), _pointer(o), _pointer(lse),
        _pointer(partial_o), _pointer(partial_lse), _pointer(slopes), ctypes.c_int64(n_q),
        ctypes.c_int64(n_k), ctypes.c_int(n_q_heads), ctypes.c_int(group),
        ctypes.c_int(tiles.splits), _pointer(strides), _pointer(reals), _pointer(band),
        _pointer(bits), ctypes.c_int(batch * n_kv_heads * tiles.splits), ctypes.c_int(shared),
        ctypes.c_int64(n_rows))
    return o, lse, tiles


CASES = [
    # (dtype, (B, Hq, Hkv, Nq, Nk, D, Dv), options, splits)
    ("float16", (2, 4, 4, 1, 333, 64, 64), {}, 1),
    ("float16", (2, 4, 4, 1, 333, 64, 64), {"causal": True}, 3),
    ("float16", (1, 8, 2, 3, 333, 64, 64), {"causal": True}, 40),  # more splits than tiles
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the first few cases only")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    failures = 0
    for dtype, (batch, hq, hkv, nq, nk, d, dv), options, splits in \
            itertools.islice(CASES, 4 if args.quick else None):
        dtype = bfloat16() if dtype == "bfloat16" else np.dtype(dtype)
        q = rng.standard_normal((batch, hq, nq, d)).astype(dtype)
        k = rng.standard_normal((batch, hkv, nk, d)).astype(dtype)
        v = rng.standard_normal((batch, hkv, nk, dv)).astype(dtype)
        failures += check(q, k, v, options, splits)
    for layout in ("unaligned", "reversed_keys", "bshd"):  # rows read in place, any strides
        q, k, v = strided_case(layout, rng)
        failures += check(q, k, v, {"causal": True}, 3)
    q, k, v = non_finite_case()
    for options in ({"causal": True}, {"causal": True, "window": (3, None)}):
        failures += check(q, k, v, options, 4)
    print("all passed" if not failures else f"{failures} failed")
    return int(failures > 0)


def check(q, k, v, options, splits) -> int:
    o, lse, tiles = emulate(q, k, v, splits, **options)
    golden_o, golden_lse = tileattn.forward(*(a.astype(np.float64) for a in (q, k, v)),
                                            backend="reference", return_lse=True, **options)
    label = f"{q.dtype.name} q{q.shape} k{k.shape} v{v.shape} {sorted(options)} {tiles}"
    try:
        assert_attention_close(o, golden_o, q.dtype, name="o")
        assert_attention_close(lse, golden_lse, q.dtype, name="lse")
    except AssertionError as error:
        print(f"FAILED {label}: {error}")
        return 1
    print(f"ok {label}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
