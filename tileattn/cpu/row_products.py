"""``out = weights @ values`` for a few rows of float32 weights, held in vector registers.

The decode kernel's ``P V`` has one to 32 rows of probabilities against a tile of value
rows. Written as Numba loops, each pass over an output row loads and stores that row again
(LLVM cannot keep a row's sums in registers across the key loop: it does not vectorise
chains of scalar sums carried by a loop, and it cannot prove that the output and the values
never overlap), so one row ran at ~30 GFLOP/s on a Zen 4 core, a third of its multiply-add
rate. Here a micro-kernel written as LLVM IR (as `bf16_products`' is) keeps a block of two
rows x 64 columns of sums in 16-lane vectors for the whole key loop: each key loads 64
values once for both rows, broadcasts each row's weight, and adds with fused multiply-adds;
the sums are stored once at the end. Each output element is the sum over the keys in key
order. `decode_kernel` chooses where these blocks or its loops run.
"""

from __future__ import annotations

import llvmlite.ir as ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .llvm_loops import carried_loop

LANES = 16
"""float32 lanes of one vector (a zmm register; two ymm where the CPU has no AVX-512)."""

_F32X16 = ir.VectorType(ir.FloatType(), LANES)


def _block_products(rows: int, vectors: int):
    """An intrinsic ``block(out, out_start, out_row_stride, weights, w_start, w_row_stride,
    values, v_start, v_row_stride, n_keys)``: for i < `rows` and c < ``vectors * LANES``,
    ``out[out_start + i * out_row_stride + c] = sum over j < n_keys of
    weights[w_start + i * w_row_stride + j] * values[v_start + j * v_row_stride + c]``
    (flat indices into the arrays' data, in elements)."""

    @intrinsic
    def block(typingctx, out, out_start, out_row_stride, weights, w_start, w_row_stride,
              values, v_start, v_row_stride, n_keys):
        if not all(isinstance(a, types.Array) and a.dtype == types.float32
                   for a in (out, weights, values)):
            return None
        signature = types.void(out, out_start, out_row_stride, weights, w_start, w_row_stride,
                               values, v_start, v_row_stride, n_keys)

        def codegen(context, builder, signature, args):
            i64 = ir.IntType(64)
            out_data, w_data, v_data = (
                context.make_array(signature.args[index])(context, builder, args[index]).data
                for index in (0, 3, 6))
            (out_start, out_row_stride, w_start, w_row_stride, v_start, v_row_stride,
             n_keys) = (context.cast(builder, args[index], signature.args[index], types.int64)
                        for index in (1, 2, 4, 5, 7, 8, 9))
            fma = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(_F32X16, [_F32X16] * 3), "llvm.fma.v16f32")
            zero = ir.Constant(_F32X16, None)
            undefined = ir.Constant(_F32X16, ir.Undefined)
            splat = ir.Constant(ir.VectorType(ir.IntType(32), LANES), None)

            def address(data, index):
                return builder.bitcast(builder.gep(data, [index]), _F32X16.as_pointer())

            def step(key, sums):  # sums: rows x vectors, row-major
                value_base = builder.add(v_start, builder.mul(key, v_row_stride))
                value_vectors = [builder.load(address(v_data, builder.add(
                    value_base, ir.Constant(i64, LANES * v))), align=4)
                    for v in range(vectors)]
                updated = []
                for i in range(rows):
                    weight_index = builder.add(builder.add(
                        w_start, builder.mul(w_row_stride, ir.Constant(i64, i))), key)
                    weight = builder.load(builder.gep(w_data, [weight_index]))
                    lanes = builder.insert_element(undefined, weight,
                                                   ir.Constant(ir.IntType(32), 0))
                    broadcast = builder.shuffle_vector(lanes, undefined, splat)
                    updated += [builder.call(fma, [broadcast, value_vectors[v],
                                                   sums[i * vectors + v]])
                                for v in range(vectors)]
                return updated

            results = carried_loop(builder, n_keys, [zero] * (rows * vectors), step)
            for index, result in enumerate(results):
                i, v = divmod(index, vectors)
                row_start = builder.add(out_start, builder.mul(out_row_stride,
                                                               ir.Constant(i64, i)))
                builder.store(result, address(out_data, builder.add(
                    row_start, ir.Constant(i64, LANES * v))), align=4)
            return context.get_dummy_value()

        return signature, codegen

    return block


# Two rows x 64 columns: eight chains of multiply-adds, enough to cover the adds' latency
# on both of a Zen 4 core's pipes, in 8 of its 32 vector registers (16 of AVX2's 16 ymm).
_two_rows_64 = _block_products(2, 4)
_one_row_64 = _block_products(1, 4)
_two_rows_16 = _block_products(2, 1)
_one_row_16 = _block_products(1, 1)


@njit(inline="always")
def _element_stride(array, axis):
    return array.strides[axis] // 4


@njit
def _row_block(pair, wide, *arguments):
    """The block of two rows or one, of 64 columns or 16, at `arguments`' place."""
    if pair:
        if wide:
            _two_rows_64(*arguments)
        else:
            _two_rows_16(*arguments)
    elif wide:
        _one_row_64(*arguments)
    else:
        _one_row_16(*arguments)


@njit
def weights_times_values(weights, values, out):
    """``out = weights @ values`` for float32 arrays whose last axes are contiguous, in
    blocks of rows x 64 and x 16 columns in registers: the first ``width // LANES * LANES``
    columns (the caller computes any others)."""
    n_rows, n_keys, width = weights.shape[0], values.shape[0], values.shape[1]
    w_stride, v_stride = _element_stride(weights, 0), _element_stride(values, 0)
    out_stride = _element_stride(out, 0)
    wide = width // 64 * 64
    for r in range(0, n_rows, 2):
        for c in range(0, width // LANES * LANES, LANES):
            if c < wide and c % 64 != 0:
                continue  # inside a block of 64 columns
            _row_block(r + 1 < n_rows, c < wide, out, r * out_stride + c, out_stride,
                       weights, r * w_stride, w_stride, values, c, v_stride, n_keys)
