"""Scalar maths for the kernels' inner loops, written so LLVM can vectorise the loops.

Why a hand-written ``exp2``: Numba lowers ``np.exp`` on float32 to a scalar ``expf`` call,
which LLVM cannot vectorise without Intel's SVML. The softmax evaluates one exponential per
score, and at ~10 cycles each that alone would cost more than the two matrix products around
it. The polynomial below is plain arithmetic plus one bit cast, so a loop of it becomes AVX2
code; on the development machine it measured 0.3 ns per element against 0.6 ns for the
``expf`` loop... (see bench/NOTES-cpu.md).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

FASTMATH = {"contract", "reassoc"}
"""The only fast-math flags the kernels use.

``contract`` lets LLVM fuse multiply-adds; ``reassoc`` lets it reorder the row sums and
reductions so they vectorise. Both keep IEEE semantics for -inf and NaN, which the kernels
rely on: masked scores are -inf, and a NaN input must reach its row's output. ``nnan`` and
``ninf`` would let LLVM assume those values never occur and fold the masking away.
"""

LOG2_E = 1.4426950408889634
LN_2 = 0.6931471805599453

# 2**f on [-0.5, 0.5]: degree-6 least-squares fit of the relative error at 2000 Chebyshev
# nodes, rounded to float32; max error 1.6 ulp including float32 Horner rounding.
_EXP2_COEFFICIENTS = (1.0, 0.6931471824645996, 0.24022646248340607, 0.05550329014658928,
                      0.009618519805371761, 0.0013399859890341759, 0.00015337577497120947)
_C0, _C1, _C2, _C3, _C4, _C5, _C6 = (np.float32(c) for c in _EXP2_COEFFICIENTS)


@intrinsic
def _power_of_two_float32(typingctx, n):
    """``2**n`` for an integral float32 `n` in [-126, 127], built in the exponent bits
    (``n = -127`` gives +0.0).

    Written as LLVM IR because Numba widens int32 arithmetic to int64 and has no bit cast.
    """
    if n != types.float32:
        return None

    def codegen(context, builder, signature, args):
        int32 = ir.IntType(32)
        exponent = builder.add(builder.fptosi(args[0], int32), ir.Constant(int32, 127))
        return builder.bitcast(builder.shl(exponent, ir.Constant(int32, 23)), ir.FloatType())

    return types.float32(types.float32), codegen


@intrinsic
def maximum(typingctx, a, b):
    """``max(a, b)`` that returns NaN if either is NaN, as ``np.maximum`` does.

    LLVM's ``llvm.maximum`` has exactly these semantics and, unlike the compare-and-select
    a Python ``max`` becomes, vectorises as a row reduction without the ``nnan`` flag
    (0.09 against 0.29 ns per element on the development machine).
    """
    if a != b or a not in (types.float32, types.float64):
        return None

    def codegen(context, builder, signature, args):
        llvm_type = context.get_value_type(a)
        function_type = ir.FunctionType(llvm_type, [llvm_type, llvm_type])
        name = "llvm.maximum.f32" if a == types.float32 else "llvm.maximum.f64"
        return builder.call(cgutils.get_or_insert_function(builder.module, function_type, name),
                            args)

    return a(a, a), codegen


def exp2_nonpositive(x):
    """``2 ** x`` for ``x <= 0``, -inf or NaN: a score minus its row maximum or its lse.

    Inside Numba kernels float32 uses the vectorisable polynomial below. Positive `x` is
    outside its domain: leaving out the overflow guard that a general ``exp2`` needs saved a
    quarter of the time (0.38 against 0.49 ns per element), so callers clamp instead.
    """
    return np.exp2(x)


@njit(fastmath=FASTMATH)
def _exp2_nonpositive_float32(x):
    # 2**x = 2**n * 2**f with n = round(x) and f in [-0.5, 0.5]. The input is clamped at
    # -127 first, with the NaN-propagating `maximum`: n = -127 builds 2**n as the bits of
    # +0.0, so everything below about -127 (also -inf) comes out 0 without a final select,
    # and f stays finite. That saved a compare and a blend per element: 0.37 -> 0.28 ns
    # (bench/NOTES-cpu.md, v6). A NaN input stays NaN through f and the polynomial (its n
    # converts to some integer, harmlessly).
    clamped = maximum(x, np.float32(-127.0))
    n = np.floor(clamped + np.float32(0.5))
    f = clamped - n
    p = _C6 * f + _C5
    p = p * f + _C4
    p = p * f + _C3
    p = p * f + _C2
    p = p * f + _C1
    p = p * f + _C0
    return p * _power_of_two_float32(n)


@overload(exp2_nonpositive)
def _exp2_nonpositive_overload(x):
    if x == types.float32:
        return lambda x: _exp2_nonpositive_float32(x)
    return lambda x: np.exp2(x)


def tanh(x):
    """``tanh(x)``; inside Numba kernels float32 takes the vectorisable form below."""
    return np.tanh(x)


# tanh x = x + x z P(z), z = x**2, for |x| < _TANH_SERIES_LIMIT: degree-4 weighted
# least-squares fit of the relative error at 4000 Chebyshev nodes of z, rounded to float32;
# max error 0.83 ulp including float32 Horner rounding.
_TANH_SERIES_LIMIT = np.float32(0.625)
_TANH_COEFFICIENTS = (-0.3333328068256378, 0.1333138793706894, -0.05373574048280716,
                      0.02062750793993473, -0.005693212617188692)
_T0, _T1, _T2, _T3, _T4 = (np.float32(c) for c in _TANH_COEFFICIENTS)


@njit(fastmath=FASTMATH, error_model="numpy")
def _tanh_float32(x):
    # Plain arithmetic, so a softcap loop vectorises, where tanhf is a scalar call (3.6
    # against 0.43 ns a score; bench/NOTES-cpu.md session 10). Both forms are computed and
    # one is selected, which keeps the loop free of branches.
    # Far from 0: tanh |x| = (1 - e) / (1 + e) with e = exp(-2 |x|) <= 1 from the
    # polynomial exp2, whose error is absolute (a few units of float32's epsilon): relative
    # to tanh |x| >= 0.55 a few ulp. Near 0 it swamps tanh x ~ x (below |x| ~ 3e-8, e
    # rounds to 1 and the quotient is 0: under a softcap far above the scores every score
    # would become 0), so there the odd series above. -inf and inf give -1 and 1; NaN stays
    # NaN (it fails the comparison and takes the far form). NumPy's error model: Python's
    # checks every division for zero, and that check kept the loop scalar (1 + e >= 1).
    e = _exp2_nonpositive_float32(np.float32(-2.0 * LOG2_E) * np.abs(x))
    magnitude = (np.float32(1.0) - e) / (np.float32(1.0) + e)
    far = magnitude if x >= np.float32(0.0) else -magnitude
    z = x * x
    near = x + x * z * ((((_T4 * z + _T3) * z + _T2) * z + _T1) * z + _T0)
    return near if np.abs(x) < _TANH_SERIES_LIMIT else far


@overload(tanh)
def _tanh_overload(x):
    if x == types.float32:
        return lambda x: _tanh_float32(x)
    return lambda x: np.tanh(x)
