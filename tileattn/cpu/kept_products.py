"""Masked entries contribute nothing to a tile's matrix products, not ``0 x NaN`` (SPEC).

A tile the mask cuts (the causal diagonal, a window edge, rows that keep no key) holds
masked entries in ``P`` and ``dS``: exactly 0 by construction (masked scores are -inf by a
select, so ``exp2`` gives 0), or NaN on a row whose maximum or lse is NaN. BLAS multiplies
them with the other operand anyway, and ``0 x NaN`` or ``0 x inf`` is NaN, which would carry
a NaN at key ``j`` into rows that do not keep ``j``.

So after BLAS forms such a tile's product, any row of the result that came out non-finite is
summed again from its kept terms alone. That is exact: a finite row had only finite terms,
so its masked terms were exact zeros (0 times a finite value), and a non-finite row is
redone by the definition. Only non-finite inputs ever take the second pass, and a tile that
the mask keeps whole never needs either.
"""

from __future__ import annotations

from numba import njit

from .tiles import kept_columns
from .vector_math import FASTMATH


@njit(fastmath=FASTMATH)
def _row_is_finite(matrix, row):
    # x * 0 is 0 for finite x and NaN otherwise (no fast-math flag here lets LLVM fold it).
    total = matrix.dtype.type(0.0)
    for d in range(matrix.shape[1]):
        total += matrix[row, d] * matrix.dtype.type(0.0)
    return total == 0


@njit(fastmath=FASTMATH)
def redo_non_finite_rows(weights, values, product, row_start, col_start,
                         band_offset, window_left, window_right):
    """`product` = ``weights @ values`` for a tile of rows from `row_start` and keys from
    `col_start`: its non-finite rows become the sums over their kept keys only."""
    n_cols = weights.shape[1]
    for r in range(product.shape[0]):
        if _row_is_finite(product, r):
            continue
        lo, hi = kept_columns(row_start + r, col_start, n_cols, band_offset, window_left,
                              window_right)
        product[r, :] = 0
        for j in range(lo, hi):
            weight = weights[r, j]
            for d in range(product.shape[1]):
                product[r, d] += weight * values[j, d]


@njit(fastmath=FASTMATH)
def redo_non_finite_columns(weights, values, product, row_start, col_start,
                            band_offset, window_left, window_right):
    """`product` = ``weights.T @ values`` (one row per key of the tile): its non-finite rows
    become the sums over the query rows that keep that key only."""
    n_rows, n_cols = weights.shape
    for j in range(product.shape[0]):
        if _row_is_finite(product, j):
            continue
        product[j, :] = 0
        for r in range(n_rows):
            lo, hi = kept_columns(row_start + r, col_start, n_cols, band_offset, window_left,
                                  window_right)
            if lo <= j < hi:
                weight = weights[r, j]
                for d in range(product.shape[1]):
                    product[j, d] += weight * values[r, d]
