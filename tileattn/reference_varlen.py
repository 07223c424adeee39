"""The golden model for variable-length batches and paged K/V, sequence by sequence.

SPEC "Variable-length batches and paged K/V" names three families; each function here
validates its inputs, then loops over the sequences and runs the dense golden model
(`tileattn.reference`) on each sequence alone, in float64, so that masks, the bottom-right
alignment and ALiBi see that sequence's own lengths in place of ``Nq`` and ``Nk``:

* padded batches, `forward_padded` / `backward_padded`: batch element ``b`` is query rows
  ``i < seqlens_q[b]`` against keys ``j < seqlens_k[b]`` of the padded arrays;
* packed sequences, `forward_packed` / `backward_packed`: ``q`` is ``(Hq, Nq_total, D)`` and
  sequence ``s`` is rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` against keys
  ``cu_seqlens_k[s]:cu_seqlens_k[s+1]``;
* paged K/V, `forward_paged` (forward only, as SPEC says): logical key ``j`` of batch
  element ``b`` is ``k[block_table[b, j // page_size], :, j % page_size]``; the keys are
  gathered by that formula, then it is a padded batch.

Rows outside every sequence (padding) give ``o = 0``, ``lse = -inf`` and ``dq = 0``; keys
outside every sequence get ``dk = dv = 0``. Nothing outside a sequence, nor a page that the
table does not name, is ever read into a computation, so a NaN there reaches no output.

Options are the keyword options of `tileattn.forward`: ``causal``, ``window``, ``scale``,
``softcap``, ``alibi_slopes``, ``dropout_p`` and ``seed``, with its defaults and checks.
Results have the dtype of ``q`` (``lse`` float32, or float64 for float64 inputs), like
``backend="reference"``: pass float64 inputs for float64 results. Inputs are NumPy arrays.

Decisions where SPEC is silent:

* ALiBi slopes of packed sequences are ``(Hq,)`` (every sequence) or ``(S, Hq)`` (one row per
  sequence), as flash-attn's ``flash_attn_varlen_func`` takes ``(nheads,)`` or
  ``(batch, nheads)``. Padded and paged batches take ``(Hq,)`` or ``(*batch, Hq)`` as dense.
* Dropout counters (`tileattn.dropout`) are ``bh = sequence * Hq + h`` with ``i`` and ``j``
  the positions *within* the sequence, for all three families. For padded batches that is
  SPEC's "positions as passed" (each sequence starts at row and key 0 of its batch element);
  for packed sequences it is flash-attn's varlen convention (positions per sequence, the
  sequence index as batch), so a sequence drops the same entries wherever it sits in the
  pack and packed equals padded bit for bit; for paged K/V ``j`` is the logical key, so
  moving pages around never changes what is dropped.
* Block-table entries after the ``ceil(seqlens_k[b] / page_size)`` that a batch element
  reads are never read and may hold anything (padding such as -1), as in flash-attn and
  vLLM; the ones read must be page ids in ``[0, num_pages)``. Pages may be shared.
* Paged K/V also takes ``seqlens_q`` (optional), as a padded batch of queries.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from . import arrays
from .options import (BATCH, INDEX, KEY_BASE, KEYS, ROW_BASE, ROWS, AttentionOptions)
# Each sequence runs the dense model itself, so a masked entry contributes nothing here
# exactly as it does there (SPEC "Errors").
from .reference import dense_backward, dense_forward, lse_dtype
# Slopes are normalised and checked as dense attention's are; only the shapes differ.
from .validation import _normalise_alibi, validate
from .varlen_validation import (check_block_table, check_cu_seqlens_pair, check_page_pools,
                                check_seqlens)

_OPTION_DEFAULTS = {"causal": False, "window": None, "scale": None, "softcap": None,
                    "alibi_slopes": None, "dropout_p": 0.0, "seed": None}


def _option_keywords(options: dict) -> dict:
    """The caller's options with `tileattn.forward`'s defaults, as `validate` takes them."""
    unknown = sorted(set(options) - set(_OPTION_DEFAULTS))
    if unknown:
        raise TypeError(f"unexpected keyword arguments {unknown}; the options are "
                        f"{sorted(_OPTION_DEFAULTS)}")
    # The golden model has no tiles and no scheduling: these are fixed.
    return {**_OPTION_DEFAULTS, **options, "block_q": None, "block_k": None,
            "deterministic": True}


# --------------------------------------------------------------------------- one sequence


def _for_sequence(options: AttentionOptions, sequence: int) -> AttentionOptions:
    """The options of one sequence: its row of the ``(S, Hq)`` ALiBi slopes."""
    if options.varlen is not None:
        options = replace(options, varlen=None)
    if options.alibi_slopes is None:
        return options
    return replace(options, alibi_slopes=options.alibi_slopes[sequence:sequence + 1])


# Non-finite inputs are not an error (SPEC): NumPy's warnings about the NaN they make
# (inf - inf, 0 x inf) would only be noise, as in `tileattn.reference.forward`.
@np.errstate(invalid="ignore")
def _sequence_forward(q, k, v, options: AttentionOptions, sequence: int):
    """`tileattn.reference.dense_forward` on one sequence ``q (1, Hq, Lq, D)``,
    ``k (1, Hkv, Lk, D)``, ``v (1, Hkv, Lk, Dv)``, its dropout heads numbered
    ``sequence * Hq + h`` (module docstring); float64 ``o``, ``lse``."""
    return dense_forward(q, k, v, options, first_head=sequence * q.shape[1])


@np.errstate(invalid="ignore")
def _sequence_backward(do, q, k, v, o, options: AttentionOptions, sequence: int):
    """`tileattn.reference.dense_backward` on one sequence, heads numbered as in
    `_sequence_forward`; float64 ``dq (1, Hq, Lq, D)``, ``dk (1, Hkv, Lk, D)``, ``dv``."""
    return dense_backward(do, q, k, v, o, options, first_head=sequence * q.shape[1])


# --------------------------------------------------------------------------- padded batches


def _padded_lengths(problem, seqlens_q, seqlens_k):
    batch_shape = problem.layout.batch_shape
    return (check_seqlens("seqlens_q", seqlens_q, batch_shape, problem.n_q, "Nq"),
            check_seqlens("seqlens_k", seqlens_k, batch_shape, problem.n_k, "Nk"))


def forward_padded(q, k, v, seqlens_q=None, seqlens_k=None, **options):
    """Golden forward of a padded batch.

    Parameters
    ----------
    q : array, shape (*batch, Hq, Nq, D) or (Nq, D)
    k : array, shape (*batch, Hkv, Nk, D) or (Nk, D)
    v : array, shape (*batch, Hkv, Nk, Dv) or (Nk, Dv)
    seqlens_q : integer array of shape `*batch`, optional
        Batch element ``b`` uses query rows ``i < seqlens_q[b]``; ``0 <= seqlens_q[b] <= Nq``.
        None: every row.
    seqlens_k : integer array of shape `*batch`, optional
        Batch element ``b`` uses keys ``j < seqlens_k[b]``; ``0 <= seqlens_k[b] <= Nk``.
        None: every key.
    **options
        causal, window, scale, softcap, alibi_slopes ``(Hq,)`` or ``(*batch, Hq)``,
        dropout_p, seed: as `tileattn.forward`, with ``seqlens_q[b]`` and ``seqlens_k[b]``
        in place of ``Nq`` and ``Nk`` (row ``i`` keeps ``j <= i + seqlens_k[b] -
        seqlens_q[b]`` under causal).

    Returns
    -------
    o : array, shape (*batch, Hq, Nq, Dv), dtype of q; 0 on padding rows
    lse : array, shape (*batch, Hq, Nq); -inf on padding rows
    """
    problem = validate(q, k, v, **_option_keywords(options))
    lengths_q, lengths_k = _padded_lengths(problem, seqlens_q, seqlens_k)
    q4, k4, v4 = (problem.tensors[name] for name in ("q", "k", "v"))
    batch = q4.shape[0]
    o = np.zeros((batch, problem.n_q_heads, problem.n_q, problem.value_dim))
    lse = np.full((batch, problem.n_q_heads, problem.n_q), -np.inf)
    # With no query heads there is nothing to compute (and no kv head to repeat).
    for b in range(batch if problem.n_q_heads else 0):
        rows, keys = slice(0, lengths_q[b]), slice(0, lengths_k[b])
        o[b:b + 1, :, rows], lse[b:b + 1, :, rows] = _sequence_forward(
            q4[b:b + 1, :, rows], k4[b:b + 1, :, keys], v4[b:b + 1, :, keys],
            _for_sequence(problem.options, b), b)
    return _restore_forward(problem, o, lse)


def backward_padded(do, q, k, v, o, lse, seqlens_q=None, seqlens_k=None, **options):
    """Golden backward of a padded batch: the vector-Jacobian product of `forward_padded`.

    Parameters
    ----------
    do, o : array, shape (*batch, Hq, Nq, Dv) or (Nq, Dv)
    q, k, v, seqlens_q, seqlens_k, **options
        As `forward_padded`, with the same options.
    lse : array, shape (*batch, Hq, Nq) or (Nq,)
        As `forward_padded` returned it; checked for shape and dtype only (the golden model
        recomputes the probabilities).

    Returns
    -------
    dq : array, shape of q, dtype of q; 0 on padding rows
    dk, dv : arrays, shapes and dtypes of k and v; 0 on padding keys
    """
    problem = validate(q, k, v, do=do, o=o, lse=lse, **_option_keywords(options))
    lengths_q, lengths_k = _padded_lengths(problem, seqlens_q, seqlens_k)
    do4, q4, k4, v4, o4 = (problem.tensors[name] for name in ("do", "q", "k", "v", "o"))
    dq, dk, dv = (np.zeros(a.shape) for a in (q4, k4, v4))
    for b in range(q4.shape[0] if problem.n_q_heads else 0):
        rows, keys = slice(0, lengths_q[b]), slice(0, lengths_k[b])
        dq[b:b + 1, :, rows], dk[b:b + 1, :, keys], dv[b:b + 1, :, keys] = _sequence_backward(
            do4[b:b + 1, :, rows], q4[b:b + 1, :, rows], k4[b:b + 1, :, keys],
            v4[b:b + 1, :, keys], o4[b:b + 1, :, rows], _for_sequence(problem.options, b), b)
    return _restore_backward(problem, dq, dk, dv)


def _restore_forward(problem, o, lse):
    """Back to the caller's shapes, in q's dtype (lse: float32, or float64)."""
    layout = problem.layout
    return (layout.restore(o.astype(problem.dtype), problem.n_q_heads),
            layout.restore(lse.astype(lse_dtype(problem.dtype)), problem.n_q_heads,
                           is_lse=True))


def _restore_backward(problem, dq, dk, dv):
    layout = problem.layout
    return (layout.restore(dq.astype(problem.dtype), problem.n_q_heads),
            layout.restore(dk.astype(problem.dtype), problem.n_kv_heads),
            layout.restore(dv.astype(problem.dtype), problem.n_kv_heads))


# --------------------------------------------------------------------------- packed sequences


def _validate_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, options, **outputs):
    """`validate` for packed ``(H, N_total, D)`` arrays, the cumulative lengths, and ALiBi
    slopes of shape ``(Hq,)`` or ``(S, Hq)``. Returns the problem, ``cu_q`` and ``cu_k``."""
    for name, array in (("q", q), ("k", k), ("v", v)):
        if np.ndim(array) != 3:
            raise ValueError(f"{name} must have shape (H, N_total, D) with cu_seqlens "
                             f"(packed sequences, no batch axes), got shape "
                             f"{np.shape(array)}")
    keywords = _option_keywords(options)
    slopes = keywords.pop("alibi_slopes")
    problem = validate(q, k, v, alibi_slopes=None, **outputs, **keywords)
    cu_q, cu_k = check_cu_seqlens_pair(cu_seqlens_q, cu_seqlens_k, problem.n_q, problem.n_k)
    if slopes is not None:
        n_sequences, n_q_heads = len(cu_q) - 1, problem.n_q_heads
        shape = np.shape(arrays.to_host(arrays.to_native(slopes)))
        if shape not in ((n_q_heads,), (n_sequences, n_q_heads)):
            raise ValueError(f"alibi_slopes of packed sequences must have shape (Hq,) = "
                             f"({n_q_heads},) or (S, Hq) = ({n_sequences}, {n_q_heads}), "
                             f"got {shape}")
        problem.options = replace(problem.options, alibi_slopes=_normalise_alibi(
            slopes, (n_sequences,), n_q_heads, problem.dtype))
    return problem, cu_q, cu_k


def forward_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, **options):
    """Golden forward of packed sequences.

    Parameters
    ----------
    q : array, shape (Hq, Nq_total, D)
    k : array, shape (Hkv, Nk_total, D)
    v : array, shape (Hkv, Nk_total, Dv)
    cu_seqlens_q : integer array, shape (S + 1,)
        Sequence ``s`` is query rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``; starts at 0,
        non-decreasing, ends at ``Nq_total``. Empty sequences are allowed.
    cu_seqlens_k : integer array, shape (S + 1,)
        Sequence ``s`` is keys ``cu_seqlens_k[s]:cu_seqlens_k[s+1]``; ends at ``Nk_total``.
    **options
        As `tileattn.forward`, per sequence: masks, alignment and ALiBi use positions and
        lengths within the sequence; no attention crosses sequences. ``alibi_slopes`` is
        ``(Hq,)`` or ``(S, Hq)``.

    Returns
    -------
    o : array, shape (Hq, Nq_total, Dv), dtype of q
    lse : array, shape (Hq, Nq_total)
    """
    problem, cu_q, cu_k = _validate_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, options)
    q4, k4, v4 = (problem.tensors[name] for name in ("q", "k", "v"))
    o = np.zeros((1, problem.n_q_heads, problem.n_q, problem.value_dim))
    lse = np.full((1, problem.n_q_heads, problem.n_q), -np.inf)
    for s in range(len(cu_q) - 1 if problem.n_q_heads else 0):
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        o[:, :, rows], lse[:, :, rows] = _sequence_forward(
            q4[:, :, rows], k4[:, :, keys], v4[:, :, keys], _for_sequence(problem.options, s),
            s)
    return _restore_forward(problem, o, lse)


def backward_packed(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, **options):
    """Golden backward of packed sequences: the vector-Jacobian product of `forward_packed`.

    Parameters
    ----------
    do, o : array, shape (Hq, Nq_total, Dv)
    lse : array, shape (Hq, Nq_total)
    q, k, v, cu_seqlens_q, cu_seqlens_k, **options
        As `forward_packed`, with the same options.

    Returns
    -------
    dq, dk, dv : arrays with the shapes and dtypes of q, k, v
    """
    problem, cu_q, cu_k = _validate_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, options,
                                           do=do, o=o, lse=lse)
    do4, q4, k4, v4, o4 = (problem.tensors[name] for name in ("do", "q", "k", "v", "o"))
    dq, dk, dv = (np.zeros(a.shape) for a in (q4, k4, v4))
    for s in range(len(cu_q) - 1 if problem.n_q_heads else 0):
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        dq[:, :, rows], dk[:, :, keys], dv[:, :, keys] = _sequence_backward(
            do4[:, :, rows], q4[:, :, rows], k4[:, :, keys], v4[:, :, keys], o4[:, :, rows],
            _for_sequence(problem.options, s), s)
    return _restore_backward(problem, dq, dk, dv)


# --------------------------------------------------------------------------- paged K/V


def _gather_pages(pages, table: np.ndarray, lengths: np.ndarray, n_keys: int) -> np.ndarray:
    """Logical keys of every batch element, by SPEC's formula, as a padded array.

    Parameters
    ----------
    pages : array, shape (num_pages, Hkv, page_size, D)
    table : int64 array, shape (B, max_pages), checked by `check_block_table`
    lengths : int64 array, shape (B,)
    n_keys : int
        The padded key axis' length, at least ``max(lengths)``.

    Returns
    -------
    numpy.ndarray, shape (B, Hkv, n_keys, D), dtype of `pages`
        Keys ``j < lengths[b]`` of element ``b``; zeros after them. Only those keys are read.
    """
    num_pages, n_kv_heads, page_size, dim = pages.shape
    gathered = np.zeros((len(lengths), n_kv_heads, n_keys, dim), dtype=pages.dtype)
    for b, length in enumerate(lengths):
        keys = np.arange(length)
        # Two index arrays around a slice put the indexed axis first: (length, Hkv, D).
        gathered[b, :, :length] = np.swapaxes(
            pages[table[b, keys // page_size], :, keys % page_size], 0, 1)
    return gathered


def forward_paged(q, k_pages, v_pages, block_table, seqlens_k, *, seqlens_q=None, **options):
    """Golden forward with paged K/V: gather each batch element's keys, then `forward_padded`.

    Parameters
    ----------
    q : array, shape (*batch, Hq, Nq, D)
    k_pages : array, shape (num_pages, Hkv, page_size, D)
        The key page pool, any strides: a ``(num_pages, page_size, Hkv, D)`` buffer passes
        as ``buffer.transpose(0, 2, 1, 3)``.
    v_pages : array, shape (num_pages, Hkv, page_size, Dv)
    block_table : integer array, shape (*batch, max_pages)
        Logical key ``j`` of batch element ``b`` is
        ``k_pages[block_table[b, j // page_size], :, j % page_size]``. The first
        ``ceil(seqlens_k[b] / page_size)`` entries of row ``b`` must be page ids in
        ``[0, num_pages)``; the others are never read. Pages may be shared.
    seqlens_k : integer array of shape `*batch` (required)
        Keys per batch element, at most ``max_pages * page_size``. Nothing past them, and
        no page the table does not name, is read.
    seqlens_q : integer array of shape `*batch`, optional
        As `forward_padded`.
    **options
        As `forward_padded`; dropout uses logical key positions.

    Returns
    -------
    o : array, shape (*batch, Hq, Nq, Dv), dtype of q
    lse : array, shape (*batch, Hq, Nq)
    """
    q_shape = np.shape(q)
    if len(q_shape) < 3:
        raise ValueError(f"q must have shape (*batch, Hq, Nq, D) with block_table (paged K/V), "
                         f"got shape {q_shape}")
    if seqlens_k is None:
        raise ValueError("seqlens_k must be given with block_table (paged K/V), got None")
    k_pages, v_pages = (arrays.to_native(a) for a in (k_pages, v_pages))
    num_pages, page_size = check_page_pools(k_pages, v_pages)
    batch_shape = tuple(q_shape[:-3])
    lengths_k = check_seqlens("seqlens_k", seqlens_k, batch_shape, None)
    table = check_block_table(block_table, lengths_k, batch_shape, num_pages, page_size)
    n_keys = table.shape[1] * page_size
    k, v = (_gather_pages(pages, table, lengths_k, n_keys).reshape(
                batch_shape + (pages.shape[1], n_keys, pages.shape[3]))
            for pages in (k_pages, v_pages))
    return forward_padded(q, k, v, seqlens_q, lengths_k.reshape(batch_shape), **options)


# --------------------------------------------------------------------------- the backend


def _descriptors(q, k, options: AttentionOptions):
    """`tileattn.options.VarlenLayout.descriptors` of a backend call's 4-D arrays."""
    return options.varlen.descriptors(q.shape[0], q.shape[2], k.shape[2])


def _sequence_keys(pages, options: AttentionOptions, row):
    """One sequence's keys ``(1, Hkv, KEYS, D)``: a slice of the padded or packed array, or
    for paged K/V the pages its table row names, gathered by SPEC's formula (page ids
    clamped into the pool: with ``check_lengths=False`` nothing was checked)."""
    b, base, count = row[BATCH], row[KEY_BASE], row[KEYS]
    layout = options.varlen
    if layout.family != "paged":
        return pages[b:b + 1, :, base:base + count]
    table = np.clip(layout.block_table[b:b + 1], 0, layout.num_pages - 1)
    return _gather_pages(pages, table, np.array([count]), count)


def forward_sequences(q, k, v, options: AttentionOptions):
    """``backend="reference"`` for a variable-length or paged call (``options.varlen``):
    the dense golden model on each sequence of `VarlenLayout.descriptors`; arrays as the
    backends receive them (`tileattn.backends`), k and v page pools when paged."""
    batch, n_q_heads, n_q, _ = q.shape
    o = np.zeros((batch, n_q_heads, n_q, v.shape[3]))
    lse = np.full((batch, n_q_heads, n_q), -np.inf)
    for row in _descriptors(q, k, options):
        b, rows = row[BATCH], slice(row[ROW_BASE], row[ROW_BASE] + row[ROWS])
        o[b:b + 1, :, rows], lse[b:b + 1, :, rows] = _sequence_forward(
            q[b:b + 1, :, rows], _sequence_keys(k, options, row),
            _sequence_keys(v, options, row), _for_sequence(options, row[INDEX]), row[INDEX])
    return o.astype(q.dtype), lse.astype(lse_dtype(q.dtype))


def backward_sequences(do, q, k, v, o, options: AttentionOptions):
    """``backend="reference"`` backward of a padded or packed call, as `forward_sequences`."""
    dq, dk, dv = (np.zeros(a.shape) for a in (q, k, v))
    for row in _descriptors(q, k, options):
        b, rows = row[BATCH], slice(row[ROW_BASE], row[ROW_BASE] + row[ROWS])
        keys = slice(row[KEY_BASE], row[KEY_BASE] + row[KEYS])
        dq[b:b + 1, :, rows], dk[b:b + 1, :, keys], dv[b:b + 1, :, keys] = _sequence_backward(
            do[b:b + 1, :, rows], q[b:b + 1, :, rows], k[b:b + 1, :, keys],
            v[b:b + 1, :, keys], o[b:b + 1, :, rows], _for_sequence(options, row[INDEX]),
            row[INDEX])
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
