"""Tile products of bfloat16 operands on AVX512-BF16, for the bfloat16 backward.

NumPy's BLAS has no bfloat16 GEMM, so bfloat16 inputs, widened to float32, multiplied at
float32's rate: two Zen 4 cores' FMA peak, about what torch's bfloat16 backward takes with
its own GEMMs on `vdpbf16ps` (16 float32 lanes, each adding the products of a pair of
bfloat16s: twice float32's multiply-adds an instruction). `dot` computes ``out = a @ b``
as NumPy's ``np.dot(a, b, out)`` does, from operands rounded to bfloat16 (Q, K, V and dO
are bfloat16 values already; P and dS are rounded, as the GPU kernels and torch round
them), accumulating in float32.

The operands are packed in pairs along the inner dimension, each pair of bfloat16s in one
32-bit word as `vdpbf16ps` reads them: a row's neighbours (`_pack_along_rows`) or the
same column of two rows (`_pack_across_rows`), whichever the operand's layout reads
contiguously; then a micro-kernel (`_pair_products`, written as LLVM IR) adds an 8 x 32
block of ``out`` over all the pairs in 16 zmm registers, each step broadcasting one pair
of each of 8 rows of ``a`` against two vectors of 16 column pairs of ``b``. On a CPU without AVX512-BF16 the
same IR widens each pair and adds its two products in the same order with fused
multiply-adds (bfloat16 products are exact in float32, so the sums round alike); the
backward takes these products only where `HAS_PAIR_DOT` says the instruction is there.
"""

from __future__ import annotations

import llvmlite.binding as llvm
import llvmlite.ir as ir
import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .llvm_loops import carried_loop

ROWS, COLUMNS = 8, 32
"""The micro-kernel's block of ``out``: 8 rows by two 16-lane vectors."""

def _targets_pair_dot() -> bool:
    """Whether Numba compiles for a CPU with `vdpbf16ps`: this one (its default), or the
    one ``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES`` name (e.g. "generic" for caches that
    move between machines, which must not contain the instruction)."""
    from numba.core import config

    if config.CPU_NAME:
        return "+avx512bf16" in (config.CPU_FEATURES or "")
    try:
        return bool(llvm.get_host_cpu_features().get("avx512bf16", False))
    except RuntimeError:  # LLVM reads no features on some hosts: assume none
        return False


HAS_PAIR_DOT = _targets_pair_dot()
"""Whether the kernels may use `vdpbf16ps` (`_targets_pair_dot`)."""


class _BFloat(ir.Type):
    """LLVM's ``bfloat``, which llvmlite's IR builder does not name."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash("bfloat")


_F32X16 = ir.VectorType(ir.FloatType(), 16)
_I32X16 = ir.VectorType(ir.IntType(32), 16)
_BF16X32 = ir.VectorType(_BFloat(), 32)


@intrinsic
def _bits(typingctx, value):
    """A float32's bits as a uint32."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(value), codegen


@intrinsic
def _pair_products(typingctx, out, out_start, out_row_stride, a_words, a_start, a_row_stride,
                   a_pair_stride, b_words, b_start, b_pair_stride, n_pairs):
    """A block of ROWS x COLUMNS float32s of `out` (any array: its data from element
    `out_start`, rows `out_row_stride` elements apart) = the block's products over
    `n_pairs` pairs: row i's pair p at ``a_words[a_start + i * a_row_stride + p *
    a_pair_stride]``, column j's at ``b_words[b_start + p * b_pair_stride + j]`` (uint32
    words of two bfloat16s, the lower one first)."""
    signature = types.void(out, out_start, out_row_stride, a_words, a_start, a_row_stride,
                           a_pair_stride, b_words, b_start, b_pair_stride, n_pairs)

    def codegen(context, builder, signature, args):
        i64, i32 = ir.IntType(64), ir.IntType(32)
        out_data = context.make_array(signature.args[0])(context, builder, args[0]).data
        a_data = context.make_array(signature.args[3])(context, builder, args[3]).data
        b_data = context.make_array(signature.args[7])(context, builder, args[7]).data
        (out_start, out_row_stride, a_start, a_row_stride, a_pair_stride, b_start,
         b_pair_stride, n_pairs) = (
            context.cast(builder, args[index], signature.args[index], types.int64)
            for index in (1, 2, 4, 5, 6, 8, 9, 10))
        zero = ir.Constant(_F32X16, None)
        if HAS_PAIR_DOT:
            pair_dot = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(_F32X16, [_F32X16, _BF16X32, _BF16X32]),
                "llvm.x86.avx512bf16.dpbf16ps.512")
        else:
            fma = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(_F32X16, [_F32X16] * 3), "llvm.fma.v16f32")

        def add_pair_products(accumulator, a_broadcast, b_vector):
            if HAS_PAIR_DOT:
                return builder.call(pair_dot, [accumulator,
                                               builder.bitcast(a_broadcast, _BF16X32),
                                               builder.bitcast(b_vector, _BF16X32)])
            # The odd (upper) products first, then the even, as vdpbf16ps adds them.
            high_mask = ir.Constant(_I32X16, [0xFFFF0000] * 16)
            shift = ir.Constant(_I32X16, [16] * 16)
            for part in (lambda x: builder.and_(x, high_mask), lambda x: builder.shl(x, shift)):
                accumulator = builder.call(fma, [builder.bitcast(part(a_broadcast), _F32X16),
                                                 builder.bitcast(part(b_vector), _F32X16),
                                                 accumulator])
            return accumulator

        vectors = COLUMNS // 16

        def step(pair, sums):  # sums: ROWS x vectors, row-major
            b_base = builder.add(b_start, builder.mul(pair, b_pair_stride))
            b_vectors = [builder.load(builder.bitcast(
                builder.gep(b_data, [builder.add(b_base, ir.Constant(i64, 16 * j))]),
                _I32X16.as_pointer()), align=4) for j in range(vectors)]
            a_base = builder.add(a_start, builder.mul(pair, a_pair_stride))
            updated = []
            for i in range(ROWS):
                address = builder.add(a_base, builder.mul(a_row_stride, ir.Constant(i64, i)))
                word = builder.bitcast(builder.load(builder.gep(a_data, [address])), i32)
                lanes = builder.insert_element(ir.Constant(_I32X16, None), word,
                                               ir.Constant(i32, 0))
                broadcast = builder.shuffle_vector(lanes, ir.Constant(_I32X16, None),
                                                   ir.Constant(_I32X16, None))
                updated += [add_pair_products(sums[i * vectors + j], broadcast, b_vectors[j])
                            for j in range(vectors)]
            return updated

        results = carried_loop(builder, n_pairs, [zero] * (ROWS * vectors), step)
        for index, result in enumerate(results):
            i, j = divmod(index, vectors)
            address = builder.add(out_start, builder.add(
                builder.mul(out_row_stride, ir.Constant(i64, i)), ir.Constant(i64, 16 * j)))
            builder.store(result, builder.bitcast(builder.gep(out_data, [address]),
                                                  _F32X16.as_pointer()), align=4)
        return context.get_dummy_value()

    return signature, codegen


@njit(inline="always")
def _bfloat16_bits(value):
    """float32 `value` rounded to bfloat16 (half to even; a NaN stays a NaN), as its 16
    bits in a uint32; branch-free, so that packing loops vectorise. (float64 kernels
    compile these products too, never taking them: their values are cast.)"""
    bits = _bits(np.float32(value))
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> \
        np.uint32(16)
    quiet = (bits >> np.uint32(16)) | np.uint32(0x40)
    return quiet if bits & np.uint32(0x7FFFFFFF) > np.uint32(0x7F800000) else rounded


@njit
def _pack_along_rows(x, target, row_stride, pair_stride, padded_rows):
    """Each row's neighbours (x[i, 2p], x[i, 2p + 1]) as word ``target[i * row_stride + p *
    pair_stride]``, a zero partner past an odd width; rows up to `padded_rows` all zeros."""
    n_rows, width = x.shape
    pairs = (width + 1) // 2
    for i in range(n_rows):
        for p in range(width // 2):
            target[i * row_stride + p * pair_stride] = _bfloat16_bits(x[i, 2 * p]) | (
                _bfloat16_bits(x[i, 2 * p + 1]) << np.uint32(16))
        if width % 2:
            target[i * row_stride + (pairs - 1) * pair_stride] = _bfloat16_bits(x[i, width - 1])
    for i in range(n_rows, padded_rows):
        for p in range(pairs):
            target[i * row_stride + p * pair_stride] = 0


@njit
def _pack_across_rows(x, target, padded_width):
    """The same column of rows 2p and 2p + 1, (x[2p, j], x[2p + 1, j]), as word ``target[p
    * padded_width + j]``: contiguous along j; zeros past an odd row count and the width."""
    n_rows, width = x.shape
    pairs = (n_rows + 1) // 2
    for p in range(n_rows // 2):
        base = p * padded_width
        for j in range(width):
            target[base + j] = _bfloat16_bits(x[2 * p, j]) | (
                _bfloat16_bits(x[2 * p + 1, j]) << np.uint32(16))
        for j in range(width, padded_width):
            target[base + j] = 0
    if n_rows % 2:
        base = (pairs - 1) * padded_width
        for j in range(width):
            target[base + j] = _bfloat16_bits(x[n_rows - 1, j])
        for j in range(width, padded_width):
            target[base + j] = 0


@njit(inline="always")
def _padded(size, multiple):
    return (size + multiple - 1) // multiple * multiple


@njit
def workspace_sizes(rows, inner, columns):
    """The words of the products' three buffers (uint32, uint32, float32) for products of
    up to rows x inner x columns."""
    pairs = (inner + 1) // 2
    return (-(-rows // ROWS) * ROWS * pairs, pairs * -(-columns // COLUMNS) * COLUMNS,
            ROWS * COLUMNS)


@njit
def tile_buffers(block_q, block_k, head_dim, value_dim):
    """One thread's buffers for the products of an attention tile of block_q x block_k
    (the forward's two, the backward's five): `workspace_sizes` of the largest."""
    a_words, b_words, block = workspace_sizes(
        max(block_q, block_k), max(block_q, block_k, head_dim, value_dim),
        max(block_k, head_dim, value_dim))
    return (np.empty(a_words, np.uint32), np.empty(b_words, np.uint32),
            np.empty(block, np.float32))


@njit
def _blocks(out, a_words, a_row_stride, a_pair_stride, b_words, b_pair_stride, pairs, block):
    """``out`` from the packed words, block by block: whole blocks straight into it where
    its rows are contiguous, edge blocks through `block`."""
    n_rows, n_columns = out.shape
    direct = out.strides[1] == 4 and out.strides[0] % 4 == 0
    stride = out.strides[0] // 4
    for row0 in range(0, n_rows, ROWS):
        rows = min(ROWS, n_rows - row0)
        for column0 in range(0, n_columns, COLUMNS):
            columns = min(COLUMNS, n_columns - column0)
            if direct and rows == ROWS and columns == COLUMNS:
                _pair_products(out, row0 * stride + column0, stride, a_words,
                               row0 * a_row_stride, a_row_stride, a_pair_stride, b_words,
                               column0, b_pair_stride, pairs)
                continue
            _pair_products(block, 0, COLUMNS, a_words, row0 * a_row_stride, a_row_stride,
                           a_pair_stride, b_words, column0, b_pair_stride, pairs)
            for i in range(rows):
                for j in range(columns):
                    out[row0 + i, column0 + j] = block[i * COLUMNS + j]


@njit
def dot_nt(a, b, out, a_words, b_words, block):
    """``out = a @ b.T`` (S = Q K^T, dP = dO V^T) from bfloat16-rounded operands."""
    pairs = (a.shape[1] + 1) // 2
    n_rows, n_columns = out.shape
    _pack_along_rows(a, a_words, pairs, 1, _padded(n_rows, ROWS))
    width = _padded(n_columns, COLUMNS)
    _pack_along_rows(b, b_words, 1, width, width)
    _blocks(out, a_words, pairs, 1, b_words, width, pairs, block)


@njit
def scaled_scores(q, k, out, scale, a_words, b_words, block):
    """``out = scale * q @ k.T``, a tile's scores in natural units: the product first, as Q
    times the scale is no bfloat16 value."""
    dot_nt(q, k, out, a_words, b_words, block)
    factor = out.dtype.type(scale)
    for r in range(out.shape[0]):
        for j in range(out.shape[1]):
            out[r, j] *= factor


@njit
def dot_tn(a, b, out, a_words, b_words, block):
    """``out = a.T @ b`` (dV = P^T dO, dK = dS^T Q) from bfloat16-rounded operands."""
    pairs = (a.shape[0] + 1) // 2
    n_rows, n_columns = out.shape
    rows = _padded(n_rows, ROWS)
    _pack_across_rows(a, a_words, rows)
    width = _padded(n_columns, COLUMNS)
    _pack_across_rows(b, b_words, width)
    _blocks(out, a_words, 1, rows, b_words, width, pairs, block)


@njit
def dot_nn(a, b, out, a_words, b_words, block):
    """``out = a @ b`` (dQ = dS K) from bfloat16-rounded operands."""
    pairs = (a.shape[1] + 1) // 2
    n_rows, n_columns = out.shape
    _pack_along_rows(a, a_words, pairs, 1, _padded(n_rows, ROWS))
    width = _padded(n_columns, COLUMNS)
    _pack_across_rows(b, b_words, width)
    _blocks(out, a_words, pairs, 1, b_words, width, pairs, block)
