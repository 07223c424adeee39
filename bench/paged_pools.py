"""Paged K/V for the GPU benchmarks: a dense (B, Hkv, N, D) cache laid out in a shuffled pool
of pages, as a server's block manager leaves it."""

from __future__ import annotations

import numpy as np


def page_pool(dense, lengths, page_size: int, rng: np.random.Generator):
    """Keys (B, Hkv, N, D), 16-bit, on the GPU -> a shuffled pool (num_pages, Hkv, page_size,
    D) holding each sequence's first ceil(lengths[b] / page_size) pages, and its block table
    (B, max_pages) int32 (entries past a sequence's pages are 0: never read). N must be a
    multiple of page_size. Copies run on the 16-bit storage (CuPy has no bfloat16 kernels)."""
    import cupy

    batch, n_kv_heads, _, head_dim = dense.shape
    pages_of = [-(-int(n) // page_size) for n in lengths]
    order = rng.permutation(sum(pages_of))
    table = np.zeros((batch, max(pages_of)), dtype=np.int32)
    pool = cupy.empty((len(order), n_kv_heads, page_size, head_dim), dtype=cupy.uint16)
    bits = dense.view(cupy.uint16)
    first = 0
    for b, pages in enumerate(pages_of):
        ids = order[first:first + pages]
        first += pages
        table[b, :pages] = ids
        chunk = bits[b, :, :pages * page_size].reshape(
            n_kv_heads, pages, page_size, head_dim).transpose(1, 0, 2, 3)
        pool[cupy.asarray(ids)] = chunk
    return pool.view(dense.dtype), cupy.asarray(table)
