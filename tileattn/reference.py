"""The golden model: attention in plain NumPy float64, written to be read.

Two forms of the same function:

* `dense_forward` / `dense_backward` materialise the full score matrix ``S`` and the
  probabilities ``P``. They are the oracle every kernel is tested against, so they do each
  step of SPEC's list literally and nothing clever. The backward is derived by hand:

  ``O = P~ V`` with ``P~ = P * keep / (1 - dropout_p)``, so
  ``dV = P~^T dO``, ``dP~ = dO V^T``, ``dP = dP~ * keep / (1 - dropout_p)``;
  softmax gives ``dS = P * (dP - D)`` with ``D = rowsum(P * dP) = rowsum(dO * O)``,
  formed from the ``o`` the caller passes, as SPEC's backward says (and as
  FlashAttention-2, FlashAttention-3 and cuDNN do);
  softcap ``s = c tanh(r / c)`` gives ``dR = dS * (1 - tanh(r / c)^2)``; and
  ``r = scale * Q K^T`` gives ``dQ = scale dR K``, ``dK = scale dR^T Q``.
  ALiBi and masks are constants: no gradient flows through them.
  Every product over the score matrix (``P V``, ``P^T dO``, ``dS K``, ``dS^T Q``) sums the
  kept entries only (`_kept_product`): a masked entry contributes nothing, not ``0 x NaN``,
  so a non-finite input reaches exactly the rows and gradient entries that keep it.

* `tiled_forward` / `tiled_backward` are the FlashAttention-2 algorithm over
  ``block_q x block_k`` tiles (Dao 2023, Algorithms 1 and 2): a running row maximum and row
  sum with online rescaling, normalisation deferred to the end, ``lse`` saved, and a backward
  that recomputes each tile of ``P`` from ``lse`` instead of storing it. They are the
  executable documentation for the CPU and GPU kernels and are tested equal to the dense form.

Both work on the 4-D layout the backends receive (``q (B, Hq, Nq, D)``, ``k (B, Hkv, Nk, D)``,
``v (B, Hkv, Nk, Dv)``); `forward` / `backward` at the bottom make this module the
``backend="reference"`` backend.
"""

from __future__ import annotations

import numpy as np

from .dropout import keep_mask
from .options import AttentionOptions, keeps, tile_is_masked

MEMORY = "host"
VARLEN = True  # variable-length and paged calls run `reference_varlen`, sequence by sequence


def availability() -> str | None:
    return None


# --------------------------------------------------------------------------- shared pieces


def _repeat_kv(x: np.ndarray, n_q_heads: int) -> np.ndarray:
    """GQA/MQA: query head ``h`` reads kv head ``h // (Hq // Hkv)``."""
    return np.repeat(x, n_q_heads // x.shape[1], axis=1)


def _sum_kv_groups(dx: np.ndarray, n_kv_heads: int) -> np.ndarray:
    """Gradient of `_repeat_kv`: sum over the query heads sharing a kv head."""
    batch, n_q_heads = dx.shape[:2]
    return dx.reshape(batch, n_kv_heads, n_q_heads // n_kv_heads, *dx.shape[2:]).sum(axis=2)


def _raw_scores(q, k, rows, cols, options):
    """``scale * q . k`` for query `rows` and key `cols` of every (batch, head)."""
    return options.scale * (q[:, :, rows] @ np.swapaxes(k[:, :, cols], -1, -2))


def _kept(rows, cols, n_q, n_k, options):
    """Step 4's mask: which (row, col) pairs are kept, shape ``(len(rows), len(cols))``."""
    return keeps(rows[:, None], cols[None, :], options.band_offset(n_q, n_k),
                 options.window_left, options.window_right)


def _transform_scores(raw, rows, cols, n_q, n_k, options):
    """Steps 2-4 of SPEC: softcap, ALiBi, mask. Returns the scores and ``dS/dRaw``."""
    scores, softcap_grad = raw, None
    if options.softcap > 0:
        capped = np.tanh(raw / options.softcap)
        scores = options.softcap * capped
        softcap_grad = 1.0 - capped * capped
    row_index, col_index = rows[:, None], cols[None, :]
    if options.alibi_slopes is not None:
        distance = np.abs(row_index + options.band_offset(n_q, n_k) - col_index)
        scores = scores - options.alibi_slopes[:, :, None, None] * distance
    kept = _kept(rows, cols, n_q, n_k, options)
    # np.where, not an additive -inf bias: a NaN score at a masked position must vanish.
    scores = np.where(kept, scores, -np.inf)
    return scores, softcap_grad


def _kept_product(weights, kept, values):
    """``sum_j weights[..., i, j] * values[..., j, :]`` over the ``j`` that row ``i`` keeps.

    SPEC: a masked entry contributes nothing at all, not ``0 x NaN`` (``weights`` may hold
    anything there, NaN included), while the kept terms follow IEEE arithmetic (``0 x inf`` is
    NaN). One matrix product with the masked weights and the non-finite values set to 0 sums
    exactly the kept terms of every row whose kept terms are all finite (the other terms are
    exact zeros). The rows with a non-finite kept term, a non-finite weight or a kept key with
    a non-finite value, are summed again from their kept terms alone. `kept` broadcasts
    against `weights`; the transposed products (``P^T dO``) pass transposed weights and mask.
    """
    finite_values = np.isfinite(values)
    kept = np.broadcast_to(kept, weights.shape)
    non_finite_terms = kept & (~np.isfinite(weights)
                               | ~finite_values.all(axis=-1)[..., None, :])
    with np.errstate(invalid="ignore"):  # inf x 0 on the rows summed again below
        result = np.where(kept, weights, 0.0) @ np.where(finite_values, values, 0.0)
        for row in zip(*np.nonzero(non_finite_terms.any(axis=-1))):
            row_kept = kept[row]
            terms = weights[row][row_kept, None] * values[row[:-1]][row_kept]
            result[row] = terms.sum(axis=0)
    return result


def _dropout_scale(rows, cols, batch, n_q_heads, options, first_head: int = 0):
    """``keep / (1 - p)`` for the given rows and columns, or None without dropout; the
    dropout hash numbers the (batch, head) pairs from `first_head`."""
    if options.dropout_p == 0:
        return None
    bh = first_head + np.arange(batch * n_q_heads).reshape(batch, n_q_heads)[:, :, None, None]
    keep = keep_mask(options.seed, options.dropout_p, bh, options.row_offset + rows[:, None],
                     options.col_offset + cols[None, :])
    return keep / (1.0 - options.dropout_p)


def _safe_max(row_max):
    """A row whose every score is -inf keeps max -inf; subtract 0 there instead (no NaN)."""
    return np.where(row_max == -np.inf, 0.0, row_max)


def _normalise(values, row_max, row_sum):
    """``values / row_sum`` and ``lse = row_max + log(row_sum)``; a row with no kept key
    (row_sum exactly 0) gives 0 and -inf, and a NaN row (non-finite input) stays NaN."""
    empty = row_sum == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        normalised = np.where(empty, 0.0, values / row_sum)
        lse = np.where(empty, -np.inf, row_max + np.log(row_sum))[..., 0]
    return normalised, lse


def _as_float64(*arrays):
    return [np.asarray(a, dtype=np.float64) for a in arrays]


# --------------------------------------------------------------------------- dense form


def dense_probabilities(q, k, options: AttentionOptions):
    """``P`` (B, Hq, Nq, Nk) after softmax (before dropout), ``lse`` and ``dS/dRaw``."""
    q, k = _as_float64(q, k)
    n_q, n_k = q.shape[2], k.shape[2]
    rows, cols = np.arange(n_q), np.arange(n_k)
    k = _repeat_kv(k, q.shape[1])
    scores, softcap_grad = _transform_scores(_raw_scores(q, k, rows, cols, options),
                                             rows, cols, n_q, n_k, options)
    row_max = scores.max(axis=-1, initial=-np.inf, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):  # non-finite inputs give NaN rows
        exps = np.exp(scores - _safe_max(row_max))
        row_sum = exps.sum(axis=-1, keepdims=True)
        probs, lse = _normalise(exps, row_max, row_sum)
    return probs, lse, softcap_grad


def dense_forward(q, k, v, options: AttentionOptions, first_head: int = 0):
    """Golden forward. Returns ``o (B, Hq, Nq, Dv)`` and ``lse (B, Hq, Nq)``, float64.
    `first_head`: the dropout hash's index of the first (batch, head) pair (a sequence of a
    variable-length batch is numbered by its place in the batch)."""
    probs, lse, _ = dense_probabilities(q, k, options)
    (v,) = _as_float64(v)
    n_q, n_k = probs.shape[2:]
    rows, cols = np.arange(n_q), np.arange(n_k)
    dropout = _dropout_scale(rows, cols, *probs.shape[:2], options, first_head)
    if dropout is not None:
        probs = probs * dropout
    return _kept_product(probs, _kept(rows, cols, n_q, n_k, options),
                         _repeat_kv(v, q.shape[1])), lse


def dense_backward(do, q, k, v, o, options: AttentionOptions, first_head: int = 0, lse=None):
    """Golden backward: ``dq, dk, dv`` in float64, with ``D = rowsum(do * o)`` from the
    given `o` (SPEC). With the exact ``o`` of `dense_forward` this is the exact gradient;
    with an ``o`` rounded to a 16-bit type it is the gradient every FlashAttention-style
    backward computes from that ``o``, which is what the kernels are judged against.
    `first_head` as in `dense_forward`. `lse`, when given, normalises ``P`` in place of
    the softmax over these keys: a block of a longer sequence (see
    `AttentionOptions.row_offset`) holds only some of each row's keys."""
    do, q, k, v, o = _as_float64(do, q, k, v, o)
    n_kv_heads, n_q_heads = k.shape[1], q.shape[1]
    probs, _, softcap_grad = dense_probabilities(q, k, options)
    if lse is not None:
        probs = _probabilities_from_lse(q, k, np.asarray(lse, dtype=np.float64), options)
    n_q, n_k = probs.shape[2:]
    rows, cols = np.arange(n_q), np.arange(n_k)
    kept = _kept(rows, cols, n_q, n_k, options)
    dropout = _dropout_scale(rows, cols, *probs.shape[:2], options, first_head)
    dropped = probs if dropout is None else probs * dropout
    k_rep, v_rep = _repeat_kv(k, n_q_heads), _repeat_kv(v, n_q_heads)
    dv = _kept_product(np.swapaxes(dropped, -1, -2), kept.T, do)
    # dP and dS hold garbage (NaN from a non-finite v or do) where masked; every product
    # below reads only their kept entries.
    dp = do @ np.swapaxes(v_rep, -1, -2)
    if dropout is not None:
        dp = dp * dropout
    delta = np.sum(do * o, axis=-1, keepdims=True)
    ds = probs * (dp - delta)
    if softcap_grad is not None:
        ds = ds * softcap_grad
    dq = options.scale * _kept_product(ds, kept, k_rep)
    dk = options.scale * _kept_product(np.swapaxes(ds, -1, -2), kept.T, q)
    return dq, _sum_kv_groups(dk, n_kv_heads), _sum_kv_groups(dv, n_kv_heads)


def _probabilities_from_lse(q, k, lse, options):
    """``exp(s - lse)`` on kept pairs, 0 elsewhere and on rows whose lse is -inf."""
    n_q, n_k = q.shape[2], k.shape[2]
    rows, cols = np.arange(n_q), np.arange(n_k)
    scores, _ = _transform_scores(_raw_scores(q, _repeat_kv(k, q.shape[1]), rows, cols,
                                              options), rows, cols, n_q, n_k, options)
    safe_lse = np.where(lse == -np.inf, np.inf, lse)[..., None]
    with np.errstate(invalid="ignore"):
        return np.exp(scores - safe_lse)


# --------------------------------------------------------------------------- tiled form


def _tiles(n: int, block: int):
    return [(start, min(start + block, n)) for start in range(0, n, block)]


def tiled_forward(q, k, v, options: AttentionOptions, block_q: int, block_k: int):
    """FlashAttention-2 forward (Algorithm 1), vectorised over batch and heads.

    For each query tile the key tiles stream past once. The running ``row_max`` ``m`` and
    ``row_sum`` ``l`` let each new tile rescale what was accumulated so far by
    ``exp(m_old - m_new)``; the division by ``l`` happens once, after the last tile
    (FlashAttention-2 section 3.1.1). Tiles that the mask removes entirely are skipped.
    """
    q, k, v = _as_float64(q, k, v)
    batch, n_q_heads, n_q, _ = q.shape
    n_k, d_v = k.shape[2], v.shape[3]
    k, v = _repeat_kv(k, n_q_heads), _repeat_kv(v, n_q_heads)
    o = np.zeros((batch, n_q_heads, n_q, d_v))
    lse = np.full((batch, n_q_heads, n_q), -np.inf)
    for row_start, row_stop in _tiles(n_q, block_q):
        rows = np.arange(row_start, row_stop)
        row_max = np.full((batch, n_q_heads, len(rows), 1), -np.inf)
        row_sum = np.zeros_like(row_max)
        acc = np.zeros((batch, n_q_heads, len(rows), d_v))
        for col_start, col_stop in _tiles(n_k, block_k):
            if tile_is_masked(row_start, row_stop, col_start, col_stop,
                              options.band_offset(n_q, n_k), options.window_left,
                              options.window_right):
                continue
            cols = np.arange(col_start, col_stop)
            scores, _ = _transform_scores(_raw_scores(q, k, rows, cols, options),
                                          rows, cols, n_q, n_k, options)
            new_max = np.maximum(row_max, scores.max(axis=-1, keepdims=True))
            safe_max = _safe_max(new_max)
            rescale = np.exp(row_max - safe_max)
            probs = np.exp(scores - safe_max)
            row_sum = rescale * row_sum + probs.sum(axis=-1, keepdims=True)
            dropout = _dropout_scale(rows, cols, batch, n_q_heads, options)
            if dropout is not None:
                probs = probs * dropout
            kept = _kept(rows, cols, n_q, n_k, options)
            acc = rescale * acc + _kept_product(probs, kept, v[:, :, cols])
            row_max = new_max
        o[:, :, rows], lse[:, :, rows] = _normalise(acc, row_max, row_sum)
    return o, lse


def tiled_backward(do, q, k, v, o, lse, options: AttentionOptions, block_q: int, block_k: int):
    """FlashAttention-2 backward (Algorithm 2): recompute each tile of ``P`` from ``lse``.

    ``D = rowsum(dO * O)`` is computed once up front. The outer loop runs over key tiles,
    accumulating that tile's ``dK``, ``dV`` over every query tile; ``dQ`` gathers each
    tile's contribution. No ``Nq x Nk`` array is ever formed.
    """
    do, q, k, v, o, lse = _as_float64(do, q, k, v, o, lse)
    batch, n_q_heads, n_q, _ = q.shape
    n_kv_heads, n_k = k.shape[1], k.shape[2]
    k, v = _repeat_kv(k, n_q_heads), _repeat_kv(v, n_q_heads)
    delta = np.sum(do * o, axis=-1, keepdims=True)
    # lse = -inf marks a row with no kept key: its probabilities are all zero.
    safe_lse = np.where(lse == -np.inf, np.inf, lse)[..., None]
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for col_start, col_stop in _tiles(n_k, block_k):
        cols = np.arange(col_start, col_stop)
        for row_start, row_stop in _tiles(n_q, block_q):
            if tile_is_masked(row_start, row_stop, col_start, col_stop,
                              options.band_offset(n_q, n_k), options.window_left,
                              options.window_right):
                continue
            rows = np.arange(row_start, row_stop)
            scores, softcap_grad = _transform_scores(_raw_scores(q, k, rows, cols, options),
                                                     rows, cols, n_q, n_k, options)
            probs = np.exp(scores - safe_lse[:, :, rows])
            kept = _kept(rows, cols, n_q, n_k, options)
            dropout = _dropout_scale(rows, cols, batch, n_q_heads, options)
            dropped = probs if dropout is None else probs * dropout
            dv[:, :, cols] += _kept_product(np.swapaxes(dropped, -1, -2), kept.T,
                                            do[:, :, rows])
            dp = do[:, :, rows] @ np.swapaxes(v[:, :, cols], -1, -2)
            if dropout is not None:
                dp = dp * dropout
            ds = probs * (dp - delta[:, :, rows])
            if softcap_grad is not None:
                ds = ds * softcap_grad
            dq[:, :, rows] += options.scale * _kept_product(ds, kept, k[:, :, cols])
            dk[:, :, cols] += options.scale * _kept_product(np.swapaxes(ds, -1, -2), kept.T,
                                                            q[:, :, rows])
    return dq, _sum_kv_groups(dk, n_kv_heads), _sum_kv_groups(dv, n_kv_heads)


# --------------------------------------------------------------------------- backend


def lse_dtype(dtype) -> np.dtype:
    """SPEC: lse is float64 for float64 inputs, float32 otherwise."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


# Non-finite inputs are not an error (SPEC): NumPy's warnings about the NaN they make
# (inf - inf, 0 x inf) would only be noise.


def forward(q, k, v, options: AttentionOptions):
    if options.varlen is not None:
        from .reference_varlen import forward_sequences

        return forward_sequences(q, k, v, options)
    with np.errstate(invalid="ignore"):
        o, lse = dense_forward(q, k, v, options)
    return o.astype(q.dtype), lse.astype(lse_dtype(q.dtype))


def backward(do, q, k, v, o, lse, options: AttentionOptions):
    if options.varlen is not None:
        from .reference_varlen import backward_sequences

        return backward_sequences(do, q, k, v, o, options)
    with np.errstate(invalid="ignore"):
        # A whole problem's P is recomputed from its scores alone; a placed block's needs
        # the whole rows' lse.
        placed_lse = None if options.alignment is None else lse
        dq, dk, dv = dense_backward(do, q, k, v, o, options, lse=placed_lse)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
