"""float16 bits widened to float32 bits sixteen lanes at a time, written as LLVM IR.

`widen.widen_row` converts float16 K and V tiles for the decode kernel, and whole float16
inputs for the others. As Numba loops its integer form ran at ~0.4 ns an element on a Zen 4
core, ten times bfloat16's shift (Numba widens 32-bit integer arithmetic to 64 bits and
has no bit cast, so LLVM vectorised little of it): a float16 decode read half the bytes of
a float32 one and took twice as long. Here each step loads 16 halves, rebuilds their
float32 bits with vector integer operations, and stores 16 words. Exactly NumPy's values:
normal numbers get their exponent rebased (15 to 127); infinities and NaNs keep an
all-ones exponent and their payload, shifted along (no float operation touches them, so a
signalling NaN stays signalling, as NumPy's conversion leaves it); zeros and subnormals
are rebuilt as ``(2**-14 + m * 2**-24) - 2**-14``, one float subtraction that is exact
(Sterbenz) and whose result, ``m * 2**-24``, is a normal float32, so flushing subnormals
(`denormals`) does not touch it.
"""

from __future__ import annotations

import llvmlite.ir as ir
from numba import types
from numba.extending import intrinsic

from .llvm_loops import carried_loop

LANES = 16

_I16X16 = ir.VectorType(ir.IntType(16), LANES)
_I32X16 = ir.VectorType(ir.IntType(32), LANES)
_F32X16 = ir.VectorType(ir.FloatType(), LANES)


def _splat_int(value: int) -> ir.Constant:
    return ir.Constant(_I32X16, [ir.Constant(ir.IntType(32), value)] * LANES)


@intrinsic
def halves_to_floats(typingctx, bits, out_bits, n_vectors):
    """``out_bits[:16 * n_vectors]`` = the float32 bits of the float16 bits
    ``bits[:16 * n_vectors]``; both arrays 1-D with contiguous elements (uint16, uint32)."""
    if not (isinstance(bits, types.Array) and bits.dtype == types.uint16
            and isinstance(out_bits, types.Array) and out_bits.dtype == types.uint32):
        return None
    signature = types.void(bits, out_bits, n_vectors)

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        source = context.make_array(signature.args[0])(context, builder, args[0]).data
        target = context.make_array(signature.args[1])(context, builder, args[1]).data
        count = context.cast(builder, args[2], signature.args[2], types.int64)
        smallest_normal = ir.Constant(_F32X16, [ir.Constant(ir.FloatType(), 2.0 ** -14)]
                                      * LANES)

        def step(index, carried):
            offset = builder.mul(index, ir.Constant(i64, LANES))
            halves = builder.load(builder.bitcast(builder.gep(source, [offset]),
                                                  _I16X16.as_pointer()), align=2)
            half = builder.zext(halves, _I32X16)
            rest = builder.shl(builder.and_(half, _splat_int(0x7FFF)), _splat_int(13))
            exponent = builder.and_(rest, _splat_int(0x0F800000))
            rebased = builder.add(rest, _splat_int(112 << 23))
            # Infinities and NaNs: all ones in five bits become all ones in eight.
            rebased = builder.select(builder.icmp_unsigned("==", exponent,
                                                           _splat_int(0x0F800000)),
                                     builder.add(rebased, _splat_int(112 << 23)), rebased)
            # Zeros and subnormals: 2**-14 * (1 + m / 1024), less 2**-14.
            lifted = builder.bitcast(builder.add(rebased, _splat_int(1 << 23)), _F32X16)
            small = builder.bitcast(builder.fsub(lifted, smallest_normal), _I32X16)
            value = builder.select(builder.icmp_unsigned("==", exponent, _splat_int(0)),
                                   small, rebased)
            sign = builder.shl(builder.and_(half, _splat_int(0x8000)), _splat_int(16))
            builder.store(builder.or_(value, sign),
                          builder.bitcast(builder.gep(target, [offset]),
                                          _I32X16.as_pointer()), align=4)
            return []

        carried_loop(builder, count, [], step)
        return context.get_dummy_value()

    return signature, codegen
