"""An experiment: the float32 forward's two tile products on the vector registers, in LLVM
IR through Numba, against OpenBLAS (``np.dot``, one thread) and torch's MKL.

    PYTHONPATH=. python bench/experiments/gemm_microkernel_cpu.py

The CPU forward's ``S = Q K^T`` and ``P V`` are 75-80 % of its time, and at its tile shapes
OpenBLAS's sgemm runs 132-157 GFLOP/s on one AVX-512 core of the development machine where
MKL (behind torch's SDPA) runs 175-197. Here each product is a grid of register tiles: `MR`
rows of A times a panel of `NR` (or 16) columns of B, the ``MR x NR`` sums held in 16-lane
vectors over the whole depth (`_register_tile`, LLVM IR: written as Numba loops the sums
stay in memory, 10 GFLOP/s). Each sum runs over the depth in order with one fused
multiply-add a step, as OpenBLAS's kernel does: the scores match ``np.dot`` bit for bit
here, so a forward on these products would round S as the backward's ``np.dot`` does.

Measured (session 13, bench/NOTES-cpu.md): the products alone 1.05-1.3x OpenBLAS, but put
into `forward_kernel._tile` the forward moved -5 to +6 % (P, 2 MiB at 1024 x 512, streams
from L3 between panels; smaller tiles did not help). Not used by the kernels.

The grids read and write whole register tiles: rows past the last (up to ``MR - 1``, and
up to ``NR`` scores past the last row's end) are read from, and written to, the padding
that the buffers keep for them (`ROW_PADDING` rows and `NR` elements).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from tileattn.cpu.tiles import tile_view
from tileattn.cpu.vector_math import FASTMATH

MR = 12  # rows of a register tile
NR = 32  # columns of a full panel (two 16-lane vectors); the last may have 16
ROW_PADDING = MR  # rows a buffer keeps past its last row for the register tiles' overrun

_LANES = 16
_VECTOR = ir.VectorType(ir.FloatType(), _LANES)


def _register_tile(width: int):
    """An intrinsic ``tile(a, b, c, depth, lda, ldb, ldc)``: ``c[i, j] = sum_k a[i, k] *
    b[k, j]`` for ``i < MR``, ``j < width``, float32 pointers with rows `lda`, `ldb`, `ldc`
    elements apart."""
    vectors = width // _LANES

    @intrinsic
    def tile(typingctx, a, b, c, depth, lda, ldb, ldc):
        signature = types.void(a, b, c, depth, lda, ldb, ldc)

        def codegen(context, builder, signature, args):
            a, b, c, depth, lda, ldb, ldc = args
            index = depth.type
            vector_pointer = _VECTOR.as_pointer()
            fma = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(_VECTOR, [_VECTOR] * 3), "llvm.fma.v16f32")
            # Sums in stack slots: LLVM's mem2reg keeps them in registers for the loop.
            sums = [cgutils.alloca_once_value(builder, ir.Constant(_VECTOR, [0.0] * _LANES))
                    for _ in range(MR * vectors)]
            undefined = ir.Constant(_VECTOR, ir.Undefined)
            broadcast = ir.Constant(ir.VectorType(ir.IntType(32), _LANES), [0] * _LANES)
            with cgutils.for_range(builder, depth) as loop:
                k = loop.index
                row = builder.gep(b, [builder.mul(k, ldb)])
                columns = [builder.load(builder.bitcast(
                    builder.gep(row, [ir.Constant(index, _LANES * v)]), vector_pointer), align=4)
                    for v in range(vectors)]
                for i in range(MR):
                    element = builder.load(builder.gep(
                        a, [builder.add(builder.mul(ir.Constant(index, i), lda), k)]))
                    spread = builder.shuffle_vector(
                        builder.insert_element(undefined, element, ir.Constant(ir.IntType(32), 0)),
                        undefined, broadcast)
                    for v, column in enumerate(columns):
                        slot = sums[vectors * i + v]
                        builder.store(builder.call(fma, [spread, column, builder.load(slot)]),
                                      slot)
            for i in range(MR):
                for v in range(vectors):
                    target = builder.gep(c, [builder.add(builder.mul(ir.Constant(index, i), ldc),
                                                         ir.Constant(index, _LANES * v))])
                    builder.store(builder.load(sums[vectors * i + v]),
                                  builder.bitcast(target, vector_pointer), align=4)
            return context.get_dummy_value()

        return signature, codegen

    return tile


_full_tile = _register_tile(NR)
_half_tile = _register_tile(_LANES)


@intrinsic
def _address(typingctx, array, offset):
    """A pointer to element `offset` (in elements) past the start of `array`'s data."""
    signature = types.CPointer(array.dtype)(array, offset)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.gep(data, [args[1]])

    return signature, codegen


@njit
def padded_columns(n_cols: int) -> int:
    """The row length of a product's output: `n_cols` rounded up to 16."""
    return -(-n_cols // _LANES) * _LANES


@njit(fastmath=FASTMATH, boundscheck=False)
def _pack_keys(keys, packed, panels):
    """``packed[p, d, j] = keys[p * NR + j, d]`` (zeros past the last key): K^T in panels
    of NR keys, each a contiguous ``depth x NR`` block."""
    n_keys, depth = keys.shape
    for p in range(panels):
        base = p * depth * NR
        for j in range(NR):
            key = p * NR + j
            if key < n_keys:
                for d in range(depth):
                    packed[base + d * NR + j] = keys[key, d]
            else:
                for d in range(depth):
                    packed[base + d * NR + j] = 0.0


@njit(fastmath=FASTMATH, boundscheck=False)
def _grid(a, lda, n_rows, b_panel, ldb, panel_step, c, ldc, width, depth):
    """Register tiles over ``n_rows`` rows of A and `width` (a multiple of 16) columns.

    `ldc` may be below `width` (C-contiguous scores of any key count, whose rows the
    softmax loops read as contiguous arrays): the last panel's columns past `ldc` then run
    into the next row's first columns, so each strip's panels go last first and the earlier
    ones write those columns again (the next strip's are written after). The last row's
    overrun lands in the padding."""
    for i0 in range(0, n_rows, MR):  # a strip of A stays in L1 across B's panels (in L2)
        a_tile = _address(a, i0 * lda)
        for p in range((width - 1) // NR * NR, -1, -NR):
            b = _address(b_panel, (p // NR) * panel_step)
            c_tile = _address(c, i0 * ldc + p)
            if width - p >= NR:
                _full_tile(a_tile, b, c_tile, depth, lda, ldb, ldc)
            else:
                _half_tile(a_tile, b, c_tile, depth, lda, ldb, ldc)


def score_tile(q_rows, keys, scores_buffer, packed):
    """``q_rows @ keys.T`` as a ``(rows, keys)`` view of `scores_buffer` (Numba only)."""
    raise NotImplementedError("a Numba kernel helper")


def value_tile(probabilities, values, product_buffer):
    """``probabilities @ values`` as a ``(rows, Dv)`` view of `product_buffer` (Numba
    only)."""
    raise NotImplementedError("a Numba kernel helper")


@overload(score_tile, jit_options={"fastmath": FASTMATH})
def _score_tile(q_rows, keys, scores_buffer, packed):
    if q_rows.dtype != types.float32:
        def blas(q_rows, keys, scores_buffer, packed):
            scores = tile_view(scores_buffer, q_rows.shape[0], keys.shape[0])
            np.dot(q_rows, keys.T, scores)
            return scores
        return blas

    def registers(q_rows, keys, scores_buffer, packed):
        n_rows, depth = q_rows.shape
        n_cols = keys.shape[0]
        _pack_keys(keys, packed, -(-n_cols // NR))
        _grid(q_rows, q_rows.strides[0] // 4, n_rows, packed, NR, depth * NR, scores_buffer,
              n_cols, padded_columns(n_cols), depth)
        return tile_view(scores_buffer, n_rows, n_cols)
    return registers


@overload(value_tile, jit_options={"fastmath": FASTMATH})
def _value_tile(probabilities, values, product_buffer):
    if probabilities.dtype != types.float32:
        def blas(probabilities, values, product_buffer):
            product = tile_view(product_buffer, probabilities.shape[0], values.shape[1])
            np.dot(probabilities, values, product)
            return product
        return blas

    def registers(probabilities, values, product_buffer):
        n_rows, n_keys = probabilities.shape
        width = values.shape[1]
        if width % 16 != 0 or values.strides[1] != 4:  # rows of V are the panels: whole vectors
            product = tile_view(product_buffer, n_rows, width)
            np.dot(probabilities, values, product)
            return product
        _grid(probabilities, probabilities.strides[0] // 4, n_rows, values,
              values.strides[0] // 4, NR, product_buffer, width, width, n_keys)
        return tile_view(product_buffer, n_rows, width)
    return registers


def main() -> None:
    import time

    import numba

    numba.set_num_threads(1)

    @njit
    def scores(q, keys, buffer, packed, repeats):
        for _ in range(repeats):
            result = score_tile(q, keys, buffer, packed)
        return result

    @njit
    def products(p, values, buffer, repeats):
        for _ in range(repeats):
            result = value_tile(p, values, buffer)
        return result

    def per_call(function, repeats=10):
        function(1)
        start = time.perf_counter()
        function(repeats)
        return (time.perf_counter() - start) / repeats

    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        torch = None
    mkl = None
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    print("| product | rows x depth x cols | registers GF/s | OpenBLAS GF/s | MKL (torch) GF/s "
          "| equal to np.dot |")
    print("|---|---|---:|---:|---:|---|")
    for rows, depth, keys_n in ((1024, 80, 512), (512, 96, 512), (1024, 128, 512)):
        padded = rng.standard_normal((rows + ROW_PADDING, depth)).astype(np.float32)
        q, keys = padded[:rows], rng.standard_normal((keys_n, depth)).astype(np.float32)
        buffer = np.empty((rows + ROW_PADDING) * keys_n + NR, np.float32)
        packed = np.empty(-(-keys_n // NR) * NR * depth, np.float32)
        s = scores(q, keys, buffer, packed, 1).copy()
        c = np.empty((rows, keys_n), np.float32)  # outputs given, as the kernels give them
        with threadpool_limits(1):
            equal = np.array_equal(s, q @ keys.T)
            blas = per_call(lambda n: [np.dot(q, keys.T, c) for _ in range(n)])
        if torch:
            tq, tk, tc = torch.from_numpy(q), torch.from_numpy(keys), torch.from_numpy(c)
            mkl = per_call(lambda n: [torch.mm(tq, tk.T, out=tc) for _ in range(n)])
        ours = per_call(lambda n: scores(q, keys, buffer, packed, n))
        flops = 2.0 * rows * depth * keys_n
        print(f"| S = Q K^T | {rows} x {depth} x {keys_n} | {flops / ours / 1e9:.0f} | "
              f"{flops / blas / 1e9:.0f} | {flops / mkl / 1e9 if mkl else float('nan'):.0f} "
              f"| {equal} |")
        values = rng.standard_normal((keys_n, depth)).astype(np.float32)
        out = np.empty((rows + ROW_PADDING) * depth, np.float32)
        c = np.empty((rows, depth), np.float32)
        with threadpool_limits(1):
            blas = per_call(lambda n: [np.dot(s, values, c) for _ in range(n)])
        if torch:
            ts, tv, tc = torch.from_numpy(s), torch.from_numpy(values), torch.from_numpy(c)
            mkl = per_call(lambda n: [torch.mm(ts, tv, out=tc) for _ in range(n)])
        ours = per_call(lambda n: products(s, values, out, n))
        print(f"| P V | {rows} x {keys_n} x {depth} | {flops / ours / 1e9:.0f} | "
              f"{flops / blas / 1e9:.0f} | {flops / mkl / 1e9 if mkl else float('nan'):.0f} "
              f"| - |")


if __name__ == "__main__":
    main()
