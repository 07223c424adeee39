"""NumPy emulation of the float32 GPU softmax arithmetic, base-2 vs natural logit units, on
the data of tests/test_backend_suite.py's large-score test (q, k ~ N(0, 50^2), D = 4,
scale 1, seeds 0-19). No GPU needed.

    python3 bench/experiments/emulate_float32_logit_units.py

Every float32 operation of the kernels' softmax is rounded as the kernels round it; the
score q.k is taken as float32(exact dot), a model of 3xTF32 (it is within ~2^-20 of it), so
that only the logit units differ between the two columns. ex2.approx is modelled as a
correctly rounded exp2 (its ~2 ulp are far below the effect measured). Both the P error
(against float64 exp(s - lse)) and dv = P^T dO (as the test measures it, in multiples of
the float32 tolerance) are printed for:

* base 2 (before): logit2 = s * fl(scale log2 e), forward max and sum in base 2,
  lse = fl(max2 * ln 2 + log(sum)) (one fma), backward P = exp2(logit2 - fl(lse log2 e));
* natural (now): logit = s * scale, lse = fl(max + fl(log(sum))),
  P = exp2(fl(fl(logit - lse) * log2 e));
* naive float32 NumPy (the test's yardstick, _float32_backward_from_lse).
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from test_backend_suite import _float32_backward_from_lse, _golden_gradients

from tileattn.testing import attention_error

f32 = np.float32
LOG2E, LN2 = f32(1.4426950408889634), f32(0.6931471805599453)
BLOCK_K = 32  # key tile of the 3xTF32 forward (online softmax over tiles)


def exp2(x):
    return np.exp2(x.astype(np.float64)).astype(f32)


def forward_lse(logits, natural: bool):
    """Online softmax over BLOCK_K-key tiles in float32; lse as the kernel stores it."""
    rows = logits.shape[:-1]
    row_max = np.full(rows, -np.inf, f32)
    row_sum = np.zeros(rows, f32)
    for start in range(0, logits.shape[-1], BLOCK_K):
        tile = logits[..., start:start + BLOCK_K]
        new_max = np.maximum(row_max, tile.max(axis=-1))
        if natural:
            rescale = exp2(((row_max - new_max).astype(f32) * LOG2E).astype(f32))
            p = exp2(((tile - new_max[..., None]).astype(f32) * LOG2E).astype(f32))
        else:
            rescale = exp2((row_max - new_max).astype(f32))
            p = exp2((tile - new_max[..., None]).astype(f32))
        row_sum = (row_sum * rescale + p.sum(axis=-1, dtype=f32)).astype(f32)
        row_max = new_max
    log_sum = np.log(row_sum.astype(np.float64))
    if natural:
        return (row_max + log_sum.astype(f32)).astype(f32)
    return (row_max.astype(np.float64) * np.float64(LN2) + log_sum).astype(f32)  # fma


def split_tf32(x):
    """tf32.cuh's split_tf32: big = the top 10 mantissa bits, small = the same of the rest."""
    mask = np.uint32(0xFFFFE000)
    big = (x.view(np.uint32) & mask).view(f32)
    small = ((x - big).astype(f32).view(np.uint32) & mask).view(f32)
    return big, small


def products_3xtf32(a, b, transposed=False):
    """a @ b^T as mma_16x8x8_3xtf32 takes it (one k8 step, D <= 8): small x big, big x
    small (swapped when `transposed`), big x big, each mma's sum of exact products added
    once into float32 (a model: the tensor cores' internal sum is not specified)."""
    (a_big, a_small), (b_big, b_small) = split_tf32(a), split_tf32(b)
    c = np.zeros(a.shape[:-1] + b.shape[-2:-1], f32)
    cross = [(a_small, b_big), (a_big, b_small)]
    for x, y in (cross[::-1] if transposed else cross) + [(a_big, b_big)]:
        c = (c + x.astype(np.float64) @ np.swapaxes(y, -1, -2).astype(np.float64)).astype(f32)
    return c


def probabilities(forward_scores, backward_scores, natural: bool):
    """P as the float32 backward recomputes it from the forward's lse."""
    if natural:
        lse = forward_lse(forward_scores, True)
        return exp2(((backward_scores - lse[..., None]).astype(f32) * LOG2E).astype(f32))
    lse = forward_lse((forward_scores * LOG2E).astype(f32), False)
    logits2 = (backward_scores * LOG2E).astype(f32)
    return exp2((logits2 - (lse * LOG2E).astype(f32)[..., None]).astype(f32))


def naive_lse(scores):
    """lse in the array's own precision, max first (the naive float32 formulation)."""
    row_max = scores.max(axis=-1)
    return row_max + np.log(np.exp(scores - row_max[..., None]).sum(axis=-1))


def main() -> None:
    names = ["base 2, S = fl(q.k)", "natural, S = fl(q.k)",
             "base 2, 3xTF32, S^T unmatched", "natural, 3xTF32, S^T unmatched",
             "base 2, 3xTF32, S^T matched", "natural, 3xTF32, S^T matched", "naive float32"]
    worst = {name: [0.0, 0.0] for name in names}
    for seed in range(20):
        rng = np.random.default_rng(seed)
        q = (50 * rng.standard_normal((2, 64, 4))).astype(f32)
        k = (50 * rng.standard_normal((2, 80, 4))).astype(f32)
        v, do = (rng.standard_normal(shape).astype(f32) for shape in ((2, 80, 4), (2, 64, 4)))
        exact = q.astype(np.float64) @ np.swapaxes(k, -1, -2).astype(np.float64)
        golden_lse = naive_lse(exact)
        golden_p = np.exp(exact - golden_lse[..., None])
        lse_magnitude = float(np.abs(golden_lse).max())
        golden_o = golden_p @ v.astype(np.float64)
        golden_dv = _golden_gradients(do, q, k, v, golden_o.astype(f32), scale=1.0)[2]
        scores = exact.astype(f32)
        naive_o, _ = _float32_backward_from_lse(q, k, v, do, f32(1.0))
        naive_golden_dv = _golden_gradients(do, q, k, v, naive_o, scale=1.0)[2]
        naive_scores = q @ np.swapaxes(k, -1, -2)
        naive_p = np.exp(naive_scores - naive_lse(naive_scores)[..., None])
        # The forward and the dQ kernel take S = Q K^T (Q the A operand), the dK/dV kernel,
        # which gives dv, S^T = K Q^T (K the A operand): its cross products went in the
        # other order (unmatched, before) and now go in the swapped one (matched).
        forward_s = products_3xtf32(q, k)
        unmatched = np.swapaxes(products_3xtf32(k, q), -1, -2)
        matched = np.swapaxes(products_3xtf32(k, q, transposed=True), -1, -2)
        assert np.array_equal(matched, forward_s)
        cases = dict(zip(names, [
            (probabilities(scores, scores, False), golden_dv),
            (probabilities(scores, scores, True), golden_dv),
            (probabilities(forward_s, unmatched, False), golden_dv),
            (probabilities(forward_s, unmatched, True), golden_dv),
            (probabilities(forward_s, matched, False), golden_dv),
            (probabilities(forward_s, matched, True), golden_dv),
            (naive_p, naive_golden_dv)]))
        for name, (p, reference_dv) in cases.items():
            dv = (np.swapaxes(p, -1, -2) @ do).astype(f32)
            worst[name][0] = max(worst[name][0], float(np.abs(p - golden_p).max()))
            worst[name][1] = max(worst[name][1], attention_error(
                dv, reference_dv, f32, lse_magnitude=lse_magnitude))
    print(f"{'formula':<34} {'max |P - P_exact|':>18} {'dv error / tolerance':>21}")
    for name, (p_error, dv_error) in worst.items():
        print(f"{name:<34} {p_error:>18.2e} {dv_error:>21.2f}")


if __name__ == "__main__":
    main()
