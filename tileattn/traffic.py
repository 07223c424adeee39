"""The memory-traffic model: bytes moved through main memory (DRAM/HBM), naive vs tiled.

This is the FlashAttention articles' accounting (FlashAttention, section 3.2 and Theorem 2)
made concrete for tileattn's loop orders and a given pair of block sizes:

* **Naive** attention writes the ``Nq x Nk`` score matrix ``S`` to memory, reads it back for
  the softmax, writes ``P``, and reads ``P`` again for ``P V``: ``Theta(N d + N^2)`` per head.
  Its backward reads ``P`` twice and writes and reads ``dP`` and ``dS``.
* **Tiled** forward (FlashAttention-2 order: query tiles outside, key tiles inside) reads
  ``Q`` once, streams ``K`` and ``V`` once per query tile over the key tiles the mask keeps,
  and writes ``O`` and ``lse`` once: ``Theta(N^2 d / block_q)``, no ``N^2`` term.
* **Tiled** backward as tileattn runs it deterministically: a pass for
  ``D = rowsum(dO * O)``; a key-tile-outer pass that reads ``K, V`` once and streams
  ``Q, dO, lse, D`` per key tile, writing ``dK, dV``; and a query-tile-outer pass that reads
  ``Q, dO, lse, D`` once and streams ``K, V`` per query tile, writing ``dQ``.

Caches are ignored (every stream counts once per pass over it), so the model is an upper
bound on what a cache-friendly run moves; GQA counts K/V once per query head for the same
reason. Masked tiles are skipped exactly as the kernels skip them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .options import UNLIMITED

LSE_BYTES = 4


@dataclass(frozen=True)
class Traffic:
    """Bytes moved through main memory by each pass (all heads together)."""

    naive_forward: int
    naive_backward: int
    tiled_forward: int
    tiled_backward: int
    kept_scores: int  # (row, key) pairs the mask keeps, all heads: the useful work

    @property
    def forward_saving(self) -> float:
        return self.naive_forward / self.tiled_forward if self.tiled_forward else 1.0

    @property
    def backward_saving(self) -> float:
        return self.naive_backward / self.tiled_backward if self.tiled_backward else 1.0


def _visited_key_columns(n_q, n_k, block_q, block_k, window_left, window_right):
    """Key columns streamed per query tile (whole key tiles, masked tiles skipped), summed
    over query tiles; and the number of (row, key) pairs the mask keeps. Vectorised over
    rows and tiles, so a long sequence costs milliseconds, not a Python loop per row."""
    offset = n_k - n_q

    def key_range(row_first, row_last):
        first = (np.zeros_like(row_first) if window_left == UNLIMITED
                 else np.maximum(0, row_first + offset - window_left))
        last = (np.full_like(row_last, n_k - 1) if window_right == UNLIMITED
                else np.minimum(n_k - 1, row_last + offset + window_right))
        return first, last

    starts = np.arange(0, n_q, block_q, dtype=np.int64)
    first, last = key_range(starts, np.minimum(starts + block_q, n_q) - 1)
    first_tile, last_tile = first // block_k, last // block_k
    streamed = np.where(last >= first,
                        np.minimum(n_k, (last_tile + 1) * block_k) - first_tile * block_k, 0)
    rows = np.arange(n_q, dtype=np.int64)
    first, last = key_range(rows, rows)
    kept = np.maximum(0, last - first + 1)
    return int(streamed.sum()), int(kept.sum())


def memory_traffic(*, n_q: int, n_k: int, head_dim: int, value_dim: int | None = None,
                   heads: int = 1, batch: int = 1, itemsize: int = 4, block_q: int = 128,
                   block_k: int = 128, causal: bool = False, window=None) -> Traffic:
    """Modelled main-memory bytes of naive and tiled attention, forward and backward.

    Parameters
    ----------
    n_q, n_k : sequence lengths;  head_dim, value_dim : D and Dv (Dv defaults to D)
    heads, batch : query heads and batch size (traffic scales with their product)
    itemsize : bytes per element of q, k, v, o and the naive S and P matrices
    block_q, block_k : the tile sizes of the tiled passes
    causal, window : masks as in `tileattn.forward` (bottom-right aligned)

    Returns
    -------
    Traffic
        Bytes per pass; ``forward_saving`` and ``backward_saving`` are naive / tiled.
    """
    d, d_v = head_dim, value_dim if value_dim is not None else head_dim
    left, right = UNLIMITED, UNLIMITED
    if window is not None:
        left = UNLIMITED if window[0] is None or window[0] < 0 else window[0]
        right = UNLIMITED if window[1] is None or window[1] < 0 else window[1]
    if causal:
        right = 0
    heads_total = heads * batch
    e = itemsize
    streamed_fwd, kept = _visited_key_columns(n_q, n_k, block_q, block_k, left, right)
    streamed_kv_outer, _ = _visited_key_columns(n_k, n_q, block_k, block_q,
                                                *_transpose_window(left, right))
    q_bytes, k_bytes, v_bytes = n_q * d * e, n_k * d * e, n_k * d_v * e
    o_bytes, lse_bytes, square = n_q * d_v * e, n_q * LSE_BYTES, n_q * n_k * e

    naive_forward = q_bytes + k_bytes + v_bytes + o_bytes + 4 * square  # S w/r, P w/r
    # read P twice (dV, dS) + dP w/r + dS w/r twice (dQ, dK) + Q, K, V, dO in, dQ, dK, dV out
    naive_backward = (7 * square + 2 * (q_bytes + k_bytes + v_bytes) + 2 * o_bytes)
    tiled_forward = q_bytes + streamed_fwd * (d + d_v) * e + o_bytes + lse_bytes
    row_stats = 2 * LSE_BYTES  # lse and D per query row
    preprocess = 2 * o_bytes + n_q * LSE_BYTES
    kv_outer = (k_bytes + v_bytes + streamed_kv_outer * ((d + d_v) * e + row_stats)
                + k_bytes + v_bytes)
    q_outer = (q_bytes + o_bytes + n_q * row_stats + streamed_fwd * (d + d_v) * e + q_bytes)
    tiled_backward = preprocess + kv_outer + q_outer
    return Traffic(naive_forward=naive_forward * heads_total,
                   naive_backward=naive_backward * heads_total,
                   tiled_forward=tiled_forward * heads_total,
                   tiled_backward=tiled_backward * heads_total,
                   kept_scores=kept * heads_total)


def _transpose_window(left: int, right: int):
    """Seen from the keys, the band's sides swap: key j is kept by rows j - right .. j + left."""
    return right, left
