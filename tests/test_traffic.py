"""The memory-traffic model against hand counts."""

from __future__ import annotations

import pytest

from tileattn.traffic import memory_traffic


def test_unmasked_forward_counts_by_hand():
    n, d, e, block = 1024, 64, 2, 128
    t = memory_traffic(n_q=n, n_k=n, head_dim=d, itemsize=e, block_q=block, block_k=block)
    # Q once, K and V once per query tile (8 tiles), O once, lse in float32.
    assert t.tiled_forward == n * d * e + 8 * n * 2 * d * e + n * d * e + 4 * n
    assert t.naive_forward == 4 * n * d * e + 4 * n * n * e
    assert t.kept_scores == n * n


def test_causal_skips_tiles_above_the_diagonal():
    n, d = 1024, 64
    full = memory_traffic(n_q=n, n_k=n, head_dim=d, block_q=128, block_k=128)
    causal = memory_traffic(n_q=n, n_k=n, head_dim=d, block_q=128, block_k=128, causal=True)
    # Query tile t streams key tiles 0..t: 1 + 2 + ... + 8 = 36 of 64 tiles.
    streamed = lambda traffic: traffic.tiled_forward - 2 * n * d * 4 - 4 * n  # noqa: E731
    assert streamed(causal) * 64 == streamed(full) * 36
    assert causal.kept_scores == n * (n + 1) // 2


def test_tiled_beats_naive_and_scales_with_heads():
    one = memory_traffic(n_q=4096, n_k=4096, head_dim=128, itemsize=2, block_q=128,
                         block_k=64)
    many = memory_traffic(n_q=4096, n_k=4096, head_dim=128, itemsize=2, block_q=128,
                          block_k=64, heads=8, batch=2)
    assert one.forward_saving > 1 and one.backward_saving > 1
    assert many.tiled_backward == 16 * one.tiled_backward


@pytest.mark.parametrize("window", [(16, 0), (0, 16), (None, 3)])
def test_window_reduces_traffic(window):
    full = memory_traffic(n_q=512, n_k=512, head_dim=32, block_q=32, block_k=32)
    banded = memory_traffic(n_q=512, n_k=512, head_dim=32, block_q=32, block_k=32,
                            window=window)
    assert banded.tiled_forward < full.tiled_forward
    assert banded.tiled_backward < full.tiled_backward
