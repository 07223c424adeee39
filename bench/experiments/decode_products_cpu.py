"""An experiment: the decode kernel's plain-loop products (<= 16 packed rows) on one core,
register-blocked variants against the kernel's loops and OpenBLAS (``np.dot``).

    PYTHONPATH=. python bench/experiments/decode_products_cpu.py [--dims 128] [--rows 8]

``S = Q K^T`` (rows x D times D x keys) and ``P V`` (rows x keys times keys x Dv) over one
key tile (512 keys, the decode tiles' `block_k` at D = 128), K and V in L2 as in the kernel.
Each variant is first checked against the float64 product, then the variants take turns
(a loop of calls each, `--repeats` turns: the development machine's cores are shared and
noisy); prints the best and the median GFLOP/s.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from numba import njit

from tileattn.cpu import blas
from tileattn.cpu.decode_kernel import _rows_times_keys, _weights_times_values
from tileattn.cpu.vector_math import FASTMATH


@njit(fastmath=FASTMATH)
def _remaining_keys(rows, keys, out, first):
    """``out[:, first:] = rows @ keys[first:].T``, one key at a time: the keys a variant's
    blocks of keys leave over."""
    for j in range(first, keys.shape[0]):
        for r in range(rows.shape[0]):
            total = rows.dtype.type(0.0)
            for d in range(rows.shape[1]):
                total += rows[r, d] * keys[j, d]
            out[r, j] = total


@njit(fastmath=FASTMATH)
def qk_1x4(rows, keys, out):
    """The kernel's loop of session 17: one row times four keys a pass."""
    n_keys = keys.shape[0]
    n_fours = n_keys // 4 * 4
    zero = rows.dtype.type(0.0)
    for j in range(0, n_fours, 4):
        for r in range(rows.shape[0]):
            total0 = total1 = total2 = total3 = zero
            for d in range(rows.shape[1]):
                x = rows[r, d]
                total0 += x * keys[j, d]
                total1 += x * keys[j + 1, d]
                total2 += x * keys[j + 2, d]
                total3 += x * keys[j + 3, d]
            out[r, j], out[r, j + 1], out[r, j + 2], out[r, j + 3] = \
                total0, total1, total2, total3
    _remaining_keys(rows, keys, out, n_fours)


@njit(fastmath=FASTMATH)
def qk_4x2(rows, keys, out):
    """Four rows x two keys a pass."""
    n_rows, n_keys, depth = rows.shape[0], keys.shape[0], rows.shape[1]
    zero = rows.dtype.type(0.0)
    n_quads = n_rows // 4 * 4
    n_twos = n_keys // 2 * 2
    for j in range(0, n_twos, 2):
        for r in range(0, n_quads, 4):
            a0 = a1 = b0 = b1 = c0 = c1 = e0 = e1 = zero
            for d in range(depth):
                k0, k1 = keys[j, d], keys[j + 1, d]
                x, y, z, w = rows[r, d], rows[r + 1, d], rows[r + 2, d], rows[r + 3, d]
                a0 += x * k0
                a1 += x * k1
                b0 += y * k0
                b1 += y * k1
                c0 += z * k0
                c1 += z * k1
                e0 += w * k0
                e1 += w * k1
            out[r, j], out[r, j + 1] = a0, a1
            out[r + 1, j], out[r + 1, j + 1] = b0, b1
            out[r + 2, j], out[r + 2, j + 1] = c0, c1
            out[r + 3, j], out[r + 3, j + 1] = e0, e1
        for r in range(n_quads, n_rows):
            a0 = a1 = zero
            for d in range(depth):
                x = rows[r, d]
                a0 += x * keys[j, d]
                a1 += x * keys[j + 1, d]
            out[r, j], out[r, j + 1] = a0, a1
    _remaining_keys(rows, keys, out, n_twos)


@njit(fastmath=FASTMATH)
def qk_4x4(rows, keys, out):
    """Four rows x four keys a pass: sixteen sums (AVX-512's 32 registers hold them)."""
    n_rows, n_keys, depth = rows.shape[0], keys.shape[0], rows.shape[1]
    zero = rows.dtype.type(0.0)
    n_quads = n_rows // 4 * 4
    n_fours = n_keys // 4 * 4
    for j in range(0, n_fours, 4):
        for r in range(0, n_quads, 4):
            a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = zero
            c0 = c1 = c2 = c3 = e0 = e1 = e2 = e3 = zero
            for d in range(depth):
                k0, k1, k2, k3 = keys[j, d], keys[j + 1, d], keys[j + 2, d], keys[j + 3, d]
                x, y, z, w = rows[r, d], rows[r + 1, d], rows[r + 2, d], rows[r + 3, d]
                a0 += x * k0
                a1 += x * k1
                a2 += x * k2
                a3 += x * k3
                b0 += y * k0
                b1 += y * k1
                b2 += y * k2
                b3 += y * k3
                c0 += z * k0
                c1 += z * k1
                c2 += z * k2
                c3 += z * k3
                e0 += w * k0
                e1 += w * k1
                e2 += w * k2
                e3 += w * k3
            out[r, j], out[r, j + 1], out[r, j + 2], out[r, j + 3] = a0, a1, a2, a3
            out[r + 1, j], out[r + 1, j + 1], out[r + 1, j + 2], out[r + 1, j + 3] = \
                b0, b1, b2, b3
            out[r + 2, j], out[r + 2, j + 1], out[r + 2, j + 2], out[r + 2, j + 3] = \
                c0, c1, c2, c3
            out[r + 3, j], out[r + 3, j + 1], out[r + 3, j + 2], out[r + 3, j + 3] = \
                e0, e1, e2, e3
        for r in range(n_quads, n_rows):
            a0 = a1 = a2 = a3 = zero
            for d in range(depth):
                x = rows[r, d]
                a0 += x * keys[j, d]
                a1 += x * keys[j + 1, d]
                a2 += x * keys[j + 2, d]
                a3 += x * keys[j + 3, d]
            out[r, j], out[r, j + 1], out[r, j + 2], out[r, j + 3] = a0, a1, a2, a3
    _remaining_keys(rows, keys, out, n_fours)


@njit(fastmath=FASTMATH)
def pv_2x4(weights, values, out):
    """Two output rows x four keys a pass over D: the four value rows' loads serve both."""
    out[:] = 0
    n_rows, n_keys, width = weights.shape[0], values.shape[0], values.shape[1]
    n_pairs = n_rows // 2 * 2
    n_fours = n_keys // 4 * 4
    for j in range(0, n_fours, 4):
        for r in range(0, n_pairs, 2):
            a0, a1, a2, a3 = weights[r, j], weights[r, j + 1], weights[r, j + 2], weights[r, j + 3]
            b0, b1, b2, b3 = (weights[r + 1, j], weights[r + 1, j + 1], weights[r + 1, j + 2],
                              weights[r + 1, j + 3])
            for d in range(width):
                v0, v1, v2, v3 = values[j, d], values[j + 1, d], values[j + 2, d], values[j + 3, d]
                out[r, d] += a0 * v0 + a1 * v1 + a2 * v2 + a3 * v3
                out[r + 1, d] += b0 * v0 + b1 * v1 + b2 * v2 + b3 * v3
        for r in range(n_pairs, n_rows):
            a0, a1, a2, a3 = weights[r, j], weights[r, j + 1], weights[r, j + 2], weights[r, j + 3]
            for d in range(width):
                out[r, d] += (a0 * values[j, d] + a1 * values[j + 1, d]
                              + a2 * values[j + 2, d] + a3 * values[j + 3, d])
    for j in range(n_fours, n_keys):
        for r in range(n_rows):
            weight = weights[r, j]
            for d in range(width):
                out[r, d] += weight * values[j, d]


@njit(fastmath=FASTMATH)
def pv_1x4(weights, values, out):
    """The kernel's loop of session 17: one output row times four keys a pass."""
    out[:] = 0
    n_keys = values.shape[0]
    n_fours = n_keys // 4 * 4
    for j in range(0, n_fours, 4):
        for r in range(weights.shape[0]):
            w0, w1, w2, w3 = weights[r, j], weights[r, j + 1], weights[r, j + 2], weights[r, j + 3]
            for d in range(values.shape[1]):
                out[r, d] += (w0 * values[j, d] + w1 * values[j + 1, d]
                              + w2 * values[j + 2, d] + w3 * values[j + 3, d])
    for j in range(n_fours, n_keys):
        for r in range(weights.shape[0]):
            weight = weights[r, j]
            for d in range(values.shape[1]):
                out[r, d] += weight * values[j, d]


@njit(fastmath=FASTMATH)
def pv_2x8(weights, values, out):
    """Two output rows x eight keys a pass."""
    out[:] = 0
    n_rows, n_keys, width = weights.shape[0], values.shape[0], values.shape[1]
    n_pairs = n_rows // 2 * 2
    n_eights = n_keys // 8 * 8
    for j in range(0, n_eights, 8):
        for r in range(0, n_pairs, 2):
            a = weights[r, j:j + 8]
            b = weights[r + 1, j:j + 8]
            for d in range(width):
                v0, v1, v2, v3 = values[j, d], values[j + 1, d], values[j + 2, d], values[j + 3, d]
                v4, v5, v6, v7 = (values[j + 4, d], values[j + 5, d], values[j + 6, d],
                                  values[j + 7, d])
                out[r, d] += (a[0] * v0 + a[1] * v1 + a[2] * v2 + a[3] * v3
                              + a[4] * v4 + a[5] * v5 + a[6] * v6 + a[7] * v7)
                out[r + 1, d] += (b[0] * v0 + b[1] * v1 + b[2] * v2 + b[3] * v3
                                  + b[4] * v4 + b[5] * v5 + b[6] * v6 + b[7] * v7)
        for r in range(n_pairs, n_rows):
            a = weights[r, j:j + 8]
            for d in range(width):
                out[r, d] += (a[0] * values[j, d] + a[1] * values[j + 1, d]
                              + a[2] * values[j + 2, d] + a[3] * values[j + 3, d]
                              + a[4] * values[j + 4, d] + a[5] * values[j + 5, d]
                              + a[6] * values[j + 6, d] + a[7] * values[j + 7, d])
    for j in range(n_eights, n_keys):
        for r in range(n_rows):
            weight = weights[r, j]
            for d in range(width):
                out[r, d] += weight * values[j, d]


@njit(fastmath=FASTMATH)
def qk_1x8(rows, keys, out):
    """One row times eight keys a pass: eight chains of adds for one row (a decode step's
    MHA rows), against the four of 1x4."""
    n_keys = keys.shape[0]
    n_eights = n_keys // 8 * 8
    zero = rows.dtype.type(0.0)
    for j in range(0, n_eights, 8):
        for r in range(rows.shape[0]):
            t0 = t1 = t2 = t3 = t4 = t5 = t6 = t7 = zero
            for d in range(rows.shape[1]):
                x = rows[r, d]
                t0 += x * keys[j, d]
                t1 += x * keys[j + 1, d]
                t2 += x * keys[j + 2, d]
                t3 += x * keys[j + 3, d]
                t4 += x * keys[j + 4, d]
                t5 += x * keys[j + 5, d]
                t6 += x * keys[j + 6, d]
                t7 += x * keys[j + 7, d]
            out[r, j], out[r, j + 1], out[r, j + 2], out[r, j + 3] = t0, t1, t2, t3
            out[r, j + 4], out[r, j + 5], out[r, j + 6], out[r, j + 7] = t4, t5, t6, t7
    _remaining_keys(rows, keys, out, n_eights)


@njit
def _blas_qk(rows, keys, out):
    np.dot(rows, keys.T, out)


@njit
def _blas_pv(weights, values, out):
    np.dot(weights, values, out)


@njit
def _repeat(product, a, b, out, times):
    for _ in range(times):
        product(a, b, out)


QK = {"1x4 (session 17)": qk_1x4, "2x4 (kernel)": _rows_times_keys, "4x2": qk_4x2,
      "4x4": qk_4x4, "1x8": qk_1x8, "np.dot": _blas_qk}
PV = {"1x4 (session 17)": pv_1x4, "1x8 (kernel)": _weights_times_values, "2x4": pv_2x4,
      "2x8": pv_2x8, "np.dot": _blas_pv}


def _operands(rng, table, n_rows, n_keys, depth):
    """As in the kernel: K and V read-only, the output a view of a flat buffer."""
    operand = rng.standard_normal((n_keys, depth), dtype=np.float32)
    operand.flags.writeable = False
    if table is QK:
        a = rng.standard_normal((n_rows, depth), dtype=np.float32)
        expected = a.astype(np.float64) @ operand.T.astype(np.float64)
    else:
        a = rng.random((n_rows, n_keys), dtype=np.float32)
        expected = a.astype(np.float64) @ operand.astype(np.float64)
    out = np.empty(expected.size, np.float32).reshape(expected.shape)
    return a, operand, out, expected


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[128])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 12, 16])
    parser.add_argument("--keys", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    with blas.single_threaded():
        for depth in args.dims:
            for name, table in (("S = Q K^T", QK), ("P V", PV)):
                print(f"\n{name}, D = {depth}, {args.keys} keys, GFLOP/s on one thread, "
                      "best / median of the variants' turns")
                print("| rows | " + " | ".join(table) + " |")
                print("|---" * (len(table) + 1) + "|")
                for n_rows in args.rows:
                    a, operand, out, expected = _operands(rng, table, n_rows, args.keys, depth)
                    flops = 2.0 * n_rows * args.keys * depth
                    times = max(1, int(5e7 // flops))
                    seconds = {product: [] for product in table.values()}
                    for product in table.values():
                        out[:] = np.nan
                        product(a, operand, out)
                        error = np.abs(out - expected).max() / np.abs(expected).max()
                        assert error < 1e-5, (product, error)
                    for _ in range(args.repeats):  # turns, so that noise hits all alike
                        for product, taken in seconds.items():
                            start = time.perf_counter()
                            _repeat(product, a, operand, out, times)
                            taken.append((time.perf_counter() - start) / times)
                    cells = [f"{flops / min(t) / 1e9:.0f} / {flops / np.median(t) / 1e9:.0f}"
                             for t in seconds.values()]
                    print(f"| {n_rows} | " + " | ".join(cells) + " |", flush=True)

if __name__ == "__main__":
    main()
